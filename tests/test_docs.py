"""The documents stay true: every figure of results/README.md equals its file at the row's rounding, the README's
headline figures are among them, and every code block of README.md and docs/*.md runs (on the data the tests read,
in a temporary directory, against a store with a registered champion where the block says so) or is marked skipped
with its reason."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

RESULTS = REPO / "results"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ROW = re.compile(r"^\| (?P<claim>[^|]+) \| (?P<figure>[^|]+) \| `(?P<command>[^`]+)` \| \[(?P<file>[^\]]+)\]\((?P=file)\) "
                 r"`(?P<pointer>[^`]+)` \| (?P<machine>[^|]+) \|$")
NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
MARK = re.compile(r"^<!-- docs: (run(?: with-champion)?|skip (?P<reason>.+)) -->$")


def pointer_get(doc, pointer: str):
    """RFC 6901: /a/0/b~1c -> doc['a'][0]['b/c']."""
    for part in pointer.lstrip("/").split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


def result_rows() -> list[dict]:
    rows = [m.groupdict() for line in (RESULTS / "README.md").read_text().splitlines() if (m := ROW.match(line))]
    assert len(rows) >= 30, "results/README.md lost its tables"
    return rows


@pytest.mark.parametrize("row", result_rows(), ids=lambda r: f"{r['file']}{r['pointer']}")
def test_each_results_figure_equals_its_file(row):
    doc = json.loads((RESULTS / row["file"]).read_text())
    value = pointer_get(doc, row["pointer"])
    shown = NUMBER.search(row["figure"]).group()
    decimals = len(shown.split(".")[1]) if "." in shown else 0
    assert isinstance(value, (int, float)), (row["pointer"], value)
    assert round(float(value), decimals) == pytest.approx(float(shown), abs=0.51 * 10 ** -decimals), (
        f"results/README.md says {row['figure']} for {row['claim']!r}; {row['file']}{row['pointer']} holds {value}")
    machine = doc.get("machine") if isinstance(doc, dict) else None
    if machine:
        assert f"{machine['cpus']} cores" in row["machine"] and machine.get("cpu_model", "CPU model not recorded") in \
            row["machine"], (row["machine"], machine)
    else:
        assert row["machine"].strip() == "not recorded in the file"
    assert (REPO / "results" / row["file"]).is_file() and row["command"].strip()


def test_the_readme_is_a_guide_and_its_headline_figures_are_results():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    figures = {NUMBER.search(r["figure"]).group() for r in result_rows()}
    headline = [line for line in readme.splitlines() if line.startswith("| [")]
    assert 1 <= len(headline) <= 6
    for line in headline:
        cell = line.rstrip(" |").rsplit("|", 1)[1]
        for number in NUMBER.findall(cell):
            assert number in figures, f"README headline figure {number} is not in results/README.md: {line}"
        assert "(results/README.md#" in line


def code_blocks() -> list[tuple[str, int, str, str, str]]:
    """(document, line, language, mark, code) of every fenced shell or Python block."""
    out = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            fence = re.match(r"^```(\w*)$", lines[i])
            if fence and fence.group(1):
                end = next(j for j in range(i + 1, len(lines)) if lines[j] == "```")
                mark = lines[i - 1] if i and MARK.match(lines[i - 1]) else ""
                if fence.group(1) in ("bash", "sh", "python"):
                    out.append((path.relative_to(REPO).as_posix(), i + 1, fence.group(1), mark, "\n".join(lines[i + 1:end])))
                i = end
            i += 1
    return out


@pytest.fixture(scope="module")
def docs_env(tmp_path_factory, data_dir):
    """A working directory with the documents' example files (my_pairs.csv: 40 / 20 / 20 STS-B pairs with a split
    column, repeats dropped, holdout.csv: 20 test pairs), and a store where a small champion is registered."""
    import pandas as pd

    from embed_lib.data.tasks import load_task

    work = tmp_path_factory.mktemp("docs")
    frames = []
    for split, n in (("train", 40), ("validation", 20), ("test", 20)):
        d = load_task("stsb", split, data_dir)
        frames.append(pd.DataFrame({"a": d.sentence1[:n], "b": d.sentence2[:n], "score": 5 * d.label[:n], "split": split}))
    # STS-B repeats a few pairs across its official splits, which a pair file may not (the file check refuses it)
    pd.concat(frames).drop_duplicates(["a", "b"]).to_csv(work / "my_pairs.csv", index=False)
    test = load_task("stsb", "test", data_dir)
    pd.DataFrame({"a": test.sentence1[20:40], "b": test.sentence2[20:40], "score": 5 * test.label[20:40]}).to_csv(
        work / "holdout.csv", index=False)
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}", "HF_HUB_OFFLINE": "1",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    return work, env


@pytest.fixture(scope="module")
def champion(docs_env):
    """pair-residual-stsb@champion in the docs' store: a small adapter (200 pairs a split, 2 seeds, 2 epochs)."""
    import mlflow

    from embed_lib.config import AdapterConfig
    from embed_lib.pipeline.prepare import load_study
    from embed_lib.tracking.registry import evidence_of, log_adapter_model, promote
    from embed_lib.tracking.runs import set_experiment
    from embed_lib.training.seed_group import train_seed_group

    work, env = docs_env
    data, _ = load_study("stsb", limit=200)
    set_experiment("docs", env["MLFLOW_TRACKING_URI"])
    result = train_seed_group(AdapterConfig(adapter="pair_gated", target="lexical", n_seeds=2, epochs=2), data)
    with mlflow.start_run():
        info = log_adapter_model(result, data, registered_name="pair-residual-stsb")
    promote("pair-residual-stsb", info.registered_model_version, evidence_of(result, data))
    return "pair-residual-stsb"


