"""Baseline command, cold cache vs warm cache: wall times of two runs of
`python -m embed_lib baseline --task <task>` against a fresh cache directory, and their ratio.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from benchmarks._common import REPO, write_results


def run(task: str, cache_dir: str, out: str) -> float:
    env = dict(os.environ, EMBED_CACHE_DIR=cache_dir)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "embed_lib", "baseline", "--task", task, "--out", out],
                   cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--task", default="stsb")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "baseline.md")
        cold = run(args.task, tmp, out)
        warm = run(args.task, tmp, out)
    write_results("baseline_cache", {"task": args.task, "cold_s": round(cold, 2), "warm_s": round(warm, 2),
                                     "warm_over_cold": round(warm / cold, 3), "speedup": round(cold / warm, 1)})


if __name__ == "__main__":
    main()
