from __future__ import annotations

import json

import pytest

from embed_lib.cli.parser import main
from embed_lib.cli.commands import baseline_rows


def test_stsb_test_spearman_matches_the_published_figure(stsb_embedded, mirror_figures):
    """0.820 is the public figure for all-MiniLM-L6-v2 on STS-B test: checks data, weights and pooling."""
    rows = {r["split"]: r for r in baseline_rows(stsb_embedded)}
    assert rows["test"]["spearman"] == pytest.approx(0.820, abs=0.002)
    assert rows["test"]["n"] == 1379


def test_baseline_command_writes_table(tmp_path, stsb_embedded, capsys):
    out = tmp_path / "b.md"
    assert main(["baseline", "--task", "stsb", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    test = {r["split"]: r for r in baseline_rows(stsb_embedded)}["test"]
    assert f"| stsb | test | {test['n']} | {test['spearman']:.4f} |" in printed
    data = json.loads(out.with_suffix(".json").read_text())
    assert {r["split"] for r in data["rows"]} == {"train", "validation", "test"}
    assert "official split" in out.read_text()


def test_unknown_task_is_a_usage_error(capsys):
    assert main(["baseline", "--task", "foo"]) == 2
    assert ("--task 'foo' is unknown. Valid tasks: ['mrpc', 'paws', 'qqp', 'stsb'], a pair file (.csv, .tsv, "
            ".jsonl, .parquet) or hf:<dataset id>[:<config>]") in capsys.readouterr().err


@pytest.mark.parametrize("command", ["train", "diagnostics", "retrieval", "teacher", "evaluate"])
def test_all_tasks_is_refused_by_the_commands_that_run_on_one(command, capsys):
    """Their --task help offered 'all', and each then said "Unknown task 'all'"."""
    assert main([command, "--task", "all"]) == 2
    assert capsys.readouterr().err == (f"error: --task all: {command} runs on one task; give one of ['mrpc', 'paws', "
                                       "'qqp', 'stsb'] or a pair file (baseline and study take all).\n")


def test_teacher_preset_flags_name_the_preset_and_the_fix():
    from embed_lib.cli.parser import build_parser
    from embed_lib.cli.args import preset_for, teacher_config

    assert preset_for("stsb=strong,qqp=light", "qqp") == "light"
    assert preset_for("stsb=strong,qqp=light", "mrpc") == "strong"  # unlisted: the default
    args = build_parser().parse_args(["train", "--task", "mrpc", "--teacher-preset", "light", "--teacher-folds", "4"])
    cfg = teacher_config(args)
    assert (cfg.folds, cfg.epochs, cfg.early_stopping_fraction) == (4, 1, 0.0)  # preset, then the override
    with pytest.raises(ValueError, match=r"unknown preset 'huge'. Valid presets: \['fast', 'light', 'strong'\]"):
        preset_for("stsb=huge", "stsb")
    with pytest.raises(ValueError, match=r"unknown preset 'huge'"):  # another task's preset is checked too
        preset_for("stsb=strong,qqp=huge", "stsb")
    with pytest.raises(ValueError, match=r"'qqp' is not TASK=PRESET; give one preset, or TASK=PRESET pairs"):
        preset_for("stsb=strong,qqp", "stsb")
    with pytest.raises(ValueError, match=r"unknown task\(s\) \['stbs'\]"):  # a misspelt task no longer falls back
        preset_for("stbs=light", "stsb")
    assert preset_for(" stsb=light , qqp=strong ", "stsb") == "light"
    args = build_parser().parse_args(["train", "--task", "stsb", "--teacher-intermediate", "others"])
    assert teacher_config(args).intermediate == "others"
    args = build_parser().parse_args(["train", "--task", "stsb", "--teacher-preset", "strong",
                                      "--teacher-precision", "bf16", "--teacher-stage-shards", "3"])
    assert (teacher_config(args).precision, teacher_config(args).stage_shards) == ("bf16", 3)
    args = build_parser().parse_args(["train", "--task", "stsb", "--teacher-preset", "fast"])
    assert teacher_config(args).stage_shards == 2  # the preset's
    assert (teacher_config(args).dropout, teacher_config(args).stage_dropout) == (None, 0.0)  # stage: none
    args = build_parser().parse_args(["train", "--task", "stsb", "--teacher-preset", "fast",
                                      "--teacher-stage-dropout", "0.1"])
    assert teacher_config(args).stage_dropout == 0.1
    args = build_parser().parse_args(["train", "--task", "stsb", "--teacher-preset", "fast",
                                      "--teacher-dropout", "0.1"])
    assert teacher_config(args).dropout == 0.1
    args = build_parser().parse_args(["train", "--task", "stsb", "--teacher-dropout", "1.5"])
    with pytest.raises(ValueError, match=r"TeacherConfig.dropout=1.5 is out of range; allowed None or \[0.0, 0.9\]"):
        teacher_config(args)


def test_teacher_summary_names_the_intermediate_stage():
    from embed_lib.cli.args import teacher_summary

    record = {"config": {"model": "minilm", "folds": 3, "epochs": 1}, "preset": "light", "seconds": 900.0,
              "quality": {"test": {"teacher_spearman": 0.84, "cosine_spearman": 0.82, "error_correlation": 0.6,
                                   "rank_average_spearman": 0.86}}}
    assert "intermediate" not in teacher_summary(record)
    record["intermediate"] = {"tasks": ["mrpc", "paws", "qqp"], "pairs": 19300, "seconds": 480.4}
    assert teacher_summary(record) == (
        "teacher minilm (light recipe, 3 folds x <= 1 epochs, from an intermediate stage on mrpc, paws, qqp (19300 "
        "pairs, 480s)): test Spearman 0.8400 vs cosine 0.8200, error correlation 0.600, rank average 0.8600; "
        "900s once per task")


def test_retrieval_refuses_a_graded_task(stsb_embedded, capsys):
    assert main(["retrieval", "--task", "stsb", "--train", "--adapter", "pair_ungated", "--target", "none"]) == 2
    assert "graded; the retrieval check needs a binary duplicate task" in capsys.readouterr().err


def test_teacher_command_and_encoder_backend_flags(capsys):
    from embed_lib.cli.parser import build_parser
    from embed_lib.cli.args import encoder_config

    args = build_parser().parse_args(["baseline", "--task", "stsb", "--encoder-backend", "onnx-int8"])
    assert encoder_config(args).backend == "onnx-int8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["baseline", "--encoder-backend", "tensorrt"])
    assert "invalid choice: 'tensorrt'" in capsys.readouterr().err
    assert main(["teacher", "--task", "stsb", "--no-teacher"]) == 2
    assert "The teacher command needs a teacher; drop --no-teacher." in capsys.readouterr().err


def test_the_gate_trains_on_its_target_alone_unless_asked_everywhere_a_config_is_made():
    """--gate-task-grad on the command line, in the sweep's search space and start points."""
    import optuna

    from embed_lib.cli.parser import build_parser
    from embed_lib.cli.args import adapter_config
    from sweeps.pair_residual import SPACE_KEYS, START_POINTS, space

    args = build_parser().parse_args(["train", "--task", "stsb"])
    assert adapter_config(args, "stsb").gate_task_grad is False
    args = build_parser().parse_args(["train", "--task", "stsb", "--gate-task-grad"])
    assert adapter_config(args, "stsb").gate_task_grad is True
    assert "gate_task_grad" in SPACE_KEYS
    gated = [p for p in START_POINTS if p["adapter"] == "pair_gated"]
    assert gated and all(p["gate_task_grad"] is False for p in gated)
    # the ungated form has no gate: the space fixes the flag instead of searching it
    ungated = optuna.trial.FixedTrial({"adapter": "pair_ungated", "gamma": 0.5, "tau": 0.05, "learn_p": False,
                                       "lambda_mod": 0.0, "lambda_delta": 0.0, "novelty_quantile": 0.0,
                                       "lambda_distil": 0.0, "lr": 1e-3, "weight_decay": 0.01, "width": 128,
                                       "epochs": 4})
    assert space(ungated)["gate_task_grad"] is False


def test_every_start_point_is_a_whole_proposal_of_the_space_and_unavailable_ones_are_left_out():
    """Optuna evaluates the start points as given: each must name every key the space asks for its form, with a
    value its distribution holds (a value off a categorical's list would stop the sweep when its trial starts)."""
    import optuna

    from sweeps.pair_residual import START_POINTS, TASK_START_POINTS, space, start_points

    every = START_POINTS + [p for points in TASK_START_POINTS.values() for p in points]
    assert len({tuple(sorted(p.items())) for p in every}) == len(every) == 5
    for point in every:
        trial = optuna.trial.FixedTrial(point)
        space(trial)
        assert sorted(trial.distributions) == sorted(point)
        assert all(d._contains(d.to_internal_repr(point[k])) for k, d in trial.distributions.items())
    # every task starts from the four; QQP also from the gated start with the stronger novelty gate
    assert start_points() == start_points(task="stsb") == start_points(task="mrpc") == START_POINTS
    assert start_points(task="my_pairs") == START_POINTS
    qqp = start_points(task="qqp")
    assert qqp[:4] == START_POINTS and len(qqp) == 5
    assert qqp[4] == {**START_POINTS[1], "novelty_quantile": 0.3} and START_POINTS[1]["novelty_quantile"] == 0.2
    # without the teacher's margin among the targets only the ungated start is evaluated, undistilled (no teacher to
    # distil); fixed keys are left out
    assert start_points(("lexical",), task="qqp") == [START_POINTS[0]]
    # no silver pairs (--no-silver): the distilled start on them is left out, the other distils the labelled pairs
    no_silver = start_points(fixed=("silver_fraction",))
    assert len(no_silver) == 3 and all("silver_fraction" not in p for p in no_silver)
    assert [p for p in no_silver if p.get("lambda_distil")] == [
        {k: v for k, v in START_POINTS[2].items() if k != "silver_fraction"}]
    # no teacher: the sweep holds lambda_distil at 0, and no distilled start is evaluated
    assert start_points(("lexical",), fixed=("lambda_distil", "silver_fraction")) == [
        {k: v for k, v in START_POINTS[0].items() if k != "lambda_distil"}]
    assert all("epochs" not in p and len(p) == len(q) - 1 for p, q in zip(start_points(fixed=("epochs",)),
                                                                            START_POINTS))


def test_the_sweeps_searcher_starts_from_the_points_of_its_task(tmp_path, monkeypatch):
    """make_tuner hands Optuna the task's own start points, and none when asked."""
    import argparse
    import types

    from ray import tune

    import sweeps.tuner as tuner
    from sweeps.pair_residual import SPACE_KEYS, space, start_points

    monkeypatch.setattr(tuner, "reuse_actors", lambda: True)  # no cluster needed to build a Tuner

    def points(task: str, no_start_points: bool = False):
        args = argparse.Namespace(resume=False, search="optuna", no_start_points=no_start_points, seed=0,
                                  num_samples=4, max_concurrent=1)
        first = types.SimpleNamespace(targets=["ce_margin", "lexical"], task=task)
        made, _ = tuner.make_tuner(args, lambda config: None, tune.RunConfig(name="t", storage_path=str(tmp_path)),
                                   {"task": task, "n_seeds": 1}, space, SPACE_KEYS, first, [1.0], tmp_path, "t",
                                   start_points)
        return made._local_tuner._tune_config.search_alg._points_to_evaluate

    assert points("stsb") == start_points() and len(points("stsb")) == 4
    assert points("qqp") == start_points(task="qqp") and len(points("qqp")) == 5
    assert not points("qqp", no_start_points=True)


def test_a_command_ends_without_the_exit_collection_but_runs_its_exit_handlers():
    """skip_exit_collection: the objects alive at exit are frozen (out of the collector's reach) after the other
    exit handlers ran, and what a handler or the command printed still reaches the caller."""
    import subprocess
    import sys

    code = ("import atexit, gc, sys\n"
            "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count() > 0))\n"  # runs after the freeze
            "from embed_lib.cli.args import skip_exit_collection\n"
            "skip_exit_collection()\n"
            "atexit.register(lambda: print('handler ran, frozen yet:', gc.get_freeze_count() > 0))\n"
            "sys.stdout.write('result, unflushed')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert out == "result, unflushedhandler ran, frozen yet: False\nfrozen at exit: True\n"


def test_a_cache_dir_the_command_cannot_write_is_named_before_anything_runs(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    out = tmp_path / "b.md"
    assert main(["baseline", "--task", "stsb", "--cache-dir", str(tmp_path / "file" / "cache"), "--out", str(out)]) == 2
    assert capsys.readouterr().err.startswith(f"error: --cache-dir {tmp_path}/file/cache: the driver cannot write "
                                              "there (Not a directory)")
    assert not out.exists()


def test_a_device_this_machine_lacks_is_named_even_when_every_vector_is_cached(stsb_embedded, tmp_path, capsys):
    """Every STS-B vector is cached, so the encoder never loads: the command used to succeed on the CPU instead."""
    import torch

    device = f"cuda:{torch.cuda.device_count()}"  # one past the last: absent on any machine
    out = tmp_path / "b.md"
    assert main(["baseline", "--task", "stsb", "--device", device, "--out", str(out)]) == 2
    assert capsys.readouterr().err == (f"error: --device={device!r}, and torch sees {torch.cuda.device_count()} CUDA "
                                       "device(s) here: give cpu, another device, or leave --device unset (the best "
                                       "available).\n")
    assert not out.exists()
    assert main(["baseline", "--task", "stsb", "--device", "cpu", "--out", str(out)]) == 0


@pytest.mark.parametrize("argv, message", [
    (["study", "--task", "stsb", "--gamma-grid", "0.1,x"], "--gamma-grid '0.1,x': expected numbers separated by commas"),
    (["study", "--task", "stsb", "--gamma-grid", "2"], "--gamma-grid '2': AdapterConfig.gamma=2.0 is out of range"),
    (["study", "--task", "stsb,qqp", "--tau", "-3"], "AdapterConfig.tau=-3.0 is out of range"),
    (["retrieval", "--task", "qqp", "--train", "--tau", "-1"], "AdapterConfig.tau=-1.0 is out of range"),
    (["diagnostics", "--task", "stsb", "--collapse-tau", "20"], "EncoderConfig.tau_attn=20.0 is out of range"),
])
def test_a_bad_flag_fails_before_any_teacher_or_encoding(argv, message, tmp_path, capsys, monkeypatch):
    """These used to surface only after the teacher had trained (minutes to an hour): the commands build every
    config first. Nothing is loaded, so the load functions are made to fail loudly if reached."""
    import embed_lib.cli.commands as commands

    def reached(*a, **k):
        raise AssertionError("the study was loaded before the flags were checked")
    monkeypatch.setattr(commands, "load_study", reached)
    assert main([*argv, "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "out.md")]
                if argv[0] != "diagnostics" else [*argv, "--cache-dir", str(tmp_path / "cache")]) == 2
    assert message in capsys.readouterr().err


def test_retrieval_from_a_store_or_model_that_is_not_there(tmp_path, capsys):
    store = tmp_path / "none.db"
    assert main(["retrieval", "--task", "qqp", "--model-uri", "models:/nope@champion", "--tracking-uri",
                 f"sqlite:///{store}", "--out", str(tmp_path / "r.md")]) == 2
    assert f"error: No MLflow store at sqlite:///{store}" in capsys.readouterr().err
    assert not store.exists()  # reading did not make an empty store
    import mlflow

    mlflow.MlflowClient(f"sqlite:///{store}").search_experiments()  # an empty store: the model is not there
    assert main(["retrieval", "--task", "qqp", "--model-uri", "models:/nope@champion", "--tracking-uri",
                 f"sqlite:///{store}", "--out", str(tmp_path / "r.md")]) == 2
    err = capsys.readouterr().err
    assert "error: MLflow: Registered Model with name=nope not found. List a model's versions and aliases with " \
           "`python -m embed_lib registry --name <model>`" in err
