"""The difficulty-routed cascade: which pairs of a batch go to the cross-encoder, at a budget.

A cascade scores every pair with the adapter (cached vectors: cheap) and re-scores a fraction `budget`
of them with the cross-encoder (a transformer pass per pair: ~30-50x the cost). Which fraction is the
routing policy's choice:

- `difficulty`: the pairs the adapter's gate rates hardest. A gate trained on the ce_margin target
  predicts, from the cached vectors alone, where the cross-encoder's ranking departs from the frozen
  cosine's: no cross-encoder call is needed to decide;
- `random`: a seeded random subset of the same size (the control: what any budget buys by chance);
- `cosine_middle`: the pairs whose frozen cosine is closest to the middle of its range (`middle`, e.g.
  the median cosine of the validation pairs), the naive heuristic "undecided pairs are hard".

Whatever the policy, a request the adapter's novelty gate finds unfamiliar routes nothing: where the mean of its
pairs' novelty-gate weights w_nov (1: as familiar as the adapter's training sentences; 0: the gate closed, the
adapter back on the frozen cosine) is under `familiarity_floor`, the request lies outside the adapter's training
data, and there the gate's difficulty and the cross-encoder (trained on the same task) are out of their domain
too. Measured with the STS-B champion and its teacher at budget 0.1, routing by difficulty alone cost PAWS test
-0.085 Spearman while the adapter held at -0.0005; a floor per pair instead of per request kept PAWS but lost
the cascade's gain on STS-B, whose test pairs the gate mostly also rates unfamiliar. `FAMILIARITY_FLOOR` was
chosen on validation splits (benchmarks/cascade_familiarity_floor.py). An adapter without a novelty gate has
w_nov = 1 for every pair: the floor never holds its requests back.

What a routed pair gets (`combine`): the cross-encoder's score in place of the adapter's ("replace"),
or the mean of the two ("mean": an ensemble of two scorers whose errors are only partly shared, which
ranks better than either where the cross-encoder is not much stronger than the adapter).

The same function routes in the service (serving/app.py) and in the frontier benchmark
(benchmarks/cascade_frontier.py), so what is measured is what is served.
"""
from __future__ import annotations

import hashlib
import math
from typing import Sequence

import numpy as np

POLICIES = ("difficulty", "random", "cosine_middle")
COMBINE = ("replace", "mean")
#: the least mean novelty-gate weight of a request's pairs for the cascade to route any (module docstring):
#: chosen on the validation splits of STS-B, MRPC, QQP and PAWS, results/benchmarks/cascade_familiarity_floor.json
FAMILIARITY_FLOOR = 0.02


def default_policy(form: str | None) -> str:
    """The routing of a cascade request that names none, for an adapter of this form (None: no model): the gate's
    difficulty where the form has a difficulty output, else the frozen cosine's closeness to the middle."""
    return "cosine_middle" if form is None or form in ("baseline", "pair_ungated") else "difficulty"


def n_routed(n: int, budget: float, rng: np.random.Generator) -> int:
    """How many of n pairs go to the cross-encoder: budget * n, the fraction rounded at random (up with
    probability equal to the fraction), so small requests meet the budget on average."""
    if not 0.0 <= budget <= 1.0:
        raise ValueError(f"budget={budget!r} must lie in [0, 1] (the fraction of pairs sent to the cross-encoder).")
    k = budget * n
    whole = math.floor(k)
    return min(n, whole + int(rng.random() < k - whole))


