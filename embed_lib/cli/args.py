"""Command-line flags shared by `python -m embed_lib` and the sweeps: one definition of each flag group.

    add_data_flags      --data-dir, --cache-dir
    add_encoder_flags   --encoder, --encoder-backend, --revision, [--tau-attn], --max-seq-length, --encode-batch-size, --device
    add_teacher_flags   --teacher, --teacher-pretrained, --teacher-preset, --teacher-folds/-epochs/-lr/-max-length,
                        --no-teacher
    add_adapter_flags   one flag per AdapterConfig field (help from the field's `#:` comment), --seeds
    add_mlflow_flags    --tracking-uri, --experiment, [--no-mlflow]
and the configs they make (`encoder_config`, `teacher_config`, `adapter_config`); `skip_exit_collection` for
the commands' processes.
"""
from __future__ import annotations

import argparse
import atexit
import dataclasses
import gc
import inspect
import re
import sys

from embed_lib.cli.values import int_at_least
from embed_lib.config import BACKENDS, AdapterConfig, EncoderConfig
from embed_lib.data.custom_tasks import CustomTask, register
from embed_lib.data.tasks import CUSTOM, SPLITS, task_names
from embed_lib.teacher.config import PRECISIONS, PRESETS, TeacherConfig, teacher_preset


def skip_exit_collection() -> None:
    """At interpreter exit, leave out the garbage collector's full passes over every object torch, transformers,
    Ray and MLflow allocated: a command that has printed its result otherwise keeps its caller (a shell, `ray job
    submit`, a test) waiting while the collector walks a heap the operating system frees anyway. `gc.freeze` only
    moves the objects alive at that moment out of the collector's reach: every exit handler still runs (Ray's
    shutdown, logging's flush), and the interpreter still flushes stdout and stderr."""
    atexit.register(gc.freeze)


def add_data_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", default=None,
                   help="local mirror of the datasets (default: $EMBED_DATA_DIR, else ../shared/data beside this "
                        "clone where the mirror is, else the Hugging Face Hub)")
    p.add_argument("--cache-dir", default=None, help="embedding cache (default: $EMBED_CACHE_DIR or ./.cache/embed_lib)")


def add_encoder_flags(p: argparse.ArgumentParser, tau_attn: bool = True,
                      device_help: str = "cpu, cuda, cuda:1 (default: best available)") -> None:
    """tau_attn=False: the caller offers its own attention-temperature flag (a sweep searches a list)."""
    p.add_argument("--encoder", default="minilm",
                   help="sentence-transformers id, local path, or alias 'minilm' (default: minilm, offline)")
    p.add_argument("--revision", default=None, help="Hub revision of the encoder")
    if tau_attn:
        p.add_argument("--tau-attn", type=float, default=1.0, help="attention temperature (TempScale), default 1.0")
    p.add_argument("--max-seq-length", type=int, default=None, help="truncation length (default: the model's)")
    p.add_argument("--encode-batch-size", type=int, default=64, help="encoding batch size (default: 64)")
    p.add_argument("--device", default=None, help=device_help)
    p.add_argument("--prompt-name", default=None, help="a prompt of the encoder's own put before every sentence "
                                                       "(e.g. query for Qwen/Qwen3-Embedding-0.6B)")
    p.add_argument("--prompt", default=None, help="a prompt text put before every sentence (instead of --prompt-name)")
    p.add_argument("--encoder-backend", default="torch", choices=BACKENDS,
                   help="inference backend of the encoder: torch, onnx (ONNX Runtime fp32) or onnx-int8 (dynamic "
                        "int8 quantisation, ~2x faster on CPU; its vectors differ slightly, so it has its own cache "
                        "key). Default: torch")


def encoder_config(args: argparse.Namespace, tau_attn: float | None = None) -> EncoderConfig:
    tau = tau_attn if tau_attn is not None else getattr(args, "tau_attn", 1.0)
    return EncoderConfig(model=args.encoder, revision=args.revision, tau_attn=tau,
                         max_seq_length=args.max_seq_length, batch_size=args.encode_batch_size, device=args.device,
                         prompt_name=args.prompt_name, prompt=args.prompt,
                         backend=getattr(args, "encoder_backend", "torch"))


