"""The study pipeline: task -> cached embeddings (+ held-out teacher) -> seed groups -> comparison table.

`load_study` wires the stages for one task; `STANDARD_ARMS` is the reference comparison (DESIGN.md
sections 2-4, with every control under the same seeds); `run_study` trains them and `study_markdown`
renders the results table.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import numpy as np

from embed_lib.config import AdapterConfig
from embed_lib.training.diagnostics import headroom
from embed_lib.training.seed_group import GroupResult, train_seed_group
from embed_lib.training.tensors import StudyData

#: (label, AdapterConfig overrides): the reference comparison, every arm on the same seed group
STANDARD_ARMS: list[tuple[str, dict[str, Any]]] = [
    ("per-sentence (surface)", dict(adapter="per_sentence", target="surface")),
    ("per-sentence (surface), h-only", dict(adapter="per_sentence", control="h_only", target="none")),
    ("per-sentence (surface), constant c", dict(adapter="per_sentence", control="constant", target="none")),
    ("per-sentence (surface), global c", dict(adapter="per_sentence", control="global", target="none")),
    ("per-sentence (surface), shuffled c", dict(adapter="per_sentence", control="shuffled", target="surface")),
    ("per-sentence (lexical)", dict(adapter="per_sentence", target="lexical")),
    ("per-sentence preserving (surface)", dict(adapter="per_sentence_preserving", target="surface")),
    ("per-sentence preserving (surface), constant c",
     dict(adapter="per_sentence_preserving", control="constant", target="none")),
    ("pair ungated", dict(adapter="pair_ungated", target="none")),
    ("pair gated (lexical)", dict(adapter="pair_gated", target="lexical")),
    ("pair gated (ce_margin)", dict(adapter="pair_gated", target="ce_margin")),
    ("pair gated (ce_margin), shuffled target", dict(adapter="pair_gated", control="shuffled", target="ce_margin")),
    # the gate trained by the task loss as well: the first study's gate, whose gain was capacity, not the signal
    ("pair gated (ce_margin), joint gate", dict(adapter="pair_gated", target="ce_margin", gate_task_grad=True)),
    ("pair gated (ce_margin), shuffled target, joint gate",
     dict(adapter="pair_gated", control="shuffled", target="ce_margin", gate_task_grad=True)),
    ("pair gated, constant gate", dict(adapter="pair_gated", control="constant", target="none")),
    # anchoring (issue: do no harm outside the training data), same seeds
    ("pair gated (ce_margin) + magnitude penalty", dict(adapter="pair_gated", target="ce_margin", lambda_delta=1.0)),
    ("pair gated (ce_margin) + novelty gate", dict(adapter="pair_gated", target="ce_margin", novelty_quantile=0.1)),
]


#: distillation (the adapter learns the teacher's scores, not only its difficulty) and its controls, same seeds: the
#: teacher-gated residual without it, the labelled pairs alone, with the silver pairs, and the teacher's scores
#: shuffled over the pairs (the same values, no information: what the extra loss term does by itself)
DISTIL = dict(lambda_distil=0.5)
DISTIL_ARMS: list[tuple[str, dict[str, Any]]] = [
    ("pair ungated", dict(adapter="pair_ungated", target="none")),
    ("pair gated (ce_margin)", dict(adapter="pair_gated", target="ce_margin")),
    ("pair ungated, distilled (labelled pairs)", dict(adapter="pair_ungated", target="none", **DISTIL)),
    ("pair ungated, distilled (labelled + silver)",
     dict(adapter="pair_ungated", target="none", silver_fraction=1.0, **DISTIL)),
    ("pair ungated, distilled (labelled + silver), shuffled teacher",
     dict(adapter="pair_ungated", target="none", silver_fraction=1.0, distil_control="shuffled", **DISTIL)),
    ("pair gated (ce_margin), distilled (labelled + silver)",
     dict(adapter="pair_gated", target="ce_margin", silver_fraction=1.0, **DISTIL)),
    ("pair gated (ce_margin), distilled (labelled + silver), shuffled teacher",
     dict(adapter="pair_gated", target="ce_margin", silver_fraction=1.0, distil_control="shuffled", **DISTIL)),
]
#: --arms value -> the arms it runs
ARM_SETS = {"all": STANDARD_ARMS + DISTIL_ARMS[2:],
            "pair": [a for a in STANDARD_ARMS if a[1]["adapter"].startswith("pair")],
            "per_sentence": [a for a in STANDARD_ARMS if a[1]["adapter"].startswith("per_sentence")],
            "distil": DISTIL_ARMS}


def _uses_gamma(overrides: dict[str, Any]) -> bool:
    return overrides["adapter"].startswith("pair") or overrides["adapter"] == "per_sentence_preserving"


def run_study(data: StudyData, base: AdapterConfig, arms: Iterable[tuple[str, dict[str, Any]]] = STANDARD_ARMS,
              gammas: Iterable[float] = (0.1,), log=print) -> list[tuple[str, GroupResult]]:
    """Every arm on the same seed group; an arm with a gamma is trained at each of `gammas` and keeps the one
    with the best mean validation delta (test is not read to choose)."""
    results = []
    gammas = list(gammas)
    for label, overrides in arms:
        if overrides.get("target") not in (None, "none", *data.targets):
            log(f"  skip {label}: target {overrides['target']!r} unavailable")
            continue
        runs = [train_seed_group(dataclasses.replace(base, task=data.task, **overrides, gamma=g), data)
                for g in (gammas if _uses_gamma(overrides) else [base.gamma])]
        r = max(runs, key=lambda x: x.summary["delta_val_mean"])
        tr = f"  transfer worst {r.summary['transfer_delta_min']:+.4f}" if "transfer_delta_min" in r.summary else ""
        log(f"  {label:50s} gamma {r.config.gamma:<5g} val {r.summary['delta_val_mean']:+.4f} "
            f"({r.summary['delta_val_positive']}/{r.config.n_seeds} >0)  test {r.summary['delta_test_mean']:+.4f}"
            f"{tr}  {sum(x.seconds for x in runs):.1f}s")
        results.append((label, r))
    return results


def headroom_of(data: StudyData) -> dict[str, dict[str, float]]:
    tr = data.splits["train"]
    return headroom(tr.s0, tr.y.numpy(), tr.pair_target)


def _diffs(a: GroupResult, b: GroupResult, key: str) -> np.ndarray:
    return np.array([x[key] - y[key] for x, y in zip(a.per_seed, b.per_seed)])


def _paired_diff(a: GroupResult, b: GroupResult, key: str = "delta_test") -> str:
    d = _diffs(a, b, key)
    return f"{d.mean():+.4f} ({int((d > 0).sum())}/{len(d)} >0)"


ISOLATION_PAIRS = [("pair gated (ce_margin)", "pair gated (ce_margin), shuffled target"),
                   ("pair gated (ce_margin)", "pair gated, constant gate"),
                   ("pair gated (ce_margin), joint gate", "pair gated (ce_margin), shuffled target, joint gate"),
                   ("pair gated (lexical)", "pair gated, constant gate"),
                   ("per-sentence (surface)", "per-sentence (surface), shuffled c"),
                   ("per-sentence (surface)", "per-sentence (surface), constant c"),
                   ("per-sentence (surface)", "per-sentence (surface), h-only"),
                   # distillation: what the teacher's scores add, what the silver pairs add, and the shuffled teacher
                   ("pair ungated, distilled (labelled + silver)", "pair ungated"),
                   ("pair ungated, distilled (labelled + silver)", "pair ungated, distilled (labelled pairs)"),
                   ("pair ungated, distilled (labelled + silver)",
                    "pair ungated, distilled (labelled + silver), shuffled teacher"),
                   ("pair gated (ce_margin), distilled (labelled + silver)", "pair gated (ce_margin)"),
                   ("pair gated (ce_margin), distilled (labelled + silver)",
                    "pair gated (ce_margin), distilled (labelled + silver), shuffled teacher")]


def reference_rows(data: StudyData, teacher: dict[str, Any] | None, results: list[tuple[str, GroupResult]]
                   ) -> dict[str, dict[str, float]]:
    """The teacher alone and the rank average of teacher and cosine on validation and test, with their cost
    per pair relative to the adapter's (both need a cross-encoder pass per pair; the adapter does not)."""
    if teacher is None or "quality" not in teacher:
        return {}
    q = teacher["quality"]
    adapter_rate = max((r.summary.get("pairs_per_s", 0.0) for _, r in results), default=0.0)
    ce_rate = teacher.get("predict_pairs_per_s")
    cost = round(adapter_rate / ce_rate, 1) if adapter_rate and ce_rate else None
    return {"teacher alone": {"validation": q["validation"]["teacher_spearman"], "test": q["test"]["teacher_spearman"],
                              "cost_vs_adapter": cost},
            "rank average (teacher, cosine)": {"validation": q["validation"]["rank_average_spearman"],
                                               "test": q["test"]["rank_average_spearman"], "cost_vs_adapter": cost}}


