from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from embed_lib.encoding.cache import EmbeddingCache, cache_key
from embed_lib.config import EncoderConfig
from embed_lib.encoding.encoders import FrozenEncoder, encoder_manifest

TEXTS = ["A man is playing a guitar.", "A woman is slicing an onion.", "Two dogs run in the snow."]


class CountingEncoder:
    def __init__(self, enc):
        self.enc, self.calls, self.encoded = enc, 0, 0

    def manifest(self):
        return self.enc.manifest()

    def encode(self, texts):
        self.calls += 1
        self.encoded += len(texts)
        return self.enc.encode(texts)


def test_hit_after_miss_and_duplicates_encoded_once(tmp_path, encoder):
    enc = CountingEncoder(encoder)
    cache = EmbeddingCache(encoder.manifest(), tmp_path)
    first = cache.get(TEXTS + TEXTS[:1], enc)
    assert enc.encoded == 3 and cache.stats.misses == 3
    np.testing.assert_array_equal(first[0], first[3])
    second = EmbeddingCache(encoder.manifest(), tmp_path).get(TEXTS[::-1])  # no encoder needed on a hit
    np.testing.assert_array_equal(second, first[:3][::-1])
    more = cache.get(TEXTS + ["A new sentence."], enc)  # only the new one is encoded
    assert enc.encoded == 4
    np.testing.assert_allclose(more[3], encoder.encode(["A new sentence."])[0], atol=1e-6)


def test_changed_manifest_misses(tmp_path, encoder):
    cache = EmbeddingCache(encoder.manifest(), tmp_path)
    cache.get(TEXTS, encoder)
    other = dict(encoder.manifest(), tau_attn=0.5)
    assert cache_key(other) != cache.key
    with pytest.raises(KeyError, match="3 sentence\\(s\\) are not in the embedding cache"):
        EmbeddingCache(other, tmp_path).get(TEXTS)
    with pytest.raises(ValueError, match="does not match this cache's manifest"):
        EmbeddingCache(other, tmp_path).get(TEXTS, encoder)

    # not a manifest at all: the type and where a manifest comes from, not "'NoneType' object is not iterable"
    for bad in (None, encoder, "minilm"):
        with pytest.raises(TypeError, match=f"takes an encoder manifest .*got {type(bad).__name__}"):
            EmbeddingCache(bad, tmp_path)
    with pytest.raises(ValueError, match="Encoder manifest lacks"):
        EmbeddingCache({"encoder": "minilm"}, tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "flip", "drop_meta"])
def test_corruption_is_detected_and_rebuilt(tmp_path, encoder, damage, caplog):
    cache = EmbeddingCache(encoder.manifest(), tmp_path)
    good = cache.get(TEXTS, encoder)
    (shard,) = list(cache.shard_dir.glob("*.npy"))
    raw = shard.read_bytes()
    if damage == "truncate":
        shard.write_bytes(raw[: len(raw) // 2])
    elif damage == "flip":
        shard.write_bytes(raw[:-8] + bytes(8))
    else:
        shard.with_suffix(".json").write_text("{not json")
    enc = CountingEncoder(encoder)
    fresh = EmbeddingCache(encoder.manifest(), tmp_path)
    with caplog.at_level(logging.WARNING):
        again = fresh.get(TEXTS, enc)
    assert enc.encoded == 3, "the damaged shard must not be used"
    assert fresh.stats.corrupt_shards and "corrupt or truncated" in caplog.text
    np.testing.assert_allclose(again, good, atol=1e-6)
    assert EmbeddingCache(encoder.manifest(), tmp_path).get(TEXTS).shape == (3, 384)


def test_manifest_memo_avoids_model_load(tmp_path, encoder):
    calls = []

    def loader():
        calls.append(1)
        return encoder

    m1 = encoder_manifest(EncoderConfig(), tmp_path, loader=loader)
    m2 = encoder_manifest(EncoderConfig(batch_size=8), tmp_path, loader=loader)  # batch size is not keyed
    assert m1 == m2 == json.loads(json.dumps(encoder.manifest()))
    assert len(calls) == 1
    m3 = encoder_manifest(EncoderConfig(tau_attn=0.5), tmp_path, loader=lambda: FrozenEncoder(EncoderConfig(tau_attn=0.5)))
    assert cache_key(m3) != cache_key(m1)
