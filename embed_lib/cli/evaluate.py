"""`python -m embed_lib evaluate`: a registered adapter on one split of a task or of your own pair file, beside the
frozen cosine it anchors to.

The model scores the pairs as the service and the pyfunc model do (the mean over its seeds, from the vectors of the
encoder its manifest names, embedded through the cache, clipped to [-1, 1]); every metric of the task (Spearman,
Pearson; for binary labels ROC-AUC, average precision, accuracy and F1 at the best threshold) for the model and the
frozen cosine, each seed's Spearman delta, and a paired bootstrap interval of the Spearman delta. With
--cross-encoder, the same metrics of a cross-encoder on the same pairs (a registered `models:/cross-encoder-<task>`
version, a folder `python -m embed_lib teacher` saved, or any cross-encoder id / path), and the share of its Spearman
gain over the frozen cosine that the model reaches; with --cascade-budget B also the served cascade's: the fraction B
of the pairs the model's gate rates hardest (a model with no gate: whose cosine is nearest the middle, as the service
routes it) re-scored by the cross-encoder (on the cosine's scale where it has a calibration), routed over the whole
split as one request or in requests of --cascade-request-pairs pairs; a request whose mean novelty-gate weight is
under the familiarity floor routes nothing, as served (embed_lib.training.cascade).
Writes results/evaluate_<task>_<split>.{md,json} (or --out).
"""
from __future__ import annotations

import argparse
import re
import time

import mlflow
import numpy as np

from embed_lib.cli.args import add_custom_data_flags, add_data_flags
from embed_lib.cli.values import float_above, int_at_least
from embed_lib.config import BACKENDS, EncoderConfig
from embed_lib.data.tasks import CUSTOM, SPLITS, load_task, task_names
from embed_lib.encoding.cache import EmbeddingCache, encoder_for
from embed_lib.report.files import write_report
from embed_lib.teacher.cross_encoder import PairCrossEncoder
from embed_lib.tracking.cross_encoder_registry import resolve_cross_encoder
from embed_lib.tracking.registry import load_registered
from embed_lib.tracking.runs import default_tracking_uri, require_store
from embed_lib.training.cascade import FAMILIARITY_FLOOR, default_policy, mix, route_requests
from embed_lib.training.export import as_served, ensemble_scores
from embed_lib.training.metrics import cosine, evaluate, paired_bootstrap, spearman
from embed_lib.training.retrieval import seed_scores


