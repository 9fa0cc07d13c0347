"""Scoring a seed group on cached vectors: one split's scores per seed, and each seed's delta on the transfer checks.

`score_split` scores pairs in chunks (every seed at once, no copy of the vectors). `TransferWatch` gives each seed's
Spearman delta against the frozen cosine on every other task's pairs: what `seed_group` records once for the selected
weights, and what a sweep's trials report after every epoch (`train_seed_group(..., epoch_transfer=True)`), so that
ASHA and the searcher see harm to another task while a configuration trains, not only once it has ended.
"""
from __future__ import annotations

import numpy as np
import torch
from scipy import stats

from embed_lib.training.adapters import PairAdapter
from embed_lib.training.tensors import TRANSFER_PREFIX, SplitTensors, StudyData

EVAL_CHUNK = 8192


def spearman_rows(scores: np.ndarray, y: np.ndarray) -> np.ndarray:
    """(S,) Spearman of each row of `scores` (S, n) with `y` (n,)."""
    return np.array([stats.spearmanr(s, y).statistic for s in scores])


@torch.no_grad()
def score_split(model: PairAdapter, X: torch.Tensor, sp: SplitTensors,
                familiarity: torch.Tensor | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Scores (S, n) and gate or mean complexity (S, n) or None, in chunks of pairs. familiarity: (m,) per
    sentence of X for the novelty gate (else the gate computes it)."""
    model.eval()
    S = len(model.seeds)
    scores, aux = [], []
    for i in range(0, len(sp.ia), EVAL_CHUNK):
        ia, ib = sp.ia[i: i + EVAL_CHUNK], sp.ib[i: i + EVAL_CHUNK]
        xa = X[ia].expand(S, -1, -1)  # (S, n, d), no copy
        xb = X[ib].expand(S, -1, -1)
        fam = {} if familiarity is None else dict(fam_a=familiarity[ia].expand(S, -1),
                                                  fam_b=familiarity[ib].expand(S, -1))
        out = model(xa, xb, **fam)
        scores.append(out.score)
        if out.gate is not None:
            aux.append(out.gate)
        elif out.c_a is not None:
            aux.append((out.c_a + out.c_b) / 2)
    model.train()
    return torch.cat(scores, 1).cpu().numpy(), (torch.cat(aux, 1).cpu().numpy() if aux else None)


class TransferWatch:
    """Each seed's Spearman delta on every transfer task's pairs ("transfer:<task>" splits; the retrieval checks,
    ~30x the pairs, are scored only for the selected weights), the pairs scored as served (`familiarity`: the novelty
    gate's own)."""

    def __init__(self, data: StudyData, familiarity: torch.Tensor | None):
        self.X, self.familiarity = data.X, familiarity
        self.splits = {split[len(TRANSFER_PREFIX):]: data.splits[split] for split in data.transfer}
        self.y = {name: sp.y.cpu().numpy() for name, sp in self.splits.items()}
        #: each task's frozen-cosine Spearman, the deltas' reference
        self.baseline = {name: float(stats.spearmanr(sp.s0, self.y[name]).statistic)
                         for name, sp in self.splits.items()}

    def deltas(self, model: PairAdapter) -> dict[str, np.ndarray]:
        """task -> (S,) each seed's delta with the model's current weights."""
        return {name: spearman_rows(score_split(model, self.X, sp, self.familiarity)[0], self.y[name])
                - self.baseline[name] for name, sp in self.splits.items()}

    def epoch_record(self, model: PairAdapter) -> dict[str, float]:
        """What an epoch reports: every task's worst seed (`epoch/transfer/<task>/delta_min`) and the worst of all
        (`epoch/transfer_delta_min`, NaN where a check cannot be measured, as the winner rule reads it)."""
        deltas = self.deltas(model)
        out = {f"epoch/transfer/{name}/delta_min": float(np.min(d)) for name, d in deltas.items()}
        if deltas:
            out["epoch/transfer_delta_min"] = float(np.min(np.concatenate(list(deltas.values()))))
        return out
