"""Difficulty signals: per-sentence surface complexity, lexical hard-pair, cross-encoder margin.

Fourth stage of the data flow (... cache -> **signals** -> adapters). None of them reads the frozen
embeddings' errors on the pair being scored, so they are non-circular targets for a gate:

- surface(text): weighted mean of capped, normalised surface features, in [0, 1];
- lexical(a, b, y) = |jaccard(tokens_a, tokens_b) - y|: high-overlap non-paraphrases and low-overlap
  paraphrases are hard; `per_sentence_mean` aggregates it per sentence for per-sentence gates;
- ce_margin = |r(ce) - r(s0)|, r(v) = (rank(v) - 1) / (n - 1) the rank normalised to [0, 1] within the
  split (ties: average rank): how far a held-out cross-encoder disagrees with the frozen baseline,
  on the rank scale so that the two scores' calibrations do not matter.
"""
from __future__ import annotations

import re
from typing import Mapping, Sequence

import numpy as np
from scipy.stats import rankdata

_TOKEN = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")
_PUNCT = re.compile(r"[^\w\s]")
CONJUNCTIONS = frozenset("and or but nor yet so".split())
SUBORDINATORS = frozenset(("because although though while whereas if unless since when whenever where "
                           "wherever after before until that which who whom whose whether").split())
AUXILIARIES = frozenset(("is are was were be been being am has have had do does did will would shall should "
                         "can could may might must").split())
DETERMINERS = frozenset("the a an this that these those his her its their our my your some any each every".split())

#: feature -> cap (value / cap, clipped to 1). Chosen near the 95th percentile of STS-B sentences.
SURFACE_CAPS = {"tokens": 40, "chars": 220, "punct": 8, "conjunctions": 4, "subordinators": 4, "clauses": 6,
                "verbs": 8, "arguments": 10}
SURFACE_WEIGHTS = {k: 1.0 for k in SURFACE_CAPS}


def tokens(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


def surface_features(text: str) -> dict[str, float]:
    """Raw counts; verbs and arguments are proxies (auxiliaries and -ed/-ing forms; determiners + pronouns)."""
    toks = tokens(text)
    conj = sum(t in CONJUNCTIONS for t in toks)
    sub = sum(t in SUBORDINATORS for t in toks)
    verbs = sum(t in AUXILIARIES or t.endswith(("ed", "ing")) for t in toks)
    args = sum(t in DETERMINERS or t in ("he", "she", "it", "they", "we", "i", "you") for t in toks)
    return {"tokens": len(toks), "chars": len(text), "punct": len(_PUNCT.findall(text)), "conjunctions": conj,
            "subordinators": sub, "clauses": 1 + conj + sub + text.count(";"), "verbs": verbs, "arguments": args}


def surface_complexity(texts: Sequence[str], weights: Mapping[str, float] | None = None) -> np.ndarray:
    """(n,) in [0, 1]: sum_f w_f * min(x_f / cap_f, 1) / sum_f w_f."""
    weights = dict(SURFACE_WEIGHTS if weights is None else weights)
    unknown = sorted(set(weights) - set(SURFACE_CAPS))
    if unknown:
        raise ValueError(f"Unknown surface feature(s) {unknown}. Valid features: {sorted(SURFACE_CAPS)}.")
    total = sum(weights.values())
    if total <= 0 or min(weights.values()) < 0:
        raise ValueError(f"Surface feature weights must be >= 0 with a positive sum; got {weights}.")
    out = np.zeros(len(texts))
    for i, text in enumerate(texts):
        f = surface_features(text)
        out[i] = sum(w * min(f[k] / SURFACE_CAPS[k], 1.0) for k, w in weights.items()) / total
    return out.astype(np.float32)


def jaccard(a: str, b: str) -> float:
    ta, tb = set(tokens(a)), set(tokens(b))
    return len(ta & tb) / len(ta | tb) if ta | tb else 1.0


def lexical_hard(s1: Sequence[str], s2: Sequence[str], y: np.ndarray) -> np.ndarray:
    """(n,) |jaccard - y| in [0, 1]; y normalised to [0, 1]."""
    jac = np.array([jaccard(a, b) for a, b in zip(s1, s2)])
    return np.abs(jac - np.asarray(y, dtype=np.float64)).astype(np.float32)


def per_sentence_mean(ia: np.ndarray, ib: np.ndarray, pair_values: np.ndarray, n_sentences: int,
                      fill: float | None = None) -> np.ndarray:
    """(m,) mean of a pair signal over the pairs each sentence occurs in; unseen sentences get `fill`
    (default: the mean over all pairs)."""
    total = np.bincount(ia, pair_values, n_sentences) + np.bincount(ib, pair_values, n_sentences)
    count = np.bincount(ia, minlength=n_sentences) + np.bincount(ib, minlength=n_sentences)
    fill = float(np.mean(pair_values)) if fill is None else fill
    return np.where(count > 0, total / np.maximum(count, 1), fill).astype(np.float32)


def rank_normalise(v: np.ndarray) -> np.ndarray:
    """(n,) ranks mapped to [0, 1] (average rank for ties)."""
    v = np.asarray(v, dtype=np.float64)
    if len(v) < 2:
        return np.zeros(len(v), dtype=np.float32)
    return ((rankdata(v) - 1.0) / (len(v) - 1.0)).astype(np.float32)


def ce_margin(ce_scores: np.ndarray, s0: np.ndarray) -> np.ndarray:
    """(n,) |r(ce) - r(s0)| in [0, 1] (see module docstring)."""
    if len(ce_scores) != len(s0):
        raise ValueError(f"ce_scores ({len(ce_scores)}) and s0 ({len(s0)}) differ in length.")
    return np.abs(rank_normalise(ce_scores) - rank_normalise(s0))
