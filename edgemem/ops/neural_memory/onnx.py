"""The ONNX side of NeuralMemory: one opaque `edgemem::NeuralMemory` node and its body.

`emit` is what `neural_memory` / `neural_memory_step` call while `torch.onnx.export` traces
them: one node whose fifteen inputs are always present, so one function body serves every
configuration (missing ones are materialised: position 0, chunk weights = weights, γ = 1 and
β = 0 with `residual_norm` = 0; for depth 1 the second-layer inputs repeat the first layer's
tensors, which keeps every branch of the body shape-valid, and are never read).
`function(opset)` is that body as a model-local FunctionProto of standard ONNX ops at the
model's opset.

Node contract (`edgemem.opset` domain and version; names and attributes in contract.py):
    inputs   query, key, value [B,T,H*D] (T); theta, eta, alpha [B,T,H] (T);
             position [B] or [1] (int64); norm_weight, norm_bias [H,D] (float32);
             weights_1, momentum_1, chunk_weights_1 [B,H,D,E] (S);
             weights_2, momentum_2, chunk_weights_2 [B,H,E,D] (S; depth 1: the three
             first-layer tensors again, unread), with T ∈ {float16, float32}, S = float32;
             depth 1 has E = D
    outputs  output [B,T,H*D] (T), present_position [B] or [1] (int64),
             present_{weights,momentum,chunk_weights}_1 (S), present_{weights,momentum,chunk_weights}_2 (S)
             (always all eight: onnxruntime rejects a node with fewer outputs than its function
             declares; for depth 1 the last three pass the unread second-layer inputs through)
    attrs    num_heads, depth (INT, required); chunk_size (INT, 1), residual_norm (INT 0/1, 0),
             activation (STRING: silu | gelu | relu | identity, "silu")
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from edgemem.ops.neural_memory.contract import (
    ATTRIBUTES,
    INPUTS,
    NORM_EPS,
    OP_TYPE,
    OUTPUTS,
    Memory,
    Options,
    ResidualNorm,
    Tokens,
)
from edgemem.ops.node import emit_node
from edgemem.opset import Build, Graph, body

if TYPE_CHECKING:
    import onnx

MIN_OPSET = 20  # RegexFullMatch (reads activation) is new in opset 20


def emit(tokens: Tokens, memory: Memory, options: Options, norm: ResidualNorm | None) -> tuple[Tensor, Memory]:
    """One `edgemem::NeuralMemory` node for the ONNX exporter, over validated, packed inputs.

    Returns what the custom op returns: y and the memory after the call (position + T); key,
    value and the gates take the query's dtype, the state is float32."""
    query, key, value, theta, eta, alpha = tokens
    depth, dtype, f32 = memory.depth, query.dtype, torch.float32
    head_dim = query.shape[-1] // options.num_heads
    position = query.new_zeros((1,), dtype=torch.int64) if memory.position is None else memory.position
    chunk_weights = memory.weights if memory.chunk_weights is None else memory.chunk_weights
    if norm is None:
        gamma = query.new_ones((options.num_heads, head_dim), dtype=f32)
        beta = query.new_zeros((options.num_heads, head_dim), dtype=f32)
    else:
        gamma, beta = norm.weight, norm.bias
    layers = [[w.to(f32), m.to(f32), c.to(f32)] for w, m, c in zip(memory.weights, memory.momentum, chunk_weights)]
    if depth == 1:  # the second-layer inputs: the first layer's tensors, never read
        layers.append(layers[0])
    inputs = [
        query, key.to(dtype), value.to(dtype), theta.to(dtype), eta.to(dtype), alpha.to(dtype), position,
        gamma.to(f32), beta.to(f32), *layers[0], *layers[1],
    ]  # fmt: skip
    attrs = dict(
        num_heads=options.num_heads,
        chunk_size=options.chunk_size,
        depth=depth,
        residual_norm=int(norm is not None),
        activation=options.activation,
    )
    # all eight outputs, also for depth 1 (onnxruntime rejects a node with fewer outputs than its function)
    state_shapes = [list(layer[0].shape) for layer in layers for _ in range(3)]
    y, end, *state = emit_node(
        OP_TYPE,
        ATTRIBUTES,
        inputs,
        attrs,
        dtypes=[dtype, torch.int64] + [f32] * 6,
        shapes=[list(query.shape), list(position.shape), *state_shapes],
    )
    w, s, wc = (tuple(state[3 * i + j] for i in range(depth)) for j in range(3))
    return y, Memory(w, s, wc, end)


