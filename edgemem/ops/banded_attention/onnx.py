"""ONNX side of BandedAttention: the opaque node emitted under export and its model-local function.

Node `edgemem::BandedAttention` (names and attributes in contract.py). Every input is always present, so one
function body serves every call (the torch side materialises the defaults):

    query            [B, T, H*D]    float16 | float32
    key              [B, T, H*D]    query's type
    value            [B, T, H*D_v]  query's type
    global_mask      [B, T]         bool; all False for "no global tokens"
    persistent_key   [B, H, P, D]   float16 | float32; per sequence (a shared [H, P, D] is
                                    expanded over B), P = 0 for "no persistent tokens"
    persistent_value [B, H, P, D_v] persistent_key's type
    → output         [B, T, H*D_v]  query's type

Attributes: num_heads (INT), window (INT ≥ 1, one-sided), dilation (INTS, one per head),
causal (INT 0/1), scale (FLOAT, already resolved: D^-½ when the user gave none).

The function body uses standard ONNX ops at the model's opset, computes in float32 and builds
no T×T tensor: every query gathers its dilated band of keys (`[B, H, T, K, D]`, K = 2w+1 or
w+1 for causal), the G global and P persistent keys are scored once per query
(`[B, H, T, G+P]`), one softmax runs over band ∪ globals ∪ persistent, and the G global
queries (a per-sequence padded set found with TopK) attend every key (`[B, H, T+P, G]`) and
overwrite their rows with ScatterND.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import torch
from onnx import TensorProto, numpy_helper

from edgemem.ops.banded_attention.contract import ATTRIBUTES, INPUTS, OP_TYPE, OUTPUTS
from edgemem.ops.node import emit_node
from edgemem.opset import body

MIN_OPSET = 18  # Reduce* and Split take their axes as inputs from 18 on

_FLOAT, _INT64, _BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
_LAST = np.iinfo(np.int64).max  # Slice "to the end"


def persistent_inputs(
    query: torch.Tensor,
    value: torch.Tensor,
    persistent_key: torch.Tensor | None,
    persistent_value: torch.Tensor | None,
    num_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The persistent K/V inputs of a node: `[B, H, P, D]`, `[B, H, P, D_v]`; a shared `[H, P, D]`
    pair is expanded over B, and none becomes P = 0."""
    b = query.shape[0]
    if persistent_key is None:
        d, dv = query.shape[2] // num_heads, value.shape[2] // num_heads
        return query.new_zeros(b, num_heads, 0, d), query.new_zeros(b, num_heads, 0, dv)
    if persistent_key.dim() == 3:
        return persistent_key.expand(b, *persistent_key.shape), persistent_value.expand(b, *persistent_value.shape)
    return persistent_key, persistent_value


def emit(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    global_mask: torch.Tensor | None,
    persistent_key: torch.Tensor | None,
    persistent_value: torch.Tensor | None,
    *,
    num_heads: int,
    window: int,
    dilation: Sequence[int],
    causal: bool,
    scale: float,
) -> torch.Tensor:
    """Under `torch.onnx.export`: one opaque `edgemem::BandedAttention` node over validated,
    packed tensors (query, key `[B, T, H*D]`, value `[B, T, H*D_v]`), defaults materialised."""
    b, t, _ = query.shape
    if global_mask is None:
        global_mask = torch.zeros(b, t, dtype=torch.bool, device=query.device)
    persistent = persistent_inputs(query, value, persistent_key, persistent_value, num_heads)
    (output,) = emit_node(
        OP_TYPE,
        ATTRIBUTES,
        (query, key, value, global_mask, *persistent),
        dict(num_heads=num_heads, window=window, dilation=dilation, causal=int(bool(causal)), scale=scale),
        dtypes=[query.dtype],
        shapes=[(b, t, value.shape[2])],
    )
    return output


