"""Pre-training diagnostics from frozen embeddings only.

- headroom: correlation (Pearson and Spearman) of each difficulty signal with the frozen baseline's
  error |calibrated s0 - y| on train, where calibration is the least-squares line y ~ a + b s0 fitted on
  train. A signal uncorrelated with the error cannot tell a gate where the baseline needs correcting.
- length collapse: mean cosine between random pairs of distinct sentences within each token-length
  bucket, for each attention temperature; mean pooling over long inputs drifts towards a common
  direction, which tau_attn < 1 is meant to counter.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np
from scipy import stats

from embed_lib.training.signals import tokens

LENGTH_BUCKETS = ((1, 8), (9, 16), (17, 32), (33, 64), (65, 10**9))


def baseline_error(s0: np.ndarray, y: np.ndarray) -> np.ndarray:
    """|a + b s0 - y| with (a, b) the least-squares fit on the given pairs."""
    b, a = np.polyfit(s0, y, 1)
    return np.abs(a + b * s0 - y)


def headroom(s0: np.ndarray, y: np.ndarray, signals: Mapping[str, np.ndarray]) -> dict[str, dict[str, float]]:
    err = baseline_error(np.asarray(s0, float), np.asarray(y, float))
    return {name: {"pearson": float(stats.pearsonr(v, err).statistic),
                   "spearman": float(stats.spearmanr(v, err).statistic)}
            for name, v in signals.items()}


def length_collapse(texts: list[str], vectors: Mapping[str, np.ndarray], pairs_per_bucket: int = 2000,
                    seed: int = 0) -> list[dict[str, float]]:
    """Rows {bucket, n_sentences, <label>: mean cosine} per token-length bucket (label: e.g. 'tau_attn=1.0')."""
    lengths = np.array([len(tokens(t)) for t in texts])
    rng = np.random.default_rng(seed)
    normed = {k: v / np.linalg.norm(v, axis=1, keepdims=True) for k, v in vectors.items()}
    rows = []
    for lo, hi in LENGTH_BUCKETS:
        idx = np.nonzero((lengths >= lo) & (lengths <= hi))[0]
        if len(idx) < 2:
            continue
        i, j = rng.choice(idx, pairs_per_bucket), rng.choice(idx, pairs_per_bucket)
        keep = i != j
        row = {"bucket": f"{lo}-{hi if hi < 10**9 else ''}".rstrip("-") + ("+" if hi >= 10**9 else ""),
               "n_sentences": int(len(idx))}
        for k, v in normed.items():
            row[k] = float((v[i[keep]] * v[j[keep]]).sum(1).mean())
        rows.append(row)
    return rows
