"""The fallback every outside user takes: no data mirror beside the clone and no Hub. The tests then make a small
data set once and hand its source to pytest-xdist's workers; the mirror's published figures are skipped with their
reason instead of being checked against the made set (before the source was handed on, 6 tests failed: 600 == 5749,
0.894 == 0.820, and the mirror's sizes for the derived splits)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_two_workers_with_no_mirror_and_no_hub_run_on_made_data(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EMBED_TEST_", "PYTEST_", "EMBED_DATA_DIR"))}
    env.update(EMBED_DATA_DIR=str(tmp_path / "no-mirror-here"), HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-rs",
                          "tests/test_tasks.py", "tests/test_cli.py"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=900)
    tail = out.stdout[-4000:] + out.stderr[-2000:]
    assert out.returncode == 0, tail
    assert "data: the small set the tests made" in out.stdout, tail
    skipped = re.findall(r"SKIPPED \[(\d+)\] .*figures of the data mirror; this run reads 'made' data", out.stdout)
    # the row counts of STS-B and MRPC, MRPC's positives and the encoder's 0.820: skipped, each with its reason
    assert sum(map(int, skipped)) == 4, tail
    assert re.search(r"\d+ passed, 4 skipped", out.stdout), tail
