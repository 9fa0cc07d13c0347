"""Request and response bodies of the serving API, and the edge checks every text passes before it reaches
the encoder: each failure is a 422 naming the field, the index and the rule.

A text is accepted when it is valid Unicode (no unpaired UTF-16 surrogate, which the tokenizer cannot
take), has no control character other than tab / newline / carriage return, has at least one visible
character (not only whitespace, zero-width or format characters) and is within max_text_chars.
"""
from __future__ import annotations

import unicodedata
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from serving.errors import ApiError

_ALLOWED_CONTROLS = frozenset("\t\n\r")


def text_problem(text: str, max_chars: int) -> str | None:
    """Why `text` cannot be scored, or None."""
    if len(text) > max_chars:
        return f"has {len(text)} characters; the limit is {max_chars} (max_text_chars)"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (f"contains an unpaired UTF-16 surrogate (U+{ord(text[exc.start]):04X}) at character {exc.start}; "
                "send valid Unicode")
    for i, ch in enumerate(text):
        if unicodedata.category(ch) == "Cc" and ch not in _ALLOWED_CONTROLS:
            return f"contains the control character U+{ord(ch):04X} at character {i}; remove it"
    if not any(not unicodedata.category(ch).startswith(("Z", "C")) for ch in text):
        return "is empty or blank (no visible character, only whitespace / zero-width / format characters)"
    return None


def check_texts(field: str, texts: list[str], max_chars: int, max_items: int | None = None,
                names: list[str] | None = None) -> None:
    """422 on the first text that cannot be scored. names: the field path of each text (default field[i])."""
    if max_items is not None and len(texts) > max_items:
        raise ApiError(422, f"{field} has {len(texts)} items; the limit is {max_items} per request.", field)
    if not texts:
        raise ApiError(422, f"{field} is empty; give at least one text.", field)
    for i, t in enumerate(texts):
        where = names[i] if names else (field if field == "query" else f"{field}[{i}]")
        problem = text_problem(t, max_chars)
        if problem:
            raise ApiError(422, f"{where} {problem}.", where)


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pairs: list[tuple[StrictStr, StrictStr]] | None = Field(None, description='[["a", "b"], ...]')
    text_1: list[StrictStr] | None = Field(None, description="first texts (with text_2, instead of pairs)")
    text_2: list[StrictStr] | None = None
    cascade: StrictBool = Field(False, description="send pairs whose difficulty exceeds the threshold to the "
                                                   "cross-encoder")
    scorer: Literal["adapter", "cross_encoder"] = "adapter"

    def resolved_pairs(self, max_pairs: int, max_chars: int) -> list[tuple[str, str]]:
        if self.pairs is not None and (self.text_1 is not None or self.text_2 is not None):
            raise ApiError(422, "give either pairs or text_1/text_2, not both.", "pairs")
        if self.pairs is None:
            if self.text_1 is None or self.text_2 is None:
                raise ApiError(422, "pairs is missing; give pairs=[[a, b], ...] or text_1 and text_2.", "pairs")
            if len(self.text_1) != len(self.text_2):
                raise ApiError(422, f"text_1 has {len(self.text_1)} items and text_2 {len(self.text_2)}; "
                                    "they must have the same length.", "text_2")
            pairs, name = list(zip(self.text_1, self.text_2)), "text_1/text_2"
            names = [f"text_{j + 1}[{i}]" for i in range(len(pairs)) for j in (0, 1)]
        else:
            pairs, name = [tuple(p) for p in self.pairs], "pairs"
            names = [f"pairs[{i}][{j}]" for i in range(len(pairs)) for j in (0, 1)]
        if len(pairs) > max_pairs:
            raise ApiError(422, f"{name} has {len(pairs)} pairs; the limit is {max_pairs} per request (max_pairs).",
                           name)
        if not pairs:
            raise ApiError(422, f"{name} is empty; give at least one pair.", name)
        check_texts(name, [t for p in pairs for t in p], max_chars, names=names)
        return pairs


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    query: StrictStr
    documents: list[StrictStr]
    top_n: StrictInt | None = Field(None, ge=1, description="return the best top_n (default: all)")
    return_documents: StrictBool = False


class WarmRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    texts: list[StrictStr]


class PairScore(BaseModel):
    index: int
    score: float = Field(description="the adapter's similarity, in [-1, 1] (the cross-encoder's where path says so)")
    baseline: float | None = Field(None, description="the frozen encoder's cosine, in [-1, 1]")
    difficulty: float | None = Field(None, description="the gate's difficulty in (0, 1); null for ungated forms")
    path: Literal["adapter", "cross_encoder"] | None = Field(None, description="with cascade: who scored the pair")


class ScoreResponse(BaseModel):
    data: list[PairScore]
    model: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: str | None = None


class RerankResponse(BaseModel):
    results: list[RerankResult]
    model: str


class WarmJob(BaseModel):
    id: str
    state: Literal["running", "succeeded", "failed", "cancelled"]
    total: int = Field(description="distinct texts in the job")
    done: int = Field(description="texts processed so far")
    added: int = Field(description="texts that were not cached and were encoded")
    error: str | None = None
