"""`make venv` on fresh clones with uv (the default) against pip, side by side, alternating.

    .venv/bin/python benchmarks/venv_install.py [--rounds 2]

Each round clones this repository's HEAD twice beside it and times `make venv INSTALLER=pip` and
`make venv INSTALLER=uv` (torch comes through pip from local disk in both; the pinned constraints.txt through the
installer named), in a newcomer's environment (`first_run.newcomer_env`). Package caches stay as they are (a
newcomer's pip and uv caches may be colder). Figures: every round's seconds per installer, the medians and their
ratio, and the number of packages each venv holds (the same set). Writes results/benchmarks/venv_install.json.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import time

from benchmarks._common import REPO, write_results
from benchmarks.first_run import newcomer_env

INSTALLERS = ("pip", "uv")


def one(installer: str, round_: int) -> tuple[float, int]:
    """(seconds of `make venv`, packages installed) on a fresh clone."""
    clone = REPO.parent / f"venv-bench-{installer}-{round_}"
    shutil.rmtree(clone, ignore_errors=True)
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True)
    try:
        t0 = time.time()
        subprocess.run(["make", "venv", f"INSTALLER={installer}"], cwd=clone, env=newcomer_env(), check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        seconds = round(time.time() - t0, 1)
        listed = subprocess.run([str(clone / ".venv/bin/python"), "-m", "pip", "list", "--format=freeze"],
                                capture_output=True, text=True, check=True).stdout.split()
        return seconds, len([p for p in listed if not p.startswith(("uv==", "embed-lib"))])
    finally:
        shutil.rmtree(clone, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    seconds: dict[str, list[float]] = {k: [] for k in INSTALLERS}
    packages: dict[str, int] = {}
    for r in range(args.rounds):
        for installer in INSTALLERS:
            s, packages[installer] = one(installer, r)
            seconds[installer].append(s)
            print(f"round {r + 1}: make venv INSTALLER={installer}: {s} s, {packages[installer]} packages", flush=True)
    median = {k: statistics.median(v) for k, v in seconds.items()}
    write_results("venv_install", {"command": "make venv INSTALLER=pip|uv (fresh clones, alternating)",
                                   "seconds": seconds, "median_s": median, "packages": packages,
                                   "speedup": round(median["pip"] / median["uv"], 2)})


if __name__ == "__main__":
    main()
