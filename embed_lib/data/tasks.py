"""Task loaders: the four pair benchmarks from a local mirror or the Hugging Face Hub.

First stage of the data flow (task loader -> frozen encoder -> cache -> signals -> adapters).
A task split is a `PairData`: two aligned lists of sentences, the normalised gold `label`
(STS-B: score/5 in [0, 1]; MRPC, QQP, PAWS: 0/1) and the `raw_label` as published.

Sources. The mirror (`../shared/data` layout, chosen by `data_dir=` or $EMBED_DATA_DIR, else found beside the
clone as `make` finds it) and the Hub hold the same columns. Where a source lacks a labelled split, a seeded split
of another one is made and described in `PairData.split_note`, which every result carries:
- mirror PAWS: only labeled_final validation (8,000 pairs) -> 70/15/15 train/validation/test;
- mirror QQP: a 15,497-pair subset of GLUE train -> 70/15/15 train/validation/test;
- Hub QQP: GLUE test labels are hidden -> GLUE validation split 50/50 into validation/test;
- Hub MRPC: GLUE test labels are hidden -> an error that points to the mirror (MSRP test labels).
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import pandas as pd

SPLITS = ("train", "validation", "test")
#: fractions of a derived 3-way split; the seed is fixed so every run sees the same pairs.
DERIVED_FRACTIONS = {"train": 0.70, "validation": 0.15, "test": 0.15}
DERIVED_SEED = 0


#: where a clone of this repository finds the mirror when $EMBED_DATA_DIR is unset: beside it, as `make` and
#: cluster/local.sh look for it (before, `python -m embed_lib ...` run by hand in a fresh clone read the Hub)
BESIDE_THE_CLONE = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def default_data_dir() -> Path | None:
    """The local data mirror: $EMBED_DATA_DIR (set but empty: none), else `../shared/data` beside this clone where it
    holds the mirror (its stsb/train.parquet), else None: tasks load from the Hub."""
    value = os.environ.get("EMBED_DATA_DIR")
    if value is not None:
        return Path(value).absolute() if value else None
    try:
        beside = (BESIDE_THE_CLONE / "stsb" / "train.parquet").is_file()
    except OSError:  # a folder this user may not look into (a worker node's user beside the head's files): none
        beside = False
    return BESIDE_THE_CLONE if beside else None


@dataclass(frozen=True)
class SourceSplit:
    """Where one split comes from: a file / Hub split, optionally a seeded part of it."""

    name: str  # mirror: parquet file stem; Hub: split name
    parts: dict[str, float] | None = None  # None: the whole split; else fractions of a derived split


@dataclass(frozen=True)
class Source:
    columns: tuple[str, str, str]  # sentence a, sentence b, label
    label_scale: float  # raw label / label_scale = normalised label
    splits: dict[str, SourceSplit]
    hub_id: str | None = None
    hub_config: str | None = None
    subdir: str | None = None  # mirror sub-directory


@dataclass(frozen=True)
class TaskSpec:
    name: str
    binary: bool
    mirror: Source
    hub: Source

    @property
    def primary_metric(self) -> str:
        return "spearman"


def _derived(name: str, fractions: dict[str, float]) -> dict[str, SourceSplit]:
    return {split: SourceSplit(name, fractions) for split in fractions}


_THREE_WAY = {s: SourceSplit(s) for s in SPLITS}

TASKS: dict[str, TaskSpec] = {
    "stsb": TaskSpec(
        "stsb", binary=False,
        mirror=Source(("sentence1", "sentence2", "label"), 5.0, _THREE_WAY, subdir="stsb"),
        hub=Source(("sentence1", "sentence2", "score"), 1.0, _THREE_WAY, hub_id="sentence-transformers/stsb"),
    ),
    "mrpc": TaskSpec(
        "mrpc", binary=True,
        mirror=Source(("sentence1", "sentence2", "label"), 1.0, _THREE_WAY, subdir="mrpc"),
        hub=Source(("sentence1", "sentence2", "label"), 1.0, _THREE_WAY, hub_id="nyu-mll/glue", hub_config="mrpc"),
    ),
    "paws": TaskSpec(
        "paws", binary=True,
        mirror=Source(("sentence1", "sentence2", "label"), 1.0, _derived("validation", DERIVED_FRACTIONS), subdir="paws"),
        hub=Source(("sentence1", "sentence2", "label"), 1.0, _THREE_WAY,
                   hub_id="google-research-datasets/paws", hub_config="labeled_final"),
    ),
    "qqp": TaskSpec(
        "qqp", binary=True,
        mirror=Source(("question1", "question2", "label"), 1.0, _derived("train_subset", DERIVED_FRACTIONS), subdir="qqp"),
        hub=Source(("question1", "question2", "label"), 1.0,
                   {"train": SourceSplit("train"), **_derived("validation", {"validation": 0.5, "test": 0.5})},
                   hub_id="nyu-mll/glue", hub_config="qqp"),
    ),
}


#: tasks registered from the user's own files (embed_lib.data.custom_tasks.register): name -> (spec, splits)
CUSTOM: dict[str, tuple] = {}
#: what a custom task's name looks like (it names an experiment and a registered model)
TASK_SLUG = re.compile(r"[a-z0-9][a-z0-9_-]{0,47}")


def task_names() -> list[str]:
    """The built-in tasks (custom tasks are in CUSTOM)."""
    return sorted(TASKS)


def get_task(name: str) -> TaskSpec:
    if name not in TASKS:
        raise ValueError(f"Unknown task {name!r}. Valid tasks: {task_names()}.")
    return TASKS[name]


@dataclass(frozen=True)
class PairData:
    """One split of a pair task. `label` is normalised to [0, 1]; `raw_label` is as published."""

    task: str
    split: str
    source: str
    split_note: str
    binary: bool
    sentence1: list[str]
    sentence2: list[str]
    label: np.ndarray  # (n,) float32 in [0, 1]
    raw_label: np.ndarray  # (n,)
    ids: np.ndarray = field(repr=False)  # (n,) row positions in the source split

    def __len__(self) -> int:
        return len(self.label)

    def mirror_dir(self) -> Path | None:
        """The mirror folder (`load_task`'s data_dir) this split was read from; None for the Hub or a custom file."""
        if self.source.startswith("mirror:"):  # "mirror:<data_dir>/<subdir>/<file>.parquet", written by load_task
            return Path(self.source[len("mirror:"):]).parent.parent
        return None

    def texts(self) -> list[str]:
        """Distinct sentences of the split, in first-seen order."""
        return list(dict.fromkeys([*self.sentence1, *self.sentence2]))

    def subset(self, n: int) -> PairData:
        """The first n pairs (for smoke tests)."""
        return PairData(self.task, self.split, self.source, self.split_note + f"; first {n} pairs",
                        self.binary, self.sentence1[:n], self.sentence2[:n], self.label[:n],
                        self.raw_label[:n], self.ids[:n])

    def select(self, rows: np.ndarray, note: str) -> PairData:
        """The pairs at `rows`, with `note` added to the split note."""
        rows = np.asarray(rows, dtype=np.int64)
        return PairData(self.task, self.split, self.source, self.split_note + f"; {note}", self.binary,
                        [self.sentence1[i] for i in rows], [self.sentence2[i] for i in rows], self.label[rows],
                        self.raw_label[rows], self.ids[rows])

    @property
    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for a, b, y in zip(self.sentence1, self.sentence2, self.label.tolist()):
            h.update(f"{a}\x1f{b}\x1f{y:.6f}\x1e".encode())
        return h.hexdigest()[:16]


def _read_mirror(source: Source, data_dir: Path, stem: str) -> pd.DataFrame:
    path = data_dir / source.subdir / f"{stem}.parquet"
    if not path.is_file():
        raise FileNotFoundError(
            f"Missing data file {path}. Point data_dir / $EMBED_DATA_DIR at a mirror with the "
            f"layout <dir>/{source.subdir}/{stem}.parquet (see ../shared/data/README.md), or unset it to use the Hub.")
    return pd.read_parquet(path)


def _read_hub(source: Source, split: str) -> pd.DataFrame:
    import datasets  # lazy: only the Hub path needs it, and it takes a second to import

    try:
        ds = datasets.load_dataset(source.hub_id, source.hub_config, split=split)
    except Exception as exc:  # offline, unknown id, ...: say what was tried and the alternative
        raise RuntimeError(
            f"Could not load {source.hub_id} ({source.hub_config}) split {split!r} from the Hub: {exc}. "
            "Offline, set $EMBED_DATA_DIR (or data_dir=) to a local mirror.") from exc
    return ds.to_pandas()


def _derived_rows(n: int, parts: dict[str, float], split: str) -> np.ndarray:
    order = np.random.default_rng(DERIVED_SEED).permutation(n)
    names = list(parts)
    bounds = np.cumsum([0.0] + [parts[k] for k in names])
    bounds = np.round(bounds / bounds[-1] * n).astype(int)
    i = names.index(split)
    return np.sort(order[bounds[i]: bounds[i + 1]])


def load_task(name: str, split: str, data_dir: str | Path | None = None, *, source: str = "auto") -> PairData:
    """Load one split of a task.

    source: "mirror" (needs data_dir or $EMBED_DATA_DIR), "hub", or "auto" (mirror when a data
    directory is known, else the Hub).
    """
    if name in CUSTOM:
        splits = CUSTOM[name][1]
        if split not in splits:
            raise ValueError(f"Task {name!r} ({CUSTOM[name][0].source}) has no {split!r} split; it has "
                             f"{sorted(splits)}.")
        return splits[split]
    spec = get_task(name)
    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r} for task {name!r}. Valid splits: {list(SPLITS)}.")
    if source not in ("auto", "mirror", "hub"):
        raise ValueError(f"Unknown source {source!r}. Valid sources: ['auto', 'hub', 'mirror'].")
    data_dir = Path(data_dir).absolute() if data_dir is not None else default_data_dir()
    use_mirror = source == "mirror" or (source == "auto" and data_dir is not None)
    if use_mirror and data_dir is None:
        raise ValueError("source='mirror' needs data_dir= or $EMBED_DATA_DIR pointing at the local mirror.")
    src = spec.mirror if use_mirror else spec.hub
    part = src.splits[split]
    if use_mirror:
        frame = _read_mirror(src, data_dir, part.name)
        where = f"mirror:{data_dir / src.subdir / part.name}.parquet"
    else:
        frame = _read_hub(src, part.name)
        where = f"hub:{src.hub_id}" + (f"/{src.hub_config}" if src.hub_config else "") + f":{part.name}"

    col_a, col_b, col_y = src.columns
    missing = [c for c in src.columns if c not in frame.columns]
    if missing:
        raise ValueError(f"{where}: missing column(s) {missing}; expected columns {list(src.columns)}, "
                         f"found {list(frame.columns)}.")
    ids = np.arange(len(frame))
    note = f"{part.name} (official split)"
    if part.parts is not None:
        ids = _derived_rows(len(frame), part.parts, split)
        frac = "/".join(f"{int(round(v * 100))}" for v in part.parts.values())
        note = f"seeded {frac} split of {part.name} (seed {DERIVED_SEED}): {split} part"
        frame = frame.iloc[ids]
    return _to_pairs(spec, src, frame, split, where, note, ids)


