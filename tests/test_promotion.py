"""The champion guard: a version takes `champion` only from a comparable champion and only when better on the rule's
figure; smoke and limited runs register under their own names; every alias move is recorded; serving pins once.

Decisions by hand first (no MLflow), then round trips through a real MLflow sqlite store with groups trained on
slices of STS-B."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import mlflow
import pytest

from embed_lib.tracking.promotion import Evidence, decide, encoder_description, with_figure

FULL = Evidence(task="stsb", val_fingerprint="a" * 16, val_pairs=1500, encoder_key="k1",
                encoder="encoder=minilm revision=None backend=torch quantization=None tau_attn=1.0 pooling=mean",
                rule="rule", tolerance=0.001, figure=0.0123)


def test_the_first_version_becomes_champion():
    d = decide(FULL, None, None)
    assert d.alias == "champion" and d.previous is None and "first version" in d.reason


def test_a_better_comparable_version_takes_champion_and_a_worse_or_equal_one_does_not():
    better = decide(with_figure(FULL, 0.0150), "1", FULL)
    assert better.alias == "champion" and better.previous["version"] == "1"
    assert "+0.01500 vs +0.01230 of version 1" in better.reason
    for figure in (0.0123, 0.0004):  # equal is not better: ties keep the champion
        d = decide(with_figure(FULL, figure), "1", FULL)
        assert d.alias == "challenger" and d.reason.startswith("not promoted: not better on the rule's figure")


@pytest.mark.parametrize("change, reason", [
    (dict(val_fingerprint="b" * 16, val_pairs=48, figure=0.5),
     "not promoted: validation data differs (48 pairs vs 1,500)"),
    (dict(val_fingerprint="b" * 16, figure=0.5), "same 1,500 pairs count, other pairs or labels"),
    (dict(encoder_key="k2", figure=0.5, encoder=FULL.encoder.replace("tau_attn=1.0", "tau_attn=0.5")),
     "not promoted: encoder differs (tau_attn 0.5 vs 1.0)"),
    (dict(encoder_key="k2", figure=0.5, encoder=FULL.encoder.replace("backend=torch", "backend=onnx")),
     "encoder differs (backend onnx vs torch)"),
    (dict(tolerance=1.0, figure=0.5), "transfer tolerance differs (1 vs 0.001)"),
    (dict(rule="another rule", figure=0.5), "winner rule differs"),
    (dict(task="qqp", figure=0.5), "task differs (qqp vs stsb)"),
])
def test_an_incomparable_version_becomes_challenger_with_the_reason_however_good(change, reason):
    d = decide(dataclasses.replace(FULL, **change), "1", FULL)
    assert d.alias == "challenger" and reason in d.reason, d.reason


def test_a_champion_without_evidence_is_never_displaced_silently():
    d = decide(FULL, "1", None)
    assert d.alias == "challenger" and "python -m embed_lib registry --promote" in d.reason


def test_evidence_round_trips_through_tags_and_a_partial_record_is_none():
    assert Evidence.from_tags(FULL.tags()) == FULL
    assert Evidence.from_tags({k: v for k, v in FULL.tags().items() if k != "val_fingerprint"}) is None
    assert encoder_description({"encoder": "minilm", "tau_attn": 0.5}).split() == [
        "encoder=minilm", "revision=None", "backend=torch", "quantization=None", "tau_attn=0.5", "pooling=None"]


# ---- round trips through a real MLflow store ----


def _study(stsb_embedded, n_val: int, n_train: int = 300):
    from embed_lib.encoding.cache import EmbeddedSplit, EmbeddedTask
    from embed_lib.training.tensors import prepare_study

    keep = {"train": n_train, "validation": n_val, "test": 100}
    splits = {k: EmbeddedSplit(s.data.subset(keep[k]), s.ia[: keep[k]], s.ib[: keep[k]])
              for k, s in stsb_embedded.splits.items()}
    return prepare_study(EmbeddedTask("stsb", stsb_embedded.vectors, stsb_embedded.texts, splits,
                                      stsb_embedded.manifest))


@pytest.fixture(scope="module")
def groups(stsb_embedded):
    """(full-validation study, its group, smoke-sized study, its group): what `make run` and a smoke test register."""
    from embed_lib.config import AdapterConfig
    from embed_lib.training.seed_group import train_seed_group

    cfg = AdapterConfig(adapter="pair_gated", target="lexical", n_seeds=2, epochs=1, width=16, hidden=16)
    full, smoke = _study(stsb_embedded, 150), _study(stsb_embedded, 48, n_train=48)
    return full, train_seed_group(cfg, full), smoke, train_seed_group(cfg, smoke)


def _register(tracking_uri, name, result, data, figure=None):
    from embed_lib.tracking.registry import evidence_of, log_adapter_model, promote
    from embed_lib.tracking.runs import set_experiment

    set_experiment("promotion-tests", tracking_uri)
    with mlflow.start_run():
        info = log_adapter_model(result, data, registered_name=name)
    evidence = evidence_of(result, data)
    decision = promote(name, info.registered_model_version, evidence if figure is None else
                       with_figure(evidence, figure), client=mlflow.MlflowClient(tracking_uri))
    return str(info.registered_model_version), decision


@pytest.fixture()
def store(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    yield uri, mlflow.MlflowClient(uri)
    mlflow.set_tracking_uri(None)


def test_a_smoke_run_after_a_real_sweep_leaves_the_served_champion_where_it_was(groups, store):
    from embed_lib.tracking.registry import model_name
    from serving.model import load_model, pinned_uri

    uri, client = store
    full, full_group, smoke, smoke_group = groups
    v1, d1 = _register(uri, model_name("stsb"), full_group, full)  # make run
    assert (v1, d1.alias) == ("1", "champion")
    # the smoke test registers under a name of its own ...
    assert model_name("stsb", smoke=True) == "pair-residual-stsb-smoke"
    assert model_name("stsb", limit=200) == "pair-residual-stsb-limited"
    for bad in (None, "", 3):
        with pytest.raises(ValueError, match="give the task's name"):
            model_name(bad)
    _, d = _register(uri, model_name("stsb", smoke=True), smoke_group, smoke)
    assert d.alias == "champion"  # of the smoke model only
    # ... and even under the real name (what the old code did) a limited run cannot take champion, however good
    v2, d2 = _register(uri, model_name("stsb"), smoke_group, smoke, figure=1.0)
    assert d2.alias == "challenger" and d2.reason == "not promoted: validation data differs (48 pairs vs 150)"
    # make serve: the champion URI pins version 1, and what loads is version 1
    pinned = pinned_uri("models:/pair-residual-stsb@champion", uri)
    assert pinned == "models:/pair-residual-stsb/1"
    _, info = load_model(pinned, uri)
    assert info["version"] == "1" and info["promotion"]["reason"] == "first version: no champion yet"
    challenger = client.get_model_version(model_name("stsb"), v2)
    assert challenger.tags["promotion_reason"] == d2.reason and "challenger" in challenger.aliases


def test_serving_a_champion_from_a_store_without_it_names_the_store_and_how_to_register_one(tmp_path, store):
    """`make serve` on a fresh clone before `make run`: it used to make an empty store where none was, then say only
    that the model was not found."""
    from serving.model import pinned_uri

    missing = f"sqlite:///{tmp_path / 'none' / 'mlflow.db'}"
    (tmp_path / "none").mkdir()
    with pytest.raises(ValueError, match=rf"No MLflow store at {missing} \(nothing was tracked there yet\).*`make run "
                                         r"TASK=<task>` registers models:/pair-residual-<task>@champion in this "
                                         r"clone's store"):
        pinned_uri("models:/pair-residual-stsb@champion", missing)
    assert not any((tmp_path / "none").iterdir())  # no empty store made
    uri, client = store  # a store without the model
    with pytest.raises(ValueError, match=r"name=pair-residual-stsb not found\. Check model_uri .* `python -m embed_lib "
                                         r"registry --name <name>` lists what a store has"):
        pinned_uri("models:/pair-residual-stsb@champion", uri)
    # `make run TASK=qqp` ran and nothing passed the rule: the error says so, with that sweep's reason
    reason = "No configuration passes the winner rule; of the 2 that completed, 2 harm a transfer task (qqp: 2)."
    exp = client.create_experiment("sweep-qqp")
    client.create_run(exp, start_time=1000, tags={"task": "qqp", "winner": "abc123"})  # an earlier sweep
    tags = {"task": "qqp", "winner": "none", "no_winner_reason": reason + " Nothing registered."}
    last = client.create_run(exp, start_time=2000, tags=tags).info.run_id
    with pytest.raises(ValueError) as e:
        pinned_uri("models:/pair-residual-qqp@champion", uri)
    assert str(e.value).endswith(f"lists what a store has. The last sweep of qqp here (experiment 'sweep-qqp', run "
                                 f"{last}) registered nothing: {reason}"), str(e.value)
    client.create_run(exp, start_time=3000, tags={"task": "qqp", "winner": "def456"})  # a later one registered
    with pytest.raises(ValueError, match=r"lists what a store has\.$"):
        pinned_uri("models:/pair-residual-qqp@champion", uri)
    # a served cross-encoder (the cascade's) is registered by `make teacher`, not `make run`
    with pytest.raises(ValueError, match=r"name=cross-encoder-stsb not found\. Check cross_encoder .* `make teacher "
                                         r"TASK=<task>` registers models:/cross-encoder-<task>@current in this clone"):
        pinned_uri("models:/cross-encoder-stsb@current", uri)


def test_a_worse_comparable_version_cannot_take_champion_and_a_better_one_does(groups, store):
    from embed_lib.tracking.registry import model_name

    uri, client = store
    full, group, _, _ = groups
    name = model_name("stsb")
    figure = group.summary["delta_val_mean"]
    _register(uri, name, group, full)
    v2, d2 = _register(uri, name, group, full, figure=figure - 0.001)
    assert d2.alias == "challenger" and "not better" in d2.reason
    v3, d3 = _register(uri, name, group, full, figure=figure + 0.001)
    assert d3.alias == "champion" and d3.previous["version"] == "1"
    assert str(client.get_model_version_by_alias(name, "champion").version) == v3
    old = client.get_model_version(name, "1")
    assert old.tags["superseded"].startswith("champion moved to version 3")
    rec = json.loads(client.get_model_version(name, v3).tags["promotion"])
    assert rec["manual"] is False and rec["previous"]["version"] == "1" and rec["git_commit"] and rec["command"]


def test_the_recorded_command_is_the_one_to_type_again():
    """`python -m embed_lib registry --rollback` was recorded as '/abs/path/embed_lib/__main__.py registry ...'
    (the promotion record) and '__main__.py train ...' (a run's command tag)."""
    from embed_lib.tracking.promotion import command_line

    assert command_line(["/w/clone/embed_lib/__main__.py", "registry", "--rollback"]) == \
        "python -m embed_lib registry --rollback"
    assert command_line(["/w/clone/sweeps/pair_residual.py", "--task", "stsb"]) == "pair_residual.py --task stsb"
    assert command_line([]) == "python"


def test_every_version_carries_its_fingerprint_encoder_key_and_promotion_record(groups, store):
    from embed_lib.encoding.cache import cache_key
    from embed_lib.tracking.registry import history, model_name

    uri, client = store
    full, full_group, smoke, smoke_group = groups
    _register(uri, model_name("stsb"), full_group, full)
    _register(uri, model_name("stsb"), smoke_group, smoke)
    rows = history(model_name("stsb"), client)
    assert [r["version"] for r in rows] == ["1", "2"]
    assert [r["val_fingerprint"] for r in rows] == [full.fingerprints["validation"], smoke.fingerprints["validation"]]
    assert all(r["encoder_key"] == cache_key(full.manifest) and r["promotion"]["reason"] for r in rows)


def test_an_explicit_promote_and_rollback_are_recorded_as_manual(groups, store, capsys):
    from embed_lib.cli.parser import main
    from embed_lib.tracking.registry import model_name

    uri, client = store
    full, group, smoke, smoke_group = groups
    name = model_name("stsb")
    _register(uri, name, group, full)
    _register(uri, name, smoke_group, smoke)  # challenger: other validation data
    assert main(["registry", "--tracking-uri", uri, "--promote", "2", "--reason", "shadow test passed"]) == 0
    rec = json.loads(client.get_model_version(name, "2").tags["promotion"])
    assert rec["manual"] is True and rec["previous"]["version"] == "1"
    assert {k: str(v) for k, v in client.get_registered_model(name).aliases.items()} == {"champion": "2"}  # not both
    assert rec["reason"] == "manual promotion from version 1 to 2: shadow test passed"
    before = client.get_model_version(name, "2").tags["promotion"]
    assert main(["registry", "--tracking-uri", uri, "--promote", "2"]) == 2  # the champion already: not a move
    assert capsys.readouterr().err.endswith("error: --promote 2: version 2 is pair-residual-stsb's champion already; "
                                            "nothing was moved.\n")  # after MLflow's own log lines
    assert client.get_model_version(name, "2").tags["promotion"] == before  # nothing recorded
    assert main(["registry", "--tracking-uri", uri, "--rollback"]) == 0
    assert str(client.get_model_version_by_alias(name, "champion").version) == "1"
    rec = json.loads(client.get_model_version(name, "1").tags["promotion"])
    assert rec["manual"] is True and rec["reason"] == "rollback from version 2 to 1"
    out = capsys.readouterr().out
    assert "champion -> version 1 (rollback from version 2 to 1); recorded as manual" in out
    # the listing says why each alias sits where it is
    assert "-> challenger: not promoted: validation data differs (48 pairs vs 150) (auto" in out
    assert "-> (none): champion moved to version 2: manual promotion from version 1 to 2" in out
    assert "\n      1  champion  " in out


def test_the_registry_command_names_the_fix_for_a_missing_model_or_version(store, capsys):
    from embed_lib.cli.parser import main

    uri, _ = store
    mlflow.MlflowClient(uri).search_experiments()  # the store exists, the model does not
    assert main(["registry", "--tracking-uri", uri, "--task", "mrpc"]) == 2
    assert "No registered model 'pair-residual-mrpc'" in capsys.readouterr().err
    missing = uri.replace("mlflow.db", "nothing-here.db")
    assert main(["registry", "--tracking-uri", missing]) == 2
    assert "No MLflow store at" in capsys.readouterr().err and not Path(missing[len("sqlite:///"):]).exists()


def test_serving_pins_the_alias_once_even_when_it_moves_during_loading(groups, store, monkeypatch):
    """The alias moves to version 2 right after the first registry read: the manifest and the weights must both
    still come from version 1, the version the application was pinned to."""
    import serving.model
    from embed_lib.tracking.registry import model_name
    from serving.app import build_app

    uri, client = store
    full, group, _, _ = groups
    name = model_name("stsb")
    _register(uri, name, group, full)
    _register(uri, name, group, full, figure=-1.0)  # version 2, challenger
    seen, real = [], serving.model.download_adapter

    def download_then_move(model_uri, *a, **k):
        seen.append(model_uri)
        client.set_registered_model_alias(name, "champion", "2")
        return real(model_uri, *a, **k)

    monkeypatch.setattr(serving.model, "download_adapter", download_then_move)
    app = build_app({"model_uri": f"models:/{name}@champion", "tracking_uri": uri})
    user_config = app._bound_deployment._deployment_config.user_config
    assert user_config["pinned"] == f"models:/{name}/1" and seen == [f"models:/{name}/1"]
    _, info = serving.model.load_model(user_config["pinned"], uri)
    assert info["version"] == "1" and seen == [f"models:/{name}/1"] * 2
