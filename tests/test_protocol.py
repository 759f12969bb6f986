"""The stateful protocol for every preset and layer: forward ≡ prefill + step … at any split."""

import random

import pytest
import torch

from edgemem.errors import EdgememError
from edgemem.layers import (
    DeltaNet,
    GatedDeltaNet,
    LinearAttention,
    NeuralMemoryLayer,
    SlidingWindowAttention,
    SoftmaxAttention,
    TitansMAC,
    TitansMAG,
    TitansMAL,
)
from edgemem.models import LMConfig, archs, build, load_config, state_bytes

LAYERS = {
    "softmax": lambda: SoftmaxAttention(32, 4),
    "linear": lambda: LinearAttention(32, 4),
    "deltanet": lambda: DeltaNet(32, 4),
    "deltanet-noconv": lambda: DeltaNet(32, 4, conv_size=0),
    "gated-deltanet": lambda: GatedDeltaNet(32, 4),
    "sliding-window": lambda: SlidingWindowAttention(32, 4, window=3, dilation=[1, 2, 1, 3], persistent=2),
    "neural-memory": lambda: NeuralMemoryLayer(32, 4, chunk_size=4),
    "neural-memory-linear-noconv": lambda: NeuralMemoryLayer(32, 4, depth=1, chunk_size=3, conv_size=0),
    "ttt": lambda: NeuralMemoryLayer(32, 4, depth=1, chunk_size=4, momentum=False, forget=False),
    "titans-mag": lambda: TitansMAG(32, 4, window=4, chunk_size=4),
    "titans-mal": lambda: TitansMAL(32, 4, window=4, chunk_size=5),
    "titans-mac": lambda: TitansMAC(32, 4, chunk_size=4),
}
LMS = [a for a in archs() if isinstance(load_config(a), LMConfig)]  # encoder-decoders: test_led_preset.py
STREAMING = [a for a in LMS if build(a, seed=0, d_model=32, mlp_hidden=32).streaming]
TOLERANCE = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.float64: dict(rtol=1e-9, atol=1e-11)}


def split_points(length: int, seed: int) -> list[tuple[str, int, int]]:
    """Random pieces covering [0, length): prefills of random length and single steps."""
    rng, pieces, start = random.Random(seed), [], 0
    while start < length:
        if rng.random() < 0.4:
            pieces.append(("step", start, start + 1))
            start += 1
        else:
            end = min(length, start + rng.randint(2, 9))
            pieces.append(("prefill", start, end))
            start = end
    return pieces


def run_pieces(module, inputs, state, pieces):
    outputs = []
    for kind, start, end in pieces:
        if kind == "step":
            y, state = module.step(inputs[:, start], state)
            outputs.append(y[:, None])
        else:
            y, state = module.prefill(inputs[:, start:end], state)
            outputs.append(y)
    return torch.cat(outputs, dim=1), state


@pytest.mark.parametrize("arch", STREAMING)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_preset_forward_equals_prefill_and_steps(arch, dtype, seed):
    torch.manual_seed(seed)
    model = build(arch, seed=seed, d_model=64, mlp_hidden=96).to(dtype)
    tokens = torch.randint(0, model.config.vocab_size, (2, 29))
    with torch.no_grad():
        expected = model(tokens)
        whole, whole_state = model.prefill(tokens, model.init_state(2))
        got, state = run_pieces(model, tokens, model.init_state(2), split_points(29, seed))
    assert got.dtype == dtype
    torch.testing.assert_close(whole, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    assert list(state) == list(whole_state)
    for name in state:
        torch.testing.assert_close(state[name], whole_state[name], **TOLERANCE[dtype])


@pytest.mark.parametrize("name", LAYERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_layer_forward_equals_prefill_and_steps(name, dtype):
    torch.manual_seed(0)
    layer = LAYERS[name]().to(dtype)
    x = torch.randn(3, 21, 32, dtype=dtype)
    with torch.no_grad():
        expected = layer(x)
        got, _ = run_pieces(layer, x, layer.init_state(3), split_points(21, seed=7))
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("arch", STREAMING)
def test_state_size_is_constant_for_recurrent_presets_and_grows_for_softmax(arch):
    model = build(arch, seed=0, d_model=32, mlp_hidden=32)
    state = model.init_state(1)
    sizes = [state_bytes(state)]
    with torch.no_grad():
        for chunk in (1, 7, 40, 150):
            _, state = model.prefill(torch.zeros(1, chunk, dtype=torch.long), state)
            sizes.append(state_bytes(state))
    if model.config.mixer == "softmax":
        per_token = 2 * model.config.n_layers * model.config.d_model * 4  # fp32 key + value
        assert sizes == [0, per_token, 8 * per_token, 48 * per_token, 198 * per_token]
    else:
        assert sizes == [sizes[0]] * 5 and sizes[0] > 0
        assert all(t.shape == s.shape for t, s in zip(state.values(), model.init_state(1).values()))


def test_softmax_attention_matches_dense_reference():
    torch.manual_seed(0)
    layer = SoftmaxAttention(32, 4).double()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    q, k, v = layer.qkv(x).unflatten(2, (3, 4, 8)).permute(2, 0, 3, 1, 4)
    pos = torch.arange(9, dtype=torch.float64)
    freqs = 10000.0 ** (-torch.arange(4, dtype=torch.float64) / 4)
    cos, sin = (pos[:, None] * freqs).cos(), (pos[:, None] * freqs).sin()
    rot = lambda t: torch.cat([t[..., :4] * cos - t[..., 4:] * sin, t[..., 4:] * cos + t[..., :4] * sin], -1)  # noqa: E731
    scores = rot(q) @ rot(k).transpose(-1, -2) / 8**0.5
    scores = scores.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
    expected = layer.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 9, 32))
    torch.testing.assert_close(layer(x), expected, rtol=1e-12, atol=1e-12)


