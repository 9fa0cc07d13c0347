"""The study pipeline: task -> cached embeddings (+ held-out teacher) -> seed groups -> comparison table.

`load_study` wires the stages for one task; `STANDARD_ARMS` is the reference comparison (DESIGN.md
sections 2-4, with every control under the same seeds); `run_study` trains them and `study_markdown`
renders the results table.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from embed_lib.cache import EmbeddedTask, EmbeddingCache, embed_task
from embed_lib.config import AdapterConfig, EncoderConfig, default_cache_dir
from embed_lib.diagnostics import headroom
from embed_lib.tasks import SPLITS, load_splits
from embed_lib.teacher import TeacherConfig, teacher_scores
from embed_lib.train import GroupResult, StudyData, prepare_study, train_seed_group


class LazyEncoder:
    """Loads the model only when a sentence is missing from the cache, or when its manifest is needed."""

    def __init__(self, config: EncoderConfig) -> None:
        self.config = config
        self._encoder = None

    def __call__(self):
        if self._encoder is None:
            from embed_lib.encoders import FrozenEncoder

            self._encoder = FrozenEncoder(self.config)
        return self._encoder

    def manifest(self, memo_dir: str | Path | None) -> dict:
        from embed_lib.encoders import encoder_manifest

        return encoder_manifest(self.config, memo_dir, loader=self)


def load_study(task: str, encoder: EncoderConfig | None = None, teacher: TeacherConfig | None = None, *,
               data_dir: str | Path | None = None, cache_dir: str | Path | None = None,
               limit: int | None = None) -> tuple[StudyData, dict[str, Any] | None]:
    """StudyData for `task` (teacher=None: no ce_margin target) and the teacher record.

    limit: keep the first `limit` pairs of every split (smoke tests).
    """
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    splits = load_splits(task, SPLITS, data_dir)
    if limit is not None:
        splits = {k: v.subset(limit) for k, v in splits.items()}
    emb, _ = embed_splits(splits, LazyEncoder(encoder or EncoderConfig()), root)
    scores, record = (None, None)
    if teacher is not None:
        scores, record = teacher_scores(splits, teacher, root)
    return prepare_study(emb, scores), record


def embed_splits(splits, lazy: LazyEncoder, cache_dir: str | Path | None = None) -> tuple[EmbeddedTask, EmbeddingCache]:
    """Every distinct sentence of `splits` through the cache; the model loads only if one is missing."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    cache = EmbeddingCache(lazy.manifest(root), root)
    return embed_task(splits, cache, lazy), cache


#: (label, AdapterConfig overrides): the reference comparison, every arm on the same seed group
STANDARD_ARMS: list[tuple[str, dict[str, Any]]] = [
    ("per-sentence (surface)", dict(adapter="per_sentence", target="surface")),
    ("per-sentence (surface), constant c", dict(adapter="per_sentence", control="constant", target="surface")),
    ("per-sentence (surface), shuffled c", dict(adapter="per_sentence", control="shuffled", target="surface")),
    ("per-sentence (lexical)", dict(adapter="per_sentence", target="lexical")),
    ("pair ungated", dict(adapter="pair_ungated", target="none")),
    ("pair gated (lexical)", dict(adapter="pair_gated", target="lexical")),
    ("pair gated (ce_margin)", dict(adapter="pair_gated", target="ce_margin")),
    ("pair gated (ce_margin), shuffled target", dict(adapter="pair_gated", control="shuffled", target="ce_margin")),
    ("pair gated, constant gate", dict(adapter="pair_gated", control="constant", target="none")),
]


def run_study(data: StudyData, base: AdapterConfig, arms: Iterable[tuple[str, dict[str, Any]]] = STANDARD_ARMS,
              log=print) -> list[tuple[str, GroupResult]]:
    results = []
    for label, overrides in arms:
        if overrides.get("target") not in (None, "none", *data.targets):
            log(f"  skip {label}: target {overrides['target']!r} unavailable")
            continue
        cfg = dataclasses.replace(base, task=data.task, **overrides)
        r = train_seed_group(cfg, data)
        log(f"  {label:45s} val {r.summary['delta_val_mean']:+.4f} ({r.summary['delta_val_positive']}/"
            f"{cfg.n_seeds} >0)  test {r.summary['delta_test_mean']:+.4f}  {r.seconds:.1f}s")
        results.append((label, r))
    return results


