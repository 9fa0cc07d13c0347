"""The intermediate stage as shards that average their weights every few steps (local SGD), a process each.

On a CPU of few cores, one process of two threads keeps them less busy than two processes of one thread each (a
cross-encoder step on small batches is many small matrix products). Averaging the gradients of two processes every
step (synchronous data parallelism) gives that gain back to the wait and the all-reduce of every step (measured on
2 cores: 0.91x). Here each of `stage_shards` processes trains its own share of the stage's pairs, with its own
optimizer and dropout, on batches of batch_size / shards (so the steps and the learning-rate schedule are those of
one process), and every `SYNC_EVERY` steps, and once at the end, the shards' trained weights are replaced by their
mean: one gloo all-reduce over loopback per SYNC_EVERY steps. This is local SGD (Stich 2019; Lin et al. 2020) with
the optimizer state kept per shard.

Every shard starts from the same weights (the new head drawn from cfg.seed) and the shards are a seeded split of
the pairs: the stage is the same model on any machine, whatever its cores (the shards are the recipe; the processes
only run them), up to the rounding of another thread count.

A shard that finishes its steps first waits at the average for the others. A shard's batches, sorted by length, hold
from a few to a hundred tokens a pair, so in the order they are formed (shuffled, each shard its own way) the slower
shard's windows of SYNC_EVERY steps held 5.9% more characters than the mean (4.6% more tokens; the fast teacher of
STS-B). So every shard trains its batches in an order of cost ranks that they all draw alike (`cost_ranked`): at each
step the shards train batches of the same rank by characters among their own, each shard's order as random as before,
and the windows 0.7% apart. Side by side capped at AVX2 each shard spent 3.0-5.5 s in the averages instead of
8.8-13.3 s, and the stage took 0.968x the time.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from embed_lib.teacher import recipe, workers

if TYPE_CHECKING:
    from embed_lib.teacher.config import TeacherConfig

#: optimizer steps between two averages of the shards' weights (part of the stage's cache key)
SYNC_EVERY = 16
#: the order each shard trains its batches in (part of the stage's cache key): "cost_ranked" (`cost_ranked`), or
#: "formed" (as `recipe.length_batches` forms them: shuffled, each shard its own way; the stages cached before it)
STEP_ORDER = "cost_ranked"
STEP_ORDERS = ("cost_ranked", "formed")


def shard_rows(n: int, shards: int, seed: int) -> list[np.ndarray]:
    """The pairs of each shard: a seeded permutation of range(n) dealt out in turn (sizes differ by at most one)."""
    perm = np.random.default_rng(seed).permutation(n)
    return [np.sort(perm[k::shards]) for k in range(shards)]


def shard_batch_size(stage: TeacherConfig, shards: int) -> int:
    """Pairs per batch of each shard: the stage's batch_size split over the shards (at least 2), so that the steps and
    the learning-rate schedule are those of one process."""
    return max(2, stage.batch_size // shards)


def cost_ranked(batches: list[np.ndarray], characters: np.ndarray, epoch: int, seed: int) -> list[np.ndarray]:
    """`batches` (indices into the pairs) reordered: the k-th step trains the batch whose rank by characters among
    them is the rank of the k-th of uniform draws (seed, epoch) among the first len(batches). Every shard draws the
    same numbers, so at every step the shards train batches of the same cost rank, and shards whose counts of
    batches differ by one have ranks that differ by at most one."""
    cost = np.array([characters[b].sum() for b in batches])
    draws = np.random.default_rng([seed, epoch]).random(len(batches))
    by_cost = np.argsort(cost, kind="stable")
    return [batches[i] for i in by_cost[np.argsort(np.argsort(draws, kind="stable"), kind="stable")]]


def step_order(seed: int, name: str = STEP_ORDER) -> Callable | None:
    """The `order` a shard passes to `recipe.fit`: `cost_ranked` with the stage's seed, or None ("formed")."""
    if name not in STEP_ORDERS:
        raise ValueError(f"step order {name!r}: give one of {list(STEP_ORDERS)}.")
    return functools.partial(cost_ranked, seed=seed) if name == "cost_ranked" else None


