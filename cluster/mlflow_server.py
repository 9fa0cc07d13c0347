"""The cluster's MLflow tracking server (cluster/nodes.py start, and `nodes.py mlflow-server` on a `ray up` head):
proxied artifacts, basic auth with the cluster token."""
from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

from node_base import HEAD_IP, MLFLOW_PORT, ROOT, STATE, VENV, mlflow_env, sh
from node_net import node_env, spawn


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
                   # MLflow's credential cache: without it every request checks the password against its hash
                   # again, a hash slow by design, and a sweep's driver makes hundreds of requests
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