def _to_pairs(spec: TaskSpec, src: Source, frame: pd.DataFrame, split: str, where: str, note: str,
              ids: np.ndarray) -> PairData:
    col_a, col_b, col_y = src.columns
    for col in (col_a, col_b):
        bad = [i for i, v in enumerate(frame[col].tolist()) if not isinstance(v, str)]
        if bad:
            raise ValueError(f"{where}: column {col!r} must hold strings; row {int(ids[bad[0]])} holds "
                             f"{frame[col].iloc[bad[0]]!r} ({len(bad)} such rows).")
    try:
        raw = frame[col_y].to_numpy(dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: column {col_y!r} must be numeric: {exc}") from exc
    if np.isnan(raw).any():
        raise ValueError(f"{where}: column {col_y!r} has {int(np.isnan(raw).sum())} missing labels.")
    if spec.binary and not np.isin(raw, (0.0, 1.0)).all():
        hidden = bool((raw < 0).any())
        hint = (" The labels of this split are hidden (-1) on the Hub; use the local mirror "
                "($EMBED_DATA_DIR), which has labelled test sets.") if hidden else ""
        raise ValueError(f"{where}: column {col_y!r} must be 0/1 for task {spec.name!r}; found values "
                         f"{sorted(set(np.unique(raw).tolist()))[:5]}.{hint}")
    if not spec.binary and ((raw < 0).any() or (raw > src.label_scale).any()):
        raise ValueError(f"{where}: column {col_y!r} must lie in [0, {src.label_scale}] for task "
                         f"{spec.name!r}; found [{raw.min()}, {raw.max()}].")
    label = (raw / src.label_scale).astype(np.float32)
    return PairData(spec.name, split, where, note, spec.binary, frame[col_a].tolist(), frame[col_b].tolist(),
                    label, raw, np.asarray(ids))


def distinct_texts(splits: Mapping[str, PairData]) -> list[str]:
    """Distinct sentences of several splits, in first-seen order (what the encoder and caches work on)."""
    return list(dict.fromkeys(t for d in splits.values() for t in (*d.sentence1, *d.sentence2)))


def load_splits(name: str, splits: Sequence[str] = SPLITS, data_dir: str | Path | None = None,
                *, source: str = "auto") -> dict[str, PairData]:
    """The named splits; a custom task gives those of them its source has."""
    if isinstance(splits, str):  # else read as the splits 't', 'r', 'a', ...
        raise TypeError(f"load_splits(splits={splits!r}): give a list of split names, e.g. [{splits!r}] (load_task "
                        "reads one split).")
    if name in CUSTOM:
        splits = [s for s in splits if s in CUSTOM[name][1]]
    return {s: load_task(name, s, data_dir, source=source) for s in splits}
