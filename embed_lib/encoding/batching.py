"""Batches of similar length: what the transformers of this project (the encoder, the cross-encoder) compute on.

A batch is padded to its longest sequence and every padding token costs as much as a real one, while one
more forward pass costs comparatively little (benchmarks/batching.py: more, shorter batches were as fast or
faster at every call size measured, 3 to 256 pairs). Fixed chunks of the
longest-first order pad little when a call has many sequences (neighbours in that order have nearly equal
lengths) and a lot when it has few: a cascade routes a few pairs of each request, a cold request brings a
few dozen new sentences, and such a call is one chunk of mixed lengths. `length_batches` cuts the
longest-first order wherever the next sequence is shorter than the batch's longest / (1 + slack), so
padding stays a bounded fraction of every batch, whatever the call's size.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

#: a batch takes sequences down to 1 / (1 + SLACK) of its longest: each wastes at most SLACK / (1 + SLACK)
#: of its tokens on padding (benchmarks/batching.py measures it against fixed chunks)
SLACK = 0.2


def length_batches(lengths: Sequence[int], max_batch: int, slack: float = SLACK) -> list[np.ndarray]:
    """Index arrays covering 0..n-1 once, longest first: each of at most `max_batch` items, none shorter than
    its batch's longest / (1 + slack). slack=inf gives the fixed chunks of the longest-first order."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    if slack < 0:
        raise ValueError(f"slack must be >= 0, got {slack}")
    lengths = np.asarray(lengths, dtype=np.float64)
    order = np.argsort(-lengths, kind="stable")
    batches, start = [], 0
    for i in range(1, len(order) + 1):
        if (i == len(order) or i - start >= max_batch
                or lengths[order[i]] * (1 + slack) < lengths[order[start]]):
            batches.append(order[start:i])
            start = i
    return batches
