"""A Serve config with some of its applications' arguments set from the command line (`cluster/local.sh serve CONFIG
KEY=VALUE ...`, `make serve TASK=qqp`), written beside the cluster's state and checked before it is deployed.

    python cluster/serve_config.py [--loopback] CONFIG OUT [KEY=VALUE ...]    # OUT "-": check only, write nothing

Each KEY=VALUE sets `args.KEY` of every application of CONFIG (the value read as YAML: 8 is a number, null is
None, {min: 1, max: 2} a mapping); the result must still validate as `serving.args.AppArgs`, so that a misspelt key
or a bad value ends here in one line (exit 2) instead of in a failed deployment. http_options.port=N and
http_options.host=ADDRESS set the config's own HTTP options instead (`make serve SERVE_PORT=8001`).

Every application of the copy carries in `runtime_env.env_vars` what its replicas run: `EMBED_SERVE_CODE`, a
fingerprint of the code they import (serving/ and embed_lib/), and `EMBED_SERVE_MODELS`, the versions its
`models:/NAME@ALIAS` arguments (model_uri, cross_encoder) point at now. Serve treats a deploy of an unchanged config
as nothing to do (its application builder, which resolves an alias, does not run again), and replicas import the
clone's code when they start: after an edit or a `git pull`, or once `champion` has moved to another version, the
same config would keep the replicas, their old code and their old model, running. With both in the config a change
of either is a changed config, and Serve rolls the replicas over to new ones; a deploy with nothing changed stays
a no-op. A model, version or alias the store says it does not have ends here in one line (exit 2), before the deploy
(it was the application builder's traceback, `make serve TASK=qqp` before `make run TASK=qqp`); a store that does not
answer is left to the builder, which names the problem.

--loopback (what `local.sh serve` gives on its loopback-only cluster): a config without `http_options.host` is
served on 127.0.0.1, said in one line.
Ray's default host is loopback behind Serve's Python proxy but every interface behind its HAProxy ingress
(`ray.serve._private.constants`: HAProxy on other nodes must reach the replicas), so a config copied without it would
expose the service on the machine's addresses.
"""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import yaml
from pydantic import ValidationError

from serving.args import AppArgs


