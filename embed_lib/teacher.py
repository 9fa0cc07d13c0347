"""The cross-encoder teacher behind the ce_margin difficulty target, held out by K-fold cross-fitting.

Used by `signals.ce_margin`: the teacher's score of a training pair must come from a model that never
trained on that pair. Two modes:
- fine-tuned (default, offline): K cross-encoders from the `model` weights (sentence-transformers'
  CrossEncoder, a fresh 1-logit head, BCE on the normalised label, AdamW with linear warmup and decay);
  fold k trains on the other K-1 folds of train and scores fold k (out-of-fold); validation and test are
  scored by the mean of the K fold models;
- pretrained (`pretrained=True`): a cross-encoder named by the user scores every split as it is.

Scores are cached like embeddings, keyed by the teacher config and the task's data fingerprints, with
the teacher's own validation Spearman (against the frozen baseline's) in the record: check it before
trusting its margin — a teacher weaker than the frozen cosine carries little signal.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from embed_lib.config import _check_int, _check_range, default_cache_dir
from embed_lib.encoders import resolve_model
from embed_lib.tasks import PairData

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TeacherConfig:
    """How the teacher is obtained. Part of the teacher-score cache key."""

    #: cross-encoder base weights (fine-tuned) or a pretrained cross-encoder id / path; alias "minilm"
    model: str = "minilm"
    #: True: `model` is already a cross-encoder; score without training
    pretrained: bool = False
    #: folds of the cross-fitting (every train pair scored by a model that did not see it)
    folds: int = 2
    epochs: int = 1
    #: 1e-4 with warmup: 2e-5 leaves a one-epoch MiniLM teacher far below the frozen cosine
    lr: float = 1e-4
    warmup: float = 0.1
    batch_size: int = 16
    max_length: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        _check_int("TeacherConfig.folds", self.folds, 2, 20)
        _check_int("TeacherConfig.epochs", self.epochs, 1, 50)
        _check_range("TeacherConfig.lr", self.lr, 0.0, 1.0, low_open=True)
        _check_range("TeacherConfig.warmup", self.warmup, 0.0, 1.0)
        _check_int("TeacherConfig.batch_size", self.batch_size, 1, 1024)
        _check_int("TeacherConfig.max_length", self.max_length, 8, 4096)


def _pairs(d: PairData, rows: np.ndarray | None = None) -> list[list[str]]:
    rows = np.arange(len(d)) if rows is None else rows
    return [[d.sentence1[i], d.sentence2[i]] for i in rows]


def _load(cfg: TeacherConfig, device: str):
    from sentence_transformers import CrossEncoder

    path = resolve_model(cfg.model)
    try:
        ce = CrossEncoder(path, num_labels=None if cfg.pretrained else 1, device=device, max_length=cfg.max_length)
    except Exception as exc:
        raise ValueError(f"Could not load cross-encoder {cfg.model!r} ({path}): {exc}") from exc
    return ce


def _fit(ce, pairs: list[list[str]], y: np.ndarray, cfg: TeacherConfig, seed: int) -> None:
    torch.manual_seed(seed)
    model = ce.model
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    steps_per_epoch = math.ceil(len(pairs) / cfg.batch_size)
    total = steps_per_epoch * cfg.epochs
    warm = max(1, int(cfg.warmup * total))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else max(0.0, (total - s) / max(1, total - warm)))
    g = torch.Generator().manual_seed(seed)
    yt = torch.as_tensor(y, dtype=torch.float32)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    for _ in range(cfg.epochs):
        order = torch.randperm(len(pairs), generator=g).tolist()
        for i in range(0, len(order), cfg.batch_size):
            idx = order[i: i + cfg.batch_size]
            features = ce.preprocess([pairs[j] for j in idx])
            features = {k: v.to(ce.device) if isinstance(v, torch.Tensor) else v for k, v in features.items()}
            logits = ce(features)["scores"].view(-1)
            loss = loss_fn(logits, yt[idx].to(logits.device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    model.eval()


def _predict(ce, pairs: list[list[str]], batch_size: int) -> np.ndarray:
    return np.asarray(ce.predict(pairs, batch_size=max(batch_size, 32), show_progress_bar=False), dtype=np.float32).reshape(-1)


def teacher_key(cfg: TeacherConfig, splits: Mapping[str, PairData]) -> str:
    blob = json.dumps({"teacher": dataclasses.asdict(cfg), "version": 1,
                       "data": {k: v.fingerprint for k, v in sorted(splits.items())}}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def teacher_scores(splits: Mapping[str, PairData], cfg: TeacherConfig | None = None,
                   cache_root: str | Path | None = None, device: str | None = None) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Held-out teacher scores per split and the teacher record (config, per-fold validation Spearman,
    seconds). Cached under <cache_root>/teacher/<key>.npz + .json."""
    from scipy import stats

    cfg = cfg or TeacherConfig()
    missing = [s for s in ("train", "validation", "test") if s not in splits]
    if missing:
        raise ValueError(f"teacher_scores needs the splits train, validation and test; missing {missing}.")
    root = (Path(cache_root) if cache_root else default_cache_dir()) / "teacher"
    key = teacher_key(cfg, splits)
    npz, meta_path = root / f"{key}.npz", root / f"{key}.json"
    if npz.is_file() and meta_path.is_file():
        try:
            with np.load(npz, allow_pickle=False) as f:
                scores = {k: f[k] for k in f.files}
            record = json.loads(meta_path.read_text())
            if all(len(scores[k]) == len(splits[k]) for k in splits) and record.get("key") == key:
                return scores, record
        except (OSError, ValueError, KeyError):
            pass
        log.warning("Teacher cache %s is corrupt or incomplete; recomputing.", npz)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    train, val, test = splits["train"], splits["validation"], splits["test"]
    record: dict[str, Any] = {"key": key, "config": dataclasses.asdict(cfg), "task": train.task, "folds": []}
    if cfg.pretrained:
        ce = _load(cfg, device)
        scores = {name: _predict(ce, _pairs(d), cfg.batch_size) for name, d in splits.items()}
    else:
        n = len(train)
        fold_of = np.random.default_rng(cfg.seed).permutation(n) % cfg.folds
        oof = np.zeros(n, dtype=np.float32)
        val_sum = np.zeros(len(val), dtype=np.float64)
        test_sum = np.zeros(len(test), dtype=np.float64)
        for k in range(cfg.folds):
            ce = _load(cfg, device)
            fit_rows, held = np.nonzero(fold_of != k)[0], np.nonzero(fold_of == k)[0]
            _fit(ce, _pairs(train, fit_rows), train.label[fit_rows], cfg, cfg.seed * 100 + k)
            oof[held] = _predict(ce, _pairs(train, held), cfg.batch_size)
            v = _predict(ce, _pairs(val), cfg.batch_size)
            val_sum += v
            test_sum += _predict(ce, _pairs(test), cfg.batch_size)
            record["folds"].append({"fold": k, "fit_pairs": len(fit_rows), "held_out": len(held),
                                    "val_spearman": float(stats.spearmanr(v, val.label).statistic)})
            log.info("teacher fold %d/%d: val Spearman %.4f", k + 1, cfg.folds, record["folds"][-1]["val_spearman"])
        scores = {"train": oof, "validation": (val_sum / cfg.folds).astype(np.float32),
                  "test": (test_sum / cfg.folds).astype(np.float32)}
    for name, d in splits.items():
        record[f"{name}_spearman"] = float(stats.spearmanr(scores[name], d.label).statistic)
    record["seconds"] = round(time.perf_counter() - t0, 1)
    root.mkdir(parents=True, exist_ok=True)
    tmp = npz.with_suffix(".tmp.npz")
    np.savez(tmp, **scores)
    tmp.replace(npz)
    meta_path.write_text(json.dumps(record, indent=2))
    return scores, record
