"""Adapters: pair scorers over cached frozen vectors, one independent model per seed, batched.

Fifth stage of the data flow (... signals -> **adapters** -> training). Every parameter carries a
leading seed dimension S, so a seed group trains as one model: inputs are (S, B, d) (each seed its
own batch order), scores (S, B). Seeds never share parameters or gradients.

Forms (DESIGN.md sections 2, 4, 5), all reproducing the anchor s0 exactly at initialisation
(zero-initialised last layers) and symmetric in (a, b):
- anchor s0 = s_p(x_a, x_b) = x_a.x_b / (|x_a|^p |x_b|^p); p = 1 is the cosine, fixed or learned
  (p = sigmoid(p_hat)), one p for both sides (the four tasks are symmetric);
- "baseline": s = s0;
- "pair_ungated": s = s0 + gamma * tanh(MLP_d(phi)), phi = [|h_a - h_b|, h_a * h_b],
  h = LayerNorm(W x + b);
- "pair_gated": s = s0 + gamma * g * tanh(MLP_d(phi)), g = sigmoid(MLP_g(phi)) supervised towards a
  difficulty target; control "constant": g = 1/2. By default the score uses g as a fixed weight (no task
  gradient reaches MLP_g: it learns its target only); `gate_task_grad=True` trains it jointly;
- "per_sentence" (DESIGN.md section 2, as the reference study defines it): h = LayerNorm(W x + b) in the
  embedding's own dimension d, c = sigmoid(MLP_c(h)), alpha = 1 + alpha0 * tanh(G([h, c])) a vector over
  the d working dimensions, u = normalize(alpha * h), s = cos(u_a, u_b). It starts from cos(h_a, h_b),
  not from the frozen cosine: the working representation is trained from scratch, which is why this form
  can fall below the baseline. "per_sentence_preserving" mixes with the baseline vector,
  w = normalize((1 - gamma) normalize(x) + gamma u), and scores cos(w_a, w_b). Controls replace c:
  "h_only" (c input zeroed), "constant" (c = 1/2), "global" (one learned c per seed), "shuffled"
  (c permuted within the batch).

Anchoring away from the training data (pair forms, optional): a novelty gate multiplies the residual by
w_nov = clip((min(f_a, f_b) - lo) / (hi - lo), 0, 1), f(x) = max cosine of x to the training sentences
(`NoveltyGate`). A pair with a sentence less familiar than `lo` gets the frozen score s0 exactly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from embed_lib.config import CONTROLS, FORMS


class SeedLinear(nn.Module):
    """S independent affine maps (S, B, i) -> (S, B, o), each initialised from its own seed like nn.Linear."""

    def __init__(self, seeds: list[int], d_in: int, d_out: int, zero: bool = False) -> None:
        super().__init__()
        bound = 1.0 / math.sqrt(d_in)
        w, b = [], []
        for seed in seeds:
            g = torch.Generator().manual_seed(seed)
            w.append(torch.empty(d_in, d_out).uniform_(-bound, bound, generator=g))
            b.append(torch.empty(1, d_out).uniform_(-bound, bound, generator=g))
        self.weight = nn.Parameter(torch.zeros(len(seeds), d_in, d_out) if zero else torch.stack(w))
        self.bias = nn.Parameter(torch.zeros(len(seeds), 1, d_out) if zero else torch.stack(b))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.baddbmm(self.bias, x, self.weight)


class SeedMLP(nn.Module):
    """Linear -> GELU -> Linear per seed; the last layer zero-initialised (the MLP outputs 0 at init)."""

    def __init__(self, seeds: list[int], d_in: int, hidden: int, d_out: int) -> None:
        super().__init__()
        self.inner = SeedLinear([s * 7919 + 1 for s in seeds], d_in, hidden)
        self.outer = SeedLinear(seeds, hidden, d_out, zero=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(F.gelu(self.inner(x)))


class SeedLayerNorm(nn.Module):
    def __init__(self, n_seeds: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n_seeds, 1, dim))
        self.bias = nn.Parameter(torch.zeros(n_seeds, 1, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:]) * self.weight + self.bias


def sim_p(a: torch.Tensor, b: torch.Tensor, p: torch.Tensor | float) -> torch.Tensor:
    """a.b / (|a|^p |b|^p) over the last dim; (..., d) -> (...). p = 1: cosine; p = 0: dot product.

    Computed in float64 and returned in a's dtype, like `metrics.cosine`: float32 rounding noise would
    otherwise depend on the batch's shape and the library, and break exact ties (a sentence with itself,
    a pair asked twice) differently here and in the study's frozen cosine, moving Spearman by ~1e-4."""
    S = a.shape[0] if a.dim() == 3 and a.stride(0) == 0 and b.dim() == 3 and b.stride(0) == 0 else None
    if S is not None:  # one batch seen by every seed (an expanded view, as in scoring): the work once, not S times
        a, b = a[0], b[0]
    a64, b64 = a.double(), b.double()
    na = a64.norm(dim=-1).clamp_min(1e-8)
    nb = b64.norm(dim=-1).clamp_min(1e-8)
    out = ((a64 * b64).sum(-1) / (na.pow(p) * nb.pow(p))).to(a.dtype)  # p (S, 1) broadcasts to (S, B)
    return out.expand(S, -1) if S is not None and out.dim() == 1 else out


