"""Delta RNN, LiZA and `linearize`: the protocol law, independent token-by-token references in
float64, constant state, causality, export with a Scan in the Delta RNN prefill graph, verify and
runtime streaming, and a short training run on a linearized softmax model."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
import torch
from test_protocol import TOLERANCE, run_pieces, split_points

from edgemem.errors import ConfigError
from edgemem.layers import DeltaRNN, LiZA
from edgemem.models import build, linearize, state_bytes
from edgemem.ops.linear_attention import UPDATE_RULES

LAYERS = {
    "delta-rnn": lambda: DeltaRNN(32, 4),
    "liza": lambda: LiZA(32, 4, window=5),
    "liza-gqa-gated-output": lambda: LiZA(
        32, 4, window=5, num_kv_heads=2, qk_norm=True, rotary_dim=4, output_gate=True
    ),
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


def _rope(x: torch.Tensor, position: int, theta: float = 10000.0, rotary: int | None = None) -> torch.Tensor:
    """Rotate-half RoPE of one position on the first `rotary` channels, x `[..., D]`."""
    rotary = rotary or x.shape[-1]
    half = rotary // 2
    angle = position * theta ** (-torch.arange(half, dtype=x.dtype) / half)
    x1, x2, rest = x[..., :half], x[..., half:rotary], x[..., rotary:]
    return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin(), rest], -1)


def _head_norm(x: torch.Tensor, norm: torch.nn.Module | None) -> torch.Tensor:
    """RMSNorm over the head channels with the norm's weight (scale 1 + w for the offset form)."""
    if norm is None:
        return x
    scale = norm.weight + (1.0 if type(norm).__name__ == "OffsetRMSNorm" else 0.0)
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + norm.eps) * scale


def liza_reference(layer: LiZA, x: torch.Tensor) -> torch.Tensor:
    """Per token: softmax over the rotated keys of the window (and persistent slots), the linear
    state (one per K/V head) updated by its rule, the two mixed by the gate, then the output gate."""
    b, t, _ = x.shape
    h, hk, d, rule = layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.update_rule
    group, rotary, theta = h // hk, layer.rotary_dim, layer.rope_theta
    keys, values, outputs = [], [], []
    memory = torch.zeros(b, hk, d, d, dtype=x.dtype)
    for i in range(t):
        xi = x[:, i]
        projected = xi @ layer.qkv.weight.T
        q_width = h * d * (2 if layer.output_gate else 1)
        q, k, v = projected[:, :q_width], projected[:, q_width : q_width + hk * d], projected[:, q_width + hk * d :]
        gate = None
        if layer.output_gate:  # per head: d query channels, then d gate channels
            q, gate = q.reshape(b, h, 2, d)[:, :, 0], q.reshape(b, h, 2, d)[:, :, 1].reshape(b, h * d)
        q, k, v = (
            _head_norm(q.reshape(b, h, d), layer.q_norm),
            _head_norm(k.reshape(b, hk, d), layer.k_norm),
            v.reshape(b, hk, d),
        )
        keys.append(_rope(k, i, theta, rotary).repeat_interleave(group, 1))
        values.append(v.repeat_interleave(group, 1))
        seen_k, seen_v = torch.stack(keys[-layer.window - 1 :], 2), torch.stack(values[-layer.window - 1 :], 2)
        if layer.persistent_key is not None:
            seen_k = torch.cat([layer.persistent_key.expand(b, -1, -1, -1), seen_k], 2)
            seen_v = torch.cat([layer.persistent_value.expand(b, -1, -1, -1), seen_v], 2)
        scores = torch.einsum("bhd,bhnd->bhn", _rope(q, i, theta, rotary), seen_k) / math.sqrt(d)
        window = torch.einsum("bhn,bhnd->bhd", _softmax(scores), seen_v)
        qn, kn = (z / torch.sqrt((z * z).sum(-1, keepdim=True) + 1e-6) for z in (q, k))
        if rule.startswith("gated"):
            forget = 1 / (1 + torch.exp(-(xi @ layer.decay.weight.T + layer.decay.bias)))
            memory = memory * forget[..., None, None]
        if "delta" in rule:
            beta = 1 / (1 + torch.exp(-(xi @ layer.beta.weight.T)))
            v = beta[..., None] * (v - torch.einsum("bhkv,bhk->bhv", memory, kn))
        memory = memory + kn[..., :, None] * v[..., None, :]
        linear = torch.einsum("bhkv,bhk->bhv", memory.repeat_interleave(group, 1), qn) / math.sqrt(d)
        alpha = 1 / (1 + torch.exp(-(xi @ layer.gate.weight.T + layer.gate.bias)))[..., None]
        y = ((1 - alpha) * window + alpha * linear).reshape(b, -1)
        if gate is not None:
            y = y / (1 + torch.exp(-gate))
        outputs.append(y @ layer.out.weight.T)
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


PROJECTIONS = {  # the options of the attention layers LiZA replaces (imported hybrids use all of them)
    "plain": {},
    "gqa-qknorm-partial-rope-gate": dict(
        num_kv_heads=2,
        head_dim=12,
        qk_norm=True,
        norm_unit_offset=True,
        rotary_dim=4,
        rope_theta=500.0,
        output_gate=True,
    ),
}


@pytest.mark.parametrize("projections", list(PROJECTIONS))
@pytest.mark.parametrize("rule", UPDATE_RULES)
def test_liza_matches_a_token_by_token_reference(rule, projections):
    torch.manual_seed(1)
    layer = LiZA(32, 4, window=4, update_rule=rule, persistent=2, **PROJECTIONS[projections]).double()
    for name, p in layer.named_parameters():
        if "norm" in name:
            torch.nn.init.normal_(p, std=0.3)
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
    with pytest.raises(ConfigError, match="deltanet has none"):
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


