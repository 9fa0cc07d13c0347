"""Request and response bodies of the serving API, and the edge checks every text passes before it reaches
the encoder: each failure is a 422 naming the field, the index and the rule.

A text is accepted when it is valid Unicode (no unpaired UTF-16 surrogate, which the tokenizer cannot
take), has no control character other than tab / newline / carriage return, has at least one visible
character (not only whitespace, zero-width or format characters) and is within max_text_chars.
"""
from __future__ import annotations

import re
import unicodedata
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from embed_lib.training.cascade import pairs_seed
from serving.errors import ApiError
from serving.truncation import Truncation, vllm_truncation

#: C0 and C1 control characters other than tab, newline and carriage return
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
_VISIBLE_ASCII = re.compile(r"[!-~]")
#: printable ASCII, tab, newline and carriage return: what a text made only of these can hold without a problem
_PLAIN_ASCII = bytes(range(0x20, 0x7F)) + b"\t\n\r"


def text_problem(text: str, max_chars: int) -> str | None:
    """Why `text` cannot be scored, or None. Checked on each text of a request the one-pass check (`_all_plain`)
    cannot clear: regular expressions and str methods (C speed) decide the common case; only texts without a
    visible ASCII character are walked character by character."""
    if len(text) > max_chars:
        return f"has {len(text)} characters; the limit is {max_chars} (max_text_chars)"
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            return (f"contains an unpaired UTF-16 surrogate (U+{ord(text[exc.start]):04X}) at character "
                    f"{exc.start}; send valid Unicode")
    bad = _CONTROL.search(text)
    if bad:
        return f"contains the control character U+{ord(bad.group()):04X} at character {bad.start()}; remove it"
    if not _VISIBLE_ASCII.search(text) and not any(not unicodedata.category(ch).startswith(("Z", "C"))
                                                   for ch in text):
        return "is empty or blank (no visible character, only whitespace / zero-width / format characters)"
    return None


def _all_plain(texts: list[str], max_chars: int) -> bool:
    """True when every text is printable ASCII (tab, newline and carriage return allowed) with a visible character
    and within max_chars: then none has a problem, decided for the whole list in a few C calls (a request of 64 texts
    in ~6 us instead of ~35 us text by text). Otherwise False, and the texts are checked one by one (which also names
    the first at fault)."""
    joined = "\n".join(texts)
    return (joined.isascii() and not joined.encode("ascii").translate(None, _PLAIN_ASCII)
            and max(map(len, texts)) <= max_chars and all(map(str.strip, texts)))  # strip: ASCII whitespace only


def check_texts(field: str, texts: list[str], max_chars: int, max_items: int | None = None,
                name_of: Callable[[int], str] | None = None) -> None:
    """422 on the first text that cannot be scored. name_of(i): the field path of text i (default field[i];
    asked only for the text at fault: this runs on every request)."""
    if max_items is not None and len(texts) > max_items:
        raise ApiError(422, f"{field} has {len(texts)} items; the limit is {max_items} per request.", field)
    if not texts:
        raise ApiError(422, f"{field} is empty; give at least one text.", field)
    if _all_plain(texts, max_chars):
        return
    for i, t in enumerate(texts):
        problem = text_problem(t, max_chars)
        if problem:
            where = name_of(i) if name_of else (field if field == "query" else f"{field}[{i}]")
            raise ApiError(422, f"{where} {problem}.", where)


#: the request bodies /docs shows (and "Try it out" sends): the README's own examples
PAIRS = [("A man plays a guitar.", "A man is playing guitar."), ("A cat sleeps.", "Stocks fell.")]
QUERY, DOCUMENTS = "guitar player", ["A man plays a guitar.", "Stocks fell."]


