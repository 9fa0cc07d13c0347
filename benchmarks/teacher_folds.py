"""The teacher's folds one after another in this process against all at once in worker processes, side by side.

    .venv/bin/python benchmarks/teacher_folds.py [--preset fast] [--task stsb]

Both start from the same intermediate stage (the cache's, else trained once first, not timed) and write to temporary
caches of their own, so neither reads the other's scores. Figures: each way's wall time for the folds, its plan
(processes x threads), the scores' largest difference between the two ways, and each way's Spearman on validation
and test. Writes results/benchmarks/teacher_folds.json.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks._common import write_results
from embed_lib.config import default_cache_dir
from embed_lib.data.tasks import load_splits
from embed_lib.teacher.config import PRESETS, teacher_preset
from embed_lib.teacher.intermediate import stage_key, warm_start
from embed_lib.teacher.scores import teacher_scores


def _run(splits, cfg, stage: Path, fold_workers: int) -> tuple[dict, dict, float]:
    """The teacher's scores from a cache of its own holding only the stage; (scores, record, folds' wall seconds)."""
    with tempfile.TemporaryDirectory(prefix="teacher-folds-") as tmp:
        (Path(tmp) / "teacher" / "intermediate").mkdir(parents=True)
        (Path(tmp) / "teacher" / "intermediate" / stage.name).symlink_to(stage)
        t0 = time.perf_counter()
        scores, record = teacher_scores(splits, cfg, tmp, progress=lambda m: print(m, flush=True),
                                        fold_workers=fold_workers)
        return scores, record, round(time.perf_counter() - t0, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="fast", choices=sorted(PRESETS), help="the teacher's recipe (default fast)")
    ap.add_argument("--task", default="stsb")
    args = ap.parse_args()
    splits = load_splits(args.task, ("train", "validation", "test"), os.environ.get("EMBED_DATA_DIR"))
    cfg = teacher_preset(args.preset)
    root = default_cache_dir()
    stage = root / "teacher" / "intermediate" / stage_key(cfg, splits)
    if not stage.is_dir():  # the stage once, into the cache (untimed): both ways start from it
        print(f"no cached stage at {stage}: training it first (not timed)", flush=True)
        warm_start(cfg, splits, root / "teacher", "cpu", print)
    out = {}
    for name, workers in (("one_after_another", 1), ("at_once", 0)):
        scores, record, wall = _run(splits, cfg, stage, workers)
        out[name] = {"folds_wall_s": wall, "processes": record["fold_processes"], "threads": record["fold_threads"],
                     "fold_seconds": [f["seconds"] for f in record["folds"]],
                     "validation_spearman": round(record["validation_spearman"], 4),
                     "test_spearman": round(record["test_spearman"], 4), "scores": scores}
    a, b = out["one_after_another"].pop("scores"), out["at_once"].pop("scores")
    write_results("teacher_folds", {
        "task": args.task, "preset": args.preset, "folds": cfg.folds, **out,
        "speedup": round(out["one_after_another"]["folds_wall_s"] / out["at_once"]["folds_wall_s"], 2),
        "max_abs_score_difference": float(max(np.abs(a[k] - b[k]).max() for k in a))})


if __name__ == "__main__":
    main()
