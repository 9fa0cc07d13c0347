"""Ray Tune wiring shared by the sweep entry points (the science stays in embed_lib).

- `precompute`: embeddings + held-out teacher scores as one Ray task (a GPU when the cluster has one),
  before any trial; trials receive the StudyData through the object store (`tune.with_parameters`).
- `trial`: trains one configuration's whole seed group, reports each epoch (ASHA) and a final result.
- `MLflowTrialCallback`: runs on the driver, the only MLflow writer: one child run per trial under the
  sweep's parent run, reused (never duplicated) when a resumed sweep restarts a trial.
- `finish_sweep`: leaderboard + plots on the parent; the winner retrained, tested once, registered.
"""
from __future__ import annotations

import functools
import json
import logging
import sys
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python sweeps/x.py` and Ray jobs put sweeps/ first on sys.path, not the repo
    sys.path.insert(0, str(REPO))

import ray  # noqa: E402
from ray import tune  # noqa: E402

from embed_lib.config import AdapterConfig  # noqa: E402
from embed_lib.selection import leaderboard, select_winner, to_markdown  # noqa: E402

log = logging.getLogger("sweeps")
METRIC, MODE = "val_delta_mean", "max"
MAX_EPOCHS = 12  # the largest epoch count a space may propose (ASHA's max_t is one more)
FINAL_KEYS = ("delta_val_mean", "delta_val_std", "delta_val_min", "delta_val_positive", "n_seeds",
              "val/spearman_mean", "train/gate_fit_mean", "ensemble/val/spearman")


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


def precompute(task: str, encoder, teacher, data_dir, cache_dir, limit: int | None, workers: int = 1):
    """StudyData and teacher record, computed before any trial: the sentences are encoded by a pool of
    `workers` Ray actors (one GPU each when the cluster has GPUs) into the shared cache, then one Ray task
    assembles the study (and trains / reads the held-out teacher, on a GPU when there is one)."""
    from embed_lib.distributed import precompute_embeddings
    from embed_lib.study import load_study

    gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
    precompute_embeddings(task, encoder, data_dir=data_dir, cache_dir=cache_dir, workers=workers, use_gpu=bool(gpus),
                          limit=limit)
    task_fn = ray.remote(num_cpus=1, num_gpus=gpus)(
        lambda: load_study(task, encoder, teacher, data_dir=data_dir, cache_dir=cache_dir, limit=limit))
    return ray.get(task_fn.remote())


def resolve(config: dict[str, Any], data, fixed: dict[str, Any]):
    """(AdapterConfig, StudyData) that a trial's config trains: fixed values win (the smoke test caps epochs),
    and tau_attn picks the study when several encoder attention temperatures were precomputed."""
    config = dict(config)
    tau_attn = config.pop("tau_attn", None)
    if isinstance(data, dict):
        data = data[tau_attn if tau_attn is not None else next(iter(data))]
    return AdapterConfig.from_dict({**config, **fixed}), data


def trial(config: dict[str, Any], data=None, fixed: dict[str, Any] | None = None, threads: int = 1,
          use_gpu: bool = False) -> None:
    """One Tune trial: the whole seed group of one configuration."""
    import torch

    from embed_lib.train import train_seed_group

    torch.set_num_threads(max(1, threads))
    cfg, data = resolve(config, data, fixed or {})
    device = "cuda" if use_gpu and torch.cuda.is_available() else "cpu"
    result = train_seed_group(cfg, data, on_epoch=lambda epoch, h: tune.report(dict(h)), evaluate_test=False,
                              device=device)
    final = {k: float(v) for k, v in result.summary.items() if k in FINAL_KEYS}
    tune.report({**final, METRIC: result.summary["delta_val_mean"], "final": 1,
                 "per_seed": json.dumps(result.per_seed), "seconds": result.seconds})


def make_trainable(data, fixed: dict[str, Any], cpus: float, gpus: float):
    fn = tune.with_parameters(trial, data=data, fixed=fixed, threads=max(1, int(cpus)), use_gpu=gpus > 0)
    return tune.with_resources(fn, {"cpu": cpus, "gpu": gpus})


class MLflowTrialCallback(tune.Callback):
    """Child MLflow runs for trials, written from the driver only (see module docstring)."""

    def __init__(self, tracking_uri: str, experiment_id: str, parent_run_id: str,
                 fixed: dict[str, Any] | None = None) -> None:
        self.tracking_uri, self.experiment_id, self.parent = tracking_uri, experiment_id, parent_run_id
        self.fixed = dict(fixed or {})  # what the trainable applies over the trial's config
        self.runs: dict[str, str] = {}

    @property
    def client(self):
        import mlflow

        return mlflow.MlflowClient(self.tracking_uri)

    def _run_for(self, trial) -> str:
        if trial.trial_id in self.runs:
            return self.runs[trial.trial_id]
        found = self.client.search_runs(
            [self.experiment_id], f"tags.`mlflow.parentRunId` = '{self.parent}' and tags.trial_id = '{trial.trial_id}'")
        if found:  # a resumed sweep restarting this trial: reuse its run
            run_id = found[0].info.run_id
            self.client.update_run(run_id, status="RUNNING")
        else:
            run = self.client.create_run(self.experiment_id, run_name=f"trial-{trial.trial_id}",
                                         tags={"mlflow.parentRunId": self.parent, "trial_id": trial.trial_id})
            run_id = run.info.run_id
            from mlflow.entities import Param

            config = {**trial.config, **self.fixed}  # the configuration that actually trains
            self.client.log_batch(run_id, params=[Param(k, str(v)) for k, v in sorted(config.items())])
            self.client.log_dict(run_id, config, "config.json")
        self.runs[trial.trial_id] = run_id
        return run_id

    def on_trial_start(self, iteration, trials, trial, **info):
        self._run_for(trial)

    def on_trial_result(self, iteration, trials, trial, result, **info):
        from mlflow.entities import Metric

        run_id, step = self._run_for(trial), int(result.get("training_iteration", 0))
        ts = int(result.get("timestamp", 0) * 1000)
        if "per_seed" in result:
            per_seed = json.loads(result["per_seed"])
            metrics = [Metric(k, float(result[k]), ts, 0) for k in (*FINAL_KEYS, "seconds") if k in result]
            metrics += [Metric(f"seed/{k}", float(v), ts, i) for i, r in enumerate(per_seed)
                        for k, v in r.items() if isinstance(v, (int, float)) and v == v]
            self.client.log_batch(run_id, metrics=metrics)
            self.client.log_dict(run_id, per_seed, "per_seed.json")
        else:
            self.client.log_batch(run_id, metrics=[Metric(k, float(result[k]), ts, step) for k in
                                                   ("val_delta_mean", "val_delta_min", "val_spearman_mean") if k in result])

    def on_trial_complete(self, iteration, trials, trial, **info):
        run_id = self._run_for(trial)
        if "per_seed" not in (trial.last_result or {}):
            self.client.set_tag(run_id, "stopped_early", "true")  # ASHA pruned it
        self.client.set_terminated(run_id, "FINISHED")

    def on_trial_error(self, iteration, trials, trial, **info):
        self.client.set_terminated(self._run_for(trial), "FAILED")


def rows_from(results, fixed: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(complete trials, early-stopped trials) as flat dicts of config + final metrics."""
    done, stopped = [], []
    for r in results:
        if r.metrics is None:
            continue
        row = {"trial": r.metrics.get("trial_id"), **r.config, **fixed, "config": dict(r.config)}
        if "per_seed" in r.metrics:
            row.update({k: r.metrics[k] for k in FINAL_KEYS if k in r.metrics})
            row["per_seed"] = json.loads(r.metrics["per_seed"])
            done.append(row)
        else:
            row["val_delta_mean_last"] = r.metrics.get("val_delta_mean")
            stopped.append(row)
    return done, stopped


def isolation_plot(rows: list[dict[str, Any]], keys: list[str]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in keys if any(k in r for r in rows)]
    fig, axes = plt.subplots(1, max(1, len(keys)), figsize=(3 * max(1, len(keys)), 3), squeeze=False)
    for ax, key in zip(axes[0], keys):
        xs = [r.get(key) for r in rows]
        ys = [r["delta_val_mean"] for r in rows]
        if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs):
            ax.scatter(xs, ys, s=12)
            if key in ("lr", "lambda_c", "lambda_mod", "weight_decay") and min(xs) > 0:
                ax.set_xscale("log")
        else:
            cats = sorted({str(x) for x in xs})
            ax.scatter([cats.index(str(x)) for x in xs], ys, s=12)
            ax.set_xticks(range(len(cats)), cats, rotation=30, fontsize=7)
        ax.axhline(0, color="k", lw=0.6)
        ax.set_title(key, fontsize=9)
    axes[0][0].set_ylabel("mean val delta")
    fig.tight_layout()
    return fig


def seed_plot(rows: list[dict[str, Any]], top: int = 5):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    for i, r in enumerate(rows[:top]):
        d = [s["delta_val"] for s in r["per_seed"]]
        ax.scatter([i] * len(d), d, s=14)
    ax.axhline(0, color="k", lw=0.6)
    ax.set_xticks(range(min(top, len(rows))), [str(r["trial"]) for r in rows[:top]], rotation=30, fontsize=7)
    ax.set_ylabel("per-seed val delta")
    ax.set_title(f"top {min(top, len(rows))} configurations")
    fig.tight_layout()
    return fig


def finish_sweep(results, data, fixed: dict[str, Any], space_keys: list[str], task: str, parent_run_id: str,
                 log_fn: Callable[[str], None] = print) -> dict[str, Any]:
    """Leaderboard and plots on the parent run; winner retrained, tested once, logged, registered."""
    import matplotlib.pyplot as plt
    import mlflow

    from embed_lib.registry import SELECTION_METRIC, log_adapter_model, model_name, promote
    from embed_lib.tracking import log_group
    from embed_lib.train import train_seed_group

    done, stopped = rows_from(results, fixed)
    board = leaderboard([{k: v for k, v in r.items() if k not in ("per_seed", "config")} for r in done])
    mlflow.log_text(board.to_csv(index=False), "leaderboard.csv")
    mlflow.log_text(to_markdown(board), "leaderboard.md")
    mlflow.log_metrics({"trials_complete": len(done), "trials_stopped_early": len(stopped)})
    ranked = sorted(done, key=lambda r: -r["delta_val_mean"])
    if done:
        for name, fig in (("plots/isolation.png", isolation_plot(done, space_keys)), ("plots/top_seeds.png", seed_plot(ranked))):
            mlflow.log_figure(fig, name)
            plt.close(fig)
    log_fn(to_markdown(board.drop(columns=[c for c in board.columns if c in fixed and c not in space_keys]), top=10))
    winner = select_winner(done)
    out: dict[str, Any] = {"complete": len(done), "stopped_early": len(stopped), "winner": None}
    if winner is None:
        msg = "No configuration is positive on every validation seed: nothing registered."
        mlflow.set_tag("winner", "none")
        log_fn(msg)
        return out
    cfg, data = resolve(winner["config"], data, fixed)  # exactly what the winning trial trained
    result = train_seed_group(cfg, data)  # the only place test is evaluated
    with mlflow.start_run(run_name="winner", nested=True, parent_run_id=parent_run_id):
        log_group(result, data)
        info = log_adapter_model(result, data, registered_name=model_name(task))
        alias = promote(model_name(task), info.registered_model_version, result.summary[SELECTION_METRIC])
    mlflow.set_tags({"winner": winner["trial"], "winner_version": str(info.registered_model_version), "winner_alias": alias})
    out.update(winner=winner["trial"], version=info.registered_model_version, alias=alias, config=cfg.to_dict(),
               summary=result.summary)
    log_fn(f"winner {winner['trial']}: val delta {result.summary['delta_val_mean']:+.4f} "
           f"({result.summary['delta_val_positive']}/{cfg.n_seeds} seeds positive), test delta "
           f"{result.summary['delta_test_mean']:+.4f} ({result.summary['delta_test_positive']}/{cfg.n_seeds}); "
           f"registered {model_name(task)} version {info.registered_model_version} as '{alias}'")
    return out


def close_orphans(tracking_uri: str, experiment_id: str, parent_run_id: str) -> int:
    """Child runs still RUNNING after the sweep (a killed driver's in-flight trials) -> KILLED."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri)
    runs = client.search_runs([experiment_id], f"tags.`mlflow.parentRunId` = '{parent_run_id}' and "
                                               "attributes.status = 'RUNNING'")
    for r in runs:
        client.set_terminated(r.info.run_id, "KILLED")
    return len(runs)


def add_sweep_args(p, *, default_samples: int) -> None:
    p.add_argument("--task", default="stsb", help="stsb | mrpc | qqp | paws (default stsb)")
    p.add_argument("--encoder", default="minilm", help="sentence-transformers id, local path or alias (default minilm)")
    p.add_argument("--tau-attn-values", default="1.0",
                   help="comma list of encoder attention temperatures offered to the search (each one is "
                        "precomputed; default 1.0)")
    p.add_argument("--teacher", default="minilm", help="cross-encoder to fine-tune (K-fold) or pretrained id")
    p.add_argument("--teacher-pretrained", action="store_true", help="--teacher is already a cross-encoder")
    p.add_argument("--teacher-folds", type=int, default=2)
    p.add_argument("--teacher-epochs", type=int, default=1)
    p.add_argument("--no-teacher", action="store_true",
                   help="skip the cross-encoder teacher: the ce_margin target is not offered")
    p.add_argument("--search", choices=["optuna", "grid"], default="optuna")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="grid values (with --search grid); repeatable")
    p.add_argument("--grid-file", default=None, help="JSON {key: [values]} for --search grid")
    p.add_argument("--num-samples", type=int, default=default_samples, help="Optuna configurations")
    p.add_argument("--seeds", type=int, default=5, help="seeds per configuration (default 5)")
    p.add_argument("--seed", type=int, default=0, help="Optuna sampler seed")
    p.add_argument("--max-concurrent", type=int, default=2, help="trials at once (default 2)")
    p.add_argument("--cpus-per-trial", type=float, default=1.0)
    p.add_argument("--gpus-per-trial", type=float, default=0.0, help="fractional GPUs per trial on GPU clusters")
    p.add_argument("--address", default=None, help="Ray address (default: $RAY_ADDRESS or a local Ray)")
    p.add_argument("--tracking-uri", default=None, help="MLflow URI (default $MLFLOW_TRACKING_URI or sqlite ./mlflow.db)")
    p.add_argument("--experiment", default=None, help="MLflow experiment (default sweep-<task>)")
    p.add_argument("--storage-path", default=None,
                   help="Tune results (default $EMBED_STORAGE_DIR or ./.cache/ray_results, absolute)")
    p.add_argument("--name", default=None, help="sweep name (default <script>-<task>); --resume continues it")
    p.add_argument("--resume", action="store_true", help="continue an interrupted sweep of the same --name")
    p.add_argument("--data-dir", default=None, help="data mirror (default $EMBED_DATA_DIR; unset: the Hub)")
    p.add_argument("--cache-dir", default=None, help="embedding cache (default $EMBED_CACHE_DIR)")
    p.add_argument("--encode-workers", type=int, default=1,
                   help="Ray actors that encode sentences before the trials (one GPU each on GPU clusters)")
    p.add_argument("--epochs", type=int, default=None, help="fix the epochs instead of searching them")
    p.add_argument("--limit", type=int, default=None, help="first N pairs of every split")
    p.add_argument("--smoke-test", action="store_true",
                   help="whole path on 48 pairs per split, 2 seeds, 2 epochs, 3 trials, a tiny teacher")


def run_sweep(args, script: str, space_fn, space_keys: list[str], fixed: dict[str, Any]) -> dict[str, Any]:
    """The sweep, step by step (entry scripts supply the space and the fixed values)."""
    import os

    import mlflow
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search.optuna import OptunaSearch

    from embed_lib.config import EncoderConfig, default_cache_dir
    from embed_lib.teacher import TeacherConfig
    from embed_lib.tracking import default_tracking_uri, git_info, set_experiment

    limit = 48 if args.smoke_test else args.limit
    if args.smoke_test:
        args.num_samples, args.seeds, args.epochs = min(args.num_samples, 3), 2, 2
    if args.epochs is not None:
        fixed = {**fixed, "epochs": args.epochs}
    fixed = {**fixed, "task": args.task, "n_seeds": args.seeds}
    name = args.name or f"{script}-{args.task}" + ("-smoke" if args.smoke_test else "")
    storage = Path(args.storage_path or os.environ.get("EMBED_STORAGE_DIR") or Path.cwd() / ".cache" / "ray_results").absolute()
    cache_dir = Path(args.cache_dir).absolute() if args.cache_dir else default_cache_dir()

    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "2")  # experiment state on disk often: --resume loses little
    # 1. Ray: the cluster named by --address / $RAY_ADDRESS, else a local one
    ray.init(address=args.address, ignore_reinit_error=True, log_to_driver=False)
    # 2. MLflow: the sweep's parent run (reopened on --resume); the driver is the only writer
    tracking_uri = args.tracking_uri or default_tracking_uri()
    mlflow.set_tracking_uri(tracking_uri)
    experiment = set_experiment(args.experiment or f"sweep-{args.task}", tracking_uri)
    marker = storage / name / "mlflow_parent_run.json"
    if args.resume and not marker.is_file():
        raise FileNotFoundError(f"--resume: no sweep named {name!r} under {storage}; run without --resume first.")
    parent_id = json.loads(marker.read_text())["run_id"] if args.resume else None
    parent = mlflow.start_run(run_id=parent_id, run_name=None if parent_id else name)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps({"run_id": parent.info.run_id, "tracking_uri": tracking_uri}))
    # 3. precompute embeddings and held-out teacher scores once, as Ray tasks
    taus = [float(t) for t in args.tau_attn_values.split(",")]
    teacher = None if args.no_teacher else TeacherConfig(
        model=args.teacher, pretrained=args.teacher_pretrained, folds=args.teacher_folds, epochs=args.teacher_epochs,
        max_length=64 if args.smoke_test else 128)
    studies, record = {}, None
    for tau in taus:
        studies[tau], record = precompute(args.task, EncoderConfig(model=args.encoder, tau_attn=tau), teacher,
                                          args.data_dir, str(cache_dir), limit, args.encode_workers)
    first = studies[taus[0]]
    if not args.resume:
        mlflow.log_params({"search": args.search, "num_samples": args.num_samples, "seeds": args.seeds,
                           "max_concurrent": args.max_concurrent, "tau_attn_values": args.tau_attn_values,
                           **{f"fixed.{k}": v for k, v in fixed.items()}})
        mlflow.set_tags({**git_info(), "command": " ".join(sys.argv), "sweep": name, "task": args.task})
        mlflow.log_dict({str(t): s.manifest for t, s in studies.items()}, "cache_manifest.json")
        mlflow.log_dict({k: str(v) for k, v in ray.cluster_resources().items()}, "cluster_resources.json")
        if record:
            mlflow.log_dict(record, "teacher.json")
            mlflow.log_metrics({"teacher/val_spearman": record["validation_spearman"]})
    # 4. the Tuner: Optuna (TPE, seeded) or an explicit grid; ASHA on the seed-group mean val delta
    trainable = make_trainable(studies if len(taus) > 1 else first, fixed, args.cpus_per_trial, args.gpus_per_trial)
    callback = MLflowTrialCallback(tracking_uri, experiment.experiment_id, parent.info.run_id, fixed)
    run_config = tune.RunConfig(name=name, storage_path=str(storage), callbacks=[callback],
                                failure_config=tune.FailureConfig(max_failures=2), verbose=1)
    if args.resume:
        tuner = tune.Tuner.restore(str(storage / name), trainable=trainable, resume_unfinished=True, resume_errored=True)
    else:
        max_t = int(fixed.get("epochs", MAX_EPOCHS)) + 1  # epochs + the final (selected-epoch) report
        scheduler = ASHAScheduler(metric=METRIC, mode=MODE, max_t=max_t, grace_period=min(3, max_t))
        if args.search == "grid":
            grid = parse_grid(args.grid, args.grid_file)
            tune_config = tune.TuneConfig(num_samples=1, max_concurrent_trials=args.max_concurrent, reuse_actors=True)
            param_space = {k: tune.grid_search(v) for k, v in grid.items()}
            space_keys = sorted(grid)
        else:
            # a partial of a module-level function: the searcher state is pickled for --resume
            targets = [t for t in ("ce_margin", "lexical", "surface") if t in first.targets]
            searcher = OptunaSearch(space=functools.partial(space_fn, tau_attn_values=taus, targets=targets,
                                                            fixed=sorted(fixed)),
                                    metric=METRIC, mode=MODE,
                                    seed=args.seed)
            tune_config = tune.TuneConfig(search_alg=searcher, scheduler=scheduler, num_samples=args.num_samples,
                                          max_concurrent_trials=args.max_concurrent, reuse_actors=True)
            param_space = {}
        tuner = tune.Tuner(trainable, param_space=param_space, tune_config=tune_config, run_config=run_config)
    # 5. run (every trial trains its whole seed group)
    results = tuner.fit()
    # 6. leaderboard + plots on the parent; winner retrained, tested once, registered
    out = finish_sweep(results, studies if len(taus) > 1 else first, fixed, space_keys, args.task, parent.info.run_id)
    # 7. close what a killed driver left open; end the parent
    out["orphans_closed"] = close_orphans(tracking_uri, experiment.experiment_id, parent.info.run_id)
    mlflow.end_run()
    out.update(parent_run_id=parent.info.run_id, experiment_id=experiment.experiment_id, tracking_uri=tracking_uri)
    print(f"MLflow: {tracking_uri} experiment '{experiment.name}', sweep run {parent.info.run_id}. UI: make mlflow-ui")
    return out


def suggest_nuisance(trial, fixed=()) -> None:
    """The nuisance hyperparameters every sweep tunes so that comparisons are fair."""
    trial.suggest_float("lr", 3e-4, 3e-3, log=True)
    trial.suggest_float("weight_decay", 1e-4, 0.1, log=True)
    trial.suggest_categorical("width", [64, 128, 256])
    if "epochs" not in fixed:
        trial.suggest_int("epochs", 4, MAX_EPOCHS)


def sweep_main(doc: str, script: str, space_fn, space_keys: list[str], fixed: dict[str, Any]) -> None:
    """Command line of an entry script: parse, run the sweep, print its outcome as JSON."""
    import argparse

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sweep_args(parser, default_samples=24)
    out = run_sweep(parser.parse_args(), script, space_fn, space_keys, fixed)
    print(json.dumps({k: v for k, v in out.items() if k not in ("summary", "config")}, default=str))
