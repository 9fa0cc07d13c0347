from __future__ import annotations

import numpy as np
import pytest

from embed_lib.training.signals import (SURFACE_CAPS, ce_margin, jaccard, lexical_hard, per_sentence_mean,
                                        rank_normalise, surface_complexity, surface_features)


def test_surface_features_by_hand():
    f = surface_features("The cat sat, and the dog barked because it was raining.")
    assert f["tokens"] == 11 and f["punct"] == 2 and f["conjunctions"] == 1 and f["subordinators"] == 1
    assert f["clauses"] == 3  # 1 + conjunction + subordinator
    assert f["verbs"] == 3  # barked, was, raining
    assert f["arguments"] == 3  # the, the, it


def test_surface_complexity_is_capped_mean():
    short, long = surface_complexity(["Hi.", "word " * 500])
    assert 0 <= short < long <= 1
    only_tokens = surface_complexity(["a b c d"], weights={"tokens": 1.0})
    assert only_tokens[0] == pytest.approx(4 / SURFACE_CAPS["tokens"])
    with pytest.raises(ValueError, match=r"Unknown surface feature\(s\) \['words'\]"):
        surface_complexity(["x"], weights={"words": 1.0})


def test_lexical_hard_pair_by_hand():
    assert jaccard("a b c", "b c d") == pytest.approx(0.5)
    hard = lexical_hard(["a b c", "a b"], ["b c d", "a b"], np.array([1.0, 0.0]))
    # overlap 0.5 with gold 1 -> 0.5; identical non-paraphrase -> |1 - 0| = 1
    np.testing.assert_allclose(hard, [0.5, 1.0])


def test_per_sentence_mean_by_hand():
    ia, ib = np.array([0, 0]), np.array([1, 2])
    v = per_sentence_mean(ia, ib, np.array([0.2, 0.6]), n_sentences=4)
    np.testing.assert_allclose(v, [0.4, 0.2, 0.6, 0.4])  # sentence 3 unseen -> mean of the pairs


def test_ce_margin_is_rank_disagreement():
    np.testing.assert_allclose(rank_normalise(np.array([10.0, 30.0, 20.0])), [0.0, 1.0, 0.5])
    same_order = ce_margin(np.array([0.1, 0.5, 0.9]), np.array([0.2, 0.3, 0.4]))
    np.testing.assert_allclose(same_order, 0.0)  # calibration does not matter, only ranks
    np.testing.assert_allclose(ce_margin(np.array([0.9, 0.5, 0.1]), np.array([0.2, 0.3, 0.4])), [1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="differ in length"):
        ce_margin(np.zeros(2), np.zeros(3))
