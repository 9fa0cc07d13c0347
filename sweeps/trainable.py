"""The Tune trainable: one trial trains one configuration's whole seed group (the science stays in embed_lib).

- `precompute`: embeddings, transfer checks and held-out teacher scores, once, before any trial; trials
  receive the StudyData through the object store (`tune.with_parameters`), never re-encode.
- `trial`: reports every epoch (ASHA prunes on it) and a final result with per-seed figures.
"""
from __future__ import annotations

import functools
import json
from typing import Any

import ray
import torch
from ray import tune

from embed_lib.config import AdapterConfig
from embed_lib.data.tasks import CUSTOM
from embed_lib.pipeline.distributed import LazyPool, precompute_embeddings
from embed_lib.pipeline.prepare import load_study
from embed_lib.training.seed_group import train_seed_group

#: what the searcher and ASHA read: each epoch's mean validation delta while a trial trains, then the harm-penalised
#: objective of its selected weights (`objective`); the plain mean is `delta_val_mean` everywhere
METRIC, MODE = "objective", "max"
MAX_EPOCHS = 12  # the largest epoch count a space may propose (ASHA's max_t is one more)
FINAL_KEYS = ("delta_val_mean", "delta_val_std", "delta_val_min", "delta_val_positive", "n_seeds",
              "val/spearman_mean", "train/gate_fit_mean", "ensemble/val/spearman", "transfer_delta_min")


#: how much a unit of transfer harm beyond the tolerance costs in the searcher's objective
HARM_PENALTY = 10.0


def objective(summary: dict[str, Any], tolerance: float) -> float:
    """What the searcher maximises: the mean validation delta, minus HARM_PENALTY times the worst seed's
    transfer harm beyond the tolerance (0 when every transfer delta is >= -tolerance, or there are none)."""
    harm = max(0.0, -tolerance - summary.get("transfer_delta_min", 0.0))
    return float(summary["delta_val_mean"] - HARM_PENALTY * harm)


def final_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """What a finished trial reports: FINAL_KEYS and every transfer figure (per other task)."""
    return {k: float(v) for k, v in summary.items() if k in FINAL_KEYS or k.startswith("transfer/")}


def _load_there(load, task: str, custom):
    """`load` in a Ray task; a custom task (read and validated on the driver) is registered there first."""
    if custom is not None:
        CUSTOM[task] = custom
    return load()


def precompute(task: str, encoder, teacher, data_dir, cache_dir, limit: int | None, workers: int = 1,
               transfer=(), progress=None):
    """(StudyData, teacher record), assembled once before any trial: sentences missing from the cache (the
    task's and the transfer checks') are encoded by a pool of `workers` Ray actors; the held-out teacher is
    trained (or read from its cache) on the driver, where its progress reaches the job's output. On a
    cluster with GPUs the encoders take one GPU each and the study is assembled in a Ray task on a GPU."""
    load = functools.partial(load_study, task, encoder, teacher, data_dir=data_dir, cache_dir=cache_dir, limit=limit,
                             transfer=transfer)
    if ray.cluster_resources().get("GPU", 0) >= 1:
        precompute_embeddings(task, encoder, data_dir=data_dir, cache_dir=cache_dir, workers=workers, use_gpu=True,
                              limit=limit, transfer=transfer)
        return ray.get(ray.remote(num_cpus=1, num_gpus=1)(_load_there).remote(load, task, CUSTOM.get(task)))
    pool = LazyPool(encoder, workers)
    try:
        return load(progress=progress, lazy=pool)
    finally:
        pool.shutdown()


def resolve(config: dict[str, Any], data, fixed: dict[str, Any]):
    """(AdapterConfig, StudyData) that a trial's config trains: fixed values win (the smoke test caps epochs),
    and tau_attn picks the study when several encoder attention temperatures were precomputed."""
    config = dict(config)
    tau_attn = config.pop("tau_attn", None)
    if isinstance(data, dict):
        data = data[tau_attn if tau_attn is not None else next(iter(data))]
    return AdapterConfig.from_dict({**config, **fixed}), data


def trial(config: dict[str, Any], data=None, fixed: dict[str, Any] | None = None, threads: int = 1,
          use_gpu: bool = False, tolerance: float = 0.001) -> None:
    """One Tune trial: the whole seed group of one configuration."""
    torch.set_num_threads(max(1, threads))
    cfg, data = resolve(config, data, fixed or {})
    device = "cuda" if use_gpu and torch.cuda.is_available() else "cpu"
    result = train_seed_group(cfg, data, on_epoch=lambda epoch, h: tune.report({**h, METRIC: h["epoch/delta_val_mean"]}),
                              evaluate_test=False, device=device)
    final = final_metrics(result.summary)
    tune.report({**final, METRIC: objective(result.summary, tolerance), "final": 1,
                 "per_seed": json.dumps(result.per_seed), "seconds": result.seconds})


def make_trainable(data, fixed: dict[str, Any], cpus: float, gpus: float, tolerance: float = 0.001):
    fn = tune.with_parameters(trial, data=data, fixed=fixed, threads=max(1, int(cpus)), use_gpu=gpus > 0,
                              tolerance=tolerance)
    return tune.with_resources(fn, {"cpu": cpus, "gpu": gpus})


