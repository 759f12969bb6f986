"""Linear attention (Katharopoulos et al. 2020): φ(x) = elu(x) + 1 with the normaliser.

o_t = φ(q_t)ᵀ S_t / φ(q_t)ᵀ z_t with S_t = Σ φ(k_j) v_jᵀ, z_t = Σ φ(k_j). The normaliser rides
in the op's state as an extra value column of ones, so one `linear` recurrence carries both:
state `recurrent_state` `[B, H, D, D + 1]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edgemem.errors import ConfigError
from edgemem.layers.base import State, StatefulLayer
from edgemem.ops import linear_attention


class LinearAttention(StatefulLayer):
    def __init__(self, d_model: int, num_heads: int, eps: float = 1e-6):
        super().__init__()
        if d_model % num_heads:
            raise ConfigError(f"d_model ({d_model}) is not divisible by num_heads ({num_heads})")
        self.num_heads, self.head_dim, self.eps = num_heads, d_model // num_heads, eps
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def init_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype | None = None) -> State:
        shape = (batch, self.num_heads, self.head_dim, self.head_dim + 1)
        return {"recurrent_state": torch.zeros(shape, device=device, dtype=self.state_dtype(dtype))}

    def prefill(self, x: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        q, k, v = self.qkv(x).unflatten(2, (3, self.num_heads, self.head_dim)).unbind(2)
        q, k = F.elu(q) + 1, F.elu(k) + 1
        v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
        o, s = linear_attention(
            q,
            k,
            v,
            state["recurrent_state"],
            update_rule="linear",
            scale=1.0,
            q_num_heads=self.num_heads,
            kv_num_heads=self.num_heads,
        )
        o = o[..., :-1] / (o[..., -1:] + self.eps)
        return self.out(o.flatten(2)), {"recurrent_state": s}
