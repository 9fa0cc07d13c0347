"""embed_lib: pair-level adapters over frozen sentence embeddings.

Everything scientific lives here and runs without Ray, in data-flow order: the experiment
configuration (`config`), task loaders (`tasks`; your own pair files: `custom_tasks`), the frozen
encoder (`encoders`) and its content-addressed cache (`cache`; `distributed` shards encoding over Ray
actors when Ray is there), difficulty signals (`signals`) and the held-out cross-encoder teacher
(`teacher`, its fine-tuning recipe `teacher_fit`, its optional intermediate stage on other tasks' pairs
`teacher_intermediate`), adapters (`adapters`), the study tensors
(`study_data`), losses (`losses`), training (`train`), metrics (`metrics`), the retrieval re-ranking
check (`retrieval`), diagnostics (`diagnostics`), the reference study (`study`), model selection
(`selection`), export and the MLflow registry (`export`, `registry`, `mlflow_model`, `tracking`), and
the command line (`cli`, `cli_args`, `commands`; `python -m embed_lib`). `sweeps/` and `serving/`
import this package, never the reverse.
"""
from __future__ import annotations

__version__ = "0.1.0"
