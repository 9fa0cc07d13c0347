"""Quality through the served API, measured as a client with its own labelled pairs would measure it.

Pairs of held-out splits go to `POST /v1/score` of a running service (`make serve`); Spearman of the
returned `score` and of the returned `baseline` (the frozen cosine, in the same responses) against the
gold labels, and their difference. Default sets: STS-B test (the champion's own task) and the validation
splits of MRPC, QQP and PAWS, whole (the sweep's transfer checks read only their pairs that share no
sentence with STS-B train; a client's data would not be filtered either).

    make serve && .venv/bin/python benchmarks/score_serve.py   # -> results/benchmarks/score_serve.json
"""
from __future__ import annotations

import argparse
import json
import time
import urllib.request

import numpy as np
from scipy import stats

from benchmarks._common import write_results
from embed_lib.data.tasks import load_splits


def score_http(url: str, pairs: list[tuple[str, str]], chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores, baselines) of the pairs from /v1/score, `chunk` pairs per request."""
    scores, baselines = [], []
    for i in range(0, len(pairs), chunk):
        body = json.dumps({"pairs": [list(p) for p in pairs[i: i + chunk]]}).encode()
        req = urllib.request.Request(f"{url}/v1/score", body, {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as resp:
            rows = sorted(json.load(resp)["data"], key=lambda r: r["index"])
        scores += [r["score"] for r in rows]
        baselines += [r["baseline"] for r in rows]
    return np.array(scores), np.array(baselines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--sets", default="stsb:test,mrpc:validation,qqp:validation,paws:validation",
                   help="comma list of task:split (default: %(default)s)")
    p.add_argument("--chunk", type=int, default=128, help="pairs per request (at most the service's max_pairs)")
    args = p.parse_args()
    rows = {}
    for item in args.sets.split(","):
        task, split = item.split(":")
        data = load_splits(task, (split,))[split]
        t0 = time.perf_counter()
        scores, baselines = score_http(args.url, list(zip(data.sentence1, data.sentence2)), args.chunk)
        served, frozen = (float(stats.spearmanr(x, data.label).statistic) for x in (scores, baselines))
        rows[item] = {"pairs": len(data), "spearman_served": served, "spearman_frozen_cosine": frozen,
                      "delta": served - frozen, "seconds": round(time.perf_counter() - t0, 1)}
        print(item, json.dumps(rows[item]), flush=True)
    write_results("score_serve", {"url": args.url, "sets": rows})


if __name__ == "__main__":
    main()
