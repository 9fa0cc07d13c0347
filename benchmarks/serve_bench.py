"""Serving benchmark: closed-loop load from a second process on loopback, bounded in time.

Starts its own Ray (2 CPUs, the Serve settings of cluster/serve.env) and Serve on 127.0.0.1, registers a small STS-B
adapter in a temporary MLflow store, and measures pairs/s, p50/p99 latency and the ingress replicas' CPU per request
at concurrency 1, 8, 32 with 1, 32 and 128 pairs per request for (a) the adapter with a warm embedding cache, (b) cold
(every sentence new: a corpus sentence's words in a new seeded order), (c) a cross-encoder served the same way; the
adapter and the cross-encoder in-process, one thread each; and the cascade at b = 0.1 (routed by the gate's
difficulty) at c=8 x 32 pairs. Targets on 2 cores (default topology, int8 both, c=8 x 32): warm adapter >= 25x the
fastest cross-encoder path, p99 <= 25 ms, the cascade at b = 0.1 >= 5x, no failed request. `--runs 3`: every cell
three times on the same service, headline figures the median over the runs (each run's and min / max kept).
`--cells c8x32`: only the targets' cells. `--placements ingress,deployment`: the cross-encoder in the ingress (the
default) and in a deployment, one application each, in alternation, the first the headline (the cascade also
against the faster cross-encoder cell).

Topologies: the default is cluster/serve.env's, Ray Serve's HAProxy ingress: HAProxy answers on the Serve port and
forwards each request to an ingress replica's own HTTP port; `--with-proxy` measures Serve's Python proxy too, after
it in the same run, on a new Ray (its figures under `proxy_same_run`); `--proxy`: the proxy alone; `--direct-ingress`:
the load straight to the ingress replica's own port (no hop at all).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import mlflow
import numpy as np
import requests
from sentence_transformers import CrossEncoder

from benchmarks._common import write_results
from benchmarks.load import Bodies, direct_ingress_port, one_thread_pairs_per_s, run_load
from embed_lib.config import AdapterConfig, EncoderConfig
from embed_lib.data.tasks import load_task
from embed_lib.encoding.weights import resolve_model
from embed_lib.pipeline.prepare import load_study
from embed_lib.tracking.registry import evidence_of, load_registered, log_adapter_model, promote
from embed_lib.tracking.runs import set_experiment
from embed_lib.training.seed_group import train_seed_group
from serving.scorer import PairScorer
from serving.serve_env import free_port

#: the cascade cell's cross-encoder budget (the target: the cascade at b = 0.1 >= 5x the cross-encoder's pairs/s)
CASCADE_BUDGET = 0.1


def _parse_args():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=6.0, help="per measurement (default 6)")
    ap.add_argument("--quick", action="store_true", help="fewer cells (c=1,8)")
    ap.add_argument("--pairs", default="1,32,128", help="pairs per request of the cells (default 1,32,128)")
    ap.add_argument("--runs", type=int, default=1, help="measure every cell this many times, one run after another "
                    "on the same service (default 1); the results give each run's ratio and their median, min, max")
    ap.add_argument("--direct-ingress", action="store_true", help="Ray Serve's direct ingress: the load goes to the "
                    "ingress replica's own HTTP port (no proxy hop), as a load balancer in front of the replicas would")
    ap.add_argument("--proxy", action="store_true",
                    help="Serve's Python proxy instead of the default HAProxy ingress (RAY_SERVE_ENABLE_HA_PROXY=0)")
    ap.add_argument("--with-proxy", action="store_true", help="after the default topology, the same cells through "
                    "Serve's Python proxy in the same run (a new Ray), written beside its figures as proxy_same_run")
    ap.add_argument("--name", default=None,
                    help="the results file's name (default: serve_bench plus the topology and the options)")
    ap.add_argument("--ingress-replicas", type=int, default=1, help="ingress replicas (default 1; serving/config.yaml "
                    "lets Serve scale to 2): each holds the adapter and its near cache, warmed from the corpus")
    ap.add_argument("--encoder-backend", default="torch", choices=("torch", "onnx", "onnx-int8"), help="the encoder's "
                    "backend: the adapter is trained on its vectors and the service encodes with it (cold requests)")
    ap.add_argument("--cross-encoder-backend", default="torch", choices=("torch", "onnx", "onnx-int8"),
                    help="the served cross-encoder's backend")
    ap.add_argument("--placements", default="ingress", help="where the cross-encoder runs, comma-separated (ingress, "
                    "deployment): one application each on the same Serve, in alternation; the first gives the "
                    "headline (default: ingress, the app's)")
    ap.add_argument("--cells", default="all", choices=("all", "c8x32"),
                    help="all cells (default), or only concurrency 8 with 32 pairs per request (the targets' cells)")
    return ap.parse_args()


def _register(tracking: str, encoder_backend: str = "torch"):
    """A pair-gated adapter trained on STS-B, registered as the champion; returns the study data."""
    set_experiment("serve-bench", tracking)  # a new store: artifacts beside it, never in ./mlruns
    data, _ = load_study("stsb", EncoderConfig(backend=encoder_backend))
    result = train_seed_group(AdapterConfig(adapter="pair_gated", target="lexical", epochs=3), data)
    with mlflow.start_run():
        info = log_adapter_model(result, data, registered_name="pair-residual-stsb")
    promote("pair-residual-stsb", info.registered_model_version, evidence_of(result, data))
    return data


def _in_process(dim: int, sentences: list[str], cross_encoder: str) -> tuple[float, float]:
    """Pairs/s on one thread, no Serve or HTTP: the ingress replica's warm scoring (PairScorer), the cross-encoder."""
    scorer = PairScorer(load_registered("models:/pair-residual-stsb@champion")[0], {"name": "pair-residual-stsb"})
    vectors = dict(zip(sentences[:64], np.random.default_rng(0).standard_normal((64, dim)).astype(np.float32)))
    pairs = [(sentences[2 * j], sentences[2 * j + 1]) for j in range(32)]  # vectors and projections cached
    adapter = one_thread_pairs_per_s(lambda: scorer.score_vectors(pairs, vectors), 2.0)
    ce = CrossEncoder(resolve_model(cross_encoder), device="cpu")
    ce_pairs = [[sentences[j], sentences[j + 1]] for j in range(32)]
    return adapter, one_thread_pairs_per_s(lambda: ce.predict(ce_pairs, batch_size=32, show_progress_bar=False), 4.0)


