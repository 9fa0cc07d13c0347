"""The sweep's Tuner: Optuna (TPE, seeded) proposing configurations, or an explicit grid; ASHA on the objective
(`sweeps.trainable.objective`: the mean validation delta less the transfer harm, each epoch); a sweep restored for
--resume."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import ray
from ray import tune
from ray.tune.schedulers import ASHAScheduler
from ray.tune.search.optuna import OptunaSearch

from sweeps.flags import parse_grid
from sweeps.trainable import MAX_EPOCHS, METRIC, MODE


def reuse_actors() -> bool:
    """Tune's actor reuse (~0.1 s instead of ~1.7 s per trial) on one node only. On several, a node lost under a
    trial leaves its actor "temporarily unavailable" until Ray declares the node dead, and a reused actor took every
    retry of that trial within the same second (seen: 3 failures of one trial at 07:54:59, the sweep lost it);
    a fresh actor per trial is placed on a live node."""
    return len([n for n in ray.nodes() if n.get("Alive")]) <= 1


def make_tuner(args, trainable, run_config, fixed: dict[str, Any], space_fn, space_keys: list[str], first,
               taus: list[float], storage: Path, name: str, start_points=None):
    """(Tuner, the keys the search varies): Optuna (TPE, seeded) or an explicit grid; ASHA on the objective."""
    if args.resume:
        return tune.Tuner.restore(str(storage / name), trainable=trainable, resume_unfinished=True,
                                  resume_errored=True), space_keys
    max_t = int(fixed.get("epochs", MAX_EPOCHS)) + 1  # epochs + the final (selected-epoch) report
    scheduler = ASHAScheduler(metric=METRIC, mode=MODE, max_t=max_t, grace_period=min(3, max_t))
    if args.search == "grid":
        grid = parse_grid(args.grid, args.grid_file)
        tune_config = tune.TuneConfig(num_samples=1, max_concurrent_trials=args.max_concurrent,
                                      reuse_actors=reuse_actors())
        param_space = {k: tune.grid_search(v) for k, v in grid.items()}
        space_keys = sorted(grid)
    else:
        # a partial of a module-level function: the searcher state is pickled for --resume
        targets = [t for t in ("ce_margin", "lexical", "surface") if t in first.targets]
        points = (start_points(targets, sorted(fixed), task=first.task)
                  if start_points and not args.no_start_points else None)
        searcher = OptunaSearch(space=functools.partial(space_fn, tau_attn_values=taus, targets=targets,
                                                        fixed=sorted(fixed)), metric=METRIC, mode=MODE, seed=args.seed,
                                points_to_evaluate=points or None)
        tune_config = tune.TuneConfig(search_alg=searcher, scheduler=scheduler, num_samples=args.num_samples,
                                      max_concurrent_trials=args.max_concurrent, reuse_actors=reuse_actors())
        param_space = {}
    return tune.Tuner(trainable, param_space=param_space, tune_config=tune_config, run_config=run_config), space_keys