def add_mlflow_flags(p: argparse.ArgumentParser, default_experiment: str, optional: bool = True) -> None:
    p.add_argument("--tracking-uri", default=None,
                   help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or sqlite:///<cwd>/mlflow.db)")
    p.add_argument("--experiment", default=None, help=f"MLflow experiment (default: {default_experiment})")
    if optional:
        p.add_argument("--no-mlflow", action="store_true", help="do not log to MLflow")


def field_docs(cls) -> dict[str, str]:
    """Field name -> its `#:` comment in the dataclass source (one source for docs and --help)."""
    docs, pending = {}, []
    for line in inspect.getsource(cls).splitlines():
        line = line.strip()
        if line.startswith("#:"):
            pending.append(line[2:].strip())
        elif (m := re.match(r"(\w+): [^=]+=", line)) and pending:
            docs[m.group(1)] = " ".join(pending).replace("%", "%%")
            pending = []
        else:
            pending = []
    return docs


def add_teacher_flags(p: argparse.ArgumentParser, default_preset: str = "strong") -> None:
    """The teacher flags, shared by every command and by the sweeps."""
    p.add_argument("--teacher", default="minilm",
                   help="teacher backbone, independent of --encoder: weights to fine-tune with K-fold cross-fitting "
                        "(sentence-transformers / transformers id or local directory, alias 'minilm'), or a "
                        "pretrained cross-encoder with --teacher-pretrained (default: minilm)")
    p.add_argument("--teacher-pretrained", action="store_true", help="--teacher is already a cross-encoder")
    p.add_argument("--teacher-preset", default=default_preset,
                   help="teacher recipe, one of " + "; ".join(f"{k}: {v}" for k, v in PRESETS.items())
                        + f" (default {default_preset}); per task: 'stsb=strong,qqp=light' (unlisted tasks: "
                        f"{default_preset})")
    docs, d = field_docs(TeacherConfig), TeacherConfig()  # help texts and defaults from the config itself
    for name, kind in (("folds", int), ("epochs", int), ("stage_shards", int)):
        p.add_argument(f"--teacher-{name.replace('_', '-')}", type=kind, default=None,
                       help=f"{docs[name]} (overrides the preset)")
    for name, kind in (("lr", float), ("max_length", int), ("dropout", float), ("stage_dropout", float)):
        p.add_argument(f"--teacher-{name.replace('_', '-')}", type=kind, default=None,
                       help=f"{docs[name]} (default: the preset's, else {getattr(d, name)!r})")
    p.add_argument("--teacher-precision", choices=PRECISIONS, default=None,
                   help=f"{docs['precision']} (default: the preset's)")
    p.add_argument("--teacher-intermediate", default=None, metavar="TASKS",
                   help=f"{docs['intermediate']} (default: the preset's, {PRESETS[default_preset]['intermediate']!r}; "
                        "'' for none)")
    p.add_argument("--no-teacher", action="store_true", help="skip the teacher (no ce_margin target)")
    p.add_argument("--silver-pairs", type=int_at_least(1), default=None, metavar="N",
                   help="distillation: N silver pairs (new pairs of the task's train sentences: nearest neighbours, "
                        "a train pair's other side, random) for the teacher to score once, cached with its scores "
                        f"(default {DEFAULT_SILVER} where a configuration distils; none otherwise)")
    p.add_argument("--no-silver", action="store_true",
                   help="no silver pairs: distillation learns the teacher's scores of the labelled train pairs only")
    p.set_defaults(teacher_preset_default=default_preset)  # for tasks a per-task --teacher-preset leaves out


def preset_for(value: str, task: str, default: str = "strong") -> str:
    """--teacher-preset value -> the preset of `task` ('light', or 'stsb=strong,qqp=light')."""
    if "=" not in value:
        name = value
    else:
        items = [item.strip() for item in value.split(",") if item.strip()]
        pairs = dict(item.split("=", 1) for item in items if "=" in item)
        bad = [item for item in items if "=" not in item or not item.split("=", 1)[0]]
        if bad:
            raise ValueError(f"--teacher-preset {value!r}: {bad[0]!r} is not TASK=PRESET; give one preset, or "
                             "TASK=PRESET pairs separated by commas, e.g. 'stsb=strong,qqp=light'.")
        unknown = sorted(t for t in pairs if t not in task_names() and t not in CUSTOM)
        if unknown:
            raise ValueError(f"--teacher-preset {value!r}: unknown task(s) {unknown}. Valid tasks: {task_names()}.")
        for name in pairs.values():  # every listed preset, not only this task's
            if name not in PRESETS:
                raise ValueError(f"--teacher-preset {value!r}: unknown preset {name!r}. Valid presets: "
                                 f"{sorted(PRESETS)}.")
        name = pairs.get(task, default)
    if name not in PRESETS:
        raise ValueError(f"--teacher-preset {value!r}: unknown preset {name!r}. Valid presets: {sorted(PRESETS)}.")
    return name


def teacher_config(args: argparse.Namespace, task: str | None = None):
    if args.no_teacher:
        return None
    overrides = {k: v for k, v in (("folds", args.teacher_folds), ("epochs", args.teacher_epochs),
                                   ("lr", args.teacher_lr), ("max_length", args.teacher_max_length),
                                   ("intermediate", args.teacher_intermediate),
                                   ("precision", args.teacher_precision),
                                   ("stage_shards", args.teacher_stage_shards),
                                   ("dropout", args.teacher_dropout),
                                   ("stage_dropout", args.teacher_stage_dropout))
                 if v is not None}
    preset = preset_for(args.teacher_preset, task or getattr(args, "task", ""),
                        getattr(args, "teacher_preset_default", "strong"))
    return teacher_preset(preset, model=args.teacher, pretrained=args.teacher_pretrained, **overrides)


#: silver pairs built for distillation when --silver-pairs is not given: the teacher scores them once (about a minute
#: of a fast-recipe teacher's folds on 2 CPU cores), and they double the pairs a distilled adapter trains on
DEFAULT_SILVER = 4000


def silver_pairs(args: argparse.Namespace, wanted: bool = True) -> int | None:
    """The silver pairs the flags ask for: None with --no-silver or --no-teacher, or where no configuration distils
    (`wanted`); --silver-pairs N, else DEFAULT_SILVER. --silver-pairs with --no-silver or --no-teacher is refused."""
    given = getattr(args, "silver_pairs", None)
    if given is not None and (args.no_silver or args.no_teacher):
        raise ValueError(f"--silver-pairs {given} with {'--no-silver' if args.no_silver else '--no-teacher'}: silver "
                         "pairs are scored by the teacher; drop one of the two.")
    if args.no_silver or args.no_teacher or not wanted:
        return None
    return given if given is not None else DEFAULT_SILVER


def teacher_progress(task: str):
    """A progress printer for the teacher's folds and epochs (stderr, one line per step)."""
    return lambda msg: print(f"[{task}] {msg}", file=sys.stderr, flush=True)


def add_adapter_flags(p: argparse.ArgumentParser) -> None:
    d = AdapterConfig()
    docs = field_docs(AdapterConfig)
    for f in dataclasses.fields(AdapterConfig):
        if f.name in ("task", "n_seeds"):
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool",) or isinstance(f.default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=docs.get(f.name))
        else:
            allowed = f"; allowed {f.metadata['bounds'].describe()}" if "bounds" in f.metadata else ""
            p.add_argument(flag, type=type(f.default), default=f.default,
                           help=f"{docs.get(f.name, '')} (default {f.default!r}{allowed})")
    p.add_argument("--seeds", type=int, default=d.n_seeds, help=f"seeds in the group (default {d.n_seeds})")


def adapter_config(args: argparse.Namespace, task: str):
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(AdapterConfig)
              if f.name not in ("task", "n_seeds")}
    try:
        return AdapterConfig(task=task, n_seeds=args.seeds, **values)
    except ValueError as exc:  # the flag that set the field first: "--lambda-distil: AdapterConfig.lambda_distil=1.5 ..."
        field = re.match(r"AdapterConfig\.(\w+)", str(exc))
        if field is None or field.group(1) not in values:
            raise
        raise ValueError(f"--{field.group(1).replace('_', '-')}: {exc}") from None


