"""ONNX Runtime inference for the frozen encoder and the cross-encoder: fp32, or int8 dynamic quantisation.

A fast CPU path, chosen by `EncoderConfig.backend` / a cross-encoder's `backend`: "torch" (default),
"onnx" (the same graph in ONNX Runtime) or "onnx-int8" (weights of the linear layers in int8, quantised
per channel; activations quantised on the fly). The graph is exported from the loaded torch modules with
`torch.onnx` (the TorchScript exporter: it takes the transformer and sentence-transformers' pooling in
one trace), so it is the model actually loaded, TempScale included; tokenisation stays in Python.

Exported graphs are cached under <cache_root>/onnx/<key>/, keyed by the weights' fingerprint, what the
graph computes and the opset. Every export is checked against torch on fixed probe texts before it is
used: a graph that disagrees beyond its tolerance raises a ValueError naming the model and the
tolerance, and nothing falls back silently (the backend is part of the encoder manifest and cache key,
so vectors of different backends never mix).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from embed_lib.config import check_backend
from embed_lib.encoding.weights import state_fingerprint

log = logging.getLogger(__name__)

OPSET = 17
#: bump when the export changes what a cached graph computes
EXPORT_VERSION = 1
#: export checks against torch on the probe texts. Encoder: the smallest cosine between the two
#: backends' vectors. Cross-encoder: the largest logit difference (fp32), the Pearson correlation of
#: the logits (int8: quantisation moves logits, the order is what a scorer needs)
TOLERANCE = {"encoder": {"onnx": 0.9999, "onnx-int8": 0.95}, "cross_encoder": {"onnx": 1e-3, "onnx-int8": 0.98}}

PROBE_TEXTS = [
    "A man is playing a guitar.", "A woman is slicing an onion.", "The cat sat on the mat.",
    "Stocks fell sharply on Monday after the central bank raised interest rates by half a point.",
    "How do I learn to program in Python?", "What is the best way to learn Python programming?",
    "Two dogs run through a snowy field, chasing a red ball that one of them dropped near the fence.",
    "ok", "The quick brown fox jumps over the lazy dog.", "Is it safe to eat raw cookie dough?",
    "The committee will publish its final report, with recommendations on funding, early next spring.",
    "A child is riding a horse.", "Nobody is riding a horse.", "In 1923 he moved to Paris with his wife.",
    "He moved with his wife to Paris in 1923.", "What causes the northern lights?",
]


class _Graph(torch.nn.Module):
    """The torch modules as one function of the tokenizer's tensors, for tracing."""

    def __init__(self, run: Callable[[dict[str, torch.Tensor]], torch.Tensor], names: list[str],
                 modules: list[torch.nn.Module]) -> None:
        super().__init__()
        self.run, self.names, self.mods = run, names, torch.nn.ModuleList(modules)

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        return self.run(dict(zip(self.names, tensors)))


def _tensors(features: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in features.items() if isinstance(v, torch.Tensor)}


class OnnxRunner:
    """An ONNX Runtime session over a graph exported from torch: `run(features) -> (n, ...) float32`."""

    def __init__(self, path: Path, names: list[str], threads: int) -> None:
        # lazy: ONNX Runtime is the optional fast path; the torch backend never loads it
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = max(1, threads)
        opts.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        self.names, self.path = names, path

    def run(self, features: dict[str, Any]) -> np.ndarray:
        feed = {k: features[k].detach().cpu().numpy() for k in self.names}
        return self.session.run(None, feed)[0]


def _export(graph: _Graph, example: dict[str, torch.Tensor], path: Path, quantize: bool) -> None:
    names = list(example)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.onnx")
    fp32 = tmp if not quantize else tmp.with_name(tmp.stem + ".fp32.onnx")
    with torch.inference_mode(False), torch.no_grad():
        torch.onnx.export(graph, tuple(example[k] for k in names), str(fp32), input_names=names,
                          output_names=["out"], opset_version=OPSET, dynamo=False,
                          dynamic_axes={**{k: {0: "batch", 1: "tokens"} for k in names}, "out": {0: "batch"}})
    if quantize:  # lazy: ONNX Runtime is the optional fast path
        from onnxruntime.quantization import QuantType, quantize_dynamic

        quantize_dynamic(str(fp32), str(tmp), weight_type=QuantType.QInt8, per_channel=True)
        fp32.unlink()
    os.replace(tmp, path)


def _agreement(kind: str, backend: str, ref: np.ndarray, got: np.ndarray) -> float:
    if kind == "encoder":
        cos = (ref * got).sum(1) / np.maximum(np.linalg.norm(ref, axis=1) * np.linalg.norm(got, axis=1), 1e-12)
        return float(cos.min())
    if backend == "onnx":
        return float(np.abs(ref - got).max())
    return float(np.corrcoef(ref.reshape(-1), got.reshape(-1))[0, 1])


