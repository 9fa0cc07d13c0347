"""Ray Tune overhead: the same N seed-group configurations through Ray Tune (reuse_actors, 1 CPU per
trial) vs a plain loop in one process, in one run. Reported: wall times and their ratios, with Tune at
concurrency 1 (pure overhead) and at concurrency 2 (this machine's cores). Target: ratio <= 1.3.
"""
from __future__ import annotations

import argparse
import time

import ray
import torch
from ray import tune

from benchmarks._common import REPO, write_results
from embed_lib.config import AdapterConfig
from embed_lib.pipeline.prepare import load_study
from embed_lib.training.seed_group import train_seed_group
from sweeps.trainable import make_trainable


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--n", type=int, default=8, help="configurations")
    p.add_argument("--epochs", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(1)
    data, _ = load_study("stsb")
    gammas = [0.02 + 0.02 * i for i in range(args.n)]
    fixed = {"adapter": "pair_gated", "target": "lexical", "epochs": args.epochs, "n_seeds": 5}
    train_seed_group(AdapterConfig(**{**fixed, "epochs": 1, "n_seeds": 1}), data)  # warm-up
    t = time.perf_counter()
    for g in gammas:
        train_seed_group(AdapterConfig(**fixed, gamma=g), data, evaluate_test=False)
    loop = time.perf_counter() - t

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    figures = {"n_configs": args.n, "epochs": args.epochs, "seeds": 5, "loop_s": round(loop, 2)}
    for concurrency in (1, 2):
        tuner = tune.Tuner(make_trainable(data, fixed, 1, 0), param_space={"gamma": tune.grid_search(gammas)},
                           tune_config=tune.TuneConfig(max_concurrent_trials=concurrency, reuse_actors=True),
                           run_config=tune.RunConfig(storage_path=str(REPO / "benchmarks" / "out"), verbose=0))
        t = time.perf_counter()
        results = tuner.fit()
        wall = time.perf_counter() - t
        assert not results.errors, results.errors
        figures[f"tune_concurrency{concurrency}_s"] = round(wall, 2)
        figures[f"ratio_tune_concurrency{concurrency}_over_loop"] = round(wall / loop, 3)
    ray.shutdown()
    figures["target_ratio"] = 1.3
    write_results("tune_overhead", figures)


if __name__ == "__main__":
    main()