# ----------------------------------------------------------------------------------------------
# The function body


class _Config:
    """Top-level values every token step reads: scalar conditions from the attributes (the
    If nodes branch on them; they are constants once the function is instantiated, and
    onnxruntime folds those Ifs away at load), the norm parameters and shared constants."""

    def __init__(self, g: Graph) -> None:
        from onnx import TensorProto

        self.zero_int, self.one_int = g.const(0, out="zero_int"), g.const(1, out="one_int")  # int64 scalars
        self.one, self.zero = g.const(1.0, out="one"), g.const(0.0, out="zero")
        self.depth_1 = g.Equal(g.attr("depth"), self.one_int, out="is_depth_1")
        no_norm = g.Equal(g.attr("residual_norm"), self.zero_int, out="no_residual_norm")
        self.residual_norm = g.Not(no_norm, out="is_residual_norm")
        # depth 1 has no activation; RegexFullMatch rather than Equal on strings, which
        # onnx.reference rejects for strings of different lengths
        activation = g.attr("activation")
        depth_2 = g.Not(self.depth_1, out="is_depth_2")
        self.is_act = {}
        for name in ("silu", "gelu", "relu"):
            named = g.RegexFullMatch(activation, out=f"is_{name}_name", pattern=name)
            self.is_act[name] = g.And(depth_2, named, out=f"is_{name}")
        head_rows = g.const([0, 1, -1], out="head_rows")  # [H, D] -> [H, 1, D]: broadcasts over [B, H, 1, D]
        gamma = g.Cast("norm_weight", out="gamma_f", to=TensorProto.FLOAT)
        beta = g.Cast("norm_bias", out="beta_f", to=TensorProto.FLOAT)
        self.gamma = g.Reshape(gamma, head_rows, out="gamma")
        self.beta = g.Reshape(beta, head_rows, out="beta")
        self.eps = g.const(NORM_EPS, out="norm_eps")
        self.last_axis = g.const([-1], out="last_axis")
        self.to_column = g.const([0, 0, -1, 1], out="to_column")  # [B,H,1,N] <-> [B,H,N,1]: same memory
        self.to_row = g.const([0, 0, 1, -1], out="to_row")


def _activation(g: Graph, c: _Config, h: str, with_grad: bool) -> list[str]:
    """act(h), and act'(h) if `with_grad`, for the activation attribute: Ifs on its name."""

    def silu(b: Graph) -> list[str]:
        sig = b.Sigmoid(h, out="sigmoid")
        a = b.Mul(h, sig, out="silu")
        if not with_grad:
            return [a]
        # d/dh h·σ(h) = σ(h)·(1 + h·(1 − σ(h)))
        h_rest = b.Mul(h, b.Sub(c.one, sig, out="one_minus_sigmoid"), out="h_one_minus_sigmoid")
        return [a, b.Mul(sig, b.Add(c.one, h_rest, out="silu_slope"), out="silu_grad")]

    def gelu(b: Graph) -> list[str]:
        # exact (erf) GELU: h·Φ(h); d/dh = Φ(h) + h·φ(h)
        erf = b.Erf(b.Mul(h, b.const(math.sqrt(0.5), out="inv_sqrt2"), out="h_over_sqrt2"), out="erf")
        cdf = b.Mul(b.Add(erf, c.one, out="one_plus_erf"), b.const(0.5, out="half"), out="cdf")
        a = b.Mul(h, cdf, out="gelu")
        if not with_grad:
            return [a]
        minus_half_h2 = b.Mul(b.Mul(h, h, out="h_squared"), b.const(-0.5, out="minus_half"), out="minus_half_h2")
        pdf_scale = b.const(1 / math.sqrt(2 * math.pi), out="inv_sqrt_2pi")
        pdf = b.Mul(b.Exp(minus_half_h2, out="exp_minus_half_h2"), pdf_scale, out="pdf")
        return [a, b.Add(cdf, b.Mul(h, pdf, out="h_pdf"), out="gelu_grad")]

    def relu(b: Graph) -> list[str]:
        a = b.Relu(h, out="relu")
        if not with_grad:
            return [a]
        positive = b.Greater(h, c.zero, out="positive")
        return [a, b.CastLike(positive, h, out="relu_grad")]

    def identity(b: Graph) -> list[str]:
        return [h, c.one][: 1 + with_grad]  # act' = 1, a scalar that broadcasts

    outs = ["act", "act_grad"][: 1 + with_grad]

    def relu_or_identity(b: Graph) -> list[str]:
        return b.branch(c.is_act["relu"], relu, identity, outs)

    def not_silu(b: Graph) -> list[str]:
        return b.branch(c.is_act["gelu"], gelu, relu_or_identity, outs)

    return g.branch(c.is_act["silu"], silu, not_silu, outs)


