"""Batches of similar length against fixed chunks, side by side, for both transformers (embed_lib.encoding.batching).

Calls of the sizes a service makes: a cascade sends the cross-encoder a few pairs of each request (3 of 32 at
b = 0.1, ~26 once Serve batches 8 requests), a cold request brings the encoder a few dozen new sentences, a
cross-encoder alone gets 256 pairs at c=8 x 32. For each size, calls of random STS-B test pairs (the encoder:
their sentences), the same calls through both batchings, alternating, `--rounds` times; one thread (what each
of a replica's batches in flight gets). Outputs are compared too: batching must not change them.

    python benchmarks/batching.py [--backend onnx-int8] [--seconds 3] [--rounds 3]

-> results/benchmarks/batching.json: per model and call size, items/s with fixed chunks (the longest-first
order cut every batch_size items) and with length batches, their ratio (median over rounds), the largest
output difference. The cross-encoder is the served STS-B teacher when `make teacher` has made it, else a
MiniLM cross-encoder with an untrained head (speed is the same architecture's).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from benchmarks._common import write_results
from benchmarks.backends import _served_teacher_dir
from embed_lib.config import EncoderConfig
from embed_lib.data.tasks import load_task
from embed_lib.encoding.batching import SLACK
from embed_lib.encoding.encoders import FrozenEncoder
from embed_lib.teacher.cross_encoder import PairCrossEncoder

SIZES = (3, 26, 64, 256)


def _rate(fn, calls: list, seconds: float) -> float:
    n, t, i = 0, time.perf_counter(), 0
    while time.perf_counter() - t < seconds:
        call = calls[i % len(calls)]
        fn(call)
        n, i = n + len(call), i + 1
    return n / (time.perf_counter() - t)


def _difference(a: np.ndarray, b: np.ndarray) -> dict:
    """How far the two batchings' outputs are apart: the largest logit difference (cross-encoder), the smallest
    cosine between the vectors (encoder; int8 quantises activations per batch, so its vectors move a little with
    what they are batched with, whichever batching)."""
    if a.ndim == 1:
        return {"max_abs_logit_difference": round(float(np.abs(a - b).max()), 5)}
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    return {"min_cosine": round(float(cos.min()), 5)}


def _compare(name: str, model, run, calls_by_size: dict, seconds: float, rounds: int) -> dict:
    rows = {}
    for size, calls in calls_by_size.items():
        per = {"fixed": [], "length": []}
        for _ in range(rounds):
            for kind, slack in (("fixed", float("inf")), ("length", SLACK)):
                model.slack = slack
                per[kind].append(_rate(run, calls, seconds))
        model.slack = float("inf")
        a = run(calls[0])
        model.slack = SLACK
        b = run(calls[0])
        rows[size] = {"fixed_per_s": round(statistics.median(per["fixed"]), 1),
                      "length_per_s": round(statistics.median(per["length"]), 1),
                      "ratio": round(statistics.median(l / f for l, f in zip(per["length"], per["fixed"])), 2),
                      "ratios_by_round": [round(l / f, 2) for l, f in zip(per["length"], per["fixed"])],
                      **_difference(np.asarray(a), np.asarray(b))}
        print(name, size, rows[size], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="onnx-int8", choices=("torch", "onnx", "onnx-int8"))
    ap.add_argument("--seconds", type=float, default=3.0, help="per measurement (default 3)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    torch.set_num_threads(1)
    test = load_task("stsb", "test")
    pairs = list(zip(test.sentence1, test.sentence2))
    rng = np.random.default_rng(0)
    calls = {n: [[pairs[i] for i in rng.choice(len(pairs), n, replace=False)] for _ in range(64)] for n in SIZES}
    ce_path = _served_teacher_dir() or "minilm"
    ce = PairCrossEncoder(ce_path, backend=args.backend, threads=1)
    cross = _compare("cross-encoder", ce, ce.logits, calls, args.seconds, args.rounds)
    enc = FrozenEncoder(EncoderConfig(backend=args.backend, batch_size=64))
    texts = {n: [[t for p in c for t in p] for c in cs] for n, cs in calls.items() if 2 * n <= 128}
    encoder = _compare("encoder", enc, lambda t: enc.encode(t, show_progress=False), texts, args.seconds,
                       args.rounds)
    write_results("batching", {
        "backend": args.backend, "threads": 1, "slack": SLACK, "seconds": args.seconds, "rounds": args.rounds,
        "cross_encoder": {"model": ce_path, "batch_size": ce.batch_size, "pairs_per_call": cross},
        "encoder": {"model": enc.config.model, "batch_size": enc.config.batch_size,
                    "sentences_per_call (2 x pairs)": {2 * n: r for n, r in encoder.items()}}})


if __name__ == "__main__":
    main()
