"""benchmarks/multinode.py's cluster: start and stop one of cluster/nodes.py's clusters, its nodes, its MLflow
server's client, the trial runs of a sweep."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlflow

from benchmarks._common import REPO


#: the environment that names one cluster of cluster/nodes.py (its bridge, state and MLflow store)
CLUSTER_ENV = ("EMBED_NET", "EMBED_MULTI_DIR", "EMBED_RAY_DIR", "EMBED_CLUSTER_STORE", "EMBED_CLUSTER_ARTIFACTS")


def net() -> str:
    return os.environ.get("EMBED_NET", "10.213.9")


def start_cluster(state: Path, net_prefix: str = "10.213.9", workers: int = 2, autoscale: bool = False
                  ) -> dict[str, str]:
    """A cluster of its own (bridge `net_prefix`, state and MLflow store under `state`): {node name: address}.
    autoscale: Ray's autoscaler adds and removes the worker nodes (cluster/autoscale.yaml)."""
    os.environ.update(EMBED_NET=net_prefix, EMBED_MULTI_DIR=str(state), EMBED_RAY_DIR=str(state),
                      EMBED_CLUSTER_STORE=f"sqlite:///{state}/mlflow.db", EMBED_CLUSTER_ARTIFACTS=f"{state}/art")
    os.chmod(state, 0o700)
    subprocess.run([sys.executable, str(REPO / "cluster" / "nodes.py"), "start", "--workers", str(workers),
                    "--cpus-per-worker", "1", "--gpus-per-worker", "1", *(["--autoscale"] if autoscale else [])],
                   check=True)
    return {n: v["ip"] for n, v in json.loads(nodes("status"))["nodes"].items()}


def stop_cluster() -> None:
    subprocess.run([sys.executable, str(REPO / "cluster" / "nodes.py"), "stop"], check=False)


def nodes(*args: str, check: bool = True) -> str:
    return subprocess.run([sys.executable, str(REPO / "cluster" / "nodes.py"), *args], check=check, text=True,
                          capture_output=True).stdout


def client_env() -> dict[str, str]:
    return dict(line[len("export "):].split("=", 1) for line in nodes("env").splitlines() if line.startswith("export "))


def mlflow_client():
    os.environ.update({k: v for k, v in client_env().items() if k.startswith("MLFLOW_")})
    return mlflow.MlflowClient(os.environ["MLFLOW_TRACKING_URI"])


def on_head(expression: str, imports: str = ""):
    """The JSON value of a Python `expression` evaluated by a Ray driver on the head (`ray` imported and connected).
    Marked in the output: Ray prints warnings to the same stdout (seen: "raylet has lagging heartbeats")."""
    code = f"import json, ray{imports}; ray.init(log_to_driver=False); print('@@' + json.dumps({expression}))"
    out = subprocess.run([sys.executable, str(REPO / "cluster" / "nodes.py"), "exec", "--", sys.executable, "-c", code],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(next(line[2:] for line in reversed(out.splitlines()) if line.startswith("@@")))


def node_ids() -> list[dict]:
    """[{name, node_id}] of the live nodes."""
    alive = on_head("[[n['NodeID'], n['NodeManagerAddress']] for n in ray.nodes() if n['Alive']]")
    names = {v["ip"]: n for n, v in json.loads(nodes("status"))["nodes"].items()}
    return [{"node_id": i, "name": names.get(ip, ip)} for i, ip in alive]


def trial_runs(client, parent_id: str) -> list:
    """The sweep's trial runs (its other child, the winner's retraining, has no trial_id)."""
    exp = client.get_run(parent_id).info.experiment_id
    runs = client.search_runs([exp], f"tags.`mlflow.parentRunId` = '{parent_id}'", max_results=1000)
    return [r for r in runs if r.data.tags.get("trial_id")]