class ScoreRequest(BaseModel):
    """Pairs to score: `pairs`, or `text_1` / `text_2` as vLLM's score API sends them (a string or a list
    each: one-to-one for two lists of equal length, one-to-many where one side is a single string)."""
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"pairs": [list(p) for p in PAIRS]}]})
    model: StrictStr | None = Field(None, description="the served model's name (optional; another name is a 404)")
    pairs: list[tuple[StrictStr, StrictStr]] | None = Field(None, description='[["a", "b"], ...]')
    text_1: StrictStr | list[StrictStr] | None = Field(None, description="first texts (with text_2, instead of pairs)")
    text_2: StrictStr | list[StrictStr] | None = None
    cascade: StrictBool = Field(False, description="re-score a fraction `budget` of the pairs with the cross-encoder, "
                                                   "chosen by `routing` (needs the app's cross_encoder)")
    budget: StrictFloat | None = Field(None, ge=0, le=1, description="cascade: fraction of the pairs sent "
                                                   "to the cross-encoder (default: the app's cascade_budget); "
                                                   "setting it turns the cascade on")
    routing: Literal["difficulty", "random", "cosine_middle"] | None = Field(
        None, description="cascade: which pairs go to the cross-encoder: the gate's hardest (difficulty), a seeded "
                          "random subset (random), or the cosines nearest the middle (cosine_middle). Default: "
                          "difficulty when the served adapter has a gate, else cosine_middle (the response says which)")
    routing_seed: StrictInt | None = Field(
        None, ge=0, description="cascade: seed of random routing and of the budget's rounding (default: one derived "
        "from the request's pairs, so the same request routes the same way and a budget that is not a whole number "
        "of pairs is met on average over requests)")
    familiarity_floor: StrictFloat | None = Field(
        None, ge=0, le=1, description="cascade: route pairs only when the mean novelty-gate weight of the request's "
        "pairs is at least this (default: the app's cascade_familiarity_floor); 0 routes whatever the pairs")
    combine: Literal["replace", "mean"] = Field("replace", description="cascade: a routed pair's score is the "
                                                "cross-encoder's (replace) or the mean of it and the adapter's (mean)")
    scorer: Literal["adapter", "cross_encoder"] = "adapter"
    # vLLM's: encoding_format is accepted without effect; truncate_prompt_tokens cuts (serving/truncation.py)
    encoding_format: StrictStr | None = Field(None, description="accepted for vLLM clients; ignored")
    truncate_prompt_tokens: StrictInt | None = Field(
        None, ge=-1, description="vLLM's: each text's last k tokens, its special tokens counted (up to the encoder's "
        "max_seq_length); -1: the last of as many as the encoder reads; unset: the encoder's own cut, the first "
        "max_seq_length tokens")

    def truncation(self, max_seq_length: int) -> Truncation | None:
        return vllm_truncation(self.truncate_prompt_tokens, max_seq_length)

    def cascade_options(self, budget: float, familiarity_floor: float, routing: str,
                        pairs: list[tuple[str, str]]) -> dict | None:
        """The cascade this request asks for ({budget, routing, seed, combine, familiarity_floor}: what it sets,
        else the app's defaults given here, and a seed derived from its `pairs`), None for none."""
        if not self.cascade and self.budget is None:
            return None
        return {"budget": budget if self.budget is None else float(self.budget), "routing": self.routing or routing,
                "seed": pairs_seed(pairs) if self.routing_seed is None else self.routing_seed, "combine": self.combine,
                "familiarity_floor": float(familiarity_floor if self.familiarity_floor is None
                                           else self.familiarity_floor)}

    def resolved_pairs(self, max_pairs: int, max_chars: int) -> list[tuple[str, str]]:
        if self.pairs is not None and (self.text_1 is not None or self.text_2 is not None):
            raise ApiError(422, "give either pairs or text_1/text_2, not both.", "pairs")
        if self.pairs is None:
            if self.text_1 is None or self.text_2 is None:
                raise ApiError(422, "pairs is missing; give pairs=[[a, b], ...] or text_1 and text_2.", "pairs")
            t1 = [self.text_1] if isinstance(self.text_1, str) else self.text_1
            t2 = [self.text_2] if isinstance(self.text_2, str) else self.text_2
            if len(t1) == 1 and len(t2) != 1:
                t1 = t1 * len(t2)  # one against many
            elif len(t2) == 1 and len(t1) != 1:
                t2 = t2 * len(t1)
            if len(t1) != len(t2):
                raise ApiError(422, f"text_1 has {len(t1)} items and text_2 {len(t2)}; they must have the same "
                                    "length, or one of them a single text.", "text_2")
            pairs, name = list(zip(t1, t2)), "text_1/text_2"
            single = (isinstance(self.text_1, str), isinstance(self.text_2, str))

            def name_of(k: int) -> str:  # text k of the flattened pairs
                side = k % 2
                return f"text_{side + 1}" + ("" if single[side] else f"[{k // 2}]")
        else:
            pairs, name = [tuple(p) for p in self.pairs], "pairs"

            def name_of(k: int) -> str:
                return f"pairs[{k // 2}][{k % 2}]"
        if len(pairs) > max_pairs:
            raise ApiError(422, f"{name} has {len(pairs)} pairs; the limit is {max_pairs} per request (max_pairs).",
                           name)
        if not pairs:
            raise ApiError(422, f"{name} is empty; give at least one pair.", name)
        check_texts(name, [t for p in pairs for t in p], max_chars, name_of=name_of)
        return pairs


