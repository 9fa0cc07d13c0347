"""Command line: `python -m embed_lib <command>`.

    baseline     frozen cosine baseline of one task or all, every split, as a table + results file
    train        one adapter configuration on a seed group: per-seed table, logged to MLflow
    study        the reference comparison (every form and control) on one task or all -> results/study_<task>.{md,json}
    retrieval    re-ranking check on a duplicate-question retrieval set -> results/retrieval_<task>.{md,json}
    diagnostics  headroom of each difficulty signal and the length-collapse table
    teacher      the K-fold teacher's record, one cross-encoder on all of train, registered as cross-encoder-<task>
    registry     versions of pair-residual-<task>, their aliases and why each sits there; --promote / --rollback
    evaluate     a registered adapter on one split of a task or your own pair file, beside the frozen cosine
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Sequence

from mlflow.exceptions import MlflowException

from embed_lib.cli.args import (add_adapter_flags, add_custom_data_flags, add_data_flags, add_encoder_flags,
                                add_mlflow_flags, add_teacher_flags, refuse_pair_file_flags, resolve_task)
from embed_lib.cli.commands import cmd_baseline, cmd_diagnostics, cmd_retrieval, cmd_study, cmd_teacher, cmd_train
from embed_lib.cli.evaluate import add_evaluate_parser
from embed_lib.cli.registry import add_registry_parser
from embed_lib.cli.values import float_above, int_at_least
from embed_lib.config import writable_dir
from embed_lib.data.tasks import task_names
from embed_lib.encoding.encoders import check_device
from embed_lib.tracking.runs import checked_tracking_uri


#: the commands that take --task all (study also takes tasks separated by commas)
MANY_TASKS = ("baseline", "study")


def _add_common(p: argparse.ArgumentParser, many: bool = False) -> None:
    p.add_argument("--task", default="stsb", help=f"one of {task_names()}{', all' if many else ''}, or your own "
                                                  "pairs: a .csv / .tsv / .jsonl / .parquet file or hf:<dataset id> "
                                                  "(default: stsb)")
    add_encoder_flags(p)
    add_data_flags(p)
    add_custom_data_flags(p)


def _add_retrieval(sub) -> None:
    p = sub.add_parser("retrieval", help="re-ranking check on a BEIR-Quora-style retrieval set (nDCG@10, MRR@10, "
                                         "Recall@100) -> results/retrieval_<task>.{md,json}")
    _add_common(p)
    add_adapter_flags(p)
    add_teacher_flags(p)
    p.add_argument("--model-uri", default="models:/pair-residual-stsb@champion",
                   help="registered adapter to re-rank with (default: the STS-B champion of `make run`)")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI)")
    p.add_argument("--train", action="store_true",
                   help="instead of --model-uri, train the adapter given by the adapter flags on the task's train split")
    p.add_argument("--retrieval-split", default="test", help="the split the retrieval set is built from (default test)")
    p.add_argument("--top-k", type=int_at_least(1), default=100,
                   help="frozen-cosine candidates re-ranked (default 100)")
    p.add_argument("--out", default=None, help="results file (default: results/retrieval_<task>.md)")
    p.set_defaults(func=cmd_retrieval)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m embed_lib", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("baseline", help="frozen cosine baseline on every split")
    _add_common(p, many=True)
    p.add_argument("--out", default=None, help="results file (default: results/baseline_<task>.md)")
    p.set_defaults(func=cmd_baseline)

    p = sub.add_parser("train", help="one adapter configuration on a seed group")
    _add_common(p)
    add_adapter_flags(p)
    add_teacher_flags(p)
    add_mlflow_flags(p, "embed_lib-<task>")
    p.add_argument("--transfer", action=argparse.BooleanOptionalAction, default=True,
                   help="score the group on the other tasks' validation pairs (do-no-harm check; default on)")
    p.add_argument("--limit", type=int_at_least(1), default=None, help="first N pairs of every split (smoke tests)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("study", help="every form and control of the reference study -> markdown + JSON")
    _add_common(p, many=True)
    add_adapter_flags(p)
    add_teacher_flags(p)
    p.add_argument("--arms", choices=["all", "pair", "per_sentence", "distil"], default="all",
                   help="the arms to run: all (default), only the standard pair / per-sentence forms, or distil "
                        "(distillation: labelled and silver pairs, a shuffled-teacher control, beside the ungated and "
                        "the teacher-gated residual)")
    p.add_argument("--gamma-grid", default="0.05,0.1,0.2,0.5,1.0",
                   help="gammas every arm with a gamma is trained at; each arm keeps its best on validation "
                        "(default 0.05,0.1,0.2,0.5,1.0: a gate that learns its target only needs the larger ones)")
    p.add_argument("--transfer", action=argparse.BooleanOptionalAction, default=True,
                   help="score every arm on the other tasks' validation pairs (default on)")
    p.add_argument("--limit", type=int_at_least(1), default=None, help="first N pairs of every split (smoke tests)")
    p.add_argument("--out", default=None, help="results file (default: results/study_<task>.md)")
    p.set_defaults(func=cmd_study)

    _add_retrieval(sub)

    p = sub.add_parser("diagnostics", help="headroom of each difficulty signal; length collapse")
    _add_common(p)
    add_teacher_flags(p)
    p.add_argument("--limit", type=int_at_least(1), default=None, help="first N pairs of every split")
    p.add_argument("--collapse-tau", type=float_above(0), default=0.5, help="tau_attn compared with 1.0 (default 0.5)")
    p.add_argument("--collapse-sample", type=int_at_least(2), default=3000,
                   help="sentences sampled for the collapse table")
    p.set_defaults(func=cmd_diagnostics)

    p = sub.add_parser("teacher", help="the teacher's quality, and one cross-encoder on all of train for serving and "
                                       "the cascade, registered in MLflow as cross-encoder-<task>")
    _add_common(p)
    add_teacher_flags(p)
    add_mlflow_flags(p, "embed_lib-<task>")
    p.set_defaults(func=cmd_teacher)

    add_registry_parser(sub)
    add_evaluate_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    task = getattr(args, "task", None)
    if task is not None:
        listed = task.split(",") if args.command == "study" else [task]
        try:  # a file or hf:<id> is validated here, before anything is encoded, cached or logged
            if task == "all":
                if args.command not in MANY_TASKS:
                    raise ValueError(f"--task all: {args.command} runs on one task; give one of {task_names()} or a "
                                     f"pair file ({' and '.join(MANY_TASKS)} take all).")
                refuse_pair_file_flags(args, task)
            else:
                args.task = ",".join(resolve_task(args, t) for t in listed)
        except (ValueError, FileNotFoundError, RuntimeError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    try:  # a store MLflow cannot use, a cache it cannot write, a device not here: one line before anything runs
        if getattr(args, "tracking_uri", None) is not None:
            args.tracking_uri = checked_tracking_uri(args.tracking_uri)
        if getattr(args, "cache_dir", None) is not None:
            writable_dir(Path(args.cache_dir).absolute(), "--cache-dir")
        check_device(getattr(args, "device", None), "--device")  # a cache hit never loads the encoder
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if hasattr(args, "out") and args.out is None:
        split = f"_{args.eval_split}" if args.command == "evaluate" else ""
        args.out = f"results/{args.command}_{args.task.replace(',', '_')}{split}.md"
    try:
        return args.func(args)
    except KeyboardInterrupt:  # one line, not a traceback; an MLflow run it had open ended KILLED (tracked_run)
        print(f"interrupted (Ctrl-C): {args.command} stopped; nothing more was written or registered.", file=sys.stderr)
        return 130
    except (ValueError, TypeError, FileNotFoundError, KeyError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except MlflowException as exc:  # a model or version the registry does not have, a store that refused a write
        missing = exc.error_code == "RESOURCE_DOES_NOT_EXIST" or "not found" in exc.message.lower()
        hint = (" List a model's versions and aliases with `python -m embed_lib registry --name <model>` (and the "
                "same --tracking-uri)." if missing else "")
        print(f"error: MLflow: {exc.message.rstrip('.')}.{hint}", file=sys.stderr)
        return 2
