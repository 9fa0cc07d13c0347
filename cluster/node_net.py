"""cluster/nodes.py's network and processes: a namespace per node on the bridge, the worker user, a node's process
session and environment, the head's firewall."""
from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from node_base import (BRIDGE, HEAD_IP, NET, PASS_ENV, TAG, VENV, WORKER_USER, serve_env, sh)


def add_namespace(name: str, ip: str, index: int) -> None:
    """Namespace `name` with one veth to the bridge (address `ip`/24) and its own loopback."""
    host_end = f"emb{TAG}v{index}"
    sh("ip", "netns", "add", name)
    sh("ip", "link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", name)
    sh("ip", "link", "set", host_end, "master", BRIDGE, "up")
    for cmd in (("ip", "addr", "add", f"{ip}/24", "dev", "eth0"), ("ip", "link", "set", "eth0", "up"),
                ("ip", "link", "set", "lo", "up")):
        sh("ip", "netns", "exec", name, *cmd)


def remove_namespace(name: str) -> None:
    sh("ip", "netns", "del", name, check=False)  # takes its veth pair with it


def setup_bridge() -> None:
    if sh("ip", "link", "show", BRIDGE, check=False).returncode == 0:
        return
    sh("ip", "link", "add", BRIDGE, "type", "bridge")
    sh("ip", "addr", "add", f"{NET}.1/24", "dev", BRIDGE)
    sh("ip", "link", "set", BRIDGE, "up")


def worker_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(WORKER_USER)
    except KeyError:
        sh("useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", WORKER_USER)
        return pwd.getpwnam(WORKER_USER)


def spawn(ns: str, argv: list[str], env: dict[str, str], log: Path, user: pwd.struct_passwd | None = None) -> int:
    """argv in namespace `ns` (as `user` when given), in a session of its own: its id is the pid returned, and
    every process the node starts (raylet, workers, agents) stays in it, so a node is stopped or killed as one."""
    prefix = ["ip", "netns", "exec", ns]
    if user is not None:
        prefix += ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", "--"]
    with open(log, "ab") as out:
        proc = subprocess.Popen(prefix + ["env", "-i", *[f"{k}={v}" for k, v in env.items()]] + argv,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd="/")
    return proc.pid


def node_env(home: Path, temp: Path, token_path: Path) -> dict[str, str]:
    env = {"PATH": f"{VENV / 'bin'}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "TMPDIR": str(temp),
           "LANG": "C.UTF-8", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path),
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_enable_metrics_collection": "1" if os.environ.get("EMBED_RAY_METRICS") == "1" else "0",
           # a stopped job's driver: SIGKILL 30 s after its SIGTERM, not 3 (a sweep closes its runs; cluster/local.sh)
           "RAY_JOB_STOP_WAIT_TIME_S": os.environ.get("RAY_JOB_STOP_WAIT_TIME_S", "30")}
    env.update(serve_env())
    env.update({k: os.environ[k] for k in PASS_ENV if os.environ.get(k)})
    return env


#: Ray's Prometheus servers of the dashboard and the autoscaler: Ray binds them to every interface when the node's
#: address is not loopback, with no setting to change it and no token; the head's firewall keeps them to its loopback
LOOPBACK_ONLY_PORTS = (44217, 44227)


def firewall_head(ns: str) -> str:
    """In the head's namespace, refuse TCP to LOOPBACK_ONLY_PORTS from anywhere but loopback (nftables, else
    iptables); returns what was applied, or why nothing was."""
    ports = ", ".join(str(p) for p in LOOPBACK_ONLY_PORTS)
    if shutil.which("nft"):
        for cmd in ("add table inet embed",
                    "add chain inet embed input { type filter hook input priority 0 ; policy accept ; }",
                    f"add rule inet embed input ip saddr != 127.0.0.0/8 tcp dport {{ {ports} }} reject"):
            sh("ip", "netns", "exec", ns, "nft", *cmd.split())
        return f"nft: tcp dport {{{ports}}} from non-loopback rejected"
    if shutil.which("iptables"):
        for port in LOOPBACK_ONLY_PORTS:
            sh("ip", "netns", "exec", ns, "iptables", "-A", "INPUT", "-p", "tcp", "--dport", str(port), "!", "-s",
               "127.0.0.0/8", "-j", "REJECT")
        return f"iptables: tcp dport {ports} from non-loopback rejected"
    print(f"warning: neither nft nor iptables found: Ray's metrics ports {ports} of the head answer on {HEAD_IP} "
          "without a token (install nftables)", file=sys.stderr)
    return "none (no nft / iptables)"


def session_pids(*sids: int) -> list[int]:
    """The processes of the sessions `sids`."""
    out = sh("ps", "-eo", "pid=,sid=").stdout.split()
    return [int(p) for p, s in zip(out[0::2], out[1::2]) if int(s) in sids]


def stop_session(*sids: int, grace_s: float = 3.0) -> None:
    """TERM every process of the sessions, KILL what is left after `grace_s`. Several sessions stop at once: N
    nodes wait one grace period, not N (measured: each node's session outlived its TERM by the whole period)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in session_pids(*sids):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while session_pids(*sids) and time.monotonic() < deadline:
            time.sleep(0.1)
