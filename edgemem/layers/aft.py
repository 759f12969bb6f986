"""Attention Free Transformer, causal (Zhai et al. 2021, "An Attention Free Transformer", §3)."""

from __future__ import annotations

import torch
from torch import nn

from edgemem.config import positive_int
from edgemem.errors import ConfigError
from edgemem.layers.base import State, StatefulLayer

Sums = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
_FLOOR = -80.0
MAX_PREFILL_LOG2 = 20


def _exp(x: torch.Tensor) -> torch.Tensor:
    """e^x for x ≤ 0, flushed to 0 below e^−80 (invisible next to the max term's 1; CPU exp is
    much slower on arguments that underflow, as empty slots and large logit gaps give: benchmarks/README.md)."""
    return x.clamp(min=_FLOOR).exp().masked_fill(x < _FLOOR, 0.0)


def _merge(x: Sums, y: Sums) -> Sums:
    """Two max-stabilised sums (m, Σ e^{k−m} v, Σ e^{k−m}) of disjoint terms → the sums of their union."""
    m = torch.maximum(x[0], y[0])
    a, b = _exp(x[0] - m), _exp(y[0] - m)
    return m, a * x[1] + b * y[1], a * x[2] + b * y[2]


def _prefix(sums: Sums) -> Sums:
    """Inclusive prefix merge along time in ⌈log₂ T⌉ doubling steps (Hillis–Steele): O(T log T · d).

    Under export T is symbolic: the graph then takes MAX_PREFILL_LOG2 steps (those past
    ⌈log₂ T⌉ merge nothing), so one graph serves prompts up to 2^MAX_PREFILL_LOG2 tokens."""
    t = sums[0].shape[1]
    steps = (t - 1).bit_length() if isinstance(t, int) else MAX_PREFILL_LOG2
    identity = (torch.finfo(sums[0].dtype).min, 0.0, 0.0)
    positions = torch.arange(t, device=sums[0].device)
    for i in range(steps):
        source = positions - (1 << i)
        valid = (source >= 0)[None, :, None]
        earlier = tuple(torch.where(valid, x[:, source.clamp(min=0)], fill) for x, fill in zip(sums, identity))
        sums = _merge(earlier, sums)
    return sums


class AFT(StatefulLayer):
    """Causal AFT-simple or AFT-local over Q, K, V = X W_q, X W_k, X W_v (d_model channels each):

        Y_t = σ(Q_t) ⊙ Σ_{j≤t} exp(K_j + w_{t−j}) ⊙ V_j / Σ_{j≤t} exp(K_j + w_{t−j}),   output Y W_o

    AFT-simple (§3.2): w = 0, i.e. a per-channel softmax of K over the past. AFT-local (§3.2):
    w_{t−j} is learned for 0 ≤ t−j < window and 0 outside it, and, as in the paper, the terms
    outside the window are kept (with w = 0): AFT-local stays globally connected.

    Choices where the paper leaves room:
    - w depends on the offset t−j only (the paper's w_{t,t'} is one scalar per position pair):
      `window` scalars shared across channels, zero-initialised (so AFT-local starts as AFT-simple);
      this is what makes the layer stream at any length.
    - Bias-free projections and an output projection W_o, like the attention block AFT replaces.

    Every sum is kept max-stabilised as (m, Σ e^{k−m} v, Σ e^{k−m}), m the running max, so nothing
    overflows at any length or logit size. State (fp32, fp64 for an fp64 layer): `max`,
    `numerator`, `denominator` `[B, d_model]` over the tokens no longer in the window (all past
    tokens for AFT-simple); AFT-local adds `key`, `value` `[B, window − 1, d_model]`, the last
    window − 1 tokens, oldest first. Empty slots of a fresh stream hold the lowest float as key,
    i.e. weight e^{k−m} = 0. `forward` is a parallel prefix scan (AFT-simple: O(T log T · d)) plus,
    for AFT-local, the window terms (O(T · window · d)); no T×T matrix.
    """

    prefill_steps = False  # its prefix scan (`_prefix`) costs several steps at T = 1 (benchmarks/README.md)

    def __init__(self, d_model: int, mode: str = "simple", window: int | None = None):
        super().__init__()
        positive_int(d_model, "AFT d_model")
        if mode not in ("simple", "local"):
            raise ConfigError(f"AFT mode must be 'simple' or 'local'; got {mode!r}")
        if mode == "simple" and window is not None:
            raise ConfigError(f"AFT window applies to mode='local' only; got window={window!r} with mode='simple'")
        if mode == "local" and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ConfigError(f"AFT mode='local' needs window, a positive integer; got {window!r}")
        self.d_model, self.mode, self.window = d_model, mode, window
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        if mode == "local":
            self.pos_bias = nn.Parameter(torch.zeros(window))  # w_{t−j} for t−j = 0 … window − 1

    def init_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype | None = None) -> State:
        dtype = self.state_dtype(dtype)
        lowest = torch.finfo(dtype).min
        state = {}
        if self.mode == "local":
            shape = (batch, self.window - 1, self.d_model)
            state["key"] = torch.full(shape, lowest, device=device, dtype=dtype)
            state["value"] = torch.zeros(shape, device=device, dtype=dtype)
        state["max"] = torch.full((batch, self.d_model), lowest, device=device, dtype=dtype)
        state["numerator"] = torch.zeros(batch, self.d_model, device=device, dtype=dtype)
        state["denominator"] = torch.zeros(batch, self.d_model, device=device, dtype=dtype)
        return state

    def prefill(self, x: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        t = x.shape[1]
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        dtype = state["max"].dtype
        k, v = k.to(dtype), v.to(dtype)
        past = tuple(state[kind][:, None] for kind in ("max", "numerator", "denominator"))
        new_state = {}
        if self.mode == "simple":
            summary = _merge(past, _prefix((k, v, torch.ones_like(k))))
            y = summary[1] / summary[2]
        else:
            # the last window − 1 tokens, then the new ones; token i's window is ks[i : i + window]
            ks, vs = torch.cat([state["key"], k], dim=1), torch.cat([state["value"], v], dim=1)
            new_state["key"], new_state["value"] = ks[:, t:], vs[:, t:]
            # summary[i] = the state plus ks[: i + 1]: the tokens outside the window of token i + 1 (w = 0)
            summary = _merge(past, _prefix((ks[:, :t], vs[:, :t], torch.ones_like(k))))
            outside = tuple(torch.cat([p, s[:, :-1]], dim=1) for p, s in zip(past, summary))
            logits = ks.unfold(1, self.window, 1) + self.pos_bias.flip(0)  # slot i has offset window − 1 − i
            mw = logits.amax(-1)
            weights = _exp(logits - mw[..., None])
            inside = (mw, (weights * vs.unfold(1, self.window, 1)).sum(-1), weights.sum(-1))
            _, n, z = _merge(outside, inside)
            y = n / z
        new_state["max"], new_state["numerator"], new_state["denominator"] = (s[:, -1] for s in summary)
        return self.out(torch.sigmoid(q) * y.to(x.dtype)), new_state
