"""The ONNX side of LinearAttention: one opaque `edgemem::LinearAttention` node and its body.

`emit` is what `linear_attention` calls while `torch.onnx.export` traces it: it writes one
node whose six inputs are always present (query, key, value, past_state, decay, beta —
missing ones are materialised as a zero state, zero log-decay and unit beta), so one
function body serves every update rule. `function(opset)` is that body as a model-local
FunctionProto made of standard ONNX ops at the model's opset, so any ONNX runtime can run
the node.

Node contract (`edgemem.opset` domain and version; names and attributes in contract.py):
    inputs   query [B,T,H_q*d_k] (T), key [B,T,H_kv*d_k] (T), value [B,T,H_kv*d_v] (T),
             past_state [B,H_kv,d_k,d_v] (S), decay [B,T,H_kv] or [B,T,H_kv*d_k] (T, log-space),
             beta [B,T,H_kv] or [B,T,1] (T);  T ∈ {float16, float32}, S = float32
    outputs  output [B,T,H_q*d_v] (T), present_state [B,H_kv,d_k,d_v] (S)
    attrs    update_rule (STRING), scale (FLOAT; emit writes the resolved value, d_k^-½ for 0),
             q_num_heads, kv_num_heads, chunk_size (INT)
The body needs opset >= 20 (RegexFullMatch).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from edgemem.ops.linear_attention.contract import ATTRIBUTES, INPUTS, OP_TYPE, OUTPUTS, check
from edgemem.ops.node import emit_node
from edgemem.opset import Graph, body

if TYPE_CHECKING:
    import onnx

MIN_OPSET = 20  # RegexFullMatch (reads update_rule) is new in opset 20


def emit(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_state: torch.Tensor | None,
    decay: torch.Tensor | None,
    beta: torch.Tensor | None,
    *,
    update_rule: str,
    scale: float,
    q_num_heads: int,
    kv_num_heads: int,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One `edgemem::LinearAttention` node (packed inputs) for the ONNX exporter.

    decay/beta/past_state are materialised when absent; key, value, decay and beta take the
    query's dtype, past_state becomes float32 (so does present_state). The scale attribute is
    the resolved value (d_k^-½ for 0)."""
    _, _, d_k, d_v = check(query, key, value, past_state, decay, beta, update_rule, q_num_heads, kv_num_heads)
    b, t, _ = query.shape
    dtype = query.dtype

    if past_state is None:
        past_state = query.new_zeros((b, kv_num_heads, d_k, d_v), dtype=torch.float32)
    if decay is None:
        decay = query.new_zeros((b, t, kv_num_heads))  # log-decay 0: no decay
    if beta is None:
        beta = query.new_ones((b, t, kv_num_heads))
    inputs = [key.to(dtype), value.to(dtype), past_state.to(torch.float32), decay.to(dtype), beta.to(dtype)]
    attrs = dict(
        update_rule=update_rule,
        scale=scale if scale else 1.0 / math.sqrt(d_k),
        q_num_heads=q_num_heads,
        kv_num_heads=kv_num_heads,
        chunk_size=chunk_size,
    )
    output, present_state = emit_node(
        OP_TYPE,
        ATTRIBUTES,
        [query, *inputs],
        attrs,
        dtypes=[dtype, torch.float32],
        shapes=[[b, t, q_num_heads * d_v], [b, kv_num_heads, d_k, d_v]],
    )
    return output, present_state


def _step(g: Graph, state: str, q: str, k_col: str, k_row: str, v_row: str, w: str) -> tuple[str, str]:
    """One token on operands without the time axis or with a time axis of 1 (`state` alike)."""
    decayed = g.Mul(state, w, out="decayed")  # w ⊙ S
    retrieved = g.MatMul(k_row, decayed, out="retrieved")  # (δβ'k)ᵀ S      [.., 1, d_v]
    written = g.Sub(v_row, retrieved, out="written")  # u = β'v − δβ' Sᵀk   [.., 1, d_v]
    update = g.MatMul(k_col, written, out="update")  # k uᵀ             [.., d_k, d_v]
    new_state = g.Add(decayed, update, out="state")
    read = g.MatMul(q, new_state, out="read")  # scale·Sᵀq per query head   [.., G, d_v]
    return new_state, read


