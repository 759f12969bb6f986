"""The ONNX side of NeuralMemory: the local function equals the torch op in onnxruntime and
onnx.reference, and the exporter writes one `edgemem::NeuralMemory` node it can run."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto
from onnx_helpers import OPSET, run_onnxruntime, run_reference, single_node_model
from torch import nn

from edgemem.ops.neural_memory import ATTRIBUTES, INPUTS, OP_TYPE, OUTPUTS, neural_memory, neural_memory_step
from edgemem.ops.neural_memory.onnx import function
from edgemem.opset import DOMAIN, VERSION

FUNCTION = function(OPSET)
RUNTIMES = {"onnxruntime": run_onnxruntime, "reference": run_reference}
TOL = dict(rtol=1e-4, atol=1e-5)
H, D, E = 2, 8, 12


def make_case(depth, t, *, residual_norm, position=(0, 5, 2), seed=0, dtype=np.float32):
    """Inputs for one node call. Rows sit at `position` (per row, or shared when one value);
    the gates of row 1 (η, α) are zero, as in TTT, the others not."""
    rng = np.random.default_rng(seed)
    b = 3
    e = E if depth == 2 else D
    q, k, v = (rng.standard_normal((b, t, H * D)) * s for s in (1.0, 0.5, 1.0))
    theta = 0.2 * rng.random((b, t, H))
    eta, alpha = rng.random((b, t, H)), 0.3 * rng.random((b, t, H))
    eta[1] = alpha[1] = 0
    shapes = [(b, H, D, e), (b, H, e, D)][:depth]
    layers = [[rng.standard_normal(s) * scale for scale in (0.5, 0.1, 0.5)] for s in shapes]
    gamma, beta = (1 + 0.5 * rng.standard_normal((H, D)), 0.3 * rng.standard_normal((H, D)))
    if not residual_norm:
        gamma, beta = np.ones((H, D)), np.zeros((H, D))
    second = layers[1] if depth == 2 else layers[0]  # depth 1: the first layer's tensors again
    values = [q, k, v, theta, eta, alpha, np.array(position, np.int64), gamma, beta, *layers[0], *second]
    feeds = {
        n: (x if n == "position" else x.astype(dtype if i < 6 else np.float32))
        for i, (n, x) in enumerate(zip(INPUTS, values))
    }
    return feeds


def torch_op(feeds, depth, attrs, dtype=torch.float64):
    """The torch op on the same values, q/k/v/gates in `dtype` (float64 by default: the exact
    result; the state and γ, β then too, else they stay float32); outputs in node order."""
    x = {n: torch.from_numpy(a) for n, a in feeds.items()}
    cast = lambda t: t.to(torch.float64 if dtype == torch.float64 else torch.float32)  # noqa: E731
    state = [[cast(x[f"{kind}_{i + 1}"]) for i in range(depth)] for kind in ("weights", "momentum", "chunk_weights")]
    norm = dict(norm_weight=cast(x["norm_weight"]), norm_bias=cast(x["norm_bias"])) if attrs["residual_norm"] else {}
    y, w, s, wc, end = neural_memory_step(
        *(x[n].to(dtype) for n in INPUTS[:6]), *state, x["position"],
        num_heads=attrs["num_heads"], chunk_size=attrs["chunk_size"], activation=attrs["activation"], **norm,
    )  # fmt: skip
    state_out = [t for i in range(depth) for t in (w[i], s[i], wc[i])]
    return [y, end, *state_out]


def node_model(feeds, attrs):
    outputs = {"output": (TensorProto.FLOAT, 3), "present_position": (TensorProto.INT64, 1)}
    outputs.update({n: (TensorProto.FLOAT, 4) for n in OUTPUTS[2:]})
    if feeds["query"].dtype == np.float16:
        outputs["output"] = (TensorProto.FLOAT16, 3)
    return single_node_model(FUNCTION, feeds, attrs, outputs)


def check(got, want, depth, tol=TOL):
    """Node outputs vs the torch op's: y, position, then the state of each layer."""
    assert len(got) == len(OUTPUTS)
    for name, g, w in zip(OUTPUTS, got[: 2 + 3 * depth], want):
        w = w.detach().numpy()
        assert g.shape == w.shape and (g.dtype == w.dtype or name != "present_position"), name
        np.testing.assert_allclose(g, w, **tol, err_msg=name)


