"""MLflow logging of seed groups: config, per-seed metrics, learning curves, plots, provenance.

Kept free of Ray: the sweeps call the same functions inside Tune trials. MLflow is imported lazily.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import warnings
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlparse

import mlflow
import numpy as np
import pandas as pd

from embed_lib.data.tasks import SPLITS, load_splits
from embed_lib.tracking.promotion import command_line
from embed_lib.training.diagnostics import baseline_error
from embed_lib.training.seed_group import GroupResult
from embed_lib.training.tensors import StudyData

REPO = Path(__file__).resolve().parents[2]


def in_job_working_dir(path: Path) -> bool:
    """Whether `path` lies in the copy of a Ray job's working_dir (Ray unpacks it under
    <session>/runtime_resources/working_dir_files/_ray_pkg_<hash>), which is deleted with the job's files."""
    parts = Path(path).absolute().parts
    return "runtime_resources" in parts and any(p.startswith("_ray_pkg_") for p in parts)


def local_store_path(uri: str) -> Path | None:
    """The file or folder of a local MLflow store (sqlite:///..., file://..., a bare path); None for a server."""
    if uri.startswith(("sqlite:///", "file://")):
        return Path(uri.split(":///" if uri.startswith("sqlite") else "://", 1)[1])
    # a bare path is a file store; "databricks[-uc]" and URLs are remote
    return Path(uri) if "://" not in uri and not uri.startswith("databricks") else None


def check_store_for_cluster(uri: str, nodes: int) -> None:
    """A local store serves one node only: on a cluster of several, replicas and later jobs on other nodes could not
    read what the driver registers there. ValueError naming the store, the node count and the fix."""
    if nodes > 1 and local_store_path(uri) is not None:
        raise ValueError(f"MLflow store {uri!r} is a local path, and this Ray cluster has {nodes} nodes, which share no "
                         "disk: start an MLflow server on the head (mlflow server --serve-artifacts ...; cluster/nodes.py "
                         "start does) and set MLFLOW_TRACKING_URI (or --tracking-uri) to its http:// URL.")


#: the tracking-store schemes MLflow takes (a database URL may name its driver: postgresql+psycopg2://...)
STORE_SCHEMES = ("sqlite", "http", "https", "postgresql", "mysql", "mssql", "file", "databricks", "databricks-uc", "uc")


def checked_tracking_uri(uri: str) -> str:
    """`uri`, unless MLflow cannot use it (a scheme it has no store for; a file store, which MLflow 3 refuses unless
    MLFLOW_ALLOW_FILE_STORE=true) or it is a local store inside a Ray job's temporary working dir (runs and models
    written there are lost when the job's files go): then a ValueError naming the store and the fix."""
    if not isinstance(uri, str) or not uri.strip():
        raise ValueError(f"MLflow tracking URI {uri!r} is empty; give sqlite:///<path>/mlflow.db or an http(s):// "
                         "MLflow server (--tracking-uri or $MLFLOW_TRACKING_URI).")
    scheme = uri.split("://", 1)[0].split("+", 1)[0].lower() if "://" in uri else ""
    if scheme and scheme not in STORE_SCHEMES:
        raise ValueError(f"MLflow tracking URI {uri!r}: MLflow has no store for the scheme {scheme!r}. Give "
                         "sqlite:///<path>/mlflow.db (one node), http(s)://<MLflow server> (several nodes), or a "
                         "database URL (postgresql://, mysql://, mssql://).")
    if (scheme in ("", "file") and not uri.startswith("databricks")
            and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("1", "true")):
        path = Path(local_store_path(uri) or uri).absolute()
        # a path naming a database file lacks only the scheme; a folder (mlruns) becomes a database beside it
        sqlite = path if path.suffix in (".db", ".sqlite", ".sqlite3") or path.is_file() else f"{path}.db"
        raise ValueError(f"MLflow tracking URI {uri!r} is a file store, which MLflow 3 refuses (maintenance mode): "
                         f"give sqlite:///{sqlite} instead, or set MLFLOW_ALLOW_FILE_STORE=true to use it anyway.")
    local = local_store_path(uri)
    if local is not None and in_job_working_dir(local):
        raise ValueError(f"MLflow store {uri!r} lies in this Ray job's temporary copy of its working dir: its runs and "
                         "registered models would be lost when the job ends. Set MLFLOW_TRACKING_URI (or "
                         "--tracking-uri) to an MLflow server (http://...) or an absolute path outside the job; "
                         "cluster/local.sh submit forwards the submitter's own store.")
    return uri


