"""Fast form: every new token gathers its w+1 dilated keys from [ring ‖ new tokens].

Time and memory O(T·window + L) for T new tokens and a ring of L slots; one token (decode)
touches window+1 keys and rewrites one slot.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from edgemem.ops.banded_attention.chunk import band_index, gather_band
from edgemem.ops.dtypes import compute_dtype


def window_attention_chunk(
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
    dilation = [dilation] * h if isinstance(dilation, int) else list(dilation)
    dtype = compute_dtype(query)
    ring = past_key.shape[2]
    q = query.to(dtype).transpose(1, 2) * (d**-0.5 if scale is None else scale)
    # sources: ring slots 0..L−1, then the new tokens at L..L+T−1
    src_k = torch.cat([past_key.to(dtype), key.to(dtype).transpose(1, 2)], 2)
    src_v = torch.cat([past_value.to(dtype), value.to(dtype).transpose(1, 2)], 2)
    pos = position.view(b, 1, 1, 1)

    rel = band_index(torch.arange(t, device=q.device), window, dilation, causal=True)[None]  # ≥ −L
    idx = torch.where(rel >= 0, ring + rel, (pos + rel) % ring)  # [B, H, T, w+1]
    scores = torch.einsum("bhtd,bhtkd->bhtk", q, gather_band(src_k, idx)).masked_fill(pos + rel < 0, float("-inf"))
    if persistent_key is None:
        out = torch.einsum("bhtk,bhtkd->bhtd", scores.softmax(-1), gather_band(src_v, idx))
    else:
        pk = persistent_key.to(dtype).expand(b, *persistent_key.shape[-3:])
        pv = persistent_value.to(dtype).expand(b, *persistent_value.shape[-3:])
        probs = torch.cat([scores, torch.einsum("bhtd,bhpd->bhtp", q, pk)], -1).softmax(-1)
        out = torch.einsum("bhtk,bhtkd->bhtd", probs[..., : window + 1], gather_band(src_v, idx)) + torch.einsum(
            "bhtp,bhpd->bhtd", probs[..., window + 1 :], pv
        )

    # slot s ends up holding the newest position ≡ s (mod L) below position + T
    slots = torch.arange(ring, device=q.device)
    newest = t - 1 - (position[:, None] + t - 1 - slots) % ring  # relative to the first new token, [B, L]
    keep = torch.where(newest >= 0, ring + newest, slots)
    present_k = src_k.gather(2, keep[:, None, :, None].expand(b, h, ring, d)).to(past_key.dtype)
    present_v = src_v.gather(2, keep[:, None, :, None].expand(b, h, ring, src_v.shape[-1])).to(past_value.dtype)
    return out.transpose(1, 2).to(query.dtype), present_k, present_v
