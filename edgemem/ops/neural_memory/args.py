"""The arguments every form of the neural memory passes on: the per-token tensors, the memory's
state, TTT's residual norm and the static options."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from edgemem.errors import ShapeError

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
