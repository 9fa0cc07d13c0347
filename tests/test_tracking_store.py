"""A job never puts its MLflow store in its temporary copy of the working dir (the runs and the registered champion
of a `cluster/local.sh submit` without MLFLOW_TRACKING_URI used to vanish with the job's files)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
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


def test_a_cluster_started_by_hand_reads_the_mirror_beside_the_clone_as_make_does(tmp_path):
    """`cluster/local.sh` takes the Makefile's data rule: the mirror `../shared/data` beside the clone, offline, when
    no EMBED_DATA_DIR is set. By hand it gave neither: the cluster's replicas, and its jobs, went to the Hub (a
    served champion's warm corpus failed in every Encoder replica offline)."""
    import shutil

    clone = tmp_path / "clone"
    (clone / "cluster").mkdir(parents=True)
    for name in ("local.sh", "runtime_env.json", "serve.env"):
        shutil.copy2(REPO / "cluster" / name, clone / "cluster" / name)
    base = {k: v for k, v in os.environ.items() if k not in ("EMBED_DATA_DIR", "HF_HUB_OFFLINE", "EMBED_MULTI_DIR")}

    def forwarded(**env):
        proc = subprocess.run([str(clone / "cluster" / "local.sh"), "job-env"], capture_output=True, text=True,
                              timeout=30, env={**base, "EMBED_RAY_DIR": str(tmp_path / "ray"), **env})
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)["env_vars"]
        return out.get("EMBED_DATA_DIR"), out.get("HF_HUB_OFFLINE")

    assert forwarded() == (None, None)  # no mirror beside it: the Hub
    (tmp_path / "shared" / "data" / "stsb").mkdir(parents=True)
    (tmp_path / "shared" / "data" / "stsb" / "train.parquet").write_bytes(b"")
    assert forwarded() == (str(tmp_path / "shared" / "data"), "1")
    assert forwarded(HF_HUB_OFFLINE="0") == (str(tmp_path / "shared" / "data"), "0")  # a setting given is kept
    assert forwarded(EMBED_DATA_DIR="/elsewhere") == ("/elsewhere", None)