def teacher_summary(record: dict) -> str:
    """One line: the teacher's recipe, quality against the frozen cosine, independence and cost."""
    q = record.get("quality", {})
    parts = [f"teacher {record['config']['model']} ({record.get('preset', 'custom')} recipe, "
             f"{record['config']['folds']} folds x <= {record['config']['epochs']} epochs"
             + (f", {record['precision']}" if record.get("precision", "fp32") != "fp32" else "")
             + (f", from an intermediate stage on {', '.join(stage['tasks'])} ({stage['pairs']} pairs, "
                f"{stage['seconds']:.0f}s)" if (stage := record.get("intermediate")) else "") + "): "]
    for split in ("validation", "test"):
        if split in q:
            parts.append(f"{split} Spearman {q[split]['teacher_spearman']:.4f} vs cosine "
                         f"{q[split]['cosine_spearman']:.4f}, error correlation {q[split]['error_correlation']:.3f}, "
                         f"rank average {q[split]['rank_average_spearman']:.4f}; ")
    return "".join(parts) + f"{record['seconds']:.0f}s once per task"


#: the pair-file flags' defaults: a built-in task refuses any other value rather than ignore it
PAIR_FILE_DEFAULTS = {"text_columns": "sentence1,sentence2", "label_column": "label", "label_range": None,
                      "binary": False, "split_column": "split", "split": None, "task_name": None}


