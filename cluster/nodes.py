"""A Ray cluster of several nodes on one machine that share no disk and no loopback, the way `ray up` nodes don't.

Each node is its own Linux network namespace on a host-only bridge (no uplink; the host keeps <net>.1), with its own
raylet, object store, temp dir and ports. The head (<net>.2) runs as this user, holds the clone's data and starts the
cluster's MLflow server (proxied artifacts, the cluster token as its password). Worker nodes (<net>.11, .12, ...) run
as another OS user (`embed-worker`, created when missing) with their own HOME and temp dir; while the cluster runs the
clone's caches, `mlflow.db`, `mlartifacts/` and `results/` are closed to other users (their modes are restored by
`stop`). The Python environment (the venv, the editable install of the code) plays the part of a node image and stays
readable, as does the data mirror, which plays the Hub's part. Needs root (network namespaces, another user).

    python3 cluster/nodes.py start [--workers 2] [--cpus-per-worker 1] [--gpus-per-worker 0]
    python3 cluster/nodes.py add-worker [--cpus 1] [--gpus 0]     # one more worker node (a replacement)
    python3 cluster/nodes.py kill-node w1                         # SIGKILL its raylet and every worker process
    python3 cluster/nodes.py exec -- CMD...                       # CMD on the head machine (a driver, curl)
    python3 cluster/nodes.py isolation | sockets | status | env | stop

`cluster/local.sh start --nodes N` is `start --workers N-1`; `local.sh submit`, `serve` and `stop` use the state
this script writes ($EMBED_MULTI_DIR/cluster.json). Environment: EMBED_NET (10.213.7: the /24 of the bridge; one per
cluster on a machine), EMBED_WORKER_USER (embed-worker), VENV, EMBED_MULTI_DIR (<EMBED_RAY_DIR, else .cache/ray_local>/multi).
"""
from __future__ import annotations

import argparse
import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("VENV", ROOT / ".venv"))
STATE = Path(os.environ.get("EMBED_MULTI_DIR") or Path(os.environ.get("EMBED_RAY_DIR", ROOT / ".cache" / "ray_local"))
             / "multi")
NET = os.environ.get("EMBED_NET", "10.213.7")
TAG = NET.split(".")[-1]
BRIDGE = f"embbr{TAG}"
WORKER_USER = os.environ.get("EMBED_WORKER_USER", "embed-worker")
GCS_PORT, DASH_PORT, MLFLOW_PORT = 6379, 8265, 5050
#: the head's data that worker nodes must not read (closed to other users while the cluster runs)
PRIVATE = [ROOT / ".cache", ROOT / "mlartifacts", ROOT / "results", ROOT / "mlflow.db", ROOT / "mlartifacts-cluster",
           ROOT / "mlflow-cluster.db"]
#: what a node needs of the submitter's environment (the mirror plays the Hub's part; never a cache path)
PASS_ENV = ("EMBED_DATA_DIR", "HF_HUB_OFFLINE")
HEAD_IP = f"{NET}.2"


def sh(*cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=check, text=True, capture_output=True, **kw)


def state() -> dict:
    path = STATE / "cluster.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def save(st: dict) -> None:
    STATE.mkdir(parents=True, exist_ok=True)
    (STATE / "cluster.json").write_text(json.dumps(st, indent=2))


def token() -> str:
    path = STATE / "auth_token"
    if not path.is_file():
        STATE.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_hex(32))
        path.chmod(0o600)
    return path.read_text().strip()


def serve_env() -> dict[str, str]:
    """cluster/serve.env: Ray Serve's throughput settings, as every cluster of the project starts with them."""
    out = {}
    for line in (ROOT / "cluster" / "serve.env").read_text().splitlines():
        if line and line[0].isupper() and "=" in line:
            k, v = line.split("=", 1)
            out[k] = os.environ.get(k, v)
    return out


