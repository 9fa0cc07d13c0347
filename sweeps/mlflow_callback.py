"""MLflow for a sweep: the driver is the only writer (one child run per trial under the sweep's parent run,
reused when a resumed sweep restarts a trial); `close_orphans` ends what a killed driver left RUNNING.

A tracking server that dies while it answers cuts its response mid-body. MLflow's client retries a refused connection
with backoff, but not a cut response (requests reads the body after urllib3's retries are done), so every call here
goes through `_retry`: the same call again, which then waits out the restart in MLflow's own backoff. A run is created
only after a search for the trial's run, so a retried creation whose first attempt reached the store finds that run;
and a trial with two runs (MLflow's client resends a request whose connection dropped before any answer) keeps its
first, the other deleted."""
from __future__ import annotations

import json
import time
from typing import Any, Callable

import mlflow
import requests
from mlflow.entities import Metric, Param, RunTag
from ray import tune

from sweeps.trainable import FINAL_KEYS, METRIC


def cut_response(exc: BaseException | None) -> bool:
    """Whether `exc` is (or was raised while handling) a response cut mid-body: MLflow's MlflowException keeps the
    transport's error only as its context ("Connection broken: IncompleteRead")."""
    for _ in range(8):  # the chain is short; bounded all the same
        if exc is None:
            return False
        if isinstance(exc, requests.exceptions.ChunkedEncodingError):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _retry(call: Callable[..., Any], *args, attempts: int = 4, pause_s: float = 1.0, **kwargs) -> Any:
    """`call(*args, **kwargs)`, again after a cut response (see module docstring); anything else is raised at once."""
    for attempt in range(attempts):
        try:
            return call(*args, **kwargs)
        except Exception as exc:
            if attempt == attempts - 1 or not cut_response(exc):
                raise
            time.sleep(pause_s * 2 ** attempt)


class MLflowTrialCallback(tune.Callback):
    """Child MLflow runs for trials, written from the driver only (see module docstring)."""

    def __init__(self, tracking_uri: str, experiment_id: str, parent_run_id: str,
                 fixed: dict[str, Any] | None = None) -> None:
        self.tracking_uri, self.experiment_id, self.parent = tracking_uri, experiment_id, parent_run_id
        self.fixed = dict(fixed or {})  # what the trainable applies over the trial's config
        self.runs: dict[str, str] = {}
        self.nodes: dict[str, list[str]] = {}  # trial id -> the nodes it ran on, in order (a retry may move it)

    @property
    def client(self):
        return mlflow.MlflowClient(self.tracking_uri)

    def _call(self, method: str, *args, **kwargs) -> Any:
        return _retry(getattr(self.client, method), *args, **kwargs)

    def _find(self, trial_id: str) -> str | None:
        """The trial's run, if any: the first created, the others (doubles) deleted."""
        found = self.client.search_runs(
            [self.experiment_id], f"tags.`mlflow.parentRunId` = '{self.parent}' and tags.trial_id = '{trial_id}'")
        first, *doubles = sorted(found, key=lambda r: (r.info.start_time, r.info.run_id)) or [None]
        for r in doubles:
            self.client.delete_run(r.info.run_id)
        return first.info.run_id if first else None

    def _create(self, trial_id: str) -> str:
        """The trial's run: found if an earlier attempt created it, else created (so a retry never doubles it)."""
        return self._find(trial_id) or self.client.create_run(
            self.experiment_id, run_name=f"trial-{trial_id}",
            tags={"mlflow.parentRunId": self.parent, "trial_id": trial_id}).info.run_id

    def _run_for(self, trial) -> str:
        if trial.trial_id in self.runs:
            return self.runs[trial.trial_id]
        run_id = _retry(self._find, trial.trial_id)
        if run_id:  # a resumed sweep restarting this trial: reuse its run
            self._call("update_run", run_id, status="RUNNING")
        else:
            _retry(self._create, trial.trial_id)
            # MLflow's client itself sends a request again when the connection drops before any answer, so a
            # creation the store had made can be made twice: the search after it keeps the first
            run_id = _retry(self._find, trial.trial_id)
            config = {**trial.config, **self.fixed}  # the configuration that actually trains
            self._call("log_batch", run_id, params=[Param(k, str(v)) for k, v in sorted(config.items())])
            self._call("log_dict", run_id, config, "config.json")
        self.runs[trial.trial_id] = run_id
        return run_id

    def on_trial_start(self, iteration, trials, trial, **info):
        self._run_for(trial)

    def _tag_node(self, run_id: str, trial_id: str, node_json: str) -> None:
        """The node a trial runs on, as tags of its run (node_id, node_ip, node_type, node_resources,
        trial_resources); `node_history` lists every node when a retry moved it."""
        node = json.loads(node_json)
        seen = self.nodes.setdefault(trial_id, [])
        if seen and seen[-1] == node["id"]:
            return
        seen.append(node["id"])
        self._call("log_batch", run_id, tags=[RunTag(k, v) for k, v in {
            "node_id": node["id"], "node_ip": str(node.get("ip")), "node_type": node.get("type") or "",
            "node_resources": json.dumps(node.get("resources", {}), sort_keys=True),
            "trial_resources": json.dumps(node.get("trial_resources", {}), sort_keys=True),
            "node_history": ",".join(seen)}.items()])

    def on_trial_result(self, iteration, trials, trial, result, **info):
        run_id, step = self._run_for(trial), int(result.get("training_iteration", 0))
        if isinstance(result.get("node"), str):
            self._tag_node(run_id, trial.trial_id, result["node"])
        ts = int(result.get("timestamp", 0) * 1000)
        if "per_seed" in result:
            per_seed = json.loads(result["per_seed"])
            metrics = [Metric(k, float(result[k]), ts, 0) for k in result
                       if k in (*FINAL_KEYS, METRIC, "seconds") or k.startswith("transfer/")]
            metrics += [Metric(f"seed/{k}", float(v), ts, i) for i, r in enumerate(per_seed)
                        for k, v in r.items() if isinstance(v, (int, float)) and v == v]
            self._call("log_batch", run_id, metrics=metrics)
            self._call("log_dict", run_id, per_seed, "per_seed.json")
        else:
            self._call("log_batch", run_id, metrics=[Metric(k, float(result[k]), ts, step) for k in result
                                                     if k.startswith("epoch/") or k == METRIC])

    def on_trial_complete(self, iteration, trials, trial, **info):
        run_id = self._run_for(trial)
        if "per_seed" not in (trial.last_result or {}):
            self._call("set_tag", run_id, "stopped_early", "true")  # ASHA pruned it
        self._call("set_terminated", run_id, "FINISHED")

    def on_trial_error(self, iteration, trials, trial, **info):
        self._call("set_terminated", self._run_for(trial), "FAILED")



def close_orphans(tracking_uri: str, experiment_id: str, parent_run_id: str) -> int:
    """Child runs still RUNNING after the sweep (a killed driver's in-flight trials) -> KILLED."""
    client = mlflow.MlflowClient(tracking_uri)
    runs = _retry(client.search_runs, [experiment_id], f"tags.`mlflow.parentRunId` = '{parent_run_id}' and "
                                                        "attributes.status = 'RUNNING'")
    for r in runs:
        _retry(client.set_terminated, r.info.run_id, "KILLED")
    return len(runs)


