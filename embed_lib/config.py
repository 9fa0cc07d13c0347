"""Experiment configuration: one frozen dataclass per concern, validated on construction.

The same objects are logged verbatim to MLflow and saved next to cached tensors and weights,
so every field is a small JSON-serialisable value.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from embed_lib.bounds import Bounds, bounded, check_bounds, learning_rate, unit_interval  # noqa: F401 (config's names)
from embed_lib.data.tasks import TASK_SLUG, task_names

#: Alias -> sentence-transformers id: packaged weights when they are installed (offline), otherwise the Hub id.
ENCODER_ALIASES = {"minilm": "sentence-transformers/all-MiniLM-L6-v2"}

DTYPES = ("float32", "float16", "bfloat16")
#: the torch devices an encoder may be put on
DEVICE = re.compile(r"cpu|cuda(:\d+)?|mps|xpu(:\d+)?")


#: inference backends of the encoder and the cross-encoder (embed_lib.encoding.onnx_backend)
BACKENDS = ("torch", "onnx", "onnx-int8")


def check_backend(backend: str, field: str = "backend") -> str:
    if backend not in BACKENDS:
        raise ValueError(f"{field}={backend!r} is not a backend; choose one of {list(BACKENDS)}.")
    return backend


def manifest_fields(backend: str) -> dict[str, str]:
    """Encoder-manifest entries of a backend; none for torch, so torch caches keep their keys."""
    if backend == "torch":
        return {}
    return {"backend": "onnx", "quantization": "int8" if backend.endswith("int8") else "none"}


def backend_of(manifest: dict[str, Any]) -> str:
    """The backend an encoder manifest was made with (inverse of `manifest_fields`)."""
    if manifest.get("backend", "torch") == "torch":
        return "torch"
    return "onnx-int8" if manifest.get("quantization") == "int8" else "onnx"


@dataclass(frozen=True)
class EncoderConfig:
    """How the frozen encoder turns sentences into vectors. Part of every cache key."""

    #: sentence-transformers model id on the Hub, a local directory, or an alias ("minilm").
    model: str = "minilm"
    #: Hub revision (branch, tag or commit); ignored for local paths.
    revision: str | None = None
    #: attention temperature (TempScale): attention logits divided by tau_attn in every self-attention layer at
    #: inference. 1.0 is the unmodified model; < 1 sharpens attention (counters the length collapse of mean pooling).
    tau_attn: float = bounded(1.0, 0.0, 10.0, low_open=True)
    #: truncation length in tokens; None keeps the model's own max_seq_length.
    max_seq_length: int | None = bounded(None, 1, 32768, allow_none=True)
    #: sentences per forward pass (sorted by length, so padding stays small).
    batch_size: int = bounded(64, 1, 4096)
    #: dtype of the stored vectors and of the forward pass on accelerators (CPU always float32).
    dtype: str = "float32"
    #: "cpu", "cuda", "cuda:1", ... or None for the best available device.
    device: str | None = None
    #: a prompt of the model's own (its `prompts`, e.g. "query" for Qwen3-Embedding) put before every sentence
    prompt_name: str | None = None
    #: a prompt text put before every sentence (instead of prompt_name)
    prompt: str | None = None
    #: inference backend: "torch", "onnx" (ONNX Runtime, fp32) or "onnx-int8" (dynamic int8 quantisation);
    #: part of the manifest and cache key (an int8 encoder's vectors are not torch's)
    backend: str = "torch"

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise ValueError(f"EncoderConfig.model must be a non-empty model id, path or alias; got {self.model!r}.")
        check_bounds(self)
        if self.dtype not in DTYPES:
            raise ValueError(f"EncoderConfig.dtype={self.dtype!r}; allowed {list(DTYPES)}.")
        if self.prompt is not None and self.prompt_name is not None:
            raise ValueError("EncoderConfig: give prompt or prompt_name, not both.")
        check_backend(self.backend, "EncoderConfig.backend")
        if self.device is not None and not DEVICE.fullmatch(str(self.device)):
            raise ValueError(f"EncoderConfig.device={self.device!r}; give cpu, cuda, cuda:N, mps or xpu[:N] (None: "
                             "the best available).")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any], **overrides: Any) -> "EncoderConfig":
        """The configuration that reproduces an encoder manifest's vectors (model, revision, TempScale,
        truncation, dtype, backend); `overrides` set what does not change them (batch_size, device)."""
        return cls(model=manifest["encoder"], revision=manifest.get("revision"), tau_attn=manifest["tau_attn"],
                   max_seq_length=manifest["max_seq_length"], dtype=manifest.get("dtype", "float32"),
                   prompt=manifest.get("prompt"), backend=backend_of(manifest), **overrides)


def writable_dir(path: Path, what: str) -> Path:
    """`path`, created if need be, once a probe file was written and removed there; else a ValueError naming `what`,
    the path and the fix (before any trial starts: caches are written only where the driver runs)."""
    probe = Path(path) / f".write-probe-{os.getpid()}"
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ValueError(f"{what} {path}: the driver cannot write there ({exc.strerror or exc}). Name a directory "
                         "this process can write; caches are written only where the driver runs.") from None
    return Path(path)


def default_cache_dir() -> Path:
    """Where embeddings and teacher scores are cached: $EMBED_CACHE_DIR or ./.cache/embed_lib."""
    return Path(os.environ.get("EMBED_CACHE_DIR", Path.cwd() / ".cache" / "embed_lib")).absolute()


#: the adapter forms and, per form, the controls that apply to it (embed_lib.training.adapters builds them)
FORMS = ("baseline", "pair_ungated", "pair_gated", "per_sentence", "per_sentence_preserving")
CONTROLS = {
    "baseline": ("none",),
    "pair_ungated": ("none",),
    "pair_gated": ("none", "constant", "shuffled"),
    "per_sentence": ("none", "h_only", "constant", "global", "shuffled"),
    "per_sentence_preserving": ("none", "h_only", "constant", "global", "shuffled"),
}
TARGETS = ("none", "surface", "lexical", "ce_margin")
LOSSES = ("cosent", "logistic", "mse")
#: distillation's controls: "shuffled" permutes the teacher's scores over the pairs (per seed), keeping their values
DISTIL_CONTROLS = ("none", "shuffled")


@dataclass(frozen=True)
class AdapterConfig:
    """One adapter configuration, trained on a seed group. Labels: [S] scientific, [N] nuisance, [F] fixed."""

    #: [F] task name (see embed_lib.data.tasks)
    task: str = "stsb"
    #: [S] adapter form: baseline | pair_ungated | pair_gated | per_sentence | per_sentence_preserving
    adapter: str = "pair_gated"
    #: [S] control that removes the difficulty signal: none | constant | shuffled | global | h_only
    control: str = "none"
    #: [S] difficulty target supervising the gate / complexity: none | surface | lexical | ce_margin
    target: str = "ce_margin"
    #: [S] bound on how far a pair moves from the anchor (pair forms) / mixing weight (preserving form)
    gamma: float = unit_interval(0.1)
    #: [S] amplitude of the per-sentence scaling: alpha in 1 +- alpha0
    alpha0: float = unit_interval(0.5)
    #: [S] normalisation exponent p of s_p (1 = cosine, 0 = dot product); the initial value when learned
    p: float = unit_interval(1.0)
    #: [S] learn p = sigmoid(p_hat) (tied for both sides: the tasks are symmetric)
    learn_p: bool = False
    #: [S] temperature of the task loss
    tau: float = bounded(0.05, 0.0, 10.0, low_open=True)
    #: [S] task loss: cosent (ranking) | logistic (binary tasks) | mse
    loss: str = "cosent"
    #: [S] weight of the gate / complexity supervision MSE(g or c, target). With cosent at tau=0.05 the task
    #: gradients are scaled by 1/tau = 20, so a weight near 1 is swamped: sweep it over orders of magnitude.
    lambda_c: float = bounded(10.0, 0.0, 1e4)
    #: [S] pair_gated: let the task loss train the gate as well ("joint gate"). False (default): the gate learns
    #: only its difficulty target and the score uses it as a fixed weight, so the gate carries the signal and
    #: not extra capacity (a jointly trained gate with shuffled targets gains as much as with the real ones)
    gate_task_grad: bool = False
    #: [S] weight of the modulus constraint (norm alignment of similar pairs)
    lambda_mod: float = bounded(0.0, 0.0, 1e4)
    #: [S] anchoring: weight of the residual-magnitude penalty mean(((s - s0) / gamma)^2) / tau (pair forms);
    #: it keeps a pair at the frozen score unless moving it pays on the task loss (/ tau like CoSENT's gradients)
    lambda_delta: float = bounded(0.0, 0.0, 1e4)
    #: [S] distillation (pair forms): weight of the teacher's ranking against the labels', L = (1 - lambda_distil)
    #: L_task(s, y) + lambda_distil CoSENT(s, teacher) over the batch's labelled pairs and its silver pairs. 0: the
    #: labels alone; 1: the teacher alone. Needs the teacher's scores (a study loaded with a teacher)
    lambda_distil: float = unit_interval(0.0)
    #: [S] distillation: the share of the study's silver pairs (unlabelled pairs of train sentences the teacher
    #: scored, `embed_lib.training.silver`) trained on beside the labelled ones: its first round(fraction * n). 0: the
    #: labelled pairs only
    silver_fraction: float = unit_interval(0.0)
    #: [S] distillation's control: none | shuffled (the teacher's scores permuted over the pairs, per seed)
    distil_control: str = "none"
    #: [S] anchoring: novelty gate (pair forms). 0 = off; q > 0 closes the residual for pairs with a sentence
    #: less familiar (max cosine to the training sentences) than the q-quantile of the training sentences'
    #: leave-one-out familiarity, opening linearly up to the (q + 0.25)-quantile
    novelty_quantile: float = bounded(0.0, 0.0, 0.7)
    #: [N] learning rate (AdamW)
    lr: float = learning_rate(1e-3)
    #: [N] AdamW weight decay
    weight_decay: float = unit_interval(0.01)
    #: [N] working width k of h = LayerNorm(W x + b) of the pair forms (per-sentence forms work in the
    #: embedding's own dimension)
    width: int = bounded(128, 1, 4096)
    #: [N] hidden units of the small MLPs
    hidden: int = bounded(128, 1, 4096)
    #: [N] epochs over the training pairs (the best epoch on validation is kept per seed)
    epochs: int = bounded(10, 1, 1000)
    #: [N] pairs per step
    batch_size: int = bounded(128, 2, 65536)
    #: seeds of the group: seed0, seed0 + 1, ..., seed0 + n_seeds - 1
    n_seeds: int = bounded(5, 1, 100)
    seed0: int = 0

    def __post_init__(self) -> None:
        # a custom task is registered in the process that read its file; elsewhere (a Ray trial) its slug stands
        if self.task not in task_names() and not TASK_SLUG.fullmatch(str(self.task)):
            raise ValueError(f"Unknown task {self.task!r}. Valid tasks: {task_names()} or a custom task's name.")
        if self.adapter not in FORMS:
            raise ValueError(f"Unknown adapter {self.adapter!r}. Valid adapters: {list(FORMS)}.")
        if self.control not in CONTROLS[self.adapter]:
            raise ValueError(f"Control {self.control!r} does not apply to adapter {self.adapter!r}. "
                             f"Valid controls: {list(CONTROLS[self.adapter])}.")
        if self.target not in TARGETS:
            raise ValueError(f"Unknown difficulty target {self.target!r}. Valid targets: {sorted(TARGETS)}.")
        if self.supervised and self.target == "none":
            raise ValueError(f"Adapter {self.adapter!r} with control {self.control!r} needs a difficulty target; "
                             f"choose one of {[t for t in TARGETS if t != 'none']}.")
        if self.loss not in LOSSES:
            raise ValueError(f"Unknown loss {self.loss!r}. Valid losses: {list(LOSSES)}.")
        check_bounds(self)
        if self.distil_control not in DISTIL_CONTROLS:
            raise ValueError(f"AdapterConfig.distil_control={self.distil_control!r} is not a distillation control; "
                             f"valid: {list(DISTIL_CONTROLS)}.")
        if self.lambda_distil > 0 and not self.adapter.startswith("pair"):
            raise ValueError(f"AdapterConfig.lambda_distil={self.lambda_distil} applies to the pair forms; adapter "
                             f"{self.adapter!r} has no residual to learn the teacher's scores with. Set it to 0.")
        if self.lambda_distil == 0 and (self.silver_fraction > 0 or self.distil_control != "none"):
            raise ValueError(f"AdapterConfig.silver_fraction={self.silver_fraction}, distil_control="
                             f"{self.distil_control!r} need distillation (silver pairs carry only the teacher's "
                             "scores): set lambda_distil in (0, 1], or silver_fraction=0 and distil_control='none'.")
        if self.novelty_quantile > 0 and not self.adapter.startswith("pair"):
            raise ValueError(f"AdapterConfig.novelty_quantile={self.novelty_quantile} applies to the pair forms; "
                             f"adapter {self.adapter!r} has no residual to close. Set it to 0.")

    @property
    def seeds(self) -> list[int]:
        return list(range(self.seed0, self.seed0 + self.n_seeds))

    @property
    def supervised(self) -> bool:
        """Whether the gate (pair_gated) or the complexity c (per-sentence forms) learns a difficulty target."""
        if self.adapter == "pair_gated":
            return self.control != "constant"
        return self.adapter.startswith("per_sentence") and self.control in ("none", "shuffled")

    @property
    def distilled(self) -> bool:
        """Whether the configuration learns the teacher's scores."""
        return self.lambda_distil > 0

    @property
    def target_level(self) -> str:
        """'pair' for pair forms, 'sentence' for per-sentence forms."""
        return "pair" if self.adapter.startswith("pair") else "sentence"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "AdapterConfig":
        if not isinstance(d, Mapping):
            raise TypeError(f"AdapterConfig.from_dict takes a mapping of fields; got {type(d).__name__}.")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"Unknown AdapterConfig field(s) {unknown}. Valid fields: {sorted(names)}.")
        return cls(**d)
