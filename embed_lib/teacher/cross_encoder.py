"""The teacher as a servable cross-encoder: one model on all of train, saved, calibrated, registered.

The K-fold teacher (`embed_lib.teacher.scores`) exists to give held-out scores to training pairs; its fold
models are not what a service should run (K models, each trained on part of the data). For serving and
for the cascade, `served_teacher` trains one cross-encoder on the whole train split with the same recipe
(early stopping on a slice of train, never on validation or test), scores validation and test, and
saves it next to the teacher's scores:

    <cache_root>/teacher/<teacher key>/served/   model.safetensors, config.json, tokenizer files,
                                                 teacher.json (recipe, figures, calibration), scores.npz

`teacher.json` carries a calibration: quantiles of the model's logits and of the frozen cosine on the
validation split, so a cascade can put a cross-encoder score on the cosine's scale (a monotone map:
the cross-encoder's order is kept) and mix it with adapter scores. `PairCrossEncoder` scores pairs with
such a folder (or any cross-encoder id / path) through torch or ONNX Runtime; `log_cross_encoder`
registers it in MLflow as `cross-encoder-<task>` (safetensors + JSON, loaded without unpickling).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from embed_lib.config import check_backend, default_cache_dir
from embed_lib.data.tasks import PairData
from embed_lib.encoding.batching import SLACK, length_batches
from embed_lib.encoding.cache import one_at_a_time
from embed_lib.encoding.onnx_backend import cross_encoder_max_tokens, cross_encoder_runner
from embed_lib.encoding.weights import check_local, one_line, resolve_model
from embed_lib.teacher import recipe
from embed_lib.teacher.config import TeacherConfig
from embed_lib.teacher.intermediate import warm_start
from embed_lib.teacher.scores import _pairs, error_correlation, fit_on_rows, teacher_key

log = logging.getLogger(__name__)

RECORD = "teacher.json"


def _quantiles(x: np.ndarray, n: int = 101) -> list[float]:
    return [float(v) for v in np.quantile(np.asarray(x, dtype=np.float64), np.linspace(0, 1, n))]


def calibrate(logits: np.ndarray, calibration: Mapping[str, Sequence[float]]) -> np.ndarray:
    """Cross-encoder logits -> the frozen cosine's scale: the cosine's quantile at the logit's quantile
    (both taken on the validation split). Monotone, so the cross-encoder's order is unchanged."""
    q_logit = np.asarray(calibration["logit"], dtype=np.float64)
    q_cos = np.asarray(calibration["cosine"], dtype=np.float64)
    q_logit = q_logit + np.arange(len(q_logit)) * 1e-9  # strictly increasing for np.interp (ties in the logits)
    return np.interp(np.asarray(logits, dtype=np.float64), q_logit, q_cos).astype(np.float32)


def served_dir(cfg: TeacherConfig, splits: Mapping[str, PairData], cache_root: str | Path | None = None) -> Path:
    return (Path(cache_root) if cache_root else default_cache_dir()) / "teacher" / teacher_key(cfg, splits) / "served"


def served_teacher(splits: Mapping[str, PairData], cfg: TeacherConfig, s0: Mapping[str, np.ndarray],
                   cache_root: str | Path | None = None, device: str | None = None,
                   progress: Callable[[str], None] | None = None) -> tuple[Path, dict[str, Any]]:
    """(folder, record) of the served teacher of `cfg` on these splits; trained once, then read from the
    cache. `s0`: the frozen cosine per split (validation for the calibration; both for the record)."""
    folder = served_dir(cfg, splits, cache_root)
    progress = progress or log.info
    if _complete(folder):
        return folder, json.loads((folder / RECORD).read_text())
    with one_at_a_time(folder, "served teacher", progress):
        if _complete(folder):  # trained by a process this one waited for
            return folder, json.loads((folder / RECORD).read_text())
        return folder, _train_served(splits, cfg, s0, folder, device, progress)


def _complete(folder: Path) -> bool:
    return (folder / RECORD).is_file() and (folder / "scores.npz").is_file()


