"""ONNX side of LinearAttention: the function body matches the torch op in onnxruntime and
onnx.reference for every rule, export emits one opaque node that runs once the function is
attached, and the models pass the full checker in a fresh process."""

import subprocess
import sys
import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx_helpers import OPSET, run_onnxruntime, run_reference, single_node_model

from edgemem.ops.linear_attention import ATTRIBUTES, INPUTS, OP_TYPE, OUTPUTS, UPDATE_RULES, linear_attention
from edgemem.ops.linear_attention.onnx import function
from edgemem.opset import DOMAIN, VERSION

B, DK, DV = 2, 8, 6
FLOAT, HALF = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
TOL = dict(rtol=1e-4, atol=1e-5)
HALF_TOL = dict(rtol=2e-3, atol=2e-3)  # one float16 rounding of the output
FUNCTION = function(OPSET)


def case(
    rule, *, hq, hkv, t, per_dim_decay=False, past=True, shared_beta=False, scale=0.0, dtype=torch.float32, seed=0
):
    """(model, feeds, expected [output, present_state]) for one call. The feeds follow the node
    contract: every input present (zero state, zero log-decay, unit beta when the torch call has none)."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    gated, delta = rule in ("gated", "gated_delta"), rule in ("delta", "gated_delta")
    query, value = rand(B, t, hq * DK).to(dtype), rand(B, t, hkv * DV).to(dtype)
    key = torch.nn.functional.normalize(rand(B, t, hkv, DK), dim=-1).flatten(2).to(dtype)  # ‖k‖ ≤ 1 for delta
    past_state = rand(B, hkv, DK, DV) if past else None  # float32 in every case
    decay = (-torch.rand(B, t, hkv * (DK if per_dim_decay else 1), generator=g)).to(dtype) if gated else None
    beta = torch.rand(B, t, 1 if shared_beta else hkv, generator=g).to(dtype) if delta else None
    attrs = dict(update_rule=rule, scale=scale, q_num_heads=hq, kv_num_heads=hkv)
    with torch.no_grad():
        expected = linear_attention(query, key, value, past_state, decay, beta, **attrs)
    feeds = dict(
        query=query,
        key=key,
        value=value,
        past_state=past_state if past else torch.zeros(B, hkv, DK, DV),
        decay=decay if gated else torch.zeros(B, t, hkv, dtype=dtype),
        beta=beta if delta else torch.ones(B, t, hkv, dtype=dtype),
    )
    feeds = {name: x.numpy() for name, x in feeds.items()}
    io_type = FLOAT if dtype == torch.float32 else HALF
    model = single_node_model(
        FUNCTION, feeds, dict(attrs, chunk_size=64), dict(output=(io_type, 3), present_state=(FLOAT, 4))
    )
    return model, feeds, [x.numpy() for x in expected]


def check(model, feeds, expected, runs=(run_onnxruntime, run_reference), tol=TOL):
    for run in runs:
        got = run(model, feeds)
        assert len(got) == 2
        for name, a, e in zip(OUTPUTS, got, expected, strict=True):
            assert (a.dtype, a.shape) == (e.dtype, e.shape), f"{run.__name__}: {name}"
            message = f"{run.__name__}: {name}"
            np.testing.assert_allclose(a.astype(np.float64), e.astype(np.float64), **tol, err_msg=message)


RULE_CASES = [(rule, False) for rule in UPDATE_RULES] + [("gated", True), ("gated_delta", True)]


@pytest.mark.parametrize("rule,per_dim_decay", RULE_CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("hq,hkv", [(4, 2), (2, 2)])
@pytest.mark.parametrize("t", [1, 7])
def test_function_matches_torch(rule, per_dim_decay, hq, hkv, t):
    check(*case(rule, hq=hq, hkv=hkv, t=t, per_dim_decay=per_dim_decay, scale=0.3))


@pytest.mark.parametrize("t", [1, 7])
def test_function_no_past_shared_beta_default_scale(t):
    """Materialised zero state, beta [B, T, 1] and scale 0 (the function's d_k^-½)."""
    check(*case("gated_delta", hq=4, hkv=2, t=t, past=False, shared_beta=True, scale=0.0))


@pytest.mark.parametrize("rule,per_dim_decay", [("linear", False), ("delta", False), ("gated_delta", True)])
@pytest.mark.parametrize("t", [1, 7])
def test_function_float16_io_float32_state(rule, per_dim_decay, t):
    model, feeds, expected = case(rule, hq=4, hkv=2, t=t, per_dim_decay=per_dim_decay, dtype=torch.float16)
    assert feeds["query"].dtype == np.float16 and feeds["past_state"].dtype == np.float32
    assert (expected[0].dtype, expected[1].dtype) == (np.float16, np.float32)
    check(model, feeds, expected, runs=(run_onnxruntime,), tol=HALF_TOL)


def test_function_attribute_defaults():
    """A node that sets only the head counts gets opset 27's defaults: gated_delta, scale d_k^-½."""
    model, feeds, expected = case("gated_delta", hq=4, hkv=2, t=3, scale=0.0)
    node = model.graph.node[0]
    keep = [a for a in node.attribute if a.name in ("q_num_heads", "kv_num_heads")]
    del node.attribute[:]
    node.attribute.extend(keep)
    check(model, feeds, expected)


@pytest.mark.parametrize("opset", [OPSET, 27])
def test_function_signature(opset):
    fn = function(opset)
    assert (fn.domain, fn.name, tuple(fn.input), tuple(fn.output)) == ("edgemem", OP_TYPE, INPUTS, OUTPUTS)
    assert tuple(fn.input) == ("query", "key", "value", "past_state", "decay", "beta")
    declared = [*fn.attribute, *(a.name for a in fn.attribute_proto)]
    assert sorted(declared) == sorted(ATTRIBUTES)
    assert [(o.domain, o.version) for o in fn.opset_import] == [("", opset)]

    def walk(nodes):
        for n in nodes:
            yield n
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    yield from walk(a.g.node)

    nodes = list(walk(fn.node))
    assert {n.domain for n in nodes} == {""}
    assert {n.op_type for n in nodes} >= {"Loop", "If"}
    refs = {a.ref_attr_name for n in nodes for a in n.attribute if a.ref_attr_name}
    assert refs == set(ATTRIBUTES) - {"chunk_size"}  # chunk_size only tunes speed


def test_function_needs_opset_20():
    with pytest.raises(ValueError, match="opset >= 20"):
        function(19)


# ---------------------------------------------------------------- export


class Delta(torch.nn.Module):
    """delta rule, 4-D layout, no past_state: export materialises the zero state and decay."""

    def forward(self, q, k, v, beta):
        attrs = dict(update_rule="delta", q_num_heads=4, kv_num_heads=2, chunk_size=16)
        return linear_attention(q, k, v, None, None, beta, **attrs)


def delta_inputs(b, t, seed):
    g = torch.Generator().manual_seed(seed)
    q, v = torch.randn(b, t, 4, DK, generator=g), torch.randn(b, t, 2, DV, generator=g)
    k = torch.nn.functional.normalize(torch.randn(b, t, 2, DK, generator=g), dim=-1)
    return q, k, v, torch.rand(b, t, 2, generator=g)


@pytest.fixture(scope="module")
def exported():
    """Delta exported once with dynamic batch and time: (model with the function attached, node)."""
    batch, time = torch.export.Dim("batch"), torch.export.Dim("time")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's notes on shared dims and deprecations
        model = torch.onnx.export(
            Delta(),
            delta_inputs(2, 5, seed=0),
            dynamo=True,
            opset_version=OPSET,
            dynamic_shapes=[{0: batch, 1: time}] * 4,
            verbose=False,
        ).model_proto
    nodes = [n for n in model.graph.node if n.domain == "edgemem"]
    assert len(nodes) == 1 and nodes[0].op_type == OP_TYPE
    assert not model.functions  # the exporter keeps the node opaque and attaches nothing
    model.functions.append(function(OPSET))
    if not any(o.domain == "edgemem" for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, VERSION))
    return model, nodes[0]


