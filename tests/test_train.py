from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from embed_lib.config import AdapterConfig
from embed_lib.training.tensors import prepare_study
from embed_lib.training.seed_group import train_seed_group


@pytest.fixture(scope="module")
def small(stsb_embedded):
    """STS-B with the first 400 train / 200 validation / 200 test pairs (fast, real vectors)."""
    from embed_lib.encoding.cache import EmbeddedSplit, EmbeddedTask

    keep = {"train": 400, "validation": 200, "test": 200}
    splits = {k: EmbeddedSplit(s.data.subset(keep[k]), s.ia[: keep[k]], s.ib[: keep[k]])
              for k, s in stsb_embedded.splits.items()}
    return prepare_study(EmbeddedTask("stsb", stsb_embedded.vectors, stsb_embedded.texts, splits,
                                      stsb_embedded.manifest))


def _cfg(**kw):
    return AdapterConfig(**{**dict(adapter="pair_gated", target="lexical", epochs=3, batch_size=32, n_seeds=3,
                                   width=16, hidden=16), **kw})


def test_deterministic_for_a_seed(small):
    a, b = train_seed_group(_cfg(), small), train_seed_group(_cfg(), small)
    assert [r["delta_val"] for r in a.per_seed] == [r["delta_val"] for r in b.per_seed]


def test_a_seed_in_a_group_equals_the_seed_alone(small):
    group = train_seed_group(_cfg(), small)
    alone = train_seed_group(_cfg(seed0=1, n_seeds=1), small)
    assert alone.per_seed[0]["delta_test"] == pytest.approx(group.per_seed[1]["delta_test"], abs=1e-5)


def test_baseline_form_has_zero_delta(small):
    r = train_seed_group(_cfg(adapter="baseline", target="none"), small)
    assert all(x["delta_val"] == 0 and x["delta_test"] == 0 for x in r.per_seed)
    assert r.baseline["test/spearman"] == pytest.approx(
        float(np.corrcoef(np.argsort(np.argsort(small.splits["test"].s0)),
                          np.argsort(np.argsort(small.splits["test"].y.numpy())))[0, 1]), abs=1e-3)


def test_summary_and_history(small):
    r = train_seed_group(_cfg(), small)
    d = np.array([x["delta_val"] for x in r.per_seed])
    assert r.summary["delta_val_mean"] == pytest.approx(d.mean())
    assert r.summary["delta_val_positive"] == int((d > 0).sum())
    assert r.summary["delta_val_min"] == pytest.approx(d.min())
    assert [h["epoch"] for h in r.history] == [1, 2, 3]
    assert all(1 <= x["best_epoch"] <= 3 for x in r.per_seed)
    assert "train/gate_fit" in r.per_seed[0] and "test/gate_fit" in r.per_seed[0]
    assert r.n_parameters > 0 and set(r.state_dict)


@pytest.mark.parametrize("overrides", [
    dict(adapter="pair_ungated", target="none"),
    dict(control="shuffled"), dict(control="constant", target="none"),
    dict(adapter="per_sentence", target="surface"), dict(adapter="per_sentence", control="global", target="none"),
    dict(adapter="per_sentence_preserving", control="h_only", target="none"),
    dict(loss="logistic"), dict(loss="mse"), dict(learn_p=True, p=0.5), dict(lambda_mod=0.1),
])
def test_every_form_control_and_loss_trains(small, overrides):
    r = train_seed_group(_cfg(**overrides), small)
    assert np.isfinite([x["val/spearman"] for x in r.per_seed]).all()
    if overrides.get("learn_p"):
        assert all(0 < x["p"] < 1 for x in r.per_seed)


def test_shuffled_gate_does_not_fit_its_target_better(small):
    real = train_seed_group(_cfg(epochs=4, lambda_c=100.0), small)
    shuffled = train_seed_group(_cfg(epochs=4, lambda_c=100.0, control="shuffled"), small)
    assert real.summary["train/gate_fit_mean"] > shuffled.summary["train/gate_fit_mean"] + 0.1


def test_missing_target_is_a_clear_error(small):
    with pytest.raises(ValueError, match="Difficulty target 'ce_margin' is not available.*needs teacher scores: load "
                                         "the study with a teacher"):
        train_seed_group(_cfg(target="ce_margin"), small)
    # a form that learns no target (AdapterConfig's default target is ce_margin): the fix is target='none'
    with pytest.raises(ValueError, match="pair_ungated learns none: set target='none'"):
        train_seed_group(_cfg(adapter="pair_ungated", target="ce_margin"), small)
    for cfg, data in ((None, small), ({"adapter": "pair_gated"}, small), (_cfg(), None)):
        with pytest.raises(TypeError, match=r"takes an AdapterConfig \(AdapterConfig.from_dict for a dict\) and a "
                                            r"StudyData \(load_study\); got"):
            train_seed_group(cfg, data)


