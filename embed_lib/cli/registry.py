"""`python -m embed_lib registry`: a registered model's versions, aliases, figures and why each alias sits where it
does; `--promote N` / `--rollback` move `champion` deliberately (recorded as manual)."""
from __future__ import annotations

import argparse
import json

import mlflow

from embed_lib.tracking.registry import history, model_name, move_champion, versions_of
from embed_lib.tracking.runs import default_tracking_uri, require_store


def add_registry_parser(sub) -> None:
    p = sub.add_parser("registry", help="versions of pair-residual-<task>: aliases, figures and the recorded reason "
                                        "of every alias move; --promote / --rollback move champion by hand")
    p.add_argument("--task", dest="model_task", default="stsb", metavar="TASK",
                   help="the task whose model is listed: pair-residual-<task> (default stsb)")
    p.add_argument("--name", default=None, help="the registered model instead (e.g. pair-residual-stsb-smoke, or "
                                                "cross-encoder-stsb: the served cross-encoder's versions)")
    p.add_argument("--tracking-uri", default=None,
                   help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or sqlite:///<cwd>/mlflow.db)")
    move = p.add_mutually_exclusive_group()
    move.add_argument("--promote", metavar="VERSION", default=None,
                      help="make VERSION the champion (a deliberate move, recorded as manual with --reason)")
    move.add_argument("--rollback", action="store_true",
                      help="move champion back to the version it was taken from (recorded as manual)")
    p.add_argument("--reason", default="", help="why, for --promote / --rollback (kept in the record)")
    p.add_argument("--json", action="store_true", help="print the history as JSON")
    p.set_defaults(func=cmd_registry)


def _event(rec: dict) -> str:
    how = "manual" if rec.get("manual") else "auto"
    return (f"{'':>9}-> {rec.get('alias')}: {rec.get('reason')} ({how}, {rec.get('time', '?')}, commit "
            f"{str(rec.get('git_commit', '?'))[:8]})")


def _row(r: dict) -> str:
    fig = f"{float(r['figure']):+.5f}" if r["figure"] else "?"
    pairs = f"{int(r['val_pairs']):,}" if r["val_pairs"] else "?"
    encoder = (r["encoder"] or "?").replace("encoder=", "")
    events = r["promotion_history"] or ([r["promotion"]] if r["promotion"] else [])
    lines = [f"{r['version']:>7}  {','.join(r['aliases']) or '-':<19}  {fig:>14}  {pairs:>9}  {encoder}",
             *(_event(e) for e in events)]
    if not events:
        lines.append(f"{'':>9}no recorded promotion (registered before promotion records)")
    return "\n".join(lines)


def _as_json(args: argparse.Namespace, name: str, tracking_uri: str, rows: list[dict], fix: str) -> bool:
    """ValueError naming the store and `fix` when `name` has no version there; with --json the rows printed as JSON
    (True: nothing more to print)."""
    if not rows:
        raise ValueError(f"No registered model {name!r} in {tracking_uri}. {fix}")
    if args.json:
        print(json.dumps({"name": name, "tracking_uri": tracking_uri, "versions": rows}, indent=2))
    return bool(args.json)


def _cross_encoders(args: argparse.Namespace, name: str, tracking_uri: str, client) -> int:
    """A served cross-encoder's versions (`make teacher` registers them; the service reads @current): its alias is
    not the champion's, and the adapter's columns and promotion records are not its own."""
    if args.promote is not None or args.rollback:
        raise ValueError(f"{name} is a served cross-encoder: `make teacher` (python -m embed_lib teacher) moves its "
                         f"alias 'current', which the cascade reads (models:/{name}@current); --promote / --rollback "
                         "move the champion of an adapter (pair-residual-<task>).")
    rows = [{"version": str(mv.version), "aliases": held, **(mv.tags or {})} for mv, held in versions_of(name, client)]
    if _as_json(args, name, tracking_uri, rows, "`make teacher TASK=<task>` registers cross-encoder-<task>."):
        return 0
    print(f"{name} in {tracking_uri}\n{'version':>7}  {'aliases':<19}  {'test Spearman':>13}  recipe (teacher key)")
    for r in rows:
        test = f"{float(r['test_spearman']):.4f}" if r.get("test_spearman") else "?"
        print(f"{r['version']:>7}  {','.join(r['aliases']) or '-':<19}  {test:>13}  {r.get('recipe', '?')} "
              f"({r.get('teacher_key', '?')})")
    return 0


def cmd_registry(args: argparse.Namespace) -> int:
    tracking_uri = require_store(args.tracking_uri or default_tracking_uri())
    client = mlflow.MlflowClient(tracking_uri, registry_uri=tracking_uri)
    name = args.name or model_name(args.model_task)
    if name.startswith("cross-encoder-"):
        return _cross_encoders(args, name, tracking_uri, client)
    if args.promote is not None or args.rollback:
        decision = move_champion(name, None if args.rollback else args.promote, args.reason, client)
        print(f"{name}: champion -> version {client.get_model_version_by_alias(name, 'champion').version} "
              f"({decision.reason}); recorded as manual")
    rows = history(name, client)
    if _as_json(args, name, tracking_uri, rows, "Run a sweep first (make run), or name another with --task / --name "
                                                "/ --tracking-uri."):
        return 0
    print(f"{name} in {tracking_uri}\n"
          f"{'version':>7}  {'aliases':<19}  {'delta_val_mean':>14}  {'val pairs':>9}  encoder\n{'':>9}-> every "
          "alias move of the version and why (how, when, commit)")
    for r in rows:
        print(_row(r))
    return 0
