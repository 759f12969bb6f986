"""Titans (Behrouz, Zhong & Mirrokni 2025, arXiv 2501.00663): a neural long-term memory
learned at test time, and the MAG / MAL ways of combining it with sliding-window attention.

`NeuralMemoryLayer` (LMM; TTT when momentum and forgetting are off): q, k, v = SiLU(short
conv(W x)), q and k L2-normalised per head; per-token, per-head gates θ_t = max_lr·σ(W_θ x)
(learning rate), η_t = σ(W_η x) (momentum), α_t = σ(W_α x) (forgetting); the per-head MLP
memory M (depth 1: x W1; depth 2: act(x W1) W2 with hidden E = expansion·D) is trained online
on ℓ = ½‖M(k_t) − v_t‖² by the `neural_memory` op (gradients at chunk starts, Titans eq. 13–14)
and read out as y_t = M_t(q_t); output: per-head RMSNorm, gated by SiLU(W_g x), projected.
The initial memory M_0 is learned, so a fresh stream's state is not zero. With
`residual_norm` the memory is TTT's inner model (Sun et al. 2024), x + γ ⊙ LN(M(x)) + β with
learnable per-head γ (ones) and β (zeros); the TTT presets use it, the Titans ones do not.

Choices where the paper leaves room: the gate biases start at θ: 0, η: +2, α: −6 so a fresh
model keeps most of its memory (σ(−6) ≈ 0.25 % forgotten per token); persistent memory is
given to the attention branch only (learned key/value slots every query sees) rather than
also prepended to the memory's input, so the memory state at position 0 is exactly M_0;
MAG's gate is o = y_attn ⊙ σ(y_mem) with both branches projected to d_model.

States: memory `memory.{i}`, `momentum.{i}`, `chunk_memory.{i}` (weights at the start of the
current chunk), `position` (int64 `[B]`), `conv_state`; attention adds `key`, `value` (ring
buffers). Composite layers share one `position`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from edgemem.errors import ConfigError, EdgememError
from edgemem.layers.base import State, StatefulLayer
from edgemem.layers.common import ShortConv, l2norm, rope
from edgemem.layers.longformer import SlidingWindowAttention
from edgemem.ops.neural_memory import ResidualNorm, memory_read, neural_memory_step


def memory_state(initial: nn.ParameterList, batch: int, device: torch.device | None, dtype: torch.dtype) -> State:
    """A fresh stream of a memory whose initial weights are `initial`: `memory.{i}`, zero
    `momentum.{i}`, `chunk_memory.{i}` (the weights at the current chunk's start), `position` 0."""
    memory = [w.to(device=device, dtype=dtype).expand(batch, *w.shape) for w in initial]
    state = {f"memory.{i}": w for i, w in enumerate(memory)}
    state.update({f"momentum.{i}": torch.zeros_like(w) for i, w in enumerate(memory)})
    state.update({f"chunk_memory.{i}": w.clone() for i, w in enumerate(memory)})  # own storage, like every state tensor
    state["position"] = torch.zeros(batch, dtype=torch.int64, device=device)
    return state


def chunk_start_memory(state: State, chunk_size: int, depth: int) -> list[torch.Tensor]:
    """The weights of `memory_state`'s memory at the start of the chunk the next token falls in."""
    starts = (state["position"] % chunk_size == 0).view(-1, 1, 1, 1)
    return [torch.where(starts, state[f"memory.{i}"], state[f"chunk_memory.{i}"]) for i in range(depth)]


class NeuralMemoryLayer(StatefulLayer):
    def __init__(
        self,
        d_model: int,
        num_heads: int,
        depth: int = 2,
        expansion: int = 2,
        chunk_size: int = 16,
        conv_size: int = 4,
        max_lr: float = 0.1,
        activation: str = "silu",
        momentum: bool = True,
        forget: bool = True,
        residual_norm: bool = False,
    ):
        super().__init__()
        if d_model % num_heads:
            raise ConfigError(f"d_model ({d_model}) is not divisible by num_heads ({num_heads})")
        if depth not in (1, 2):
            raise ConfigError(f"depth must be 1 (linear memory) or 2 (MLP memory); got {depth}")
        if chunk_size < 1 or expansion < 1 or max_lr <= 0:
            raise ConfigError(
                f"chunk_size and expansion must be ≥ 1 and max_lr > 0; got {chunk_size}, {expansion}, {max_lr}"
            )
        if conv_size < 0 or conv_size == 1:
            raise ConfigError(f"conv_size must be 0 (no conv) or ≥ 2; got {conv_size}")
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.chunk_size, self.max_lr, self.activation = chunk_size, max_lr, activation
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.conv = ShortConv(3 * d_model, conv_size) if conv_size else None
        self.theta = nn.Linear(d_model, num_heads)
        self.eta = nn.Linear(d_model, num_heads) if momentum else None
        self.alpha = nn.Linear(d_model, num_heads) if forget else None
        for gate, bias in ((self.theta, 0.0), (self.eta, 2.0), (self.alpha, -6.0)):
            if gate is not None:
                nn.init.constant_(gate.bias, bias)
        d, e = self.head_dim, expansion * self.head_dim
        shapes = [(num_heads, d, d)] if depth == 1 else [(num_heads, d, e), (num_heads, e, d)]
        self.initial_memory = nn.ParameterList(nn.Parameter(torch.randn(s) * s[1] ** -0.5) for s in shapes)
        # TTT's LayerNorm inside the memory: per-head scale γ and shift β (None: plain MLP memory)
        self.inner_norm_weight = nn.Parameter(torch.ones(num_heads, d)) if residual_norm else None
        self.inner_norm_bias = nn.Parameter(torch.zeros(num_heads, d)) if residual_norm else None
        self.norm = nn.RMSNorm(self.head_dim, eps=1e-5)
        self.g = nn.Linear(d_model, d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def init_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype | None = None) -> State:
        dtype = self.state_dtype(dtype)
        state = memory_state(self.initial_memory, batch, device, dtype)
        if self.conv is not None:
            state["conv_state"] = self.conv.init_state(batch, device, dtype)
        return state

    def prefill(self, x: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        new: State = {}
        qkv = self.qkv(x)
        if self.conv is None:
            qkv = F.silu(qkv)
        else:
            qkv, new["conv_state"] = self.conv(qkv, state["conv_state"])
        q, k, v = qkv.unflatten(2, (3, self.num_heads, self.head_dim)).unbind(2)
        v = self.values(v, state)
        zeros = x.new_zeros(*x.shape[:2], self.num_heads)
        depth = len(self.initial_memory)
        y, memory, momentum, chunk_memory, new["position"] = neural_memory_step(
            l2norm(q),
            l2norm(k),
            v,
            self.max_lr * torch.sigmoid(self.theta(x)),
            zeros if self.eta is None else torch.sigmoid(self.eta(x)),
            zeros if self.alpha is None else torch.sigmoid(self.alpha(x)),
            [state[f"memory.{i}"] for i in range(depth)],
            [state[f"momentum.{i}"] for i in range(depth)],
            [state[f"chunk_memory.{i}"] for i in range(depth)],
            state["position"],
            num_heads=self.num_heads,
            chunk_size=self.chunk_size,
            activation=self.activation,
            norm_weight=self.inner_norm_weight,
            norm_bias=self.inner_norm_bias,
        )
        for i in range(depth):
            new[f"memory.{i}"], new[f"momentum.{i}"], new[f"chunk_memory.{i}"] = memory[i], momentum[i], chunk_memory[i]
        y = self.norm(y) * F.silu(self.g(x)).unflatten(2, (self.num_heads, self.head_dim))
        return self.out(y.flatten(2)), {k: new[k] for k in state if k in new}

    def values(self, v: torch.Tensor, state: State) -> torch.Tensor:
        """The targets `[B, T, H, D]` the memory learns to map its keys to: v itself here (HOPE's
        self-modifying memory overrides this)."""
        return v

    def segment_memory(self, state: State) -> list[torch.Tensor]:
        """The memory weights at the start of the chunk the next token falls in."""
        return chunk_start_memory(state, self.chunk_size, len(self.initial_memory))


Piece = Callable[[torch.Tensor, State], tuple[torch.Tensor, State]]


def by_segment(piece: Piece, x: torch.Tensor, state: State, segment: int, layer: str) -> tuple[torch.Tensor, State]:
    """`piece` over the parts of x that stay inside one `segment` of the stream (segments aligned to
    position 0), one after another. Traced for any length, x is one such part: the exported prefill
    graph loops over them (`prefill_segment`, edgemem.export.segments)."""
    if not isinstance(x.shape[1], int) or x.shape[1] == 1:
        return piece(x, state)
    position = state["position"]
    if bool((position != position[0]).any()):
        raise EdgememError(
            f"{layer} prefills a batch only when its streams sit at one position (got {position.tolist()}); step them instead"  # noqa: E501
        )
    first, start, outputs = int(position[0]), 0, []
    while start < x.shape[1]:
        end = min(x.shape[1], start + segment - (first + start) % segment)
        y, state = piece(x[:, start:end], state)
        outputs.append(y)
        start = end
    return torch.cat(outputs, dim=1), state


class _MemoryWithAttention(StatefulLayer):
    """A neural memory and a sliding-window attention with persistent slots, one position."""

    forwards_options_to = NeuralMemoryLayer  # **memory are NeuralMemoryLayer's options

    def __init__(self, d_model: int, num_heads: int, window: int, persistent: int = 4, **memory):
        super().__init__()
        self.attention = SlidingWindowAttention(d_model, num_heads, window, persistent=persistent)
        self.memory = NeuralMemoryLayer(d_model, num_heads, **memory)

    def init_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype | None = None) -> State:
        return {**self.attention.init_state(batch, device, dtype), **self.memory.init_state(batch, device, dtype)}


class TitansMAG(_MemoryWithAttention):
    """Memory as a gate: o = SWA*(x) ⊙ σ(M(x)), both branches reading the same input."""

    def prefill(self, x: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        y_attn, attn_state = self.attention.prefill(x, state)
        y_mem, mem_state = self.memory.prefill(x, state)
        merged = {**attn_state, **mem_state}
        return y_attn * torch.sigmoid(y_mem), {k: merged[k] for k in state}


class TitansMAL(_MemoryWithAttention):
    """Memory as a layer: o = SWA*(M(x)); the attention reads what the memory retrieved."""

    def prefill(self, x: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        y_mem, mem_state = self.memory.prefill(x, state)
        y_attn, attn_state = self.attention.prefill(y_mem, state)
        merged = {**attn_state, **mem_state}
        return y_attn, {k: merged[k] for k in state}


class TitansMAC(StatefulLayer):
    """Memory as context: the sequence is cut into segments of `chunk_size` tokens (the
    memory's chunks, aligned to the stream start). For a segment, h = M_{s−1}(q) reads the
    memory as it was at the segment start; attention runs over [persistent ‖ h ‖ segment]
    (causal: token i sees h_j and x_j for j ≤ i of its segment); the memory then learns from
    the attention output y, and o = y ⊙ σ(M_t(y)).

    Choice: the paper's segment attention is read causally (attending h_j or x_j for j > i
    would leak future tokens in an LM), and the final read M_t(y) uses the memory after token
    t's update, as the memory op defines. State adds the current segment's keys and values,
    `key`/`value` `[B, H, 2·chunk_size, D]` (slots [0, C) for h, [C, 2C) for x, slot = position mod C).
    Prefill runs the pieces of the prompt that never cross a segment boundary one after another;
    traced for any length, prefill is one such piece, and the exported prefill graph loops over
    them (edgemem.export.segments).
    """

    forwards_options_to = NeuralMemoryLayer  # **memory are NeuralMemoryLayer's options
    parallel_prefill = False  # segments run one after another: the exported prefill graph loops over them

    def __init__(self, d_model: int, num_heads: int, persistent: int = 4, **memory):
        super().__init__()
        self.memory = NeuralMemoryLayer(d_model, num_heads, **memory)
        self.num_heads, self.head_dim, self.segment = num_heads, d_model // num_heads, self.memory.chunk_size
        self.prefill_segment = self.segment
        if self.head_dim % 2:
            raise ConfigError(f"titans-mac needs an even head size for RoPE; d_model/num_heads = {self.head_dim}")
        self.read_query = nn.Linear(d_model, d_model, bias=False)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.persistent_key = nn.Parameter(torch.randn(num_heads, persistent, self.head_dim) * self.head_dim**-0.5)
        self.persistent_value = nn.Parameter(torch.randn(num_heads, persistent, self.head_dim) * 0.02)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def init_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype | None = None) -> State:
        shape = (batch, self.num_heads, 2 * self.segment, self.head_dim)
        buffer = {k: torch.zeros(shape, device=device, dtype=self.state_dtype(dtype)) for k in ("key", "value")}
        return {**buffer, **self.memory.init_state(batch, device, dtype)}

    def prefill(self, x: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        return by_segment(self._segment_piece, x, state, self.segment, "titans-mac")

    def _segment_piece(self, x: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        b, n, _ = x.shape
        heads = lambda t: t.unflatten(2, (self.num_heads, self.head_dim)).transpose(1, 2)  # noqa: E731
        position = state["position"]
        positions = position[:, None] + torch.arange(n, device=x.device)
        done = position % self.segment  # tokens of this segment already in the buffer

        read = l2norm(heads(F.silu(self.read_query(x))))
        memory = self.memory
        h = memory_read(
            read.to(state["memory.0"].dtype),
            memory.segment_memory(state),
            memory.activation,
            ResidualNorm.of(memory.inner_norm_weight, memory.inner_norm_bias),
        )
        h = h.to(x.dtype).transpose(1, 2).flatten(2)

        q, k, v = (heads(t) for t in self.qkv(x).chunk(3, dim=-1))
        _, kh, vh = (heads(t) for t in self.qkv(h).chunk(3, dim=-1))
        q, k, kh = (rope(t, positions) for t in (q, k, kh))
        p = self.persistent_key.shape[1]
        keys = torch.cat([self.persistent_key.expand(b, -1, -1, -1), state["key"].to(x.dtype), kh, k], dim=2)
        values = torch.cat([self.persistent_value.expand(b, -1, -1, -1), state["value"].to(x.dtype), vh, v], dim=2)
        slot = torch.arange(2 * self.segment, device=x.device) % self.segment
        buffered = (slot[None, :] < done[:, None])[:, None, :].expand(b, n, -1)
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril().expand(b, n, n)
        mask = torch.cat([buffered.new_ones(b, n, p), buffered, causal, causal], dim=2)
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None])
        y = self.out(y.transpose(1, 2).flatten(2))

        r, memory_state = self.memory.prefill(y, state)
        index = (positions % self.segment)[:, None, :, None].expand(b, self.num_heads, n, self.head_dim)
        index = torch.cat([index, index + self.segment], dim=2)
        new = {
            "key": state["key"].scatter(2, index, torch.cat([kh, k], dim=2).to(state["key"].dtype)),
            "value": state["value"].scatter(2, index, torch.cat([vh, v], dim=2).to(state["value"].dtype)),
            **memory_state,
        }
        return y * torch.sigmoid(r), {k: new[k] for k in state}
