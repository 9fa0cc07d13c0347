"""Distillation: silver pairs (what they hold and never hold), the distillation loss and its settings, the controls."""
from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from embed_lib.config import AdapterConfig
from embed_lib.data.tasks import PairData
from embed_lib.encoding.cache import EmbeddedSplit, EmbeddedTask
from embed_lib.training import losses
from embed_lib.training.distil import silver_count
from embed_lib.training.seed_group import train_seed_group
from embed_lib.training.silver import KINDS, SILVER, build_silver, kinds_of, nearest
from embed_lib.training.tensors import prepare_study


def _pairs(task: str, split: str, s1: list[str], s2: list[str], y) -> PairData:
    y = np.asarray(y, dtype=np.float32)
    return PairData(task, split, "test", "", False, list(s1), list(s2), y, y, np.arange(len(y)))


@pytest.fixture(scope="module")
def stsb_small(stsb_embedded):
    keep = {"train": 400, "validation": 200, "test": 200}
    return {k: EmbeddedSplit(s.data.subset(keep[k]), s.ia[: keep[k]], s.ib[: keep[k]])
            for k, s in stsb_embedded.splits.items() if k in keep}


def _silver(stsb_embedded, splits, n=300, seed=0):
    banned = {t for k in ("validation", "test") for t in splits[k].data.texts()}
    return build_silver(splits["train"].data, stsb_embedded.texts, stsb_embedded.vectors, n, seed, banned)


def test_nearest_by_hand():
    v = np.array([[1, 0], [0.9, 0.1], [0, 1], [-1, 0]], dtype=np.float32)
    nn = nearest(v, 2)
    assert nn.tolist() == [[1, 2], [0, 2], [1, 0], [2, 1]]  # never itself; nearest first


def test_silver_holds_no_validation_or_test_sentence_and_no_train_pair(stsb_embedded, stsb_small):
    s = _silver(stsb_embedded, stsb_small)
    assert len(s) == 300 and s.split == SILVER and np.all(s.label == 0)
    held = {t for k in ("validation", "test") for t in stsb_small[k].data.texts()}
    assert not held & (set(s.sentence1) | set(s.sentence2))
    train = stsb_small["train"].data
    assert set(s.sentence1) | set(s.sentence2) <= set(train.texts())
    labelled = {frozenset(p) for p in zip(train.sentence1, train.sentence2)}
    drawn = [frozenset(p) for p in zip(s.sentence1, s.sentence2)]
    assert not labelled & set(drawn)  # no train pair in either order
    assert len(set(drawn)) == len(drawn) and all(len(p) == 2 for p in drawn)  # no repeat, no sentence with itself


def test_silver_is_seeded_and_its_prefix_is_the_mix(stsb_embedded, stsb_small):
    a, b = _silver(stsb_embedded, stsb_small, seed=3), _silver(stsb_embedded, stsb_small, seed=3)
    assert a.fingerprint == b.fingerprint
    assert _silver(stsb_embedded, stsb_small, seed=4).fingerprint != a.fingerprint
    assert list(kinds_of(6)) == list(KINDS) * 2
    # neighbour pairs are the frozen cosine's near pairs: far more similar than the random ones
    row = {t: i for i, t in enumerate(stsb_embedded.texts)}
    x = stsb_embedded.vectors / np.linalg.norm(stsb_embedded.vectors, axis=1, keepdims=True)
    cos = np.array([x[row[p]] @ x[row[q]] for p, q in zip(a.sentence1, a.sentence2)])
    kinds = kinds_of(len(a))
    assert cos[kinds == "neighbour"].mean() > cos[kinds == "random"].mean() + 0.2


def test_silver_bad_count_and_tiny_pools():
    tr = _pairs("t", "train", ["a b", "c d"], ["e f", "g h"], [1, 0])
    v = np.eye(4, dtype=np.float32)
    texts = ["a b", "c d", "e f", "g h"]
    for n in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="--silver-pairs"):
            build_silver(tr, texts, v, n)
    with pytest.raises(ValueError, match="no vector"):
        build_silver(tr, texts[:3], v[:3], 5)
    with pytest.raises(ValueError, match="2 or more"):
        build_silver(tr, texts, v, 5, exclude=["a b", "c d", "e f"])
    s = build_silver(tr, texts, v, 100)  # 4 sentences make 6 pairs, 2 of them labelled: the other 4, each once
    assert sorted(sorted(p) for p in zip(s.sentence1, s.sentence2)) == [
        ["a b", "c d"], ["a b", "g h"], ["c d", "e f"], ["e f", "g h"]]


