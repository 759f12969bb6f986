"""Causal multi-head softmax attention with RoPE and a KV cache: the baseline whose state grows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edgemem.errors import ConfigError
from edgemem.layers.base import State, StatefulLayer
from edgemem.layers.common import rope


class SoftmaxAttention(StatefulLayer):
    """State: `key`, `value` `[B, H, L, D]` holding every past token (L = position)."""

    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        if d_model % num_heads or (d_model // num_heads) % 2:
            raise ConfigError(f"d_model ({d_model}) must split into num_heads ({num_heads}) even-sized heads")
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def init_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype | None = None) -> State:
        shape = (batch, self.num_heads, 0, self.head_dim)
        dtype = self.state_dtype(dtype)
        return {"key": torch.zeros(shape, device=device, dtype=dtype), "value": torch.zeros(shape, device=device, dtype=dtype)}

    def prefill(self, x: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        b, t, _ = x.shape
        past = state["key"].shape[2]
        q, k, v = self.qkv(x).unflatten(2, (3, self.num_heads, self.head_dim)).permute(2, 0, 3, 1, 4)
        positions = torch.arange(past, past + t, device=x.device)
        q, k = rope(q, positions), rope(k, positions)
        keys = torch.cat([state["key"].to(x.dtype), k], dim=2)
        values = torch.cat([state["value"].to(x.dtype), v], dim=2)
        # query i sits at position past + i and sees keys 0 … past + i
        mask = torch.ones(t, past + t, dtype=torch.bool, device=x.device).tril(past)
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        y = self.out(y.transpose(1, 2).reshape(b, t, -1))
        dtype = state["key"].dtype
        return y, {"key": keys.to(dtype), "value": values.to(dtype)}
