"""The study pipeline that sweeps and commands share: task -> cached embeddings (+ held-out teacher) -> tensors.

`load_study` wires the stages for one task and returns the `StudyData` every trial trains on: the task's
splits (and other tasks' validation pairs as transfer checks, `transfer_splits`), every distinct sentence
through the content-addressed cache (`embed_splits`; the model loads only when a sentence is missing,
`LazyEncoder`), the teacher's held-out scores when a ce_margin target is wanted, and the tensors. The
report (`embed_lib.report`) and the sweeps sit above it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import numpy as np

from embed_lib.config import EncoderConfig, default_cache_dir
from embed_lib.data.tasks import SPLITS, PairData, load_splits, task_names
from embed_lib.encoding.cache import EmbeddedSplit, EmbeddedTask, EmbeddingCache, embed_task
from embed_lib.encoding.encoders import FrozenEncoder, encoder_manifest
from embed_lib.teacher.config import TeacherConfig
from embed_lib.teacher.scores import quality_report, teacher_scores
from embed_lib.training.retrieval import RetrievalSet, build_retrieval_set
from embed_lib.training.silver import SILVER, build_silver
from embed_lib.training.tensors import TRANSFER_PREFIX, WHOLE_SUFFIX, StudyData, prepare_study


class LazyEncoder:
    """Loads the model only when a sentence is missing from the cache, or when its manifest is needed."""

    def __init__(self, config: EncoderConfig) -> None:
        self.config = config
        self._encoder = None

    def __call__(self):
        if self._encoder is None:
            self._encoder = FrozenEncoder(self.config)
        return self._encoder

    def manifest(self, memo_dir: str | Path | None) -> dict:
        return encoder_manifest(self.config, memo_dir, loader=self)


def transfer_splits(task: str, train: PairData, transfer: Iterable[str], data_dir: str | Path | None = None,
                    limit: int | None = None) -> dict[str, PairData]:
    """The validation splits of the `transfer` tasks as "transfer:<name>" splits, without the pairs that
    share a sentence with `train` (a gain there could be memorisation, not transfer); where some were removed, the
    whole split as "transfer:<name>-all" too. Harm is judged on both: on STS-B validation, whose pairs from MRPC
    share sentences with MRPC train, an MRPC model moved those pairs against the rest and lost 0.016 Spearman
    while its unseen pairs gained 0.0015."""
    seen = set(train.sentence1) | set(train.sentence2)
    out = {}
    for name in transfer:
        if name == task:
            continue
        d = load_splits(name, ("validation",), data_dir)["validation"]
        if limit is not None:
            d = d.subset(limit)
        keep = [i for i, (a, b) in enumerate(zip(d.sentence1, d.sentence2)) if a not in seen and b not in seen]
        out[TRANSFER_PREFIX + name] = d.select(keep, f"transfer check: {len(d) - len(keep)} pairs sharing a "
                                                     f"sentence with {task} train removed")
        if len(keep) < len(d):
            out[TRANSFER_PREFIX + name + WHOLE_SUFFIX] = d.select(np.arange(len(d)), f"transfer check: every pair, "
                                                           f"{len(d) - len(keep)} sharing a sentence with {task} train")
    return out


def default_transfer(task: str) -> list[str]:
    """The other tasks the project has: every sweep's do-no-harm checks."""
    return [t for t in task_names() if t != task]


