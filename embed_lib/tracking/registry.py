"""The MLflow Model Registry side: log a trained seed group as a model, move the aliases, load it back.

Registered name: `pair-residual-<task>` (smoke tests and limited runs: `pair-residual-<task>-smoke` and
`-limited`, so they never touch the real model's aliases). A new version gets `champion` only from a champion it
is comparable with, and only when it is better on the winner rule's own figure (`embed_lib.tracking.promotion`);
otherwise `challenger`. Every alias move, automatic or manual, is recorded on the version with its reason, the previous
champion, the command and the git commit.
"""
from __future__ import annotations

import hashlib
import re
import tempfile
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from mlflow.types import DataType
from mlflow.types.schema import Array, ColSpec, Schema

from embed_lib.encoding.cache import cache_key
from embed_lib.tracking.promotion import (Decision, Evidence, appended, decide, encoder_description, from_tag, record,
                                          to_tag)
from embed_lib.tracking.runs import git_info, require_store
from embed_lib.training.export import load_adapter, save_adapter
from embed_lib.training.seed_group import GroupResult
from embed_lib.training.selection import TRANSFER_TOLERANCE, rule_text
from embed_lib.training.tensors import StudyData

MODEL_FILE = Path(__file__).with_name("pyfunc_adapter.py")
PACKAGE_DIR = Path(__file__).parents[1]  # all of embed_lib travels with a logged model
SELECTION_METRIC = "ensemble/val/spearman"


def model_name(task: str, smoke: bool = False, limit: int | None = None) -> str:
    """`pair-residual-<task>`; a smoke test's or a limited run's versions register under a name of their own."""
    if not isinstance(task, str) or not task.strip():
        raise ValueError(f"model_name(task={task!r}): give the task's name, e.g. 'stsb' (or a pair file's task name).")
    return f"pair-residual-{task}" + ("-smoke" if smoke else "-limited" if limit is not None else "")


def sweep_experiment(task: str) -> str:
    """`sweep-<task>`: the MLflow experiment a task's sweeps log to (unless `--experiment` names another)."""
    return f"sweep-{task}"


def _signature():
    """Text pairs (sentence1, sentence2) or cached vectors (emb_a, emb_b) in; score, baseline, difficulty out."""
    return ModelSignature(
        inputs=Schema([ColSpec(DataType.string, "sentence1", required=False),
                       ColSpec(DataType.string, "sentence2", required=False),
                       # double: MLflow's schema enforcement takes float32 and float64 arrays and lists of floats
                       # for it (float refused every float64 input, plain lists of floats included)
                       ColSpec(Array(DataType.double), "emb_a", required=False),
                       ColSpec(Array(DataType.double), "emb_b", required=False)]),
        outputs=Schema([ColSpec(DataType.double, c) for c in ("score", "baseline", "difficulty")]))


#: what the MLflow UI shows as the model's input example (and what `mlflow models serve` is checked with)
INPUT_EXAMPLE = {"sentence1": ["A man is playing a guitar.", "A cat sleeps on the sofa."],
                 "sentence2": ["A man plays the guitar.", "Stocks fell sharply on Monday."]}


def input_example():
    return pd.DataFrame(INPUT_EXAMPLE)


def log_adapter_model(result: GroupResult, data: StudyData, name: str = "model",
                      registered_name: str | None = None) -> Any:
    """Log the group as a pyfunc model into the active run; returns MLflow's ModelInfo."""
    metrics = {**result.summary, **{f"baseline/{k}": v for k, v in result.baseline.items()}}
    signature = _signature()
    with tempfile.TemporaryDirectory() as tmp:
        adapter_dir = save_adapter(Path(tmp) / "adapter", result.config, result.state_dict, data.manifest,
                                   int(data.X.shape[1]), metrics)
        return mlflow.pyfunc.log_model(
            name=name, python_model=str(MODEL_FILE), artifacts={"adapter": str(adapter_dir)},
            code_paths=[str(PACKAGE_DIR)], registered_model_name=registered_name, signature=signature,
            input_example=input_example(), pip_requirements=["torch", "numpy", "pandas", "safetensors", "scipy", "scikit-learn",
                              "sentence-transformers", "mlflow"])


