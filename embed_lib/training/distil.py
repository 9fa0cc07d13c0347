"""Distillation's inputs to the training loop: the teacher's scores as each seed reads them, and the silver batches.

Read by `seed_group` when `AdapterConfig.lambda_distil` > 0: the teacher's held-out scores of the train pairs and, with
`silver_fraction` > 0, the first round(silver_fraction * n) of the study's silver pairs (`StudyData.silver`) with
theirs; the shuffled-teacher control permutes both per seed, with generators of its own (the batches stay the
unshuffled arm's).
"""
from __future__ import annotations

import torch

from embed_lib.config import AdapterConfig
from embed_lib.training.tensors import StudyData

#: silver rows of sentence a and b (n_s,) and the teacher's scores as each seed reads them (S, n_s)
Silver = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def distil_targets(cfg: AdapterConfig, data: StudyData, dev: torch.device) -> tuple[torch.Tensor, Silver | None]:
    """((S, n) the teacher's score of each train pair per seed, the silver pairs `cfg` trains on or None)."""
    S, tr = cfg.n_seeds, data.splits["train"]
    shuffle = [torch.Generator().manual_seed(20_000 + s) for s in cfg.seeds] if cfg.distil_control == "shuffled" \
        else None
    teach = teacher_rows(torch.from_numpy(tr.teacher).float(), S, shuffle).to(dev)
    n_silver = silver_count(cfg, data)
    if not n_silver:
        return teach, None
    sv = data.silver
    return teach, (sv.ia[:n_silver].to(dev), sv.ib[:n_silver].to(dev),
                   teacher_rows(torch.from_numpy(sv.teacher[:n_silver]).float(), S, shuffle).to(dev))


def teacher_rows(t: torch.Tensor, S: int, shuffle: list[torch.Generator] | None) -> torch.Tensor:
    """(n,) teacher scores -> (S, n), permuted per seed with `shuffle`'s generators (the shuffled-teacher control)."""
    if shuffle is None:
        return t.expand(S, -1).clone()
    return torch.stack([t[torch.randperm(len(t), generator=g)] for g in shuffle])


def silver_count(cfg: AdapterConfig, data: StudyData) -> int:
    """The silver pairs `cfg` trains on: the first round(silver_fraction * n) of the study's n (0 without distillation
    or without silver pairs asked for); a ValueError when it asks for some and the study has none."""
    if not cfg.distilled or cfg.silver_fraction == 0:
        return 0
    if data.silver is None or len(data.silver.ia) == 0:
        raise ValueError(f"AdapterConfig.silver_fraction={cfg.silver_fraction}: this study has no silver pairs; load "
                         "it with some (load_study(silver=N), --silver-pairs N) or set silver_fraction=0.")
    return max(1, int(round(cfg.silver_fraction * len(data.silver.ia))))


def silver_order(silver: Silver | None, gens: list[torch.Generator]) -> torch.Tensor | None:
    """(S, n_s) an epoch's order of the silver pairs, each seed its own (from its batch generator); None without."""
    if silver is None:
        return None
    n_s = len(silver[0])
    return torch.stack([torch.randperm(n_s, generator=g) for g in gens]).to(silver[0].device)


def silver_batch(model, X: torch.Tensor, silver: Silver, fam: torch.Tensor | None, order: torch.Tensor, step: int,
                 batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores (S, B), teacher scores (S, B)) of step `step`'s batch of silver pairs; a silver set smaller than an
    epoch's batches cycles."""
    pos = (torch.arange(batch_size, device=X.device) + step * batch_size) % order.shape[1]
    sidx = order[:, pos]  # (S, B)
    sa, sb = silver[0][sidx], silver[1][sidx]
    out = model(X[sa], X[sb], **({} if fam is None else dict(fam_a=fam[sa], fam_b=fam[sb])))
    return out.score, torch.gather(silver[2], 1, sidx)
