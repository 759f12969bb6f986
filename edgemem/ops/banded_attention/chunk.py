"""Fast form: O(T·(s + G + P)) time and memory with s = window·max(dilation), no T×T matrix.

Longformer's blocked band: queries go in blocks of s (T padded to a multiple of s), and block c
attends the 3s keys of key blocks c−1, c and c+1, which hold its whole band. Scores are one batched
product `[B, H, T/s, s, D] × [B, H, T/s, D, 3s]`; query i of a block and key slot j are i − j + s
apart whatever the block, so the band is one `[H, s, 3s]` mask. The G global keys of a sequence and
the P persistent keys are shared by all queries and scored once as `[B, H, T/s, s, G+P]`; one
softmax runs over band and shared keys together. Global keys are dropped from the band so none
counts twice. The G global queries attend every key (`[B, H, G, T+P]`) and overwrite their rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

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


def block_size(t: int, window: int, dilation: Sequence[int]) -> int:
    """s: the farthest band key, window·max(dilation), and no more than T (one block holds it all)."""
    return max(1, min(window * max(dilation), t))


def key_blocks(x: torch.Tensor, size: int, blocks: int) -> torch.Tensor:
    """x `[B, H, T, D]` → `[B, H, n, 3s, D]`: block c holds positions (c−1)·s … (c+2)·s − 1, zeros outside."""
    x = F.pad(x, (0, 0, size, (blocks + 1) * size - x.shape[2])).unflatten(2, (blocks + 2, size))
    return torch.cat([x[:, :, :-2], x[:, :, 1:-1], x[:, :, 2:]], 3)


def band_mask(size: int, window: int, dilation: Sequence[int], causal: bool, device: torch.device) -> torch.Tensor:
    """`[H, s, 3s]`: query i of a block sees key slot j of its 3 key blocks, i − j + s positions back."""
    dist = size + torch.arange(size, device=device)[:, None] - torch.arange(3 * size, device=device)
    dil = torch.tensor(list(dilation), device=device)[:, None, None]
    ok = (dist.abs() <= window * dil) & (dist % dil == 0)
    return ok & (dist >= 0) if causal else ok


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

    size = block_size(t, window, dilation)
    n = -(-t // size)
    qb = F.pad(q, (0, 0, 0, n * size - t)).unflatten(2, (n, size))  # [B, H, n, s, D]
    key_pos = (torch.arange(n, device=q.device)[:, None] - 1) * size + torch.arange(3 * size, device=q.device)
    key_ok = ((key_pos >= 0) & (key_pos < t))[None]  # [1, n, 3s]
    shared_k, shared_v, shared_ok = [], [], []
    if global_mask is not None:
        key_ok = key_ok & ~global_mask[:, key_pos.clamp(0, t - 1)]
        count = global_mask.sum(-1)
        gpos = torch.argsort((~global_mask).to(torch.int8), dim=-1, stable=True)[:, : int(count.max())]  # [B, G]
        gok = torch.arange(gpos.shape[1], device=q.device) < count[:, None]
        shared_k.append(_take(k, gpos))
        shared_v.append(_take(v, gpos))
        padded_rows = torch.arange(n * size, device=q.device)
        seen = (gok[:, None, :] & (gpos[:, None, :] <= padded_rows[:, None])) if causal else gok[:, None, :]
        shared_ok.append(seen.expand(b, n * size, -1))
    if persistent_key is not None:
        pk = persistent_key.to(dtype).expand(b, *persistent_key.shape[-3:])
        pv = persistent_value.to(dtype).expand(b, *persistent_value.shape[-3:])
        shared_k.append(pk)
        shared_v.append(pv)
        shared_ok.append(torch.ones(b, n * size, pk.shape[2], dtype=torch.bool, device=q.device))

    # padding rows past T may see no key: the lowest finite score keeps their (discarded) softmax finite
    ok = band_mask(size, window, dilation, causal, q.device)[None, :, None] & key_ok[:, None, :, None, :]
    lowest = torch.finfo(dtype).min
    scores = (qb @ key_blocks(k, size, n).transpose(-1, -2)).masked_fill(~ok, lowest)  # [B, H, n, s, 3s]
    vb = key_blocks(v, size, n)
    if not shared_k:
        out = scores.softmax(-1) @ vb
    else:
        sk, sv = torch.cat(shared_k, 2)[:, :, None], torch.cat(shared_v, 2)[:, :, None]
        sok = torch.cat(shared_ok, -1).unflatten(1, (n, size))[:, None]  # [B, 1, n, s, G+P]
        shared = (qb @ sk.transpose(-1, -2)).masked_fill(~sok, float("-inf"))
        probs = torch.cat([scores, shared], -1).softmax(-1)
        out = probs[..., : 3 * size] @ vb + probs[..., 3 * size :] @ sv
    out = out.flatten(2, 3)[:, :, :t]  # [B, H, T, D_v]

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
