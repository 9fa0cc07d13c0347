"""The served teacher in the MLflow Model Registry: `cross-encoder-<task>` (alias `current`), logged as a
"models from code" pyfunc (`tracking/pyfunc_cross_encoder.py`, safetensors + JSON, never unpickled), found by its
teacher key, and downloaded back to a folder that `teacher.cross_encoder.PairCrossEncoder` loads.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping

import mlflow
from mlflow.models import ModelSignature
from mlflow.types import DataType
from mlflow.types.schema import ColSpec, Schema

from embed_lib.tracking.registry import PACKAGE_DIR, download_model_artifact, input_example

MODEL_FILE = Path(__file__).with_name("pyfunc_cross_encoder.py")


def model_name(task: str) -> str:
    return f"cross-encoder-{task}"


def _signature():
    return ModelSignature(inputs=Schema([ColSpec(DataType.string, "sentence1"), ColSpec(DataType.string, "sentence2")]),
                          outputs=Schema([ColSpec(DataType.double, "score"), ColSpec(DataType.double, "logit")]))


def log_cross_encoder(folder: Path, record: Mapping[str, Any], task: str, client=None) -> Any:
    """Log the folder as an MLflow pyfunc model into the active run and register it as `cross-encoder-<task>`
    with the alias `current` (what serving/config_cascade.yaml serves); the version carries the teacher key
    and its figures as tags. Returns MLflow's ModelVersion."""
    name = model_name(task)
    with tempfile.TemporaryDirectory() as tmp:
        # MLflow stores an artifact under its folder's own name: name it what loaders look for
        staged = shutil.copytree(folder, Path(tmp) / "cross_encoder")
        info = mlflow.pyfunc.log_model(
            name="cross_encoder", python_model=str(MODEL_FILE), artifacts={"cross_encoder": str(staged)},
            code_paths=[str(PACKAGE_DIR)], registered_model_name=name, signature=_signature(),
            input_example=input_example(), pip_requirements=["torch", "numpy", "pandas", "safetensors", "sentence-transformers", "mlflow"])
    client = client or mlflow.MlflowClient()
    version = str(info.registered_model_version)
    tags = {"teacher_key": record["teacher_key"], "backbone": record["config"]["model"],
            "recipe": record["recipe"], **{k: repr(float(record[k])) for k in (
                "validation_spearman", "test_spearman", "validation_cosine_spearman", "test_cosine_spearman",
                "test_error_correlation", "fit_seconds", "predict_pairs_per_s")}}
    for k, v in tags.items():
        client.set_model_version_tag(name, version, k, str(v))
    client.update_model_version(name, version, description=(
        f"Cross-encoder teacher of {task}: {record['recipe']}. Test Spearman {record['test_spearman']:.4f} "
        f"(frozen cosine {record['test_cosine_spearman']:.4f}), validation {record['validation_spearman']:.4f}; "
        f"rank-error correlation with the cosine on test {record['test_error_correlation']:.3f}. Teacher key "
        f"{record['teacher_key']}. Scores carry a calibration to the cosine's scale (teacher.json)."))
    client.set_registered_model_alias(name, "current", version)
    return client.get_model_version(name, version)


def resolve_cross_encoder(name: str, tracking_uri: str | None = None) -> str:
    """A models:/ URI -> the downloaded cross-encoder folder; ids, aliases and paths unchanged."""
    if not name.startswith(("models:/", "runs:/")):
        return name

    return str(download_model_artifact(name, "cross_encoder", tracking_uri=tracking_uri))


def find_version(task: str, teacher_key_: str, client) -> str | None:
    """The registered `cross-encoder-<task>` version made from this teacher key, if any."""
    try:
        versions = client.search_model_versions(f"name='{model_name(task)}'")
    except Exception:  # noqa: BLE001 -- no such model yet
        return None
    hits = [v for v in versions if (v.tags or {}).get("teacher_key") == teacher_key_]
    return str(max(int(v.version) for v in hits)) if hits else None