@pytest.mark.parametrize("block", code_blocks(), ids=lambda b: f"{b[0]}:{b[1]}")
def test_every_documented_block_runs_or_says_why_not(block, docs_env, request):
    doc, line, language, mark, code = block
    assert mark, f"{doc}:{line}: mark the block <!-- docs: run --> or <!-- docs: skip REASON --> on the line above"
    m = MARK.match(mark)
    if m.group("reason"):  # a block marked as needing a service, a cluster or hours of training: said, with its reason
        pytest.skip(f"{doc}:{line}: {m.group('reason')}")
    if "with-champion" in mark:
        request.getfixturevalue("champion")
    work, env = docs_env
    code = code.replace(".venv/bin/python", sys.executable)
    argv = ["bash", "-euo", "pipefail", "-c", code] if language in ("bash", "sh") else [sys.executable, "-c", code]
    proc = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{doc}:{line} failed ({proc.returncode}):\n{out[-3000:]}"
    assert "Traceback" not in out and not re.search(r"^error: '\w+'$", out, re.M), f"{doc}:{line}:\n{out[-3000:]}"


def test_a_block_without_a_mark_fails_the_check(tmp_path):
    """The check above cannot pass a document whose block carries no mark."""
    lines = ["text", "```bash", "echo hi", "```"]
    i = 1
    assert not (i and MARK.match(lines[i - 1]))
    assert MARK.match("<!-- docs: skip needs a GPU -->").group("reason") == "needs a GPU"
    assert MARK.match("<!-- docs: run with-champion -->") and not MARK.match("<!-- docs: maybe -->")


#: what a results page, a guide or a comment must not lean on: a session's number, a file named by one, a commit id
#: (history lives in git), or a vague "this" machine (a figure names the machine it was measured on)
NOTEBOOK = {"a session number": re.compile(r"session [0-9]", re.I),
            "a file named by session": re.compile(r"_s[0-9][0-9]\."),
            "a commit id": re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"),
            "'this host'": re.compile(r"this host", re.I)}


def _prose_of_python(path: Path) -> str:
    """The comments and docstrings of a Python file (its string literals may hold any hex a test needs)."""
    import io
    import tokenize

    out, prev = [], None
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING and tok.string.lstrip("rbuRBU").startswith(
                ('"""', "'''")) and prev in (None, tokenize.INDENT, tokenize.NEWLINE, tokenize.NL, tokenize.DEDENT)):
            out.append(tok.string)
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            prev = tok.type
    return "\n".join(out)


def notebook_texts() -> dict[str, str]:
    """Every place the check reads: the guides, the results page, the names of the results files, the Makefile, and
    the comments and docstrings of the code."""
    texts = {p.relative_to(REPO).as_posix(): p.read_text()
             for p in [*DOCS, RESULTS / "README.md", REPO / "serving" / "README.md", REPO / "Makefile"] if p.is_file()}
    texts["results/ file names"] = "\n".join(p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*"))
    for folder in ("embed_lib", "sweeps", "serving", "cluster", "benchmarks", "tests"):
        for path in sorted((REPO / folder).rglob("*.py")):
            texts[path.relative_to(REPO).as_posix()] = _prose_of_python(path)
    return texts


def test_no_page_or_comment_reads_as_a_lab_notebook():
    found = [f"{where}: {what} ({m.group()!r})" for where, text in notebook_texts().items()
             for what, rx in NOTEBOOK.items() for m in [rx.search(text)] if m]
    assert not found, "history lives in git, figures name their machine:\n" + "\n".join(found)


def test_the_notebook_check_catches_each_pattern():
    for sample in ("rerun in session 28", "study_s36.json", "fresh clones of 635bc3b", "on this host"):
        assert any(rx.search(sample) for rx in NOTEBOOK.values()), sample
    for fine in ("a limit of 24089536 bytes", "deadbeef", "sessions", "the host's"):
        assert not any(rx.search(fine) for rx in NOTEBOOK.values()), fine


def test_the_results_page_is_short():
    assert len((RESULTS / "README.md").read_text().splitlines()) <= 300
