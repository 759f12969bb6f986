"""Public neural memory functions and the `edgemem::neural_memory` custom op behind them.

The custom op takes packed `[B, T, H*D]` tensors and the streaming state, like the
exported `NeuralMemory` node: `neural_memory` calls it with no chunk weights and no
position (a fresh chunk at the start of the call), `neural_memory_step` with both; TTT's
residual norm adds γ and β. Under `torch.onnx.export` the functions emit one opaque
`edgemem::NeuralMemory` node instead (`edgemem.ops.neural_memory.onnx`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from edgemem.errors import ShapeError
from edgemem.ops.dtypes import compute_dtype
from edgemem.ops.neural_memory.chunk import neural_memory_chunk
from edgemem.ops.neural_memory.contract import Memory, Options, ResidualNorm, Tokens
from edgemem.ops.neural_memory.naive import ACTIVATIONS, neural_memory_naive

# the per-token form is faster for the step, very short blocks and chunk_size 1
_NAIVE_MAX_TOKENS = 2

State = tuple[Tensor, ...]


def _forward(tokens: Tokens, memory: Memory, options: Options, norm: ResidualNorm | None) -> tuple[Tensor, Memory]:
    q, k, v = (x.unflatten(2, (options.num_heads, -1)) for x in tokens[:3])
    per_token = q.shape[1] <= _NAIVE_MAX_TOKENS or options.chunk_size == 1
    form = neural_memory_naive if per_token else neural_memory_chunk
    y, memory = form(Tokens(q, k, v, *tokens[3:]), memory, options, norm)
    return y.flatten(2), memory


# The custom op's flat signature (tensors, tensor lists, scalars), its only place: `neural_memory`
# passes no chunk weights (an empty list) and no position, and no γ, β without the residual norm.
def _flat_forward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    theta: Tensor,
    eta: Tensor,
    alpha: Tensor,
    weights: list[Tensor],
    momentum: list[Tensor],
    chunk_weights: list[Tensor],
    position: Tensor | None,
    norm_weight: Tensor | None,
    norm_bias: Tensor | None,
    num_heads: int,
    chunk_size: int,
    activation: str,
) -> tuple[Tensor, list[Tensor], list[Tensor], list[Tensor], Tensor]:
    memory = Memory(weights, momentum, chunk_weights or None, position)
    norm = ResidualNorm.of(norm_weight, norm_bias)
    tokens = Tokens(query, key, value, theta, eta, alpha)
    y, out = _forward(tokens, memory, Options(num_heads, chunk_size, activation), norm)
    return y, list(out.weights), list(out.momentum), list(out.chunk_weights), out.position


def _flat_args(memory: Memory, options: Options, norm: ResidualNorm | None) -> list:
    """The op's arguments after the six per-token tensors."""
    return [
        list(memory.weights), list(memory.momentum), list(memory.chunk_weights or ()), memory.position,
        *((None, None) if norm is None else (norm.weight, norm.bias)),
        options.num_heads, options.chunk_size, options.activation,
    ]  # fmt: skip


_neural_memory_op = torch.library.custom_op("edgemem::neural_memory", _flat_forward, mutates_args=())


@_neural_memory_op.register_fake
def _(query, key, value, theta, eta, alpha, weights, momentum, chunk_weights, position, *rest):
    dtype = compute_dtype(query)
    return (
        query.new_empty(query.shape),
        [w.new_empty(w.shape, dtype=dtype) for w in weights],
        [m.new_empty(m.shape, dtype=dtype) for m in momentum],
        [w.new_empty(w.shape, dtype=dtype) for w in weights],
        query.new_empty((1,) if position is None else position.shape, dtype=torch.int64),
    )


def _setup_context(ctx, inputs, output):
    query, key, value, theta, eta, alpha, weights, momentum, chunk_weights, position, gamma, beta, *config = inputs
    ctx.depth, ctx.config = len(weights), config
    saved = (query, key, value, theta, eta, alpha, *weights, *momentum, *chunk_weights, gamma, beta, position)
    ctx.save_for_backward(*saved)


def _backward(ctx, grad_y, grad_w, grad_s, grad_wc, grad_position):
    # backward by recompute: rerun the forward under autograd and differentiate it
    *saved, gamma, beta, position = ctx.saved_tensors
    norm = [None if x is None else x.detach().requires_grad_() for x in (gamma, beta)]
    inputs = [x.detach().requires_grad_() for x in saved]
    d = ctx.depth  # inputs: q, k, v, θ, η, α, d weights, d momenta, 0 or d chunk weights
    weights, momentum, chunk_weights = inputs[6 : 6 + d], inputs[6 + d : 6 + 2 * d], inputs[6 + 2 * d :]
    with torch.enable_grad():
        y, w, s, wc, _ = _flat_forward(*inputs[:6], weights, momentum, chunk_weights, position, *norm, *ctx.config)
    pairs = [(o, g) for o, g in zip([y, *w, *s, *wc], [grad_y, *grad_w, *grad_s, *grad_wc]) if g is not None]
    outputs, grad_outputs = zip(*pairs)
    wrt = inputs + [x for x in norm if x is not None]
    grads = list(torch.autograd.grad(outputs, wrt, grad_outputs, allow_unused=True))
    g_norm = [None if x is None else grads.pop(len(inputs)) for x in norm]
    g_w, g_s, g_wc = list(grads[6 : 6 + d]), list(grads[6 + d : 6 + 2 * d]), list(grads[6 + 2 * d :])
    return (*grads[:6], g_w, g_s, g_wc, None, *g_norm, None, None, None)