def mlflow_env() -> dict[str, str]:
    """What a client of the cluster's MLflow server sets: its URL and the cluster token as password."""
    return {"MLFLOW_TRACKING_URI": f"http://{HEAD_IP}:{MLFLOW_PORT}", "MLFLOW_TRACKING_USERNAME": "embed",
            "MLFLOW_TRACKING_PASSWORD": token()}


# ---------------------------------------------------------------------------------------------------- the network
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


# ---------------------------------------------------------------------------------------------------- the nodes
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
           "RAY_enable_metrics_collection": "1" if os.environ.get("EMBED_RAY_METRICS") == "1" else "0"}
    env.update(serve_env())
    env.update({k: os.environ[k] for k in PASS_ENV if os.environ.get(k)})
    return env


def start_head(st: dict) -> None:
    # a short temp dir: Ray's Unix sockets live under it, and a socket path is at most 107 bytes
    ns, temp = f"emb{TAG}-head", Path(f"/tmp/emb{TAG}-head")
    add_namespace(ns, HEAD_IP, 0)
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(mode=0o700, parents=True)
    env = {**node_env(Path.home(), temp, STATE / "auth_token"), **mlflow_env(), "PYTHONPATH": str(ROOT)}
    # the head schedules, tracks and drives: no trial or replica runs there (0 logical CPUs), as in cluster/aws.yaml
    pid = spawn(ns, ["ray", "start", "--head", "--block", f"--node-ip-address={HEAD_IP}", f"--port={GCS_PORT}",
                     f"--dashboard-host={HEAD_IP}", f"--dashboard-port={DASH_PORT}", f"--temp-dir={temp / 'ray'}",
                     "--num-cpus=0", "--disable-usage-stats"], env, STATE / "head.log")
    st["nodes"]["head"] = {"ns": ns, "ip": HEAD_IP, "sid": pid, "kind": "head", "user": pwd.getpwuid(os.getuid()).pw_name,
                           "cpus": 0, "gpus": 0, "temp": str(temp)}


