"""The teacher's intermediate stage: its backbone trained once on other tasks' pairs before the folds.

A cross-encoder fine-tuned from a bi-encoder's weights (the default, all-MiniLM-L6-v2) starts without ever
having attended across a sentence pair, and STS-B's 5.7k training pairs are few to learn that from. A first
pass over the paraphrase pairs of other tasks (one epoch, one pair order) gives every fold a backbone that
has (`results/study_notes.md`: one model on all of STS-B train, test 0.818 -> 0.835).

What it may read, so that the teacher's held-out scores stay held out: only the *train* split of each
intermediate task, never the teacher's own task (its train pairs are the folds' held-out pairs), and none of the
other tasks' pairs that are also a pair the teacher scores (`left_out`): tasks share pairs (454 of STS-B's train
pairs, 110 of its validation and 119 of its test pairs are MRPC train pairs: STS-B's MSRpar part), and a user's
file may hold a built-in task's pairs. The stage is cached under <cache>/teacher/intermediate/<key>/, keyed by the
backbone, the recipe, the intermediate data's fingerprints and the rows left out, and shared by every fold, by
presets of the same stage recipe (light and strong; fast trains its own: bf16, frozen word embeddings, two shards
averaged every few steps, `teacher.shards`) and by the served teacher of a task.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

from embed_lib.data.tasks import PairData, default_data_dir, load_task, task_names
from embed_lib.encoding.cache import one_at_a_time
from embed_lib.teacher import recipe, shards
from embed_lib.teacher.config import LATER_FIELDS, OTHERS

if TYPE_CHECKING:
    from embed_lib.teacher.config import TeacherConfig

RECORD = "intermediate.json"


def intermediate_tasks(spec: str, task: str) -> list[str]:
    """The tasks of the stage for a teacher of `task`; its own task is refused (its folds would leak)."""
    names = [t for t in task_names() if t != task] if spec == OTHERS else [t.strip() for t in spec.split(",")
                                                                           if t.strip()]
    if task in names:
        raise ValueError(f"TeacherConfig.intermediate={spec!r} includes the teacher's own task {task!r}: its train "
                         f"pairs are the folds' held-out pairs. Leave it out, or use {OTHERS!r}.")
    return sorted(set(names))


@functools.lru_cache(maxsize=None)
def _train_split(name: str, data_dir: Path | None) -> PairData:
    """A task's train split, read once per process (the teacher's key and its stage both need it)."""
    try:
        return load_task(name, "train", data_dir)
    except Exception as exc:
        raise ValueError(f"The teacher's intermediate stage reads the train split of {name!r} and could not: {exc} "
                         "Point $EMBED_DATA_DIR (or --data-dir) at the mirror, or skip the stage with "
                         "--teacher-intermediate '' (TeacherConfig.intermediate='').") from exc


def _scored(own: Mapping[str, PairData]) -> Mapping[str, PairData]:
    """`own` as given, when it is the splits the teacher scores (one split alone is refused: the pairs of its
    validation and test splits must be left out of the stage too)."""
    if not isinstance(own, Mapping):
        raise TypeError(f"the intermediate stage needs every split the teacher scores, e.g. {{'train': ..., "
                        f"'validation': ..., 'test': ...}} (load_splits); got {type(own).__name__}.")
    return own


def _own(own: Mapping[str, PairData]) -> PairData:
    """The train split of the teacher's task, from the splits it scores."""
    if "train" not in _scored(own):
        raise TypeError(f"the intermediate stage needs every split the teacher scores, its train split among them; "
                        f"got the splits {sorted(own)}.")
    return own["train"]


def _splits(cfg: TeacherConfig, own: Mapping[str, PairData]) -> dict[str, PairData]:
    """The stage's train splits for a teacher of `own`'s task, from where that task came from (the same
    mirror; else $EMBED_DATA_DIR or the Hub)."""
    split = _own(own)
    where = split.mirror_dir() or default_data_dir()  # resolved before the per-process cache of _train_split
    return {t: _train_split(t, where) for t in intermediate_tasks(cfg.intermediate, split.task)}


def _pair(a: str, b: str) -> tuple[str, str]:
    """A pair as the same pair however it is ordered, cased or spaced."""
    a, b = " ".join(a.split()).casefold(), " ".join(b.split()).casefold()
    return (a, b) if a <= b else (b, a)


def left_out(splits: Mapping[str, PairData], own: Mapping[str, PairData]) -> dict[str, np.ndarray]:
    """Rows of each stage split (`splits`) whose pair is also a pair of the teacher's own splits (`own`: every
    split it scores), however ordered, cased or spaced: the stage never trains on a pair the teacher then scores.
    Only the splits with such rows."""
    scored = {_pair(a, b) for d in _scored(own).values() for a, b in zip(d.sentence1, d.sentence2)}
    out = {t: np.flatnonzero([_pair(a, b) in scored for a, b in zip(d.sentence1, d.sentence2)])
           for t, d in splits.items()}
    return {t: rows for t, rows in out.items() if len(rows)}


def _sample(splits: dict[str, PairData], per_task: int, seed: int,
            leave_out: Mapping[str, np.ndarray]) -> tuple[list[list[str]], np.ndarray]:
    """(pairs, labels): a seeded sample of at most `per_task` pairs of each split, none of its `leave_out` rows
    (a split with none samples as it did before pairs were left out)."""
    pairs, labels = [], []
    for t, d in splits.items():
        kept = np.setdiff1d(np.arange(len(d)), leave_out.get(t, []))
        rows = np.sort(kept[np.random.default_rng(seed).permutation(len(kept))[:per_task]])
        pairs += [[d.sentence1[i], d.sentence2[i]] for i in rows]
        labels.append(d.label[rows])
    return pairs, np.concatenate(labels).astype(np.float32)


