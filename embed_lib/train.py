"""Training on cached tensors: a seed group of one adapter configuration as one batched model.

Sixth stage of the data flow (... adapters -> **training** -> metrics). `prepare_study` turns an
embedded task (and, for the ce_margin target, held-out teacher scores) into tensors;
`train_seed_group` fits every seed of an `AdapterConfig` at once (parameters carry a seed dimension,
each seed its own initialisation and batch order), keeps each seed's best epoch on validation, and
evaluates validation and test once at the selected epochs. Deltas are against the frozen cosine.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
import torch
from scipy import stats

from embed_lib import losses
from embed_lib.adapters import NoveltyGate, PairAdapter
from embed_lib.cache import EmbeddedTask
from embed_lib.config import AdapterConfig
from embed_lib.metrics import PRIMARY_METRIC, cosine, evaluate
from embed_lib.signals import ce_margin, lexical_hard, per_sentence_mean, surface_complexity

EVAL_CHUNK = 8192
#: a split named "transfer:<task>" is another task's pairs, scored once at the end (do-no-harm checks)
TRANSFER_PREFIX = "transfer:"
#: reference sentences the novelty gate keeps (a seeded sample when the training split has more)
NOVELTY_REF_MAX = 20_000


@dataclass
class SplitTensors:
    ia: torch.Tensor  # (n,) rows of sentence a in StudyData.X
    ib: torch.Tensor
    y: torch.Tensor  # (n,) float32 in [0, 1]
    s0: np.ndarray  # (n,) frozen cosine
    pair_target: dict[str, np.ndarray] = field(default_factory=dict)  # target name -> (n,)


@dataclass
class StudyData:
    task: str
    binary: bool
    X: torch.Tensor  # (m, d) raw pooled vectors of the distinct sentences
    splits: dict[str, SplitTensors]
    sentence_target: dict[str, np.ndarray]  # target name -> (m,)
    manifest: dict[str, Any]
    split_notes: dict[str, str]
    _familiarity: torch.Tensor | None = field(default=None, repr=False)

    @property
    def targets(self) -> list[str]:
        return sorted(self.sentence_target)

    @property
    def transfer(self) -> list[str]:
        """Names of the transfer splits ("transfer:<task>")."""
        return sorted(k for k in self.splits if k.startswith(TRANSFER_PREFIX))

    @property
    def train_rows(self) -> torch.Tensor:
        """(r,) sorted rows of X that occur in a training pair."""
        tr = self.splits["train"]
        return torch.unique(torch.cat([tr.ia, tr.ib]))

    def familiarity(self) -> torch.Tensor:
        """(m,) max cosine of every sentence to the training sentences (of the novelty gate's reference set),
        leave-one-out for the training sentences themselves: how familiar a sentence never trained on looks."""
        if self._familiarity is None:
            ref_rows = novelty_reference_rows(self)
            ref = torch.nn.functional.normalize(self.X[ref_rows].float(), dim=-1)
            xn = torch.nn.functional.normalize(self.X.float(), dim=-1)
            out = torch.empty(len(xn))
            pos = torch.full((len(xn),), -1, dtype=torch.long)
            pos[ref_rows] = torch.arange(len(ref_rows))
            for i in range(0, len(xn), 4096):
                sims = xn[i: i + 4096] @ ref.T  # (chunk, r)
                own = pos[i: i + 4096]
                hit = own >= 0
                sims[hit.nonzero().squeeze(1), own[hit]] = -2.0  # leave one out
                out[i: i + 4096] = sims.amax(-1)
            self._familiarity = out
        return self._familiarity


def novelty_reference_rows(data: StudyData) -> torch.Tensor:
    """Rows of X the novelty gate compares with: the training sentences, a seeded sample of NOVELTY_REF_MAX."""
    rows = data.train_rows
    if len(rows) > NOVELTY_REF_MAX:
        g = torch.Generator().manual_seed(0)
        rows = torch.sort(rows[torch.randperm(len(rows), generator=g)[:NOVELTY_REF_MAX]]).values
    return rows


def novelty_gate(data: StudyData, quantile: float) -> NoveltyGate:
    """The gate closed below the `quantile` of the training sentences' leave-one-out familiarity and fully
    open from the (quantile + 0.25)-quantile on."""
    fam = data.familiarity()[data.train_rows]
    lo = float(torch.quantile(fam, quantile))
    hi = float(torch.quantile(fam, min(quantile + 0.25, 0.95)))
    return NoveltyGate(data.X[novelty_reference_rows(data)], lo, max(hi, lo + 1e-3))


def prepare_study(emb: EmbeddedTask, teacher_scores: Mapping[str, np.ndarray] | None = None,
                  surface_weights: Mapping[str, float] | None = None) -> StudyData:
    """Tensors and every available difficulty target (surface, lexical; ce_margin with teacher scores).

    Per-sentence aggregates of pair targets use train pairs only; other sentences get the train mean.
    """
    X = torch.from_numpy(np.ascontiguousarray(emb.vectors))
    m = len(emb.texts)
    surface = surface_complexity(emb.texts, surface_weights)
    splits: dict[str, SplitTensors] = {}
    for name, s in emb.splits.items():
        s0 = cosine(emb.vectors[s.ia], emb.vectors[s.ib])
        t = {"surface": (surface[s.ia] + surface[s.ib]) / 2,
             "lexical": lexical_hard(s.data.sentence1, s.data.sentence2, s.data.label)}
        if teacher_scores is not None and name in teacher_scores:
            if len(teacher_scores[name]) != len(s.ia):
                raise ValueError(f"teacher scores for split {name!r} have {len(teacher_scores[name])} rows; "
                                 f"the split has {len(s.ia)} pairs. Rebuild the teacher cache for this task.")
            t["ce_margin"] = ce_margin(np.asarray(teacher_scores[name]), s0)
        splits[name] = SplitTensors(torch.from_numpy(s.ia), torch.from_numpy(s.ib),
                                    torch.from_numpy(s.data.label.astype(np.float32)), s0, t)
    tr = emb.splits["train"]
    sentence_target = {"surface": surface}
    for name in ("lexical", "ce_margin"):
        if name in splits["train"].pair_target:
            sentence_target[name] = per_sentence_mean(tr.ia, tr.ib, splits["train"].pair_target[name], m)
    first = next(iter(emb.splits.values())).data
    return StudyData(emb.task, first.binary, X, splits, sentence_target, dict(emb.manifest),
                     {k: v.data.split_note for k, v in emb.splits.items()})


@dataclass
class GroupResult:
    config: AdapterConfig
    per_seed: list[dict[str, float]]  # each: val/..., test/..., delta_val, delta_test, best_epoch, gate fit
    baseline: dict[str, float]  # frozen cosine metrics, val/... and test/...
    history: list[dict[str, float]]  # per epoch: mean/min val delta over seeds
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


def _on_device(data: StudyData, dev: torch.device) -> StudyData:
    if data.X.device == dev:
        return data
    splits = {k: SplitTensors(s.ia.to(dev), s.ib.to(dev), s.y.to(dev), s.s0, s.pair_target) for k, s in data.splits.items()}
    fam = data.familiarity().to(dev) if data._familiarity is not None else None
    return StudyData(data.task, data.binary, data.X.to(dev), splits, data.sentence_target, data.manifest,
                     data.split_notes, fam)


def _spearman_rows(scores: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.array([stats.spearmanr(s, y).statistic for s in scores])


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    if np.std(a) < 1e-12 or np.std(b) < 1e-12:
        return float("nan")
    return float(stats.pearsonr(a, b).statistic)


@torch.no_grad()
def score_split(model: PairAdapter, X: torch.Tensor, sp: SplitTensors,
                familiarity: torch.Tensor | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Scores (S, n) and gate or mean complexity (S, n) or None, in chunks of pairs. familiarity: (m,) per
    sentence of X for the novelty gate (else the gate computes it)."""
    model.eval()
    S = len(model.seeds)
    scores, aux = [], []
    for i in range(0, len(sp.ia), EVAL_CHUNK):
        ia, ib = sp.ia[i: i + EVAL_CHUNK], sp.ib[i: i + EVAL_CHUNK]
        xa = X[ia].expand(S, -1, -1)  # (S, n, d), no copy
        xb = X[ib].expand(S, -1, -1)
        fam = {} if familiarity is None else dict(fam_a=familiarity[ia].expand(S, -1),
                                                  fam_b=familiarity[ib].expand(S, -1))
        out = model(xa, xb, **fam)
        scores.append(out.score)
        if out.gate is not None:
            aux.append(out.gate)
        elif out.c_a is not None:
            aux.append((out.c_a + out.c_b) / 2)
    model.train()
    return torch.cat(scores, 1).cpu().numpy(), (torch.cat(aux, 1).cpu().numpy() if aux else None)


def train_seed_group(cfg: AdapterConfig, data: StudyData,
                     on_epoch: Callable[[int, dict[str, float]], None] | None = None,
                     evaluate_test: bool = True, device: str | None = None) -> GroupResult:
    """Fit every seed of `cfg` as one batched model; see module docstring.

    on_epoch(epoch, {'val_delta_mean', 'val_delta_min', 'val_spearman_mean'}) is called after every
    epoch (Tune reports through it). evaluate_test=False leaves the test split untouched (sweeps select
    on validation and evaluate test once, for the winner).
    """
    if cfg.target not in ("none", *data.targets):
        raise ValueError(f"Difficulty target {cfg.target!r} is not available for this study; available: "
                         f"{data.targets} (ce_margin needs teacher scores).")
    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed0)
    seeds, S = cfg.seeds, cfg.n_seeds
    dev = torch.device(device or "cpu")
    data = _on_device(data, dev)
    X, tr, va = data.X, data.splits["train"], data.splits["validation"]
    d = X.shape[1]
    fam = gate = None
    if cfg.novelty_quantile > 0:
        gate = novelty_gate(data, cfg.novelty_quantile)
        fam = data.familiarity().to(dev)
    model = PairAdapter.from_config(cfg, d, novelty=gate).to(dev)
    params = list(model.parameters())
    center = None
    if cfg.loss == "logistic":
        center = torch.nn.Parameter(torch.full((S, 1), float(np.mean(tr.s0)), device=dev))
        params.append(center)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=True) if params else None

    n = len(tr.ia)
    gens = [torch.Generator().manual_seed(10_000 + s) for s in seeds]
    pair_t = sent_t = None
    if cfg.target != "none":
        pair_t = torch.from_numpy(tr.pair_target[cfg.target]).float().expand(S, -1).clone()  # (S, n)
        sent_t = torch.from_numpy(data.sentence_target[cfg.target]).float().to(dev)
        if cfg.control == "shuffled" and cfg.adapter == "pair_gated":
            # the shuffled-target control: same gate, targets permuted over the train pairs per seed
            pair_t = torch.stack([pair_t[k, torch.randperm(n, generator=g)] for k, g in enumerate(gens)])
        pair_t = pair_t.to(dev)
    supervise_gate = cfg.supervised and cfg.adapter == "pair_gated" and cfg.lambda_c > 0
    supervise_c = cfg.supervised and cfg.adapter.startswith("per_sentence") and cfg.lambda_c > 0
    y_val = va.y.cpu().numpy()
    base_val = float(stats.spearmanr(va.s0, y_val).statistic)

    best = {k: v.detach().clone() for k, v in model.state_dict().items()}
    best_val = np.full(S, -np.inf)
    best_epoch = np.zeros(S, dtype=int)
    history: list[dict[str, float]] = []
    steps = max(1, n // cfg.batch_size)  # drop the ragged last batch: CoSENT needs several pairs
    for epoch in range(1, cfg.epochs + 1 if opt is not None else 1):
        order = torch.stack([torch.randperm(n, generator=g) for g in gens]).to(dev)  # (S, n) each its own order
        for step in range(steps):
            idx = order[:, step * cfg.batch_size: (step + 1) * cfg.batch_size]  # (S, B)
            ia, ib, y = tr.ia[idx], tr.ib[idx], tr.y[idx]
            out = model(X[ia], X[ib], **({} if fam is None else dict(fam_a=fam[ia], fam_b=fam[ib])))  # (S, B, d)
            if cfg.loss == "cosent":
                loss = losses.cosent(out.score, y, cfg.tau)
            elif cfg.loss == "logistic":
                loss = losses.logistic(out.score, y, cfg.tau, center)
            else:
                loss = losses.mse(out.score, y)
            if supervise_gate:
                loss = loss + cfg.lambda_c * losses.mse(out.gate, torch.gather(pair_t, 1, idx))
            if supervise_c:
                loss = loss + cfg.lambda_c * 0.5 * (losses.mse(out.c_a, sent_t[ia]) + losses.mse(out.c_b, sent_t[ib]))
            if cfg.lambda_delta > 0 and cfg.adapter.startswith("pair") and cfg.gamma > 0:
                # / tau: CoSENT's gradients scale with 1/tau, so a weight near 1 balances the two terms
                loss = loss + cfg.lambda_delta / cfg.tau * losses.mse(out.score, out.s0) / cfg.gamma ** 2
            if cfg.lambda_mod > 0 and out.norm_a is not None:
                loss = loss + cfg.lambda_mod * losses.modulus(out.norm_a, out.norm_b, y)
            opt.zero_grad(set_to_none=True)
            loss.sum().backward()  # a sum keeps each seed's gradient its own
            opt.step()
        torch.manual_seed(cfg.seed0 + epoch)  # shuffled-c control: the same eval permutation for every run
        val_scores, _ = score_split(model, X, va, fam)
        val = _spearman_rows(val_scores, y_val)
        better = val > best_val
        if better.any():
            mask = torch.from_numpy(better).to(dev)
            for k, v in model.state_dict().items():
                if v.dim() > 0 and v.shape[0] == S:
                    best[k][mask] = v.detach()[mask]
            best_val[better], best_epoch[better] = val[better], epoch
        delta = val - base_val
        history.append({"epoch": epoch, "val_delta_mean": float(delta.mean()), "val_delta_min": float(delta.min()),
                        "val_spearman_mean": float(val.mean())})
        if on_epoch is not None:
            on_epoch(epoch, history[-1])
    if opt is not None:
        model.load_state_dict(best)

    torch.manual_seed(cfg.seed0 + 10_000)
    per_seed, baseline, ensemble = [[{} for _ in seeds], {}, {}]
    splits_out: dict[str, tuple[np.ndarray, np.ndarray | None]] = {}
    eval_splits = [("validation", "val")] + ([("test", "test")] if evaluate_test else [])
    if cfg.target != "none":  # train scores serve only the gate's fit to its target
        eval_splits.append(("train", "train"))
    eval_splits += [(t, t) for t in data.transfer]
    pairs_per_s = None
    for split, prefix in eval_splits:
        sp = data.splits[split]
        t_split = time.perf_counter()
        scores, aux = score_split(model, X, sp, fam)
        if split == "validation":  # the served ensemble's cost: every seed, cached vectors
            pairs_per_s = len(sp.ia) / max(time.perf_counter() - t_split, 1e-9)
        splits_out[split] = (scores, aux)
        y = sp.y.cpu().numpy()
        if split.startswith(TRANSFER_PREFIX):  # another task: Spearman of the seed against the frozen cosine
            base = float(stats.spearmanr(sp.s0, y).statistic)
            name = split[len(TRANSFER_PREFIX):]
            baseline[f"transfer/{name}/spearman"] = base
            for k, v in enumerate(_spearman_rows(scores, y)):
                per_seed[k][f"transfer/{name}/delta"] = float(v - base)
        elif split != "train":
            baseline.update(evaluate(sp.s0, y, data.binary, prefix))
            for k in range(S):
                thr_k = per_seed[k].get("val/threshold_acc") if split == "test" else None
                per_seed[k].update(evaluate(scores[k], y, data.binary, prefix, threshold=thr_k))
            # the served model: the mean score over the seed group
            ensemble.update(evaluate(scores.mean(0), y, data.binary, prefix))
    for k in range(S):
        r = per_seed[k]
        r["delta_val"] = r[f"val/{PRIMARY_METRIC}"] - baseline[f"val/{PRIMARY_METRIC}"]
        if evaluate_test:
            r["delta_test"] = r[f"test/{PRIMARY_METRIC}"] - baseline[f"test/{PRIMARY_METRIC}"]
        r["best_epoch"] = int(best_epoch[k])
        if cfg.target != "none" and splits_out["train"][1] is not None:
            for split, prefix in (("train", "train"), ("test", "test")):
                if split not in splits_out:
                    continue
                aux = splits_out[split][1][k]
                target = data.splits[split].pair_target[cfg.target]
                r[f"{prefix}/gate_fit"] = _pearson(aux, target)
        if cfg.learn_p:
            r["p"] = float(model.p[k].item())
    summary = summarize(per_seed)
    if gate is not None:
        summary.update({"novelty/lo": float(gate.bounds[0]), "novelty/hi": float(gate.bounds[1])})
    summary["pairs_per_s"] = float(pairs_per_s or 0.0)
    summary.update({f"ensemble/{k}": v for k, v in ensemble.items() if k.endswith(PRIMARY_METRIC)})
    return GroupResult(cfg, per_seed, baseline, history, summary,
                       {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                       time.perf_counter() - t0, model.n_parameters())


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
        out["transfer_delta_min"] = float(min(r[k] for r in per_seed for k in transfer))
    for key in ("val/spearman", "test/spearman", "train/gate_fit", "test/gate_fit"):
        values = np.array([r[key] for r in per_seed if key in r], dtype=float)
        if np.isfinite(values).any():  # a constant gate has no fit to report
            out[f"{key}_mean"] = float(np.nanmean(values))
    out["n_seeds"] = len(per_seed)
    return out
