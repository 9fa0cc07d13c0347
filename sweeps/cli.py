"""The sweep's steps and its command (entry scripts supply the search space and the fixed values; the flags
are in sweeps.flags)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import mlflow
import ray
import torch
from ray import tune

from embed_lib.cli.args import (encoder_config, resolve_task, silver_pairs, skip_exit_collection, teacher_config,
                                teacher_progress, teacher_summary)
from embed_lib.config import default_cache_dir, writable_dir
from embed_lib.teacher.config import preset_of
from embed_lib.teacher.workers import cpu_cores
from embed_lib.tracking.registry import model_name, sweep_experiment
from embed_lib.tracking.runs import (check_store_for_cluster, checked_tracking_uri, default_tracking_uri, git_info,
                                     local_store_path, log_task_inputs, set_experiment, ui_link)
from sweeps import interrupt
from sweeps.flags import add_sweep_args, check_settings, distil_fixed, tau_values, transfer_tasks, unplaceable
from sweeps.mlflow_callback import MLflowTrialCallback, close_orphans
from sweeps.report import finish_sweep
from sweeps.trainable import MAX_EPOCHS, make_trainable, precompute
from sweeps.tuner import make_tuner


def _tracking_uri(args) -> str:
    """--tracking-uri, else $MLFLOW_TRACKING_URI or ./mlflow.db; never a store in a job's temporary working dir."""
    return checked_tracking_uri(args.tracking_uri) if args.tracking_uri else default_tracking_uri()


def parent_marker(args, name: str, storage: Path) -> Path:
    """The file naming a sweep's MLflow parent run; with --resume, a FileNotFoundError unless the sweep is there."""
    marker = storage / name / "mlflow_parent_run.json"
    if args.resume and not marker.is_file():
        raise FileNotFoundError(f"--resume: no sweep named {name!r} under {storage}; run without --resume first.")
    return marker


def hold_name(storage: Path, name: str):
    """The sweep's name held while it runs (`<storage>/<name>.lock`, released when the process ends): two sweeps of
    one name at once (`make run` twice, other SWEEP_ARGS) shared Tune's experiment dir and the parent-run marker, so
    that --resume reopened the other's run. A ValueError naming the lock and the fix when another holds it."""
    from filelock import FileLock, Timeout

    storage.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(storage / f"{name}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise ValueError(f"a sweep named {name!r} is running now (lock {lock.lock_file}): give this one another "
                         "--name, or wait for that one to end.") from None
    return lock


def _open_parent_run(args, name: str, storage: Path):
    """(tracking URI, experiment, parent run): the sweep's parent run, reopened on --resume."""
    tracking_uri = _tracking_uri(args)
    check_store_for_cluster(tracking_uri, len([n for n in ray.nodes() if n.get("Alive")]))
    mlflow.set_tracking_uri(tracking_uri)
    experiment = set_experiment(args.experiment or sweep_experiment(args.task), tracking_uri)
    marker = parent_marker(args, name, storage)
    parent_id = json.loads(marker.read_text())["run_id"] if args.resume else None
    parent = mlflow.start_run(run_id=parent_id, run_name=None if parent_id else name)
    if parent_id:
        interrupt.resumed(mlflow.get_run(parent_id))
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"run_id": parent.info.run_id, "tracking_uri": tracking_uri}))
    return tracking_uri, experiment, parent


def driver_threads() -> int:
    """Torch threads for the driver's own work ($EMBED_DRIVER_THREADS, else the CPUs it may run on). A Ray
    job's entrypoint inherits OMP_NUM_THREADS=1, which left a sweep's teacher on one core of two."""
    if os.environ.get("EMBED_DRIVER_THREADS"):
        return max(1, int(os.environ["EMBED_DRIVER_THREADS"]))
    return max(1, cpu_cores())


def encode_workers(requested: int, use_gpu: bool) -> int:
    """--encode-workers: as given, or for 0 one actor per CPU of the cluster (per GPU where the encoders take GPUs),
    at most 4: no trial runs while they encode, and each holds its own copy of the encoder."""
    if requested < 0:
        raise ValueError(f"--encode-workers={requested}; give 0 (one per CPU of the cluster, at most 4) or more.")
    if requested:
        return requested
    return max(1, min(4, int(ray.cluster_resources().get("GPU" if use_gpu else "CPU", 1))))