def test_load_study_names_a_bad_limit_or_transfer_before_reading_anything(tmp_path):
    from embed_lib.pipeline.prepare import load_study

    for bad in (0, -3, "5", 2.5, True):
        with pytest.raises(ValueError, match=f"load_study\\(limit={bad!r}\\): give a whole number"):
            load_study("stsb", limit=bad, cache_dir=tmp_path)
    # a string is an iterable of letters: 'qqp' would have been the tasks 'q', 'q', 'p'
    with pytest.raises(TypeError, match=r"load_study\(transfer='qqp'\): give a list of task names, e.g. \['qqp'\]"):
        load_study("stsb", transfer="qqp", cache_dir=tmp_path)
    assert not any(tmp_path.iterdir())


def test_config_validation_names_field_and_range():
    with pytest.raises(ValueError, match=r"AdapterConfig.gamma=2.0 is out of range; allowed \[0.0, 1.0\]"):
        AdapterConfig(gamma=2.0)
    with pytest.raises(ValueError, match=r"Unknown difficulty target 'foo'. Valid targets: \['ce_margin', 'lexical', 'none', 'surface'\]"):
        AdapterConfig(target="foo")
    with pytest.raises(ValueError, match="needs a difficulty target"):
        AdapterConfig(adapter="pair_gated", target="none")
    with pytest.raises(ValueError, match=r"Unknown AdapterConfig field\(s\) \['gama'\]"):
        AdapterConfig.from_dict({"gama": 0.1})
    cfg = AdapterConfig()
    assert AdapterConfig.from_dict(dataclasses.asdict(cfg)) == cfg


def test_declared_bounds_are_checked_at_their_edges():
    # every bounded field of every config: its bounds pass, one step past them fails naming the field
    from embed_lib.config import EncoderConfig
    from embed_lib.teacher.config import TeacherConfig

    checked = 0
    # a field whose every value needs another one set with it (silver pairs only with distillation)
    companions = {"silver_fraction": {"lambda_distil": 0.5}}
    for cls in (EncoderConfig, AdapterConfig, TeacherConfig):
        for f in dataclasses.fields(cls):
            if "bounds" not in f.metadata:
                continue
            b, checked = f.metadata["bounds"], checked + 1
            step = 1 if b.integer else 1e-9 * max(1.0, abs(b.high))
            low_ok = b.low + step if b.low_open else b.low
            with_ = companions.get(f.name, {}) if cls is AdapterConfig else {}
            for ok in (low_ok, b.high) + ((None,) if b.allow_none else ()):
                assert getattr(cls(**{f.name: ok, **with_}), f.name) == ok
            for bad in (b.low if b.low_open else b.low - step, b.high + step):
                with pytest.raises(ValueError, match=rf"^{cls.__name__}\.{f.name}={bad!r}"):
                    cls(**{f.name: bad, **with_})
    # AdapterConfig: 17 with lambda_distil and silver_fraction; TeacherConfig: 15 with stage_shards, freeze_layers,
    # dropout and stage_dropout
    assert checked == 3 + 17 + 15


def test_bounds_reject_what_is_not_a_number_and_take_numpy_scalars():
    with pytest.raises(ValueError, match=r"AdapterConfig.lr='0.1' is not a number; allowed \(0.0, 1.0\]"):
        AdapterConfig(lr="0.1")
    with pytest.raises(ValueError, match=r"AdapterConfig.gamma=True is not a number"):
        AdapterConfig(gamma=True)
    with pytest.raises(ValueError, match=r"AdapterConfig.epochs=2.0 is not a whole number; allowed 1..1000"):
        AdapterConfig(epochs=2.0)
    with pytest.raises(ValueError, match=r"AdapterConfig.width='64' is not a whole number; allowed 1..4096"):
        AdapterConfig(width="64")  # it said "width='64'; allowed 1..4096", as if 64 were out of range
    with pytest.raises(ValueError, match=r"AdapterConfig.tau=nan is out of range"):
        AdapterConfig(tau=float("nan"))
    cfg = AdapterConfig(gamma=np.float32(0.25), lambda_c=100, width=np.int64(64), epochs=np.int32(3))
    assert (cfg.gamma, cfg.width, cfg.epochs) == (0.25, 64, 3)  # numpy ints were refused as "allowed 1..4096"
    assert json.loads(json.dumps(cfg.to_dict()))["width"] == 64  # held as Python numbers: JSON, MLflow, cache keys


