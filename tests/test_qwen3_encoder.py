"""An encoder like Qwen3-Embedding (decoder-only, last-token pooling, left padding, an instruction prompt)
through the frozen-encoder path, offline: a tiny randomly initialised Qwen3 with a tokenizer trained here."""
from __future__ import annotations

import numpy as np
import pytest

SENTENCES = ["A man is playing a guitar.", "A woman slices an onion.", "Two dogs run through the snow.",
             "The stock market fell sharply today.", "Someone plays music on a stage.", "A cat sleeps."]
QUERY_PROMPT = "Instruct: Given a sentence, retrieve similar sentences\nQuery:"


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    import torch
    from sentence_transformers import SentenceTransformer, models
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3Model

    root = tmp_path_factory.mktemp("qwen3")
    tok = Tokenizer(tok_models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES * 3 + [QUERY_PROMPT], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<|endoftext|>",
                                   eos_token="<|endoftext|>", padding_side="left")
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=fast.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    Qwen3Model(config).save_pretrained(root / "hf")
    fast.save_pretrained(root / "hf")
    transformer = models.Transformer(str(root / "hf"), max_seq_length=64)
    pooling = models.Pooling(transformer.get_word_embedding_dimension(), pooling_mode="lasttoken")
    st = SentenceTransformer(modules=[transformer, pooling, models.Normalize()], prompts={"query": QUERY_PROMPT})
    st.save(str(root / "st"))
    return str(root / "st")


def test_last_token_pooling_left_padding_and_the_prompt_flow_through(tiny_qwen3):
    from sentence_transformers import SentenceTransformer

    from embed_lib.encoding.cache import cache_key
    from embed_lib.config import EncoderConfig
    from embed_lib.encoding.encoders import FrozenEncoder

    enc = FrozenEncoder(EncoderConfig(model=tiny_qwen3, prompt_name="query", batch_size=4))
    m = enc.manifest()
    assert m["pooling"] == "lasttoken" and m["prompt"] == QUERY_PROMPT and m["prompt_name"] == "query"
    raw = enc.encode(SENTENCES)
    # the library's vectors are sentence-transformers' own with the same prompt, before its Normalize
    st = SentenceTransformer(tiny_qwen3, device="cpu").encode(SENTENCES, prompt_name="query")
    np.testing.assert_allclose(raw / np.linalg.norm(raw, axis=1, keepdims=True), st, atol=1e-5)
    # left padding: a sentence alone and in a batch of longer ones gets the same last-token vector
    alone = enc.encode([SENTENCES[-1]])
    np.testing.assert_allclose(alone[0], raw[-1], atol=1e-5)
    # the prompt is part of what determines the vectors: another cache key than without it
    plain = FrozenEncoder(EncoderConfig(model=tiny_qwen3, batch_size=4))
    assert cache_key(plain.manifest()) != cache_key(m) and "prompt" not in plain.manifest()
    assert not np.allclose(plain.encode(SENTENCES[:2]), raw[:2], atol=1e-4)
    with pytest.raises(ValueError, match=r"has no prompt named 'passage'; its prompts: \['document', 'query'\]|"
                                         r"has no prompt named 'passage'; its prompts: \['query'\]"):
        FrozenEncoder(EncoderConfig(model=tiny_qwen3, prompt_name="passage"))
    # a manifest reproduces the encoder, prompt included (what serving builds from a registered model)
    again = FrozenEncoder(EncoderConfig.from_manifest(m, batch_size=4))
    np.testing.assert_allclose(again.encode(SENTENCES[:2]), raw[:2], atol=1e-6)
