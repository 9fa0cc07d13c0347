"""Encoding throughput: the project's encoder path vs plain SentenceTransformer.encode, same sentences.

Both run in this process, alternating, on the same STS-B sentences and batch size; the best of
`--rounds` timings each is kept. Target: ratio (ours / stock sentences per second) >= 0.95.
"""
from __future__ import annotations

import argparse
import time

from benchmarks._common import write_results
from embed_lib.config import EncoderConfig
from embed_lib.data.tasks import load_task
from embed_lib.encoding.encoders import FrozenEncoder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--n", type=int, default=2000, help="distinct STS-B sentences (default 2000)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    texts = load_task("stsb", "train").texts()[: args.n]
    enc = FrozenEncoder(EncoderConfig(batch_size=args.batch_size))
    enc.encode(texts[:64])
    enc.model.encode(texts[:64], batch_size=args.batch_size)  # warm-up both paths
    ours, stock = [], []
    for _ in range(args.rounds):
        t = time.perf_counter()
        enc.encode(texts, show_progress=False)
        ours.append(time.perf_counter() - t)
        t = time.perf_counter()
        enc.model.encode(texts, batch_size=args.batch_size, show_progress_bar=False)
        stock.append(time.perf_counter() - t)
    ours_sps, stock_sps = len(texts) / min(ours), len(texts) / min(stock)
    write_results("encode_throughput", {
        "sentences": len(texts), "batch_size": args.batch_size, "rounds": args.rounds,
        "ours_sentences_per_s": round(ours_sps, 1), "stock_sentences_per_s": round(stock_sps, 1),
        "ratio_ours_over_stock": round(ours_sps / stock_sps, 3), "target_ratio": 0.95})


if __name__ == "__main__":
    main()
