"""Chunked form of the neural memory op: matmuls over each chunk, no per-token loop.

Inside a chunk every gradient is taken at the chunk-start weights, so Titans eq. 13/14
are linear in the gradients and unroll, for tokens j ≤ i of one chunk, to
    S_i = P_i S_0 − Σ_j L_ij θ_j ∇ℓ_j          L_ij = Π_{j<m≤i} η_m,       P_i = Π_{m≤i} η_m
    W_i = A_i W_0 + c_i S_0 − Σ_j K_ij θ_j ∇ℓ_j  Λ_ij = Π_{j<m≤i} (1 − α_m), A_i = Π_{m≤i} (1 − α_m)
with K = Λ L and c = Λ P. Since ∇ℓ_j = x_jᵀ d_j (see `memory_deltas`), a read through the
weights after token i, x_i W_i = A_i x_i W_0 + c_i x_i S_0 − Σ_j K_ij θ_j (x_i · x_j) d_j,
is a masked linear attention over the chunk: no per-token weights are materialised.
TTT's residual norm, M(x) = x + γ ⊙ LN(f(x)) + β, changes neither: its LayerNorm acts on
each row's f(x) after the read, and on the gradients only through the d_j, which are all
taken at the chunk-start weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from edgemem.ops.dtypes import compute_dtype
from edgemem.ops.neural_memory.contract import Memory, Options, ResidualNorm, Tokens
from edgemem.ops.neural_memory.naive import (
    ACTIVATIONS,
    Norm,
    memory_deltas,
    norm_rows,
    residual_norm,
)


def _decay(g: Tensor) -> Tensor:
    """`[..., C]` -> `[..., C, C]` holding Π_{j<m≤i} g_m at [i, j] for i ≥ j, 0 above."""
    i = torch.arange(g.shape[-1], device=g.device)
    return torch.where(i[:, None] >= i, torch.where(i[:, None] > i, g[..., :, None], 1).cumprod(-2), 0)


def _chunk(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    theta: Tensor,
    eta: Tensor,
    alpha: Tensor,
    weights: Sequence[Tensor],
    momentum: Sequence[Tensor],
    grad_weights: Sequence[Tensor],
    real: Tensor | None,
    activation: str,
    norm: Norm | None,
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """One chunk of `[B, H, C, ·]` tokens: its outputs and the state after its last token.

    Slots where `real` (`[B, 1, C]`) is 0 leave the state as it is: θ = 0, η = 1, α = 0
    there, and S_m does not enter W (Λ's column m is zeroed).
    """
    keep = 1 - alpha
    l_eta = _decay(eta)
    p = eta.cumprod(-1)[..., None]
    a = keep.cumprod(-1)[..., None]
    l_keep = _decay(keep) if real is None else _decay(keep) * real[..., None, :]
    c = l_keep @ p
    k_theta = (l_keep @ l_eta) * theta[..., None, :]
    l_theta = l_eta * theta[..., None, :]
    x = q
    w_out, s_out = [], []
    deltas = memory_deltas(k, v, grad_weights, activation, norm)
    for layer, ((xk, d), w, s) in enumerate(zip(deltas, weights, momentum)):
        y = a * (x @ w) + c * (x @ s) - ((x @ xk.mT) * k_theta) @ d
        w_out.append(a[..., -1:, :] * w + c[..., -1:, :] * s - (xk * k_theta[..., -1, :, None]).mT @ d)
        s_out.append(p[..., -1:, :] * s - (xk * l_theta[..., -1, :, None]).mT @ d)
        x = ACTIVATIONS[activation][0](y) if layer + 1 < len(weights) else y
    return (x if norm is None else residual_norm(q, x, norm)), w_out, s_out


def _shift(x: Tensor, index: Tensor, valid: Tensor, fill: float | None = None) -> Tensor:
    """Gather `x [B, T, ...]` along T at `index [B, L]`; slots not `valid` get `fill`."""
    shape = (*index.shape, *[1] * (x.dim() - 2))
    out = x.gather(1, index.view(shape).expand(*index.shape, *x.shape[2:]))
    return out if fill is None else torch.where(valid.view(shape), out, fill)


def neural_memory_chunk(
    tokens: Tokens, memory: Memory, options: Options, norm: ResidualNorm | None = None
) -> tuple[Tensor, Memory]:
    """Same contract and result as `neural_memory_naive`, one chunk at a time.

    Given a position, a row that starts `o = position % chunk_size` tokens into a chunk
    is shifted right by `o` slots that leave the state unchanged (the sequence grows by
    `chunk_size − 1` slots in all rows, so shapes do not depend on values), chunks line up
    with absolute positions in every row and the first chunk's gradients use the chunk weights.
    """
    chunk_size, activation, position = options.chunk_size, options.activation, memory.position
    out_dtype, dtype = tokens.query.dtype, compute_dtype(tokens.query)
    q, k, v, theta, eta, alpha = (x.to(dtype) for x in tokens)
    batch, length = q.shape[:2]
    w = [x.to(dtype, copy=True) for x in memory.weights]
    s = [x.to(dtype, copy=True) for x in memory.momentum]
    rows = norm_rows(norm, dtype)
    offset = torch.zeros(batch, dtype=torch.int64, device=q.device)
    if position is not None:
        offset = offset + position % chunk_size
    mid_chunk = (offset > 0).view(-1, 1, 1, 1)
    wc = w
    if memory.chunk_weights is not None:
        wc = [torch.where(mid_chunk, c.to(dtype), x) for c, x in zip(memory.chunk_weights, w)]
    pad = chunk_size - 1 if position is not None and length else 0
    real = None
    if pad:
        index = torch.arange(length + pad, device=q.device) - offset[:, None]
        valid = (index >= 0) & (index < length)
        index = index.clamp(0, length - 1)
        q, k, v = (_shift(x, index, valid) for x in (q, k, v))
        theta, eta, alpha = (_shift(g, index, valid, f) for g, f in ((theta, 0.0), (eta, 1.0), (alpha, 0.0)))
        real = valid.to(dtype)[:, None]
    q, k, v, theta, eta, alpha = (x.transpose(1, 2) for x in (q, k, v, theta, eta, alpha))
    ys = []
    for start in range(0, length + pad, chunk_size):
        if start:
            # a new chunk starts in every row that still has tokens at or after `start`
            live = (start < offset + length).view(-1, 1, 1, 1)
            wc = [torch.where(live, x, c) for x, c in zip(w, wc)]
        piece = (x[:, :, start : start + chunk_size] for x in (q, k, v, theta, eta, alpha))
        real_piece = None if real is None else real[..., start : start + chunk_size]
        y, w, s = _chunk(*piece, w, s, wc, real_piece, activation, rows)
        ys.append(y)
    y = torch.cat(ys, 2).transpose(1, 2) if ys else q.transpose(1, 2)
    if pad:
        y = _shift(y, offset[:, None] + torch.arange(length, device=q.device), valid)
    position = offset.new_zeros(1) if position is None else position
    return y.to(out_dtype), Memory(tuple(w), tuple(s), tuple(wc), position + length)
