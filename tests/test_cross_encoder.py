"""The served teacher: trained on all of train, saved as safetensors + JSON, calibrated, registered in MLflow."""
from __future__ import annotations

import json

import numpy as np
import pytest

from embed_lib.teacher.cross_encoder import PairCrossEncoder, calibrate, served_teacher
from embed_lib.tracking.cross_encoder_registry import find_version, log_cross_encoder, model_name
from embed_lib.data.tasks import load_splits
from embed_lib.teacher.config import TeacherConfig

TINY = TeacherConfig(folds=2, epochs=1, batch_size=8, max_length=32, early_stopping_fraction=0.0)


@pytest.fixture(scope="module")
def served(data_dir, tmp_path_factory):
    splits = {k: v.subset(24) for k, v in load_splits("stsb", data_dir=data_dir).items()}
    s0 = {k: np.linspace(-0.5, 0.9, len(v)).astype(np.float32) for k, v in splits.items()}
    root = tmp_path_factory.mktemp("teacher_cache")
    folder, record = served_teacher(splits, TINY, s0, root)
    return splits, s0, root, folder, record


def test_served_teacher_is_saved_without_pickles_and_cached(served):
    splits, s0, root, folder, record = served
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    assert not list(folder.rglob("*.bin")) and not list(folder.rglob("*.pkl"))
    assert record["task"] == "stsb" and record["both_orders"] is True
    assert len(record["curve"]) == 1 and record["curve"][0]["pairs_per_s"] > 0
    assert set(record) >= {"validation_spearman", "test_spearman", "test_error_correlation", "calibration"}
    again_folder, again = served_teacher(splits, TINY, s0, root)  # cached: read back, not trained again
    assert again_folder == folder and again == json.loads((folder / "teacher.json").read_text()) == record


def test_loaded_teacher_reproduces_its_recorded_scores(served):
    """Round trip: the saved weights, loaded by PairCrossEncoder, give the logits recorded at training
    (both orders averaged, as trained)."""
    splits, _, _, folder, _ = served
    val = splits["validation"]
    ce = PairCrossEncoder(folder)
    recorded = np.load(folder / "scores.npz")["validation"]
    np.testing.assert_allclose(ce.logits(list(zip(val.sentence1, val.sentence2))), recorded, atol=1e-4)


def test_calibration_maps_logits_onto_the_cosine_scale_keeping_order():
    cal = {"logit": [-4.0, -1.0, 0.0, 2.0], "cosine": [0.1, 0.3, 0.5, 0.9]}
    got = calibrate(np.array([-10.0, -4.0, -2.5, 0.0, 1.0, 9.0]), cal)
    # by hand: clipped below and above, linear inside each quantile interval
    np.testing.assert_allclose(got, [0.1, 0.1, 0.2, 0.5, 0.7, 0.9], atol=1e-6)
    z = np.random.default_rng(0).normal(size=200)
    assert (np.diff(calibrate(np.sort(z), cal)) >= 0).all()


def test_a_served_teacher_scores_on_the_cosine_scale(served):
    splits, s0, _, folder, record = served
    val = splits["validation"]
    ce = PairCrossEncoder(folder)
    scores = ce.score(list(zip(val.sentence1, val.sentence2)))
    assert scores.min() >= s0["validation"].min() - 1e-6 and scores.max() <= s0["validation"].max() + 1e-6
    # the cascade's default middle: the median of the calibration's 101 cosine quantiles, the validation median
    assert ce.middle == record["calibration"]["cosine"][50] == pytest.approx(np.median(s0["validation"]))


