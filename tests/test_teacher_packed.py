"""The teacher's training steps on real tokens only (`embed_lib.teacher.packed`): the model's own logits, gradients
and random draws, the padding's arithmetic left out."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from embed_lib.teacher import packed, recipe
from embed_lib.teacher.config import TeacherConfig

CFG = TeacherConfig(folds=2, epochs=2, batch_size=4, max_length=48)
PAIRS = [["A man is playing a guitar on the stage tonight.", "A man plays guitar."],
         ["Stocks fell.", "The market went down sharply today in New York after the report."],
         ["Yes.", "No."], ["Two dogs run.", "Dogs run."]]


@pytest.fixture(scope="module")
def ce():
    model = recipe.load(CFG, "cpu", seed=0)
    model.model.get_input_embeddings().weight.requires_grad_(False)
    return model


def _features(ce, pairs=PAIRS):
    return {k: v for k, v in ce.preprocess(pairs).items() if isinstance(v, torch.Tensor)}


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_batch_is_padded_so_the_packing_has_work_to_do(ce):
    mask = _features(ce)["attention_mask"]
    assert mask.shape[0] == 4 and int(mask.sum()) < 0.75 * mask.numel()  # rows of 7-19 tokens padded to 19
    assert packed.supports(ce.model, _features(ce))


def test_packed_logits_are_the_models_own_in_eval(ce):
    ce.model.eval()
    with torch.no_grad():
        own = ce(ce.preprocess(PAIRS))["scores"].view(-1)
        mine = packed.packed_logits(ce.model, _features(ce)).view(-1)
    torch.testing.assert_close(mine, own, rtol=0, atol=1e-6)


def test_a_training_step_draws_the_models_dropout_and_gives_its_gradients(ce):
    model = ce.model
    model.train()
    try:
        torch.manual_seed(5)
        own = ce(ce.preprocess(PAIRS))["scores"].view(-1)
        own.square().sum().backward()
        after_own, g_own = torch.get_rng_state(), _grads(model)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        mine = packed.packed_logits(model, _features(ce)).view(-1)
        mine.square().sum().backward()
        after_mine, g_mine = torch.get_rng_state(), _grads(model)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(6)  # another draw of the dropout masks: other logits (the masks matter)
        other = packed.packed_logits(model, _features(ce)).view(-1)
    finally:
        model.eval()
    torch.testing.assert_close(mine, own, rtol=0, atol=1e-6)
    assert (other - own).abs().max() > 1e-3
    assert torch.equal(after_mine, after_own)  # the same random numbers drawn: later steps draw the same masks
    assert set(g_mine) == set(g_own) and "bert.embeddings.word_embeddings.weight" not in g_own
    scale = max(g.abs().max() for g in g_own.values())
    # the keys' biases move no score (softmax ignores a constant added to a row): their true gradient is 0, rounding
    for name, g in g_own.items():
        torch.testing.assert_close(g_mine[name], g, rtol=1e-3, atol=1e-5 * scale, msg=name)


def test_bf16_autocast_gives_the_models_logits_within_its_rounding(ce):
    ce.model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        own = ce(ce.preprocess(PAIRS))["scores"].view(-1).float()
        mine = packed.training_logits(ce, PAIRS).float()
    torch.testing.assert_close(mine, own, rtol=0, atol=2e-2)


def test_fitting_packed_trains_the_model_the_padded_forward_trains(ce, monkeypatch):
    y = np.array([0.9, 0.1, 0.3, 0.6], dtype=np.float32)
    cfg = dataclasses.replace(CFG, epochs=3)  # batches of 4 of the 8 examples: padded (of 2, a pair and its reverse)
    start = {k: v.clone() for k, v in ce.model.state_dict().items()}
    curve_packed = recipe.fit(ce, PAIRS, y, cfg, seed=3)
    packed_state = {k: v.clone() for k, v in ce.model.state_dict().items()}
    ce.model.load_state_dict(start)
    calls = []
    monkeypatch.setattr(packed, "supports", lambda *a: bool(calls.append(1)))  # counted, refused
    curve_padded = recipe.fit(ce, PAIRS, y, cfg, seed=3)
    padded_state = {k: v.clone() for k, v in ce.model.state_dict().items()}
    ce.model.load_state_dict(start)
    assert len(calls) == 6  # 3 epochs of 8 examples (both orders) in batches of 4 went through the fallback
    assert [round(c["train_loss"], 5) for c in curve_packed] == [round(c["train_loss"], 5) for c in curve_padded]
    moved = max(float((packed_state[k] - start[k]).abs().max()) for k in start)
    assert moved > 1e-4  # it trained
    for k in start:
        torch.testing.assert_close(packed_state[k], padded_state[k], rtol=0, atol=1e-5, msg=k)


def test_what_the_packing_refuses_takes_the_models_own_forward(ce, monkeypatch):
    features = _features(ce)
    left = {**features, "attention_mask": features["attention_mask"].flip(1)}  # padded on the left
    assert not packed.supports(ce.model, left)
    assert not packed.supports(ce.model, {k: v for k, v in features.items() if k != "attention_mask"})
    assert not packed.supports(torch.nn.Linear(2, 2), features)
    ce.model.config.is_decoder = True
    try:
        assert not packed.supports(ce.model, features)
    finally:
        ce.model.config.is_decoder = False
    ce.model.eval()
    monkeypatch.setattr(packed, "packed_logits", None)  # never called: training_logits takes the model's scores
    monkeypatch.setattr(packed, "supports", lambda *a: False)
    with torch.no_grad():
        torch.testing.assert_close(packed.training_logits(ce, PAIRS),
                                   ce(ce.preprocess(PAIRS))["scores"].view(-1), rtol=0, atol=0)
