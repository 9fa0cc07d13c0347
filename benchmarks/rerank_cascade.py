"""Re-ranking through the cascade (the service's `rerank_budget`): what routing a fraction of each re-ranking
request's documents to the cross-encoder does to a duplicate-question retrieval set, beside the adapter alone and the
cross-encoder alone.

The service re-ranks a request (a query and its documents) by the adapter; with the app's `rerank_budget` b it sends
the fraction b of the request's documents its gate rates hardest to the cross-encoder (under the app's familiarity
floor: a request whose mean novelty-gate weight is under it routes nothing), seeded by the request's pairs, and
orders the documents by the scores as mixed. Here each query of a BEIR-Quora-style retrieval set built from
`--split` of each task (embed_lib.training.retrieval: queries are the first questions of its duplicate pairs, the
corpus every distinct question) is one such request: its frozen-cosine top `--top-k` candidates as the documents
(the first `--queries` queries). For each, nDCG@10 and MRR@10 of: the frozen cosine, the adapter alone (the seeds'
mean, ordered as the endpoints order it: serving.scorer.best_first), the cascade at `--budget` under each floor of
`--floors` (the app's default first), and the cross-encoder re-ranking every candidate; with the requests routed and
the documents routed.

    python benchmarks/rerank_cascade.py [--model-uri models:/pair-residual-stsb@champion]
        [--cross-encoder models:/cross-encoder-stsb@current] [--cross-encoder-backend onnx-int8]
        [--tasks qqp,mrpc] [--split validation] [--queries 500] [--top-k 30] [--budget 0.1] [--floors 0.02,0]
        [--name rerank_cascade]

-> results/benchmarks/<name>.json. Needs `make run` (the champion) and `make teacher` (the registered cross-encoder)
in the MLflow store of $MLFLOW_TRACKING_URI or ./mlflow.db.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks._common import add_champion_args, champion_and_cross_encoder, write_results
from embed_lib.config import default_cache_dir
from embed_lib.data.tasks import load_task
from embed_lib.encoding.cache import EmbeddingCache, encoder_for
from embed_lib.teacher.cross_encoder import PairCrossEncoder
from embed_lib.training.cascade import FAMILIARITY_FLOOR, default_policy, mix, pairs_seed, route
from embed_lib.training.export import as_served, ensemble_scores
from embed_lib.training import retrieval as R
from embed_lib.training.retrieval import build_retrieval_set, cosine_top_k, order_by
from serving.scorer import best_first


def ranking_metrics(ranked: np.ndarray, relevant: list[set[int]]) -> dict[str, float]:
    """nDCG@10 and MRR@10 (recall over the candidates does not move with their order)."""
    return {m: v for m, v in R.ranking_metrics(ranked, relevant).items() if m != "recall@100"}


def served_order(top: np.ndarray, unclipped: np.ndarray) -> np.ndarray:
    """(q, k) candidates in the order the re-ranking endpoints answer them: by the score as served (clipped to
    [-1, 1]), the ties of the clip by the score before it, then by position (serving.scorer.best_first)."""
    return np.stack([row[best_first(as_served(s), s)] for row, s in zip(top, unclipped)])


def task_figures(task: str, split_name: str, model, manifest, ce: PairCrossEncoder, args: argparse.Namespace,
                 floors: list[float]) -> dict:
    split = load_task(task, split_name)
    rs = build_retrieval_set(split.sentence1, split.sentence2, split.label)
    V = EmbeddingCache(manifest, default_cache_dir()).get(rs.texts, lambda: encoder_for(manifest))
    queries, relevant = rs.queries[: args.queries], rs.relevant[: args.queries]
    top = cosine_top_k(V, queries, args.top_k)  # (q, k): each query's documents, as a request of k
    q, k = top.shape
    qs, ds = np.repeat(queries, k), top.reshape(-1)
    out = ensemble_scores(model, V[qs], V[ds])
    adapter = out["score"].astype(np.float64).reshape(q, k)  # before the clip: served_order clips
    pairs = [(rs.texts[a], rs.texts[b]) for a, b in zip(qs, ds)]
    t0 = time.perf_counter()
    ce_scores = np.asarray(ce.score(pairs), dtype=np.float64).reshape(q, k)
    ce_s = time.perf_counter() - t0
    routing = default_policy(model.form)
    metrics = {"frozen_cosine": ranking_metrics(top, relevant),
               "adapter": ranking_metrics(served_order(top, adapter), relevant),
               "cross_encoder": ranking_metrics(order_by(top, ce_scores), relevant)}
    per_floor = {}
    for f in floors:
        mixed, routed, requests = adapter.copy(), 0, 0
        for i in range(q):
            rows = slice(i * k, (i + 1) * k)
            r = route(args.budget, routing, difficulty=out["difficulty"][rows], baseline=out["baseline"][rows],
                      middle=ce.middle, seed=pairs_seed(pairs[rows]), novelty=out["novelty"][rows],
                      familiarity_floor=f)
            mixed[i] = mix(adapter[i], ce_scores[i], r)
            routed, requests = routed + len(r), requests + bool(len(r))
        per_floor[f"{f:g}"] = {"metrics": ranking_metrics(served_order(top, mixed), relevant),
                               "documents_routed": routed, "requests_routed": requests}
    base = metrics["frozen_cosine"]
    deltas = {name: {m: v[m] - base[m] for m in base} for name, v in
              {**metrics, **{f"cascade_floor_{f}": p["metrics"] for f, p in per_floor.items()}}.items()}
    return {"queries": int(q), "top_k": int(k), "corpus": len(rs.texts), "split_note": split.split_note,
            "routing": routing, "novelty_weight_mean": float(out["novelty"].mean()), "metrics": metrics,
            "cascade": per_floor, "delta_over_frozen_cosine": deltas,
            "cross_encoder_pairs_per_s": round(len(pairs) / ce_s, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_champion_args(ap, backend="onnx-int8")
    ap.add_argument("--tasks", default="qqp,mrpc", help="binary duplicate tasks (a retrieval set each)")
    ap.add_argument("--split", default="validation")
    ap.add_argument("--queries", type=int, default=500, help="the first N queries of each retrieval set")
    ap.add_argument("--top-k", type=int, default=30, help="documents per request: the frozen cosine's top k")
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--floors", default=f"{FAMILIARITY_FLOOR:g},0", help="familiarity floors (the app's default "
                    "first)")
    ap.add_argument("--name", default="rerank_cascade")
    args = ap.parse_args()
    t0 = time.perf_counter()
    floors = [float(f) for f in args.floors.split(",")]
    model, config, manifest, version, ce = champion_and_cross_encoder(args)
    tasks = {}
    for task in args.tasks.split(","):
        tasks[task] = task_figures(task, args.split, model, manifest, ce, args, floors)
        print(task, {n: round(d["ndcg@10"], 4) for n, d in tasks[task]["delta_over_frozen_cosine"].items()},
              {f: (p["requests_routed"], p["documents_routed"]) for f, p in tasks[task]["cascade"].items()},
              flush=True)
    write_results(args.name, {
        "model_uri": args.model_uri, "model_version": version, "trained_on": config.task,
        "cross_encoder": args.cross_encoder, "cross_encoder_backend": args.cross_encoder_backend,
        "split": args.split, "budget": args.budget, "floors": floors, "tasks": tasks,
        "seconds": round(time.perf_counter() - t0, 1)})


if __name__ == "__main__":
    main()
