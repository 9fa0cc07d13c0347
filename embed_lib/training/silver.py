"""Silver pairs: new, unlabelled pairs of a task's own train sentences, for the teacher to score (distillation).

Beside the labelled train pairs, the adapter learns the teacher's scores of pairs nobody labelled (Augmented SBERT,
Thakur et al. 2021: sample pairs, label them with a cross-encoder, train the bi-encoder on them). `build_silver` draws
them from the train split's sentences, in three kinds taken in turn, so that any prefix of the set is the same mix:

- "neighbour": a sentence and one of its `k` nearest neighbours by the frozen cosine (the pairs the cosine finds
  similar, where the teacher's finer judgement matters most);
- "other_side": a train pair (a, b), and a with a near neighbour of b (graded pairs close to the labelled ones);
- "random": two sentences drawn at random (the low end of the scale, where the cosine is already right).

Nothing from validation or test enters: a sentence that also occurs in another split of the task (`exclude`) is never
drawn, and no silver pair repeats a train pair (either order) or another silver pair. Seeded and deterministic: the
same sentences, vectors and seed give the same pairs; `PairData.fingerprint` names them in the teacher's cache key.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

from embed_lib.data.tasks import PairData

#: the kinds of silver pair, in the order a set takes them
KINDS = ("neighbour", "other_side", "random")
#: nearest neighbours a sentence's "neighbour" and "other_side" pairs are drawn among
NEIGHBOURS = 5
#: the split name silver pairs carry (PairData.split) and the teacher's scores are cached under
SILVER = "silver"


def _normalised(v: np.ndarray) -> np.ndarray:
    v = np.asarray(v, dtype=np.float32)
    return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-8)


def nearest(vectors: np.ndarray, k: int, chunk: int = 2048) -> np.ndarray:
    """(m, k) rows of each row's k nearest other rows by cosine, nearest first; (m, d) -> (m, k)."""
    m = len(vectors)
    k = min(k, m - 1)
    xn = _normalised(vectors)
    out = np.empty((m, k), dtype=np.int64)
    for i in range(0, m, chunk):
        sims = xn[i: i + chunk] @ xn.T  # (c, m)
        sims[np.arange(len(sims)), np.arange(i, i + len(sims))] = -np.inf  # never its own neighbour
        top = np.argpartition(-sims, k - 1, axis=1)[:, :k] if k < m else np.argsort(-sims, axis=1)[:, :k]
        order = np.argsort(-np.take_along_axis(sims, top, axis=1), axis=1, kind="stable")
        out[i: i + len(sims)] = np.take_along_axis(top, order, axis=1)
    return out


def build_silver(train: PairData, texts: list[str], vectors: np.ndarray, n: int, seed: int = 0,
                 exclude: Iterable[str] = ()) -> PairData:
    """`n` silver pairs of `train`'s sentences (see the module docstring), labels 0 (the teacher gives them scores).

    texts, vectors: the sentences with their frozen vectors ((m, d), any superset of train's sentences); exclude: the
    sentences of the task's other splits (validation, test), never drawn. Fewer than `n` pairs when the sentences
    cannot make so many distinct ones; a ValueError when they make none."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"silver pairs: n={n!r}; give a whole number of pairs, 1 or more (--silver-pairs; "
                         "--no-silver for none).")
    if len(texts) != len(vectors):
        raise ValueError(f"build_silver: {len(texts)} texts and {len(vectors)} vectors; give one vector per text.")
    banned = set(exclude)
    row = {t: i for i, t in enumerate(texts)}
    pool = [t for t in dict.fromkeys([*train.sentence1, *train.sentence2]) if t not in banned]
    missing = [t for t in pool if t not in row]
    if missing:
        raise ValueError(f"build_silver: {len(missing)} train sentences have no vector (e.g. {missing[0]!r}); embed "
                         "every train sentence first.")
    if len(pool) < 2:
        raise ValueError(f"build_silver: {train.task} train has {len(pool)} sentence(s) outside validation and test; "
                         "silver pairs need 2 or more.")
    at = {t: i for i, t in enumerate(pool)}  # sentence -> position in the pool
    nn = nearest(vectors[[row[t] for t in pool]], NEIGHBOURS)  # (p, k) positions in the pool
    labelled = [(at[a], at[b]) for a, b in zip(train.sentence1, train.sentence2) if a in at and b in at]
    seen = {frozenset((a, b)) for a, b in zip(train.sentence1, train.sentence2)}
    rng = np.random.default_rng(seed)
    s1: list[str] = []
    s2: list[str] = []
    failures = 0
    # each kind in turn; a kind that keeps drawing pairs already taken is exhausted (a small pool)
    while len(s1) < n and failures < 50 * len(KINDS) + 10 * n:
        i, j = _draw(KINDS[len(s1) % len(KINDS)], rng, nn, labelled)
        key = frozenset((pool[i], pool[j]))
        if i == j or key in seen:
            failures += 1
            continue
        seen.add(key)
        s1.append(pool[i])
        s2.append(pool[j])
    if not s1:
        raise ValueError(f"build_silver: {train.task} train's sentences make no pair that is not already a train pair.")
    k = len(s1)
    return PairData(train.task, SILVER, f"silver:{train.source}",
                    f"{k} silver pairs of {train.task} train sentences (seed {seed}; kinds {', '.join(KINDS)} in turn; "
                    "none with a validation or test sentence)", train.binary, s1, s2,
                    np.zeros(k, dtype=np.float32), np.zeros(k, dtype=np.float32), np.arange(k, dtype=np.int64))


def _draw(kind: str, rng: np.random.Generator, nn: np.ndarray, labelled: list[tuple[int, int]]) -> tuple[int, int]:
    """One candidate pair of pool positions of `kind`; nn: (p, k) each position's nearest neighbours, labelled: the
    train pairs as positions."""
    p, k = nn.shape
    if kind == "random":
        i, j = rng.choice(p, size=2, replace=False)
        return int(i), int(j)
    if kind == "other_side" and labelled:
        a, b = labelled[int(rng.integers(len(labelled)))]
        if rng.random() < 0.5:
            a, b = b, a
        return a, int(nn[b, rng.integers(k)])
    i = int(rng.integers(p))  # a neighbour pair (and the other side's stand-in where no train pair is in the pool)
    return i, int(nn[i, rng.integers(k)])


def kinds_of(n: int) -> np.ndarray:
    """(n,) the kind of each pair of a silver set as `build_silver` takes them in turn (names from KINDS)."""
    return np.array([KINDS[i % len(KINDS)] for i in range(n)])