_neural_memory_op.register_autograd(_backward, setup_context=_setup_context)


def _shape_error(name: str, got: object, expected: object) -> ShapeError:
    return ShapeError(f"neural_memory: {name} has shape {got}, expected {expected}")


def _check_tensor(name: str, x: object, expected: tuple[int, ...], floating: bool = True) -> None:
    if not isinstance(x, Tensor):
        raise ShapeError(f"neural_memory: {name} is a {type(x).__name__}, expected a tensor of shape {expected}")
    if tuple(x.shape) != expected:
        raise _shape_error(name, tuple(x.shape), expected)
    if floating != x.is_floating_point():
        kind = "a floating" if floating else "an integer"
        raise ShapeError(f"neural_memory: {name} has dtype {x.dtype}, expected {kind} dtype")


def _check(tokens: Tokens, memory: Memory, options: Options, norm: ResidualNorm | None) -> None:
    """Raise ShapeError, naming the argument, where a call does not fit the op's contract."""
    if options.activation not in ACTIVATIONS:
        raise ShapeError(f"neural_memory: activation is {options.activation!r}, expected one of {sorted(ACTIVATIONS)}")
    for name in ("num_heads", "chunk_size"):
        n = getattr(options, name)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ShapeError(f"neural_memory: {name} is {n!r}, expected an integer >= 1")
    query, key, value, theta, eta, alpha = tokens
    if not isinstance(query, Tensor) or query.dim() not in (3, 4):
        got = tuple(query.shape) if isinstance(query, Tensor) else type(query).__name__
        raise _shape_error("query", got, "(B, T, H*D) or (B, T, H, D)")
    b, t, h = query.shape[0], query.shape[1], options.num_heads
    if query.dim() == 4 and query.shape[2] != h:
        raise _shape_error("query", tuple(query.shape), f"(B, T, num_heads={h}, D)")
    if query.dim() == 3 and query.shape[2] % h:
        raise _shape_error("query", tuple(query.shape), f"(B, T, H*D) with H*D divisible by num_heads={h}")
    d = query.shape[-1] if query.dim() == 4 else query.shape[2] // h
    for name, x in (("query", query), ("key", key), ("value", value)):
        _check_tensor(name, x, tuple(query.shape))
    for name, x in (("theta", theta), ("eta", eta), ("alpha", alpha)):
        _check_tensor(name, x, (b, t, h))
    weights = memory.weights
    if not isinstance(weights, (tuple, list)) or len(weights) not in (1, 2):
        got = f"{len(weights)} tensors" if isinstance(weights, (tuple, list)) else type(weights).__name__
        raise ShapeError(f"neural_memory: past_weights has {got}, expected 1 (depth 1) or 2 (depth 2) tensors")
    if len(weights) == 1:
        expected = [(b, h, d, d)]
    else:
        w1 = weights[0]
        e = w1.shape[-1] if isinstance(w1, Tensor) and w1.dim() == 4 else "E"
        expected = [(b, h, d, e), (b, h, e, d)]
    states = [("past_weights", weights), ("past_momentum", memory.momentum)]
    if memory.chunk_weights is not None:
        states.append(("past_chunk_weights", memory.chunk_weights))
    for name, tensors in states:
        if not isinstance(tensors, (tuple, list)) or len(tensors) != len(weights):
            raise ShapeError(f"neural_memory: {name} must be a tuple of {len(weights)} tensors like past_weights")
        for i, x in enumerate(tensors):
            _check_tensor(f"{name}[{i}]", x, expected[i])
    position = memory.position
    if position is not None:
        if not isinstance(position, Tensor) or position.dtype != torch.int64:
            raise ShapeError(f"neural_memory: past_position must be an int64 tensor of shape ({b},) or (1,)")
        if tuple(position.shape) not in ((b,), (1,)):
            raise _shape_error("past_position", tuple(position.shape), f"({b},) or (1,)")
    if norm is not None:
        _check_tensor("norm_weight", norm.weight, (h, d))
        _check_tensor("norm_bias", norm.bias, (h, d))


