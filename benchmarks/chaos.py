"""Fault tolerance, measured: (1) a Tune trial worker killed mid-sweep is retried and the sweep completes;
(2) a Serve ingress (scoring) replica killed under load is replaced while the service keeps answering (failed requests
counted). The driver-killed / `--resume` case is the integration test tests/test_sweeps.py::
test_resume_after_the_driver_is_killed. Figures -> results/benchmarks/chaos.json.
"""
from __future__ import annotations

import argparse
import os
import signal
import tempfile
import threading
import time

import mlflow
import requests

from benchmarks._common import write_results
from embed_lib.config import AdapterConfig
from embed_lib.pipeline.prepare import load_study
from embed_lib.tracking.registry import evidence_of, log_adapter_model, promote
from embed_lib.tracking.runs import set_experiment
from embed_lib.training.seed_group import train_seed_group


def _actors(name_part: str):
    # lazy: Serve's and Ray's settings are put in the environment before Ray is first imported
    from ray.util.state import list_actors

    return [a for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000) if name_part in a.class_name]


def trial_worker_kill(data) -> dict:
    # lazy: Serve's and Ray's settings are put in the environment before Ray is first imported
    from ray import tune

    from sweeps.trainable import make_trainable

    fixed = {"adapter": "pair_gated", "target": "lexical", "epochs": 6, "n_seeds": 5}
    tuner = tune.Tuner(make_trainable(data, fixed, 1, 0), param_space={"gamma": tune.grid_search([0.05, 0.1, 0.15, 0.2])},
                       tune_config=tune.TuneConfig(max_concurrent_trials=2, reuse_actors=True),
                       run_config=tune.RunConfig(storage_path=tempfile.mkdtemp(), verbose=0,
                                                 failure_config=tune.FailureConfig(max_failures=2)))
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(results=tuner.fit()))
    t0 = time.time()
    t.start()
    killed = None
    while killed is None and time.time() - t0 < 120:
        time.sleep(1.0)
        workers = _actors("ImplicitFunc")
        if workers and time.time() - t0 > 8:  # let the trials get going
            killed = workers[0].pid
            os.kill(killed, signal.SIGKILL)
    t.join()
    results = out["results"]
    trials = results._experiment_analysis.trials
    return {"trials": len(trials), "killed_worker_pid": killed, "errors": len(results.errors),
            "terminated": sum(tr.status == "TERMINATED" for tr in trials),
            "retries": sum(tr.num_failures for tr in trials), "wall_s": round(time.time() - t0, 1)}


def serve_replica_kill(data, seconds: float = 20.0) -> dict:
    # lazy: Serve's and Ray's settings are put in the environment before Ray is first imported
    from ray import serve

    from serving.app import build_app
    from serving.serve_env import free_port

    tracking = f"sqlite:///{tempfile.mkdtemp()}/mlflow.db"
    set_experiment("chaos", tracking)  # a new store: artifacts beside it, never in ./mlruns
    r = train_seed_group(AdapterConfig(adapter="pair_gated", target="lexical", epochs=2, n_seeds=2), data)
    with mlflow.start_run():
        info = log_adapter_model(r, data, registered_name="pair-residual-stsb")
    promote("pair-residual-stsb", info.registered_model_version, evidence_of(r, data))
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"model_uri": "models:/pair-residual-stsb@champion", "tracking_uri": tracking,
                         "ingress": {"min": 2, "max": 2, "num_cpus": 0.3},
                         "encoder": {"min": 1, "max": 1, "num_cpus": 0.4}}), name="chaos", route_prefix="/")
    url = f"http://127.0.0.1:{port}/v1/score"
    body = {"pairs": [["A man is playing a guitar.", "A man plays the guitar."]] * 8}
    ok, failed, stop = [0], [0], threading.Event()

    def load():
        s = requests.Session()
        while not stop.is_set():
            try:
                code = s.post(url, json=body, timeout=30).status_code
            except requests.RequestException:
                code = 0
            (ok if code == 200 else failed)[0] += 1

    threads = [threading.Thread(target=load) for _ in range(4)]
    for th in threads:
        th.start()
    time.sleep(seconds / 4)
    victim = _actors("ServeReplica:chaos:Ingress")[0]
    os.kill(victim.pid, signal.SIGKILL)
    t_kill = time.time()
    replaced = None
    while time.time() - t_kill < seconds:
        time.sleep(0.5)
        if replaced is None and len(_actors("ServeReplica:chaos:Ingress")) == 2:
            replaced = round(time.time() - t_kill, 1)
    stop.set()
    for th in threads:
        th.join()
    serve.shutdown()
    return {"requests_ok": ok[0], "requests_failed": failed[0], "replica_replaced_after_s": replaced,
            "killed": "one of 2 ingress (scoring) replicas", "concurrency": 4}


def main() -> None:
    # lazy: Serve's and Ray's settings are put in the environment before Ray is first imported
    import ray

    from serving.serve_env import apply_serve_env

    data, _ = load_study("stsb")
    settings = apply_serve_env()  # the Serve settings every cluster of the project runs with (cluster/serve.env)
    ray.init(num_cpus=2, include_dashboard=True, log_to_driver=False)
    figures = {"serve_settings": settings,"trial_worker_killed": trial_worker_kill(data), "serve_replica_killed": serve_replica_kill(data),
               "driver_killed": "tests/test_sweeps.py::test_resume_after_the_driver_is_killed (4 trials, one MLflow "
                                "run each, none left RUNNING)"}
    ray.shutdown()
    write_results("chaos", figures)


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