def function(opset: int = 20) -> onnx.FunctionProto:
    """`edgemem::LinearAttention` in standard ONNX ops of the default domain at `opset` (≥ 20).

    Per token t and kv head (state S [d_k, d_v], float32; query head j reads kv head
    j // G, G = q_num_heads / kv_num_heads; δ = rule ∈ {delta, gated_delta}, γ = rule ∈
    {gated, gated_delta}, both 0/1 floats, so the rule needs no branch):

        S   ← w_t ⊙ S,  w_t = exp(γ·g_t)            (g_t per head or per key dim: rows of S)
        u_t = β'_t·v_t − δ·β'_t·Sᵀk_t,  β' = δ·β + (1 − δ)
        S   ← S + k_t u_tᵀ
        o_t = Sᵀ (scale·q_t)

    Everything that does not depend on the state — casts to float32, the head split, w, β'v,
    δβ'k, scale·q — is computed for all tokens up front, shaped for the step's MatMuls
    ([B, T, H, …]). T = 1 (decode) runs the six step ops (Mul, MatMul, Sub, MatMul, Add,
    MatMul) once on those tensors as they are; T > 1 runs them in a Loop over tokens that
    gathers token t of each operand and carries S. An If on T picks one (onnxruntime folds it
    when T is static). chunk_size is accepted and unused. An update_rule outside the four
    gives the linear rule.
    """
    from onnx import TensorProto

    FLOAT = TensorProto.FLOAT
    g = body(OP_TYPE, INPUTS, ATTRIBUTES, opset, MIN_OPSET)

    # --- attributes → tensors
    rule = g.attr("update_rule", out="rule")
    delta = g.Cast(g.RegexFullMatch(rule, pattern="(gated_)?delta", out="is_delta"), to=FLOAT, out="delta")
    gated = g.Cast(g.RegexFullMatch(rule, pattern="gated(_delta)?", out="is_gated"), to=FLOAT, out="gated")
    axis0 = g.const([0], out="axis0")
    hq = g.Unsqueeze(g.attr("q_num_heads", out="hq_scalar"), axis0, out="hq")
    hkv = g.Unsqueeze(g.attr("kv_num_heads", out="hkv_scalar"), axis0, out="hkv")
    group = g.Div(hq, hkv, out="group")  # G
    # scale, or d_k^-½ for 0 (an If on a constant: onnxruntime folds it, and the shape ops with it)
    scale_attr = g.attr("scale", out="scale_attr")
    scale_is_zero = g.Equal(scale_attr, g.const(0.0, out="zero"), out="scale_is_zero")

    def default_scale(b: Graph) -> list[str]:
        d_k = b.Cast(b.Squeeze(b.Div(b.Shape("query", start=2, out="q_width"), hq, out="d_k")), to=FLOAT, out="d_k_f")
        return [b.Reciprocal(b.Sqrt(d_k, out="sqrt_d_k"), out="default_scale")]

    (scale,) = g.branch(scale_is_zero, default_scale, lambda b: [scale_attr], ["scale"])

    # --- operands for all tokens: float32, [B, T, H, …] shaped for the step's MatMuls
    seq_len = g.Shape("query", start=1, end=2, out="seq_len")  # [T]
    bt, one, minus_one = g.const([0, 0], out="bt"), g.const([1], out="one_1d"), g.const([-1], out="minus_one")

    def heads(name: str, *dims: str, out: str) -> str:
        shape = g.Concat(bt, *dims, axis=0, out=f"{out}_shape")
        return g.Cast(g.Reshape(name, shape, out=f"{out}_heads"), to=FLOAT, out=f"{out}_f")

    q = g.Mul(heads("query", hkv, group, minus_one, out="q"), scale, out="q_scaled")  # [B,T,H,G,d_k]
    k_col = heads("key", hkv, minus_one, one, out="k_col")  # [B,T,H,d_k,1]
    k = heads("key", hkv, one, minus_one, out="k")  # [B,T,H,1,d_k]
    v = heads("value", hkv, one, minus_one, out="v")  # [B,T,H,1,d_v]
    decay = heads("decay", hkv, minus_one, one, out="decay")  # [B,T,H,1|d_k,1]
    beta = heads("beta", minus_one, one, one, out="beta")  # [B,T,H|1,1,1]
    state0 = g.Cast("past_state", to=FLOAT, out="state0")  # [B,H,d_k,d_v]

    w = g.Exp(g.Mul(gated, decay, out="decay_used"), out="w")  # exp(γg)
    delta_beta = g.Mul(delta, beta, out="delta_beta")  # δβ  (= δβ', as δ ∈ {0, 1})
    not_delta = g.Sub(g.const(1.0, out="one"), delta, out="not_delta")
    beta_used = g.Add(delta_beta, not_delta, out="beta_used")  # β'
    k_row = g.Mul(delta_beta, k, out="k_row")  # δβ'k  [B,T,H,1,d_k]
    v_row = g.Mul(beta_used, v, out="v_row")  # β'v    [B,T,H,1,d_v]
    operands = (q, k_col, k_row, v_row, w)

    def single_token(b: Graph) -> list[str]:  # T = 1: one step on the operands as they are (S gets a time axis too)
        state, read = _step(b, b.Unsqueeze(state0, one, out="state0_t"), *operands)
        present = b.Reshape(state, b.Shape(state0, out="state_shape"), out="present_single")
        output = b.Reshape(read, b.Concat(bt, minus_one, axis=0, out="packed_shape"), out="output_single")
        return [present, output]

    def token_loop(b: Graph) -> list[str]:  # T > 1: a Loop over tokens carrying S; reads stacked [T,B,H,G,d_v]
        def token(lb: Graph, t: str, carried: list[str]) -> tuple[list[str], list[str]]:
            state, read = _step(lb, carried[0], *(lb.Gather(x, t, axis=1, out=f"{x}_t") for x in operands))
            return [state], [read]

        present, reads = b.loop(b.Squeeze(seq_len, out="trip_count"), [state0], token, ["present_loop", "reads"])
        # [T,B,H,G,d_v] → [B,T,H_q·d_v]. (Reshape to [T,B,-1] before the Transpose: onnx.reference
        # concatenates Loop scan outputs along axis 0 where the standard stacks them.)
        batch = b.Shape("query", start=0, end=1, out="batch")
        reads_tb = b.Reshape(reads, b.Concat(seq_len, batch, minus_one, axis=0, out="reads_shape"), out="reads_tb")
        return [present, b.Transpose(reads_tb, perm=[1, 0, 2], out="output_loop")]

    is_single = g.Equal(seq_len, one, out="is_single")
    present_f, output_f = g.branch(is_single, single_token, token_loop, ["present_f", "output_f"])
    g.CastLike(output_f, "query", out="output")
    g.CastLike(present_f, "past_state", out="present_state")
    doc = "ONNX opset-27 LinearAttention with decay and beta always present (edgemem)."
    return g.function(OP_TYPE, INPUTS, OUTPUTS, opset, doc)
