"""Sweeps that register and resume: champion then challenger through `ray job submit`, and a sweep whose
driver is killed resumed with --resume (real Ray cluster, real MLflow sqlite store). Apart from
test_sweeps.py so that the two longest sweep tests run beside the others on a second worker."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.sweeps_common import REPO, child_runs, mlflow_client, submit_sweep

pytestmark = pytest.mark.integration


@pytest.mark.slow
def test_grid_sweep_registers_champion_then_challenger(sweep_env, stsb_embedded):
    from embed_lib.cli.commands import baseline_rows

    frozen_val = {r["split"]: r for r in baseline_rows(stsb_embedded)}["validation"]["spearman"]
    args = ["--task", "stsb", "--no-teacher", "--search", "grid", "--grid", "adapter=pair_gated",
            "--grid", "target=lexical", "--grid", "gamma=0.05,0.1", "--seeds", "2", "--epochs", "2",
            "--transfer", "mrpc,paws", "--transfer-tolerance", "1.0"]  # 2 epochs: registration, not quality
    out = submit_sweep(sweep_env, *args, "--name", "grid-a")
    assert "registered pair-residual-stsb version 1 as 'champion'" in out
    client = mlflow_client(sweep_env)
    champion = client.get_model_version_by_alias("pair-residual-stsb", "champion")
    assert str(champion.version) == "1" and float(champion.tags["val_spearman"]) > frozen_val
    # the rule and the transfer figures it was chosen on travel with the version
    assert "every transfer delta >= -1 on every seed" in champion.tags["winner_rule"]
    assert {"transfer_delta_min", "transfer_delta_min.mrpc", "transfer_delta_min.paws"} <= set(champion.tags)
    assert "worst transfer delta" in champion.description and "transfer_delta_min.qqp" not in champion.tags
    # (a limited run's own name, end to end: tests/test_mlflow_cut.py; a limited run under the real name:
    # tests/test_promotion.py)
    # the same sweep again: equal validation, so the new version must not displace the champion
    out = submit_sweep(sweep_env, *args, "--name", "grid-b")
    assert "version 2 as 'challenger'" in out and "not promoted: not better on the rule's figure" in out
    for v in ("1", "2"):  # every version: validation fingerprint, encoder key, promotion record
        tags = client.get_model_version("pair-residual-stsb", v).tags
        assert tags["val_pairs"] == str(len(stsb_embedded.splits["validation"].ia)) and tags["encoder_key"] and json.loads(tags["promotion"])["reason"]
    assert str(client.get_model_version_by_alias("pair-residual-stsb", "champion").version) == "1"
    assert str(client.get_model_version_by_alias("pair-residual-stsb", "challenger").version) == "2"
    from embed_lib.tracking.registry import load_registered

    model, cfg, manifest = load_registered("models:/pair-residual-stsb@champion", sweep_env["MLFLOW_TRACKING_URI"])
    assert cfg.adapter == "pair_gated" and cfg.n_seeds == 2 and manifest["encoder"] == "minilm"


def _text(output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def _wait_for_a_terminated_trial_in_tune_state(experiment_dir: Path, timeout_s: float = 120) -> None:
    """Until Tune's experiment state on disk records a finished trial (what --resume reads): killing the driver
    before then would test a resume with nothing to skip."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        for state in experiment_dir.glob("experiment_state-*.json"):
            try:
                trials = json.loads(state.read_text())["trial_data"]
            except (OSError, ValueError, KeyError):
                continue  # being written
            if any(json.loads(t[0]).get("status") == "TERMINATED" for t in trials):
                return
        time.sleep(0.5)
    raise AssertionError(f"Tune recorded no finished trial in {experiment_dir} within {timeout_s} s")


