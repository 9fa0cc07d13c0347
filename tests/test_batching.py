"""Batches of similar length (embed_lib.encoding.batching) and that batching never changes what a model computes."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from embed_lib.encoding.batching import length_batches
from embed_lib.encoding.onnx_backend import cross_encoder_max_tokens


def _as_lists(batches):
    return [b.tolist() for b in batches]


def test_batches_cut_where_the_length_drops_past_the_slack():
    lengths = [10, 50, 12, 48, 40, 11, 30]
    # longest first: 50 48 40 | 30 | 12 11 10  (40 * 1.25 = 50 stays; 30 * 1.25 < 50 cuts; 12 * 1.25 < 30 cuts)
    assert _as_lists(length_batches(lengths, max_batch=32, slack=0.25)) == [[1, 3, 4], [6], [2, 5, 0]]


def test_max_batch_caps_each_batch_and_infinite_slack_gives_fixed_chunks():
    lengths = [5, 9, 7, 3, 8]
    assert _as_lists(length_batches(lengths, max_batch=2, slack=float("inf"))) == [[1, 4], [2, 0], [3]]
    assert _as_lists(length_batches(lengths, max_batch=2, slack=0.0)) == [[1], [4], [2], [0], [3]]


def test_every_index_once_and_padding_bounded_by_the_slack():
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 120, size=500)
    batches = length_batches(lengths, max_batch=32, slack=0.2)
    assert sorted(np.concatenate(batches).tolist()) == list(range(500))
    for b in batches:
        assert 1 <= len(b) <= 32
        assert lengths[b].min() * 1.2 >= lengths[b].max()
    assert length_batches([], max_batch=4) == []


def test_equal_lengths_keep_their_order():
    assert _as_lists(length_batches([4, 4, 4, 4], max_batch=3, slack=0.0)) == [[0, 1, 2], [3]]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="max_batch must be >= 1, got 0"):
        length_batches([1, 2], max_batch=0)
    with pytest.raises(ValueError, match="slack must be >= 0, got -0.1"):
        length_batches([1, 2], max_batch=2, slack=-0.1)


PAIRS = [("A man is playing a guitar.", "A man plays the guitar."), ("ok", "no"),
         ("The committee, which had met on several occasions during the long negotiations, agreed that the "
          "proposal would be revised before the vote.", "The proposal will be revised, the committee agreed."),
         ("A cat sleeps.", "Stocks fell sharply on Monday after the central bank raised interest rates.")]


def test_cross_encoder_scores_do_not_depend_on_the_batching(tmp_path):
    from embed_lib.teacher.cross_encoder import PairCrossEncoder

    saved = tmp_path / "ce"  # "minilm" as a cross-encoder gets a fresh random head at every load: save one
    PairCrossEncoder("minilm").ce.save_pretrained(str(saved))
    ce = PairCrossEncoder(saved)
    with warnings.catch_warnings():  # its cut read through sentence-transformers' current property, not the old one
        warnings.simplefilter("error", DeprecationWarning)
        lengths = ce.token_lengths(PAIRS)
        cut = cross_encoder_max_tokens(ce.ce)
    assert lengths[1] == 5  # [CLS] ok [SEP] no [SEP]
    assert lengths[2] == max(lengths)
    assert ce.token_lengths([("word " * 2 * cut, "word")]) == [cut]  # a pair past the cut counts as the model reads it
    one_batch = PairCrossEncoder(saved, slack=float("inf")).logits(PAIRS)
    singles = PairCrossEncoder(saved, slack=0.0, batch_size=1).logits(PAIRS)
    assert np.std(one_batch) > 0  # the pairs score differently: equal scores would make the comparisons below vacuous
    np.testing.assert_allclose(ce.logits(PAIRS), one_batch, atol=1e-5)
    np.testing.assert_allclose(singles, one_batch, atol=1e-5)


def test_encoder_vectors_do_not_depend_on_the_batching(encoder):
    texts = [t for p in PAIRS for t in p]
    lengths = encoder.token_lengths(texts)
    assert lengths[2] == 3  # [CLS] ok [SEP]
    got = encoder.encode(texts)
    alone = np.stack([encoder.encode([t])[0] for t in texts])
    np.testing.assert_allclose(got, alone, atol=1e-5)
    # the texts' mixed lengths make encode() run more than one batch, so the comparison above crossed batches
    assert len(length_batches(lengths, encoder.config.batch_size)) > 1


def _right_while_another_thread_tokenizes(run, token_lengths, batches: list) -> None:
    """Each batch gives what it gives alone while a second thread measures token lengths meanwhile (what one of a
    deployment's two batches in flight does while the other is being padded). Hugging Face fast tokenizers keep
    padding / truncation as state that every call resets: unguarded, the padded call could get unpadded rows
    ('expected sequence of length 23 at dim 1 (got 22)'; 11 failures in 300 calls measured before the fix: 100 calls
    leave such a regression unseen about 2% of the time)."""
    import threading

    alone = [run(b) for b in batches]
    done, measured = threading.Event(), [0]

    def measure() -> None:
        while not done.is_set():
            token_lengths([p for b in batches[:4] for p in b])
            measured[0] += 1

    other = threading.Thread(target=measure)
    other.start()
    try:
        together = [run(b) for b in batches]
    finally:
        done.set()
        other.join()
    assert measured[0] > len(batches)  # the second thread was tokenizing all along
    for got, want in zip(together, alone):
        np.testing.assert_allclose(got, want, atol=1e-5)


def _mixed_batches(n: int = 100) -> list:
    rng = np.random.default_rng(0)
    pool = [(a[: 5 + i], b[: 3 + i]) for i, (a, b) in enumerate(PAIRS * 8)]
    return [[pool[i] for i in rng.choice(len(pool), size=int(rng.integers(2, 6)), replace=False)] for _ in range(n)]


def test_one_cross_encoder_scores_right_while_another_thread_tokenizes(tmp_path):
    from embed_lib.teacher.cross_encoder import PairCrossEncoder

    saved = tmp_path / "ce"
    PairCrossEncoder("minilm").ce.save_pretrained(str(saved))
    ce = PairCrossEncoder(saved)
    _right_while_another_thread_tokenizes(ce.logits, ce.token_lengths, _mixed_batches())


def test_one_encoder_encodes_right_while_another_thread_tokenizes(encoder):
    _right_while_another_thread_tokenizes(lambda batch: encoder.encode([t for p in batch for t in p]),
                                          lambda pairs: encoder.token_lengths([t for p in pairs for t in p]),
                                          _mixed_batches())
