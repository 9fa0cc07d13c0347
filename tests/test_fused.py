"""The served ensemble's fused inference path (embed_lib/training/fused.py) against the training module."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from embed_lib.config import CONTROLS
from embed_lib.training.adapters import NoveltyGate, PairAdapter
from embed_lib.training.export import ensemble_scores, project
from embed_lib.training.fused import FUSED_FORMS, FusedEnsemble

D, N = 16, 12
PAIR = [(f, c) for f in FUSED_FORMS for c in CONTROLS[f]]


def _vectors(seed=0):
    rng = np.random.default_rng(seed)
    xa = (rng.standard_normal((N, D)) * 3).astype(np.float32)
    xb = (xa + rng.standard_normal((N, D))).astype(np.float32)  # correlated pairs, norms far from 1
    return xa, xb


def _model(form, control="none", novelty=False, learn_p=False, seeds=(0, 1, 2), width=8, hidden=6, perturb=True):
    gate = NoveltyGate(torch.randn(20, D, generator=torch.Generator().manual_seed(5)), lo=-0.2, hi=0.4) \
        if novelty else None
    model = PairAdapter(form, D, list(seeds), control=control, width=width, hidden=hidden, gamma=0.3, p=0.8,
                        learn_p=learn_p, novelty=gate).eval()
    if perturb:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _both(model, xa, xb):
    ha, hb = project(model, xa), project(model, xb)
    return FusedEnsemble(model).scores(xa, xb, ha, hb), ensemble_scores(model, xa, xb, ha, hb)


@pytest.mark.parametrize("novelty", [False, True])
@pytest.mark.parametrize("learn_p", [False, True])
@pytest.mark.parametrize("form,control", PAIR)
def test_fused_scores_equal_the_training_modules_ensemble(form, control, novelty, learn_p):
    """Score, frozen anchor and difficulty as `ensemble_scores` gives them, to float32 rounding, for every pair
    form and control, with and without the novelty gate, with a fixed and a learned normalisation exponent."""
    xa, xb = _vectors()
    fused, ref = _both(_model(form, control, novelty, learn_p), xa, xb)
    assert np.abs(ref["score"] - ref["baseline"]).max() > 1e-2  # the residual is not zero: the test can fail
    for key in ("score", "baseline"):
        np.testing.assert_allclose(fused[key], ref[key], rtol=0, atol=1e-6)
    if form == "pair_ungated":
        assert np.isnan(fused["difficulty"]).all() and np.isnan(ref["difficulty"]).all()
    else:
        np.testing.assert_allclose(fused["difficulty"], ref["difficulty"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(fused["novelty"], ref["novelty"], rtol=0, atol=1e-6)
    if novelty:  # the weight the cascade's familiarity floor reads: by hand, from the gate's familiarity
        gate = _model(form, control, novelty, learn_p).novelty
        fa, fb = (gate.familiarity(torch.from_numpy(x)).numpy() for x in (xa, xb))
        lo, hi = gate.bounds.tolist()
        np.testing.assert_allclose(ref["novelty"], np.clip((np.minimum(fa, fb) - lo) / (hi - lo), 0, 1), atol=1e-6)
        assert 0 < ref["novelty"].mean() < 1  # some pairs familiar, some not: the check can fail
    else:
        assert (fused["novelty"] == 1).all() and (ref["novelty"] == 1).all()
    assert all(v.dtype == np.float32 and v.shape == (N,) for v in fused.values())


def test_the_anchor_at_p_1_is_the_studys_frozen_cosine_to_the_bit():
    """The served baseline is `metrics.cosine`, the study's frozen cosine, exactly: the same ties, the same ranks."""
    from embed_lib.training.metrics import cosine

    model = PairAdapter("pair_gated", D, [0, 1], width=4, hidden=3, p=1.0).eval()
    xa, xb = _vectors(5)
    xb[0] = xa[0]  # a sentence with itself
    anchor = FusedEnsemble(model).anchor(xa, xb)
    np.testing.assert_array_equal(anchor, cosine(xa, xb))
    assert anchor.dtype == np.float32 and anchor[0] == cosine(xa[:1], xa[:1])[0]


