"""The ONNX side of LinearAttention: one opaque `edgemem::LinearAttention` node and its body.

`emit` is what `linear_attention` calls while `torch.onnx.export` traces it: it writes one
node whose six inputs are always present (query, key, value, past_state, decay, beta —
missing ones are materialised as a zero state, zero log-decay and unit beta), so one
function body serves every update rule. `function(opset)` is that body as a model-local
FunctionProto made of standard ONNX ops at the model's opset, so any ONNX runtime can run
the node.

Node contract (domain "edgemem", version 1):
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

from edgemem.errors import ShapeError
from edgemem.ops.linear_attention.args import check
from edgemem.ops.linear_attention.op import OP_TYPE

if TYPE_CHECKING:
    import onnx

DOMAIN = "edgemem"
VERSION = 1
MIN_OPSET = 20  # RegexFullMatch (reads update_rule) is new in opset 20
INPUTS = ("query", "key", "value", "past_state", "decay", "beta")
OUTPUTS = ("output", "present_state")
ATTRIBUTES = ("update_rule", "scale", "q_num_heads", "kv_num_heads", "chunk_size")


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
    _, _, d_k, d_v = check(query, key, value, decay, beta, update_rule, q_num_heads, kv_num_heads)
    b, t, _ = query.shape
    dtype = query.dtype
    if decay is not None and decay.shape[-1] not in (kv_num_heads, kv_num_heads * d_k):
        raise ShapeError(f"decay last dim must be H_kv ({kv_num_heads}) or H_kv*d_k; got {decay.shape[-1]}")
    if beta is not None and beta.shape[-1] not in (kv_num_heads, 1):
        raise ShapeError(f"beta last dim must be H_kv ({kv_num_heads}) or 1; got {beta.shape[-1]}")

    if past_state is None:
        past_state = query.new_zeros((b, kv_num_heads, d_k, d_v), dtype=torch.float32)
    if decay is None:
        decay = query.new_zeros((b, t, kv_num_heads))  # log-decay 0: no decay
    if beta is None:
        beta = query.new_ones((b, t, kv_num_heads))
    inputs = [key.to(dtype), value.to(dtype), past_state.to(torch.float32), decay.to(dtype), beta.to(dtype)]
    attrs = dict(
        update_rule=update_rule,
        scale=float(scale) if scale else 1.0 / math.sqrt(d_k),
        q_num_heads=int(q_num_heads),
        kv_num_heads=int(kv_num_heads),
        chunk_size=int(chunk_size),
    )
    output, present_state = torch.onnx.ops.symbolic_multi_out(
        f"{DOMAIN}::{OP_TYPE}",
        [query, *inputs],
        attrs=attrs,
        dtypes=[dtype, torch.float32],
        shapes=[[b, t, q_num_heads * d_v], [b, kv_num_heads, d_k, d_v]],
        version=VERSION,
    )
    return output, present_state


class _Graph:
    """The nodes of a graph body: `g.op(...)` appends one node and returns its output name."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []

    def op(self, op_type: str, *inputs: str, out: str, **attrs) -> str:
        from onnx import helper

        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out

    def ints(self, out: str, values: list[int]) -> str:
        """A 1-D int64 constant."""
        return self.op("Constant", out=out, value_ints=values)

    def attr(self, out: str, attribute: str, kind: str) -> str:
        """A scalar constant holding the function attribute `attribute` (kind: int | float | string)."""
        from onnx import AttributeProto, helper

        node = helper.make_node("Constant", [], [out], name=out)
        ref = AttributeProto(name=f"value_{kind}", ref_attr_name=attribute)
        ref.type = {"int": AttributeProto.INT, "float": AttributeProto.FLOAT, "string": AttributeProto.STRING}[kind]
        node.attribute.append(ref)
        self.nodes.append(node)
        return out


