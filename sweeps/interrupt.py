"""Ctrl-C, and `ray job stop`, end a sweep as stopped: nothing registered, its MLflow runs KILLED, `--resume` ready.

Before, Tune's own SIGINT handler stopped the trials and `Tuner.fit` returned as from a finished sweep: the sweep
then chose a winner among the trials done so far and registered it, possibly as champion. A job stopped by `ray job
stop` (SIGTERM; Ray's handler exits the driver) left its parent run to MLflow's exit hook, which ended it FINISHED.

Now the first SIGINT or SIGTERM while trials run asks Tune to stop as its Ctrl-C does (SIGUSR1, the graceful stop
Tune registers for every run: trials stopped, the experiment state saved for `--resume`) and marks the sweep
interrupted; before or after the trials, and at a second signal, it raises KeyboardInterrupt. `ended_as_killed` turns
either into `SweepInterrupted` once the runs are closed."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import mlflow

from sweeps.mlflow_callback import close_orphans

#: set by the first SIGINT / SIGTERM of the sweep
INTERRUPTED = threading.Event()
_tuning, _tuned = threading.Event(), threading.Event()


class SweepInterrupted(Exception):
    """The sweep stopped at a signal, its runs closed; the message says what was kept and how to resume."""


def _handler(signum: int, frame) -> None:
    first = not INTERRUPTED.is_set()
    INTERRUPTED.set()
    tune_stops = callable(signal.getsignal(signal.SIGUSR1))  # Tune's graceful stop, registered when fit() starts
    if first and _tuning.is_set() and tune_stops:
        print(f"\n{signal.Signals(signum).name}: stopping the trials (Tune saves the experiment state for --resume); "
              "nothing will be registered. Again to stop at once.", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGUSR1)
        return
    raise KeyboardInterrupt(signal.Signals(signum).name)


def install() -> None:
    """SIGINT and SIGTERM go to `_handler` (main thread only; after `ray.init`, whose SIGTERM handler it replaces);
    Tune leaves SIGINT alone (TUNE_DISABLE_SIGINT_HANDLER), so that the sweep knows it was interrupted."""
    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"
    INTERRUPTED.clear()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _handler)


@contextlib.contextmanager
def tuning() -> Iterator[None]:
    """Around `Tuner.fit()`: a signal inside asks Tune to stop; afterwards, an interrupted fit raises
    KeyboardInterrupt (Tune returns from a stopped run as from a finished one)."""
    _tuning.set()
    try:
        yield
    finally:
        _tuning.clear()
    if INTERRUPTED.is_set():
        raise KeyboardInterrupt("the trials were stopped")
    _tuned.set()


@contextlib.contextmanager
def ended_as_killed(tracking_uri: str, experiment_id: str, parent_run_id: str, tune_dir: Path) -> Iterator[None]:
    """KeyboardInterrupt inside (a signal, or `tuning`'s) -> the trial runs still RUNNING and the parent run end
    KILLED, the parent tagged `interrupted`; raised again as SweepInterrupted saying what to run next (`tune_dir`:
    the Tune experiment that --resume restores, once a trial has started)."""
    _tuned.clear()
    began = time.time() - 1  # a file's time stamp may lag the clock by a tick
    try:
        yield
    except KeyboardInterrupt as exc:
        closed = close_orphans(tracking_uri, experiment_id, parent_run_id)
        resume = f"resume with the same command and --resume (sweep '{tune_dir.name}')"
        # Tune's state saved by this sweep (an earlier sweep of the name left its own there)
        tuned = any(f.stat().st_mtime >= began for f in tune_dir.glob("experiment_state-*.json"))
        if _tuned.is_set():  # in finish_sweep: the winner retrained, tested, registered
            note = f"as the winner was registered: a version may be (`python -m embed_lib registry`); {resume}"
        elif tuned:
            note = f"nothing registered; {resume}"
        else:
            note = "nothing registered, no trial had started: run the same command again"
        note = f"interrupted ({exc or 'Ctrl-C'}): {note}"
        mlflow.set_tag("interrupted", note)
        mlflow.end_run(status="KILLED")
        trials = (f", and {closed} trial run(s) still running; the finished trials' runs are kept"
                  if tuned or _tuned.is_set() else "")
        raise SweepInterrupted(f"sweep {note}. MLflow: the sweep run {parent_run_id} ended KILLED{trials}.") from None


def resumed(run) -> None:
    """On --resume: the `interrupted` tag of an earlier stop kept as `resumed_after` (the run goes on, then ends as
    it ends)."""
    note = run.data.tags.get("interrupted")
    if note:
        client = mlflow.MlflowClient()
        client.set_tag(run.info.run_id, "resumed_after", note)
        client.delete_tag(run.info.run_id, "interrupted")
