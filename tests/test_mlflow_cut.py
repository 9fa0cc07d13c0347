"""A tracking server that dies while it answers: the sweep's MLflow callback, and a sweep's registration, against a
real server behind a proxy that forwards each request (so the store acts on it) and then cuts chosen responses
mid-body, or closes without one, as a killed server does."""
from __future__ import annotations

import http.server
import json
import os
import threading
from types import SimpleNamespace

import pytest
import requests

from tests.conftest import free_ports
from tests.test_tracking_store import _mlflow_server


class CuttingProxy(http.server.ThreadingHTTPServer):
    """Forwards to `upstream`; the first `cuts[path]` responses of each path are cut after half their body, and the
    first `drops[path]` get no answer at all (the connection closed once the store has acted)."""

    def __init__(self, port: int, upstream: str, cuts: dict[str, int], drops: dict[str, int] | None = None):
        self.upstream, self.cuts, self.drops, self.cut, self.dropped = upstream, dict(cuts), dict(drops or {}), [], []
        super().__init__(("127.0.0.1", port), _Forward)


class _Forward(http.server.BaseHTTPRequestHandler):
    def _relay(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        keep = {k: v for k, v in self.headers.items() if k.lower() in ("authorization", "content-type")}
        r = requests.request(self.command, self.server.upstream + self.path, data=body, headers=keep, timeout=60)
        path = self.path.split("?")[0]
        if self.server.drops.get(path, 0) > 0:
            self.server.drops[path] -= 1
            self.server.dropped.append(path)
            self.close_connection = True
            return
        cut = self.server.cuts.get(path, 0) > 0
        self.send_response(r.status_code)
        self.send_header("Content-Type", r.headers.get("Content-Type", "application/json"))
        self.send_header("Content-Length", str(len(r.content)))
        self.end_headers()
        if cut:  # the store has acted; the answer stops halfway
            self.server.cuts[path] -= 1
            self.server.cut.append(path)
            self.wfile.write(r.content[: len(r.content) // 2])
            self.wfile.flush()
            self.close_connection = True
        else:
            self.wfile.write(r.content)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _relay

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def cut_server(tmp_path_factory, ray_cluster):
    """(start a proxy with these cuts, the real server's client, the proxy's tracking URI); one server for the module
    (it takes ~20 s to start here), a proxy per test. The session's cluster is started first, so that the environment
    it keeps for later tests never holds this module's MLflow credentials."""
    import mlflow

    server_port, proxy_port = free_ports(2)
    start, stop, env = _mlflow_server(tmp_path_factory.mktemp("cut"), server_port)
    start()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    proxies = []

    def proxy(cuts: dict[str, int], drops: dict[str, int] | None = None) -> CuttingProxy:
        for old in proxies:
            old.shutdown()
            old.server_close()
        p = CuttingProxy(proxy_port, env["MLFLOW_TRACKING_URI"], cuts, drops)
        threading.Thread(target=p.serve_forever, daemon=True).start()
        proxies.append(p)
        return p

    try:
        yield proxy, mlflow.MlflowClient(env["MLFLOW_TRACKING_URI"]), f"http://127.0.0.1:{proxy_port}"
    finally:
        for p in proxies:
            p.shutdown()
            p.server_close()
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        stop()


def test_a_response_cut_mid_body_is_what_mlflow_does_not_retry_and_cut_response_names_it(cut_server):
    """The gap the callback fills: MLflow's client raises on a cut response (after its store acted), and
    `cut_response` recognises it through the exception's context; an ordinary MLflow error is not one."""
    import mlflow

    from sweeps.mlflow_callback import cut_response

    proxy, direct, uri = cut_server
    p = proxy({"/api/2.0/mlflow/experiments/create": 1})
    with pytest.raises(mlflow.exceptions.MlflowException) as cut:
        mlflow.MlflowClient(uri).create_experiment("cut")
    assert "IncompleteRead" in str(cut.value) and cut_response(cut.value)
    assert p.cut == ["/api/2.0/mlflow/experiments/create"]
    assert direct.get_experiment_by_name("cut") is not None  # the store acted before the answer was cut
    with pytest.raises(mlflow.exceptions.MlflowException) as refused:
        mlflow.MlflowClient(uri).create_experiment("cut")  # exists: an answer, not a cut
    assert not cut_response(refused.value)


def test_the_trial_callback_records_each_trial_once_through_cut_responses(cut_server):
    """Search, create, params, node tags, metrics and the end of a trial each answered with a cut once: the trial has
    one run, its params, its metrics once each and FINISHED; the cut creation was found, not made again."""
    from sweeps.mlflow_callback import MLflowTrialCallback, close_orphans

    proxy, direct, uri = cut_server
    exp = direct.create_experiment("cuts")
    parent = direct.create_run(exp, run_name="sweep").info.run_id
    api = "/api/2.0/mlflow/runs/"
    p = proxy({api + "search": 1, api + "create": 1, api + "log-batch": 3, api + "update": 1})
    cb = MLflowTrialCallback(uri, exp, parent, fixed={"epochs": 2})
    trial = SimpleNamespace(trial_id="t1", config={"tau": 0.5}, last_result={"per_seed": "[]"})
    cb.on_trial_start(0, [], trial)
    node = json.dumps({"id": "n1", "ip": "127.0.0.1", "resources": {"CPU": 2}})
    cb.on_trial_result(0, [], trial, {"training_iteration": 1, "epoch/val": 0.81, "node": node, "timestamp": 1.0})
    cb.on_trial_complete(0, [], trial)

    assert sorted(set(p.cut)) == sorted({api + "search", api + "create", api + "log-batch", api + "update"})
    assert len(p.cut) == 6  # every cut was taken: each call above met one and went on
    runs = direct.search_runs([exp], "tags.trial_id = 't1'")
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED" and run.data.params == {"epochs": "2", "tau": "0.5"}
    assert run.data.tags["node_id"] == "n1"
    assert [(m.value, m.step) for m in direct.get_metric_history(run.info.run_id, "epoch/val")] == [(0.81, 1)]
    assert close_orphans(uri, exp, parent) == 0


def test_a_creation_mlflow_sends_twice_leaves_the_trial_one_run(cut_server):
    """The connection closed without an answer after the store created the trial's run: MLflow's client sends the
    creation again (its retries cover any method), so the store holds two runs of the trial; the callback keeps the
    first and deletes the other, before any param is logged."""
    from sweeps.mlflow_callback import MLflowTrialCallback

    proxy, direct, uri = cut_server
    exp = direct.create_experiment("drops")
    parent = direct.create_run(exp, run_name="sweep").info.run_id
    p = proxy({}, drops={"/api/2.0/mlflow/runs/create": 1})
    cb = MLflowTrialCallback(uri, exp, parent)
    trial = SimpleNamespace(trial_id="t2", config={"tau": 0.5}, last_result={})
    cb.on_trial_start(0, [], trial)
    assert p.dropped == ["/api/2.0/mlflow/runs/create"]
    from mlflow.entities import ViewType

    every = direct.search_runs([exp], "tags.trial_id = 't2'", run_view_type=ViewType.ALL)
    assert len(every) == 2  # the resent creation made a second run ...
    (kept,) = direct.search_runs([exp], "tags.trial_id = 't2'")  # ... and one is left
    assert kept.info.run_id == cb.runs["t2"] == min(every, key=lambda r: r.info.start_time).info.run_id
    assert kept.data.params == {"tau": "0.5"}


@pytest.mark.slow
def test_a_sweep_whose_registration_was_cut_finishes_with_resume(cut_server, sweep_env):
    """The answer to the winner's model-version creation cut (the store made version 1): the driver fails, as the
    parent run's writes have only MLflow's own retries (docs/clusters.md, Faults). `--resume` runs no trial again,
    registers version 2 as champion with its evidence, and leaves version 1 without tags or alias. A limited run
    (`--limit`): it registers under a name of its own, never the real model's."""
    import subprocess
    import sys

    from tests.sweeps_common import REPO

    proxy, direct, uri = cut_server
    p = proxy({"/api/2.0/mlflow/model-versions/create": 1})
    creds = {k: os.environ[k] for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")}
    env = {**sweep_env, **creds, "MLFLOW_TRACKING_URI": uri}
    args = [sys.executable, "sweeps/pair_residual.py", "--task", "stsb", "--no-teacher", "--search", "grid",
            "--grid", "adapter=pair_gated", "--grid", "target=lexical", "--grid", "gamma=0.05,0.1", "--seeds", "2",
            "--epochs", "2", "--limit", "120", "--transfer", "mrpc", "--transfer-tolerance", "1.0",
            "--experiment", "cut-registration", "--name", "cut-registration"]
    failed = subprocess.run(args, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert failed.returncode != 0 and "IncompleteRead" in failed.stderr, failed.stdout[-2000:] + failed.stderr[-2000:]
    assert p.cut == ["/api/2.0/mlflow/model-versions/create"]
    resumed = subprocess.run([*args, "--resume"], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    out = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert out["stages"]["trials_s"] < 5 and out["complete"] == 2  # restored from Tune's state, none trained again
    name = "pair-residual-stsb-limited"
    assert (out["registered_name"], out["version"], out["alias"]) == (name, "2", "champion")
    assert direct.get_model_version_by_alias(name, "champion").version == "2"
    assert direct.search_model_versions("name='pair-residual-stsb'") == []
    assert "promotion" in direct.get_model_version(name, "2").tags
    orphan = direct.get_model_version(name, "1")
    assert not orphan.tags and not orphan.aliases
    exp = direct.get_experiment_by_name("cut-registration")
    trials = direct.search_runs([exp.experiment_id], "tags.trial_id != ''")
    assert sorted(r.data.tags["trial_id"] for r in trials) == sorted({r.data.tags["trial_id"] for r in trials})
    assert len(trials) == 2 and all(r.info.status == "FINISHED" for r in trials)
