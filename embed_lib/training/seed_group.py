"""Training on cached tensors: a seed group of one adapter configuration as one batched model.

Sixth stage of the data flow (... adapters -> **training** -> metrics). `train_seed_group` fits every
seed of an `AdapterConfig` at once on a `StudyData` (embed_lib.training.tensors): parameters carry a seed
dimension, each seed its own initialisation and batch order, drawn from its own `torch.Generator`
(nothing reseeds torch's global generator). It keeps each seed's best epoch on validation and evaluates
validation, test and the transfer splits once at the selected epochs (and, for a sweep's trials, the transfer
pairs after every epoch: `scoring.TransferWatch`). Deltas are against the frozen cosine.

Distillation (`AdapterConfig.lambda_distil` > 0): every step's loss mixes the task loss on the labels with CoSENT on
the teacher's held-out scores of the same batch, and, with `silver_fraction` > 0, of a batch of the study's silver
pairs drawn beside it (each seed its own order of them); the shuffled-teacher control permutes those scores per seed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from scipy import stats

from embed_lib.config import AdapterConfig
from embed_lib.training import losses
from embed_lib.training.adapters import PairAdapter
from embed_lib.training.distil import distil_targets, silver_batch, silver_order
from embed_lib.training.metrics import PRIMARY_METRIC, evaluate
from embed_lib.training.scoring import TransferWatch, score_split, spearman_rows
from embed_lib.training.tensors import SplitTensors, StudyData, novelty_gate


@dataclass
class GroupResult:
    config: AdapterConfig
    per_seed: list[dict[str, float]]  # each: val/..., test/..., delta_val, delta_test, best_epoch, gate fit
    baseline: dict[str, float]  # frozen cosine metrics, val/... and test/...
    history: list[dict[str, float]]  # per epoch: epoch/delta_val_mean, epoch/delta_val_min over seeds
    summary: dict[str, float]
    state_dict: dict[str, torch.Tensor]
    seconds: float
    n_parameters: int

    def table(self) -> str:
        rows = ["| seed | best epoch | val baseline | val adapter | val delta | test baseline | test adapter | test delta |",
                "|---|---|---|---|---|---|---|---|"]
        b = self.baseline
        for seed, r in zip(self.config.seeds, self.per_seed):
            if "delta_test" not in r:
                rows.append(f"| {seed} | {r['best_epoch']} | {b['val/spearman']:.4f} | {r['val/spearman']:.4f} | "
                            f"{r['delta_val']:+.4f} | | | |")
                continue
            rows.append(f"| {seed} | {r['best_epoch']} | {b['val/spearman']:.4f} | {r['val/spearman']:.4f} | "
                        f"{r['delta_val']:+.4f} | {b['test/spearman']:.4f} | {r['test/spearman']:.4f} | "
                        f"{r['delta_test']:+.4f} |")
        return "\n".join(rows)


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    if np.std(a) < 1e-12 or np.std(b) < 1e-12:
        return float("nan")
    return float(stats.pearsonr(a, b).statistic)


@dataclass
class _Fit:
    """A seed group being trained: the model and what its loss reads besides the batch."""
    model: PairAdapter
    opt: torch.optim.Optimizer | None
    center: torch.nn.Parameter | None  # the logistic loss's learned midpoint, per seed
    fam: torch.Tensor | None  # (m,) familiarity of every sentence for the novelty gate: leave-one-out, for training
    served_fam: torch.Tensor | None  # (m,) the gate's own, for scoring every other split as the service scores it
    pair_t: torch.Tensor | None  # (S, n) difficulty target of each train pair (permuted per seed: shuffled control)
    sent_t: torch.Tensor | None  # (m,) per-sentence difficulty target
    gens: list[torch.Generator]  # one per seed: batch order and the shuffled control's permutation
    teach: torch.Tensor | None = None  # (S, n) the teacher's score of each train pair (permuted per seed: shuffled)
    silver: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # silver rows a, b (n_s,), teacher (S, n_s)


def _build(cfg: AdapterConfig, data: StudyData, dev: torch.device) -> _Fit:
    fam = served_fam = gate = None
    if cfg.novelty_quantile > 0:
        gate = novelty_gate(data, cfg.novelty_quantile)
        fam, served_fam = data.familiarity().to(dev), data.familiarity(served=True).to(dev)
    model = PairAdapter.from_config(cfg, data.X.shape[1], novelty=gate).to(dev)
    # the shuffled-c control permutes c within each evaluation batch: its own generator, reset per epoch
    model.shuffle_generator = torch.Generator().manual_seed(cfg.seed0)
    params = list(model.parameters())
    tr, S = data.splits["train"], cfg.n_seeds
    center = None
    if cfg.loss == "logistic":
        center = torch.nn.Parameter(torch.full((S, 1), float(np.mean(tr.s0)), device=dev))
        params.append(center)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=True) if params else None
    n = len(tr.ia)
    gens = [torch.Generator().manual_seed(10_000 + s) for s in cfg.seeds]
    pair_t = sent_t = None
    if cfg.target != "none":
        pair_t = torch.from_numpy(tr.pair_target[cfg.target]).float().expand(S, -1).clone()  # (S, n)
        sent_t = torch.from_numpy(data.sentence_target[cfg.target]).float().to(dev)
        if cfg.control == "shuffled" and cfg.adapter == "pair_gated":
            # the shuffled-target control: same gate, targets permuted over the train pairs per seed
            pair_t = torch.stack([pair_t[k, torch.randperm(n, generator=g)] for k, g in enumerate(gens)])
        pair_t = pair_t.to(dev)
    teach, silver = distil_targets(cfg, data, dev) if cfg.distilled else (None, None)
    return _Fit(model, opt, center, fam, served_fam, pair_t, sent_t, gens, teach, silver)


def _loss(cfg: AdapterConfig, fit: _Fit, out, y: torch.Tensor, idx: torch.Tensor, ia: torch.Tensor,
          ib: torch.Tensor, silver: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """(S,) the objective of each seed on one batch: ranking loss plus the configured auxiliary terms.
    silver: (scores (S, Bs), teacher scores (S, Bs)) of the batch's silver pairs, when it has some."""
    if cfg.loss == "cosent":
        loss = losses.cosent(out.score, y, cfg.tau)
    elif cfg.loss == "logistic":
        loss = losses.logistic(out.score, y, cfg.tau, fit.center)
    else:
        loss = losses.mse(out.score, y)
    if cfg.distilled:
        # the teacher's ranking of the labelled and the silver pairs together: one CoSENT over the whole batch
        s, t = out.score, torch.gather(fit.teach, 1, idx)
        if silver is not None:
            s, t = torch.cat([s, silver[0]], dim=1), torch.cat([t, silver[1]], dim=1)
        loss = (1 - cfg.lambda_distil) * loss + cfg.lambda_distil * losses.cosent(s, t, cfg.tau)
    if cfg.lambda_c > 0 and cfg.supervised:
        if cfg.adapter == "pair_gated":
            loss = loss + cfg.lambda_c * losses.mse(out.gate, torch.gather(fit.pair_t, 1, idx))
        elif cfg.adapter.startswith("per_sentence"):
            loss = loss + cfg.lambda_c * 0.5 * (losses.mse(out.c_a, fit.sent_t[ia]) + losses.mse(out.c_b, fit.sent_t[ib]))
    if cfg.lambda_delta > 0 and cfg.adapter.startswith("pair") and cfg.gamma > 0:
        # / tau: CoSENT's gradients scale with 1/tau, so a weight near 1 balances the two terms
        loss = loss + cfg.lambda_delta / cfg.tau * losses.mse(out.score, out.s0) / cfg.gamma ** 2
    if cfg.lambda_mod > 0 and out.norm_a is not None:
        loss = loss + cfg.lambda_mod * losses.modulus(out.norm_a, out.norm_b, y)
    return loss


