"""The teacher's folds at once, each in a process of its own, on a CPU machine (`fold_plan`, `run_folds`).

A cross-encoder's training step on small batches keeps a few CPU cores only partly busy: on 2 cores, one
process of 2 threads trains 49 pairs/s, two processes of one thread 66 together, three 64. So K folds in K
processes of `cores // K` threads (at least one) finish sooner than one after another on every thread. The
processes are spawned (never forked: the caller may hold Ray's or a server's threads) and send their progress
lines back here. Each fold seeds itself, so its model is the same whichever process trains it, up to the
rounding of a different thread count. `run_folds` also runs the intermediate stage's shards (`teacher.shards`).
"""
from __future__ import annotations

import math
import multiprocessing as mp
import os
import queue
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Sequence

#: the environment variable that sets the folds' processes where the caller passes none (0: decide, 1: one after
#: another in the calling process), so that a sweep, the CLI and the make targets all take it
ENV = "EMBED_TEACHER_FOLD_WORKERS"
#: a fold of fewer training examples (pairs x orders x epochs) than this trains in the calling process: starting a
#: worker (importing torch and the model, ~5 s) would cost more than the parallelism gains
MIN_EXAMPLES_PER_FOLD = 2000

_progress: Any = None  # the worker's queue of progress lines (set by _start)


def cpu_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def check_workers(workers: Any) -> None:
    """ValueError unless `workers` is None or a whole number >= 0."""
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 0):
        raise ValueError(f"fold_workers={workers!r}; give a whole number >= 1, or 0 / None to decide by the machine.")


def fold_plan(folds: int, examples_per_fold: int, device: str, workers: int | None = None,
              cores: int | None = None) -> tuple[int, int]:
    """(processes, torch threads of each) for the folds; (1, 0): one after another in this process, its threads as
    they are. workers None decides: on a CPU of 2 cores or more, folds of MIN_EXAMPLES_PER_FOLD examples or more all
    at once (at most two per core), the cores shared out; a GPU trains them one after another. 1: in this process.
    None also reads $EMBED_TEACHER_FOLD_WORKERS where it is set."""
    if workers is None and os.environ.get(ENV, "").strip():
        try:
            workers = int(os.environ[ENV])
        except ValueError:
            raise ValueError(f"{ENV}={os.environ[ENV]!r}; give a whole number: 1 trains the teacher's folds one "
                             "after another, 0 decides by the machine.") from None
        if workers < 0:
            raise ValueError(f"{ENV}={workers}; give 1 (one after another), 2 or more, or 0 (decide).")
    check_workers(workers)
    cores = cores or cpu_cores()
    if not workers:
        big = examples_per_fold >= MIN_EXAMPLES_PER_FOLD
        workers = min(folds, 2 * cores) if device == "cpu" and cores >= 2 and big else 1
    workers = min(workers, folds)
    return (1, 0) if workers <= 1 else (workers, max(1, cores // workers))


def _start(progress_queue, threads: int, parent: int) -> None:
    global _progress
    _progress = progress_queue
    threading.Thread(target=_end_with, args=(parent,), name="end-with-parent", daemon=True).start()
    import torch

    torch.set_num_threads(threads)


def _end_with(parent: int, every_s: float = 1.0) -> None:
    """Ends this worker once the process that started it is gone. A pool tells its workers to stop only when its
    process ends in order: one killed (SIGTERM, SIGKILL, `timeout`, a SIGINT to it alone) left the folds training
    as orphans, two or three processes busy for the rest of a fold (seen: three for 9 minutes and counting)."""
    while os.getppid() == parent:
        time.sleep(every_s)
    os._exit(1)


def _run(fn: Callable[..., Any], args: tuple) -> Any:
    return fn(*args, progress=_progress.put)


def _relay(q, progress: Callable[[str], None]) -> None:
    while True:
        try:
            progress(q.get_nowait())
        except queue.Empty:
            return


def run_folds(fn: Callable[..., Any], calls: Sequence[tuple], workers: int, threads: int,
              progress: Callable[[str], None]) -> list[Any]:
    """[fn(*args, progress=...) for args in calls], in that order: in `workers` spawned processes of `threads` torch
    threads each, their progress lines passed to `progress` here; with workers <= 1 in this process, one after
    another. `fn` and its arguments must be picklable (a module-level function)."""
    if workers <= 1:
        return [fn(*args, progress=progress) for args in calls]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    try:
        with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_start,
                                 initargs=(q, threads, os.getpid())) as pool:
            pending = futures = [pool.submit(_run, fn, args) for args in calls]
            while pending:
                _, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
                _relay(q, progress)
            results = [f.result() for f in futures]
    except BrokenProcessPool as exc:
        guard = 'if __name__ == "__main__":'
        raise RuntimeError(
            f"A worker process training the teacher (a fold, or a shard of its intermediate stage) died ({exc}). "
            f"Out of memory? Train the folds one after another ({ENV}=1 in the environment, or "
            "teacher_scores(fold_workers=1)) and the stage in one process (TeacherConfig.stage_shards=1). Or a script "
            "calls this at import: every worker process re-imports the script that started it (spawn), so the "
            f"script's top-level calls must sit under `{guard}` (the worker's own error, above, says so)."
        ) from None
    _relay(q, progress)  # lines sent just before a worker finished
    return results


def examples_per_fold(n_train: int, folds: int, both_orders: bool, epochs: int) -> int:
    """Training examples one fold sees: its share of the train pairs, both orders, every epoch."""
    return math.ceil(n_train * (folds - 1) / folds) * (2 if both_orders else 1) * epochs
