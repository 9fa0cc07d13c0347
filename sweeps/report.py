"""The end of a sweep: leaderboard and plots on the parent run, the do-no-harm winner rule, the winner
retrained with test evaluated once, logged and registered in the MLflow Model Registry."""
from __future__ import annotations

import json
from typing import Any, Callable

import mlflow

from embed_lib.tracking.cross_encoder_registry import find_version
from embed_lib.tracking.cross_encoder_registry import model_name as ce_name
from embed_lib.tracking.registry import SELECTION_METRIC, evidence_of, log_adapter_model, model_name, promote
from embed_lib.tracking.runs import log_group, pyplot
from embed_lib.training.seed_group import train_seed_group
from embed_lib.training.selection import (TRANSFER_TOLERANCE, leaderboard, no_winner_reason, rule_text, select_winner,
                                          to_markdown)
from sweeps.trainable import METRIC, final_metrics, resolve


def rows_from(results, fixed: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(complete trials, early-stopped trials) as flat dicts of config + final metrics. A trial that failed past its
    retries (`r.error`; no config or result to rank) is neither: `errored` counts it."""
    done, stopped = [], []
    for r in results:
        if r.metrics is None or r.config is None or getattr(r, "error", None) is not None:
            continue
        row = {"trial": r.metrics.get("trial_id"), **r.config, **fixed, "config": dict(r.config)}
        if "per_seed" in r.metrics:
            row.update(final_metrics(r.metrics))
            row["per_seed"] = json.loads(r.metrics["per_seed"])
            done.append(row)
        else:
            row["objective_last"] = r.metrics.get(METRIC)
            stopped.append(row)
    return done, stopped


def isolation_plot(rows: list[dict[str, Any]], keys: list[str]):
    plt = pyplot()
    from matplotlib.ticker import NullFormatter

    keys = [k for k in keys if any(k in r for r in rows)]
    # a grid of readable panels (4 across), not one strip of many
    cols = min(4, max(1, len(keys)))
    nrows = -(-max(1, len(keys)) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    for ax in axes.flat[len(keys):]:
        ax.axis("off")
    for ax, key in zip(axes.flat, keys):
        xs = [r.get(key) for r in rows]
        ys = [r["delta_val_mean"] for r in rows]
        # numbers on a numeric axis; a value every trial shares (a fixed width) as one category, not a spread axis
        if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs) and len(set(xs)) > 1:
            ax.scatter(xs, ys, s=12)
            if key in ("lr", "lambda_c", "lambda_mod", "weight_decay") and min(xs) > 0:
                ax.set_xscale("log")
                ax.xaxis.set_minor_formatter(NullFormatter())  # 3x10^-3, 4x10^-3, ... ran into one another
        else:
            cats = sorted({str(x) for x in xs})
            ax.scatter([cats.index(str(x)) for x in xs], ys, s=12)
            ax.set_xticks(range(len(cats)), cats, rotation=30, fontsize=8)
        ax.axhline(0, color="k", lw=0.6)
        ax.set_title(key, fontsize=11)
        ax.set_ylabel("mean val delta", fontsize=9)
    fig.tight_layout()
    return fig


def seed_plot(rows: list[dict[str, Any]], top: int = 5):
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 3))
    for i, r in enumerate(rows[:top]):
        d = [s["delta_val"] for s in r["per_seed"]]
        ax.scatter([i] * len(d), d, s=14)
    ax.axhline(0, color="k", lw=0.6)
    ax.set_xticks(range(min(top, len(rows))), [str(r["trial"]) for r in rows[:top]], rotation=30, fontsize=7)
    ax.set_ylabel("per-seed val delta")
    ax.set_title(f"top {min(top, len(rows))} configurations")
    fig.tight_layout()
    return fig


def _board(done: list[dict[str, Any]], stopped: list[dict[str, Any]], space_keys: list[str], fixed: dict[str, Any],
           log_fn: Callable[[str], None]) -> None:
    """Leaderboard (CSV + markdown) and plots on the active (parent) run."""
    board = leaderboard([{k: v for k, v in r.items() if k not in ("per_seed", "config")} for r in done])
    mlflow.log_text(board.to_csv(index=False), "leaderboard.csv")
    mlflow.log_text(to_markdown(board), "leaderboard.md")
    mlflow.log_metrics({"trials_complete": len(done), "trials_stopped_early": len(stopped)})
    ranked = sorted(done, key=lambda r: -r["delta_val_mean"])
    if done:
        for name, fig in (("plots/isolation.png", isolation_plot(done, space_keys)), ("plots/top_seeds.png", seed_plot(ranked))):
            mlflow.log_figure(fig, name)
            pyplot().close(fig)
    shown = [c for c in board.columns if not (c in fixed and c not in space_keys)
             and not (c.startswith("transfer/") and not c.endswith("_min"))]
    log_fn(to_markdown(board[shown], top=10))


def _describe_version(task: str, name: str, version: str, result, tolerance: float,
                      teacher: dict[str, Any] | None) -> dict:
    """Tags and description of the registered version: the rule and the figures it was chosen on."""
    s = result.summary
    transfer = {k.split("/")[1]: v for k, v in s.items() if k.startswith("transfer/") and k.endswith("/delta_min")}
    tags = {"val_spearman": repr(float(s[SELECTION_METRIC])),  # the served seed ensemble's, full precision
            "delta_val_positive": f"{s['delta_val_positive']}/{s['n_seeds']}",
            **({"transfer_delta_min": f"{s['transfer_delta_min']:+.5f}"} if "transfer_delta_min" in s else {}),
            **{f"transfer_delta_min.{k}": f"{v:+.5f}" for k, v in transfer.items()}}
    if teacher is not None and result.config.target == "ce_margin":  # the teacher whose margin gates it
        tags["teacher"] = f"{teacher['config']['model']} ({teacher.get('preset', 'custom')}), key {teacher['key']}"
    client = mlflow.MlflowClient()
    if teacher is not None and result.config.target == "ce_margin":
        ce_version = find_version(task, teacher["key"], client)  # that teacher, registered by `embed_lib teacher`
        if ce_version is not None:
            tags["teacher_model"] = f"models:/{ce_name(task)}/{ce_version}"
    for k, v in tags.items():
        client.set_model_version_tag(name, version, k, v)
    client.update_model_version(name, version, description=(
        f"{result.config.adapter} (target {result.config.target}, gamma {result.config.gamma:g}) on {task}: validation "
        f"delta {s['delta_val_mean']:+.4f} vs the frozen cosine ({s['delta_val_positive']}/{s['n_seeds']} seeds > 0), "
        f"test {s.get('delta_test_mean', float('nan')):+.4f}; worst transfer delta "
        f"{s.get('transfer_delta_min', float('nan')):+.4f} (" + ", ".join(f"{k} {v:+.4f}" for k, v in transfer.items())
        + f"). Rule: {rule_text(tolerance)}."))
    return tags


def finish_sweep(results, data, fixed: dict[str, Any], space_keys: list[str], task: str, parent_run_id: str,
                 log_fn: Callable[[str], None] = print, tolerance: float = TRANSFER_TOLERANCE,
                 teacher: dict[str, Any] | None = None, registered_name: str | None = None) -> dict[str, Any]:
    """Leaderboard and plots on the parent run; the do-no-harm winner retrained, tested once, registered under
    `registered_name` (default `pair-residual-<task>`), its alias decided by `registry.promote`."""
    done, stopped = rows_from(results, fixed)
    _board(done, stopped, space_keys, fixed, log_fn)
    winner = select_winner(done, tolerance=tolerance)
    out: dict[str, Any] = {"complete": len(done), "stopped_early": len(stopped), "winner": None,
                           "errored": sum(getattr(r, "error", None) is not None for r in results)}
    mlflow.set_tag("winner_rule", rule_text(tolerance))
    swept = (f"Sweep of `{task}`: {len(done)} configurations complete, {len(stopped)} stopped early by ASHA, "
             f"{fixed.get('n_seeds', '?')} seeds each; searched: {', '.join(space_keys) or 'nothing'}; fixed: "
             f"{', '.join(f'{k}={v}' for k, v in fixed.items())}.\n\nWinner rule: {rule_text(tolerance)}.\n\n")
    if winner is None:
        msg = no_winner_reason(done, tolerance) + " Nothing registered."
        mlflow.set_tags({"winner": "none", "no_winner_reason": msg, "mlflow.note.content": swept + msg})
        log_fn(msg)
        out["reason"] = msg
        return out
    cfg, data = resolve(winner["config"], data, fixed)  # exactly what the winning trial trained
    result = train_seed_group(cfg, data)  # the only place test is evaluated
    name = registered_name or model_name(task)
    with mlflow.start_run(run_name="winner", nested=True, parent_run_id=parent_run_id):
        log_group(result, data, teacher)
        info = log_adapter_model(result, data, registered_name=name)
        version = str(info.registered_model_version)
        _describe_version(task, name, version, result, tolerance, teacher)
        decision = promote(name, version, evidence_of(result, data, tolerance))
    alias = decision.alias
    mlflow.set_tags({"winner": winner["trial"], "winner_version": version, "winner_alias": alias,
                     "promotion_reason": decision.reason,
                     "mlflow.note.content": swept + f"Winner: trial {winner['trial']} ({cfg.adapter}, target "
                     f"{cfg.target}), validation delta {result.summary['delta_val_mean']:+.4f}, test delta "
                     f"{result.summary['delta_test_mean']:+.4f}; registered {name} version {version} "
                     f"as '{alias}' ({decision.reason}; previous champion: "
                     f"{(decision.previous or {}).get('version', 'none')}). Leaderboard: leaderboard.md."})
    out.update(winner=winner["trial"], version=version, alias=alias, promotion_reason=decision.reason,
               registered_name=name, config=cfg.to_dict(), summary=result.summary)
    s = result.summary
    transfer = ", ".join(f"{k.split('/')[1]} {v:+.4f}" for k, v in s.items()
                         if k.startswith("transfer/") and k.endswith("/delta_min"))
    distil = (f", lambda_distil {cfg.lambda_distil:.3g}, silver_fraction {cfg.silver_fraction:.3g}" if cfg.distilled
              else ", not distilled")
    log_fn(f"winner {winner['trial']} ({cfg.adapter}, target {cfg.target}, gamma {cfg.gamma:.3g}, lambda_delta "
           f"{cfg.lambda_delta:.3g}, novelty_quantile {cfg.novelty_quantile:.3g}{distil}): val delta "
           f"{s['delta_val_mean']:+.4f} "
           f"({s['delta_val_positive']}/{cfg.n_seeds} seeds positive), test delta {s['delta_test_mean']:+.4f} "
           f"({s['delta_test_positive']}/{cfg.n_seeds}); worst seed's transfer delta per task: {transfer or 'none'}; "
           f"registered {name} version {version} as '{alias}'")
    log_fn(f"{name} version {version} -> '{alias}': {decision.reason}")
    return out