def _qwen3_5_hybrid(path):
    """A tiny random Qwen3.5 text model (gated DeltaNet + full attention with GQA, q/k norms, partial
    RoPE and an output gate), saved as transformers saves it."""
    from test_hf_qwen3_5 import randomise, save, text_config
    from transformers import Qwen3_5ForCausalLM

    layers = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    hf = randomise(Qwen3_5ForCausalLM(text_config(layers)), seed=7)
    return hf, save(hf, path)


def test_a_linearized_qwen3_5_hybrid_with_the_gate_shut_equals_transformers(tmp_path):
    """Only the full-attention layers become LiZA; with α = 0 and a window longer than the input, the
    linearized model is transformers' Qwen3.5 exactly (its q/k/v/o weights, norms, gate kept)."""
    from edgemem.models import from_hf

    hf, path = _qwen3_5_hybrid(tmp_path)
    model = linearize(from_hf(path), window=32)
    assert model.config.layer_types == ["gated_deltanet", "liza", "gated_deltanet", "liza"]
    tokens = torch.randint(0, hf.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
        mixed = model(tokens)
        for block in model.blocks:
            if isinstance(block.mixer, LiZA):
                block.mixer.gate.bias.fill_(-math.inf)
        torch.testing.assert_close(model(tokens), expected, rtol=1e-4, atol=1e-4)
    assert (mixed - expected).abs().max() > 1e-3  # the linear branch is really mixed in by default


def test_a_linearized_hybrid_streams_in_constant_memory_at_random_splits(tmp_path):
    from edgemem.models import from_hf

    _, path = _qwen3_5_hybrid(tmp_path)
    model = linearize(from_hf(path), window=5).double()
    tokens = torch.randint(0, 61, (2, 26), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(tokens)
        got, state = run_pieces(model, tokens, model.init_state(2), split_points(26, seed=3))
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float64])
    assert state_bytes(state) == state_bytes(model.init_state(2))


def test_linearize_and_fine_tune_from_the_command_line(tmp_path):
    """`edgemem linearize` → `edgemem train --init` → `edgemem export --checkpoint` → `verify`."""
    from click.testing import CliRunner

    from edgemem.cli import main
    from edgemem.models import load_checkpoint, save_checkpoint

    save_checkpoint(build("softmax", seed=0, d_model=32, n_layers=1, mlp_hidden=32), tmp_path / "softmax.safetensors")
    runner = CliRunner()
    run = lambda *args: runner.invoke(main, [str(a) for a in args])  # noqa: E731
    done = run(
        "linearize",
        "--checkpoint",
        tmp_path / "softmax.safetensors",
        "--out",
        tmp_path / "liza.safetensors",
        "--window",
        8,
    )
    assert done.exit_code == 0, done.output
    assert "1 of 1 layers now LiZA" in done.output
    done = run(
        "train",
        "--init",
        tmp_path / "liza.safetensors",
        "--task",
        "copy",
        "--steps",
        3,
        "--batch",
        4,
        "--task-set",
        "tokens=4",
        "--out",
        tmp_path / "tuned.safetensors",
    )
    assert done.exit_code == 0, done.output
    before, after = load_checkpoint(tmp_path / "liza.safetensors"), load_checkpoint(tmp_path / "tuned.safetensors")
    assert after.config == before.config and not torch.equal(
        after.blocks[0].mixer.gate.bias, before.blocks[0].mixer.gate.bias
    )
    done = run(
        "export", "--checkpoint", tmp_path / "tuned.safetensors", "--out", tmp_path / "out", "--target", "generic"
    )
    assert done.exit_code == 0, done.output
    done = run("verify", tmp_path / "out")
    assert done.exit_code == 0, done.output

    for args, message in [
        (("linearize", "--out", tmp_path / "x.safetensors"), "give --checkpoint FILE or --hf DIR"),
        (
            ("linearize", "--checkpoint", tmp_path / "liza.safetensors", "--out", tmp_path / "liza.safetensors"),
            "own input",
        ),
        (("train", "--task", "copy"), "give --arch"),
        (("train", "--init", tmp_path / "liza.safetensors", "--arch", "softmax", "--task", "copy"), "not both"),
    ]:
        done = run(*args)
        assert done.exit_code == 2 and message in done.output, done.output


@pytest.mark.slow
def test_a_linearized_hybrid_exports_verifies_and_streams(tmp_path):
    from edgemem.export import export
    from edgemem.export.verify import verify
    from edgemem.models import from_hf, save_checkpoint
    from edgemem.runtime import Engine

    _, path = _qwen3_5_hybrid(tmp_path / "hf")
    model = linearize(from_hf(path), window=6).eval()
    save_checkpoint(model, tmp_path / "model.safetensors")
    manifest = export(
        model,
        tmp_path / "out",
        targets=["generic", "ort"],
        extra_config={"checkpoint": str(tmp_path / "model.safetensors")},
    )
    assert all("past_sequence" not in s.shape for s in manifest.state)  # no growing cache left
    checks, _ = verify(tmp_path / "out", threads=1)
    assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]
    tokens = torch.randint(0, 61, (1, 21), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = model(tokens)[0].numpy()
    stream = Engine.load(tmp_path / "out", threads=1).new_stream()
    got = [stream.prefill(tokens[0, :9].tolist(), chunk_size=4)] + [stream.step(int(t))[None] for t in tokens[0, 9:]]
    np.testing.assert_allclose(np.concatenate(got), expected, rtol=1e-4, atol=1e-4)