def study_markdown(task: str, data: StudyData, results: list[tuple[str, GroupResult]],
                   teacher: dict[str, Any] | None) -> str:
    any_r = results[0][1]
    b = any_r.baseline
    n = any_r.config.n_seeds
    lines = [f"### {task}", "",
             "Splits: " + "; ".join(f"{k}: {v}" for k, v in data.split_notes.items()), "",
             "| arm | gamma | params/seed | val Spearman | val delta | val >0 | test Spearman | test delta | test >0 | "
             "transfer worst seed | gate/c fit train | gate/c fit test |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|",
             f"| frozen baseline (cosine) | | 0 | {b['val/spearman']:.4f} | | | {b['test/spearman']:.4f} | | | | | |"]
    for label, r in results:
        s = r.summary
        fit = lambda k: f"{s[k]:.2f}" if k in s and np.isfinite(s[k]) else ""  # noqa: E731
        tr = f"{s['transfer_delta_min']:+.4f}" if "transfer_delta_min" in s else ""
        gamma = f"{r.config.gamma:g}" if _uses_gamma(r.config.to_dict()) else ""
        lines.append(
            f"| {label} | {gamma} | {r.n_parameters} | {s['val/spearman_mean']:.4f} | {s['delta_val_mean']:+.4f} ± "
            f"{s['delta_val_std']:.4f} | {s['delta_val_positive']}/{n} | {s['test/spearman_mean']:.4f} | "
            f"{s['delta_test_mean']:+.4f} ± {s['delta_test_std']:.4f} | {s['delta_test_positive']}/{n} | {tr} | "
            f"{fit('train/gate_fit_mean')} | {fit('test/gate_fit_mean')} |")
    for label, ref in reference_rows(data, teacher, results).items():
        cost = f"needs a cross-encoder pass per pair: ~{ref['cost_vs_adapter']:g}x the adapter's cost" \
            if ref["cost_vs_adapter"] else "needs a cross-encoder pass per pair"
        lines.append(f"| reference: {label} ({cost}) | | | {ref['validation']:.4f} | "
                     f"{ref['validation'] - b['val/spearman']:+.4f} | | {ref['test']:.4f} | "
                     f"{ref['test'] - b['test/spearman']:+.4f} | | | | |")
    by = dict(results)
    diffs = [f"- {a} minus {c}: test {_paired_diff(by[a], by[c])}, val {_paired_diff(by[a], by[c], 'delta_val')}"
             for a, c in ISOLATION_PAIRS if a in by and c in by]
    hr = headroom_of(data)
    lines += ["", "Per-seed differences (signal isolation, same seeds, each arm at its own gamma):", *diffs, "",
              "Headroom on train (correlation of the signal with |calibrated s0 - y|): " +
              ", ".join(f"{k} Pearson {v['pearson']:+.3f} / Spearman {v['spearman']:+.3f}" for k, v in hr.items())]
    if teacher is not None:
        c = teacher["config"]
        q = teacher.get("quality", {})
        folds = ", ".join(f"{f['val_spearman']:.3f} (best epoch {f.get('best_epoch', '?')})"
                          for f in teacher.get("folds", []))
        corr = ", ".join(f"{k} {v['error_correlation']:.3f}" for k, v in q.items())
        lines.append(f"Teacher: {c['model']}, {teacher.get('preset', 'custom')} recipe ({c.get('folds')} folds x <= "
                     f"{c.get('epochs')} epochs, lr {c.get('lr')}, both orders {c.get('both_orders')}"
                     + (f", {teacher['precision']}" if teacher.get("precision", "fp32") != "fp32" else "")
                     + "); out-of-fold "
                     f"train Spearman {teacher['train_spearman']:.4f}; fold models' validation Spearman {folds}; "
                     f"rank-error correlation with the frozen cosine: {corr}; {teacher['seconds']:.0f}s once "
                     f"({teacher.get('train_pairs_per_s')} training pairs/s).")
    return "\n".join(lines) + "\n"


