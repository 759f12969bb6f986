"""The NeuralMemory contract: the node's name, inputs, outputs and attributes (onnx.py has the
details), and the arguments every form passes on: the per-token tensors, the memory's state, TTT's
residual norm and the static options."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from edgemem.errors import ShapeError
from edgemem.opset import Attribute

OP_TYPE = "NeuralMemory"
INPUTS = (
    "query", "key", "value", "theta", "eta", "alpha", "position", "norm_weight", "norm_bias",
    "weights_1", "momentum_1", "chunk_weights_1", "weights_2", "momentum_2", "chunk_weights_2",
)  # fmt: skip
OUTPUTS = (
    "output", "present_position", "present_weights_1", "present_momentum_1", "present_chunk_weights_1",
    "present_weights_2", "present_momentum_2", "present_chunk_weights_2",
)  # fmt: skip
ATTRIBUTES = {
    "num_heads": Attribute("int"),
    "chunk_size": Attribute("int", 1),
    "depth": Attribute("int"),
    "residual_norm": Attribute("int", 0),
    "activation": Attribute("string", "silu"),
}

# eps of the LayerNorm inside the TTT inner model x + γ ⊙ LN(f(x)) + β
NORM_EPS = 1e-6


class Tokens(NamedTuple):
    """Per token: query, key, value `[B, T, H*D]` (or `[B, T, H, D]`), learning rate θ, momentum
    decay η and forgetting α `[B, T, H]`."""

    query: Tensor
    key: Tensor
    value: Tensor
    theta: Tensor
    eta: Tensor
    alpha: Tensor


@dataclass(frozen=True)
class Memory:
    """The memory's state. Per layer (depth 1: `(W1,)`; depth 2: `(W1, W2)`) the weights and the
    momentum; when streaming, the weights at the start of the current chunk and `position`, int64
    `[B]` or `[1]`, the tokens each row has seen (both None: a chunk starts at the call)."""

    weights: Sequence[Tensor]
    momentum: Sequence[Tensor]
    chunk_weights: Sequence[Tensor] | None = None
    position: Tensor | None = None

    @property
    def depth(self) -> int:
        return len(self.weights)


@dataclass(frozen=True)
class ResidualNorm:
    """TTT's inner model M(x) = x + γ ⊙ LN(f(x)) + β around the memory MLP f; γ = weight and
    β = bias are `[H, D]`."""

    weight: Tensor
    bias: Tensor

    @staticmethod
    def of(norm_weight: Tensor | None, norm_bias: Tensor | None) -> ResidualNorm | None:
        if (norm_weight is None) != (norm_bias is None):
            raise ShapeError("neural_memory: give both norm_weight and norm_bias (the residual norm) or neither")
        return None if norm_weight is None else ResidualNorm(norm_weight, norm_bias)

    def rows(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(γ, β) as `[H, 1, D]` in `dtype`: they broadcast over `[B, H, N, D]` rows."""
        return self.weight.to(dtype)[:, None], self.bias.to(dtype)[:, None]


@dataclass(frozen=True)
class Options:
    """What the node's attributes hold besides depth and residual norm: heads, tokens per chunk
    (gradients of a chunk are taken at its start weights), the depth-2 MLP's activation."""

    num_heads: int
    chunk_size: int = 1
    activation: str = "silu"
