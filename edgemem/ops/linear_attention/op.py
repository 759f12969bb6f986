"""`edgemem::linear_attention`: the torch custom op every layer calls.

One opaque node for torch.export, a fake impl for shape propagation, and a backward that
recomputes the differentiable chunk form, so layers train through it. Under
`torch.onnx.export` the public function emits one opaque `edgemem::LinearAttention` node
instead (plugin `LinearAttention`; onnx.py: `emit`, and the model-local `function` that gives
the node a body in standard ops).
"""

from __future__ import annotations

import torch

from edgemem.errors import ShapeError
from edgemem.ops.dtypes import compute_dtype
from edgemem.ops.linear_attention.chunk import linear_attention_chunk
from edgemem.ops.linear_attention.contract import INPUTS
from edgemem.ops.linear_attention.naive import linear_attention_naive


@torch.library.custom_op("edgemem::linear_attention", mutates_args=())
def _linear_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_state: torch.Tensor | None,
    decay: torch.Tensor | None,
    beta: torch.Tensor | None,
    update_rule: str,
    scale: float,
    q_num_heads: int,
    kv_num_heads: int,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    kwargs = dict(update_rule=update_rule, scale=scale, q_num_heads=q_num_heads, kv_num_heads=kv_num_heads)
    if query.shape[1] == 1:  # decode: the recurrence is one step, no chunk set-up
        return linear_attention_naive(query, key, value, past_state, decay, beta, **kwargs)
    return linear_attention_chunk(query, key, value, past_state, decay, beta, chunk_size=chunk_size, **kwargs)


@_linear_attention.register_fake
def _(query, key, value, past_state, decay, beta, update_rule, scale, q_num_heads, kv_num_heads, chunk_size):
    b, t, _ = query.shape
    d_k = query.shape[-1] // q_num_heads
    d_v = value.shape[-1] // kv_num_heads
    state_dtype = past_state.dtype if past_state is not None else compute_dtype(query, key, value)
    return (
        query.new_empty((b, t, q_num_heads * d_v)),
        query.new_empty((b, kv_num_heads, d_k, d_v), dtype=state_dtype),
    )


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:6])
    ctx.attrs = inputs[6:]


def _backward(ctx, grad_output, grad_state):
    tensors = [None if t is None else t.detach().requires_grad_(t.is_floating_point()) for t in ctx.saved_tensors]
    update_rule, scale, q_num_heads, kv_num_heads, chunk_size = ctx.attrs
    with torch.enable_grad():
        outputs = linear_attention_chunk(
            *tensors,
            update_rule=update_rule,
            scale=scale,
            q_num_heads=q_num_heads,
            kv_num_heads=kv_num_heads,
            chunk_size=chunk_size,
        )
        needed = [t for t in tensors if t is not None]
        grads = iter(torch.autograd.grad(outputs, needed, (grad_output, grad_state), allow_unused=True))
    return (*(None if t is None else next(grads) for t in tensors), None, None, None, None, None)


_linear_attention.register_autograd(_backward, setup_context=_setup_context)


def linear_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_state: torch.Tensor | None = None,
    decay: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    *,
    update_rule: str,
    scale: float = 0.0,
    q_num_heads: int,
    kv_num_heads: int,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ONNX opset-27 LinearAttention.

    query `[B, T, H_q*d_k]`, key `[B, T, H_kv*d_k]`, value `[B, T, H_kv*d_v]` (or the same as
    `[B, T, H, D]`, giving the output in that layout); past_state `[B, H_kv, d_k, d_v]`;
    decay: log-space, `[B, T, H_kv]` or `[B, T, H_kv*d_k]`; beta `[B, T, H_kv]` or `[B, T, 1]`.
    `update_rule` is linear | gated | delta | gated_delta; `scale` 0 means d_k^-½; query head h
    reads kv head h // (q_num_heads // kv_num_heads). Returns (output, present_state). The state
    accumulates in float32 (float64 for float64 inputs); present_state has past_state's dtype,
    or the accumulation dtype when there is no past_state. `chunk_size` only tunes speed.
    Under `torch.onnx.export` this is one `edgemem::LinearAttention` node whose present_state
    is float32 (see onnx.py).
    """
    unpacked = query.dim() == 4
    if unpacked:
        for name, x, heads in (
            ("query", query, q_num_heads),
            ("key", key, kv_num_heads),
            ("value", value, kv_num_heads),
        ):
            if x.dim() != 4 or x.shape[2] != heads:
                raise ShapeError(f"{name} must be [B, T, {heads}, D] like query's 4-D layout; got {tuple(x.shape)}")
        query, key, value = (x.flatten(2) for x in (query, key, value))
    if chunk_size < 1:
        raise ShapeError(f"chunk_size must be a positive integer; got {chunk_size}")
    for name, x in zip(INPUTS, (query, key, value, past_state, decay, beta)):
        if x is not None and not isinstance(x, torch.Tensor):
            raise ShapeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    if torch.onnx.is_in_onnx_export():
        from edgemem.ops.linear_attention.onnx import emit  # imports onnx only when exporting

        attrs = dict(update_rule=update_rule, scale=float(scale), q_num_heads=q_num_heads, kv_num_heads=kv_num_heads)
        output, state = emit(query, key, value, past_state, decay, beta, **attrs, chunk_size=chunk_size)
    else:
        output, state = _linear_attention(
            query, key, value, past_state, decay, beta, update_rule, float(scale), q_num_heads, kv_num_heads, chunk_size
        )
    if unpacked:
        output = output.unflatten(2, (q_num_heads, -1))
    return output, state
