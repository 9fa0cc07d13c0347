"""Texts cut to a number of tokens, as text: what the truncation options of the client APIs ask for.

The encoder truncates on its own at `max_seq_length` (on the right: it reads a text's first tokens). A client may ask
for fewer tokens (Cohere's `max_tokens_per_doc`, vLLM's `truncate_prompt_tokens`) or for the text's last tokens (vLLM's
`truncate_prompt_tokens`, TEI's `truncation_direction: left`). The cut is made in the text, at the tokenizer's offsets,
so the shorter text is an ordinary text afterwards: cached, batched and encoded like any other.

- `side="right"` keeps the first `keep` tokens: the text up to the end of its `keep`-th token. A WordPiece or BPE
  tokenizer reads that prefix as the same tokens.
- `side="left"` keeps the last `keep` tokens from the start of a word: a text cut inside a word would be read as other
  tokens (a word's first piece is not its continuation), so a cut that would fall inside a word moves to the start of
  the next word (fewer tokens kept), unless the last word alone is longer than `keep` (then inside it).
"""
from __future__ import annotations

from typing import Sequence

SIDES = ("right", "left")


def cut(text: str, offsets: Sequence[tuple[int, int]], words: Sequence[int | None], keep: int, side: str) -> str:
    """`text` cut to `keep` of its tokens (`offsets`: each token's (start, end) in the text; `words`: each token's
    word index, as a fast tokenizer's `word_ids` gives them)."""
    n = len(offsets)
    if keep < 1:
        raise ValueError(f"keep={keep}: keep at least 1 token.")
    if side not in SIDES:
        raise ValueError(f"side={side!r}; give one of {list(SIDES)}.")
    if n <= keep:
        return text
    if side == "right":
        return text[: offsets[keep - 1][1]]
    first = n - keep
    start = first
    while start < n and start > 0 and words[start] is not None and words[start] == words[start - 1]:
        start += 1  # inside a word: on to the next word's first token
    return text[offsets[start if start < n else first][0]:]


def truncate(tokenizer, texts: Sequence[str], keep: int, side: str = "right") -> tuple[list[str], list[int]]:
    """(each text cut to `keep` tokens, each text's tokens before the cut), without special tokens. Needs a fast
    tokenizer (its offsets)."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"Cutting texts to a number of tokens needs a fast tokenizer (its offsets); "
                         f"{type(tokenizer).__name__} is not one: send texts within the encoder's length instead.")
    enc = tokenizer(list(texts), add_special_tokens=False, truncation=False, return_offsets_mapping=True,
                    verbose=False)
    out, counts = [], []
    for i, text in enumerate(texts):
        offsets = enc["offset_mapping"][i]
        counts.append(len(offsets))
        out.append(cut(text, offsets, enc.word_ids(i), keep, side))
    return out, counts


def budget(tokenizer, max_seq_length: int, prompt: str | None = None) -> int:
    """Tokens of a text the encoder reads at most: `max_seq_length` less the special tokens and the prompt's tokens."""
    taken = tokenizer.num_special_tokens_to_add(pair=False)
    if prompt:
        taken += len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    return max_seq_length - taken
