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
import json
import os
import pwd
import shutil
import signal
import time
from pathlib import Path

# its sibling modules: run as a script (local.sh, netns_provider.py, the tests), Python puts cluster/ on the path
from mlflow_server import cmd_mlflow_server, start_mlflow
from node_base import (BRIDGE, DASH_PORT, GCS_PORT, HEAD_IP, MLFLOW_PORT, NET, ROOT, STATE, TAG, VENV, WORKER_USER,
                       locked, mlflow_env, save, sh, state, token)
from node_checks import (alive_nodes, grant_interpreter, isolation, lock_private, sockets, unlock_private,
                         wait_up)
from node_net import (add_namespace, firewall_head, node_env, remove_namespace, session_pids, setup_bridge, spawn,
                      stop_session, worker_user)

# ---------------------------------------------------------------------------------------------------- the network


# ---------------------------------------------------------------------------------------------------- the nodes


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


# ---------------------------------------------------------------------------------------------------- checks


# ---------------------------------------------------------------------------------------------------- commands


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
    names and the MLflow server together, then whatever namespace or temp dir of this cluster's subnet is still there
    (a node launched while the state was read)."""
    st = state()
    head = st.get("nodes", {}).get("head")
    if head:
        stop_session(head["sid"])
    with locked():
        st = state() or st
    sids = [node["sid"] for node in st.get("nodes", {}).values()] + ([st["mlflow"]["sid"]] if "mlflow" in st else [])
    stop_session(*sids)  # the worker nodes and the MLflow server, all at once
    for node in reversed(list(st.get("nodes", {}).values())):
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


def _at_least(lo: float, kind=float, *, inclusive: bool = True):
    """An argparse type: a `kind` number >= lo (> lo when not inclusive), else the flag's error naming the bound."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not value == value or value < lo or (value == lo and not inclusive) or value == float("inf"):
            bound = f"{'>=' if inclusive else '>'} {lo:g}"
            raise argparse.ArgumentTypeError(f"{text} is out of range; give a number {bound}")
        return value
    return parse


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start")
    s.add_argument("--workers", type=_at_least(0, int), default=2)
    s.add_argument("--cpus-per-worker", type=_at_least(0, inclusive=False), default=1)
    s.add_argument("--gpus-per-worker", type=_at_least(0), default=0,
                   help="logical GPUs (no CUDA: the work runs on CPU)")
    s.add_argument("--autoscale", nargs="?", const=str(ROOT / "cluster" / "autoscale.yaml"), default=None,
                   metavar="YAML",
                   help="Ray's autoscaler adds and removes worker nodes (default cluster/autoscale.yaml)")
    sub.add_parser("stop")
    sub.add_parser("status")
    sub.add_parser("env")
    sub.add_parser("isolation")
    sub.add_parser("sockets")
    k = sub.add_parser("kill-node")
    k.add_argument("name")
    a = sub.add_parser("add-worker")
    a.add_argument("--cpus", type=_at_least(0, inclusive=False), default=1)
    a.add_argument("--gpus", type=_at_least(0), default=0)
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
    st = state()
    if (args.cmd == "env" and "dashboard" not in st) or (
            args.cmd in ("isolation", "sockets", "kill-node", "add-worker", "remove-node", "exec") and not st.get("nodes")):
        raise SystemExit(f"no cluster is running ({STATE / 'cluster.json'} names none): "
                         "cluster/nodes.py start (or cluster/local.sh start --nodes N) first")
    commands = {"start": cmd_start, "stop": cmd_stop, "kill-node": cmd_kill_node, "add-worker": cmd_add_worker,
                "remove-node": cmd_remove_node, "exec": cmd_exec, "mlflow-server": cmd_mlflow_server,
                "status": cmd_status, "env": cmd_env,
                "isolation": lambda _: print(json.dumps(isolation(state()), indent=2)),
                "sockets": lambda _: print(json.dumps(sockets(state()), indent=2))}
    commands[args.cmd](args)


if __name__ == "__main__":
    main()
