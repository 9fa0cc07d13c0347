"""A Ray cluster of several nodes on one machine that share no disk and no loopback, the way `ray up` nodes don't.

Each node is its own Linux network namespace on a host-only bridge (no uplink; the host keeps <net>.1), with its own
raylet, object store, temp dir and ports. The head (<net>.2) runs as this user, holds the clone's data and starts the
cluster's MLflow server (proxied artifacts, the cluster token as its password). Worker nodes (<net>.11, .12, ...) run
as another OS user (`embed-worker`, created when missing) with their own HOME and temp dir; while the cluster runs the
clone's caches, `mlflow.db`, `mlartifacts/` and `results/` are closed to other users (their modes are restored by
`stop`). The Python environment (the venv, the editable install of the code) plays the part of a node image and stays
readable, as does the data mirror, which plays the Hub's part. Needs root (network namespaces, another user).

    python3 cluster/nodes.py start [--workers 2] [--cpus-per-worker 1] [--gpus-per-worker 0] [--autoscale [YAML]]
    python3 cluster/nodes.py add-worker [--cpus 1] [--gpus 0]     # one more worker node (a replacement)
    python3 cluster/nodes.py kill-node w1                         # SIGKILL its raylet and every worker process
    python3 cluster/nodes.py remove-node w1                       # stop it as a cloud would (TERM, then KILL)
    python3 cluster/nodes.py mlflow-server --host IP              # the cluster's MLflow server on a `ray up` head
    python3 cluster/nodes.py exec -- CMD...                       # CMD on the head machine (a driver, curl)
    python3 cluster/nodes.py isolation | sockets | status | env | stop

--autoscale: Ray's autoscaler on the head adds and removes the worker nodes (cluster/autoscale.yaml, with the provider
of cluster/netns_provider.py). `cluster/local.sh start --nodes N` is `start --workers N-1`; `local.sh submit`, `serve`
and `stop` use the state this script writes ($EMBED_MULTI_DIR/cluster.json). Environment: EMBED_NET (10.213.7: the
/24 of the bridge; one per cluster on a machine), EMBED_WORKER_USER (embed-worker), VENV, EMBED_MULTI_DIR
(<EMBED_RAY_DIR, else .cache/ray_local>/multi).
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
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


@contextlib.contextmanager
def locked():
    """The state file's lock: the autoscaler's provider adds and removes nodes while other commands run."""
    STATE.mkdir(parents=True, exist_ok=True)
    with open(STATE / "cluster.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


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
    # several nodes: Serve's Python proxy (in Ray's HAProxy mode every ingress replica would serve HTTP on an address
    # the other nodes reach, unauthenticated; serving/serve_env.py MULTI_NODE)
    out["RAY_SERVE_ENABLE_HA_PROXY"] = "0"
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


def start_head(st: dict, autoscale: str | None = None) -> None:
    # a short temp dir: Ray's Unix sockets live under it, and a socket path is at most 107 bytes
    ns, temp = f"emb{TAG}-head", Path(f"/tmp/emb{TAG}-head")
    add_namespace(ns, HEAD_IP, 0)
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(mode=0o700, parents=True)
    env = {**node_env(Path.home(), temp, STATE / "auth_token"), **mlflow_env(), "PYTHONPATH": str(ROOT),
           # what the autoscaler's provider (cluster/netns_provider.py, in the head's monitor) needs to add nodes
           "EMBED_NET": NET, "EMBED_MULTI_DIR": str(STATE), "EMBED_WORKER_USER": WORKER_USER, "VENV": str(VENV)}
    extra = []
    if autoscale:
        env.update(RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1")
        extra = [f"--autoscaling-config={autoscale}"]
    # the head schedules, tracks and drives: no trial or replica runs there (0 logical CPUs), as in cluster/aws.yaml
    pid = spawn(ns, ["ray", "start", "--head", "--block", f"--node-ip-address={HEAD_IP}", f"--port={GCS_PORT}",
                     f"--dashboard-host={HEAD_IP}", f"--dashboard-port={DASH_PORT}", f"--temp-dir={temp / 'ray'}",
                     "--num-cpus=0", "--disable-usage-stats", *extra], env, STATE / "head.log")
    st["firewall"] = firewall_head(ns)
    st["nodes"]["head"] = {"ns": ns, "ip": HEAD_IP, "sid": pid, "kind": "head", "user": pwd.getpwuid(os.getuid()).pw_name,
                           "cpus": 0, "gpus": 0, "temp": str(temp)}


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


def mlflow_server_argv(host: str, port: int, store: str, artifacts: str, state: Path, token_path: Path
                       ) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of an MLflow tracking server for a cluster: `store` (a sqlite store is created first, before
    the server's workers start: concurrent creation corrupts it), artifacts proxied from `artifacts`
    (`mlflow-artifacts:` URIs, so no client needs a path), and every request but /health asking for user `embed` with
    the cluster token as password (MLflow's basic-auth app; its user store under `state`)."""
    state.mkdir(parents=True, exist_ok=True)
    ini = state / "mlflow_auth.ini"
    ini.write_text("[mlflow]\ndefault_permission = EDIT\n"
                   f"database_uri = sqlite:///{state / 'mlflow_auth.db'}\nadmin_username = embed\n"
                   "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
                   # MLflow's credential cache: without it each request checks the password hash again, ~0.4 s of
                   # CPU on this 2-core machine (a sweep's finish makes ~100 requests)
                   "auth_cache_ttl_seconds = 600\n")
    if store.startswith("sqlite:///") and not os.path.exists(store[len("sqlite:///"):]):
        sh(str(VENV / "bin" / "python") if (VENV / "bin" / "python").exists() else sys.executable, "-c",
           "import sys; from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore; "
           "SqlAlchemyStore(sys.argv[1], 'mlflow-artifacts:/')", store)
        os.chmod(store[len("sqlite:///"):], 0o600)
    if "://" not in artifacts:  # a local folder: only the server's user reads it
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        Path(artifacts).chmod(0o700)
    env = {"MLFLOW_AUTH_CONFIG_PATH": str(ini), "MLFLOW_AUTH_ADMIN_PASSWORD": token_path.read_text().strip(),
           "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    argv = ["mlflow", "server", "--app-name", "basic-auth", "--host", host, "--port", str(port),
            "--backend-store-uri", store, "--artifacts-destination", artifacts, "--serve-artifacts", "--workers", "1"]
    return argv, env


