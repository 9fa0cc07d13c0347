from __future__ import annotations

import numpy as np
import pytest
from scipy import stats
from sklearn.metrics import accuracy_score, average_precision_score, f1_score, roc_auc_score

from embed_lib.training.metrics import best_threshold, cosine, evaluate, paired_bootstrap


def _brute_force(s, y):
    best_acc, best_f1 = (y == 0).mean(), 0.0
    for t in np.unique(s):
        pred = s >= t
        best_acc = max(best_acc, accuracy_score(y, pred))
        best_f1 = max(best_f1, f1_score(y, pred, zero_division=0.0))
    return best_acc, best_f1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_binary_metrics_match_scipy_and_sklearn(seed):
    rng = np.random.default_rng(seed)
    y = (rng.random(300) < 0.4).astype(float)
    s = np.round(y * 0.5 + rng.normal(size=300), 1)  # rounding makes ties
    m = evaluate(s, y, binary=True, prefix="val")
    assert m["val/spearman"] == pytest.approx(stats.spearmanr(s, y).statistic)
    assert m["val/pearson"] == pytest.approx(stats.pearsonr(s, y).statistic)
    assert m["val/roc_auc"] == pytest.approx(roc_auc_score(y, s))
    assert m["val/average_precision"] == pytest.approx(average_precision_score(y, s))
    acc, f1 = _brute_force(s, y)
    assert m["val/accuracy"] == pytest.approx(acc)
    assert m["val/f1"] == pytest.approx(f1)
    assert accuracy_score(y, s >= m["val/threshold_acc"]) == pytest.approx(acc)


def test_best_threshold_by_hand():
    # scores 0.9 0.8 0.3 0.1 with labels 1 0 1 0: best accuracy 0.75 at t=0.9 (or 0.3), best F1 0.8 at t=0.3
    t_acc, acc, t_f1, f1 = best_threshold([0.9, 0.8, 0.3, 0.1], [1, 0, 1, 0])
    assert acc == pytest.approx(0.75) and t_acc == pytest.approx(0.9)
    assert f1 == pytest.approx(0.8) and t_f1 == pytest.approx(0.3)


def test_threshold_chosen_elsewhere_is_applied():
    m = evaluate([0.9, 0.8, 0.3, 0.1], [1, 0, 1, 0], binary=True, threshold=0.85)
    assert m["accuracy_at_threshold"] == pytest.approx(0.75)
    assert m["f1_at_threshold"] == pytest.approx(2 / 3)


def test_graded_has_no_binary_metrics_and_errors_are_clear():
    m = evaluate([0.1, 0.2, 0.3, 0.5], [0.0, 0.1, 0.4, 0.3], binary=False)
    assert set(m) == {"spearman", "pearson"}
    assert m["spearman"] == pytest.approx(0.8)
    with pytest.raises(ValueError, match=r"scores \(3\) and labels \(4\) differ"):
        evaluate([0.1, 0.2, 0.3], [0, 1, 0, 1], binary=True)
    with pytest.raises(ValueError, match="non-finite"):
        evaluate([0.1, np.nan, 0.3], [0, 1, 0], binary=True)
    with pytest.raises(ValueError, match="both classes"):
        evaluate([0.1, 0.2, 0.3], [1, 1, 1], binary=True)


def test_cosine_by_hand():
    a = np.array([[1.0, 0.0], [3.0, 4.0]])
    b = np.array([[0.0, 2.0], [6.0, 8.0]])
    np.testing.assert_allclose(cosine(a, b), [0.0, 1.0])


def test_paired_bootstrap_by_hand_and_its_invariants():
    g = np.random.default_rng(0)
    y = g.normal(size=400)
    ref = y + g.normal(scale=1.0, size=400)
    better = y + g.normal(scale=0.5, size=400)
    b = paired_bootstrap(better, ref, y, resamples=300, seed=1)
    # by hand: the same resamples, both sides ranked on each
    h = np.random.default_rng(1)
    d = []
    for _ in range(300):
        i = h.integers(0, 400, 400)
        d.append(stats.spearmanr(better[i], y[i]).statistic - stats.spearmanr(ref[i], y[i]).statistic)
    assert b["low"] == pytest.approx(np.quantile(d, 0.025)) and b["high"] == pytest.approx(np.quantile(d, 0.975))
    assert b["resamples"] == 300 and b["dropped"] == 0 and b["share_above_0"] == 1.0 and b["low"] > 0
    same = paired_bootstrap(ref, ref, y, resamples=50)  # paired: a model against itself differs by exactly 0
    assert same["low"] == same["high"] == 0.0 and same["share_above_0"] == 0.0
    swapped = paired_bootstrap(ref, better, y, resamples=300, seed=1)  # antisymmetric
    assert swapped["low"] == pytest.approx(-b["high"]) and swapped["high"] == pytest.approx(-b["low"])
    with pytest.raises(ValueError, match="one length >= 3"):
        paired_bootstrap(ref[:5], ref[:4], y[:5])
    with pytest.raises(ValueError, match="every resample had a constant side"):
        paired_bootstrap(np.ones(4), ref[:4], y[:4], resamples=10)
