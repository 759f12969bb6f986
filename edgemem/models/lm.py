"""Byte-level language model around any stateful mixer (nanoGPT-style, one file).

embedding → N × [RMSNorm → mixer → residual → RMSNorm → SwiGLU → residual] → RMSNorm → head
(mlp_hidden = 0 drops the SwiGLU, for mixers such as GAU that carry their own gating MLP).
The model follows the stateful protocol on token ids: its state is the flat, ordered union of
its layers' states, named `"{layer}.{kind}"` (export maps them to
`past_key_values.{layer}.{kind}` / `present.{layer}.{kind}`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from edgemem.errors import EdgememError
from edgemem.layers import (
    AFT,
    GAU,
    BandedEncoderAttention,
    DeltaNet,
    DeltaRNN,
    GatedDeltaNet,
    LinearAttention,
    LiZA,
    NeuralMemoryLayer,
    SlidingWindowAttention,
    SoftmaxAttention,
    State,
    StatefulLayer,
    TitansMAC,
    TitansMAG,
    TitansMAL,
)

MIXERS: dict[str, type[StatefulLayer]] = {
    "softmax": SoftmaxAttention,
    "linear": LinearAttention,
    "deltanet": DeltaNet,
    "gated_deltanet": GatedDeltaNet,
    "neural_memory": NeuralMemoryLayer,
    "titans_mag": TitansMAG,
    "titans_mal": TitansMAL,
    "titans_mac": TitansMAC,
    "sliding_window": SlidingWindowAttention,
    "banded_encoder": BandedEncoderAttention,
    "gau": GAU,
    "aft": AFT,
    "delta_rnn": DeltaRNN,
    "liza": LiZA,
}


@dataclass
class LMConfig:
    arch: str
    mixer: str
    d_model: int
    n_layers: int
    mlp_hidden: int
    vocab_size: int = 256
    norm_eps: float = 1e-5
    mixer_options: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: LMConfig):
        super().__init__()
        self.mixer_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.mixer = MIXERS[config.mixer](config.d_model, **config.mixer_options)
        self.mlp_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps) if config.mlp_hidden else None
        self.mlp = SwiGLU(config.d_model, config.mlp_hidden) if config.mlp_hidden else None

    def prefill(self, x: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        y, state = self.mixer.prefill(self.mixer_norm(x), state)
        x = x + y
        return (x if self.mlp is None else x + self.mlp(self.mlp_norm(x))), state


class LM(nn.Module):
    def __init__(self, config: LMConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    @property
    def streaming(self) -> bool:
        """False when a layer is bidirectional: then only `forward` / one `prefill` of a whole input."""
        return all(block.mixer.streaming for block in self.blocks)

    @property
    def parallel_prefill(self) -> bool:
        """False when a layer's prefill loops over segments: an export then has a step graph only."""
        return all(block.mixer.parallel_prefill for block in self.blocks)

    def init_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype | None = None) -> State:
        """Flat ordered state `{"{layer}.{kind}": tensor}` of a fresh stream."""
        return {
            f"{i}.{kind}": tensor
            for i, block in enumerate(self.blocks)
            for kind, tensor in block.mixer.init_state(batch, device, dtype).items()
        }

    def prefill(self, tokens: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        """tokens `[B, T]` continuing from `state` → (logits `[B, T, V]`, state)."""
        x = self.embed(tokens)
        new_state: State = {}
        for i, block in enumerate(self.blocks):
            prefix = f"{i}."
            mine = {name[len(prefix) :]: t for name, t in state.items() if name.startswith(prefix)}
            x, mine = block.prefill(x, mine)
            new_state.update({prefix + kind: t for kind, t in mine.items()})
        return self.head(self.norm(x)), new_state

    def step(self, tokens: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        """tokens `[B]` → (logits `[B, V]`, state)."""
        if not self.streaming:
            raise EdgememError(f"{self.config.arch} is bidirectional: it has no step, run whole inputs through forward")
        logits, state = self.prefill(tokens[:, None], state)
        return logits[:, 0], state

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens `[B, T]` → logits `[B, T, V]` from a fresh state."""
        return self.prefill(tokens, self.init_state(tokens.shape[0], tokens.device))[0]
