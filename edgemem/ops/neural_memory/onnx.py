"""The ONNX side of NeuralMemory: one opaque `edgemem::NeuralMemory` node and its body.

`emit` is what `neural_memory` / `neural_memory_step` call while `torch.onnx.export` traces
them: one node whose fifteen inputs are always present, so one function body serves every
configuration (missing ones are materialised: position 0, chunk weights = weights, γ = 1 and
β = 0 with `residual_norm` = 0; for depth 1 the second-layer inputs repeat the first layer's
tensors, which keeps every branch of the body shape-valid, and are never read).
`function(opset)` is that body as a model-local FunctionProto of standard ONNX ops at the
model's opset.

Node contract (domain "edgemem", version 1):
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
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from edgemem.ops.neural_memory.naive import NORM_EPS

if TYPE_CHECKING:
    import onnx

DOMAIN = "edgemem"
VERSION = 1
OP_TYPE = "NeuralMemory"
INPUTS = (
    "query", "key", "value", "theta", "eta", "alpha", "position", "norm_weight", "norm_bias",
    "weights_1", "momentum_1", "chunk_weights_1", "weights_2", "momentum_2", "chunk_weights_2",
)  # fmt: skip
OUTPUTS = (
    "output", "present_position", "present_weights_1", "present_momentum_1", "present_chunk_weights_1",
    "present_weights_2", "present_momentum_2", "present_chunk_weights_2",
)  # fmt: skip
ATTRIBUTES = ("num_heads", "chunk_size", "depth", "residual_norm", "activation")


def emit(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    theta: Tensor,
    eta: Tensor,
    alpha: Tensor,
    weights: Sequence[Tensor],
    momentum: Sequence[Tensor],
    chunk_weights: Sequence[Tensor] | None,
    position: Tensor | None,
    norm_weight: Tensor | None,
    norm_bias: Tensor | None,
    *,
    num_heads: int,
    chunk_size: int,
    activation: str,
) -> tuple[Tensor, tuple[Tensor, ...], tuple[Tensor, ...], tuple[Tensor, ...], Tensor]:
    """One `edgemem::NeuralMemory` node for the ONNX exporter, over validated, packed inputs.

    Returns what the custom op returns: `(y, weights, momentum, chunk_weights, position + T)`;
    key, value and the gates take the query's dtype, the state is float32."""
    depth, dtype, f32 = len(weights), query.dtype, torch.float32
    residual_norm = norm_weight is not None
    head_dim = query.shape[-1] // num_heads
    if position is None:
        position = query.new_zeros((1,), dtype=torch.int64)
    if chunk_weights is None:
        chunk_weights = weights
    if norm_weight is None:
        norm_weight = query.new_ones((num_heads, head_dim), dtype=f32)
        norm_bias = query.new_zeros((num_heads, head_dim), dtype=f32)
    layers = [[w.to(f32), m.to(f32), c.to(f32)] for w, m, c in zip(weights, momentum, chunk_weights)]
    if depth == 1:  # the second-layer inputs: the first layer's tensors, never read
        layers.append(layers[0])
    inputs = [
        query, key.to(dtype), value.to(dtype), theta.to(dtype), eta.to(dtype), alpha.to(dtype), position,
        norm_weight.to(f32), norm_bias.to(f32), *layers[0], *layers[1],
    ]  # fmt: skip
    attrs = dict(
        num_heads=int(num_heads),
        chunk_size=int(chunk_size),
        depth=depth,
        residual_norm=int(residual_norm),
        activation=str(activation),
    )
    # all eight outputs, also for depth 1 (onnxruntime rejects a node with fewer outputs than its function)
    state_shapes = [list(layer[0].shape) for layer in layers for _ in range(3)]
    outputs = torch.onnx.ops.symbolic_multi_out(
        f"{DOMAIN}::{OP_TYPE}",
        inputs,
        attrs=attrs,
        dtypes=[dtype, torch.int64] + [f32] * 6,
        shapes=[list(query.shape), list(position.shape), *state_shapes],
        version=VERSION,
    )
    y, end, *state = outputs
    w, s, wc = (tuple(state[3 * i + j] for i in range(depth)) for j in range(3))
    return y, w, s, wc, end


