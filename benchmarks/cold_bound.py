"""What a cold pair costs against a cross-encoder pair in compute alone: the bound on the cold-request target.

A cold request (every sentence new) makes the frozen encoder read both sentences of each pair; the
cross-encoder reads each pair once as one sequence (a served teacher trained on both orders reads it
twice and averages). Both models are MiniLM-L6 transformers, so per token they cost the same: the ratio
of cold adapter pairs/s to cross-encoder pairs/s that any service can reach is bounded by these compute
costs, whatever the serving path adds. This script measures them in-process, no Serve, on the same
pairs, in calls shaped like the service's (32 pairs a call: 64 sentences for the encoder), the models
timed back to back in each of `--repeats` rounds, the median of the per-round ratios kept:

    python benchmarks/cold_bound.py [--backend onnx-int8] [--threads 2] [--repeats 5] [--cross-encoder minilm]

-> results/benchmarks/cold_bound_<backend>.json: pairs/s of the encoder (two sentences per pair), of the
cross-encoder on one order and on both, and their ratios: the upper bound of the served cold ratio
(target >= 2x the served cross-encoder) against a one-order and a both-orders cross-encoder.
The cross-encoder's head weights do not change its cost: MiniLM with an untrained head (the default
`minilm`) costs what a trained teacher of the same backbone costs.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks._common import write_results
from embed_lib.config import EncoderConfig
from embed_lib.data.tasks import load_task
from embed_lib.encoding.encoders import FrozenEncoder
from embed_lib.teacher.cross_encoder import PairCrossEncoder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="onnx-int8", choices=("torch", "onnx", "onnx-int8"),
                    help="backend of both models (default onnx-int8, the fastest the project has)")
    ap.add_argument("--threads", type=int, default=2, help="compute threads of each model (default 2: the machine)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--pairs", type=int, default=1024, help="STS-B test pairs timed per round (default 1024)")
    ap.add_argument("--cross-encoder", default="minilm", help="cross-encoder id or folder (default minilm)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    test = load_task("stsb", "test")
    pairs = list(zip(test.sentence1, test.sentence2))[: args.pairs]
    calls = [pairs[i: i + 32] for i in range(0, len(pairs), 32)]  # one call per request of 32 pairs
    encoder = FrozenEncoder(EncoderConfig(backend=args.backend))
    ce = PairCrossEncoder(args.cross_encoder, backend=args.backend, threads=args.threads)

    def cold(chunks) -> None:  # every sentence new: both sentences of every pair, no sharing across pairs
        for call in chunks:
            encoder.encode([t for p in call for t in p], show_progress=False)

    def one_order(chunks) -> None:
        for call in chunks:
            ce._logits_one_order([list(p) for p in call])

    def both_orders(chunks) -> None:
        for call in chunks:
            ce._logits_one_order([list(p) for p in call])
            ce._logits_one_order([[b, a] for a, b in call])

    runs = {"encoder_cold_pairs": cold, "cross_encoder_one_order": one_order, "cross_encoder_both_orders": both_orders}
    for fn in runs.values():  # warm-up: graph load, allocator
        fn(calls[:1])
    seconds: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.repeats):  # interleaved: a drift in the machine's speed touches all three alike
        for name, fn in runs.items():
            t = time.perf_counter()
            fn(calls)
            seconds[name].append(time.perf_counter() - t)
    rate = {k: round(len(pairs) / statistics.median(v), 1) for k, v in seconds.items()}
    # per round (the three timed back to back), then the median: the machine's drift between rounds cancels
    bound = {name: statistics.median(t_ce / t_enc for t_enc, t_ce in zip(seconds["encoder_cold_pairs"], seconds[name]))
             for name in ("cross_encoder_one_order", "cross_encoder_both_orders")}
    out = {"backend": args.backend, "threads": args.threads, "repeats": args.repeats, "pairs": len(pairs),
           "cross_encoder": args.cross_encoder, "pairs_per_s": rate,
           "pairs_per_s_by_round": {k: [round(len(pairs) / s, 1) for s in v] for k, v in seconds.items()},
           "cold_bound_over_one_order_cross_encoder": round(bound["cross_encoder_one_order"], 2),
           "cold_bound_over_both_orders_cross_encoder": round(bound["cross_encoder_both_orders"], 2),
           "target_cold_over_cross_encoder": 2.0}
    print(out)
    write_results(f"cold_bound_{args.backend}", out)


if __name__ == "__main__":
    main()
