"""`edgemem::window_attention`: streaming causal banded attention over a ring buffer.

The custom op takes the packed tensors of the ONNX node, has a fake impl and a backward that
recomputes the fast form. Under `torch.onnx.export` the public functions emit one opaque
`edgemem::WindowAttention` node instead (onnx.py: `emit`, and the model-local `function` that
gives the node a body in standard ops).
"""

from collections.abc import Sequence

import torch

from edgemem.errors import ShapeError
from edgemem.ops.banded_attention.contract import check_layout, check_persistent, check_scale, check_window, describe
from edgemem.ops.window_attention.chunk import window_attention_chunk


def ring_length(window: int, dilation: int | Sequence[int] = 1) -> int:
    """Slots L of the ring buffer: window·max(dilation), the farthest key a query looks back to."""
    return window * (dilation if isinstance(dilation, int) else max(dilation))


def init_window_state(
    batch: int,
    num_heads: int,
    head_dim: int,
    *,
    window: int,
    dilation: int | Sequence[int] = 1,
    value_dim: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The empty stream: zero ring buffers `[B, H, L, D]`, `[B, H, L, D_v]`, to use with position 0."""
    ring = ring_length(window, dilation)
    return (
        torch.zeros(batch, num_heads, ring, head_dim, device=device, dtype=dtype),
        torch.zeros(batch, num_heads, ring, head_dim if value_dim is None else value_dim, device=device, dtype=dtype),
    )


def _forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    position: torch.Tensor,
    persistent_key: torch.Tensor | None,
    persistent_value: torch.Tensor | None,
    num_heads: int,
    window: int,
    dilation: list[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = (x.unflatten(2, (num_heads, -1)) for x in (query, key, value))
    out, present_key, present_value = window_attention_chunk(
        q,
        k,
        v,
        past_key,
        past_value,
        position,
        window=window,
        dilation=dilation,
        scale=scale,
        persistent_key=persistent_key,
        persistent_value=persistent_value,
    )
    return out.flatten(2), present_key, present_value


_window_attention = torch.library.custom_op("edgemem::window_attention", mutates_args=())(_forward)


@_window_attention.register_fake
def _(query, key, value, past_key, past_value, *_):
    return (
        query.new_empty((*query.shape[:2], value.shape[-1])),
        torch.empty_like(past_key),
        torch.empty_like(past_value),
    )


@torch.library.custom_op("edgemem::window_attention_backward", mutates_args=())
def _window_attention_backward(
    grad_output: torch.Tensor,
    grad_present_key: torch.Tensor,
    grad_present_value: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    position: torch.Tensor,
    persistent_key: torch.Tensor | None,
    persistent_value: torch.Tensor | None,
    num_heads: int,
    window: int,
    dilation: list[int],
    scale: float,
) -> list[torch.Tensor]:
    """Gradients of query, key, value, past_key, past_value (and persistent_key/value when
    given), by recomputing the fast form; opaque to tracing like the forward."""
    inputs = [x for x in (query, key, value, past_key, past_value, persistent_key, persistent_value) if x is not None]

    def forward(q, k, v, past_k, past_v, *persistent):
        persistent = persistent or (None, None)
        return _forward(q, k, v, past_k, past_v, position, *persistent, num_heads, window, dilation, scale)

    # the kernel runs below autograd, so differentiate with torch.func
    return list(torch.func.vjp(forward, *inputs)[1]((grad_output, grad_present_key, grad_present_value)))


@_window_attention_backward.register_fake
def _(
    grad_output,
    grad_present_key,
    grad_present_value,
    query,
    key,
    value,
    past_key,
    past_value,
    position,
    persistent_key,
    persistent_value,
    *_,
):
    given = (query, key, value, past_key, past_value, persistent_key, persistent_value)
    return [torch.empty_like(x) for x in given if x is not None]


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:8])
    ctx.attrs = inputs[8:]


def _backward(ctx, grad_output, grad_present_key, grad_present_value):
    dq, dk, dv, dpast_k, dpast_v, *dp = _window_attention_backward(
        grad_output, grad_present_key, grad_present_value, *ctx.saved_tensors, *ctx.attrs
    )
    dpk, dpv = dp or (None, None)
    return dq, dk, dv, dpast_k, dpast_v, None, dpk, dpv, None, None, None, None


_window_attention.register_autograd(_backward, setup_context=_setup_context)


def window_attention_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    position: torch.Tensor | int,
    *,
    num_heads: int,
    window: int,
    dilation: int | Sequence[int] = 1,
    persistent_key: torch.Tensor | None = None,
    persistent_value: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """T new tokens of a stream, continuing from its ring buffers. Returns (output, present_key, present_value).

    The streaming form of `banded_attention(..., causal=True, persistent_key=, persistent_value=)`:
    a prefill of the whole sequence from the empty state, or any split of it into prefills and
    steps, gives the same outputs.

    query, key `[B, T, H*D]`, value `[B, T, H*D_v]` (or `[B, T, H, D]`; output in the same layout).
    position: int or int64 `[]` / `[B]`, the absolute index (≥ 0) of the first new token of each stream.
    State: past_key `[B, H, L, D]`, past_value `[B, H, L, D_v]` with L = `ring_length(window,
    dilation)` = window·max(dilation), holding the L tokens before `position`: the token at
    absolute position a lives in slot a mod L. Slots that would hold a negative position are
    never read, so zeros (`init_window_state`) with position 0 is the empty stream.

    The token at absolute position p attends, in head h with dilation d_h, the keys at
    p − o·d_h for o = 0..window that are ≥ 0 — itself always — plus every persistent token
    (persistent_key `[H, P, D]` or `[B, H, P, D]`, persistent_value likewise with D_v: fixed keys
    outside the sequence). Global tokens of the sequence have no streaming form (a global query
    needs every past key); fixed global K/V go in as persistent tokens.

    present_key/present_value hold the L tokens before position + T in the same slot layout, in
    the dtype of past_key/past_value; the caller advances position by T. Softmax in float32
    (float64 for float64 queries), output in the query dtype. Cost O(T·window + L).
    """
    op = "window_attention"
    q, k, v = check_layout(op, query, key, value, num_heads)
    dilation = check_window(op, window, dilation, num_heads)
    b, _, h, d = q.shape
    ring = ring_length(window, dilation)
    for name, x, dim in (("past_key", past_key, d), ("past_value", past_value, v.shape[-1])):
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.shape == (b, h, ring, dim)):
            raise ShapeError(
                f"{op}: {name} is {describe(x)}; expected a floating tensor [B, H, L, {dim}] = "
                f"[{b}, {h}, {ring}, {dim}] (L = window·max(dilation))"
            )
    position = torch.as_tensor(position, device=q.device)
    if position.is_floating_point() or position.dtype == torch.bool or position.shape not in ((), (b,)):
        raise ShapeError(f"{op}: position is {describe(position)}; expected an integer tensor [] or [B] = [{b}]")
    check_persistent(op, persistent_key, persistent_value, q, v)
    position = position.to(torch.int64).reshape(-1).expand(b)
    args = (q.flatten(2), k.flatten(2), v.flatten(2), past_key, past_value, position, persistent_key, persistent_value)
    attrs = dict(num_heads=num_heads, window=window, dilation=dilation, scale=check_scale(op, scale, d))
    if torch.onnx.is_in_onnx_export():
        from edgemem.ops.window_attention.onnx import emit  # imports onnx only when exporting

        out, present_key, present_value = emit(*args, **attrs)
    else:
        out, present_key, present_value = _window_attention(*args, *attrs.values())
    return (out.unflatten(2, (num_heads, -1)) if query.dim() == 4 else out), present_key, present_value


def window_attention_step(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    position: torch.Tensor | int,
    *,
    num_heads: int,
    window: int,
    dilation: int | Sequence[int] = 1,
    persistent_key: torch.Tensor | None = None,
    persistent_value: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode token: `window_attention_prefill` with T = 1 (query `[B, 1, H*D]` or `[B, 1, H, D]`).

    Reads window+1 keys per head and rewrites ring slot position mod L.
    """
    if isinstance(query, torch.Tensor) and query.dim() in (3, 4) and query.shape[1] != 1:
        raise ShapeError(f"window_attention_step: query has shape {tuple(query.shape)}; expected one token, T = 1")
    return window_attention_prefill(
        query,
        key,
        value,
        past_key,
        past_value,
        position,
        num_heads=num_heads,
        window=window,
        dilation=dilation,
        persistent_key=persistent_key,
        persistent_value=persistent_value,
        scale=scale,
    )
