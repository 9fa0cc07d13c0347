"""The pair scorer behind the HTTP service, without Serve: model, vector caches and scoring in one object.

`PairScorer` holds the adapter, a near cache of sentence vectors (what this replica has seen) and a
cache of each sentence's adapter projection, so a pair of cached sentences runs only the adapter's
pair-level layers (the pair forms' fused for inference: embed_lib.training.fused). It knows nothing of
HTTP or Ray: the ingress fetches the vectors it lacks (from the encoder deployment) and hands them over;
tests drive it with any vector source.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Awaitable, Callable, Mapping, Sequence

import numpy as np

from embed_lib.training.cascade import default_policy, mix, route
from embed_lib.training.export import as_served, ensemble_scores, project
from embed_lib.training.fused import FusedEnsemble


class LRU:
    """A bounded text -> vector map with hit / miss counts."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.data, self.hits, self.misses = capacity, OrderedDict(), 0, 0

    def get_many(self, texts: Sequence[str]) -> tuple[dict[str, np.ndarray], list[str]]:
        found, missing = {}, []
        for t in dict.fromkeys(texts):
            v = self.data.get(t)
            if v is None:
                missing.append(t)
            else:
                self.data.move_to_end(t)
                found[t] = v
        self.hits += len(found)
        self.misses += len(missing)
        return found, missing

    def put(self, text: str, vec: np.ndarray) -> None:
        if self.capacity <= 0:
            return
        self.data[text] = vec
        self.data.move_to_end(text)
        while len(self.data) > self.capacity:
            self.data.popitem(last=False)

    def __contains__(self, text: str) -> bool:
        return text in self.data

    def stats(self) -> dict[str, Any]:
        total = self.hits + self.misses
        return {"size": len(self.data), "capacity": self.capacity, "hits": self.hits, "misses": self.misses,
                "hit_rate": self.hits / total if total else None}


def projections(model, cache: LRU, texts: Sequence[str], vectors: Mapping[str, np.ndarray]
                ) -> dict[str, np.ndarray] | None:
    """text -> its (S, width) adapter projection under `model`, for every text, kept per text in `cache` (None
    for the baseline form, which has none). `vectors`: text -> raw vector, for the texts not cached yet."""
    if model.form == "baseline":
        return None
    found, missing = cache.get_many(texts)
    if missing:
        h = project(model, np.stack([vectors[t] for t in missing]))
        for j, t in enumerate(missing):
            found[t] = h[:, j].copy()
            cache.put(t, found[t])
    return found


def gather(table: Mapping[str, np.ndarray], keys: Sequence[str], axis: int = 0) -> np.ndarray:
    """float32 `np.stack([table[k] for k in keys], axis)`, filled row by row (for a request's few dozen small
    arrays ~4x faster than np.stack, which makes a view of each first)."""
    first = table[keys[0]]
    out = np.empty((*first.shape[:axis], len(keys), *first.shape[axis:]), np.float32)
    rows = np.moveaxis(out, axis, 0)
    for j, k in enumerate(keys):
        rows[j] = table[k]
    return out


#: fetches raw vectors (n, d) for texts the scorer does not hold (the encoder deployment, in the service)
VectorSource = Callable[[list[str]], Awaitable[np.ndarray]]