_SERVE_PORT: dict[str, int] = {}  # this process's Serve port: a free one (not a fixed 8123), the same for every app


def _serve(tmp: str, tracking: str, sentences: list[str], cross_encoder: str, direct_ingress: bool,
           cross_encoder_backend: str = "torch", max_pairs: int = 64, ingress_replicas: int = 1,
           placement: str = "ingress", name: str = "bench", share: float = 1.0) -> str:
    """The service on a Ray of its own, caches warm; returns the base URL the load goes to. `share` scales the
    replicas' CPU shares (a scheduling figure: each computes on one thread) so two apps fit the 2-CPU node."""
    # lazy: Serve's and Ray's settings are put in the environment before Ray is first imported
    from ray import serve

    from serving.app import build_app

    port = _SERVE_PORT.get("port") or _SERVE_PORT.setdefault("port", free_port())  # one bind, on the first call
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    corpus = os.path.join(tmp, "corpus.txt")
    with open(corpus, "w") as fh:
        fh.write("\n".join(sentences))
    # one encoder replica; the ingress replicas as asked, sharing half a CPU (each warms its near cache at start)
    n, prefix = ingress_replicas, "/" if name == "bench" else f"/{name}"
    serve.run(build_app({"model_uri": "models:/pair-residual-stsb@champion", "tracking_uri": tracking,
                         "cross_encoder": cross_encoder, "cross_encoder_backend": cross_encoder_backend,
                         "cross_encoder_placement": placement, "warm_corpus": corpus,
                         "encoder": {"min": 1, "max": 1, "num_cpus": 0.5 * share},
                         "ingress": {"min": n, "max": n, "num_cpus": 0.5 * share / n},
                         "max_inflight": 256, "max_pairs": max_pairs}), name=name, route_prefix=prefix)
    base = f"http://127.0.0.1:{port}{prefix.rstrip('/')}"
    if direct_ingress:  # the replica's own port, under the application's route prefix as on the proxy's
        base = f"http://127.0.0.1:{direct_ingress_port(name)}{prefix.rstrip('/')}"
    for i in range(0, len(sentences), 1000):  # the ingress replica's near cache too (max_warm_sync per call)
        requests.post(f"{base}/v1/warm", json={"texts": sentences[i: i + 1000]}, timeout=600)
    return base


