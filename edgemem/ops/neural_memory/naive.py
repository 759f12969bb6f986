"""Reference form of the neural memory op: one token at a time, easy to check by eye.

Tensors here are unpacked: q/k/v `[B, T, H, D]`, gates `[B, T, H]`, memory weights and
momentum `[B, H, D_in, D_out]` per layer. `edgemem.ops.neural_memory` validates, packs and
dispatches; call these directly only with well-formed inputs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

Activation = tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]


def _silu_grad(h: Tensor) -> Tensor:
    s = torch.sigmoid(h)
    return s * (1 + h * (1 - s))


def _gelu_grad(h: Tensor) -> Tensor:
    # exact (erf) GELU: d/dh h·Φ(h) = Φ(h) + h·φ(h)
    cdf = 0.5 * (1 + torch.erf(h * math.sqrt(0.5)))
    pdf = torch.exp(-0.5 * h * h) / math.sqrt(2 * math.pi)
    return cdf + h * pdf


# name -> (activation, its derivative); the derivative makes the gradients closed-form.
ACTIVATIONS: dict[str, Activation] = {
    "silu": (F.silu, _silu_grad),
    "gelu": (F.gelu, _gelu_grad),
    "relu": (F.relu, lambda h: (h > 0).to(h.dtype)),
    "identity": (lambda h: h, torch.ones_like),
}


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other floating dtype computes in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def memory_deltas(
    key: Tensor, value: Tensor, weights: Sequence[Tensor], activation: str
) -> list[tuple[Tensor, Tensor]]:
    """Closed-form gradient of ½‖M(k) − v‖² for every row of `key` (`[..., N, D]`).

    Returns one `(x, d)` pair per memory layer with ∇W_l = xᵀ d summed over the rows:
    depth 1: x = k, d = kW1 − v; depth 2 with h = kW1, z = act(h), e = zW2 − v:
    (k, (e W2ᵀ) ⊙ act'(h)) for W1 and (z, e) for W2.
    """
    if len(weights) == 1:
        return [(key, key @ weights[0] - value)]
    act, act_grad = ACTIVATIONS[activation]
    w1, w2 = weights
    h = key @ w1
    z = act(h)
    e = z @ w2 - value
    return [(key, (e @ w2.mT) * act_grad(h)), (z, e)]


def memory_read(x: Tensor, weights: Sequence[Tensor], activation: str) -> Tensor:
    """M(x): `x W1`, or `act(x W1) W2` for depth 2."""
    if len(weights) == 1:
        return x @ weights[0]
    return ACTIVATIONS[activation][0](x @ weights[0]) @ weights[1]


def neural_memory_naive(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    theta: Tensor,
    eta: Tensor,
    alpha: Tensor,
    weights: Sequence[Tensor],
    momentum: Sequence[Tensor],
    chunk_weights: Sequence[Tensor] | None = None,
    position: Tensor | None = None,
    *,
    chunk_size: int = 1,
    activation: str = "silu",
) -> tuple[Tensor, tuple[Tensor, ...], tuple[Tensor, ...], tuple[Tensor, ...], Tensor]:
    """Titans long-term memory, token by token.

    Token t sits at absolute position `position + t` (`position`: int64 `[B]` or `[1]`);
    a chunk starts wherever that position is a multiple of `chunk_size`, and there
    `chunk_weights` become the current weights (defaults: position 0, so the call starts
    a fresh chunk and `chunk_weights` are not read). Per token (Titans eq. 13/14):
        S_t = η_t S_{t−1} − θ_t ∇ℓ_t(W_chunk),   W_t = (1 − α_t) W_{t−1} + S_t,
        y_t = M(q_t; W_t).
    Returns `(y [B,T,H,D], weights, momentum, chunk_weights, position + T)`; state in the
    compute dtype, y in q's dtype.
    """
    out_dtype, dtype = q.dtype, compute_dtype(q.dtype)
    chunk_weights = weights if chunk_weights is None else chunk_weights
    position = q.new_zeros(1, dtype=torch.int64) if position is None else position
    q, k, v = (x.to(dtype).transpose(1, 2) for x in (q, k, v))
    theta, eta, alpha = (g.to(dtype).transpose(1, 2)[..., None, None] for g in (theta, eta, alpha))
    w = [x.to(dtype, copy=True) for x in weights]
    s = [x.to(dtype, copy=True) for x in momentum]
    wc = [x.to(dtype, copy=True) for x in chunk_weights]
    ys = []
    for t in range(q.shape[2]):
        starts = ((position + t) % chunk_size == 0).view(-1, 1, 1, 1)
        wc = [torch.where(starts, wi, ci) for wi, ci in zip(w, wc)]
        deltas = memory_deltas(k[:, :, t, None], v[:, :, t, None], wc, activation)
        s = [eta[:, :, t] * si - theta[:, :, t] * (x.mT @ d) for si, (x, d) in zip(s, deltas)]
        w = [(1 - alpha[:, :, t]) * wi + si for wi, si in zip(w, s)]
        ys.append(memory_read(q[:, :, t, None], w, activation))
    y = torch.cat(ys, 2) if ys else torch.empty_like(q)
    return y.transpose(1, 2).to(out_dtype), tuple(w), tuple(s), tuple(wc), position + q.shape[2]
