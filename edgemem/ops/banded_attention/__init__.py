"""BandedAttention: Longformer attention (dilated sliding window, global and persistent tokens).

contract.py — the node's name, inputs, outputs, attributes and the argument checks other ops
and layers share; naive.py — the row-by-row reference; chunk.py — the fast form, Longformer's
blocked band with no T×T matrix; op.py — the `edgemem::banded_attention` custom op (fake impl, autograd by
recomputation) behind the validated `banded_attention`; onnx.py — the opaque
`edgemem::BandedAttention` node it emits under `torch.onnx.export` and the model-local
function (standard ONNX ops) that runs it. onnx.py is imported on demand, keeping `onnx` out of
this package's import.
"""

from edgemem.ops.banded_attention.chunk import banded_attention_chunk
from edgemem.ops.banded_attention.contract import ATTRIBUTES, INPUTS, OP_TYPE, OUTPUTS
from edgemem.ops.banded_attention.naive import banded_attention_naive
from edgemem.ops.banded_attention.op import banded_attention

__all__ = [
    "ATTRIBUTES",
    "INPUTS",
    "OP_TYPE",
    "OUTPUTS",
    "banded_attention",
    "banded_attention_chunk",
    "banded_attention_naive",
]
