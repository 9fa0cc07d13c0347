"""Sweep the per-sentence complexity-scaling forms against their controls under one budget
(DESIGN.md section 2: the negative result must be reproducible), on the pair_residual machinery.

    python sweeps/per_sentence.py --task stsb [--smoke-test]

Hyperparameters
  scientific: form (per_sentence / per_sentence_preserving), control (none, h_only, constant, global,
              shuffled), difficulty target (surface, lexical, ce_margin), alpha0, gamma (preserving mix),
              tau, lambda_c, lambda_mod
  nuisance:   learning rate, weight decay, width, epochs
  fixed:      encoder, task, data split, loss (CoSENT), p = 1 (cosine), batch size 128, seed group
The leaderboard shows whether any complexity-conditioned form beats its constant / shuffled controls.
"""
from __future__ import annotations

from sweeps import require_stack

require_stack("sweeps/per_sentence.py")

from sweeps.cli import suggest_nuisance, sweep_main  # noqa: E402  (after the check: it imports the stack)

FIXED = {"loss": "cosent", "batch_size": 128, "p": 1.0, "learn_p": False, "hidden": 128}
SPACE_KEYS = ["adapter", "control", "target", "alpha0", "gamma", "tau", "lambda_c", "lambda_mod", "lr",
              "weight_decay", "width", "epochs"]


def space(trial, tau_attn_values=(1.0,), targets=("surface", "lexical", "ce_margin"), fixed=()) -> dict:
    """Optuna define-by-run space; returns the constants implied by the choices."""
    constants = {}
    # scientific
    trial.suggest_categorical("adapter", ["per_sentence", "per_sentence_preserving"])
    control = trial.suggest_categorical("control", ["none", "h_only", "constant", "global", "shuffled"])
    if control in ("none", "shuffled"):
        trial.suggest_categorical("target", [t for t in targets if t in ("surface", "lexical", "ce_margin")])
        trial.suggest_float("lambda_c", 0.1, 100.0, log=True)
    else:
        constants.update(target="none", lambda_c=0.0)
    trial.suggest_float("alpha0", 0.1, 0.9)
    trial.suggest_float("gamma", 0.05, 0.5, log=True)
    trial.suggest_float("tau", 0.02, 0.2, log=True)
    trial.suggest_categorical("lambda_mod", [0.0, 0.01, 0.1])
    suggest_nuisance(trial, fixed)
    return constants


if __name__ == "__main__":
    sweep_main(__doc__, "per_sentence", space, SPACE_KEYS, FIXED)
