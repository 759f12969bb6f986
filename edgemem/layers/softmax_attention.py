"""Causal multi-head softmax attention with RoPE and a KV cache: the baseline whose state grows.

Options cover the attention layers of hybrid models: grouped K/V heads (GQA), a head width of
its own, RoPE on the first `rotary_dim` channels of a head only (partial RoPE) with base
`rope_theta`, per-head RMSNorm of q and k before RoPE (`qk_norm`, scale 1 + w with
`norm_unit_offset`), and a sigmoid output gate per channel (`output_gate`: the q projection
gives, per head, d query channels then d gate channels).

Two cache layouts:
- growing (`max_length` None): state `key`, `value` `[B, H_kv, L, D]` holding every past token
  (L = position), `present = concat(past, new)`; what onnxruntime-genai's llama contract expects.
- preallocated (`max_length` = L): state `key`, `value` `[B, H_kv, L, D]` of fixed size and
  `position` (int64 `[B]`, per row, so streams at any positions share a batch); the new rows are
  written at each row's position (`edgemem::CacheAttention`, in place on the `ort` target).
  Past L tokens: an error (`CacheFullError`), or with `sinks` = S a sliding window with attention
  sinks (StreamingLLM): the first S tokens stay, the other L − S slots are a ring of the latest
  tokens. RoPE in the window: keys are cached rotated at their absolute positions; StreamingLLM
  numbers positions inside the cache (sinks 0..S−1, the ring's tokens by age up to L − 1), which
  keeps every ring distance p − a and makes a sink's distance (L − 1) − s once p ≥ L. So the query
  is rotated at p for the ring and at min(p, L − 1) for the sinks: the same scores, no re-rotation.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from edgemem.errors import CacheFullError, ConfigError, named
from edgemem.layers.base import State, StatefulLayer
from edgemem.layers.common import rms_norm, rope
from edgemem.ops.cache_attention import cache_attention


class AttentionProjections(StatefulLayer):
    """The q/k/v/output projections, q/k norms and output gate of an attention layer, shared by
    `SoftmaxAttention` and the layers that replace it in place (LiZA), so weights move between them."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        rope_theta: float = 10000.0,
        rotary_dim: int | None = None,
        qk_norm: bool = False,
        norm_unit_offset: bool = False,
        norm_eps: float = 1e-6,
        output_gate: bool = False,
    ):
        super().__init__()
        if head_dim is None and d_model % num_heads:
            raise ConfigError(f"d_model ({d_model}) is not divisible by num_heads ({num_heads})")
        self.num_heads, self.head_dim = num_heads, head_dim or d_model // num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.rotary_dim = rotary_dim or self.head_dim
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ConfigError(f"rotary_dim ({self.rotary_dim}) must be even and at most head_dim ({self.head_dim})")
        if num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        self.rope_theta, self.output_gate = rope_theta, output_gate
        q_width = num_heads * self.head_dim * (2 if output_gate else 1)
        self.split = [q_width, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim]
        self.qkv = nn.Linear(d_model, sum(self.split), bias=False)
        self.out = nn.Linear(num_heads * self.head_dim, d_model, bias=False)
        self.q_norm = rms_norm(self.head_dim, norm_eps, norm_unit_offset) if qk_norm else None
        self.k_norm = rms_norm(self.head_dim, norm_eps, norm_unit_offset) if qk_norm else None

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """q `[B, H, T, D]`, k and v `[B, H_kv, T, D]` (q and k normed, not rotated) and the output
        gate's logits `[B, T, H·D]` (None without an output gate)."""
        q, k, v = self.qkv(x).split(self.split, dim=-1)
        gate = None
        if self.output_gate:
            q, gate = q.unflatten(2, (self.num_heads, 2, self.head_dim)).unbind(3)
            gate = gate.flatten(2)
        else:
            q = q.unflatten(2, (self.num_heads, self.head_dim))
        k = k.unflatten(2, (self.num_kv_heads, self.head_dim))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        v = v.unflatten(2, (self.num_kv_heads, self.head_dim))
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), gate

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE of `x` `[B, H, T, D]` at `positions` `[T]` or `[B, T]`."""
        return rope(x, positions, self.rope_theta, self.rotary_dim)

    def output(self, y: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """The output projection of y `[B, T, H·D]`, through the sigmoid output gate if any."""
        return self.out(y if gate is None else y * torch.sigmoid(gate))


class SoftmaxAttention(AttentionProjections):
    """State: `key`, `value` after RoPE, growing or preallocated (+ `position`), see the module docstring."""

    forwards_options_to = AttentionProjections  # **options are the projections' options

    def __init__(
        self, d_model: int, num_heads: int, *, max_length: int | None = None, sinks: int | None = None, **options: Any
    ):
        super().__init__(d_model, num_heads, **options)
        self.set_cache(max_length, sinks)

    def set_cache(self, max_length: int | None, sinks: int | None = None) -> None:
        """The cache layout (module docstring): growing (None), or `max_length` slots with `sinks` (None: error past it)."""  # noqa: E501
        length, sink = named("max_length", "--max-length"), named("sinks", "--sinks")
        if max_length is not None and (type(max_length) is not int or max_length < 1):
            raise ConfigError(f"{length} must be a positive integer; got {max_length!r}")
        if sinks is not None and (max_length is None or type(sinks) is not int or not 0 <= sinks < max_length):
            raise ConfigError(
                f"{sink} (attention sinks of the sliding window) must be an integer in [0, {length}) "
                f"with {length} set; got {sink} {sinks!r}, {length} {max_length!r}"
            )
        self.max_length, self.sinks = max_length, sinks

    def init_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype | None = None) -> State:
        shape = (batch, self.num_kv_heads, self.max_length or 0, self.head_dim)
        dtype = self.state_dtype(dtype)
        state = {
            "key": torch.zeros(shape, device=device, dtype=dtype),
            "value": torch.zeros(shape, device=device, dtype=dtype),
        }
        if self.max_length is not None:
            state["position"] = torch.zeros(batch, dtype=torch.int64, device=device)
        return state

    def prefill(self, x: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        b, t, _ = x.shape
        q, k, v, gate = self.project(x)
        if self.max_length is not None:
            return self._prefill_cache(q, k, v, gate, state)
        past = state["key"].shape[2]
        positions = torch.arange(past, past + t, device=x.device)
        q, k = self.rotate(q, positions), self.rotate(k, positions)
        keys = torch.cat([state["key"].to(x.dtype), k], dim=2)
        values = torch.cat([state["value"].to(x.dtype), v], dim=2)
        if self.num_kv_heads != self.num_heads:
            group = self.num_heads // self.num_kv_heads
            keys_q, values_q = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        else:
            keys_q, values_q = keys, values
        # query i sits at position past + i and sees keys 0 … past + i
        mask = torch.ones(t, past + t, dtype=torch.bool, device=x.device).tril(past)
        y = F.scaled_dot_product_attention(q, keys_q, values_q, attn_mask=mask).transpose(1, 2).reshape(b, t, -1)
        y = self.output(y, gate)
        dtype = state["key"].dtype
        return y, {"key": keys.to(dtype), "value": values.to(dtype)}

    def _prefill_cache(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None, state: State
    ) -> tuple[torch.Tensor, State]:
        """The preallocated cache, from `project`'s q `[B, H, T, D]`, k and v `[B, H_kv, T, D]`."""
        t = q.shape[2]
        position = state["position"]
        if self.sinks is None and not torch.onnx.is_in_onnx_export() and int(position.max()) + t > self.max_length:
            raise CacheFullError(
                f"the KV cache holds max_length={self.max_length} tokens; a stream at position "
                f"{int(position.max())} cannot take {t} more (export with a larger max_length, or sinks "
                "for a sliding window)"
            )
        positions = position[:, None] + torch.arange(t, device=q.device)  # [B, T]

        def packed(x: torch.Tensor) -> torch.Tensor:  # [B, H, T, D] → [B, T, H·D]
            return x.transpose(1, 2).flatten(2)

        query, key = packed(self.rotate(q, positions)), packed(self.rotate(k, positions))
        sink_query = None if self.sinks is None else packed(self.rotate(q, positions.clamp(max=self.max_length - 1)))
        y, present_key, present_value = cache_attention(
            query,
            key,
            packed(v),
            state["key"],
            state["value"],
            position,
            sink_query,
            num_heads=self.num_heads,
            kv_num_heads=self.num_kv_heads,
            sinks=-1 if self.sinks is None else self.sinks,
        )
        return self.output(y, gate), {"key": present_key, "value": present_value, "position": position + t}
