"""Declared bounds of numeric config fields: a field says once which values it allows (`bounded`), and `check_bounds`
refuses any other with a ValueError naming the config, the field, the value and the range (every config's
`__post_init__` calls it; `embed_lib.config` re-exports these names)."""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Bounds:
    """The values a numeric config field allows, declared once beside the field (`bounded`) and checked by
    `check_bounds`; integer bounds make an integer field."""

    low: float
    high: float
    low_open: bool = False
    allow_none: bool = False

    @property
    def integer(self) -> bool:
        return isinstance(self.low, int) and isinstance(self.high, int)

    def describe(self) -> str:
        if self.integer:
            allowed = f"{self.low}..{self.high}"
        else:
            allowed = f"{'(' if self.low_open else '['}{self.low}, {self.high}]"
        return f"None or {allowed}" if self.allow_none else allowed

    def check(self, name: str, value: Any) -> None:
        if self.allow_none and value is None:
            return
        if self.integer:
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"{name}={value!r} is not a whole number; allowed {self.describe()}.")
            if not self.low <= value <= self.high:
                raise ValueError(f"{name}={value!r}; allowed {self.describe()}.")
            return
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{name}={value!r} is not a number; allowed {self.describe()}.")
        if not ((value > self.low if self.low_open else value >= self.low) and value <= self.high):
            raise ValueError(f"{name}={value!r} is out of range; allowed {self.describe()}.")


def bounded(default: Any, low: float, high: float, *, low_open: bool = False, allow_none: bool = False) -> Any:
    """A dataclass field with a default and the values it allows (see `Bounds`)."""
    return dataclasses.field(default=default, metadata={"bounds": Bounds(low, high, low_open, allow_none)})


def unit_interval(default: float) -> Any:
    """A field whose values lie in [0, 1] (a weight, a fraction, an exponent of the normalisation)."""
    return bounded(default, 0.0, 1.0)


def learning_rate(default: float) -> Any:
    """An optimiser's peak learning rate: positive, at most 1 (the adapters and the teacher share the rule)."""
    return bounded(default, 0.0, 1.0, low_open=True)


def check_bounds(config: Any) -> None:
    """ValueError naming the first field of `config` outside its bounds; numpy scalars become Python numbers (JSON)."""
    for f in dataclasses.fields(config):
        if "bounds" in f.metadata:
            value = getattr(config, f.name)
            f.metadata["bounds"].check(f"{type(config).__name__}.{f.name}", value)
            if isinstance(value, numbers.Number) and type(value).__module__ == "numpy":
                object.__setattr__(config, f.name, value.item())
