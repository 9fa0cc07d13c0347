from __future__ import annotations

import pytest

from embed_lib.selection import leaderboard, select_winner, to_markdown


def _row(trial, mean, positive, gamma, n=5):
    return {"trial": trial, "delta_val_mean": mean, "delta_val_positive": positive, "n_seeds": n, "gamma": gamma}


def test_winner_must_be_positive_on_every_seed():
    rows = [_row("a", 0.02, 4, 0.1), _row("b", 0.01, 5, 0.1)]
    assert select_winner(rows)["trial"] == "b"  # a has the larger mean but one negative seed
    assert select_winner([_row("a", 0.02, 4, 0.1)]) is None


def test_near_ties_go_to_the_smaller_gamma():
    rows = [_row("big", 0.01005, 5, 0.2), _row("small", 0.01, 5, 0.05), _row("worse", 0.005, 5, 0.01)]
    assert select_winner(rows, tie=1e-4)["trial"] == "small"
    assert select_winner(rows, tie=0.0)["trial"] == "big"


def test_leaderboard_order_and_markdown():
    board = leaderboard([_row("a", 0.01, 5, 0.1), _row("b", 0.03, 5, 0.1)])
    assert list(board["trial"]) == ["b", "a"]
    md = to_markdown(board)
    assert md.splitlines()[0].startswith("| trial |") and "| b |" in md.splitlines()[2]
    assert to_markdown(leaderboard([])) == "(no trials)\n"


def test_grid_values_parse_as_json_scalars_or_strings():
    from sweeps.tune_helpers import parse_grid

    grid = parse_grid(["gamma=0.05,0.1", "adapter=pair_gated", "learn_p=true,false", "target=none,lexical"], None)
    assert grid == {"gamma": [0.05, 0.1], "adapter": ["pair_gated"], "learn_p": [True, False],
                    "target": ["none", "lexical"]}
    with pytest.raises(ValueError, match=r"Unknown grid key\(s\) \['gama'\]"):
        parse_grid(["gama=0.1"], None)
