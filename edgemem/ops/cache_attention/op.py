"""CacheAttention's PyTorch form (`cache_attention`, no custom op; the contract is in contract.py)
and, under `torch.onnx.export`, its opaque `edgemem::CacheAttention` node (onnx.py)."""

from __future__ import annotations

import torch

from edgemem.errors import ShapeError
from edgemem.ops.dtypes import compute_dtype


def slot_positions(position: torch.Tensor, length: int, sinks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For a cache of `length` slots before the tokens at `position` [B]: the position each slot
    holds and whether it holds one, both [B, L]."""
    sink_end = length if sinks < 0 else sinks
    ring = max(length - sink_end, 1)
    slots = torch.arange(length, device=position.device)
    last = position[:, None] - 1
    ring_pos = last - (last - slots) % ring  # the newest position ≡ slot (mod R) before `position`
    is_sink = slots < sink_end
    held = torch.where(is_sink, slots < position[:, None], ring_pos >= sink_end)
    return torch.where(is_sink, slots, ring_pos), held


def _attend(query, key, value, past_key, past_value, position, sink_query, num_heads, kv_num_heads, sinks, scale):
    b, t, _ = query.shape
    length, d = past_key.shape[2], past_key.shape[3]
    sink_end = length if sinks < 0 else sinks
    ring = max(length - sink_end, 1)
    dtype = compute_dtype(query)

    def heads(x: torch.Tensor, n: int) -> torch.Tensor:
        return x.to(dtype).unflatten(2, (n, d)).transpose(1, 2)

    group = num_heads // kv_num_heads
    src_k = torch.cat([past_key.to(dtype), heads(key, kv_num_heads)], 2)  # [B, H_kv, L+T, D]
    src_v = torch.cat([past_value.to(dtype), heads(value, kv_num_heads)], 2)
    old_pos, held = slot_positions(position, length, sinks)
    new_pos = position[:, None] + torch.arange(t, device=query.device)  # [B, T]
    src_pos = torch.cat([old_pos, new_pos], 1)[:, None, None]  # [B, 1, 1, L+T]
    src_held = torch.cat([held, torch.ones_like(new_pos, dtype=torch.bool)], 1)[:, None, None]
    q_pos = new_pos[:, None, :, None]  # [B, 1, T, 1]
    visible = src_held & (src_pos <= q_pos) & ((src_pos < sink_end) | (src_pos > q_pos - ring))
    keys = src_k.repeat_interleave(group, 1) if group > 1 else src_k
    values = src_v.repeat_interleave(group, 1) if group > 1 else src_v
    scores = heads(query, num_heads) @ keys.transpose(2, 3)
    if sink_query is not query:
        scores = torch.where(src_pos < sink_end, heads(sink_query, num_heads) @ keys.transpose(2, 3), scores)
    probs = (scores * scale).masked_fill(~visible, float("-inf")).softmax(-1)
    out = (probs @ values).transpose(1, 2).flatten(2).to(query.dtype)

    # slot c keeps the newest new token written there, else its old content
    slots = torch.arange(length, device=query.device)
    last = position[:, None] + t - 1
    newest = last - (last - slots) % ring  # [B, L]
    j = torch.where(slots < sink_end, slots - position[:, None], newest - position[:, None])
    new = (j >= 0) & (j < t) & ((slots < sink_end) | (newest >= sink_end))
    keep = torch.where(new, length + j, slots)[:, None, :, None]
    present_k = src_k.gather(2, keep.expand(b, kv_num_heads, length, d)).to(past_key.dtype)
    present_v = src_v.gather(2, keep.expand(b, kv_num_heads, length, d)).to(past_value.dtype)
    return out, present_k, present_v


def cache_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    position: torch.Tensor,
    sink_query: torch.Tensor | None = None,
    *,
    num_heads: int,
    kv_num_heads: int,
    sinks: int = -1,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output, present_key, present_value) for packed tensors; see contract.py."""
    op = "cache_attention"
    if query.dim() != 3 or past_key.dim() != 4 or past_key.shape != past_value.shape:
        raise ShapeError(
            f"{op}: query must be [B, T, H*D] and past_key/past_value one [B, H_kv, L, D] shape; got "
            f"{list(query.shape)}, {list(past_key.shape)}, {list(past_value.shape)}"
        )
    b, t, _ = query.shape
    length, d = past_key.shape[2], past_key.shape[3]
    want = {"query": (query, num_heads), "key": (key, kv_num_heads), "value": (value, kv_num_heads)}
    for name, (x, n) in want.items():
        if list(x.shape) != [b, t, n * d]:
            raise ShapeError(f"{op}: {name} has shape {list(x.shape)}; expected [{b}, {t}, {n * d}]")
    if list(past_key.shape[:2]) != [b, kv_num_heads] or num_heads % kv_num_heads:
        raise ShapeError(
            f"{op}: past_key has shape {list(past_key.shape)}; expected [{b}, {kv_num_heads}, L, {d}] "
            f"with num_heads ({num_heads}) a multiple of kv_num_heads"
        )
    if position.dtype != torch.int64 or list(position.shape) != [b]:
        raise ShapeError(f"{op}: position must be int64 [{b}]; got {position.dtype} {list(position.shape)}")
    if not -1 <= sinks < length:
        raise ShapeError(f"{op}: sinks must be -1 (linear cache) or in [0, L={length}); got {sinks}")
    sink_query = query if sink_query is None else sink_query
    scale = d**-0.5 if scale is None else float(scale)
    args = (query, key, value, past_key, past_value, position, sink_query)
    attrs = dict(num_heads=num_heads, kv_num_heads=kv_num_heads, sinks=sinks, scale=scale)
    if torch.onnx.is_in_onnx_export():
        from edgemem.ops.cache_attention.onnx import emit  # imports onnx only when exporting

        return emit(*args, **attrs)
    return _attend(*args, **attrs)