def test_a_cluster_served_by_hand_reads_the_clones_store_from_any_directory(tmp_path):
    """`cluster/local.sh start` / `serve` by hand with no MLFLOW_TRACKING_URI take the Makefile's store, the clone's
    sqlite:///<repo>/mlflow.db. They named none: the replicas read MLflow's default, ./mlflow.db of the directory
    `start` ran in, and from any other found no champion (an empty store made there). Here the clone has no store
    yet, so `serve` names that file and stops, before it looks for a cluster, and nothing is made in the caller's
    directory."""
    import shutil

    clone, elsewhere = tmp_path / "clone", tmp_path / "elsewhere"
    (clone / "cluster").mkdir(parents=True)
    (clone / "serving").mkdir()
    elsewhere.mkdir()
    for name in ("local.sh", "runtime_env.json", "serve.env", "serve_config.py"):
        shutil.copy2(REPO / "cluster" / name, clone / "cluster" / name)
    shutil.copy2(REPO / "serving" / "config.yaml", clone / "serving" / "config.yaml")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "EMBED_MULTI_DIR"))}
    env.update(EMBED_RAY_DIR=str(tmp_path / "ray"), VENV=str(Path(sys.executable).parents[1]))
    proc = subprocess.run([str(clone / "cluster" / "local.sh"), "serve"], cwd=elsewhere, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and (f"is read from the MLflow store sqlite:///{clone}/mlflow.db, which does not exist "
                                     "yet") in proc.stderr, proc.stdout + proc.stderr
    assert not list(elsewhere.iterdir()) and not (clone / "mlflow.db").exists()


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


@pytest.mark.parametrize("flag, named", [("--cache-dir", "--cache-dir / $EMBED_CACHE_DIR"),
                                         ("--storage-path", "--storage-path / $EMBED_STORAGE_DIR")])
def test_a_sweep_with_an_unwritable_cache_or_storage_stops_before_ray_or_mlflow_start(tmp_path, flag, named):
    """Tune's storage used to fail with a FileNotFoundError traceback after Ray and MLflow had started."""
    (tmp_path / "a-file").write_text("")
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    proc = subprocess.run([sys.executable, str(REPO / "sweeps" / "pair_residual.py"), "--task", "stsb", "--no-teacher",
                           flag, str(tmp_path / "a-file" / "dir")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {named} {tmp_path}")
    assert not (tmp_path / "mlflow.db").exists()


def _mlflow_server(tmp_path, port: int):
    """The cluster's MLflow server on 127.0.0.1:`port` as a `ray up` head starts it (`cluster/nodes.py mlflow-server`:
    basic auth with the cluster token, proxied artifacts), in a session of its own; returns (start, stop, client
    environment)."""
    import signal
    import time

    import requests

    (tmp_path / "token").write_text("s" * 64)
    argv = [sys.executable, str(REPO / "cluster" / "nodes.py"), "mlflow-server", "--host", "127.0.0.1", "--port",
            str(port), "--store", f"sqlite:///{tmp_path / 'server.db'}", "--artifacts", str(tmp_path / "art"),
            "--state", str(tmp_path / "auth")]
    env = {"RAY_AUTH_TOKEN_PATH": str(tmp_path / "token"), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    holder = []

    def start():
        holder.append(subprocess.Popen(argv, env={**os.environ, **env}, start_new_session=True,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for _ in range(240):
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.25)
        raise RuntimeError("the MLflow server did not start")

    def stop():
        os.killpg(holder[-1].pid, signal.SIGKILL)
        holder[-1].wait()

    client_env = {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}", "MLFLOW_TRACKING_USERNAME": "embed",
                  "MLFLOW_TRACKING_PASSWORD": "s" * 64}
    return start, stop, client_env


@pytest.mark.slow
def test_a_sweep_outlives_a_restart_of_its_mlflow_server_with_every_run_recorded_once(sweep_env, tmp_path):
    """The server killed while the sweep's trials run and started again 5 s later: the driver's MLflow client
    retries with backoff (MLflow's own, its variables forwarded by submit), so the sweep finishes and no run is lost or
    doubled."""
    import time

    import mlflow

    from tests.conftest import free_ports

    (port,) = free_ports(1)
    start, stop, client_env = _mlflow_server(tmp_path, port)
    start()
    # MLflow's client retries with backoff (7 retries); a factor of 1 s instead of its 2 s still outlasts the outage
    # (1 + 2 + ... + 64 s, 127 s in all) and spares the suite the longest waits (local.sh submit forwards it)
    env = {**sweep_env, **client_env, "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
    cmd = [str(REPO / "cluster" / "local.sh"), "submit", "--", "python", "sweeps/pair_residual.py", "--task", "stsb",
           "--smoke-test", "--name", "restarted", "--experiment", "restart"]
    job = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    os.environ.update(client_env)
    client = mlflow.MlflowClient(client_env["MLFLOW_TRACKING_URI"])
    restarted = False
    try:
        deadline = time.time() + 600
        while job.poll() is None and time.time() < deadline and not restarted:
            time.sleep(0.5)
            exp = client.get_experiment_by_name("restart")
            runs = client.search_runs([exp.experiment_id], "tags.trial_id != ''") if exp else []
            if runs:  # a trial has started: the server goes away under it
                stop()
                time.sleep(5)
                start()
                restarted = True
        out = job.communicate(timeout=600)[0]
    finally:
        for k in client_env:
            os.environ.pop(k, None)
        stop()
    assert restarted and job.returncode == 0, out[-3000:]
    store = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'server.db'}")  # the server's own store, read once it is down
    exp = store.get_experiment_by_name("restart")
    (parent,) = store.search_runs([exp.experiment_id], "attributes.run_name = 'restarted'")
    trials = [r for r in store.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
              if r.data.tags.get("trial_id")]
    assert parent.info.status == "FINISHED"
    assert len(trials) == 3 and all(r.info.status == "FINISHED" for r in trials)
    assert len({r.data.tags["trial_id"] for r in trials}) == 3  # none doubled by a retried request


_BEFORE_THE_MOVE: list = []


def test_a_test_that_moves_mlflow_to_a_store_of_its_own(tmp_path):
    """With the next test: MLflow's setters export the store and the experiment to the process (and to every
    subprocess a later test starts); tests/conftest.py puts them back after each test."""
    from embed_lib.tracking.runs import set_experiment

    _BEFORE_THE_MOVE[:] = [os.environ.get("MLFLOW_TRACKING_URI"), os.environ.get("MLFLOW_EXPERIMENT_ID")]
    experiment = set_experiment("moved", f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert os.environ["MLFLOW_TRACKING_URI"] == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert os.environ["MLFLOW_EXPERIMENT_ID"] == experiment.experiment_id


def test_the_next_test_starts_where_the_last_one_started():
    import mlflow

    from tests.conftest import SESSION_TRACKING_URI

    if _BEFORE_THE_MOVE:  # (run alone: nothing moved)
        assert [os.environ.get("MLFLOW_TRACKING_URI"), os.environ.get("MLFLOW_EXPERIMENT_ID")] == _BEFORE_THE_MOVE
    # and where this module started: the session's store (a module before it in this worker served a champion
    # from a store of its own, in a module-scoped fixture)
    assert os.environ["MLFLOW_TRACKING_URI"] == mlflow.get_tracking_uri() == SESSION_TRACKING_URI


def test_a_dataset_inserted_by_a_concurrent_sweep_is_linked_not_an_error(tmp_path, monkeypatch):
    """Two sweeps of one experiment log the same dataset at once: the store refuses the second insert (seen with two
    jobs on one cluster); log_task_inputs tries again and links the row the other wrote."""
    import mlflow

    from embed_lib.tracking import runs
    from embed_lib.tracking.runs import set_experiment

    set_experiment("races", f"sqlite:///{tmp_path / 'mlflow.db'}")  # explicit: other tests leave fluent state behind
    real, calls = mlflow.log_input, []

    def racing(dataset, **kw):
        calls.append(dataset.name)
        if len(calls) == 1:  # the other sweep's row landed between this one's check and its insert
            real(dataset, **kw)
            raise mlflow.exceptions.MlflowException("(sqlite3.IntegrityError) UNIQUE constraint failed: datasets.experiment_id, "
                                                    "datasets.name, datasets.digest")
        return real(dataset, **kw)

    monkeypatch.setattr(mlflow, "log_input", racing)
    with mlflow.start_run() as run, warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        runs.log_task_inputs("stsb")
    # MLflow's "dataset source can be interpreted in multiple ways", once per split of every run, is not passed on
    assert not [w for w in seen if "interpreted in multiple ways" in str(w.message)]
    assert calls[:2] == ["stsb-train", "stsb-train"] and len(calls) == 4  # train twice, then validation and test
    names = {i.dataset.name for i in mlflow.get_run(run.info.run_id).inputs.dataset_inputs}
    assert names == {"stsb-train", "stsb-validation", "stsb-test"}
    # any other error of the store is not swallowed
    monkeypatch.setattr(mlflow, "log_input", lambda *a, **k: (_ for _ in ()).throw(
        mlflow.exceptions.MlflowException("RESOURCE_DOES_NOT_EXIST")))
    with mlflow.start_run(), pytest.raises(mlflow.exceptions.MlflowException, match="RESOURCE_DOES_NOT_EXIST"):
        runs.log_task_inputs("stsb")


def test_through_a_server_new_experiments_proxy_artifacts_and_one_with_a_local_path_is_refused(tmp_path):
    """A tracking server's new experiment keeps its artifacts behind the server (mlflow-artifacts:); an experiment
    of that server whose artifacts sit on a local path (made by a one-node store) is refused, naming --experiment."""
    import mlflow

    from embed_lib.tracking.runs import set_experiment
    from tests.conftest import free_ports

    (port,) = free_ports(1)
    start, stop, client_env = _mlflow_server(tmp_path, port)
    start()
    os.environ.update(client_env)
    try:
        uri = client_env["MLFLOW_TRACKING_URI"]
        assert set_experiment("proxied", uri).artifact_location.startswith("mlflow-artifacts:")
        mlflow.MlflowClient(uri).create_experiment("on-a-path", artifact_location=(tmp_path / "local").as_uri())
        with pytest.raises(ValueError, match=r"'on-a-path' of the MLflow server .* local path .* \(--experiment NAME\)"):
            set_experiment("on-a-path", uri)
    finally:
        for k in client_env:
            os.environ.pop(k, None)
        stop()


def test_an_experiment_tag_written_by_a_concurrent_sweep_is_kept_not_an_error(tmp_path, monkeypatch):
    """Two sweeps open a new experiment together: both see it without its kind tag, and the store refuses the second
    insert (seen on the multi-node cluster: "UNIQUE constraint failed: experiment_tags..."); set_experiment keeps the
    tag the other one wrote. Any other error of the store is not swallowed."""
    import mlflow

    from embed_lib.tracking.runs import set_experiment

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    real = mlflow.MlflowClient.set_experiment_tag

    def racing(self, experiment_id, key, value):
        real(self, experiment_id, key, value)  # the other sweep's write
        raise mlflow.exceptions.MlflowException("(sqlite3.IntegrityError) UNIQUE constraint failed: "
                                                "experiment_tags.key, experiment_tags.experiment_id")

    monkeypatch.setattr(mlflow.MlflowClient, "set_experiment_tag", racing)
    experiment = set_experiment("raced", uri)
    tags = mlflow.MlflowClient(uri).get_experiment(experiment.experiment_id).tags
    assert tags["mlflow.experimentKind"] == "custom_model_development"
    monkeypatch.setattr(mlflow.MlflowClient, "set_experiment_tag", lambda *a, **k: (_ for _ in ()).throw(
        mlflow.exceptions.MlflowException("RESOURCE_DOES_NOT_EXIST")))
    with pytest.raises(mlflow.exceptions.MlflowException, match="RESOURCE_DOES_NOT_EXIST"):
        set_experiment("another", uri)


def test_a_store_mlflow_cannot_use_is_named_with_the_fix(tmp_path, monkeypatch):
    """An unknown scheme and a file store (which MLflow 3 refuses) used to end in MLflow's traceback, after the
    command had started; now one line names the store and what to give instead."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(ValueError, match=r"MLflow tracking URI 'foo://x': MLflow has no store for the scheme 'foo'"):
        checked_tracking_uri("foo://x")
    for uri in (str(tmp_path / "mlruns"), f"file://{tmp_path}/mlruns"):
        with pytest.raises(ValueError, match=rf"is a file store, which MLflow 3 refuses .*give "
                                             rf"sqlite:///{tmp_path}/mlruns.db instead"):
            checked_tracking_uri(uri)
    # a database file named without its scheme lacks only the scheme (it was told to give .../mlflow.db.db)
    for uri in (str(tmp_path / "mlflow.db"), "mlflow.db"):
        with pytest.raises(ValueError, match=rf"give sqlite:///{Path(uri).absolute()} instead, or set"):
            checked_tracking_uri(uri)
    with pytest.raises(ValueError, match=r"MLflow tracking URI '' is empty"):
        checked_tracking_uri("")
    for uri in ("postgresql+psycopg2://u@db/mlflow", "HTTPS://mlflow.example", "databricks-uc", "databricks://p"):
        assert checked_tracking_uri(uri) == uri  # schemes MLflow serves pass as they are
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow's own opt-out is honoured
    assert checked_tracking_uri(str(tmp_path / "mlruns")) == str(tmp_path / "mlruns")


def test_the_cli_stops_at_a_store_mlflow_cannot_use(tmp_path, capsys, monkeypatch):
    from embed_lib.cli.parser import main

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    assert main(["registry", "--task", "stsb", "--tracking-uri", str(tmp_path / "mlruns")]) == 2
    assert capsys.readouterr().err.startswith(f"error: MLflow tracking URI '{tmp_path}/mlruns' is a file store")
    assert not (tmp_path / "mlruns").exists()


def test_reading_a_model_from_a_store_that_does_not_exist_is_refused_and_makes_no_store(tmp_path):
    """The library's loaders, as the commands do: a sqlite path with no store behind it is named with the fix, not
    answered by MLflow making an empty store there (and then 'Registered Model ... not found')."""
    from embed_lib.tracking.registry import load_registered

    missing = tmp_path / "mlflow.db"
    with pytest.raises(ValueError, match=r"No MLflow store at sqlite:///.*/mlflow\.db \(nothing was tracked there"):
        load_registered("models:/pair-residual-stsb@champion", f"sqlite:///{missing}")
    assert not missing.exists()
