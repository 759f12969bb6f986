"""Delta RNN, LiZA and `linearize`: the protocol law, independent token-by-token references in
float64, constant state, causality, export with a Scan in the Delta RNN prefill graph, verify and
runtime streaming, and a short training run on a linearized softmax model."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
import torch

from edgemem.errors import ConfigError
from edgemem.layers import DeltaRNN, LiZA
from edgemem.models import build, linearize, state_bytes
from edgemem.ops.linear_attention import UPDATE_RULES

from test_protocol import TOLERANCE, run_pieces, split_points

LAYERS = {
    "delta-rnn": lambda: DeltaRNN(32, 4),
    "liza": lambda: LiZA(32, 4, window=5),
    "liza-delta-persistent": lambda: LiZA(32, 4, window=3, update_rule="delta", persistent=2),
}


def _linearized(dtype: torch.dtype = torch.float32, **options) -> torch.nn.Module:
    return linearize(build("softmax", seed=0, d_model=32, mlp_hidden=48), window=6, **options).to(dtype)


@pytest.mark.parametrize("name", LAYERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", [0, 1])
def test_layer_forward_equals_prefill_and_steps_at_random_splits(name, dtype, seed):
    torch.manual_seed(seed)
    layer = LAYERS[name]().to(dtype)
    x = torch.randn(2, 23, 32, dtype=dtype)
    with torch.no_grad():
        expected = layer(x)
        got, state = run_pieces(layer, x, layer.init_state(2), split_points(23, seed))
        _, whole = layer.prefill(x, layer.init_state(2))
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    for key in whole:
        torch.testing.assert_close(state[key], whole[key], **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_linearized_softmax_forward_equals_prefill_and_steps(dtype):
    model = _linearized(dtype)
    tokens = torch.randint(0, 256, (2, 27), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(tokens)
        got, _ = run_pieces(model, tokens, model.init_state(2), split_points(27, seed=5))
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("model", ["delta-rnn", "liza", "linearized"])
def test_state_bytes_are_constant_and_the_model_is_causal(model):
    model = _linearized() if model == "linearized" else build(model, seed=0, d_model=32, mlp_hidden=32)
    state = model.init_state(1)
    sizes = {state_bytes(state)}
    with torch.no_grad():
        for chunk in (1, 9, 70):
            _, state = model.prefill(torch.zeros(1, chunk, dtype=torch.long), state)
            sizes.add(state_bytes(state))
        model = model.double()
        tokens = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(0))
        changed = tokens.clone()
        changed[0, 17] = (changed[0, 17] + 1) % 256
        diff = (model(tokens) - model(changed)).abs().amax(-1)[0]
    assert len(sizes) == 1 and sizes.pop() > 0
    assert diff[:17].max() == 0 and diff[17] > 0


def _softmax(z: torch.Tensor) -> torch.Tensor:
    e = torch.exp(z - z.max(-1, keepdim=True).values)
    return e / e.sum(-1, keepdim=True)


def _rms(y: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return y / torch.sqrt((y * y).mean(-1, keepdim=True) + eps) * weight


def delta_rnn_reference(layer: DeltaRNN, x: torch.Tensor) -> torch.Tensor:
    """The paper's equations one token at a time, fast weights as [D_v, D_k] matrices (W φ(k))."""
    b, t, _ = x.shape
    h, d = layer.num_heads, layer.head_dim
    fast = torch.zeros(b, h, d, d, dtype=x.dtype)
    recurrent = torch.zeros(b, h, d, d, dtype=x.dtype)
    previous = torch.zeros(b, h, d, dtype=x.dtype)
    outputs = []
    for i in range(t):
        q, k, v, r, u = (x[:, i] @ layer.proj.weight.T).reshape(b, 5, h, d).unbind(1)
        rates = 1 / (1 + torch.exp(-(x[:, i] @ layer.rates.weight.T)))
        beta, gamma = rates[:, :h, None, None], rates[:, h:, None, None]
        fk, fr = _softmax(k), _softmax(r)
        fast = fast + beta * (v - (fast @ fk[..., None])[..., 0])[..., :, None] * fk[..., None, :]
        recurrent = recurrent + gamma * (u - (recurrent @ fr[..., None])[..., 0])[..., :, None] * fr[..., None, :]
        y = (fast @ _softmax(q)[..., None])[..., 0] + (recurrent @ _softmax(previous)[..., None])[..., 0]
        previous = y
        outputs.append(_rms(y, layer.norm.weight).reshape(b, -1) @ layer.out.weight.T)
    return torch.stack(outputs, 1)


