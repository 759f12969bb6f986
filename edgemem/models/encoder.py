"""A BERT-style encoder around `BandedEncoderAttention` (the shape of Hugging Face's Longformer).

    ids → word + absolute position + token type 0 embeddings → LayerNorm
        → N × [attention → residual → LayerNorm → Linear → GELU → Linear → residual → LayerNorm]
        → last_hidden_state `[B, T, d_model]`

Modelling choices:
- Post-LN blocks (LayerNorm after each residual sum), exact (erf) GELU, biases everywhere.
- Positions are RoBERTa's: a token equal to `pad_token_id` takes position `pad_token_id`, the
  others count from `pad_token_id + 1` over the non-pad tokens before them (so an input of T
  tokens needs `max_positions ≥ T + pad_token_id + 1`). No RoPE.
- Every token has token type 0 (the type embedding's first row), as when no token_type_ids
  are given to Hugging Face's model.
- Attention: per-layer one-sided `windows`, global tokens wherever `global_attention_mask` is
  non-zero, with their own global projections (see `BandedEncoderAttention`). There is no
  padding mask: every sequence of a batch is a real input of the same length (batch unequal
  inputs by running them separately).
- Bidirectional: the stateful protocol holds with an empty state and a prefill of the whole
  input; there is no step.

Export (`edgemem.export.export`): one prefill graph for any batch and length, no step graph, no
state. Inputs `input_ids` and `global_attention_mask` (both int64 `[batch, sequence]`, as
transformers takes them); output `last_hidden_state` (`[batch, sequence, d_model]`), which the
manifest names as `inputs: {"tokens": "input_ids", "global_attention_mask": ...}` and
`outputs: {"last_hidden_state": "last_hidden_state"}`. Run it with onnxruntime directly; the
streaming runtime refuses models without a step graph.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from edgemem.errors import ConfigError, EdgememError, ShapeError
from edgemem.layers import BandedEncoderAttention, State


@dataclass
class EncoderConfig:
    arch: str
    vocab_size: int
    d_model: int
    n_layers: int
    num_heads: int
    mlp_hidden: int
    windows: list[int]  # one-sided attention window of each layer
    max_positions: int  # rows of the position table
    pad_token_id: int
    type_vocab_size: int = 1
    norm_eps: float = 1e-5

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def max_length(self) -> int:
        """The longest input the position table covers."""
        return self.max_positions - self.pad_token_id - 1


class EncoderBlock(nn.Module):
    """One post-LN Longformer block (also LED's encoder layer): banded attention with global
    projections → residual → LayerNorm → Linear → GELU → Linear → residual → LayerNorm."""

    def __init__(self, d_model: int, num_heads: int, window: int, mlp_hidden: int, norm_eps: float):
        super().__init__()
        d = d_model
        self.attn = BandedEncoderAttention(
            d, num_heads, window, global_tokens=0, bias=True, rope=False, global_projections=True
        )
        self.attn_norm = nn.LayerNorm(d, eps=norm_eps)
        self.up = nn.Linear(d, mlp_hidden)
        self.down = nn.Linear(mlp_hidden, d)
        self.mlp_norm = nn.LayerNorm(d, eps=norm_eps)

    def forward(self, x: torch.Tensor, global_mask: torch.Tensor) -> torch.Tensor:
        x = self.attn_norm(x + self.attn.prefill(x, {}, global_mask)[0])
        return self.mlp_norm(x + self.down(F.gelu(self.up(x))))


class Encoder(nn.Module):
    """The encoder; `prefill(input_ids, {}, global_attention_mask)` → (`[B, T, d_model]`, {})."""

    streaming = False
    parallel_prefill = True
    extra_inputs = {"global_attention_mask": torch.int64}  # per-token graph inputs besides input_ids
    output_name = "last_hidden_state"

    def __init__(self, config: EncoderConfig):
        super().__init__()
        if len(config.windows) != config.n_layers:
            raise ConfigError(f"windows lists one window per layer: {config.n_layers} expected, got {config.windows}")
        if not 0 <= config.pad_token_id < min(config.vocab_size, config.max_positions):
            raise ConfigError(
                f"pad_token_id ({config.pad_token_id}) must index both the vocabulary ({config.vocab_size}) "
                f"and the position table ({config.max_positions})"
            )
        if config.max_length < 1:
            raise ConfigError(
                f"max_positions ({config.max_positions}) leaves no position after pad_token_id ({config.pad_token_id})"
            )
        self.config = config
        d = config.d_model
        self.embed = nn.Embedding(config.vocab_size, d)
        self.positions = nn.Embedding(config.max_positions, d)
        self.token_types = nn.Embedding(config.type_vocab_size, d)
        self.embed_norm = nn.LayerNorm(d, eps=config.norm_eps)
        self.blocks = nn.ModuleList(
            EncoderBlock(d, config.num_heads, w, config.mlp_hidden, config.norm_eps) for w in config.windows
        )

    def init_state(self, batch: int, device: torch.device | None = None, dtype: torch.dtype | None = None) -> State:
        return {}

    def _check(self, ids: torch.Tensor, global_attention_mask: torch.Tensor | None) -> None:
        if not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point()):
            shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ShapeError(f"input_ids must be an integer tensor [B, T]; got {shape}")
        if global_attention_mask is not None and (
            not isinstance(global_attention_mask, torch.Tensor)
            or global_attention_mask.shape != ids.shape
            or global_attention_mask.is_floating_point()
        ):
            shape = tuple(global_attention_mask.shape) if isinstance(global_attention_mask, torch.Tensor) else None
            raise ShapeError(
                f"global_attention_mask must be an integer or bool tensor shaped like input_ids {tuple(ids.shape)} "
                f"(1: global, 0: local); got {shape or type(global_attention_mask).__name__}"
            )
        if torch.onnx.is_in_onnx_export():
            return  # symbolic sizes and values: checked above for shape only
        if ids.shape[1] > self.config.max_length:
            raise ShapeError(
                f"input of {ids.shape[1]} tokens is longer than the position table allows ({self.config.max_length})"
            )
        if ids.numel() and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise ShapeError(f"input_ids must lie in [0, {self.config.vocab_size}); got [{ids.min()}, {ids.max()}]")

    def prefill(
        self, input_ids: torch.Tensor, state: State, global_attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, State]:
        """input_ids `[B, T]`, global_attention_mask `[B, T]` (non-zero: global; None: no global
        tokens) → (last_hidden_state `[B, T, d_model]`, {})."""
        self._check(input_ids, global_attention_mask)
        pad = self.config.pad_token_id
        real = (input_ids != pad).long()
        positions = real.cumsum(1) * real + pad
        x = self.embed(input_ids) + self.positions(positions) + self.token_types.weight[0]
        x = self.embed_norm(x)
        global_mask = None if global_attention_mask is None else global_attention_mask != 0
        for block in self.blocks:
            x = block(x, global_mask)
        return x, {}

    def forward(self, input_ids: torch.Tensor, global_attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.prefill(input_ids, {}, global_attention_mask)[0]

    def step(self, tokens: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
        raise EdgememError(f"{self.config.arch} is bidirectional: it has no step, run whole inputs through forward")
