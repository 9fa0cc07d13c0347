"""Model selection over seed groups: the leaderboard and the do-no-harm winner rule of DESIGN.md.

A configuration "wins" only if (1) its validation delta is positive on every seed and (2) it does no harm
elsewhere: on every transfer check (another task's validation pairs unseen in training, and its whole validation
split where some pairs share a sentence with train; for duplicate questions also their re-ranking,
`embed_lib.training.retrieval.RetrievalCheck`) every seed's delta (Spearman, or nDCG@10) is >= -tolerance.
Among those the best mean validation delta wins, and near-ties (within `tie`) go to the smaller gamma. Test is
never read here. Every split is scored as the service scores it: a sentence that also occurs in train has the
novelty gate's own familiarity (its own nearest neighbour), not the leave-one-out familiarity training reads
(`embed_lib.training.tensors.StudyData.familiarity`).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import pandas as pd

#: shown first in every leaderboard
LEADERBOARD_COLUMNS = ["trial", "adapter", "control", "target", "gamma", "tau", "p", "learn_p", "lambda_c",
                       "lambda_mod", "lambda_delta", "novelty_quantile", "lr", "weight_decay", "width", "epochs",
                       "delta_val_mean", "delta_val_std", "delta_val_min", "delta_val_positive", "n_seeds",
                       "transfer_delta_min", "train/gate_fit_mean"]
#: the default do-no-harm tolerance: the worst seed's transfer delta may not fall below -0.001
TRANSFER_TOLERANCE = 0.001
#: how a rule failure for a transfer check that gave NaN begins
UNMEASURED = "transfer delta not measurable"


def leaderboard(rows: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """Rows (config + summary per trial) sorted by mean validation delta, best first."""
    if not rows:
        return pd.DataFrame(columns=LEADERBOARD_COLUMNS)
    df = pd.DataFrame(list(rows))
    cols = [c for c in LEADERBOARD_COLUMNS if c in df.columns] + [c for c in df.columns if c not in LEADERBOARD_COLUMNS]
    return df[cols].sort_values("delta_val_mean", ascending=False, kind="stable").reset_index(drop=True)


def _worst_by_task(row: dict[str, Any]) -> dict[str, float]:
    """Each transfer task's worst seed delta in a row: {"paws": -0.0015, ...}."""
    return {k.split("/")[1]: v for k, v in row.items() if k.startswith("transfer/") and k.endswith("/delta_min")}


def rule_failures(row: dict[str, Any], tolerance: float = TRANSFER_TOLERANCE) -> list[str]:
    """Why a row may not win (empty: eligible)."""
    why = []
    if not (row.get("n_seeds", 0) > 0 and row.get("delta_val_positive", 0) == row.get("n_seeds", -1)):
        why.append(f"validation delta positive on {row.get('delta_val_positive', 0)}/{row.get('n_seeds', 0)} seeds")
    worst = row.get("transfer_delta_min")
    per_task = _worst_by_task(row)
    unmeasured = sorted(t for t, v in per_task.items() if not math.isfinite(v))
    if unmeasured or (worst is not None and not math.isfinite(worst)):
        # NaN compares False with everything: left to the comparison below, an unmeasurable check would pass
        why.append(f"{UNMEASURED} (NaN) on {', '.join(unmeasured) or 'a transfer task'}: its pairs "
                   "are too few or their labels or scores constant; give more pairs (--limit) or leave the task out "
                   "(--transfer)")
    elif worst is not None and worst < -tolerance:
        bad = sorted(t for t, v in per_task.items() if v < -tolerance)
        why.append(f"transfer delta {worst:+.4f} < -{tolerance:g} on {', '.join(bad) or 'a transfer task'}")
    return why


def select_winner(rows: Sequence[dict[str, Any]], tie: float = 1e-4,
                  tolerance: float = TRANSFER_TOLERANCE) -> dict[str, Any] | None:
    """The winning row, or None when no configuration passes `rule_failures` (see module docstring)."""
    eligible = [r for r in rows if not rule_failures(r, tolerance)]
    if not eligible:
        return None
    best = max(r["delta_val_mean"] for r in eligible)
    near = [r for r in eligible if r["delta_val_mean"] >= best - tie]
    return min(near, key=lambda r: (r.get("gamma", 0.0), -r["delta_val_mean"]))


def rule_text(tolerance: float = TRANSFER_TOLERANCE) -> str:
    """The winner rule in words: recorded on every registered version (versions under other rules do not compete)."""
    return (f"validation delta > 0 on every seed, pairs scored as served; every transfer delta >= -{tolerance:g} on "
            "every seed (pairs unseen in training, and the whole split where some share a sentence with train); best "
            "mean validation delta, near-ties to the smaller gamma")


def no_winner_reason(rows: Sequence[dict[str, Any]], tolerance: float = TRANSFER_TOLERANCE) -> str:
    """One sentence: how many of the configurations that completed failed which part of the rule (only the parts
    some failed), and on which transfer tasks."""
    if not rows:
        return "No configuration completed."
    fails = [rule_failures(r, tolerance) for r in rows]
    val = sum(any(f.startswith("validation") for f in fs) for fs in fails)
    unmeasured = sum(any(f.startswith(UNMEASURED) for f in fs) for fs in fails)
    harm = sum(any(f.startswith("transfer") and not f.startswith(UNMEASURED) for f in fs) for fs in fails)
    tasks: dict[str, int] = {}
    for r in rows:
        for task, v in _worst_by_task(r).items():
            if math.isfinite(v) and v < -tolerance:
                tasks[task] = tasks.get(task, 0) + 1
    where = ", ".join(f"{t}: {n}" for t, n in sorted(tasks.items(), key=lambda kv: (-kv[1], kv[0])))
    parts = [f"{val} have a seed whose validation delta is not positive" if val else "",
             f"{harm} harm a transfer task by more than {tolerance:g} on some seed ({where})" if harm else "",
             f"{unmeasured} have a transfer check that could not be measured (NaN: give more pairs with --limit, or "
             "leave the task out with --transfer)" if unmeasured else ""]
    return (f"No configuration passes the winner rule; of the {len(rows)} that completed, "
            + ", ".join(p for p in parts if p) + ".")


def _float_format(column: pd.Series, digits: int) -> str:
    """How a column's floats print: whole numbers as integers (seed counts and widths, which Tune reports as floats),
    a column whose values all lie below 0.01 in two decimals more (learning rates: 0.0009 said little), else `digits`
    decimals."""
    nums = [float(v) for v in column if isinstance(v, float) and not math.isnan(v)]
    if nums and all(v.is_integer() for v in nums):
        return ".0f"
    return f".{digits + 2}f" if nums and max(abs(v) for v in nums) < 0.01 else f".{digits}f"


def to_markdown(df: pd.DataFrame, top: int | None = None, digits: int = 4) -> str:
    df = df.head(top) if top else df
    if df.empty:
        return "(no trials)\n"
    cols = list(df.columns)
    specs = [_float_format(df[c], digits) for c in cols]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, row in df.iterrows():
        cells = [format(v, spec) if isinstance(v, float) else str(v) for v, spec in zip(row.tolist(), specs)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
