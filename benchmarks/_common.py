"""Shared helpers for benchmark scripts: write figures to results/benchmarks/<name>.json and print them."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("EMBED_DATA_DIR", str(REPO.parent / "shared" / "data"))

# after the environment above: what embed_lib imports reads it
from embed_lib.report.files import ISA_FLAGS, cpu_flags, cpu_model, machine  # noqa: E402, F401 (benchmarks' names)


def write_results(name: str, figures: dict) -> Path:
    out = REPO / "results" / "benchmarks" / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": name, "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine(), **figures}
    out.write_text(json.dumps(record, indent=2))
    print(json.dumps(figures, indent=2))
    print(f"wrote {out}")
    return out


def add_champion_args(ap, backend: str = "torch") -> None:
    """--model-uri, --cross-encoder and --cross-encoder-backend: the registered adapter and cross-encoder a cascade
    benchmark reads (`champion_and_cross_encoder`)."""
    ap.add_argument("--model-uri", default="models:/pair-residual-stsb@champion")
    ap.add_argument("--cross-encoder", default="models:/cross-encoder-stsb@current")
    ap.add_argument("--cross-encoder-backend", default=backend, choices=("torch", "onnx", "onnx-int8"))


def champion_and_cross_encoder(args) -> tuple:
    """(model, config, manifest, version, cross-encoder): the registered adapter at args.model_uri (an alias pinned
    to its version once) and the cross-encoder args.cross_encoder, from the MLflow store of $MLFLOW_TRACKING_URI or
    ./mlflow.db (`make run`, `make teacher`)."""
    from embed_lib.cli.evaluate import _pinned
    from embed_lib.config import default_cache_dir
    from embed_lib.teacher.cross_encoder import PairCrossEncoder
    from embed_lib.tracking.cross_encoder_registry import resolve_cross_encoder
    from embed_lib.tracking.registry import load_registered
    from embed_lib.tracking.runs import default_tracking_uri, require_store

    store = require_store(default_tracking_uri())
    pinned, version = _pinned(args.model_uri, store)
    model, config, manifest = load_registered(pinned, store)
    ce = PairCrossEncoder(resolve_cross_encoder(args.cross_encoder, store), backend=args.cross_encoder_backend,
                          cache_root=default_cache_dir())
    return model, config, manifest, version, ce


def teacher_training_pairs(fast, own: dict) -> tuple[list[list[str]], list[list[str]]]:
    """(the intermediate stage's pairs, one order; fold 0's training pairs in both orders): what the teacher of `own`
    (STS-B's splits) with the recipe `fast` trains on, as `teacher.intermediate` and `teacher.scores` pick them."""
    import numpy as np

    from embed_lib.teacher import intermediate
    from embed_lib.teacher.scores import fold_assignment

    splits = intermediate._splits(fast, own)
    stage, _ = intermediate._sample(splits, fast.intermediate_pairs, fast.seed, intermediate.left_out(splits, own))
    train = own["train"]
    rows = np.nonzero(fold_assignment(len(train), fast.folds, fast.seed) != 0)[0]
    fold = [[train.sentence1[i], train.sentence2[i]] for i in rows]
    return stage, fold + [[b, a] for a, b in fold]


def stsb_fast_teacher(precision: str) -> tuple[dict, Any, Any]:
    """(STS-B's train, validation and test splits, the fast teacher recipe in `precision`, its cross-encoder as a new
    fold starts it: seed 0's head) for the teacher benchmarks, on one torch thread."""
    import torch

    from embed_lib.data.tasks import load_task
    from embed_lib.teacher import recipe
    from embed_lib.teacher.config import teacher_preset

    torch.set_num_threads(1)
    own = {s: load_task("stsb", s, os.environ.get("EMBED_DATA_DIR")) for s in ("train", "validation", "test")}
    fast = teacher_preset("fast", precision=precision)
    return own, fast, recipe.load(fast, "cpu", seed=0)
