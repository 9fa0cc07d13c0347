"""What the teacher's recipe changes in the model before it trains: layers kept as they are, the dropout."""
from __future__ import annotations

import torch


def freeze_bottom(model: torch.nn.Module, layers: int) -> None:
    """Keeps `model`'s embedding block and its first `layers` transformer layers as they are (no gradients)."""
    base = getattr(model, "base_model", model)
    depth = getattr(getattr(model, "config", None), "num_hidden_layers", -1)
    stack = next((m for m in base.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == depth), None)
    embeddings = getattr(base, "embeddings", None)
    if stack is None or not isinstance(embeddings, torch.nn.Module):
        raise ValueError(f"TeacherConfig.freeze_layers={layers}, but {type(model).__name__} has no embedding block "
                         "and layer list to freeze: set freeze_layers=0 for this model.")
    if layers >= len(stack):
        raise ValueError(f"TeacherConfig.freeze_layers={layers}, but the model has {len(stack)} layers: give at most "
                         f"{len(stack) - 1}, so that some of the backbone trains.")
    embeddings.requires_grad_(False)
    for layer in stack[:layers]:
        layer.requires_grad_(False)


def set_dropout(model: torch.nn.Module, p: float) -> None:
    """Every dropout of `model` at probability `p`: its Dropout modules, and the probabilities that attention blocks
    keep as numbers (transformers' `attention_dropout`, ...)."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = p
        for name in [k for k, v in vars(m).items() if "dropout" in k and isinstance(v, float)]:
            setattr(m, name, p)
