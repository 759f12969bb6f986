"""`edgemem::banded_attention`: the torch custom op and the public, validated entry point.

The custom op takes the packed `[B, T, H*D]` tensors of the ONNX node; its fake impl gives shapes
and its backward recomputes the differentiable fast form. Under `torch.onnx.export` the public
function emits one opaque `edgemem::BandedAttention` node instead (onnx.py: `emit`, and the
model-local `function` that gives the node a body in standard ops).
"""

from collections.abc import Sequence

import torch

from edgemem.errors import ShapeError
from edgemem.opset import Attribute
from edgemem.ops.banded_attention.chunk import banded_attention_chunk

# The node contract (onnx.py has the details)
OP_TYPE = "BandedAttention"
INPUTS = ("query", "key", "value", "global_mask", "persistent_key", "persistent_value")
OUTPUTS = ("output",)
ATTRIBUTES = {
    "num_heads": Attribute("int"),
    "window": Attribute("int"),
    "dilation": Attribute("ints"),
    "causal": Attribute("int"),
    "scale": Attribute("float"),
}


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


def describe(x: object) -> str:
    """A tensor as its shape and dtype, anything else as its repr, for error messages."""
    return f"shape {tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else repr(x)


def _positive_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def check_layout(
    op: str, query: object, key: object, value: object, num_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query, key `[B, T, H*D]` and value `[B, T, H*D_v]`, or all `[B, T, H, D]`, one floating
    dtype; returns them as `[B, T, H, D]`."""
    if not _positive_int(num_heads):
        raise ShapeError(f"{op}: num_heads must be an int >= 1; got {num_heads!r}")
    if not (isinstance(query, torch.Tensor) and query.dim() in (3, 4)):
        raise ShapeError(f"{op}: query is {describe(query)}; expected [B, T, H*D] or [B, T, H, D]")
    packed = query.dim() == 3
    expected = "[B, T, H*D]" if packed else f"[B, T, {num_heads}, D]"
    heads = []
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype == query.dtype):
            raise ShapeError(f"{op}: {name} is {describe(x)}; expected a floating tensor of query's dtype")
        if x.dim() != query.dim() or (x.shape[-1] % num_heads if packed else x.shape[2] != num_heads):
            raise ShapeError(f"{op}: {name} has shape {tuple(x.shape)}; expected {expected} with H = {num_heads}")
        heads.append(x.unflatten(2, (num_heads, -1)) if packed else x)
    q, k, v = heads
    if k.shape != q.shape:
        raise ShapeError(f"{op}: key has shape {tuple(key.shape)}; expected query's {tuple(query.shape)}")
    if v.shape[:2] != q.shape[:2]:
        raise ShapeError(
            f"{op}: value has shape {tuple(value.shape)}; expected query's batch and time {tuple(q.shape[:2])}"
        )
    return q, k, v


def check_window(op: str, window: object, dilation: object, num_heads: int) -> list[int]:
    """window an int >= 1; dilation an int >= 1 or one per head. Returns one dilation per head."""
    if not _positive_int(window):
        raise ShapeError(f"{op}: window must be an int >= 1; got {window!r}")
    if _positive_int(dilation):
        return [dilation] * num_heads
    if not (isinstance(dilation, Sequence) and len(dilation) == num_heads and all(map(_positive_int, dilation))):
        raise ShapeError(f"{op}: dilation must be an int >= 1 or one such int per head ({num_heads}); got {dilation!r}")
    return list(dilation)


def check_persistent(
    op: str, persistent_key: object, persistent_value: object, q: torch.Tensor, v: torch.Tensor
) -> None:
    """persistent_key `[H, P, D]` or `[B, H, P, D]`, persistent_value the same with D_v; or both None."""
    if persistent_key is None and persistent_value is None:
        return
    b, _, h, d = q.shape
    for name, x, dim in (("persistent_key", persistent_key, d), ("persistent_value", persistent_value, v.shape[-1])):
        if not (
            isinstance(x, torch.Tensor)
            and x.is_floating_point()
            and x.dim() in (3, 4)
            and x.shape[-3] == h
            and x.shape[-1] == dim
            and (x.dim() == 3 or x.shape[0] == b)
        ):
            raise ShapeError(
                f"{op}: {name} is {describe(x)}; expected a floating tensor [H, P, {dim}] or [B, H, P, {dim}] "
                f"with B = {b}, H = {h}"
            )
    if persistent_key.shape[:-1] != persistent_value.shape[:-1]:
        raise ShapeError(
            f"{op}: persistent_value has shape {tuple(persistent_value.shape)}; expected the leading dims "
            f"{tuple(persistent_key.shape[:-1])} of persistent_key"
        )


def check_scale(op: str, scale: object, head_dim: int) -> float:
    """scale a number, or None for head_dim^-½."""
    if scale is None:
        return head_dim**-0.5
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise ShapeError(f"{op}: scale must be a number or None; got {scale!r}")
    return float(scale)


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
    for float64 inputs); the output has the input dtype. Time and memory O(T·(window + G + P))
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
