"""Your own pair data as a task: a CSV / TSV / JSONL / Parquet file or a Hugging Face dataset id.

    spec = CustomTask.from_args("my_pairs.csv", text_columns=("a", "b"), label_column="score",
                                label_range=(0, 5))
    register(spec)            # the task is now known by its slug, e.g. "my_pairs"
    load_splits("my_pairs")   # train / validation / test PairData, validated

Labels are graded (declare their range: normalised to [0, 1]) or binary (0/1; detected when every label is 0 or 1
and no range is declared). Splits come from the file's split column (train / validation (also val, dev) / test),
else a seeded 70/15/15 split named in every result; a file used only for evaluation is declared with
`eval_split="test"`; a split whose labels are all one value is refused (its Spearman is undefined). Every failure
names the source, the row (1-based, as a spreadsheet shows data rows), the column and the rule, before anything is
encoded, cached or logged.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from embed_lib.data.tables import read_table, sep_hint
from embed_lib.data.tasks import CUSTOM, DERIVED_FRACTIONS, DERIVED_SEED, SPLITS, TASK_SLUG, PairData, task_names

SPLIT_NAMES = {"train": "train", "training": "train", "validation": "validation", "val": "validation",
               "valid": "validation", "dev": "validation", "test": "test", "testing": "test"}
#: the fewest pairs a split may have (a Spearman on fewer says little)
MIN_PAIRS = {"train": 20, "validation": 10, "test": 10}


def slug_of(source: str) -> str:
    """'data/My Pairs.v2.csv' -> 'my_pairs_v2'; 'hf:org/name:config' -> 'name_config'."""
    base = source[3:].split("/")[-1].replace(":", "_") if source.startswith("hf:") else Path(source).stem
    slug = re.sub(r"[^a-z0-9_-]+", "_", base.lower()).strip("_-")[:48]
    return slug or "custom"


@dataclass(frozen=True)
class CustomTask:
    name: str
    source: str  # a file path or hf:<id>[:<config>]
    text_columns: tuple[str, str] = ("sentence1", "sentence2")
    label_column: str = "label"
    label_range: tuple[float, float] | None = None
    binary: bool = False
    split_column: str = "split"
    eval_split: str | None = None  # the whole source is this split (evaluation only)

    @classmethod
    def from_args(cls, source: str, text_columns=("sentence1", "sentence2"), label_column: str = "label",
                  label_range=None, binary: bool = False, split_column: str = "split", eval_split: str | None = None,
                  name: str | None = None) -> "CustomTask":
        name = name or slug_of(source)
        if not TASK_SLUG.fullmatch(name):
            raise ValueError(f"Task name {name!r} is not a slug: use lowercase letters, digits, '_' and '-' "
                             "(at most 48), e.g. --task-name my_pairs.")
        if name in task_names():
            raise ValueError(f"Task name {name!r} is a built-in task; give your data another --task-name.")
        if len(text_columns) != 2 or text_columns[0] == text_columns[1]:
            raise ValueError(f"--text-columns needs exactly two column names, one per sentence of a pair; got "
                             f"{list(text_columns)}.")
        if binary and label_range is not None:
            raise ValueError("Give either --binary or --label-range, not both.")
        if label_range is not None and not float(label_range[0]) < float(label_range[1]):
            raise ValueError(f"--label-range {label_range[0]},{label_range[1]}: the low end must be below the high end.")
        if eval_split is not None and eval_split not in SPLITS:
            raise ValueError(f"--split {eval_split!r}: valid splits are {list(SPLITS)}.")
        if source.startswith("hf:") and not source[3:].partition(":")[0].strip():
            raise ValueError(f"--task {source!r} names no dataset: give hf:<dataset id>[:<config>], e.g. "
                             "hf:sentence-transformers/stsb.")
        if not source.startswith("hf:") and not Path(source).is_file():
            raise FileNotFoundError(f"No pair file {source}: give a .csv, .tsv, .jsonl or .parquet file, or "
                                    "hf:<dataset id>[:<config>].")
        return cls(name, source, tuple(text_columns), label_column,
                   None if label_range is None else (float(label_range[0]), float(label_range[1])),
                   binary, split_column, eval_split)

    # -- reading -------------------------------------------------------------------------------------------
    def frame(self) -> pd.DataFrame:
        """The source as one table (a Hub dataset's splits in its split column)."""
        if self.source.startswith("hf:"):
            return self._hub_frame()
        return read_table(Path(self.source))

    def _hub_frame(self) -> pd.DataFrame:
        import datasets  # lazy: only the Hub path needs it, and it takes a second to import

        ident, _, config = self.source[3:].partition(":")
        try:
            ds = datasets.load_dataset(ident, config or None)
        except Exception as exc:  # offline, unknown id, ...
            raise RuntimeError(f"Could not load {self.source} from the Hugging Face Hub: {exc}. Offline, give a "
                               "local file instead.") from exc
        frames = []
        for split, part in ds.items():
            f = part.to_pandas()
            f[self.split_column] = split
            frames.append(f)
        return pd.concat(frames, ignore_index=True)

    # -- validation and splitting ---------------------------------------------------------------------------
    def _fail(self, row: int | None, column: str | None, rule: str) -> ValueError:
        where = self.source + (f", row {row + 1}" if row is not None else "") + (f", column {column!r}" if column else "")
        return ValueError(f"{where}: {rule}")

    def _texts(self, frame: pd.DataFrame) -> None:
        for col in self.text_columns:
            for i, v in enumerate(frame[col].tolist()):
                if v is None or (isinstance(v, float) and v != v):  # a missing cell: pandas reads an empty one as NaN
                    raise self._fail(i, col, "text is missing (an empty cell); fill it in or drop the row.")
                if not isinstance(v, str):
                    raise self._fail(i, col, f"text must be a string; found {v!r}.")
                if not v.strip():
                    raise self._fail(i, col, "text is empty.")

    def _labels(self, frame: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, bool]:
        col = self.label_column
        raw = pd.to_numeric(frame[col], errors="coerce").to_numpy(dtype=np.float64)
        bad = np.nonzero(np.isnan(raw))[0]
        if len(bad):
            value = frame[col].iloc[bad[0]]
            rule = "label is missing." if value is None or (isinstance(value, float) and np.isnan(value)) \
                else f"label must be a number; found {value!r}."
            raise self._fail(int(bad[0]), col, rule)
        binary = self.binary or (self.label_range is None and bool(np.isin(raw, (0.0, 1.0)).all()))
        if binary:
            off = np.nonzero(~np.isin(raw, (0.0, 1.0)))[0]
            if len(off):
                raise self._fail(int(off[0]), col, f"binary labels must be 0 or 1; found {raw[off[0]]:g}.")
            return raw, raw.astype(np.float32), True
        if self.label_range is None:
            raise self._fail(None, col, f"labels range over [{raw.min():g}, {raw.max():g}]: declare their scale "
                                        "with --label-range LO,HI (graded) or --binary (0/1).")
        flags = np.nonzero(frame[col].map(lambda v: isinstance(v, (bool, np.bool_))).to_numpy())[0]
        if len(flags):  # a graded scale read true as 1: refused, as "high" is
            raise self._fail(int(flags[0]), col, f"label must be a number; found {frame[col].iloc[flags[0]]!r} "
                                                 "(true / false are labels of --binary).")
        lo, hi = self.label_range
        off = np.nonzero((raw < lo) | (raw > hi))[0]
        if len(off):
            raise self._fail(int(off[0]), col, f"label {raw[off[0]]:g} lies outside --label-range {lo:g},{hi:g}.")
        return raw, ((raw - lo) / (hi - lo)).astype(np.float32), False

    def _split_of(self, frame: pd.DataFrame) -> tuple[np.ndarray, str]:
        n = len(frame)
        if self.eval_split is not None:
            return np.full(n, self.eval_split, dtype=object), f"the whole of {self.source} (evaluation only)"
        if self.split_column in frame.columns:
            values = frame[self.split_column].astype(str).str.lower().tolist()
            for i, v in enumerate(values):
                if v not in SPLIT_NAMES:
                    raise self._fail(i, self.split_column, f"unknown split {v!r}; use train, validation (val, dev) "
                                                           "or test.")
            return np.array([SPLIT_NAMES[v] for v in values], dtype=object), f"{self.split_column} column of {self.source}"
        # by distinct pair (either order): a pair the file repeats lands in one split, never in two
        keys = [tuple(sorted(p)) for p in zip(frame[self.text_columns[0]], frame[self.text_columns[1]])]
        group = {k: g for g, k in enumerate(dict.fromkeys(keys))}
        order = np.random.default_rng(DERIVED_SEED).permutation(len(group))
        bounds = np.round(np.cumsum([0.0] + list(DERIVED_FRACTIONS.values())) * len(group)).astype(int)
        of_group = np.empty(len(group), dtype=object)
        for k, name in enumerate(DERIVED_FRACTIONS):
            of_group[order[bounds[k]: bounds[k + 1]]] = name
        return (np.array([of_group[group[k]] for k in keys], dtype=object),
                f"seeded 70/15/15 split of {self.source}'s distinct pairs (seed {DERIVED_SEED})")

    def _no_pair_in_two_splits(self, a: list[str], b: list[str], split: np.ndarray) -> None:
        first: dict[tuple[str, str], int] = {}
        for i, key in enumerate(tuple(sorted(p)) for p in zip(a, b)):
            j = first.setdefault(key, i)
            if split[j] != split[i]:
                raise self._fail(i, None, f"the pair also appears in row {j + 1} in split {split[j]!r} (this row: "
                                          f"{split[i]!r}); a pair in two splits leaks the answer: drop one.")

    def load(self) -> dict[str, PairData]:
        """Every split the source has, validated (see the module docstring)."""
        frame = self.frame().reset_index(drop=True)
        missing = [c for c in (*self.text_columns, self.label_column) if c not in frame.columns]
        if missing:
            raise self._fail(None, missing[0], f"column not found; the columns are {list(frame.columns)} (name "
                                               f"them with --text-columns A,B and --label-column C){sep_hint(frame)}.")
        if frame.empty:
            raise self._fail(None, None, "no pairs: the file names its columns and has no rows; give one pair per "
                                         "row below them.")
        self._texts(frame)
        raw, label, binary = self._labels(frame)
        split, note = self._split_of(frame)
        a, b = frame[self.text_columns[0]].tolist(), frame[self.text_columns[1]].tolist()
        self._no_pair_in_two_splits(a, b, split)
        out = {}
        for name in SPLITS:
            rows = np.nonzero(split == name)[0]
            if not len(rows):
                continue
            if len(rows) < MIN_PAIRS[name]:
                raise self._fail(None, None, f"split {name!r} has {len(rows)} pairs; at least {MIN_PAIRS[name]} are "
                                             "needed.")
            if len(np.unique(raw[rows])) < 2:  # a rank correlation, an ROC-AUC of one label is undefined (NaN)
                raise self._fail(None, self.label_column, f"every label of split {name!r} is {raw[rows[0]]:g} "
                                 f"({len(rows)} pairs); scoring it needs labels that differ: add pairs of other labels.")
            out[name] = PairData(self.name, name, self.source, f"{note}: {name} part", binary,
                                 [a[i] for i in rows], [b[i] for i in rows], label[rows], raw[rows], rows)
        if self.eval_split is None and "train" not in out:
            raise self._fail(None, self.split_column, "no train split: training needs one (for evaluation only, "
                                                      "declare --split test).")
        return out


def register(task: CustomTask) -> str:
    """Validate the source now (so a bad file fails before anything runs) and make the task known by its name."""
    splits = task.load()
    CUSTOM[task.name] = (task, splits)
    return task.name
