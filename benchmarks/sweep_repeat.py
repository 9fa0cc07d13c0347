"""Is a sweep repeatable? The same sweep run again, with one trial at a time and with several, side by side.

    .venv/bin/python benchmarks/sweep_repeat.py [--task stsb] [--runs 2] [--concurrency 1,2] [--num-samples 32] [--name N]

Runs `sweeps/pair_residual.py --task TASK --max-concurrent C` `--runs` times for each C, one after another, each with
a store and Tune results of its own (a temporary directory) and this clone's cache (run `make run` first: with the
embeddings and teacher cached a run takes 2-3 minutes). For each C: every run's winner (form, target, gamma, its
validation and test delta) and trial seconds, how many distinct winners, and how many of the first run's trials
(configuration and mean validation delta) every other run repeated. Each trial's result is seeded; what can differ
is which configurations are tried: Optuna proposes from the results in hand and ASHA stops a trial by the rungs
reported so far, so with several trials at once the order in which they finish steers the sweep.
Writes results/benchmarks/sweep_repeat.json (sweep_repeat_TASK.json for another task; --name NAME: NAME.json).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile

from benchmarks._common import REPO, write_results

WINNER = re.compile(r"^winner \w+ \((?P<form>[\w_]+), target (?P<target>\w+), gamma (?P<gamma>[\d.]+).*?val delta "
                    r"(?P<val>[+-][\d.]+).*?test delta (?P<test>[+-][\d.]+)")


def _trials(uri: str, task: str) -> set[str]:
    """Every trial of the sweep in store `uri`: its configuration and mean validation delta, as one string each."""
    import mlflow

    from embed_lib.tracking.registry import sweep_experiment

    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=[sweep_experiment(task)], filter_string="tags.trial_id != ''",
                              output_format="list")
    return {json.dumps([sorted(r.data.params.items()), round(r.data.metrics.get("delta_val_mean", float("nan")), 5)])
            for r in runs}


def run_sweep(task: str, concurrency: int, samples: int | None, extra: tuple[str, ...] = ()) -> dict:
    """One sweep with a store and Tune results of its own (`samples` None: no --num-samples, as a grid takes none):
    its winner (None: its `reason`), trial seconds, and its trials (`_trials`)."""
    with tempfile.TemporaryDirectory(prefix="sweep-repeat-") as tmp:
        uri = f"sqlite:///{tmp}/mlflow.db"
        cmd = [sys.executable, "sweeps/pair_residual.py", "--task", task, "--max-concurrent", str(concurrency),
               *(("--num-samples", str(samples)) if samples else ()), "--tracking-uri", uri, "--storage-path",
               f"{tmp}/ray_results", *extra]
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
        summary = json.loads(next(ln for ln in reversed(out.stdout.splitlines()) if ln.startswith("{")))
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("winner ")), "")
        w = WINNER.match(line)
        per_task = line.split("per task:", 1)[-1].split(";", 1)[0] if "per task:" in line else ""
        winner = ({"form": w["form"], "target": w["target"], "gamma": float(w["gamma"]),
                   "winner_val": float(w["val"]), "winner_test": float(w["test"]), "line": line,
                   "transfer_min_by_task": {t: float(v) for t, v in re.findall(r"(\S+) ([+-]\d+\.\d+)", per_task)}}
                  if w else None)
        return {"winner": winner, "reason": summary.get("reason"), "trials_s": summary["stages"]["trials_s"],
                "complete": summary["complete"], "stopped_early": summary["stopped_early"],
                "trials": _trials(uri, task)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="stsb")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--concurrency", default="1,2", help="comma list of --max-concurrent values")
    ap.add_argument("--num-samples", type=int, default=32)
    ap.add_argument("--name", default=None, help="results/benchmarks/NAME.json (default sweep_repeat for stsb, "
                    "sweep_repeat_TASK for another task)")
    args = ap.parse_args()
    figures: dict = {"task": args.task, "num_samples": args.num_samples, "runs_each": args.runs, "by_concurrency": {}}
    for c in (int(v) for v in args.concurrency.split(",")):
        runs = []
        for i in range(args.runs):
            runs.append(run_sweep(args.task, c, args.num_samples))
            print(f"max_concurrent {c}, run {i + 1}: {runs[-1]['winner']}, trials {runs[-1]['trials_s']} s", flush=True)
        first = runs[0]["trials"]
        # a winner's configuration and figures; its line names the trial by an id drawn anew in every run
        winners = {json.dumps({k: v for k, v in (r["winner"] or {}).items() if k != "line"}, sort_keys=True)
                   for r in runs}
        figures["by_concurrency"][str(c)] = {
            "runs": [{k: v for k, v in r.items() if k != "trials"} for r in runs],
            "trials": len(first), "distinct_winners": len(winners),
            "trials_repeated_min": min(len(first & r["trials"]) for r in runs[1:]) if len(runs) > 1 else None,
            "identical": len(runs) > 1 and all(r["trials"] == first for r in runs[1:])}
    write_results(args.name or ("sweep_repeat" if args.task == "stsb" else f"sweep_repeat_{args.task}"), figures)


if __name__ == "__main__":
    main()
