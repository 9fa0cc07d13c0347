"""The truncation options of the request shapes the service speaks, applied before a request's texts are scored.

The encoder reads at most `max_seq_length` tokens of a text (all-MiniLM-L6-v2: 256, its 2 special tokens among them)
and cuts a longer text on the right. A request may ask for another cut:

- vLLM's `truncate_prompt_tokens: k` (/v1/score): each text's last k tokens, its special tokens counted, as vLLM
  truncates (on the left); -1: the last tokens of as many as the encoder reads; k past `max_seq_length`: 422.
- Cohere's `max_tokens_per_doc: n` (/v1/rerank, /v2/rerank): each document's first n tokens; the query as it is.
- TEI's `truncate: false` (/rerank): a text longer than the encoder reads is a 413 naming it (TEI's answer), not cut;
  `truncation_direction: left`: a longer text keeps its last tokens.

The encoder deployment cuts the texts in the text itself (`embed_lib.encoding.truncation`: a cut on the left starts at
a word), so the shorter texts are scored, cached and batched like any other. A request without these options makes no
call more.
"""
from __future__ import annotations

from dataclasses import dataclass

from serving.errors import ApiError


@dataclass(frozen=True)
class Truncation:
    """How a request asks its texts to be cut; `field`: the option that asks (errors name it)."""

    field: str
    #: tokens of each text to keep (None: as many as the encoder reads)
    keep: int | None = None
    #: "right": a text's first tokens; "left": its last ones
    side: str = "right"
    #: `keep` counts the special tokens (and a prompt's) too, as vLLM counts
    counting_special: bool = False
    #: a text longer than the encoder reads is a 413, not cut (TEI's truncate=false)
    strict: bool = False
    #: the first text of each pair (a re-ranking's query) is cut too; Cohere's max_tokens_per_doc cuts documents only
    query: bool = True
    #: a re-ranking's field of documents, which a 413 names with the query (TEI's "texts"); None: pairs[i][j]
    texts_field: str | None = None


def vllm_truncation(k: int | None, max_seq_length: int) -> Truncation | None:
    """vLLM's `truncate_prompt_tokens` (None: the encoder's own cut)."""
    field = "truncate_prompt_tokens"
    if k is None:
        return None
    if k == -1:
        return Truncation(field, side="left")
    if k < 1 or k > max_seq_length:
        raise ApiError(422, f"{field}={k}: give -1 (as many tokens as the encoder reads) or a number of tokens from 1 "
                            f"to the encoder's max_seq_length, {max_seq_length}.", field)
    return Truncation(field, keep=k, side="left", counting_special=True)


async def truncated_pairs(encoder, pairs: list[tuple[str, str]], spec: Truncation | None) -> list[tuple[str, str]]:
    """The texts of `pairs` cut as `spec` asks (the first of each pair too where `spec.query`), each distinct text once,
    by the encoder deployment (`Encoder.truncate`)."""
    if spec is None:
        return pairs
    sides = (0, 1) if spec.query else (1,)
    texts = list(dict.fromkeys(p[j] for p in pairs for j in sides))
    try:
        cut, counts, most = await encoder.truncate.remote(texts, spec.keep, spec.side, spec.counting_special)
    except ValueError as exc:  # the encoder's reason, without Ray's traceback
        raise ApiError(422, f"{spec.field}: {str(exc).splitlines()[-1].removeprefix('ValueError: ')}",
                       spec.field) from None
    tokens = dict(zip(texts, counts))
    if spec.strict and any(n > most for n in counts):
        i, j = next((i, j) for i, p in enumerate(pairs) for j in sides if tokens[p[j]] > most)
        name = ("query" if j == 0 else f"{spec.texts_field}[{i}]") if spec.texts_field else f"pairs[{i}][{j}]"
        raise ApiError(413, f"{name} has {tokens[pairs[i][j]]} tokens; the encoder reads at most {most} of a text. "
                            f"Send {spec.field}=true to cut it, or a shorter text.", name)
    new = dict(zip(texts, cut))
    return [(new.get(a, a), new[b]) for a, b in pairs]
