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

from edgemem.ops.dtypes import compute_dtype
from edgemem.ops.neural_memory.contract import NORM_EPS, Memory, Options, ResidualNorm, Tokens

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


# (γ, β) shaped `[H, 1, D]` to broadcast over `[B, H, N, D]` rows, in the compute dtype
Norm = tuple[Tensor, Tensor]


def norm_rows(norm: ResidualNorm | None, dtype: torch.dtype) -> Norm | None:
    return None if norm is None else norm.rows(dtype)


def _layer_norm(z: Tensor) -> tuple[Tensor, Tensor]:
    """LN over the last dim without parameters: (ẑ, σ) with ẑ = (z − mean z) / σ."""
    centred = z - z.mean(-1, keepdim=True)
    sigma = (centred.pow(2).mean(-1, keepdim=True) + NORM_EPS).sqrt()
    return centred / sigma, sigma


def residual_norm(x: Tensor, z: Tensor, norm: Norm) -> Tensor:
    """x + γ ⊙ LN(z) + β, the TTT inner model's output around z = f(x)."""
    return x + norm[0] * _layer_norm(z)[0] + norm[1]


def _output_delta(key: Tensor, value: Tensor, z: Tensor, norm: Norm | None) -> Tensor:
    """dℓ/dz for ℓ = ½‖M(k) − v‖² where z = f(k) is the last layer's output.

    Plain memory (M = f): z − v. With the residual norm, M(k) = k + γ ⊙ ẑ + β, and with
    e = M(k) − v, g = γ ⊙ e, the LayerNorm backward per row is
    dℓ/dz = (g − mean(g) − ẑ · mean(g ⊙ ẑ)) / σ.
    """
    if norm is None:
        return z - value
    z_hat, sigma = _layer_norm(z)
    gamma, beta = norm
    g = gamma * (key + gamma * z_hat + beta - value)
    return (g - g.mean(-1, keepdim=True) - z_hat * (g * z_hat).mean(-1, keepdim=True)) / sigma


def memory_deltas(
    key: Tensor, value: Tensor, weights: Sequence[Tensor], activation: str, norm: Norm | None = None
) -> list[tuple[Tensor, Tensor]]:
    """Closed-form gradient of ½‖M(k) − v‖² for every row of `key` (`[..., N, D]`).

    Returns one `(x, d)` pair per memory layer with ∇W_l = xᵀ d summed over the rows:
    with z = f(k) and dz = dℓ/dz (z − v, or through the LayerNorm: `_output_delta`),
    depth 1 (z = kW1): (k, dz); depth 2 with h = kW1, a = act(h), z = aW2:
    (k, (dz W2ᵀ) ⊙ act'(h)) for W1 and (a, dz) for W2.
    """
    if len(weights) == 1:
        return [(key, _output_delta(key, value, key @ weights[0], norm))]
    act, act_grad = ACTIVATIONS[activation]
    w1, w2 = weights
    h = key @ w1
    a = act(h)
    dz = _output_delta(key, value, a @ w2, norm)
    return [(key, (dz @ w2.mT) * act_grad(h)), (a, dz)]


def memory_read(x: Tensor, weights: Sequence[Tensor], activation: str, norm: ResidualNorm | None = None) -> Tensor:
    """M(x) for `x [B, H, N, D]`: f(x) = `x W1` or `act(x W1) W2` (depth 2), or, given the
    residual norm, the TTT form x + γ ⊙ LN(f(x)) + β."""
    return read(x, weights, activation, norm_rows(norm, x.dtype))


def read(x: Tensor, weights: Sequence[Tensor], activation: str, norm: Norm | None) -> Tensor:
    """`memory_read` with the norm parameters as `norm_rows` gives them."""
    z = x @ weights[0] if len(weights) == 1 else ACTIVATIONS[activation][0](x @ weights[0]) @ weights[1]
    return z if norm is None else residual_norm(x, z, norm)


def neural_memory_naive(
    tokens: Tokens, memory: Memory, options: Options, norm: ResidualNorm | None = None
) -> tuple[Tensor, Memory]:
    """Titans long-term memory, token by token, over unpacked `[B, T, H, D]` q/k/v.

    Token t sits at absolute position `memory.position + t`; a chunk starts wherever that
    position is a multiple of `chunk_size`, and there the chunk weights become the current
    weights (no position: position 0, so the call starts a fresh chunk and the chunk weights
    are not read). Per token (Titans eq. 13/14):
        S_t = η_t S_{t−1} − θ_t ∇ℓ_t(W_chunk),   W_t = (1 − α_t) W_{t−1} + S_t,
        y_t = M(q_t; W_t).
    Given `norm` the memory is TTT's M(x) = x + γ ⊙ LN(f(x)) + β around the MLP f (LN over D,
    eps `NORM_EPS`). Returns `(y [B,T,H,D], memory after the last token)` with every field
    set (position + T); state in the compute dtype, y in q's dtype.
    """
    q, k, v, theta, eta, alpha = tokens
    out_dtype, dtype = q.dtype, compute_dtype(q)
    chunk_weights = memory.weights if memory.chunk_weights is None else memory.chunk_weights
    position = q.new_zeros(1, dtype=torch.int64) if memory.position is None else memory.position
    activation = options.activation
    q, k, v = (x.to(dtype).transpose(1, 2) for x in (q, k, v))
    theta, eta, alpha = (g.to(dtype).transpose(1, 2)[..., None, None] for g in (theta, eta, alpha))
    w = [x.to(dtype, copy=True) for x in memory.weights]
    s = [x.to(dtype, copy=True) for x in memory.momentum]
    wc = [x.to(dtype, copy=True) for x in chunk_weights]
    rows = norm_rows(norm, dtype)
    ys = []
    for t in range(q.shape[2]):
        starts = ((position + t) % options.chunk_size == 0).view(-1, 1, 1, 1)
        wc = [torch.where(starts, wi, ci) for wi, ci in zip(w, wc)]
        deltas = memory_deltas(k[:, :, t, None], v[:, :, t, None], wc, activation, rows)
        s = [eta[:, :, t] * si - theta[:, :, t] * (x.mT @ d) for si, (x, d) in zip(s, deltas)]
        w = [(1 - alpha[:, :, t]) * wi + si for wi, si in zip(w, s)]
        ys.append(read(q[:, :, t, None], w, activation, rows))
    y = torch.cat(ys, 2) if ys else torch.empty_like(q)
    return y.transpose(1, 2).to(out_dtype), Memory(tuple(w), tuple(s), tuple(wc), position + q.shape[2])
