"""What today's first run would take on hosts measured before (AVX2-only, AVX512-BF16): an estimate from measurements.

    .venv/bin/python benchmarks/first_run_projection.py [--capped first_run_isa_avx2 [NAME ...]]
                                                        [--hosts first_run_avx2 first_run_avx2_s20]
                                                        [--reference NAME] [--name first_run_projection]

No AVX2-only host may be at hand when the recipe changes. `first_run.py --isa-cap avx2` then measures today's
recipe in that arithmetic (fp32 teacher, AVX2 kernels) on a faster host (`--capped`); the `--hosts` files hold fresh
clones measured on AVX2-only hosts with an earlier recipe (the same for AVX512-BF16 hosts: `--isa-cap avx512_bf16`,
`--hosts first_run_avx512_bf16_3folds`). The intermediate stage did the same arithmetic in both (the same pairs,
shards and precision; only its learning rate differed), so each host run's stage over the capped runs' mean stage is
that host's speed in this arithmetic. Each host run's estimate: the capped runs' mean teacher
(stage and folds) times that ratio, plus the rest of the host run (venv, cluster, encoding, trials, registry) as it
was measured. The assumptions: the folds scale with the host as the stage does, and the rest has not changed. The
quality floors are not estimated: the capped runs measured them in the host's arithmetic.
`--reference`: when today's stage does other arithmetic than the hosts' did (fewer padded tokens, say), a file of
capped runs on the same core of a recipe whose stage did the hosts' arithmetic: each host's speed is then its stage
over the reference runs' mean stage, and the estimate today's (`--capped`) teacher times it. Writes
results/benchmarks/first_run_projection.json (or NAME.json).
"""
from __future__ import annotations

import argparse
import json

from benchmarks._common import REPO, write_results

TEACHER = ("teacher_stage", "teacher_folds")


def _runs(name: str) -> list[dict]:
    path = REPO / "results" / "benchmarks" / f"{name}.json"
    if not path.is_file():
        raise SystemExit(f"{path} not found: give the name of a results file of benchmarks/first_run.py")
    return json.loads(path.read_text())["runs"]


def _mean_stage(runs: list[dict]) -> float:
    return sum(r["wall_s_by_stage"]["teacher_stage"] for r in runs) / len(runs)


def project(capped: list[dict], host_runs: list[tuple[str, int, dict]], wall_max: float,
            reference: list[dict] | None = None) -> dict:
    """The estimate of each host run (see the module docstring), from the capped runs and (file, index, run); the
    hosts' speed from the `reference` capped runs where given, else from `capped`'s."""
    if any(r.get("isa_cap") is None for r in [*capped, *(reference or [])]):
        raise SystemExit("--capped, --reference: files of `first_run.py --isa-cap ...` runs (their runs record "
                         "`isa_cap`)")
    speed_from = reference or capped
    stage = _mean_stage(speed_from)
    teacher = sum(sum(r["wall_s_by_stage"][k] for k in TEACHER) for r in capped) / len(capped)
    rows = []
    for name, i, run in host_runs:
        by_stage = run["wall_s_by_stage"]
        ratio = by_stage["teacher_stage"] / stage
        rest = sum(v for k, v in by_stage.items() if k not in TEACHER)
        estimate = rest + teacher * ratio
        rows.append({"file": name, "run": i, "commit": run["commit"], "cpu_flags": run.get("cpu_flags"),
                     "measured_wall_s": run["wall_s"], "stage_s": by_stage["teacher_stage"],
                     "stage_over_capped": round(ratio, 3), "rest_s": round(rest, 1),
                     "estimate_wall_s": round(estimate, 1), "within_target": estimate <= wall_max})
    estimates = [r["estimate_wall_s"] for r in rows]
    return {"capped_commits": sorted({r["commit"] for r in capped}), "capped_stage_s": round(_mean_stage(capped), 1),
            "speed_from_commits": sorted({r["commit"] for r in speed_from}), "speed_from_stage_s": round(stage, 1),
            "capped_teacher_s": round(teacher, 1), "hosts": rows, "estimate_min_s": min(estimates),
            "estimate_max_s": max(estimates), "wall_s_max": wall_max,
            "within_target": sum(r["within_target"] for r in rows), "of": len(rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capped", nargs="+", default=["first_run_isa_avx2"], help="results files of the capped runs "
                    "(default first_run_isa_avx2)")
    ap.add_argument("--hosts", nargs="+", default=["first_run_avx2", "first_run_avx2_s20"],
                    help="results files of runs on the hosts themselves (default first_run_avx2 first_run_avx2_s20)")
    ap.add_argument("--reference", default=None, help="results file of capped runs, on the --capped runs' core, of a "
                    "recipe whose stage did the hosts' arithmetic: the hosts' speed is read against it (default: "
                    "against --capped)")
    ap.add_argument("--name", default="first_run_projection", help="results/benchmarks/NAME.json (default "
                    "first_run_projection)")
    args = ap.parse_args()
    from benchmarks.first_run import TARGETS

    host_runs = [(name, i, run) for name in args.hosts for i, run in enumerate(_runs(name))]
    figures = project([run for name in args.capped for run in _runs(name)], host_runs, TARGETS["wall_s_max"],
                      _runs(args.reference) if args.reference else None)
    write_results(args.name, {"estimate": True, "capped": " ".join(args.capped), "reference": args.reference,
                              "hosts_files": args.hosts, **figures})


if __name__ == "__main__":
    main()
