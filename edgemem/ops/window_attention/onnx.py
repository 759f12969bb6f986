"""ONNX side of WindowAttention: the opaque node emitted under export and its model-local function.

Node `edgemem::WindowAttention` (names and attributes in contract.py). Every input is always present, so one
function body serves every call (the torch side materialises the defaults):

    query            [B, T, H*D]    float16 | float32
    key              [B, T, H*D]    query's type
    value            [B, T, H*D_v]  query's type
    past_key         [B, H, L, D]   float16 | float32: ring buffer, position a in slot a mod L,
                                    L = window·max(dilation)
    past_value       [B, H, L, D_v] float16 | float32
    position         [B]            int64: absolute index of each stream's first new token
    persistent_key   [B, H, P, D]   float16 | float32; per sequence (a shared [H, P, D] is
                                    expanded over B), P = 0 for "no persistent tokens"
    persistent_value [B, H, P, D_v] persistent_key's type
    → output         [B, T, H*D_v]  query's type
    → present_key    [B, H, L, D]   past_key's type: the L tokens before position + T
    → present_value  [B, H, L, D_v] past_value's type

Attributes: num_heads (INT), window (INT ≥ 1), dilation (INTS, one per head), scale (FLOAT,
already resolved).

The body computes in float32 at O(T·window + L): sources are [ring ‖ new tokens]; the token at
position p gathers, per head, its window+1 keys p − o·d_h (a new token, or ring slot
(p − o·d_h) mod L; negative positions masked) and one softmax runs over them and the persistent
tokens. The present ring gathers, for each slot s, the newest position ≡ s (mod L) below
position + T from the same sources, so a block longer than the ring writes each slot once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import torch
from onnx import TensorProto

from edgemem.ops.banded_attention.onnx import MIN_OPSET, persistent_inputs
from edgemem.ops.node import emit_node
from edgemem.ops.window_attention.contract import ATTRIBUTES, INPUTS, OP_TYPE, OUTPUTS
from edgemem.opset import body

_FLOAT, _INT64 = TensorProto.FLOAT, TensorProto.INT64
_LAST = np.iinfo(np.int64).max  # Slice "to the end"


def emit(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    position: torch.Tensor,
    persistent_key: torch.Tensor | None,
    persistent_value: torch.Tensor | None,
    *,
    num_heads: int,
    window: int,
    dilation: Sequence[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Under `torch.onnx.export`: one opaque `edgemem::WindowAttention` node over validated,
    packed tensors (query, key `[B, T, H*D]`, value `[B, T, H*D_v]`, position int64 `[B]`),
    defaults materialised."""
    b, t, _ = query.shape
    persistent = persistent_inputs(query, value, persistent_key, persistent_value, num_heads)
    output, present_key, present_value = emit_node(
        OP_TYPE,
        ATTRIBUTES,
        (query, key, value, past_key, past_value, position, *persistent),
        dict(num_heads=num_heads, window=window, dilation=dilation, scale=scale),
        dtypes=(query.dtype, past_key.dtype, past_value.dtype),
        shapes=((b, t, value.shape[2]), past_key.shape, past_value.shape),
    )
    return output, present_key, present_value


