"""`python -m embed_lib train` end to end into a real MLflow sqlite store."""
from __future__ import annotations

import json


from embed_lib.cli.parser import main


def test_train_logs_config_metrics_and_plots_to_mlflow(tmp_path, stsb_embedded, capsys):
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    code = main(["train", "--task", "stsb", "--adapter", "pair_gated", "--target", "lexical", "--seeds", "2",
                 "--epochs", "2", "--limit", "300", "--tracking-uri", uri, "--experiment", "t"])
    assert code == 0
    out = capsys.readouterr().out
    assert "| seed | best epoch | val baseline" in out and "/2 positive" in out
    client = mlflow.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    assert run.data.params["adapter"] == "pair_gated" and run.data.params["gamma"] == "0.1"
    assert {"delta_val_mean", "delta_test_mean", "baseline/test/spearman", "train/gate_fit_mean"} <= set(run.data.metrics)
    assert len(client.get_metric_history(run.info.run_id, "seed/delta_val")) == 2  # one point per seed
    assert len(client.get_metric_history(run.info.run_id, "epoch/delta_val_mean")) == 2  # one point per epoch
    assert run.data.tags["git_commit"] and run.data.tags["split.test"].endswith("first 300 pairs")
    paths = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.json", "encoder_manifest.json", "plots"} <= paths
    plots = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert plots == {"plots/seed_deltas.png", "plots/signal_vs_baseline_error.png"}
    cfg = json.loads(open(client.download_artifacts(run.info.run_id, "config.json", str(tmp_path))).read())
    assert cfg["target"] == "lexical" and cfg["n_seeds"] == 2


def test_a_ctrl_c_while_train_logs_ends_its_run_killed_in_one_line(tmp_path, stsb_embedded, capsys, monkeypatch):
    """Ctrl-C while the run is open: the run ended FAILED (MLflow's context takes any exception for a crash) and a
    traceback was printed; now KILLED, what was logged kept, one line, exit 130."""
    import mlflow

    from embed_lib.cli import commands

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "log_task_inputs", interrupted)  # called after log_group, inside the run
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    code = main(["train", "--task", "stsb", "--adapter", "pair_gated", "--target", "lexical", "--seeds", "2",
                 "--epochs", "1", "--limit", "300", "--tracking-uri", uri, "--experiment", "t"])
    assert code == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "interrupted (Ctrl-C): train stopped; nothing more was written or registered.")
    client = mlflow.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    assert run.info.status == "KILLED" and run.data.params["adapter"] == "pair_gated"
    assert mlflow.active_run() is None


def test_train_rejects_bad_options(capsys):
    assert main(["train", "--task", "stsb", "--gamma", "3", "--no-mlflow"]) == 2
    assert "AdapterConfig.gamma=3.0 is out of range" in capsys.readouterr().err
    assert main(["train", "--task", "stsb", "--target", "ce_margin", "--no-teacher", "--no-mlflow"]) == 2
    assert "--target ce_margin needs the teacher" in capsys.readouterr().err


def test_a_new_store_keeps_every_artifact_beside_it(tmp_path, monkeypatch):
    """The store's Default experiment and ours put artifacts beside the sqlite file, never under the current
    directory (a Ray job's temporary copy of the tree), and ours opens as model training in MLflow 3's UI."""
    import mlflow

    from embed_lib.tracking.runs import set_experiment

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_ARTIFACT_ROOT", raising=False)
    (tmp_path / "store").mkdir()
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    set_experiment("mine", uri)
    experiments = {e.name: e for e in mlflow.MlflowClient(uri).search_experiments()}
    beside = (tmp_path / "store" / "mlartifacts").as_uri()
    assert all(e.artifact_location.startswith(beside) for e in experiments.values()), experiments
    assert experiments["mine"].tags["mlflow.experimentKind"] == "custom_model_development"


def test_counts_out_of_range_are_refused_by_the_parser(capsys, tmp_path):
    """`--limit -5` used to slice all but the last five pairs of every split, without a word."""
    import pytest

    for argv, message in [
        (["diagnostics", "--task", "paws", "--limit", "-5"], "argument --limit: -5 is below 1; give 1 or more"),
        (["train", "--task", "stsb", "--limit", "0"], "argument --limit: 0 is below 1; give 1 or more"),
        (["retrieval", "--task", "qqp", "--top-k", "0"], "argument --top-k: 0 is below 1; give 1 or more"),
        (["diagnostics", "--task", "stsb", "--collapse-tau", "-0.5"],
         "argument --collapse-tau: -0.5 is out of range; give a number > 0"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main([*argv, "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"] if argv[0] == "train" else argv)
        assert exit_.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].endswith(message)
    assert not (tmp_path / "mlflow.db").exists()
