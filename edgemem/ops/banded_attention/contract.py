"""The BandedAttention contract: the node's name, inputs, outputs and attributes (onnx.py has the
details), and the argument checks `banded_attention`, `window_attention` and the layers share."""

from collections.abc import Sequence

import torch

from edgemem.errors import ShapeError
from edgemem.opset import Attribute

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
