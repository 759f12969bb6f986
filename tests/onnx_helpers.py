"""Shared test helpers: one edgemem node plus its local function as a runnable ONNX model."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper
from onnx.reference import ReferenceEvaluator

from edgemem.opset import DOMAIN, VERSION

OPSET = 20


def single_node_model(
    function: onnx.FunctionProto,
    feeds: dict[str, np.ndarray],
    attrs: dict,
    outputs: dict[str, tuple[int, int]],
    *,
    opset: int = OPSET,
) -> onnx.ModelProto:
    """A model with one `edgemem::<function.name>` node over `feeds` (in the function's input
    order; a name missing from feeds becomes an absent optional input) and the function attached.
    `outputs`: name → (ONNX element type, rank), e.g. `(onnx.TensorProto.FLOAT, 3)`, in the node's order."""
    node_inputs = [name if name in feeds else "" for name in function.input]
    while node_inputs and node_inputs[-1] == "":
        node_inputs.pop()
    node = helper.make_node(function.name, node_inputs, list(outputs), domain=DOMAIN, **attrs)
    graph = helper.make_graph(
        [node],
        function.name,
        [
            helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape))
            for n, a in feeds.items()
        ],
        [helper.make_tensor_value_info(n, t, [f"{n}_{i}" for i in range(rank)]) for n, (t, rank) in outputs.items()],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, VERSION)],
        functions=[function],
    )
    model.ir_version = 10
    return model


def run_onnxruntime(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def run_reference(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ReferenceEvaluator(model).run(None, feeds)