def _wait_for_a_finished_trial_run(client, sweep: subprocess.Popen, timeout_s: float = 300):
    """Until the sweep's MLflow store holds a finished trial run (the sweep still running); its experiment."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        time.sleep(1)
        exp = client.get_experiment_by_name("sweep-stsb")
        if exp is not None and client.search_runs([exp.experiment_id],
                                                  "tags.trial_id != '' and attributes.status = 'FINISHED'"):
            return exp
        assert sweep.poll() is None, "the sweep ended before it could be interrupted"
    raise AssertionError(f"no trial finished within {timeout_s:.0f} s")


@pytest.mark.slow
def test_resume_after_the_driver_is_killed(sweep_env):
    args = [sys.executable, "sweeps/pair_residual.py", "--task", "stsb", "--no-teacher", "--search", "grid",
            "--grid", "adapter=pair_gated", "--grid", "target=lexical", "--grid", "gamma=0.02,0.05,0.1,0.2",
            "--seeds", "2", "--epochs", "3", "--max-concurrent", "1", "--name", "resume-me"]
    driver = subprocess.Popen(args, env=sweep_env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    client = mlflow_client(sweep_env)
    _wait_for_a_finished_trial_run(client, driver)
    _wait_for_a_terminated_trial_in_tune_state(Path(sweep_env["EMBED_STORAGE_DIR"]) / "resume-me")
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait()
    try:
        resumed = subprocess.run([*args, "--resume"], env=sweep_env, cwd=REPO, capture_output=True, text=True,
                                 timeout=600)
    except subprocess.TimeoutExpired as exc:  # what it was waiting on, not only that it waited
        pytest.fail(f"--resume did not end in 600 s:\n{_text(exc.stdout)[-4000:]}\n{_text(exc.stderr)[-4000:]}")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    exp = client.get_experiment_by_name("sweep-stsb")
    (parent,) = client.search_runs([exp.experiment_id], "tags.sweep = 'resume-me'")
    assert parent.info.status == "FINISHED"
    runs = [r for r in child_runs(client, exp.experiment_id, parent.info.run_id) if "trial_id" in r.data.tags]
    trial_ids = [r.data.tags["trial_id"] for r in runs]
    assert len(trial_ids) == len(set(trial_ids)) == 4, "one MLflow run per trial, none duplicated"
    assert all(r.info.status in ("FINISHED",) for r in runs), [r.info.status for r in runs]


@pytest.mark.slow
def test_ctrl_c_under_make_run_stops_the_sweep_registers_nothing_and_resume_finishes_it(sweep_env):
    """Ctrl-C where `make run` follows its job (`local.sh submit`): the job is stopped, its driver stops the trials
    through Tune (state saved), closes its MLflow runs KILLED and registers nothing; `--resume` then finishes the
    sweep. Before, a Ctrl-C'd sweep went on running, and one stopped (Tune's own Ctrl-C) registered the winner of
    the trials done so far as champion."""
    args = ["--task", "stsb", "--no-teacher", "--search", "grid", "--grid", "adapter=pair_gated", "--grid",
            "target=lexical", "--grid", "gamma=0.02,0.05,0.1,0.2", "--seeds", "2", "--epochs", "3",
            "--max-concurrent", "1", "--transfer", "mrpc", "--name", "stop-me"]
    job = subprocess.Popen([str(REPO / "cluster" / "local.sh"), "submit", "--", "python", "sweeps/pair_residual.py",
                            *args], env=sweep_env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as from a terminal
    client = mlflow_client(sweep_env)
    exp = _wait_for_a_finished_trial_run(client, job)
    os.killpg(job.pid, signal.SIGINT)
    out = job.communicate(timeout=180)[0]
    assert job.returncode != 0 and "Ctrl-C: stopping job" in out, out[-3000:]
    assert "sweep interrupted (SIGTERM):" in out or "sweep interrupted (the trials were stopped):" in out, out[-3000:]
    assert "nothing registered; resume with the same command and --resume (sweep 'stop-me')" in out, out[-3000:]
    assert out.rstrip().endswith("STOPPED"), out[-3000:]
    (parent,) = client.search_runs([exp.experiment_id], "tags.sweep = 'stop-me'")
    assert parent.info.status == "KILLED" and "nothing registered" in parent.data.tags["interrupted"]
    runs = child_runs(client, exp.experiment_id, parent.info.run_id)
    assert runs and all(r.info.status in ("FINISHED", "KILLED") for r in runs), [r.info.status for r in runs]
    assert client.search_registered_models() == []  # no winner of a partial sweep
    submit_sweep(sweep_env, *args, "--resume")
    (parent,) = client.search_runs([exp.experiment_id], "tags.sweep = 'stop-me'")
    assert parent.info.status == "FINISHED" and "interrupted" not in parent.data.tags
    assert parent.data.tags["resumed_after"].startswith("interrupted")
    trials = [r for r in child_runs(client, exp.experiment_id, parent.info.run_id) if "trial_id" in r.data.tags]
    assert sorted(r.data.tags["trial_id"][-1] for r in trials) == ["0", "1", "2", "3"]
    assert all(r.info.status == "FINISHED" for r in trials), [r.info.status for r in trials]
    assert str(client.get_model_version_by_alias("pair-residual-stsb", "champion").version) == "1"