class PairScorer:
    """Scores sentence pairs with one adapter; see the module docstring."""

    def __init__(self, model=None, info: dict[str, Any] | None = None, cache_size: int = 200_000,
                 projection_cache_size: int = 50_000) -> None:
        self.projection_cache_size = projection_cache_size
        self.near = LRU(cache_size)
        self.model, self.info, self.projected, self.fused = None, {}, LRU(projection_cache_size), None
        if model is not None:
            self.set_model(model, info or {})

    def set_model(self, model, info: dict[str, Any]) -> None:
        """Swap the adapter: its projections are emptied with it (they belong to the old model)."""
        fused = FusedEnsemble(model) if FusedEnsemble.supports(model) else None
        self.model, self.info, self.projected, self.fused = model, info, LRU(self.projection_cache_size), fused

    def add_vectors(self, texts: Sequence[str], vectors: np.ndarray) -> None:
        for t, v in zip(texts, vectors):
            self.near.put(t, v)

    async def fetch(self, texts: Sequence[str], source: VectorSource) -> dict[str, np.ndarray]:
        """text -> vector for every text, asking `source` once for the ones not held. Returned, not just
        cached: a near cache smaller than one request must not lose vectors before they are used."""
        found, missing = self.near.get_many(texts)
        if missing:
            vectors = await source(missing)
            for t, v in zip(missing, vectors):
                self.near.put(t, v)
                found[t] = v
        return found

    def score_vectors(self, pairs: Sequence[tuple[str, str]], vectors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """{'score', 'baseline', 'difficulty', 'novelty', 'unclipped'} (n,) each, for pairs whose texts are all in
        `vectors`. Synchronous: one model scores the whole request even while a swap waits. Cosines (the frozen
        baseline, a per-sentence form's score) and the residual's score are clipped to [-1, 1] (`as_served`);
        'unclipped' is the score before the clip, which orders the pairs the clip ties (`best_first`)."""
        model, projected, fused = self.model, self.projected, self.fused
        if model is None:
            raise RuntimeError("No model loaded yet.")
        if not pairs:
            return {k: np.zeros(0, np.float32) for k in ("score", "baseline", "difficulty", "novelty", "unclipped")}
        a, b = [p[0] for p in pairs], [p[1] for p in pairs]
        xa, xb = gather(vectors, a), gather(vectors, b)
        h = projections(model, projected, a + b, vectors)
        ha, hb = (None, None) if h is None else (gather(h, a, axis=1), gather(h, b, axis=1))  # (S, n, width)
        out = fused.scores(xa, xb, ha, hb) if fused is not None else ensemble_scores(model, xa, xb, ha, hb)
        return {"score": as_served(out["score"]), "baseline": as_served(out["baseline"]),
                "difficulty": out["difficulty"], "novelty": out["novelty"], "unclipped": out["score"]}

    async def score(self, pairs: Sequence[tuple[str, str]], source: VectorSource) -> dict[str, np.ndarray]:
        """Fetch what is missing, then score (see `score_vectors`)."""
        vectors = await self.fetch([t for p in pairs for t in p], source)
        return self.score_vectors(pairs, vectors)

    def default_routing(self) -> str:
        """The cascade's routing when a request names none (embed_lib.training.cascade.default_policy)."""
        return default_policy(None if self.model is None else self.model.form)

    def stats(self) -> dict[str, Any]:
        return {"near_cache": self.near.stats(), "projection_cache": self.projected.stats()}


class RoutingError(ValueError):
    """A cascade request whose routing the served model cannot follow (e.g. difficulty without a gate)."""


def best_first(scores: np.ndarray, unclipped: np.ndarray) -> np.ndarray:
    """The pairs' indices, best first: by `scores` (as served), the pairs they tie by `unclipped` (the adapter's
    score before the clip to [-1, 1]: two near-duplicates the model puts at 1.06 and 1.02 keep that order), then
    in the order given."""
    return np.lexsort((np.arange(len(scores)), -np.asarray(unclipped, np.float64), -np.asarray(scores, np.float64)))


async def cascade_scores(pairs: Sequence[tuple[str, str]], out: dict[str, np.ndarray], cascade: dict[str, Any],
                         middle: float | None, cross_encoder: Callable[[list], Awaitable[np.ndarray]]
                         ) -> tuple[np.ndarray, np.ndarray]:
    """(scores, routed): the adapter's scores `out` with the pairs routed at cascade's budget / routing / seed /
    familiarity_floor (embed_lib.training.cascade.route) re-scored by `cross_encoder`. RoutingError for a policy the
    model cannot serve."""
    try:
        routed = route(cascade["budget"], cascade["routing"], difficulty=out["difficulty"], baseline=out["baseline"],
                       middle=middle, seed=cascade["seed"], novelty=out["novelty"],
                       familiarity_floor=cascade.get("familiarity_floor", 0.0))
    except ValueError as exc:  # the request's routing, not a failure of the cross-encoder
        raise RoutingError(str(exc)) from None
    scores = out["score"].astype(np.float64)
    if len(routed):
        scores = mix(scores, await cross_encoder([pairs[i] for i in routed]), routed, cascade.get("combine", "replace"))
    return scores, routed