def _train_served(splits: Mapping[str, PairData], cfg: TeacherConfig, s0: Mapping[str, np.ndarray], folder: Path,
                  device: str | None, progress: Callable[[str], None]) -> dict[str, Any]:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    train, val, test = splits["train"], splits["validation"], splits["test"]
    t0 = time.perf_counter()
    start, stage = warm_start(cfg, splits, folder.parent.parent, device, progress)
    ce = recipe.load(cfg, device, start)
    curve: list[dict[str, float]] = []
    if not cfg.pretrained:
        curve, _, _ = fit_on_rows(ce, train, np.arange(len(train)), cfg, cfg.seed * 1000 + 999, cfg.seed * 100 + 99,
                                  lambda msg: progress(f"served teacher: {msg}"))
    fit_seconds = time.perf_counter() - t0
    t1 = time.perf_counter()
    scores = {"validation": recipe.predict(ce, _pairs(val), cfg), "test": recipe.predict(ce, _pairs(test), cfg)}
    predict_s = time.perf_counter() - t1
    record: dict[str, Any] = {
        "task": train.task, "teacher_key": folder.parent.name, "config": dataclasses.asdict(cfg),
        "recipe": ("pretrained, not trained" if cfg.pretrained else
                   f"one model on all of train, <= {cfg.epochs} epoch(s), " + (
                       f"{cfg.early_stopping_fraction:.0%} of train held out for early stopping"
                       if cfg.early_stopping_fraction else "no early stopping")),
        "both_orders": cfg.both_orders, "max_length": cfg.max_length, "intermediate": stage, "curve": curve,
        "precision": recipe.effective_precision(cfg, torch.device(device)),
        "fit_seconds": round(fit_seconds, 1),
        "predict_pairs_per_s": round((len(val) + len(test)) / max(predict_s, 1e-9), 1),
        "calibration": {"logit": _quantiles(scores["validation"]), "cosine": _quantiles(s0["validation"])}}
    for split, d in (("validation", val), ("test", test)):
        record[f"{split}_spearman"] = recipe.spearman_or_nan(scores[split], d.label)
        record[f"{split}_cosine_spearman"] = recipe.spearman_or_nan(s0[split], d.label)
        record[f"{split}_error_correlation"] = error_correlation(scores[split], s0[split], d.label)
    folder.mkdir(parents=True, exist_ok=True)
    ce.save_pretrained(str(folder), safe_serialization=True)
    np.savez(folder / "scores.npz", **scores)
    (folder / RECORD).write_text(json.dumps(record, indent=2))  # last: its presence marks a complete folder
    return record


class PairCrossEncoder:
    """Scores pairs with a cross-encoder folder (a served teacher, with its calibration) or any cross-encoder
    id / path, through torch or ONNX Runtime (`backend`: torch, onnx, onnx-int8)."""

    def __init__(self, path: str | Path, backend: str = "torch", cache_root: str | Path | None = None,
                 threads: int | None = None, batch_size: int = 32, slack: float = SLACK) -> None:
        check_backend(backend, "cross_encoder_backend")
        check_local(str(path), "cross-encoder")
        self.path, self.backend, self.batch_size, self.slack = str(path), backend, batch_size, slack
        record_file = Path(path) / RECORD
        self.record = json.loads(record_file.read_text()) if record_file.is_file() else {}
        self.calibration = self.record.get("calibration")
        self.both_orders = bool(self.record.get("both_orders", False))
        kw = {"max_length": self.record["max_length"]} if "max_length" in self.record else {}
        # lazy: sentence-transformers takes seconds to import, and a cache hit never needs the model
        from sentence_transformers import CrossEncoder

        try:
            self.ce = CrossEncoder(resolve_model(str(path)), device="cpu", **kw)
        except Exception as exc:
            raise ValueError(f"Could not load cross-encoder {str(path)!r}: {one_line(exc)}. Give a cross-encoder id, "
                             "a local directory, or a models:/cross-encoder-<task> URI.") from exc
        self.ce.model.eval()
        # one tokenizer call at a time (see FrozenEncoder): the forward passes of two threads still run in parallel
        self._tokenizing = threading.Lock()
        self.runner = None
        if backend != "torch":
            self.runner = cross_encoder_runner(self.ce, backend, str(path),
                                               Path(cache_root) if cache_root else default_cache_dir(), threads)

    @torch.inference_mode()
    def _logits_one_order(self, pairs: list[list[str]]) -> np.ndarray:
        out = np.empty(len(pairs), dtype=np.float32)
        for idx in length_batches(self.token_lengths(pairs), self.batch_size, self.slack):
            with self._tokenizing:
                features = self.ce.preprocess([pairs[i] for i in idx])
            out[idx] = (self.runner.run(features) if self.runner is not None
                        else recipe.logits_of(self.ce, features).float().numpy())
        return out

    def token_lengths(self, pairs: Sequence[Sequence[str]]) -> list[int]:
        """Tokens of each pair as the model reads it (both texts, special tokens, truncation)."""
        with self._tokenizing:
            return recipe.token_lengths(self.ce, pairs, cross_encoder_max_tokens(self.ce)).tolist()

    def logits(self, pairs: Sequence[Sequence[str]]) -> np.ndarray:
        """(n,) logits; the mean over both orders for a teacher trained on both."""
        pairs = [[a, b] for a, b in pairs]
        if not pairs:
            return np.zeros(0, np.float32)
        out = self._logits_one_order(pairs)
        if self.both_orders:
            out = (out + self._logits_one_order([[b, a] for a, b in pairs])) / 2
        return out

    @property
    def middle(self) -> float | None:
        """The middle of the cosine's scale, as the calibration saw it (its median validation cosine), where a
        cascade routes `cosine_middle` by default; None without a calibration (a request's own median then)."""
        cal = self.calibration
        return cal["cosine"][len(cal["cosine"]) // 2] if cal else None

    def to_score(self, z: np.ndarray) -> np.ndarray:
        """Logits -> scores: on the frozen cosine's scale when the folder has a calibration, else sigmoid."""
        if self.calibration:
            return calibrate(z, self.calibration)
        return (1 / (1 + np.exp(-np.asarray(z, dtype=np.float64)))).astype(np.float32)

    def score(self, pairs: Sequence[Sequence[str]]) -> np.ndarray:
        """(n,) scores of the pairs (see `to_score`)."""
        return self.to_score(self.logits(pairs))


