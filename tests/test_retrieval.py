"""Retrieval metrics by hand on a 5-query toy corpus, and the BEIR-Quora-style construction."""
from __future__ import annotations

import math

import numpy as np
import pytest

from embed_lib.training import retrieval as R


def test_metrics_match_hand_computed_values_on_a_toy_corpus():
    # 5 queries over documents 0..9; rankings and relevance chosen so each case is computed by hand
    rankings = [[1, 2, 3], [4, 1, 2], [5, 6, 7], [8, 9, 0], [2, 3, 4]]
    relevant = [{1}, {1, 2}, {9}, {0, 9}, {3}]
    # q0: rel at rank 1 -> nDCG 1, MRR 1, recall 1
    # q1: rel at ranks 2, 3 -> DCG = 1/log2(3) + 1/log2(4); ideal = 1 + 1/log2(3); MRR 1/2
    # q2: rel not retrieved -> 0, 0, recall 0
    # q3: rel at ranks 2, 3 -> same as q1; recall 1
    # q4: rel at rank 2 -> nDCG 1/log2(3), MRR 1/2
    q1 = (1 / math.log2(3) + 1 / math.log2(4)) / (1 + 1 / math.log2(3))
    m = R.ranking_metrics(rankings, relevant)
    assert m["ndcg@10"] == pytest.approx((1 + q1 + 0 + q1 + 1 / math.log2(3)) / 5)
    assert m["mrr@10"] == pytest.approx((1 + 0.5 + 0 + 0.5 + 0.5) / 5)
    assert m["recall@100"] == pytest.approx((1 + 1 + 0 + 1 + 1) / 5)
    assert R.ndcg_at_k([5, 5, 1], {1}, k=2) == 0.0 and R.mrr_at_k([0, 1], {1}, k=1) == 0.0


def test_build_set_cosine_top_k_and_rerank():
    s1 = ["how to cook rice", "how to cook rice", "best phone 2020", "is the sky blue"]
    s2 = ["ways to cook rice", "rice cooking tips", "top phone 2020", "why is grass green"]
    rs = R.build_retrieval_set(s1, s2, np.array([1, 1, 1, 0]))
    assert len(rs.texts) == 7
    row = {t: i for i, t in enumerate(rs.texts)}
    assert [rs.texts[q] for q in rs.queries] == ["how to cook rice", "best phone 2020"]
    assert rs.relevant[0] == {row["ways to cook rice"], row["rice cooking tips"]}
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(7, 4))
    top = R.cosine_top_k(vectors, rs.queries, k=3)
    assert top.shape == (2, 3) and not any(q in t for q, t in zip(rs.queries, top))  # never the query itself
    v = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    assert list(top[0]) == [d for d in np.argsort(-(v @ v[rs.queries[0]])) if d != rs.queries[0]][:3]
    # a re-ranker that prefers larger document rows reverses into descending order
    again = R.rerank(top, rs.queries, lambda qs, ds: ds.astype(float))
    assert all(list(r) == sorted(r, reverse=True) for r in again)
