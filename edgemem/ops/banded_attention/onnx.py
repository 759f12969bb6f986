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
no T×T tensor: Longformer's blocked band (chunk.py), queries in blocks of s = window·max(dilation)
(at most T; T padded to a multiple of s), each block scoring the 3s keys of the previous, its own
and the next key block in one MatMul (`[B, H, T/s, s, 3s]`) under one `[H, s, 3s]` band mask; the
G global and P persistent keys are scored once per query (`[B, H, T/s, s, G+P]`), one softmax runs
over band ∪ globals ∪ persistent, and the G global queries (a per-sequence padded set found with
TopK) attend every key (`[B, H, T+P, G]`) and overwrite their rows with ScatterND.
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
    axis0, one1 = g.const([0], out="axis0"), g.const([1], out="one1")
    neg_inf = g.const(-np.inf, out="neg_inf")
    lowest = g.const(np.finfo(np.float32).min, out="lowest")
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

    # Longformer's blocked band (chunk.py): queries in blocks of s = window·max(dilation), at most T,
    # with T padded to n·s; block c scores the 3s keys of key blocks c−1, c, c+1
    size = g.Max(g.Min(g.Mul(window, g.ReduceMax(dilation, keepdims=0)), T), one, out="size")
    blocks = g.Div(g.Sub(g.Add(T, size), one), size, out="blocks")  # n = ⌈T/s⌉
    S1, N1 = g.Unsqueeze(size, axis0, out="S1"), g.Unsqueeze(blocks, axis0, out="N1")
    padded_T1 = g.Mul(N1, S1, out="padded_T1")
    width = g.Mul(size, g.const(3), out="width")  # 3s

    def time_pad(x: str, before: str, after: str, name: str) -> str:
        """x `[B, H, T, ·]` with `before` and `after` zero rows around its time axis."""
        return g.Pad(x, g.Concat(g.const([0, 0]), before, g.const([0, 0, 0]), after, g.const([0]), axis=0), out=name)

    q_pad = time_pad(q, g.const([0]), g.Sub(padded_T1, T1), "q_pad")
    q_blocks = g.Reshape(q_pad, g.Concat(B1, H1, N1, S1, D1, axis=0), out="q_blocks")  # [B, H, n, s, D]

    def key_blocks(x: str, dim1: str, name: str) -> str:
        """x `[B, H, T, dim]` → `[B, H, n, 3s, dim]`: block c holds positions (c−1)·s … (c+2)·s − 1, zeros outside."""
        x = time_pad(x, S1, g.Sub(g.Add(padded_T1, S1), T1), f"{name}_pad")
        x = g.Reshape(x, g.Concat(B1, H1, g.Add(N1, g.const([2])), S1, dim1, axis=0), out=f"{name}_split")
        shifted = [g.Slice(x, g.const([i]), g.Add(N1, g.const([i])), g.const([2])) for i in range(3)]
        return g.Concat(*shifted, axis=3, out=name)

    k_blocks = key_blocks(g.Transpose(k_bthd, perm=[0, 2, 1, 3]), D1, "k_blocks")
    # values carry a column of ones, so the products below also sum the softmax's numerators
    v_ones = g.Concat(v_bthd, g.Expand(g.const(1.0), g.Concat(B1, T1, H1, one1, axis=0)), axis=3, out="v_ones")
    Dv1p = g.Add(Dv1, one1, out="Dv1p")
    v_blocks = key_blocks(g.Transpose(v_ones, perm=[0, 2, 1, 3]), Dv1p, "v_blocks")  # [B, H, n, 3s, D_v+1]

    # query i of a block and key slot j are s + i − j apart in every block: one [H, s, 3s] band
    dist = g.Sub(
        g.Add(size, g.Unsqueeze(g.Range(zero, size, one), g.const([1]))), g.Range(zero, width, one), out="dist"
    )  # [s, 3s]
    dil = g.Unsqueeze(dilation, g.const([1, 2]), out="dil")  # [H, 1, 1]
    in_band = g.And(
        g.LessOrEqual(g.Abs(dist), g.Mul(window, dil)), g.Equal(g.Mod(dist, dil), zero), out="in_band"
    )  # [H, s, 3s]
    in_band = g.And(in_band, g.Or(g.Not(causal), g.GreaterOrEqual(dist, zero)), out="in_band_causal")
    key_pos = g.Add(
        g.Mul(g.Sub(g.Unsqueeze(g.Range(zero, blocks, one), g.const([1])), one), size),
        g.Range(zero, width, one),
        out="key_pos",
    )  # [n, 3s]
    last = g.Max(g.Sub(T, one), zero, out="last")
    in_seq = g.And(g.GreaterOrEqual(key_pos, zero), g.Less(key_pos, T), out="in_seq")
    key_is_global = g.Gather("global_mask", g.Clip(key_pos, zero, last), axis=1, out="key_is_global")  # [B, n, 3s]
    key_ok = g.And(in_seq, g.Not(key_is_global), out="key_ok")  # global keys are scored once, below
    band_ok = g.And(
        g.Unsqueeze(in_band, g.const([0, 2])), g.Unsqueeze(key_ok, g.const([1, 3])), out="band_ok"
    )  # [B, H, n, s, 3s]
    band_dot = g.MatMul(q_blocks, g.Transpose(k_blocks, perm=[0, 1, 2, 4, 3]), out="band_dot")
    # padding rows past T may see no key: the lowest finite score keeps their (discarded) sums finite
    band_scores = g.Where(band_ok, band_dot, lowest, out="band_scores")

    # global tokens: per sequence, positions sorted with the globals first, padded to G = max count
    count = g.ReduceSum(g.Cast("global_mask", to=_INT64), g.const([1]), keepdims=0, out="global_count")  # [B]
    G1 = g.ReduceMax(count, keepdims=1, out="G1")
    order = g.Where("global_mask", rows, g.Add(rows, T), out="global_order")  # [B, T], all distinct
    gpos = g.TopK(order, G1, axis=1, largest=0, sorted=1, out=["_global_order_top", "gpos"])[1]  # [B, G]
    g_real = g.Less(
        g.Range(zero, g.Squeeze(G1), one), g.Unsqueeze(count, g.const([1])), out="g_real"
    )  # [B, G]: slot holds a global token, not padding
    batch_t = g.Mul(batch, T, out="batch_t")  # b·T
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
    GP1 = g.Shape(shared_k, start=2, end=3, out="GP1")
    shared_v = g.Concat(
        g.Concat(v_glob, pv, axis=2), g.Expand(g.const(1.0), g.Concat(B1, H1, GP1, one1, axis=0)), axis=3
    )
    shared_v = g.Unsqueeze(shared_v, g.const([2]), out="shared_v")  # [B, H, 1, G+P, D_v+1]
    shared_dot = g.MatMul(
        q_blocks, g.Transpose(g.Unsqueeze(shared_k, g.const([2])), perm=[0, 1, 2, 4, 3]), out="shared_dot"
    )  # [B, H, n, s, G+P]
    padded_rows = g.Range(zero, g.Squeeze(padded_T1), one, out="padded_rows")
    glob_seen = g.Or(
        g.Not(causal),
        g.LessOrEqual(g.Unsqueeze(gpos, g.const([1])), g.Unsqueeze(padded_rows, g.const([1]))),
        out="glob_seen",
    )  # [B, n·s, G]
    glob_ok = g.And(glob_seen, g.Unsqueeze(g_real, g.const([1])), out="glob_ok")
    pers_ok = g.ConstantOfShape(g.Concat(B1, padded_T1, P1, axis=0), value=true, out="pers_ok")  # [B, n·s, P]
    shared_ok = g.Reshape(
        g.Concat(glob_ok, pers_ok, axis=2), g.Concat(B1, one1, N1, S1, GP1, axis=0), allowzero=1, out="shared_ok"
    )  # [B, 1, n, s, G+P]
    shared_scores = g.Where(shared_ok, shared_dot, neg_inf, out="shared_scores")

    # one softmax over band ∪ globals ∪ persistent: exp(x − max) times [values ‖ 1], then one division
    axis4 = g.const([4])
    top = g.ReduceMax(
        g.Concat(g.ReduceMax(band_scores, axis4, keepdims=1), shared_scores, axis=4), axis4, keepdims=1, out="top"
    )  # [B, H, n, s, 1]
    weighted = g.Add(
        g.MatMul(g.Exp(g.Sub(band_scores, top)), v_blocks),
        g.MatMul(g.Exp(g.Sub(shared_scores, top)), shared_v),
        out="weighted",
    )  # [B, H, n, s, D_v+1]
    out_blocks = g.Div(
        g.Slice(weighted, g.const([0]), Dv1, axis4), g.Slice(weighted, Dv1, g.const([_LAST]), axis4), out="out_blocks"
    )
    out = g.Slice(
        g.Reshape(out_blocks, g.Concat(B1, H1, padded_T1, Dv1, axis=0)), g.const([0]), T1, g.const([2]), out="out_bhtd"
    )
    out = g.Transpose(out, perm=[0, 2, 1, 3], out="out")  # [B, T, H, D_v]

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
