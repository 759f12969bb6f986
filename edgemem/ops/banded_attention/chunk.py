"""Fast form: O(T·(window + G + P)) time and memory, no T×T matrix.

Every query gathers its band of 2w+1 (causal: w+1) dilated keys into `[B, H, T, K, D]`. The G
global keys of a sequence and the P persistent keys are shared by all queries and scored once
as `[B, H, T, G+P]`; one softmax runs over band and shared keys together. Global keys are
dropped from the band so none counts twice. The G global queries attend every key
(`[B, H, G, T+P]`) and overwrite their rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from edgemem.ops.dtypes import compute_dtype


def band_index(rows: torch.Tensor, window: int, dilation: Sequence[int], causal: bool) -> torch.Tensor:
    """Key position of each band slot of each query row, per head: `[H, len(rows), K]`.

    Slot o holds rows + (o − window)·d_h with o = 0..window (causal) or 0..2·window, so slot
    `window` is the query itself. Positions may fall outside the sequence: the caller masks them.
    """
    offsets = torch.arange(-window, 1 if causal else window + 1, device=rows.device)
    return rows[None, :, None] + offsets * torch.tensor(list(dilation), device=rows.device)[:, None, None]


def gather_band(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x `[B, H, S, D]`, index `[B or 1, H, N, K]` into S → `[B, H, N, K, D]`."""
    b, h, _, d = x.shape
    flat = index.reshape(index.shape[0], h, -1, 1).expand(b, h, -1, d)
    return x.gather(2, flat).reshape(b, h, *index.shape[2:], d)


def _take(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x `[B, H, S, D]`, positions `[B, N]` → `[B, H, N, D]`."""
    return x.gather(2, positions[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[-1]))


def banded_attention_chunk(
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
    dilation = [dilation] * h if isinstance(dilation, int) else list(dilation)
    dtype = compute_dtype(query)
    q = query.to(dtype).transpose(1, 2) * (d**-0.5 if scale is None else scale)
    k, v = (x.to(dtype).transpose(1, 2) for x in (key, value))
    rows = torch.arange(t, device=q.device)
    if global_mask is not None and not global_mask.any():
        global_mask = None

    idx = band_index(rows, min(window, t - 1), dilation, causal)[None]  # offsets past T−1 never hit a key
    band_ok = (idx >= 0) & (idx < t)
    idx = idx.clamp(0, t - 1)
    shared_k, shared_v, shared_ok = [], [], []
    if global_mask is not None:
        band_ok = band_ok & ~global_mask[:, idx[0]]
        count = global_mask.sum(-1)
        gpos = torch.argsort((~global_mask).to(torch.int8), dim=-1, stable=True)[:, : int(count.max())]  # [B, G]
        gok = torch.arange(gpos.shape[1], device=q.device) < count[:, None]
        shared_k.append(_take(k, gpos))
        shared_v.append(_take(v, gpos))
        shared_ok.append((gok[:, None, :] & (gpos[:, None, :] <= rows[:, None])) if causal else gok[:, None, :])
    if persistent_key is not None:
        pk = persistent_key.to(dtype).expand(b, *persistent_key.shape[-3:])
        pv = persistent_value.to(dtype).expand(b, *persistent_value.shape[-3:])
        shared_k.append(pk)
        shared_v.append(pv)
        shared_ok.append(torch.ones(1, 1, pk.shape[2], dtype=torch.bool, device=q.device))

    kb, vb = gather_band(k, idx), gather_band(v, idx)
    scores = torch.einsum("bhtd,bhtkd->bhtk", q, kb).masked_fill(~band_ok, float("-inf"))
    if not shared_k:
        out = torch.einsum("bhtk,bhtkd->bhtd", scores.softmax(-1), vb)
    else:
        sk, sv = torch.cat(shared_k, 2), torch.cat(shared_v, 2)
        ok = torch.cat([m.expand(b, t, -1) for m in shared_ok], -1)[:, None]  # [B, 1, T, G+P]
        shared = torch.einsum("bhtd,bhnd->bhtn", q, sk).masked_fill(~ok, float("-inf"))
        probs = torch.cat([scores, shared], -1).softmax(-1)
        width = scores.shape[-1]
        out = torch.einsum("bhtk,bhtkd->bhtd", probs[..., :width], vb) + torch.einsum(
            "bhtn,bhnd->bhtd", probs[..., width:], sv
        )

    if global_mask is not None:
        keys, values = (torch.cat([k, pk], 2), torch.cat([v, pv], 2)) if persistent_key is not None else (k, v)
        scores = torch.einsum("bhgd,bhsd->bhgs", _take(q, gpos), keys)
        if causal:
            future = rows[None, None, :] > gpos[:, :, None]  # [B, G, T]
            future = torch.cat([future, future.new_zeros(b, gpos.shape[1], keys.shape[2] - t)], -1)
            scores = scores.masked_fill(future[:, None], float("-inf"))
        out_g = torch.einsum("bhgs,bhsd->bhgd", scores.softmax(-1), values)
        rank = (global_mask.cumsum(-1) - 1).clamp(min=0)  # row i's slot among the global queries
        out = torch.where(global_mask[:, None, :, None], _take(out_g, rank), out)
    return out.transpose(1, 2).to(query.dtype)