def _within(kind: str, backend: str, value: float) -> bool:
    tol = TOLERANCE[kind][backend]
    return value <= tol if (kind == "cross_encoder" and backend == "onnx") else value >= tol


def build_runner(kind: str, backend: str, model_name: str, fingerprint: str, graph: _Graph,
                 features: Callable[[list], dict[str, Any]], probe: list, torch_out: np.ndarray,
                 cache_root: Path, extra_key: dict[str, Any] | None = None, threads: int | None = None) -> OnnxRunner:
    """Export (or reuse) the graph of `kind` ('encoder' | 'cross_encoder'), check it against `torch_out`
    (torch's output on `probe`) and return its runner. ValueError when export or check fails."""
    check_backend(backend)
    blob = json.dumps({"kind": kind, "backend": backend, "weights": fingerprint, "opset": OPSET,
                       "export_version": EXPORT_VERSION, **(extra_key or {})}, sort_keys=True)
    key = hashlib.sha256(blob.encode()).hexdigest()[:20]
    folder = Path(cache_root) / "onnx" / key
    path, record_path = folder / "model.onnx", folder / "check.json"
    example = _tensors(features(probe[:2]))
    threads = threads or torch.get_num_threads()
    tol = TOLERANCE[kind][backend]
    if not (path.is_file() and record_path.is_file()):
        folder.mkdir(parents=True, exist_ok=True)
        try:
            _export(graph, example, path, quantize=backend == "onnx-int8")
        except Exception as exc:
            raise ValueError(f"ONNX export of {kind} {model_name!r} ({backend}) failed: {exc}. Use backend "
                             "'torch' for this model.") from exc
    runner = OnnxRunner(path, list(example), threads)
    got = runner.run(_tensors(features(probe)))
    value = _agreement(kind, backend, torch_out, got)
    if not _within(kind, backend, value):
        path.unlink(missing_ok=True)
        raise ValueError(f"The {backend} graph of {kind} {model_name!r} disagrees with torch on the probe texts: "
                         f"{'max |logit difference|' if kind == 'cross_encoder' and backend == 'onnx' else 'agreement'} "
                         f"{value:.5f} against the tolerance {tol} (onnx_backend.TOLERANCE). Use backend 'torch' "
                         "(or 'onnx' instead of 'onnx-int8') for this model.")
    record_path.write_text(json.dumps({"kind": kind, "backend": backend, "model": model_name, "agreement": value,
                                       "tolerance": tol, "probe": len(probe)}))
    return runner


def encoder_runner(enc, cache_root: Path) -> OnnxRunner:
    """The ONNX graph of a FrozenEncoder's modules up to the pooled vector (its Normalize dropped, as in torch)."""
    modules = list(enc._modules)

    def run(features: dict[str, torch.Tensor]) -> torch.Tensor:
        for m in modules:
            features = m(features)
        return features["sentence_embedding"]

    example = _tensors(enc.model.preprocess(PROBE_TEXTS[:2], prompt=enc.prompt))
    graph = _Graph(run, list(example), modules).eval()
    ref = enc.encode_torch(PROBE_TEXTS)
    return build_runner("encoder", enc.config.backend, enc.config.model, enc.weights_fingerprint(), graph,
                        lambda t: enc.model.preprocess(t, prompt=enc.prompt), PROBE_TEXTS, ref, cache_root,
                        {"tau_attn": enc.config.tau_attn, "normalize_dropped": enc.normalize_dropped})


def cross_encoder_max_tokens(ce) -> int | None:
    """The tokens a sentence-transformers CrossEncoder reads of a pair: its `max_seq_length` where the class has one
    (6.2, the pinned version, warns on every read of the older `max_length`), else `max_length`."""
    return ce.max_seq_length if hasattr(type(ce), "max_seq_length") else ce.max_length


def cross_encoder_runner(ce, backend: str, name: str, cache_root: Path, threads: int | None = None) -> OnnxRunner:
    """The ONNX graph of a sentence-transformers CrossEncoder's logits (one per pair)."""
    pairs = [[PROBE_TEXTS[i], PROBE_TEXTS[(i + 1) % len(PROBE_TEXTS)]] for i in range(len(PROBE_TEXTS))]
    ce.model.eval()

    def run(features: dict[str, torch.Tensor]) -> torch.Tensor:
        return ce.model(**features).logits.reshape(-1)

    example = _tensors(ce.preprocess(pairs[:2]))
    graph = _Graph(run, list(example), [ce.model]).eval()
    with torch.inference_mode():
        ref = run({k: v for k, v in _tensors(ce.preprocess(pairs)).items()}).float().numpy()
    return build_runner("cross_encoder", backend, name, state_fingerprint(ce.model), graph, ce.preprocess, pairs,
                        ref, cache_root, {"max_length": cross_encoder_max_tokens(ce)}, threads)
