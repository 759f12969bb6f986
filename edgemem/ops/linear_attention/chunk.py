"""Chunk-parallel form of LinearAttention (same signature as the reference).

Inside a chunk of C tokens starting from state S₀, with G_t = Σ_{s≤t} g_s (cumulative
log-decay; zero for the ungated rules) every rule unrolls to

    S_t = e^{G_t} S₀ + Σ_{j≤t} e^{G_t−G_j} k_j u_jᵀ,       o_t = scale · S_tᵀ q_t,

(with e^{G} acting on the key dimension). u_j = v_j for the additive rules. For the delta
rules u_t = β_t (v_t − e^{G_t} S₀ᵀ k_t − Σ_{j<t} e^{G_t−G_j}(k_t·k_j) u_j), i.e. the
lower-triangular system (I + A) U = β V − β e^{G} K S₀ with A_tj = β_t e^{G_t−G_j} k_t·k_j:
the UT/WY transform. Solving it once per chunk gives U = Ũ − W S₀, so only small matmuls
remain sequential across chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edgemem.ops.linear_attention.contract import finish, prepare


def _chunks(x: torch.Tensor, size: int) -> torch.Tensor:
    """[B, H, T, D] → [B, H, N, C, D], zero-padded at the end (padded tokens change nothing)."""
    t = x.shape[-2]
    pad = -t % size
    x = F.pad(x, (0, 0, 0, pad))
    return x.reshape(*x.shape[:-2], (t + pad) // size, size, x.shape[-1])


def _pair_decay(g: torch.Tensor, strict: bool) -> torch.Tensor:
    """e^{G_t − G_j} for j ≤ t (j < t if strict), zero elsewhere: [B, H, N, C, C, 1 | d_k]."""
    c = g.shape[-2]
    mask = torch.ones(c, c, dtype=torch.bool, device=g.device).tril(-1 if strict else 0)
    diff = g[..., :, None, :] - g[..., None, :, :]
    return diff.masked_fill(~mask[..., None], float("-inf")).exp()


def _scores(x: torch.Tensor, k: torch.Tensor, pair: torch.Tensor) -> torch.Tensor:
    """Σ_d x_t[d] k_j[d] e^{G_t[d]−G_j[d]}; x may carry a query-group dim before N."""
    if pair.shape[-1] == 1:
        return torch.einsum("...ctd,...cjd->...ctj", x, k) * pair[..., 0]
    return torch.einsum("...ctd,...cjd,...ctjd->...ctj", x, k, pair)


def linear_attention_chunk(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_state: torch.Tensor | None = None,
    decay: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    *,
    update_rule: str,
    scale: float = 0.0,
    q_num_heads: int,
    kv_num_heads: int,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    p = prepare(query, key, value, past_state, decay, beta, update_rule, scale, q_num_heads, kv_num_heads)
    b, h, group, t, d_k = p.q.shape
    size = max(1, min(chunk_size, t))
    q = _chunks(p.q.reshape(b, h * group, t, d_k), size)
    q = q.reshape(b, h, group, *q.shape[2:])  # [B, H, G, N, C, d_k]
    k, v = _chunks(p.k, size), _chunks(p.v, size)
    g = _chunks(p.decay, size).cumsum(-2) if p.gated else k.new_zeros((*k.shape[:-1], 1))

    pair = _pair_decay(g, strict=False)
    attn = _scores(q, k[:, :, None], pair[:, :, None])  # [B, H, G, N, C, C]
    decay_q = q * g[:, :, None].exp()
    decay_k = k * (g[..., -1:, :] - g).exp()  # e^{G_C − G_j} k_j: carries k_j to the chunk end
    if p.delta:
        bt = _chunks(p.beta, size)
        a = bt * _scores(k, k, _pair_decay(g, strict=True))
        eye = torch.eye(size, dtype=a.dtype, device=a.device)
        rhs = torch.cat([bt * v, bt * k * g.exp()], dim=-1)
        solved = torch.linalg.solve_triangular(a + eye, rhs, upper=False, unitriangular=True)
        u_part, w = solved.split([v.shape[-1], d_k], dim=-1)  # U = Ũ − W S₀
    else:
        u_part, w = v, None

    s = p.state
    outputs = []
    for n in range(k.shape[2]):
        u = u_part[:, :, n] if w is None else u_part[:, :, n] - w[:, :, n] @ s
        outputs.append(p.scale * (decay_q[:, :, :, n] @ s[:, :, None] + attn[:, :, :, n] @ u[:, :, None]))
        s = g[:, :, n, -1, :, None].exp() * s + decay_k[:, :, n].transpose(-1, -2) @ u
    output = torch.stack(outputs, dim=3).flatten(3, 4)[..., :t, :]
    return finish(output, s, p)