def load_study(task: str, encoder: EncoderConfig | None = None, teacher: TeacherConfig | None = None, *,
               data_dir: str | Path | None = None, cache_dir: str | Path | None = None,
               limit: int | None = None, transfer: Iterable[str] = (), progress=None,
               lazy=None, teacher_compute=None, teacher_device: str | None = None,
               silver: int | None = None, silver_seed: int = 0,
               ) -> tuple[StudyData, dict[str, Any] | None]:
    """StudyData for `task` (teacher=None: no ce_margin target) and the teacher record, with the teacher's
    quality per split (Spearman, error correlation with the frozen cosine, rank average) in the record.

    limit: keep the first `limit` pairs of every split (smoke tests). transfer: other tasks whose
    validation pairs are scored by every trained group (`transfer_splits`). lazy: what encodes a sentence
    missing from the cache (default a LazyEncoder of `encoder`; the sweeps pass a Ray actor pool).
    teacher_compute: where the teacher trains on a cache miss (`teacher_scores`' compute; default here).
    teacher_device: the torch device it trains on here (None: the best available).
    silver: build this many silver pairs of the train sentences (`embed_lib.training.silver`, seeded by silver_seed)
    for the teacher to score with the splits (they enter its cache key): `StudyData.silver`, for distillation.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"load_study(limit={limit!r}): give a whole number of pairs per split, 1 or more (None: all).")
    if isinstance(transfer, str):
        raise TypeError(f"load_study(transfer={transfer!r}): give a list of task names, e.g. [{transfer!r}].")
    if silver is not None and teacher is None:
        raise ValueError(f"load_study(silver={silver!r}): silver pairs have no labels, only the teacher's scores; give "
                         "a teacher, or no silver pairs (--no-silver).")
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    splits = load_splits(task, SPLITS, data_dir)
    if limit is not None:
        splits = {k: v.subset(limit) for k, v in splits.items()}
    extra = transfer_splits(task, splits["train"], transfer, data_dir, limit)
    emb, _ = embed_splits({**splits, **extra}, lazy or LazyEncoder(encoder or EncoderConfig()), root)
    if hasattr(lazy, "shutdown"):  # an encoder pool: release its workers before the teacher trains
        lazy.shutdown()
    scores, record = (None, None)
    scored = dict(splits)
    if silver is not None:
        # unseen pairs of train sentences; no sentence of validation, test or a transfer check among them
        banned = {t for name, d in {**splits, **extra}.items() if name != "train" for t in d.texts()}
        scored[SILVER] = build_silver(splits["train"], emb.texts, emb.vectors, silver, silver_seed, banned)
        row = {t: i for i, t in enumerate(emb.texts)}
        emb.splits[SILVER] = EmbeddedSplit(scored[SILVER], np.array([row[t] for t in scored[SILVER].sentence1]),
                                           np.array([row[t] for t in scored[SILVER].sentence2]))
    if teacher is not None:
        scores, record = teacher_scores(scored, teacher, root, device=teacher_device, progress=progress,
                                        compute=teacher_compute)
    data = prepare_study(emb, scores)
    if record is not None and SILVER in scored:
        record = {**record, "silver": {"pairs": len(scored[SILVER]), "seed": silver_seed,
                                       "fingerprint": scored[SILVER].fingerprint, "note": scored[SILVER].split_note}}
    if record is not None:
        record = {**record, "quality": quality_report(
            scores, {k: data.splits[k].s0 for k in SPLITS}, {k: data.splits[k].y.numpy() for k in SPLITS})}
    return data, record


def embed_splits(splits, lazy: LazyEncoder, cache_dir: str | Path | None = None) -> tuple[EmbeddedTask, EmbeddingCache]:
    """Every distinct sentence of `splits` through the cache; the model loads only if one is missing."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    cache = EmbeddingCache(lazy.manifest(root), root)
    return embed_task(splits, cache, lazy), cache


def embed_retrieval_set(split, lazy, cache_dir=None) -> tuple[RetrievalSet, np.ndarray]:
    """The retrieval set of a binary PairData split and its corpus vectors (n, d), through the embedding
    cache (`lazy` encodes what is missing, as in `study.embed_splits`)."""

    if not split.binary:
        raise ValueError(f"Task {split.task!r} is graded; the retrieval check needs a binary duplicate task "
                         "(qqp, mrpc).")
    rs = build_retrieval_set(split.sentence1, split.sentence2, split.label)
    emb, _ = embed_splits({split.split: split}, lazy, cache_dir)
    row = {t: i for i, t in enumerate(emb.texts)}
    return rs, np.ascontiguousarray(emb.vectors[[row[t] for t in rs.texts]])


