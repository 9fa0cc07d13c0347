"""The quality-cost frontier of the cascade: Spearman against pairs/s as the cross-encoder budget grows.

Per task (STS-B test, QQP test): a pair_gated adapter with the ce_margin target (5 seeds, on the K-fold
teacher's held-out margins) scores every pair; the served teacher (`embed_lib.teacher.cross_encoder`: one
cross-encoder on all of train, calibrated to the cosine's scale) re-scores a fraction b of them, chosen
by each routing policy of `embed_lib.training.cascade` (difficulty, random, cosine_middle), for b in
{0, 0.05, 0.1, 0.2, 0.5, 1}. Spearman per seed (the adapter's seed, and the random policy's), mean and
spread. The cost side is measured through Ray Serve: the adapter registered in a temporary MLflow store,
the teacher as the app's cross-encoder, closed-loop load of 32-pair requests at concurrency 8 with warm
sentences, per budget, and the cross-encoder alone for reference.

    python benchmarks/cascade_frontier.py [--tasks stsb,qqp] [--seconds 6] [--backend torch|onnx-int8]
                                          [--direct-ingress]

-> results/benchmarks/cascade_frontier[_<backend>][_direct_ingress].json (per task and policy: [{budget, spearman, spearman_std,
pairs_per_s}]), results/benchmarks/cascade_frontier.png (quality against pairs/s, one line per policy),
both also logged to MLflow (experiment cascade-frontier of $MLFLOW_TRACKING_URI, else ./mlflow.db).
Targets: at b = 0.1, routing by difficulty gains >= 2x random routing's Spearman gain on STS-B test, and
keeps >= 8x the cross-encoder's pairs/s.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import matplotlib
import matplotlib.pyplot as plt
import mlflow
import numpy as np
import requests
import torch

from benchmarks._common import REPO, write_results
from benchmarks.load import Bodies, direct_ingress_port, run_load
from embed_lib.config import AdapterConfig
from embed_lib.data.tasks import SPLITS, load_splits, load_task
from embed_lib.pipeline.prepare import load_study
from embed_lib.teacher.config import teacher_preset as preset
from embed_lib.teacher.cross_encoder import PairCrossEncoder, calibrate, served_teacher
from embed_lib.tracking.registry import log_adapter_model
from embed_lib.tracking.runs import default_tracking_uri, set_experiment
from embed_lib.training.cascade import COMBINE, POLICIES, mix, route
from embed_lib.training.export import load_adapter, save_adapter
from embed_lib.training.metrics import spearman
from embed_lib.training.seed_group import train_seed_group

BUDGETS = (0.0, 0.05, 0.1, 0.2, 0.5, 1.0)
SEEDS = (0, 1, 2, 3, 4)


def _quality(task: str, teacher_preset: str, backend: str = "torch") -> dict:
    """Per-seed test scores and gates of a ce_margin-gated adapter, the served teacher's calibrated test
    scores, and the Spearman of every (policy, budget) point."""
    teacher = preset(teacher_preset)
    data, record = load_study(task, teacher=teacher, progress=lambda m: print(f"[{task}] {m}", flush=True))
    splits = load_splits(task, SPLITS)
    folder, served = served_teacher(splits, teacher, {k: data.splits[k].s0 for k in SPLITS},
                                    progress=lambda m: print(f"[{task}] {m}", flush=True))
    # gamma 0.5: this arm's best on validation in the study on both tasks (results/study_all.md)
    cfg = AdapterConfig(adapter="pair_gated", target="ce_margin", gamma=0.5, n_seeds=len(SEEDS), seed0=SEEDS[0])
    result = train_seed_group(cfg, data)
    tmp = tempfile.mkdtemp()
    model, _, _ = load_adapter(save_adapter(f"{tmp}/a", cfg, result.state_dict, data.manifest, data.X.shape[1]))
    test = data.splits["test"]
    S = len(SEEDS)
    with torch.no_grad():
        out = model(data.X[test.ia].expand(S, -1, -1), data.X[test.ib].expand(S, -1, -1))
    adapter, gate = out.score.numpy(), out.gate.numpy()
    y, s0 = test.y.numpy(), test.s0
    if backend == "torch":  # the served teacher's recorded test logits
        z = np.load(folder / "scores.npz")["test"]
    else:  # the backend the service will run

        z = PairCrossEncoder(folder, backend=backend).logits(list(zip(splits["test"].sentence1, splits["test"].sentence2)))
    ce = calibrate(z, served["calibration"])
    middle = float(np.median(data.splits["validation"].s0))
    curves = {}
    for combine in COMBINE:
        for policy in POLICIES:
            points = []
            for b in BUDGETS:
                per_seed = [spearman(mix(adapter[i], ce, route(b, policy, difficulty=gate[i], baseline=s0,
                                                               middle=middle, seed=seed), combine), y)
                            for i, seed in enumerate(SEEDS)]
                points.append({"budget": b, "spearman": float(np.mean(per_seed)),
                               "spearman_std": float(np.std(per_seed)), "per_seed": [round(v, 5) for v in per_seed]})
            curves[policy if combine == "replace" else f"{policy}+mean"] = points
    return {"task": task, "n_test": len(y), "cosine_spearman": spearman(s0, y),
            "adapter_spearman": float(np.mean([spearman(a, y) for a in adapter])),
            "cross_encoder_spearman": spearman(ce, y), "teacher_kfold_test_spearman": record["test_spearman"],
            "served_teacher": {k: served[k] for k in ("recipe", "test_spearman", "validation_spearman",
                                                      "test_error_correlation", "fit_seconds", "predict_pairs_per_s")},
            "served_teacher_dir": str(folder), "teacher_preset": teacher_preset, "adapter": cfg.to_dict(),
            "adapter_summary": {k: result.summary[k] for k in ("delta_val_mean", "delta_test_mean")},
            "curves": curves, "_state": (cfg, result, data)}


def _register(task: str, state, tracking: str) -> str:
    cfg, result, data = state
    set_experiment("cascade-frontier", tracking)  # a new store: artifacts beside it, never in ./mlruns
    with mlflow.start_run():
        info = log_adapter_model(result, data, registered_name=f"frontier-{task}")
    return f"models:/frontier-{task}/{info.registered_model_version}"


def _throughput(task: str, model_uri: str, tracking: str, ce_dir: str, backend: str, seconds: float,
                port: int, direct_ingress: bool = False, placements: tuple[str, ...] = ("deployment",),
                rounds: int = 1) -> dict:
    """Pairs/s (and p99) per budget and of the cross-encoder alone, for each cross-encoder placement (one
    application each, side by side, every point measured for one placement then the next), median over
    `rounds`; and per round, each placement's cascade at b = 0.1 against its own cross-encoder alone."""
    # lazy: Serve's and Ray's settings are put in the environment before Ray is first imported
    from ray import serve

    from serving.app import build_app

    sentences = load_task(task, "test").texts()[:2000]
    share = 0.5 / len(placements)  # a scheduling figure: two applications fit the 2-CPU node side by side
    urls, names = {}, {pl: f"frontier-{task}" if len(placements) == 1 else f"frontier-{task}-{pl}" for pl in placements}
    for pl, name in names.items():
        prefix = "/" if len(placements) == 1 else f"/{pl}"
        serve.run(build_app({"model_uri": model_uri, "tracking_uri": tracking, "cross_encoder": ce_dir,
                             "cross_encoder_backend": backend, "cross_encoder_placement": pl,
                             "encoder": {"min": 1, "max": 1, "num_cpus": share},
                             "ingress": {"min": 1, "max": 1, "num_cpus": share}, "max_inflight": 256,
                             "max_pairs": 64}), name=name, route_prefix=prefix)
        base = f"http://127.0.0.1:{direct_ingress_port(name) if direct_ingress else port}{prefix.rstrip('/')}"
        for i in range(0, len(sentences), 1000):
            requests.post(f"{base}/v1/warm", json={"texts": sentences[i: i + 1000]}, timeout=600)
        urls[pl] = f"{base}/v1/score"
    runs = {pl: {"by_budget": {b: [] for b in BUDGETS}, "cross_encoder": []} for pl in placements}
    for r in range(rounds):
        for b in BUDGETS:
            for pl, url in urls.items():
                res = run_load(url, Bodies("warm", sentences, 32, budget=b), 8, seconds)
                runs[pl]["by_budget"][b].append(res)
                print(task, f"round {r}", pl, "budget", b, res, flush=True)
        for pl, url in urls.items():
            res = run_load(url, Bodies("warm", sentences, 32, "cross_encoder"), 8, seconds)
            runs[pl]["cross_encoder"].append(res)
            print(task, f"round {r}", pl, "cross-encoder alone", res, flush=True)
    for name in names.values():
        serve.delete(name)

    def median(results: list[dict]) -> dict:  # the round with the median pairs/s
        return sorted(results, key=lambda x: x["pairs_per_s"])[len(results) // 2]

    out = {pl: {"by_budget": {b: median(v) for b, v in runs[pl]["by_budget"].items()},
                "cross_encoder": median(runs[pl]["cross_encoder"]),
                "ratio_at_0.1_by_round": [round(c["pairs_per_s"] / a["pairs_per_s"], 2) for c, a in
                                          zip(runs[pl]["by_budget"][0.1], runs[pl]["cross_encoder"])]}
           for pl in placements}
    for pl in placements:
        out[pl]["ratio_at_0.1_median"] = statistics.median(out[pl]["ratio_at_0.1_by_round"])
    return {**out[placements[0]], "by_placement": out}


def _plot(results: dict, path) -> None:
    matplotlib.use("Agg")

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.8), squeeze=False)
    for ax, (task, r) in zip(axes[0], results.items()):
        for policy, points in r["curves"].items():
            xs = [p["pairs_per_s"] for p in points]
            ax.errorbar(xs, [p["spearman"] for p in points], yerr=[p["spearman_std"] for p in points], marker="o",
                        capsize=3, ls="--" if policy.endswith("+mean") else "-", label=policy)
            for p in points:
                ax.annotate(f"{p['budget']:g}", (p["pairs_per_s"], p["spearman"]), fontsize=7,
                            textcoords="offset points", xytext=(4, -10))
        ax.axhline(r["cosine_spearman"], color="grey", ls=":", label="frozen cosine")
        ax.set_xscale("log")
        ax.set_xlabel("pairs/s through Serve (c=8, 32 pairs per request; log scale)")
        ax.set_ylabel("Spearman (test)")
        ax.set_title(f"{task}: cascade frontier (labels: budget)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="stsb,qqp")
    ap.add_argument("--seconds", type=float, default=6.0, help="per throughput point (default 6)")
    ap.add_argument("--backend", default="torch", help="the served cross-encoder's backend (torch, onnx, onnx-int8)")
    ap.add_argument("--teacher-preset", default="light",
                    help="the teacher recipe (default light, the recipe of the recorded figures; make run's and make "
                         "teacher's is fast)")
    ap.add_argument("--no-serve", action="store_true", help="quality only (no throughput through Serve)")
    ap.add_argument("--direct-ingress", action="store_true",
                    help="Ray Serve's direct ingress: the load goes to the ingress replica's own HTTP port (no proxy "
                         "hop), as in serve_bench.py --direct-ingress")
    ap.add_argument("--placements", default="deployment",
                    help="where the served cross-encoder runs (the app's cross_encoder_placement), comma-separated: "
                         "deployment, ingress; two: side by side, each point measured for one then the other "
                         "(default deployment; the curves' pairs/s are the first one's)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure every throughput point this many times, rounds one after another; the median "
                         "round's figures are kept and each round's ratio at b = 0.1 (default 1)")
    args = ap.parse_args()
    results = {t: _quality(t, args.teacher_preset, args.backend) for t in args.tasks.split(",")}
    if not args.no_serve:
        from serving.serve_env import apply_serve_env, free_port

        if args.direct_ingress:
            os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] = "1"
        apply_serve_env()  # before ray.init: the local cluster's processes inherit them
        import ray
        from ray import serve

        tmp = tempfile.mkdtemp()
        tracking = f"sqlite:///{tmp}/mlflow.db"
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for task, r in results.items():
            uri = _register(task, r["_state"], tracking)
            t = _throughput(task, uri, tracking, r["served_teacher_dir"], args.backend, args.seconds, port,
                            args.direct_ingress, tuple(args.placements.split(",")), args.rounds)
            for points in r["curves"].values():
                for p in points:
                    p["pairs_per_s"] = round(t["by_budget"][p["budget"]]["pairs_per_s"], 1)
            r["cross_encoder_pairs_per_s"] = round(t["cross_encoder"]["pairs_per_s"], 1)
            r["p99_ms_by_budget"] = {str(b): t["by_budget"][b]["p99_ms"] for b in BUDGETS}
            r["throughput_by_placement"] = _by_placement(t)
        serve.shutdown()
        ray.shutdown()
    summary = _summarise(results, args)
    out = write_results("cascade_frontier" + ("" if args.backend == "torch" else f"_{args.backend}")
                        + ("_direct_ingress" if args.direct_ingress else "")
                        + ("" if args.placements == "deployment" else "_ce-in-" + args.placements.replace(",", "-")),
                        summary)
    if not args.no_serve:
        png = out.with_suffix(".png")
        _plot(results, png)
        _log_mlflow(out, png)