def test_a_one_seed_residual_computed_by_hand():
    """s = cos(a, b) + gamma * tanh(w2 . gelu(W1 [|h_a - h_b|, h_a * h_b] + b1) + b2), written out for one seed."""
    model = _model("pair_ungated", seeds=(4,), width=3, hidden=2)
    xa, xb = _vectors(2)
    ha, hb = project(model, xa), project(model, xb)
    got = FusedEnsemble(model).scores(xa, xb, ha, hb)["score"]
    inner, outer = model.delta.inner, model.delta.outer
    W1, b1 = inner.weight[0].detach().double().numpy(), inner.bias[0, 0].detach().double().numpy()
    w2, b2 = outer.weight[0, :, 0].detach().double().numpy(), float(outer.bias[0, 0, 0].detach())
    for i in range(N):
        a, b = ha[0, i].astype(np.float64), hb[0, i].astype(np.float64)
        z = np.concatenate([np.abs(a - b), a * b]) @ W1 + b1
        gelu = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in z])
        x, y = xa[i].astype(np.float64), xb[i].astype(np.float64)
        cos_p = x @ y / (np.linalg.norm(x) ** 0.8 * np.linalg.norm(y) ** 0.8)  # p = 0.8
        assert got[i] == pytest.approx(cos_p + 0.3 * math.tanh(gelu @ w2 + b2), abs=1e-5)


@pytest.mark.parametrize("form,control", PAIR)
def test_symmetric_and_the_frozen_score_at_initialisation(form, control):
    xa, xb = _vectors(3)
    model = _model(form, control, novelty=True)
    fused = FusedEnsemble(model)
    ab = fused.scores(xa, xb, project(model, xa), project(model, xb))
    ba = fused.scores(xb, xa, project(model, xb), project(model, xa))
    for key in ("score", "baseline"):
        np.testing.assert_array_equal(ab[key], ba[key])
    fresh = _model(form, control, perturb=False)  # zero-initialised last layers: the residual is exactly 0
    out = FusedEnsemble(fresh).scores(xa, xb, project(fresh, xa), project(fresh, xb))
    np.testing.assert_array_equal(out["score"], out["baseline"])


def test_an_unfamiliar_sentence_gets_the_frozen_score_exactly():
    model = _model("pair_gated", novelty=True)
    xa, xb = _vectors(4)
    ha, hb = project(model, xa), project(model, xb)
    ha[:, :3, -1] = -1.0  # familiarity below lo: the novelty weight is 0 for the first three pairs
    out = FusedEnsemble(model).scores(xa, xb, ha, hb)
    np.testing.assert_array_equal(out["score"][:3], out["baseline"][:3])
    assert np.abs(out["score"][3:] - out["baseline"][3:]).max() > 1e-3


@pytest.mark.parametrize("form", ["baseline", "per_sentence", "per_sentence_preserving"])
def test_forms_without_a_pair_residual_are_refused_and_served_by_the_module(form):
    model = PairAdapter(form, D, [0, 1])
    assert not FusedEnsemble.supports(model)
    with pytest.raises(ValueError, match=f"form '{form}' keeps embed_lib.training.export.ensemble_scores"):
        FusedEnsemble(model)
    from serving.scorer import PairScorer

    xa, xb = _vectors(5)
    texts = [f"a{i}" for i in range(N)] + [f"b{i}" for i in range(N)]
    scorer = PairScorer(model, {"name": "m"})
    assert scorer.fused is None
    out = scorer.score_vectors(list(zip(texts[:N], texts[N:])), dict(zip(texts, np.concatenate([xa, xb]))))
    np.testing.assert_allclose(out["score"], np.clip(ensemble_scores(model, xa, xb)["score"], -1, 1), atol=1e-6)


def test_the_pair_scorer_serves_pair_forms_through_the_fused_path():
    from serving.scorer import PairScorer

    model = _model("pair_gated", novelty=True)
    xa, xb = _vectors(6)
    texts = [f"a{i}" for i in range(N)] + [f"b{i}" for i in range(N)]
    scorer = PairScorer(model, {"name": "m"})
    assert isinstance(scorer.fused, FusedEnsemble)
    out = scorer.score_vectors(list(zip(texts[:N], texts[N:])), dict(zip(texts, np.concatenate([xa, xb]))))
    ref = ensemble_scores(model, xa, xb)
    np.testing.assert_allclose(out["score"], np.clip(ref["score"], -1, 1), rtol=0, atol=1e-6)
    np.testing.assert_allclose(out["difficulty"], ref["difficulty"], rtol=0, atol=1e-6)
    scorer.set_model(_model("per_sentence"), {"name": "m2"})  # a swap to a form the fused path does not take
    assert scorer.fused is None
