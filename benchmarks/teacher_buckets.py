"""The teacher's batches sorted by characters or by tokens (`TeacherConfig.bucket_tokens`), side by side: the padded
positions they compute, a training epoch's time and the scoring's time and logits.

    .venv/bin/python benchmarks/teacher_buckets.py [--rounds 2] [--pairs 560] [--precision fp32]

Padding (no model run): every pair the fast teacher of STS-B trains on, batched as the recipe batches them
(`recipe.length_batches`: buckets of 50 batches of 16, seed 0), the stage's pairs (one order) and one fold's (both
orders), and the validation and test pairs as its scoring batches them (longest first, at most 32: by characters as
sentence-transformers' predict sorts them, by tokens through `encoding.batching`). Each figure is the padded positions
over the tokens the pairs hold. Time: `--rounds` rounds, each timing both sortings in turn, one torch thread, in
`--precision` (fp32: as on a CPU without native bf16; run it under ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2 for an AVX2-only CPU's kernels): one epoch of the recipe's training (`recipe.fit`, one
order, batches of 16) over `--pairs` of the stage's pairs, and the scoring of STS-B validation, both orders
(`recipe.predict`); the median round and its ratio to characters. Writes results/benchmarks/teacher_buckets.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import numpy as np
import torch

from benchmarks._common import write_results
from embed_lib.data.tasks import load_task
from embed_lib.encoding.batching import length_batches as longest_first
from embed_lib.teacher import intermediate, recipe
from embed_lib.teacher.config import teacher_preset
from embed_lib.teacher.scores import fold_assignment

SORTS = ("chars", "tokens")


def _configs(precision: str) -> dict:
    fast = teacher_preset("fast", precision=precision)
    return {"chars": dataclasses.replace(fast, bucket_tokens=False), "tokens": fast}


def _scoring_batches(key: np.ndarray, sort: str, batch: int) -> list[np.ndarray]:
    """The scoring's batches: fixed chunks of the longest-first order by characters (sentence-transformers' predict),
    or `encoding.batching`'s by tokens (what recipe.predict runs under bucket_tokens)."""
    if sort == "tokens":
        return longest_first(key, batch)
    order = np.argsort(-key, kind="stable")
    return [order[i: i + batch] for i in range(0, len(order), batch)]


def _padding(ce, cfgs: dict, own: dict) -> dict:
    """Padded positions over real tokens, per sorting, for the stage's, a fold's and the scoring's batches."""
    fast = cfgs["tokens"]
    splits = intermediate._splits(fast, own)
    stage, _ = intermediate._sample(splits, fast.intermediate_pairs, fast.seed, intermediate.left_out(splits, own))
    train = own["train"]
    rows = np.nonzero(fold_assignment(len(train), fast.folds, fast.seed) != 0)[0]
    fold = [[train.sentence1[i], train.sentence2[i]] for i in rows]
    fold += [[b, a] for a, b in fold]
    scored = [[d.sentence1[i], d.sentence2[i]] for d in (own["validation"], own["test"]) for i in range(len(d))]
    out = {}
    for name, pairs, batch in (("stage", stage, fast.batch_size), ("fold", fold, fast.batch_size),
                               ("scoring", scored, 32)):
        tokens = recipe.pair_lengths(ce, pairs, cfgs["tokens"])
        row = {"pairs": len(pairs), "tokens": int(tokens.sum())}
        for sort in SORTS:
            key = recipe.pair_lengths(ce, pairs, cfgs[sort])
            batches = (_scoring_batches(key, sort, batch) if name == "scoring"
                       else recipe.length_batches(key, batch, np.random.default_rng(0)))
            padded = int(sum(len(b) * tokens[b].max() for b in batches))
            row[f"padded_{sort}"] = padded
            row[f"overhead_{sort}"] = round(padded / row["tokens"] - 1, 4)
        out[name] = row
        print(f"{name}: {len(pairs)} pairs, padded positions over tokens: characters +{row['overhead_chars']:.1%}, "
              f"tokens +{row['overhead_tokens']:.1%}", flush=True)
    return {"padding": out, "stage_pairs": stage}


def _epoch_seconds(cfg, pairs: list[list[str]], y: np.ndarray) -> float:
    """Seconds of one epoch of `recipe.fit` over `pairs` (one order), after an untimed step on a few of them."""
    cfg = dataclasses.replace(cfg, both_orders=False, epochs=1, early_stopping_fraction=0.0)
    ce = recipe.load(cfg, "cpu", seed=0)
    recipe.fit(ce, pairs[:cfg.batch_size], y[:cfg.batch_size], cfg, seed=1)
    t0 = time.perf_counter()
    recipe.fit(ce, pairs, y, cfg, seed=0)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=560, help="stage pairs one timed training epoch runs over")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    data_dir = os.environ.get("EMBED_DATA_DIR")
    own = {s: load_task("stsb", s, data_dir) for s in ("train", "validation", "test")}
    cfgs = _configs(args.precision)
    ce = recipe.load(cfgs["tokens"], "cpu", seed=0)
    pad = _padding(ce, cfgs, own)
    stage = pad.pop("stage_pairs")
    rows = np.random.default_rng(0).permutation(len(stage))[:args.pairs]
    pairs, y = [stage[i] for i in rows], np.random.default_rng(1).random(len(rows)).astype(np.float32)
    val = [[a, b] for a, b in zip(own["validation"].sentence1, own["validation"].sentence2)]
    fit_s, score_s, logits = {s: [] for s in SORTS}, {s: [] for s in SORTS}, {}
    for r in range(args.rounds):
        for sort in SORTS:
            fit_s[sort].append(round(_epoch_seconds(cfgs[sort], pairs, y), 2))
            t0 = time.perf_counter()
            logits[sort] = recipe.predict(ce, val, cfgs[sort])
            score_s[sort].append(round(time.perf_counter() - t0, 2))
            print(f"round {r + 1}, {sort}: training epoch {fit_s[sort][-1]} s, scoring {score_s[sort][-1]} s",
                  flush=True)

    def timed(seconds: dict) -> dict:
        med = {s: statistics.median(v) for s, v in seconds.items()}
        return {s: {"rounds": v, "median": round(med[s], 2), "ratio_to_chars": round(med[s] / med["chars"], 3)}
                for s, v in seconds.items()}

    cap = {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
           if k in os.environ}
    write_results("teacher_buckets", {
        "precision": recipe.effective_precision(cfgs["tokens"], torch.device("cpu")), "threads": 1, "isa_cap": cap,
        **pad, "training": {"pairs": len(pairs), "batch_pairs": cfgs["tokens"].batch_size, "seconds": timed(fit_s)},
        "scoring": {"pairs": len(val), "both_orders": True, "seconds": timed(score_s),
                    "max_abs_logit_difference": float(np.abs(logits["chars"] - logits["tokens"]).max())}})


if __name__ == "__main__":
    main()
