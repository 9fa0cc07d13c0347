"""The default test suite's wall time on this machine: `make test` as CI runs it, timed, its counts read off pytest.

    .venv/bin/python benchmarks/suite.py [--name suite]   -> results/benchmarks/suite.json

Feeds results/README.md's "The suite" table (the target: <= 900 s on 2 cores). The machine record says which CPU and
instruction sets measured it (the suite's torch work runs faster with AVX512 or AMX than with AVX2 alone).
"""
from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks._common import REPO, write_results

#: the suite's own target (DEVELOPERS.md): the default `make test` within 15 minutes on 2 cores
TARGET_S = 900
#: pytest's closing line: "1290 passed, 7 skipped in 701.2s"
COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", default="suite")
    args = ap.parse_args()
    t0 = time.perf_counter()
    run = subprocess.run(["make", "test"], cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    log = Path(tempfile.gettempdir()) / f"embed-{args.name}.log"  # the whole output, not kept in results/
    log.write_text(run.stdout + run.stderr)
    failed = [line.split(" ", 1)[1].split(" - ")[0] for line in run.stdout.splitlines() if line.startswith("FAILED ")]
    tail = [line for line in run.stdout.splitlines() if " in " in line and "passed" in line]
    counts = {kind: int(n) for n, kind in COUNTS.findall(tail[-1])} if tail else {}
    write_results(args.name, {"command": "make test", "returncode": run.returncode, "wall_s": round(wall, 1),
                              "counts": counts, "target_s": TARGET_S, "within_target": wall <= TARGET_S,
                              "closing_line": tail[-1] if tail else None, "failed": failed, "log": str(log)})
    return run.returncode


if __name__ == "__main__":
    raise SystemExit(main())