@pytest.mark.integration
def test_the_mlflow_model_scores_vectors_and_sentences_like_the_library(small, encoder, tmp_path):
    """Round trip through the MLflow registry: the pyfunc model (models from code) on cached vectors and on
    texts (encoded by the manifest's encoder) equals `ensemble_scores`; a manifest naming other weights is refused."""
    import json

    import mlflow
    import pandas as pd

    from embed_lib.training.export import as_served, ensemble_scores, load_adapter
    from embed_lib.tracking.registry import download_adapter, log_adapter_model
    from embed_lib.tracking.runs import set_experiment

    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    set_experiment("pyfunc-tests", tracking)
    result = train_seed_group(_cfg(epochs=1, n_seeds=2), small)
    with mlflow.start_run():
        info = log_adapter_model(result, small)
    model = mlflow.pyfunc.load_model(info.model_uri)
    signature = model.metadata.get_input_schema().input_names()
    assert signature == ["sentence1", "sentence2", "emb_a", "emb_b"]  # what the MLflow UI shows a user
    from embed_lib.tracking.registry import INPUT_EXAMPLE

    assert model.input_example.to_dict("list") == INPUT_EXAMPLE
    texts = [("A man is playing a guitar.", "A man plays the guitar."), ("A cat sleeps.", "Stocks fell sharply.")]
    xa, xb = encoder.encode([a for a, _ in texts]), encoder.encode([b for _, b in texts])
    adapter_dir = download_adapter(info.model_uri, tracking_uri=tracking)
    expected = as_served(ensemble_scores(load_adapter(adapter_dir)[0], xa, xb)["score"])  # in [-1, 1], as served
    by_text = model.predict(pd.DataFrame({"sentence1": [a for a, _ in texts], "sentence2": [b for _, b in texts]}))
    by_vector = model.predict(pd.DataFrame({"emb_a": list(xa), "emb_b": list(xb)}))
    np.testing.assert_allclose(by_text["score"], expected, atol=1e-5)
    np.testing.assert_allclose(by_vector["score"], expected, atol=1e-6)
    with pytest.raises(ValueError, match=r"Input needs columns emb_a/emb_b or sentence1/sentence2; got none of them "
                                         r"\(MLflow passes on only the columns the model's signature names"):
        model.predict(pd.DataFrame({"x": [1]}))  # MLflow drops the column it does not know before predict
    with pytest.raises(ValueError, match=r"Input needs columns emb_a/emb_b or sentence1/sentence2; got "
                                         r"\['sentence1'\]"):
        model.predict(pd.DataFrame({"sentence1": ["a"]}))
    # vectors as numpy's default float64 and as lists of floats (MLflow's schema refused both with Array(float))
    as_lists = model.predict(pd.DataFrame({"emb_a": [list(map(float, v)) for v in xa],
                                           "emb_b": [v.astype(np.float64) for v in xb]}))
    np.testing.assert_allclose(as_lists["score"], expected, atol=1e-6)
    dim = xa.shape[1]
    with pytest.raises(ValueError, match=rf"emb_b\[1\] has 5 values; this adapter takes vectors of {dim}"):
        model.predict(pd.DataFrame({"emb_a": list(xa), "emb_b": [xb[0], np.zeros(5)]}))
    with pytest.raises(ValueError, match=r"emb_a\[0\] holds NaN or infinity"):
        model.predict(pd.DataFrame({"emb_a": [np.full(dim, np.nan)], "emb_b": [xb[0]]}))
    with pytest.raises(ValueError, match=r"sentence2\[1\] is empty or blank"):
        model.predict(pd.DataFrame({"sentence1": ["a", "b"], "sentence2": ["c", " \t"]}))
    with pytest.raises(ValueError, match=r"sentence1\[1\] is missing \(None or NaN\); give a text in every row"):
        model.predict(pd.DataFrame({"sentence1": ["a", None], "sentence2": ["c", "d"]}))
    # a dict of lists of texts, which MLflow hands over as one row of lists: a row per pair
    by_dict = model.predict({"sentence1": [a for a, _ in texts], "sentence2": [b for _, b in texts]})
    np.testing.assert_allclose(by_dict["score"], expected, atol=1e-5)
    with pytest.raises(ValueError, match="sentence1 holds 2 texts and sentence2 1; give one of each per pair"):
        model.predict({"sentence1": ["a", "b"], "sentence2": ["c"]})
    _through_mlflow_models_serve(model, expected)

    # the same model whose manifest names other encoder weights: scoring texts is refused, naming the field
    broken = tmp_path / "broken"
    mlflow.artifacts.download_artifacts(artifact_uri=info.model_uri, dst_path=str(broken), tracking_uri=tracking)
    manifest_file = broken / "artifacts" / "adapter" / "encoder_manifest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest_file.write_text(json.dumps({**manifest, "weights_fingerprint": "0" * 32}))
    with pytest.raises(ValueError, match="weights_fingerprint"):
        mlflow.pyfunc.load_model(str(broken)).predict(pd.DataFrame({"sentence1": ["a"], "sentence2": ["b"]}))


