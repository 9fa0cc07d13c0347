"""The Tune trainable: one trial trains one configuration's whole seed group (the science stays in embed_lib).

- `precompute`: embeddings, transfer checks and held-out teacher scores, once, before any trial; trials
  receive the StudyData through the object store (`tune.with_parameters`), never re-encode.
- `trial`: reports every epoch (ASHA prunes on it, the searcher learns from a pruned trial's last report) and a
  final result with per-seed figures; both rank by `objective`, the winner rule's transfer harm included.
"""
from __future__ import annotations

import json
import tempfile
from typing import Any

import ray
import torch
from ray import tune

from embed_lib.config import AdapterConfig
from embed_lib.pipeline.distributed import LazyPool, usable_device
from embed_lib.pipeline.prepare import load_study
from embed_lib.teacher.scores import teacher_scores
from embed_lib.training.seed_group import train_seed_group

#: what the searcher and ASHA read: `objective` of each epoch's weights while a trial trains (its mean validation
#: delta and its worst delta on the other tasks' pairs), then of its selected weights (every transfer check); the
#: plain mean is `delta_val_mean` everywhere
METRIC, MODE = "objective", "max"
MAX_EPOCHS = 12  # the largest epoch count a space may propose (ASHA's max_t is one more)
FINAL_KEYS = ("delta_val_mean", "delta_val_std", "delta_val_min", "delta_val_positive", "n_seeds",
              "val/spearman_mean", "train/gate_fit_mean", "ensemble/val/spearman", "transfer_delta_min")


#: how much a unit of transfer harm beyond the tolerance costs in the objective: enough that a configuration the rule
#: refuses ranks below the ones it keeps (QQP: +0.05 on validation at -0.004 on PAWS scores 0.05 - 100 x 0.003 < 0;
#: at 10 it outranked the keepers, and the sweep's winner gained +0.0086 where one of +0.0436 exists)
HARM_PENALTY = 100.0


def objective(summary: dict[str, Any], tolerance: float) -> float:
    """What the searcher maximises: the mean validation delta, minus HARM_PENALTY times the worst seed's
    transfer harm beyond the tolerance (0 when every transfer delta is >= -tolerance, or there are none)."""
    harm = max(0.0, -tolerance - summary.get("transfer_delta_min", 0.0))
    return float(summary["delta_val_mean"] - HARM_PENALTY * harm)


def final_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """What a finished trial reports: FINAL_KEYS and every transfer figure (per other task)."""
    return {k: float(v) for k, v in summary.items() if k in FINAL_KEYS or k.startswith("transfer/")}


def _teacher_there(splits, cfg):
    """The held-out teacher trained where this Ray task runs (a GPU node): its scores and record go back to the
    driver through the object store; what it writes on the way (the intermediate stage) stays in a temporary
    directory of that node, gone with it."""
    with tempfile.TemporaryDirectory(prefix="embed-teacher-") as tmp:
        return teacher_scores(splits, cfg, tmp, device=usable_device("cuda"))


def remote_teacher(splits, cfg):
    """`teacher_scores`' compute for a cluster with GPUs: one Ray task with a whole GPU."""
    print("teacher: training in a Ray task on a GPU node; its scores return through the object store and are cached "
          "where this driver runs (the task's progress is in that node's worker log)", flush=True)
    return ray.get(ray.remote(num_cpus=1, num_gpus=1, max_retries=2)(_teacher_there).remote(splits, cfg))


