"""HOPE (Behrouz, Razaviyayn, Zhong & Mirrokni, "Nested Learning: The Illusion of Deep Learning
Architectures", NeurIPS 2025): a self-modifying Titans memory followed by a continuum memory
system (CMS), a chain of MLP memories each learning at its own frequency.

    h_0 = SelfModifyingMemory(x),   h_l = h_{l−1} + W_o^l M_l(q_t^l; W^l at its period's start)

Self-modifying memory: `NeuralMemoryLayer` (Titans eq. 13–14 through the `neural_memory` op:
momentum, forgetting, gradients at chunk starts) with the paper's memory form M(x) = x + f(x)
(here TTT's x + γ ⊙ LN(f(x)) + β, f a per-head 2-layer MLP) whose targets it generates itself
(NL's self-referential values, v̂_t = M_{t−1}(v_t)): it learns ℓ_t = ½‖M(k_t) − v̂_t‖² with
v̂_t = M(v_t) read at the weights of the chunk's start, the weights its gradients are taken at.

CMS level l (NL's CMS equation): its MLP weights W^l are constant within a period of C_l tokens
(periods counted from the stream start) and at the period's end take one step
W^l ← W^l − Σ_{t in period} θ_t^l ∇ℓ_t^l(W^l); this is the `neural_memory` op with chunk size
C_l, no momentum and no forgetting, read at the chunk-start weights. Its input is
q_t = k_t = L2-normalised heads of RMSNorm(h_{l−1}), v_t = W_v^l RMSNorm(h_{l−1}).

Choices the paper leaves open, as made here:
- the levels' local objective is the associative-memory loss ℓ_t^l = ½‖M_l(k_t) − v_t‖² with a
  learned value projection W_v^l (the paper trains CMS on the model's loss during pre-training,
  which a model streaming at test time does not have); each level's MLP is per head
  (act(x W1) W2, hidden `level_expansion`·D), the heads mixed by W_o^l, and added to its input;
- θ_t^l = (`level_lr` / C_l)·σ(W_θ^l x): a period's step is at most `level_lr` times the
  gradient of the period's mean loss, whatever C_l;
- only the values are self-generated; the paper's adaptive key, learning-rate and decay
  memories (M_k, M_η, M_α) are the Titans layer's projections and gates here, fixed at test time;
- the memory learns by Titans' momentum gradient descent with forgetting (the op), not by the
  paper's delta-rule variant of gradient descent, and is read after the token's update,
  y_t = M_t(q_t), as the op defines;
- a preset's CMS takes the place of the block's MLP (`mlp_hidden = 0`); the block adds the
  chain's output h_k to its residual stream;
- the initial weights of every memory are learned (a fresh stream's state is not zero).

A prefill runs in pieces that never cross a chunk or period boundary, one after another; rows of
a batch must then sit at one position. The layer's `prefill_segment` is the greatest common divisor
of the memory's chunk and the periods, so the exported prefill graph loops over segments of that
many positions (edgemem.export.segments), as titans-mac's does.
States: the memory's (`memory.{i}`, `momentum.{i}`, `chunk_memory.{i}`, `position`,
`conv_state`) and per level `cms.{l}.memory.{i}`, `cms.{l}.chunk_memory.{i}` (no momentum: with η = 0
the op's momentum input is multiplied by zero, so a level passes zeros); all share `position`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from edgemem.errors import ConfigError
from edgemem.layers.base import State, StatefulLayer
from edgemem.layers.common import l2norm
from edgemem.layers.titans import NeuralMemoryLayer, by_segment, chunk_start_memory, memory_state
from edgemem.ops.neural_memory import ResidualNorm, memory_read, neural_memory_step


def _heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    return x.unflatten(2, (num_heads, -1))


def _read(x: torch.Tensor, weights: list[torch.Tensor], activation: str, norm: ResidualNorm | None) -> torch.Tensor:
    """M(x) for `x [B, T, H, D]` at fixed weights, in the weights' dtype, returned in x's."""
    y = memory_read(x.transpose(1, 2).to(weights[0].dtype), weights, activation, norm)
    return y.transpose(1, 2).to(x.dtype)


class SelfModifyingMemory(NeuralMemoryLayer):
    """Titans memory M(x) = x + γ ⊙ LN(f(x)) + β learning its own values v̂_t = M(v_t)."""

    parallel_prefill = False

    def __init__(self, d_model: int, num_heads: int, **memory):
        super().__init__(d_model, num_heads, residual_norm=True, **memory)

    def values(self, v: torch.Tensor, state: State) -> torch.Tensor:
        norm = ResidualNorm.of(self.inner_norm_weight, self.inner_norm_bias)
        return _read(v, self.segment_memory(state), self.activation, norm)

    def prefill(self, x: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        return by_segment(super().prefill, x, state, self.chunk_size, "hope")


class CMSLevel(StatefulLayer):
    """One continuum-memory level: h + W_o M(q; W at the period start), W learning every `period` tokens."""

    parallel_prefill = False

    def __init__(
        self, d_model: int, num_heads: int, period: int, expansion: int = 2, lr: float = 0.1, activation: str = "silu"
    ):
        super().__init__()
        if d_model % num_heads:
            raise ConfigError(f"d_model ({d_model}) is not divisible by num_heads ({num_heads})")
        if period < 1 or expansion < 1 or lr <= 0:
            raise ConfigError(f"a CMS level needs period and expansion ≥ 1 and lr > 0; got {period}, {expansion}, {lr}")
        self.num_heads, self.period, self.max_lr, self.activation = num_heads, period, lr / period, activation
        d = d_model // num_heads
        self.norm = nn.RMSNorm(d_model, eps=1e-5)
        self.value = nn.Linear(d_model, d_model, bias=False)
        self.theta = nn.Linear(d_model, num_heads)
        nn.init.zeros_(self.theta.bias)
        shapes = [(num_heads, d, expansion * d), (num_heads, expansion * d, d)]
        self.initial_memory = nn.ParameterList(nn.Parameter(torch.randn(s) * s[1] ** -0.5) for s in shapes)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def init_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype | None = None) -> State:
        state = memory_state(self.initial_memory, batch, device, self.state_dtype(dtype))
        return {k: t for k, t in state.items() if not k.startswith("momentum.")}  # η = 0: the op's momentum is unused

    def prefill(self, h: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        return by_segment(self._piece, h, state, self.period, "hope")

    def _piece(self, h: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        x = self.norm(h)
        q = l2norm(_heads(x, self.num_heads))
        y = _read(q, chunk_start_memory(state, self.period, 2), self.activation, None)
        zeros = x.new_zeros(*x.shape[:2], self.num_heads)
        new: State = {}
        _, memory, _, chunk_memory, new["position"] = neural_memory_step(
            q, q, _heads(self.value(x), self.num_heads), self.max_lr * torch.sigmoid(self.theta(x)), zeros, zeros,
            [state[f"memory.{i}"] for i in range(2)],
            [torch.zeros_like(state[f"memory.{i}"]) for i in range(2)],
            [state[f"chunk_memory.{i}"] for i in range(2)],
            state["position"],
            num_heads=self.num_heads, chunk_size=self.period, activation=self.activation,
        )  # fmt: skip
        for i in range(2):
            new[f"memory.{i}"], new[f"chunk_memory.{i}"] = memory[i], chunk_memory[i]
        return h + self.out(y.flatten(2)), {k: new[k] for k in state}


class HOPE(StatefulLayer):
    """Self-modifying Titans memory → CMS levels with periods `levels` (C_1 < C_2 < …)."""

    forwards_options_to = NeuralMemoryLayer  # **memory are the self-modifying memory's options
    parallel_prefill = False

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        levels: list[int],
        level_expansion: int = 2,
        level_lr: float = 0.1,
        **memory,
    ):
        super().__init__()
        ok = isinstance(levels, list) and levels and all(isinstance(c, int) and not isinstance(c, bool) for c in levels)
        if not ok or levels[0] < 1 or any(a >= b for a, b in zip(levels, levels[1:])):
            raise ConfigError(
                f"levels are the CMS update periods, increasing integers ≥ 1 (e.g. [16, 64, 256]); got {levels!r}"
            )
        if "residual_norm" in memory:
            raise ConfigError("hope's memory always has the residual form x + γ ⊙ LN(f(x)) + β; drop residual_norm")
        self.memory = SelfModifyingMemory(d_model, num_heads, **memory)
        activation = self.memory.activation
        self.levels = nn.ModuleList(
            CMSLevel(d_model, num_heads, c, level_expansion, level_lr, activation) for c in levels
        )
        self.prefill_segment = math.gcd(self.memory.chunk_size, *levels)

    def init_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype | None = None) -> State:
        state = self.memory.init_state(batch, device, dtype)
        for l, level in enumerate(self.levels):  # noqa: E741
            own = level.init_state(batch, device, dtype)
            state.update({f"cms.{l}.{kind}": t for kind, t in own.items() if kind != "position"})
        return state

    def prefill(self, x: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        mine = {k: t for k, t in state.items() if not k.startswith("cms.")}
        h, new = self.memory.prefill(x, mine)
        for l, level in enumerate(self.levels):  # noqa: E741
            prefix = f"cms.{l}."
            own = {k[len(prefix) :]: t for k, t in state.items() if k.startswith(prefix)}
            h, own = level.prefill(h, {**own, "position": state["position"]})
            new.update({prefix + k: t for k, t in own.items() if k != "position"})
        return h, {k: new[k] for k in state}
