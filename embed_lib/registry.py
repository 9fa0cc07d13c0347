"""The MLflow Model Registry side: log a trained seed group as a model, move the aliases, load it back.

Registered name: `pair-residual-<task>`. A new version gets the alias `champion` only if its
validation Spearman (the served ensemble's) beats the current champion's; otherwise `challenger`.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from embed_lib.export import load_adapter, save_adapter
from embed_lib.study_data import StudyData
from embed_lib.train import GroupResult

MODEL_FILE = Path(__file__).with_name("mlflow_model.py")
PACKAGE_DIR = Path(__file__).parent
SELECTION_METRIC = "ensemble/val/spearman"


def model_name(task: str) -> str:
    return f"pair-residual-{task}"


def _signature():
    """Text pairs (sentence1, sentence2) or cached vectors (emb_a, emb_b) in; score, baseline, difficulty out."""
    from mlflow.models import ModelSignature
    from mlflow.types import DataType
    from mlflow.types.schema import Array, ColSpec, Schema

    return ModelSignature(
        inputs=Schema([ColSpec(DataType.string, "sentence1", required=False),
                       ColSpec(DataType.string, "sentence2", required=False),
                       ColSpec(Array(DataType.float), "emb_a", required=False),
                       ColSpec(Array(DataType.float), "emb_b", required=False)]),
        outputs=Schema([ColSpec(DataType.double, c) for c in ("score", "baseline", "difficulty")]))


#: what the MLflow UI shows as the model's input example (and what `mlflow models serve` is checked with)
INPUT_EXAMPLE = {"sentence1": ["A man is playing a guitar.", "A cat sleeps on the sofa."],
                 "sentence2": ["A man plays the guitar.", "Stocks fell sharply on Monday."]}


def input_example():
    import pandas as pd

    return pd.DataFrame(INPUT_EXAMPLE)


def log_adapter_model(result: GroupResult, data: StudyData, name: str = "model",
                      registered_name: str | None = None) -> Any:
    """Log the group as a pyfunc model into the active run; returns MLflow's ModelInfo."""
    import mlflow

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


def promote(name: str, version: str | int, val_metric: float, client=None) -> str:
    """Tag the version with its validation metric and set `champion` if it beats the current one, else
    `challenger`. Returns the alias set."""
    import mlflow
    from mlflow.exceptions import MlflowException

    client = client or mlflow.MlflowClient()
    client.set_model_version_tag(name, str(version), "val_spearman", repr(float(val_metric)))  # full precision
    try:
        current = client.get_model_version_by_alias(name, "champion")
        current_metric = float(current.tags.get("val_spearman", "-inf"))
    except MlflowException:
        current, current_metric = None, float("-inf")
    alias = "champion" if current is None or float(val_metric) > current_metric + 1e-12 else "challenger"
    client.set_registered_model_alias(name, alias, str(version))
    return alias


def download_model_artifact(model_uri: str, artifact: str, dst: str | Path | None = None,
                            tracking_uri: str | None = None) -> Path:
    """Download a logged / registered model (runs:/..., models:/name@alias, models:/name/version) and return
    its artifacts/<artifact> directory. tracking_uri: the MLflow store to read (default: MLflow's current one)."""
    import re

    import mlflow

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
        raise FileNotFoundError(f"{model_uri} has no artifacts/{artifact} directory; was it logged by embed_lib "
                                f"({'registry.log_adapter_model' if artifact == 'adapter' else 'cross_encoder.log_cross_encoder'})?")
    return folder


def download_adapter(model_uri: str, dst: str | Path | None = None, tracking_uri: str | None = None) -> Path:
    """The adapter directory of a logged / registered adapter model."""
    return download_model_artifact(model_uri, "adapter", dst, tracking_uri)


def load_registered(model_uri: str, tracking_uri: str | None = None):
    """(model, config, manifest) of a registered adapter, read from safetensors + JSON."""
    return load_adapter(download_adapter(model_uri, tracking_uri=tracking_uri))
