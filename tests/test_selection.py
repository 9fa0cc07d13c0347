from __future__ import annotations

import pytest

from embed_lib.training.selection import leaderboard, no_winner_reason, rule_failures, select_winner, to_markdown


def _row(trial, mean, positive, gamma, n=5):
    return {"trial": trial, "delta_val_mean": mean, "delta_val_positive": positive, "n_seeds": n, "gamma": gamma}


def test_winner_must_be_positive_on_every_seed():
    rows = [_row("a", 0.02, 4, 0.1), _row("b", 0.01, 5, 0.1)]
    assert select_winner(rows)["trial"] == "b"  # a has the larger mean but one negative seed
    assert select_winner([_row("a", 0.02, 4, 0.1)]) is None


def _with_transfer(row, per_seed: dict[str, list[float]]):
    """A row as a finished trial reports it: per transfer task the mean and the worst seed's delta."""
    for task, deltas in per_seed.items():
        row[f"transfer/{task}/delta_mean"] = sum(deltas) / len(deltas)
        row[f"transfer/{task}/delta_min"] = min(deltas)
    row["transfer_delta_min"] = min(min(d) for d in per_seed.values())
    return row


def test_rule_rejects_a_trial_that_harms_a_transfer_task_on_one_seed():
    harmful = _with_transfer(_row("harmful", 0.03, 5, 0.1),  # best on its own split, every seed positive ...
                             {"mrpc": [0.01, 0.0, 0.002, 0.001, 0.0], "paws": [0.0, 0.0, -0.0015, 0.0, 0.0]})
    safe = _with_transfer(_row("safe", 0.01, 5, 0.1), {"mrpc": [0.0] * 5, "paws": [-0.0009, 0.0, 0.0, 0.0, 0.0]})
    assert select_winner([harmful, safe])["trial"] == "safe"  # ... but one seed costs paws 0.0015 > 0.001
    assert rule_failures(harmful) == ["transfer delta -0.0015 < -0.001 on paws"]
    assert rule_failures(safe) == []
    assert select_winner([harmful, safe], tolerance=0.002)["trial"] == "harmful"  # the tolerance is named
    assert select_winner([harmful]) is None
    assert no_winner_reason([harmful]) == ("No configuration passes the winner rule; of the 1 that completed, 1 "
                                           "harm a transfer task by more than 0.001 on some seed (paws: 1).")
    two = [harmful, _with_transfer(_row("both", 0.01, 4, 0.1), {"mrpc": [-0.002] * 5, "paws": [-0.003] * 5})]
    assert no_winner_reason(two) == ("No configuration passes the winner rule; of the 2 that completed, 1 have a "
                                     "seed whose validation delta is not positive, 2 harm a transfer task by more "
                                     "than 0.001 on some seed (paws: 2, mrpc: 1).")


def test_rule_refuses_a_transfer_check_that_could_not_be_measured():
    # a transfer split too small, or with constant labels, gives a NaN Spearman: NaN < -tolerance is False, so
    # without its own check the unmeasured task would pass the do-no-harm rule
    nan = float("nan")
    unmeasured = _with_transfer(_row("unmeasured", 0.03, 5, 0.1), {"mrpc": [0.0] * 5, "paws": [0.0] * 5})
    unmeasured["transfer/paws/delta_min"] = unmeasured["transfer_delta_min"] = nan
    safe = _with_transfer(_row("safe", 0.01, 5, 0.1), {"mrpc": [0.0] * 5, "paws": [0.0] * 5})
    assert select_winner([unmeasured, safe])["trial"] == "safe"
    assert select_winner([unmeasured]) is None
    (why,) = rule_failures(unmeasured)
    assert why.startswith("transfer delta not measurable (NaN) on paws:") and "--limit" in why and "--transfer" in why
    assert no_winner_reason([unmeasured]) == (
        "No configuration passes the winner rule; of the 1 that completed, 1 have a transfer check that could not be "
        "measured (NaN: give more pairs with --limit, or leave the task out with --transfer).")