def _study(stsb_embedded, stsb_small, teacher_fn, n_silver=300):
    splits = dict(stsb_small)
    s = _silver(stsb_embedded, stsb_small, n_silver)
    row = {t: i for i, t in enumerate(stsb_embedded.texts)}
    splits[SILVER] = EmbeddedSplit(s, np.array([row[t] for t in s.sentence1]), np.array([row[t] for t in s.sentence2]))
    emb = EmbeddedTask("stsb", stsb_embedded.vectors, stsb_embedded.texts, splits, stsb_embedded.manifest)
    scores = {k: teacher_fn(k, sp) for k, sp in splits.items()}
    return prepare_study(emb, scores)


def _cosine_teacher(stsb_embedded):
    x = stsb_embedded.vectors / np.linalg.norm(stsb_embedded.vectors, axis=1, keepdims=True)
    return lambda k, sp: (x[sp.ia] * x[sp.ib]).sum(1).astype(np.float32)


def test_silver_becomes_the_study_silver_with_the_teacher_scores(stsb_embedded, stsb_small):
    data = _study(stsb_embedded, stsb_small, _cosine_teacher(stsb_embedded))
    assert SILVER not in data.splits and SILVER not in data.fingerprints
    assert len(data.silver.ia) == 300 and np.allclose(data.silver.teacher, data.silver.s0, atol=1e-5)
    assert data.splits["train"].teacher is not None
    moved = data.to(torch.device("meta"))
    assert moved.silver is not None and moved.silver.ia.device.type == "meta"


def test_silver_without_teacher_scores_is_refused(stsb_embedded, stsb_small):
    with pytest.raises(ValueError, match="silver pairs without the teacher"):
        _study(stsb_embedded, stsb_small, lambda k, sp: None if k == SILVER else np.zeros(len(sp.ia), np.float32))


def _cfg(**kw):
    return AdapterConfig(**{**dict(adapter="pair_ungated", target="none", gamma=0.3, epochs=3, batch_size=32,
                                   n_seeds=2, width=16, hidden=16), **kw})


def test_config_bounds_and_combinations():
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"lambda_distil=.*allowed \[0.0, 1.0\]"):
            _cfg(lambda_distil=bad)
    with pytest.raises(ValueError, match="need distillation"):
        _cfg(silver_fraction=0.5)
    with pytest.raises(ValueError, match="need distillation"):
        _cfg(distil_control="shuffled")
    with pytest.raises(ValueError, match="distil_control='foo' is not a distillation control"):
        _cfg(lambda_distil=0.5, distil_control="foo")
    with pytest.raises(ValueError, match="applies to the pair forms"):
        AdapterConfig(adapter="per_sentence", target="surface", lambda_distil=0.5)
    assert _cfg(lambda_distil=0.5, silver_fraction=1.0).distilled and not _cfg().distilled


def test_distillation_needs_teacher_scores_and_silver(stsb_embedded, stsb_small):
    plain = prepare_study(EmbeddedTask("stsb", stsb_embedded.vectors, stsb_embedded.texts, dict(stsb_small),
                                       stsb_embedded.manifest))
    with pytest.raises(ValueError, match="no teacher scores to distil"):
        train_seed_group(_cfg(lambda_distil=0.5), plain)
    no_silver = _study(stsb_embedded, stsb_small, _cosine_teacher(stsb_embedded))
    no_silver.silver = None
    with pytest.raises(ValueError, match="has no silver pairs"):
        train_seed_group(_cfg(lambda_distil=0.5, silver_fraction=1.0), no_silver)


def test_silver_count_takes_the_prefix(stsb_embedded, stsb_small):
    data = _study(stsb_embedded, stsb_small, _cosine_teacher(stsb_embedded))
    assert silver_count(_cfg(lambda_distil=0.5, silver_fraction=0.5), data) == 150
    assert silver_count(_cfg(lambda_distil=0.5, silver_fraction=1.0), data) == 300
    assert silver_count(_cfg(lambda_distil=0.5), data) == 0 and silver_count(_cfg(), data) == 0


def test_distil_loss_by_hand():
    """lambda = 1 with the teacher's order equal to the labels': the loss is CoSENT on the scores against either."""
    s = torch.tensor([[0.1, 0.5, 0.3]])
    t = torch.tensor([[0.0, 2.0, 1.0]])
    y = torch.tensor([[0.0, 1.0, 0.5]])
    assert torch.allclose(losses.cosent(s, t, 0.1), losses.cosent(s, y, 0.1))
    # by hand: pairs (i above j) by the teacher: (1,0), (2,0), (1,2); exp((s_j - s_i) / tau)
    by_hand = np.log(1 + np.exp((0.1 - 0.5) / 0.1) + np.exp((0.1 - 0.3) / 0.1) + np.exp((0.3 - 0.5) / 0.1))
    assert float(losses.cosent(s, t, 0.1)) == pytest.approx(by_hand, rel=1e-5)


