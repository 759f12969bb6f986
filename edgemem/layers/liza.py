"""LiZA (TPTT, Furfaro 2025, "Transforming Pretrained Transformers into Titans"): linear attention
and sliding-window softmax attention over the same q, k, v, mixed per head by a learned gate
(Memory as Gate) before one output projection:

    o_t = (1 − α_t) · SWA(q, k, v)_t + α_t · LA(q, k, v)_t,    α_t = σ(W_α x_t + b_α)

SWA is the `window_attention` op (RoPE at absolute positions, the `window` previous tokens and
itself, persistent slots if asked); LA is the `linear_attention` op with any of its update rules
on the un-rotated q, k, L2-normalised per head, scale d^−½: β = σ(W_β x) for the delta rules,
log-decay log σ(W_a x + b_a) for the gated ones. The projections are `SoftmaxAttention`'s
(`AttentionProjections`: grouped K/V heads, head width, partial RoPE, q/k norms, sigmoid output
gate, with the same parameter names), so `edgemem.models.linearize` moves the attention layers of
a softmax model or of an imported hybrid over unchanged.

Choices the paper leaves open, as made here: the gate is per query head and input-dependent
(TPTT's default is one scalar, 0.5): W_α starts at zero and b_α at logit(`gate_init`), so a fresh
layer mixes with that scalar; the linear branch gets no RoPE (a rotated key would not recall the
same association at another position) and keeps one state per K/V head (query heads of a group
read it, as grouped attention does); β and the decay are per K/V head; the gated rules' decay bias
starts at 4 (σ ≈ 0.98, a long memory); the window's ring buffers hold keys and values per query
head (a group's K/V repeated), since the window op has no grouped form.
States: `key`, `value` `[B, H, window, D]` (ring buffers), `position` (int64 `[B]`) and
`recurrent_state` `[B, H_kv, D, D]`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from edgemem.errors import ConfigError
from edgemem.layers.base import State
from edgemem.layers.common import l2norm
from edgemem.layers.softmax_attention import AttentionProjections
from edgemem.ops import linear_attention
from edgemem.ops.banded_attention.contract import check_window
from edgemem.ops.linear_attention import UPDATE_RULES
from edgemem.ops.window_attention import init_window_state, window_attention_prefill


class LiZA(AttentionProjections):
    forwards_options_to = AttentionProjections  # **projections are SoftmaxAttention's projection options

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        window: int,
        update_rule: str = "gated_delta",
        gate_init: float = 0.5,
        persistent: int = 0,
        **projections,
    ):
        super().__init__(d_model, num_heads, **projections)
        if update_rule not in UPDATE_RULES:
            raise ConfigError(f"update_rule must be one of {', '.join(UPDATE_RULES)}; got {update_rule!r}")
        if not 0 < gate_init < 1:
            raise ConfigError(f"gate_init is the initial share of linear attention, in (0, 1); got {gate_init}")
        if persistent < 0:
            raise ConfigError(f"persistent must be ≥ 0; got {persistent}")
        self.window, self.dilation = window, check_window("LiZA", window, 1, num_heads)
        self.update_rule = update_rule
        shape = (num_heads, persistent, self.head_dim)
        self.persistent_key = nn.Parameter(torch.randn(shape) * self.head_dim**-0.5) if persistent else None
        self.persistent_value = nn.Parameter(torch.randn(shape) * 0.02) if persistent else None
        self.gate = nn.Linear(d_model, num_heads)
        nn.init.zeros_(self.gate.weight)
        nn.init.constant_(self.gate.bias, math.log(gate_init / (1 - gate_init)))
        self.beta = nn.Linear(d_model, self.num_kv_heads, bias=False) if "delta" in update_rule else None
        self.decay = nn.Linear(d_model, self.num_kv_heads) if update_rule.startswith("gated") else None
        if self.decay is not None:
            nn.init.constant_(self.decay.bias, 4.0)

    def init_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype | None = None) -> State:
        dtype = self.state_dtype(dtype)
        key, value = init_window_state(
            batch,
            self.num_heads,
            self.head_dim,
            window=self.window,
            dilation=self.dilation,
            device=device,
            dtype=dtype,
        )
        recurrent = torch.zeros(batch, self.num_kv_heads, self.head_dim, self.head_dim, device=device, dtype=dtype)
        position = torch.zeros(batch, dtype=torch.int64, device=device)
        return {"key": key, "value": value, "position": position, "recurrent_state": recurrent}

    def prefill(self, x: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        position = state["position"]
        positions = position[:, None] + torch.arange(x.shape[1], device=x.device)
        q, k, v, gate = self.project(x)
        group = self.num_heads // self.num_kv_heads
        heads = lambda t: t.repeat_interleave(group, dim=1).transpose(1, 2)  # noqa: E731  [B, T, H, D]
        window, key, value = window_attention_prefill(
            self.rotate(q, positions).transpose(1, 2),
            heads(self.rotate(k, positions)),
            heads(v),
            state["key"],
            state["value"],
            position,
            num_heads=self.num_heads,
            window=self.window,
            dilation=self.dilation,
            persistent_key=self.persistent_key,
            persistent_value=self.persistent_value,
        )
        linear, recurrent = linear_attention(
            l2norm(q).transpose(1, 2),
            l2norm(k).transpose(1, 2),
            v.transpose(1, 2),
            state["recurrent_state"],
            None if self.decay is None else F.logsigmoid(self.decay(x)),
            None if self.beta is None else torch.sigmoid(self.beta(x)),
            update_rule=self.update_rule,
            q_num_heads=self.num_heads,
            kv_num_heads=self.num_kv_heads,
        )
        alpha = torch.sigmoid(self.gate(x))[..., None]
        y = window + alpha * (linear.to(window.dtype) - window)
        new = {"key": key, "value": value, "position": position + x.shape[1], "recurrent_state": recurrent}
        return self.output(y.flatten(2), gate), new
