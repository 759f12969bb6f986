"""Longformer attention (Beltagy et al. 2020) without a T×T matrix.

`SlidingWindowAttention` — causal, for streaming LMs: every head attends its own token and the
`window` previous ones at its dilation (dilation may differ per head, as in Longformer's
dilated heads), plus `persistent` learned key/value slots every query sees (the fixed form of
global tokens: a streaming query cannot be global, it would need every past key). RoPE at
absolute positions. State: ring buffers `key`, `value` `[B, H, window·max(dilation), D]` and
`position` (int64 `[B]`).

`BandedEncoderAttention` — bidirectional with the first `global_tokens` tokens global
(they attend and are attended by every token, as Longformer's [CLS]); prefill of a whole
input only, no streaming state.
"""

from __future__ import annotations

import torch
from torch import nn

from edgemem.errors import ConfigError, EdgememError
from edgemem.layers.base import State, StatefulLayer
from edgemem.layers.common import rope
from edgemem.ops.banded_attention import banded_attention
from edgemem.ops.window_attention import init_window_state, window_attention_prefill


def _dilation(dilation: int | list[int], num_heads: int) -> int | list[int]:
    values = [dilation] if isinstance(dilation, int) else list(dilation)
    if not values or any(not isinstance(d, int) or d < 1 for d in values):
        raise ConfigError(f"dilation must be a positive int or a list of them; got {dilation!r}")
    if not isinstance(dilation, int) and len(values) != num_heads:
        raise ConfigError(f"dilation lists one value per head: {num_heads} expected, got {len(values)}")
    return dilation if isinstance(dilation, int) else values


class _Projections(StatefulLayer):
    def __init__(self, d_model: int, num_heads: int, window: int, dilation: int | list[int]):
        super().__init__()
        if d_model % num_heads or (d_model // num_heads) % 2:
            raise ConfigError(f"d_model ({d_model}) must split into num_heads ({num_heads}) even-sized heads")
        if window < 1:
            raise ConfigError(f"window must be ≥ 1; got {window}")
        self.num_heads, self.head_dim, self.window = num_heads, d_model // num_heads, window
        self.dilation = _dilation(dilation, num_heads)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k (rotated at `positions`) and v, each `[B, T, H, D]`."""
        q, k, v = self.qkv(x).unflatten(2, (3, self.num_heads, self.head_dim)).unbind(2)
        q, k = (rope(t.transpose(1, 2), positions).transpose(1, 2) for t in (q, k))
        return q, k, v


class SlidingWindowAttention(_Projections):
    def __init__(self, d_model: int, num_heads: int, window: int, dilation: int | list[int] = 1, persistent: int = 0):
        super().__init__(d_model, num_heads, window, dilation)
        if persistent < 0:
            raise ConfigError(f"persistent must be ≥ 0; got {persistent}")
        shape = (num_heads, persistent, self.head_dim)
        self.persistent_key = nn.Parameter(torch.randn(shape) * self.head_dim**-0.5) if persistent else None
        self.persistent_value = nn.Parameter(torch.randn(shape) * 0.02) if persistent else None

    def init_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype | None = None) -> State:
        key, value = init_window_state(
            batch, self.num_heads, self.head_dim, window=self.window, dilation=self.dilation,
            device=device, dtype=self.state_dtype(dtype),
        )
        return {"key": key, "value": value, "position": torch.zeros(batch, dtype=torch.int64, device=device)}

    def prefill(self, x: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        position = state["position"]
        q, k, v = self.project(x, position[:, None] + torch.arange(x.shape[1], device=x.device))
        y, key, value = window_attention_prefill(
            q, k, v, state["key"], state["value"], position,
            num_heads=self.num_heads, window=self.window, dilation=self.dilation,
            persistent_key=self.persistent_key, persistent_value=self.persistent_value,
        )
        return self.out(y.flatten(2)), {"key": key, "value": value, "position": position + x.shape[1]}


class BandedEncoderAttention(_Projections):
    streaming = False

    def __init__(self, d_model: int, num_heads: int, window: int, dilation: int | list[int] = 1, global_tokens: int = 1):
        super().__init__(d_model, num_heads, window, dilation)
        if global_tokens < 0:
            raise ConfigError(f"global_tokens must be ≥ 0; got {global_tokens}")
        self.global_tokens = global_tokens

    def init_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype | None = None) -> State:
        return {}

    def prefill(self, x: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        b, t, _ = x.shape
        q, k, v = self.project(x, torch.arange(t, device=x.device))
        global_mask = (torch.arange(t, device=x.device) < self.global_tokens).expand(b, t)
        y = banded_attention(
            q, k, v, num_heads=self.num_heads, window=self.window, dilation=self.dilation,
            causal=False, global_mask=global_mask,
        )
        return self.out(y.flatten(2)), {}

    def step(self, x: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        raise EdgememError("bidirectional banded attention has no step: run the whole input through prefill")
