"""Values of command-line flags: argparse types that check a number's bound as the flag is parsed, and comma
lists of numbers (a bad value is one line naming the flag, before anything starts)."""
from __future__ import annotations

import argparse
import math

from embed_lib.config import AdapterConfig


def int_at_least(lo: int):
    """An argparse type: an integer >= lo, else the flag's error naming the bound (before anything starts)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"{value} is below {lo}; give {lo} or more")
        return value
    parse.__name__ = f"integer >= {lo}"
    return parse


def float_above(lo: float, *, inclusive: bool = False):
    """An argparse type: a finite number > lo (>= lo with inclusive), else the flag's error naming the bound."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value < lo or (value == lo and not inclusive):
            raise argparse.ArgumentTypeError(f"{value:g} is out of range; give a number {'>=' if inclusive else '>'} "
                                             f"{lo:g}")
        return value
    parse.__name__ = f"number {'>=' if inclusive else '>'} {lo:g}"
    return parse


def float_list(text: str, flag: str, example: str) -> list[float]:
    """'0.05,0.1' -> [0.05, 0.1]; else a ValueError naming `flag` and showing `example`."""
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected numbers separated by commas, e.g. {example}.") from None


def gamma_grid(text: str) -> list[float]:
    """--gamma-grid '0.05,0.1' -> [0.05, 0.1], each within AdapterConfig.gamma's bounds; else a ValueError naming it."""
    gammas = float_list(text, "--gamma-grid", "0.05,0.1,0.2")
    for g in gammas:
        try:
            AdapterConfig(gamma=g)
        except ValueError as exc:
            raise ValueError(f"--gamma-grid {text!r}: {exc}") from None
    return gammas