def evidence_of(result: GroupResult, data: StudyData, tolerance: float = TRANSFER_TOLERANCE) -> Evidence:
    """What a trained group was selected on: its task, validation data, encoder, rule and figure."""
    val = data.splits["validation"]
    fingerprint = data.fingerprints.get("validation")
    if fingerprint is None:  # a StudyData built by hand: the pairs' rows and labels stand in for their texts
        h = hashlib.sha256()
        for t in (val.ia, val.ib, val.y):
            h.update(t.cpu().numpy().tobytes())
        fingerprint = "rows-" + h.hexdigest()[:16]
    return Evidence(task=result.config.task, val_fingerprint=fingerprint, val_pairs=len(val.y),
                    encoder_key=cache_key(data.manifest), encoder=encoder_description(data.manifest),
                    rule=rule_text(tolerance), tolerance=float(tolerance),
                    figure=float(result.summary["delta_val_mean"]))


def _champion(name: str, client) -> tuple[str | None, Any]:
    try:
        mv = client.get_model_version_by_alias(name, "champion")
    except MlflowException:
        return None, None
    return str(mv.version), mv


def _append_event(name: str, version: str, rec: dict, client) -> None:
    earlier = (client.get_model_version(name, version).tags or {}).get("promotion_history")
    client.set_model_version_tag(name, version, "promotion_history", appended(earlier, rec))


def _move(name: str, version: str, old: str | None, decision: Decision, client, *, manual: bool,
          evidence: Evidence | None) -> dict:
    """Set the alias and record the move in the version's history (and, when champion moves from `old`, in the
    history of the version it leaves)."""
    rec = record(decision, manual=manual, provenance=git_info(), evidence=evidence)
    _append_event(name, version, rec, client)
    client.set_model_version_tag(name, version, "promotion", to_tag(rec))
    client.set_model_version_tag(name, version, "promotion_reason", decision.reason)
    client.set_registered_model_alias(name, decision.alias, version)
    if decision.alias == "champion" and str(client.get_registered_model(name).aliases.get("challenger")) == version:
        client.delete_registered_model_alias(name, "challenger")  # one version is not both
    if decision.alias == "champion" and old is not None and old != version:
        left = f"champion moved to version {version}: {decision.reason}"
        _append_event(name, old, {**rec, "alias": "(none)", "reason": left}, client)
        client.set_model_version_tag(name, old, "superseded", f"{left} ({rec['time']})")
    return rec


def promote(name: str, version: str | int, evidence: Evidence, client=None) -> Decision:
    """Record the version's evidence, then set `champion` if it is comparable with and better than the current
    champion (`promotion.decide`), else `challenger`; the decision is recorded on the version."""
    client = client or mlflow.MlflowClient()
    version = str(version)
    for k, v in evidence.tags().items():
        client.set_model_version_tag(name, version, k, v)
    old, mv = _champion(name, client)
    decision = decide(evidence, old, Evidence.from_tags(mv.tags) if mv is not None else None)
    _move(name, version, old, decision, client, manual=False, evidence=evidence)
    return decision


