"""Sweeps end to end: real Ray cluster, `ray job submit`, real MLflow (sqlite), the registry."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[1]


def _submit(env, *args, timeout=600):
    cmd = [str(REPO / "cluster" / "local.sh"), "submit", "--", "python", "sweeps/pair_residual.py", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.fixture()
def sweep_env(ray_cluster, tmp_path, stsb_embedded):
    env = dict(ray_cluster, MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}",
               EMBED_STORAGE_DIR=str(tmp_path / "ray_results"))
    return env


def _client(env):
    import mlflow

    return mlflow.MlflowClient(env["MLFLOW_TRACKING_URI"])


def _children(client, exp_id, parent_id):
    return client.search_runs([exp_id], f"tags.`mlflow.parentRunId` = '{parent_id}'")


@pytest.mark.slow
def test_smoke_sweep_through_ray_job_submit(sweep_env):
    out = _submit(sweep_env, "--task", "stsb", "--smoke-test")
    assert "SUCCEEDED" in out
    client = _client(sweep_env)
    exp = client.get_experiment_by_name("sweep-stsb")
    (parent,) = client.search_runs([exp.experiment_id], "tags.sweep = 'pair_residual-stsb-smoke'")
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["git_commit"] and "pair_residual.py" in parent.data.tags["command"]
    assert parent.data.params["search"] == "optuna" and parent.data.metrics["trials_complete"] == 3
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"leaderboard.csv", "leaderboard.md", "cache_manifest.json", "teacher.json", "plots"} <= artifacts
    trials = [r for r in _children(client, exp.experiment_id, parent.info.run_id) if "trial_id" in r.data.tags]
    assert len(trials) == 3 and all(r.info.status == "FINISHED" for r in trials)
    assert parent.data.params["transfer"] == "mrpc,paws,qqp" and "winner_rule" in parent.data.tags
    # what a person reads in the MLflow UI: the run's description, the experiment opened as model training
    assert "Winner rule:" in parent.data.tags["mlflow.note.content"] and "3 configurations complete" in \
        parent.data.tags["mlflow.note.content"]
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    assert {i.dataset.name for i in parent.inputs.dataset_inputs} == {"stsb-train", "stsb-validation", "stsb-test"}
    for r in trials:
        assert {"delta_val_mean", "delta_val_positive", "val_delta_mean", "transfer_delta_min",
                "transfer/paws/delta_min", "transfer/qqp/delta_mean"} <= set(r.data.metrics)
        assert len(client.get_metric_history(r.info.run_id, "seed/delta_val")) == 2  # two seeds
        assert len(client.get_metric_history(r.info.run_id, "val_delta_mean")) >= 2  # epochs + final


@pytest.mark.slow
def test_grid_sweep_registers_champion_then_challenger(sweep_env, stsb_embedded):
    from embed_lib.commands import baseline_rows

    frozen_val = {r["split"]: r for r in baseline_rows(stsb_embedded)}["validation"]["spearman"]
    args = ["--task", "stsb", "--no-teacher", "--search", "grid", "--grid", "adapter=pair_gated",
            "--grid", "target=lexical", "--grid", "gamma=0.05,0.1", "--seeds", "2", "--epochs", "2",
            "--transfer", "mrpc,paws", "--transfer-tolerance", "1.0"]  # 2 epochs: registration, not quality
    out = _submit(sweep_env, *args, "--name", "grid-a")
    assert "registered pair-residual-stsb version 1 as 'champion'" in out
    client = _client(sweep_env)
    champion = client.get_model_version_by_alias("pair-residual-stsb", "champion")
    assert str(champion.version) == "1" and float(champion.tags["val_spearman"]) > frozen_val
    # the rule and the transfer figures it was chosen on travel with the version
    assert "every transfer delta >= -1 on every seed" in champion.tags["winner_rule"]
    assert {"transfer_delta_min", "transfer_delta_min.mrpc", "transfer_delta_min.paws"} <= set(champion.tags)
    assert "worst transfer delta" in champion.description and "transfer_delta_min.qqp" not in champion.tags
    # the same sweep again: equal validation, so the new version must not displace the champion
    out = _submit(sweep_env, *args, "--name", "grid-b")
    assert "version 2 as 'challenger'" in out
    assert str(client.get_model_version_by_alias("pair-residual-stsb", "champion").version) == "1"
    assert str(client.get_model_version_by_alias("pair-residual-stsb", "challenger").version) == "2"
    from embed_lib.registry import load_registered

    model, cfg, manifest = load_registered("models:/pair-residual-stsb@champion", sweep_env["MLFLOW_TRACKING_URI"])
    assert cfg.adapter == "pair_gated" and cfg.n_seeds == 2 and manifest["encoder"] == "minilm"


@pytest.mark.slow
def test_resume_after_the_driver_is_killed(sweep_env):
    args = [sys.executable, "sweeps/pair_residual.py", "--task", "stsb", "--no-teacher", "--search", "grid",
            "--grid", "adapter=pair_gated", "--grid", "target=lexical", "--grid", "gamma=0.02,0.05,0.1,0.2",
            "--seeds", "2", "--epochs", "3", "--max-concurrent", "1", "--name", "resume-me"]
    driver = subprocess.Popen(args, env=sweep_env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    client = _client(sweep_env)
    deadline = time.time() + 300
    finished = []
    while time.time() < deadline and len(finished) < 1:
        time.sleep(2)
        exp = client.get_experiment_by_name("sweep-stsb")
        if exp is not None:
            finished = client.search_runs([exp.experiment_id], "tags.trial_id != '' and attributes.status = 'FINISHED'")
        assert driver.poll() is None, "the sweep ended before it could be interrupted"
    assert finished, "no trial finished within 300 s"
    time.sleep(3)  # let Tune write its experiment state
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait()
    resumed = subprocess.run([*args, "--resume"], env=sweep_env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    exp = client.get_experiment_by_name("sweep-stsb")
    (parent,) = client.search_runs([exp.experiment_id], "tags.sweep = 'resume-me'")
    assert parent.info.status == "FINISHED"
    runs = [r for r in _children(client, exp.experiment_id, parent.info.run_id) if "trial_id" in r.data.tags]
    trial_ids = [r.data.tags["trial_id"] for r in runs]
    assert len(trial_ids) == len(set(trial_ids)) == 4, "one MLflow run per trial, none duplicated"
    assert all(r.info.status in ("FINISHED",) for r in runs), [r.info.status for r in runs]


def test_per_sentence_sweep_smoke(sweep_env):
    proc = subprocess.run([sys.executable, "sweeps/per_sentence.py", "--task", "stsb", "--smoke-test", "--no-teacher",
                           "--experiment", "per-sentence"], env=sweep_env, cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    client = _client(sweep_env)
    exp = client.get_experiment_by_name("per-sentence")
    runs = client.search_runs([exp.experiment_id], "tags.trial_id != ''")
    assert len(runs) == 3 and all(r.data.params["adapter"].startswith("per_sentence") for r in runs)
    assert all(r.data.params["epochs"] == "2" for r in runs)  # the smoke test fixes epochs; it is not searched


@pytest.mark.slow
def test_a_sweep_on_your_own_pair_file_through_ray_job_submit(sweep_env, tmp_path, data_dir):
    """A CSV of pairs (other column names, scores 0-5, no split column) swept through `ray job submit`:
    experiment sweep-<name>, the dataset as the run's input, the winner registered as pair-residual-<name>."""
    import pandas as pd

    from embed_lib.tasks import load_splits

    d = load_splits("stsb", ("train",), data_dir)["train"]
    pd.DataFrame({"q1": d.sentence1[:300], "q2": d.sentence2[:300], "sim": d.raw_label[:300]}).to_csv(
        tmp_path / "support_pairs.csv", index=False)  # an absolute path: every node of this cluster reads it
    out = _submit(sweep_env, "--task", str(tmp_path / "support_pairs.csv"), "--text-columns", "q1,q2",
                  "--label-column", "sim", "--label-range", "0,5", "--smoke-test", "--no-teacher",
                  "--transfer", "mrpc")
    assert "SUCCEEDED" in out
    client = _client(sweep_env)
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