def function(opset: int = 20) -> onnx.FunctionProto:
    """The model-local function `edgemem::WindowAttention`, body in standard ops at `opset` (≥ 18)."""
    g = body(OP_TYPE, INPUTS, ATTRIBUTES, opset, MIN_OPSET)
    zero, one = g.const(0, out="zero"), g.const(1, out="one")
    axis0 = g.const([0], out="axis0")
    neg_inf = g.const(-np.inf, out="neg_inf")

    # attributes and sizes
    heads, window, dilation, scale = (g.attr(name) for name in ("num_heads", "window", "dilation", "scale"))
    B1 = g.Shape("query", start=0, end=1, out="B1")
    T1 = g.Shape("query", start=1, end=2, out="T1")
    L1 = g.Shape("past_key", start=2, end=3, out="L1")
    H1 = g.Unsqueeze(heads, axis0, out="H1")
    T, L = g.Squeeze(T1, out="T"), g.Squeeze(L1, out="L")
    D1 = g.Div(g.Shape("query", start=2), H1, out="D1")
    Dv1 = g.Div(g.Shape("value", start=2), H1, out="Dv1")
    LT1 = g.Add(L1, T1, out="LT1")
    rows1 = g.Mul(g.Mul(B1, H1), LT1, out="rows1")  # B·H·(L+T)
    batch = g.Range(zero, g.Squeeze(B1), one, out="batch")  # [B]
    head = g.Range(zero, heads, one, out="head")  # [H]
    rows = g.Range(zero, T, one, out="rows")  # [T]
    position = g.Unsqueeze("position", g.const([1, 2, 3]), out="position_bhtk")  # [B, 1, 1, 1]

    # float32 query [B, H, T, D]; sources [ring ‖ new] flattened to rows (b·H + h)·(L+T) + s
    q = g.Transpose(
        g.Reshape(g.Mul(g.Cast("query", to=_FLOAT), scale), g.Concat(B1, T1, H1, D1, axis=0)),
        perm=[0, 2, 1, 3],
        out="q",
    )
    new_k = g.Transpose(g.Reshape(g.Cast("key", to=_FLOAT), g.Concat(B1, T1, H1, D1, axis=0)), perm=[0, 2, 1, 3])
    new_v = g.Transpose(g.Reshape(g.Cast("value", to=_FLOAT), g.Concat(B1, T1, H1, Dv1, axis=0)), perm=[0, 2, 1, 3])
    src_k = g.Concat(g.Cast("past_key", to=_FLOAT), new_k, axis=2, out="src_k")  # [B, H, L+T, D]
    src_v = g.Concat(g.Cast("past_value", to=_FLOAT), new_v, axis=2, out="src_v")
    k_rows = g.Reshape(src_k, g.Concat(rows1, D1, axis=0), out="k_rows")
    v_rows = g.Reshape(src_v, g.Concat(rows1, Dv1, axis=0), out="v_rows")
    base = g.Mul(
        g.Add(g.Mul(g.Unsqueeze(batch, g.const([1])), heads), g.Unsqueeze(head, axis0)), g.Squeeze(LT1), out="base"
    )  # [B, H]: the row of source 0

    # the band: slot o of new token t in head h holds relative position t − (window − o)·d_h
    offsets = g.Range(g.Neg(window), one, one, out="offsets")  # [K = window+1]
    rel = g.Add(
        g.Unsqueeze(rows, g.const([0, 2])), g.Mul(g.Unsqueeze(dilation, g.const([1, 2])), offsets), out="rel"
    )  # [H, T, K]
    absolute = g.Add(position, rel, out="absolute")  # [B, H, T, K]
    source = g.Where(g.GreaterOrEqual(rel, zero), g.Add(L, rel), g.Mod(absolute, L), out="source")  # new, or ring slot
    band_rows = g.Add(g.Unsqueeze(base, g.const([2, 3])), source, out="band_rows")
    k_band = g.Gather(k_rows, band_rows, axis=0, out="k_band")  # [B, H, T, K, D]
    v_band = g.Gather(v_rows, band_rows, axis=0, out="v_band")  # [B, H, T, K, D_v]
    band_dot = g.Squeeze(g.MatMul(k_band, g.Unsqueeze(q, g.const([4]))), g.const([4]), out="band_dot")
    band_scores = g.Where(g.GreaterOrEqual(absolute, zero), band_dot, neg_inf, out="band_scores")

    # one softmax over band ∪ persistent
    pk = g.Cast("persistent_key", to=_FLOAT, out="pk")  # [B, H, P, D]
    pv = g.Cast("persistent_value", to=_FLOAT, out="pv")
    pers_scores = g.MatMul(q, g.Transpose(pk, perm=[0, 1, 3, 2]), out="pers_scores")  # [B, H, T, P]
    probs = g.Softmax(g.Concat(band_scores, pers_scores, axis=3), axis=3, out="probs")
    K1 = g.Shape(offsets, out="K1")
    band_probs = g.Slice(probs, g.const([0]), K1, g.const([3]), out="band_probs")
    pers_probs = g.Slice(probs, K1, g.const([_LAST]), g.const([3]), out="pers_probs")
    band_out = g.Squeeze(g.MatMul(g.Unsqueeze(band_probs, g.const([3])), v_band), g.const([3]), out="band_out")
    out = g.Add(band_out, g.MatMul(pers_probs, pv), out="out")  # [B, H, T, D_v]
    packed = g.Reshape(
        g.Transpose(out, perm=[0, 2, 1, 3]), g.Concat(B1, T1, g.Shape("value", start=2), axis=0), out="packed"
    )
    g.CastLike(packed, "query", out="output")

    # the present ring: slot s takes the newest position ≡ s (mod L) below position + T
    slots = g.Range(zero, L, one, out="slots")  # [L]
    last = g.Sub(T, one, out="last")
    newest = g.Sub(
        last, g.Mod(g.Sub(g.Add(g.Unsqueeze("position", g.const([1])), last), slots), L), out="newest"
    )  # [B, L], relative to the first new token
    keep = g.Where(g.GreaterOrEqual(newest, zero), g.Add(L, newest), slots, out="keep")  # source of each slot
    keep_rows = g.Add(g.Unsqueeze(base, g.const([2])), g.Unsqueeze(keep, g.const([1])), out="keep_rows")  # [B, H, L]
    g.CastLike(g.Gather(k_rows, keep_rows, axis=0), "past_key", out="present_key")
    g.CastLike(g.Gather(v_rows, keep_rows, axis=0), "past_value", out="present_value")
    return g.function(OP_TYPE, INPUTS, OUTPUTS, opset, __doc__)
