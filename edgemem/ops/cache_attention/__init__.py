"""CacheAttention: softmax attention over a preallocated KV cache written at per-row positions.

contract.py — the node's name, inputs, outputs, attributes and what they mean; op.py — the
PyTorch form (`cache_attention`) and, under `torch.onnx.export`, the opaque
`edgemem::CacheAttention` node; onnx.py — that node and its model-local function (standard
ONNX ops), imported on demand so that `onnx` stays out of this package's import. The `ort` target
lowers the node to onnxruntime's `com.microsoft::GroupQueryAttention` (edgemem.export.lower).
"""

from edgemem.ops.cache_attention.contract import ATTRIBUTES, INPUTS, OP_TYPE, OUTPUTS
from edgemem.ops.cache_attention.op import cache_attention

__all__ = ["ATTRIBUTES", "INPUTS", "OP_TYPE", "OUTPUTS", "cache_attention"]
