"""Reference: the ring buffer driven one token at a time."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from edgemem.ops.dtypes import compute_dtype


def window_attention_naive(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    position: torch.Tensor,
    *,
    window: int,
    dilation: int | Sequence[int] = 1,
    scale: float | None = None,
    persistent_key: torch.Tensor | None = None,
    persistent_value: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query, key `[B, T, H, D]`, value `[B, T, H, D_v]`, ring `[B, H, L, D | D_v]`, position `[B]`;
    the contract of `window_attention_prefill`, returning output `[B, T, H, D_v]`."""
    b, t, h, d = query.shape
    dtype = compute_dtype(query)
    q = query.to(dtype) * (d**-0.5 if scale is None else scale)
    k, v = key.to(dtype), value.to(dtype)
    ring_k, ring_v = past_key.to(dtype), past_value.to(dtype)
    ring = past_key.shape[2]
    dil = torch.tensor([dilation] * h if isinstance(dilation, int) else list(dilation), device=q.device)[:, None]
    slots = torch.arange(ring, device=q.device)
    batch = torch.arange(b, device=q.device)
    if persistent_key is not None:
        pk = persistent_key.to(dtype).expand(b, *persistent_key.shape[-3:])
        pv = persistent_value.to(dtype).expand(b, *persistent_value.shape[-3:])
    outputs = []
    for i in range(t):
        p = position + i
        held = p[:, None] - 1 - (p[:, None] - 1 - slots) % ring  # [B, L]: the newest position < p in each slot
        dist = (p[:, None] - held)[:, None]  # [B, 1, L]
        ok = (held[:, None] >= 0) & (dist <= window * dil) & (dist % dil == 0)  # [B, H, L]
        keys = torch.cat([ring_k, k[:, i, :, None]], 2)  # the token itself is always attended
        values = torch.cat([ring_v, v[:, i, :, None]], 2)
        ok = torch.cat([ok, ok.new_ones(b, h, 1)], -1)
        if persistent_key is not None:
            keys, values = torch.cat([keys, pk], 2), torch.cat([values, pv], 2)
            ok = torch.cat([ok, ok.new_ones(b, h, pk.shape[2])], -1)
        scores = torch.einsum("bhd,bhsd->bhs", q[:, i], keys).masked_fill(~ok, float("-inf"))
        outputs.append(torch.einsum("bhs,bhsd->bhd", scores.softmax(-1), values))
        ring_k, ring_v = ring_k.clone(), ring_v.clone()
        ring_k[batch, :, p % ring] = k[:, i]
        ring_v[batch, :, p % ring] = v[:, i]
    out = torch.stack(outputs, 1) if outputs else q.new_zeros(b, 0, h, v.shape[-1])
    return out.to(query.dtype), ring_k.to(past_key.dtype), ring_v.to(past_value.dtype)
