"""Command line: `python -m embed_lib <command>`.

    baseline     frozen cosine baseline of one task or all, every split, as a table + results file
    train        one adapter configuration on a seed group: per-seed table, logged to MLflow
    study        the reference comparison (every form and control) on one task or all -> results/study_<task>.{md,json}
    retrieval    re-ranking check on a duplicate-question retrieval set -> results/retrieval_<task>.{md,json}
    diagnostics  headroom of each difficulty signal and the length-collapse table
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path
from typing import Sequence

from embed_lib.cache import EmbeddedTask, EmbeddingCache
from embed_lib.config import EncoderConfig, default_cache_dir
from embed_lib.study import LazyEncoder, default_transfer, embed_splits
from embed_lib.metrics import cosine, evaluate
from embed_lib.tasks import SPLITS, distinct_texts, load_splits, task_names


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", default="stsb", help=f"one of {task_names()} or 'all' (default: stsb)")
    p.add_argument("--encoder", default="minilm",
                   help="sentence-transformers id, local path, or alias 'minilm' (default: minilm, offline)")
    p.add_argument("--revision", default=None, help="Hub revision of the encoder")
    p.add_argument("--tau-attn", type=float, default=1.0, help="attention temperature (TempScale), default 1.0")
    p.add_argument("--max-seq-length", type=int, default=None, help="truncation length (default: the model's)")
    p.add_argument("--encode-batch-size", type=int, default=64, help="encoding batch size (default: 64)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: best available)")
    p.add_argument("--data-dir", default=None,
                   help="local mirror of the datasets (default: $EMBED_DATA_DIR; unset: the Hugging Face Hub)")
    p.add_argument("--cache-dir", default=None, help="embedding cache (default: $EMBED_CACHE_DIR or ./.cache/embed_lib)")


def encoder_config(args: argparse.Namespace) -> EncoderConfig:
    return EncoderConfig(model=args.encoder, revision=args.revision, tau_attn=args.tau_attn,
                         max_seq_length=args.max_seq_length, batch_size=args.encode_batch_size, device=args.device)


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
        emb, cache = embed_splits(load_splits(task, SPLITS, args.data_dir), lazy, args.cache_dir)
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


def field_docs(cls) -> dict[str, str]:
    """Field name -> its `#:` comment in the dataclass source (one source for docs and --help)."""
    import inspect
    import re

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


def _add_teacher(p: argparse.ArgumentParser, default_preset: str = "strong") -> None:
    """The teacher flags, shared by every command and by the sweeps."""
    from embed_lib.teacher import PRESETS

    p.add_argument("--teacher", default="minilm",
                   help="teacher backbone, independent of --encoder: weights to fine-tune with K-fold cross-fitting "
                        "(sentence-transformers / transformers id or local directory, alias 'minilm'), or a "
                        "pretrained cross-encoder with --teacher-pretrained (default: minilm)")
    p.add_argument("--teacher-pretrained", action="store_true", help="--teacher is already a cross-encoder")
    p.add_argument("--teacher-preset", default=default_preset,
                   help="teacher recipe, one of " + "; ".join(f"{k}: {v}" for k, v in PRESETS.items())
                        + f" (default {default_preset}); per task: 'stsb=strong,qqp=light' (unlisted tasks: "
                        f"{default_preset})")
    p.add_argument("--teacher-folds", type=int, default=None, help="cross-fitting folds (overrides the preset)")
    p.add_argument("--teacher-epochs", type=int, default=None, help="most epochs per fold (overrides the preset)")
    p.add_argument("--teacher-lr", type=float, default=None, help="peak learning rate (default 5e-5)")
    p.add_argument("--teacher-max-length", type=int, default=None, help="tokens per pair (default 128)")
    p.add_argument("--no-teacher", action="store_true", help="skip the teacher (no ce_margin target)")
    p.set_defaults(teacher_preset_default=default_preset)  # for tasks a per-task --teacher-preset leaves out


def preset_for(value: str, task: str, default: str = "strong") -> str:
    """--teacher-preset value -> the preset of `task` ('light', or 'stsb=strong,qqp=light')."""
    from embed_lib.teacher import PRESETS

    if "=" not in value:
        name = value
    else:
        pairs = dict(item.split("=", 1) for item in value.split(",") if item.strip())
        name = pairs.get(task, default)
    if name not in PRESETS:
        raise ValueError(f"--teacher-preset {value!r}: unknown preset {name!r}. Valid presets: {sorted(PRESETS)}.")
    return name


def teacher_config(args: argparse.Namespace, task: str | None = None):
    from embed_lib.teacher import teacher_preset

    if args.no_teacher:
        return None
    overrides = {k: v for k, v in (("folds", args.teacher_folds), ("epochs", args.teacher_epochs),
                                   ("lr", args.teacher_lr), ("max_length", args.teacher_max_length))
                 if v is not None}
    preset = preset_for(args.teacher_preset, task or getattr(args, "task", ""),
                        getattr(args, "teacher_preset_default", "strong"))
    return teacher_preset(preset, model=args.teacher, pretrained=args.teacher_pretrained, **overrides)


def teacher_progress(task: str):
    """A progress printer for the teacher's folds and epochs (stderr, one line per step)."""
    return lambda msg: print(f"[{task}] {msg}", file=sys.stderr, flush=True)


