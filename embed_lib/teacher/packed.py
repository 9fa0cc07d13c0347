"""A BERT cross-encoder's training step on its real tokens only: the padding's arithmetic left out, nothing else.

A padded position costs a real one's arithmetic in every linear layer, and the teacher's training batches (sorted by
characters, `recipe.length_batches`) hold fewer tokens than positions: a fold's and a stage shard's batches of 16 pad
28% more positions than their pairs hold (measured on STS-B; batches sorted by tokens instead trained a
weaker teacher). Here the linear layers, the layer norms and the feed-forward block run on the real tokens packed into
one (tokens, hidden) matrix; only the attention, a few percent of the arithmetic at these lengths, runs on the padded
(batch, heads, length, length) layout, through the model's own attention function and mask. The dropout masks are
drawn as the model draws them, for the padded shape and in the same order, then the real positions' kept: with the same
seed the same logits and gradients as the model's own forward, up to the rounding of matrix products of another height
(tests/test_teacher_packed.py). Models other than BERT's sequence classifier (or configured beyond it: a decoder,
chunked feed-forward) take their own forward.
"""
from __future__ import annotations

import torch

#: the model classes whose forward `packed_logits` follows (transformers' modeling_bert)
_ENCODER_ONLY = ("BertForSequenceClassification",)


def training_logits(ce, pairs: list[list[str]]) -> torch.Tensor:
    """(n,) logits of a training batch of the sentence-transformers CrossEncoder `ce`: on the real tokens only where
    `supports` says so (the same logits and gradients), else through its own forward."""
    features = ce.preprocess(pairs)
    features = {k: v.to(ce.device) if isinstance(v, torch.Tensor) else v for k, v in features.items()}
    if len(ce) == 1 and supports(ce.model, features):  # one module: the model's logits are the scores
        return packed_logits(ce.model, features).view(-1)
    return ce(features)["scores"].view(-1)


def supports(model: torch.nn.Module, features: dict) -> bool:
    """Whether `packed_logits` computes `model`'s logits for this batch: a BERT sequence classifier (encoder only, no
    chunked feed-forward, a pooler) on the CPU (a GPU's dropout draws its masks otherwise, and pads more cheaply), and a
    batch padded on the right (every row's first position a real token)."""
    config = getattr(model, "config", None)
    bert = getattr(model, "bert", None)
    mask = features.get("attention_mask")
    return (type(model).__name__ in _ENCODER_ONLY and config is not None and bert is not None
            and not config.is_decoder and not getattr(config, "chunk_size_feed_forward", 0)
            and bert.pooler is not None and hasattr(bert, "_create_attention_masks")  # transformers 5's BertModel
            and mask is not None and mask.ndim == 2 and mask.device.type == "cpu" and bool(mask[:, 0].all()))


def packed_logits(model: torch.nn.Module, features: dict) -> torch.Tensor:
    """(batch, num_labels) logits of `model` (see `supports`) for a tokenized batch, linear layers on real tokens."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # lazy: transformers takes seconds to import
    from transformers.models.bert.modeling_bert import eager_attention_forward

    bert = model.bert
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(model.config._attn_implementation, eager_attention_forward)
    ids, mask = features["input_ids"], features["attention_mask"]
    rows, length = ids.shape
    emb = bert.embeddings(input_ids=ids, token_type_ids=features.get("token_type_ids"))
    attention_mask, _ = bert._create_attention_masks(attention_mask=mask, encoder_attention_mask=None,
                                                     embedding_output=emb, encoder_hidden_states=None, cache=None)
    keep = mask.reshape(-1).nonzero().squeeze(1)  # the real positions of the (rows * length) padded ones
    h = emb.reshape(rows * length, -1).index_select(0, keep)
    for layer in bert.encoder.layer:
        h = _layer(layer, attend, h, keep, rows, length, attention_mask)
    first = torch.searchsorted(keep, torch.arange(rows, device=keep.device) * length)  # each row's position 0
    pooled = bert.pooler.activation(bert.pooler.dense(h.index_select(0, first)))
    return model.classifier(model.dropout(pooled))


def _layer(layer, attend, h: torch.Tensor, keep: torch.Tensor, rows: int, length: int,
           attention_mask: torch.Tensor | None) -> torch.Tensor:
    """BertLayer's forward (self-attention through `attend`, the model's attention function, its output block, the
    feed-forward block) on packed tokens."""
    att = layer.attention.self
    heads, size = att.num_attention_heads, att.attention_head_size

    def padded(x: torch.Tensor) -> torch.Tensor:  # (tokens, hidden) -> (rows, heads, length, size), zero padding
        full = x.new_zeros(rows * length, x.shape[-1]).index_copy(0, keep, x)
        return full.view(rows, length, heads, size).transpose(1, 2)

    a, _ = attend(att, padded(att.query(h)), padded(att.key(h)), padded(att.value(h)), attention_mask,
                  dropout=att.dropout.p if att.training else 0.0, scaling=att.scaling)
    a = a.reshape(rows * length, -1).index_select(0, keep)
    out = layer.attention.output
    x = out.LayerNorm(_dropout(out.dense(a), out.dropout, keep, rows * length) + h)
    ffn = layer.output
    return ffn.LayerNorm(_dropout(ffn.dense(layer.intermediate(x)), ffn.dropout, keep, rows * length) + x)


def _dropout(x: torch.Tensor, module: torch.nn.Dropout, keep: torch.Tensor, positions: int) -> torch.Tensor:
    """`module`'s dropout of packed `x` with the mask it would draw for the padded (positions, hidden) tensor: torch's
    CPU dropout draws `empty_like(input).bernoulli_(1 - p)` and scales it by 1 / (1 - p)."""
    if not module.training or module.p == 0:
        return x
    noise = torch.empty((positions, x.shape[-1]), dtype=x.dtype, device=x.device).bernoulli_(1 - module.p)
    return x * noise.index_select(0, keep).div_(1 - module.p)
