"""Model selection over seed groups: the leaderboard and the winner rule of DESIGN.md.

A configuration "wins" only if its validation delta is positive on every seed; among those the best
mean validation delta wins, and near-ties (within `tie`) go to the smaller gamma. Test is never read here.
"""
from __future__ import annotations

from typing import Any, Sequence

import pandas as pd

#: shown first in every leaderboard
LEADERBOARD_COLUMNS = ["trial", "adapter", "control", "target", "gamma", "tau", "p", "learn_p", "lambda_c",
                       "lambda_mod", "lr", "weight_decay", "width", "epochs", "delta_val_mean", "delta_val_std",
                       "delta_val_min", "delta_val_positive", "n_seeds", "train/gate_fit_mean"]


def leaderboard(rows: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """Rows (config + summary per trial) sorted by mean validation delta, best first."""
    if not rows:
        return pd.DataFrame(columns=LEADERBOARD_COLUMNS)
    df = pd.DataFrame(list(rows))
    cols = [c for c in LEADERBOARD_COLUMNS if c in df.columns] + [c for c in df.columns if c not in LEADERBOARD_COLUMNS]
    return df[cols].sort_values("delta_val_mean", ascending=False, kind="stable").reset_index(drop=True)


def select_winner(rows: Sequence[dict[str, Any]], tie: float = 1e-4) -> dict[str, Any] | None:
    """The winning row, or None when no configuration is positive on every validation seed."""
    eligible = [r for r in rows if r.get("delta_val_positive", 0) == r.get("n_seeds", -1) and r["n_seeds"] > 0]
    if not eligible:
        return None
    best = max(r["delta_val_mean"] for r in eligible)
    near = [r for r in eligible if r["delta_val_mean"] >= best - tie]
    return min(near, key=lambda r: (r.get("gamma", 0.0), -r["delta_val_mean"]))


def to_markdown(df: pd.DataFrame, top: int | None = None, digits: int = 4) -> str:
    df = df.head(top) if top else df
    if df.empty:
        return "(no trials)\n"
    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, row in df.iterrows():
        cells = [f"{v:.{digits}f}" if isinstance(v, float) else str(v) for v in row.tolist()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