def test_the_pyfunc_answers_scores_in_minus_one_to_one_as_the_service_does():
    """Near-duplicate pairs a model scores above 1: the pyfunc answers 1.0, as /v1/score does (export.as_served)."""
    import pandas as pd

    from embed_lib.tracking.pyfunc_adapter import PairAdapterModel
    from embed_lib.training.adapters import PairAdapter
    from embed_lib.training.export import ensemble_scores

    model = PairAdapter("pair_gated", 8, [0, 1]).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.3)
    rng = np.random.default_rng(0)
    xa = np.repeat(rng.standard_normal((1, 8)), 12, axis=0).astype(np.float32)
    xb = (xa + 0.1 * rng.standard_normal(xa.shape)).astype(np.float32)
    raw = ensemble_scores(model, xa, xb)
    assert (raw["score"] > 1).sum() >= 2 and (raw["score"] < 1).any()  # the case
    pyfunc = PairAdapterModel()
    pyfunc.model, pyfunc.manifest = model, {"dim": 8}
    out = pyfunc.predict(None, pd.DataFrame({"emb_a": list(xa), "emb_b": list(xb)}))
    np.testing.assert_allclose(out["score"], np.clip(raw["score"], -1, 1), atol=1e-6)
    assert out["score"].max() == 1.0 and out["baseline"].between(-1, 1).all()


def _through_mlflow_models_serve(model, expected):
    """MLflow's own scoring server (what `mlflow models serve` runs) scores the texts as the library does, and
    answers bad input with 400 and the message naming the field (it was a 400 'unexpected error while evaluating
    the model', the message only in the stack trace)."""
    from fastapi.testclient import TestClient
    from mlflow.pyfunc import scoring_server

    client = TestClient(scoring_server.init(model))
    texts = {"sentence1": ["A man is playing a guitar.", "A cat sleeps."],
             "sentence2": ["A man plays the guitar.", "Stocks fell sharply."]}
    for body in ({"inputs": texts}, {"dataframe_split": {"columns": list(texts), "data": list(zip(*texts.values()))}}):
        answer = client.post("/invocations", json=body)
        assert answer.status_code == 200, answer.text
        np.testing.assert_allclose([p["score"] for p in answer.json()["predictions"]], expected, atol=1e-5)
    answer = client.post("/invocations", json={"dataframe_records": [{"sentence1": "a", "sentence2": " "}]})
    assert answer.status_code == 400 and answer.json()["error_code"] == "INVALID_PARAMETER_VALUE"
    assert "sentence2[0] is empty or blank; give a text with a visible character" in answer.json()["message"]


def _toy_study(seed: int = 0, m: int = 400, d: int = 16, n: int = 1200):
    """Random vectors; gold similarity is the cosine of the first 4 dimensions only, so the full cosine (the
    anchor) ranks pairs only partly right and a pair residual has something known to learn."""
    import torch

    from embed_lib.training.tensors import SplitTensors, StudyData

    g = torch.Generator().manual_seed(seed)
    X = torch.randn(m, d, generator=g)
    splits = {}
    for name, rows in (("train", n), ("validation", 400), ("test", 400)):
        ia, ib = torch.randint(0, m, (rows,), generator=g), torch.randint(0, m, (rows,), generator=g)
        y = (torch.nn.functional.cosine_similarity(X[ia, :4], X[ib, :4], dim=-1) + 1) / 2
        s0 = torch.nn.functional.cosine_similarity(X[ia], X[ib], dim=-1).numpy()
        splits[name] = SplitTensors(ia, ib, y.float(), s0, {})
    return StudyData("toy", False, X, splits, {"surface": np.zeros(m, np.float32)}, {"encoder": "toy"},
                     {k: "toy" for k in splits})


def test_training_moves_validation_spearman_on_a_task_with_a_known_answer():
    """A trainer that never steps would leave the identity (delta 0): require a real gain on every seed."""
    data = _toy_study()
    r = train_seed_group(AdapterConfig(task="stsb", adapter="pair_ungated", target="none", gamma=0.5, epochs=15,
                                       lr=3e-3, width=32, hidden=32, batch_size=64, n_seeds=3), data)
    assert r.summary["delta_val_min"] > 0.05, r.summary
    assert r.summary["delta_test_mean"] > 0.05


