"""Longformer attention (Beltagy et al. 2020) without a T×T matrix.

`SlidingWindowAttention` — causal, for streaming LMs: every head attends its own token and the
`window` previous ones at its dilation (dilation may differ per head, as in Longformer's
dilated heads), plus `persistent` learned key/value slots every query sees (the fixed form of
global tokens: a streaming query cannot be global, it would need every past key). RoPE at
absolute positions. State: ring buffers `key`, `value` `[B, H, window·max(dilation), D]` and
`position` (int64 `[B]`).

`BandedEncoderAttention` — bidirectional, global tokens at any positions (they attend and are
attended by every token, as Longformer's [CLS]); prefill of a whole input only, no streaming
state. The options that Hugging Face's Longformer needs (biases, no RoPE, global projections)
are described on the class.
"""

from __future__ import annotations

import torch
from torch import nn

from edgemem.errors import ConfigError, EdgememError
from edgemem.layers.base import State, StatefulLayer
from edgemem.layers.common import rope
from edgemem.ops.banded_attention import banded_attention
from edgemem.ops.banded_attention.contract import check_window
from edgemem.ops.window_attention import init_window_state, window_attention_prefill


class _Projections(StatefulLayer):
    def __init__(
        self,
        d_model: int,
        num_heads: int,
        window: int,
        dilation: int | list[int],
        bias: bool = False,
        rope: bool = True,
    ):
        super().__init__()
        if d_model % num_heads or (rope and (d_model // num_heads) % 2):
            parity = " even-sized" if rope else ""
            raise ConfigError(f"d_model ({d_model}) must split into num_heads ({num_heads}){parity} heads")
        self.num_heads, self.head_dim, self.window, self.rope = num_heads, d_model // num_heads, window, rope
        self.dilation = check_window(type(self).__name__, window, dilation, num_heads)  # one per head
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.out = nn.Linear(d_model, d_model, bias=bias)

    def project(
        self, x: torch.Tensor, positions: torch.Tensor, qkv: nn.Linear | None = None
    ) -> tuple[torch.Tensor, ...]:
        """q, k (rotated at `positions` when the layer uses RoPE) and v from `qkv` (default:
        the layer's own), each `[B, T, H, D]`."""
        q, k, v = (qkv or self.qkv)(x).unflatten(2, (3, self.num_heads, self.head_dim)).unbind(2)
        if self.rope:
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
            batch,
            self.num_heads,
            self.head_dim,
            window=self.window,
            dilation=self.dilation,
            device=device,
            dtype=self.state_dtype(dtype),
        )
        return {"key": key, "value": value, "position": torch.zeros(batch, dtype=torch.int64, device=device)}

    def prefill(self, x: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        position = state["position"]
        q, k, v = self.project(x, position[:, None] + torch.arange(x.shape[1], device=x.device))
        y, key, value = window_attention_prefill(
            q,
            k,
            v,
            state["key"],
            state["value"],
            position,
            num_heads=self.num_heads,
            window=self.window,
            dilation=self.dilation,
            persistent_key=self.persistent_key,
            persistent_value=self.persistent_value,
        )
        return self.out(y.flatten(2)), {"key": key, "value": value, "position": position + x.shape[1]}


class BandedEncoderAttention(_Projections):
    """Bidirectional Longformer self-attention over a whole input; `[B, T, d_model]` in and out.

    Query i attends the keys within `window` of it (one-sided, at its head's dilation), and every
    global token; a global query attends every key (`banded_attention`, no T×T matrix). The
    global tokens are those of `prefill`'s `global_mask` (bool `[B, T]`, any positions, any
    count per sequence), or without one the first `global_tokens` of every sequence.

    - `bias`: biases on the q/k/v and output projections (Longformer has them).
    - `rope`: RoPE at positions 0..T−1 on q and k; False for models whose embeddings already
      carry absolute positions (Longformer).
    - `global_projections`: global queries get their own projections (`qkv_global`, Longformer's
      `query_global`/`key_global`/`value_global`): a global row attends the global-projected
      keys of every token and sums their global-projected values, while every other row sees the
      global tokens through the ordinary projections. Computed as a second `banded_attention`
      over the global projections with window 1, keeping its global rows only: O(T + G·T) more,
      with no data-dependent shapes, so the same code traces to ONNX for any T.
    """

    streaming = False

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        window: int,
        dilation: int | list[int] = 1,
        global_tokens: int = 1,
        bias: bool = False,
        rope: bool = True,
        global_projections: bool = False,
    ):
        super().__init__(d_model, num_heads, window, dilation, bias=bias, rope=rope)
        if global_tokens < 0:
            raise ConfigError(f"global_tokens must be ≥ 0; got {global_tokens}")
        self.global_tokens = global_tokens
        self.qkv_global = nn.Linear(d_model, 3 * d_model, bias=bias) if global_projections else None

    def init_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype | None = None) -> State:
        return {}

    def prefill(
        self, x: torch.Tensor, state: State, global_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, State]:
        b, t, _ = x.shape
        positions = torch.arange(t, device=x.device)
        if global_mask is None and self.global_tokens:
            global_mask = (positions < self.global_tokens).expand(b, t)
        options = dict(num_heads=self.num_heads, causal=False, global_mask=global_mask)
        q, k, v = self.project(x, positions)
        y = banded_attention(q, k, v, window=self.window, dilation=self.dilation, **options)
        if self.qkv_global is not None and global_mask is not None:
            rows = banded_attention(*self.project(x, positions, self.qkv_global), window=1, **options)
            y = torch.where(global_mask[:, :, None, None], rows, y)
        return self.out(y.flatten(2)), {}

    def step(self, x: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        raise EdgememError("bidirectional banded attention has no step: run the whole input through prefill")
