"""Losses on scores and cached vectors, batched over a seed group: tensors are (S, B) = (seeds, pairs).

Each returns a per-seed loss of shape (S,), so the seed group's total is their sum and every seed's
gradient stays its own.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def cosent(scores: torch.Tensor, y: torch.Tensor, tau: float) -> torch.Tensor:
    """log(1 + sum_{i,j: y_i > y_j} exp((s_j - s_i) / tau)); scores, y (S, B) -> (S,)."""
    diff = (scores[:, None, :] - scores[:, :, None]) / tau  # (S, B, B): [s, i, j] = (s_j - s_i) / tau
    mask = y[:, :, None] > y[:, None, :]  # pairs that should rank i above j
    diff = diff.masked_fill(~mask, float("-inf"))
    zero = torch.zeros(diff.shape[0], 1, device=diff.device, dtype=diff.dtype)
    return torch.logsumexp(torch.cat([zero, diff.flatten(1)], dim=1), dim=1)


def logistic(scores: torch.Tensor, y: torch.Tensor, tau: float, center: torch.Tensor) -> torch.Tensor:
    """mean BCE(sigmoid((s - center) / tau), y); scores, y (S, B), center (S, 1) -> (S,)."""
    return F.binary_cross_entropy_with_logits((scores - center) / tau, y, reduction="none").mean(dim=1)


def mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """mean (pred - target)^2 over the last dims; (S, B) -> (S,)."""
    return (pred - target).pow(2).flatten(1).mean(dim=1)


def modulus(norm_a: torch.Tensor, norm_b: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """sum_i y_i (log|v_a,i| - log|v_b,i|)^2 / sum_i y_i: pulls the norms of similar pairs together; (S, B) -> (S,)."""
    gap = (norm_a.clamp_min(1e-6).log() - norm_b.clamp_min(1e-6).log()).pow(2)
    return (y * gap).sum(dim=1) / y.sum(dim=1).clamp_min(1e-6)