def test_export_emits_one_node(exported):
    model, node = exported
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs == dict(
        update_rule=b"delta", scale=pytest.approx(DK**-0.5), q_num_heads=4, kv_num_heads=2, chunk_size=16
    )
    assert {a.name: a.type for a in node.attribute} == dict(
        update_rule=onnx.AttributeProto.STRING,
        scale=onnx.AttributeProto.FLOAT,
        q_num_heads=onnx.AttributeProto.INT,
        kv_num_heads=onnx.AttributeProto.INT,
        chunk_size=onnx.AttributeProto.INT,
    )
    assert len(node.input) == 6 and all(node.input)  # zero state and zero decay materialised
    assert [(o.domain, o.version) for o in model.opset_import if o.domain == "edgemem"] == [("edgemem", 1)]
    state_type = next(o for o in model.graph.output if o.name == node.output[1]).type.tensor_type
    assert state_type.elem_type == FLOAT and len(state_type.shape.dim) == 4


@pytest.mark.parametrize("b,t", [(3, 9), (3, 1)])
def test_exported_model_runs_at_other_shapes(exported, b, t):
    model, _ = exported
    args = delta_inputs(b, t, seed=1)
    names = [i.name for i in model.graph.input]
    got = run_onnxruntime(model, dict(zip(names, (x.numpy() for x in args), strict=True)))
    with torch.no_grad():
        expected = Delta()(*args)
    for a, e in zip(got, expected, strict=True):
        assert a.shape == tuple(e.shape)
        np.testing.assert_allclose(a, e.numpy(), **TOL)


def test_full_check_in_a_fresh_process(tmp_path, exported):
    """onnx.checker with full_check (body opset = model opset) in a process that registered no
    edgemem schema: the exported model and a float16 single-node model."""
    models = dict(exported=exported[0], single=case("gated_delta", hq=4, hkv=2, t=7, dtype=torch.float16)[0])
    paths = []
    for name, model in models.items():
        paths.append(str(tmp_path / f"{name}.onnx"))
        onnx.save(model, paths[-1])
    code = "import sys, onnx\nfor p in sys.argv[1:]:\n    onnx.checker.check_model(p, full_check=True)\n"
    done = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