def precompute_on_gpu(args) -> bool:
    """Whether the encoders and the teacher take GPUs: --device cpu keeps them on CPUs; --device cuda puts them on
    GPUs, refused where the cluster has none and no trial asks for one (the actors would wait for ever); unset: GPUs
    where the cluster has them or the trials ask for them (an autoscaling cluster whose GPU nodes start at zero)."""
    if args.device == "cpu":
        return False
    has = ray.cluster_resources().get("GPU", 0) >= 1
    if args.device == "cuda" and not has and args.gpus_per_trial == 0:
        raise ValueError("--device cuda, and this Ray cluster has no GPU: give cpu, leave --device unset, or join a "
                         "GPU node first (an autoscaling cluster whose GPU nodes start at zero adds one for "
                         "--gpus-per-trial > 0).")
    return args.device == "cuda" or args.gpus_per_trial > 0 or has


def _precompute_all(args, cache_dir: Path, limit: int | None, transfer: list[str], distils: bool = False):
    """{tau_attn: StudyData} and the teacher record, each computed once before any trial; with silver pairs for the
    teacher to score where the search `distils` (and the flags leave them on)."""
    teacher = teacher_config(args)
    silver = silver_pairs(args, wanted=distils and teacher is not None)
    if silver is not None and limit is not None:
        silver = min(silver, 2 * limit)  # the smoke test's and --limit's few pairs: as many silver pairs as train ones
    if teacher is not None and args.smoke_test:
        # the smoke test checks the path, not the teacher: no intermediate stage (tens of thousands of pairs)
        teacher = dataclasses.replace(teacher, max_length=64, epochs=1, early_stopping_fraction=0.0, intermediate="")
    if teacher is not None:
        preset = preset_of(teacher)
        note = (" -- lighter than the study's 'strong' recipe, to fit a first run on 2 CPU cores"
                if preset in ("fast", "light") else "")
        print(f"teacher: {args.teacher}, '{preset}' recipe ({teacher.folds} folds x <= {teacher.epochs} epochs){note}",
              flush=True)
    studies, record = {}, None

    threads = torch.get_num_threads()
    torch.set_num_threads(driver_threads())  # no trial runs yet: the teacher may use every core of this node
    gpu = precompute_on_gpu(args)  # encoders and teacher on GPUs
    workers = encode_workers(args.encode_workers, gpu)
    try:
        for tau in tau_values(args.tau_attn_values):
            studies[tau], record = precompute(args.task, encoder_config(args, tau_attn=tau), teacher,
                                              args.data_dir, str(cache_dir), limit, workers,
                                              transfer=transfer, progress=teacher_progress(args.task),
                                              use_gpu=gpu, teacher_device="cpu" if args.device == "cpu" else None,
                                              silver=silver)
    finally:
        torch.set_num_threads(threads)
    if record is not None:
        print(teacher_summary(record), flush=True)
    return studies, record


def _log_sweep_inputs(args, name: str, fixed: dict[str, Any], studies: dict, record, transfer: list[str]) -> None:
    mlflow.log_params({"search": args.search, "num_samples": args.num_samples, "seeds": args.seeds,
                       "max_concurrent": args.max_concurrent, "tau_attn_values": args.tau_attn_values,
                       "transfer": ",".join(transfer) or "none", "transfer_tolerance": args.transfer_tolerance,
                       "teacher_preset": "none" if record is None else record.get("preset", "custom"),
                       **{f"fixed.{k}": v for k, v in fixed.items()}})
    mlflow.set_tags({**git_info(), "command": " ".join(sys.argv), "sweep": name, "task": args.task})
    log_task_inputs(args.task, args.data_dir)
    mlflow.log_dict({str(t): s.manifest for t, s in studies.items()}, "cache_manifest.json")
    mlflow.log_dict({k: str(v) for k, v in ray.cluster_resources().items()}, "cluster_resources.json")
    if record:
        mlflow.log_dict(record, "teacher.json")
        q = record.get("quality", {})
        mlflow.log_metrics({"teacher/val_spearman": record["validation_spearman"], "teacher/seconds": record["seconds"],
                            **{f"teacher/{k}/error_correlation": v["error_correlation"] for k, v in q.items()
                               if v["error_correlation"] == v["error_correlation"]}})


