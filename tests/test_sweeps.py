"""Sweeps end to end: real Ray cluster, `ray job submit`, real MLflow (sqlite), the registry."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.sweeps_common import REPO, child_runs, mlflow_client, submit_sweep

pytestmark = pytest.mark.integration


@pytest.mark.slow
def test_smoke_sweep_through_ray_job_submit(sweep_env):
    out = submit_sweep(sweep_env, "--task", "stsb", "--smoke-test")
    assert "SUCCEEDED" in out
    client = mlflow_client(sweep_env)
    # a smoke test registers under a name of its own (or nothing, when no configuration passes the rule, as on the
    # small made data set): the real model's aliases are never touched
    (summary,) = [json.loads(line[line.index("{"):]) for line in out.splitlines() if '{"complete": ' in line]
    if summary["winner"] is not None:
        assert summary["registered_name"] == "pair-residual-stsb-smoke" and summary["version"] == "1"
    else:
        assert "Nothing registered." in summary["reason"]
    assert client.search_model_versions("name='pair-residual-stsb'") == []
    exp = client.get_experiment_by_name("sweep-stsb")
    (parent,) = client.search_runs([exp.experiment_id], "tags.sweep = 'pair_residual-stsb-smoke'")
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["git_commit"] and "pair_residual.py" in parent.data.tags["command"]
    assert parent.data.params["search"] == "optuna" and parent.data.metrics["trials_complete"] == 3
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"leaderboard.csv", "leaderboard.md", "cache_manifest.json", "teacher.json", "plots"} <= artifacts
    trials = [r for r in child_runs(client, exp.experiment_id, parent.info.run_id) if "trial_id" in r.data.tags]
    assert len(trials) == 3 and all(r.info.status == "FINISHED" for r in trials)
    assert parent.data.params["transfer"] == "mrpc,paws,qqp" and "winner_rule" in parent.data.tags
    # what a person reads in the MLflow UI: the run's description, the experiment opened as model training
    assert "Winner rule:" in parent.data.tags["mlflow.note.content"] and "3 configurations complete" in \
        parent.data.tags["mlflow.note.content"]
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    assert {i.dataset.name for i in parent.inputs.dataset_inputs} == {"stsb-train", "stsb-validation", "stsb-test"}
    for r in trials:
        assert {"delta_val_mean", "delta_val_positive", "objective", "transfer_delta_min",
                "transfer/paws/delta_min", "transfer/qqp/delta_mean"} <= set(r.data.metrics)
        assert len(client.get_metric_history(r.info.run_id, "seed/delta_val")) == 2  # two seeds
        assert len(client.get_metric_history(r.info.run_id, "objective")) >= 2  # epochs + final
        assert len(client.get_metric_history(r.info.run_id, "epoch/delta_val_mean")) == 2  # the curve: one per epoch
        # what ASHA and Optuna read at each epoch: the validation delta less 100x the transfer harm beyond 0.001
        history = {name: {m.step: m.value for m in client.get_metric_history(r.info.run_id, name)}
                   for name in ("epoch/delta_val_mean", "epoch/transfer_delta_min", "objective")}
        assert set(history["epoch/transfer_delta_min"]) == set(history["epoch/delta_val_mean"])
        for step, delta in history["epoch/delta_val_mean"].items():
            harm = max(0.0, -0.001 - history["epoch/transfer_delta_min"][step])
            assert history["objective"][step] == pytest.approx(delta - 100 * harm, abs=1e-12)


def test_per_sentence_sweep_smoke(sweep_env):
    proc = subprocess.run([sys.executable, "sweeps/per_sentence.py", "--task", "stsb", "--smoke-test", "--no-teacher",
                           "--experiment", "per-sentence"], env=sweep_env, cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    client = mlflow_client(sweep_env)
    exp = client.get_experiment_by_name("per-sentence")
    runs = client.search_runs([exp.experiment_id], "tags.trial_id != ''")
    assert len(runs) == 3 and all(r.data.params["adapter"].startswith("per_sentence") for r in runs)
    assert all(r.data.params["epochs"] == "2" for r in runs)  # the smoke test fixes epochs; it is not searched


@pytest.mark.slow
def test_a_sweep_on_your_own_pair_file_through_ray_job_submit(sweep_env, tmp_path, data_dir):
    """A CSV of pairs (other column names, scores 0-5, no split column) swept through `ray job submit`:
    experiment sweep-<name>, the dataset as the run's input, the winner registered as pair-residual-<name>."""
    import pandas as pd

    from embed_lib.data.tasks import load_splits

    d = load_splits("stsb", ("train",), data_dir)["train"]
    pd.DataFrame({"q1": d.sentence1[:300], "q2": d.sentence2[:300], "sim": d.raw_label[:300]}).to_csv(
        tmp_path / "support_pairs.csv", index=False)  # an absolute path: every node of this cluster reads it
    out = submit_sweep(sweep_env, "--task", str(tmp_path / "support_pairs.csv"), "--text-columns", "q1,q2",
                       "--label-column", "sim", "--label-range", "0,5", "--smoke-test", "--no-teacher",
                       "--transfer", "mrpc")
    assert "SUCCEEDED" in out
    client = mlflow_client(sweep_env)
    exp = client.get_experiment_by_name("sweep-support_pairs")
    (parent,) = client.search_runs([exp.experiment_id], "tags.sweep = 'pair_residual-support_pairs-smoke'")
    assert parent.info.status == "FINISHED" and parent.data.tags["task"] == "support_pairs"
    inputs = {i.dataset.name: i for i in parent.inputs.dataset_inputs}
    assert set(inputs) == {"support_pairs-train", "support_pairs-validation", "support_pairs-test"}
    assert inputs["support_pairs-train"].dataset.source and inputs["support_pairs-train"].dataset.digest
    if parent.data.tags["winner"] != "none":  # a smoke sweep may find no winner: the rule then says why
        assert client.get_registered_model("pair-residual-support_pairs").latest_versions


