"""ONNX side of CacheAttention: the opaque node emitted under export and its model-local function.

Node `edgemem::CacheAttention` (contract, names and attributes in contract.py; every input present).
The body computes in float32 over sources [cache slots ‖ new tokens] (L + T of them): each
source's position (slot_positions in op.py), a mask per query (held, causal, inside the sink
window), one softmax, and the present cache as a gather of, per slot, its newest source. It
rewrites the whole cache (a copy per run); the `ort` target's GroupQueryAttention writes the new
rows in place instead.
"""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto

from edgemem.ops.cache_attention.contract import ATTRIBUTES, INPUTS, OP_TYPE, OUTPUTS
from edgemem.ops.node import emit_node
from edgemem.opset import body

MIN_OPSET = 18
_FLOAT = TensorProto.FLOAT


def emit(query, key, value, past_key, past_value, position, sink_query, **attrs) -> tuple[torch.Tensor, ...]:
    """Under `torch.onnx.export`: one opaque `edgemem::CacheAttention` node."""
    output, present_key, present_value = emit_node(
        OP_TYPE,
        ATTRIBUTES,
        (query, key, value, past_key, past_value, position, sink_query),
        attrs,
        dtypes=(query.dtype, past_key.dtype, past_value.dtype),
        shapes=(query.shape, past_key.shape, past_value.shape),
    )
    return output, present_key, present_value


def function(opset: int = 20) -> onnx.FunctionProto:
    """The model-local function `edgemem::CacheAttention`, body in standard ops at `opset` (≥ 18)."""
    g = body(OP_TYPE, INPUTS, ATTRIBUTES, opset, MIN_OPSET)
    zero, one = g.const(0, out="zero"), g.const(1, out="one")
    heads, kv_heads, sinks, scale = (g.attr(n) for n in ("num_heads", "kv_num_heads", "sinks", "scale"))
    B1 = g.Shape("query", start=0, end=1, out="B1")
    T1 = g.Shape("query", start=1, end=2, out="T1")
    L1 = g.Shape("past_key", start=2, end=3, out="L1")
    D1 = g.Shape("past_key", start=3, out="D1")
    T, L = g.Squeeze(T1, out="T"), g.Squeeze(L1, out="L")
    H1, Hkv1 = g.Unsqueeze(heads, g.const([0])), g.Unsqueeze(kv_heads, g.const([0]))
    group1 = g.Div(H1, Hkv1, out="group1")
    sink_end = g.Where(g.Less(sinks, zero), L, sinks, out="sink_end")
    ring = g.Max(g.Sub(L, sink_end), one, out="ring")
    slots = g.Range(zero, L, one, out="slots")  # [L]
    position = g.Unsqueeze("position", g.const([1]), out="position_b1")  # [B, 1]

    # source positions [B, L+T] and whether each is held
    last_old = g.Sub(position, one)
    ring_pos = g.Sub(last_old, g.Mod(g.Sub(last_old, slots), ring), out="ring_pos")
    is_sink = g.Less(slots, sink_end, out="is_sink")
    held = g.Or(
        g.And(is_sink, g.Less(slots, position)), g.And(g.Not(is_sink), g.GreaterOrEqual(ring_pos, sink_end)), out="held"
    )
    old_pos = g.Where(is_sink, slots, ring_pos, out="old_pos")
    new_pos = g.Add(position, g.Range(zero, T, one), out="new_pos")  # [B, T]
    src_pos = g.Unsqueeze(g.Concat(old_pos, new_pos, axis=1), g.const([1, 2]), out="src_pos")  # [B, 1, 1, L+T]
    src_held = g.Unsqueeze(g.Concat(held, g.Expand(g.const(True), g.Shape(new_pos)), axis=1), g.const([1, 2]))
    q_pos = g.Unsqueeze(new_pos, g.const([1, 3]), out="q_pos")  # [B, 1, T, 1]
    window = g.Or(g.Less(src_pos, sink_end), g.Greater(src_pos, g.Sub(q_pos, ring)))
    visible = g.And(g.And(src_held, g.LessOrEqual(src_pos, q_pos)), window, out="visible")

    def split_heads(name: str, n: str) -> str:  # [B, T, n*D] → float32 [B, n, T, D]
        shape = g.Concat(B1, T1, n, D1, axis=0)
        return g.Transpose(g.Reshape(g.Cast(name, to=_FLOAT), shape), perm=[0, 2, 1, 3], out=f"{name}_heads")

    src_k = g.Concat(g.Cast("past_key", to=_FLOAT), split_heads("key", Hkv1), axis=2, out="src_k")
    src_v = g.Concat(g.Cast("past_value", to=_FLOAT), split_heads("value", Hkv1), axis=2, out="src_v")
    # GQA: [B, H_kv, S, D] → [B, H_kv, group, S, D] → [B, H, S, D]
    S1 = g.Add(L1, T1, out="S1")
    wide = g.Concat(B1, Hkv1, group1, S1, D1, axis=0)
    flat = g.Concat(B1, H1, S1, D1, axis=0)
    keys = g.Reshape(g.Expand(g.Unsqueeze(src_k, g.const([2])), wide), flat, out="keys")
    values = g.Reshape(g.Expand(g.Unsqueeze(src_v, g.const([2])), wide), flat, out="values")
    keys_t = g.Transpose(keys, perm=[0, 1, 3, 2])
    scores = g.Where(
        g.Less(src_pos, sink_end),
        g.MatMul(split_heads("sink_query", H1), keys_t),
        g.MatMul(split_heads("query", H1), keys_t),
    )
    masked = g.Where(visible, g.Mul(scores, scale), g.const(-np.inf), out="masked")
    out = g.MatMul(g.Softmax(masked, axis=3), values, out="out")  # [B, H, T, D]
    packed = g.Reshape(g.Transpose(out, perm=[0, 2, 1, 3]), g.Shape("query"), out="packed")
    g.CastLike(packed, "query", out="output")

    # present: slot c keeps its newest new token, else its old content
    last = g.Add(position, g.Sub(T, one), out="last")
    newest = g.Sub(last, g.Mod(g.Sub(last, slots), ring), out="newest")  # [B, L]
    j = g.Where(is_sink, g.Sub(slots, position), g.Sub(newest, position), out="j")
    new = g.And(
        g.And(g.GreaterOrEqual(j, zero), g.Less(j, T)), g.Or(is_sink, g.GreaterOrEqual(newest, sink_end)), out="new"
    )
    keep = g.Unsqueeze(g.Where(new, g.Add(L, j), g.Expand(slots, g.Shape(j))), g.const([1, 3]), out="keep")
    index = g.Expand(keep, g.Concat(B1, Hkv1, L1, D1, axis=0), out="index")  # [B, H_kv, L, D]
    g.CastLike(g.GatherElements(src_k, index, axis=2), "past_key", out="present_key")
    g.CastLike(g.GatherElements(src_v, index, axis=2), "past_value", out="present_value")
    return g.function(OP_TYPE, INPUTS, OUTPUTS, opset, __doc__)