def main() -> None:
    args = _parse_args()
    # lazy: Serve's and Ray's settings are put in the environment before Ray is first imported
    from serving.serve_env import apply_serve_env, ingress

    if sum([args.direct_ingress, args.proxy, args.with_proxy]) > 1:
        raise SystemExit("--direct-ingress, --proxy and --with-proxy are three topologies: choose one")
    if args.direct_ingress:
        os.environ.update(RAY_SERVE_ENABLE_DIRECT_INGRESS="1", RAY_SERVE_ENABLE_HA_PROXY="0")
    if args.proxy:
        os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "0"
    tmp = tempfile.mkdtemp()
    settings = apply_serve_env(haproxy_dir=os.path.join(tmp, "haproxy"))  # before ray.init: its processes inherit them
    tracking = f"sqlite:///{tmp}/mlflow.db"
    data = _register(tracking, args.encoder_backend)
    sentences = load_task("stsb", "validation").texts()[:2000]
    cross_encoder = os.environ.get("BENCH_CROSS_ENCODER", "minilm")
    in_process, in_process_ce = _in_process(data.X.shape[1], sentences, cross_encoder)
    placements = args.placements.split(",")
    topologies = {ingress(): (settings, _measure(args, tmp, tracking, sentences, cross_encoder, placements))}
    if args.with_proxy:  # the same cells through Serve's Python proxy, on a new Ray
        os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "0"
        topologies["proxy"] = ({**settings, "RAY_SERVE_ENABLE_HA_PROXY": "0"},
                               _measure(args, tmp, tracking, sentences, cross_encoder, placements))
    _write(args, topologies, in_process, in_process_ce, placements)


def _measure(args, tmp: str, tracking: str, sentences: list[str], cross_encoder: str, placements: list[str]) -> list:
    """On a Ray of its own with the environment's Serve settings: the service, then every run's rows."""
    import ray
    from ray import serve

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    sizes = [int(p) for p in args.pairs.split(",")]
    apps = {pl: "bench" if len(placements) == 1 else f"ce-{pl}" for pl in placements}
    urls = {pl: _serve(tmp, tracking, sentences, cross_encoder, args.direct_ingress, args.cross_encoder_backend,
                       max(sizes), args.ingress_replicas, pl, apps[pl], 1.0 / len(placements)) + "/v1/score"
            for pl in placements}
    cells = ([(8, 32)] if args.cells == "c8x32" else
             [(c, p) for c in ((1, 8) if args.quick else (1, 8, 32)) for p in sizes])
    runs = []
    for run in range(max(1, args.runs)):
        rows = []
        for kind, scorer in (("warm", "adapter"), ("cold", "adapter"), ("warm", "cross_encoder")):
            for c, p in cells:
                for pl in placements:  # alternating: the same cell of each placement, one after the other
                    res = run_load(urls[pl], Bodies(kind, sentences, p, scorer, salt=f"r{run}c{c}p{p}{pl} "), c,
                                   args.seconds, cpu_of=apps[pl])
                    rows.append(_row(run, f"{kind} {scorer}", c, p, res, pl))
        # the cascade at b = 0.1 (routed by the gate's difficulty), in the cell of the target
        for pl in placements:
            res = run_load(urls[pl], Bodies("warm", sentences, 32, salt=f"r{run}{pl} ", budget=CASCADE_BUDGET), 8,
                           args.seconds, cpu_of=apps[pl])
            rows.append(_row(run, f"cascade b={CASCADE_BUDGET}", 8, 32, res, pl))
        runs.append(rows)
    serve.shutdown()
    ray.shutdown()
    return runs