def _call(tokens: Tokens, memory: Memory, options: Options, norm: ResidualNorm | None) -> tuple[Tensor, Memory]:
    _check(tokens, memory, options, norm)
    unpacked = tokens.query.dim() == 4
    if unpacked:
        tokens = Tokens(*(x.flatten(2) for x in tokens[:3]), *tokens[3:])
    if torch.onnx.is_in_onnx_export():
        from edgemem.ops.neural_memory.onnx import emit  # imports onnx only when exporting

        y, memory = emit(tokens, memory, options, norm)
    else:
        y, w, s, wc, end = _neural_memory_op(*tokens, *_flat_args(memory, options, norm))
        memory = Memory(tuple(w), tuple(s), tuple(wc), end)
    if unpacked:
        y = y.unflatten(2, (options.num_heads, -1))
    return y, memory


def neural_memory(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    theta: Tensor,
    eta: Tensor,
    alpha: Tensor,
    past_weights: Sequence[Tensor],
    past_momentum: Sequence[Tensor],
    *,
    num_heads: int,
    chunk_size: int = 1,
    activation: str = "silu",
    norm_weight: Tensor | None = None,
    norm_bias: Tensor | None = None,
) -> tuple[Tensor, State, State]:
    """Titans long-term memory (TTT is the case η = α = 0): a per-head MLP trained online.

    query/key/value: `[B, T, H*D]` (or `[B, T, H, D]`; the output keeps the layout).
    theta (learning rate), eta (momentum decay), alpha (forgetting): `[B, T, H]`.
    past_weights: `(W1,)` with W1 `[B, H, D, D]` for M(x) = x W1, or `(W1, W2)` with
    `[B, H, D, E]`, `[B, H, E, D]` for M(x) = act(x W1) W2 (activation: silu, gelu (erf),
    relu or identity); past_momentum likewise. Given `norm_weight` γ and `norm_bias` β
    (`[H, D]`, both or neither) the memory is TTT's M(x) = x + γ ⊙ LN(f(x)) + β around that
    MLP f (LayerNorm over D, eps 1e-6, gradients through it in closed form; γ and β get
    gradients from the op's backward). For ℓ_t = ½‖M(k_t) − v_t‖², in chunks of
    `chunk_size` tokens counted from the start of this call, every gradient of a chunk
    taken at its start weights (closed form, no autograd), per token (Titans eq. 13/14):
        S_t = η_t S_{t−1} − θ_t ∇ℓ_t,   W_t = (1 − α_t) W_{t−1} + S_t,   y_t = M(q_t; W_t).
    Computes in float32 (float64 for float64 inputs); returns `(y, present_weights,
    present_momentum)`, y in query's dtype and the state in the compute dtype. Calls split
    at multiples of `chunk_size` continue each other; to split anywhere, stream with
    `neural_memory_step`. Bad shapes raise `ShapeError`.
    """
    norm = ResidualNorm.of(norm_weight, norm_bias)
    memory = Memory(past_weights, past_momentum)
    tokens = Tokens(query, key, value, theta, eta, alpha)
    y, memory = _call(tokens, memory, Options(num_heads, chunk_size, activation), norm)
    return y, memory.weights, memory.momentum


def neural_memory_step(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    theta: Tensor,
    eta: Tensor,
    alpha: Tensor,
    past_weights: Sequence[Tensor],
    past_momentum: Sequence[Tensor],
    past_chunk_weights: Sequence[Tensor],
    past_position: Tensor,
    *,
    num_heads: int,
    chunk_size: int = 1,
    activation: str = "silu",
    norm_weight: Tensor | None = None,
    norm_bias: Tensor | None = None,
) -> tuple[Tensor, State, State, State, Tensor]:
    """`neural_memory` continuing a stream: one token (T = 1, the step) or a block (prefill).

    Chunks are counted from the start of the stream, not of the call. Besides the memory
    weights and momentum the state holds `past_chunk_weights`, the weights at the start of
    the current chunk (shaped like past_weights), and `past_position`, int64 `[B]` or `[1]`:
    the tokens each row has seen. Where a token's position is a multiple of `chunk_size`
    a new chunk starts and the chunk weights become the current weights. Start a stream
    with `past_chunk_weights = past_weights` and `past_position = 0`; rows may sit at
    different positions. Returns `(y, present_weights, present_momentum,
    present_chunk_weights, present_position)` (position shaped like past_position);
    consecutive calls over pieces of a sequence reproduce one `neural_memory` call over it.
    """
    norm = ResidualNorm.of(norm_weight, norm_bias)
    memory = Memory(past_weights, past_momentum, past_chunk_weights, past_position)
    tokens = Tokens(query, key, value, theta, eta, alpha)
    y, memory = _call(tokens, memory, Options(num_heads, chunk_size, activation), norm)
    return y, memory.weights, memory.momentum, memory.chunk_weights, memory.position
