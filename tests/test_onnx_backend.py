"""The ONNX Runtime path of the encoder and the cross-encoder: agreement with torch, cache keys, refusals."""
from __future__ import annotations

import numpy as np
import pytest

from embed_lib.encoding import onnx_backend as O
from embed_lib.encoding.cache import cache_key
from embed_lib.config import EncoderConfig, backend_of, manifest_fields
from embed_lib.data.tasks import load_splits


@pytest.fixture(scope="module")
def sentences(data_dir) -> list[str]:
    test = load_splits("stsb", ["test"], data_dir)["test"]
    return list(dict.fromkeys(list(test.sentence1) + list(test.sentence2)))[:100]


@pytest.fixture(scope="module")
def onnx_encoder(tmp_path_factory):
    import os

    from embed_lib.encoding.encoders import FrozenEncoder

    old = os.environ.get("EMBED_CACHE_DIR")
    os.environ["EMBED_CACHE_DIR"] = str(tmp_path_factory.mktemp("onnx_cache"))
    try:
        yield FrozenEncoder(EncoderConfig(backend="onnx"))
    finally:
        if old is None:
            os.environ.pop("EMBED_CACHE_DIR")
        else:
            os.environ["EMBED_CACHE_DIR"] = old


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_onnx_encoder_vectors_equal_torch_on_100_sentences(onnx_encoder, encoder, sentences):
    got = onnx_encoder.encode(sentences)
    ref = encoder.encode(sentences)
    assert got.shape == ref.shape == (100, 384)
    assert _cos(got, ref).min() >= 1 - 1e-3
    # raw pooled vectors (the Normalize module dropped, as in torch): magnitudes agree too
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(ref, axis=1), rtol=1e-3)


def test_backend_is_in_the_manifest_and_the_cache_key(onnx_encoder, encoder):
    torch_m, onnx_m = encoder.manifest(), onnx_encoder.manifest()
    assert "backend" not in torch_m  # torch caches keep the keys they had before backends existed
    assert (onnx_m["backend"], onnx_m["quantization"]) == ("onnx", "none")
    assert cache_key(torch_m) != cache_key(onnx_m)
    assert cache_key({**onnx_m, "quantization": "int8"}) != cache_key(onnx_m)
    assert EncoderConfig.from_manifest(onnx_m).backend == "onnx"
    assert EncoderConfig.from_manifest(torch_m).backend == "torch"
    for b in ("torch", "onnx", "onnx-int8"):
        assert backend_of(manifest_fields(b)) == b


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match=r"EncoderConfig.backend='tensorrt'.*\['torch', 'onnx', 'onnx-int8'\]"):
        EncoderConfig(backend="tensorrt")


def test_a_graph_that_disagrees_is_refused_naming_model_and_tolerance(encoder, tmp_path, monkeypatch):
    """A graph beyond tolerance raises (never a silent fall-back) and is not kept in the cache."""
    monkeypatch.setitem(O.TOLERANCE["encoder"], "onnx", 1.01)  # a cosine can never reach it
    with pytest.raises(ValueError, match=r"onnx graph of encoder 'minilm' disagrees.*tolerance 1.01"):
        O.encoder_runner(_with_backend(encoder, "onnx"), tmp_path)
    assert not list(tmp_path.rglob("model.onnx"))


def _with_backend(encoder, backend: str):
    import copy
    import dataclasses

    enc = copy.copy(encoder)
    enc.config = dataclasses.replace(encoder.config, backend=backend)
    return enc


def test_cross_encoder_onnx_logits_equal_torch(tmp_path):
    from embed_lib.teacher.cross_encoder import PairCrossEncoder

    pairs = [("A man is playing a guitar.", "A man plays the guitar."), ("A cat sleeps.", "Stocks fell on Monday."),
             ("ok", "The committee will publish its report next spring.")]
    saved = tmp_path / "ce"  # "minilm" as a cross-encoder gets a fresh random head at every load: save one
    PairCrossEncoder("minilm").ce.save_pretrained(str(saved))
    ref = PairCrossEncoder(saved).logits(pairs)
    got = PairCrossEncoder(saved, backend="onnx", cache_root=tmp_path).logits(pairs)
    assert np.std(ref) > 0
    np.testing.assert_allclose(got, ref, atol=1e-3)
