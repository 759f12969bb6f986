"""WindowAttention: the streaming (decode / prefill) form of causal BandedAttention.

State is a ring buffer of the last window·max(dilation) keys and values plus fixed persistent
K/V; per token O(window) work, constant memory. contract.py — the node's name, inputs, outputs
and attributes; naive.py — a token-by-token ring-buffer reference; chunk.py — the fast gathered
form; op.py — the `edgemem::window_attention` custom op behind `window_attention_prefill` /
`window_attention_step`; onnx.py — the opaque `edgemem::WindowAttention` node they emit under
`torch.onnx.export` and the model-local function (standard ONNX ops) that runs it, imported on
demand so that `onnx` stays out of this package's import.
"""

from edgemem.ops.window_attention.chunk import window_attention_chunk
from edgemem.ops.window_attention.contract import ATTRIBUTES, INPUTS, OP_TYPE, OUTPUTS
from edgemem.ops.window_attention.naive import window_attention_naive
from edgemem.ops.window_attention.op import (
    init_window_state,
    ring_length,
    window_attention_prefill,
    window_attention_step,
)

__all__ = [
    "ATTRIBUTES",
    "INPUTS",
    "OP_TYPE",
    "OUTPUTS",
    "init_window_state",
    "ring_length",
    "window_attention_chunk",
    "window_attention_naive",
    "window_attention_prefill",
    "window_attention_step",
]