def test_a_bad_pair_file_stops_the_sweep_before_anything_starts(tmp_path):
    (tmp_path / "bad.csv").write_text("a,b,label\nx,y,0.5\n")
    proc = subprocess.run([sys.executable, "sweeps/pair_residual.py", "--task", str(tmp_path / "bad.csv"),
                           "--label-range", "0,1", "--text-columns", "a,b"], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (f"error: {tmp_path / 'bad.csv'}: split 'train' has 1 pairs; at "
                                                    "least 20 are needed.")


def test_a_failing_job_ends_the_submit_with_its_output_and_failed(ray_cluster):
    """`cluster/local.sh submit` follows the job to its end: what the job printed, then the verdict as the last
    line, and a non-zero exit when the job failed."""
    import re

    proc = subprocess.run([str(REPO / "cluster" / "local.sh"), "submit", "--", "python", "-c",
                           "import sys; print('half done', flush=True); sys.exit(3)"], env=ray_cluster, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 1 and "half done" in lines, proc.stdout + proc.stderr
    assert re.fullmatch(r"Job 'embed-[\w-]+' FAILED", lines[-1]), lines[-1]


@pytest.mark.parametrize("when", ["as the submit returns", "during the submit"])
def test_a_ctrl_c_before_the_job_is_followed_stops_it_or_says_it_was_not_submitted(ray_cluster, tmp_path, when):
    """Ctrl-C in the seconds `ray job submit` takes (or just as it returns, before the log is followed) ended
    `local.sh submit` and left a submitted job running, the follower's start in a traceback; now the job is stopped,
    or the submit says it did not happen (exit 130 both). A `ray` of the test's own sends the Ctrl-C to the
    submit's process group, as a terminal does, after or instead of the real submit."""
    import re
    import runpy
    import signal
    import urllib.error
    from pathlib import Path

    real = Path(ray_cluster["VENV"]) / "bin"
    fake = tmp_path / "venv" / "bin"
    fake.mkdir(parents=True)
    for entry in real.iterdir():
        if entry.name != "ray":
            (fake / entry.name).symlink_to(entry)
    run_real = f'"{real / "ray"}" "$@"; rc=$?' if when == "as the submit returns" else "rc=130"
    (fake / "ray").write_text(f"#!/bin/bash\n{run_real}\nkill -INT 0\nexit $rc\n")
    (fake / "ray").chmod(0o755)
    proc = subprocess.run([str(REPO / "cluster" / "local.sh"), "submit", "--", "python", "-c", "import time; "
                           "time.sleep(120)"], env=dict(ray_cluster, VENV=str(fake.parent)), cwd=REPO,
                          capture_output=True, text=True, timeout=120, start_new_session=True,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    job_id = re.search(r"stopping job '(embed-[\w-]+)'", proc.stderr)
    assert proc.returncode == 130 and job_id, proc.stdout + proc.stderr
    verdict = f"Job '{job_id.group(1)}' " + ("STOPPED" if when == "as the submit returns" else "NOT SUBMITTED")
    assert proc.stdout.strip().splitlines()[-1] == verdict, proc.stdout + proc.stderr
    # what the cluster's job API says of it (asked as local.sh asks it): stopped, or no such job
    api = runpy.run_path(str(REPO / "cluster" / "dashboard.py"))["_api"]
    token = Path(ray_cluster.get("RAY_AUTH_TOKEN_PATH") or Path(ray_cluster["EMBED_RAY_DIR"]) / "auth_token")
    try:
        status = api(f"http://127.0.0.1:{ray_cluster['RAY_DASHBOARD_PORT']}/api/jobs/{job_id.group(1)}",
                     token.read_text().strip())["status"]
    except urllib.error.HTTPError as exc:
        status = exc.code
    assert status == ("STOPPED" if when == "as the submit returns" else 404)


def test_the_isolation_plot_draws_a_shared_value_as_one_category_and_log_axes_without_crowded_labels():
    """plots/isolation.png of a sweep: a value every trial shares (width 128) was a numeric axis spread around it
    (122.5 ... 135.0), and weight decay's log axis labelled every minor tick (3x10^-3, 4x10^-3, ... overlapping)."""
    from sweeps.report import isolation_plot

    rows = [{"width": 128, "weight_decay": wd, "gamma": g, "adapter": "pair_gated", "delta_val_mean": d}
            for wd, g, d in [(0.003, 0.2, 0.004), (0.004, 0.5, 0.009), (0.02, 0.7, 0.012), (0.05, 1.0, 0.010)]]
    fig = isolation_plot(rows, ["width", "weight_decay", "gamma", "adapter", "not_in_rows"])
    fig.canvas.draw()
    axes = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert sorted(axes) == ["adapter", "gamma", "weight_decay", "width"]
    assert [t.get_text() for t in axes["width"].get_xticklabels()] == ["128"]
    assert axes["weight_decay"].get_xscale() == "log"
    assert not any(t.get_text() for t in axes["weight_decay"].get_xticklabels(minor=True))
    assert axes["gamma"].get_xscale() == "linear" and len(axes["gamma"].collections[0].get_offsets()) == 4