def _layer_norm(g: Graph, c: _Config, z: str) -> tuple[str, str]:
    """(ẑ, σ) over the last dim: ẑ = (z − mean z) / σ, σ = √(var z + eps)."""
    centred = g.Sub(z, g.ReduceMean(z, c.last_axis, out="z_mean"), out="z_centred")
    var = g.ReduceMean(g.Mul(centred, centred, out="z_centred_sq"), c.last_axis, out="z_var")
    sigma = g.Sqrt(g.Add(var, c.eps, out="z_var_eps"), out="z_sigma")
    return g.Div(centred, sigma, out="z_hat"), sigma


def _residual_norm(g: Graph, c: _Config, x: str, z_hat: str) -> str:
    """x + γ ⊙ ẑ + β."""
    norm_out = g.Add(g.Mul(c.gamma, z_hat, out="gamma_z_hat"), c.beta, out="norm_out")
    return g.Add(x, norm_out, out="residual_out")


def _readout(g: Graph, c: _Config, x: str, z: str) -> str:
    """M(x) from z = f(x): z, or x + γ ⊙ LN(z) + β with the residual norm."""

    def norm(b: Graph) -> list[str]:
        return [_residual_norm(b, c, x, _layer_norm(b, c, z)[0])]

    return g.branch(c.residual_norm, norm, lambda b: [z], ["readout"])[0]


def _output_delta(g: Graph, c: _Config, k: str, v: str, z: str) -> str:
    """dℓ/dz for ℓ = ½‖M(k) − v‖², z = f(k): z − v, or through the LayerNorm
    (with g = γ ⊙ (M(k) − v): dz = (g − mean g − ẑ·mean(g ⊙ ẑ)) / σ)."""

    def norm(b: Graph) -> list[str]:
        z_hat, sigma = _layer_norm(b, c, z)
        error = b.Sub(_residual_norm(b, c, k, z_hat), v, out="norm_error")
        grad = b.Mul(c.gamma, error, out="norm_grad")  # g
        grad_mean = b.ReduceMean(grad, c.last_axis, out="norm_grad_mean")
        along = b.ReduceMean(b.Mul(grad, z_hat, out="grad_z_hat"), c.last_axis, out="grad_z_hat_mean")
        centred = b.Sub(grad, grad_mean, out="grad_centred")
        projected = b.Sub(centred, b.Mul(z_hat, along, out="z_hat_along"), out="grad_projected")
        return [b.Div(projected, sigma, out="dz_norm")]

    return g.branch(c.residual_norm, norm, lambda b: [b.Sub(z, v, out="error")], ["dz"])[0]


def _update(g: Graph, step: dict[str, str], w: str, s: str, x_col: str, d: str, layer: int) -> tuple[str, str]:
    """S ← η S − θ ∇ with ∇ = xᵀ d, as η S + xᵀ(−θ d) (θ scales the row, not the matrix);
    W ← (1 − α) W + S."""
    step_grad = g.MatMul(x_col, g.Mul(step["minus_theta"], d, out=f"minus_theta_d{layer}"), out=f"step{layer}")
    s_new = g.Add(g.Mul(step["eta"], s, out=f"eta_momentum{layer}"), step_grad, out=f"momentum{layer}")
    w_new = g.Add(g.Mul(step["keep"], w, out=f"kept_weights{layer}"), s_new, out=f"weights{layer}")
    return w_new, s_new


