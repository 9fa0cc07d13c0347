"""QQP under the do-no-harm rule: the default sweep beside a small grid of anchored configurations, in one run.

    .venv/bin/python benchmarks/qqp_rule.py

Runs `sweeps/pair_residual.py --task qqp` as `make run TASK=qqp` does (Optuna, ASHA, 32 samples, 2 at once), then the
grid of docs/serving.md (pair_gated on the teacher's margin, gamma 0.5, novelty quantile 0.3 and 0.5, magnitude
penalty 1), each with a store of its own and this clone's cache (run `make run TASK=qqp` first: the QQP teacher
trains once, about 11 minutes on 2 cores with AMX). For each: the winner (form, target, gamma, validation and test
delta) or the reason none passed the rule, how many trials completed and how many ASHA stopped early.
Writes results/benchmarks/qqp_rule.json.
"""
from __future__ import annotations

import argparse

from benchmarks._common import write_results
from benchmarks.sweep_repeat import run_sweep

GRID = ("--search", "grid", "--grid", "adapter=pair_gated", "--grid", "target=ce_margin", "--grid", "gamma=0.5",
        "--grid", "novelty_quantile=0.3,0.5", "--grid", "lambda_delta=1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-samples", type=int, default=32, help="the default sweep's Optuna samples (make run's: 32)")
    args = ap.parse_args()
    figures = {}
    for name, samples, extra in (("default", args.num_samples, ()), ("grid", None, GRID)):
        out = run_sweep("qqp", 2, samples, extra)
        figures[name] = {"sweep_args": " ".join(extra), **{k: v for k, v in out.items() if k != "trials"}}
        print(f"{name}: {out['winner'] or out['reason']}", flush=True)
    write_results("qqp_rule", figures)


if __name__ == "__main__":
    main()
