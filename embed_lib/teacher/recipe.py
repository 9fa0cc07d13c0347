"""Fine-tuning and scoring one cross-encoder: the teacher's recipe (see `embed_lib.teacher.scores`).

Both pair orders in training and averaged at scoring, length-bucketed batches, AdamW without weight
decay on biases and norms, linear warmup then decay, gradient clipping, early stopping on a held-out
slice with the best epoch's weights restored; optionally bf16 autocast, frozen layers or word embeddings, and a
dropout of the recipe's own (`teacher.backbone`). Training buckets pairs by their characters (batches sorted by tokens
trained a weaker teacher: results/README.md#the-first-run) and computes a BERT model's steps on the real tokens only
(`teacher.packed`: the same logits and gradients, the padding's arithmetic left out); scoring batches them by tokens
(the same logits, less padding).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np
import torch

from embed_lib.encoding.batching import length_batches as longest_first
from embed_lib.encoding.weights import check_local, one_line, packaged_instead, resolve_model
from embed_lib.progress import Progress
from embed_lib.teacher import backbone, packed
from embed_lib.training.metrics import spearman

if TYPE_CHECKING:
    from embed_lib.teacher.config import TeacherConfig

log = logging.getLogger(__name__)


def length_batches(lengths: np.ndarray, batch_size: int, generator: np.random.Generator,
                   bucket_batches: int = 50) -> list[np.ndarray]:
    """Indices in batches of similar length: a random permutation cut into buckets of `bucket_batches`
    batches, each bucket sorted by length and cut into batches, the batches shuffled. Every index once."""
    n = len(lengths)
    perm = generator.permutation(n)
    span = batch_size * bucket_batches
    batches = []
    for s in range(0, n, span):
        chunk = perm[s: s + span]
        chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
        batches += [chunk[i: i + batch_size] for i in range(0, len(chunk), batch_size)]
    order = generator.permutation(len(batches))
    return [batches[i] for i in order]


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on weight matrices only: decaying biases and norm gains pulls them to 0 for nothing."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def load(cfg: TeacherConfig, device: str, start: str | None = None, seed: int | None = None):
    """The cross-encoder of `cfg.model` (a fresh 1-logit head unless pretrained), or of the weights at `start`
    (an intermediate stage's folder). `seed`: the new head's initial weights drawn from it (the same model in
    whichever process loads it), the caller's random state left as it was."""
    # lazy: sentence-transformers takes seconds to import, and a cache hit never needs the model
    from sentence_transformers import CrossEncoder

    if start is None:
        check_local(cfg.model, "cross-encoder")
    path = start or resolve_model(cfg.model)
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        try:
            return CrossEncoder(path, num_labels=None if cfg.pretrained else 1, device=device,
                                max_length=cfg.max_length)
        except Exception as exc:
            fix = packaged_instead(cfg.model, "--teacher") or (
                "Name a sentence-transformers or transformers model id, a local model directory, or the alias 'minilm'")
            raise ValueError(f"Could not load cross-encoder {cfg.model!r} ({path}): {one_line(exc)}. {fix}.") from exc


def logits(ce, pairs: list[list[str]]) -> torch.Tensor:
    return logits_of(ce, ce.preprocess(pairs))


def logits_of(ce, features: dict) -> torch.Tensor:
    """(n,) logits of a batch the tokenizer already made (`ce.preprocess`)."""
    features = {k: v.to(ce.device) if isinstance(v, torch.Tensor) else v for k, v in features.items()}
    return ce(features)["scores"].view(-1)


def predict(ce, pairs: list[list[str]], cfg: TeacherConfig) -> np.ndarray:
    """Logits (n,), the mean over both orders when cfg.both_orders; in bf16 where cfg.precision says so and the
    device has it (the ranks barely move: Spearman 0.99999 with fp32's on STS-B validation, 1.6x the pairs/s)."""
    device = getattr(ce, "device", torch.device("cpu"))
    with autocast(effective_precision(cfg, device), device):
        out = _logits_in_batches(ce, pairs, cfg)
        if cfg.both_orders:
            out = (out + _logits_in_batches(ce, [[b, a] for a, b in pairs], cfg)) / 2
    return out.astype(np.float32)


def _logits_in_batches(ce, pairs: list[list[str]], cfg: TeacherConfig) -> np.ndarray:
    """(n,) float64 logits through sentence-transformers' predict, in batches of at most max(batch_size, 32) pairs
    sorted by tokens (`encoding.batching`, as the served cross-encoder sorts them). Its own sort is by characters, a
    loose proxy: 31% more positions padded than STS-B's validation and test pairs hold, 1.4% by tokens, and the scoring
    0.76x its time side by side (measured side by side on STS-B). The batches change no logit beyond rounding."""
    out = np.empty(len(pairs), dtype=np.float64)
    for idx in longest_first(token_lengths(ce, pairs, cfg.max_length), max(cfg.batch_size, 32)):
        out[idx] = np.asarray(ce.predict([pairs[i] for i in idx], batch_size=len(idx), show_progress_bar=False,
                                         activation_fn=torch.nn.Identity()), dtype=np.float64).reshape(-1)
    return out


def token_lengths(ce, pairs: list[list[str]], max_length: int) -> np.ndarray:
    """(n,) tokens of each pair as the model reads them: both texts and the special tokens, truncated at max_length."""
    if not pairs:
        return np.zeros(0, dtype=np.int64)
    ids = ce.tokenizer([a for a, _ in pairs], [b for _, b in pairs], truncation=True,
                       max_length=max_length)["input_ids"]
    return np.array([len(x) for x in ids], dtype=np.int64)


def spearman_or_nan(a: np.ndarray, b: np.ndarray) -> float:
    """metrics.spearman, NaN where it is undefined (fewer than 3 pairs, a constant side)."""
    if len(a) < 3 or np.std(a) == 0 or np.std(b) == 0:
        return float("nan")
    return spearman(a, b)


def fit(ce, pairs: list[list[str]], y: np.ndarray, cfg: TeacherConfig, seed: int,
        es_pairs: list[list[str]] | None = None, es_y: np.ndarray | None = None,
        progress: Callable[[str], None] | None = None,
        after_step: Callable[[int], None] | None = None, order: Callable | None = None) -> list[dict[str, float]]:
    """Fine-tune `ce` in place on (pairs, y); returns the per-epoch curve. With an early-stopping slice the
    best epoch's weights are restored and training stops after `patience` epochs without improvement.
    after_step(step): called after every optimizer step (counted from 0 over all epochs), e.g. to average the weights
    of shards (`teacher.shards`). order(batches, characters, epoch) -> batches: the order an epoch's batches train
    in (e.g. the shards' `teacher.shards.cost_ranked`); None: as they are formed."""
    # dropout draws from torch's global generator (transformers takes no generator): seed it inside a fork so
    # the caller's random state is left as it was
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _fit_epochs(ce, pairs, y, cfg, np.random.default_rng(seed), es_pairs, es_y, progress, after_step,
                           order)


def warmup_then_decay(opt: torch.optim.Optimizer, total: int, warmup: float) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over the first `warmup` fraction of the steps, then linear decay to 0."""
    warm = max(1, int(warmup * total))
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else max(0.0, (total - s) / max(1, total - warm)))


#: oneDNN's ISA caps (ONEDNN_MAX_CPU_ISA) below its native bf16 kernels (AVX512_CORE_BF16, AVX10, AMX), and torch's
#: (ATEN_CPU_CAPABILITY) below AVX512
_ONEDNN_BELOW_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}
_ATEN_BELOW_AVX512 = {"DEFAULT", "AVX", "AVX2"}


def isa_capped_below_bf16(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment tells this process to run below the CPU's bf16 instructions: oneDNN capped under
    AVX512_CORE_BF16 (ONEDNN_MAX_CPU_ISA, or the older DNNL_MAX_CPU_ISA) or torch's own kernels under AVX512
    (ATEN_CPU_CAPABILITY), as on a CPU without them. bf16 would then run emulated, slower than fp32."""
    environ = os.environ if environ is None else environ
    onednn = (environ.get("ONEDNN_MAX_CPU_ISA") or environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    aten = environ.get("ATEN_CPU_CAPABILITY", "").strip().upper()
    return onednn in _ONEDNN_BELOW_BF16 or aten in _ATEN_BELOW_AVX512


@functools.lru_cache(maxsize=None)
def _cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no cheap way to tell, and bf16 emulated in software is slower than fp32
        return False
    return ("avx512_bf16" in flags or "amx_bf16" in flags) and not isa_capped_below_bf16()


def effective_precision(cfg: TeacherConfig, device: torch.device) -> str:
    """The precision training and scoring run in: cfg.precision where the device computes bf16 natively, else fp32."""
    if cfg.precision != "bf16":
        return "fp32"
    native = torch.cuda.is_bf16_supported() if device.type == "cuda" else device.type == "cpu" and _cpu_has_bf16()
    return "bf16" if native else "fp32"


def autocast(precision: str, device: torch.device) -> torch.autocast:
    """The context a forward pass of `precision` ("fp32" | "bf16", see effective_precision) runs in."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def training_attention(precision: str, device: torch.device):
    """The context a training forward pass runs in: in bf16 on a CPU, torch's attention through its math kernel. Where
    no dropout draws a mask (`TeacherConfig.dropout=0.0`) torch picks its fused kernel instead, whose bf16 backward
    made a step 1.2x the time of one with dropout (math: 0.85x, measured side by side); with dropout it takes
    the math kernel anyway (the same logits and random draws)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH) if precision == "bf16" and device.type == "cpu" else contextlib.nullcontext()


def _prepare(ce, cfg: TeacherConfig) -> str:
    """Freezes the word embeddings, or the embedding block and the first layers, and sets the dropout, when cfg asks;
    the precision training runs in."""
    if cfg.dropout is not None:
        backbone.set_dropout(ce.model, cfg.dropout)
    if cfg.freeze_embeddings:
        ce.model.get_input_embeddings().weight.requires_grad_(False)
    if cfg.freeze_layers:
        backbone.freeze_bottom(ce.model, cfg.freeze_layers)
    precision = effective_precision(cfg, ce.device)
    if precision != cfg.precision:
        why = ("ONEDNN_MAX_CPU_ISA or ATEN_CPU_CAPABILITY caps it below them" if isa_capped_below_bf16() else
               "this CPU has neither")
        slower = (f" (AVX512-BF16 or AMX: {why}; 1.5-1.7x the time of bf16 with AVX512-BF16, about 2.4x with AMX, "
                  "measured for the fast recipe on 2 cores, results/README.md#the-first-run)"
                  if ce.device.type == "cpu" else "")
        log.warning("The teacher's recipe asks for %s training and %s does not compute it natively: training in %s%s.",
                    cfg.precision, ce.device, precision, slower)
    return precision


def _optimizer(model: torch.nn.Module, cfg: TeacherConfig, device: torch.device, steps: int):
    """(AdamW, its warmup-then-decay schedule over `steps`)."""
    # fused: one kernel over all the weights instead of a loop over ~100 tensors (on 2 CPU cores 8 ms a step instead
    # of 25 of a fold's ~325; the same update up to rounding)
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr,
                            fused=True if device.type in ("cpu", "cuda") else None)
    return opt, warmup_then_decay(opt, steps, cfg.warmup)