def _add_adapter(p: argparse.ArgumentParser) -> None:
    from embed_lib.config import AdapterConfig

    d = AdapterConfig()
    docs = field_docs(AdapterConfig)
    for f in dataclasses.fields(AdapterConfig):
        if f.name in ("task", "n_seeds"):
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool",) or isinstance(f.default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=docs.get(f.name))
        else:
            p.add_argument(flag, type=type(f.default), default=f.default,
                           help=f"{docs.get(f.name, '')} (default {f.default!r})")
    p.add_argument("--seeds", type=int, default=d.n_seeds, help=f"seeds in the group (default {d.n_seeds})")


def adapter_config(args: argparse.Namespace, task: str):
    from embed_lib.config import AdapterConfig

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(AdapterConfig)
              if f.name not in ("task", "n_seeds")}
    return AdapterConfig(task=task, n_seeds=args.seeds, **values)


def _add_mlflow(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tracking-uri", default=None,
                   help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or sqlite:///<cwd>/mlflow.db)")
    p.add_argument("--experiment", default=None, help="MLflow experiment (default: embed_lib-<task>)")
    p.add_argument("--no-mlflow", action="store_true", help="do not log to MLflow")


def _needs_teacher(cfg) -> bool:
    return cfg.target == "ce_margin"


def cmd_train(args: argparse.Namespace) -> int:
    from embed_lib.study import load_study
    from embed_lib.train import train_seed_group

    cfg = adapter_config(args, args.task)
    teacher = teacher_config(args)
    if _needs_teacher(cfg) and teacher is None:
        raise ValueError("--target ce_margin needs the teacher; drop --no-teacher.")
    data, record = load_study(args.task, encoder_config(args), teacher if _needs_teacher(cfg) else None,
                              data_dir=args.data_dir, cache_dir=args.cache_dir, limit=args.limit,
                              transfer=default_transfer(args.task) if args.transfer else (),
                              progress=teacher_progress(args.task))
    result = train_seed_group(cfg, data)
    print(result.table())
    s = result.summary
    print(f"\nvalidation delta {s['delta_val_mean']:+.4f} ± {s['delta_val_std']:.4f} (min {s['delta_val_min']:+.4f}, "
          f"{s['delta_val_positive']}/{cfg.n_seeds} positive); test delta {s['delta_test_mean']:+.4f} ± "
          f"{s['delta_test_std']:.4f} ({s['delta_test_positive']}/{cfg.n_seeds} positive); "
          f"{result.n_parameters} parameters per seed; {result.seconds:.1f}s")
    if "train/gate_fit_mean" in s:
        print(f"gate fit to its target (Pearson): train {s['train/gate_fit_mean']:.3f}, "
              f"test {s['test/gate_fit_mean']:.3f}")
    if "transfer_delta_min" in s:
        print("transfer (other tasks' validation, pairs unseen in training): " + ", ".join(
            f"{k.split('/')[1]} {s[k]:+.4f}" for k in s if k.startswith("transfer/") and k.endswith("_mean"))
              + f"; worst seed {s['transfer_delta_min']:+.4f}")
    if record is not None:
        print(teacher_summary(record))
    if not args.no_mlflow:
        import mlflow

        from embed_lib.tracking import default_tracking_uri, log_group, set_experiment

        set_experiment(args.experiment or f"embed_lib-{args.task}", args.tracking_uri or default_tracking_uri())
        with mlflow.start_run(run_name=f"{cfg.adapter}-{cfg.control}-{cfg.target}") as run:
            log_group(result, data, record)
        print(f"MLflow run {run.info.run_id} at {mlflow.get_tracking_uri()}")
    return 0


def teacher_summary(record: dict) -> str:
    """One line: the teacher's recipe, quality against the frozen cosine, independence and cost."""
    q = record.get("quality", {})
    parts = [f"teacher {record['config']['model']} ({record.get('preset', 'custom')} recipe, "
             f"{record['config']['folds']} folds x <= {record['config']['epochs']} epochs): "]
    for split in ("validation", "test"):
        if split in q:
            parts.append(f"{split} Spearman {q[split]['teacher_spearman']:.4f} vs cosine "
                         f"{q[split]['cosine_spearman']:.4f}, error correlation {q[split]['error_correlation']:.3f}, "
                         f"rank average {q[split]['rank_average_spearman']:.4f}; ")
    return "".join(parts) + f"{record['seconds']:.0f}s once per task"


def cmd_study(args: argparse.Namespace) -> int:
    from embed_lib.study import STANDARD_ARMS, default_transfer, load_study, run_study, study_json, study_markdown

    tasks = task_names() if args.task == "all" else args.task.split(",")
    sections, summary = [], {}
    for task in tasks:
        print(f"[{task}]", file=sys.stderr)
        data, record = load_study(task, encoder_config(args), teacher_config(args, task), data_dir=args.data_dir,
                                  cache_dir=args.cache_dir, limit=args.limit,
                                  transfer=default_transfer(task) if args.transfer else (),
                                  progress=teacher_progress(task))
        if record is not None:
            print(teacher_summary(record), file=sys.stderr)
        gammas = [float(g) for g in args.gamma_grid.split(",")]
        arms = [(label, o) for label, o in STANDARD_ARMS if args.arms == "all" or o["adapter"].startswith(args.arms)]
        results = run_study(data, adapter_config(args, task), arms=arms, gammas=gammas,
                            log=lambda m: print(m, file=sys.stderr))
        sections.append(study_markdown(task, data, results, record))
        summary[task] = study_json(data, results, record)
    text = "".join(s + "\n" for s in sections)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python -m embed_lib", *sys.argv[1:]]) if sys.argv[1:2] == ["study"] else \
        f"python -m embed_lib study --task {args.task} --seeds {args.seeds} --out {args.out}"
    out.write_text(f"# Study results ({args.seeds} seeds per arm)\n\nRegenerate: `{command}`\n\n"
                   "Each arm that has a gamma is shown at its own best gamma on validation from the grid "
                   f"{args.gamma_grid}. Transfer: the worst per-seed Spearman delta on the other tasks' "
                   "validation pairs that share no sentence with this task's train split.\n\n" + text)
    out.with_suffix(".json").write_text(json.dumps({"seeds": args.seeds, "gamma_grid": args.gamma_grid,
                                                    "command": command, "tasks": summary}, indent=2))
    print(f"wrote {out} and {out.with_suffix('.json')}", file=sys.stderr)
    return 0


def _retrieval_models(args, data):
    """[(label, PairAdapter)] to re-rank with: the registered model (--model-uri) or a group trained here."""
    from embed_lib.adapters import PairAdapter

    if args.train:
        from embed_lib.train import novelty_gate, train_seed_group

        cfg = adapter_config(args, args.task)
        result = train_seed_group(cfg, data)
        gate = novelty_gate(data, cfg.novelty_quantile) if cfg.novelty_quantile > 0 else None
        model = PairAdapter.from_config(cfg, int(data.X.shape[1]), novelty=gate)
        model.load_state_dict(result.state_dict)
        return f"{cfg.adapter} trained on {args.task} train ({cfg.n_seeds} seeds)", model.eval()
    from embed_lib.cache import manifest_mismatch
    from embed_lib.registry import load_registered
    from embed_lib.tracking import default_tracking_uri

    model, config, manifest = load_registered(args.model_uri, args.tracking_uri or default_tracking_uri())
    diff = manifest_mismatch(manifest, data.manifest)
    if diff:
        raise ValueError(f"{args.model_uri} was trained on other encoder vectors (field: (model, here) = {diff}); "
                         "pass the matching --encoder / --tau-attn.")
    return f"{args.model_uri} ({config.adapter}, trained on {config.task})", model.eval()


def cmd_retrieval(args: argparse.Namespace) -> int:
    import numpy as np

    from embed_lib import retrieval as R
    from embed_lib.study import load_study

    t0 = time.perf_counter()
    teacher = teacher_config(args) if args.train and args.target == "ce_margin" else None
    data, _ = load_study(args.task, encoder_config(args), teacher, data_dir=args.data_dir, cache_dir=args.cache_dir,
                         progress=teacher_progress(args.task))
    split = load_splits(args.task, (args.split,), args.data_dir)[args.split]
    rs, V = R.embed_retrieval_set(split, LazyEncoder(encoder_config(args)), args.cache_dir)
    label, model = _retrieval_models(args, data)
    top = R.cosine_top_k(V, rs.queries, args.top_k)
    base = R.ranking_metrics(top, rs.relevant)
    q, k = top.shape
    scores = R.seed_scores(model, V, rs.queries, top)  # (S, q, k)
    per_seed = [R.ranking_metrics(R.order_by(top, s), rs.relevant) for s in scores]
    ens = R.ranking_metrics(R.order_by(top, scores.mean(0)), rs.relevant)
    diffs = {m: np.array([p[m] - base[m] for p in per_seed]) for m in base}
    result = {"task": args.task, "split": args.split, "split_note": split.split_note, "model": label,
              "queries": int(q), "corpus": len(rs.texts), "top_k": int(k), "frozen_cosine": base,
              "reranked_per_seed": per_seed, "reranked_ensemble": ens,
              "delta": {m: {"mean": float(d.mean()), "std": float(d.std(ddof=1)) if len(d) > 1 else 0.0,
                            "min": float(d.min()), "positive": int((d > 0).sum()), "n_seeds": len(d)}
                        for m, d in diffs.items()},
              "seconds": round(time.perf_counter() - t0, 1)}
    lines = [f"# Re-ranking check: {args.task} {args.split} (BEIR-Quora style)", "",
             f"Model: {label}. {q} queries (first questions of the split's duplicate pairs), corpus {len(rs.texts)} "
             f"distinct questions of the split ({split.split_note}); frozen cosine top-{k}, re-ranked by each seed.",
             "", "| metric | frozen cosine | re-ranked (mean over seeds) | delta mean ± std | min | seeds > 0 | "
             "served ensemble |", "|---|---|---|---|---|---|---|"]
    for m, d in diffs.items():
        lines.append(f"| {m} | {base[m]:.4f} | {np.mean([p[m] for p in per_seed]):.4f} | {d.mean():+.4f} ± "
                     f"{result['delta'][m]['std']:.4f} | {d.min():+.4f} | {int((d > 0).sum())}/{len(d)} | {ens[m]:.4f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out} and {out.with_suffix('.json')} in {result['seconds']:.0f}s", file=sys.stderr)
    return 0


def cmd_diagnostics(args: argparse.Namespace) -> int:
    import numpy as np

    from embed_lib.diagnostics import length_collapse
    from embed_lib.study import load_study, headroom_of

    data, record = load_study(args.task, encoder_config(args), teacher_config(args), data_dir=args.data_dir,
                              cache_dir=args.cache_dir, limit=args.limit)
    print(f"Headroom on {args.task} train: correlation of each signal with |calibrated s0 - y|")
    for name, v in headroom_of(data).items():
        print(f"  {name:10s} Pearson {v['pearson']:+.3f}  Spearman {v['spearman']:+.3f}")
    # length collapse: the task's sentences under tau_attn = 1 and the tau_attn asked for
    root = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    splits = load_splits(args.task, SPLITS, args.data_dir)
    texts = distinct_texts(splits)
    rng = np.random.default_rng(0)
    texts = [texts[i] for i in sorted(rng.choice(len(texts), min(len(texts), args.collapse_sample), replace=False))]
    vectors = {}
    for tau in sorted({1.0, args.collapse_tau}, reverse=True):
        lazy = LazyEncoder(dataclasses.replace(encoder_config(args), tau_attn=tau))
        vectors[f"tau_attn={tau}"] = EmbeddingCache(lazy.manifest(root), root).get(texts, lazy)
    rows = length_collapse(texts, vectors)
    print("\nLength collapse: mean cosine of random sentence pairs within a length bucket (word tokens)")
    keys = list(vectors)
    print("| bucket | sentences | " + " | ".join(keys) + " |\n|---|---|" + "---|" * len(keys))
    for r in rows:
        print(f"| {r['bucket']} | {r['n_sentences']} | " + " | ".join(f"{r[k]:.4f}" for k in keys) + " |")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m embed_lib", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("baseline", help="frozen cosine baseline on every split")
    _add_common(p)
    p.add_argument("--out", default=None, help="results file (default: results/baseline_<task>.md)")
    p.set_defaults(func=cmd_baseline)

    p = sub.add_parser("train", help="one adapter configuration on a seed group")
    _add_common(p)
    _add_adapter(p)
    _add_teacher(p)
    _add_mlflow(p)
    p.add_argument("--transfer", action=argparse.BooleanOptionalAction, default=True,
                   help="score the group on the other tasks' validation pairs (do-no-harm check; default on)")
    p.add_argument("--limit", type=int, default=None, help="first N pairs of every split (smoke tests)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("study", help="every form and control of the reference study -> markdown + JSON")
    _add_common(p)
    _add_adapter(p)
    _add_teacher(p)
    p.add_argument("--arms", choices=["all", "pair", "per_sentence"], default="all",
                   help="the standard arms to run: all (default), or only the pair / per-sentence forms")
    p.add_argument("--gamma-grid", default="0.05,0.1,0.2",
                   help="gammas every arm with a gamma is trained at; each arm keeps its best on validation")
    p.add_argument("--transfer", action=argparse.BooleanOptionalAction, default=True,
                   help="score every arm on the other tasks' validation pairs (default on)")
    p.add_argument("--limit", type=int, default=None, help="first N pairs of every split (smoke tests)")
    p.add_argument("--out", default=None, help="results file (default: results/study_<task>.md)")
    p.set_defaults(func=cmd_study)

    p = sub.add_parser("retrieval", help="re-ranking check on a BEIR-Quora-style retrieval set (nDCG@10, MRR@10, "
                                         "Recall@100) -> results/retrieval_<task>.{md,json}")
    _add_common(p)
    _add_adapter(p)
    _add_teacher(p)
    p.add_argument("--model-uri", default="models:/pair-residual-stsb@champion",
                   help="registered adapter to re-rank with (default: the STS-B champion of `make run`)")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI)")
    p.add_argument("--train", action="store_true",
                   help="instead of --model-uri, train the adapter given by the adapter flags on the task's train split")
    p.add_argument("--split", default="test", help="the split the retrieval set is built from (default test)")
    p.add_argument("--top-k", type=int, default=100, help="frozen-cosine candidates re-ranked (default 100)")
    p.add_argument("--out", default=None, help="results file (default: results/retrieval_<task>.md)")
    p.set_defaults(func=cmd_retrieval)

    p = sub.add_parser("diagnostics", help="headroom of each difficulty signal; length collapse")
    _add_common(p)
    _add_teacher(p)
    p.add_argument("--limit", type=int, default=None, help="first N pairs of every split")
    p.add_argument("--collapse-tau", type=float, default=0.5, help="tau_attn compared with 1.0 (default 0.5)")
    p.add_argument("--collapse-sample", type=int, default=3000, help="sentences sampled for the collapse table")
    p.set_defaults(func=cmd_diagnostics)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    task = getattr(args, "task", None)
    listed = task.split(",") if args.command == "study" and task else [task]
    if task != "all" and any(t not in (*task_names(), None) for t in listed):
        parser.error(f"--task {task!r} is unknown. Valid tasks: {task_names()} or 'all'"
                     + (" (study: a comma list)." if args.command == "study" else "."))
    if hasattr(args, "out") and args.out is None:
        args.out = f"results/{args.command}_{args.task.replace(',', '_')}.md"
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError, KeyError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
