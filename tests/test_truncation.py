"""Texts cut to a number of tokens (embed_lib/encoding/truncation.py) and the client APIs' truncation options that ask
for it (serving/truncation.py, serving/schemas.py). Through a served champion: tests/test_serving.py."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from embed_lib.encoding.truncation import cut

#: "A man is playing the guitarist unbelievably well." as MiniLM's tokenizer reads it: 13 tokens, 9 words
TEXT = "A man is playing the guitarist unbelievably well."
TOKENS = ["a", "man", "is", "playing", "the", "guitarist", "un", "##bel", "##ie", "##va", "##bly", "well", "."]
OFFSETS = [(0, 1), (2, 5), (6, 8), (9, 16), (17, 20), (21, 30), (31, 33), (33, 36), (36, 38), (38, 40), (40, 43),
           (44, 48), (48, 49)]
WORDS = [0, 1, 2, 3, 4, 5, 6, 6, 6, 6, 6, 7, 8]


@pytest.mark.parametrize("keep, side, expected", [
    (13, "right", TEXT), (13, "left", TEXT), (50, "left", TEXT),
    (1, "right", "A"), (3, "right", "A man is"),
    (8, "right", "A man is playing the guitarist unbel"),  # the end of the 8th token, inside a word: "un" "##bel"
    (1, "left", "."), (2, "left", "well."),
    (3, "left", "well."),  # the 3rd last token is "##bly", inside "unbelievably": on to the next word
    (7, "left", "unbelievably well."), (8, "left", "guitarist unbelievably well.")])
def test_a_cut_keeps_the_first_tokens_or_the_last_from_the_start_of_a_word(keep, side, expected):
    assert cut(TEXT, OFFSETS, WORDS, keep, side) == expected


def test_a_last_word_longer_than_what_is_kept_is_cut_inside_it():
    offsets, words = [(0, 2), (3, 5), (5, 7), (7, 9)], [0, 1, 1, 1]  # "ab cdefg": "ab", "cd", "##ef", "##g"
    assert cut("ab cdefg", offsets, words, 2, "left") == "efg"


def test_a_cut_refuses_nothing_to_keep_and_an_unknown_side():
    with pytest.raises(ValueError, match="keep=0: keep at least 1 token"):
        cut(TEXT, OFFSETS, WORDS, 0, "right")
    with pytest.raises(ValueError, match=r"side='middle'; give one of \['right', 'left'\]"):
        cut(TEXT, OFFSETS, WORDS, 3, "middle")


@pytest.fixture(scope="module")
def frozen():
    from embed_lib.encoding.encoders import FrozenEncoder

    return FrozenEncoder()


def test_the_encoder_cuts_at_its_own_tokens_and_reads_the_cut_text_as_those_tokens(frozen):
    tok = frozen.model.tokenizer
    assert tok.tokenize(TEXT) == TOKENS  # the hand-written offsets above are this tokenizer's
    long = " ".join(["The quick brown fox jumps over the lazy dog near unbelievably tall trees."] * 30)
    (right, short), counts, most = frozen.truncate([long, TEXT])
    assert most == 256 - 2 and counts[0] > most and counts[1] == 13  # max_seq_length less [CLS] and [SEP]
    assert short == TEXT and len(tok.tokenize(right)) == most
    # the encoder's own cut (the first 254 tokens) and the text cut there give the same vector
    np.testing.assert_allclose(frozen.encode([right]), frozen.encode([long]), atol=1e-5)
    (left,), _, _ = frozen.truncate([long], keep=20, side="left")
    tokens = tok.tokenize(long)
    assert tok.tokenize(left) == tokens[-len(tok.tokenize(left)):] and 0 < len(tok.tokenize(left)) <= 20
    assert not tok.tokenize(left)[0].startswith("##") and long.endswith(left)


def test_counting_the_special_tokens_leaves_two_fewer_for_the_text(frozen):
    (text,), _, _ = frozen.truncate([TEXT], keep=5, side="right", counting_special=True)
    assert text == "A man is"  # 5 tokens read: [CLS] a man is [SEP]
    with pytest.raises(ValueError, match="2 tokens leave none of the text: the encoder reads each text with 2 more "
                                         r"\(special tokens and prompt\); give at least 3"):
        frozen.truncate([TEXT], keep=2, counting_special=True)


def test_each_apis_options_ask_for_their_cut():
    from serving.errors import ApiError
    from serving.schemas import RerankRequest, ScoreRequest, TeiRerankRequest
    from serving.truncation import Truncation

    def score(k):
        return ScoreRequest(pairs=[["a", "b"]], truncate_prompt_tokens=k).truncation(256)

    assert score(None) is None
    assert score(-1) == Truncation("truncate_prompt_tokens", side="left")
    assert score(256) == Truncation("truncate_prompt_tokens", keep=256, side="left", counting_special=True)
    for k in (0, 257):
        with pytest.raises(ApiError) as e:
            score(k)
        assert e.value.status == 422 and e.value.field == "truncate_prompt_tokens" and f"={k}: give -1" in str(e.value)

    def cohere(n):
        return RerankRequest(query="q", documents=["d"], max_tokens_per_doc=n).truncation(256)

    assert cohere(None) is None and cohere(4096) is None  # Cohere's default cuts nothing the encoder reads
    assert cohere(10) == Truncation("max_tokens_per_doc", keep=10, query=False)

    def tei(**kw):
        return TeiRerankRequest(query="q", texts=["d"], **kw).truncation()

    assert tei() is None and tei(truncate=True) is None and tei(truncation_direction="Right") is None
    assert tei(truncate=False) == Truncation("truncate", strict=True, texts_field="texts")
    assert tei(truncation_direction="Left") == Truncation("truncation_direction", side="left", texts_field="texts")


class _Remote:
    """An encoder deployment's handle method in-process: `.remote(...)` awaits the library's call."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    async def remote(self, *args):
        self.calls.append(args)
        return self.fn(*args)