def _token(g: Graph, c: _Config, step: dict[str, str], state: Sequence[str]) -> list[str]:
    """One token: chunk weights, gradient at them, momentum, forgetting, retrieval.

    `step`: this token's q / k_row / v `[B,H,1,D]`, k_col `[B,H,D,1]`, minus_theta / eta / keep
    `[B,H,1,1]` and starts `[B|1,1,1,1]` (bool); `state`: w1, s1, wc1, w2, s2, wc2.
    Returns w1, s1, wc1, w2, s2, wc2 after the token and y `[B,H,1,D]`.

    Depth 1 is depth 2 with an identity second layer: the activation is the identity and
    the Ifs on `depth_1` skip W2 (z = a, dh = dz) and keep its state as it is. Every branch
    is shape-valid for both depths (runtimes infer shapes in untaken branches too): a depth-1
    node's second-layer inputs are its [B,H,D,D] first-layer tensors."""
    w1, s1, wc1, w2, s2, wc2 = state
    q, k_row, k_col, v, starts = step["q"], step["k_row"], step["k_col"], step["v"], step["starts"]

    def layer_2(op_type: str, *inputs: str, out: str) -> Build:
        return lambda b: [b.node(op_type, inputs, [out])[0]]

    # where a chunk starts, its weights are the current ones
    wc1 = g.Where(starts, w1, wc1, out="chunk_w1")
    wc2 = g.branch(c.depth_1, lambda b: [wc2], layer_2("Where", starts, w2, wc2, out="chunk_w2_2"), ["chunk_w2"])[0]

    # gradient of ½‖M(k) − v‖² at the chunk weights: h = k W1c, a = act(h), z = a W2c
    a, act_grad = _activation(g, c, g.MatMul(k_row, wc1, out="h_k"), with_grad=True)
    z = g.branch(c.depth_1, lambda b: [a], layer_2("MatMul", a, wc2, out="z_k_2"), ["z_k"])[0]
    dz = _output_delta(g, c, k_row, v, z)  # [B,H,1,D]

    def back_2(b: Graph) -> list[str]:  # dz W2cᵀ as (W2c dzᵀ)ᵀ: W2c is not transposed
        back = b.MatMul(wc2, b.Reshape(dz, c.to_column, out="dz_col"), out="back_col")
        return [b.Reshape(back, c.to_row, out="back_2")]

    back = g.branch(c.depth_1, lambda b: [dz], back_2, ["back"])[0]
    dh = g.Mul(back, act_grad, out="dh")  # [B,H,1,E]
    w1_new, s1_new = _update(g, step, w1, s1, k_col, dh, 1)  # ∇W1 = kᵀ dh

    def update_2(b: Graph) -> list[str]:  # ∇W2 = aᵀ dz
        return [*_update(b, step, w2, s2, b.Reshape(a, c.to_column, out="a_k_col"), dz, 2), wc2]

    w2_new, s2_new, wc2 = g.branch(c.depth_1, lambda b: [w2, s2, wc2], update_2, ["w2_new", "s2_new", "wc2_new"])

    # retrieval through the updated weights
    (a_q,) = _activation(g, c, g.MatMul(q, w1_new, out="h_q"), with_grad=False)
    z_q = g.branch(c.depth_1, lambda b: [a_q], layer_2("MatMul", a_q, w2_new, out="z_q_2"), ["z_q"])[0]
    return [w1_new, s1_new, wc1, w2_new, s2_new, wc2, _readout(g, c, q, z_q)]


