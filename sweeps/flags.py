"""The sweep's command-line flags (shared by both entry scripts) and the parsing of their values."""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

from embed_lib.cli.args import (add_custom_data_flags, add_data_flags, add_encoder_flags, add_mlflow_flags,
                                add_teacher_flags, encoder_config, silver_pairs, teacher_config)
from embed_lib.cli.values import float_above, float_list, int_at_least
from embed_lib.config import AdapterConfig
from embed_lib.data.tasks import task_names
from embed_lib.encoding.weights import check_local
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
    grid: dict[str, list[Any]] = {}
    if file:
        try:
            grid = json.loads(Path(file).read_text())
        except OSError as exc:
            raise ValueError(f"--grid-file {file}: {exc.strerror or exc}.") from None
        except ValueError as exc:
            raise ValueError(f"--grid-file {file}: not JSON ({exc}); expected {{key: [values]}}.") from None
        if not isinstance(grid, dict) or not all(isinstance(v, list) and v for v in grid.values()):
            raise ValueError(f"--grid-file {file}: expected a JSON object {{key: [values]}}, each list non-empty.")
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


class _Given(argparse.Action):
    """Stores the value and notes that the flag was given (`<dest>_given`): a default cannot be told from it."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


def add_sweep_args(p, *, default_samples: int) -> None:
    p.add_argument("--task", default="stsb", help=f"the task to sweep: one of {task_names()} (default stsb), or your "
                                                  "own pairs: a .csv / .tsv / .jsonl / .parquet file or hf:<dataset id> "
                                                  "(inside --working-dir, or a path every node can read)")
    add_custom_data_flags(p)
    add_encoder_flags(p, tau_attn=False, device_help="where the encoders and the teacher run: cpu, or cuda (a GPU "
                      "each, as Ray assigns them); default: GPUs where the cluster has them or --gpus-per-trial asks")
    p.add_argument("--tau-attn-values", default="1.0",
                   help="comma list of encoder attention temperatures offered to the search (each one is "
                        "precomputed; default 1.0)")
    add_teacher_flags(p, default_preset="fast")
    p.add_argument("--transfer", default="others",
                   help="do-no-harm checks: comma list of tasks whose validation pairs (those sharing no sentence "
                        "with the sweep's train split, and the whole split where some do) every trial is scored on; "
                        "qqp's duplicates are also a retrieval check (the frozen top 20 per query re-ranked, "
                        "nDCG@10); 'others' = every other task (default), 'none' = no checks")
    p.add_argument("--transfer-tolerance", type=float_above(0, inclusive=True), default=0.001,
                   help="the winner's delta on every transfer check (Spearman; nDCG@10 for retrieval) must be "
                        ">= -tolerance on every seed (default 0.001)")
    p.add_argument("--search", choices=["optuna", "grid"], default="optuna")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="grid values (with --search grid); repeatable")
    p.add_argument("--grid-file", default=None, help="JSON {key: [values]} for --search grid")
    p.add_argument("--num-samples", type=int_at_least(1), default=default_samples, action=_Given,
                   help=f"Optuna configurations (default {default_samples}; --search grid runs each point of its grid "
                        "once)")
    p.add_argument("--no-start-points", action="store_true",
                   help="let Optuna start from random proposals instead of the entry script's start points "
                        "(pair_residual.py: START_POINTS, and TASK_START_POINTS for the task where it has some)")
    p.add_argument("--seeds", type=int_at_least(1), default=5, help="seeds per configuration (default 5)")
    p.add_argument("--seed", type=int, default=0, action=_Given,
                   help="Optuna sampler seed (the same seed repeats a sweep exactly with --max-concurrent 1)")
    p.add_argument("--max-concurrent", type=int_at_least(1), default=2,
                   help="trials at once (default 2). With several, Optuna proposes from the results in hand and ASHA "
                        "stops a trial by the rungs reported so far, so a rerun may try other configurations and pick "
                        "another winner; 1 repeats a sweep exactly, in about twice the trials' time on 2 CPUs")
    p.add_argument("--cpus-per-trial", type=float_above(0), default=1.0, help="CPUs per trial (fractions allowed; "
                                                                               "default 1.0)")
    p.add_argument("--gpus-per-trial", type=float_above(0, inclusive=True), default=0.0,
                   help="fractional GPUs per trial on GPU clusters")
    p.add_argument("--address", default=None, help="Ray address (default: $RAY_ADDRESS or a local Ray); for the "
                   "cluster of cluster/local.sh, eval \"$(cluster/local.sh env)\" in this shell first")
    add_mlflow_flags(p, "sweep-<task>", optional=False)
    p.add_argument("--storage-path", default=None,
                   help="Tune results (default $EMBED_STORAGE_DIR or ./.cache/ray_results, absolute)")
    p.add_argument("--name", default=None, help="sweep name (default <script>-<task>); --resume continues it")
    p.add_argument("--resume", action="store_true", help="continue an interrupted sweep of the same --name")
    add_data_flags(p)
    p.add_argument("--encode-workers", type=int_at_least(0), default=0,
                   help="Ray actors that encode sentences before the trials, one CPU (GPU clusters: one GPU) each; "
                        "0 (default): one per CPU (GPU) of the cluster, at most 4")
    p.add_argument("--epochs", type=int_at_least(1), default=None, help="fix the epochs instead of searching them")
    p.add_argument("--limit", type=int_at_least(1), default=None,
                   help="first N pairs of every split; the winner registers as pair-residual-<task>-limited, never "
                        "touching the aliases of pair-residual-<task>")
    p.add_argument("--check-flags", action="store_true",
                   help="check the flags, the task and the stores as the sweep would, then exit (0: they would run)")
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
    if task in names:  # it used to be dropped without a word: --transfer stsb on stsb was no check at all
        raise ValueError(f"--transfer {value}: {task!r} is the sweep's own task, no transfer check; give other tasks, "
                         "'others' or 'none'.")
    return list(dict.fromkeys(names))  # in the order given, each once


def tau_values(text: str) -> list[float]:
    """--tau-attn-values '1.0,0.5' -> [1.0, 0.5]."""
    return float_list(text, "--tau-attn-values", "1.0,0.5")


def check_settings(args, fixed: dict[str, Any]) -> None:
    """Every config the flags make, built once before Ray, MLflow or the cache start: a bad value fails here in one
    line (ValueError) rather than after minutes of encoding and teacher training, or inside every trial."""
    check_local(args.encoder, "encoder")
    if args.device not in (None, "cpu", "cuda"):  # the encoders and the teacher never saw it: a flag that did nothing
        raise ValueError(f"--device {args.device!r}: a sweep's encoders and teacher run in Ray workers, each on the "
                         "GPU Ray gives it; give cpu, cuda, or leave it unset (GPUs where the cluster has them).")
    if teacher_config(args) is not None:
        check_local(args.teacher, "cross-encoder")
    silver_pairs(args)  # --silver-pairs with --no-silver or --no-teacher is refused here
    transfer_tasks(args.transfer, args.task)
    for tau in tau_values(args.tau_attn_values):
        encoder_config(args, tau_attn=tau)
    fixed = {**fixed, "task": args.task, "n_seeds": args.seeds,
             **({"epochs": args.epochs} if args.epochs is not None else {})}
    if args.search != "grid":
        if args.grid or args.grid_file:  # else ignored: an Optuna sweep would run where a grid was meant
            raise ValueError(f"--grid / --grid-file give the values of --search grid, and this sweep searches with "
                             f"{args.search}: add --search grid, or drop them.")
        AdapterConfig.from_dict(fixed)
        return
    optuna_only = [flag for flag, given in (("--num-samples", getattr(args, "num_samples_given", False)),
                                            ("--seed", getattr(args, "seed_given", False)),
                                            ("--no-start-points", args.no_start_points)) if given]
    if optuna_only:  # else ignored: the grid runs each of its points once, in order
        raise ValueError(f"{', '.join(optuna_only)} steer the configurations Optuna proposes, and --search grid runs "
                         "each point of its grid once: drop them (more seeds per point: --seeds).")
    grid = parse_grid(args.grid, args.grid_file)
    if not grid:
        raise ValueError("--search grid needs values: give --grid KEY=V1,V2 (repeatable) or --grid-file.")
    if clash := sorted(set(grid) & set(fixed)):  # fixed values win in a trial: the grid would vary nothing
        held = ", ".join(f"{k}={fixed[k]!r}" for k in clash)
        raise ValueError(f"--grid varies {clash}, which this sweep holds fixed ({held}): drop them from the grid "
                         "(the seeds come from --seeds, the epochs from --epochs).")
    for combo in itertools.islice(itertools.product(*grid.values()), 100_000):  # the trials the grid makes
        try:
            AdapterConfig.from_dict({**dict(zip(grid, combo)), **fixed})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"--grid point {dict(zip(grid, combo))}: {exc}") from None


def unplaceable(nodes: list[dict], cpus_per_trial: float, gpus_per_trial: float) -> list[str]:
    """Warnings for a trial no alive node of `nodes` (ray.nodes()) can hold now: Tune waits for one without end on a
    fixed cluster, and says so only after a minute of silence."""
    out = []
    for flag, what, need in (("--cpus-per-trial", "CPU", cpus_per_trial), ("--gpus-per-trial", "GPU", gpus_per_trial)):
        most = max((n.get("Resources", {}).get(what, 0) for n in nodes if n.get("Alive")), default=0)
        if need > most:
            out.append(f"warning: {flag} {need:g}, and no node of this cluster has more than {most:g} {what} now: the "
                       "trials wait until one joins (an autoscaling cluster adds it); on a fixed cluster, lower it.")
    return out


def distil_fixed(data, record, space_keys: list[str]) -> dict[str, Any]:
    """What the search may not vary of distillation with the study it has: no teacher, no distillation; no silver
    pairs (--no-silver), none to train on."""
    if "lambda_distil" not in space_keys:
        return {}
    if record is None or data.splits["train"].teacher is None:
        return {"lambda_distil": 0.0, "silver_fraction": 0.0}
    return {"silver_fraction": 0.0} if data.silver is None else {}
