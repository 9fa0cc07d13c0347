"""Saving and loading a trained seed group without pickle: safetensors weights + JSON.

    <dir>/weights.safetensors   every seed's parameters (leading seed dimension)
    <dir>/config.json           the AdapterConfig
    <dir>/encoder_manifest.json the frozen encoder the vectors came from (checked at load by servers)
    <dir>/metrics.json          validation / test figures of the group and of the served ensemble

The served score of a group is the mean over its seeds (`ensemble_scores`): every seed stays anchored
to the frozen cosine, so their mean does too.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from embed_lib.config import AdapterConfig
from embed_lib.training.adapters import NoveltyGate, PairAdapter

FILES = ("weights.safetensors", "config.json", "encoder_manifest.json")
#: the range every served path reports a score and a baseline in (the service, the pyfunc, `evaluate`): the frozen
#: cosine's. The residual can carry a near-duplicate pair past 1 (30 of STS-B test's 1379 pairs, at most 1.11, with
#: a `make run` champion); the re-ranking endpoints order the pairs the clip ties by their score before it.
SCORE_RANGE = (-1.0, 1.0)


def save_adapter(directory: str | Path, config: AdapterConfig, state_dict: Mapping[str, torch.Tensor],
                 manifest: Mapping[str, Any], dim: int, metrics: Mapping[str, Any] | None = None) -> Path:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in state_dict.items()}, str(out / "weights.safetensors"),
              metadata={"format": "embed_lib.pair_adapter", "dim": str(dim)})
    (out / "config.json").write_text(json.dumps(config.to_dict(), indent=2, sort_keys=True))
    (out / "encoder_manifest.json").write_text(json.dumps(dict(manifest), indent=2, sort_keys=True))
    (out / "metrics.json").write_text(json.dumps(dict(metrics or {}), indent=2, sort_keys=True))
    return out


def load_adapter(directory: str | Path) -> tuple[PairAdapter, AdapterConfig, dict[str, Any]]:
    """(model in eval mode, config, encoder manifest); a missing or mismatched file is a clear error."""
    d = Path(directory)
    missing = [f for f in FILES if not (d / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{d} is not a saved adapter: missing {missing} (expected {list(FILES)}).")
    config = AdapterConfig.from_dict(_read_json(d / "config.json"))
    manifest = _read_json(d / "encoder_manifest.json")
    try:
        dim = int(manifest["dim"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{d / 'encoder_manifest.json'} has no valid 'dim' ({exc!r}): the adapter's files are "
                         "damaged; export or register the adapter again.") from exc
    try:
        weights = load_file(str(d / "weights.safetensors"))
    except Exception as exc:  # safetensors' own error type: a truncated or overwritten file
        raise ValueError(f"{d / 'weights.safetensors'} cannot be read ({exc}): the file is damaged; export or register "
                         "the adapter again.") from exc
    try:
        novelty = None
        if "novelty.ref" in weights:  # the reference sentences travel with the weights (buffers)
            novelty = NoveltyGate(weights["novelty.ref"], *weights["novelty.bounds"].tolist())
        model = PairAdapter.from_config(config, dim, novelty=novelty)
        model.load_state_dict(weights, strict=True)
    except (RuntimeError, KeyError, ValueError) as exc:
        raise ValueError(f"{d / 'weights.safetensors'} does not match its config.json ({config.adapter}, "
                         f"width {config.width}, {config.n_seeds} seeds, dim {dim}): {exc}") from exc
    model.eval()
    return model, config, manifest


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`; ValueError naming the file when it is not one (a truncated or overwritten file)."""
    try:
        value = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}): the adapter's files are damaged; export or register the "
                         "adapter again.") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds {type(value).__name__}, not a JSON object: the adapter's files are damaged; "
                         "export or register the adapter again.")
    return value


def _tensor(x: np.ndarray | torch.Tensor) -> torch.Tensor:
    return x.float() if isinstance(x, torch.Tensor) else torch.as_tensor(np.ascontiguousarray(x, dtype=np.float32))


@torch.no_grad()
def ensemble_scores(model: PairAdapter, xa: np.ndarray | torch.Tensor, xb: np.ndarray | torch.Tensor,
                    ha: np.ndarray | torch.Tensor | None = None, hb: np.ndarray | torch.Tensor | None = None
                    ) -> dict[str, np.ndarray]:
    """Mean over seeds of score, anchor and gate for (n, d) raw vectors -> {'score', 'baseline', 'difficulty',
    'novelty'}: 'novelty' the novelty gate's weight w_nov (1 for every pair of a model without one; the cascade
    routes no pair under its floor). ha, hb: the vectors' working representations (S, n, width) from `project`,
    where the caller caches them."""
    xa, xb = _tensor(xa), _tensor(xb)
    S = len(model.seeds)
    out = model(xa.expand(S, -1, -1), xb.expand(S, -1, -1), None if ha is None else _tensor(ha),
                None if hb is None else _tensor(hb))
    gate = out.gate if out.gate is not None else (
        (out.c_a + out.c_b) / 2 if out.c_a is not None else None)
    n = xa.shape[0]
    return {"score": out.score.mean(0).numpy(), "baseline": out.s0.mean(0).numpy(),
            "difficulty": gate.mean(0).numpy() if gate is not None else np.full(n, np.nan, np.float32),
            "novelty": out.novelty.mean(0).numpy() if out.novelty is not None else np.ones(n, np.float32)}


def as_served(scores: np.ndarray) -> np.ndarray:
    """`scores` clipped to SCORE_RANGE, as every served path reports them."""
    return np.clip(scores, *SCORE_RANGE)


@torch.no_grad()
def project(model: PairAdapter, x: np.ndarray | torch.Tensor) -> np.ndarray | None:
    """(n, d) raw vectors -> (S, n, width) working representations, one per seed (None for the baseline form):
    what a pair's score needs of each sentence beyond its vector, so a server can keep it per sentence."""
    if model.form == "baseline":
        return None
    x = _tensor(x)
    return model.working(x.expand(len(model.seeds), -1, -1)).numpy()
