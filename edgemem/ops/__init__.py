"""edgemem ops: one package per op, each made of the same files.

    contract.py   OP_TYPE, INPUTS, OUTPUTS, ATTRIBUTES of the `edgemem::<OP_TYPE>` node and the
                  argument checks (other ops and layers import checks from here, never from op.py)
    naive.py      the reference, easy to check by eye (an op with a plain PyTorch form has none)
    chunk.py      the fast form, same signature (likewise)
    op.py         the public function(s) and the torch custom op (fake impl, autograd); under
                  `torch.onnx.export` they call onnx.py's `emit` instead
    onnx.py       `emit` (the opaque node) and `function(opset)` (its model-local FunctionProto
                  in standard ops); imports the contract, never op.py, and is imported on demand,
                  keeping `onnx` out of this package's import
    __init__.py   hands the public names on

To add an op: write its package with these files (four, or six with a reference and a fast form),
import its contract here and add it to `CONTRACTS` below, and hand its public function(s) on
(imports, `__all__`). Export (`attach_functions`) and tests/test_opset.py then find it; its
TensorRT plugin is `plugins/`'s side.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from edgemem.ops.banded_attention import banded_attention
from edgemem.ops.banded_attention import contract as banded_attention_contract
from edgemem.ops.cache_attention import cache_attention
from edgemem.ops.cache_attention import contract as cache_attention_contract
from edgemem.ops.linear_attention import contract as linear_attention_contract
from edgemem.ops.linear_attention import linear_attention
from edgemem.ops.neural_memory import contract as neural_memory_contract
from edgemem.ops.neural_memory import neural_memory, neural_memory_step
from edgemem.ops.window_attention import contract as window_attention_contract
from edgemem.ops.window_attention import window_attention_prefill, window_attention_step

if TYPE_CHECKING:
    import onnx

# op type → its contract module (one line per op)
CONTRACTS = {
    contract.OP_TYPE: contract
    for contract in (
        linear_attention_contract,
        neural_memory_contract,
        banded_attention_contract,
        window_attention_contract,
        cache_attention_contract,
    )
}


def onnx_functions(opset: int, op_types: list[str] | None = None) -> dict[str, onnx.FunctionProto]:
    """Op type → model-local FunctionProto (body in standard ops at `opset`) of the edgemem ops
    named (default: all), from the onnx.py beside each contract."""
    return {
        op_type: import_module(".onnx", CONTRACTS[op_type].__package__).function(opset)
        for op_type in (op_types if op_types is not None else CONTRACTS)
    }


__all__ = [
    "CONTRACTS",
    "banded_attention",
    "cache_attention",
    "linear_attention",
    "neural_memory",
    "neural_memory_step",
    "onnx_functions",
    "window_attention_prefill",
    "window_attention_step",
]