# ----------------------------------------------------------------------------------------------
# The function body


class _Graph:
    """Nodes of one graph or subgraph. `op` returns its output's name; names stay unique over
    the whole function (subgraphs share `taken`), so a name says where a value came from."""

    def __init__(self, taken: set[str] | None = None) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.produced: set[str] = set()
        self.taken = set() if taken is None else taken

    def fresh(self, base: str) -> str:
        name, i = base, 1
        while name in self.taken:
            i += 1
            name = f"{base}_{i}"
        self.taken.add(name)
        return name

    def node(self, op_type: str, inputs: Sequence[str], outs: Sequence[str], **attrs) -> list[str]:
        from onnx import helper

        names = [self.fresh(o) for o in outs]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=names[0], **attrs))
        self.produced.update(names)
        return names

    def op(self, op_type: str, *inputs: str, out: str, **attrs) -> str:
        return self.node(op_type, inputs, [out], **attrs)[0]

    def const(self, out: str, value: float | int | bool | list[int]) -> str:
        """A Constant: a float32 / int64 / bool scalar, or a 1-D int64 tensor for a list."""
        from onnx import TensorProto, helper

        if isinstance(value, bool):
            return self.op("Constant", out=out, value=helper.make_tensor(out, TensorProto.BOOL, [], [value]))
        kind = {float: "value_float", int: "value_int", list: "value_ints"}[type(value)]
        return self.op("Constant", out=out, **{kind: value})

    def attr_const(self, attribute: str, kind: str) -> str:
        """A scalar Constant holding the function attribute `attribute` (kind: value_int | value_string)."""
        from onnx import AttributeProto

        name = self.op("Constant", out=attribute)
        ref = AttributeProto(name=kind, ref_attr_name=attribute)
        ref.type = AttributeProto.INT if kind == "value_int" else AttributeProto.STRING
        self.nodes[-1].attribute.append(ref)
        return name

    def subgraph(
        self,
        name: str,
        build: Callable[[_Graph], Sequence[str]],
        inputs: Sequence[tuple[str, int, list | None]] = (),
        types: Sequence[int] | None = None,
    ) -> onnx.GraphProto:
        """A subgraph whose outputs are what `build` returns (outer-scope values pass through an
        Identity); `inputs`: (name, elem type, shape) of its formal inputs (a Loop body);
        outputs are float32 unless `types` says otherwise."""
        from onnx import TensorProto, helper

        sub = _Graph(self.taken)
        sub.produced.update(n for n, _, _ in inputs)
        outs = [o if o in sub.produced else sub.op("Identity", o, out=f"{o}_out") for o in build(sub)]
        types = types or [TensorProto.FLOAT] * len(outs)
        return helper.make_graph(
            sub.nodes,
            name,
            [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
            [helper.make_tensor_value_info(o, t, None) for o, t in zip(outs, types)],
        )

    def branch(self, cond: str, then: Builder, other: Builder, outs: Sequence[str]) -> list[str]:
        """If(cond) over two builders that return float32 values for `outs`."""
        then_graph = self.subgraph(f"{outs[0]}_then", then)
        else_graph = self.subgraph(f"{outs[0]}_else", other)
        return self.node("If", [cond], outs, then_branch=then_graph, else_branch=else_graph)


Builder = Callable[[_Graph], Sequence[str]]


class _Config:
    """Top-level values every token step reads: scalar conditions from the attributes (the
    If nodes branch on them; they are constants once the function is instantiated, and
    onnxruntime folds those Ifs away at load), the norm parameters and shared constants."""

    def __init__(self, g: _Graph) -> None:
        from onnx import TensorProto

        self.zero_int, self.one_int = g.const("zero_int", 0), g.const("one_int", 1)  # int64 scalars
        self.one, self.zero = g.const("one", 1.0), g.const("zero", 0.0)
        self.depth_1 = g.op("Equal", g.attr_const("depth", "value_int"), self.one_int, out="is_depth_1")
        no_norm = g.op("Equal", g.attr_const("residual_norm", "value_int"), self.zero_int, out="no_residual_norm")
        self.residual_norm = g.op("Not", no_norm, out="is_residual_norm")
        # depth 1 has no activation; RegexFullMatch rather than Equal on strings, which
        # onnx.reference rejects for strings of different lengths
        activation = g.attr_const("activation", "value_string")
        depth_2 = g.op("Not", self.depth_1, out="is_depth_2")
        self.is_act = {}
        for name in ("silu", "gelu", "relu"):
            named = g.op("RegexFullMatch", activation, out=f"is_{name}_name", pattern=name)
            self.is_act[name] = g.op("And", depth_2, named, out=f"is_{name}")
        head_rows = g.const("head_rows", [0, 1, -1])  # [H, D] -> [H, 1, D]: broadcasts over [B, H, 1, D]
        gamma = g.op("Cast", "norm_weight", out="gamma_f", to=TensorProto.FLOAT)
        beta = g.op("Cast", "norm_bias", out="beta_f", to=TensorProto.FLOAT)
        self.gamma = g.op("Reshape", gamma, head_rows, out="gamma")
        self.beta = g.op("Reshape", beta, head_rows, out="beta")
        self.eps = g.const("norm_eps", float(NORM_EPS))
        self.last_axis = g.const("last_axis", [-1])
        self.to_column = g.const("to_column", [0, 0, -1, 1])  # [B,H,1,N] <-> [B,H,N,1]: same memory
        self.to_row = g.const("to_row", [0, 0, 1, -1])


def _activation(g: _Graph, c: _Config, h: str, with_grad: bool) -> list[str]:
    """act(h), and act'(h) if `with_grad`, for the activation attribute: Ifs on its name."""

    def silu(b: _Graph) -> list[str]:
        sig = b.op("Sigmoid", h, out="sigmoid")
        a = b.op("Mul", h, sig, out="silu")
        if not with_grad:
            return [a]
        # d/dh h·σ(h) = σ(h)·(1 + h·(1 − σ(h)))
        h_rest = b.op("Mul", h, b.op("Sub", c.one, sig, out="one_minus_sigmoid"), out="h_one_minus_sigmoid")
        return [a, b.op("Mul", sig, b.op("Add", c.one, h_rest, out="silu_slope"), out="silu_grad")]

    def gelu(b: _Graph) -> list[str]:
        # exact (erf) GELU: h·Φ(h); d/dh = Φ(h) + h·φ(h)
        erf = b.op("Erf", b.op("Mul", h, b.const("inv_sqrt2", math.sqrt(0.5)), out="h_over_sqrt2"), out="erf")
        cdf = b.op("Mul", b.op("Add", erf, c.one, out="one_plus_erf"), b.const("half", 0.5), out="cdf")
        a = b.op("Mul", h, cdf, out="gelu")
        if not with_grad:
            return [a]
        minus_half_h2 = b.op("Mul", b.op("Mul", h, h, out="h_squared"), b.const("minus_half", -0.5), out="minus_half_h2")
        pdf_scale = b.const("inv_sqrt_2pi", 1 / math.sqrt(2 * math.pi))
        pdf = b.op("Mul", b.op("Exp", minus_half_h2, out="exp_minus_half_h2"), pdf_scale, out="pdf")
        return [a, b.op("Add", cdf, b.op("Mul", h, pdf, out="h_pdf"), out="gelu_grad")]

    def relu(b: _Graph) -> list[str]:
        a = b.op("Relu", h, out="relu")
        if not with_grad:
            return [a]
        positive = b.op("Greater", h, c.zero, out="positive")
        return [a, b.op("CastLike", positive, h, out="relu_grad")]

    def identity(b: _Graph) -> list[str]:
        return [h, c.one][: 1 + with_grad]  # act' = 1, a scalar that broadcasts

    outs = ["act", "act_grad"][: 1 + with_grad]

    def relu_or_identity(b: _Graph) -> list[str]:
        return b.branch(c.is_act["relu"], relu, identity, outs)

    def not_silu(b: _Graph) -> list[str]:
        return b.branch(c.is_act["gelu"], gelu, relu_or_identity, outs)

    return g.branch(c.is_act["silu"], silu, not_silu, outs)


def _layer_norm(g: _Graph, c: _Config, z: str) -> tuple[str, str]:
    """(ẑ, σ) over the last dim: ẑ = (z − mean z) / σ, σ = √(var z + eps)."""
    centred = g.op("Sub", z, g.op("ReduceMean", z, c.last_axis, out="z_mean"), out="z_centred")
    var = g.op("ReduceMean", g.op("Mul", centred, centred, out="z_centred_sq"), c.last_axis, out="z_var")
    sigma = g.op("Sqrt", g.op("Add", var, c.eps, out="z_var_eps"), out="z_sigma")
    return g.op("Div", centred, sigma, out="z_hat"), sigma


def _residual_norm(g: _Graph, c: _Config, x: str, z_hat: str) -> str:
    """x + γ ⊙ ẑ + β."""
    norm_out = g.op("Add", g.op("Mul", c.gamma, z_hat, out="gamma_z_hat"), c.beta, out="norm_out")
    return g.op("Add", x, norm_out, out="residual_out")


def _readout(g: _Graph, c: _Config, x: str, z: str) -> str:
    """M(x) from z = f(x): z, or x + γ ⊙ LN(z) + β with the residual norm."""

    def norm(b: _Graph) -> list[str]:
        return [_residual_norm(b, c, x, _layer_norm(b, c, z)[0])]

    return g.branch(c.residual_norm, norm, lambda b: [z], ["readout"])[0]


def _output_delta(g: _Graph, c: _Config, k: str, v: str, z: str) -> str:
    """dℓ/dz for ℓ = ½‖M(k) − v‖², z = f(k): z − v, or through the LayerNorm
    (with g = γ ⊙ (M(k) − v): dz = (g − mean g − ẑ·mean(g ⊙ ẑ)) / σ)."""

    def norm(b: _Graph) -> list[str]:
        z_hat, sigma = _layer_norm(b, c, z)
        error = b.op("Sub", _residual_norm(b, c, k, z_hat), v, out="norm_error")
        grad = b.op("Mul", c.gamma, error, out="norm_grad")  # g
        grad_mean = b.op("ReduceMean", grad, c.last_axis, out="norm_grad_mean")
        along = b.op("ReduceMean", b.op("Mul", grad, z_hat, out="grad_z_hat"), c.last_axis, out="grad_z_hat_mean")
        centred = b.op("Sub", grad, grad_mean, out="grad_centred")
        projected = b.op("Sub", centred, b.op("Mul", z_hat, along, out="z_hat_along"), out="grad_projected")
        return [b.op("Div", projected, sigma, out="dz_norm")]

    return g.branch(c.residual_norm, norm, lambda b: [b.op("Sub", z, v, out="error")], ["dz"])[0]


def _update(g: _Graph, step: dict[str, str], w: str, s: str, x_col: str, d: str, layer: int) -> tuple[str, str]:
    """S ← η S − θ ∇ with ∇ = xᵀ d, as η S + xᵀ(−θ d) (θ scales the row, not the matrix);
    W ← (1 − α) W + S."""
    step_grad = g.op("MatMul", x_col, g.op("Mul", step["minus_theta"], d, out=f"minus_theta_d{layer}"), out=f"step{layer}")
    s_new = g.op("Add", g.op("Mul", step["eta"], s, out=f"eta_momentum{layer}"), step_grad, out=f"momentum{layer}")
    w_new = g.op("Add", g.op("Mul", step["keep"], w, out=f"kept_weights{layer}"), s_new, out=f"weights{layer}")
    return w_new, s_new


def _token(g: _Graph, c: _Config, step: dict[str, str], state: Sequence[str]) -> list[str]:
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

    def layer_2(op_type: str, *inputs: str, out: str) -> Builder:
        return lambda b: [b.op(op_type, *inputs, out=out)]

    # where a chunk starts, its weights are the current ones
    wc1 = g.op("Where", starts, w1, wc1, out="chunk_w1")
    wc2 = g.branch(c.depth_1, lambda b: [wc2], layer_2("Where", starts, w2, wc2, out="chunk_w2_2"), ["chunk_w2"])[0]

    # gradient of ½‖M(k) − v‖² at the chunk weights: h = k W1c, a = act(h), z = a W2c
    a, act_grad = _activation(g, c, g.op("MatMul", k_row, wc1, out="h_k"), with_grad=True)
    z = g.branch(c.depth_1, lambda b: [a], layer_2("MatMul", a, wc2, out="z_k_2"), ["z_k"])[0]
    dz = _output_delta(g, c, k_row, v, z)  # [B,H,1,D]

    def back_2(b: _Graph) -> list[str]:  # dz W2cᵀ as (W2c dzᵀ)ᵀ: W2c is not transposed
        back = b.op("MatMul", wc2, b.op("Reshape", dz, c.to_column, out="dz_col"), out="back_col")
        return [b.op("Reshape", back, c.to_row, out="back_2")]

    back = g.branch(c.depth_1, lambda b: [dz], back_2, ["back"])[0]
    dh = g.op("Mul", back, act_grad, out="dh")  # [B,H,1,E]
    w1_new, s1_new = _update(g, step, w1, s1, k_col, dh, 1)  # ∇W1 = kᵀ dh

    def update_2(b: _Graph) -> list[str]:  # ∇W2 = aᵀ dz
        return [*_update(b, step, w2, s2, b.op("Reshape", a, c.to_column, out="a_k_col"), dz, 2), wc2]

    w2_new, s2_new, wc2 = g.branch(c.depth_1, lambda b: [w2, s2, wc2], update_2, ["w2_new", "s2_new", "wc2_new"])

    # retrieval through the updated weights
    (a_q,) = _activation(g, c, g.op("MatMul", q, w1_new, out="h_q"), with_grad=False)
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
    from onnx import TensorProto, helper

    if opset < 20:
        raise ValueError(f"NeuralMemory's body needs opset >= 20 (RegexFullMatch); got {opset}")
    g = _Graph()
    g.taken.update(INPUTS)
    c = _Config(g)

    # --- heads and time-major per-token operands, float32
    # (explicit sizes, no -1: a reshape of T = 0 tokens must still know them)
    heads = g.op("Unsqueeze", g.attr_const("num_heads", "value_int"), g.const("axis_0", [0]), out="heads")
    packed = g.op("Shape", "query", out="packed_width", start=2)  # [H*D]
    head_dim = g.op("Div", packed, heads, out="head_dim")
    zeros_2, ones_1 = g.const("zeros_2", [0, 0]), g.const("ones_1", [1])
    row_shape = g.op("Concat", zeros_2, heads, ones_1, head_dim, out="row_shape", axis=0)  # [B,T,H,1,D]
    col_shape = g.op("Concat", zeros_2, heads, head_dim, ones_1, out="col_shape", axis=0)  # [B,T,H,D,1]
    gate_shape = g.op("Concat", zeros_2, heads, ones_1, ones_1, out="gate_shape", axis=0)  # [B,T,H,1,1]
    floats = {x: g.op("Cast", x, out=f"{x}_f", to=TensorProto.FLOAT) for x in INPUTS[:6]}

    def time_major(name: str, x: str, shape: str) -> str:  # [B,T,…] -> [T,B,H,·,·]
        heads_split = g.op("Reshape", floats[x], shape, out=f"{name}_heads")
        return g.op("Transpose", heads_split, out=f"{name}_tm", perm=[1, 0, 2, 3, 4])

    per_token = {
        "q": time_major("q", "query", row_shape),  # [T,B,H,1,D]
        "k_row": time_major("k_row", "key", row_shape),  # [T,B,H,1,D]
        "k_col": time_major("k_col", "key", col_shape),  # [T,B,H,D,1]
        "v": time_major("v", "value", row_shape),  # [T,B,H,1,D]
        "minus_theta": g.op("Neg", time_major("theta", "theta", gate_shape), out="minus_theta_tm"),  # [T,B,H,1,1]
        "eta": time_major("eta", "eta", gate_shape),
        "keep": g.op("Sub", c.one, time_major("alpha", "alpha", gate_shape), out="keep_tm"),  # 1 − α
    }

    # --- chunk starts: (position + t) mod chunk_size = 0, [T,B|1,1,1,1]
    seq_len = g.op("Shape", "query", out="seq_len_1d", start=1, end=2)
    seq_len_scalar = g.op("Squeeze", seq_len, out="seq_len")
    steps = g.op("Unsqueeze", g.op("Range", c.zero_int, seq_len_scalar, c.one_int, out="steps"), g.const("axis_1", [1]), out="steps_col")
    positions = g.op("Add", steps, g.op("Unsqueeze", "position", "axis_0", out="position_row"), out="positions")
    in_chunk = g.op("Mod", positions, g.attr_const("chunk_size", "value_int"), out="in_chunk")
    starts = g.op("Equal", in_chunk, c.zero_int, out="starts")
    per_token["starts"] = g.op("Unsqueeze", starts, g.const("axes_234", [2, 3, 4]), out="starts_tm")

    state_in = INPUTS[9:]  # w1, s1, wc1, w2, s2, wc2

    def single(b: _Graph) -> list[str]:  # T = 1: the step on token 0, no Loop
        step = {k: b.op("Gather", x, c.zero_int, out=f"{k}_0", axis=0) for k, x in per_token.items()}
        *state, y = _token(b, c, step, state_in)
        return [*state, b.op("Unsqueeze", y, "axis_0", out="ys_1")]

    def loop(b: _Graph) -> list[str]:  # T ≠ 1: a Loop over tokens carrying the state, emitting y_t
        carried = [f"{name}_in" for name in ("w1", "s1", "wc1", "w2", "s2", "wc2")]
        b.taken.update(["t", "cond_in", *carried])

        def body(lb: _Graph) -> list[str]:
            step = {k: lb.op("Gather", x, "t", out=f"{k}_t", axis=0) for k, x in per_token.items()}
            *state, y = _token(lb, c, step, carried)
            return [lb.op("Identity", "cond_in", out="cond_out"), *state, y]

        formal = [("t", TensorProto.INT64, []), ("cond_in", TensorProto.BOOL, [])]
        formal += [(name, TensorProto.FLOAT, None) for name in carried]
        types = [TensorProto.BOOL] + [TensorProto.FLOAT] * 7
        body_graph = b.subgraph("token_step", body, inputs=formal, types=types)
        keep_going = b.const("keep_going", True)  # explicit: onnx.reference reads a missing cond as false
        outs = ["w1_n", "s1_n", "wc1_n", "w2_n", "s2_n", "wc2_n", "ys_n"]
        return b.node("Loop", [seq_len_scalar, keep_going, *state_in], outs, body=body_graph)

    is_single = g.op("Equal", seq_len_scalar, c.one_int, out="is_single_token")
    *state_out, ys = g.branch(is_single, single, loop, ["w1_T", "s1_T", "wc1_T", "w2_T", "s2_T", "wc2_T", "ys"])

    # --- outputs: y [T,B,H,1,D] -> [B,T,H*D] in the query's dtype; position + T; the state.
    # (Reshaped by [T,B,H*D]: onnx.reference concatenates Loop scan outputs ([T*B,H,1,D]) rather than stacking them.)
    batch = g.op("Shape", "query", out="batch_1d", start=0, end=1)
    ys_tb = g.op("Reshape", ys, g.op("Concat", seq_len, batch, packed, out="ys_shape", axis=0), out="ys_tb")
    output_f = g.op("Transpose", ys_tb, out="output_f", perm=[1, 0, 2])
    g.op("CastLike", output_f, "query", out="output")
    g.op("Add", "position", seq_len, out="present_position")
    for name, value in zip(OUTPUTS[2:], state_out):
        g.op("Identity", value, out=name)

    defaults = [
        helper.make_attribute("chunk_size", 1),
        helper.make_attribute("residual_norm", 0),
        helper.make_attribute("activation", "silu"),
    ]
    return helper.make_function(
        DOMAIN,
        OP_TYPE,
        list(INPUTS),
        list(OUTPUTS),
        g.nodes,
        [helper.make_opsetid("", opset)],
        attributes=["num_heads", "depth"],
        attribute_protos=defaults,
        doc_string=function.__doc__,
    )
