"""The first `make run` of a newcomer, timed on fresh clones: venv, cluster, encoding, teacher, trials, registration.

    .venv/bin/python benchmarks/first_run.py [--runs 2] [--keep] [--name first_run]  (make first-run)

Each run clones this repository's HEAD (commit first: local changes are not in a clone) beside it, so that the data
mirror at ../shared/data is found as a user's clone finds it, and runs `make run` there with nothing cached: no venv
(pip's own download cache is used, as on any machine that installed Python packages before), no embeddings, no
teacher, an empty MLflow store. Wall time in all and by stage, and the quality the run reached (the teacher's test
Spearman, the registered winner's deltas against the frozen cosine and its worst transfer check), from the clone's
MLflow store. Writes results/benchmarks/first_run.json (or NAME.json); the issue's targets are checked beside the
figures. Each run records the CPU it ran on (model, cores, instruction sets): a figure for a kind of CPU is measured on
one, never projected from another. Feeds results/README.md's "The first run".
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import mlflow

from benchmarks._common import REPO, cpu_flags, cpu_model, write_results

#: what a first run must reach (issue 32): in all, venv included, and the quality of the study's champion
TARGETS = {"wall_s_max": 1200, "teacher_test_min": 0.835, "winner_val_min": 0.012, "winner_test_min": 0.012,
           "positive_seeds": "every seed, on validation and on test", "transfer_min": -0.001}


#: what this clone's Makefile (`make first-run`) or a developer's shell exports, and a newcomer's shell does not have:
#: left in, the fresh clone would use this clone's caches, MLflow store and Ray state instead of its own
NOT_A_NEWCOMERS = ("EMBED_CACHE_DIR", "EMBED_STORAGE_DIR", "EMBED_RAY_DIR", "MLFLOW_TRACKING_URI",
                   "MLFLOW_ARTIFACT_ROOT", "RAY_ADDRESS", "MAKEFLAGS", "MAKELEVEL", "MFLAGS")

def newcomer_env(environ=None) -> dict[str, str]:
    """The environment a fresh clone's make runs in: this one without NOT_A_NEWCOMERS."""
    return {k: v for k, v in (os.environ if environ is None else environ).items() if k not in NOT_A_NEWCOMERS}


def _timed(cmd: list[str], cwd: Path, log: Path) -> float:
    t0 = time.time()
    with open(log, "a") as out:
        subprocess.run(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, check=True,
                       env=newcomer_env())
    return round(time.time() - t0, 1)


def _store_figures(clone: Path) -> dict:
    """The sweep's parent run, its teacher record and its registered winner, from the clone's own store."""
    client = mlflow.MlflowClient(f"sqlite:///{clone / 'mlflow.db'}")
    exps = [e.experiment_id for e in client.search_experiments()]
    parent = next(r for r in client.search_runs(exps, order_by=["attributes.start_time DESC"])
                  if "sweep" in r.data.tags and "mlflow.parentRunId" not in r.data.tags)
    local = client.download_artifacts(parent.info.run_id, "teacher.json", str(clone / ".first-run"))
    teacher = json.loads(Path(local).read_text())
    (winner,) = client.search_runs(exps, f"tags.`mlflow.parentRunId` = '{parent.info.run_id}' and "
                                         "attributes.run_name = 'winner'")
    m = winner.data.metrics
    seeds = int(float(winner.data.params.get("n_seeds", 0) or 0)) or None
    transfer = {k.split("/")[1]: v for k, v in m.items() if k.startswith("transfer/") and k.endswith("/delta_min")}
    stage = teacher.get("intermediate") or {}
    return {"teacher": {"preset": teacher.get("preset"), "precision": teacher.get("precision", "fp32"),
                        "threads": teacher.get("threads"), "fold_processes": teacher.get("fold_processes", 1),
                        "fold_threads": teacher.get("fold_threads"),
                        "seconds": teacher.get("seconds"),
                        "stage_s": stage.get("seconds"), "stage_pairs": stage.get("pairs"),
                        # each shard's seconds in the averages, most of it waiting for the other, and its step order
                        "stage_average_s": [r.get("average_seconds") for r in stage.get("shard_records", [])],
                        "stage_step_order": stage.get("step_order", "formed" if stage.get("shards") else None),
                        "folds_s": [f["seconds"] for f in teacher.get("folds", [])],
                        "val": teacher.get("validation_spearman"), "test": teacher.get("test_spearman")},
            "stages": {k.split("/", 1)[1]: v for k, v in parent.data.metrics.items() if k.startswith("stage/")},
            "winner_val": m.get("delta_val_mean"), "winner_test": m.get("delta_test_mean"),
            "positive_seeds": {"val": m.get("delta_val_positive"), "test": m.get("delta_test_positive"), "of": seeds},
            "transfer_min": min(transfer.values()) if transfer else None, "transfer_min_by_task": transfer,
            "winner_config": {k: winner.data.params.get(k) for k in ("adapter", "target", "gamma", "lambda_distil",
                                                                      "silver_fraction", "novelty_quantile")},
            "registered": {"version": parent.data.tags.get("winner_version"),
                           "alias": parent.data.tags.get("winner_alias")}}


