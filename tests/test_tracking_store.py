"""A job never puts its MLflow store in its temporary copy of the working dir (the runs and the registered champion
of a `cluster/local.sh submit` without MLFLOW_TRACKING_URI used to vanish with the job's files)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from embed_lib.config import writable_dir
from embed_lib.tracking.runs import (check_store_for_cluster, checked_tracking_uri, default_tracking_uri,
                                     in_job_working_dir)

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


def test_a_local_store_is_refused_on_a_cluster_of_several_nodes(tmp_path):
    check_store_for_cluster(f"sqlite:///{tmp_path / 'mlflow.db'}", nodes=1)  # one node: its own disk is fine
    check_store_for_cluster("http://127.0.0.1:5000", nodes=3)
    for uri in (f"sqlite:///{tmp_path / 'mlflow.db'}", f"file://{tmp_path}/mlruns", "mlruns"):
        with pytest.raises(ValueError, match=r"has 3 nodes, which share no disk: start an MLflow server"):
            check_store_for_cluster(uri, nodes=3)


def test_a_cache_the_driver_cannot_write_fails_before_anything_starts(tmp_path):
    assert writable_dir(tmp_path / "new" / "cache", "--cache-dir") == tmp_path / "new" / "cache"
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"--cache-dir .*file/cache: the driver cannot write there"):
        writable_dir(tmp_path / "file" / "cache", "--cache-dir")


def _job_env(state_dir, check=True, **env):
    """What `cluster/local.sh job-env` forwards, for the cluster whose state is in `state_dir` (never the developer's)."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("MLFLOW_TRACKING_URI", "MLFLOW_ARTIFACT_ROOT", "EMBED_CACHE_DIR", "EMBED_STORAGE_DIR",
                         "EMBED_MULTI_DIR")}
    proc = subprocess.run([str(REPO / "cluster" / "local.sh"), "job-env"], capture_output=True, text=True, timeout=30,
                          env={**base, "EMBED_RAY_DIR": str(state_dir), **env})
    if not check:
        return proc
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["env_vars"]


def test_submit_forwards_the_submitters_absolute_store_when_none_is_set(tmp_path):
    env = _job_env(tmp_path)
    assert env["MLFLOW_TRACKING_URI"] == f"sqlite:///{REPO}/mlflow.db"
    assert env["MLFLOW_ARTIFACT_ROOT"] == f"{REPO}/mlartifacts"
    assert (env["EMBED_CACHE_DIR"], env["EMBED_STORAGE_DIR"]) == (f"{REPO}/.cache/embed_lib", f"{REPO}/.cache/ray_results")
    assert _job_env(tmp_path, MLFLOW_TRACKING_URI="http://127.0.0.1:5000")["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:5000"


def test_a_job_on_several_nodes_uses_the_clusters_mlflow_server_and_a_local_store_is_refused_at_submit(tmp_path):
    # the state cluster/nodes.py writes for a running cluster of several nodes (no cluster needed to read it)
    (tmp_path / "multi").mkdir()
    (tmp_path / "multi" / "auth_token").write_text("t" * 64)
    (tmp_path / "multi" / "cluster.json").write_text(json.dumps({"dashboard": "http://10.213.7.2:8265", "nodes": {}}))
    env = _job_env(tmp_path, EMBED_NET="10.213.7")
    assert env["MLFLOW_TRACKING_URI"] == "http://10.213.7.2:5050"
    assert (env["MLFLOW_TRACKING_USERNAME"], env["MLFLOW_TRACKING_PASSWORD"]) == ("embed", "t" * 64)
    assert "MLFLOW_ARTIFACT_ROOT" not in env  # the server proxies artifacts: no local path travels
    proc = _job_env(tmp_path, check=False, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/mlflow.db")
    assert proc.returncode == 2 and proc.stdout == ""
    assert "is a local store, and this cluster has several nodes" in proc.stderr and "MLflow server" in proc.stderr


def test_a_sweep_with_an_unwritable_cache_stops_before_ray_or_mlflow_start(tmp_path):
    (tmp_path / "a-file").write_text("")
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    proc = subprocess.run([sys.executable, str(REPO / "sweeps" / "pair_residual.py"), "--task", "stsb", "--no-teacher",
                           "--cache-dir", str(tmp_path / "a-file" / "cache")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: --cache-dir / $EMBED_CACHE_DIR {tmp_path}")
    assert not (tmp_path / "mlflow.db").exists()