def test_linear_attention_layer_matches_normalised_formula():
    torch.manual_seed(0)
    layer = LinearAttention(32, 4).double()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    q, k, v = layer.qkv(x).unflatten(2, (3, 4, 8)).permute(2, 0, 3, 1, 4)
    phi = lambda t: torch.nn.functional.elu(t) + 1  # noqa: E731
    weights = (phi(q) @ phi(k).transpose(-1, -2)).tril()
    o = (weights @ v) / (weights.sum(-1, keepdim=True) + layer.eps)
    expected = layer.out(o.transpose(1, 2).reshape(2, 9, 32))
    torch.testing.assert_close(layer(x), expected, rtol=1e-10, atol=1e-12)


# what a level learns reaches the output only after its period: hope's periods must end within 12 tokens
GRADIENT_OVERRIDES = {"hope": {"levels": [2, 4, 8]}}


@pytest.mark.parametrize("arch", LMS)
def test_every_parameter_gets_a_gradient(arch):
    model = build(arch, seed=0, d_model=32, mlp_hidden=32, **GRADIENT_OVERRIDES.get(arch, {}))
    tokens = torch.randint(0, 256, (2, 12))
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing


@pytest.mark.parametrize("arch", STREAMING)
def test_preset_is_causal(arch):
    """Changing token t changes no logit before t (and does change the one at t)."""
    model = build(arch, seed=0, d_model=32, mlp_hidden=32).double()
    tokens = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[0, 23] = (changed[0, 23] + 1) % 256
    with torch.no_grad():
        diff = (model(tokens) - model(changed)).abs().amax(-1)[0]
    assert diff[:23].max() == 0 and diff[23] > 0


def test_encoder_preset_is_bidirectional_and_has_no_step():
    model = build("longformer-encoder", seed=0, d_model=32, mlp_hidden=32, window=2, n_layers=1).double()
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[:, 15] = (changed[:, 15] + 1) % 256
    with torch.no_grad():
        diff = (model(tokens) - model(changed)).abs().amax(-1)
    assert (diff[:, 0] > 0).all()  # the global first token sees everything
    assert (diff[:, 5] == 0).all()  # outside the window of token 15 and not global
    assert (diff[:, 13:18] > 0).all()  # inside the window
    with pytest.raises(EdgememError, match="bidirectional: it has no step"):
        model.step(tokens[:, 0], model.init_state(2))


def test_short_conv_is_a_causal_depthwise_convolution():
    from edgemem.layers.common import ShortConv

    torch.manual_seed(0)
    conv = ShortConv(6, 4).double()
    x = torch.randn(2, 9, 6, dtype=torch.float64)
    y, state = conv(x, conv.init_state(2, None, torch.float64))
    padded = torch.nn.functional.pad(x.transpose(1, 2), (3, 0))
    expected = torch.nn.functional.silu(torch.nn.functional.conv1d(padded, conv.weight, groups=6)).transpose(1, 2)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state, x[:, -3:].transpose(1, 2))
