"""Language model around any stateful mixers (nanoGPT-style, one file): the presets' byte-level
LMs and the models imported from Hugging Face directories (`edgemem.models.hf`).

embedding → N × [RMSNorm → mixer → residual → RMSNorm → SwiGLU → residual] → RMSNorm → head
(mlp_hidden = 0 drops the SwiGLU, for mixers such as GAU that carry their own gating MLP).
Every layer uses `mixer` unless `layer_types` names a mixer per layer (hybrids); the options of
a mixer other than `mixer` are in `layer_type_options`. `norm_unit_offset` makes every RMSNorm
scale by 1 + w (Qwen3.5); `tie_embeddings` shares the embedding with the head.
The model follows the stateful protocol on token ids: its state is the flat, ordered union of
its layers' states, named `"{layer}.{kind}"` (export maps them to
`past_key_values.{layer}.{kind}` / `present.{layer}.{kind}`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from edgemem.config import check_settings
from edgemem.errors import ConfigError, EdgememError
from edgemem.layers import (
    AFT,
    GAU,
    HOPE,
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
from edgemem.layers.common import rms_norm

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
    "hope": HOPE,
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
    layer_types: list[str] = field(default_factory=list)
    layer_type_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    norm_unit_offset: bool = False
    tie_embeddings: bool = False

    def mixer_of(self, layer: int) -> tuple[str, dict[str, Any]]:
        """The mixer type of `layer` and its constructor options."""
        kind = self.layer_types[layer] if self.layer_types else self.mixer
        return kind, self.mixer_options if kind == self.mixer else self.layer_type_options.get(kind, {})

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
    def __init__(self, config: LMConfig, layer: int):
        super().__init__()
        kind, options = config.mixer_of(layer)
        norm = config.norm_unit_offset
        self.mixer_norm = rms_norm(config.d_model, config.norm_eps, norm)
        self.mixer = MIXERS[kind](config.d_model, **options)
        self.mlp_norm = rms_norm(config.d_model, config.norm_eps, norm) if config.mlp_hidden else None
        self.mlp = SwiGLU(config.d_model, config.mlp_hidden) if config.mlp_hidden else None

    def prefill(self, x: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        y, state = self.mixer.prefill(self.mixer_norm(x), state)
        x = x + y
        return (x if self.mlp is None else x + self.mlp(self.mlp_norm(x))), state


class LM(nn.Module):
    def __init__(self, config: LMConfig):
        super().__init__()
        self.config = config
        for options in [config.mixer_options, *config.layer_type_options.values()]:  # before any allocation
            check_settings(
                {
                    "d_model": config.d_model,
                    "n_layers": config.n_layers,
                    "mlp_hidden": config.mlp_hidden,
                    "vocab_size": config.vocab_size,
                    "norm_eps": config.norm_eps,
                    **options,
                },
                config.arch,
            )
        if config.layer_types and len(config.layer_types) != config.n_layers:
            raise ConfigError(f"layer_types has {len(config.layer_types)} entries for {config.n_layers} layers")
        unknown = sorted({t for t in [config.mixer, *config.layer_types] if t not in MIXERS})
        if unknown:
            raise ConfigError(f"unknown mixer type(s) {', '.join(unknown)}; known: {', '.join(MIXERS)}")
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = rms_norm(config.d_model, config.norm_eps, config.norm_unit_offset)
        # tied: the head reads the embedding matrix (one parameter, so checkpoints hold it once)
        self.head = None if config.tie_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)

    @property
    def streaming(self) -> bool:
        """False when a layer is bidirectional: then only `forward` / one `prefill` of a whole input."""
        return all(block.mixer.streaming for block in self.blocks)

    @property
    def parallel_prefill(self) -> bool:
        """False when a layer's prefill loops over segments (see `prefill_segment`)."""
        return all(block.mixer.parallel_prefill for block in self.blocks)

    @property
    def kv_cache(self) -> dict[str, Any] | None:
        """The preallocated KV cache of the softmax-attention layers (`set_kv_cache`): `max_length`,
        `sinks` (None: error past it) and the state names of the caches; None for growing or no caches."""
        layers = [(i, b.mixer) for i, b in enumerate(self.blocks) if isinstance(b.mixer, SoftmaxAttention)]
        layouts = {(m.max_length, m.sinks) for _, m in layers}
        if not layers or layouts == {(None, None)}:
            return None
        if len(layouts) > 1:
            raise ConfigError(
                f"softmax-attention layers differ in their KV cache (max_length, sinks): {sorted(layouts, key=str)}; "
                "give them one layout"
            )
        ((max_length, sinks),) = layouts
        return {
            "max_length": max_length,
            "sinks": sinks,
            "states": [f"{i}.{kind}" for i, _ in layers for kind in ("key", "value")],
        }

    @property
    def prefill_segment(self) -> int:
        """Positions per segment within which one traced prefill is exact for every layer (the greatest
        common divisor of theirs: each layer's boundaries are boundaries of it); 0 when all prefill in
        parallel or one loops with no segment."""
        sizes = [block.mixer.prefill_segment for block in self.blocks if not block.mixer.parallel_prefill]
        return math.gcd(*sizes) if sizes and all(sizes) else 0

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
        x = self.norm(x)
        return (F.linear(x, self.embed.weight) if self.head is None else self.head(x)), new_state

    def step(self, tokens: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        """tokens `[B]` → (logits `[B, V]`, state)."""
        if not self.streaming:
            raise EdgememError(f"{self.config.arch} is bidirectional: it has no step, run whole inputs through forward")
        logits, state = self.prefill(tokens[:, None], state)
        return logits[:, 0], state

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens `[B, T]` → logits `[B, T, V]` from a fresh state."""
        return self.prefill(tokens, self.init_state(tokens.shape[0], tokens.device))[0]


def set_kv_cache(model: LM, max_length: int, sinks: int | None = None) -> None:
    """Give every softmax-attention layer of `model` a preallocated cache of `max_length` tokens (with
    `sinks`: a sliding window with attention sinks past it), in the layers and in `model.config`."""
    layers = [b.mixer for b in model.blocks if isinstance(b.mixer, SoftmaxAttention)]
    if not layers:
        raise ConfigError(f"{model.config.arch} has no softmax-attention layer: a KV-cache length does not apply")
    for layer in layers:
        layer.set_cache(max_length, sinks)
    config, options = model.config, {"max_length": max_length, "sinks": sinks}
    if config.mixer == "softmax":
        config.mixer_options = {**config.mixer_options, **options}
    if "softmax" in config.layer_types and config.mixer != "softmax":
        config.layer_type_options = {
            **config.layer_type_options,
            "softmax": {**config.layer_type_options.get("softmax", {}), **options},
        }
