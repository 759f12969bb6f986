"""LinearAttention: the chunk form, the custom op and two independent ONNX implementations agree."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from edgemem.errors import ShapeError
from edgemem.ops.linear_attention import (
    UPDATE_RULES,
    linear_attention,
    linear_attention_chunk,
    linear_attention_naive,
)


def make_inputs(
    rule, *, b=2, t=13, hq=4, hkv=2, dk=8, dv=6, per_dim_decay=False, past=True, dtype=torch.float64, seed=0
):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    key = torch.nn.functional.normalize(rand(b, t, hkv, dk), dim=-1).flatten(2)  # delta rule needs ‖k‖ ≤ 1
    inputs = dict(query=rand(b, t, hq * dk), key=key, value=rand(b, t, hkv * dv))
    inputs["past_state"] = rand(b, hkv, dk, dv) if past else None
    gated, delta = rule in ("gated", "gated_delta"), rule in ("delta", "gated_delta")
    inputs["decay"] = -torch.rand(b, t, hkv * (dk if per_dim_decay else 1), generator=g, dtype=dtype) if gated else None
    inputs["beta"] = torch.rand(b, t, hkv, generator=g, dtype=dtype) if delta else None
    return inputs, dict(update_rule=rule, q_num_heads=hq, kv_num_heads=hkv)


def assert_close(a, b, rtol, atol=None):
    torch.testing.assert_close(a, b, rtol=rtol, atol=rtol if atol is None else atol)


@pytest.mark.parametrize(
    "rule,per_dim_decay", [(r, False) for r in UPDATE_RULES] + [("gated", True), ("gated_delta", True)]
)
@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2), (4, 1)])
@pytest.mark.parametrize("t,chunk", [(1, 64), (13, 4), (16, 8), (31, 64)])
@pytest.mark.parametrize("past", [False, True])
def test_chunk_form_equals_recurrence_fp64(rule, per_dim_decay, hq, hkv, t, chunk, past):
    inputs, attrs = make_inputs(rule, t=t, hq=hq, hkv=hkv, per_dim_decay=per_dim_decay, past=past)
    ref = linear_attention_naive(**inputs, **attrs)
    out = linear_attention_chunk(**inputs, **attrs, chunk_size=chunk)
    assert_close(out[0], ref[0], 1e-10)
    assert_close(out[1], ref[1], 1e-10)


@pytest.mark.parametrize("rule", UPDATE_RULES)
def test_chunk_form_equals_recurrence_fp32(rule):
    inputs, attrs = make_inputs(rule, t=70, dtype=torch.float32)
    ref = linear_attention_naive(**inputs, **attrs)
    out = linear_attention_chunk(**inputs, **attrs, chunk_size=16)
    assert_close(out[0], ref[0], 1e-4, 1e-4)
    assert_close(out[1], ref[1], 1e-4, 1e-4)


@pytest.mark.parametrize("rule", UPDATE_RULES)
@pytest.mark.parametrize("split", [1, 5, 12])
def test_continuation_across_calls(rule, split):
    inputs, attrs = make_inputs(rule, t=13, past=True)
    whole = linear_attention(**inputs, **attrs, chunk_size=4)
    cut = lambda x, sl: None if x is None or x.dim() == 4 else x[:, sl]  # noqa: E731
    first = {k: cut(v, slice(0, split)) for k, v in inputs.items()}
    first["past_state"] = inputs["past_state"]
    out1, state = linear_attention(**first, **attrs, chunk_size=4)
    rest = {k: cut(v, slice(split, None)) for k, v in inputs.items()}
    rest["past_state"] = state
    out2, state = linear_attention(**rest, **attrs, chunk_size=4)
    assert_close(torch.cat([out1, out2], 1), whole[0], 1e-10)
    assert_close(state, whole[1], 1e-10)


def _onnx_model(domain: str, inputs: dict, attrs: dict, scale: float) -> onnx.ModelProto:
    names = [n for n in ("query", "key", "value", "past_state", "decay", "beta") if inputs[n] is not None]
    node_inputs = [n if inputs[n] is not None else "" for n in ("query", "key", "value", "past_state", "decay", "beta")]
    while node_inputs[-1] == "":
        node_inputs.pop()
    node = helper.make_node(
        "LinearAttention", node_inputs, ["output", "present_state"], domain=domain, scale=scale, **attrs
    )
    io = lambda n, a: helper.make_tensor_value_info(n, TensorProto.FLOAT, list(a.shape))  # noqa: E731
    graph = helper.make_graph(
        [node],
        "linear_attention",
        [io(n, inputs[n]) for n in names],
        [
            helper.make_tensor_value_info("output", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("present_state", TensorProto.FLOAT, None),
        ],
    )
    opsets = [helper.make_opsetid("", 27)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 11
    return model


def _numpy(inputs):
    return {k: v.numpy() for k, v in inputs.items() if v is not None}


@pytest.mark.parametrize("rule", UPDATE_RULES)
@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2)])
@pytest.mark.parametrize("scale", [0.0, 0.3])
def test_op_matches_onnx_reference_evaluator(rule, hq, hkv, scale):
    inputs, attrs = make_inputs(rule, t=9, hq=hq, hkv=hkv, dtype=torch.float32)
    expected = ReferenceEvaluator(_onnx_model("", inputs, attrs, scale)).run(None, _numpy(inputs))
    out, state = linear_attention(**inputs, **attrs, scale=scale, chunk_size=4)
    np.testing.assert_allclose(out.numpy(), expected[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(state.numpy(), expected[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("domain", ["", "com.microsoft"])
@pytest.mark.parametrize("rule", UPDATE_RULES)
def test_op_matches_onnxruntime_kernel(domain, rule):
    inputs, attrs = make_inputs(rule, t=11, hq=4, hkv=2, dtype=torch.float32)
    session = ort.InferenceSession(
        _onnx_model(domain, inputs, attrs, 0.0).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    expected = session.run(None, _numpy(inputs))
    out, state = linear_attention(**inputs, **attrs, chunk_size=4)
    np.testing.assert_allclose(out.numpy(), expected[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(state.numpy(), expected[1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rule", UPDATE_RULES)
def test_backward_matches_autograd_through_recurrence(rule):
    inputs, attrs = make_inputs(rule, t=7, hq=4, hkv=2, dk=4, dv=3)
    leaves = {k: v.clone().requires_grad_() for k, v in inputs.items() if v is not None}
    full = {**inputs, **leaves}
    weights = torch.randn(2, 7, 4 * 3, dtype=torch.float64), torch.randn(2, 2, 4, 3, dtype=torch.float64)

    def loss(fn, **kw):
        out, state = fn(**full, **attrs, **kw)
        return (out * weights[0]).sum() + (state * weights[1]).sum()

    expected = torch.autograd.grad(loss(linear_attention_naive), list(leaves.values()))
    got = torch.autograd.grad(loss(linear_attention, chunk_size=3), list(leaves.values()))
    for e, g in zip(expected, got):
        assert_close(g, e, 1e-10)


def test_custom_op_passes_opcheck():
    inputs, attrs = make_inputs("gated_delta", t=6, dtype=torch.float32)
    args = (*inputs.values(), "gated_delta", 0.0, attrs["q_num_heads"], attrs["kv_num_heads"], 4)
    torch.library.opcheck(torch.ops.edgemem.linear_attention.default, args)


def test_half_inputs_accumulate_state_in_float32():
    inputs, attrs = make_inputs("gated_delta", t=40, past=False, dtype=torch.float32)
    half = {k: None if v is None else v.half() for k, v in inputs.items()}
    out, state = linear_attention(**half, **attrs)
    ref_out, ref_state = linear_attention_naive(
        **{k: None if v is None else v.float() for k, v in half.items()}, **attrs
    )
    assert out.dtype == torch.float16 and state.dtype == torch.float32
    assert_close(state, ref_state, 1e-5)
    assert_close(out.float(), ref_out, 2e-3)


def test_unpacked_layout_gives_unpacked_output():
    inputs, attrs = make_inputs("delta", t=5)
    packed = linear_attention(**inputs, **attrs)
    four_d = dict(inputs)
    for name, heads in (("query", 4), ("key", 2), ("value", 2)):
        four_d[name] = inputs[name].unflatten(2, (heads, -1))
    out, state = linear_attention(**four_d, **attrs)
    assert out.shape == (2, 5, 4, 6)
    assert_close(out.flatten(2), packed[0], 1e-12)
    assert_close(state, packed[1], 1e-12)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(update_rule="lstm"), "update_rule must be one of"),
        (dict(q_num_heads=3), "must be a positive multiple of kv_num_heads"),
        (dict(value=torch.zeros(2, 12, 12, dtype=torch.float64)), "value has batch/time"),
        (dict(query=torch.zeros(2, 13, dtype=torch.float64)), r"query must be \[B, T, H\*D\]"),
        (dict(past_state=torch.zeros(2, 2, 8, 5, dtype=torch.float64)), r"past_state must be \[B, H_kv, d_k, d_v\]"),
        (dict(decay=torch.zeros(2, 13, 3, dtype=torch.float64)), r"decay must be \[B, T, H_kv\]"),
        (dict(beta=None), "requires beta"),
        (dict(chunk_size=0), "chunk_size must be a positive integer"),
    ],
)
def test_bad_inputs_name_the_problem(change, message):
    inputs, attrs = make_inputs("gated_delta")
    kwargs = {**inputs, **attrs, **change}
    with pytest.raises(ShapeError, match=message):
        linear_attention(**kwargs)
