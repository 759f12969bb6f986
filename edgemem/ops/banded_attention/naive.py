"""Reference: one query row at a time, each row masking the keys it may attend."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from edgemem.ops.dtypes import compute_dtype


def banded_attention_naive(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    window: int,
    dilation: int | Sequence[int] = 1,
    causal: bool = False,
    global_mask: torch.Tensor | None = None,
    scale: float | None = None,
    persistent_key: torch.Tensor | None = None,
    persistent_value: torch.Tensor | None = None,
) -> torch.Tensor:
    """query, key `[B, T, H, D]`, value `[B, T, H, D_v]` → `[B, T, H, D_v]`; the rule of `banded_attention`."""
    b, t, h, d = query.shape
    dtype = compute_dtype(query)
    q = query.to(dtype) * (d**-0.5 if scale is None else scale)
    k, v = key.to(dtype), value.to(dtype)
    dil = torch.tensor([dilation] * h if isinstance(dilation, int) else list(dilation), device=q.device)[:, None]
    g = torch.zeros(b, t, dtype=torch.bool, device=q.device) if global_mask is None else global_mask
    j = torch.arange(t, device=q.device)
    if persistent_key is not None:
        pk = persistent_key.to(dtype).expand(b, *persistent_key.shape[-3:])
        pv = persistent_value.to(dtype).expand(b, *persistent_value.shape[-3:])
    rows = []
    for i in range(t):
        dist = i - j
        allowed = (dist.abs() <= window * dil) & (dist % dil == 0)  # [H, T]
        allowed = allowed | g[:, None, :] | g[:, i, None, None]  # [B, H, T]
        if causal:
            allowed = allowed & (dist >= 0)
        scores = torch.einsum("bhd,bjhd->bhj", q[:, i], k).masked_fill(~allowed, float("-inf"))
        if persistent_key is None:
            rows.append(torch.einsum("bhj,bjhd->bhd", scores.softmax(-1), v))
            continue
        probs = torch.cat([scores, torch.einsum("bhd,bhpd->bhp", q[:, i], pk)], -1).softmax(-1)
        rows.append(
            torch.einsum("bhj,bjhd->bhd", probs[..., :t], v) + torch.einsum("bhp,bhpd->bhd", probs[..., t:], pv)
        )
    return torch.stack(rows, 1).to(query.dtype)
