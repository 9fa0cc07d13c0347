"""Command line: `python -m embed_lib <command>`.

    baseline   frozen cosine baseline of one task or all, every split, as a table + results file
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Sequence

from embed_lib.cache import EmbeddingCache, EmbeddedTask, embed_task
from embed_lib.config import EncoderConfig, default_cache_dir
from embed_lib.metrics import cosine, evaluate
from embed_lib.tasks import SPLITS, load_splits, task_names


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", default="stsb", help=f"one of {task_names()} or 'all' (default: stsb)")
    p.add_argument("--encoder", default="minilm",
                   help="sentence-transformers id, local path, or alias 'minilm' (default: minilm, offline)")
    p.add_argument("--revision", default=None, help="Hub revision of the encoder")
    p.add_argument("--tau-attn", type=float, default=1.0, help="attention temperature (TempScale), default 1.0")
    p.add_argument("--max-seq-length", type=int, default=None, help="truncation length (default: the model's)")
    p.add_argument("--batch-size", type=int, default=64, help="encoding batch size (default: 64)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: best available)")
    p.add_argument("--data-dir", default=None,
                   help="local mirror of the datasets (default: $EMBED_DATA_DIR; unset: the Hugging Face Hub)")
    p.add_argument("--cache-dir", default=None, help="embedding cache (default: $EMBED_CACHE_DIR or ./.cache/embed_lib)")


def encoder_config(args: argparse.Namespace) -> EncoderConfig:
    return EncoderConfig(model=args.encoder, revision=args.revision, tau_attn=args.tau_attn,
                         max_seq_length=args.max_seq_length, batch_size=args.batch_size, device=args.device)


class LazyEncoder:
    """Loads the model only when a sentence is missing from the cache, or when its manifest is needed."""

    def __init__(self, config: EncoderConfig) -> None:
        self.config = config
        self._encoder = None

    def __call__(self):
        if self._encoder is None:
            from embed_lib.encoders import FrozenEncoder

            self._encoder = FrozenEncoder(self.config)
        return self._encoder


    def manifest(self, memo_dir: str | Path | None) -> dict:
        from embed_lib.encoders import encoder_manifest

        return encoder_manifest(self.config, memo_dir, loader=self)


def load_embedded(task: str, args: argparse.Namespace, lazy: LazyEncoder) -> tuple[EmbeddedTask, EmbeddingCache]:
    splits = load_splits(task, SPLITS, args.data_dir)
    root = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    cache = EmbeddingCache(lazy.manifest(root), root)
    return embed_task(splits, cache, lazy), cache


def baseline_rows(emb: EmbeddedTask) -> list[dict]:
    """Frozen cosine on every split; binary tasks also score test at the validation-chosen threshold."""
    rows, thr = [], None
    for split in SPLITS:
        a, b, y = emb.pair_vectors(split)
        data = emb.splits[split].data
        m = evaluate(cosine(a, b), y, data.binary, threshold=thr if split == "test" else None)
        if split == "validation" and data.binary:
            thr = m["threshold_acc"]
        rows.append({"task": emb.task, "split": split, "n": len(data), "split_note": data.split_note,
                     "source": data.source, **m})
    return rows


def format_table(rows: list[dict]) -> str:
    cols = ["task", "split", "n", "spearman", "pearson", "roc_auc", "average_precision", "accuracy", "f1",
            "accuracy_at_threshold"]
    head = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
    body = ""
    for r in rows:
        cells = [f"{r[c]:.4f}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols]
        body += "| " + " | ".join(cells) + " |\n"
    return head + body


def cmd_baseline(args: argparse.Namespace) -> int:
    tasks = task_names() if args.task == "all" else [args.task]
    lazy = LazyEncoder(encoder_config(args))
    rows, t0 = [], time.perf_counter()
    for task in tasks:
        emb, cache = load_embedded(task, args, lazy)
        rows.extend(baseline_rows(emb))
        print(f"[{task}] {len(emb.texts)} distinct sentences, cache {cache.key}: "
              f"{cache.stats.hits} hits, {cache.stats.misses} encoded", file=sys.stderr)
    table = format_table(rows)
    notes = sorted({f"- {r['task']} {r['split']}: {r['split_note']}" for r in rows})
    manifest = cache.manifest
    text = (f"# Frozen cosine baseline\n\nEncoder `{manifest['encoder']}` (weights {manifest['weights_fingerprint']}, "
            f"pooling {manifest['pooling']}, tau_attn {manifest['tau_attn']}, max_seq_length "
            f"{manifest['max_seq_length']}). Binary tasks: accuracy/F1 at the best threshold of the split itself; "
            "`accuracy_at_threshold` on test uses the threshold chosen on validation.\n\n"
            f"{table}\nSplits:\n" + "\n".join(notes) + "\n")
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"encoder": manifest, "rows": rows}, indent=2))
    print(f"wrote {out} and {out.with_suffix('.json')} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m embed_lib", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("baseline", help="frozen cosine baseline on every split")
    _add_common(p)
    p.add_argument("--out", default=None, help="results file (default: results/baseline_<task>.md)")
    p.set_defaults(func=cmd_baseline)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "task", None) not in (*task_names(), "all", None):
        parser.error(f"--task {args.task!r} is unknown. Valid tasks: {task_names()} or 'all'.")
    if hasattr(args, "out") and args.out is None:
        args.out = f"results/baseline_{args.task}.md"
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
