"""Progress of long steps: in a log, a line per interval with count, rate and ETA, never a bar."""
from __future__ import annotations

import io

from embed_lib.progress import Progress


def test_progress_in_a_log_prints_counted_lines_with_an_eta():
    out = io.StringIO()  # not a terminal: no bar, no carriage returns
    p = Progress(100, "encode minilm", every_s=0.0, stream=out)
    p.update(25)
    p.update(75)
    p.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("encode minilm: 25/100 sentences (25%),") and "ETA" in lines[0]
    assert lines[-1].startswith("encode minilm: 100/100 sentences (100%)") and "done in" in lines[-1]
    assert "\r" not in out.getvalue()


def test_short_steps_stay_quiet():
    out = io.StringIO()
    p = Progress(10, "encode", every_s=60.0, stream=out)
    p.update(10)
    p.close()
    assert out.getvalue() == ""


def test_progress_lines_can_go_to_a_callers_printer():
    """The teacher's epochs report through its progress printer (a per-task, per-fold prefix)."""
    lines = []
    p = Progress(4, "epoch 1/3", unit="batches", every_s=0.0, emit=lines.append)
    p.update(2)
    assert lines == [lines[0]] and lines[0].startswith("epoch 1/3: 2/4 batches (50%),") and "ETA" in lines[0]