def _row(run: int, path: str, concurrency: int, pairs: int, res: dict, placement: str = "ingress") -> dict:
    """One cell's row (floats rounded), printed as it is measured."""
    row = {"path": path, "cross_encoder_placement": placement, "concurrency": concurrency, "pairs_per_request": pairs,
           **{k: (round(v, 2) if isinstance(v, float) else v) for k, v in res.items()}}
    print(json.dumps({"run": run, **row}), flush=True)
    return row


def _figures(rows) -> dict:
    """One run's headline figures: best warm adapter and cross-encoder pairs/s (over all cells, and over the
    cells of 32 pairs or fewer), their ratios, the cold and p99 figures at concurrency 8 with 32 pairs per request."""
    def best(path, most=10**9):
        return max(r["pairs_per_s"] for r in rows if r["path"] == path and r["pairs_per_request"] <= most)

    def cell(path):  # concurrency 8, 32 pairs per request
        return next((r for r in rows if r["path"] == path and r["concurrency"] == 8 and r["pairs_per_request"] == 32),
                    None)

    warm, ce = best("warm adapter"), best("warm cross_encoder")
    cold, ce8, warm8 = cell("cold adapter"), cell("warm cross_encoder"), cell("warm adapter")
    cascade = cell(f"cascade b={CASCADE_BUDGET}")
    return {"best_warm_adapter_pairs_per_s": warm, "best_cross_encoder_pairs_per_s": ce,
            "warm_over_cross_encoder": round(warm / ce, 1),
            "warm_over_cross_encoder_up_to_32_pairs": round(best("warm adapter", 32) / best("warm cross_encoder", 32), 1),
            "cold_c8_32pairs_over_cross_encoder_c8_32pairs": cold and ce8 and round(cold["pairs_per_s"] / ce8["pairs_per_s"], 2),
            "p99_ms_c8_32pairs_warm": warm8 and warm8["p99_ms"],
            # the CPU the ingress replica spent per request in that cell: a slow sitting shows here first
            "ingress_cpu_ms_per_request_c8_32pairs_warm": warm8 and warm8.get("ingress_cpu_ms_per_request"),
            # the cascade against the cross-encoder alone in the same cell (c=8 x 32 pairs)
            "cascade_c8_32pairs_over_cross_encoder_c8_32pairs": cascade and ce8 and round(
                cascade["pairs_per_s"] / ce8["pairs_per_s"], 2),
            # its ceiling from the same run's cells: a request costs its pairs on the warm path plus a fraction b on
            # the cross-encoder, so the ratio to the cross-encoder <= 1 / (b + ce / warm) (8x at b = 0.1 needs 40x)
            "cascade_additive_bound_over_cross_encoder": cascade and ce8 and warm8 and round(
                1 / (CASCADE_BUDGET + ce8["pairs_per_s"] / warm8["pairs_per_s"]), 2)}


def _summary(per_run: list[dict]) -> dict:
    """The median over runs of every headline figure (one run: that run), each run's, and their min / max."""
    median = {k: statistics.median(f[k] for f in per_run) for k in per_run[0] if per_run[0][k] is not None}
    spread = {k: [min(f[k] for f in per_run), max(f[k] for f in per_run)] for k in median}
    return {**median, "per_run": per_run, "min_max_over_runs": spread}


def _by_placement(runs, placements: list[str]) -> dict:
    """Each placement's figures; and, per run, each placement's cascade against the faster of the placements'
    cross-encoder-alone cells (the fastest cross-encoder path the service has)."""
    out = {pl: _summary([_figures([r for r in rows if r["cross_encoder_placement"] == pl]) for rows in runs])
           for pl in placements}
    key = f"cascade b={CASCADE_BUDGET}"
    for pl in placements:
        ratios = []
        for rows in runs:
            c8 = {(r["path"], r["cross_encoder_placement"]): r["pairs_per_s"] for r in rows
                  if r["concurrency"] == 8 and r["pairs_per_request"] == 32}
            ratios.append(round(c8[(key, pl)] / max(c8[("warm cross_encoder", q)] for q in placements), 2))
        out[pl]["cascade_c8_32pairs_over_fastest_cross_encoder_c8_32pairs"] = {
            "median": statistics.median(ratios), "per_run": ratios}
    return out


