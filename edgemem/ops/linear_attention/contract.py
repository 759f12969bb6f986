"""The LinearAttention contract (ONNX opset 27): the node's name, inputs, outputs and attributes
(onnx.py has the details), the argument checks, unpacking and repacking.

Both forms (`naive`, `chunk`) take the op's public signature and go through `prepare`, so
they see the same validated tensors: q `[B, H_kv, G, T, d_k]` (G = query heads per kv
head), k `[B, H_kv, T, d_k]`, v `[B, H_kv, T, d_v]`, decay `[B, H_kv, T, 1 | d_k]`,
beta `[B, H_kv, T, 1]`, state `[B, H_kv, d_k, d_v]`, all in the compute dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from edgemem.errors import ShapeError
from edgemem.ops.dtypes import compute_dtype
from edgemem.opset import Attribute

OP_TYPE = "LinearAttention"
INPUTS = ("query", "key", "value", "past_state", "decay", "beta")
OUTPUTS = ("output", "present_state")
ATTRIBUTES = {  # as in ONNX opset 27
    "update_rule": Attribute("string", "gated_delta"),
    "scale": Attribute("float", 0.0),
    "q_num_heads": Attribute("int"),
    "kv_num_heads": Attribute("int"),
    "chunk_size": Attribute("int", 64),
}
UPDATE_RULES = ("linear", "gated", "delta", "gated_delta")


@dataclass
class Prepared:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    decay: torch.Tensor | None
    beta: torch.Tensor | None
    state: torch.Tensor
    scale: float
    gated: bool
    delta: bool
    out_dtype: torch.dtype
    state_dtype: torch.dtype


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    b, t, hd = x.shape
    return x.reshape(b, t, heads, hd // heads).transpose(1, 2)


def check(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_state: torch.Tensor | None,
    decay: torch.Tensor | None,
    beta: torch.Tensor | None,
    update_rule: str,
    q_num_heads: int,
    kv_num_heads: int,
) -> tuple[bool, bool, int, int]:
    """Shape and rule checks shared by both forms and the ONNX emitter: (gated, delta, d_k, d_v)."""
    if update_rule not in UPDATE_RULES:
        raise ShapeError(f"update_rule must be one of {', '.join(UPDATE_RULES)}; got {update_rule!r}")
    if q_num_heads <= 0 or kv_num_heads <= 0 or q_num_heads % kv_num_heads:
        raise ShapeError(f"q_num_heads ({q_num_heads}) must be a positive multiple of kv_num_heads ({kv_num_heads})")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.dim() != 3:
            raise ShapeError(f"{name} must be [B, T, H*D] (or [B, T, H, D]); got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise ShapeError(f"{name} must be a floating-point tensor; got {x.dtype}")
    b, t, _ = query.shape
    for name, x in (("key", key), ("value", value)):
        if tuple(x.shape[:2]) != (b, t):
            raise ShapeError(f"{name} has batch/time {tuple(x.shape[:2])} but query has {(b, t)}; they must match")
    for name, x, heads in (("query", query, q_num_heads), ("key", key, kv_num_heads), ("value", value, kv_num_heads)):
        if x.shape[-1] % heads:
            raise ShapeError(f"{name} last dim {x.shape[-1]} is not divisible by its {heads} heads")
    d_k = query.shape[-1] // q_num_heads
    if key.shape[-1] // kv_num_heads != d_k:
        raise ShapeError(f"key head dim {key.shape[-1] // kv_num_heads} differs from query head dim {d_k}")
    d_v = value.shape[-1] // kv_num_heads

    gated = update_rule in ("gated", "gated_delta")
    delta = update_rule in ("delta", "gated_delta")
    if gated != (decay is not None):
        raise ShapeError(f"update_rule {update_rule!r} {'requires' if gated else 'takes no'} decay")
    if delta != (beta is not None):
        raise ShapeError(f"update_rule {update_rule!r} {'requires' if delta else 'takes no'} beta")
    if decay is not None and (
        decay.dim() != 3 or decay.shape[:2] != (b, t) or decay.shape[-1] not in (kv_num_heads, kv_num_heads * d_k)
    ):
        raise ShapeError(
            f"decay must be [B, T, H_kv] = {[b, t, kv_num_heads]} or [B, T, H_kv*d_k] = "
            f"{[b, t, kv_num_heads * d_k]}; got {list(decay.shape)}"
        )
    if beta is not None and (beta.dim() != 3 or beta.shape[:2] != (b, t) or beta.shape[-1] not in (kv_num_heads, 1)):
        raise ShapeError(f"beta must be [B, T, H_kv] = {[b, t, kv_num_heads]} or [B, T, 1]; got {list(beta.shape)}")
    if past_state is not None and tuple(past_state.shape) != (b, kv_num_heads, d_k, d_v):
        raise ShapeError(
            f"past_state must be [B, H_kv, d_k, d_v] = {[b, kv_num_heads, d_k, d_v]}; got {list(past_state.shape)}"
        )
    return gated, delta, d_k, d_v


def prepare(
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
) -> Prepared:
    gated, delta, d_k, d_v = check(query, key, value, past_state, decay, beta, update_rule, q_num_heads, kv_num_heads)
    b, t, _ = query.shape
    dtype = compute_dtype(query, key, value, past_state)
    group = q_num_heads // kv_num_heads
    q = _heads(query, q_num_heads).to(dtype).reshape(b, kv_num_heads, group, t, d_k)
    k = _heads(key, kv_num_heads).to(dtype)
    v = _heads(value, kv_num_heads).to(dtype)

    if decay is not None:
        decay = _heads(decay, kv_num_heads).to(dtype)
    if beta is not None:
        beta = _heads(beta, beta.shape[-1]).to(dtype).expand(b, kv_num_heads, t, 1)

    if past_state is None:
        state = query.new_zeros((b, kv_num_heads, d_k, d_v), dtype=dtype)
        state_dtype = dtype
    else:
        state = past_state.to(dtype)
        state_dtype = past_state.dtype
    return Prepared(
        q=q,
        k=k,
        v=v,
        decay=decay,
        beta=beta,
        state=state,
        scale=scale if scale else 1.0 / math.sqrt(d_k),
        gated=gated,
        delta=delta,
        out_dtype=query.dtype,
        state_dtype=state_dtype,
    )


def finish(output: torch.Tensor, state: torch.Tensor, p: Prepared) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, H_kv, G, T, d_v] → packed [B, T, H_q*d_v] in the query's dtype; state in its dtype."""
    b, h, g, t, d_v = output.shape
    output = output.reshape(b, h * g, t, d_v).transpose(1, 2).reshape(b, t, h * g * d_v)
    return output.to(p.out_dtype), state.to(p.state_dtype)
