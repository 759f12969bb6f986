"""ONNX side of BandedAttention and WindowAttention: the function bodies match the torch ops in
onnxruntime and onnx.reference, export emits one opaque node that runs once the function is
attached, the bodies build no T×T tensor, and the models pass the full checker."""

import subprocess
import sys
import warnings

import numpy as np
import onnx
import onnx.inliner
import onnxruntime as ort
import pytest
import torch
from onnx.reference import ReferenceEvaluator
from onnx_helpers import OPSET, run_onnxruntime, run_reference, single_node_model

from edgemem.ops.banded_attention import OP_TYPE as BANDED
from edgemem.ops.banded_attention import banded_attention
from edgemem.ops.banded_attention.onnx import function as banded_function
from edgemem.ops.window_attention import OP_TYPE as WINDOW
from edgemem.ops.window_attention import init_window_state, ring_length, window_attention_prefill
from edgemem.ops.window_attention.onnx import function as window_function
from edgemem.opset import DOMAIN, VERSION

B, H, D, DV = 2, 3, 4, 5
FLOAT, HALF = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
TOL = dict(rtol=1e-4, atol=1e-5)
BANDED_FN, WINDOW_FN = banded_function(OPSET), window_function(OPSET)


def rand(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


def persistent_feeds(pk, pv, b, dtype=torch.float32):
    """The node's layout: per sequence `[B, H, P, D]`, empty `[B, H, 0, D]` when absent."""
    if pk is None:
        pk, pv = torch.zeros(H, 0, D, dtype=dtype), torch.zeros(H, 0, DV, dtype=dtype)
    if pk.dim() == 3:
        pk, pv = pk.expand(b, *pk.shape), pv.expand(b, *pv.shape)
    return dict(persistent_key=pk.contiguous().numpy(), persistent_value=pv.contiguous().numpy())


def check_both(model, feeds, expected, tol=TOL):
    for run in (run_onnxruntime, run_reference):
        got = run(model, feeds)
        assert len(got) == len(expected)
        for g, e in zip(got, expected, strict=True):
            assert g.dtype == e.dtype and g.shape == e.shape, run.__name__
            np.testing.assert_allclose(g.astype(np.float64), e.astype(np.float64), **tol, err_msg=run.__name__)


# ---------------------------------------------------------------- BandedAttention function


def banded_case(*, t, window, dilation, causal, globals_=None, p=0, per_batch=False, dtype=torch.float32, seed=0):
    """(model, feeds, expected output) for one banded call."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = rand(g, B, t, H * D, dtype=dtype), rand(g, B, t, H * D, dtype=dtype), rand(g, B, t, H * DV, dtype=dtype)
    lead = (B,) if per_batch else ()
    pk, pv = (rand(g, *lead, H, p, D, dtype=dtype), rand(g, *lead, H, p, DV, dtype=dtype)) if p else (None, None)
    mask = None
    if globals_ is not None:
        mask = torch.zeros(B, t, dtype=torch.bool)
        for row, positions in enumerate(globals_):
            mask[row, list(positions)] = True
    kw = dict(num_heads=H, window=window, dilation=dilation, causal=causal, global_mask=mask)
    expected = banded_attention(q, k, v, **kw, persistent_key=pk, persistent_value=pv, scale=0.6)
    feeds = dict(
        query=q.numpy(),
        key=k.numpy(),
        value=v.numpy(),
        global_mask=(torch.zeros(B, t, dtype=torch.bool) if mask is None else mask).numpy(),
        **persistent_feeds(pk, pv, B, dtype),
    )
    dil = [dilation] * H if isinstance(dilation, int) else list(dilation)
    attrs = dict(num_heads=H, window=window, dilation=dil, causal=int(causal), scale=0.6)
    out_type = HALF if dtype == torch.float16 else FLOAT
    return single_node_model(BANDED_FN, feeds, attrs, {"output": (out_type, 3)}), feeds, [expected.numpy()]


@pytest.mark.parametrize(
    "case",
    [
        dict(t=13, window=2, dilation=1, causal=True),
        dict(t=13, window=2, dilation=1, causal=False),
        dict(t=13, window=2, dilation=[1, 2, 3], causal=True),
        dict(t=13, window=3, dilation=[1, 2, 3], causal=False, p=2),
        dict(t=13, window=2, dilation=[1, 2, 3], causal=False, globals_=[(0, 5), (3, 7, 12)]),
        dict(t=13, window=2, dilation=[1, 2, 3], causal=True, globals_=[(0, 5), (3, 7, 12)], p=2),
        dict(t=13, window=2, dilation=2, causal=False, globals_=[(4,), ()], p=3, per_batch=True),
        dict(t=11, window=1, dilation=[2, 1, 1], causal=True, globals_=[(), ()]),
        dict(t=7, window=9, dilation=1, causal=False, globals_=[(6,), (0,)], p=1),
        dict(t=7, window=7, dilation=[1, 2, 3], causal=True, p=2),
        dict(t=1, window=3, dilation=1, causal=False, globals_=[(0,), ()], p=2),
        dict(t=12, window=2, dilation=[1, 3, 2], causal=False, globals_=[(0,), (5, 6, 11)]),  # T = 2 blocks of 6
        dict(t=3, window=4, dilation=1, causal=False, globals_=[(), (0,)]),  # T < window
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()).replace(" ", ""),
)
def test_banded_function_matches_torch(case):
    check_both(*banded_case(**case))


def test_banded_function_float16_in_float32_math():
    model, feeds, expected = banded_case(
        t=9, window=2, dilation=[1, 2, 1], causal=False, globals_=[(3,), ()], p=2, dtype=torch.float16
    )
    check_both(model, feeds, expected, tol=dict(rtol=2e-3, atol=2e-3))


# ---------------------------------------------------------------- WindowAttention function


def window_case(*, t, position, window=3, dilation=(1, 2, 3), p=0, dtype=torch.float32, ring_dtype=None, seed=0):
    """(model, feeds, expected outputs) for one window-attention call from a filled ring."""
    g = torch.Generator().manual_seed(seed)
    ring_dtype = ring_dtype or dtype
    dilation = list(dilation)
    ring = ring_length(window, dilation)
    q, k, v = rand(g, B, t, H * D, dtype=dtype), rand(g, B, t, H * D, dtype=dtype), rand(g, B, t, H * DV, dtype=dtype)
    past_k, past_v = rand(g, B, H, ring, D, dtype=ring_dtype), rand(g, B, H, ring, DV, dtype=ring_dtype)
    pk, pv = (rand(g, H, p, D, dtype=dtype), rand(g, H, p, DV, dtype=dtype)) if p else (None, None)
    position = torch.tensor(position, dtype=torch.int64)
    kw = dict(num_heads=H, window=window, dilation=dilation, persistent_key=pk, persistent_value=pv)
    expected = window_attention_prefill(q, k, v, past_k, past_v, position, **kw)
    feeds = dict(
        query=q.numpy(),
        key=k.numpy(),
        value=v.numpy(),
        past_key=past_k.numpy(),
        past_value=past_v.numpy(),
        position=position.numpy(),
        **persistent_feeds(pk, pv, B, dtype),
    )
    attrs = dict(num_heads=H, window=window, dilation=dilation, scale=D**-0.5)
    types = {torch.float32: FLOAT, torch.float16: HALF}
    ring_type = types[ring_dtype]
    outputs = {"output": (types[dtype], 3), "present_key": (ring_type, 4), "present_value": (ring_type, 4)}
    return single_node_model(WINDOW_FN, feeds, attrs, outputs), feeds, [x.numpy() for x in expected]


@pytest.mark.parametrize("p", [0, 2])
@pytest.mark.parametrize(
    "t, position",
    [
        (1, [0, 0]),  # first token of an empty stream
        (1, [4, 2]),  # mid-ring, ring not yet full
        (1, [50, 37]),  # after several wraps
        (5, [0, 3]),  # prefill from the start / mid-ring
        (6, [7, 40]),  # prefill across the wrap
        (20, [0, 23]),  # longer than the ring (L = 9): each slot written once
    ],
)
def test_window_function_matches_torch(t, position, p):
    check_both(*window_case(t=t, position=position, p=p))


def test_window_function_uniform_dilation():
    check_both(*window_case(t=4, position=[9, 2], window=4, dilation=(1, 1, 1), p=1))


def test_window_function_float16_io_and_rings_keep_their_dtype():
    half_io = dict(rtol=2e-3, atol=2e-3)
    check_both(*window_case(t=3, position=[5, 11], p=2, dtype=torch.float16), tol=half_io)
    check_both(*window_case(t=3, position=[5, 11], p=2, dtype=torch.float16, ring_dtype=torch.float32), tol=half_io)
    check_both(*window_case(t=2, position=[5, 11], dtype=torch.float32, ring_dtype=torch.float16), tol=half_io)


def test_window_function_streams_a_sequence_like_causal_banded():
    """Decode step by step in ORT from the empty ring: the outputs are causal banded attention."""
    t, window, dilation = 12, 2, [1, 2, 1]
    g = torch.Generator().manual_seed(3)
    q, k, v = rand(g, 1, t, H * D), rand(g, 1, t, H * D), rand(g, 1, t, H * DV)
    expected = banded_attention(q, k, v, num_heads=H, window=window, dilation=dilation, causal=True)
    past_k, past_v = (x.numpy() for x in init_window_state(1, H, D, window=window, dilation=dilation, value_dim=DV))
    session = None
    outputs = []
    for i in range(t):
        feeds = dict(
            query=q[:, i : i + 1].numpy(),
            key=k[:, i : i + 1].numpy(),
            value=v[:, i : i + 1].numpy(),
            past_key=past_k,
            past_value=past_v,
            position=np.array([i]),
            **persistent_feeds(None, None, 1),
        )
        if session is None:
            attrs = dict(num_heads=H, window=window, dilation=dilation, scale=D**-0.5)
            model = single_node_model(
                WINDOW_FN, feeds, attrs, {"output": (FLOAT, 3), "present_key": (FLOAT, 4), "present_value": (FLOAT, 4)}
            )
            session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        out, past_k, past_v = session.run(None, feeds)
        outputs.append(out)
    np.testing.assert_allclose(np.concatenate(outputs, 1), expected.numpy(), **TOL)


# ---------------------------------------------------------------- the functions themselves


@pytest.mark.parametrize("opset", [OPSET, 27])
def test_function_signatures(opset):
    for fn, name, inputs, outputs, attrs in (
        (
            banded_function(opset),
            BANDED,
            ["query", "key", "value", "global_mask", "persistent_key", "persistent_value"],
            ["output"],
            ["num_heads", "window", "dilation", "causal", "scale"],
        ),
        (
            window_function(opset),
            WINDOW,
            ["query", "key", "value", "past_key", "past_value", "position", "persistent_key", "persistent_value"],
            ["output", "present_key", "present_value"],
            ["num_heads", "window", "dilation", "scale"],
        ),
    ):
        assert (fn.domain, fn.name, list(fn.input), list(fn.output), list(fn.attribute)) == (
            "edgemem",
            name,
            inputs,
            outputs,
            attrs,
        )
        assert [(o.domain, o.version) for o in fn.opset_import] == [("", opset)]
        assert {n.domain for n in fn.node} == {""}
        refs = {a.ref_attr_name for n in fn.node for a in n.attribute if a.ref_attr_name}
        assert refs == set(attrs)  # every attribute is used, through a reference


def test_function_needs_opset_18():
    with pytest.raises(ValueError, match="opset >= 18"):
        banded_function(17)


def intermediate_shapes(model, feeds):
    """The shape of every value the inlined body computes (onnx.reference's intermediate results)."""
    inlined = onnx.inliner.inline_local_functions(model)
    assert not inlined.functions and all(n.domain == "" for n in inlined.graph.node)
    results = ReferenceEvaluator(inlined).run(None, feeds, intermediate=True)
    return {name: np.shape(x) for name, x in results.items() if name not in feeds}


def test_no_t_by_t_intermediate():
    """T = 256, window 4: no value of either body has two dims ≥ T. BandedAttention scores blocks of
    s = 4·3 queries against 3s keys ([B, H, 22, 12, 36]); WindowAttention gathers [B, H, T, w+1, D]."""
    t = 256
    banded = banded_case(t=t, window=4, dilation=[1, 2, 3], causal=True, globals_=[(0, 100), (7,)], p=2)
    window = window_case(t=t, position=[5, 300], window=4, p=2)
    for model, feeds, expected, blocks in ((*banded, (B, H, 22, 12, 36)), (*window, (B, H, t, 5, D))):
        shapes = intermediate_shapes(model, feeds)
        assert len(shapes) > 50
        large = {name: s for name, s in shapes.items() if sum(n >= t for n in s) >= 2}
        assert not large, large
        assert blocks in shapes.values()
        np.testing.assert_allclose(run_reference(model, feeds)[0], expected[0], **TOL)


# ---------------------------------------------------------------- export: one opaque node + the function

WINDOW_KW = dict(num_heads=H, window=3, dilation=[1, 2, 1])
BANDED_KW = dict(num_heads=H, window=2, dilation=[1, 2, 1], causal=False)


class Banded(torch.nn.Module):
    def forward(self, q, k, v, mask):
        return banded_attention(q, k, v, **BANDED_KW, global_mask=mask)


class Window(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.pk, self.pv = torch.nn.Parameter(rand(g, H, 2, D)), torch.nn.Parameter(rand(g, H, 2, DV))

    def forward(self, q, k, v, past_k, past_v, position):
        return window_attention_prefill(
            q, k, v, past_k, past_v, position, **WINDOW_KW, persistent_key=self.pk, persistent_value=self.pv
        )


def banded_inputs(g, b, t, globals_):
    mask = torch.zeros(b, t, dtype=torch.bool)
    for row, positions in enumerate(globals_):
        mask[row, list(positions)] = True
    return rand(g, b, t, H * D), rand(g, b, t, H * D), rand(g, b, t, H * DV), mask


def window_inputs(g, b, t, position):
    ring = ring_length(WINDOW_KW["window"], WINDOW_KW["dilation"])
    q, k, v = rand(g, b, t, H * D), rand(g, b, t, H * D), rand(g, b, t, H * DV)
    past_k, past_v = rand(g, b, H, ring, D), rand(g, b, H, ring, DV)
    return q, k, v, past_k, past_v, torch.tensor(position, dtype=torch.int64)


def export(module, args, dynamic_shapes, function):
    """torch.onnx.export (dynamo, opset 20), then attach the function: (model, the edgemem node)."""
    model = torch.onnx.export(
        module.eval(), args, dynamo=True, opset_version=OPSET, dynamic_shapes=dynamic_shapes, verbose=False
    ).model_proto
    nodes = [n for n in model.graph.node if n.domain == "edgemem"]
    assert len(nodes) == 1 and nodes[0].op_type == function.name
    assert not model.functions  # the exporter keeps the node opaque and attaches nothing
    model.functions.append(function)
    if not any(o.domain == "edgemem" for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, VERSION))
    return model, nodes[0]


@pytest.fixture(scope="module")
def exported():
    """Both ops exported once with dynamic batch and time: name → (module, model, edgemem node)."""
    g = torch.Generator().manual_seed(2)
    batch, time = torch.export.Dim("batch"), torch.export.Dim("time")
    bt = {0: batch, 1: time}
    banded, window = Banded(), Window()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's notes on shared dims and deprecations
        banded_model = export(banded, banded_inputs(g, 2, 6, [(1,), ()]), [bt] * 4, banded_function(OPSET))
        window_dims = [bt] * 3 + [{0: batch}] * 3
        window_model = export(window, window_inputs(g, 2, 5, [0, 7]), window_dims, window_function(OPSET))
    return dict(banded=(banded, *banded_model), window=(window, *window_model))


def attributes(node):
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def test_export_banded_attention(exported):
    module, model, node = exported["banded"]
    assert attributes(node) == dict(num_heads=H, window=2, dilation=[1, 2, 1], causal=0, scale=pytest.approx(D**-0.5))
    assert len(node.input) == 6  # defaults materialised: empty persistent K/V
    g = torch.Generator().manual_seed(3)
    args = banded_inputs(g, 3, 11, [(0, 4), (), (10,)])  # another batch and length
    names = [i.name for i in model.graph.input]
    (got,) = run_onnxruntime(model, dict(zip(names, (x.numpy() for x in args), strict=True)))
    np.testing.assert_allclose(got, module(*args).numpy(), **TOL)


def test_export_window_attention(exported):
    module, model, node = exported["window"]
    assert attributes(node) == dict(num_heads=H, window=3, dilation=[1, 2, 1], scale=pytest.approx(D**-0.5))
    assert len(node.input) == 8
    names = [i.name for i in model.graph.input]
    assert names[-1] == "position"  # a graph input, not a constant
    g = torch.Generator().manual_seed(4)
    for t, position in ((1, [0, 13, 6]), (8, [2, 0, 29])):  # a step and a prefill at batch 3
        args = window_inputs(g, 3, t, position)
        got = run_onnxruntime(model, dict(zip(names, (x.numpy() for x in args), strict=True)))
        with torch.no_grad():
            expected = module(*args)
        for a, e in zip(got, expected, strict=True):
            np.testing.assert_allclose(a, e.numpy(), **TOL)


def test_full_check_in_a_fresh_process(tmp_path, exported):
    """onnx.checker with full_check (body opset = model opset) on single-node and exported models,
    in a process that never registered an edgemem schema."""
    models = dict(
        banded=banded_case(t=5, window=2, dilation=[1, 2, 3], causal=True, globals_=[(1,), ()], p=1)[0],
        window=window_case(t=2, position=[3, 9], p=1)[0],
        banded_export=exported["banded"][1],
        window_export=exported["window"][1],
    )
    paths = []
    for name, model in models.items():
        paths.append(str(tmp_path / f"{name}.onnx"))
        onnx.save(model, paths[-1])
    code = "import sys, onnx\nfor p in sys.argv[1:]:\n    onnx.checker.check_model(p, full_check=True)\n"
    done = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
