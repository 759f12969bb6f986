"""DeltaNet (Yang et al. 2024) and gated DeltaNet (Yang, Kautz & Hatamizadeh 2025).

Both: q, k, v = SiLU(short causal conv(W x)) (SiLU alone without the conv; one depthwise conv
over q‖k‖v, which equals separate q/k/v convs), q and k L2-normalised per head, β = σ(W_β x)
(2σ with `allow_neg_eigval`: eigenvalues of the transition in [−1, 1]), the delta rule
S ← S + β k (v − Sᵀk)ᵀ through the `linear_attention` op with scale d_k^−½, and a per-head
RMSNorm on the output, optionally gated by SiLU(W_g x).
Gated DeltaNet adds the decay g = −exp(A_log)·softplus(W_a x + dt_bias) (S ← e^g S first).
Heads: H_k query/key heads of width d_k, H_v ≥ H_k value heads of width d_v; each group of
H_v / H_k consecutive value heads shares one key head (q and k are repeated to H_v heads).
States: `recurrent_state` `[B, H_v, d_k, d_v]` and, with the conv, `conv_state`
`[B, 2·H_k·d_k + H_v·d_v, K−1]`.
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
    default_output_gate = False  # output_gate=None takes this

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        conv_size: int = 4,
        *,
        head_dim: int | None = None,
        num_v_heads: int | None = None,
        v_head_dim: int | None = None,
        output_gate: bool | None = None,
        allow_neg_eigval: bool = False,
        norm_eps: float = 1e-5,
    ):
        super().__init__()
        output_gate = self.default_output_gate if output_gate is None else output_gate
        if head_dim is None and d_model % num_heads:
            raise ConfigError(f"d_model ({d_model}) is not divisible by num_heads ({num_heads})")
        if conv_size < 0 or conv_size == 1:
            raise ConfigError(f"conv_size must be 0 (no conv) or ≥ 2; got {conv_size}")
        num_v_heads = num_v_heads or num_heads
        if num_v_heads % num_heads:
            raise ConfigError(f"num_v_heads ({num_v_heads}) must be a multiple of num_heads ({num_heads})")
        self.num_heads, self.head_dim = num_heads, head_dim or d_model // num_heads
        self.num_v_heads, self.v_head_dim = num_v_heads, v_head_dim or self.head_dim
        self.allow_neg_eigval = allow_neg_eigval
        key_dim, value_dim = num_heads * self.head_dim, num_v_heads * self.v_head_dim
        self.split = [key_dim, key_dim, value_dim]
        self.qkv = nn.Linear(d_model, sum(self.split), bias=False)
        self.conv = ShortConv(sum(self.split), conv_size) if conv_size else None
        self.beta = nn.Linear(d_model, num_v_heads, bias=False)
        self.norm = nn.RMSNorm(self.v_head_dim, eps=norm_eps)
        self.out = nn.Linear(value_dim, d_model, bias=False)
        self._gate_parameters(d_model, output_gate)

    def _gate_parameters(self, d_model: int, output_gate: bool) -> None:
        self.g = nn.Linear(d_model, self.num_v_heads * self.v_head_dim, bias=False) if output_gate else None

    def init_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype | None = None) -> State:
        dtype = self.state_dtype(dtype)
        shape = (batch, self.num_v_heads, self.head_dim, self.v_head_dim)
        state = {"recurrent_state": torch.zeros(shape, device=device, dtype=dtype)}
        if self.conv is not None:
            state["conv_state"] = self.conv.init_state(batch, device, dtype)
        return state

    def decay(self, x: torch.Tensor) -> torch.Tensor | None:
        return None

    def gate(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.g is None:
            return o
        return o * F.silu(self.g(x)).unflatten(2, (self.num_v_heads, self.v_head_dim))

    def prefill(self, x: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        new_state = {}
        qkv = self.qkv(x)
        if self.conv is None:
            qkv = F.silu(qkv)
        else:
            qkv, new_state["conv_state"] = self.conv(qkv, state["conv_state"])
        q, k, v = qkv.split(self.split, dim=-1)
        q, k = (l2norm(t.unflatten(2, (self.num_heads, self.head_dim))) for t in (q, k))
        if self.num_v_heads != self.num_heads:
            group = self.num_v_heads // self.num_heads
            q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
        beta = torch.sigmoid(self.beta(x))
        if self.allow_neg_eigval:
            beta = 2 * beta
        o, new_state["recurrent_state"] = linear_attention(
            q,
            k,
            v.unflatten(2, (self.num_v_heads, self.v_head_dim)),
            state["recurrent_state"],
            self.decay(x),
            beta,
            update_rule=self.update_rule,
            q_num_heads=self.num_v_heads,
            kv_num_heads=self.num_v_heads,
        )
        o = self.gate(self.norm(o), x)
        return self.out(o.flatten(2)), {k: new_state[k] for k in state}


class GatedDeltaNet(DeltaNet):
    update_rule = "gated_delta"
    default_output_gate = True

    def _gate_parameters(self, d_model: int, output_gate: bool) -> None:
        # creation order (a, g, A_log, dt_bias) kept so seeded presets draw the same weights
        heads = self.num_v_heads
        self.a = nn.Linear(d_model, heads, bias=False)
        super()._gate_parameters(d_model, output_gate)
        # A ~ U(0, 16) and dt log-uniform in [1e-3, 0.1] with dt_bias = softplus⁻¹(dt), as in the paper's code
        self.A_log = nn.Parameter(torch.empty(heads).uniform_(1e-4, 16).log())
        dt = torch.exp(torch.rand(heads) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        return -self.A_log.exp() * F.softplus(self.a(x) + self.dt_bias)