#: KEY=VALUE pairs that set the config's own HTTP options rather than an application's argument
HTTP_KEYS = ("http_options.port", "http_options.host")
ROOT = Path(__file__).resolve().parent.parent
#: the environment variable of every application's runtime_env that holds `code_fingerprint` (module docstring) ...
CODE_VAR = "EMBED_SERVE_CODE"
#: ... and the versions its model aliases point at (`pinned_models`)
MODELS_VAR = "EMBED_SERVE_MODELS"
#: MLflow's client settings while `pinned_models` asks the registry
QUICK = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def code_fingerprint(root: Path = ROOT) -> str:
    """A digest of every .py file under serving/ and embed_lib/ of `root` (path and content): what the replicas run."""
    digest = hashlib.sha256()
    for path in sorted(p for d in ("serving", "embed_lib") for p in (root / d).rglob("*.py")):
        digest.update(f"{path.relative_to(root)}\0".encode() + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _registry_uris(args) -> list[str]:
    """The `models:/...` arguments of an application (model_uri, its default where not given, and cross_encoder)."""
    args = args if isinstance(args, dict) else {}  # something else: Serve's validation names it
    uris = [args.get("model_uri", AppArgs.model_fields["model_uri"].default), args.get("cross_encoder")]
    return [u for u in uris if isinstance(u, str) and u.startswith("models:/")]


def _not_in_store(exc: Exception) -> bool:
    """Whether `pinned_uri` failed because the store answered that it has no such model, version or alias (MLflow's
    RESOURCE_DOES_NOT_EXIST; a missing alias is its INVALID_PARAMETER_VALUE), not because it could not be asked."""
    return getattr(exc.__cause__, "error_code", None) in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")


def pinned_models(args: dict, environ=None) -> str:
    """The versions the `models:/` arguments of an application (model_uri, cross_encoder) point at now, e.g.
    'models:/pair-residual-stsb/2' for models:/pair-residual-stsb@champion; ValueError naming an argument the store
    does not have; one that cannot be resolved otherwise (a server that does not answer) adds nothing."""
    environ = os.environ if environ is None else environ
    uris = _registry_uris(args)  # a version is asked for too (is it there?), and stamped only through an alias
    store = args.get("tracking_uri") or environ.get("MLFLOW_TRACKING_URI")
    if not uris or not store:  # no store named: MLflow's default would make an empty ./mlflow.db wherever this runs
        return ""
    from serving.model import pinned_uri  # MLflow: imported only where an alias is to be resolved

    # one try of 10 s against a server: MLflow's client retries a server that does not answer for minutes
    saved = {k: os.environ.get(k) for k in QUICK}
    os.environ.update(QUICK)
    pinned = []
    try:
        for uri in uris:
            try:
                now = pinned_uri(uri, store)
            except Exception as exc:  # the builder resolves it again, and names what is wrong
                if _not_in_store(exc):
                    raise ValueError(str(exc)) from None
                continue
            pinned += [now] if "@" in uri else []
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return " ".join(pinned)


def missing_store(config: dict, environ=None) -> str | None:
    """Why an application cannot load its model, when the local MLflow store (sqlite:/// or file://) its
    `models:/` arguments are read from does not exist (a clone before its first `make run`); else None. Said before
    a cluster starts, in one line, instead of by the application builder's traceback. A server is not asked."""
    environ = os.environ if environ is None else environ
    for app in config.get("applications") or []:
        args = (app.get("args") or {}) if isinstance(app, dict) else {}
        args = args if isinstance(args, dict) else {}
        store = args.get("tracking_uri") or environ.get("MLFLOW_TRACKING_URI") or ""
        path = store.split(":///" if store.startswith("sqlite") else "://", 1)[-1]
        uri = next(iter(_registry_uris(args)), None)
        if uri and store.startswith(("sqlite:///", "file://")) and not Path(path).exists():
            return (f"{uri} (application {app.get('name')!r}) is read from the MLflow store {store}, which does not "
                    "exist yet: `make run` (with the same TASK) trains and registers a champion there first; or name "
                    "another store (MLFLOW_TRACKING_URI, or tracking_uri=...).")
    return None


def stamped(config: dict, fingerprint: str, models=None) -> dict:
    """`config` with runtime_env.env_vars CODE_VAR = fingerprint and MODELS_VAR = models(app's args) (default
    `pinned_models`) in every application (its runtime_env otherwise kept)."""
    models = models or pinned_models
    for app in config.get("applications") or []:
        env = app.get("runtime_env") or {} if isinstance(app, dict) else None
        if isinstance(env, dict) and isinstance(env.get("env_vars") or {}, dict):  # else Serve's validation names it
            args = app.get("args") or {}
            stamp = {CODE_VAR: fingerprint, MODELS_VAR: models(args) if isinstance(args, dict) else ""}
            app["runtime_env"] = {**env, "env_vars": {**(env.get("env_vars") or {}), **stamp}}
    return config


def _http(config: dict) -> dict | None:
    """The config's http_options, made a mapping where it is missing or null; None when it is something else (which
    Serve's own validation names)."""
    if config.get("http_options") is None:
        config["http_options"] = {}
    return config["http_options"] if isinstance(config["http_options"], dict) else None


def _http_option(http: dict, key: str, value: str) -> None:
    """Sets http_options.port (an integer 1-65535) or http_options.host (an address); ValueError else."""
    name = key.split(".", 1)[1]
    if name == "port":
        port = int(value) if value.isdigit() else 0
        if not 1 <= port <= 65535:
            raise ValueError(f"{key}={value!r}: give a TCP port, an integer from 1 to 65535 (e.g. {key}=8001).")
        http[name] = port
    else:
        if not value or any(c.isspace() for c in value):
            raise ValueError(f"{key}={value!r}: give an address to listen on (127.0.0.1: this machine only).")
        http[name] = value


def overridden(config: dict, pairs: list[str]) -> dict:
    """`config` with args.KEY = VALUE in every application (http_options.port / .host: the config's own HTTP
    options); ValueError naming a malformed or invalid pair."""
    values = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if sep and key in HTTP_KEYS:
            if (http := _http(config)) is None:
                raise ValueError("the config's http_options is not a mapping.")
            _http_option(http, key, value)
            continue
        if not sep or not key or key not in AppArgs.model_fields:
            raise ValueError(f"{pair!r}: give KEY=VALUE with KEY an argument of the serving application, one of "
                             f"{sorted(AppArgs.model_fields)}, or one of {list(HTTP_KEYS)}.")
        values[key] = yaml.safe_load(value) if value else None
    apps = config.get("applications") or []
    if not apps:
        raise ValueError("the config lists no application to set arguments of.")
    for app in apps:
        app["args"] = {**(app.get("args") or {}), **values}
        try:
            AppArgs(**app["args"])
        except ValidationError as exc:
            err = exc.errors()[0]  # a validator's own message, without pydantic's "Value error, " before it
            where, msg = ".".join(str(p) for p in err["loc"]), err["msg"].removeprefix("Value error, ")
            raise ValueError(f"{where + ': ' if where else ''}{msg} (application {app.get('name')!r}).") from None
    return config


def loopback_by_default(config: dict, where: str) -> str | None:
    """Sets `http_options.host` to 127.0.0.1 where `config` (the file `where`) gives none; returns the line that says
    so, else None (a host given, or http_options not a mapping, which Serve's own validation names)."""
    http = _http(config)
    if http is None or http.get("host"):
        return None
    http["host"] = "127.0.0.1"
    return (f"serve: {where} sets no http_options.host: serving on 127.0.0.1 (behind Serve's HAProxy ingress Ray's "
            "default is every interface); give a host to expose the service deliberately (docs/clusters.md, Network "
            "exposure).")


def main(argv: list[str]) -> int:
    loopback = argv[:1] == ["--loopback"]
    argv = argv[1:] if loopback else argv
    if len(argv) < 2:
        print(__doc__.split("\n\n", 1)[1].split("\n\n", 1)[0].strip(), file=sys.stderr)
        return 2
    source, out, pairs = Path(argv[0]), Path(argv[1]), argv[2:]
    try:
        config = yaml.safe_load(source.read_text(encoding="utf-8")) or {}
        config = overridden(config, pairs) if pairs else config
    except ValueError as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 2
    if isinstance(config, dict) and (why := missing_store(config)):
        print(f"serve: {why}", file=sys.stderr)
        return 2
    note = loopback_by_default(config, str(source)) if loopback and isinstance(config, dict) else None
    if note:
        print(note)
    if str(out) == "-":
        return 0
    try:
        if isinstance(config, dict):
            stamped(config, code_fingerprint())
    except ValueError as exc:  # a model the store does not have
        print(f"serve: {exc}", file=sys.stderr)
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    what = " with ".join([str(source), *([" ".join(pairs)] if pairs else [])]) + (", on 127.0.0.1" if note else "")
    out.write_text(f"# {what} (cluster/serve_config.py)\n" + yaml.safe_dump(config, sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
