"""Reference: the recurrence of ONNX LinearAttention, one token at a time."""

from __future__ import annotations

import torch

from edgemem.ops.linear_attention.contract import finish, prepare


def linear_attention_naive(
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
) -> tuple[torch.Tensor, torch.Tensor]:
    p = prepare(query, key, value, past_state, decay, beta, update_rule, scale, q_num_heads, kv_num_heads)
    s = p.state
    outputs = []
    for t in range(p.k.shape[2]):
        k, v = p.k[:, :, t], p.v[:, :, t]
        if p.gated:
            s = s * p.decay[:, :, t, :, None].exp()  # S ← exp(g_t) S  (g per head or per key dim)
        if p.delta:
            # S ← S + β_t k_t ⊗ (v_t − Sᵀ k_t)
            s = s + p.beta[:, :, t, :, None] * k[..., :, None] * (v - torch.einsum("bhkv,bhk->bhv", s, k))[..., None, :]
        else:
            s = s + k[..., :, None] * v[..., None, :]
        outputs.append(p.scale * torch.einsum("bhgk,bhkv->bhgv", p.q[:, :, :, t], s))
    output = torch.stack(outputs, dim=3) if outputs else p.q.new_zeros((*p.q.shape[:4], p.v.shape[-1]))
    return finish(output, s, p)
