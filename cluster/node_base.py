"""cluster/nodes.py's settings and state: the subnet, the head's address and ports, the paths closed to the worker
user, the state file and its lock, the cluster token, the environment every node starts with."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import subprocess
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
