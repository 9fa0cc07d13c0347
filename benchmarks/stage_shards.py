"""The teacher's intermediate stage in one process against in shards averaged every few steps, side by side; or the
shards' two step orders.

    .venv/bin/python benchmarks/stage_shards.py [--preset fast] [--task stsb] [--shards 2] [--pairs N]
                                                [--compare processes|orders] [--rounds 1]

Trains the stage of the preset's recipe twice, each into a temporary cache of its own (nothing is read from or left in
the real cache): with `stage_shards=1` (one process of every thread) and with `--shards` (one process per shard); with
`--compare orders`, in `--shards` both ways, each shard's batches in the order they are formed and in the shards' shared
order of cost ranks (`teacher.shards.STEP_ORDERS`).
Figures: each way's seconds and pairs/s, each shard's seconds in the averages (most of it waiting for the others),
each stage's own Spearman on the task's validation pairs (the stage alone as a scorer, before any fold trains on the
task), and how far apart the two stages' logits are there (another recipe, so they differ). The teacher's quality
from each stage is what `benchmarks/first_run.py` reports. Writes results/benchmarks/stage_shards.json (or
stage_shards_orders.json).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks._common import write_results
from embed_lib.data.tasks import load_splits
from embed_lib.teacher import recipe, shards
from embed_lib.teacher.config import PRESETS, teacher_preset
from embed_lib.teacher.intermediate import warm_start


def _stage(cfg, splits) -> tuple[dict, np.ndarray]:
    with tempfile.TemporaryDirectory(prefix="stage-shards-") as tmp:
        t0 = time.perf_counter()
        folder, record = warm_start(cfg, splits, Path(tmp), "cpu", lambda m: print(m, flush=True))
        wall = round(time.perf_counter() - t0, 1)
        val = splits["validation"]
        logits = recipe.predict(recipe.load(cfg, "cpu", start=folder), [[a, b] for a, b in zip(val.sentence1,
                                                                                              val.sentence2)], cfg)
    return {"wall_s": wall, "pairs": record["pairs"], "pairs_per_s": round(record["pairs"] / wall, 1),
            "validation_spearman_of_the_stage_alone": round(recipe.spearman_or_nan(logits, val.label), 4),
            "shards": cfg.stage_shards, "step_order": record.get("step_order"), "record_seconds": record["seconds"],
            "average_seconds": [r["average_seconds"] for r in record.get("shard_records", [])]}, logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="fast", choices=sorted(PRESETS), help="the teacher's recipe (default fast)")
    ap.add_argument("--task", default="stsb")
    ap.add_argument("--shards", type=int, default=2, help="shards of the second way (default 2)")
    ap.add_argument("--pairs", type=int, default=None, help="the stage's pairs per task (default: the recipe's)")
    ap.add_argument("--compare", default="processes", choices=("processes", "orders"),
                    help="one process against shards (default), or the shards' step orders")
    ap.add_argument("--rounds", type=int, default=1, help="each way this many times, in turn (wall_s: the median)")
    args = ap.parse_args()
    splits = load_splits(args.task, ("train", "validation"), os.environ.get("EMBED_DATA_DIR"))
    cfg = teacher_preset(args.preset, **({"intermediate_pairs": args.pairs} if args.pairs else {}))
    ways = ([("one_process", 1, shards.STEP_ORDER), ("shards", args.shards, shards.STEP_ORDER)]
            if args.compare == "processes" else [(order, args.shards, order) for order in reversed(shards.STEP_ORDERS)])
    rounds, logits, default = {name: [] for name, _, _ in ways}, {}, shards.STEP_ORDER
    try:
        for _ in range(args.rounds):  # the ways in turn, round after round: a machine's drift falls on both
            for name, n, order in ways:
                shards.STEP_ORDER = order  # the stage's key and its shards both read it
                figures, logits[name] = _stage(dataclasses.replace(cfg, stage_shards=n), splits)
                rounds[name].append(figures)
    finally:
        shards.STEP_ORDER = default
    out = {name: {**runs[-1], "wall_s": statistics.median(r["wall_s"] for r in runs),
                  "rounds_wall_s": [r["wall_s"] for r in runs],
                  "rounds_average_seconds": [r["average_seconds"] for r in runs]} for name, runs in rounds.items()}
    (a, _, _), (b, _, _) = ways
    write_results("stage_shards" if args.compare == "processes" else "stage_shards_orders", {
        "task": args.task, "preset": args.preset, "pairs_per_task": cfg.intermediate_pairs, "rounds": args.rounds,
        **out, "speedup": round(out[a]["wall_s"] / out[b]["wall_s"], 3),
        "validation_logits_max_abs_difference": float(np.abs(logits[a] - logits[b]).max()),
        "validation_logits_correlation": float(np.corrcoef(logits[a], logits[b])[0, 1])})


if __name__ == "__main__":
    main()