def _by_placement(t: dict) -> dict:
    """Each cross-encoder placement's points, its ratio at b = 0.1 per round and the ceiling at b = 0.1 from the
    same placement's points: 1 / (b + ce / warm at b = 0)."""
    return {pl: {"pairs_per_s_by_budget": {str(b): round(v["by_budget"][b]["pairs_per_s"], 1) for b in BUDGETS},
                 "cross_encoder_pairs_per_s": round(v["cross_encoder"]["pairs_per_s"], 1),
                 "ratio_at_0.1_by_round": v["ratio_at_0.1_by_round"], "ratio_at_0.1_median": v["ratio_at_0.1_median"],
                 "ceiling_at_0.1": round(1 / (0.1 + v["cross_encoder"]["pairs_per_s"]
                                              / v["by_budget"][0.0]["pairs_per_s"]), 2)}
            for pl, v in t["by_placement"].items()}


def _summarise(results: dict, args) -> dict:
    for r in results.values():
        r.pop("_state")
        curves = r["curves"]
        at = {p: next(x for x in curves[p] if x["budget"] == 0.1) for p in curves}
        base = curves["random"][0]["spearman"]  # b = 0: the adapter alone (same for every policy)
        gain = {p: at[p]["spearman"] - base for p in curves}
        r["at_budget_0.1"] = {"gain_over_adapter": gain, **{
            f"difficulty{c}_over_random{c}_gain": (gain[f"difficulty{c}"] / gain[f"random{c}"]
                                                   if gain[f"random{c}"] > 0 else None) for c in ("", "+mean")}}
        if "cross_encoder_pairs_per_s" in r:
            r["at_budget_0.1"]["pairs_per_s_over_cross_encoder"] = round(
                at["difficulty"]["pairs_per_s"] / r["cross_encoder_pairs_per_s"], 1)
    return {"cross_encoder_backend": args.backend, "cross_encoder_placements": args.placements.split(","),
            "rounds": args.rounds,
            "seconds_per_point": args.seconds, "budgets": list(BUDGETS),
            "topology": "direct ingress (load to the ingress replica's own port)" if args.direct_ingress
            else "Serve HTTP proxy -> ingress replica",
            "seeds": list(SEEDS), "tasks": results,
            "targets": {"difficulty_over_random_gain_at_0.1": 2.0, "pairs_per_s_over_cross_encoder_at_0.1": 8.0}}


def _log_mlflow(json_path, png_path) -> None:
    set_experiment("cascade-frontier", os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri())
    with mlflow.start_run(run_name="cascade-frontier"):
        mlflow.log_artifact(str(json_path))
        mlflow.log_artifact(str(png_path))


if __name__ == "__main__":
    os.chdir(REPO)
    main()
