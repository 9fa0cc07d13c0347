"""Your own pairs as a task: file formats, label kinds, splits, the validation rules and the commands."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from embed_lib.data.custom_tasks import CustomTask, register, slug_of
from embed_lib.data.tasks import CUSTOM, load_splits

SIZES = {"train": 120, "validation": 40, "test": 40}


@pytest.fixture(scope="module")
def pairs_frame(data_dir) -> pd.DataFrame:
    """Real STS-B pairs under other column names, scores 0-5, a split column (what a user's CSV looks like)."""
    stsb = load_splits("stsb", data_dir=data_dir)
    parts, seen = [], set()
    for split, n in SIZES.items():
        d = stsb[split]
        rows = [i for i in range(len(d)) if tuple(sorted((d.sentence1[i], d.sentence2[i]))) not in seen][:n]
        seen |= {tuple(sorted((d.sentence1[i], d.sentence2[i]))) for i in rows}  # STS-B repeats a few pairs
        parts.append(pd.DataFrame({"a": [d.sentence1[i] for i in rows], "b": [d.sentence2[i] for i in rows],
                                   "score": d.raw_label[rows], "split": split}))
    return pd.concat(parts, ignore_index=True)


def _write(frame: pd.DataFrame, path) -> str:
    suffix = path.suffix
    if suffix == ".csv":
        frame.to_csv(path, index=False)
    elif suffix == ".tsv":
        frame.to_csv(path, index=False, sep="\t")
    elif suffix == ".jsonl":
        frame.to_json(path, orient="records", lines=True)
    else:
        frame.to_parquet(path)
    return str(path)


@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".jsonl", ".parquet"])
def test_every_file_format_loads_the_same_pairs(pairs_frame, tmp_path, suffix):
    path = _write(pairs_frame, tmp_path / f"My Pairs{suffix}")
    spec = CustomTask.from_args(path, ("a", "b"), "score", (0, 5))
    assert spec.name == "my_pairs"
    splits = spec.load()
    assert {k: len(v) for k, v in splits.items()} == SIZES
    tr = splits["train"]
    assert tr.sentence1[0] == pairs_frame["a"][0] and not tr.binary
    np.testing.assert_allclose(tr.label, pairs_frame["score"][:120].to_numpy(dtype=float) / 5, atol=1e-6)
    assert "split column" in tr.split_note


def test_binary_labels_are_detected_and_a_seeded_split_is_named(pairs_frame, tmp_path):
    frame = pairs_frame.drop(columns="split").assign(score=(pairs_frame["score"] >= 3).astype(int))
    spec = CustomTask.from_args(_write(frame, tmp_path / "dups.csv"), ("a", "b"), "score")
    splits = spec.load()
    assert all(d.binary for d in splits.values())
    assert sum(len(d) for d in splits.values()) == 200 and 130 <= len(splits["train"]) <= 150
    assert "seeded 70/15/15 split" in splits["test"].split_note
    again = CustomTask.from_args(_write(frame, tmp_path / "dups2.csv"), ("a", "b"), "score").load()
    assert again["test"].sentence1 == splits["test"].sentence1  # the seed fixes the split


def test_a_file_for_evaluation_only(pairs_frame, tmp_path):
    frame = pairs_frame[pairs_frame.split == "test"].drop(columns="split")
    splits = CustomTask.from_args(_write(frame, tmp_path / "eval.csv"), ("a", "b"), "score", (0, 5),
                                  eval_split="test").load()
    assert list(splits) == ["test"] and len(splits["test"]) == 40


@pytest.mark.parametrize("edit,message", [
    (lambda f: f.drop(columns="b"), "eval.csv, column 'b': column not found; the columns are"),
    (lambda f: f.iloc[0:0], "eval.csv: no pairs: the file names its columns and has no rows"),
    (lambda f: f.assign(a=f.a.where(f.index != 4, "  ")), "eval.csv, row 5, column 'a': text is empty."),
    (lambda f: f.assign(b=f.b.where(f.index != 6, "")),  # an empty CSV cell: pandas reads NaN
     "eval.csv, row 7, column 'b': text is missing (an empty cell); fill it in or drop the row."),
    (lambda f: f.assign(score=f.score.astype(object).where(f.index != 7, "high")),
     "eval.csv, row 8, column 'score': label must be a number; found 'high'."),
    (lambda f: f.assign(score=f.score.where(f.index != 2, None)), "eval.csv, row 3, column 'score': label is missing."),
    (lambda f: f.assign(score=f.score.where(f.index != 9, 7.5)),
     "eval.csv, row 10, column 'score': label 7.5 lies outside --label-range 0,5."),
    (lambda f: f.assign(split=f.split.where(f.index != 11, "holdout")),
     "eval.csv, row 12, column 'split': unknown split 'holdout'"),
    (lambda f: f[(f.split != "test") | (f.index < 165)], "split 'test' has 5 pairs; at least 10 are needed."),
    (lambda f: f.assign(score=f.score.where(f.split != "validation", 3.0)),  # a Spearman of it would be NaN
     "eval.csv, column 'score': every label of split 'validation' is 3 (40 pairs); scoring it needs labels that "
     "differ"),
    (lambda f: pd.concat([f, f.iloc[[0]].assign(split="test")], ignore_index=True),
     "eval.csv, row 201: the pair also appears in row 1 in split 'train'"),
])
def test_every_rule_names_file_row_and_column(pairs_frame, tmp_path, edit, message):
    path = _write(edit(pairs_frame.copy()), tmp_path / "eval.csv")
    with pytest.raises(ValueError) as e:
        CustomTask.from_args(path, ("a", "b"), "score", (0, 5)).load()
    assert message in str(e.value)