def start_mlflow(st: dict) -> None:
    """The cluster's MLflow server on the head: the clone's store, artifacts proxied (`mlflow-artifacts:`), every
    request but /health asking for the cluster token (HTTP basic auth, user `embed`)."""
    ini = STATE / "mlflow_auth.ini"
    ini.write_text("[mlflow]\ndefault_permission = EDIT\n"
                   f"database_uri = sqlite:///{STATE / 'mlflow_auth.db'}\nadmin_username = embed\n"
                   "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
    env = {**node_env(Path.home(), STATE, STATE / "auth_token"), "MLFLOW_AUTH_CONFIG_PATH": str(ini),
           "MLFLOW_AUTH_ADMIN_PASSWORD": token(), "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16),
           "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    store = os.environ.get("EMBED_CLUSTER_STORE", f"sqlite:///{ROOT / 'mlflow-cluster.db'}")
    artifacts = os.environ.get("EMBED_CLUSTER_ARTIFACTS", str(ROOT / "mlartifacts-cluster"))
    if store.startswith("sqlite:///") and not os.path.exists(store[len("sqlite:///"):]):
        # created here, before the server's workers start (concurrent creation corrupts a sqlite store)
        sh(str(VENV / "bin" / "python"), "-c", "import sys; from mlflow.store.tracking.sqlalchemy_store import "
           "SqlAlchemyStore; SqlAlchemyStore(sys.argv[1], 'mlflow-artifacts:/')", store)
        os.chmod(store[len("sqlite:///"):], 0o600)
    Path(artifacts).mkdir(parents=True, exist_ok=True)
    Path(artifacts).chmod(0o700)  # the head's disk: only the server (this user) reads it
    pid = spawn(st["nodes"]["head"]["ns"], [
        "mlflow", "server", "--app-name", "basic-auth", "--host", HEAD_IP, "--port", str(MLFLOW_PORT),
        "--backend-store-uri", store, "--artifacts-destination", artifacts, "--serve-artifacts",
        "--workers", "1"], env, STATE / "mlflow.log")
    st["mlflow"] = {"sid": pid, "url": mlflow_env()["MLFLOW_TRACKING_URI"], "store": store, "artifacts": artifacts}


def start_worker(st: dict, cpus: float, gpus: float, node_type: str | None = None) -> str:
    """One more worker node, as the worker user in a namespace of its own; returns its name (w1, w2, ...)."""
    user = worker_user()
    index = st.get("next_worker", 1)
    st["next_worker"] = index + 1
    name, ip = f"w{index}", f"{NET}.{10 + index}"
    ns, temp = f"emb{TAG}-{name}", Path(f"/tmp/emb{TAG}-{name}")
    shutil.rmtree(temp, ignore_errors=True)
    (temp / "home").mkdir(parents=True)
    token_path = temp / "home" / "ray_token"  # the node's copy of the cluster token, as file_mounts would put it
    token_path.write_text(token())
    token_path.chmod(0o600)
    sh("chown", "-R", f"{user.pw_uid}:{user.pw_gid}", str(temp))
    temp.chmod(0o700)
    add_namespace(ns, ip, index)
    node_type = node_type or ("gpu_worker" if gpus else "cpu_worker")
    env = {**node_env(temp / "home", temp, token_path), **mlflow_env(), "EMBED_CACHE_DIR": str(temp / "home" / "cache")}
    pid = spawn(ns, ["ray", "start", "--block", f"--address={HEAD_IP}:{GCS_PORT}", f"--node-ip-address={ip}",
                     f"--num-cpus={cpus:g}", f"--num-gpus={gpus:g}", f"--temp-dir={temp / 'ray'}",
                     f"--resources={json.dumps({node_type: 1})}", "--disable-usage-stats"],
                env, STATE / f"{name}.log", user=user)
    st["nodes"][name] = {"ns": ns, "ip": ip, "sid": pid, "kind": node_type, "user": user.pw_name, "cpus": cpus,
                         "gpus": gpus, "temp": str(temp)}
    return name


def session_pids(sid: int) -> list[int]:
    out = sh("ps", "-eo", "pid=,sid=").stdout.split()
    return [int(p) for p, s in zip(out[0::2], out[1::2]) if int(s) == sid]


def stop_session(sid: int, grace_s: float = 3.0) -> None:
    """TERM every process of the session, KILL what is left after `grace_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in session_pids(sid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while session_pids(sid) and time.monotonic() < deadline:
            time.sleep(0.1)


# ---------------------------------------------------------------------------------------------------- checks
def _get(url: str, auth: str | None = None, basic: tuple[str, str] | None = None) -> int:
    req = urllib.request.Request(url)
    if auth:
        req.add_header("Authorization", f"Bearer {auth}")
    if basic:
        import base64
        req.add_header("Authorization", "Basic " + base64.b64encode(":".join(basic).encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def wait_up(st: dict, timeout_s: float = 180) -> None:
    """The dashboard and the MLflow server answer (with the token), and every node has joined."""
    deadline = time.monotonic() + timeout_s
    want = len(st["nodes"])
    while time.monotonic() < deadline:
        if _get(f"http://{HEAD_IP}:{DASH_PORT}/api/version", auth=token()) == 200 and (
                "mlflow" not in st or _get(f"{st['mlflow']['url']}/health") == 200):
            if alive_nodes() >= want:
                return
        time.sleep(0.5)
    raise SystemExit(f"the cluster did not come up within {timeout_s:.0f} s; see {STATE}/*.log")


def alive_nodes() -> int:
    req = urllib.request.Request(f"http://{HEAD_IP}:{DASH_PORT}/nodes?view=summary",
                                 headers={"Authorization": f"Bearer {token()}"})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            summary = json.loads(resp.read())["data"]["summary"]
    except (OSError, ValueError, KeyError):
        return 0
    return sum(1 for n in summary if n.get("raylet", {}).get("state") == "ALIVE")


def isolation(st: dict) -> dict:
    """How the no-shared-disk rule is enforced, and what a worker node's user gets when it opens the head's files."""
    name = next((n for n in st["nodes"] if n != "head"), None)
    if name is None:
        return {"enforced": False, "why": "no worker node"}
    node, attempts = st["nodes"][name], {}
    user = pwd.getpwnam(node["user"])
    for path in [*PRIVATE, STATE / "auth_token"]:
        if not path.exists():
            continue
        probe = ("import sys\ntry:\n    open(sys.argv[1], 'rb').read(1) if __import__('os').path.isfile(sys.argv[1]) "
                 "else __import__('os').listdir(sys.argv[1])\n    print('READ')\nexcept OSError as e:\n"
                 "    print(type(e).__name__ + ': ' + str(e))")
        r = sh("ip", "netns", "exec", node["ns"], "setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}",
               "--clear-groups", "--", sys.executable, "-c", probe, str(path), check=False)
        attempts[str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)] = (r.stdout or r.stderr).strip()
    return {"enforced": True, "node": name, "user": node["user"],
            "how": f"worker nodes run as OS user {node['user']!r} (not the head's), each in its own network namespace "
                   f"with its own HOME and temp dir; the head's data is closed to other users (chmod go-rwx) while "
                   "the cluster runs",
            "attempts": attempts, "all_refused": all(v != "READ" for v in attempts.values())}


def sockets(st: dict) -> list[dict]:
    """Every listening TCP socket of every node: address, port, process, and whether it is loopback."""
    out = []
    for name, node in st["nodes"].items():
        r = sh("ip", "netns", "exec", node["ns"], "ss", "-ltnpH", check=False)
        for line in r.stdout.splitlines():
            parts = line.split()
            local, proc = parts[3], (parts[5] if len(parts) > 5 else "")
            host, port = local.rsplit(":", 1)
            out.append({"node": name, "address": host, "port": int(port),
                        "process": proc.split('"')[1] if '"' in proc else proc,
                        "loopback": host.startswith("127.") or host in ("[::1]", "::1")})
    return out


# ---------------------------------------------------------------------------------------------------- commands
def grant_interpreter(st: dict, user: pwd.struct_passwd) -> None:
    """The node image: the worker user must run the venv's interpreter. A venv links to its base Python, which may
    sit under a home the user cannot enter (pyenv under /root): such directories get o+x (enter, not list) while the
    cluster runs, and `stop` takes it back."""
    st["granted"] = []
    real = Path(os.path.realpath(VENV / "bin" / "python"))
    for d in reversed(real.parents):
        mode = d.stat().st_mode & 0o777
        if not mode & 0o001:
            d.chmod(mode | 0o001)
            st["granted"].append([str(d), mode])
            print(f"note: {d} made enterable by other users (o+x, not readable) so that {user.pw_name!r} can run "
                  f"{real}; restored by stop", file=sys.stderr)


def lock_private(st: dict) -> None:
    st["modes"] = {}
    for path in PRIVATE:
        if path.exists():
            st["modes"][str(path)] = path.stat().st_mode & 0o777
            path.chmod(path.stat().st_mode & 0o700)


def unlock_private(st: dict) -> None:
    for path, mode in [*st.get("modes", {}).items(), *st.get("granted", [])]:
        if os.path.exists(path):
            os.chmod(path, mode)


def cmd_start(args) -> None:
    if os.geteuid() != 0:
        raise SystemExit("cluster/nodes.py needs root: it makes network namespaces and runs worker nodes as another "
                         "user. Without root, use cluster/local.sh start (one node) or ray.cluster_utils.Cluster.")
    if state().get("nodes"):
        raise SystemExit(f"a cluster is already running ({STATE}/cluster.json): cluster/nodes.py stop first")
    for tool in ("ip", "setpriv", "ss"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} not found: install iproute2 / util-linux")
    st: dict = {"net": NET, "nodes": {}, "head_ip": HEAD_IP, "dashboard": f"http://{HEAD_IP}:{DASH_PORT}"}
    token()
    lock_private(st)
    grant_interpreter(st, worker_user())
    save(st)
    setup_bridge()
    start_head(st)
    save(st)
    start_mlflow(st)
    save(st)
    for _ in range(args.workers):
        start_worker(st, args.cpus_per_worker, args.gpus_per_worker)
        save(st)
    wait_up(st)
    print(f"Ray cluster up: head {HEAD_IP} + {args.workers} worker node(s) as {WORKER_USER!r}; "
          f"dashboard/jobs {st['dashboard']}, MLflow {st['mlflow']['url']} (user embed, the cluster token)")


def cmd_stop(args) -> None:
    st = state()
    for node in reversed(list(st.get("nodes", {}).values())):
        stop_session(node["sid"])
        remove_namespace(node["ns"])
        shutil.rmtree(node["temp"], ignore_errors=True)
    if "mlflow" in st:
        stop_session(st["mlflow"]["sid"])
    sh("ip", "link", "del", BRIDGE, check=False)
    unlock_private(st)
    (STATE / "cluster.json").unlink(missing_ok=True)
    print("cluster stopped" if st else "no cluster running")


def cmd_kill_node(args) -> None:
    st = state()
    node = st["nodes"].get(args.name)
    if node is None or args.name == "head":
        raise SystemExit(f"no worker node {args.name!r}; nodes: {', '.join(st.get('nodes', {})) or 'none'}")
    pids = session_pids(node["sid"])
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    remove_namespace(node["ns"])
    del st["nodes"][args.name]
    st.setdefault("killed", []).append({"name": args.name, "at": time.time(), "processes": len(pids)})
    save(st)
    print(json.dumps({"killed": args.name, "processes": len(pids)}))


def cmd_add_worker(args) -> None:
    st = state()
    name = start_worker(st, args.cpus, args.gpus)
    save(st)
    wait_up(st)
    print(name)


def cmd_exec(args) -> None:
    st = state()
    argv = args.command[1:] if args.command[:1] == ["--"] else args.command
    env = {**os.environ, **mlflow_env(), "RAY_ADDRESS": f"{HEAD_IP}:{GCS_PORT}", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN_PATH": str(STATE / "auth_token"), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
    os.execvpe("ip", ["ip", "netns", "exec", st["nodes"]["head"]["ns"], *argv], env)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start")
    s.add_argument("--workers", type=int, default=2)
    s.add_argument("--cpus-per-worker", type=float, default=1)
    s.add_argument("--gpus-per-worker", type=float, default=0, help="logical GPUs (no CUDA: the work runs on CPU)")
    sub.add_parser("stop")
    sub.add_parser("status")
    sub.add_parser("env")
    sub.add_parser("isolation")
    sub.add_parser("sockets")
    k = sub.add_parser("kill-node")
    k.add_argument("name")
    a = sub.add_parser("add-worker")
    a.add_argument("--cpus", type=float, default=1)
    a.add_argument("--gpus", type=float, default=0)
    e = sub.add_parser("exec")
    e.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args()
    if args.cmd == "start":
        cmd_start(args)
    elif args.cmd == "stop":
        cmd_stop(args)
    elif args.cmd == "kill-node":
        cmd_kill_node(args)
    elif args.cmd == "add-worker":
        cmd_add_worker(args)
    elif args.cmd == "exec":
        cmd_exec(args)
    elif args.cmd == "status":
        st = state()
        print(json.dumps({"nodes": st.get("nodes", {}), "alive": alive_nodes() if st else 0,
                          "mlflow": st.get("mlflow")}, indent=2))
    elif args.cmd == "env":
        st = state()
        for k, v in {"RAY_DASHBOARD": st["dashboard"], **mlflow_env()}.items():
            print(f"export {k}={v}")
    elif args.cmd == "isolation":
        print(json.dumps(isolation(state()), indent=2))
    elif args.cmd == "sockets":
        print(json.dumps(sockets(state()), indent=2))


if __name__ == "__main__":
    main()
