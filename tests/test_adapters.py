from __future__ import annotations

import math

import pytest
import torch

from embed_lib.training.adapters import PairAdapter, sim_p
from embed_lib.config import CONTROLS, FORMS

S, B, D = 3, 16, 24
ALL = [(f, c) for f in FORMS for c in CONTROLS[f]]


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    xa = torch.randn(B, D, generator=g) * 3
    xb = xa + torch.randn(B, D, generator=g)  # correlated pairs, norms far from 1
    return xa.expand(S, B, D), xb.expand(S, B, D)


def _perturb(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.mark.parametrize("form,control", [fc for fc in ALL if not fc[0].startswith("per_sentence")])
def test_identity_at_initialisation(form, control):
    xa, xb = _inputs()
    model = PairAdapter(form, D, [0, 1, 2], control=control, width=8, hidden=8)
    out = model(xa, xb)
    cos = torch.nn.functional.cosine_similarity(xa, xb, dim=-1)
    torch.testing.assert_close(out.s0, cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(out.score, out.s0, atol=1e-6, rtol=0)


def _layer_norm_by_hand(model, x, seed):
    """h = LayerNorm(W x + b) of one seed, written out (population variance, eps 1e-5)."""
    z = x @ model.proj.weight[seed] + model.proj.bias[seed, 0]
    z = (z - z.mean(-1, keepdim=True)) / torch.sqrt(z.var(-1, unbiased=False, keepdim=True) + 1e-5)
    return z * model.norm.weight[seed, 0] + model.norm.bias[seed, 0]


@pytest.mark.parametrize("form", ["per_sentence", "per_sentence_preserving"])
def test_per_sentence_scaling_acts_on_h_as_the_formula_says(form):
    """u = normalize(alpha * h), alpha = 1 + alpha0 tanh(G([h, c])), c = sigmoid(MLP_c(h)); preserving:
    w = normalize((1 - gamma) normalize(x) + gamma u); score = cos. Checked against the formula by hand."""
    xa, xb = _inputs()
    gamma, alpha0 = 0.3, 0.5
    model = PairAdapter(form, D, [0, 1, 2], width=8, hidden=8, gamma=gamma, alpha0=alpha0)
    assert model.proj.weight.shape == (3, D, D)  # the working space is the embedding's own dimension
    _perturb(model)
    out = model(xa, xb)
    for seed in range(3):
        def u(x):
            h = _layer_norm_by_hand(model, x[seed], seed)
            inner = torch.nn.functional.gelu(h @ model.c_net.inner.weight[seed] + model.c_net.inner.bias[seed, 0])
            c = torch.sigmoid(inner @ model.c_net.outer.weight[seed] + model.c_net.outer.bias[seed, 0])
            g = torch.cat([h, c], -1) @ model.scale.weight[seed] + model.scale.bias[seed, 0]
            v = (1 + alpha0 * torch.tanh(g)) * h
            v = v / v.norm(dim=-1, keepdim=True)
            if form == "per_sentence_preserving":
                v = (1 - gamma) * x[seed] / x[seed].norm(dim=-1, keepdim=True) + gamma * v
                v = v / v.norm(dim=-1, keepdim=True)
            return v
        torch.testing.assert_close(out.score[seed], (u(xa) * u(xb)).sum(-1), atol=1e-5, rtol=0)


def test_per_sentence_starts_from_the_working_cosine_and_preserving_near_the_anchor():
    xa, xb = _inputs()
    plain = PairAdapter("per_sentence", D, [0, 1, 2], width=8, hidden=8)
    out = plain(xa, xb)
    ha, hb = plain.working(xa), plain.working(xb)
    torch.testing.assert_close(out.score, torch.nn.functional.cosine_similarity(ha, hb, dim=-1), atol=1e-6, rtol=0)
    near = PairAdapter("per_sentence_preserving", D, [0, 1, 2], gamma=0.01)
    assert (near(xa, xb).score - out.s0).abs().max() < 0.02 < (out.score - out.s0).abs().max()


def test_novelty_gate_returns_the_frozen_cosine_exactly_far_from_the_training_data():
    from embed_lib.training.adapters import NoveltyGate

    g = torch.Generator().manual_seed(0)
    ref = torch.randn(50, D, generator=g)
    ref[:, : D // 2] = 0  # the training sentences live in one half of the space
    xa, xb = _inputs()
    far_a, far_b = xa.clone(), xb.clone()
    far_a[..., D // 2:] = 0  # these pairs live in the other half: familiarity 0
    far_b[..., D // 2:] = 0
    gate = NoveltyGate(ref, lo=0.3, hi=0.6)
    model = PairAdapter("pair_gated", D, [0, 1, 2], width=8, hidden=8, gamma=0.3, novelty=gate)
    _perturb(model)
    far = model(far_a, far_b)
    assert torch.equal(far.score, far.s0) and torch.equal(far.novelty, torch.zeros_like(far.novelty))
    near_a, near_b = ref[:B].expand(S, B, D), (ref[:B] + 0.05 * torch.randn(B, D, generator=g)).expand(S, B, D)
    near = model(near_a, near_b)
    assert (near.novelty == 1).all() and (near.score - near.s0).abs().max() > 1e-3
    # the familiarity by hand: the max cosine to the reference rows
    fam = gate.familiarity(near_b[0])
    by_hand = torch.nn.functional.cosine_similarity(near_b[0][:, None], ref[None], dim=-1).amax(-1)
    torch.testing.assert_close(fam, by_hand, atol=1e-6, rtol=0)
    torch.testing.assert_close(gate.weight(torch.tensor([0.45]), torch.tensor([0.9])), torch.tensor([0.5]))


@pytest.mark.parametrize("form,control", [fc for fc in ALL if fc[1] != "shuffled"])
def test_scores_are_symmetric_after_training_moves_weights(form, control):
    xa, xb = _inputs()
    model = PairAdapter(form, D, [0, 1, 2], control=control, width=8, hidden=8, gamma=0.3)
    _perturb(model)
    ab, ba = model(xa, xb).score, model(xb, xa).score
    torch.testing.assert_close(ab, ba, atol=1e-6, rtol=0)
    if form != "baseline":
        assert (ab - model(xa, xb).s0).abs().max() > 1e-3, "perturbed weights must move the score"


def test_pair_residual_is_bounded_by_gamma():
    xa, xb = _inputs()
    model = PairAdapter("pair_gated", D, [0, 1, 2], width=8, hidden=8, gamma=0.05)
    _perturb(model, seed=3)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(50)  # saturate tanh and sigmoid
    out = model(xa, xb)
    assert (out.score - out.s0).abs().max() <= 0.05 + 1e-6
    assert ((out.gate > 0) & (out.gate < 1) | (out.gate == 0) | (out.gate == 1)).all()


def test_sim_p_by_hand():
    a, b = torch.tensor([3.0, 4.0]), torch.tensor([6.0, 8.0])  # |a| = 5, |b| = 10, a.b = 50
    assert sim_p(a, b, 1.0).item() == pytest.approx(1.0)
    assert sim_p(a, b, 0.0).item() == pytest.approx(50.0)
    assert sim_p(a, b, 0.5).item() == pytest.approx(50 / math.sqrt(50))


def test_the_cosine_is_the_same_whatever_the_batch_and_library():
    """The baseline form's cosine (torch, batched per seed) equals the study's frozen cosine (numpy) bit for bit,
    and a sentence with itself scores exactly 1: otherwise float32 noise breaks exact ties differently in the
    two, and the baseline form's Spearman differs from the frozen cosine's."""
    import numpy as np

    from embed_lib.training.metrics import cosine

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 384, generator=g) * torch.rand(64, 1, generator=g) * 10
    ia, ib = torch.randint(0, 64, (500,), generator=g), torch.randint(0, 64, (500,), generator=g)
    ib[:50] = ia[:50]  # self pairs
    expected = cosine(x[ia].numpy(), x[ib].numpy())
    batched = sim_p(x[ia].expand(3, -1, -1), x[ib].expand(3, -1, -1), 1.0)
    assert batched.dtype == torch.float32 and (batched.numpy() == expected[None]).all()
    assert (expected[:50] == 1.0).all() and (sim_p(x[ib], x[ia], 1.0).numpy() == expected).all()
    assert np.array_equal(cosine(x[ia[:7]].numpy(), x[ib[:7]].numpy()), expected[:7])


def test_learned_p_starts_at_its_initial_value_and_moves_the_anchor():
    xa, xb = _inputs()
    model = PairAdapter("pair_ungated", D, [0, 1, 2], p=0.5, learn_p=True, width=8, hidden=8)
    torch.testing.assert_close(model.p, torch.full((3, 1), 0.5))
    out = model(xa, xb)
    torch.testing.assert_close(out.s0, sim_p(xa, xb, torch.full((3, 1), 0.5)))


def test_seeds_are_independent_models():
    xa, xb = _inputs()
    model = PairAdapter("pair_gated", D, [0, 1, 2], width=8, hidden=8)
    _perturb(model)
    model(xa, xb).score[0].sum().backward()  # a loss of seed 0 only
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert p.grad[1:].abs().max() == 0, f"{name}: seed 0's loss leaked into other seeds"
    different = PairAdapter("pair_gated", D, [0, 1, 2], width=8, hidden=8)
    assert not torch.equal(different.proj.weight[0], different.proj.weight[1]), "each seed its own init"
    same = PairAdapter("pair_gated", D, [1], width=8, hidden=8)
    torch.testing.assert_close(same.proj.weight[0], different.proj.weight[1])  # seed 1 alone == seed 1 in a group


def test_invalid_form_and_control():
    with pytest.raises(ValueError, match="Unknown adapter form 'pair'. Valid forms"):
        PairAdapter("pair", D, [0])
    with pytest.raises(ValueError, match="Control 'h_only' does not apply to form 'pair_gated'"):
        PairAdapter("pair_gated", D, [0], control="h_only")


def test_vector_scaling_is_not_a_scalar():
    """A per-sentence positive scalar cancels in the cosine; alpha must vary over dimensions."""
    xa, xb = _inputs()
    model = PairAdapter("per_sentence", D, [0, 1, 2], width=8, hidden=8)
    _perturb(model)
    out = model(xa, xb)
    assert (out.score - out.s0).abs().max() > 1e-3


@pytest.mark.parametrize("form,control", [fc for fc in ALL if fc[1] != "shuffled"])  # shuffled draws a permutation
def test_cached_projections_score_exactly_like_the_full_forward(form, control):
    """What the serving ingress does for warm sentences: their projections computed once, then reused."""
    import numpy as np

    from embed_lib.training.export import ensemble_scores, project

    novelty = None
    if form.startswith("pair"):
        from embed_lib.training.adapters import NoveltyGate
        novelty = NoveltyGate(torch.randn(20, D, generator=torch.Generator().manual_seed(5)), lo=-0.2, hi=0.4)
    model = PairAdapter(form, D, [0, 1, 2], control=control, novelty=novelty).eval()
    _perturb(model)
    xa, xb = _inputs()
    xa, xb = xa[0].numpy(), xb[0].numpy()
    full = ensemble_scores(model, xa, xb)
    ha, hb = project(model, xa), project(model, xb)
    assert (ha is None) == (form == "baseline")
    cached = ensemble_scores(model, xa, xb, ha, hb)
    for key in ("score", "baseline", "difficulty"):
        np.testing.assert_allclose(cached[key], full[key], rtol=0, atol=1e-6)


@pytest.mark.parametrize("gate_task_grad", [False, True])
def test_the_task_loss_reaches_the_gate_only_when_it_trains_jointly(gate_task_grad):
    """By default the gate learns its difficulty target alone: a loss on the score leaves the gate MLP without
    gradient (the residual MLP gets one); the target's MSE on `gate` reaches it either way."""
    xa, xb = _inputs()
    model = PairAdapter("pair_gated", D, [0, 1, 2], width=8, hidden=8, gamma=0.3, gate_task_grad=gate_task_grad)
    _perturb(model)
    out = model(xa, xb)
    out.score.pow(2).sum().backward()
    gate_grad = sum(float(p.grad.abs().sum()) for p in model.gate.parameters() if p.grad is not None)
    delta_grad = sum(float(p.grad.abs().sum()) for p in model.delta.parameters())
    assert delta_grad > 0
    assert (gate_grad > 0) == gate_task_grad
    model.zero_grad()
    out = model(xa, xb)
    (out.gate - 0.9).pow(2).sum().backward()  # the supervision term alone
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.gate.parameters())
    # the forward value is the same whichever way the gate learns
    twin = PairAdapter("pair_gated", D, [0, 1, 2], width=8, hidden=8, gamma=0.3, gate_task_grad=not gate_task_grad)
    twin.load_state_dict(model.state_dict())
    torch.testing.assert_close(twin(xa, xb).score, model(xa, xb).score, atol=0, rtol=0)
