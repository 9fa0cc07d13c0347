"""A 5-seed pair-gated seed group on STS-B from a warm cache, on one CPU thread: the batched group
(one model with a seed dimension) vs the same 5 seeds trained one after another. Target: <= 10 s.
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from benchmarks._common import write_results
from embed_lib.config import AdapterConfig
from embed_lib.pipeline.prepare import load_study
from embed_lib.teacher.config import TeacherConfig
from embed_lib.training.seed_group import train_seed_group


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--target", default="lexical", help="lexical (no teacher needed) or ce_margin")
    p.add_argument("--epochs", type=int, default=AdapterConfig().epochs)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    data, _ = load_study("stsb", teacher=TeacherConfig() if args.target == "ce_margin" else None)
    cfg = AdapterConfig(adapter="pair_gated", target=args.target, n_seeds=5, epochs=args.epochs)
    train_seed_group(dataclasses.replace(cfg, epochs=1, n_seeds=1), data)  # warm-up (lazy imports, allocator)
    t = time.perf_counter()
    group = train_seed_group(cfg, data)
    batched = time.perf_counter() - t
    t = time.perf_counter()
    singles = [train_seed_group(dataclasses.replace(cfg, seed0=s, n_seeds=1), data) for s in cfg.seeds]
    sequential = time.perf_counter() - t
    same = max(abs(a["delta_val"] - b.per_seed[0]["delta_val"]) for a, b in zip(group.per_seed, singles))
    write_results("seed_group", {
        "config": {k: v for k, v in cfg.to_dict().items() if k in ("adapter", "target", "epochs", "batch_size", "width")},
        "threads": args.threads, "batched_s": round(batched, 2), "sequential_5_singles_s": round(sequential, 2),
        "speedup": round(sequential / batched, 2), "target_s": 10.0,
        "max_abs_diff_val_delta_batched_vs_single": same,
        "delta_val_mean": group.summary["delta_val_mean"], "delta_val_positive": group.summary["delta_val_positive"]})


if __name__ == "__main__":
    main()
