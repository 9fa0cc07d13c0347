"""The served ensemble of a pair-form seed group, its per-seed MLPs fused for inference.

`ensemble_scores` (export.py) runs the training module: per seed, the residual MLP and the gate MLP as four
batched matmuls, the anchor in float64 once per seed, norms the training losses use. On a warm request of 32
pairs that is ~0.7 ms on one thread, mostly the per-op overhead of ~30 small torch calls around two ~10 MFLOP
matmuls. `FusedEnsemble` computes the same mean over seeds with the weights laid out once at load:

- the residual's and the gate's first layers side by side, one (S, 2 width, 2 hidden) matmul;
- their last layers (one output each) as one product and a sum per MLP (column 0 the residual, 1 the gate);
- the anchor once for the batch (a fixed p is the same for every seed), in float64 like `sim_p`;
- nothing the score does not use (the modulus term's norms), no autograd;
- only the matmul and the GELU in torch, the rest in numpy, whose calls on arrays this small cost a fraction of
  torch's (~0.55 against ~0.59 ms for 32 pairs, 5 seeds, width and hidden 128, on one thread here).

The same arithmetic in the same precision: the scores equal `ensemble_scores`'s to float32 rounding (tested for
every pair form and control, with and without the novelty gate). Forms without a pair residual (baseline,
per-sentence) keep `ensemble_scores`: `FusedEnsemble.supports(model)` says which.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from embed_lib.training.adapters import PairAdapter

FUSED_FORMS = ("pair_gated", "pair_ungated")


class FusedEnsemble:
    """Mean over seeds of a pair-form adapter's score, anchor and gate; see the module docstring."""

    def __init__(self, model: PairAdapter) -> None:
        if not self.supports(model):
            raise ValueError(f"FusedEnsemble serves the pair forms {FUSED_FORMS}; form {model.form!r} keeps "
                             "embed_lib.training.export.ensemble_scores.")
        with torch.no_grad():
            self.gated = model.form == "pair_gated" and model.control != "constant"
            self.constant_gate = model.form == "pair_gated" and model.control == "constant"
            mlps = [model.delta, model.gate] if self.gated else [model.delta]
            self.w_in = torch.cat([m.inner.weight for m in mlps], -1).contiguous()  # (S, 2 width, k hidden)
            self.b_in = torch.cat([m.inner.bias for m in mlps], -1).contiguous()  # (S, 1, k hidden)
            # the last layers, each one output: a product and a sum over its own hidden units (a (S, 2 hidden, 2)
            # block-diagonal matmul computes the same at 5x the time: matmuls this narrow are slow on CPU)
            self.w_out = torch.cat([m.outer.weight[..., 0] for m in mlps], -1).unsqueeze(1).contiguous()  # (S, 1, kH)
            self.b_out = torch.cat([m.outer.bias for m in mlps], -1).contiguous()  # (S, 1, k)
            self.k = len(mlps)
            self.p_np = model.p.detach().double().numpy().copy()  # scalar (fixed) or (S, 1) (learned)
            self.gamma = float(model.gamma)
            self.novelty = None if model.novelty is None else model.novelty.bounds.tolist()

    @staticmethod
    def supports(model: PairAdapter) -> bool:
        return model.form in FUSED_FORMS

    @torch.inference_mode()
    def scores(self, xa: np.ndarray, xb: np.ndarray, ha: np.ndarray, hb: np.ndarray) -> dict[str, np.ndarray]:
        """xa, xb (n, d) raw vectors; ha, hb (S, n, width [+ 1]) their `project`ions -> {'score', 'baseline',
        'difficulty', 'novelty'} (n,) each, as `ensemble_scores` returns them."""
        s0 = self.anchor(xa, xb)  # (n,), or (S, n) for a learned p
        ha, hb = np.asarray(ha, np.float32), np.asarray(hb, np.float32)
        w = None
        if self.novelty is not None:  # the familiarity travels as the projection's last column
            lo, hi = self.novelty
            w = np.clip((np.minimum(ha[..., -1], hb[..., -1]) - lo) / np.float32(hi - lo), 0.0, 1.0)
            ha, hb = ha[..., :-1], hb[..., :-1]
        S, n, width = ha.shape
        phi = np.empty((S, n, 2 * width), np.float32)  # [|a - b|, a * b]
        np.subtract(ha, hb, out=phi[..., :width])
        np.abs(phi[..., :width], out=phi[..., :width])
        np.multiply(ha, hb, out=phi[..., width:])
        z = F.gelu(torch.baddbmm(self.b_in, torch.from_numpy(phi), self.w_in)).view(S, n, self.k, -1)
        out = z.mul_(self.w_out.view(S, 1, self.k, -1)).sum(-1) + self.b_out  # (S, n, k)
        step = self.gamma * torch.tanh(out[..., 0]).numpy()  # (S, n)
        if w is not None:
            step = step * w
        gate = torch.sigmoid(out[..., 1]).numpy() if self.gated else None
        if gate is not None:
            step = gate * step
        elif self.constant_gate:
            step = 0.5 * step
        # one anchor for every seed: added once to the mean residual, so a zero residual gives the anchor exactly
        score, baseline = ((s0 + step).mean(0), s0.mean(0)) if s0.ndim == 2 else (s0 + step.mean(0), s0)
        difficulty = (gate.mean(0) if gate is not None else
                      np.full(n, 0.5, np.float32) if self.constant_gate else np.full(n, np.nan, np.float32))
        return {"score": score.astype(np.float32, copy=False), "baseline": baseline.astype(np.float32, copy=False),
                "difficulty": difficulty.astype(np.float32, copy=False),
                "novelty": w.mean(0) if w is not None else np.ones(n, np.float32)}

    def anchor(self, xa: np.ndarray, xb: np.ndarray) -> np.ndarray:
        """`sim_p` of the raw vectors in numpy: float64, then float32; at p = 1 `metrics.cosine` to the bit."""
        a, b = np.asarray(xa, np.float64), np.asarray(xb, np.float64)
        na = np.maximum(np.linalg.norm(a, axis=1), 1e-8)
        nb = np.maximum(np.linalg.norm(b, axis=1), 1e-8)
        return ((a * b).sum(axis=1) / (na ** self.p_np * nb ** self.p_np)).astype(np.float32)