def require_store(uri: str) -> str:
    """`uri`, when it names a store that exists (a server, or a local one already made); else a ValueError naming it:
    reading from a sqlite path that does not exist would make an empty store there."""
    local = local_store_path(uri)
    if local is not None and not local.exists():
        raise ValueError(f"No MLflow store at {uri} (nothing was tracked there yet). Name the store with "
                         "--tracking-uri or $MLFLOW_TRACKING_URI (make run uses sqlite:///<repo>/mlflow.db).")
    return uri


def default_tracking_uri() -> str:
    """$MLFLOW_TRACKING_URI, else a sqlite file ./mlflow.db (absolute: Ray jobs run in a copy of the tree); never a
    store inside a Ray job's temporary working dir (`checked_tracking_uri`)."""
    return checked_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI")
                                or f"sqlite:///{(Path.cwd() / 'mlflow.db').absolute()}")


def git_info(repo: Path = REPO) -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        return {"git_commit": git("rev-parse", "HEAD") or "unknown", "git_dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": "unknown", "git_dirty": True}


def pyplot():
    """matplotlib's pyplot on the Agg backend, imported on first use: plots are the only users, and pyplot takes
    most of a second to import in every process that loads this module (serving replicas, Ray workers)."""
    import matplotlib
    import matplotlib.pyplot as plt  # lazy: see the docstring

    matplotlib.use("Agg")
    return plt


def plot_seed_deltas(result: GroupResult):
    plt = pyplot()

    seeds = result.config.seeds
    fig, ax = plt.subplots(figsize=(6, 3))
    x = np.arange(len(seeds))
    ax.bar(x - 0.2, [r["delta_val"] for r in result.per_seed], 0.4, label="validation")
    ax.bar(x + 0.2, [r["delta_test"] for r in result.per_seed], 0.4, label="test")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(x, [str(s) for s in seeds])
    ax.set_xlabel("seed")
    ax.set_ylabel("Spearman delta vs frozen cosine")
    ax.set_title(f"{result.config.task}: {result.config.adapter} ({result.config.control}, {result.config.target})")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)  # beside the bars, not on them
    fig.tight_layout()
    return fig


def plot_signal_vs_error(data: StudyData, target: str):
    plt = pyplot()

    tr = data.splits["train"]
    err = baseline_error(tr.s0, tr.y.numpy())
    fig, ax = plt.subplots(figsize=(4, 3.5))
    ax.scatter(tr.pair_target[target], err, s=3, alpha=0.3)
    r = np.corrcoef(tr.pair_target[target], err)[0, 1]
    ax.set_xlabel(f"{target} target")
    ax.set_ylabel("|calibrated s0 - y|")
    ax.set_title(f"{data.task} train: Pearson {r:+.3f}")
    fig.tight_layout()
    return fig


@contextlib.contextmanager
def tracked_run(**kwargs: Any) -> Iterator[Any]:
    """`mlflow.start_run(**kwargs)`, ended KILLED by a Ctrl-C (MLflow's own context ends it FAILED, as a crash)."""
    with mlflow.start_run(**kwargs) as run:
        try:
            yield run
        except KeyboardInterrupt:
            mlflow.end_run("KILLED")
            raise


