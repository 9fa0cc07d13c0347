"""The re-ranking check through the served API: the frozen cosine's top-k of a BEIR-Quora-style QQP set
(embed_lib.training.retrieval) sent to `POST /v1/rerank` of a running service (`make serve`), ranked by the
returned relevance scores; nDCG@10 / MRR@10 / Recall@100 beside the frozen cosine and beside the same
adapter ensemble re-ranking in-process (they must agree: the service scores with that ensemble).

    make serve && .venv/bin/python benchmarks/rerank_serve.py   # -> results/benchmarks/rerank_serve.json
"""
from __future__ import annotations

import argparse
import json
import time
import urllib.request

import numpy as np

from benchmarks._common import write_results
from embed_lib.config import EncoderConfig
from embed_lib.data.tasks import load_splits
from embed_lib.pipeline.prepare import LazyEncoder, embed_retrieval_set
from embed_lib.tracking.registry import load_registered
from embed_lib.tracking.runs import default_tracking_uri
from embed_lib.training import retrieval as R


def rerank_http(url: str, query: str, documents: list[str]) -> list[int]:
    body = json.dumps({"query": query, "documents": documents, "top_n": len(documents)}).encode()
    req = urllib.request.Request(f"{url}/v1/rerank", body, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return [r["index"] for r in json.load(resp)["results"]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--task", default="qqp")
    p.add_argument("--split", default="test")
    p.add_argument("--model-uri", default="models:/pair-residual-stsb@champion")
    p.add_argument("--tracking-uri", default=None)
    p.add_argument("--top-k", type=int, default=100)
    p.add_argument("--queries", type=int, default=None, help="first N queries (default all)")
    args = p.parse_args()

    split = load_splits(args.task, (args.split,))[args.split]
    rs, V = embed_retrieval_set(split, LazyEncoder(EncoderConfig()))
    queries, relevant = rs.queries[: args.queries], rs.relevant[: args.queries]
    top = R.cosine_top_k(V, queries, args.top_k)
    q, k = top.shape
    model, _, _ = load_registered(args.model_uri, args.tracking_uri or default_tracking_uri())
    in_process = R.order_by(top, R.seed_scores(model, V, queries, top).mean(0))  # the served ensemble
    t0, served = time.perf_counter(), []
    for qi, cand in zip(queries, top):
        order = rerank_http(args.url, rs.texts[qi], [rs.texts[d] for d in cand])
        served.append(cand[order])
    seconds = time.perf_counter() - t0
    base, local, http = (R.ranking_metrics(r, relevant) for r in (top, in_process, np.array(served)))
    agree = float(np.mean([list(a[:10]) == list(b[:10]) for a, b in zip(in_process, served)]))
    write_results("rerank_serve", {
        "task": args.task, "split": args.split, "model_uri": args.model_uri, "queries": int(q), "top_k": int(k),
        "frozen_cosine": base, "in_process_ensemble": local, "through_v1_rerank": http,
        "delta_v1_rerank_vs_cosine": {m: http[m] - base[m] for m in base},
        "top10_identical_to_in_process": agree, "seconds": round(seconds, 1),
        "requests_per_s": round(q / seconds, 1)})


if __name__ == "__main__":
    main()