class _Encoder:
    def __init__(self, frozen):
        self.truncate = _Remote(frozen.truncate)


def test_pairs_are_cut_each_distinct_text_once_and_a_strict_request_names_the_long_text(frozen):
    from serving.errors import ApiError
    from serving.truncation import Truncation, truncated_pairs

    enc = _Encoder(frozen)
    long = " ".join(["word"] * 300)
    pairs = [("the query here", TEXT), ("the query here", long)]
    out = asyncio.run(truncated_pairs(enc, pairs, Truncation("max_tokens_per_doc", keep=2, query=False)))
    assert out == [("the query here", "A man"), ("the query here", "word word")]
    assert enc.truncate.calls[-1][0] == [TEXT, long]  # documents only, each once
    out = asyncio.run(truncated_pairs(enc, pairs, Truncation("truncation_direction", side="left", texts_field="texts")))
    assert out[0] == pairs[0] and out[1][1] == " ".join(["word"] * 254)
    assert enc.truncate.calls[-1][0] == ["the query here", TEXT, long]
    with pytest.raises(ApiError) as e:
        asyncio.run(truncated_pairs(enc, pairs, Truncation("truncate", strict=True, texts_field="texts")))
    assert e.value.status == 413 and e.value.field == "texts[1]"
    assert str(e.value).startswith("texts[1] has 300 tokens; the encoder reads at most 254 of a text. Send "
                                   "truncate=true to cut it")
    assert asyncio.run(truncated_pairs(enc, pairs[:1], Truncation("truncate", strict=True))) == pairs[:1]
    with pytest.raises(ApiError) as e:
        asyncio.run(truncated_pairs(enc, pairs, Truncation("truncate_prompt_tokens", keep=1, counting_special=True)))
    assert e.value.status == 422 and str(e.value).startswith("truncate_prompt_tokens: 1 tokens leave none of the text")
    assert asyncio.run(truncated_pairs(enc, pairs, None)) is pairs
