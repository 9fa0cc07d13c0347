"""How the teacher is obtained: `TeacherConfig`, its named recipes (`PRESETS`) and the intermediate stage's spec.

Below the recipe (`teacher.recipe`), the stage (`teacher.intermediate`) and the scores (`teacher.scores`), which
all read it; part of the teacher-score cache key.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from embed_lib.config import bounded, check_bounds, learning_rate, unit_interval
from embed_lib.data.tasks import task_names

#: `TeacherConfig.intermediate` value for every built-in task but the teacher's own
OTHERS = "others"
#: `TeacherConfig.precision` values
PRECISIONS = ("fp32", "bf16")
#: fields added after teacher scores were first cached: left out of the cache keys at these defaults, so that
#: every teacher cached before them keeps its key
LATER_FIELDS = {"precision": "fp32", "freeze_embeddings": False, "stage_shards": 1, "freeze_layers": 0,
                "dropout": None, "stage_dropout": None}


def check_spec(spec: str) -> None:
    """ValueError unless `spec` is '', 'others' or a comma-separated list of built-in tasks."""
    if not isinstance(spec, str):
        raise ValueError(f"TeacherConfig.intermediate={spec!r}; give '', {OTHERS!r} or built-in tasks "
                         f"separated by commas, from {task_names()}.")
    unknown = [t for t in spec.split(",") if t.strip() and t.strip() not in task_names()] if spec != OTHERS else []
    if unknown:
        raise ValueError(f"TeacherConfig.intermediate names unknown task(s) {unknown}; give '', {OTHERS!r} or "
                         f"built-in tasks separated by commas, from {task_names()}.")


@dataclass(frozen=True)
class TeacherConfig:
    """How the teacher is obtained. Part of the teacher-score cache key."""

    #: cross-encoder base weights (fine-tuned) or a pretrained cross-encoder id / path; alias "minilm"
    model: str = "minilm"
    #: True: `model` is already a cross-encoder; score without training
    pretrained: bool = False
    #: folds of the cross-fitting (every train pair scored by a model that did not see it)
    folds: int = bounded(3, 2, 20)
    #: the most epochs per fold; early stopping keeps the best epoch on the fold's early-stopping slice
    epochs: int = bounded(3, 1, 50)
    #: epochs without improvement on the early-stopping slice before a fold stops
    patience: int = bounded(1, 1, 50)
    #: fraction of each fold's training part held out for early stopping (0: train on all, keep the last epoch)
    early_stopping_fraction: float = bounded(0.1, 0.0, 0.5)
    #: peak learning rate; 5e-5 with warmup and decay (2e-5 for one epoch leaves MiniLM below the cosine)
    lr: float = learning_rate(5e-5)
    #: fraction of the steps spent warming the learning rate up (linear), before its linear decay to 0
    warmup: float = unit_interval(0.1)
    #: AdamW weight decay (never on norms and biases)
    weight_decay: float = unit_interval(0.01)
    #: gradient-norm clip
    grad_clip: float = bounded(1.0, 0.0, 1e6, low_open=True)
    #: pairs per step
    batch_size: int = bounded(16, 2, 1024)
    #: tokens per pair (both sentences together); longer pairs are truncated
    max_length: int = bounded(128, 8, 4096)
    #: train on (a, b) and (b, a) and score as the mean of both orders
    both_orders: bool = True
    #: batches of pairs of similar length (shuffled in buckets, batches in random order)
    length_buckets: bool = True
    #: the arithmetic of training and of the teacher's own scoring: "fp32", or "bf16" (matmuls autocast to bfloat16;
    #: weights, gradients and optimizer state in fp32) where the hardware has it (AVX512-BF16 or AMX CPUs, bf16
    #: GPUs) and no ISA cap holds the process below it (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY), else fp32, as the
    #: record says
    precision: str = "fp32"
    #: keep the backbone's word-embedding table as it is: it is half of MiniLM's weights, and updating it is most of
    #: each optimizer step
    freeze_embeddings: bool = False
    #: keep the backbone's whole embedding block (word, position and type embeddings and their norm) and its first
    #: N transformer layers as they are: the backward pass then stops above them. 3 of MiniLM's 6 frozen: a training
    #: step in fp32 0.66 of its time, but the fast teacher's STS-B test Spearman 0.778 instead of 0.838 (a
    #: bi-encoder's lower layers never attended across two sentences; results/README.md#the-first-run)
    freeze_layers: int = bounded(0, 0, 128)
    #: the probability of every dropout in the model while the folds and the served teacher train (None: the model's
    #: own, MiniLM's 0.1; the stage's too unless `stage_dropout` says otherwise). The fast recipe with 0.0 in stage
    #: and folds trained a better teacher, faster (STS-B test Spearman 0.8429 instead of 0.8378 and 630 s instead of
    #: 680-694 s in fp32, fresh clones), but the sweep's champion over it gained less: validation +0.0111 instead of
    #: +0.0129, under the +0.012 floor of the first run (results/README.md#the-first-run)
    dropout: float | None = bounded(None, 0.0, 0.9, allow_none=True)
    #: the probability of every dropout in the model while the intermediate stage trains (None: `dropout`'s). The
    #: fast recipe's stage trains without (0.0): a stage step 0.85x the time in fp32 and in bf16, and the folds keep
    #: the model's own (results/README.md#the-first-run)
    stage_dropout: float | None = bounded(None, 0.0, 0.9, allow_none=True)
    #: intermediate stage (embed_lib.teacher.intermediate): "" (none), "others" (every built-in task but the
    #: teacher's own) or built-in tasks separated by commas, whose train pairs the backbone learns once
    #: (one epoch, one order) before the folds start from it
    intermediate: str = ""
    #: the most train pairs the intermediate stage takes from each of its tasks (a seeded sample)
    intermediate_pairs: int = bounded(10000, 100, 10_000_000)
    #: the stage's pairs split into this many shards, each trained in a process of its own on batches of
    #: batch_size / shards, the shards' weights averaged every few steps (`embed_lib.teacher.shards`); 1: one process
    stage_shards: int = bounded(1, 1, 16)
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise ValueError(f"TeacherConfig.model must be a model id, path or alias; got {self.model!r}.")
        check_bounds(self)
        check_spec(self.intermediate)
        if self.precision not in PRECISIONS:
            raise ValueError(f"TeacherConfig.precision={self.precision!r}; give one of {list(PRECISIONS)}.")
        if self.pretrained and self.intermediate:
            raise ValueError("TeacherConfig.intermediate trains the backbone, and a pretrained teacher is not "
                             "trained: drop one of them.")


#: named recipes. "strong" is the study's teacher; "light": one epoch per fold, no early stopping (about a third
#: of the cost, a little weaker); "fast", `make run`'s: light in bf16 where the hardware has it, with the word
#: embeddings frozen (stage and folds 1.6-1.9x faster than light on 2 CPU cores with AVX512-BF16, test Spearman
#: 0.8380), its stage in two shards averaged every 16 steps (380 s instead of 435 side by side, teacher test
#: Spearman 0.8375 instead of 0.8419: results/README.md#the-first-run), and lr 1e-4 (stage and folds) with 2 folds
#: instead of light's 5e-5 with 3 (the teacher's work 0.77x, validation Spearman 0.876 instead of 0.867, test 0.838
#: in bf16 and in fp32; 2 folds at 2e-4, better on validation, fell to 0.833 on test in fp32,
#: 7 variants trained side by side), and its stage without dropout (the stage 0.86x its time capped at AVX2, teacher
#: test Spearman 0.8432 instead of 0.8416, the champion +0.0130 on validation instead of +0.0126: fresh clones).
#: All start the folds from an intermediate stage on the other tasks' train pairs (see teacher_intermediate).
PRESETS: dict[str, dict[str, Any]] = {
    "strong": dict(folds=3, epochs=3, patience=1, early_stopping_fraction=0.1, intermediate="others"),
    "light": dict(folds=3, epochs=1, early_stopping_fraction=0.0, intermediate="others"),
    "fast": dict(folds=2, lr=1e-4, epochs=1, early_stopping_fraction=0.0, intermediate="others", precision="bf16",
                 freeze_embeddings=True, stage_shards=2, stage_dropout=0.0),
}


def teacher_preset(name: str, **overrides: Any) -> TeacherConfig:
    """TeacherConfig of a named recipe; `overrides` (model, lr, ...) win over the preset. A pretrained
    teacher is not trained, so it drops the preset's intermediate stage unless `overrides` names one."""
    if name not in PRESETS:
        raise ValueError(f"Unknown teacher preset {name!r}. Valid presets: {sorted(PRESETS)}.")
    fields = {**PRESETS[name], **overrides}
    if fields.get("pretrained") and "intermediate" not in overrides:
        fields["intermediate"] = ""
    return TeacherConfig(**fields)


def preset_of(cfg: TeacherConfig) -> str:
    """The preset name a config matches (its recipe fields), else 'custom'."""
    for name, fields in PRESETS.items():
        if all(getattr(cfg, k) == v for k, v in {**LATER_FIELDS, **fields}.items()):
            return name
    return "custom"