def test_a_teacher_that_is_the_gold_label_is_the_label_and_its_shuffle_is_noise(stsb_embedded, stsb_small):
    """The gold labels as the teacher: lambda_distil = 1 on the labelled pairs is training on the labels (the same
    figure); the same scores shuffled over the pairs (the control) carry nothing and pull the adapter off."""
    gold = lambda k, sp: sp.data.label.astype(np.float32)  # noqa: E731
    data = _study(stsb_embedded, stsb_small, gold)
    kw = dict(lr=3e-3, epochs=6, gamma=0.5)
    labels = train_seed_group(_cfg(**kw), data)
    teacher = train_seed_group(_cfg(lambda_distil=1.0, **kw), data)
    assert teacher.summary["delta_val_mean"] == pytest.approx(labels.summary["delta_val_mean"], abs=1e-6)
    shuffled = train_seed_group(_cfg(lambda_distil=1.0, distil_control="shuffled", **kw), data)
    assert shuffled.summary["delta_val_mean"] < teacher.summary["delta_val_mean"] - 0.005


def test_distilled_adapter_is_the_same_size_and_starts_at_the_anchor(stsb_embedded, stsb_small):
    data = _study(stsb_embedded, stsb_small, _cosine_teacher(stsb_embedded))
    plain = train_seed_group(_cfg(), data)
    distilled = train_seed_group(_cfg(lambda_distil=0.5, silver_fraction=1.0), data)
    assert distilled.n_parameters == plain.n_parameters  # the served path's cost is unchanged
    assert set(distilled.state_dict) == set(plain.state_dict)
    # a teacher that is the frozen cosine itself has nothing to teach: a distilled model stays near it
    only_teacher = train_seed_group(_cfg(lambda_distil=1.0, silver_fraction=1.0), data)
    assert abs(only_teacher.summary["delta_val_mean"]) < 0.01


def test_flags(monkeypatch):
    from embed_lib.cli.args import DEFAULT_SILVER, add_teacher_flags, silver_pairs

    p = argparse.ArgumentParser(exit_on_error=False)
    add_teacher_flags(p)
    assert silver_pairs(p.parse_args([])) == DEFAULT_SILVER
    assert silver_pairs(p.parse_args([]), wanted=False) is None
    assert silver_pairs(p.parse_args(["--silver-pairs", "7"])) == 7
    assert silver_pairs(p.parse_args(["--no-silver"])) is None
    with pytest.raises(ValueError, match="--silver-pairs 7 with --no-silver"):
        silver_pairs(p.parse_args(["--silver-pairs", "7", "--no-silver"]))
    with pytest.raises(ValueError, match="--silver-pairs 7 with --no-teacher"):
        silver_pairs(p.parse_args(["--silver-pairs", "7", "--no-teacher"]))
    for bad in ("0", "-5"):
        with pytest.raises(argparse.ArgumentError, match="silver-pairs.*give 1 or more"):
            p.parse_args(["--silver-pairs", bad])


def test_bad_distillation_flags_name_the_flag():
    from embed_lib.cli.args import adapter_config
    from embed_lib.cli.parser import build_parser

    for argv, message in ((["--lambda-distil", "1.5"], r"^--lambda-distil: AdapterConfig.lambda_distil=1.5 is out of"),
                          (["--lambda-distil", "-0.5"], r"^--lambda-distil: .*allowed \[0.0, 1.0\]"),
                          (["--silver-fraction", "0.5"], r"^--silver-fraction: .*need distillation"),
                          (["--lambda-distil", "0.5", "--distil-control", "noise"],
                           r"^--distil-control: AdapterConfig.distil_control='noise' is not")):
        args = build_parser().parse_args(["train", "--task", "stsb", *argv])
        with pytest.raises(ValueError, match=message):
            adapter_config(args, "stsb")


def test_the_sweep_refuses_silver_pairs_it_would_not_build():
    import sweeps.pair_residual  # noqa: F401  (the entry script's checks import the stack)
    from sweeps.flags import add_sweep_args, check_settings

    p = argparse.ArgumentParser()
    add_sweep_args(p, default_samples=4)
    for argv, flag in ((["--silver-pairs", "10", "--no-silver"], "--no-silver"),
                       (["--silver-pairs", "10", "--no-teacher"], "--no-teacher")):
        with pytest.raises(ValueError, match=f"--silver-pairs 10 with {flag}"):
            check_settings(p.parse_args(argv), {"loss": "cosent"})