def study_json(data: StudyData, results: list[tuple[str, GroupResult]], teacher: dict[str, Any] | None
               ) -> dict[str, Any]:
    """The machine-readable study of one task (what results/study_all.json holds per task)."""
    b = results[0][1].baseline
    out: dict[str, Any] = {
        "baseline": {"validation_spearman": b["val/spearman"], "test_spearman": b["test/spearman"],
                     **{k: v for k, v in b.items() if k.startswith("transfer/")}},
        "splits": data.split_notes, "arms": {}, "isolation": {}}
    if teacher is not None:
        q = teacher.get("quality", {})
        out["teacher"] = {
            "test_spearman": teacher["test_spearman"], "validation_spearman": teacher["validation_spearman"],
            "train_oof_spearman": teacher["train_spearman"],
            "error_correlation_test": q.get("test", {}).get("error_correlation"),
            "error_correlation": {k: v["error_correlation"] for k, v in q.items()},
            "rank_average_test_spearman": q.get("test", {}).get("rank_average_spearman"),
            "seconds": teacher["seconds"], "train_pairs_per_s": teacher.get("train_pairs_per_s"),
            "predict_pairs_per_s": teacher.get("predict_pairs_per_s"),
            "recipe": {"preset": teacher.get("preset"), **teacher["config"]}}
        out["reference"] = reference_rows(data, teacher, results)
        if "silver" in teacher:
            out["silver"] = teacher["silver"]
    for label, r in results:
        s = r.summary
        out["arms"][label] = {
            "delta_val_mean": s["delta_val_mean"], "delta_val_std": s["delta_val_std"],
            "val_positive": s["delta_val_positive"], "test_delta_mean": s["delta_test_mean"],
            "test_delta_std": s["delta_test_std"], "test_positive": s["delta_test_positive"],
            "n_seeds": s["n_seeds"], "gamma": r.config.gamma if _uses_gamma(r.config.to_dict()) else None,
            "n_parameters": r.n_parameters, "transfer_delta_min": s.get("transfer_delta_min"),
            "transfer_delta_mean": {k.split("/")[1]: v for k, v in s.items()
                                    if k.startswith("transfer/") and k.endswith("_mean")},
            "gate_fit_train": s.get("train/gate_fit_mean"), "gate_fit_test": s.get("test/gate_fit_mean"),
            "config": r.config.to_dict()}
    by = dict(results)
    for a, c in ISOLATION_PAIRS:
        if a in by and c in by:
            dt, dv = _diffs(by[a], by[c], "delta_test"), _diffs(by[a], by[c], "delta_val")
            key = "ce_margin_minus_shuffled" if (a, c) == ISOLATION_PAIRS[0] else f"{a} minus {c}"
            out["isolation"][key] = {"test_mean": float(dt.mean()), "test_positive": int((dt > 0).sum()),
                                     "val_mean": float(dv.mean()), "val_positive": int((dv > 0).sum()),
                                     "per_seed_test": dt.tolist(), "per_seed_val": dv.tolist()}
    return out