class NoveltyGate(nn.Module):
    """Familiarity of a sentence, f(x) = max_r cos(x, r) over reference (training) sentence vectors, and the
    pair weight w = clip((min(f_a, f_b) - lo) / (hi - lo), 0, 1). No trainable parameters: lo and hi are
    quantiles of the training sentences' leave-one-out familiarity (see `embed_lib.training.tensors`)."""

    def __init__(self, ref: torch.Tensor, lo: float, hi: float) -> None:
        super().__init__()
        if ref.dim() != 2 or ref.shape[0] < 1:
            raise ValueError(f"NoveltyGate needs reference vectors of shape (R, d), R >= 1; got {tuple(ref.shape)}.")
        if not hi > lo:
            raise ValueError(f"NoveltyGate needs hi > lo; got lo={lo}, hi={hi}.")
        self.register_buffer("ref", F.normalize(ref.float(), dim=-1))  # (R, d)
        self.register_buffer("bounds", torch.tensor([float(lo), float(hi)]))

    def familiarity(self, x: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
        """(n, d) -> (n,) max cosine to the reference sentences."""
        xn = F.normalize(x.float(), dim=-1)
        return torch.cat([(xn[i: i + chunk] @ self.ref.T).amax(-1) for i in range(0, len(xn), chunk)]) if len(xn) \
            else xn.new_zeros(0)

    def weight(self, fa: torch.Tensor, fb: torch.Tensor) -> torch.Tensor:
        lo, hi = self.bounds[0], self.bounds[1]
        return ((torch.minimum(fa, fb) - lo) / (hi - lo)).clamp(0.0, 1.0)


@dataclass
class AdapterOutput:
    score: torch.Tensor  # (S, B)
    s0: torch.Tensor  # (S, B) the anchor
    gate: torch.Tensor | None = None  # (S, B) pair gate g
    c_a: torch.Tensor | None = None  # (S, B) per-sentence complexity of a
    c_b: torch.Tensor | None = None
    norm_a: torch.Tensor | None = None  # (S, B) pre-normalisation norms for the modulus term
    norm_b: torch.Tensor | None = None
    novelty: torch.Tensor | None = None  # (S, B) novelty-gate weight w_nov (1: familiar pair)


class PairAdapter(nn.Module):
    """One adapter form for a seed group (see module docstring)."""

    def __init__(self, form: str, dim: int, seeds: list[int], *, control: str = "none", width: int = 128,
                 hidden: int = 128, gamma: float = 0.1, alpha0: float = 0.5, p: float = 1.0,
                 learn_p: bool = False, novelty: NoveltyGate | None = None, gate_task_grad: bool = False) -> None:
        super().__init__()
        if form not in FORMS:
            raise ValueError(f"Unknown adapter form {form!r}. Valid forms: {list(FORMS)}.")
        if control not in CONTROLS[form]:
            raise ValueError(f"Control {control!r} does not apply to form {form!r}. Valid: {list(CONTROLS[form])}.")
        self.form, self.control, self.gamma, self.alpha0 = form, control, gamma, alpha0
        self.gate_task_grad = gate_task_grad
        self.seeds, S = list(seeds), len(seeds)
        self.learn_p = learn_p
        if learn_p:
            p0 = min(max(p, 1e-3), 1 - 1e-3)
            self.p_hat = nn.Parameter(torch.full((S, 1), math.log(p0 / (1 - p0))))
        else:
            self.register_buffer("p_fixed", torch.tensor(float(p)))
        if novelty is not None and not form.startswith("pair"):
            raise ValueError(f"The novelty gate applies to the pair forms; form {form!r} has no residual to close.")
        self.novelty = novelty
        #: random source of the shuffled-c control's permutation (set by the trainer, per epoch)
        self.shuffle_generator: torch.Generator | None = None
        if form == "baseline":
            return
        if form.startswith("per_sentence"):
            width = dim  # the preserving mix adds u to the baseline vector: the same space
        self.width = width
        self.proj = SeedLinear([s * 104729 + 3 for s in seeds], dim, width)
        self.norm = SeedLayerNorm(S, width)
        if form.startswith("pair"):
            self.delta = SeedMLP(seeds, 2 * width, hidden, 1)
            if form == "pair_gated" and control != "constant":
                # gate starts at sigmoid(0) = 1/2 like the constant control; its input layer differs per seed
                self.gate = SeedMLP([s * 31 + 5 for s in seeds], 2 * width, hidden, 1)
        else:
            if control == "none" or control == "shuffled":
                self.c_net = SeedMLP([s * 31 + 5 for s in seeds], width, hidden, 1)
            if control == "global":
                self.c_global = nn.Parameter(torch.zeros(S, 1, 1))
            self.scale = SeedLinear(seeds, width + 1, dim, zero=True)

    @classmethod
    def from_config(cls, cfg, dim: int, novelty: NoveltyGate | None = None) -> "PairAdapter":
        """The adapter an `AdapterConfig` describes, over `dim`-dimensional vectors."""
        return cls(cfg.adapter, dim, cfg.seeds, control=cfg.control, width=cfg.width, hidden=cfg.hidden,
                   gamma=cfg.gamma, alpha0=cfg.alpha0, p=cfg.p, learn_p=cfg.learn_p, novelty=novelty,
                   gate_task_grad=cfg.gate_task_grad)

    @property
    def p(self) -> torch.Tensor:
        """(S, 1) or scalar normalisation exponent."""
        return torch.sigmoid(self.p_hat) if self.learn_p else self.p_fixed

    def working(self, x: torch.Tensor) -> torch.Tensor:
        """What a pair's score needs of each sentence beyond its vector: h = LayerNorm(W x + b), and with a
        novelty gate its familiarity as one more column; (S, B, d) -> (S, B, width [+ 1])."""
        h = self.norm(self.proj(x))
        if self.novelty is None:
            return h
        fam = self.novelty.familiarity(x[0])  # the same vectors for every seed: computed once
        return torch.cat([h, fam.view(1, -1, 1).expand(h.shape[0], -1, 1)], dim=-1)

    def _split(self, h: torch.Tensor, fam: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.novelty is not None and h.shape[-1] == self.width + 1:
            return h[..., :-1], (h[..., -1] if fam is None else fam)
        return h, fam

    def forward(self, xa: torch.Tensor, xb: torch.Tensor, ha: torch.Tensor | None = None,
                hb: torch.Tensor | None = None, fam_a: torch.Tensor | None = None,
                fam_b: torch.Tensor | None = None) -> AdapterOutput:
        """xa, xb: (S, B, d) raw pooled vectors -> scores (S, B). ha, hb: `working(x)` where the caller keeps it
        per sentence (a serving cache); else computed. fam_a, fam_b: (S, B) familiarity for the novelty gate
        where the caller has it (training passes the leave-one-out values of training sentences)."""
        s0 = sim_p(xa, xb, self.p)
        if self.form == "baseline":
            return AdapterOutput(s0, s0)
        if ha is None or hb is None:
            B = xa.shape[1]
            h = self.norm(self.proj(torch.cat([xa, xb], dim=1)))  # one projection for both sides: (S, 2B, width)
            ha, hb = h[:, :B], h[:, B:]  # familiarity, when not given, is searched below, in the pair branch
        ha, fam_a = self._split(ha, fam_a)
        hb, fam_b = self._split(hb, fam_b)
        if self.form.startswith("pair"):
            phi = torch.cat([(ha - hb).abs(), ha * hb], dim=-1)  # (S, B, 2 width), symmetric in a, b
            step = self.gamma * torch.tanh(self.delta(phi)).squeeze(-1)
            w = None
            if self.novelty is not None:
                if fam_a is None or fam_b is None:
                    fam_a, fam_b = (self.novelty.familiarity(x[0]).expand(x.shape[0], -1) for x in (xa, xb))
                w = self.novelty.weight(fam_a, fam_b)
                step = step * w
            norms = dict(norm_a=ha.norm(dim=-1), norm_b=hb.norm(dim=-1), novelty=w)
            if self.form == "pair_ungated":
                return AdapterOutput(s0 + step, s0, **norms)
            g = (torch.full_like(step, 0.5) if self.control == "constant"
                 else torch.sigmoid(self.gate(phi)).squeeze(-1))
            # the gate's own supervision reaches it through `gate`; the score's weight is detached unless the
            # gate trains jointly. Where w_nov = 0 the product is exactly 0: the frozen score, to the last bit
            weight = g if self.gate_task_grad else g.detach()
            return AdapterOutput(s0 + weight * step, s0, gate=g, **norms)
        ca, cb = self._complexity(ha), self._complexity(hb)
        va, vb = self._scaled(ha, ca), self._scaled(hb, cb)  # alpha * h, before normalisation
        ua, ub = F.normalize(va, dim=-1), F.normalize(vb, dim=-1)
        if self.form == "per_sentence_preserving":
            ua = F.normalize((1 - self.gamma) * F.normalize(xa, dim=-1) + self.gamma * ua, dim=-1)
            ub = F.normalize((1 - self.gamma) * F.normalize(xb, dim=-1) + self.gamma * ub, dim=-1)
        return AdapterOutput((ua * ub).sum(-1), s0, c_a=ca.squeeze(-1), c_b=cb.squeeze(-1),
                             norm_a=va.norm(dim=-1), norm_b=vb.norm(dim=-1))

    def _complexity(self, h: torch.Tensor) -> torch.Tensor:
        """c in (0, 1), (S, B, 1), according to the control."""
        S, B, _ = h.shape
        if self.control == "constant" or self.control == "h_only":
            return torch.full((S, B, 1), 0.5, device=h.device, dtype=h.dtype)
        if self.control == "global":
            return torch.sigmoid(self.c_global).expand(S, B, 1)
        return torch.sigmoid(self.c_net(h))

    def _scaled(self, h: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        c_in = torch.zeros_like(c) if self.control == "h_only" else c
        if self.control == "shuffled":  # the training loop owns the generator (None: torch's global one)
            c_in = c_in[:, torch.randperm(c.shape[1], generator=self.shuffle_generator).to(c.device)]
        alpha = 1 + self.alpha0 * torch.tanh(self.scale(torch.cat([h, c_in], dim=-1)))  # (S, B, d)
        return alpha * h

    def n_parameters(self) -> int:
        """Trainable parameters of one seed's model (the novelty gate's reference vectors are buffers)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad) // len(self.seeds)