def test_registered_as_cross_encoder_of_the_task(served, tmp_path):
    import mlflow

    _, _, _, folder, record = served
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    from embed_lib.tracking.runs import set_experiment

    set_experiment("teacher-test", uri)
    client = mlflow.MlflowClient(uri, registry_uri=uri)
    with mlflow.start_run():
        version = log_cross_encoder(folder, record, "stsb", client)
    assert version.name == model_name("stsb") == "cross-encoder-stsb"
    assert version.tags["teacher_key"] == record["teacher_key"]
    assert float(version.tags["test_spearman"]) == pytest.approx(record["test_spearman"])
    assert find_version("stsb", record["teacher_key"], client) == str(version.version)
    assert find_version("stsb", "another-key", client) is None
    model = mlflow.pyfunc.load_model(f"models:/cross-encoder-stsb/{version.version}")
    import pandas as pd

    out = model.predict(pd.DataFrame({"sentence1": ["A man plays a guitar."], "sentence2": ["A man plays music."]}))
    assert list(out.columns) == ["score", "logit"] and np.isfinite(out.to_numpy()).all()
    # the input example the UI shows is the registry's, and it is what the model accepts
    example = model.input_example
    assert list(example.columns) == ["sentence1", "sentence2"] and len(model.predict(example)) == len(example)
    # a dict of lists is a row per pair (it was one pair of the lists' reprs), a missing text is refused (it was
    # scored as the text "None")
    by_dict = model.predict({"sentence1": ["A man plays a guitar.", "A cat"], "sentence2": ["A man plays music.", "x"]})
    assert len(by_dict) == 2 and by_dict["score"].iloc[0] == pytest.approx(out["score"].iloc[0], abs=1e-5)
    with pytest.raises(ValueError, match=r"sentence2\[1\] is missing \(None or NaN\); give a text in every row"):
        model.predict(pd.DataFrame({"sentence1": ["a", "b"], "sentence2": ["c", None]}))
    with pytest.raises(ValueError, match=r"sentence1\[0\] is empty or blank"):
        model.predict(pd.DataFrame({"sentence1": [" "], "sentence2": ["c"]}))
    # what the service's cross_encoder option does with a models:/ URI: download, then load the folder
    from embed_lib.tracking.cross_encoder_registry import resolve_cross_encoder

    local = resolve_cross_encoder("models:/cross-encoder-stsb@current", uri)
    assert PairCrossEncoder(local).record["teacher_key"] == record["teacher_key"]


def test_the_registry_command_lists_a_cross_encoder_as_one_and_leaves_its_alias_alone(served, tmp_path, capsys):
    """`registry --name cross-encoder-stsb` listed it with the adapter's columns ("?") and "no recorded promotion",
    and `--promote 1` gave it a `champion` alias nothing reads; now its own columns, and a move is refused."""
    import mlflow

    from embed_lib.cli.parser import main
    from embed_lib.tracking.runs import set_experiment

    _, _, _, folder, record = served
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    set_experiment("teacher-test", uri)
    with mlflow.start_run():
        log_cross_encoder(folder, record, "stsb", mlflow.MlflowClient(uri, registry_uri=uri))
    assert main(["registry", "--name", "cross-encoder-stsb", "--tracking-uri", uri]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["version", "aliases", "test", "Spearman", "recipe", "(teacher", "key)"]
    assert out[2].split()[:3] == ["1", "current", f"{record['test_spearman']:.4f}"]
    assert out[2].endswith(f"({record['teacher_key']})")
    assert main(["registry", "--name", "cross-encoder-stsb", "--promote", "1", "--tracking-uri", uri]) == 2
    assert "is a served cross-encoder: `make teacher` (python -m embed_lib teacher) moves its alias 'current'" in \
        capsys.readouterr().err
    aliases = mlflow.MlflowClient(uri, registry_uri=uri).get_registered_model("cross-encoder-stsb").aliases
    assert {a: str(v) for a, v in aliases.items()} == {"current": "1"}


def test_a_missing_cross_encoder_directory_is_named(tmp_path):
    with pytest.raises(ValueError, match=f"Could not load cross-encoder '{tmp_path}/gone': no such file or directory"):
        PairCrossEncoder(tmp_path / "gone")
    with pytest.raises(ValueError, match="cross_encoder_backend"):
        PairCrossEncoder(tmp_path / "gone", backend="tensorrt")
