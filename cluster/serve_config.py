"""A Serve config with some of its applications' arguments set from the command line (`cluster/local.sh serve CONFIG
KEY=VALUE ...`, `make serve TASK=qqp`), written beside the cluster's state and checked before it is deployed.

    python cluster/serve_config.py CONFIG OUT KEY=VALUE ...    # OUT "-": check only, write nothing

Each KEY=VALUE sets `args.KEY` of every application of CONFIG (the value read as YAML: 8 is a number, null is
None, {min: 1, max: 2} a mapping); the result must still validate as `serving.args.AppArgs`, so that a misspelt key
or a bad value ends here in one line (exit 2) instead of in a failed deployment.
"""
from __future__ import annotations

import sys
from pathlib import Path

import yaml
from pydantic import ValidationError

from serving.args import AppArgs


def overridden(config: dict, pairs: list[str]) -> dict:
    """`config` with args.KEY = VALUE in every application; ValueError naming a malformed or invalid pair."""
    values = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key or key not in AppArgs.model_fields:
            raise ValueError(f"{pair!r}: give KEY=VALUE with KEY an argument of the serving application, one of "
                             f"{sorted(AppArgs.model_fields)}.")
        values[key] = yaml.safe_load(value) if value else None
    apps = config.get("applications") or []
    if not apps:
        raise ValueError("the config lists no application to set arguments of.")
    for app in apps:
        app["args"] = {**(app.get("args") or {}), **values}
        try:
            AppArgs(**app["args"])
        except ValidationError as exc:
            err = exc.errors()[0]
            raise ValueError(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']} "
                             f"(application {app.get('name')!r}).") from None
    return config


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__.split("\n\n", 1)[1].split("\n\n", 1)[0].strip(), file=sys.stderr)
        return 2
    source, out, pairs = Path(argv[0]), Path(argv[1]), argv[2:]
    try:
        config = overridden(yaml.safe_load(source.read_text(encoding="utf-8")) or {}, pairs)
    except ValueError as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 2
    if str(out) == "-":
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# {source} with {' '.join(pairs)} (cluster/serve_config.py)\n" + yaml.safe_dump(config,
                                                                                                   sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
