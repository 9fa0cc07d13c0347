"""Short GPU check (< 10 minutes on one GPU): encoder throughput on CPU vs GPU, the seed-group trainer on
CPU vs GPU, and a small Ray Tune sweep with fractional GPUs per trial. Figures -> results/benchmarks/gpu_check.json.
On a machine without a GPU it records that and measures the CPU side only.
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from benchmarks._common import write_results
from embed_lib.config import AdapterConfig, EncoderConfig
from embed_lib.data.tasks import load_task
from embed_lib.encoding.encoders import FrozenEncoder
from embed_lib.pipeline.prepare import load_study
from embed_lib.training.seed_group import train_seed_group


def main() -> None:
    gpu = torch.cuda.is_available()
    figures: dict = {"cuda": gpu, "device_name": torch.cuda.get_device_name(0) if gpu else None}
    texts = load_task("stsb", "train").texts()[:4000]
    for device in (["cpu", "cuda"] if gpu else ["cpu"]):
        enc = FrozenEncoder(EncoderConfig(device=device, batch_size=256 if device == "cuda" else 64))
        enc.encode(texts[:256])
        n = len(texts) if device == "cuda" else 1000
        t = time.perf_counter()
        enc.encode(texts[:n])
        figures[f"encode_{device}_sentences_per_s"] = round(n / (time.perf_counter() - t), 1)
    data, _ = load_study("stsb")
    cfg = AdapterConfig(adapter="pair_gated", target="lexical", n_seeds=5)
    for device in (["cpu", "cuda"] if gpu else ["cpu"]):
        train_seed_group(dataclasses.replace(cfg, epochs=1), data, device=device)
        t = time.perf_counter()
        r = train_seed_group(cfg, data, device=device)
        figures[f"seed_group_{device}_s"] = round(time.perf_counter() - t, 2)
        figures[f"seed_group_{device}_delta_val_mean"] = r.summary["delta_val_mean"]
    if gpu:
        import ray
        from ray import tune

        from sweeps.trainable import make_trainable

        ray.init(include_dashboard=False, log_to_driver=False)
        fixed = {"adapter": "pair_gated", "target": "lexical", "n_seeds": 5, "epochs": 8}
        t = time.perf_counter()
        res = tune.Tuner(make_trainable(data, fixed, 1, 0.25),
                         param_space={"gamma": tune.grid_search([0.02, 0.05, 0.1, 0.2]),
                                      "lr": tune.grid_search([3e-4, 1e-3, 3e-3])},
                         tune_config=tune.TuneConfig(max_concurrent_trials=4, reuse_actors=True),
                         run_config=tune.RunConfig(storage_path="/tmp/gpu_check", verbose=0)).fit()
        figures["tune_12_trials_quarter_gpu_s"] = round(time.perf_counter() - t, 1)
        figures["tune_errors"] = len(res.errors)
        ray.shutdown()
    write_results("gpu_check", figures)


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