def pairs_seed(pairs: Sequence[tuple[str, str]]) -> int:
    """A 64-bit seed of the pairs' texts (BLAKE2b): the same pairs, the same seed; other pairs, another seed. The
    service's default routing seed: with one fixed seed, every request of n pairs would round budget x n the same way
    (at 0.1, a request of 4 pairs or fewer would never route a pair)."""
    text = "\x1e".join(f"{a}\x1f{b}" for a, b in pairs)
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def route(budget: float, policy: str, *, difficulty: np.ndarray | None = None, baseline: np.ndarray | None = None,
          middle: float | None = None, seed: int = 0, n: int | None = None, novelty: np.ndarray | None = None,
          familiarity_floor: float = 0.0) -> np.ndarray:
    """Indices (sorted) of the pairs the policy sends to the cross-encoder at this budget; none where the mean of
    the pairs' novelty-gate weights `novelty` is under `familiarity_floor` (see the module docstring)."""
    if policy not in POLICIES:
        raise ValueError(f"routing={policy!r} is not a policy; choose one of {list(POLICIES)}.")
    if not 0.0 <= familiarity_floor <= 1.0:
        raise ValueError(f"familiarity_floor={familiarity_floor!r} must lie in [0, 1] (the least mean novelty-gate "
                         "weight of a request's pairs for the cascade to route any; 0: every request).")
    sizes = [len(v) for v in (difficulty, baseline) if v is not None]
    n = n if n is not None else (sizes[0] if sizes else None)
    if n is None:
        raise ValueError("route needs n, difficulty or baseline.")
    rng = np.random.default_rng(seed)
    k = n_routed(n, budget, rng)
    if policy == "difficulty":
        if difficulty is None or np.isnan(difficulty).any():
            raise ValueError("routing='difficulty' needs the adapter's difficulty, and the served adapter has no gate "
                             "(an ungated form): use routing='random' or 'cosine_middle', or serve a gated adapter.")
        priority = np.asarray(difficulty, dtype=np.float64)
    elif policy == "random":
        priority = rng.random(n)
    else:
        if baseline is None:
            raise ValueError("routing='cosine_middle' needs the frozen cosine of every pair.")
        mid = float(np.median(baseline)) if middle is None else float(middle)
        priority = -np.abs(np.asarray(baseline, dtype=np.float64) - mid)
    if novelty is not None and familiarity_floor > 0 and len(novelty) and not np.mean(novelty) >= familiarity_floor:
        return np.zeros(0, np.int64)  # an unfamiliar request routes nothing
    return np.sort(np.argsort(-priority, kind="stable")[:k])


def route_requests(budget: float, policy: str, requests: Sequence[np.ndarray], pairs: Sequence[tuple[str, str]],
                   scored: dict[str, np.ndarray], middle: float | None = None,
                   familiarity_floor: float = 0.0) -> np.ndarray:
    """Indices (sorted) the service routes when the pairs arrive as `requests` (index arrays into `pairs`), each routed
    on its own and seeded by its pairs, as a request without routing_seed is. scored: every pair's 'difficulty',
    'baseline' and 'novelty' (`ensemble_scores`). What `evaluate --cascade-budget` and the floor benchmark measure."""
    parts = [r[route(budget, policy, difficulty=scored["difficulty"][r], baseline=scored["baseline"][r], middle=middle,
                     novelty=scored["novelty"][r], familiarity_floor=familiarity_floor,
                     seed=pairs_seed([pairs[i] for i in r]))] for r in requests]
    return np.sort(np.concatenate([np.zeros(0, np.int64)] + parts))


def mix(adapter: np.ndarray, cross_encoder: np.ndarray, routed: np.ndarray, combine: str = "replace") -> np.ndarray:
    """Adapter scores with the routed pairs' replaced by the cross-encoder's (both on the same scale), or
    by the mean of the two (combine="mean"). `cross_encoder` is either every pair's score or only the
    routed pairs', in `routed` order."""
    if combine not in COMBINE:
        raise ValueError(f"combine={combine!r}; choose one of {list(COMBINE)}.")
    out = np.array(adapter, dtype=np.float64, copy=True)
    ce = np.asarray(cross_encoder, dtype=np.float64)
    ce = ce[routed] if len(ce) == len(out) else ce
    out[routed] = ce if combine == "replace" else (out[routed] + ce) / 2
    return out
