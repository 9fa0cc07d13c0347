"""embed_lib: pair-level adapters over frozen sentence embeddings.

Everything scientific lives here and runs without Ray. Sub-packages by concern, each importing only the ones
below it (the layers contract in pyproject.toml, checked by `lint-imports` in `make test`):

    cli        `python -m embed_lib <command>`: arguments, commands, the registry listing
    tracking   MLflow glue: runs and provenance, the model registry and its promotion rule, pyfunc models
    report     the reference study's comparison tables
    pipeline   task -> cached embeddings (+ held-out teacher) -> tensors, shared by sweeps and commands
    teacher    the held-out cross-encoder: its config, recipe, intermediate stage, K-fold scores, served model
    training   tensors, difficulty signals, adapters, losses, the seed-group loop, metrics, selection, export
    encoding   the frozen encoder (torch / ONNX Runtime), its weights and its content-addressed cache
    config     the experiment dataclasses          data   built-in tasks and your own pair files

`sweeps/` and `serving/` import this package, never the reverse. The names most code needs are importable from
`embed_lib` itself (`from embed_lib import AdapterConfig, load_study, train_seed_group`).
"""
from __future__ import annotations

import importlib
from typing import Any

from embed_lib import _moved

__version__ = "0.1.0"

#: the core a user imports, by the module that defines it (loaded on first use: `import embed_lib` stays light)
_EXPORTS = {
    "AdapterConfig": "config", "EncoderConfig": "config", "default_cache_dir": "config",
    "PairData": "data.tasks", "load_task": "data.tasks", "load_splits": "data.tasks", "task_names": "data.tasks",
    "FrozenEncoder": "encoding.encoders", "EmbeddingCache": "encoding.cache", "embed_task": "encoding.cache",
    "TeacherConfig": "teacher.config", "teacher_preset": "teacher.config", "teacher_scores": "teacher.scores",
    "PairCrossEncoder": "teacher.cross_encoder",
    "StudyData": "training.tensors", "prepare_study": "training.tensors", "PairAdapter": "training.adapters",
    "GroupResult": "training.seed_group", "train_seed_group": "training.seed_group",
    "select_winner": "training.selection", "save_adapter": "training.export", "load_adapter": "training.export",
    "load_study": "pipeline.prepare", "LazyEncoder": "pipeline.prepare",
    "load_registered": "tracking.registry", "model_name": "tracking.registry",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"embed_lib.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'embed_lib' has no attribute {name!r}")


_moved.install()