def stage_config(cfg: TeacherConfig) -> TeacherConfig:
    """The stage's recipe: the teacher's, for one epoch over one pair order, batches of 32, no early stopping, at the
    stage's dropout (`stage_dropout`, else the teacher's): a stage that trains at some dropout is the same stage (and
    key) however the teacher's config says so."""
    return dataclasses.replace(cfg, epochs=1, both_orders=False, batch_size=32, early_stopping_fraction=0.0,
                               dropout=cfg.dropout if cfg.stage_dropout is None else cfg.stage_dropout,
                               stage_dropout=None)


def stage_key(cfg: TeacherConfig, own: Mapping[str, PairData]) -> str | None:
    """The cache key of the stage a teacher of `own`'s task starts from (the backbone, the recipe, the
    intermediate data's fingerprints and the rows left out of it, where any are); None without a stage. `own`:
    every split the teacher scores."""
    _own(own)
    if not cfg.intermediate:
        return None
    recipe = dataclasses.asdict(stage_config(cfg))
    recipe = {k: recipe[k] for k in ("model", "lr", "warmup", "weight_decay", "grad_clip", "batch_size",
                                     "max_length", "length_buckets", "seed", "intermediate_pairs")
              + tuple(name for name in LATER_FIELDS if recipe[name] != LATER_FIELDS[name])}
    if cfg.stage_shards > 1:
        recipe["sync_every"] = shards.SYNC_EVERY
        if shards.STEP_ORDER != "formed":  # the stages cached before the shards ordered their steps keep their keys
            recipe["step_order"] = shards.STEP_ORDER
    splits = _splits(cfg, own)
    prints: dict[str, Any] = {t: d.fingerprint for t, d in splits.items()}
    for t, rows in left_out(splits, own).items():  # a stage that leaves nothing out keeps its key (and cache)
        prints[t] = {"data": prints[t], "left_out": hashlib.sha256(rows.astype(np.int64).tobytes()).hexdigest()[:16]}
    blob = json.dumps({"recipe": recipe, "data": prints, "version": 1}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def own_folder(folder: Path) -> Path:
    """A temporary folder of this process's own beside `folder` (`<name>.<pid>.<random>.tmp`), after removing those
    that processes no longer running left there: two sweeps training the same stage at once each write their own
    (a fixed name let the later one delete the first one's stage as it trained), and the first to finish keeps its
    copy (`warm_start`)."""
    for stale in folder.parent.glob(f"{folder.name}.*.tmp"):
        pid = stale.name[len(folder.name) + 1:].split(".")[0]
        if pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    return folder.with_name(f"{folder.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def warm_start(cfg: TeacherConfig, own: Mapping[str, PairData], cache_root: Path, device: str,
               progress: Callable[[str], None]) -> tuple[str | None, dict[str, Any] | None]:
    """(folder, record) of the stage for a teacher of `own`'s task (every split it scores), trained once and then
    read from the cache; (None, None) without a stage. Its new head is drawn from cfg.seed, so that a stage is the
    same model in every fresh cache (up to the rounding of another thread count)."""
    key = stage_key(cfg, own)
    if key is None:
        return None, None
    folder = cache_root / "intermediate" / key
    if (folder / RECORD).is_file():
        return str(folder), json.loads((folder / RECORD).read_text())
    with one_at_a_time(folder, f"intermediate stage {key}", progress):
        if (folder / RECORD).is_file():  # made by a process this one waited for
            return str(folder), json.loads((folder / RECORD).read_text())
        return _train_stage(cfg, own, folder, key, device, progress)


def _train_stage(cfg: TeacherConfig, own: Mapping[str, PairData], folder: Path, key: str, device: str,
                 progress: Callable[[str], None]) -> tuple[str, dict[str, Any]]:
    splits = _splits(cfg, own)
    leave_out = left_out(splits, own)
    pairs, y = _sample(splits, cfg.intermediate_pairs, cfg.seed, leave_out)
    t0 = time.perf_counter()
    say = lambda m: progress(f"intermediate stage: {m}")  # noqa: E731
    if leave_out:
        say("left out " + ", ".join(f"{len(r)} {t} train pairs" for t, r in leave_out.items())
            + f" that are also {_own(own).task} pairs (the teacher scores them)")
    tmp = own_folder(folder)
    if cfg.stage_shards > 1:
        curve, extra = shards.fit_shards(cfg, stage_config(cfg), pairs, y, device, tmp, say)
    else:
        ce = recipe.load(cfg, device, seed=cfg.seed)
        curve, extra = recipe.fit(ce, pairs, y, stage_config(cfg), cfg.seed, progress=say), {}
        ce.save_pretrained(str(tmp), safe_serialization=True)
    record = {"tasks": list(splits), "pairs": len(pairs), "fingerprints": {t: d.fingerprint for t, d in splits.items()},
              "left_out": {t: len(r) for t, r in leave_out.items()}, "curve": curve,
              "seconds": round(time.perf_counter() - t0, 1), "key": key, **extra}
    (tmp / RECORD).write_text(json.dumps(record, indent=2))
    try:
        tmp.rename(folder)
    except OSError:  # another process finished the same stage first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
    return str(folder), record
