"""Re-ranking check on a duplicate-question retrieval set, built the way BEIR's Quora set is built.

From one split of a binary duplicate task (QQP): the queries are the first questions of its duplicate
pairs; the corpus is every distinct question of the split; a query's relevant documents are its
duplicates in the split (the query itself is never a candidate). The frozen cosine retrieves the top-k
(default 100) documents; the adapter re-scores only those (a re-ranker over cached vectors). Metrics
per query, averaged: nDCG@10, MRR@10, Recall@100 (binary relevance).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from embed_lib.training.metrics import cosine


@dataclass
class RetrievalSet:
    texts: list[str]  # the corpus (distinct questions)
    queries: np.ndarray  # (q,) corpus rows of the queries
    relevant: list[set[int]]  # per query: corpus rows of its duplicates


def build_retrieval_set(sentence1: Sequence[str], sentence2: Sequence[str], labels: np.ndarray) -> RetrievalSet:
    """Queries, corpus and relevance from labelled pairs (see module docstring)."""
    texts = list(dict.fromkeys([*sentence1, *sentence2]))
    row = {t: i for i, t in enumerate(texts)}
    dup: dict[int, set[int]] = defaultdict(set)
    for a, b, y in zip(sentence1, sentence2, labels):
        if y >= 0.5 and a != b:
            dup[row[a]].add(row[b])
            dup[row[b]].add(row[a])
    queries = list(dict.fromkeys(row[a] for a, b, y in zip(sentence1, sentence2, labels) if y >= 0.5 and a != b))
    return RetrievalSet(texts, np.array(queries, dtype=np.int64), [dup[q] for q in queries])


def ndcg_at_k(ranked: Sequence[int], relevant: set[int], k: int = 10) -> float:
    """Binary-relevance nDCG@k: sum_{i<k, d_i rel} 1/log2(i+2) / sum_{i<min(k,|rel|)} 1/log2(i+2)."""
    dcg = sum(1.0 / np.log2(i + 2) for i, d in enumerate(ranked[:k]) if d in relevant)
    ideal = sum(1.0 / np.log2(i + 2) for i in range(min(k, len(relevant))))
    return dcg / ideal if ideal else 0.0


def mrr_at_k(ranked: Sequence[int], relevant: set[int], k: int = 10) -> float:
    """1 / rank of the first relevant document within the top k, else 0."""
    for i, d in enumerate(ranked[:k]):
        if d in relevant:
            return 1.0 / (i + 1)
    return 0.0


def recall_at_k(ranked: Sequence[int], relevant: set[int], k: int = 100) -> float:
    return len(set(ranked[:k]) & relevant) / len(relevant) if relevant else 0.0


def ranking_metrics(rankings: Sequence[Sequence[int]], relevant: Sequence[set[int]]) -> dict[str, float]:
    return {"ndcg@10": float(np.mean([ndcg_at_k(r, rel) for r, rel in zip(rankings, relevant)])),
            "mrr@10": float(np.mean([mrr_at_k(r, rel) for r, rel in zip(rankings, relevant)])),
            "recall@100": float(np.mean([recall_at_k(r, rel) for r, rel in zip(rankings, relevant)]))}


#: transfer tasks whose validation pairs also make a retrieval check in every trained group (duplicate questions)
RETRIEVAL_TRANSFER = ("qqp",)
#: candidates the in-training check re-ranks: nDCG@10 of the frozen top 20 re-ordered, a fifth of the cost of
#: the top 100 that `python -m embed_lib retrieval` re-ranks once for the winner
CHECK_TOP_K = 20


@dataclass
class RetrievalCheck:
    """A retrieval set over rows of a study's vectors, with the frozen cosine's candidates and nDCG@10."""

    queries: np.ndarray  # (q,) rows
    candidates: np.ndarray  # (q, k) rows: the frozen cosine's top k, best first
    relevant: list[set[int]]  # per query: rows of its duplicates
    baseline_ndcg: float  # the frozen cosine's nDCG@10 on these candidates

    def pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """(q * k,) query rows and candidate rows: every pair the adapter scores."""
        q, k = self.candidates.shape
        return np.repeat(self.queries, k), self.candidates.reshape(-1)

    def deltas(self, scores: np.ndarray) -> list[float]:
        """(S, q * k) scores of `pairs()` per seed -> each seed's nDCG@10 minus the frozen cosine's."""
        q, k = self.candidates.shape
        return [float(np.mean([ndcg_at_k(r, rel) for r, rel in zip(order_by(self.candidates, s.reshape(q, k)),
                                                                      self.relevant)])) - self.baseline_ndcg
                for s in scores]


def retrieval_check(vectors: np.ndarray, ia: np.ndarray, ib: np.ndarray, labels: np.ndarray,
                    k: int = CHECK_TOP_K) -> RetrievalCheck | None:
    """The retrieval set (module docstring) of the pairs (rows ia, ib of `vectors`), or None without duplicates."""
    rs = build_retrieval_set(ia.tolist(), ib.tolist(), labels)
    if not len(rs.queries):
        return None
    rows = np.asarray(rs.texts, dtype=np.int64)  # corpus position -> row
    queries, candidates = rows[rs.queries], rows[cosine_top_k(vectors[rows], rs.queries, k)]
    # in the order of the frozen cosine the adapters anchor to (bit for bit), so the baseline form's delta is 0
    s0 = cosine(vectors[np.repeat(queries, candidates.shape[1])], vectors[candidates.reshape(-1)])
    candidates = order_by(candidates, s0.reshape(candidates.shape))
    relevant = [{int(rows[j]) for j in rel} for rel in rs.relevant]
    base = float(np.mean([ndcg_at_k(r, rel) for r, rel in zip(candidates, relevant)]))
    return RetrievalCheck(queries, candidates, relevant, base)


def cosine_top_k(vectors: np.ndarray, queries: np.ndarray, k: int = 100) -> np.ndarray:
    """(q, k) corpus rows by frozen cosine, best first, the query itself excluded."""
    v = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    sims = v[queries] @ v.T  # (q, n)
    sims[np.arange(len(queries)), queries] = -np.inf
    k = min(k, v.shape[0] - 1)
    top = np.argpartition(-sims, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(sims, top, 1), axis=1, kind="stable")
    return np.take_along_axis(top, order, 1)


def order_by(candidates: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """(q, k) candidates re-ordered by their (q, k) scores, best first (ties keep the cosine's order)."""
    return np.take_along_axis(candidates, np.argsort(-scores, axis=1, kind="stable"), 1)


def rerank(candidates: np.ndarray, queries: np.ndarray,
           score_pairs: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> np.ndarray:
    """(q, k) candidates re-ordered by score_pairs(query rows, doc rows) -> (n_pairs,) scores."""
    q, k = candidates.shape
    return order_by(candidates, score_pairs(np.repeat(queries, k), candidates.reshape(-1)).reshape(q, k))


def seed_scores(model, vectors: np.ndarray, queries: np.ndarray, candidates: np.ndarray,
                chunk: int = 8192) -> np.ndarray:
    """(S, q, k) scores of every seed of a PairAdapter group for each query against its candidates."""
    S, (q, k) = len(model.seeds), candidates.shape
    V = torch.from_numpy(vectors)
    qs, ds = np.repeat(queries, k), candidates.reshape(-1)
    with torch.no_grad():
        out = [model(V[qs[i: i + chunk]].expand(S, -1, -1), V[ds[i: i + chunk]].expand(S, -1, -1)).score
               for i in range(0, len(qs), chunk)]
    return torch.cat(out, 1).numpy().reshape(S, q, k)
