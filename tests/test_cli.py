from __future__ import annotations

import json

import pytest

from embed_lib.cli import baseline_rows, main


def test_stsb_test_spearman_matches_the_published_figure(stsb_embedded):
    """0.820 is the public figure for all-MiniLM-L6-v2 on STS-B test: checks data, weights and pooling."""
    rows = {r["split"]: r for r in baseline_rows(stsb_embedded)}
    assert rows["test"]["spearman"] == pytest.approx(0.820, abs=0.002)
    assert rows["test"]["n"] == 1379


def test_baseline_command_writes_table(tmp_path, stsb_embedded, capsys):
    out = tmp_path / "b.md"
    assert main(["baseline", "--task", "stsb", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| stsb | test | 1379 | 0.820" in printed
    data = json.loads(out.with_suffix(".json").read_text())
    assert {r["split"] for r in data["rows"]} == {"train", "validation", "test"}
    assert "official split" in out.read_text()


def test_unknown_task_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["baseline", "--task", "foo"])
    assert exc.value.code == 2
    assert "--task 'foo' is unknown. Valid tasks: ['mrpc', 'paws', 'qqp', 'stsb'] or 'all'" in capsys.readouterr().err
