"""`edgemem::banded_attention`: the torch custom op and the public, validated entry point.

The custom op takes the packed `[B, T, H*D]` tensors of the ONNX node; its fake impl gives shapes
and its backward recomputes the differentiable fast form. Under `torch.onnx.export` the public
function emits one opaque `edgemem::BandedAttention` node instead (onnx.py: `emit`, and the
model-local `function` that gives the node a body in standard ops).
"""

from collections.abc import Sequence

import torch

from edgemem.errors import ShapeError
from edgemem.ops.banded_attention.chunk import banded_attention_chunk
from edgemem.ops.banded_attention.contract import check_layout, check_persistent, check_scale, check_window, describe


def _forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    global_mask: torch.Tensor | None,
    persistent_key: torch.Tensor | None,
    persistent_value: torch.Tensor | None,
    num_heads: int,
    window: int,
    dilation: list[int],
    causal: bool,
    scale: float,
) -> torch.Tensor:
    q, k, v = (x.unflatten(2, (num_heads, -1)) for x in (query, key, value))
    out = banded_attention_chunk(
        q,
        k,
        v,
        window=window,
        dilation=dilation,
        causal=causal,
        global_mask=global_mask,
        scale=scale,
        persistent_key=persistent_key,
        persistent_value=persistent_value,
    )
    return out.flatten(2)


_banded_attention = torch.library.custom_op("edgemem::banded_attention", mutates_args=())(_forward)


@_banded_attention.register_fake
def _(query, key, value, *_):
    return query.new_empty((*query.shape[:2], value.shape[-1]))


@torch.library.custom_op("edgemem::banded_attention_backward", mutates_args=())
def _banded_attention_backward(
    grad: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    global_mask: torch.Tensor | None,
    persistent_key: torch.Tensor | None,
    persistent_value: torch.Tensor | None,
    num_heads: int,
    window: int,
    dilation: list[int],
    causal: bool,
    scale: float,
) -> list[torch.Tensor]:
    """Gradients of query, key, value (and persistent_key/value when given), by recomputing the
    fast form. An op of its own: the global rows have a data-dependent size, so the backward
    must be opaque to tracing as the forward is."""
    inputs = [x for x in (query, key, value, persistent_key, persistent_value) if x is not None]

    def forward(q, k, v, *persistent):
        return _forward(q, k, v, global_mask, *(persistent or (None, None)), num_heads, window, dilation, causal, scale)

    # the kernel runs below autograd, so differentiate with torch.func
    return list(torch.func.vjp(forward, *inputs)[1](grad))


@_banded_attention_backward.register_fake
def _(grad, query, key, value, global_mask, persistent_key, persistent_value, *_):
    given = (query, key, value, persistent_key, persistent_value)
    return [torch.empty_like(x) for x in given if x is not None]


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:6])
    ctx.attrs = inputs[6:]


def _backward(ctx, grad):
    query, key, value, global_mask, persistent_key, persistent_value = ctx.saved_tensors
    dq, dk, dv, *dp = _banded_attention_backward(
        grad, query, key, value, global_mask, persistent_key, persistent_value, *ctx.attrs
    )
    dpk, dpv = dp or (None, None)
    return dq, dk, dv, None, dpk, dpv, None, None, None, None, None


_banded_attention.register_autograd(_backward, setup_context=_setup_context)


def banded_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    num_heads: int,
    window: int,
    dilation: int | Sequence[int] = 1,
    causal: bool = False,
    global_mask: torch.Tensor | None = None,
    scale: float | None = None,
    persistent_key: torch.Tensor | None = None,
    persistent_value: torch.Tensor | None = None,
) -> torch.Tensor:
    """Longformer attention: dilated sliding window, global tokens, persistent tokens.

    query, key `[B, T, H*D]` and value `[B, T, H*D_v]` (or `[B, T, H, D]`, `[B, T, H, D_v]`; the
    output `[B, T, H*D_v]` comes in the same layout). With d_h the dilation of head h (an int,
    or one per head), query i attends key j when

        |i − j| ≤ window·d_h and (i − j) mod d_h = 0   (the dilated band)
        or global_mask[b, j]                            (a global key: every query sees it)
        or global_mask[b, i]                            (a global query sees every key)

    and, if causal, j ≤ i in every case. global_mask is bool `[B, T]`. The P persistent tokens
    (persistent_key `[H, P, D]` or per sequence `[B, H, P, D]`, persistent_value likewise with
    D_v) are keys outside the sequence that every query attends, causal or not; they are never
    queries. Softmax runs over the allowed keys with `scale` (default D^-½) in float32 (float64
    for float64 inputs); the output has the input dtype. Time and memory O(T·(window·max(dilation) + G + P))
    for G global tokens, plus O(G·T) for the global rows; no T×T matrix.
    """
    op = "banded_attention"
    q, k, v = check_layout(op, query, key, value, num_heads)
    dilation = check_window(op, window, dilation, num_heads)
    b, t, _, d = q.shape
    if global_mask is not None and not (
        isinstance(global_mask, torch.Tensor) and global_mask.dtype == torch.bool and global_mask.shape == (b, t)
    ):
        raise ShapeError(f"{op}: global_mask is {describe(global_mask)}; expected a bool tensor [B, T] = [{b}, {t}]")
    check_persistent(op, persistent_key, persistent_value, q, v)
    args = (q.flatten(2), k.flatten(2), v.flatten(2), global_mask, persistent_key, persistent_value)
    scale = check_scale(op, scale, d)
    attrs = dict(num_heads=num_heads, window=window, dilation=dilation, causal=bool(causal), scale=scale)
    if torch.onnx.is_in_onnx_export():
        from edgemem.ops.banded_attention.onnx import emit  # imports onnx only when exporting

        out = emit(*args, **attrs)
    else:
        out = _banded_attention(*args, *attrs.values())
    return out.unflatten(2, (num_heads, -1)) if query.dim() == 4 else out
