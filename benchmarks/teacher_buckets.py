"""The teacher's batches sorted by characters or by tokens, side by side: the padded positions they compute, and the
scoring's time and logits.

    .venv/bin/python benchmarks/teacher_buckets.py [--rounds 2] [--precision fp32]

Padding (no model run): every pair the fast teacher of STS-B trains on, batched as the recipe batches them
(`recipe.length_batches`: buckets of 50 batches of 16, seed 0), the stage's pairs (one order) and one fold's (both
orders), sorted by characters (the recipe's training) and by tokens; and the validation and test pairs as scoring
batches them (longest first, at most 32: by characters as sentence-transformers' predict sorts them, by tokens as
`recipe.predict` does through `encoding.batching`). Each figure is the padded positions over the tokens the pairs
hold. Time: `--rounds` rounds, each scoring STS-B validation in both orders both ways in turn (sentence-transformers'
predict alone, then `recipe.predict`), one torch thread, in `--precision` (fp32: as on a CPU without native bf16; run
it under ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 for an AVX2-only CPU's
kernels); the median round and its ratio to characters, and the largest difference of their logits. Training on batches
sorted by tokens was measured too (ff4b168: an epoch 0.773x) and rejected: it trained weaker teachers
(results/README.md#the-first-run). Writes results/benchmarks/teacher_buckets.json.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from benchmarks._common import stsb_fast_teacher, teacher_training_pairs, write_results
from embed_lib.encoding.batching import length_batches as longest_first
from embed_lib.teacher import intermediate, recipe, shards

SORTS = ("chars", "tokens")


def _scoring_batches(key: np.ndarray, sort: str, batch: int) -> list[np.ndarray]:
    """The scoring's batches: fixed chunks of the longest-first order by characters (sentence-transformers' predict),
    or `encoding.batching`'s by tokens (what recipe.predict runs)."""
    if sort == "tokens":
        return longest_first(key, batch)
    order = np.argsort(-key, kind="stable")
    return [order[i: i + batch] for i in range(0, len(order), batch)]


def _padding(ce, fast, own: dict) -> dict:
    """Padded positions over real tokens, per sorting, for the stage's, a fold's and the scoring's batches."""
    stage, fold = teacher_training_pairs(fast, own)
    scored = [[d.sentence1[i], d.sentence2[i]] for d in (own["validation"], own["test"]) for i in range(len(d))]
    out = {}
    shard_batch = shards.shard_batch_size(intermediate.stage_config(fast), fast.stage_shards)  # a stage shard's
    for name, pairs, batch in (("stage", stage, shard_batch), ("fold", fold, fast.batch_size),
                               ("scoring", scored, 32)):
        tokens = recipe.token_lengths(ce, pairs, fast.max_length)
        row = {"pairs": len(pairs), "tokens": int(tokens.sum())}
        chars = np.array([len(a) + len(b) for a, b in pairs])
        for sort, key in (("chars", chars), ("tokens", tokens)):
            batches = (_scoring_batches(key, sort, batch) if name == "scoring"
                       else recipe.length_batches(key, batch, np.random.default_rng(0)))
            padded = int(sum(len(b) * tokens[b].max() for b in batches))
            row[f"padded_{sort}"] = padded
            row[f"overhead_{sort}"] = round(padded / row["tokens"] - 1, 4)
        out[name] = row
        print(f"{name}: {len(pairs)} pairs, padded positions over tokens: characters +{row['overhead_chars']:.1%}, "
              f"tokens +{row['overhead_tokens']:.1%}", flush=True)
    return {"padding": out}


def _by_characters(ce, pairs: list[list[str]]) -> np.ndarray:
    """Logits averaged over both orders through sentence-transformers' predict alone (its sort by characters)."""
    kw = dict(batch_size=32, show_progress_bar=False, activation_fn=torch.nn.Identity())
    one = np.asarray(ce.predict(pairs, **kw), dtype=np.float64)
    return ((one + np.asarray(ce.predict([[b, a] for a, b in pairs], **kw), dtype=np.float64)) / 2).astype(np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    args = ap.parse_args()
    own, fast, ce = stsb_fast_teacher(args.precision)
    pad = _padding(ce, fast, own)
    val = [[a, b] for a, b in zip(own["validation"].sentence1, own["validation"].sentence2)]
    ways = {"chars": lambda: _by_characters(ce, val), "tokens": lambda: recipe.predict(ce, val, fast)}
    seconds, logits = {s: [] for s in SORTS}, {}
    with recipe.autocast(recipe.effective_precision(fast, ce.device), ce.device):
        for r in range(args.rounds):
            for sort in SORTS:
                t0 = time.perf_counter()
                logits[sort] = ways[sort]()
                seconds[sort].append(round(time.perf_counter() - t0, 2))
                print(f"round {r + 1}, {sort}: scoring {seconds[sort][-1]} s", flush=True)
    med = {s: statistics.median(v) for s, v in seconds.items()}
    cap = {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
           if k in os.environ}
    write_results("teacher_buckets", {
        "precision": recipe.effective_precision(fast, torch.device("cpu")), "threads": 1, "isa_cap": cap, **pad,
        "scoring": {"pairs": len(val), "both_orders": True, "seconds": {
            s: {"rounds": v, "median": round(med[s], 2), "ratio_to_chars": round(med[s] / med["chars"], 3)}
            for s, v in seconds.items()},
            "max_abs_logit_difference": float(np.abs(logits["chars"] - logits["tokens"]).max())}})


if __name__ == "__main__":
    main()