def _step(g: _Graph, state: str, q: str, k_col: str, k_row: str, v_row: str, w: str, tag: str) -> tuple[str, str]:
    """One token on operands without the time axis or with a time axis of 1 (`state` alike)."""
    decayed = g.op("Mul", state, w, out=f"decayed_{tag}")  # w ⊙ S
    retrieved = g.op("MatMul", k_row, decayed, out=f"retrieved_{tag}")  # (δβ'k)ᵀ S      [.., 1, d_v]
    written = g.op("Sub", v_row, retrieved, out=f"written_{tag}")  # u = β'v − δβ' Sᵀk   [.., 1, d_v]
    update = g.op("MatMul", k_col, written, out=f"update_{tag}")  # k uᵀ             [.., d_k, d_v]
    new_state = g.op("Add", decayed, update, out=f"state_{tag}")
    read = g.op("MatMul", q, new_state, out=f"read_{tag}")  # scale·Sᵀq per query head   [.., G, d_v]
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
    from onnx import TensorProto, helper

    if opset < MIN_OPSET:
        raise ValueError(f"edgemem::{OP_TYPE}: the function body needs opset >= {MIN_OPSET}; got {opset}")
    FLOAT = TensorProto.FLOAT
    g = _Graph()

    # --- attributes → tensors
    rule = g.attr("rule", "update_rule", "string")
    delta = g.op("Cast", g.op("RegexFullMatch", rule, out="is_delta", pattern="(gated_)?delta"), out="delta", to=FLOAT)
    gated = g.op("Cast", g.op("RegexFullMatch", rule, out="is_gated", pattern="gated(_delta)?"), out="gated", to=FLOAT)
    axis0 = g.ints("axis0", [0])
    hq = g.op("Unsqueeze", g.attr("hq_scalar", "q_num_heads", "int"), axis0, out="hq")
    hkv = g.op("Unsqueeze", g.attr("hkv_scalar", "kv_num_heads", "int"), axis0, out="hkv")
    group = g.op("Div", hq, hkv, out="group")  # G
    # scale, or d_k^-½ for 0 (an If on a constant: onnxruntime folds it, and the shape ops with it)
    scale_attr = g.attr("scale_attr", "scale", "float")
    scale_is_zero = g.op("Equal", scale_attr, g.op("Constant", out="zero", value_float=0.0), out="scale_is_zero")
    default = _Graph()
    d_k = default.op("Div", default.op("Shape", "query", out="q_width", start=2), hq, out="d_k")
    d_k_f = default.op("Cast", default.op("Squeeze", d_k, out="d_k_scalar"), out="d_k_f", to=FLOAT)
    default.op("Reciprocal", default.op("Sqrt", d_k_f, out="sqrt_d_k"), out="default_scale")
    given = _Graph()
    given.op("Identity", scale_attr, out="given_scale")
    scalar_out = lambda name: helper.make_tensor_value_info(name, FLOAT, [])  # noqa: E731
    g.nodes.append(
        helper.make_node(
            "If",
            [scale_is_zero],
            ["scale"],
            name="scale",
            then_branch=helper.make_graph(default.nodes, "default_scale", [], [scalar_out("default_scale")]),
            else_branch=helper.make_graph(given.nodes, "given_scale", [], [scalar_out("given_scale")]),
        )
    )
    scale = "scale"

    # --- operands for all tokens: float32, [B, T, H, …] shaped for the step's MatMuls
    seq_len = g.op("Shape", "query", out="seq_len", start=1, end=2)  # [T]
    bt, one, minus_one = g.ints("bt", [0, 0]), g.ints("one_1d", [1]), g.ints("minus_one", [-1])

    def heads(name: str, *dims: str, out: str) -> str:
        shape = g.op("Concat", bt, *dims, out=f"{out}_shape", axis=0)
        return g.op("Cast", g.op("Reshape", name, shape, out=f"{out}_heads"), out=f"{out}_f", to=FLOAT)

    q = g.op("Mul", heads("query", hkv, group, minus_one, out="q"), scale, out="q_scaled")  # [B,T,H,G,d_k]
    k_col = heads("key", hkv, minus_one, one, out="k_col")  # [B,T,H,d_k,1]
    k = heads("key", hkv, one, minus_one, out="k")  # [B,T,H,1,d_k]
    v = heads("value", hkv, one, minus_one, out="v")  # [B,T,H,1,d_v]
    decay = heads("decay", hkv, minus_one, one, out="decay")  # [B,T,H,1|d_k,1]
    beta = heads("beta", minus_one, one, one, out="beta")  # [B,T,H|1,1,1]
    state0 = g.op("Cast", "past_state", out="state0", to=FLOAT)  # [B,H,d_k,d_v]

    w = g.op("Exp", g.op("Mul", gated, decay, out="decay_used"), out="w")  # exp(γg)
    delta_beta = g.op("Mul", delta, beta, out="delta_beta")  # δβ  (= δβ', as δ ∈ {0, 1})
    not_delta = g.op("Sub", g.op("Constant", out="one", value_float=1.0), delta, out="not_delta")
    beta_used = g.op("Add", delta_beta, not_delta, out="beta_used")  # β'
    k_row = g.op("Mul", delta_beta, k, out="k_row")  # δβ'k  [B,T,H,1,d_k]
    v_row = g.op("Mul", beta_used, v, out="v_row")  # β'v    [B,T,H,1,d_v]
    operands = (q, k_col, k_row, v_row, w)

    float_out = lambda name: helper.make_tensor_value_info(name, FLOAT, None)  # noqa: E731

    # --- T = 1: one step on the operands as they are (time axis of 1; S gets one too)
    single = _Graph()
    state_1, read_1 = _step(single, single.op("Unsqueeze", state0, one, out="state0_t"), *operands, tag="single")
    single.op("Reshape", state_1, single.op("Shape", state0, out="state_shape"), out="present_single")
    single.op("Reshape", read_1, single.op("Concat", bt, minus_one, out="packed_shape", axis=0), out="output_single")
    single_token = helper.make_graph(
        single.nodes, "single_token", [], [float_out("present_single"), float_out("output_single")]
    )

    # --- T > 1: a Loop over tokens carrying S; token t's read is stacked into [T,B,H,G,d_v]
    body = _Graph()
    at_t = [body.op("Gather", x, "t", out=f"{x}_t", axis=1) for x in operands]
    state_t, read_t = _step(body, "state_in", *at_t, tag="t")
    body.op("Identity", "cond_in", out="cond_out")
    token_step = helper.make_graph(
        body.nodes,
        "token_step",
        [
            helper.make_tensor_value_info("t", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            float_out("state_in"),
        ],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), float_out(state_t), float_out(read_t)],
    )
    many = _Graph()
    trip_count = many.op("Squeeze", seq_len, out="trip_count")
    # An explicit `true` condition: onnx.reference runs no iteration when it is left out.
    true = helper.make_tensor("keep_going", TensorProto.BOOL, [], [True])
    keep_going = many.op("Constant", out="keep_going", value=true)
    loop = helper.make_node("Loop", [trip_count, keep_going, state0], ["present_loop", "reads"], body=token_step)
    many.nodes.append(loop)
    # [T,B,H,G,d_v] → [B,T,H_q·d_v]. (Reshape to [T,B,-1] before the Transpose: onnx.reference
    # concatenates Loop scan outputs along axis 0 where the standard stacks them.)
    batch = many.op("Shape", "query", out="batch", start=0, end=1)
    reads_shape = many.op("Concat", seq_len, batch, minus_one, out="reads_shape", axis=0)
    reads_tb = many.op("Reshape", "reads", reads_shape, out="reads_tb")
    many.op("Transpose", reads_tb, out="output_loop", perm=[1, 0, 2])
    token_loop = helper.make_graph(many.nodes, "token_loop", [], [float_out("present_loop"), float_out("output_loop")])

    is_single = g.op("Equal", seq_len, one, out="is_single")
    g.nodes.append(
        helper.make_node(
            "If", [is_single], ["present_f", "output_f"], name="steps", then_branch=single_token, else_branch=token_loop
        )
    )
    g.op("CastLike", "output_f", "query", out="output")
    g.op("CastLike", "present_f", "past_state", out="present_state")

    defaults = [  # as in ONNX opset 27; the required head counts have none
        helper.make_attribute("update_rule", "gated_delta"),
        helper.make_attribute("scale", 0.0),
        helper.make_attribute("chunk_size", 64),
    ]
    return helper.make_function(
        DOMAIN,
        OP_TYPE,
        list(INPUTS),
        list(OUTPUTS),
        g.nodes,
        [helper.make_opsetid("", opset)],
        attributes=["q_num_heads", "kv_num_heads"],
        attribute_protos=defaults,
        doc_string="ONNX opset-27 LinearAttention with decay and beta always present (edgemem).",
    )
