from __future__ import annotations

import math

import pytest
import torch

from embed_lib.training import losses


def test_cosent_by_hand():
    s = torch.tensor([[0.9, 0.1, 0.5]])
    y = torch.tensor([[1.0, 0.0, 0.5]])
    # pairs with y_i > y_j: (0,1), (0,2), (2,1): terms exp((s_j - s_i)/tau)
    tau = 0.5
    expected = math.log(1 + math.exp((0.1 - 0.9) / tau) + math.exp((0.5 - 0.9) / tau) + math.exp((0.1 - 0.5) / tau))
    assert losses.cosent(s, y, tau).item() == pytest.approx(expected, rel=1e-6)


def test_cosent_is_zero_without_ordered_pairs_and_per_seed():
    s = torch.tensor([[0.3, 0.7], [0.7, 0.3]])
    assert losses.cosent(s, torch.tensor([[0.5, 0.5], [0.5, 0.5]]), 0.05).tolist() == [0.0, 0.0]
    per_seed = losses.cosent(s, torch.tensor([[1.0, 0.0], [1.0, 0.0]]), 1.0)
    assert per_seed[0].item() == pytest.approx(math.log(1 + math.exp(0.4)))  # wrong order: larger loss
    assert per_seed[1].item() == pytest.approx(math.log(1 + math.exp(-0.4)))


def test_logistic_by_hand():
    s, y = torch.tensor([[0.8, 0.2]]), torch.tensor([[1.0, 0.0]])
    center = torch.tensor([[0.5]])
    z = torch.tensor([0.3, -0.3]) / 0.1
    expected = (-torch.log(torch.sigmoid(z[0])) - torch.log(1 - torch.sigmoid(z[1]))) / 2
    assert losses.logistic(s, y, 0.1, center).item() == pytest.approx(expected.item(), rel=1e-5)


def test_mse_and_modulus_by_hand():
    x = torch.tensor([[0.2, 0.4]])
    assert losses.mse(x, x).item() == 0.0
    assert losses.mse(x, torch.zeros_like(x)).item() == pytest.approx((0.04 + 0.16) / 2)
    na, nb = torch.tensor([[2.0, 3.0]]), torch.tensor([[2.0, 3.0 * math.e]])
    assert losses.modulus(na, na, torch.ones(1, 2)).item() == 0.0
    # only the second pair is similar (y=1): (log 3 - log 3e)^2 = 1
    assert losses.modulus(na, nb, torch.tensor([[0.0, 1.0]])).item() == pytest.approx(1.0)