def start_mlflow(st: dict) -> None:
    """The cluster's MLflow server on the head (`mlflow_server_argv`): the clone's cluster store by default."""
    store = os.environ.get("EMBED_CLUSTER_STORE", f"sqlite:///{ROOT / 'mlflow-cluster.db'}")
    artifacts = os.environ.get("EMBED_CLUSTER_ARTIFACTS", str(ROOT / "mlartifacts-cluster"))
    argv, env = mlflow_server_argv(HEAD_IP, MLFLOW_PORT, store, artifacts, STATE, STATE / "auth_token")
    pid = spawn(st["nodes"]["head"]["ns"], argv, {**node_env(Path.home(), STATE, STATE / "auth_token"), **env},
                STATE / "mlflow.log")
    st["mlflow"] = {"sid": pid, "url": mlflow_env()["MLFLOW_TRACKING_URI"], "store": store, "artifacts": artifacts}


def cmd_mlflow_server(args) -> None:
    """The cluster's MLflow server on a `ray up` head (cluster/aws.yaml, gcp.yaml): runs in the foreground."""
    token_path = Path(os.path.expanduser(os.environ.get("RAY_AUTH_TOKEN_PATH", "~/.ray/auth_token")))
    argv, env = mlflow_server_argv(args.host, args.port, args.store, args.artifacts, Path(args.state), token_path)
    os.execvpe(argv[0], argv, {**os.environ, **env})


