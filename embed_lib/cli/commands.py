"""The commands of `python -m embed_lib` (the parser is in embed_lib.cli, the shared flags in embed_lib.cli.args)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import mlflow
import numpy as np

from embed_lib.cli.args import (adapter_config, encoder_config, silver_pairs, teacher_config, teacher_progress,
                                teacher_summary)
from embed_lib.cli.values import gamma_grid
from embed_lib.config import default_cache_dir
from embed_lib.data.tasks import SPLITS, distinct_texts, load_splits, task_names
from embed_lib.encoding.cache import EmbeddedTask, EmbeddingCache, manifest_mismatch
from embed_lib.pipeline.prepare import LazyEncoder, default_transfer, embed_retrieval_set, embed_splits, load_study
from embed_lib.report.files import machine, write_report
from embed_lib.report.study import ARM_SETS, headroom_of, run_study, study_json, study_markdown
from embed_lib.teacher.cross_encoder import served_teacher
from embed_lib.tracking.cross_encoder_registry import log_cross_encoder
from embed_lib.tracking.registry import load_registered
from embed_lib.tracking.runs import (default_tracking_uri, log_group, log_task_inputs, require_store, set_experiment,
                                     tracked_run, ui_link)
from embed_lib.training import retrieval as R
from embed_lib.training.adapters import PairAdapter
from embed_lib.training.diagnostics import length_collapse
from embed_lib.training.metrics import cosine, evaluate
from embed_lib.training.seed_group import train_seed_group
from embed_lib.training.tensors import novelty_gate


def baseline_rows(emb: EmbeddedTask) -> list[dict]:
    """Frozen cosine on every split the task has (a pair file may have only test); binary tasks also score test at
    the validation-chosen threshold when there is a validation split."""
    rows, thr = [], None
    for split in [s for s in SPLITS if s in emb.splits]:
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
    write_report(args.out, text, {"encoder": manifest, "rows": rows}, time.perf_counter() - t0)
    return 0


def _needs_teacher(cfg) -> bool:
    return cfg.target == "ce_margin" or cfg.distilled


def cmd_train(args: argparse.Namespace) -> int:
    cfg = adapter_config(args, args.task)
    teacher = teacher_config(args)
    if _needs_teacher(cfg) and teacher is None:
        raise ValueError(f"{'--lambda-distil' if cfg.distilled else '--target ce_margin'} needs the teacher; drop "
                         "--no-teacher.")
    silver = silver_pairs(args, wanted=cfg.silver_fraction > 0)
    if cfg.silver_fraction > 0 and silver is None:
        raise ValueError(f"--silver-fraction {cfg.silver_fraction} trains on silver pairs, and --no-silver builds "
                         "none: drop one of the two.")
    data, record = load_study(args.task, encoder_config(args), teacher if _needs_teacher(cfg) else None,
                              data_dir=args.data_dir, cache_dir=args.cache_dir, limit=args.limit,
                              transfer=default_transfer(args.task) if args.transfer else (),
                              progress=teacher_progress(args.task), silver=silver)
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
        print("transfer (other tasks' validation: pairs unseen in training; <task>-all: every pair): " + ", ".join(
            f"{k.split('/')[1]} {s[k]:+.4f}" for k in s if k.startswith("transfer/") and k.endswith("_mean"))
              + f"; worst seed {s['transfer_delta_min']:+.4f}")
    if record is not None:
        print(teacher_summary(record))
    if not args.no_mlflow:
        set_experiment(args.experiment or f"embed_lib-{args.task}", args.tracking_uri or default_tracking_uri())
        with tracked_run(run_name=f"{cfg.adapter}-{cfg.control}-{cfg.target}") as run:
            log_group(result, data, record)
            log_task_inputs(args.task, args.data_dir)
        print(f"MLflow run {run.info.run_id} at {mlflow.get_tracking_uri()}; UI (make mlflow-ui): "
              f"{ui_link(run.info.experiment_id, run.info.run_id)}")
    return 0


def cmd_study(args: argparse.Namespace) -> int:
    tasks = task_names() if args.task == "all" else args.task.split(",")
    gammas = gamma_grid(args.gamma_grid)
    for task in tasks:  # every flag made into its config before the first task is encoded or its teacher trained
        adapter_config(args, task), teacher_config(args, task)
    sections, summary = [], {}
    silver = silver_pairs(args, wanted=any(o.get("silver_fraction", 0) > 0 for _, o in ARM_SETS[args.arms]))
    for task in tasks:
        print(f"[{task}]", file=sys.stderr)
        data, record = load_study(task, encoder_config(args), teacher_config(args, task), data_dir=args.data_dir,
                                  cache_dir=args.cache_dir, limit=args.limit,
                                  transfer=default_transfer(task) if args.transfer else (),
                                  progress=teacher_progress(task), silver=silver)
        if record is not None:
            print(teacher_summary(record), file=sys.stderr)
        arms = ARM_SETS[args.arms]
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
                   "validation pairs that share no sentence with this task's train split, and on the whole split "
                   "where some do (<task>-all; for QQP also the nDCG@10 delta of re-ranking its duplicates' frozen "
                   "top 20).\n\n" + text)
    out.with_suffix(".json").write_text(json.dumps({"seeds": args.seeds, "gamma_grid": args.gamma_grid,
                                                    "command": command, "tasks": summary, "machine": machine()},
                                                   indent=2))
    print(f"wrote {out} and {out.with_suffix('.json')}", file=sys.stderr)
    return 0


def _retrieval_models(args, data, cfg, registered):
    """[(label, PairAdapter)] to re-rank with: the registered model (--model-uri) or a group trained here."""
    if args.train:
        result = train_seed_group(cfg, data)
        gate = novelty_gate(data, cfg.novelty_quantile) if cfg.novelty_quantile > 0 else None
        model = PairAdapter.from_config(cfg, int(data.X.shape[1]), novelty=gate)
        model.load_state_dict(result.state_dict)
        return f"{cfg.adapter} trained on {args.task} train ({cfg.n_seeds} seeds)", model.eval()

    model, config, manifest = registered
    diff = manifest_mismatch(manifest, data.manifest)
    if diff:
        raise ValueError(f"{args.model_uri} was trained on other encoder vectors (field: (model, here) = {diff}); "
                         "pass the matching --encoder / --tau-attn.")
    return f"{args.model_uri} ({config.adapter}, trained on {config.task})", model.eval()


def cmd_retrieval(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    # the adapter's flags, or the registered model, before anything is encoded
    cfg = adapter_config(args, args.task) if args.train else None
    registered = None if args.train else load_registered(args.model_uri,
                                                         require_store(args.tracking_uri or default_tracking_uri()))
    teacher = teacher_config(args) if args.train and args.target == "ce_margin" else None
    data, _ = load_study(args.task, encoder_config(args), teacher, data_dir=args.data_dir, cache_dir=args.cache_dir,
                         progress=teacher_progress(args.task))
    split = load_splits(args.task, (args.retrieval_split,), args.data_dir)[args.retrieval_split]
    rs, V = embed_retrieval_set(split, LazyEncoder(encoder_config(args)), args.cache_dir)
    label, model = _retrieval_models(args, data, cfg, registered)
    top = R.cosine_top_k(V, rs.queries, args.top_k)
    base = R.ranking_metrics(top, rs.relevant)
    q, k = top.shape
    scores = R.seed_scores(model, V, rs.queries, top)  # (S, q, k)
    per_seed = [R.ranking_metrics(R.order_by(top, s), rs.relevant) for s in scores]
    ens = R.ranking_metrics(R.order_by(top, scores.mean(0)), rs.relevant)
    diffs = {m: np.array([p[m] - base[m] for p in per_seed]) for m in base}
    result = {"task": args.task, "split": args.retrieval_split, "split_note": split.split_note, "model": label,
              "queries": int(q), "corpus": len(rs.texts), "top_k": int(k), "frozen_cosine": base,
              "reranked_per_seed": per_seed, "reranked_ensemble": ens,
              "delta": {m: {"mean": float(d.mean()), "std": float(d.std(ddof=1)) if len(d) > 1 else 0.0,
                            "min": float(d.min()), "positive": int((d > 0).sum()), "n_seeds": len(d)}
                        for m, d in diffs.items()},
              "seconds": round(time.perf_counter() - t0, 1)}
    lines = [f"# Re-ranking check: {args.task} {args.retrieval_split} (BEIR-Quora style)", "",
             f"Model: {label}. {q} queries (first questions of the split's duplicate pairs), corpus {len(rs.texts)} "
             f"distinct questions of the split ({split.split_note}); frozen cosine top-{k}, re-ranked by each seed.",
             "", "| metric | frozen cosine | re-ranked (mean over seeds) | delta mean ± std | min | seeds > 0 | "
             "served ensemble |", "|---|---|---|---|---|---|---|"]
    for m, d in diffs.items():
        lines.append(f"| {m} | {base[m]:.4f} | {np.mean([p[m] for p in per_seed]):.4f} | {d.mean():+.4f} ± "
                     f"{result['delta'][m]['std']:.4f} | {d.min():+.4f} | {int((d > 0).sum())}/{len(d)} | {ens[m]:.4f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    write_report(args.out, text, result, result["seconds"])
    return 0


def cmd_diagnostics(args: argparse.Namespace) -> int:
    dataclasses.replace(encoder_config(args), tau_attn=args.collapse_tau)  # --collapse-tau checked before the teacher
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


def cmd_teacher(args: argparse.Namespace) -> int:
    """The K-fold teacher's record, the served teacher (one model on all of train) and its registration."""
    teacher = teacher_config(args)
    if teacher is None:
        raise ValueError("The teacher command needs a teacher; drop --no-teacher.")
    data, record = load_study(args.task, encoder_config(args), teacher, data_dir=args.data_dir,
                              cache_dir=args.cache_dir, progress=teacher_progress(args.task))
    print(teacher_summary(record))
    splits = load_splits(args.task, SPLITS, args.data_dir)
    folder, served = served_teacher(splits, teacher, {k: data.splits[k].s0 for k in SPLITS},
                                    args.cache_dir, progress=teacher_progress(args.task))
    print(f"served teacher ({served['recipe']}): test Spearman {served['test_spearman']:.4f} (cosine "
          f"{served['test_cosine_spearman']:.4f}), validation {served['validation_spearman']:.4f}; error correlation "
          f"with the cosine on test {served['test_error_correlation']:.3f}; trained in {served['fit_seconds']:.0f}s, "
          f"scores {served['predict_pairs_per_s']:.0f} pairs/s; saved at {folder}")
    if args.no_mlflow:
        return 0

    set_experiment(args.experiment or f"embed_lib-{args.task}", args.tracking_uri or default_tracking_uri())
    with tracked_run(run_name=f"teacher-{args.task}"):
        mlflow.log_dict(record, "teacher_kfold.json")
        mlflow.log_metrics({f"served/{k}": served[k] for k in ("validation_spearman", "test_spearman",
                                                               "test_error_correlation", "fit_seconds")})
        version = log_cross_encoder(folder, served, args.task)
    print(f"registered {version.name} version {version.version}: models:/{version.name}/{version.version}")
    return 0