def _with_transfer(data, other):
    """`data` plus the test split of `other` as a transfer split (a stand-in for another task)."""
    from embed_lib.training.tensors import StudyData

    return StudyData(data.task, data.binary, data.X, {**data.splits, "transfer:other": other}, data.sentence_target,
                     data.manifest, data.split_notes)


def test_transfer_splits_are_scored_per_seed_against_the_frozen_cosine(small):
    data = _with_transfer(small, small.splits["test"])
    r = train_seed_group(_cfg(), data)
    # the stand-in transfer split is the test split itself: its delta is the test delta, seed by seed
    for seed in r.per_seed:
        assert seed["transfer/other/delta"] == pytest.approx(seed["delta_test"], abs=1e-9)
    deltas = [s["transfer/other/delta"] for s in r.per_seed]
    assert r.summary["transfer_delta_min"] == pytest.approx(min(deltas))
    assert r.summary["transfer/other/delta_mean"] == pytest.approx(np.mean(deltas))
    base = train_seed_group(_cfg(adapter="baseline", target="none"), data)
    assert base.summary["transfer_delta_min"] == 0.0


def test_a_sweep_trial_reads_the_transfer_checks_every_epoch_without_changing_what_it_trains(small):
    """epoch_transfer=True (a sweep's trials, so that ASHA and the searcher rank by the rule while a trial trains):
    each epoch's record adds every transfer task's worst seed and the worst of all, scored as the final check scores
    them; the weights and every figure stay those of a run without it."""
    data = _with_transfer(small, small.splits["test"])
    cfg = _cfg(control="shuffled", novelty_quantile=0.2)  # the shuffled control draws from an evaluation generator
    seen: list[dict] = []
    watched = train_seed_group(cfg, data, on_epoch=lambda e, h: seen.append(h), epoch_transfer=True)
    plain = train_seed_group(cfg, data)
    assert watched.per_seed == plain.per_seed and watched.baseline == plain.baseline
    assert all(torch.equal(watched.state_dict[k], plain.state_dict[k]) for k in plain.state_dict)
    assert [h["epoch"] for h in seen] == [1, 2, 3]
    assert all(h["epoch/transfer_delta_min"] == h["epoch/transfer/other/delta_min"] for h in seen)
    assert "epoch/transfer_delta_min" not in plain.history[0]  # asked for only
    # after one epoch the weights scored are the selected ones; the stand-in transfer split is the test split
    seen.clear()
    one = train_seed_group(_cfg(epochs=1), data, on_epoch=lambda e, h: seen.append(h), epoch_transfer=True)
    assert seen[0]["epoch/transfer/other/delta_min"] == one.summary["transfer/other/delta_min"]
    assert seen[0]["epoch/transfer_delta_min"] == pytest.approx(min(s["delta_test"] for s in one.per_seed), abs=1e-9)
    # a study without transfer checks reports none
    assert "epoch/transfer_delta_min" not in train_seed_group(_cfg(epochs=1), small, epoch_transfer=True).history[0]


def test_every_split_but_train_is_scored_with_the_familiarity_it_has_when_served(small):
    """Validation, test and transfer pairs are scored as the service scores them: the novelty gate's own familiarity,
    a sentence that also occurs in train its own nearest neighbour, not the leave-one-out familiarity training reads
    (which would close the gate on pairs the service opens it on). Here every split holds the training pairs."""
    from scipy import stats

    from embed_lib.training.adapters import NoveltyGate, PairAdapter
    from embed_lib.training.seed_group import score_split
    from embed_lib.training.tensors import StudyData

    train = small.splits["train"]
    data = StudyData(small.task, small.binary, small.X, {**small.splits, "validation": train, "test": train,
                                                         "transfer:own": train, "transfer:own-all": train},
                     small.sentence_target, small.manifest, small.split_notes)
    r = train_seed_group(_cfg(novelty_quantile=0.5), data)
    gate = NoveltyGate(r.state_dict["novelty.ref"], *r.state_dict["novelty.bounds"].tolist())
    model = PairAdapter.from_config(r.config, data.X.shape[1], novelty=gate)
    model.load_state_dict(r.state_dict)
    served, _ = score_split(model, data.X, train)  # the gate searches its own familiarity, as when served
    assert np.abs(served - score_split(model, data.X, train, data.familiarity(served=True))[0]).max() < 1e-6
    loo, _ = score_split(model, data.X, train, data.familiarity())
    assert np.abs(served - loo).max() > 1e-4  # the two familiarities differ on training sentences
    y = train.y.numpy()
    base = stats.spearmanr(train.s0, y).statistic
    for k, seed in enumerate(r.per_seed):
        want = stats.spearmanr(served[k], y).statistic
        assert seed["val/spearman"] == pytest.approx(want, abs=1e-9)
        assert seed["test/spearman"] == pytest.approx(want, abs=1e-9)
        assert seed["transfer/own-all/delta"] == pytest.approx(want - base, abs=1e-9)
        assert seed["transfer/own/delta"] == pytest.approx(want - base, abs=1e-9)