def _rope(x: torch.Tensor, position: int) -> torch.Tensor:
    """Rotate-half RoPE of one position, x `[..., D]`."""
    half = x.shape[-1] // 2
    angle = position * 10000.0 ** (-torch.arange(half, dtype=x.dtype) / half)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()], -1)


def liza_reference(layer: LiZA, x: torch.Tensor) -> torch.Tensor:
    """Per token: softmax over the rotated keys of the window (and persistent slots), the linear
    state updated by its rule, the two mixed by the gate."""
    b, t, _ = x.shape
    h, d, rule = layer.num_heads, layer.head_dim, layer.update_rule
    keys, values, outputs = [], [], []
    memory = torch.zeros(b, h, d, d, dtype=x.dtype)
    for i in range(t):
        xi = x[:, i]
        q, k, v = (xi @ layer.qkv.weight.T).reshape(b, 3, h, d).unbind(1)
        keys.append(_rope(k, i))
        values.append(v)
        seen_k, seen_v = torch.stack(keys[-layer.window - 1 :], 2), torch.stack(values[-layer.window - 1 :], 2)
        if layer.persistent_key is not None:
            seen_k = torch.cat([layer.persistent_key.expand(b, -1, -1, -1), seen_k], 2)
            seen_v = torch.cat([layer.persistent_value.expand(b, -1, -1, -1), seen_v], 2)
        scores = torch.einsum("bhd,bhnd->bhn", _rope(q, i), seen_k) / math.sqrt(d)
        window = torch.einsum("bhn,bhnd->bhd", _softmax(scores), seen_v)
        qn, kn = (z / torch.sqrt((z * z).sum(-1, keepdim=True) + 1e-6) for z in (q, k))
        if rule.startswith("gated"):
            forget = 1 / (1 + torch.exp(-(xi @ layer.decay.weight.T + layer.decay.bias)))
            memory = memory * forget[..., None, None]
        if "delta" in rule:
            beta = 1 / (1 + torch.exp(-(xi @ layer.beta.weight.T)))
            v = beta[..., None] * (v - torch.einsum("bhkv,bhk->bhv", memory, kn))
        memory = memory + kn[..., :, None] * v[..., None, :]
        linear = torch.einsum("bhkv,bhk->bhv", memory, qn) / math.sqrt(d)
        alpha = 1 / (1 + torch.exp(-(xi @ layer.gate.weight.T + layer.gate.bias)))[..., None]
        outputs.append(((1 - alpha) * window + alpha * linear).reshape(b, -1) @ layer.out.weight.T)
    return torch.stack(outputs, 1)


def test_delta_rnn_matches_a_token_by_token_reference():
    torch.manual_seed(0)
    layer = DeltaRNN(32, 4).double()
    x = torch.randn(2, 19, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), delta_rnn_reference(layer, x), rtol=1e-10, atol=1e-12)


def test_delta_rnn_read_depends_on_the_previous_output():
    """The recurrent fast weight makes the layer differ from its W part alone (R's read is not zero)."""
    torch.manual_seed(0)
    layer = DeltaRNN(32, 4).double()
    x = torch.randn(1, 12, 32, dtype=torch.float64)
    with torch.no_grad():
        full = layer(x)
        layer.proj.weight[4 * 32 :] = 0  # u = 0: R stays zero
        assert (full - layer(x)).abs().max() > 1e-3


@pytest.mark.parametrize("rule", UPDATE_RULES)
def test_liza_matches_a_token_by_token_reference(rule):
    torch.manual_seed(1)
    layer = LiZA(32, 4, window=4, update_rule=rule, persistent=2).double()
    torch.nn.init.normal_(layer.gate.weight, std=0.3)  # an input-dependent gate, not the initial constant
    x = torch.randn(2, 17, 32, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), liza_reference(layer, x), rtol=1e-10, atol=1e-12)


def test_linearize_keeps_every_weight_and_with_the_gate_shut_equals_the_softmax_model():
    softmax = build("softmax", seed=0, d_model=32, mlp_hidden=48).double()
    model = linearize(softmax, window=40)
    original = softmax.state_dict()
    for name, value in model.state_dict().items():
        if name in original:
            assert torch.equal(value, original[name]), name
    for block in model.blocks:
        block.mixer.gate.bias.data.fill_(-math.inf)  # α = 0: softmax branch only
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), softmax(tokens), rtol=1e-10, atol=1e-12)
        assert not torch.allclose(linearize(softmax, window=40)(tokens), softmax(tokens))


