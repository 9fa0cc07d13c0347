"""The teacher's training steps through the model's own (padded) forward, on real tokens only (`teacher.packed`), and
on real tokens without dropout (`TeacherConfig.dropout=0.0`), side by side.

    .venv/bin/python benchmarks/teacher_packed.py [--rounds 3] [--batches 60] [--precision fp32] [--name NAME]

The batches the fast teacher of STS-B trains on (`recipe.length_batches`, seed 0, sorted by characters): a stage
shard's (the stage's pairs in one order, batches of the stage's 32 / stage_shards = 16) and a fold's (fold 0's
training pairs in both orders, batches of batch_size = 16). Each round runs the first `--batches` of each every way in
turn: forward, backward, gradient clipping and AdamW's step, one torch thread, the word embeddings frozen as the recipe
freezes them,
in `--precision` (fp32: as on a CPU without native bf16; under ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2, an AVX2-only CPU's kernels). Reports each way's median round, the packed one's ratio to
the padded one and the one without dropout's to the packed one, the padded positions over the tokens of those batches,
and the largest difference of the padded and packed logits on the first batch (eval mode). Writes
results/benchmarks/teacher_packed.json (or NAME.json).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from benchmarks._common import stsb_fast_teacher, teacher_training_pairs, write_results
from embed_lib.teacher import backbone, intermediate, packed, recipe, shards

#: way -> (the training logits, the dropout: None for MiniLM's own 0.1)
WAYS = {"padded": (recipe.logits, None), "packed": (packed.training_logits, None),
        "packed_no_dropout": (packed.training_logits, 0.0)}


def _batches(fast, own: dict) -> dict:
    """{"stage": (pairs, batches), "fold": (pairs, batches)}: what a stage shard and fold 0 train on."""
    stage, fold = teacher_training_pairs(fast, own)
    out = {}
    shard_batch = shards.shard_batch_size(intermediate.stage_config(fast), fast.stage_shards)
    for name, pairs, size in (("stage", stage, shard_batch),
                              ("fold", fold, fast.batch_size)):
        chars = np.array([len(a) + len(b) for a, b in pairs])
        out[name] = (pairs, recipe.length_batches(chars, size, np.random.default_rng(0)))
    return out


def _steps(ce, pairs, batches, way, opt, precision: str) -> float:
    """Seconds of training steps on `batches` with the logits and the dropout of `way` (targets drawn once: only the
    time counts)."""
    y = torch.as_tensor(np.random.default_rng(1).random(len(pairs)), dtype=torch.float32)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    logits, dropout = WAYS[way]
    backbone.set_dropout(ce.model, 0.1 if dropout is None else dropout)
    ce.model.train()
    t0 = time.perf_counter()
    for idx in batches:
        with recipe.autocast(precision, ce.device), recipe.training_attention(precision, ce.device):
            z = logits(ce, [pairs[j] for j in idx])
        loss = loss_fn(z.float(), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ce.model.parameters(), 1.0)
        opt.step()
    ce.model.eval()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, default=60, help="batches of each kind a round trains on (default 60)")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--name", default="teacher_packed", help="results/benchmarks/NAME.json (default teacher_packed)")
    args = ap.parse_args()
    own, fast, ce = stsb_fast_teacher(args.precision)
    ce.model.get_input_embeddings().weight.requires_grad_(False)
    precision = recipe.effective_precision(fast, ce.device)
    opt = torch.optim.AdamW(recipe.param_groups(ce.model, fast.weight_decay), lr=1e-6, fused=True)
    out = {}
    for name, (pairs, batches) in _batches(fast, own).items():
        batches = batches[: args.batches]
        tokens = recipe.token_lengths(ce, pairs, fast.max_length)
        overhead = sum(len(b) * tokens[b].max() for b in batches) / sum(tokens[b].sum() for b in batches) - 1
        with torch.no_grad(), recipe.autocast(precision, ce.device):
            first = [pairs[j] for j in batches[0]]
            diff = float((recipe.logits(ce, first) - packed.training_logits(ce, first)).abs().max())
        seconds = {w: [] for w in WAYS}
        for r in range(args.rounds):
            for way in WAYS:
                seconds[way].append(round(_steps(ce, pairs, batches, way, opt, precision), 2))
            print(f"{name}, round {r + 1}: " + ", ".join(f"{w} {s[-1]} s" for w, s in seconds.items()), flush=True)
        med = {w: statistics.median(v) for w, v in seconds.items()}
        out[name] = {"batches": len(batches), "batch_size": len(batches[0]), "padding_overhead": round(overhead, 4),
                     "max_abs_logit_difference": diff,
                     "seconds": {w: {"rounds": v, "median": round(med[w], 2)} for w, v in seconds.items()},
                     "packed_over_padded": round(med["packed"] / med["padded"], 3),
                     "no_dropout_over_packed": round(med["packed_no_dropout"] / med["packed"], 3)}
        print(f"{name}: padded positions over tokens +{overhead:.1%}; packed / padded "
              f"{out[name]['packed_over_padded']}; without dropout / packed {out[name]['no_dropout_over_packed']}",
              flush=True)
    cap = {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
           if k in os.environ}
    write_results(args.name, {"precision": precision, "threads": 1, "isa_cap": cap, **out})


if __name__ == "__main__":
    main()