def test_transfer_checks_add_the_whole_split_where_some_pairs_share_a_sentence_with_train(monkeypatch):
    """transfer_splits: another task's validation pairs without those sharing a sentence with train, and, only where
    some were left out, the whole split as "<task>-all"."""
    from embed_lib.data.tasks import PairData
    from embed_lib.pipeline import prepare

    def pairs(task, split, rows):
        a, b = zip(*rows)
        return PairData(task, split, "made", split, False, list(a), list(b), np.arange(len(a), dtype=np.float32),
                        np.arange(len(a), dtype=np.float32), np.arange(len(a)))

    train = pairs("stsb", "train", [("a", "b"), ("c", "d")])
    validation = {"mrpc": pairs("mrpc", "validation", [("x", "a"), ("y", "z"), ("d", "w"), ("u", "v")]),
                  "qqp": pairs("qqp", "validation", [("p", "q"), ("r", "s")])}
    monkeypatch.setattr(prepare, "load_splits", lambda name, splits, data_dir=None: {"validation": validation[name]})
    out = prepare.transfer_splits("stsb", train, ["mrpc", "qqp"])
    assert sorted(out) == ["transfer:mrpc", "transfer:mrpc-all", "transfer:qqp"]
    assert list(zip(out["transfer:mrpc"].sentence1, out["transfer:mrpc"].sentence2)) == [("y", "z"), ("u", "v")]
    assert out["transfer:mrpc-all"].sentence1 == ["x", "y", "d", "u"]
    assert "2 pairs sharing a sentence with stsb train removed" in out["transfer:mrpc"].split_note
    assert "every pair, 2 sharing a sentence with stsb train" in out["transfer:mrpc-all"].split_note
    assert len(out["transfer:qqp"]) == 2


def test_magnitude_penalty_keeps_scores_closer_to_the_anchor():
    from embed_lib.training.seed_group import score_split

    data = _toy_study(1)
    cfg = AdapterConfig(task="stsb", adapter="pair_ungated", target="none", gamma=0.5, epochs=5, lr=3e-3, width=16,
                        hidden=16, batch_size=64, n_seeds=2)
    moved = {}
    for lam in (0.0, 10.0):
        r = train_seed_group(dataclasses.replace(cfg, lambda_delta=lam), data)
        from embed_lib.training.adapters import PairAdapter

        model = PairAdapter.from_config(r.config, data.X.shape[1])
        model.load_state_dict(r.state_dict)
        scores, _ = score_split(model, data.X, data.splits["validation"])
        moved[lam] = float(np.abs(scores - data.splits["validation"].s0).mean())
    assert moved[10.0] < 0.5 * moved[0.0], moved


def test_novelty_gate_leaves_unfamiliar_pairs_at_the_frozen_cosine(small):
    """Familiarity is leave-one-out for training sentences; a pair whose sentence is less familiar than the
    gate's lower bound scores exactly s0."""
    from embed_lib.training.adapters import PairAdapter
    from embed_lib.training.tensors import novelty_gate
    from embed_lib.training.seed_group import score_split

    r = train_seed_group(_cfg(novelty_quantile=0.5), small)
    gate = novelty_gate(small, 0.5)
    assert r.summary["novelty/lo"] == pytest.approx(float(gate.bounds[0]))
    fam = small.familiarity()
    train_fam = fam[small.train_rows]
    assert float((train_fam < gate.bounds[0]).float().mean()) == pytest.approx(0.5, abs=0.01)
    import torch

    rows = small.train_rows
    xn = torch.nn.functional.normalize(small.X[rows], dim=-1)
    for i in (0, 7, len(rows) - 1):  # leave-one-out by hand: the best other training sentence, not itself
        sims = xn @ xn[i]
        sims[i] = -2
        assert float(train_fam[i]) == pytest.approx(float(sims.max()), abs=1e-5)
    model = PairAdapter.from_config(r.config, small.X.shape[1], novelty=gate)
    model.load_state_dict(r.state_dict)
    te = small.splits["test"]
    S = len(model.seeds)
    with torch.no_grad():
        out = model(small.X[te.ia].expand(S, -1, -1), small.X[te.ib].expand(S, -1, -1),
                    fam_a=fam[te.ia].expand(S, -1), fam_b=fam[te.ib].expand(S, -1))
    far = (torch.minimum(fam[te.ia], fam[te.ib]) < gate.bounds[0])
    assert far.any() and (~far).any()
    assert torch.equal(out.score[:, far], out.s0[:, far])  # exactly, not approximately
    assert (out.score[:, ~far] - out.s0[:, ~far]).abs().max() > 1e-4
    scores, _ = score_split(model, small.X, te, fam)  # the evaluation path agrees
    np.testing.assert_allclose(scores, out.score.numpy(), atol=1e-6)