def log_group(result: GroupResult, data: StudyData, teacher: dict[str, Any] | None = None,
              plots: bool = True, extra_params: dict[str, Any] | None = None) -> None:
    """Log one seed group into the active MLflow run."""
    cfg = result.config
    mlflow.log_params({**cfg.to_dict(), **(extra_params or {})})
    mlflow.log_dict(cfg.to_dict(), "config.json")
    mlflow.log_dict(data.manifest, "encoder_manifest.json")
    mlflow.set_tags({**git_info(), "command": command_line(),
                     "task": cfg.task, "adapter": cfg.adapter, "control": cfg.control, "target": cfg.target,
                     **{f"split.{k}": v for k, v in data.split_notes.items()}})
    metrics = {f"baseline/{k}": v for k, v in result.baseline.items()}
    if teacher is not None:
        mlflow.log_dict(teacher, "teacher.json")
        mlflow.set_tags({"teacher": teacher["config"]["model"], "teacher_preset": teacher.get("preset", "custom")})
        metrics["teacher/seconds"] = teacher["seconds"]
        for split, q in teacher.get("quality", {}).items():
            metrics.update({f"teacher/{split}/{k}": v for k, v in q.items()})
    metrics.update({k: v for k, v in result.summary.items()})
    metrics.update({"n_parameters": result.n_parameters, "train_seconds": result.seconds})
    mlflow.log_metrics({k.replace("@", "_"): float(v) for k, v in metrics.items() if np.isfinite(v)})
    for i, r in enumerate(result.per_seed):  # step = position in the seed group
        mlflow.log_metrics({f"seed/{k}": float(v) for k, v in r.items() if np.isfinite(v)}, step=i)
    for h in result.history:
        mlflow.log_metrics({k: v for k, v in h.items() if k != "epoch"}, step=int(h["epoch"]))
    if plots:
        fig = plot_seed_deltas(result)
        mlflow.log_figure(fig, "plots/seed_deltas.png")
        pyplot().close(fig)
        if cfg.target in data.splits["train"].pair_target:
            fig = plot_signal_vs_error(data, cfg.target)
            mlflow.log_figure(fig, "plots/signal_vs_baseline_error.png")
            pyplot().close(fig)


def default_artifact_root(tracking_uri: str) -> str:
    """$MLFLOW_ARTIFACT_ROOT, else `mlartifacts/` beside a sqlite file. Absolute, because Ray jobs run in a
    temporary copy of the working directory and a relative `./mlruns` would vanish with it."""
    root = os.environ.get("MLFLOW_ARTIFACT_ROOT")
    if root:
        return root
    if tracking_uri.startswith("sqlite:///"):
        return str(Path(tracking_uri[len("sqlite:///"):]).absolute().parent / "mlartifacts")
    return str((Path.cwd() / "mlartifacts").absolute())


def ui_link(experiment_id: str, run_id: str | None = None, port: int | None = None,
            tracking_uri: str | None = None) -> str:
    """The MLflow UI page of an experiment (or run), on the model-training view: on the tracking server itself when
    `tracking_uri` is one, else as `make mlflow-ui` serves a local store."""
    page = f"experiments/{experiment_id}" + (f"/runs/{run_id}" if run_id else "")
    if tracking_uri and tracking_uri.startswith(("http://", "https://")):
        return f"{tracking_uri.rstrip('/')}/#/{page}?workflowType=machine_learning"
    port = port or int(os.environ.get("MLFLOW_PORT", "5000"))
    return f"http://127.0.0.1:{port}/#/{page}?workflowType=machine_learning"


def init_store(tracking_uri: str) -> None:
    """Create a new sqlite store with the absolute artifact root: MLflow would give its `Default`
    experiment `./mlruns` under the current directory, which in a Ray job is a temporary copy of the tree."""
    if not tracking_uri.startswith("sqlite:///") or Path(tracking_uri[len("sqlite:///"):]).exists():
        return
    # lazy: a second of import, for the one call that creates a sqlite store
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    SqlAlchemyStore(tracking_uri, Path(default_artifact_root(tracking_uri)).as_uri())