class RerankRequest(BaseModel):
    """A query and documents to order, as Cohere's rerank API (v1 and v2) takes them: documents are strings,
    or (v1) objects with a "text" field, or with the fields named by rank_fields."""
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"query": QUERY, "documents": DOCUMENTS,
                                                                              "top_n": 1}]})
    model: StrictStr | None = Field(None, description="the served model's name (optional; another name is a 404)")
    query: StrictStr
    documents: list[StrictStr | dict[StrictStr, StrictStr]]
    top_n: StrictInt | None = Field(None, ge=1, description="return the best top_n (default: all)")
    return_documents: StrictBool = False
    rank_fields: list[StrictStr] | None = Field(None, description="fields of object documents to rank on "
                                                "(joined as 'field: value' lines; default: text)")
    max_chunks_per_doc: StrictInt | None = Field(None, ge=1, description="accepted for Cohere clients; ignored")
    max_tokens_per_doc: StrictInt | None = Field(None, ge=1, description="each document's first n tokens (at most "
                                                 "what the encoder reads: its max_seq_length less special tokens)")
    priority: StrictInt | None = Field(None, description="accepted for Cohere clients; ignored")

    def truncation(self, max_seq_length: int) -> Truncation | None:
        """Cohere's max_tokens_per_doc where it cuts more than the encoder does (its default, 4096, cuts nothing)."""
        n = self.max_tokens_per_doc
        return None if n is None or n >= max_seq_length else Truncation("max_tokens_per_doc", keep=n, query=False)

    def document(self, i: int) -> dict[str, str]:
        """Document i as the request gave it (Cohere's return_documents): an object with all its fields, a string as
        {"text": ...}; not the 'field: value' lines its rank_fields were scored as."""
        d = self.documents[i]
        return d if isinstance(d, dict) else {"text": d}

    def texts(self) -> list[str]:
        """The documents as texts (422 naming the document and the field where one lacks it)."""
        out = []
        for i, d in enumerate(self.documents):
            if isinstance(d, str):
                out.append(d)
                continue
            fields = self.rank_fields or ["text"]
            missing = [f for f in fields if f not in d]
            if missing:
                raise ApiError(422, f"documents[{i}] has no field {missing[0]!r}; give each document a 'text' "
                                    "field, or name its fields with rank_fields.", f"documents[{i}]")
            out.append(d["text"] if fields == ["text"] else "\n".join(f"{f}: {d[f]}" for f in fields))
        return out


class TeiRerankRequest(BaseModel):
    """Text Embeddings Inference's `POST /rerank` body."""
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"query": QUERY, "texts": DOCUMENTS}]})
    query: StrictStr
    texts: list[StrictStr]
    return_text: StrictBool = False
    raw_scores: StrictBool = Field(False, description="true: each score as the model gives it, before its clip to "
                                   "[-1, 1] (a near-duplicate may pass 1)")
    truncate: StrictBool | None = Field(None, description="false: a text longer than the encoder reads is a 413 (TEI's "
                                        "answer); true or unset: it is cut")
    truncation_direction: Literal["Left", "Right", "left", "right"] | None = Field(
        None, description="the end a longer text is cut at: right (unset: its first tokens stay) or left (its last)")

    def truncation(self) -> Truncation | None:
        if self.truncate is False:
            return Truncation("truncate", strict=True, texts_field="texts")
        left = (self.truncation_direction or "right").lower() == "left"
        return Truncation("truncation_direction", side="left", texts_field="texts") if left else None


class WarmRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"texts": DOCUMENTS}]})
    texts: list[StrictStr]


class PairScore(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float = Field(description="the adapter's similarity, in [-1, 1] (the cross-encoder's where path says so)")
    baseline: float | None = Field(None, description="the frozen encoder's cosine, in [-1, 1]")
    difficulty: float | None = Field(None, description="the gate's difficulty in (0, 1); null for ungated forms")
    path: Literal["adapter", "cross_encoder"] | None = Field(None, description="with cascade: who scored the pair "
                                                             "(the cross-encoder's score on the cosine's scale)")


class CascadeInfo(BaseModel):
    budget: float = Field(description="the fraction asked for")
    routing: str
    combine: str
    routed: int = Field(description="pairs the cross-encoder scored")
    familiarity_floor: float = Field(description="the least mean novelty-gate weight for the cascade to route")
    familiarity: float | None = Field(None, description="the request's mean novelty-gate weight (1: as familiar as "
                                      "the adapter's training pairs); under familiarity_floor nothing is routed")
    cross_encoder: str | None = None


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[PairScore]
    cascade: CascadeInfo | None = Field(None, description="with cascade: the budget, the policy and what it routed")


class RerankDocument(BaseModel):
    """A document as the request gave it: a string as {"text": ...}, an object with all its fields."""
    model_config = ConfigDict(extra="allow")
    text: str | None = None


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = Field(None, description="with return_documents (v1)")


class RerankResponse(BaseModel):
    """Cohere's rerank response (v1 and v2), with the served model's name."""
    id: str
    results: list[RerankResult]
    meta: dict
    model: str


class TeiRank(BaseModel):
    index: int
    score: float
    text: str | None = None


class WarmJob(BaseModel):
    id: str
    state: Literal["running", "succeeded", "failed", "cancelled"]
    total: int = Field(description="distinct texts in the job")
    done: int = Field(description="texts processed so far")
    added: int = Field(description="texts that were not cached and were encoded")
    error: str | None = None
