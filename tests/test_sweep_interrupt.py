"""sweeps.interrupt: what a signal does to a sweep at each step (the whole path, Ctrl-C under `make run`, runs in
tests/test_sweeps_registry.py)."""
from __future__ import annotations

import os
import signal

import mlflow
import pytest

from sweeps import interrupt


@pytest.fixture()
def parent(tmp_path):
    """A sweep's parent run with one trial run still RUNNING, in a store of the test's own."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    exp = mlflow.set_experiment("sweep-x")
    run = mlflow.start_run(run_name="x")
    client = mlflow.MlflowClient(uri)
    child = client.create_run(exp.experiment_id, tags={"mlflow.parentRunId": run.info.run_id, "trial_id": "t0"})
    yield uri, exp.experiment_id, run.info.run_id, child.info.run_id, client
    while mlflow.active_run():
        mlflow.end_run()


@pytest.mark.parametrize("where", ["precompute", "trials", "winner"])
def test_an_interrupted_sweep_ends_its_runs_killed_and_says_what_to_run_next(parent, tmp_path, where):
    uri, exp_id, parent_id, child_id, client = parent
    tune_dir = tmp_path / "ray_results" / "sweep-x"
    tune_dir.mkdir(parents=True)
    earlier = tune_dir / "experiment_state-2026-12-01.json"  # an earlier sweep of the same name: not this one's
    earlier.write_text("{}")
    os.utime(earlier, (1e9, 1e9))
    with pytest.raises(interrupt.SweepInterrupted) as err:
        with interrupt.ended_as_killed(uri, exp_id, parent_id, tune_dir):
            if where != "precompute":  # this sweep's Tune saved its experiment state: --resume can restore it
                (tune_dir / "experiment_state-2026-12-06.json").write_text("{}")
            if where == "winner":
                with interrupt.tuning():
                    pass  # the trials ended; the signal comes as the winner is registered
            raise KeyboardInterrupt("SIGTERM")
    message = str(err.value)
    expected = {"precompute": "nothing registered, no trial had started: run the same command again",
                "trials": "nothing registered; resume with the same command and --resume (sweep 'sweep-x')",
                "winner": "as the winner was registered: a version may be (`python -m embed_lib registry`); resume "
                          "with the same command and --resume (sweep 'sweep-x')"}[where]
    trials = "" if where == "precompute" else \
        ", and 1 trial run(s) still running; the finished trials' runs are kept"
    assert message == f"sweep interrupted (SIGTERM): {expected}. MLflow: the sweep run {parent_id} ended KILLED" \
        f"{trials}."
    assert client.get_run(parent_id).info.status == "KILLED" and client.get_run(child_id).info.status == "KILLED"
    assert client.get_run(parent_id).data.tags["interrupted"] == f"interrupted (SIGTERM): {expected}"
    # --resume reopens the run: the note moves to `resumed_after`
    interrupt.resumed(client.get_run(parent_id))
    tags = client.get_run(parent_id).data.tags
    assert "interrupted" not in tags and tags["resumed_after"] == f"interrupted (SIGTERM): {expected}"


def test_a_signal_while_trials_run_asks_tune_to_stop_and_a_second_one_stops_at_once():
    """The first SIGINT / SIGTERM inside `tuning` sends the process SIGUSR1 (Tune's graceful stop, registered by
    fit) and returns; `tuning` then raises, so that nothing is registered. Outside `tuning`, or a second time, the
    signal raises KeyboardInterrupt."""
    asked = []
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    tune_env = os.environ.get("TUNE_DISABLE_SIGINT_HANDLER")
    try:
        interrupt.install()
        assert os.environ["TUNE_DISABLE_SIGINT_HANDLER"] == "1"  # Tune leaves SIGINT to the sweep
        signal.signal(signal.SIGUSR1, lambda s, f: asked.append(s))  # stands for Tune's handler
        with pytest.raises(KeyboardInterrupt, match="the trials were stopped"):
            with interrupt.tuning():
                os.kill(os.getpid(), signal.SIGTERM)  # `ray job stop`
                assert asked == [signal.SIGUSR1]
                with pytest.raises(KeyboardInterrupt, match="SIGINT"):
                    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C again: at once
        interrupt.install()
        with pytest.raises(KeyboardInterrupt, match="SIGINT"):  # before the trials (encoding, the teacher)
            os.kill(os.getpid(), signal.SIGINT)
        assert asked == [signal.SIGUSR1]
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
        if tune_env is None:
            os.environ.pop("TUNE_DISABLE_SIGINT_HANDLER", None)
        interrupt.INTERRUPTED.clear()
