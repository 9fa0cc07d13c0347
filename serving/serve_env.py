"""The Ray Serve settings of cluster/serve.env, for the Python entry points that start a Ray of their own."""
from __future__ import annotations

import os
from pathlib import Path

SERVE_ENV_FILE = Path(__file__).resolve().parents[1] / "cluster" / "serve.env"


def serve_env(path: Path = SERVE_ENV_FILE) -> dict[str, str]:
    """KEY=VALUE lines of the file (comments and blank lines skipped)."""
    env = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"{path}:{n}: expected KEY=VALUE, got {line!r}")
        env[key] = value
    return env


def apply_serve_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set the file's variables where the environment does not set them already (call before ray.init: the
    processes of a local Ray inherit them); returns the values in force."""
    environ = os.environ if environ is None else environ
    settings = serve_env()
    for key, value in settings.items():
        environ.setdefault(key, value)
    return {key: environ[key] for key in settings}