@pytest.mark.parametrize("name,text,message", [
    # every row one field more than the header: pandas took the first column as the index, so the pair read was
    # ("y", "4") with the label 5, without a word
    ("shift.csv", 'a,b,score\n"x, y",z,4,5\n"p, q",r,3,1\n', "shift.csv, row 1: 4 fields where the header has 3; "
                                                                 'quote a text that holds a comma ("a, b").'),
    # one row of more fields: pandas' tokenizer error, now with the row and the fix
    ("one.csv", 'a,b,score\nx,y,4\nx, y,z,4\n', "one.csv, row 2: 4 fields where the header has 3"),
    ("one.tsv", "a\tb\tscore\nx\ty\t1\tz\n", "one.tsv, row 1: 4 fields where the header has 3; quote a text "
                                                 "that holds a tab."),
])
def test_a_row_of_more_fields_than_the_header_is_named_never_shifted(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        CustomTask.from_args(str(path), ("a", "b"), "score", (0, 5), eval_split="test").load()
    assert message in str(e.value) and "cannot be read" not in str(e.value)


@pytest.mark.parametrize("name,text,message", [
    ("semi.csv", "a;b;score\nx;y;4\n", "semi.csv, column 'a': column not found; the columns are ['a;b;score'] (name "
                                      "them with --text-columns A,B and --label-column C); its header holds ';': a "
                                      ".csv must be comma-separated and a .tsv tab-separated"),
    ("comma.tsv", "a,b,score\nx,y,4\n", "its header holds ','"),
])
def test_a_file_of_another_separator_says_which_it_holds(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        CustomTask.from_args(str(path), ("a", "b"), "score", (0, 5), eval_split="test").load()
    assert message in str(e.value)


def test_json_lines_name_the_bad_line_and_booleans_are_binary_labels_only(tmp_path):
    """A .jsonl line that is not a JSON object is named by its row (pandas named a byte position); true / false
    labels read as 1 / 0 in a binary file, and are refused on a graded scale (they read as 1 there, silently)."""
    import json

    rows = [{"a": f"sentence {i}", "b": f"other {i}", "score": i % 2 == 0} for i in range(20)]
    path = tmp_path / "dups.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    for binary in (True, False):  # declared, and told from the values
        test = CustomTask.from_args(str(path), ("a", "b"), "score", binary=binary, eval_split="test").load()["test"]
        assert test.binary and test.label.tolist() == [float(i % 2 == 0) for i in range(20)]
    graded = [{**r, "score": 2.5} for r in rows]
    graded[5]["score"] = True
    path.write_text("\n".join(json.dumps(r) for r in graded))
    with pytest.raises(ValueError, match=re.escape("dups.jsonl, row 6, column 'score': label must be a number; found "
                                                   "True (true / false are labels of --binary).")):
        CustomTask.from_args(str(path), ("a", "b"), "score", (0, 5), eval_split="test").load()
    for bad, message in (("{not json}", "row 3: not JSON (Expecting property name enclosed in double quotes, "
                                        "column 2)"),
                         ('["a", "b", 1]', "row 3: a JSON value that is not an object; each line holds one object")):
        path.write_text("\n".join([json.dumps(rows[0]), json.dumps(rows[1]), bad, json.dumps(rows[2])]))
        with pytest.raises(ValueError, match=re.escape(f"dups.jsonl, {message}")):
            CustomTask.from_args(str(path), ("a", "b"), "score", binary=True, eval_split="test").load()


def test_graded_labels_need_a_declared_scale_and_names_are_slugs(pairs_frame, tmp_path):
    path = _write(pairs_frame, tmp_path / "graded.csv")
    lo, hi = pairs_frame.score.min(), pairs_frame.score.max()
    with pytest.raises(ValueError, match=re.escape(f"labels range over [{lo:g}, {hi:g}]: declare their scale with "
                                                   "--label-range")):
        CustomTask.from_args(path, ("a", "b"), "score").load()
    with pytest.raises(ValueError, match="is a built-in task"):
        CustomTask.from_args(path, ("a", "b"), "score", (0, 5), name="stsb")
    with pytest.raises(ValueError, match="is not a slug"):
        CustomTask.from_args(path, ("a", "b"), "score", (0, 5), name="My Pairs!")
    with pytest.raises(FileNotFoundError, match="No pair file"):
        CustomTask.from_args(str(tmp_path / "nope.csv"))
    for empty in ("hf:", "hf: ", "hf::cfg"):
        with pytest.raises(ValueError, match=re.escape(f"--task {empty!r} names no dataset: give hf:<dataset id>")):
            CustomTask.from_args(empty, name="x")
    for columns in (("a",), ("a", "b", "score"), ("a", "a")):  # one column twice would pair each sentence with itself
        with pytest.raises(ValueError, match=re.escape(f"--text-columns needs exactly two column names, one per "
                                                       f"sentence of a pair; got {list(columns)}")):
            CustomTask.from_args(path, columns, "score", (0, 5))
    assert slug_of("hf:org/Some-Set:cfg") == "some-set_cfg" and slug_of("x/Q&A pairs.v2.jsonl") == "q_a_pairs_v2"


def test_a_registered_task_trains_like_a_built_in_one(pairs_frame, tmp_path, encoder):
    from embed_lib.config import AdapterConfig
    from embed_lib.pipeline.prepare import load_study
    from embed_lib.training.seed_group import train_seed_group

    name = register(CustomTask.from_args(_write(pairs_frame, tmp_path / "reg.csv"), ("a", "b"), "score", (0, 5)))
    assert name == "reg" and name in CUSTOM
    data, _ = load_study(name)
    r = train_seed_group(AdapterConfig(task=name, adapter="pair_ungated", target="none", epochs=2, n_seeds=2), data)
    assert r.config.task == "reg" and np.isfinite(r.summary["delta_val_mean"])


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "embed_lib", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=600)


def test_baseline_command_on_a_pair_file(pairs_frame, tmp_path):
    path = _write(pairs_frame, tmp_path / "my_pairs.csv")
    out = tmp_path / "baseline.md"
    proc = _cli("baseline", "--task", path, "--text-columns", "a,b", "--label-column", "score", "--label-range", "0,5",
                "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert {(r["task"], r["split"]) for r in rows} == {("my_pairs", s) for s in SIZES}
    assert all(0.5 < r["spearman"] <= 1 for r in rows)  # the frozen cosine on real STS-B pairs


def test_baseline_of_a_file_for_evaluation_only(pairs_frame, tmp_path):
    """The README's evaluation-only example: a file with one split (it failed with the bare `error: 'train'`)."""
    path = _write(pairs_frame[pairs_frame.split == "test"].drop(columns="split"), tmp_path / "pairs.csv")
    out = tmp_path / "baseline.md"
    proc = _cli("baseline", "--task", path, "--text-columns", "a,b", "--label-column", "score", "--label-range", "0,5",
                "--split", "test", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert (row["split"], row["n"]) == ("test", 40) and 0.5 < row["spearman"] <= 1


def test_a_bad_file_fails_in_one_line_and_writes_nothing(pairs_frame, tmp_path):
    bad = pairs_frame.assign(score=pairs_frame.score.where(pairs_frame.index != 3, 9.0))
    path = _write(bad, tmp_path / "bad.csv")
    cache = tmp_path / "cache"
    proc = _cli("train", "--task", path, "--text-columns", "a,b", "--label-column", "score", "--label-range", "0,5",
                "--cache-dir", str(cache), "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}", cwd=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"error: {path}, row 4, column 'score': label 9 lies outside --label-range 0,5."], proc.stderr
    assert not cache.exists() and not (tmp_path / "mlflow.db").exists()


def test_pair_file_flags_on_a_built_in_task_are_refused_not_ignored(tmp_path):
    """`--text-columns a,b` with `--task stsb` used to be dropped without a word: the user scored STS-B's own
    columns believing they had named others. Now one line names the flags; nothing is written."""
    out = tmp_path / "baseline.md"
    proc = _cli("baseline", "--task", "stsb", "--text-columns", "a,b", "--split", "test", "--out", str(out),
                cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --text-columns, --split describe a pair file or hf:<id>, and --task 'stsb' is a built-in task with "
        "its own columns, labels and splits: drop them, or give the file as --task."], proc.stderr
    assert not out.exists() and not out.with_suffix(".json").exists()
    proc = _cli("baseline", "--task", "all", "--label-column", "score", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: --label-column describes a pair file or hf:<id>, and --task 'all' is every built-in task with its own "
        "columns, labels and splits: drop them, or give the file as --task."], proc.stderr
