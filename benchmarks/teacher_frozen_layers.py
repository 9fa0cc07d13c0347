"""The teacher with its first layers frozen (`TeacherConfig.freeze_layers`): a training step's time side by side, and
the teacher's quality.

    .venv/bin/python benchmarks/teacher_frozen_layers.py [--layers 0,2,3] [--rounds 2] [--teacher 3]

Steps: `--rounds` rounds, each timing every `--layers` value in turn: the recipe's own training (`recipe.fit`) on the
same 560 STS-B train pairs in 35 length-bucketed batches of 16 (the fast preset's), the last 30 steps timed, one torch
thread, in fp32 (as on a CPU without native bf16); the median round per value and its ratio to the first value.
`--teacher N`: also the whole fast teacher with N layers frozen, through `load_study` (trained once, about 14 min in
fp32 on 2 cores, then read from the cache), with its stage and folds' seconds and its validation and test Spearman
against the floor 0.835. Writes results/benchmarks/teacher_frozen_layers.json.
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


def _step_seconds(layers: int, pairs: list[list[str]], y: np.ndarray) -> float:
    """Seconds of the last STEPS optimizer steps of the recipe's own training (`recipe.fit`: forward, backward,
    gradient clip, fused AdamW) on `pairs`, one order, after WARM untimed ones."""
    cfg = teacher_preset("fast", precision="fp32", freeze_layers=layers, both_orders=False)
    ce = recipe.load(cfg, "cpu", seed=0)
    ends: list[float] = []
    recipe.fit(ce, pairs, y, cfg, seed=0, after_step=lambda _: ends.append(time.perf_counter()))
    return ends[-1] - ends[WARM - 1]


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
    rows = np.random.default_rng(0).permutation(len(d))[:(STEPS + WARM) * BATCH]  # fit batches them by length
    pairs, y = [[d.sentence1[i], d.sentence2[i]] for i in rows], d.label[rows]
    values = [int(v) for v in args.layers.split(",")]
    rounds = {v: [] for v in values}
    for r in range(args.rounds):
        for v in values:
            rounds[v].append(round(_step_seconds(v, pairs, y), 2))
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