def _epoch_batches(cfg: TeacherConfig, lengths: np.ndarray, g: np.random.Generator, steps: int, epoch: int,
                   order) -> list[np.ndarray]:
    batches = (length_batches(lengths, cfg.batch_size, g) if cfg.length_buckets
               else np.array_split(g.permutation(len(lengths)), steps))
    return batches if order is None else order(batches, lengths, epoch)


def _fit_epochs(ce, pairs, y, cfg, g: np.random.Generator, es_pairs, es_y, progress,
                after_step=None, order=None) -> list[dict[str, float]]:
    if cfg.both_orders:
        pairs = pairs + [[b, a] for a, b in pairs]
        y = np.concatenate([y, y])
    lengths = np.array([len(a) + len(b) for a, b in pairs])
    yt = torch.as_tensor(y, dtype=torch.float32)
    model = ce.model
    precision = _prepare(ce, cfg)
    steps_per_epoch = math.ceil(len(pairs) / cfg.batch_size)
    opt, sched = _optimizer(model, cfg, ce.device, steps_per_epoch * cfg.epochs)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    curve: list[dict[str, float]] = []
    best_score, best_state, since_best, step = -math.inf, None, 0, 0
    for epoch in range(1, cfg.epochs + 1):
        model.train()
        t0, loss_sum = time.perf_counter(), 0.0
        batches = _epoch_batches(cfg, lengths, g, steps_per_epoch, epoch, order)
        ticker = None if progress is None else Progress(len(batches), f"epoch {epoch}/{cfg.epochs}", "batches",
                                                         emit=progress)
        for idx in batches:
            with autocast(precision, ce.device), training_attention(precision, ce.device):
                z = packed.training_logits(ce, [pairs[j] for j in idx])
            loss = loss_fn(z.float(), yt[idx].to(ce.device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            sched.step()
            if after_step is not None:
                after_step(step)
            step += 1
            loss_sum += float(loss.detach()) * len(idx)
            if ticker is not None:
                ticker.update(1)
        model.eval()
        seconds = time.perf_counter() - t0
        point = {"epoch": epoch, "train_loss": loss_sum / len(pairs), "seconds": round(seconds, 1),
                 "pairs_per_s": round(len(pairs) / seconds, 1), "precision": precision}
        if es_pairs:
            point["early_stopping_spearman"] = spearman_or_nan(predict(ce, es_pairs, cfg), es_y)
        curve.append(point)
        if progress is not None:
            progress(f"epoch {epoch}/{cfg.epochs} done in {seconds:.0f}s ({point['pairs_per_s']} pairs/s)"
                     + (f", early-stopping Spearman {point['early_stopping_spearman']:.4f}" if es_pairs else ""))
        if not es_pairs:
            continue
        if point["early_stopping_spearman"] > best_score:
            best_score, since_best = point["early_stopping_spearman"], 0
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        else:
            since_best += 1
            if since_best >= cfg.patience:
                break
    if best_state is not None:
        model.load_state_dict(best_state)
    model.eval()
    return curve