def start_worker(st: dict, cpus: float, gpus: float, node_type: str | None = None, node_id: str | None = None,
                 resources: dict | None = None) -> str:
    """One more worker node, as the worker user in a namespace of its own; returns its name (w1, w2, ...).
    node_id: the Ray node id it must take (the autoscaler's provider names its nodes so)."""
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
    if node_id:
        env.update(RAY_OVERRIDE_NODE_ID_FOR_TESTING=node_id, RAY_CLOUD_INSTANCE_ID=node_id, RAY_NODE_TYPE_NAME=node_type)
    pid = spawn(ns, ["ray", "start", "--block", f"--address={HEAD_IP}:{GCS_PORT}", f"--node-ip-address={ip}",
                     f"--num-cpus={cpus:g}", f"--num-gpus={gpus:g}", f"--temp-dir={temp / 'ray'}",
                     f"--resources={json.dumps({node_type: 1, **(resources or {})})}", "--disable-usage-stats"],
                env, STATE / f"{name}.log", user=user)
    st["nodes"][name] = {"ns": ns, "ip": ip, "sid": pid, "kind": node_type, "user": user.pw_name, "cpus": cpus,
                         "gpus": gpus, "temp": str(temp), "started": time.time(), "node_id": node_id}
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
    store = [Path(st["mlflow"][k].replace("sqlite:///", "")) for k in ("store", "artifacts") if k in st.get("mlflow", {})]
    for path in dict.fromkeys([*PRIVATE, *store, STATE / "auth_token"]):
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
    """Close the head's data to other users. What does not exist yet is made now, closed (a directory, or an empty
    sqlite file): made later by the head's processes with the usual umask it would be readable by the workers' user
    (seen: a test running alongside made .cache after the start). `unlock_private` takes back what is still empty."""
    st["modes"], st["made"] = {}, []
    for path in PRIVATE:
        if not path.exists():
            if path.suffix == ".db":
                path.touch(mode=0o600)
            else:
                path.mkdir(mode=0o700)
            st["made"].append(str(path))
        st["modes"][str(path)] = path.stat().st_mode & 0o777
        path.chmod(path.stat().st_mode & 0o700)


def unlock_private(st: dict) -> None:
    umask = os.umask(0)
    os.umask(umask)
    for made in st.get("made", []):
        path = Path(made)
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()
        elif path.is_file() and path.stat().st_size == 0:
            path.unlink()
        elif path.exists():  # used while the cluster ran: the mode it would have had
            st["modes"][made] = (0o777 if path.is_dir() else 0o666) & ~umask
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
    sh("ip", "netns", "attach", f"emb{TAG}-host", str(os.getpid()))  # the host's namespace, named: the provider
    # in the head's namespace makes nodes from there                                     (where the bridge is)
    autoscale = str(Path(args.autoscale).resolve()) if args.autoscale else None
    start_head(st, autoscale)
    st["autoscale"] = autoscale
    save(st)
    start_mlflow(st)
    save(st)
    for _ in range(args.workers):
        start_worker(st, args.cpus_per_worker, args.gpus_per_worker)
        save(st)
    wait_up(st)
    scaling = f", autoscaling from {args.autoscale}" if autoscale else ""
    print(f"Ray cluster up: head {HEAD_IP} + {args.workers} worker node(s) as {WORKER_USER!r}{scaling}; "
          f"dashboard/jobs {st['dashboard']}, MLflow {st['mlflow']['url']} (user embed, the cluster token)")


def cmd_stop(args) -> None:
    """The head first (with it the autoscaler, which could start a node meanwhile), then every node the state file
    names, then whatever namespace or temp dir of this cluster's subnet is still there (a node launched while the
    state was read)."""
    st = state()
    head = st.get("nodes", {}).get("head")
    if head:
        stop_session(head["sid"])
    with locked():
        st = state() or st
    for node in reversed(list(st.get("nodes", {}).values())):
        stop_session(node["sid"])
        remove_namespace(node["ns"])
        shutil.rmtree(node["temp"], ignore_errors=True)
    for ns in sh("ip", "netns", "list", check=False).stdout.split():
        if ns.startswith(f"emb{TAG}-w"):
            for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            remove_namespace(ns)
    for temp in Path("/tmp").glob(f"emb{TAG}-w*"):
        shutil.rmtree(temp, ignore_errors=True)
    if "mlflow" in st:
        stop_session(st["mlflow"]["sid"])
    sh("ip", "link", "del", BRIDGE, check=False)
    sh("ip", "netns", "del", f"emb{TAG}-host", check=False)  # the name only: the host's namespace stays
    unlock_private(st)
    (STATE / "cluster.json").unlink(missing_ok=True)
    print("cluster stopped" if st else "no cluster running")


def cmd_kill_node(args) -> None:
    """A worker node lost: SIGKILL to its raylet and every process it started, its network gone."""
    with locked():
        st = state()
        node = st["nodes"].pop(args.name, None)
        if node is None or args.name == "head":
            raise SystemExit(f"no worker node {args.name!r}; nodes: {', '.join(st.get('nodes', {})) or 'none'}")
        pids = session_pids(node["sid"])
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        remove_namespace(node["ns"])
        st.setdefault("killed", []).append({"name": args.name, "at": time.time(), "processes": len(pids),
                                            "temp": node["temp"]})  # its files stay until stop, as a dead disk
        save(st)
    print(json.dumps({"killed": args.name, "processes": len(pids)}))