def test_worst_transfer_delta_is_nan_wherever_a_seed_gave_nan():
    from embed_lib.training.seed_group import summarize

    nan = float("nan")
    seeds = [{"delta_val": 0.01, "transfer/mrpc/delta": 0.002, "transfer/paws/delta": d} for d in (0.0, nan, 0.001)]
    out = summarize(seeds)
    assert out["transfer_delta_min"] != out["transfer_delta_min"]  # NaN, not 0.0 (Python's min keeps the first)
    assert out["transfer/mrpc/delta_min"] == 0.002 and out["transfer/paws/delta_min"] != out["transfer/paws/delta_min"]
    assert rule_failures({**out, "delta_val_positive": 3, "n_seeds": 3})[0].startswith(
        "transfer delta not measurable (NaN) on paws")


def test_trial_objective_penalises_harm_beyond_the_tolerance():
    from sweeps.trainable import HARM_PENALTY, objective

    assert objective({"delta_val_mean": 0.02}, 0.001) == 0.02  # no transfer checks
    assert objective({"delta_val_mean": 0.02, "transfer_delta_min": -0.001}, 0.001) == 0.02
    assert objective({"delta_val_mean": 0.02, "transfer_delta_min": -0.004}, 0.001) == pytest.approx(
        0.02 - HARM_PENALTY * 0.003)
    # QQP's sweep: a rule-breaker's large gain ranks below a small gain that keeps the rule
    assert objective({"delta_val_mean": 0.0518, "transfer_delta_min": -0.0038}, 0.001) < objective(
        {"delta_val_mean": 0.0086, "transfer_delta_min": 0.0}, 0.001)


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


def test_the_markdown_leaderboard_prints_counts_as_integers_and_small_rates_with_more_decimals():
    """Tune reports every metric as a float: 5 positive seeds printed as 5.0000, and a learning rate of 0.000907 as
    0.0009 beside 0.0015 (now 0.000907 and 0.001500: one column, one format)."""
    rows = [{**_row(t, d, 5.0, g, n=5.0), "lr": lr, "width": 128.0, "adapter": "pair_gated"}
            for t, d, g, lr in [("a", 0.0126, 0.715, 0.000907), ("b", 0.0123, 0.7325, 0.0015)]]
    header, _, first, second = to_markdown(leaderboard(rows)).splitlines()
    cells = dict(zip(header.strip("| ").split(" | "), first.strip("| ").split(" | ")))
    assert cells == {"trial": "a", "delta_val_mean": "0.0126", "delta_val_positive": "5", "n_seeds": "5",
                     "gamma": "0.7150", "lr": "0.000907", "width": "128", "adapter": "pair_gated"}
    assert "| 0.001500 |" in second and "| nan |" not in second


def test_grid_values_parse_as_json_scalars_or_strings():
    from sweeps.flags import parse_grid

    grid = parse_grid(["gamma=0.05,0.1", "adapter=pair_gated", "learn_p=true,false", "target=none,lexical"], None)
    assert grid == {"gamma": [0.05, 0.1], "adapter": ["pair_gated"], "learn_p": [True, False],
                    "target": ["none", "lexical"]}
    with pytest.raises(ValueError, match=r"Unknown grid key\(s\) \['gama'\]"):
        parse_grid(["gama=0.1"], None)


def test_the_sweep_driver_uses_every_core_it_may_run_on(monkeypatch):
    """A Ray job's entrypoint inherits OMP_NUM_THREADS=1; the driver's precompute (the teacher) must not
    stay on one core."""
    import os

    from sweeps.cli import driver_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("EMBED_DRIVER_THREADS", raising=False)
    assert driver_threads() == len(os.sched_getaffinity(0))
    monkeypatch.setenv("EMBED_DRIVER_THREADS", "3")
    assert driver_threads() == 3


def test_encoding_takes_one_actor_per_cpu_of_the_cluster_at_most_four(monkeypatch):
    """--encode-workers 0: the encoders run before any trial, so one actor per CPU (a single actor of one thread
    left one of two cores idle for the whole encoding); per GPU on GPU clusters; capped, as each holds a model."""
    import sweeps.cli as cli

    resources = {"CPU": 2.0}
    monkeypatch.setattr(cli.ray, "cluster_resources", lambda: resources)
    assert cli.encode_workers(0, use_gpu=False) == 2
    assert cli.encode_workers(3, use_gpu=False) == 3  # asked for: as given
    resources.update(CPU=64.0, GPU=1.0)
    assert cli.encode_workers(0, use_gpu=False) == 4 and cli.encode_workers(0, use_gpu=True) == 1
    with pytest.raises(ValueError, match=r"--encode-workers=-1; give 0 \(one per CPU of the cluster, at most 4\)"):
        cli.encode_workers(-1, use_gpu=False)
