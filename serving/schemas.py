"""Request bodies of the serving API and the checks that give every 4xx a message naming field and limit."""
from __future__ import annotations

from typing import Literal

from fastapi import HTTPException
from pydantic import BaseModel, ConfigDict, Field, StrictStr


def check_texts(field: str, texts: list[str], max_chars: int, max_items: int | None = None) -> None:
    if max_items is not None and len(texts) > max_items:
        raise HTTPException(422, f"{field} has {len(texts)} items; the limit is {max_items} per request.")
    if not texts:
        raise HTTPException(422, f"{field} is empty; give at least one text.")
    for i, t in enumerate(texts):
        where = field if field == "query" else f"{field}[{i}]"
        if not t.strip():
            raise HTTPException(422, f"{where} is empty or blank; texts must be non-empty strings.")
        if len(t) > max_chars:
            raise HTTPException(422, f"{where} has {len(t)} characters; the limit is {max_chars} (max_text_chars).")


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pairs: list[tuple[StrictStr, StrictStr]] | None = Field(None, description='[["a", "b"], ...]')
    text_1: list[StrictStr] | None = Field(None, description="first texts (with text_2, instead of pairs)")
    text_2: list[StrictStr] | None = None
    cascade: bool = Field(False, description="send pairs whose difficulty exceeds the threshold to the cross-encoder")
    scorer: Literal["adapter", "cross_encoder"] = "adapter"

    def resolved_pairs(self, max_pairs: int, max_chars: int) -> list[tuple[str, str]]:
        if self.pairs is not None and (self.text_1 is not None or self.text_2 is not None):
            raise HTTPException(422, "give either pairs or text_1/text_2, not both.")
        if self.pairs is None:
            if self.text_1 is None or self.text_2 is None:
                raise HTTPException(422, "pairs is missing; give pairs=[[a, b], ...] or text_1 and text_2.")
            if len(self.text_1) != len(self.text_2):
                raise HTTPException(422, f"text_1 has {len(self.text_1)} items and text_2 {len(self.text_2)}; "
                                         "they must have the same length.")
            pairs = list(zip(self.text_1, self.text_2))
            name = "text_1/text_2"
        else:
            pairs, name = [tuple(p) for p in self.pairs], "pairs"
        if len(pairs) > max_pairs:
            raise HTTPException(422, f"{name} has {len(pairs)} pairs; the limit is {max_pairs} per request (max_pairs).")
        if not pairs:
            raise HTTPException(422, f"{name} is empty; give at least one pair.")
        for i, (a, b) in enumerate(pairs):
            for j, t in enumerate((a, b)):
                where = f"pairs[{i}][{j}]" if name == "pairs" else f"text_{j + 1}[{i}]"
                if not t.strip():
                    raise HTTPException(422, f"{where} is empty or blank; texts must be non-empty strings.")
                if len(t) > max_chars:
                    raise HTTPException(422, f"{where} has {len(t)} characters; the limit is {max_chars} "
                                             "(max_text_chars).")
        return pairs


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    query: StrictStr
    documents: list[StrictStr]
    top_n: int | None = Field(None, ge=1, description="return the best top_n (default: all)")
    return_documents: bool = False


class WarmRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    texts: list[StrictStr]
