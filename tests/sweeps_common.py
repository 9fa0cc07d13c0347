"""What the sweep tests share: a job submitted through cluster/local.sh, the MLflow client, a sweep's trial runs
(the environment a sweep runs in is conftest's `sweep_env`)."""
from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def submit_sweep(env, *args, timeout=600):
    cmd = [str(REPO / "cluster" / "local.sh"), "submit", "--", "python", "sweeps/pair_residual.py", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def mlflow_client(env):
    import mlflow

    return mlflow.MlflowClient(env["MLFLOW_TRACKING_URI"])


def child_runs(client, exp_id, parent_id):
    return client.search_runs([exp_id], f"tags.`mlflow.parentRunId` = '{parent_id}'")
