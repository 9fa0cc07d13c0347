"""The cross-encoder teacher behind the ce_margin difficulty target, held out by K-fold cross-fitting.

Used by `signals.ce_margin`: the teacher's score of a training pair must come from a model that never
trained on that pair. Two modes:
- fine-tuned (default, offline): K cross-encoders from the `model` weights (sentence-transformers'
  CrossEncoder, a fresh 1-logit head). Fold k trains on the other K-1 folds of train and scores fold k
  (out-of-fold); validation, test and any other split given (the silver pairs of distillation,
  `embed_lib.training.silver`) are scored by the mean of the K fold models. The recipe: both pair
  orders in training and averaged at scoring (a cross-encoder is not symmetric by construction),
  length-bucketed batches (less padding), AdamW without weight decay on biases and norms, linear warmup
  then linear decay, gradient clipping, and early stopping on a slice held out of the fold's own
  training part (never the out-of-fold pairs it will score, never validation or test). The presets start
  every fold from an intermediate stage: the backbone trained once on the other tasks' train pairs
  (`embed_lib.teacher.intermediate`; STS-B test 0.823 -> 0.837 with the light recipe);
- pretrained (`pretrained=True`): a cross-encoder named by the user scores every split as it is.

The teacher backbone is independent of the frozen encoder: a teacher that shares the encoder's weights
tends to share its errors, and then its margin tells the gate little (see `error_correlation`).

Scores are cached like embeddings, keyed by the teacher config and the task's data fingerprints; the
record holds the recipe, per-fold learning curves, seconds and pairs/s. Check the teacher's own
Spearman against the frozen baseline's (and its error correlation) before trusting its margin.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch

from embed_lib.config import default_cache_dir
from embed_lib.data.tasks import PairData
from embed_lib.encoding.cache import atomic_write, one_at_a_time
from embed_lib.teacher import recipe, workers
from embed_lib.teacher.config import LATER_FIELDS, PRESETS, TeacherConfig, preset_of
from embed_lib.teacher.intermediate import stage_key, warm_start
from embed_lib.training.signals import rank_normalise
from embed_lib.training.silver import SILVER

log = logging.getLogger(__name__)


def fold_assignment(n: int, folds: int, seed: int) -> np.ndarray:
    """(n,) fold of every train pair: a seeded permutation modulo K (fold sizes differ by at most one)."""
    return (np.random.default_rng(seed).permutation(n) % folds).astype(np.int64)


def _pairs(d: PairData, rows: np.ndarray | None = None) -> list[list[str]]:
    rows = np.arange(len(d)) if rows is None else rows
    return [[d.sentence1[i], d.sentence2[i]] for i in rows]


def teacher_key(cfg: TeacherConfig, splits: Mapping[str, PairData]) -> str:
    config = dataclasses.asdict(cfg)
    # the stage enters as its own key (its tasks, however spelled, their data and its recipe); teachers without
    # a stage keep the keys (and caches) they had before stages existed
    del config["intermediate"], config["intermediate_pairs"]
    for name, default in LATER_FIELDS.items():
        if config[name] == default:
            del config[name]
    if cfg.intermediate:
        own = {k: v for k, v in splits.items() if k in ("train", "validation", "test")}  # not the silver pairs
        config["intermediate_key"] = stage_key(cfg, own)
    blob = json.dumps({"teacher": config, "version": 2,
                       "data": {k: v.fingerprint for k, v in sorted(splits.items())}}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _read_cache(npz: Path, meta_path: Path, key: str, splits: Mapping[str, PairData]):
    try:
        with np.load(npz, allow_pickle=False) as f:
            scores = {k: f[k] for k in f.files}
        record = json.loads(meta_path.read_text())
        if all(len(scores[k]) == len(splits[k]) for k in splits) and record.get("key") == key:
            return scores, record
    except (OSError, ValueError, KeyError):
        pass
    log.warning("Teacher cache %s is corrupt or incomplete; recomputing.", npz)
    return None


def fit_on_rows(ce, train: PairData, rows: np.ndarray, cfg: TeacherConfig, split_seed: int, fit_seed: int,
                progress: Callable[[str], None]) -> tuple[list[dict[str, float]], int, int]:
    """Fine-tune `ce` on train[rows], a seeded `early_stopping_fraction` of them held out for early
    stopping (never validation or test). Returns (per-epoch curve, pairs fitted, pairs held out)."""
    n_es = int(round(cfg.early_stopping_fraction * len(rows)))
    perm = np.random.default_rng(split_seed).permutation(rows)
    es_rows, fit_rows = np.sort(perm[:n_es]), np.sort(perm[n_es:])
    curve = recipe.fit(ce, _pairs(train, fit_rows), train.label[fit_rows], cfg, fit_seed,
                  _pairs(train, es_rows) if n_es else None, train.label[es_rows] if n_es else None, progress)
    return curve, len(fit_rows), n_es


def _fold(splits: Mapping[str, PairData], cfg: TeacherConfig, device: str, start: str | None, k: int,
          progress: Callable[[str], None]) -> dict[str, Any]:
    """Fold k of the cross-fitting: a model from `start` fine-tuned on the other folds' train rows; its scores of its
    held-out rows, of validation and of test, and its record. Module-level: it may run in a worker process."""
    t0 = time.perf_counter()
    train, val, test = splits["train"], splits["validation"], splits["test"]
    fold_of = fold_assignment(len(train), cfg.folds, cfg.seed)
    held = np.nonzero(fold_of == k)[0]
    ce = recipe.load(cfg, device, start, seed=cfg.seed * 100 + k)  # a new head: the same in whichever process
    say = lambda msg: progress(f"teacher fold {k + 1}/{cfg.folds}: {msg}")  # noqa: E731
    curve, n_fit, n_es = fit_on_rows(ce, train, np.nonzero(fold_of != k)[0], cfg, cfg.seed * 1000 + k,
                                     cfg.seed * 100 + k, say)
    oof = recipe.predict(ce, _pairs(train, held), cfg)
    t_pred = time.perf_counter()
    v, t = recipe.predict(ce, _pairs(val), cfg), recipe.predict(ce, _pairs(test), cfg)
    predict_seconds = time.perf_counter() - t_pred
    # any other split (the silver pairs of distillation) is scored like validation: by every fold model, averaged
    extra = {name: recipe.predict(ce, _pairs(d), cfg) for name, d in splits.items()
             if name not in ("train", "validation", "test")}
    rec = {"fold": k, "fit_pairs": n_fit, "early_stopping_pairs": n_es, "held_out": len(held),
           "epochs_run": len(curve), "best_epoch": (max(curve, key=lambda c: c["early_stopping_spearman"])["epoch"]
                                                    if n_es else len(curve)),
           "curve": curve, "held_out_spearman": recipe.spearman_or_nan(oof, train.label[held]),
           "val_spearman": recipe.spearman_or_nan(v, val.label), "seconds": round(time.perf_counter() - t0, 1)}
    say(f"held-out Spearman {rec['held_out_spearman']:.4f}, validation {rec['val_spearman']:.4f}, "
        f"{rec['seconds']:.0f}s")
    return {"held": held, "oof": oof, "validation": v, "test": t, **extra, "predict_seconds": predict_seconds,
            "record": rec}


def _cross_fit(splits: Mapping[str, PairData], cfg: TeacherConfig, device: str, start: str | None,
               record: dict[str, Any], progress: Callable[[str], None], fold_workers: int | None
               ) -> dict[str, np.ndarray]:
    train, val, test = splits["train"], splits["validation"], splits["test"]
    examples = workers.examples_per_fold(len(train), cfg.folds, cfg.both_orders, cfg.epochs)
    n_workers, threads = workers.fold_plan(cfg.folds, examples, device, fold_workers)
    record["fold_processes"], record["fold_threads"] = n_workers, threads or torch.get_num_threads()
    if n_workers > 1:
        progress(f"teacher: {cfg.folds} folds at once, in {n_workers} processes of {threads} thread(s)")
    folds = workers.run_folds(_fold, [(dict(splits), cfg, device, start, k) for k in range(cfg.folds)], n_workers,
                              threads, progress)
    oof = np.zeros(len(train), dtype=np.float32)
    for f in folds:
        oof[f["held"]] = f["oof"]
    record["folds"] = [f["record"] for f in folds]
    # pairs/s of the scoring ensemble as used for validation and test (K models, both orders each)
    record["predict_pairs_per_s"] = round((len(val) + len(test)) / max(sum(f["predict_seconds"] for f in folds),
                                                                       1e-9), 1)
    mean = lambda split: (np.sum([f[split] for f in folds], axis=0, dtype=np.float64) / cfg.folds)  # noqa: E731
    return {"train": oof, **{name: mean(name).astype(np.float32) for name in splits if name != "train"}}


def teacher_scores(splits: Mapping[str, PairData], cfg: TeacherConfig | None = None,
                   cache_root: str | Path | None = None, device: str | None = None,
                   progress: Callable[[str], None] | None = None,
                   compute: Callable[[dict[str, PairData], TeacherConfig], tuple[dict, dict]] | None = None,
                   fold_workers: int | None = None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Held-out teacher scores (logits) per split and the teacher record (recipe, per-fold curves, Spearman
    per split, seconds, pairs/s). Cached under <cache_root>/teacher/<key>.npz + .json.

    compute: what produces them on a cache miss instead of this process (`compute(splits, cfg)` -> (scores,
    record)), e.g. a Ray task on a GPU node that returns them through the object store; they are cached here.
    fold_workers: processes training the folds at once (`workers.fold_plan`): None / 0 decides by the machine (on a
    CPU of 2+ cores, all folds at once), 1 one after another in this process. It changes no figure beyond rounding,
    so it is not part of the cache key. Processes asking at once for the same teacher not yet cached make it once:
    the others wait for it (`one_at_a_time`), then read the cache."""
    cfg = cfg or TeacherConfig()
    workers.check_workers(fold_workers)
    missing = [s for s in ("train", "validation", "test") if s not in splits]
    if missing:
        raise ValueError(f"teacher_scores needs the splits train, validation and test; missing {missing}.")
    root = (Path(cache_root) if cache_root else default_cache_dir()) / "teacher"
    key = teacher_key(cfg, splits)
    hit = _cached(root, key, splits, cfg)
    if hit is not None:
        return hit
    progress = progress or log.info
    with one_at_a_time(root / key, f"teacher {key}", progress):
        # a process that made the same teacher while this one waited for it has cached it
        hit = _cached(root, key, splits, cfg)
        if hit is not None:
            return hit
        if compute is not None:
            scores, record = compute(dict(splits), cfg)
            _refuse_non_finite(scores, cfg)
            _write_cache(root / f"{key}.npz", root / f"{key}.json", scores, record)
            return scores, record
        return _train(splits, cfg, root, key, device, progress, fold_workers)