def function(opset: int = 20) -> onnx.FunctionProto:
    """The model-local function `edgemem::BandedAttention`, body in standard ops at `opset` (≥ 18)."""
    g = body(OP_TYPE, INPUTS, ATTRIBUTES, opset, MIN_OPSET)
    zero, one = g.const(0, out="zero"), g.const(1, out="one")
    axis0 = g.const([0], out="axis0")
    neg_inf = g.const(-np.inf, out="neg_inf")
    true = numpy_helper.from_array(np.array([True]))

    # attributes and sizes
    heads, window, dilation, scale = (g.attr(name) for name in ("num_heads", "window", "dilation", "scale"))
    causal = g.Cast(g.attr("causal"), to=_BOOL, out="is_causal")
    B1 = g.Shape("query", start=0, end=1, out="B1")
    T1 = g.Shape("query", start=1, end=2, out="T1")
    P1 = g.Shape("persistent_key", start=2, end=3, out="P1")
    H1 = g.Unsqueeze(heads, axis0, out="H1")
    T = g.Squeeze(T1, out="T")
    D1 = g.Div(g.Shape("query", start=2), H1, out="D1")
    Dv1 = g.Div(g.Shape("value", start=2), H1, out="Dv1")
    BTH1 = g.Mul(g.Mul(B1, T1), H1, out="BTH1")
    batch = g.Range(zero, g.Squeeze(B1), one, out="batch")  # [B]
    head = g.Range(zero, heads, one, out="head")  # [H]
    rows = g.Range(zero, T, one, out="rows")  # [T]

    # float32 tensors: [B, T, H, D] and the same as rows (b·T + t)·H + h of [B·T·H, D]
    q_bthd = g.Reshape(g.Mul(g.Cast("query", to=_FLOAT), scale), g.Concat(B1, T1, H1, D1, axis=0), out="q_bthd")
    k_bthd = g.Reshape(g.Cast("key", to=_FLOAT), g.Concat(B1, T1, H1, D1, axis=0), out="k_bthd")
    v_bthd = g.Reshape(g.Cast("value", to=_FLOAT), g.Concat(B1, T1, H1, Dv1, axis=0), out="v_bthd")
    q_rows = g.Reshape(q_bthd, g.Concat(BTH1, D1, axis=0), out="q_rows")
    k_rows = g.Reshape(k_bthd, g.Concat(BTH1, D1, axis=0), out="k_rows")
    v_rows = g.Reshape(v_bthd, g.Concat(BTH1, Dv1, axis=0), out="v_rows")
    q = g.Transpose(q_bthd, perm=[0, 2, 1, 3], out="q")  # [B, H, T, D]
    pk = g.Cast("persistent_key", to=_FLOAT, out="pk")  # [B, H, P, D]
    pv = g.Cast("persistent_value", to=_FLOAT, out="pv")

    # the band: slot o of query t in head h is key t + offset_o·dilation_h; offsets past T−1 never hit
    last = g.Max(g.Sub(T, one), zero, out="last")
    w = g.Min(window, last, out="w")
    band_end = g.Add(g.Mul(g.Sub(one, g.Cast(causal, to=_INT64)), w), one, out="band_end")  # 1, or w+1
    offsets = g.Range(g.Neg(w), band_end, one, out="offsets")  # [K]
    band_pos = g.Add(
        g.Unsqueeze(rows, g.const([0, 2])), g.Mul(g.Unsqueeze(dilation, g.const([1, 2])), offsets), out="band_pos"
    )  # [H, T, K]
    in_seq = g.And(g.GreaterOrEqual(band_pos, zero), g.Less(band_pos, T), out="in_seq")
    band_pos_c = g.Clip(band_pos, zero, last, out="band_pos_clamped")
    batch_t = g.Mul(batch, T, out="batch_t")  # b·T
    band_rows = g.Add(
        g.Mul(g.Add(g.Unsqueeze(batch_t, g.const([1, 2, 3])), band_pos_c), heads),
        g.Unsqueeze(head, g.const([1, 2])),
        out="band_rows",
    )  # [B, H, T, K]
    k_band = g.Gather(k_rows, band_rows, axis=0, out="k_band")  # [B, H, T, K, D]
    v_band = g.Gather(v_rows, band_rows, axis=0, out="v_band")  # [B, H, T, K, D_v]
    band_dot = g.Squeeze(g.MatMul(k_band, g.Unsqueeze(q, g.const([4]))), g.const([4]), out="band_dot")
    band_is_global = g.Gather("global_mask", band_pos_c, axis=1, out="band_is_global")  # [B, H, T, K]
    band_ok = g.And(in_seq, g.Not(band_is_global), out="band_ok")  # global keys are scored once, below
    band_scores = g.Where(band_ok, band_dot, neg_inf, out="band_scores")

    # global tokens: per sequence, positions sorted with the globals first, padded to G = max count
    count = g.ReduceSum(g.Cast("global_mask", to=_INT64), g.const([1]), keepdims=0, out="global_count")  # [B]
    G1 = g.ReduceMax(count, keepdims=1, out="G1")
    order = g.Where("global_mask", rows, g.Add(rows, T), out="global_order")  # [B, T], all distinct
    gpos = g.TopK(order, G1, axis=1, largest=0, sorted=1, out=["_global_order_top", "gpos"])[1]  # [B, G]
    g_real = g.Less(
        g.Range(zero, g.Squeeze(G1), one), g.Unsqueeze(count, g.const([1])), out="g_real"
    )  # [B, G]: slot holds a global token, not padding
    g_rows = g.Add(
        g.Mul(g.Add(g.Unsqueeze(batch_t, g.const([1, 2])), g.Unsqueeze(gpos, g.const([1]))), heads),
        g.Unsqueeze(head, g.const([1])),
        out="g_rows",
    )  # [B, H, G]
    k_glob = g.Gather(k_rows, g_rows, axis=0, out="k_glob")  # [B, H, G, D]
    v_glob = g.Gather(v_rows, g_rows, axis=0, out="v_glob")
    q_glob = g.Gather(q_rows, g_rows, axis=0, out="q_glob")

    # keys every query sees: the globals (causal: those not after it) and the persistent tokens
    shared_k = g.Concat(k_glob, pk, axis=2, out="shared_k")  # [B, H, G+P, D]
    shared_v = g.Concat(v_glob, pv, axis=2, out="shared_v")
    shared_dot = g.MatMul(q, g.Transpose(shared_k, perm=[0, 1, 3, 2]), out="shared_dot")  # [B, H, T, G+P]
    glob_seen = g.Or(
        g.Not(causal), g.LessOrEqual(g.Unsqueeze(gpos, g.const([1])), g.Unsqueeze(rows, g.const([1]))), out="glob_seen"
    )  # [B, T, G]
    glob_ok = g.And(glob_seen, g.Unsqueeze(g_real, g.const([1])), out="glob_ok")
    pers_ok = g.ConstantOfShape(g.Concat(B1, T1, P1, axis=0), value=true, out="pers_ok")  # [B, T, P]
    shared_ok = g.Unsqueeze(g.Concat(glob_ok, pers_ok, axis=2), g.const([1]), out="shared_ok")  # [B, 1, T, G+P]
    shared_scores = g.Where(shared_ok, shared_dot, neg_inf, out="shared_scores")

    # one softmax over band ∪ globals ∪ persistent
    probs = g.Softmax(g.Concat(band_scores, shared_scores, axis=3), axis=3, out="probs")
    K1 = g.Shape(offsets, out="K1")
    band_probs = g.Slice(probs, g.const([0]), K1, g.const([3]), out="band_probs")
    shared_probs = g.Slice(probs, K1, g.const([_LAST]), g.const([3]), out="shared_probs")
    band_out = g.Squeeze(g.MatMul(g.Unsqueeze(band_probs, g.const([3])), v_band), g.const([3]), out="band_out")
    shared_out = g.MatMul(shared_probs, shared_v, out="shared_out")
    out = g.Transpose(g.Add(band_out, shared_out), perm=[0, 2, 1, 3], out="out")  # [B, T, H, D_v]

    # global queries attend every key of their sequence (causal: up to themselves) and the persistent ones
    k_all = g.Concat(g.Transpose(k_bthd, perm=[0, 2, 1, 3]), pk, axis=2, out="k_all")  # [B, H, T+P, D]
    v_all = g.Concat(g.Transpose(v_bthd, perm=[0, 2, 1, 3]), pv, axis=2, out="v_all")
    gq_dot = g.MatMul(k_all, g.Transpose(q_glob, perm=[0, 1, 3, 2]), out="gq_dot")  # [B, H, T+P, G]
    future = g.And(
        causal, g.Greater(g.Unsqueeze(rows, g.const([0, 2])), g.Unsqueeze(gpos, g.const([1]))), out="gq_future"
    )  # [B, T, G]
    gq_pers_ok = g.ConstantOfShape(g.Concat(B1, P1, G1, axis=0), value=true, out="gq_pers_ok")  # [B, P, G]
    gq_ok = g.Unsqueeze(g.Concat(g.Not(future), gq_pers_ok, axis=1), g.const([1]), out="gq_ok")  # [B, 1, T+P, G]
    gq_probs = g.Softmax(g.Where(gq_ok, gq_dot, neg_inf), axis=2, out="gq_probs")
    gq_out = g.Transpose(
        g.MatMul(g.Transpose(gq_probs, perm=[0, 1, 3, 2]), v_all), perm=[0, 2, 1, 3], out="gq_out"
    )  # [B, G, H, D_v]

    # write the global rows back; padding slots rewrite the (distinct) row they point at unchanged
    g_batch = g.Expand(g.Unsqueeze(batch, g.const([1])), g.Shape(gpos), out="g_batch")  # [B, G]
    g_index = g.Concat(
        g.Unsqueeze(g_batch, g.const([2])), g.Unsqueeze(gpos, g.const([2])), axis=2, out="g_index"
    )  # [B, G, 2]
    g_update = g.Where(
        g.Unsqueeze(g_real, g.const([2, 3])), gq_out, g.GatherND(out, g_index), out="g_update"
    )  # [B, G, H, D_v]
    out = g.ScatterND(out, g_index, g_update, out="out_with_globals")
    packed = g.Reshape(out, g.Concat(B1, T1, g.Shape("value", start=2), axis=0), out="packed")
    g.CastLike(packed, "query", out="output")
    return g.function(OP_TYPE, INPUTS, OUTPUTS, opset, __doc__)