def one_run(i: int, keep: bool) -> dict:
    clone = REPO.parent / f"first-run-{i}"
    shutil.rmtree(clone, ignore_errors=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True, capture_output=True,
                            check=True).stdout.strip()
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True)
    log = Path(tempfile.gettempdir()) / f"embed-first-run-{i}.log"  # the run's whole output (not kept in results/)
    log.write_text("")
    try:
        t0 = time.time()
        venv_s = _timed(["make", "venv"], clone, log)
        run_s = _timed(["make", "run"], clone, log)
        wall = round(time.time() - t0, 1)
        text = log.read_text()
        figures = _store_figures(clone)
    finally:
        if not keep:
            shutil.rmtree(clone, ignore_errors=True)
    stages = figures.pop("stages")
    teacher = figures["teacher"]
    job = stages.get("total_s", 0.0)
    by_stage = {"venv": venv_s, "cluster_and_submit": round(run_s - job, 1),
                "encoding": round(stages.get("precompute_s", 0.0) - (teacher["seconds"] or 0.0), 1),
                # the folds' wall time (they may train at once): the teacher's after its intermediate stage
                "teacher_stage": teacher["stage_s"],
                "teacher_folds": round((teacher["seconds"] or 0.0) - (teacher["stage_s"] or 0.0), 1),
                "trials": stages.get("trials_s"),
                "winner_and_registry": round(job - stages.get("precompute_s", 0.0) - stages.get("trials_s", 0.0), 1)}
    return {"commit": commit, "cpu_model": cpu_model(), "cpu_flags": cpu_flags(),
            "cpus": os.cpu_count(),
            "wall_s": wall, "wall_s_by_stage": by_stage,
            "teacher_test": teacher["test"], "teacher_val": teacher["val"], **figures,
            "job_succeeded": "SUCCEEDED" in text, "log": str(log),
            "winner_line": next((ln for ln in text.splitlines() if re.match(r"\s*winner \w+ \(", ln)), None)}


def met(run: dict) -> dict:
    seeds = run["positive_seeds"]
    return {"wall": run["wall_s"] <= TARGETS["wall_s_max"],
            "teacher_test": (run["teacher_test"] or 0) >= TARGETS["teacher_test_min"],
            "winner_val": (run["winner_val"] or 0) >= TARGETS["winner_val_min"],
            "winner_test": (run["winner_test"] or 0) >= TARGETS["winner_test_min"],
            "positive_seeds": seeds["of"] is not None and seeds["val"] == seeds["test"] == seeds["of"],
            "transfer": run["transfer_min"] is not None and run["transfer_min"] >= TARGETS["transfer_min"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2, help="fresh clones, one after the other (default 2)")
    parser.add_argument("--keep", action="store_true", help="keep each clone (../first-run-N) for inspection")
    parser.add_argument("--name", default="first_run", help="results/benchmarks/NAME.json (default first_run; "
                        "another name keeps the record, e.g. for a host of another kind)")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs {args.runs}: give at least 1 fresh clone")
    runs = []
    for i in range(1, args.runs + 1):
        runs.append(one_run(i, args.keep))
        runs[-1]["met"] = met(runs[-1])
        print(json.dumps(runs[-1], indent=2), flush=True)
    write_results(args.name, {"command": "make run (fresh clone beside the mirror; venv included)",
                              "targets": TARGETS, "runs": runs,
                              "all_met": all(all(r["met"].values()) for r in runs)})


if __name__ == "__main__":
    main()