def add_custom_data_flags(p: argparse.ArgumentParser) -> None:
    """Flags of a --task that is a file or a Hub dataset (embed_lib.data.custom_tasks)."""
    g = p.add_argument_group("your own pairs (--task FILE.csv|.tsv|.jsonl|.parquet or hf:<id>[:<config>])")
    g.add_argument("--text-columns", default=PAIR_FILE_DEFAULTS["text_columns"],
                   help="the two text columns (default sentence1,sentence2)")
    g.add_argument("--label-column", default=PAIR_FILE_DEFAULTS["label_column"],
                   help="the label column (default label)")
    g.add_argument("--label-range", default=None, metavar="LO,HI", help="graded labels and their scale, e.g. 0,5")
    g.add_argument("--binary", action="store_true", help="0/1 labels (detected when every label is 0 or 1)")
    g.add_argument("--split-column", default=PAIR_FILE_DEFAULTS["split_column"],
                   help="column naming each row's split (train / validation / test; default split); without it a "
                        "seeded 70/15/15 split is made")
    g.add_argument("--split", default=None, choices=SPLITS,
                   help="the whole file is this split (e.g. test: a file used only for evaluation)")
    g.add_argument("--task-name", default=None, help="the task's name (a slug; default from the file name): experiment "
                                                "sweep-<name>, registered model pair-residual-<name>")


def refuse_pair_file_flags(args: argparse.Namespace, value: str) -> None:
    """ValueError when a pair-file flag is given with a built-in task (or 'all'), which would ignore it."""
    given = [f"--{k.replace('_', '-')}" for k, v in PAIR_FILE_DEFAULTS.items() if getattr(args, k, v) != v]
    if given:
        verb = "describes" if len(given) == 1 else "describe"
        what = "every built-in task" if value == "all" else "a built-in task"
        raise ValueError(f"{', '.join(given)} {verb} a pair file or hf:<id>, and --task {value!r} is {what} "
                         "with its own columns, labels and splits: drop them, or give the file as --task.")


def resolve_task(args: argparse.Namespace, value: str) -> str:
    """A built-in task name stays as it is; a file or hf:<id> is validated and registered as a custom task,
    whose name is returned. Raises ValueError / FileNotFoundError naming the file, row, column and rule."""
    if value in task_names():
        refuse_pair_file_flags(args, value)
        return value
    if value in CUSTOM:
        return value
    looks_like_data = value.startswith("hf:") or "/" in value or "." in value
    if not looks_like_data:
        raise ValueError(f"--task {value!r} is unknown. Valid tasks: {task_names()}, a pair file "
                         "(.csv, .tsv, .jsonl, .parquet) or hf:<dataset id>[:<config>].")
    label_range = None
    if args.label_range:
        try:
            lo, hi = (float(x) for x in args.label_range.split(","))
        except ValueError:
            raise ValueError(f"--label-range {args.label_range!r}: expected LO,HI, e.g. 0,5.") from None
        label_range = (lo, hi)
    spec = CustomTask.from_args(value, tuple(c.strip() for c in args.text_columns.split(",")), args.label_column,
                                label_range, args.binary, args.split_column, args.split, args.task_name)
    return register(spec)