def headroom_of(data: StudyData) -> dict[str, dict[str, float]]:
    tr = data.splits["train"]
    return headroom(tr.s0, tr.y.numpy(), tr.pair_target)


def _paired_diff(a: GroupResult, b: GroupResult, key: str = "delta_test") -> str:
    d = np.array([x[key] - y[key] for x, y in zip(a.per_seed, b.per_seed)])
    return f"{d.mean():+.4f} ({int((d > 0).sum())}/{len(d)} >0)"


def study_markdown(task: str, data: StudyData, results: list[tuple[str, GroupResult]],
                   teacher: dict[str, Any] | None) -> str:
    any_r = results[0][1]
    b = any_r.baseline
    n = any_r.config.n_seeds
    lines = [f"### {task}", "",
             "Splits: " + "; ".join(f"{k}: {v}" for k, v in data.split_notes.items()), "",
             "| arm | val Spearman | val delta | val >0 | test Spearman | test delta | test >0 | gate/c fit train | gate/c fit test |",
             "|---|---|---|---|---|---|---|---|---|",
             f"| frozen baseline (cosine) | {b['val/spearman']:.4f} | | | {b['test/spearman']:.4f} | | | | |"]
    for label, r in results:
        s = r.summary
        fit = lambda k: f"{s[k]:.2f}" if k in s and np.isfinite(s[k]) else ""
        lines.append(
            f"| {label} | {s['val/spearman_mean']:.4f} | {s['delta_val_mean']:+.4f} ± {s['delta_val_std']:.4f} | "
            f"{s['delta_val_positive']}/{n} | {s['test/spearman_mean']:.4f} | {s['delta_test_mean']:+.4f} ± "
            f"{s['delta_test_std']:.4f} | {s['delta_test_positive']}/{n} | {fit('train/gate_fit_mean')} | "
            f"{fit('test/gate_fit_mean')} |")
    if teacher is not None:
        lines.append(f"| cross-encoder teacher (reference ceiling) | {teacher['validation_spearman']:.4f} | "
                     f"{teacher['validation_spearman'] - b['val/spearman']:+.4f} | | {teacher['test_spearman']:.4f} | "
                     f"{teacher['test_spearman'] - b['test/spearman']:+.4f} | | | |")
    by = dict(results)
    pairs = [("pair gated (ce_margin)", "pair gated (ce_margin), shuffled target"),
             ("pair gated (ce_margin)", "pair gated, constant gate"),
             ("pair gated (lexical)", "pair gated, constant gate"),
             ("per-sentence (surface)", "per-sentence (surface), shuffled c"),
             ("per-sentence (surface)", "per-sentence (surface), constant c")]
    diffs = [f"- {a} minus {c}: test {_paired_diff(by[a], by[c])}, val {_paired_diff(by[a], by[c], 'delta_val')}"
             for a, c in pairs if a in by and c in by]
    hr = headroom_of(data)
    lines += ["", "Per-seed differences (signal isolation, same seeds):", *diffs, "",
              "Headroom on train (correlation of the signal with |calibrated s0 - y|): " +
              ", ".join(f"{k} Pearson {v['pearson']:+.3f} / Spearman {v['spearman']:+.3f}" for k, v in hr.items())]
    if teacher is not None:
        folds = ", ".join(f"{f['val_spearman']:.3f}" for f in teacher.get("folds", []))
        lines.append(f"Teacher: {teacher['config']['model']}, {teacher['config'].get('folds')} folds x "
                     f"{teacher['config'].get('epochs')} epoch(s), lr {teacher['config'].get('lr')}; out-of-fold "
                     f"train Spearman {teacher['train_spearman']:.4f}; fold models' validation Spearman {folds}; "
                     f"{teacher['seconds']:.0f}s.")
    return "\n".join(lines) + "\n"
