"""LinearAttention (ONNX opset 27): linear | gated | delta | gated_delta recurrences with GQA.

naive.py — the token-by-token reference; chunk.py — the chunk-parallel (UT/WY) form;
op.py — the `edgemem::linear_attention` custom op with fake impl and autograd.
"""

from edgemem.ops.linear_attention.args import UPDATE_RULES
from edgemem.ops.linear_attention.chunk import linear_attention_chunk
from edgemem.ops.linear_attention.naive import linear_attention_naive
from edgemem.ops.linear_attention.op import linear_attention

OP_TYPE = "LinearAttention"

__all__ = ["OP_TYPE", "UPDATE_RULES", "linear_attention", "linear_attention_chunk", "linear_attention_naive"]
