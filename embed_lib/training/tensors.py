"""A task's cached vectors as tensors for training: splits, difficulty targets, familiarity.

`prepare_study` turns an embedded task (and, for the ce_margin target, held-out teacher scores) into a
`StudyData`: the distinct sentences' raw vectors, each split's row indices, labels and frozen cosine,
every available difficulty target, and the familiarity the novelty gate reads. Splits named
"transfer:<task>" are other tasks' pairs, never trained on (the do-no-harm checks).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import torch

from embed_lib.encoding.cache import EmbeddedTask
from embed_lib.training.adapters import NoveltyGate
from embed_lib.training.metrics import cosine
from embed_lib.training.retrieval import RETRIEVAL_TRANSFER, retrieval_check
from embed_lib.training.signals import ce_margin, lexical_hard, per_sentence_mean, surface_complexity
from embed_lib.training.silver import SILVER

#: a split named "transfer:<task>" is another task's pairs, never trained on (do-no-harm checks)
TRANSFER_PREFIX = "transfer:"
#: "transfer:<task>-all": the whole validation split of a task some of whose pairs share a sentence with train
#: ("transfer:<task>" leaves those out, so that the check reads how the adapter treats sentences it never saw)
WHOLE_SUFFIX = "-all"
#: reference sentences the novelty gate keeps (a seeded sample when the training split has more)
NOVELTY_REF_MAX = 20_000


@dataclass
class SplitTensors:
    ia: torch.Tensor  # (n,) rows of sentence a in StudyData.X
    ib: torch.Tensor
    y: torch.Tensor  # (n,) float32 in [0, 1]
    s0: np.ndarray  # (n,) frozen cosine
    pair_target: dict[str, np.ndarray] = field(default_factory=dict)  # target name -> (n,)
    teacher: np.ndarray | None = None  # (n,) the teacher's held-out score of each pair (distillation), if scored


@dataclass
class StudyData:
    task: str
    binary: bool
    X: torch.Tensor  # (m, d) raw pooled vectors of the distinct sentences
    splits: dict[str, SplitTensors]
    sentence_target: dict[str, np.ndarray]  # target name -> (m,)
    manifest: dict[str, Any]
    split_notes: dict[str, str]
    _familiarity: torch.Tensor | None = field(default=None, repr=False)
    _retrieval: dict[str, Any] | None = field(default=None, repr=False)
    #: split name -> fingerprint of its pairs and labels (PairData.fingerprint): what a registered version was
    #: validated on, so that the registry compares like with like
    fingerprints: dict[str, str] = field(default_factory=dict)
    #: the silver pairs (`embed_lib.training.silver`): train sentences recombined, no labels (y is 0), each with the
    #: teacher's score; None where the study was loaded without them
    silver: SplitTensors | None = None

    @property
    def targets(self) -> list[str]:
        return sorted(self.sentence_target)

    @property
    def transfer(self) -> list[str]:
        """Names of the transfer splits ("transfer:<task>")."""
        return sorted(k for k in self.splits if k.startswith(TRANSFER_PREFIX))

    @property
    def train_rows(self) -> torch.Tensor:
        """(r,) sorted rows of X that occur in a training pair."""
        tr = self.splits["train"]
        return torch.unique(torch.cat([tr.ia, tr.ib]))

    def familiarity(self, served: bool = False) -> torch.Tensor:
        """(m,) max cosine of every sentence to the training sentences (of the novelty gate's reference set),
        leave-one-out for the training sentences themselves: how familiar a sentence never trained on looks. What
        training reads. served: the novelty gate's own familiarity, a reference sentence its own nearest neighbour
        (cosine 1): what the service gives every pair it scores, so what every split but train is scored with."""
        if served:
            rows = novelty_reference_rows(self)
            xn = torch.nn.functional.normalize(self.X[rows].float(), dim=-1)
            out = self.familiarity().to(self.X.device, copy=True)
            out[rows] = torch.maximum(out[rows], (xn * xn).sum(-1))
            return out
        if self._familiarity is None:
            ref_rows = novelty_reference_rows(self)
            ref = torch.nn.functional.normalize(self.X[ref_rows].float(), dim=-1)
            xn = torch.nn.functional.normalize(self.X.float(), dim=-1)
            out = torch.empty(len(xn), device=xn.device)
            pos = torch.full((len(xn),), -1, dtype=torch.long, device=xn.device)
            pos[ref_rows] = torch.arange(len(ref_rows), device=xn.device)
            for i in range(0, len(xn), 4096):
                sims = xn[i: i + 4096] @ ref.T  # (chunk, r)
                own = pos[i: i + 4096]
                hit = own >= 0
                sims[hit.nonzero().squeeze(1), own[hit]] = -2.0  # leave one out
                out[i: i + 4096] = sims.amax(-1)
            self._familiarity = out
        return self._familiarity

    def retrieval_checks(self) -> dict[str, Any]:
        """name -> `retrieval.RetrievalCheck` of every transfer split of a duplicate-question task
        (`retrieval.RETRIEVAL_TRANSFER`): re-ranking its frozen top-k is one more do-no-harm check."""
        if self._retrieval is None:
            X = self.X.float().cpu().numpy()
            checks = {name: retrieval_check(X, sp.ia.cpu().numpy(), sp.ib.cpu().numpy(), sp.y.cpu().numpy())
                      for name, sp in ((k[len(TRANSFER_PREFIX):], self.splits[k]) for k in self.transfer)
                      if name in RETRIEVAL_TRANSFER}
            self._retrieval = {k: v for k, v in checks.items() if v is not None}
        return self._retrieval

    def to(self, dev: torch.device) -> "StudyData":
        """The same study with its tensors on `dev` (itself when already there)."""
        if self.X.device == dev:
            return self
        moved = lambda s: SplitTensors(s.ia.to(dev), s.ib.to(dev), s.y.to(dev), s.s0, s.pair_target,  # noqa: E731
                                       s.teacher)
        splits = {k: moved(s) for k, s in self.splits.items()}
        fam = self._familiarity.to(dev) if self._familiarity is not None else None
        return StudyData(self.task, self.binary, self.X.to(dev), splits, self.sentence_target, self.manifest,
                         self.split_notes, fam, self._retrieval, dict(self.fingerprints),
                         None if self.silver is None else moved(self.silver))


def novelty_reference_rows(data: StudyData) -> torch.Tensor:
    """Rows of X the novelty gate compares with: the training sentences, a seeded sample of NOVELTY_REF_MAX."""
    rows = data.train_rows
    if len(rows) > NOVELTY_REF_MAX:
        g = torch.Generator().manual_seed(0)
        rows = torch.sort(rows[torch.randperm(len(rows), generator=g)[:NOVELTY_REF_MAX]]).values
    return rows


def novelty_gate(data: StudyData, quantile: float) -> NoveltyGate:
    """The gate closed below the `quantile` of the training sentences' leave-one-out familiarity and fully
    open from the (quantile + 0.25)-quantile on."""
    fam = data.familiarity()[data.train_rows]
    lo = float(torch.quantile(fam, quantile))
    hi = float(torch.quantile(fam, min(quantile + 0.25, 0.95)))
    return NoveltyGate(data.X[novelty_reference_rows(data)], lo, max(hi, lo + 1e-3))


def prepare_study(emb: EmbeddedTask, teacher_scores: Mapping[str, np.ndarray] | None = None,
                  surface_weights: Mapping[str, float] | None = None) -> StudyData:
    """Tensors and every available difficulty target (surface, lexical; ce_margin with teacher scores).

    Per-sentence aggregates of pair targets use train pairs only; other sentences get the train mean. A split named
    "silver" (`embed_lib.training.silver`, unlabelled) becomes `StudyData.silver`, with the teacher's scores.
    """
    if not isinstance(emb, EmbeddedTask):
        raise TypeError(f"prepare_study(emb) takes an EmbeddedTask (embed_task; load_study does every step); got "
                        f"{type(emb).__name__}.")
    X = torch.from_numpy(np.ascontiguousarray(emb.vectors))
    m = len(emb.texts)
    surface = surface_complexity(emb.texts, surface_weights)
    splits: dict[str, SplitTensors] = {}
    silver = None
    for name, s in emb.splits.items():
        s0 = cosine(emb.vectors[s.ia], emb.vectors[s.ib])
        teacher = None if teacher_scores is None or teacher_scores.get(name) is None else \
            np.asarray(teacher_scores[name], dtype=np.float32)
        if teacher is not None and len(teacher) != len(s.ia):
            raise ValueError(f"teacher scores for split {name!r} have {len(teacher)} rows; the split has "
                             f"{len(s.ia)} pairs. Rebuild the teacher cache for this task.")
        if name == SILVER:  # unlabelled: only the teacher's scores, which distillation reads
            if teacher is None:
                raise ValueError("prepare_study: silver pairs without the teacher's scores; they carry no label, so a "
                                 "teacher must score them (load_study with a teacher, or leave the silver pairs out).")
            silver = SplitTensors(torch.from_numpy(s.ia), torch.from_numpy(s.ib), torch.zeros(len(s.ia)), s0,
                                  teacher=teacher)
            continue
        t = {"surface": (surface[s.ia] + surface[s.ib]) / 2,
             "lexical": lexical_hard(s.data.sentence1, s.data.sentence2, s.data.label)}
        if teacher is not None:
            t["ce_margin"] = ce_margin(teacher, s0)
        splits[name] = SplitTensors(torch.from_numpy(s.ia), torch.from_numpy(s.ib),
                                    torch.from_numpy(s.data.label.astype(np.float32)), s0, t, teacher)
    tr = emb.splits["train"]
    sentence_target = {"surface": surface}
    for name in ("lexical", "ce_margin"):
        if name in splits["train"].pair_target:
            sentence_target[name] = per_sentence_mean(tr.ia, tr.ib, splits["train"].pair_target[name], m)
    first = next(iter(emb.splits.values())).data
    kept = {k: v for k, v in emb.splits.items() if k != SILVER}
    return StudyData(emb.task, first.binary, X, splits, sentence_target, dict(emb.manifest),
                     {k: v.data.split_note for k, v in kept.items()},
                     fingerprints={k: v.data.fingerprint for k, v in kept.items()}, silver=silver)