def set_experiment(name: str, tracking_uri: str | None = None):
    """mlflow.set_experiment, creating the experiment if it is new: with an absolute artifact location for a local
    store, with the server's own (`mlflow-artifacts:`, proxied) for a tracking server. A server's experiment whose
    artifacts lie on a local path is refused (ValueError naming it and the fix): no other node could read them."""
    uri = tracking_uri or mlflow.get_tracking_uri()
    init_store(uri)
    mlflow.set_tracking_uri(uri)
    local = local_store_path(uri) is not None
    existing = mlflow.get_experiment_by_name(name)
    if existing is None:
        try:
            mlflow.create_experiment(name, artifact_location=Path(default_artifact_root(uri)).as_uri() if local else None)
        except Exception:  # created concurrently by another process: use theirs
            if mlflow.get_experiment_by_name(name) is None:
                raise
    elif not local and urlparse(existing.artifact_location).scheme in ("", "file"):
        raise ValueError(f"experiment {name!r} of the MLflow server {uri} keeps its artifacts on a local path "
                         f"({existing.artifact_location}), which other nodes cannot read: name a new experiment "
                         "(--experiment NAME), which the server creates with proxied artifacts (mlflow-artifacts:).")
    experiment = mlflow.set_experiment(name)
    # MLflow 3 opens experiments on its GenAI view unless told otherwise: the kind tag says "model training"
    # to the UIs that read it; 3.17's UI follows its global GenAI / Model training switch, which the links
    # we print set (`ui_link`)
    if experiment.tags.get("mlflow.experimentKind") != "custom_model_development":
        client = mlflow.MlflowClient(uri)
        try:
            client.set_experiment_tag(experiment.experiment_id, "mlflow.experimentKind", "custom_model_development")
        except mlflow.exceptions.MlflowException as exc:
            # two sweeps opening a new experiment together: the other one's insert landed first (its check and insert
            # are not atomic); what it wrote is what this one would have
            tags = client.get_experiment(experiment.experiment_id).tags
            if "UNIQUE constraint failed" not in str(exc) or tags.get("mlflow.experimentKind") is None:
                raise
    return experiment


def _dataset_source(where: str) -> str:
    """A PairData source ('mirror:<file>', 'hub:<id>/<config>:<split>', a file, 'hf:<id>') as a URI MLflow can
    resolve: a local path, or the dataset's page on the Hugging Face Hub."""
    for prefix in ("mirror:", "hub:", "hf:"):
        if where.startswith(prefix):
            rest = where[len(prefix):]
            if prefix == "mirror:":
                return rest
            ident = rest.split(":")[0]  # org/name, then a config for the built-in tasks
            return "https://huggingface.co/datasets/" + "/".join(ident.split("/")[:2])
    return str(Path(where).absolute())


def log_task_inputs(task: str, data_dir: str | Path | None = None, attempts: int = 3) -> None:
    """The task's splits as the active run's dataset inputs (source, digest, row counts in the MLflow UI).

    Two sweeps of one experiment starting together both insert the same dataset: the store refuses the second
    insert (its check and insert are not atomic: "UNIQUE constraint failed: datasets..."); another attempt finds the
    row the first one wrote and links it."""
    for split, d in load_splits(task, SPLITS, data_dir).items():
        frame = pd.DataFrame({"sentence1": d.sentence1, "sentence2": d.sentence2, "label": d.label})
        with warnings.catch_warnings():  # MLflow registers its local source twice, and says so on every dataset
            warnings.filterwarnings("ignore", "The specified dataset source can be interpreted in multiple ways")
            dataset = mlflow.data.from_pandas(frame, source=_dataset_source(d.source), name=f"{task}-{split}")
        for attempt in range(attempts):
            try:
                mlflow.log_input(dataset, context=split, tags={"split_note": d.split_note[:250]})
                break
            except mlflow.exceptions.MlflowException as exc:
                if "UNIQUE constraint failed: datasets" not in str(exc) or attempt == attempts - 1:
                    raise