def move_champion(name: str, version: str | int | None = None, reason: str = "", client=None) -> Decision:
    """A deliberate move of `champion`: to `version`, or (None) back to the version the current champion took
    it from (a rollback). Recorded as manual, with the reason given."""
    client = client or mlflow.MlflowClient()
    old, mv = _champion(name, client)
    if version is None:
        prev = (from_tag(mv.tags.get("promotion")) or {}).get("previous") if mv is not None else None
        if not prev or not prev.get("version"):
            raise ValueError(f"--rollback: {name}'s champion (version {old}) records no previous champion to return "
                             "to; name one with --promote <version>.")
        version, what = str(prev["version"]), "rollback"
    else:
        version, what = str(version), "manual promotion"
    if version == str(old):  # it used to be recorded as a move "from version 1 to 1", which a rollback then returned to
        raise ValueError(f"{'--rollback' if what == 'rollback' else f'--promote {version}'}: version {version} is "
                         f"{name}'s champion already; nothing was moved.")
    try:
        target = client.get_model_version(name, version)
    except MlflowException as exc:
        raise ValueError(f"{name} has no version {version!r}; list them with `python -m embed_lib registry`.") from exc
    previous = None if old is None else {"version": old, **({"figure": float(mv.tags["delta_val_mean"])}
                                                             if "delta_val_mean" in mv.tags else {})}
    decision = Decision("champion", f"{what} from version {old} to {version}" + (f": {reason}" if reason else ""),
                        previous)
    _move(name, version, old, decision, client, manual=True, evidence=Evidence.from_tags(target.tags))
    return decision


def versions_of(name: str, client) -> list[tuple[Any, list[str]]]:
    """Every version of `name`, oldest first, with the aliases it holds ([] where the model has none)."""
    versions = sorted(client.search_model_versions(f"name='{name}'"), key=lambda v: int(v.version))
    aliases = client.get_registered_model(name).aliases if versions else {}  # search results carry no aliases
    return [(mv, sorted(a for a, v in aliases.items() if str(v) == str(mv.version))) for mv in versions]


def history(name: str, client=None) -> list[dict[str, Any]]:
    """Every version of `name`, oldest first: aliases, figures, evidence and the recorded promotion."""
    client = client or mlflow.MlflowClient()
    rows = []
    for mv, held in versions_of(name, client):
        tags = mv.tags or {}
        rows.append({"version": str(mv.version), "aliases": held,
                     "figure": tags.get("delta_val_mean"), "val_pairs": tags.get("val_pairs"),
                     "val_fingerprint": tags.get("val_fingerprint"), "encoder": tags.get("encoder"),
                     "encoder_key": tags.get("encoder_key"), "promotion": from_tag(tags.get("promotion")),
                     "promotion_history": from_tag(tags.get("promotion_history")) or []})
    return rows


def download_model_artifact(model_uri: str, artifact: str, dst: str | Path | None = None,
                            tracking_uri: str | None = None) -> Path:
    """Download a logged / registered model (runs:/..., models:/name@alias, models:/name/version) and return
    its artifacts/<artifact> directory. tracking_uri: the MLflow store to read (default: MLflow's current one); a local
    one that does not exist is a ValueError (reading would make an empty store there)."""
    if tracking_uri:
        require_store(tracking_uri)
    m = re.fullmatch(r"models:/([^/@]+)(?:@([^/]+)|/(\d+))", model_uri)
    if m:  # resolve through a client of this store: MLflow's own models:/ resolution reads the global registry
        name, alias, version = m.groups()
        client = mlflow.MlflowClient(tracking_uri, registry_uri=tracking_uri)
        version = client.get_model_version_by_alias(name, alias).version if alias else version
        model_uri = client.get_model_version_download_uri(name, str(version))
    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=str(dst) if dst else None,
                                                     tracking_uri=tracking_uri))
    folder = local / "artifacts" / artifact
    if not folder.is_dir():
        logger = "registry.log_adapter_model" if artifact == "adapter" else "cross_encoder_registry.log_cross_encoder"
        raise FileNotFoundError(f"{model_uri} has no artifacts/{artifact} directory; was it logged by embed_lib "
                                f"({logger})?")
    return folder


def download_adapter(model_uri: str, dst: str | Path | None = None, tracking_uri: str | None = None) -> Path:
    """The adapter directory of a logged / registered adapter model."""
    return download_model_artifact(model_uri, "adapter", dst, tracking_uri)


def load_registered(model_uri: str, tracking_uri: str | None = None):
    """(model, config, manifest) of a registered adapter, read from safetensors + JSON."""
    return load_adapter(download_adapter(model_uri, tracking_uri=tracking_uri))
