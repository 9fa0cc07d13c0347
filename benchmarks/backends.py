"""Inference backends side by side: torch, ONNX Runtime fp32, ONNX Runtime int8, for both encoders.

In one run, on the same texts and threads: (a) the frozen encoder (all-MiniLM-L6-v2) on STS-B test's
distinct sentences: sentences/s and the frozen cosine's Spearman on STS-B test per backend; (b) the
cross-encoder (the served STS-B teacher of `make teacher`, fast recipe, or of `python -m embed_lib teacher
--task stsb --teacher-preset light`, else a MiniLM cross-encoder with an untrained head, quality then not
meaningful) on STS-B test's pairs: pairs/s and Spearman. Each backend is timed `--repeats` times, interleaved,
median kept.

    python benchmarks/backends.py [--repeats 3] [--threads 2]

-> results/benchmarks/backends.json. Targets: int8 >= 2x torch for both, Spearman within 0.003 of torch.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from benchmarks._common import write_results
from embed_lib.config import EncoderConfig
from embed_lib.data.tasks import SPLITS, load_splits, load_task
from embed_lib.encoding.encoders import FrozenEncoder
from embed_lib.teacher.config import teacher_preset
from embed_lib.teacher.cross_encoder import PairCrossEncoder, served_dir
from embed_lib.training.metrics import spearman

BACKENDS = ("torch", "onnx", "onnx-int8")


def _timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def _encoders(test, repeats: int) -> dict:
    texts = list(dict.fromkeys(list(test.sentence1) + list(test.sentence2)))
    at = {t: i for i, t in enumerate(texts)}
    ia, ib = [at[t] for t in test.sentence1], [at[t] for t in test.sentence2]
    encoders = {b: FrozenEncoder(EncoderConfig(backend=b)) for b in BACKENDS}
    rows, ref = {}, None
    for b, enc in encoders.items():  # one warm-up pass each (graph load, allocator)
        enc.encode(texts[:64], show_progress=False)
    for b, enc in encoders.items():
        seconds, vectors = _timed(lambda: enc.encode(texts, show_progress=False), repeats)
        ref = vectors if ref is None else ref
        rows[b] = {"sentences_per_s": round(len(texts) / seconds, 1),
                   "stsb_test_spearman": round(spearman(_cos(vectors[ia], vectors[ib]), test.label), 5),
                   "min_cosine_to_torch": round(float(_cos(vectors, ref).min()), 5)}
        print("encoder", b, rows[b], flush=True)
    return {"sentences": len(texts), "rows": rows}


def _cross_encoders(test, repeats: int, ce_path: str) -> dict:
    pairs = list(zip(test.sentence1, test.sentence2))
    models = {b: PairCrossEncoder(ce_path, backend=b) for b in BACKENDS}
    rows = {}
    for b, ce in models.items():
        ce.logits(pairs[:32])
    for b, ce in models.items():
        seconds, z = _timed(lambda: ce.logits(pairs), repeats)
        rows[b] = {"pairs_per_s": round(len(pairs) / seconds, 1), "stsb_test_spearman": round(spearman(z, test.label), 5),
                   "both_orders": ce.both_orders}
        print("cross-encoder", b, rows[b], flush=True)
    return {"model": ce_path, "pairs": len(pairs), "rows": rows}


def _served_teacher_dir() -> str | None:
    splits = load_splits("stsb", SPLITS)
    for preset in ("fast", "light"):  # make teacher's recipe, then the one it had before
        folder = served_dir(teacher_preset(preset), splits)
        if (folder / "teacher.json").is_file():
            return str(folder)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    test = load_task("stsb", "test")
    ce_path = _served_teacher_dir()
    if ce_path is None:
        raise SystemExit("No served STS-B teacher yet: run `make teacher` (or `python -m embed_lib teacher --task stsb "
                         "--teacher-preset fast --no-mlflow`) first (the cross-encoder's quality is measured on it).")
    enc = _encoders(test, args.repeats)
    ce = _cross_encoders(test, args.repeats, ce_path)
    e, c = enc["rows"], ce["rows"]
    ratios = {
        "encoder_int8_over_torch": round(e["onnx-int8"]["sentences_per_s"] / e["torch"]["sentences_per_s"], 2),
        "encoder_int8_spearman_delta": round(e["onnx-int8"]["stsb_test_spearman"] - e["torch"]["stsb_test_spearman"], 5),
        "cross_encoder_int8_over_torch": round(c["onnx-int8"]["pairs_per_s"] / c["torch"]["pairs_per_s"], 2),
        "cross_encoder_int8_spearman_delta": round(c["onnx-int8"]["stsb_test_spearman"]
                                                   - c["torch"]["stsb_test_spearman"], 5),
    }
    write_results("backends", {"threads": args.threads, "repeats": args.repeats, "encoder": enc, "cross_encoder": ce,
                               "ratios": ratios, "targets": {"int8_over_torch": 2.0, "spearman_delta_abs": 0.003}})


if __name__ == "__main__":
    main()