def storage_dir(args) -> Path:
    """Where Tune keeps the sweep's state: --storage-path, else $EMBED_STORAGE_DIR, else ./.cache/ray_results."""
    where = args.storage_path or os.environ.get("EMBED_STORAGE_DIR") or Path.cwd() / ".cache" / "ray_results"
    return Path(where).absolute()


def cache_root(args) -> Path:
    """The embedding and teacher cache, checked writable: --cache-dir, else $EMBED_CACHE_DIR (default_cache_dir)."""
    return writable_dir(Path(args.cache_dir).absolute() if args.cache_dir else default_cache_dir(),
                        "--cache-dir / $EMBED_CACHE_DIR")


def sweep_name(args, script: str) -> str:
    return args.name or f"{script}-{args.task}" + ("-smoke" if args.smoke_test else "")


def _settle(args, script: str, fixed: dict[str, Any]):
    """The task validated and the run's settings derived from the flags: (limit, fixed values, transfer tasks,
    run name, Tune storage, embedding cache)."""
    args.task = resolve_task(args, args.task)  # a pair file is validated before Ray, MLflow or the cache see it
    limit = 48 if args.smoke_test else args.limit
    if args.smoke_test:
        args.num_samples, args.seeds, args.epochs = min(args.num_samples, 3), 2, 2
    if args.epochs is not None:
        fixed = {**fixed, "epochs": args.epochs}
    fixed = {**fixed, "task": args.task, "n_seeds": args.seeds}
    name = sweep_name(args, script)
    storage = storage_dir(args)
    cache = cache_root(args)
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "2")  # experiment state on disk often: --resume loses little
    # a job's output is a log: MLflow's per-file download bars would print a screen of lines per model
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    return limit, fixed, transfer_tasks(args.transfer, args.task), name, storage, cache


def run_sweep(args, script: str, space_fn, space_keys: list[str], fixed: dict[str, Any],
              start_points=None) -> dict[str, Any]:
    """The sweep, step by step (entry scripts supply the space and the fixed values)."""
    t0 = time.perf_counter()
    limit, fixed, transfer, name, storage, cache_dir = _settle(args, script, fixed)
    # 1. Ray: the cluster named by --address / $RAY_ADDRESS, else a local one
    ray.init(address=args.address, ignore_reinit_error=True, log_to_driver=False)
    # Ctrl-C / `ray job stop` from here on: nothing registered, the runs KILLED, --resume ready (sweeps.interrupt)
    interrupt.install()  # after ray.init, whose SIGTERM handler it replaces
    # 2. MLflow: the sweep's parent run (reopened on --resume); the driver is the only writer
    tracking_uri, experiment, parent = _open_parent_run(args, name, storage)
    with interrupt.ended_as_killed(tracking_uri, experiment.experiment_id, parent.info.run_id, storage / name):
        # 3. embeddings, transfer checks and held-out teacher scores, once
        studies, record = _precompute_all(args, cache_dir, limit, transfer, distils="lambda_distil" in space_keys)
        taus = list(studies)
        first = studies[taus[0]]
        fixed = {**distil_fixed(first, record, space_keys), **fixed}
        stages = {"precompute_s": round(time.perf_counter() - t0, 1)}
        if not args.resume:
            _log_sweep_inputs(args, name, fixed, studies, record, transfer)
        # 4. the Tuner
        trainable = make_trainable(studies if len(taus) > 1 else first, fixed, args.cpus_per_trial, args.gpus_per_trial,
                                   tolerance=args.transfer_tolerance)
        callback = MLflowTrialCallback(tracking_uri, experiment.experiment_id, parent.info.run_id, fixed)
        run_config = tune.RunConfig(name=name, storage_path=str(storage), callbacks=[callback],
                                    failure_config=tune.FailureConfig(max_failures=2), verbose=1)
        tuner, space_keys = make_tuner(args, trainable, run_config, fixed, space_fn, space_keys, first, taus, storage,
                                       name, start_points)
        # 5. run (every trial trains its whole seed group)
        with interrupt.tuning():
            results = tuner.fit()
        stages["trials_s"] = round(time.perf_counter() - t0 - stages["precompute_s"], 1)
        # 6. leaderboard + plots on the parent; the do-no-harm winner retrained, tested once, registered
        out = finish_sweep(results, studies if len(taus) > 1 else first, fixed, space_keys, args.task,
                           parent.info.run_id, tolerance=args.transfer_tolerance, teacher=record,
                           registered_name=model_name(args.task, smoke=args.smoke_test, limit=limit))
    # 7. close what a killed driver left open; end the parent
    out["orphans_closed"] = close_orphans(tracking_uri, experiment.experiment_id, parent.info.run_id)
    stages["total_s"] = round(time.perf_counter() - t0, 1)
    mlflow.log_metrics({f"stage/{k}": v for k, v in stages.items()})
    mlflow.end_run()
    out.update(parent_run_id=parent.info.run_id, experiment_id=experiment.experiment_id, tracking_uri=tracking_uri,
               stages=stages)
    print("stages: " + ", ".join(f"{k[:-2]} {v:.0f}s" for k, v in stages.items()))

    link = ui_link(experiment.experiment_id, parent.info.run_id, tracking_uri=tracking_uri)
    where = "" if local_store_path(tracking_uri) is None else "make mlflow-ui, then "
    print(f"MLflow: {tracking_uri} experiment '{experiment.name}', sweep run {parent.info.run_id}. UI: {where}{link}")
    return out


