"""Titans long-term neural memory (TTT as its special case): a per-head MLP memory trained
online by momentum gradient descent with forgetting, in chunks (see `neural_memory`)."""

from edgemem.ops.neural_memory.chunk import neural_memory_chunk
from edgemem.ops.neural_memory.naive import memory_read, neural_memory_naive
from edgemem.ops.neural_memory.op import neural_memory, neural_memory_step

OP_TYPE = "NeuralMemory"

__all__ = [
    "OP_TYPE",
    "memory_read",
    "neural_memory",
    "neural_memory_chunk",
    "neural_memory_naive",
    "neural_memory_step",
]