def test_a_duplicate_question_transfer_split_is_also_a_retrieval_check():
    """A qqp transfer split is re-ranked as well (its frozen top-k per query): the baseline form leaves nDCG@10
    exactly where the frozen cosine has it, and a trained group's per-seed deltas are what the retrieval
    command's own helpers (seed_scores, order_by, ranking_metrics) give on the same candidates."""
    import torch

    from embed_lib.training.adapters import PairAdapter
    from embed_lib.training.metrics import cosine
    from embed_lib.training.retrieval import CHECK_TOP_K, order_by, ranking_metrics, seed_scores
    from embed_lib.training.tensors import SplitTensors, StudyData

    toy = _toy_study()
    X = toy.X
    g = torch.Generator().manual_seed(1)
    ia, ib = torch.randint(0, 400, (600,), generator=g), torch.randint(0, 400, (600,), generator=g)
    y = (torch.nn.functional.cosine_similarity(X[ia, :4], X[ib, :4], dim=-1) > 0.5).float()
    qqp = SplitTensors(ia, ib, y, cosine(X[ia].numpy(), X[ib].numpy()), {})
    data = StudyData("toy", False, X, {**toy.splits, "transfer:qqp": qqp}, toy.sentence_target, toy.manifest,
                     toy.split_notes)
    check = data.retrieval_checks()["qqp"]
    assert check.candidates.shape == (len(check.queries), CHECK_TOP_K)
    assert not any(q in c for q, c in zip(check.queries, check.candidates))  # never the query itself
    assert check.baseline_ndcg == pytest.approx(ranking_metrics(check.candidates, check.relevant)["ndcg@10"])
    base = train_seed_group(AdapterConfig(task="stsb", adapter="baseline", target="none", epochs=1, n_seeds=2), data)
    assert [s["transfer/qqp-retrieval/delta"] for s in base.per_seed] == [0.0, 0.0]
    cfg = AdapterConfig(task="stsb", adapter="pair_ungated", target="none", gamma=0.5, epochs=5, lr=3e-3, width=32,
                        hidden=32, batch_size=64, n_seeds=2)
    r = train_seed_group(cfg, data)
    model = PairAdapter.from_config(cfg, X.shape[1])
    model.load_state_dict(r.state_dict)
    model.eval()
    scores = seed_scores(model, X.numpy(), check.queries, check.candidates)
    expected = [ranking_metrics(order_by(check.candidates, s), check.relevant)["ndcg@10"] - check.baseline_ndcg
                for s in scores]
    assert [s["transfer/qqp-retrieval/delta"] for s in r.per_seed] == pytest.approx(expected, abs=1e-9)
    assert any(abs(e) > 0 for e in expected)  # the residual did re-rank something
    assert r.summary["transfer_delta_min"] <= min(expected)


