"""LinearAttention (ONNX opset 27): linear | gated | delta | gated_delta recurrences with GQA.

contract.py — the node's name, inputs, outputs, attributes and the argument checks;
naive.py — the token-by-token reference; chunk.py — the chunk-parallel (UT/WY) form;
op.py — the `edgemem::linear_attention` custom op with fake impl and autograd; onnx.py — the
opaque `edgemem::LinearAttention` node it emits under `torch.onnx.export` and the model-local
function (standard ONNX ops) that runs it. onnx.py is imported on demand, keeping `onnx` out of
this package's import.
"""

from edgemem.ops.linear_attention.chunk import linear_attention_chunk
from edgemem.ops.linear_attention.contract import ATTRIBUTES, INPUTS, OP_TYPE, OUTPUTS, UPDATE_RULES
from edgemem.ops.linear_attention.naive import linear_attention_naive
from edgemem.ops.linear_attention.op import linear_attention

__all__ = [
    "ATTRIBUTES",
    "INPUTS",
    "OP_TYPE",
    "OUTPUTS",
    "UPDATE_RULES",
    "linear_attention",
    "linear_attention_chunk",
    "linear_attention_naive",
]
