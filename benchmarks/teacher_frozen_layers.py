"""The teacher with its first layers frozen (`TeacherConfig.freeze_layers`): a training step's time side by side, and
the teacher's quality.

    .venv/bin/python benchmarks/teacher_frozen_layers.py [--layers 0,2,3] [--rounds 2] [--teacher 3]

Steps: `--rounds` rounds, each timing every `--layers` value in turn on the same 30 batches of 16 STS-B train pairs
(length-bucketed, after 5 untimed), one torch thread, in fp32 (as on a CPU without native bf16), the fast preset's
other settings; the median round per value and its ratio to the first value. `--teacher N`: also the whole fast
teacher with N layers frozen, through `load_study` (trained once, about 14 min in fp32 on 2 cores, then read from the
cache), with its stage and folds' seconds and its validation and test Spearman against the floor 0.835. Writes
results/benchmarks/teacher_frozen_layers.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from benchmarks._common import write_results
from embed_lib.data.tasks import load_task
from embed_lib.teacher import recipe
from embed_lib.teacher.config import teacher_preset

STEPS, WARM, BATCH = 30, 5, 16


def _step_seconds(layers: int, pairs: list[list[str]], batches: list[np.ndarray]) -> float:
    """Seconds of STEPS training steps (forward, backward, fused AdamW) after WARM untimed ones."""
    cfg = teacher_preset("fast", precision="fp32", freeze_layers=layers)
    ce = recipe.load(cfg, "cpu", seed=0)
    recipe._prepare(ce, cfg)
    opt, _ = recipe._optimizer(ce.model, cfg, ce.device, len(batches))
    ce.model.train()
    y = torch.rand(BATCH, generator=torch.Generator().manual_seed(0))
    total = 0.0
    for i, idx in enumerate(batches):
        t0 = time.perf_counter()
        z = recipe.logits(ce, [pairs[j] for j in idx])
        loss = torch.nn.functional.binary_cross_entropy_with_logits(z.float(), y[:len(idx)])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        total += (time.perf_counter() - t0) if i >= WARM else 0.0
    return total


def _teacher(layers: int) -> dict:
    from embed_lib.pipeline.prepare import load_study

    t0 = time.perf_counter()
    _, rec = load_study("stsb", teacher=teacher_preset("fast", freeze_layers=layers))
    stage = rec.get("intermediate") or {}
    return {"freeze_layers": layers, "wall_s_this_call": round(time.perf_counter() - t0, 1),
            "teacher_seconds": rec["seconds"], "precision": rec["precision"], "stage_s": stage.get("seconds"),
            "folds_s": [f["seconds"] for f in rec["folds"]], "teacher_val": rec["validation_spearman"],
            "teacher_test": rec["test_spearman"], "floor_teacher_test": 0.835,
            "meets_floor": rec["test_spearman"] >= 0.835, "key": rec["key"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="0,2,3", help="freeze_layers values to time, the first the baseline")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--teacher", type=int, default=None, help="also the whole fast teacher with this many frozen")
    args = ap.parse_args()
    torch.set_num_threads(1)
    d = load_task("stsb", "train", os.environ.get("EMBED_DATA_DIR"))
    pairs = [[a, b] for a, b in zip(d.sentence1, d.sentence2)]
    lengths = np.array([len(a) + len(b) for a, b in pairs])
    batches = recipe.length_batches(lengths, BATCH, np.random.default_rng(0))[:STEPS + WARM]
    values = [int(v) for v in args.layers.split(",")]
    rounds = {v: [] for v in values}
    for r in range(args.rounds):
        for v in values:
            rounds[v].append(round(_step_seconds(v, pairs, batches), 2))
            print(f"round {r + 1}: freeze_layers={v}: {rounds[v][-1]} s for {STEPS} steps", flush=True)
    median = {v: statistics.median(s) for v, s in rounds.items()}
    figures = {"steps": STEPS, "batch_pairs": BATCH, "threads": 1, "precision": "fp32",
               "step_seconds_by_layers": {str(v): {"rounds": s, "median": round(median[v], 2),
                                                   "ratio_to_first": round(median[v] / median[values[0]], 3)}
                                          for v, s in rounds.items()}}
    if args.teacher is not None:
        figures["teacher"] = _teacher(args.teacher)
    write_results("teacher_frozen_layers", figures)


if __name__ == "__main__":
    main()