def add_evaluate_parser(sub) -> None:
    p = sub.add_parser("evaluate", help="a registered adapter on one split of a task or your own pair file, beside "
                                        "the frozen cosine, with a paired bootstrap interval of the Spearman delta")
    p.add_argument("--task", default="stsb", help=f"one of {task_names()} or your own pairs: a .csv / .tsv / .jsonl "
                                                  "/ .parquet file or hf:<dataset id> (default: stsb)")
    p.add_argument("--model-uri", default="models:/pair-residual-stsb@champion",
                   help="the registered adapter (default: the STS-B champion of `make run`)")
    p.add_argument("--tracking-uri", default=None,
                   help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or sqlite:///<cwd>/mlflow.db)")
    p.add_argument("--eval-split", choices=SPLITS, default="test",
                   help="the split scored (default test; a file given with --split test has only that one)")
    p.add_argument("--bootstrap", type=int_at_least(0), default=1000,
                   help="resamples of the paired bootstrap of the Spearman delta (default 1000; 0: none)")
    p.add_argument("--device", default=None, help="the encoder's device: cpu, cuda, cuda:1 (default: best available)")
    p.add_argument("--cross-encoder", default=None,
                   help="also score the pairs with this cross-encoder, for comparison: models:/cross-encoder-<task>"
                        "/<version> or @alias, a folder `python -m embed_lib teacher` saved, or a cross-encoder id")
    p.add_argument("--cross-encoder-backend", choices=BACKENDS, default="torch",
                   help="its inference backend (default torch; onnx-int8 is ~2x faster on CPU, a little less exact)")
    p.add_argument("--cascade-budget", type=float_above(0, inclusive=True), default=None, metavar="B",
                   help="also the served cascade: the fraction B (0-1) of the pairs the model's gate rates hardest "
                        "re-scored by --cross-encoder (the service's default budget is 0.1)")
    p.add_argument("--cascade-familiarity-floor", type=float_above(0, inclusive=True), default=FAMILIARITY_FLOOR,
                   metavar="F", help="the cascade routes none of a request's pairs where their mean novelty-gate "
                                     f"weight is under F (0-1; default {FAMILIARITY_FLOOR:g}, the service's; 0: off)")
    p.add_argument("--cascade-request-pairs", type=int_at_least(1), default=None, metavar="N",
                   help="route the cascade in requests of N pairs, in the split's order, as the service routes each "
                        "request (default: the whole split as one request)")
    add_data_flags(p)
    add_custom_data_flags(p)
    p.add_argument("--out", default=None, help="results file (default: results/evaluate_<task>_<split>.md)")
    p.set_defaults(func=cmd_evaluate)


def _split(args: argparse.Namespace):
    if args.cascade_budget is not None and (not args.cross_encoder or args.cascade_budget > 1):
        raise ValueError(f"--cascade-budget {args.cascade_budget:g}: give a fraction in [0, 1], and the cross-encoder "
                         "it routes to with --cross-encoder.")
    if args.cascade_familiarity_floor > 1:
        raise ValueError(f"--cascade-familiarity-floor {args.cascade_familiarity_floor:g}: give a weight in [0, 1].")
    if args.task == "all":
        raise ValueError("evaluate scores one task: give --task a task name or a pair file, not 'all'.")
    has = [s for s in SPLITS if s in CUSTOM[args.task][1]] if args.task in CUSTOM else SPLITS
    if args.eval_split not in has:
        raise ValueError(f"--eval-split {args.eval_split}: {args.task} has only {list(has)}; give --eval-split "
                         f"{has[-1]}.")
    return load_task(args.task, args.eval_split, args.data_dir)


def _vectors(manifest: dict, texts: list[str], args: argparse.Namespace) -> np.ndarray:
    """The texts' vectors under the model's own encoder (from its manifest), through the embedding cache."""
    EncoderConfig.from_manifest(manifest, device=args.device)  # a bad --device named before the cache is read
    return EmbeddingCache(manifest, args.cache_dir).get(texts, lambda: encoder_for(manifest, device=args.device))


def _pinned(model_uri: str, tracking_uri: str) -> tuple[str, str | None]:
    """(the URI of the version `model_uri` names now, that version): an alias is read once, so that the figures belong
    to one version even if the alias moves meanwhile."""
    if m := re.fullmatch(r"models:/([^/@]+)@([^/]+)", model_uri):
        version = str(mlflow.MlflowClient(tracking_uri).get_model_version_by_alias(*m.groups()).version)
        return f"models:/{m[1]}/{version}", version
    m = re.fullmatch(r"models:/[^/@]+/(\d+)", model_uri)
    return model_uri, m[1] if m else None


def evaluation(args: argparse.Namespace) -> dict:
    """The figures of `evaluate` (see the module docstring), as the JSON file holds them."""
    t0 = time.perf_counter()
    store = require_store(args.tracking_uri or default_tracking_uri())
    pinned, version = _pinned(args.model_uri, store)
    split = _split(args)  # the flags checked before a model loads
    model, config, manifest = load_registered(pinned, store)
    texts = split.texts()
    row = {t: i for i, t in enumerate(texts)}
    V = _vectors(manifest, texts, args)
    ia, ib = (np.array([row[t] for t in side], dtype=np.int64) for side in (split.sentence1, split.sentence2))
    per_seed = seed_scores(model, V, ia, ib[:, None])[:, :, 0]  # (S, n): each pair a query with one candidate
    cos = cosine(V[ia], V[ib])  # the frozen cosine, which the model's anchor equals exactly
    y = split.label
    score = as_served(per_seed.mean(0))  # as served (the service, the pyfunc): the seeds' mean, clipped to [-1, 1]
    base = spearman(cos, y)
    seed_deltas = [spearman(as_served(s), y) - base for s in per_seed]
    out = {"task": args.task, "split": args.eval_split, "split_note": split.split_note, "pairs": len(split),
           "binary": split.binary, "model_uri": args.model_uri, "model_version": version, "adapter": config.adapter,
           "trained_on": config.task,
           "encoder": {k: manifest.get(k) for k in ("encoder", "revision", "backend", "tau_attn", "dim")},
           "frozen_cosine": evaluate(cos, y, split.binary),
           "model": evaluate(score, y, split.binary),
           "seed_spearman_deltas": seed_deltas, "not_held_out": not_held_out(config.task, args.task, args.eval_split),
           # where the served scores left the cosine: a gain or a loss comes from these pairs alone
           "pairs_moved": int((np.abs(score - cos) > 1e-6).sum())}
    out["delta"] = _deltas(out["model"], out["frozen_cosine"])
    if args.bootstrap:
        out["spearman_delta_bootstrap"] = paired_bootstrap(score, cos, y, args.bootstrap)
    if args.cross_encoder:
        out["cross_encoder"], ce_scores, middle = _cross_encoder(args, store, split, out["frozen_cosine"], score)
        if args.cascade_budget is not None:
            out["cascade"] = _cascade(args, score, ensemble_scores(model, V[ia], V[ib]), default_policy(model.form),
                                      ce_scores, middle, out["frozen_cosine"], split)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def not_held_out(trained_on: str, task: str, split: str) -> str | None:
    """Why a split of the model's own task is no held-out test of it (None for test and for other tasks)."""
    if trained_on != task:
        return None
    return {"train": "the model trained on these pairs, so its delta here is no held-out figure (test is)",
            "validation": "the sweep chose the model by its delta on these pairs, so the figure here is optimistic "
                          "(test is held out)"}.get(split)


def _deltas(metrics: dict, base: dict) -> dict:
    """metrics minus the frozen cosine's `base`, metric by metric (not the thresholds)."""
    return {k: metrics[k] - base[k] for k in metrics if not k.startswith("threshold")}


def _cross_encoder(args: argparse.Namespace, store: str, split, base: dict,
                   score: np.ndarray) -> tuple[dict, np.ndarray, float | None]:
    """(figures, the cross-encoder's scores of the pairs, its `middle` for cosine_middle routing). The figures: its
    metrics on the split, their deltas over the frozen cosine's (`base`), the model's Spearman gain over the cosine as
    a share of the cross-encoder's (None where the cross-encoder gains nothing), and with --bootstrap a paired
    interval of the model's Spearman minus the cross-encoder's."""
    t0 = time.perf_counter()
    ce = PairCrossEncoder(resolve_cross_encoder(args.cross_encoder, store), backend=args.cross_encoder_backend,
                          cache_root=args.cache_dir)
    scores = ce.score(list(zip(split.sentence1, split.sentence2)))
    seconds = time.perf_counter() - t0
    metrics = evaluate(scores, split.label, split.binary)
    gain, model_gain = metrics["spearman"] - base["spearman"], spearman(score, split.label) - base["spearman"]
    out = {"name": args.cross_encoder, "backend": args.cross_encoder_backend, "metrics": metrics,
           "delta": _deltas(metrics, base),
           "share_of_gain_reached": model_gain / gain if gain > 0 else None,
           "seconds": round(seconds, 1), "pairs_per_s": round(len(scores) / max(seconds, 1e-9), 1)}
    if args.bootstrap:
        out["model_minus_cross_encoder_bootstrap"] = paired_bootstrap(score, scores, split.label, args.bootstrap)
    return out, scores, ce.middle


def _cascade(args: argparse.Namespace, score: np.ndarray, ensemble: dict, routing: str, ce_scores: np.ndarray,
             middle: float | None, base: dict, split) -> dict:
    """The served cascade at --cascade-budget by `routing` (the service's default), over the whole split or in requests
    of --cascade-request-pairs: the model's scores (`score`, clipped to [-1, 1] as served) with the pairs its gate rates
    hardest replaced by the cross-encoder's, or for a model with no gate, the pairs whose frozen cosine is nearest
    `middle`; nothing of a request under the familiarity floor (`ensemble`: `ensemble_scores`)."""
    n, size = len(score), args.cascade_request_pairs or max(len(score), 1)
    requests = [np.arange(i, min(i + size, n)) for i in range(0, n, size)]
    routed = route_requests(args.cascade_budget, routing, requests, list(zip(split.sentence1, split.sentence2)),
                            ensemble, middle, args.cascade_familiarity_floor)
    scores = mix(score, ce_scores, routed)
    metrics = evaluate(scores, split.label, split.binary)
    return {"budget": args.cascade_budget, "routing": routing, "routed": len(routed), "request_pairs": size,
            "familiarity_floor": args.cascade_familiarity_floor, "familiarity": float(ensemble["novelty"].mean()),
            "metrics": metrics, "delta": _deltas(metrics, base)}


def markdown(r: dict) -> str:
    lines = [f"# Evaluation: {r['model_uri']} on {r['task']} {r['split']}", "",
             f"Model: {r['adapter']}" + (f", version {r['model_version']}" if r["model_version"] else "") +
             f", trained on {r['trained_on']}; encoder {r['encoder']['encoder']} (from the "
             f"model's manifest). {r['pairs']:,} pairs ({r['split_note']}). Model: the mean over its "
             f"{len(r['seed_spearman_deltas'])} seeds, as served.", "",
             *([f"**Not held out:** {r['not_held_out']}.", ""] if r.get("not_held_out") else []),
             "| metric | frozen cosine | model | delta |", "|---|---|---|---|"]
    lines += [f"| {k} | {r['frozen_cosine'][k]:.4f} | {r['model'][k]:.4f} | {d:+.4f} |" for k, d in r["delta"].items()]
    d = np.asarray(r["seed_spearman_deltas"])
    lines += ["", f"Spearman delta per seed: {', '.join(f'{v:+.4f}' for v in d)} ({int((d > 0).sum())}/{len(d)} "
                  "above 0)."]
    if "pairs_moved" in r:
        lines.append(f"The model's score differs from the frozen cosine on {r['pairs_moved']:,} of {r['pairs']:,} pairs"
                     + (" (on the others its novelty gate kept the cosine)." if r["pairs_moved"] < r["pairs"] else "."))
    if "spearman_delta_bootstrap" in r:
        b = r["spearman_delta_bootstrap"]
        lines.append(f"Spearman delta, {b['level']:.0%} paired bootstrap interval over {b['resamples']} resamples of "
                     f"the pairs: [{b['low']:+.4f}, {b['high']:+.4f}]; above 0 in {b['share_above_0']:.1%} of them.")
    if ce := r.get("cross_encoder"):
        share = ce["share_of_gain_reached"]
        lines += ["", f"Cross-encoder {ce['name']} ({ce['backend']}, {ce['pairs_per_s']:,} pairs/s here, every pair "
                      "through the transformer):", "", "| metric | cross-encoder | delta over the frozen cosine |",
                  "|---|---|---|"]
        lines += [f"| {k} | {ce['metrics'][k]:.4f} | {d:+.4f} |" for k, d in ce["delta"].items()]
        lines += ["", (f"The model's Spearman gain over the frozen cosine is {share:.0%} of the cross-encoder's."
                       if share is not None else "The cross-encoder does not beat the frozen cosine here.")]
        if b := ce.get("model_minus_cross_encoder_bootstrap"):
            diff = r["model"]["spearman"] - ce["metrics"]["spearman"]
            lines.append(f"Model minus cross-encoder, Spearman: {diff:+.4f}; {b['level']:.0%} paired bootstrap "
                         f"interval [{b['low']:+.4f}, {b['high']:+.4f}], above 0 in {b['share_above_0']:.1%} of the "
                         "resamples.")
    if c := r.get("cascade"):
        how = "the gate's difficulty" if c["routing"] == "difficulty" else "the cosine's closeness to its middle"
        where = ("over the split as one request" if c["request_pairs"] >= r["pairs"] else
                 f"in requests of {c['request_pairs']} pairs")
        lines += ["", f"The cascade at budget {c['budget']:g} ({c['routed']:,} of {r['pairs']:,} pairs routed to the "
                      f"cross-encoder by {how}, {where}; the pairs' mean novelty-gate weight {c['familiarity']:.3f}, "
                      f"a request under {c['familiarity_floor']:g} routes nothing):", "",
                  "| metric | cascade | delta over the frozen cosine |", "|---|---|---|"]
        lines += [f"| {k} | {c['metrics'][k]:.4f} | {d:+.4f} |" for k, d in c["delta"].items()]
    return "\n".join(lines) + "\n"


def cmd_evaluate(args: argparse.Namespace) -> int:
    result = evaluation(args)
    text = markdown(result)
    print(text)
    write_report(args.out, text, result, result["seconds"])
    return 0
