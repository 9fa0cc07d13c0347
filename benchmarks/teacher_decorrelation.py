"""Can a MiniLM teacher be made to err where the frozen cosine does not? A negative-correlation penalty.

One cross-encoder per penalty weight lambda, on all of STS-B train (the light recipe: one epoch, both pair
orders, length buckets, warmup + decay, clipping), trained on BCE(z, y) + 2 lambda mean((sigmoid(z) - y) e),
where e is the frozen cosine's rank error r(s0) - r(y) on that pair: the penalty rewards erring *against*
the cosine (negative correlation learning, Liu & Yao 1999, with the cosine as the fixed ensemble member).
lambda = 0 is the plain recipe. Per split: the teacher's Spearman, its error correlation with the cosine
and the Spearman of their rank average (embed_lib.teacher.scores.quality_report), the figures issue 10 targets.

    python benchmarks/teacher_decorrelation.py [--lambdas 0,1] [--epochs 1]
-> results/benchmarks/teacher_decorrelation.json
"""
from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch
from sentence_transformers import CrossEncoder

from benchmarks._common import write_results
from embed_lib.data.tasks import SPLITS, load_splits
from embed_lib.encoding.weights import resolve_model
from embed_lib.pipeline.prepare import load_study
from embed_lib.teacher import recipe
from embed_lib.teacher.config import teacher_preset
from embed_lib.teacher.scores import quality_report
from embed_lib.training.signals import rank_normalise


def _pairs(d) -> list[list[str]]:
    return [[a, b] for a, b in zip(d.sentence1, d.sentence2)]


def train_one(pairs: list[list[str]], y: np.ndarray, cosine_error: np.ndarray, lam: float, cfg) -> tuple:
    """A cross-encoder fitted with the penalty (both orders: the reversed pairs carry the same error)."""
    pairs, y, err = pairs + [[b, a] for a, b in pairs], np.tile(y, 2), np.tile(cosine_error, 2)
    torch.manual_seed(cfg.seed)  # the new head's initialisation
    ce = CrossEncoder(resolve_model(cfg.model), num_labels=1, device="cpu", max_length=cfg.max_length)
    g = np.random.default_rng(cfg.seed)
    opt = torch.optim.AdamW(recipe.param_groups(ce.model, cfg.weight_decay), lr=cfg.lr)
    sched = recipe.warmup_then_decay(opt, math.ceil(len(pairs) / cfg.batch_size) * cfg.epochs, cfg.warmup)
    yt, et = torch.as_tensor(y, dtype=torch.float32), torch.as_tensor(err, dtype=torch.float32)
    bce = torch.nn.BCEWithLogitsLoss()
    lengths, t0 = np.array([len(a) + len(b) for a, b in pairs]), time.perf_counter()
    ce.model.train()
    for _ in range(cfg.epochs):
        for idx in recipe.length_batches(lengths, cfg.batch_size, g):
            z = recipe.logits(ce, [pairs[j] for j in idx])
            loss = bce(z, yt[idx]) + 2 * lam * ((torch.sigmoid(z) - yt[idx]) * et[idx]).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ce.model.parameters(), cfg.grad_clip)
            opt.step()
            sched.step()
    ce.model.eval()
    return ce, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lambdas", default="0,1", help="penalty weights, comma-separated (0: the plain recipe)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = teacher_preset("light", epochs=args.epochs)
    data, _ = load_study("stsb", teacher=None)
    splits = load_splits("stsb", SPLITS)
    s0 = {k: data.splits[k].s0 for k in SPLITS}
    y = {k: splits[k].label for k in SPLITS}
    cosine_error = (rank_normalise(s0["train"]) - rank_normalise(y["train"])).astype(np.float32)
    rows = []
    for lam in [float(v) for v in args.lambdas.split(",")]:
        ce, seconds = train_one(_pairs(splits["train"]), y["train"].astype(np.float32), cosine_error, lam, cfg)
        scores = {k: recipe.predict(ce, _pairs(splits[k]), cfg) for k in ("validation", "test")}
        report = quality_report(scores, s0, y)
        rows.append({"lambda": lam, "fit_seconds": round(seconds, 1),
                     **{k: {m: round(v, 4) for m, v in report[k].items()} for k in scores}})
        print(rows[-1], flush=True)
    write_results("teacher_decorrelation", {"task": "stsb", "recipe": f"light, {args.epochs} epoch(s), all of train",
                                            "rows": rows})


if __name__ == "__main__":
    main()
