"""`python -m embed_lib evaluate`: a registered adapter from a real MLflow store, scored as served, beside the frozen
cosine, on a built-in split and on a pair file of one's own."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from embed_lib.cli.parser import main


def _register(stsb_embedded, uri: str, cfg, name: str, keep: dict[str, int]) -> str:
    """The model URI of `cfg`'s seed group trained on the first `keep` pairs of each STS-B split, registered as `name`
    in a real MLflow store at `uri`."""
    import mlflow

    from embed_lib.encoding.cache import EmbeddedSplit, EmbeddedTask
    from embed_lib.tracking.registry import log_adapter_model
    from embed_lib.tracking.runs import set_experiment
    from embed_lib.training.seed_group import train_seed_group
    from embed_lib.training.tensors import prepare_study

    splits = {k: EmbeddedSplit(s.data.subset(keep[k]), s.ia[: keep[k]], s.ib[: keep[k]])
              for k, s in stsb_embedded.splits.items()}
    data = prepare_study(EmbeddedTask("stsb", stsb_embedded.vectors, stsb_embedded.texts, splits,
                                      stsb_embedded.manifest))
    set_experiment(f"evaluate-{name}", uri)
    with mlflow.start_run():
        info = log_adapter_model(train_seed_group(cfg, data), data, registered_name=name)
    return f"models:/{name}/{info.registered_model_version}"


def _untrained_cross_encoder(folder):
    """A cross-encoder of MiniLM with a seeded, untrained head, saved at `folder`: the same scores every run."""
    import torch
    from sentence_transformers import CrossEncoder

    from embed_lib.encoding.weights import resolve_model

    torch.manual_seed(0)
    CrossEncoder(resolve_model("minilm"), num_labels=1, device="cpu").save(str(folder))
    return folder


@pytest.fixture(scope="module")
def registered(stsb_embedded, tmp_path_factory):
    """(tracking URI, model URI) of a tiny pair_gated group trained on part of STS-B train."""
    from embed_lib.config import AdapterConfig

    uri = f"sqlite:///{tmp_path_factory.mktemp('evaluate') / 'mlflow.db'}"
    cfg = AdapterConfig(adapter="pair_gated", target="lexical", n_seeds=3, epochs=3, width=32, hidden=32)
    return uri, _register(stsb_embedded, uri, cfg, "pair-residual-eval", {"train": 400, "validation": 150,
                                                                          "test": 150})


def test_evaluate_scores_the_registered_model_as_served_beside_the_frozen_cosine(registered, stsb_embedded, tmp_path,
                                                                                capsys):
    import mlflow

    from embed_lib.training.metrics import cosine, spearman

    uri, model_uri = registered
    out = tmp_path / "eval.md"
    assert main(["evaluate", "--task", "stsb", "--model-uri", model_uri, "--tracking-uri", uri, "--bootstrap", "200",
                 "--out", str(out)]) == 0
    r = json.loads(out.with_suffix(".json").read_text())
    test = stsb_embedded.splits["test"]
    V = stsb_embedded.vectors
    # the frozen cosine by hand, on the whole test split
    assert r["pairs"] == len(test.data)  # the whole split (1379 pairs on the mirror)
    assert r["frozen_cosine"]["spearman"] == pytest.approx(spearman(cosine(V[test.ia], V[test.ib]), test.data.label),
                                                           abs=1e-9)
    # the model as the pyfunc flavour scores it (the served ensemble), on the cached vectors of the same texts
    before = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        model = mlflow.pyfunc.load_model(model_uri)
    finally:
        mlflow.set_tracking_uri(before)
    served = model.predict(pd.DataFrame({"emb_a": list(V[test.ia]), "emb_b": list(V[test.ib])}))
    assert r["model"]["spearman"] == pytest.approx(spearman(served["score"].to_numpy(), test.data.label), abs=1e-6)
    assert r["delta"]["spearman"] == pytest.approx(r["model"]["spearman"] - r["frozen_cosine"]["spearman"])
    # the pairs whose served score left the cosine, counted by hand from the pyfunc's own two columns
    moved = int((np.abs(served["score"] - served["baseline"]) > 1e-6).sum())
    assert r["pairs_moved"] == moved and 0 < moved <= len(test.data)
    assert len(r["seed_spearman_deltas"]) == 3 and r["adapter"] == "pair_gated" and r["trained_on"] == "stsb"
    assert r["not_held_out"] is None  # its task's test split
    assert r["model_version"] == model_uri.rsplit("/", 1)[1]
    b = r["spearman_delta_bootstrap"]
    assert b["resamples"] == 200 and b["low"] <= b["high"] and 0.0 <= b["share_above_0"] <= 1.0
    text = capsys.readouterr().out
    assert f"# Evaluation: {model_uri} on stsb test" in text and "| spearman |" in text and "paired bootstrap" in text
    assert f"The model's score differs from the frozen cosine on {moved:,} of {len(test.data):,} pairs" in text
    assert out.read_text() == text.rstrip("\n") + "\n"


def test_evaluate_on_a_holdout_file_of_ones_own(registered, stsb_embedded, tmp_path, capsys):
    import mlflow

    uri, model_uri = registered
    version = model_uri.rsplit("/", 1)[1]
    mlflow.MlflowClient(uri).set_registered_model_alias("pair-residual-eval", "best", version)
    model_uri = "models:/pair-residual-eval@best"  # an alias: the figures name the version it pointed at
    test = stsb_embedded.splits["test"].data
    holdout = tmp_path / "holdout.csv"
    frame = pd.DataFrame({"a": test.sentence1[:60], "b": test.sentence2[:60], "score": test.raw_label[:60]})
    frame = frame.drop_duplicates(["a", "b"])  # a pair file may not repeat a pair (the file check refuses it)
    frame.to_csv(holdout)
    args = ["evaluate", "--task", str(holdout), "--text-columns", "a,b", "--label-column", "score", "--label-range",
            "0,5", "--split", "test", "--model-uri", model_uri, "--tracking-uri", uri, "--bootstrap", "0",
            "--out", str(tmp_path / "h.md")]
    assert main(args) == 0
    r = json.loads((tmp_path / "h.json").read_text())
    assert r["pairs"] == len(frame) and r["task"] == "holdout" and "spearman_delta_bootstrap" not in r
    assert r["model_uri"] == model_uri and r["model_version"] == version
    assert r["not_held_out"] is None  # another task's pairs
    assert main([*args, "--eval-split", "validation"]) == 2
    assert "--eval-split validation: holdout has only ['test']; give --eval-split test." in capsys.readouterr().err


@pytest.mark.parametrize("split, note", [
    ("train", "the model trained on these pairs, so its delta here is no held-out figure (test is)"),
    ("validation", "the sweep chose the model by its delta on these pairs, so the figure here is optimistic (test is "
                   "held out)"),
])
def test_evaluate_on_a_split_the_model_trained_or_was_chosen_on_says_so(registered, tmp_path, capsys, split, note):
    """Its figures used to read like a held-out result (train: +0.075 Spearman for make run's champion)."""
    uri, model_uri = registered
    out = tmp_path / "e.md"
    assert main(["evaluate", "--task", "stsb", "--eval-split", split, "--model-uri", model_uri, "--tracking-uri", uri,
                 "--bootstrap", "0", "--out", str(out)]) == 0
    assert json.loads(out.with_suffix(".json").read_text())["not_held_out"] == note
    assert f"**Not held out:** {note}." in capsys.readouterr().out.splitlines()


def test_evaluate_refuses_what_it_cannot_score(registered, tmp_path, capsys):
    uri, model_uri = registered
    assert main(["evaluate", "--task", "all", "--model-uri", model_uri, "--tracking-uri", uri]) == 2
    assert "--task all: evaluate runs on one task" in capsys.readouterr().err
    assert main(["evaluate", "--model-uri", "models:/nope@champion", "--tracking-uri", uri]) == 2
    assert capsys.readouterr().err.startswith("error: MLflow:")
    assert main(["evaluate", "--tracking-uri", f"sqlite:///{tmp_path / 'none.db'}"]) == 2
    assert not (tmp_path / "none.db").exists()  # nothing made where no store was
    with pytest.raises(SystemExit) as exit_:
        main(["evaluate", "--bootstrap", "-1"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().endswith("argument --bootstrap: -1 is below 0; give 0 or more")


def test_evaluate_beside_a_cross_encoder(registered, stsb_embedded, tmp_path, capsys):
    """--cross-encoder: the cross-encoder's metrics on the same pairs, computed by hand with PairCrossEncoder, and
    the share of its Spearman gain the model reaches. The file's labels are the cross-encoder's own scores, so that
    it ranks them perfectly (Spearman 1) and the share has a value to check; a cross-encoder that cannot be loaded
    is one line and exit 2, with nothing written."""
    from embed_lib.teacher.cross_encoder import PairCrossEncoder
    from embed_lib.training.metrics import spearman

    uri, model_uri = registered
    folder = _untrained_cross_encoder(tmp_path / "ce")
    test = stsb_embedded.splits["test"].data
    frame = pd.DataFrame({"a": test.sentence1[:40], "b": test.sentence2[:40]}).drop_duplicates(["a", "b"])
    pairs = list(zip(frame["a"], frame["b"]))
    frame["label"] = PairCrossEncoder(folder).score(pairs)  # sigmoid scores, in (0, 1)
    holdout = tmp_path / "mine.csv"
    frame.to_csv(holdout, index=False)
    args = ["evaluate", "--task", str(holdout), "--text-columns", "a,b", "--label-column", "label", "--label-range",
            "0,1", "--split", "test", "--model-uri", model_uri, "--tracking-uri", uri, "--bootstrap", "0",
            "--out", str(tmp_path / "m.md")]
    assert main([*args, "--cross-encoder", str(folder)]) == 0
    r = json.loads((tmp_path / "m.json").read_text())
    ce = r["cross_encoder"]
    assert ce["name"] == str(folder) and ce["backend"] == "torch" and ce["pairs_per_s"] > 0
    assert ce["metrics"]["spearman"] == pytest.approx(spearman(frame["label"].to_numpy(), frame["label"].to_numpy()))
    assert ce["metrics"]["spearman"] == pytest.approx(1.0)
    gain = ce["metrics"]["spearman"] - r["frozen_cosine"]["spearman"]
    assert ce["delta"]["spearman"] == pytest.approx(gain)
    assert ce["share_of_gain_reached"] == pytest.approx(r["delta"]["spearman"] / gain)
    text = capsys.readouterr().out
    assert f"Cross-encoder {folder} (torch," in text and "% of the cross-encoder's." in text
    assert "model_minus_cross_encoder_bootstrap" not in ce  # --bootstrap 0
    assert main([*args, "--cross-encoder", str(folder), "--bootstrap", "50"]) == 0
    b = json.loads((tmp_path / "m.json").read_text())["cross_encoder"]["model_minus_cross_encoder_bootstrap"]
    assert b["resamples"] == 50 and b["high"] <= 0 and b["share_above_0"] == 0  # nothing ranks above a perfect rank
    assert "Model minus cross-encoder, Spearman: " in capsys.readouterr().out
    (tmp_path / "m.json").unlink()
    assert main([*args, "--cross-encoder", str(tmp_path / "gone")]) == 2
    assert f"Could not load cross-encoder '{tmp_path / 'gone'}'" in capsys.readouterr().err
    assert not (tmp_path / "m.json").exists()


def test_evaluate_the_cascade_at_a_budget(registered, stsb_embedded, tmp_path, capsys):
    """--cascade-budget B: the model's scores with the B-fraction of pairs its gate rates hardest replaced by the
    cross-encoder's, checked by hand (the top of the ensemble's difficulty, replaced); with a cross-encoder that
    ranks the labels perfectly, budget 1 ranks them perfectly too, and budget 0 is the model. Without
    --cross-encoder, or past 1: exit 2 before a model loads."""
    from embed_lib.teacher.cross_encoder import PairCrossEncoder
    from embed_lib.tracking.registry import load_registered
    from embed_lib.training.export import ensemble_scores
    from embed_lib.training.metrics import spearman

    uri, model_uri = registered
    folder = _untrained_cross_encoder(tmp_path / "ce")
    test = stsb_embedded.splits["test"].data
    frame = pd.DataFrame({"a": test.sentence1[:44], "b": test.sentence2[:44]}).drop_duplicates(["a", "b"])[:40]
    pairs = list(zip(frame["a"], frame["b"]))
    frame["label"] = PairCrossEncoder(folder).score(pairs)
    holdout = tmp_path / "mine.csv"
    frame.to_csv(holdout, index=False)
    args = ["evaluate", "--task", str(holdout), "--text-columns", "a,b", "--label-column", "label", "--label-range",
            "0,1", "--split", "test", "--model-uri", model_uri, "--tracking-uri", uri, "--bootstrap", "0",
            "--out", str(tmp_path / "c.md")]
    assert main([*args, "--cross-encoder", str(folder), "--cascade-budget", "0.25"]) == 0
    r = json.loads((tmp_path / "c.json").read_text())
    c = r["cascade"]
    assert c["budget"] == 0.25 and c["routing"] == "difficulty" and c["routed"] == 10  # 0.25 x 40 pairs
    row = {t: i for i, t in enumerate(stsb_embedded.texts)}
    V = stsb_embedded.vectors
    ia, ib = [row[t] for t in frame["a"]], [row[t] for t in frame["b"]]
    model, _, _ = load_registered(model_uri, uri)
    out = ensemble_scores(model, V[ia], V[ib])
    hardest = np.argsort(-out["difficulty"], kind="stable")[:10]
    expected = np.clip(out["score"], -1, 1).astype(np.float64)
    expected[hardest] = frame["label"].to_numpy()[hardest]
    assert c["metrics"]["spearman"] == pytest.approx(spearman(expected, frame["label"].to_numpy()), abs=1e-6)
    assert c["delta"]["spearman"] == pytest.approx(c["metrics"]["spearman"] - r["frozen_cosine"]["spearman"])
    assert "The cascade at budget 0.25 (10 of 40 pairs routed" in capsys.readouterr().out
    for budget, spearman_at in (("0", r["model"]["spearman"]), ("1", 1.0)):  # nothing routed; every pair routed
        assert main([*args, "--cross-encoder", str(folder), "--cascade-budget", budget]) == 0
        c = json.loads((tmp_path / "c.json").read_text())["cascade"]
        assert c["routed"] == (40 if budget == "1" else 0) and c["metrics"]["spearman"] == pytest.approx(spearman_at)
    (tmp_path / "c.json").unlink()
    for extra in (["--cascade-budget", "0.1"], ["--cross-encoder", str(folder), "--cascade-budget", "1.5"]):
        assert main([*args, *extra]) == 2
        assert "give a fraction in [0, 1], and the cross-encoder it routes to" in capsys.readouterr().err
    assert not (tmp_path / "c.json").exists()


def test_the_cascade_of_a_model_without_a_gate_routes_by_the_cosine_middle(stsb_embedded, tmp_path):
    """An ungated adapter has no difficulty to route by: the cascade routes as the service does for it, the pairs whose
    frozen cosine is nearest the middle (the cross-encoder's calibrated median; without a calibration, as here, the
    pairs' own median), checked by hand."""
    from embed_lib.config import AdapterConfig
    from embed_lib.teacher.cross_encoder import PairCrossEncoder
    from embed_lib.tracking.registry import load_registered
    from embed_lib.training.export import ensemble_scores
    from embed_lib.training.metrics import cosine, spearman

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = AdapterConfig(adapter="pair_ungated", target="none", n_seeds=2, epochs=2, width=32, hidden=32)
    model_uri = _register(stsb_embedded, uri, cfg, "pair-residual-ungated", {"train": 200, "validation": 100,
                                                                             "test": 100})
    folder = _untrained_cross_encoder(tmp_path / "ce")
    assert main(["evaluate", "--task", "stsb", "--model-uri", model_uri, "--tracking-uri", uri, "--bootstrap", "0",
                 "--cross-encoder", str(folder), "--cascade-budget", "0.2", "--out", str(tmp_path / "u.md")]) == 0
    c = json.loads((tmp_path / "u.json").read_text())["cascade"]
    test = stsb_embedded.splits["test"]
    xa, xb = stsb_embedded.vectors[test.ia], stsb_embedded.vectors[test.ib]
    cos = cosine(xa, xb)
    k = int(0.2 * len(cos))
    assert c["routing"] == "cosine_middle" and c["routed"] in (k, k + 1)  # the fraction rounded at random
    nearest = np.argsort(np.abs(cos - np.median(cos)), kind="stable")[: c["routed"]]
    model, _, _ = load_registered(model_uri, uri)
    expected = np.clip(ensemble_scores(model, xa, xb)["score"], -1, 1).astype(np.float64)
    pairs = list(zip(test.data.sentence1, test.data.sentence2))
    expected[nearest] = PairCrossEncoder(folder).score([pairs[i] for i in nearest])
    assert c["metrics"]["spearman"] == pytest.approx(spearman(expected, test.data.label), abs=1e-6)


def test_the_cascade_routes_nothing_of_an_unfamiliar_request_as_served(stsb_embedded, tmp_path, capsys):
    """A model with a novelty gate: the cascade routes none of a request's pairs where their mean novelty-gate weight
    is under --cascade-familiarity-floor. Over the split as one request, a floor just above the split's mean weight
    routes nothing (the cascade is the model) and one just below routes the budget; in requests of 100 pairs
    (--cascade-request-pairs), with the floor halfway between the least and the most familiar request's mean, exactly
    the requests at or above it route their hardest fifth, checked by hand. A floor past 1: exit 2."""
    from embed_lib.config import AdapterConfig
    from embed_lib.teacher.cross_encoder import PairCrossEncoder
    from embed_lib.tracking.registry import load_registered
    from embed_lib.training.cascade import n_routed, pairs_seed
    from embed_lib.training.export import ensemble_scores
    from embed_lib.training.metrics import spearman

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = AdapterConfig(adapter="pair_gated", target="lexical", n_seeds=2, epochs=2, width=32, hidden=32,
                        novelty_quantile=0.5)
    model_uri = _register(stsb_embedded, uri, cfg, "pair-residual-novelty", {"train": 400, "validation": 100,
                                                                             "test": 100})
    folder = _untrained_cross_encoder(tmp_path / "ce")
    test = stsb_embedded.splits["test"]
    xa, xb = stsb_embedded.vectors[test.ia], stsb_embedded.vectors[test.ib]
    model, _, _ = load_registered(model_uri, uri)
    out = ensemble_scores(model, xa, xb)
    w, y = out["novelty"].astype(np.float64), test.data.label
    assert 0 < w.mean() < 1 and model.novelty is not None  # some pairs familiar, some not: the checks can fail
    args = ["evaluate", "--task", "stsb", "--model-uri", model_uri, "--tracking-uri", uri, "--bootstrap", "0",
            "--cross-encoder", str(folder), "--cascade-budget", "0.2", "--out", str(tmp_path / "f.md")]

    def cascade(*extra):
        assert main([*args, *extra]) == 0
        return json.loads((tmp_path / "f.json").read_text())

    r = cascade("--cascade-familiarity-floor", f"{min(1.0, w.mean() + 0.01):.6f}")
    assert r["cascade"]["routed"] == 0 and r["cascade"]["familiarity"] == pytest.approx(w.mean(), abs=1e-6)
    assert r["cascade"]["metrics"]["spearman"] == pytest.approx(r["model"]["spearman"])
    assert cascade("--cascade-familiarity-floor", f"{w.mean() - 0.01:.6f}")["cascade"]["routed"] in (
        int(0.2 * len(y)), int(0.2 * len(y)) + 1)
    blocks = [np.arange(i, min(i + 100, len(y))) for i in range(0, len(y), 100)]
    means = [w[b].mean() for b in blocks]  # STS-B test's captions come first: their requests are the familiar ones
    floor = (min(means) + max(means)) / 2
    c = cascade("--cascade-familiarity-floor", f"{floor:.6f}", "--cascade-request-pairs", "100")["cascade"]
    kept = [b for b in blocks if w[b].mean() >= float(f"{floor:.6f}")]
    pairs = list(zip(test.data.sentence1, test.data.sentence2))
    # each request's fifth; the last's 15.8 rounded at random as the service rounds it, seeded by the request's pairs
    routed = np.sort(np.concatenate([b[np.argsort(-out["difficulty"][b], kind="stable")[
        : n_routed(len(b), 0.2, np.random.default_rng(pairs_seed([pairs[i] for i in b])))]] for b in kept]))
    assert 0 < len(kept) < len(blocks) and c["routed"] == len(routed) and c["request_pairs"] == 100
    expected = np.clip(out["score"], -1, 1).astype(np.float64)
    expected[routed] = PairCrossEncoder(folder).score([pairs[i] for i in routed])
    assert c["metrics"]["spearman"] == pytest.approx(spearman(expected, y), abs=1e-6)
    assert "in requests of 100 pairs; the pairs' mean novelty-gate weight" in capsys.readouterr().out
    (tmp_path / "f.json").unlink()
    assert main([*args, "--cascade-familiarity-floor", "1.5"]) == 2
    assert "--cascade-familiarity-floor 1.5: give a weight in [0, 1]" in capsys.readouterr().err
    assert not (tmp_path / "f.json").exists()
