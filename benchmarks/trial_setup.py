"""A sweep trial's time on a study shipped with its per-study caches (what `sweeps.trainable.precompute` now ships)
against a study shipped without them, side by side.

    .venv/bin/python benchmarks/trial_setup.py [--trials 3] [--epochs 3]

Every Tune trial gets its own copy of the study through Ray's object store (a pickle round trip, done here the same
way); the novelty gate's familiarity of every sentence and the retrieval checks' frozen top-k are fields of the study,
computed on first use. Each way trains `--trials` seed groups of `make run`'s winning configuration on fresh copies,
one thread, like a trial on a 2-core machine. Needs the STS-B study cached (embeddings and the fast teacher: a `make
run` before). Figures: seconds per trial each way, their medians and the difference. Writes
results/benchmarks/trial_setup.json.
"""
from __future__ import annotations

import argparse
import pickle
import statistics
import time

import torch

from benchmarks._common import write_results
from embed_lib.config import AdapterConfig
from embed_lib.data.tasks import task_names
from embed_lib.pipeline.prepare import load_study
from embed_lib.teacher.config import teacher_preset
from embed_lib.training.seed_group import train_seed_group

#: the configuration `make run` registered on both fresh clones of the last first-run benchmark (results/README.md)
WINNER = dict(adapter="pair_gated", target="ce_margin", gamma=0.715, tau=0.151, lambda_c=2.0312, lambda_mod=0.01,
              lambda_delta=1.0, novelty_quantile=0.2, lr=0.0009, weight_decay=0.0158, width=128)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    study, _ = load_study("stsb", None, teacher_preset("fast"), transfer=[t for t in task_names() if t != "stsb"])
    bare = pickle.dumps(study)  # as the sweep shipped it before: the caches not computed yet
    t0 = time.perf_counter()
    study.familiarity()
    study.retrieval_checks()
    prime_s = round(time.perf_counter() - t0, 2)
    primed = pickle.dumps(study)
    cfg = AdapterConfig.from_dict({**WINNER, "epochs": args.epochs})
    # a reused trial actor has imported what the first trial imports (the optimizer's torch._dynamo, ~2 s): warm up
    train_seed_group(AdapterConfig.from_dict({**WINNER, "epochs": 1}), pickle.loads(primed), evaluate_test=False)
    seconds: dict[str, list[float]] = {"without_caches": [], "with_caches": []}
    for _ in range(args.trials):
        for name, blob in (("without_caches", bare), ("with_caches", primed)):
            t0 = time.perf_counter()
            train_seed_group(cfg, pickle.loads(blob), evaluate_test=False)
            seconds[name].append(round(time.perf_counter() - t0, 2))
    median = {k: statistics.median(v) for k, v in seconds.items()}
    write_results("trial_setup", {"config": {**WINNER, "epochs": args.epochs}, "threads": 1, "seconds": seconds,
                                  "median_s": median, "saved_per_trial_s": round(median["without_caches"]
                                                                                 - median["with_caches"], 2),
                                  "computed_once_by_precompute_s": prime_s})


if __name__ == "__main__":
    main()
