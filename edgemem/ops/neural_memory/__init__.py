"""Titans long-term neural memory (TTT as its special case): a per-head MLP memory trained
online by momentum gradient descent with forgetting, in chunks (see `neural_memory`)."""

from edgemem.ops.neural_memory.args import Memory, Options, ResidualNorm, Tokens
from edgemem.ops.neural_memory.chunk import neural_memory_chunk
from edgemem.ops.neural_memory.naive import memory_read, neural_memory_naive
from edgemem.ops.neural_memory.op import ATTRIBUTES, INPUTS, OP_TYPE, OUTPUTS, neural_memory, neural_memory_step

__all__ = [
    "ATTRIBUTES",
    "INPUTS",
    "Memory",
    "OP_TYPE",
    "OUTPUTS",
    "Options",
    "ResidualNorm",
    "Tokens",
    "memory_read",
    "neural_memory",
    "neural_memory_chunk",
    "neural_memory_naive",
    "neural_memory_step",
]
