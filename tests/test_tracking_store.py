"""A job never puts its MLflow store in its temporary copy of the working dir (the runs and the registered champion
of a `cluster/local.sh submit` without MLFLOW_TRACKING_URI used to vanish with the job's files)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from embed_lib.tracking.runs import checked_tracking_uri, default_tracking_uri, in_job_working_dir

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def job_dir(tmp_path) -> Path:
    """A directory laid out as Ray unpacks a job's working_dir."""
    d = tmp_path / "session_1" / "runtime_resources" / "working_dir_files" / "_ray_pkg_0123abcd"
    d.mkdir(parents=True)
    return d


def test_a_store_in_the_jobs_working_dir_is_refused_naming_the_fix(job_dir, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(job_dir)
    assert in_job_working_dir(Path.cwd()) and not in_job_working_dir(job_dir.parents[3])
    with pytest.raises(ValueError, match=r"temporary copy of its working dir.*Set MLFLOW_TRACKING_URI"):
        default_tracking_uri()
    with pytest.raises(ValueError, match="mlflow.db' lies in this Ray job's temporary copy"):
        checked_tracking_uri(f"sqlite:///{job_dir / 'mlflow.db'}")


def test_a_server_or_a_store_outside_the_job_is_kept(job_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(job_dir)
    for uri in ("http://127.0.0.1:5000", f"sqlite:///{tmp_path / 'mlflow.db'}", "databricks"):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        assert default_tracking_uri() == uri == checked_tracking_uri(uri)


def _job_env(**env) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "MLFLOW_ARTIFACT_ROOT")}
    out = subprocess.run([str(REPO / "cluster" / "local.sh"), "job-env"], env={**base, **env}, capture_output=True,
                         text=True, timeout=30, check=True).stdout
    return json.loads(out)["env_vars"]


def test_submit_forwards_the_submitters_absolute_store_when_none_is_set():
    env = _job_env()
    assert env["MLFLOW_TRACKING_URI"] == f"sqlite:///{REPO}/mlflow.db"
    assert env["MLFLOW_ARTIFACT_ROOT"] == f"{REPO}/mlartifacts"
    assert _job_env(MLFLOW_TRACKING_URI="http://127.0.0.1:5000")["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:5000"