ACTIVATIONS = ["silu", "gelu", "relu", "identity"]
# depth 2: every activation with the norm on and off, at T = 1 and T = 6, chunk 1 or 4;
# depth 1 (no activation): every chunk size, length and norm setting.
CASES = [(2, a, n, t, 4 if (i + n + t) % 2 else 1) for i, a in enumerate(ACTIVATIONS) for n in (0, 1) for t in (1, 6)]
CASES += [(1, "silu", n, t, c) for n in (0, 1) for t in (1, 6) for c in (1, 4)]


@pytest.mark.parametrize("runtime", list(RUNTIMES))
@pytest.mark.parametrize(("depth", "activation", "residual_norm", "t", "chunk_size"), CASES)
def test_function_matches_torch_op(depth, activation, residual_norm, t, chunk_size, runtime):
    """Rows at position 0, mid-chunk and another offset; zero and non-zero momentum/forgetting."""
    attrs = dict(num_heads=H, chunk_size=chunk_size, depth=depth, residual_norm=residual_norm, activation=activation)
    feeds = make_case(depth, t, residual_norm=residual_norm, seed=t + chunk_size)
    got = RUNTIMES[runtime](node_model(feeds, attrs), feeds)
    check(got, torch_op(feeds, depth, attrs), depth)


@pytest.mark.parametrize("position", [(0,), (3,)])
@pytest.mark.parametrize("runtime", list(RUNTIMES))
def test_function_with_a_shared_position(position, runtime):
    """position `[1]` (every row at the same place), at the start of a chunk and inside one."""
    attrs = dict(num_heads=H, chunk_size=4, depth=2, residual_norm=1, activation="gelu")
    feeds = make_case(2, 6, residual_norm=True, position=position, seed=4)
    got = RUNTIMES[runtime](node_model(feeds, attrs), feeds)
    assert got[1].tolist() == [position[0] + 6]
    check(got, torch_op(feeds, 2, attrs), 2)


def test_function_with_no_tokens_passes_the_state_on():
    """T = 0 (onnxruntime; onnx.reference's Loop cannot return empty scan outputs)."""
    attrs = dict(num_heads=H, chunk_size=4, depth=2, residual_norm=1, activation="gelu")
    feeds = make_case(2, 0, residual_norm=True)
    got = run_onnxruntime(node_model(feeds, attrs), feeds)
    assert got[0].shape == (3, 0, H * D)
    check(got, torch_op(feeds, 2, attrs), 2)


def test_function_takes_float16_and_answers_in_float16():
    """float16 q/k/v/gates compute in float32 (state float32), output in float16, like the op."""
    attrs = dict(num_heads=H, chunk_size=4, depth=2, residual_norm=1, activation="silu")
    feeds = make_case(2, 6, residual_norm=True, seed=5, dtype=np.float16)
    got = run_onnxruntime(node_model(feeds, attrs), feeds)
    want = torch_op(feeds, 2, attrs, dtype=torch.float16)
    assert got[0].dtype == np.float16 and all(g.dtype == np.float32 for g in got[2:])
    np.testing.assert_allclose(got[0].astype(np.float32), want[0].float().numpy(), rtol=2e-3, atol=2e-3)
    assert got[1].tolist() == want[1].tolist()
    for name, g, w in zip(OUTPUTS[2:], got[2:], want[2:]):
        np.testing.assert_allclose(g, w.numpy(), **TOL, err_msg=name)


def test_function_proto_contract():
    assert (FUNCTION.domain, FUNCTION.name) == (DOMAIN, OP_TYPE) == ("edgemem", "NeuralMemory")
    assert list(FUNCTION.input) == list(INPUTS) and list(FUNCTION.output) == list(OUTPUTS)
    declared = set(FUNCTION.attribute) | {a.name for a in FUNCTION.attribute_proto}
    assert declared == set(ATTRIBUTES)
    assert [(o.domain, o.version) for o in FUNCTION.opset_import] == [("", OPSET)]

    def nodes(graph_nodes):
        for node in graph_nodes:
            yield node
            for a in node.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    yield from nodes(a.g.node)

    body = list(nodes(FUNCTION.node))
    assert {n.domain for n in body} == {""}
    refs = {a.ref_attr_name for n in body for a in n.attribute if a.ref_attr_name}
    assert refs == set(ATTRIBUTES)
    assert function(27).opset_import[0].version == 27
    with pytest.raises(ValueError, match="opset >= 20"):
        function(19)


