"""Metrics: one contract for every evaluator.

`evaluate(scores, labels, binary, prefix)` returns a flat dict of prefixed names
(`val/spearman`, `test/roc_auc`, ...). The primary metric of every task is Spearman, maximised
(`PRIMARY_METRIC`, `PRIMARY_MODE`): Tune's metric/mode, model selection and MLflow read the same
names. Binary tasks add ROC-AUC, average precision, and accuracy / F1 at the best threshold, the
threshold chosen on the split given (pass `threshold=` to apply one chosen elsewhere).
"""
from __future__ import annotations

import numpy as np
from scipy import stats
from sklearn.metrics import average_precision_score, roc_auc_score

PRIMARY_METRIC = "spearman"
PRIMARY_MODE = "max"


def _as_1d(x, name: str) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64).reshape(-1)
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} holds {int((~np.isfinite(arr)).sum())} non-finite values.")
    return arr


def spearman(scores, labels) -> float:
    s, y = _as_1d(scores, "scores"), _as_1d(labels, "labels")
    return float(stats.spearmanr(s, y).statistic)


def pearson(scores, labels) -> float:
    s, y = _as_1d(scores, "scores"), _as_1d(labels, "labels")
    return float(stats.pearsonr(s, y).statistic)


def best_threshold(scores, labels) -> tuple[float, float, float, float]:
    """(threshold_acc, accuracy, threshold_f1, f1): predict positive when score >= threshold.

    Every distinct score is a candidate threshold; ties are handled as blocks, so the result equals
    a brute-force scan over thresholds.
    """
    s, y = _as_1d(scores, "scores"), _as_1d(labels, "labels").astype(bool)
    n, n_pos = len(s), int(y.sum())
    order = np.argsort(-s, kind="stable")
    s_sorted, y_sorted = s[order], y[order]
    tp = np.cumsum(y_sorted)  # positives predicted when the threshold is s_sorted[i]
    k = np.arange(1, n + 1)  # predicted positive
    last = np.r_[s_sorted[1:] != s_sorted[:-1], True]  # end of each tie block
    tp, k, thr = tp[last], k[last], s_sorted[last]
    fp = k - tp
    tn = (n - n_pos) - fp
    acc = (tp + tn) / n
    f1 = np.where(k + n_pos > 0, 2 * tp / np.maximum(k + n_pos, 1), 0.0)
    # threshold above every score: all negative
    acc0 = (n - n_pos) / n
    i_acc, i_f1 = int(np.argmax(acc)), int(np.argmax(f1))
    t_acc, a = (float(thr[i_acc]), float(acc[i_acc])) if acc[i_acc] >= acc0 else (float(np.inf), acc0)
    return t_acc, a, float(thr[i_f1]), float(f1[i_f1])


def evaluate(scores, labels, binary: bool, prefix: str = "", threshold: float | None = None) -> dict[str, float]:
    """Metric dict with names `<prefix>/<metric>` (no slash when prefix is empty)."""
    s, y = _as_1d(scores, "scores"), _as_1d(labels, "labels")
    if len(s) != len(y):
        raise ValueError(f"scores ({len(s)}) and labels ({len(y)}) differ in length.")
    if len(s) < 3:
        raise ValueError(f"Need at least 3 pairs to compute correlations; got {len(s)}.")
    out = {"spearman": spearman(s, y), "pearson": pearson(s, y)}
    if binary:
        if len(np.unique(y)) < 2:
            raise ValueError("Binary metrics need both classes in the labels; found one.")
        out["roc_auc"] = float(roc_auc_score(y, s))
        out["average_precision"] = float(average_precision_score(y, s))
        t_acc, acc, t_f1, f1 = best_threshold(s, y)
        out.update(accuracy=acc, f1=f1, threshold_acc=t_acc, threshold_f1=t_f1)
        if threshold is not None:
            pred = s >= threshold
            tp = float((pred & (y == 1)).sum())
            out["accuracy_at_threshold"] = float((pred == (y == 1)).mean())
            out["f1_at_threshold"] = 2 * tp / max(float(pred.sum()) + float((y == 1).sum()), 1.0)
    return {(f"{prefix}/{k}" if prefix else k): v for k, v in out.items()}


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine of (n, d) arrays -> (n,), computed in float64 and returned as float32 (see
    `adapters.sim_p`, which must give the same values: the baseline form is this cosine exactly)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    na = np.maximum(np.linalg.norm(a, axis=1), 1e-8)
    nb = np.maximum(np.linalg.norm(b, axis=1), 1e-8)
    return ((a * b).sum(axis=1) / (na * nb)).astype(np.float32)


def paired_bootstrap(scores, reference, labels, resamples: int = 1000, seed: int = 0,
                     level: float = 0.95) -> dict[str, float]:
    """Percentile interval of Spearman(scores) - Spearman(reference) over `resamples` resamples of the pairs with
    replacement, both scored on the same resample each time (paired), and the share of resamples where the delta is
    above 0. Resamples whose Spearman is undefined (a constant side) are dropped and counted."""
    s, r, y = _as_1d(scores, "scores"), _as_1d(reference, "reference"), _as_1d(labels, "labels")
    if not len(s) == len(r) == len(y) or len(s) < 3:
        raise ValueError(f"paired_bootstrap needs three arrays of one length >= 3; got {len(s)}, {len(r)}, {len(y)}.")
    if resamples < 1 or not 0 < level < 1:
        raise ValueError(f"paired_bootstrap: resamples={resamples} (>= 1), level={level} (in (0, 1)).")
    g = np.random.default_rng(seed)
    deltas = []
    for _ in range(resamples):
        i = g.integers(0, len(y), len(y))
        if np.ptp(y[i]) == 0 or np.ptp(s[i]) == 0 or np.ptp(r[i]) == 0:
            continue
        deltas.append(stats.spearmanr(s[i], y[i]).statistic - stats.spearmanr(r[i], y[i]).statistic)
    if not deltas:
        raise ValueError("paired_bootstrap: every resample had a constant side; the pairs are too few or too alike.")
    d = np.asarray(deltas)
    lo, hi = np.quantile(d, [(1 - level) / 2, (1 + level) / 2])
    return {"low": float(lo), "high": float(hi), "level": level, "resamples": len(d),
            "dropped": resamples - len(d), "share_above_0": float((d > 0).mean())}
