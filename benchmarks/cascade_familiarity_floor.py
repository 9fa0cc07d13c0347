"""Choosing the cascade's familiarity floor on validation splits: the least mean novelty-gate weight of a request's
pairs for the cascade to route any of them (`embed_lib.training.cascade.route`).

The served cascade sends the pairs its adapter's gate rates hardest to the cross-encoder. Off the adapter's task that
harmed: with the STS-B champion and its served teacher at budget 0.1, PAWS test fell -0.085 Spearman below the frozen
cosine while the adapter alone held at -0.0005, because the router ignored the novelty gate that had closed the
adapter's step for almost every PAWS pair. This script chooses the floor where the study chooses its winner: on
validation splits, by the do-no-harm rule.

For each task (the model's own and the transfer tasks) on `--split` (default validation), the registered model scores
every pair as served (the seeds' mean, clipped to [-1, 1]) and the cross-encoder scores every pair once. Then for each
candidate floor the cascade at `--budget` routes by the service's default policy (the gate's difficulty; cosine_middle
for an ungated model): over the split as one request (as `evaluate --cascade-budget` does by default), and in requests
of 8 and of 32 pairs (as the service routes them, each seeded by its pairs) drawn in `--orders` seeded orders of the
split. The rule: a floor is admissible when the cascade's Spearman delta over the frozen cosine on every transfer
task, in every one of those passes, is >= -tolerance (0.001, the winner rule's); the lowest admissible floor wins (it
routes the most pairs the rule allows, and so keeps the most of what the cross-encoder adds where it helps).

    python benchmarks/cascade_familiarity_floor.py [--model-uri models:/pair-residual-stsb@champion]
        [--cross-encoder models:/cross-encoder-stsb@current] [--tasks stsb,mrpc,qqp,paws] [--split validation]
        [--budget 0.1] [--floors 0,0.01,0.02,0.05,0.1,0.2,0.3] [--orders 5] [--name cascade_familiarity_floor]

-> results/benchmarks/<name>.json: per task its novelty-weight figures, the model's and the cross-encoder's deltas, and
per floor and pass the pairs routed and the cascade's Spearman delta (mean and worst over the orders); the chosen floor
and the table it was chosen from. Needs `make run` (the champion) and `make teacher` (the registered cross-encoder)
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
from embed_lib.training.cascade import default_policy, mix, route_requests
from embed_lib.training.export import ensemble_scores
from embed_lib.training.metrics import spearman
from embed_lib.training.selection import TRANSFER_TOLERANCE

REQUESTS = (8, 32)  # pairs per request of the served-like passes (32: serve_bench's c8x32 cell)


def task_figures(task: str, split_name: str, model, manifest, ce: PairCrossEncoder, budget: float,
                 floors: list[float], orders: int) -> dict:
    split = load_task(task, split_name)
    texts = split.texts()
    row = {t: i for i, t in enumerate(texts)}
    V = EmbeddingCache(manifest, default_cache_dir()).get(texts, lambda: encoder_for(manifest))
    ia, ib = (np.array([row[t] for t in side], dtype=np.int64) for side in (split.sentence1, split.sentence2))
    out = ensemble_scores(model, V[ia], V[ib])
    score, y = np.clip(out["score"].astype(np.float64), -1.0, 1.0), split.label
    pairs = list(zip(split.sentence1, split.sentence2))
    ce_scores = np.asarray(ce.score(pairs), dtype=np.float64)
    base = spearman(out["baseline"], y)
    routing = default_policy(model.form)

    def delta(routed: np.ndarray) -> float:
        return spearman(mix(score, ce_scores, routed), y) - base

    per_floor = {}
    for f in floors:
        whole = route_requests(budget, routing, [np.arange(len(y))], pairs, out, ce.middle, f)
        passes = {"split": {"routed": int(len(whole)), "delta": delta(whole), "worst": delta(whole)}}
        for size in REQUESTS:
            runs = [route_requests(budget, routing, np.array_split(order, range(size, len(y), size)), pairs, out,
                                   ce.middle, f)
                    for order in (np.random.default_rng(o).permutation(len(y)) for o in range(orders))]
            d = [delta(r) for r in runs]
            passes[f"requests_of_{size}"] = {"routed": float(np.mean([len(r) for r in runs])),
                                             "delta": float(np.mean(d)), "worst": float(min(d))}
        per_floor[f"{f:g}"] = passes
    w = out["novelty"]
    return {"pairs": len(y), "split_note": split.split_note, "routing": routing, "frozen_cosine": base,
            "model_delta": spearman(score, y) - base, "cross_encoder_delta": spearman(ce_scores, y) - base,
            "novelty_weight": {"mean": float(w.mean()), "share_0": float((w == 0).mean()),
                               "share_1": float((w == 1).mean())},
            "floors": per_floor}


def choose(tasks: dict, own: str, floors: list[float], tolerance: float) -> dict:
    """The rule of the module docstring: {floor, table, why}."""
    rows = []
    for f in floors:
        key = f"{f:g}"
        worst = min((p["worst"] for name, t in tasks.items() if name != own for p in t["floors"][key].values()),
                    default=0.0)
        own_passes = tasks[own]["floors"][key] if own in tasks else {}
        rows.append({"floor": f, "worst_transfer": worst, "admissible": worst >= -tolerance,
                     **{f"own_{k}": p["delta"] for k, p in own_passes.items()}})
    ok = [r["floor"] for r in rows if r["admissible"]]
    return {"floor": min(ok) if ok else None, "table": rows,
            "why": ("the lowest floor whose every transfer pass stays >= -tolerance" if ok
                    else "no floor keeps every transfer task within the tolerance")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_champion_args(ap)
    ap.add_argument("--tasks", default="stsb,mrpc,qqp,paws")
    ap.add_argument("--split", default="validation")
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--floors", default="0,0.01,0.02,0.05,0.1,0.2,0.3")
    ap.add_argument("--orders", type=int, default=5, help="seeded orders of the split for the request passes")
    ap.add_argument("--tolerance", type=float, default=TRANSFER_TOLERANCE)
    ap.add_argument("--name", default="cascade_familiarity_floor")
    args = ap.parse_args()
    t0 = time.perf_counter()
    floors = [float(f) for f in args.floors.split(",")]
    model, config, manifest, version, ce = champion_and_cross_encoder(args)
    tasks = {}
    for task in args.tasks.split(","):
        tasks[task] = task_figures(task, args.split, model, manifest, ce, args.budget, floors, args.orders)
        print(task, {f: {k: round(p["delta"], 4) for k, p in v.items()} for f, v in tasks[task]["floors"].items()},
              flush=True)
    write_results(args.name, {
        "model_uri": args.model_uri, "model_version": version, "trained_on": config.task,
        "cross_encoder": args.cross_encoder, "cross_encoder_backend": args.cross_encoder_backend,
        "split": args.split, "budget": args.budget, "tolerance": args.tolerance, "orders": args.orders,
        "tasks": tasks, "choice": choose(tasks, config.task, floors, args.tolerance),
        "seconds": round(time.perf_counter() - t0, 1)})


if __name__ == "__main__":
    main()
