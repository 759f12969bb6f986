"""Titans long-term neural memory (TTT as its special case): a per-head MLP memory trained
online by momentum gradient descent with forgetting, in chunks (see `neural_memory`).

contract.py — the node's name, inputs, outputs, attributes and the arguments every form takes;
naive.py — the token-by-token reference; chunk.py — the chunked form; op.py — the
`edgemem::neural_memory` custom op behind `neural_memory` / `neural_memory_step`; onnx.py — the
opaque `edgemem::NeuralMemory` node they emit under `torch.onnx.export` and the model-local
function (standard ONNX ops) that runs it, imported on demand so that `onnx` stays out of this
package's import.
"""

from edgemem.ops.neural_memory.chunk import neural_memory_chunk
from edgemem.ops.neural_memory.contract import (
    ATTRIBUTES,
    INPUTS,
    OP_TYPE,
    OUTPUTS,
    Memory,
    Options,
    ResidualNorm,
    Tokens,
)
from edgemem.ops.neural_memory.naive import memory_read, neural_memory_naive
from edgemem.ops.neural_memory.op import neural_memory, neural_memory_step

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
