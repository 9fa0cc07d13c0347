"""The sweep's command-line flags (shared by both entry scripts) and the parsing of their values."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from embed_lib.cli.args import (add_custom_data_flags, add_data_flags, add_encoder_flags, add_mlflow_flags,
                                add_teacher_flags)
from embed_lib.config import AdapterConfig
from embed_lib.data.tasks import task_names
from embed_lib.pipeline.prepare import default_transfer


def _scalar(text: str) -> Any:
    """'0.1' -> 0.1, 'true' -> True, 'pair_gated' -> 'pair_gated' ('none' stays a string: it is a target name)."""
    if text == "none":
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_grid(items: list[str], file: str | None) -> dict[str, list[Any]]:
    """`key=v1,v2` items and/or a JSON file {key: [values]} -> {key: values} (values parsed as JSON)."""
    grid: dict[str, list[Any]] = json.loads(Path(file).read_text()) if file else {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--grid {item!r}: expected key=v1,v2,...")
        key, values = item.split("=", 1)
        grid[key] = [_scalar(v) for v in values.split(",")]
    valid = {f for f in AdapterConfig.__dataclass_fields__}
    unknown = sorted(set(grid) - valid)
    if unknown:
        raise ValueError(f"Unknown grid key(s) {unknown}. Valid keys: {sorted(valid)}.")
    return grid


def add_sweep_args(p, *, default_samples: int) -> None:
    p.add_argument("--task", default="stsb", help=f"the task to sweep: one of {task_names()} (default stsb), or your "
                                                  "own pairs: a .csv / .tsv / .jsonl / .parquet file or hf:<dataset id> "
                                                  "(inside --working-dir, or a path every node can read)")
    add_custom_data_flags(p)
    add_encoder_flags(p, tau_attn=False)
    p.add_argument("--tau-attn-values", default="1.0",
                   help="comma list of encoder attention temperatures offered to the search (each one is "
                        "precomputed; default 1.0)")
    add_teacher_flags(p, default_preset="fast")
    p.add_argument("--transfer", default="others",
                   help="do-no-harm checks: comma list of tasks whose validation pairs (those sharing no sentence "
                        "with the sweep's train split) every trial is scored on; qqp's duplicates are also a "
                        "retrieval check (the frozen top 20 per query re-ranked, nDCG@10); 'others' = every other "
                        "task (default), 'none' = no checks")
    p.add_argument("--transfer-tolerance", type=float, default=0.001,
                   help="the winner's delta on every transfer check (Spearman; nDCG@10 for retrieval) must be "
                        ">= -tolerance on every seed (default 0.001)")
    p.add_argument("--search", choices=["optuna", "grid"], default="optuna")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="grid values (with --search grid); repeatable")
    p.add_argument("--grid-file", default=None, help="JSON {key: [values]} for --search grid")
    p.add_argument("--num-samples", type=int, default=default_samples, help="Optuna configurations")
    p.add_argument("--no-start-points", action="store_true",
                   help="let Optuna start from random proposals instead of the entry script's START_POINTS")
    p.add_argument("--seeds", type=int, default=5, help="seeds per configuration (default 5)")
    p.add_argument("--seed", type=int, default=0, help="Optuna sampler seed")
    p.add_argument("--max-concurrent", type=int, default=2, help="trials at once (default 2)")
    p.add_argument("--cpus-per-trial", type=float, default=1.0)
    p.add_argument("--gpus-per-trial", type=float, default=0.0, help="fractional GPUs per trial on GPU clusters")
    p.add_argument("--address", default=None, help="Ray address (default: $RAY_ADDRESS or a local Ray); for the "
                   "cluster of cluster/local.sh, eval \"$(cluster/local.sh env)\" in this shell first")
    add_mlflow_flags(p, "sweep-<task>", optional=False)
    p.add_argument("--storage-path", default=None,
                   help="Tune results (default $EMBED_STORAGE_DIR or ./.cache/ray_results, absolute)")
    p.add_argument("--name", default=None, help="sweep name (default <script>-<task>); --resume continues it")
    p.add_argument("--resume", action="store_true", help="continue an interrupted sweep of the same --name")
    add_data_flags(p)
    p.add_argument("--encode-workers", type=int, default=0,
                   help="Ray actors that encode sentences before the trials, one CPU (GPU clusters: one GPU) each; "
                        "0 (default): one per CPU (GPU) of the cluster, at most 4")
    p.add_argument("--epochs", type=int, default=None, help="fix the epochs instead of searching them")
    p.add_argument("--limit", type=int, default=None,
                   help="first N pairs of every split; the winner registers as pair-residual-<task>-limited, never "
                        "touching the aliases of pair-residual-<task>")
    p.add_argument("--smoke-test", action="store_true",
                   help="whole path on 48 pairs per split, 2 seeds, 2 epochs, 3 trials, a tiny teacher; the winner "
                        "registers as pair-residual-<task>-smoke, never touching the aliases of pair-residual-<task>")


def transfer_tasks(value: str, task: str) -> list[str]:
    """--transfer value -> task names ('others': every task but `task`; 'none': no checks)."""
    if value == "others":
        return default_transfer(task)
    if value == "none":
        return []
    names = [t.strip() for t in value.split(",") if t.strip()]
    unknown = sorted(set(names) - set(task_names()))
    if unknown:
        raise ValueError(f"--transfer: unknown task(s) {unknown}. Valid: {task_names()}, 'others' or 'none'.")
    return [t for t in names if t != task]
