"""edgemem.opset: every op's function and exported node carry its domain, version and declared
attributes, and the body builder's If / Loop helpers give graphs ONNX runtimes run as written."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from onnx_helpers import run_onnxruntime, run_reference

from edgemem.errors import ConfigError
from edgemem.ops import (
    CONTRACTS,
    banded_attention,
    cache_attention,
    linear_attention,
    neural_memory,
    onnx_functions,
    window_attention_prefill,
)
from edgemem.opset import DOMAIN, VERSION, Attribute, body

KIND = {
    "int": onnx.AttributeProto.INT,
    "ints": onnx.AttributeProto.INTS,
    "float": onnx.AttributeProto.FLOAT,
    "string": onnx.AttributeProto.STRING,
}


def contract(op_type):
    module = CONTRACTS[op_type]
    return module.INPUTS, module.OUTPUTS, module.ATTRIBUTES


def walk(nodes):
    for node in nodes:
        yield node
        for a in node.attribute:
            for g in [a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs:
                yield from walk(g.node)


@pytest.mark.parametrize("op_type", sorted(CONTRACTS))
def test_function_declares_the_ops_contract(op_type):
    """Domain, name, inputs, outputs, attributes with their defaults, and attribute references of
    the declared kind only, in the body and its subgraphs."""
    fn = onnx_functions(20, [op_type])[op_type]
    inputs, outputs, attributes = contract(op_type)
    assert (fn.domain, fn.name, tuple(fn.input), tuple(fn.output)) == (DOMAIN, op_type, inputs, outputs)
    assert list(fn.attribute) == [n for n, a in attributes.items() if a.default is None]
    defaults = {a.name: helper.get_attribute_value(a) for a in fn.attribute_proto}
    expected = {n: a.default.encode() if a.kind == "string" else a.default for n, a in attributes.items()}
    assert defaults == {n: v for n, v in expected.items() if v is not None}
    refs = [a for n in walk(fn.node) for a in n.attribute if a.ref_attr_name]
    assert refs and all(a.type == KIND[attributes[a.ref_attr_name].kind] for a in refs)
    onnx.checker.check_function(fn)


def call_each_op(x):
    """One call of each public op on `[1, 3, 2·4]` tensors (two heads)."""
    gates, state = torch.sigmoid(x[..., :2]), torch.zeros(1, 2, 4, 4)
    linear_attention(x, x, x, update_rule="linear", q_num_heads=2, kv_num_heads=2)
    neural_memory(x, x, x, gates, gates, gates, (state,), (state,), num_heads=2)
    banded_attention(x, x, x, num_heads=2, window=1)
    ring = torch.zeros(1, 2, 2, 4)
    window_attention_prefill(x, x, x, ring, ring, torch.zeros(1, dtype=torch.int64), num_heads=2, window=2)
    cache_attention(x, x, x, ring, ring, torch.zeros(1, dtype=torch.int64), num_heads=2, kv_num_heads=2)


def test_emitted_nodes_use_opset_domain_version_and_attributes(monkeypatch):
    """What each op hands the exporter for its node (torch.onnx.ops.symbolic_multi_out, recorded):
    `edgemem::<OP_TYPE>` at VERSION, one input per INPUTS, one output per OUTPUTS, and every
    declared attribute in the Python type of its kind."""
    calls = []

    def record(name, inputs, attrs, dtypes, shapes, version):
        calls.append((name, len(inputs), attrs, len(dtypes), version))
        return [torch.zeros(s, dtype=d) for d, s in zip(dtypes, shapes)]

    monkeypatch.setattr(torch.onnx, "is_in_onnx_export", lambda: True)
    monkeypatch.setattr(torch.onnx.ops, "symbolic_multi_out", record)
    call_each_op(torch.randn(1, 3, 8))
    python_type = {"int": int, "ints": list, "float": float, "string": str}
    assert sorted(name for name, *_ in calls) == sorted(f"{DOMAIN}::{op}" for op in CONTRACTS)
    for name, n_inputs, attrs, n_outputs, version in calls:
        inputs, outputs, attributes = contract(name.split("::")[1])
        assert (n_inputs, n_outputs, version) == (len(inputs), len(outputs), VERSION)
        assert {k: type(v) for k, v in attrs.items()} == {k: python_type[a.kind] for k, a in attributes.items()}


TABLE = {"times": Attribute("int"), "scale": Attribute("float", 2.0)}


def cumulative_function(opset=20):
    """`Cum(x) = scale · (x₀, x₀+x₁, …)` over the first axis, by a Loop carrying the sum, when
    `times` is 1; else an If gives `x` unchanged: a test body for the helpers."""
    g = body("Cum", ["x"], TABLE, opset, 20)
    scale = g.attr("scale")

    def running_sum(b):
        def step(lb, t, carried):
            total = lb.Add(carried[0], lb.Gather("x", t, axis=0), out="total")
            return [total], [lb.Mul(total, scale, out="scaled")]

        zero = b.Mul(b.Gather("x", b.const(0)), b.const(0.0))
        _, sums = b.loop(b.Squeeze(b.Shape("x", start=0, end=1)), [zero], step, ["sum", "sums"])
        return [sums]

    once = g.Equal(g.attr("times"), g.const(1))
    (y,) = g.branch(once, running_sum, lambda b: ["x"], ["y"])
    g.Identity(y, out="out")
    return g.function("Cum", ["x"], ["out"], opset, "a cumulative sum")


@pytest.mark.parametrize("times", [1, 0])
@pytest.mark.parametrize("run", [run_onnxruntime, run_reference])
def test_builder_if_and_loop_run_as_written(times, run):
    fn = cumulative_function()
    names = [o for n in walk(fn.node) for o in n.output]
    assert len(names) == len(set(names))  # one name per value over the body and its subgraphs
    node = helper.make_node("Cum", ["x"], ["out"], domain=DOMAIN, times=times, scale=3.0)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid(DOMAIN, VERSION)], functions=[fn]
    )
    model.ir_version = 10
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    (got,) = run(model, {"x": x})
    want = 3.0 * np.cumsum(x, axis=0) if times == 1 else x
    np.testing.assert_allclose(got.reshape(4, 3), want, rtol=1e-6, atol=1e-6)


def test_builder_refuses_a_low_opset_and_an_unproduced_output():
    with pytest.raises(ConfigError, match="edgemem::Cum: the function body needs opset >= 20; got 18"):
        cumulative_function(18)
    g = body("Cum", ["x"], TABLE, 20, 20)
    g.Identity("x", out="y")
    with pytest.raises(ValueError, match=r"does not produce \['out'\]"):
        g.function("Cum", ["x"], ["out"], 20, "")