def suggest_nuisance(trial, fixed=()) -> None:
    """The nuisance hyperparameters every sweep tunes so that comparisons are fair."""
    trial.suggest_float("lr", 3e-4, 3e-3, log=True)
    trial.suggest_float("weight_decay", 1e-4, 0.1, log=True)
    trial.suggest_categorical("width", [64, 128, 256])
    if "epochs" not in fixed:
        trial.suggest_int("epochs", 4, MAX_EPOCHS)


def sweep_main(doc: str, script: str, space_fn, space_keys: list[str], fixed: dict[str, Any],
               start_points=None) -> None:
    """Command line of an entry script: parse, run the sweep, print its outcome as JSON."""
    skip_exit_collection()

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sweep_args(parser, default_samples=32)
    args = parser.parse_args()
    try:  # a bad pair file, store or cache: one line naming it and the fix; nothing started
        args.task = resolve_task(args, args.task)
        check_settings(args, fixed)
        tracking_uri = _tracking_uri(args)
        parent_marker(args, sweep_name(args, script), storage_dir(args))
        cache_root(args)
        writable_dir(storage_dir(args), "--storage-path / $EMBED_STORAGE_DIR")
        held = hold_name(storage_dir(args), sweep_name(args, script))  # noqa: F841 (held until the process ends)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        parser.exit(2, f"error: {exc}\n")
    if args.check_flags:  # `make run SWEEP_ARGS=...`, before it starts a cluster
        parser.exit(0, "sweep flags, task, store and directories checked\n")
    ray.init(address=args.address, ignore_reinit_error=True, log_to_driver=False)
    try:  # what the cluster decides (its GPUs for --device, its nodes for a local store): before MLflow opens a run
        precompute_on_gpu(args)
        check_store_for_cluster(tracking_uri, len([n for n in ray.nodes() if n.get("Alive")]))
    except ValueError as exc:
        parser.exit(2, f"error: {exc}\n")
    sys.stderr.write("".join(f"{w}\n" for w in unplaceable(ray.nodes(), args.cpus_per_trial, args.gpus_per_trial)))
    try:
        out = run_sweep(args, script, space_fn, space_keys, fixed, start_points)
    except interrupt.SweepInterrupted as exc:
        parser.exit(130, f"{exc}\n")
    print(json.dumps({k: v for k, v in out.items() if k not in ("summary", "config")}, default=str))

