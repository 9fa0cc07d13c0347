"""Loading the served model from the MLflow registry (safetensors + JSON, never unpickled).

An alias is resolved to a version once (`pinned_uri`); the manifest, the weights and the registry figures are then
all read from that version, so a move of the alias while a replica loads cannot mix two versions.
"""
from __future__ import annotations

import json
import logging
import os
import re
from typing import Any

import mlflow

from embed_lib.config import EncoderConfig, default_cache_dir
from embed_lib.encoding.cache import cache_key, manifest_mismatch
from embed_lib.encoding.encoders import encoder_manifest
from embed_lib.tracking.promotion import from_tag
from embed_lib.tracking.registry import download_adapter, sweep_experiment
from embed_lib.tracking.runs import require_store
from embed_lib.training.export import load_adapter
from serving.errors import ApiError

log = logging.getLogger("ray.serve")  # Serve's logger: lines land in the replica's log, tagged with the replica


def _client(tracking_uri: str | None):
    if tracking_uri:
        mlflow.set_tracking_uri(tracking_uri)
    return mlflow.MlflowClient(tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"))


def registry_info(model_uri: str, tracking_uri: str | None) -> dict[str, Any]:
    """name / version / alias of a models:/name@alias or models:/name/version URI ({} otherwise)."""
    m = re.fullmatch(r"models:/([^/@]+)(?:@([^/]+)|/(\d+))", model_uri)
    if not m:
        return {"name": model_uri, "version": None, "alias": None}
    name, alias, version = m.groups()
    client = _client(tracking_uri)
    mv = client.get_model_version_by_alias(name, alias) if alias else client.get_model_version(name, version)
    return {"name": name, "version": str(mv.version), "alias": alias, "aliases": list(mv.aliases),
            "run_id": mv.run_id, "description": mv.description or "",
            "selection": {k: v for k, v in (mv.tags or {}).items()
                          if k.startswith(("winner_rule", "transfer", "val_", "teacher", "delta_val", "encoder_key"))},
            # why this version holds its alias: the reason, the previous champion, manual or not, command, commit
            "promotion": from_tag((mv.tags or {}).get("promotion"))}


def pinned_uri(model_uri: str, tracking_uri: str | None) -> str:
    """models:/name@alias -> models:/name/<version the alias points at now>; other URIs unchanged. A local store
    that does not exist is named, not made (MLflow would make an empty one and then not find the model)."""
    store = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    try:
        if store and model_uri.startswith("models:/"):
            require_store(store)
        info = registry_info(model_uri, tracking_uri)
    except Exception as exc:  # MLflow's errors name neither the field nor the fix
        field, made_by = (("cross_encoder", "`make teacher TASK=<task>` registers models:/cross-encoder-<task>@current")
                          if model_uri.startswith("models:/cross-encoder-") else
                          ("model_uri", "`make run TASK=<task>` registers models:/pair-residual-<task>@champion"))
        raise ValueError(f"Cannot load {model_uri!r} from MLflow ({store or 'default tracking URI'}): "
                         f"{str(exc).rstrip('.')}. Check {field} (models:/<name>@<alias>) and tracking_uri; "
                         f"{made_by} in this clone's store, and `python -m embed_lib registry --name <name>` lists "
                         f"what a store has.{_no_winner(model_uri, store)}") from exc
    if info.get("alias") and info.get("version"):
        return f"models:/{info['name']}/{info['version']}"
    return model_uri


def _no_winner(model_uri: str, store: str | None) -> str:
    """Where the task's last sweep in the store ended without a winner (`make run TASK=qqp` ran, and nothing passed
    the rule): that sweep and its reason, else "". Best effort: a store that cannot say gives ""."""
    m = re.fullmatch(r"models:/pair-residual-([^/@]+)(?:@[^/]+|/\d+)", model_uri)
    if not m or not store:
        return ""
    experiment = sweep_experiment(m[1])
    try:
        require_store(store)  # a store that is not there is not made by asking it
        client = mlflow.MlflowClient(store)
        exp = client.get_experiment_by_name(experiment)
        runs = client.search_runs([exp.experiment_id], f"tags.task = '{m[1]}' and tags.winner != ''",
                                  order_by=["attributes.start_time DESC"], max_results=1) if exp else []
    except Exception:  # noqa: BLE001 -- the error being raised says what matters; this only adds to it
        return ""
    if not runs or runs[0].data.tags.get("winner") != "none":
        return ""
    reason = runs[0].data.tags.get("no_winner_reason", "").removesuffix(" Nothing registered.").rstrip(".")
    return (f" The last sweep of {m[1]} here (experiment '{experiment}', run {runs[0].info.run_id}) registered "
            f"nothing: {reason}.")


def resolve_manifest(model_uri: str, tracking_uri: str | None, requested: str | None = None) -> dict[str, Any]:
    """The encoder manifest of a registered adapter (pass a pinned URI: `pinned_uri`); raises if it does not match
    the encoder available here."""
    _client(tracking_uri)
    try:
        adapter_dir = download_adapter(model_uri, tracking_uri=tracking_uri)
    except Exception as exc:
        raise ValueError(f"Cannot load {model_uri!r} from MLflow ({tracking_uri or 'default tracking URI'}): {exc}. "
                         "Check model_uri (models:/<name>@<alias>) and tracking_uri.") from exc
    manifest = json.loads((adapter_dir / "encoder_manifest.json").read_text())
    diff = manifest_mismatch(manifest, encoder_manifest(EncoderConfig.from_manifest(manifest), default_cache_dir()))
    if diff:
        raise ValueError(f"Refusing to serve {requested or model_uri}: its encoder differs from the one available here "
                         f"(field: (trained, serving) = {diff}; read from {model_uri}). Serve it where its encoder is "
                         "installed, or retrain.")
    return manifest


def load_model(model_uri: str, tracking_uri: str | None):
    """(adapter model, info) with info = registry name/version/alias, config, validation metrics, encoder (pass a
    pinned URI: `pinned_uri`)."""
    _client(tracking_uri)
    adapter_dir = download_adapter(model_uri, tracking_uri=tracking_uri)
    model, config, manifest = load_adapter(adapter_dir)
    metrics = json.loads((adapter_dir / "metrics.json").read_text()) if (adapter_dir / "metrics.json").exists() else {}
    info = {**registry_info(model_uri, tracking_uri), "model_uri": model_uri, "task": config.task,
            "adapter": config.adapter, "target": config.target, "n_seeds": config.n_seeds,
            "encoder": {k: manifest.get(k) for k in ("encoder", "revision", "weights_fingerprint", "pooling",
                                                     "tau_attn", "max_seq_length", "dim")},
            "validation": {k: v for k, v in metrics.items() if "val" in k and isinstance(v, (int, float))},
            # the do-no-harm checks the version was chosen on: other tasks' validation pairs, per seed worst
            "transfer": {k: v for k, v in metrics.items() if "transfer" in k and isinstance(v, (int, float))},
            "anchoring": {"gamma": config.gamma, "lambda_delta": config.lambda_delta,
                          "novelty_quantile": config.novelty_quantile},
            "encoder_key": cache_key(manifest)}
    return model, info


def load_served(user_config: dict[str, Any], tracking_uri: str | None, previous: dict[str, Any] | None):
    """(model, info) for an ingress replica: the pinned version, reported under the alias it was asked for, with the
    registry's record of the alias move that put it there (`moved_from`: from which version, why, by hand or not).
    A swap in place to a model of another encoder is refused (its vectors would not match the caches)."""
    model, info = load_model(user_config.get("pinned") or user_config["model_uri"], tracking_uri)
    if previous and info["encoder_key"] != previous["encoder_key"]:
        raise RuntimeError("Refusing to switch to a model trained on another encoder; redeploy the application.")
    info["requested_uri"] = user_config["model_uri"]
    if "@" in user_config["model_uri"]:  # served through an alias: report it
        info["alias"] = user_config["model_uri"].rsplit("@", 1)[1]
    rec = info.get("promotion") or {}
    if (rec.get("previous") or {}).get("version"):
        info["moved_from"] = {"version": rec["previous"]["version"], "reason": rec.get("reason"),
                              "manual": rec.get("manual", False)}
    before = previous.get("version") if previous else None
    log.info("serving %s version %s%s; registry: %s", info.get("name"), info.get("version"),
             f" (was version {before} in this replica)" if before not in (None, info.get("version")) else "",
             rec.get("reason", "no promotion recorded"))
    return model, info


def check_requested_model(model: str | None, info: dict[str, Any]) -> None:
    """A request may name the model (Cohere, vLLM and OpenAI-style clients do): it must be the served one (`info`:
    the scorer's), by name, name/version, the URI it was asked by, or its models:/ URI; else 404."""
    if model is None:
        return
    name, version = info.get("name"), info.get("version")
    if model not in {name, f"{name}/{version}", info.get("requested_uri"), f"models:/{name}/{version}"}:
        raise ApiError(404, f"model {model!r} is not served here; this service serves {name!r} (version {version}): "
                            "send that name, or omit model.", "model", type="model_not_found")