def function(opset: int = 20) -> onnx.FunctionProto:
    """`edgemem::NeuralMemory` as standard ONNX ops of the default domain at `opset` (≥ 20).

    Per token t at stream position p = position + t, per head (all in float32):

        W_c ← W               where p mod chunk_size = 0   (a chunk starts)
        ∇   = ∂/∂W ½‖M(k_t; W_c) − v_t‖²                    (closed form, at the chunk start)
        S   ← η_t S − θ_t ∇,   W ← (1 − α_t) W + S,   y_t = M(q_t; W)

    with M(x) = f(x) = x W1 or act(x W1) W2 (depth), or x + γ ⊙ LN(f(x)) + β (residual_norm).
    Everything that does not depend on the state (casts, head split, 1 − α, chunk starts) is
    computed for all tokens up front in time-major layout; a Loop over tokens carries the six
    state tensors and emits y_t. T = 1 (decode) takes an If branch with the same step and no
    Loop (a Loop copies its carried state out). depth, residual_norm and activation select
    branches through If nodes on conditions computed from the attributes.
    """
    from onnx import TensorProto

    g = body(OP_TYPE, INPUTS, ATTRIBUTES, opset, MIN_OPSET)
    c = _Config(g)

    # --- heads and time-major per-token operands, float32
    # (explicit sizes, no -1: a reshape of T = 0 tokens must still know them)
    heads = g.Unsqueeze(g.attr("num_heads"), g.const([0], out="axis_0"), out="heads")
    packed = g.Shape("query", out="packed_width", start=2)  # [H*D]
    head_dim = g.Div(packed, heads, out="head_dim")
    zeros_2, ones_1 = g.const([0, 0], out="zeros_2"), g.const([1], out="ones_1")
    row_shape = g.Concat(zeros_2, heads, ones_1, head_dim, out="row_shape", axis=0)  # [B,T,H,1,D]
    col_shape = g.Concat(zeros_2, heads, head_dim, ones_1, out="col_shape", axis=0)  # [B,T,H,D,1]
    gate_shape = g.Concat(zeros_2, heads, ones_1, ones_1, out="gate_shape", axis=0)  # [B,T,H,1,1]
    floats = {x: g.Cast(x, out=f"{x}_f", to=TensorProto.FLOAT) for x in INPUTS[:6]}

    def time_major(name: str, x: str, shape: str) -> str:  # [B,T,…] -> [T,B,H,·,·]
        heads_split = g.Reshape(floats[x], shape, out=f"{name}_heads")
        return g.Transpose(heads_split, out=f"{name}_tm", perm=[1, 0, 2, 3, 4])

    per_token = {
        "q": time_major("q", "query", row_shape),  # [T,B,H,1,D]
        "k_row": time_major("k_row", "key", row_shape),  # [T,B,H,1,D]
        "k_col": time_major("k_col", "key", col_shape),  # [T,B,H,D,1]
        "v": time_major("v", "value", row_shape),  # [T,B,H,1,D]
        "minus_theta": g.Neg(time_major("theta", "theta", gate_shape), out="minus_theta_tm"),  # [T,B,H,1,1]
        "eta": time_major("eta", "eta", gate_shape),
        "keep": g.Sub(c.one, time_major("alpha", "alpha", gate_shape), out="keep_tm"),  # 1 − α
    }

    # --- chunk starts: (position + t) mod chunk_size = 0, [T,B|1,1,1,1]
    seq_len = g.Shape("query", out="seq_len_1d", start=1, end=2)
    seq_len_scalar = g.Squeeze(seq_len, out="seq_len")
    steps = g.Range(c.zero_int, seq_len_scalar, c.one_int, out="steps")
    steps = g.Unsqueeze(steps, g.const([1], out="axis_1"), out="steps_col")
    positions = g.Add(steps, g.Unsqueeze("position", "axis_0", out="position_row"), out="positions")
    in_chunk = g.Mod(positions, g.attr("chunk_size"), out="in_chunk")
    starts = g.Equal(in_chunk, c.zero_int, out="starts")
    per_token["starts"] = g.Unsqueeze(starts, g.const([2, 3, 4], out="axes_234"), out="starts_tm")

    state_in = INPUTS[9:]  # w1, s1, wc1, w2, s2, wc2

    def single(b: Graph) -> list[str]:  # T = 1: the step on token 0, no Loop
        step = {k: b.Gather(x, c.zero_int, out=f"{k}_0", axis=0) for k, x in per_token.items()}
        *state, y = _token(b, c, step, state_in)
        return [*state, b.Unsqueeze(y, "axis_0", out="ys_1")]

    def loop(b: Graph) -> list[str]:  # T ≠ 1: a Loop over tokens carrying the state, emitting y_t
        def token(lb: Graph, t: str, carried: list[str]) -> tuple[list[str], list[str]]:
            step = {k: lb.Gather(x, t, out=f"{k}_t", axis=0) for k, x in per_token.items()}
            *state, y = _token(lb, c, step, carried)
            return state, [y]

        outs = ["w1_n", "s1_n", "wc1_n", "w2_n", "s2_n", "wc2_n", "ys_n"]
        return b.loop(seq_len_scalar, state_in, token, outs)

    is_single = g.Equal(seq_len_scalar, c.one_int, out="is_single_token")
    *state_out, ys = g.branch(is_single, single, loop, ["w1_T", "s1_T", "wc1_T", "w2_T", "s2_T", "wc2_T", "ys"])

    # --- outputs: y [T,B,H,1,D] -> [B,T,H*D] in the query's dtype; position + T; the state.
    # (Reshaped by [T,B,H*D]: onnx.reference concatenates Loop scan outputs ([T*B,H,1,D]) rather than stacking them.)
    batch = g.Shape("query", out="batch_1d", start=0, end=1)
    ys_tb = g.Reshape(ys, g.Concat(seq_len, batch, packed, out="ys_shape", axis=0), out="ys_tb")
    output_f = g.Transpose(ys_tb, out="output_f", perm=[1, 0, 2])
    g.CastLike(output_f, "query", out="output")
    g.Add("position", seq_len, out="present_position")
    for name, value in zip(OUTPUTS[2:], state_out):
        g.Identity(value, out=name)

    return g.function(OP_TYPE, INPUTS, OUTPUTS, opset, function.__doc__)