class TinyMemory(nn.Module):
    """Two memories on one input: `neural_memory_step` (depth 2, GELU, the residual norm, chunk 4,
    streaming state) and `neural_memory` (depth 1, no norm, chunk 3, no position or chunk weights)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(H * D, 6 * H * D)
        self.gates = nn.Linear(H * D, 6 * H)
        self.gamma = nn.Parameter(1 + 0.2 * torch.randn(H, D))
        self.beta = nn.Parameter(0.2 * torch.randn(H, D))

    def forward(self, x, position, w1, w2, s1, s2, wc1, wc2, linear_w, linear_s):
        q, k, v, q_lin, k_lin, v_lin = self.proj(x).chunk(6, -1)
        theta, eta, alpha, *linear_gates = (0.2 * torch.sigmoid(self.gates(x))).chunk(6, -1)
        y, w, s, wc, end = neural_memory_step(
            q, k, v, theta, 5 * eta, alpha, (w1, w2), (s1, s2), (wc1, wc2), position,
            num_heads=H, chunk_size=4, activation="gelu", norm_weight=self.gamma, norm_bias=self.beta,
        )  # fmt: skip
        y_lin, (w_lin,), (s_lin,) = neural_memory(
            q_lin, k_lin, v_lin, *linear_gates, (linear_w,), (linear_s,), num_heads=H, chunk_size=3
        )
        return y, end, *w, *s, *wc, y_lin, w_lin, s_lin

    @staticmethod
    def example(b, t, seed):
        g = torch.Generator().manual_seed(seed)
        shapes = [(b, H, D, E), (b, H, E, D)]
        state = [torch.randn(*s, generator=g) * scale for scale in (0.4, 0.1, 0.4) for s in shapes]
        position = torch.arange(b, dtype=torch.int64) * 3 + 1  # rows at different offsets
        linear = [torch.randn(b, H, D, D, generator=g) * scale for scale in (0.3, 0.1)]
        return (torch.randn(b, t, H * D, generator=g), position, *state, *linear)


def test_export_emits_one_node_per_call_that_runs(tmp_path):
    """dynamo export at opset 20 with dynamic batch and length: one opaque node per op call and
    no local function; with `function(20)` attached, onnxruntime reproduces eager at another
    batch and length and at T = 1, and the full checker passes in a fresh process."""
    module = TinyMemory().eval()
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    args = module.example(2, 5, seed=0)
    dynamic = ({0: batch, 1: seq}, *[{0: batch}] * (len(args) - 1))
    model = torch.onnx.export(module, args, dynamo=True, opset_version=OPSET, dynamic_shapes=dynamic).model_proto
    nodes = [n for n in model.graph.node if n.domain == DOMAIN]
    assert [n.op_type for n in nodes] == [OP_TYPE, OP_TYPE] and len(model.functions) == 0
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in nodes]
    assert attrs == [
        dict(num_heads=H, chunk_size=4, depth=2, residual_norm=1, activation=b"gelu"),
        dict(num_heads=H, chunk_size=3, depth=1, residual_norm=0, activation=b"silu"),
    ]
    assert all(len(n.input) == len(INPUTS) and len(n.output) == len(OUTPUTS) for n in nodes)

    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, VERSION))
    model.functions.append(function(OPSET))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for b, t in ((3, 7), (1, 1)):  # another batch and length; the decode step
        args = module.example(b, t, seed=b + t)
        got = session.run(None, {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)})
        with torch.no_grad():
            want = module(*args)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w.numpy(), **TOL)

    path = tmp_path / "memories.onnx"
    onnx.save(model, path)
    code = "import onnx, sys; onnx.checker.check_model(onnx.load(sys.argv[1]), full_check=True)"
    subprocess.run([sys.executable, "-c", code, str(path)], check=True)  # no schema registered there