def _cached(root: Path, key: str, splits: Mapping[str, PairData],
            cfg: TeacherConfig) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
    npz, meta_path = root / f"{key}.npz", root / f"{key}.json"
    hit = _read_cache(npz, meta_path, key, splits) if npz.is_file() and meta_path.is_file() else None
    # the preset's name as today's presets give it: a preset may have changed since
    return None if hit is None else (hit[0], {**hit[1], "preset": preset_of(cfg)})


def _train(splits: Mapping[str, PairData], cfg: TeacherConfig, root: Path, key: str, device: str | None,
           progress: Callable[[str], None], fold_workers: int | None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    if cfg.pretrained:
        progress(f"teacher: {cfg.model} (pretrained) has not scored this data yet (key {key}): scoring it, cached "
                 "for later runs")
    else:
        others = [p for p in _cached_recipes(root, splits["train"].task) if p in PRESETS and p != preset_of(cfg)]
        progress(f"teacher: the {preset_of(cfg)} recipe is not cached for this data (key {key}); training it, the "
                 "longest step on a CPU, cached for later runs" + (
                     f" (cached here for {splits['train'].task}: the {others[0]} recipe, --teacher-preset {others[0]})"
                     if others else ""))
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    record: dict[str, Any] = {"key": key, "config": dataclasses.asdict(cfg), "preset": preset_of(cfg),
                              "task": splits["train"].task, "device": device, "threads": torch.get_num_threads(),
                              "precision": recipe.effective_precision(cfg, torch.device(device)), "folds": []}
    if cfg.pretrained:
        ce = recipe.load(cfg, device)
        scores = {name: recipe.predict(ce, _pairs(d), cfg) for name, d in splits.items()}
    else:
        # the stage leaves out the task's own pairs; silver pairs are train sentences recombined, and keep its key
        own = {k: splits[k] for k in ("train", "validation", "test")}
        start, record["intermediate"] = warm_start(cfg, own, root, device, progress)
        scores = _cross_fit(splits, cfg, device, start, record, progress, fold_workers)
    _refuse_non_finite(scores, cfg)
    for name, d in splits.items():
        if name != SILVER:  # silver pairs have no labels to check the teacher against
            record[f"{name}_spearman"] = recipe.spearman_or_nan(scores[name], d.label)
    record["seconds"] = round(time.perf_counter() - t0, 1)
    trained = sum(c["pairs_per_s"] * c["seconds"] for f in record["folds"] for c in f["curve"])
    train_s = sum(c["seconds"] for f in record["folds"] for c in f["curve"])
    record["train_pairs_per_s"] = round(trained / train_s, 1) if train_s else None
    _write_cache(root / f"{key}.npz", root / f"{key}.json", scores, record)
    return scores, record


def _cached_recipes(root: Path, task: str) -> list[str]:
    """The recipes (preset names) of the teachers cached under `root` for `task`, most recent first: what to name
    when another is about to be trained (`python -m embed_lib train --target ce_margin`, whose default is the study's
    strong recipe, after `make run` cached the fast one)."""
    out = []
    for meta in sorted(root.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            rec = json.loads(meta.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and rec.get("task") == task and rec.get("preset") not in (None, *out):
            out.append(rec["preset"])
    return out


def _refuse_non_finite(scores: Mapping[str, np.ndarray], cfg: TeacherConfig) -> None:
    """ValueError naming the splits and counts where a teacher's scores are not all finite (a diverged fold), before
    anything is cached: every later run would read a cached NaN teacher."""
    bad = {name: int((~np.isfinite(v)).sum()) for name, v in scores.items() if not np.isfinite(v).all()}
    if bad:
        fix = ("check the cross-encoder's weights (a corrupt or mismatched model)" if cfg.pretrained else
               "its training diverged: lower its learning rate (--teacher-lr) or train it in fp32 "
               "(--teacher-precision fp32)")
        raise ValueError(f"The teacher ({cfg.model}) gave non-finite scores "
                         f"({', '.join(f'{n}: {k} pairs' for n, k in bad.items())}); nothing was cached. "
                         f"{fix[0].upper()}{fix[1:]}.")


def _write_cache(npz: Path, meta_path: Path, scores: Mapping[str, np.ndarray], record: dict[str, Any]) -> None:
    """The scores, then their record, each through a file of this call's own (two sweeps that trained the same
    teacher at once wrote one fixed temporary file: the later one's rename found it gone and failed)."""
    npz.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(npz, lambda fh: np.savez(fh, **scores))
    atomic_write(meta_path, lambda fh: fh.write(json.dumps(record, indent=2).encode()))


def error_correlation(teacher: np.ndarray, s0: np.ndarray, y: np.ndarray) -> float:
    """Pearson correlation of the rank errors r(teacher) - r(y) and r(s0) - r(y), ranks scaled to [0, 1].
    Near 1: the teacher fails where the frozen cosine fails, and its margin carries little."""
    ry = rank_normalise(y)
    et, es = rank_normalise(teacher) - ry, rank_normalise(s0) - ry
    if np.std(et) == 0 or np.std(es) == 0:
        return float("nan")
    return float(np.corrcoef(et, es)[0, 1])


def rank_average(teacher: np.ndarray, s0: np.ndarray) -> np.ndarray:
    """(n,) mean of the two scores' normalised ranks: the simplest ensemble of teacher and cosine."""
    return (rank_normalise(teacher) + rank_normalise(s0)) / 2


def quality_report(scores: Mapping[str, np.ndarray], s0: Mapping[str, np.ndarray],
                   y: Mapping[str, np.ndarray]) -> dict[str, dict[str, float]]:
    """Per split: the teacher's Spearman, the cosine's, their error correlation and the rank average's Spearman."""
    return {split: {"teacher_spearman": recipe.spearman_or_nan(scores[split], y[split]),
                    "cosine_spearman": recipe.spearman_or_nan(s0[split], y[split]),
                    "error_correlation": error_correlation(scores[split], s0[split], y[split]),
                    "rank_average_spearman": recipe.spearman_or_nan(rank_average(scores[split], s0[split]), y[split])}
            for split in scores if split in s0 and split in y}