def precompute(task: str, encoder, teacher, data_dir, cache_dir, limit: int | None, workers: int = 1,
               transfer=(), progress=None, use_gpu: bool | None = None, teacher_device: str | None = None,
               silver: int | None = None):
    """(StudyData, teacher record), assembled once before any trial, on the driver: sentences missing from the cache
    (the task's and the transfer checks') are encoded by a pool of `workers` Ray actors; the held-out teacher is
    trained (or read from its cache) on the driver, where its progress reaches the job's output. On a cluster with
    GPUs the encoders take one GPU each and the teacher trains in a Ray task on a GPU. Vectors and scores come back
    through the object store into the driver's caches: no node reads another's disk, and trials get the study
    through the object store too (`make_trainable`).

    use_gpu: None decides by the GPUs the cluster has now; the sweep passes True when its trials ask for GPUs, so that
    an autoscaling cluster whose GPU nodes start at zero adds one for the encoders and the teacher too.
    teacher_device: the device of a teacher trained on the driver (None: the best available; the sweep's --device cpu
    gives cpu). silver: silver pairs for the teacher to score with the splits (distillation; `load_study`)."""
    gpu = use_gpu if use_gpu is not None else ray.cluster_resources().get("GPU", 0) >= 1
    pool = LazyPool(encoder, workers, use_gpu=gpu)
    try:
        data, record = load_study(task, encoder, teacher, data_dir=data_dir, cache_dir=cache_dir, limit=limit,
                                  transfer=transfer, progress=progress, lazy=pool,
                                  teacher_compute=remote_teacher if gpu else None, teacher_device=teacher_device,
                                  silver=silver)
    finally:
        pool.shutdown()
    # what each trial would otherwise compute again on its own copy of the study (the novelty gate's familiarity of
    # every sentence, the retrieval checks' frozen top-k: ~3.7 s a trial on 2 CPU cores), once here; both are fields
    # of the study, so they travel with it through the object store
    data.familiarity()
    data.retrieval_checks()
    return data, record


def resolve(config: dict[str, Any], data, fixed: dict[str, Any]):
    """(AdapterConfig, StudyData) that a trial's config trains: fixed values win (the smoke test caps epochs),
    and tau_attn picks the study when several encoder attention temperatures were precomputed."""
    config = dict(config)
    tau_attn = config.pop("tau_attn", None)
    if isinstance(data, dict):
        data = data[tau_attn if tau_attn is not None else next(iter(data))]
    return AdapterConfig.from_dict({**config, **fixed}), data


def node_record() -> str:
    """Where this trial runs, as JSON: the Ray node's id, address, type (the cluster YAMLs' node types are custom
    resources: head, cpu_worker, gpu_worker) and resources, and the trial's own (what MLflow tags it with)."""
    ctx = ray.get_runtime_context()
    node_id = ctx.get_node_id()
    node = next((n for n in ray.nodes() if n["NodeID"] == node_id), {})
    resources = node.get("Resources", {})
    return json.dumps({"id": node_id, "ip": node.get("NodeManagerAddress"),
                       "type": next((k for k in resources if k.endswith("_worker") or k == "head"), ""),
                       "resources": {k: v for k, v in resources.items() if "node:" not in k and "memory" not in k},
                       "trial_resources": ctx.get_assigned_resources()})


def trial(config: dict[str, Any], data=None, fixed: dict[str, Any] | None = None, threads: int = 1,
          use_gpu: bool = False, tolerance: float = 0.001) -> None:
    """One Tune trial: the whole seed group of one configuration."""
    torch.set_num_threads(max(1, threads))
    cfg, data = resolve(config, data, fixed or {})
    device = usable_device("cuda") if use_gpu else "cpu"
    node = node_record()
    def on_epoch(epoch: int, h: dict[str, float]) -> None:
        # the rule's harm while the trial trains: ASHA would otherwise keep the configurations that gain most on
        # validation by harming another task, and stop the anchored ones before they finish (QQP's sweep found none)
        now = {"delta_val_mean": h["epoch/delta_val_mean"],
               "transfer_delta_min": h.get("epoch/transfer_delta_min", 0.0)}
        tune.report({**h, METRIC: objective(now, tolerance), "node": node})

    result = train_seed_group(cfg, data, on_epoch=on_epoch, evaluate_test=False, device=device, epoch_transfer=True)
    final = final_metrics(result.summary)
    tune.report({**final, METRIC: objective(result.summary, tolerance), "final": 1, "node": node,
                 "per_seed": json.dumps(result.per_seed), "seconds": result.seconds})


def make_trainable(data, fixed: dict[str, Any], cpus: float, gpus: float, tolerance: float = 0.001):
    fn = tune.with_parameters(trial, data=data, fixed=fixed, threads=max(1, int(cpus)), use_gpu=gpus > 0,
                              tolerance=tolerance)
    return tune.with_resources(fn, {"cpu": cpus, "gpu": gpus})