def test_linearize_refuses_a_model_without_softmax_attention():
    with pytest.raises(ConfigError, match="mixer is 'deltanet'"):
        linearize(build("deltanet", seed=0, d_model=32, mlp_hidden=32))
    with pytest.raises(ConfigError, match="update_rule must be one of"):
        linearize(build("softmax", seed=0, d_model=32, mlp_hidden=32), update_rule="ssm")


def test_a_linearized_softmax_model_trains_on_a_task():
    from edgemem.train import train

    model = _linearized()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    result = train(model, "copy", steps=4, batch=4, length=32, progress=False, task_params={"tokens": 4})
    assert len(result.losses) == 4 and all(math.isfinite(x) for x in result.losses)
    assert (result.model.config.arch, result.model.config.mixer) == ("softmax-linearized", "liza")
    assert all(not torch.equal(p, before[n]) for n, p in result.model.named_parameters())


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    from edgemem.export import export

    out = {}
    for arch in ("delta-rnn", "liza"):
        out[arch] = tmp_path_factory.mktemp(arch)
        model = build(arch, seed=0, d_model=32, n_layers=1, mlp_hidden=32)
        export(model, out[arch], targets=["generic", "ort"], force=True, extra_config={"seed": 0})
    return out


def test_delta_rnn_prefill_graph_loops_over_tokens_in_a_scan(exports):
    graph = onnx.load(exports["delta-rnn"] / "generic" / "prefill.onnx").graph
    assert [n.op_type for n in graph.node if n.op_type in ("Scan", "Loop")] == ["Scan"]
    assert graph.input[0].type.tensor_type.shape.dim[1].dim_param  # any prompt length
    step = onnx.load(exports["delta-rnn"] / "generic" / "step.onnx").graph
    assert not [n for n in step.node if n.op_type in ("Scan", "Loop")]  # one token needs no loop


@pytest.mark.parametrize("arch", ["delta-rnn", "liza"])
def test_export_verifies_and_streams_in_the_runtime(exports, arch):
    from edgemem.export.verify import verify
    from edgemem.runtime import Engine

    checks, skipped = verify(exports[arch], threads=1)
    assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]
    assert {c.target for c in checks} == {"generic", "ort"} and not skipped
    model = build(arch, seed=0, d_model=32, n_layers=1, mlp_hidden=32).eval()
    tokens = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(tokens)[0].numpy()
    stream = Engine.load(exports[arch], threads=1).new_stream()
    got = [stream.prefill(tokens[0, :13].tolist(), chunk_size=5)] + [stream.step(int(t))[None] for t in tokens[0, 13:]]
    np.testing.assert_allclose(np.concatenate(got), expected, rtol=1e-4, atol=1e-4)


def test_a_linearized_checkpoint_exports_verifies_and_streams(tmp_path):
    """A softmax model, linearized, streams from the runtime in constant memory: its state is the
    window ring buffer and the linear state, and the export matches PyTorch."""
    from edgemem.export import export
    from edgemem.export.verify import verify
    from edgemem.models import save_checkpoint
    from edgemem.runtime import Engine

    model = linearize(build("softmax", seed=0, d_model=32, n_layers=1, mlp_hidden=32), window=8).eval()
    checkpoint = tmp_path / "model.safetensors"
    save_checkpoint(model, checkpoint)
    manifest = export(model, tmp_path / "out", targets=["generic"], extra_config={"checkpoint": str(checkpoint)})
    assert manifest.arch == "softmax-linearized" and all("past_sequence" not in s.shape for s in manifest.state)
    checks, _ = verify(tmp_path / "out", threads=1)
    assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]
    tokens = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = model(tokens)[0].numpy()
    stream = Engine.load(tmp_path / "out", threads=1).new_stream()
    got = [stream.prefill(tokens[0, :10].tolist())] + [stream.step(int(t))[None] for t in tokens[0, 10:]]
    np.testing.assert_allclose(np.concatenate(got), expected, rtol=1e-4, atol=1e-4)


def test_train_refuses_overrides_for_a_given_model():
    from edgemem.train import train

    with pytest.raises(ConfigError, match="trained as it is"):
        train(_linearized(), "copy", steps=1, overrides={"d_model": 64}, progress=False)