TOPOLOGY = {"haproxy": "Serve's HAProxy ingress -> ingress replica's own port", "proxy": "Serve's Python HTTP proxy -> "
            "ingress replica", "direct": "direct ingress (load to the ingress replica's own port)"}


def _write(args, topologies: dict, in_process: float, in_process_ce: float, placements: list[str]) -> None:
    """The first topology's figures as the headline; a second one (--with-proxy) beside them, same layout."""
    (first, (settings, runs)), *rest = topologies.items()
    backends = args.encoder_backend, args.cross_encoder_backend
    name = args.name or "serve_bench" + "".join([
        {"haproxy": "_haproxy", "proxy": "", "direct": "_direct_ingress"}[first],
        "_enc-{}_ce-{}".format(*backends) * (backends != ("torch", "torch")),
        f"_ingress-{args.ingress_replicas}" * (args.ingress_replicas != 1),
        ("_ce-in-" + "-".join(placements)) * (placements != ["ingress"]), f"_{args.cells}" * (args.cells != "all")])
    out = {"encoder_backend": args.encoder_backend, "cross_encoder_backend": args.cross_encoder_backend,
           "seconds_per_cell": args.seconds, "ingress_replicas": args.ingress_replicas, "cells": args.cells,
           "cross_encoder_placements": placements, "in_process_adapter_pairs_per_s": round(in_process, 1),
           "in_process_cross_encoder_pairs_per_s": round(in_process_ce, 1),
           "in_process_ratio": round(in_process / in_process_ce, 1),
           **_topology(first, settings, runs, placements, in_process),
           "target_ratio": 25, "target_p99_ms": 25, "target_cascade_ratio": 5, "target_cold_ratio": 2}
    for other, (other_settings, other_runs) in rest:
        out[f"{other}_same_run"] = _topology(other, other_settings, other_runs, placements, in_process)
        out[f"warm_over_cross_encoder_{first}_over_{other}"] = round(
            out["warm_over_cross_encoder"] / out[f"{other}_same_run"]["warm_over_cross_encoder"], 2)
    write_results(name, out)


def _topology(kind: str, settings: dict, runs: list, placements: list[str], in_process: float) -> dict:
    """One topology's figures: the first placement's median over runs (one run: that run), each run's in
    `per_run`; the rows of the run with the median warm / cross-encoder ratio (every run's in rows_by_run)."""
    per_run = [_figures([r for r in rows if r["cross_encoder_placement"] == placements[0]]) for rows in runs]
    for figures, rows in zip(per_run, runs):  # against the fastest cross-encoder path of any placement
        fastest = max(r["pairs_per_s"] for r in rows if r["path"] == "warm cross_encoder")
        figures["warm_over_fastest_cross_encoder"] = round(figures["best_warm_adapter_pairs_per_s"] / fastest, 1)
    summary = _summary(per_run)
    return {"topology": TOPOLOGY[kind], "ingress": kind,
            "serve_settings": {**settings, **{k: os.environ.get(k) for k in ("RAY_SERVE_ENABLE_DIRECT_INGRESS",)}},
            "runs": len(runs), "failed_requests": sum(r["errors"] for rows in runs for r in rows),
            "rows": runs[sorted(range(len(runs)), key=lambda i: per_run[i]["warm_over_cross_encoder"])[len(runs) // 2]],
            "rows_by_run": runs if len(runs) > 1 else None, **summary,
            **({"by_placement": _by_placement(runs, placements)} if len(placements) > 1 else {}),
            "serve_overhead_in_process_over_served": round(in_process / summary["best_warm_adapter_pairs_per_s"], 1)}


if __name__ == "__main__":
    main()
