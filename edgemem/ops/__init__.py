"""edgemem ops. Each op lives in one package: reference (naive), fast form, custom op, and its
ONNX side (`onnx.py`: the opaque node it emits under export and the model-local function)."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from edgemem.ops.banded_attention import banded_attention
from edgemem.ops.cache_attention import cache_attention
from edgemem.ops.linear_attention import linear_attention
from edgemem.ops.neural_memory import neural_memory, neural_memory_step
from edgemem.ops.window_attention import window_attention_prefill, window_attention_step

if TYPE_CHECKING:
    import onnx

# op type → its package (each package's OP_TYPE)
OP_PACKAGES = {
    import_module(f"edgemem.ops.{package}").OP_TYPE: package
    for package in ("linear_attention", "neural_memory", "banded_attention", "window_attention", "cache_attention")
}


def onnx_functions(opset: int, op_types: list[str] | None = None) -> dict[str, onnx.FunctionProto]:
    """Op type → model-local FunctionProto (body in standard ops at `opset`) of the edgemem ops
    named (default: all)."""
    return {
        op_type: import_module(f"edgemem.ops.{OP_PACKAGES[op_type]}.onnx").function(opset)
        for op_type in (op_types if op_types is not None else OP_PACKAGES)
    }


__all__ = [
    "banded_attention",
    "cache_attention",
    "linear_attention",
    "neural_memory",
    "neural_memory_step",
    "onnx_functions",
    "window_attention_prefill",
    "window_attention_step",
]
