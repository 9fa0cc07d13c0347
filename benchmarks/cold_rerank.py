"""Cold requests by their shape: 32 independent pairs against one query with 32 documents, every text new.

serve_bench's cold cell sends 32 pairs of 64 new sentences: per pair the encoder reads two sentences and the
cross-encoder one sequence of both, about the same tokens on models of the same size, so a cold adapter
request cannot be much faster than the cross-encoder. A re-ranking request (one query, 32 candidate
documents) is the other common shape: the service encodes the query once (the scorer deduplicates a
request's texts), 33 sentences for 32 pairs, while the cross-encoder still reads the query 32 times.
This script measures both shapes side by side on one service (the same one serve_bench builds), closed
loop at concurrency 8, cold adapter and cross-encoder alternating, `--runs` times; the figures are the
median over runs with min / max. Texts are made new as in serve_bench (a sentence's words in a seeded new
order, same lengths); both scorers get the same request bodies.

    python benchmarks/cold_rerank.py [--runs 3] [--seconds 6] [--direct-ingress]
                                     [--encoder-backend onnx-int8] [--cross-encoder-backend onnx-int8]

-> results/benchmarks/cold_rerank[_direct_ingress]_enc-<backend>_ce-<backend>.json
Target of issue 12: cold adapter requests (every sentence new, c=8, 32 pairs) >= 2x the cross-encoder.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

from benchmarks._common import write_results
from benchmarks.load import Bodies, run_load
from benchmarks.serve_bench import _register, _serve
from embed_lib.data.tasks import load_task

SHAPES = ("pairs", "rerank")


class RerankBodies(Bodies):
    """One query and `n` documents per request (the query's text repeated in every pair, as a re-ranking
    client sends it through /v1/score); cold: all of them new."""

    def __call__(self, k: int, i: int):
        m = len(self.sentences)
        query = self.sentences[(k * 97 + i * 31) % m]
        docs = [self.sentences[(k * 13 + i * 7 + j + 1) % m] for j in range(self.n)]
        if self.kind == "cold":
            query = self._new(query, f"{k}-{i}-q")
            docs = [self._new(d, f"{k}-{i}-{j}d") for j, d in enumerate(docs)]
        return {"pairs": [[query, d] for d in docs], "scorer": self.scorer}, self.n


def _parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="repetitions of the four cells (default 3)")
    ap.add_argument("--seconds", type=float, default=6.0, help="per cell (default 6)")
    ap.add_argument("--pairs", type=int, default=32, help="pairs (documents) per request (default 32)")
    ap.add_argument("--concurrency", type=int, default=8, help="clients in the closed loop (default 8)")
    ap.add_argument("--direct-ingress", action="store_true", help="load to the ingress replica's own port")
    for side in ("encoder", "cross-encoder"):
        ap.add_argument(f"--{side}-backend", default="onnx-int8", choices=("torch", "onnx", "onnx-int8"),
                        help=f"the {side}'s backend (default onnx-int8, the fastest path of each)")
    return ap.parse_args()


def main() -> None:
    args = _parse_args()
    # lazy: Serve's and Ray's settings are put in the environment before Ray is first imported
    from serving.serve_env import apply_serve_env

    if args.direct_ingress:
        os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] = "1"
    apply_serve_env()
    import ray
    from ray import serve

    tmp = tempfile.mkdtemp()
    tracking = f"sqlite:///{tmp}/mlflow.db"
    _register(tracking, args.encoder_backend)
    sentences = load_task("stsb", "validation").texts()[:2000]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    url = _serve(tmp, tracking, sentences, os.environ.get("BENCH_CROSS_ENCODER", "minilm"), args.direct_ingress,
                 args.cross_encoder_backend, args.pairs) + "/v1/score"
    runs = []
    for run in range(args.runs):
        cells = {}
        for shape in SHAPES:
            make = RerankBodies if shape == "rerank" else Bodies
            for kind, scorer in (("cold", "adapter"), ("cold", "cross_encoder")):
                bodies = make(kind, sentences, args.pairs, scorer, salt=f"r{run}{shape} ")
                res = run_load(url, bodies, args.concurrency, args.seconds)
                cells[f"{shape} {scorer}"] = res
                print(json.dumps({"run": run, "shape": shape, "scorer": scorer, **res}))
        runs.append({**{k: round(v["pairs_per_s"], 1) for k, v in cells.items()},
                     **{f"{s}_adapter_over_cross_encoder": round(cells[f"{s} adapter"]["pairs_per_s"]
                                                                 / cells[f"{s} cross_encoder"]["pairs_per_s"], 2)
                        for s in SHAPES}})
    serve.shutdown()
    ray.shutdown()
    median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    name = "cold_rerank" + ("_direct_ingress" if args.direct_ingress else "")
    write_results(f"{name}_enc-{args.encoder_backend}_ce-{args.cross_encoder_backend}", {
        "encoder_backend": args.encoder_backend, "cross_encoder_backend": args.cross_encoder_backend,
        "concurrency": args.concurrency, "pairs_per_request": args.pairs, "seconds_per_cell": args.seconds,
        "median": median, "min_max": {k: [min(r[k] for r in runs), max(r[k] for r in runs)] for k in median},
        "per_run": runs, "target_cold_over_cross_encoder": 2.0})


if __name__ == "__main__":
    main()
