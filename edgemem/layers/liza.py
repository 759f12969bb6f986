"""LiZA (TPTT, Furfaro 2025, "Transforming Pretrained Transformers into Titans"): linear attention
and sliding-window softmax attention over the same q, k, v, mixed per head by a learned gate
(Memory as Gate) before one output projection:

    o_t = (1 − α_t) · SWA(q, k, v)_t + α_t · LA(q, k, v)_t,    α_t = σ(W_α x_t + b_α)

SWA is `SlidingWindowAttention`'s attention (RoPE at absolute positions, the `window` previous
tokens and itself, persistent slots if asked); LA is the `linear_attention` op with any of its
update rules on the un-rotated q, k, L2-normalised per head, scale d^−½: β = σ(W_β x) for the
delta rules, log-decay log σ(W_a x + b_a) for the gated ones. The q/k/v/output projections keep
the names of `SoftmaxAttention`'s (`qkv`, `out`), so `edgemem.models.linearize` moves a softmax
model's weights over unchanged.

Choices the paper leaves open, as made here: the gate is per head and input-dependent (TPTT's
default is one scalar, 0.5): W_α starts at zero and b_α at logit(`gate_init`), so a fresh layer
mixes with that scalar; the linear branch gets no RoPE (a rotated key would not recall the same
association at another position); the gated rules' decay bias starts at 4 (σ ≈ 0.98, a long memory).
States: those of `SlidingWindowAttention` (`key`, `value`, `position`) and `recurrent_state` `[B, H, D, D]`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from edgemem.errors import ConfigError
from edgemem.layers.base import State
from edgemem.layers.common import l2norm, rope
from edgemem.layers.longformer import SlidingWindowAttention
from edgemem.ops import linear_attention
from edgemem.ops.linear_attention import UPDATE_RULES
from edgemem.ops.window_attention import window_attention_prefill


class LiZA(SlidingWindowAttention):
    def __init__(
        self,
        d_model: int,
        num_heads: int,
        window: int,
        update_rule: str = "gated_delta",
        gate_init: float = 0.5,
        persistent: int = 0,
    ):
        super().__init__(d_model, num_heads, window, persistent=persistent)
        if update_rule not in UPDATE_RULES:
            raise ConfigError(f"update_rule must be one of {', '.join(UPDATE_RULES)}; got {update_rule!r}")
        if not 0 < gate_init < 1:
            raise ConfigError(f"gate_init is the initial share of linear attention, in (0, 1); got {gate_init}")
        self.update_rule = update_rule
        self.gate = nn.Linear(d_model, num_heads)
        nn.init.zeros_(self.gate.weight)
        nn.init.constant_(self.gate.bias, math.log(gate_init / (1 - gate_init)))
        self.beta = nn.Linear(d_model, num_heads, bias=False) if "delta" in update_rule else None
        self.decay = nn.Linear(d_model, num_heads) if update_rule.startswith("gated") else None
        if self.decay is not None:
            nn.init.constant_(self.decay.bias, 4.0)

    def init_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype | None = None) -> State:
        shape = (batch, self.num_heads, self.head_dim, self.head_dim)
        recurrent = torch.zeros(shape, device=device, dtype=self.state_dtype(dtype))
        return {**super().init_state(batch, device, dtype), "recurrent_state": recurrent}

    def prefill(self, x: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        position = state["position"]
        positions = position[:, None] + torch.arange(x.shape[1], device=x.device)
        q, k, v = self.qkv(x).unflatten(2, (3, self.num_heads, self.head_dim)).unbind(2)
        rotated_q, rotated_k = (rope(t.transpose(1, 2), positions).transpose(1, 2) for t in (q, k))
        window, key, value = window_attention_prefill(
            rotated_q, rotated_k, v, state["key"], state["value"], position,
            num_heads=self.num_heads, window=self.window, dilation=self.dilation,
            persistent_key=self.persistent_key, persistent_value=self.persistent_value,
        )
        linear, recurrent = linear_attention(
            l2norm(q), l2norm(k), v, state["recurrent_state"],
            None if self.decay is None else F.logsigmoid(self.decay(x)),
            None if self.beta is None else torch.sigmoid(self.beta(x)),
            update_rule=self.update_rule, q_num_heads=self.num_heads, kv_num_heads=self.num_heads,
        )
        alpha = torch.sigmoid(self.gate(x))[..., None]
        y = window + alpha * (linear.to(window.dtype) - window)
        new = {"key": key, "value": value, "position": position + x.shape[1], "recurrent_state": recurrent}
        return self.out(y.flatten(2)), new