def _train_epochs(cfg: AdapterConfig, data: StudyData, fit: _Fit,
                  on_epoch: Callable[[int, dict[str, float]], None] | None,
                  watch: TransferWatch | None = None) -> tuple[list[dict[str, float]], np.ndarray]:
    """The training loop; leaves every seed at its best validation epoch. Returns (history, best epochs).
    watch: the transfer checks each epoch's record adds (`TransferWatch.epoch_record`)."""
    model, X, tr, va, S = fit.model, data.X, data.splits["train"], data.splits["validation"], cfg.n_seeds
    dev = X.device
    y_val = va.y.cpu().numpy()
    base_val = float(stats.spearmanr(va.s0, y_val).statistic)
    best = {k: v.detach().clone() for k, v in model.state_dict().items()}
    best_val, best_epoch = np.full(S, -np.inf), np.zeros(S, dtype=int)
    history: list[dict[str, float]] = []
    n = len(tr.ia)
    steps = max(1, n // cfg.batch_size)  # drop the ragged last batch: CoSENT needs several pairs
    for epoch in range(1, cfg.epochs + 1 if fit.opt is not None else 1):
        order = torch.stack([torch.randperm(n, generator=g) for g in fit.gens]).to(dev)  # (S, n) each its own order
        # the silver pairs in each seed's own order, a batch of them beside every batch
        s_order = silver_order(fit.silver, fit.gens)
        for step in range(steps):
            idx = order[:, step * cfg.batch_size: (step + 1) * cfg.batch_size]  # (S, B)
            ia, ib = tr.ia[idx], tr.ib[idx]
            out = model(X[ia], X[ib], **({} if fit.fam is None else dict(fam_a=fit.fam[ia], fam_b=fit.fam[ib])))
            silver = None if s_order is None else silver_batch(model, X, fit.silver, fit.fam, s_order, step,
                                                               cfg.batch_size)
            loss = _loss(cfg, fit, out, tr.y[idx], idx, ia, ib, silver)
            fit.opt.zero_grad(set_to_none=True)
            loss.sum().backward()  # a sum keeps each seed's gradient its own
            fit.opt.step()
        model.shuffle_generator.manual_seed(cfg.seed0 + epoch)  # shuffled-c control: one eval permutation per epoch
        val = spearman_rows(score_split(model, X, va, fit.served_fam)[0], y_val)
        better = val > best_val
        if better.any():
            mask = torch.from_numpy(better).to(dev)
            for k, v in model.state_dict().items():
                if v.dim() > 0 and v.shape[0] == S:
                    best[k][mask] = v.detach()[mask]
            best_val[better], best_epoch[better] = val[better], epoch
        delta = val - base_val
        history.append({"epoch": epoch, "epoch/delta_val_mean": float(delta.mean()),
                        "epoch/delta_val_min": float(delta.min()), "epoch/val_spearman_mean": float(val.mean())})
        if watch is not None:
            history[-1].update(watch.epoch_record(model))
        if on_epoch is not None:
            on_epoch(epoch, history[-1])
    if fit.opt is not None:
        model.load_state_dict(best)
    return history, best_epoch


def _evaluate(cfg: AdapterConfig, data: StudyData, fit: _Fit, evaluate_test: bool, watch: TransferWatch):
    """Score validation (test, train for the gate's fit, transfer splits) once with the selected weights.
    Returns (per seed metrics, frozen-cosine metrics, ensemble metrics, aux per split, pairs/s)."""
    model, S = fit.model, cfg.n_seeds
    model.shuffle_generator.manual_seed(cfg.seed0 + 10_000)
    per_seed: list[dict[str, float]] = [{} for _ in range(S)]
    baseline: dict[str, float] = {}
    ensemble: dict[str, float] = {}
    aux_out: dict[str, np.ndarray | None] = {}
    eval_splits = [("validation", "val")] + ([("test", "test")] if evaluate_test else [])
    if cfg.target != "none":  # train scores serve only the gate's fit to its target
        eval_splits.append(("train", "train"))
    pairs_per_s = 0.0
    for split, prefix in eval_splits:
        sp = data.splits[split]
        t_split = time.perf_counter()
        # train as trained (leave-one-out), every other split as served: a sentence also in train its own neighbour
        scores, aux_out[split] = score_split(model, data.X, sp, fit.fam if split == "train" else fit.served_fam)
        if split == "validation":  # the served ensemble's cost: every seed, cached vectors
            pairs_per_s = len(sp.ia) / max(time.perf_counter() - t_split, 1e-9)
        y = sp.y.cpu().numpy()
        if split != "train":
            baseline.update(evaluate(sp.s0, y, data.binary, prefix))
            for k in range(S):
                thr_k = per_seed[k].get("val/threshold_acc") if split == "test" else None
                per_seed[k].update(evaluate(scores[k], y, data.binary, prefix, threshold=thr_k))
            # the served model: the mean score over the seed group
            ensemble.update(evaluate(scores.mean(0), y, data.binary, prefix))
    for name, deltas in watch.deltas(model).items():  # another task's pairs: each seed against the frozen cosine
        baseline[f"transfer/{name}/spearman"] = watch.baseline[name]
        for k, d in enumerate(deltas):
            per_seed[k][f"transfer/{name}/delta"] = float(d)
    for name, check in data.retrieval_checks().items():  # a duplicate-question set's frozen top-k, re-ranked
        rows = [torch.from_numpy(r).to(data.X.device) for r in check.pairs()]
        scores, _ = score_split(model, data.X, SplitTensors(*rows, None, None), fit.served_fam)
        baseline[f"transfer/{name}-retrieval/ndcg@10"] = check.baseline_ndcg
        for k, delta in enumerate(check.deltas(scores)):
            per_seed[k][f"transfer/{name}-retrieval/delta"] = delta
    return per_seed, baseline, ensemble, aux_out, pairs_per_s


def train_seed_group(cfg: AdapterConfig, data: StudyData,
                     on_epoch: Callable[[int, dict[str, float]], None] | None = None,
                     evaluate_test: bool = True, device: str | None = None,
                     epoch_transfer: bool = False) -> GroupResult:
    """Fit every seed of `cfg` as one batched model; see module docstring.

    on_epoch(epoch, {'epoch/delta_val_mean', 'epoch/delta_val_min', 'epoch/val_spearman_mean'}) is called after every
    epoch (Tune reports through it). evaluate_test=False leaves the test split untouched (sweeps select
    on validation and evaluate test once, for the winner). epoch_transfer=True adds each epoch's transfer deltas
    to that record (`scoring.TransferWatch.epoch_record`: the sweeps' trials rank by the winner rule while they train);
    the weights trained and every figure of the result are the same either way.
    """
    if not isinstance(cfg, AdapterConfig) or not isinstance(data, StudyData):
        raise TypeError(f"train_seed_group(cfg, data) takes an AdapterConfig (AdapterConfig.from_dict for a dict) and "
                        f"a StudyData (load_study); got {type(cfg).__name__} and {type(data).__name__}.")
    if cfg.distilled and data.splits["train"].teacher is None:
        raise ValueError(f"AdapterConfig.lambda_distil={cfg.lambda_distil}: this study has no teacher scores to "
                         "distil; load it with a teacher (load_study(teacher=...); the commands' --teacher) or set "
                         "lambda_distil=0.")
    if cfg.target not in ("none", *data.targets):
        fix = "load the study with a teacher" if cfg.supervised else f"{cfg.adapter} learns none: set target='none'"
        raise ValueError(f"Difficulty target {cfg.target!r} is not available for this study; available: "
                         f"{data.targets} (ce_margin needs teacher scores: {fix}).")
    t0 = time.perf_counter()
    data = data.to(torch.device(device or "cpu"))
    fit = _build(cfg, data, data.X.device)
    watch = TransferWatch(data, fit.served_fam)  # the transfer pairs as served, their frozen-cosine baselines once
    history, best_epoch = _train_epochs(cfg, data, fit, on_epoch, watch if epoch_transfer and data.transfer else None)
    per_seed, baseline, ensemble, aux, pairs_per_s = _evaluate(cfg, data, fit, evaluate_test, watch)
    for k, r in enumerate(per_seed):
        r["delta_val"] = r[f"val/{PRIMARY_METRIC}"] - baseline[f"val/{PRIMARY_METRIC}"]
        if evaluate_test:
            r["delta_test"] = r[f"test/{PRIMARY_METRIC}"] - baseline[f"test/{PRIMARY_METRIC}"]
        r["best_epoch"] = int(best_epoch[k])
        if cfg.target != "none" and aux.get("train") is not None:
            for split, prefix in (("train", "train"), ("test", "test")):
                if split in aux:
                    r[f"{prefix}/gate_fit"] = _pearson(aux[split][k], data.splits[split].pair_target[cfg.target])
        if cfg.learn_p:
            r["p"] = float(fit.model.p[k].item())
    summary = summarize(per_seed)
    if fit.model.novelty is not None:
        summary.update({"novelty/lo": float(fit.model.novelty.bounds[0]), "novelty/hi": float(fit.model.novelty.bounds[1])})
    summary["pairs_per_s"] = float(pairs_per_s)
    summary.update({f"ensemble/{k}": v for k, v in ensemble.items() if k.endswith(PRIMARY_METRIC)})
    return GroupResult(cfg, per_seed, baseline, history, summary,
                       {k: v.detach().cpu().clone() for k, v in fit.model.state_dict().items()},
                       time.perf_counter() - t0, fit.model.n_parameters())


def summarize(per_seed: list[dict[str, float]]) -> dict[str, float]:
    """mean / std / min / count positive of the per-seed deltas, and mean gate fit."""
    out: dict[str, float] = {}
    for key in ("delta_val", "delta_test"):
        if key not in per_seed[0]:
            continue
        v = np.array([r[key] for r in per_seed])
        out.update({f"{key}_mean": float(v.mean()), f"{key}_std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
                    f"{key}_min": float(v.min()), f"{key}_positive": int((v > 0).sum())})
    transfer = sorted(k for k in per_seed[0] if k.startswith("transfer/"))
    for key in transfer:
        v = np.array([r[key] for r in per_seed])
        out.update({f"{key}_mean": float(v.mean()), f"{key}_min": float(v.min())})
    if transfer:  # the do-no-harm check reads this: the worst transfer delta of any seed on any other task
        # np.min: a NaN check (too few pairs, constant labels) makes the minimum NaN, which the rule refuses;
        # Python's min would keep or drop it depending on where it falls
        out["transfer_delta_min"] = float(np.min([r[k] for r in per_seed for k in transfer]))
    for key in ("val/spearman", "test/spearman", "train/gate_fit", "test/gate_fit"):
        values = np.array([r[key] for r in per_seed if key in r], dtype=float)
        if np.isfinite(values).any():  # a constant gate has no fit to report
            out[f"{key}_mean"] = float(np.nanmean(values))
    out["n_seeds"] = len(per_seed)
    return out