def _average(model: torch.nn.Module, world: int) -> None:
    """Replace the weights that train (the frozen embeddings are equal in every shard anyway) by their mean over the
    shards: one all-reduce of them as one vector."""
    import torch.distributed as dist
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        flat = parameters_to_vector(params).to("cpu", torch.float32)
        dist.all_reduce(flat)
        vector_to_parameters((flat / world).to(params[0].device), params)


def _shard(rank: int, cfg: TeacherConfig, stage: TeacherConfig, pairs: list[list[str]], y: np.ndarray, device: str,
           sync_every: int, rendezvous: str, out: str, order: str, progress: Callable[[str], None]) -> dict[str, Any]:
    """Shard `rank` of the stage; rank 0 saves the averaged model to `out`. Module-level: it runs in a worker."""
    import torch.distributed as dist

    world = cfg.stage_shards
    # a shard that dies leaves the others waiting at the next average: they give up after this long
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10))
    try:
        rows = shard_rows(len(pairs), world, cfg.seed)
        shard_cfg = dataclasses.replace(stage, batch_size=shard_batch_size(stage, world))
        # every shard takes at least this many steps: the averages inside it are the same calls in every process
        common = min(-(-len(r) // shard_cfg.batch_size) for r in rows) * shard_cfg.epochs
        ce = recipe.load(cfg, device, seed=cfg.seed)  # the same starting weights in every shard
        waited = [0.0, 0]

        def after_step(step: int) -> None:
            if (step + 1) % sync_every == 0 and step + 1 <= common:
                t = time.perf_counter()
                _average(ce.model, world)
                waited[0] += time.perf_counter() - t
                waited[1] += 1

        mine = rows[rank]
        curve = recipe.fit(ce, [pairs[i] for i in mine], y[mine], shard_cfg, cfg.seed * 1000 + rank,
                           progress=progress if rank == 0 else None, after_step=after_step,
                           order=step_order(cfg.seed, order))
        _average(ce.model, world)
        dist.barrier()
        if rank == 0:
            ce.save_pretrained(out, safe_serialization=True)
        return {"rank": rank, "pairs": len(mine), "curve": curve, "averages": waited[1] + 1,
                "average_seconds": round(waited[0], 1)}
    finally:
        dist.destroy_process_group()


def fit_shards(cfg: TeacherConfig, stage: TeacherConfig, pairs: list[list[str]], y: np.ndarray, device: str,
               out: Path, progress: Callable[[str], None], sync_every: int = SYNC_EVERY, order: str | None = None
               ) -> tuple[list[dict[str, float]], dict[str, Any]]:
    """Train the stage (`stage`: its recipe, `intermediate.stage_config`) as `cfg.stage_shards` shards at once, each in
    a spawned process of cores / shards threads (at least one), their batches in `order` (STEP_ORDERS; None:
    STEP_ORDER, as the stage's key says), their weights averaged every `sync_every` steps and at the end, and save the
    averaged model to `out`. Returns (shard 0's curve, the record's extra fields)."""
    shards, order = cfg.stage_shards, order or STEP_ORDER
    step_order(cfg.seed, order)  # an unknown order is refused here, not in every worker
    threads = max(1, workers.cpu_cores() // shards)
    progress(f"{shards} shards at once, in {shards} processes of {threads} thread(s), steps {order.replace('_', '-')}, "
             f"weights averaged every {sync_every} steps")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="embed-stage-") as tmp:
        results = workers.run_folds(_shard, [(k, cfg, stage, pairs, y, device, sync_every, f"{tmp}/rendezvous",
                                              str(out), order)
                                             for k in range(shards)], shards, threads, progress)
    rate = round(len(pairs) / (time.perf_counter() - t0), 1)
    progress(f"{shards} shards averaged: {len(pairs)} pairs, {rate} pairs/s together")
    curve = results[0]["curve"]  # shard 0's: its share of the pairs
    return curve, {"shards": shards, "shard_threads": threads, "sync_every": sync_every, "step_order": order,
                   "pairs_per_s": rate,
                   "shard_records": [{k: v for k, v in r.items() if k != "curve"} for r in results]}
