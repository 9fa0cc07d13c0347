"""The teacher's intermediate stage in one process against in shards averaged every few steps, side by side.

    .venv/bin/python benchmarks/stage_shards.py [--preset fast] [--task stsb] [--shards 2] [--pairs N]

Trains the stage of the preset's recipe twice, each into a temporary cache of its own (nothing is read from or left in
the real cache): with `stage_shards=1` (one process of every thread) and with `--shards` (one process per shard).
Figures: each way's seconds and pairs/s, each stage's own Spearman on the task's validation pairs (the stage alone as
a scorer, before any fold trains on the task), and how far apart the two stages' logits are there (the shards are
another recipe, so they differ). The teacher's quality from each stage is what `benchmarks/first_run.py` reports.
Writes results/benchmarks/stage_shards.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks._common import write_results
from embed_lib.data.tasks import load_splits
from embed_lib.teacher import recipe
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
            "shards": cfg.stage_shards, "record_seconds": record["seconds"],
            "average_seconds": [r["average_seconds"] for r in record.get("shard_records", [])]}, logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="fast", choices=sorted(PRESETS), help="the teacher's recipe (default fast)")
    ap.add_argument("--task", default="stsb")
    ap.add_argument("--shards", type=int, default=2, help="shards of the second way (default 2)")
    ap.add_argument("--pairs", type=int, default=None, help="the stage's pairs per task (default: the recipe's)")
    args = ap.parse_args()
    splits = load_splits(args.task, ("train", "validation"), os.environ.get("EMBED_DATA_DIR"))
    cfg = teacher_preset(args.preset, **({"intermediate_pairs": args.pairs} if args.pairs else {}))
    out, logits = {}, {}
    for name, shards in (("one_process", 1), ("shards", args.shards)):
        out[name], logits[name] = _stage(dataclasses.replace(cfg, stage_shards=shards), splits)
    write_results("stage_shards", {
        "task": args.task, "preset": args.preset, **out,
        "speedup": round(out["one_process"]["wall_s"] / out["shards"]["wall_s"], 2),
        "validation_logits_max_abs_difference": float(np.abs(logits["one_process"] - logits["shards"]).max()),
        "validation_logits_correlation": float(np.corrcoef(logits["one_process"], logits["shards"])[0, 1])})


if __name__ == "__main__":
    main()
