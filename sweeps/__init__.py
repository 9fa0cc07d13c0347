"""Ray Tune sweeps of the adapters (see sweeps/README.md). `require_stack` is what the entry scripts call first."""
from __future__ import annotations

import importlib.util
import sys

#: what the sweep's modules import at their top (sweeps.cli and the trainables)
STACK = ("numpy", "torch", "ray", "mlflow", "optuna", "sentence_transformers")


def require_stack(script: str) -> None:
    """Exits with one line when this Python lacks a package of the sweep's stack: under `ray job submit` the job's
    `python` is the one on the PATH of whoever ran `ray start`, which need not be the project's venv."""
    # found, not imported: sentence_transformers alone takes ~2 s to import, and the sweep's driver imports it only
    # where it encodes (a package that is there but broken fails at its import, with its own traceback)
    missing = [name for name in STACK if importlib.util.find_spec(name) is None]
    if missing:
        print(f"error: {script} runs under {sys.executable}, which lacks {', '.join(missing)}: run it with the "
              f"project's venv (`make venv`, then `.venv/bin/python {script} ...`). Under `ray job submit`, the job's "
              "`python` is the one on the PATH of whoever ran `ray start`: start the cluster with `cluster/local.sh "
              "start`, or from an activated venv (`source .venv/bin/activate; ray start --head`).", file=sys.stderr)
        raise SystemExit(2)
