"""An encoder-decoder around Longformer's banded attention (the shape of Hugging Face's LED,
Longformer-Encoder-Decoder): a long input is encoded once, a decoder streams from it.

    encode:  ids → shared embedding + learned positions 0..S−1 → LayerNorm
             → N × `EncoderBlock` (banded attention, global tokens, post-LN) → memory `[B, S, d]`
             → per decoder layer: cross keys and values `[B, H, S, D]` (the decoder's state)
    decode:  ids → shared embedding + learned positions p.. → LayerNorm
             → M × [self-attention over a preallocated KV cache → residual → LayerNorm
                    → cross-attention over the encoder's keys/values → residual → LayerNorm
                    → Linear → GELU → Linear → residual → LayerNorm]
             → head (tied to the embedding unless `tie_embeddings` is false) + final_logits_bias

The decoder follows the stateful protocol; its state is the self-attention caches `{i}.key`,
`{i}.value` `[B, H, max_length, D]`, the cross keys/values `{i}.cross_key`, `{i}.cross_value`
`[B, H, S, D]` (filled once by `start`, then read only; S is the encoded input's length, the
state dim named `encoder_sequence`) and `position` (int64 `[B]`). The encoder is bidirectional:
inputs are encoded whole, never streamed, through `banded_attention` (no S×S tensor).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from edgemem.errors import CacheFullError, ConfigError, ShapeError
from edgemem.layers import State
from edgemem.models.encoder import EncoderBlock
from edgemem.ops.cache_attention import cache_attention

ENCODER_SEQUENCE = "encoder_sequence"  # the state dim of the cross keys/values: the encoded input's length


@dataclass
class Seq2SeqConfig:
    arch: str
    vocab_size: int
    d_model: int
    encoder_layers: int
    decoder_layers: int
    encoder_heads: int
    decoder_heads: int
    encoder_ffn: int
    decoder_ffn: int
    windows: list[int]  # one-sided attention window of each encoder layer
    max_encoder_positions: int  # the longest input
    max_decoder_positions: int  # the longest decoder stream
    pad_token_id: int = 1
    decoder_start_token_id: int = 2
    eos_token_id: int = 2
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    max_length: int | None = None  # decoder KV cache slots (None: max_decoder_positions)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def cache_length(self) -> int:
        return self.max_length or self.max_decoder_positions


class CrossAttention(nn.Module):
    """Decoder queries over the encoder's keys and values (computed once per input by `memory`)."""

    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)

    def memory(self, encoded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[B, H, S, D]` of the encoder output `[B, S, d]`."""
        return tuple(p(encoded).unflatten(2, (self.num_heads, self.head_dim)).transpose(1, 2) for p in (self.k, self.v))

    def forward(self, x: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        q = self.q(x).unflatten(2, (self.num_heads, self.head_dim)).transpose(1, 2)
        probs = (q @ key.transpose(2, 3) * self.head_dim**-0.5).softmax(-1)
        return self.out((probs @ value).transpose(1, 2).flatten(2))


class DecoderBlock(nn.Module):
    def __init__(self, config: Seq2SeqConfig):
        super().__init__()
        d, eps = config.d_model, config.norm_eps
        self.num_heads, self.head_dim = config.decoder_heads, d // config.decoder_heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.attn_norm = nn.LayerNorm(d, eps=eps)
        self.cross = CrossAttention(d, config.decoder_heads)
        self.cross_norm = nn.LayerNorm(d, eps=eps)
        self.up = nn.Linear(d, config.decoder_ffn)
        self.down = nn.Linear(config.decoder_ffn, d)
        self.mlp_norm = nn.LayerNorm(d, eps=eps)

    def forward(self, x: torch.Tensor, state: State, position: torch.Tensor) -> tuple[torch.Tensor, State]:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        h = self.num_heads
        y, key, value = cache_attention(
            q, k, v, state["key"], state["value"], position, num_heads=h, kv_num_heads=h, scale=self.head_dim**-0.5
        )
        x = self.attn_norm(x + self.out(y))
        x = self.cross_norm(x + self.cross(x, state["cross_key"], state["cross_value"]))
        x = self.mlp_norm(x + self.down(F.gelu(self.up(x))))
        return x, {**state, "key": key, "value": value}


class EncoderDecoder(nn.Module):
    """LED's model: `start(input_ids, global_attention_mask)` encodes and returns a decoder state
    at position 0; `prefill` / `step` then decode from it (the stateful protocol on decoder ids)."""

    streaming = True
    parallel_prefill = True

    def __init__(self, config: Seq2SeqConfig):
        super().__init__()
        if len(config.windows) != config.encoder_layers:
            raise ConfigError(
                f"windows lists one window per encoder layer: {config.encoder_layers} expected, got {config.windows}"
            )
        for name in ("encoder_heads", "decoder_heads"):
            if config.d_model % getattr(config, name):
                raise ConfigError(f"d_model ({config.d_model}) is not a multiple of {name} ({getattr(config, name)})")
        if not 1 <= config.cache_length <= config.max_decoder_positions:
            raise ConfigError(
                f"max_length ({config.max_length}) must lie in [1, max_decoder_positions = "
                f"{config.max_decoder_positions}]: the decoder has no positions past it"
            )
        self.config = config
        d = config.d_model
        self.embed = nn.Embedding(config.vocab_size, d)
        self.encoder_positions = nn.Embedding(config.max_encoder_positions, d)
        self.encoder_norm = nn.LayerNorm(d, eps=config.norm_eps)
        self.encoder = nn.ModuleList(
            EncoderBlock(d, config.encoder_heads, w, config.encoder_ffn, config.norm_eps) for w in config.windows
        )
        self.decoder_positions = nn.Embedding(config.max_decoder_positions, d)
        self.decoder_norm = nn.LayerNorm(d, eps=config.norm_eps)
        self.decoder = nn.ModuleList(DecoderBlock(config) for _ in range(config.decoder_layers))
        self.head = None if config.tie_embeddings else nn.Linear(d, config.vocab_size, bias=False)
        self.register_buffer("final_logits_bias", torch.zeros(config.vocab_size))

    # ------------------------------------------------------------------ encoder
    def check_input(self, input_ids: Any, global_attention_mask: Any = None) -> None:
        """input_ids an integer `[B, S]` tensor within the vocabulary and the encoder's positions;
        global_attention_mask None or an integer/bool tensor of the same shape."""
        if not (isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and not input_ids.is_floating_point()):
            shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ShapeError(f"input_ids must be an integer tensor [B, S]; got {shape}")
        mask = global_attention_mask
        if mask is not None and not (
            isinstance(mask, torch.Tensor) and mask.shape == input_ids.shape and not mask.is_floating_point()
        ):
            shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ShapeError(
                f"global_attention_mask must be an integer or bool tensor shaped like input_ids "
                f"{tuple(input_ids.shape)} (1: global, 0: local); got {shape}"
            )
        if torch.onnx.is_in_onnx_export():
            return
        s, limit = input_ids.shape[1], self.config.max_encoder_positions
        if not 1 <= s <= limit:
            raise ShapeError(f"an input of {s} tokens: the encoder takes 1 to {limit} (max_encoder_positions)")
        if input_ids.min() < 0 or input_ids.max() >= self.config.vocab_size:
            raise ShapeError(
                f"input_ids must lie in [0, {self.config.vocab_size}); got "
                f"[{int(input_ids.min())}, {int(input_ids.max())}]"
            )

    def encode(self, input_ids: torch.Tensor, global_attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The encoder's output `[B, S, d]` (LEDEncoder's last_hidden_state)."""
        self.check_input(input_ids, global_attention_mask)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.encoder_norm(self.embed(input_ids) + self.encoder_positions(positions))
        mask = None if global_attention_mask is None else global_attention_mask != 0
        for block in self.encoder:
            x = block(x, mask)
        return x

    def memory(self, encoded: torch.Tensor) -> State:
        """The cross keys and values every decoder layer reads, from the encoder's output."""
        state = {}
        for i, block in enumerate(self.decoder):
            state[f"{i}.cross_key"], state[f"{i}.cross_value"] = block.cross.memory(encoded)
        return state

    def start(self, input_ids: torch.Tensor, global_attention_mask: torch.Tensor | None = None) -> State:
        """A decoder state at position 0 reading the encoded `input_ids`."""
        memory = self.memory(self.encode(input_ids, global_attention_mask))
        state = self.init_state(input_ids.shape[0], input_ids.device, encoder_length=input_ids.shape[1])
        return {**state, **memory}

    # ------------------------------------------------------------------ decoder (stateful protocol)
    @property
    def state_dims(self) -> dict[str, dict[int, str]]:
        """State dims whose size is set per stream (not by the model): the encoded input's length."""
        return {
            f"{i}.cross_{kind}": {2: ENCODER_SEQUENCE}
            for i in range(self.config.decoder_layers)
            for kind in ("key", "value")
        }

    @property
    def read_only(self) -> list[str]:
        """States a stream reads and never writes after `start` (the decoder's graphs do not output them)."""
        return list(self.state_dims)

    @property
    def kv_cache(self) -> dict[str, Any]:
        """The decoder's preallocated self-attention cache (as `LM.kv_cache`)."""
        states = [f"{i}.{kind}" for i in range(self.config.decoder_layers) for kind in ("key", "value")]
        return {"max_length": self.config.cache_length, "sinks": None, "states": states}

    def init_state(
        self, batch: int, device: torch.device | None = None, dtype: torch.dtype | None = None, encoder_length: int = 0
    ) -> State:
        c = self.config
        heads, d = c.decoder_heads, c.d_model // c.decoder_heads
        dtype = dtype or torch.float32
        state: State = {}
        for i in range(c.decoder_layers):
            for kind, length in (
                ("key", c.cache_length),
                ("value", c.cache_length),
                ("cross_key", encoder_length),
                ("cross_value", encoder_length),
            ):
                state[f"{i}.{kind}"] = torch.zeros(batch, heads, length, d, device=device, dtype=dtype)
        state["position"] = torch.zeros(batch, dtype=torch.int64, device=device)
        return state

    def prefill(self, tokens: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        """Decoder ids `[B, T]` continuing from `state` → (logits `[B, T, V]`, state)."""
        position = state["position"]
        t = tokens.shape[1]
        if not torch.onnx.is_in_onnx_export() and int(position.max()) + t > self.config.cache_length:
            raise CacheFullError(
                f"the decoder holds max_length={self.config.cache_length} tokens; a stream at "
                f"position {int(position.max())} cannot take {t} more"
            )
        positions = position[:, None] + torch.arange(t, device=tokens.device)
        x = self.decoder_norm(self.embed(tokens) + self.decoder_positions(positions))
        new: State = {}
        for i, block in enumerate(self.decoder):
            prefix = f"{i}."
            mine = {name[len(prefix) :]: v for name, v in state.items() if name.startswith(prefix)}
            x, mine = block(x, mine, position)
            new.update({prefix + kind: v for kind, v in mine.items()})
        new["position"] = position + t
        logits = F.linear(x, self.embed.weight) if self.head is None else self.head(x)
        return logits + self.final_logits_bias, new

    def step(self, tokens: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        """Decoder ids `[B]` → (logits `[B, V]`, state)."""
        logits, state = self.prefill(tokens[:, None], state)
        return logits[:, 0], state

    def forward(
        self,
        input_ids: torch.Tensor,
        decoder_input_ids: torch.Tensor,
        global_attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Teacher-forced logits `[B, T, V]` of `decoder_input_ids` given `input_ids`."""
        return self.prefill(decoder_input_ids, self.start(input_ids, global_attention_mask))[0]