def test_the_sweep_ships_the_study_with_its_per_study_caches_so_trials_never_recompute_them(monkeypatch):
    """Every trial gets its own copy of the study (Ray's object store pickles it): the familiarity of every sentence
    and the retrieval checks' frozen top-k are computed once by the sweep's precompute and travel with it."""
    import pickle

    import torch

    from embed_lib.training import tensors
    from embed_lib.training.metrics import cosine
    from embed_lib.training.tensors import SplitTensors, StudyData
    from sweeps import trainable

    toy = _toy_study()
    g = torch.Generator().manual_seed(1)
    ia, ib = torch.randint(0, 400, (600,), generator=g), torch.randint(0, 400, (600,), generator=g)
    y = (torch.nn.functional.cosine_similarity(toy.X[ia, :4], toy.X[ib, :4], dim=-1) > 0.5).float()
    qqp = SplitTensors(ia, ib, y, cosine(toy.X[ia].numpy(), toy.X[ib].numpy()), {})
    study = StudyData("toy", False, toy.X, {**toy.splits, "transfer:qqp": qqp}, toy.sentence_target, toy.manifest,
                      toy.split_notes)

    class Pool:
        def __init__(self, *a, **k):
            pass

        def shutdown(self):
            pass

    monkeypatch.setattr(trainable, "LazyPool", Pool)
    monkeypatch.setattr(trainable, "load_study", lambda *a, **k: (study, {"teacher": "record"}))
    data, record = trainable.precompute("toy", None, None, None, None, None, use_gpu=False)
    assert record == {"teacher": "record"}
    trial_copy = pickle.loads(pickle.dumps(data))
    monkeypatch.setattr(tensors, "novelty_reference_rows", lambda *a: pytest.fail("familiarity computed again"))
    monkeypatch.setattr(tensors, "retrieval_check", lambda *a: pytest.fail("retrieval check computed again"))
    assert torch.equal(trial_copy.familiarity(), data.familiarity())
    assert set(trial_copy.retrieval_checks()) == {"qqp"}


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "weights.safetensors").write_bytes((d / "weights.safetensors").read_bytes()[:40]),
     r"weights.safetensors cannot be read \(.*\): the file is damaged; export or register the adapter again"),
    (lambda d: (d / "config.json").write_text('{"adapter": "pair_ga'),
     r"config.json is not valid JSON \(.*\): the adapter's files are damaged"),
    (lambda d: (d / "encoder_manifest.json").write_text("[1, 2]"),
     r"encoder_manifest.json holds list, not a JSON object"),
    (lambda d: (d / "encoder_manifest.json").write_text('{"model": "minilm"}'),
     r"encoder_manifest.json has no valid 'dim'"),
])
def test_a_damaged_saved_adapter_is_named_with_the_fix(tmp_path, damage, message):
    """A truncated or overwritten file of a saved adapter (a registry artifact, a copied folder): one error naming
    the file, never safetensors' or json's bare message."""
    from embed_lib.training.adapters import PairAdapter
    from embed_lib.training.export import load_adapter, save_adapter

    cfg = _cfg(n_seeds=2)
    save_adapter(tmp_path, cfg, PairAdapter.from_config(cfg, 8).state_dict(), {"dim": 8, "model": "minilm"}, dim=8)
    load_adapter(tmp_path)  # intact: loads
    damage(tmp_path)
    with pytest.raises(ValueError, match=message):
        load_adapter(tmp_path)


def test_the_library_names_an_argument_of_the_wrong_kind_and_what_to_give(data_dir, stsb_embedded, tmp_path):
    """Each used to fail deep inside (AttributeError, 'not iterable') or, for load_splits, read 'train' as the
    splits 't', 'r', 'a', ... and name the split 't'."""
    from embed_lib import EmbeddingCache, embed_task, load_splits

    with pytest.raises(TypeError, match=r"^load_splits\(splits='train'\): give a list of split names, e.g. "
                                        r"\['train'\]"):
        load_splits("stsb", "train", data_dir)
    with pytest.raises(TypeError, match=r"^AdapterConfig.from_dict takes a mapping of fields; got NoneType"):
        AdapterConfig.from_dict(None)
    with pytest.raises(TypeError, match=r"^prepare_study\(emb\) takes an EmbeddedTask \(embed_task; load_study does "
                                        r"every step\); got dict"):
        prepare_study({"train": None})
    splits = load_splits("stsb", ["validation"], data_dir)
    with pytest.raises(TypeError, match=r"^embed_task\(splits, cache\) takes \{split name: PairData\} \(load_splits\) "
                                        r"and an EmbeddingCache .*; got str and EmbeddingCache"):
        embed_task("stsb", EmbeddingCache(stsb_embedded.manifest, tmp_path))
    with pytest.raises(TypeError, match=r"; got dict and str"):
        embed_task(splits, "cache")


def test_the_seed_delta_plot_keeps_its_legend_off_the_bars():
    """plots/seed_deltas.png of a trial: the legend sat in the upper right, over the last seeds' bars."""
    from types import SimpleNamespace

    from embed_lib.tracking.runs import plot_seed_deltas

    cfg = SimpleNamespace(seeds=[0, 1, 2, 3, 4], task="stsb", adapter="pair_gated", control="none", target="ce_margin")
    per_seed = [{"delta_val": 0.012 + 0.001 * s, "delta_test": 0.016 - 0.0005 * s} for s in cfg.seeds]
    fig = plot_seed_deltas(SimpleNamespace(config=cfg, per_seed=per_seed))
    fig.canvas.draw()
    (ax,) = fig.axes
    legend = ax.get_legend().get_window_extent()
    bars = [patch.get_window_extent() for patch in ax.patches]
    assert len(bars) == 10 and not any(legend.overlaps(bar) for bar in bars)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["validation", "test"]