def cmd_add_worker(args) -> None:
    with locked():
        st = state()
        name = start_worker(st, args.cpus, args.gpus, args.type, args.node_id, json.loads(args.resources))
        save(st)
    if not args.no_wait:
        wait_up(st)
    print(name)


def cmd_remove_node(args) -> None:
    """A worker node stopped as a cloud provider would end it (TERM, then KILL), its namespace and temp dir gone."""
    with locked():
        st = state()
        node = st["nodes"].pop(args.name, None)
        if node is None or args.name == "head":
            raise SystemExit(f"no worker node {args.name!r}")
        st.setdefault("removed", []).append({"name": args.name, "at": time.time(), "kind": node["kind"]})
        save(st)
    stop_session(node["sid"])
    remove_namespace(node["ns"])
    shutil.rmtree(node["temp"], ignore_errors=True)
    print(args.name)


def cmd_exec(args) -> None:
    st = state()
    argv = args.command[1:] if args.command[:1] == ["--"] else args.command
    env = {**os.environ, **mlflow_env(), "RAY_ADDRESS": f"{HEAD_IP}:{GCS_PORT}", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN_PATH": str(STATE / "auth_token"), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
    os.execvpe("ip", ["ip", "netns", "exec", st["nodes"]["head"]["ns"], *argv], env)


def cmd_status(args) -> None:
    st = state()
    print(json.dumps({"nodes": st.get("nodes", {}), "alive": alive_nodes() if st else 0, "mlflow": st.get("mlflow"),
                      "firewall": st.get("firewall"), "autoscale": st.get("autoscale"), "killed": st.get("killed", []),
                      "removed": st.get("removed", [])}, indent=2))


def cmd_env(args) -> None:
    """What a client on this machine sets to reach the cluster's dashboard and MLflow server."""
    for k, v in {"RAY_DASHBOARD": state()["dashboard"], **mlflow_env()}.items():
        print(f"export {k}={v}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start")
    s.add_argument("--workers", type=int, default=2)
    s.add_argument("--cpus-per-worker", type=float, default=1)
    s.add_argument("--gpus-per-worker", type=float, default=0, help="logical GPUs (no CUDA: the work runs on CPU)")
    s.add_argument("--autoscale", nargs="?", const=str(ROOT / "cluster" / "autoscale.yaml"), default=None,
                   metavar="YAML", help="Ray's autoscaler adds and removes worker nodes (default cluster/autoscale.yaml)")
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
    a.add_argument("--type", default=None, help="node type (default gpu_worker with GPUs, else cpu_worker)")
    a.add_argument("--node-id", default=None, help="the Ray node id to take (the autoscaler's provider sets it)")
    a.add_argument("--resources", default="{}", help="more custom resources, as JSON")
    a.add_argument("--no-wait", action="store_true", help="return once started, not once joined")
    r = sub.add_parser("remove-node")
    r.add_argument("name")
    m = sub.add_parser("mlflow-server", help="the cluster's MLflow server on a `ray up` head (foreground)")
    m.add_argument("--host", required=True, help="the head's private address (never a public one)")
    m.add_argument("--port", type=int, default=MLFLOW_PORT)
    m.add_argument("--store", default=f"sqlite:///{Path.home() / 'mlflow.db'}")
    m.add_argument("--artifacts", default=str(Path.home() / "mlartifacts"), help="a folder, or s3:// / gs:// URI")
    m.add_argument("--state", default=str(Path.home() / ".embed-mlflow"))
    e = sub.add_parser("exec")
    e.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args()
    commands = {"start": cmd_start, "stop": cmd_stop, "kill-node": cmd_kill_node, "add-worker": cmd_add_worker,
                "remove-node": cmd_remove_node, "exec": cmd_exec, "mlflow-server": cmd_mlflow_server,
                "status": cmd_status, "env": cmd_env,
                "isolation": lambda _: print(json.dumps(isolation(state()), indent=2)),
                "sockets": lambda _: print(json.dumps(sockets(state()), indent=2))}
    commands[args.cmd](args)


if __name__ == "__main__":
    main()
