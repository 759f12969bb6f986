"""DeltaNet (Yang et al. 2024) and gated DeltaNet (Yang, Kautz & Hatamizadeh 2025).

Both: q, k, v = SiLU(short causal conv(W x)) (SiLU alone without the conv), q and k
L2-normalised per head, β = σ(W_β x), the delta rule S ← S + β k (v − Sᵀk)ᵀ through the
`linear_attention` op with scale d_k^−½, and a per-head RMSNorm on the output.
Gated DeltaNet adds the decay g = −exp(A_log)·softplus(W_a x + dt_bias) (S ← e^g S first)
and gates the normed output with SiLU(W_g x).
States: `recurrent_state` `[B, H, D, D]` and, with the conv, `conv_state` `[B, 3·d_model, K−1]`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from edgemem.errors import ConfigError
from edgemem.layers.base import State, StatefulLayer
from edgemem.layers.common import ShortConv, l2norm
from edgemem.ops import linear_attention


class DeltaNet(StatefulLayer):
    update_rule = "delta"

    def __init__(self, d_model: int, num_heads: int, conv_size: int = 4):
        super().__init__()
        if d_model % num_heads:
            raise ConfigError(f"d_model ({d_model}) is not divisible by num_heads ({num_heads})")
        if conv_size < 0 or conv_size == 1:
            raise ConfigError(f"conv_size must be 0 (no conv) or ≥ 2; got {conv_size}")
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.conv = ShortConv(3 * d_model, conv_size) if conv_size else None
        self.beta = nn.Linear(d_model, num_heads, bias=False)
        self.norm = nn.RMSNorm(self.head_dim, eps=1e-5)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def init_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype | None = None) -> State:
        dtype = self.state_dtype(dtype)
        state = {"recurrent_state": torch.zeros(batch, self.num_heads, self.head_dim, self.head_dim, device=device, dtype=dtype)}
        if self.conv is not None:
            state["conv_state"] = self.conv.init_state(batch, device, dtype)
        return state

    def decay(self, x: torch.Tensor) -> torch.Tensor | None:
        return None

    def gate(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return o

    def prefill(self, x: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        new_state = {}
        qkv = self.qkv(x)
        if self.conv is None:
            qkv = F.silu(qkv)
        else:
            qkv, new_state["conv_state"] = self.conv(qkv, state["conv_state"])
        q, k, v = qkv.unflatten(2, (3, self.num_heads, self.head_dim)).unbind(2)
        o, new_state["recurrent_state"] = linear_attention(
            l2norm(q), l2norm(k), v, state["recurrent_state"], self.decay(x), torch.sigmoid(self.beta(x)),
            update_rule=self.update_rule, q_num_heads=self.num_heads, kv_num_heads=self.num_heads,
        )
        o = self.gate(self.norm(o), x)
        return self.out(o.flatten(2)), {k: new_state[k] for k in state}


class GatedDeltaNet(DeltaNet):
    update_rule = "gated_delta"

    def __init__(self, d_model: int, num_heads: int, conv_size: int = 4):
        super().__init__(d_model, num_heads, conv_size)
        self.a = nn.Linear(d_model, num_heads, bias=False)
        self.g = nn.Linear(d_model, d_model, bias=False)
        # A ~ U(0, 16) and dt log-uniform in [1e-3, 0.1] with dt_bias = softplus⁻¹(dt), as in the paper's code
        self.A_log = nn.Parameter(torch.empty(num_heads).uniform_(1e-4, 16).log())
        dt = torch.exp(torch.rand(num_heads) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        return -self.A_log.exp() * F.softplus(self.a(x) + self.dt_bias)

    def gate(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return o * F.silu(self.g(x)).unflatten(2, (self.num_heads, self.head_dim))
