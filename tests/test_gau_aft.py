"""GAU (mixed-chunk attention) and AFT (simple / local): dense references and the stateful protocol."""

import random

import pytest
import torch
import torch.nn.functional as F

from edgemem.errors import ConfigError
from edgemem.layers.aft import AFT
from edgemem.layers.gau import GAU

D = 32
CHUNK = 5
WINDOW = 5
LAYERS = {
    "gau": lambda: GAU(D, expansion=2, s=16, chunk_size=CHUNK),
    "gau-chunk1": lambda: GAU(D, expansion=1, s=8, chunk_size=1),
    "aft-simple": lambda: AFT(D),
    "aft-local": lambda: AFT(D, mode="local", window=WINDOW),
    "aft-local-window1": lambda: AFT(D, mode="local", window=1),
}
TOLERANCE = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.float64: dict(rtol=1e-9, atol=1e-11)}


def randomise(layer: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Matrices ~ N(0, 1/fan_in), the rest ~ N(0, 0.7²): relu² sees both signs and every term matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            std = p.shape[1] ** -0.5 if p.dim() == 2 else 0.7
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * std)
    return layer


def gau_reference(layer: GAU, x: torch.Tensor) -> torch.Tensor:
    c, t = layer.chunk_size, x.shape[1]
    u, v, z = F.silu(x @ layer.proj.weight.T).split([layer.e, layer.e, layer.s], dim=-1)
    q_quad, q_lin, k_quad, k_lin = (z * layer.gamma[i] + layer.beta[i] for i in range(4))
    pos = torch.arange(t)
    offset = pos[:, None] - pos[None]
    chunk = pos // c
    quad_mask = (chunk[:, None] == chunk[None]) & (offset >= 0)
    lin_mask = chunk[None] < chunk[:, None]
    bias = torch.where(quad_mask, layer.rel_bias[offset.clamp(0, c - 1)], 0.0)
    quad = F.relu(q_quad @ k_quad.mT / c + bias) ** 2 * quad_mask
    lin = q_lin @ k_lin.mT / c * lin_mask
    return (u * ((quad + lin) @ v)) @ layer.out.weight.T


def aft_reference(layer: AFT, x: torch.Tensor) -> torch.Tensor:
    q, k, v = (x @ layer.qkv.weight.T).chunk(3, dim=-1)
    t = x.shape[1]
    offset = torch.arange(t)[:, None] - torch.arange(t)[None]
    bias = torch.zeros(t, t, dtype=x.dtype)
    if layer.mode == "local":
        inside = (offset >= 0) & (offset < layer.window)
        bias = torch.where(inside, layer.pos_bias[offset.clamp(0, layer.window - 1)], 0.0)
    logits = (k[:, None, :, :] + bias[None, :, :, None]).masked_fill((offset < 0)[None, :, :, None], float("-inf"))
    y = torch.sigmoid(q) * torch.einsum("btjd,bjd->btd", logits.softmax(dim=2), v)
    return y @ layer.out.weight.T


def reference(layer, x):
    return gau_reference(layer, x) if isinstance(layer, GAU) else aft_reference(layer, x)


def run_pieces(layer, x, state, cuts):
    edges = sorted({0, x.shape[1], *cuts})
    outputs = []
    for start, end in zip(edges[:-1], edges[1:]):
        if end - start == 1:
            y, state = layer.step(x[:, start], state)
            outputs.append(y[:, None])
        else:
            y, state = layer.prefill(x[:, start:end], state)
            outputs.append(y)
    return torch.cat(outputs, dim=1), state


def cut_sets(length: int, period: int) -> list[set[int]]:
    """Mid-chunk and chunk-boundary cuts, long multi-chunk prefills from mid-chunk, and random mixes."""
    fixed = [
        {period - 1, period, period + 1, 2 * period, 3 * period + 2},
        {3, 3 + 3 * period},
        set(range(1, length)),
    ]
    return fixed + [set(random.Random(seed).sample(range(1, length), length // 3)) for seed in range(3)]


@pytest.mark.parametrize("name", LAYERS)
def test_forward_matches_dense_reference(name):
    torch.manual_seed(0)
    layer = randomise(LAYERS[name]().double())
    x = torch.randn(2, 23, D, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), reference(layer, x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", LAYERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_equals_prefill_and_steps_at_any_split(name, dtype):
    torch.manual_seed(1)
    layer = randomise(LAYERS[name]()).to(dtype)
    length = 4 * CHUNK + 7
    x = torch.randn(3, length, D, dtype=dtype)
    with torch.no_grad():
        expected = layer(x)
        _, whole_state = layer.prefill(x, layer.init_state(3))
        for cuts in cut_sets(length, CHUNK):
            got, state = run_pieces(layer, x, layer.init_state(3), cuts)
            assert got.dtype == dtype
            torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
            assert list(state) == list(whole_state)
            for kind in state:
                torch.testing.assert_close(state[kind], whole_state[kind], **TOLERANCE[dtype])


def test_gau_streams_in_one_batch_can_sit_at_different_positions():
    torch.manual_seed(2)
    layer = randomise(LAYERS["gau"]()).double()
    x = torch.randn(2, 20, D, dtype=torch.float64)
    with torch.no_grad():
        _, first = layer.prefill(x[:1, :7], layer.init_state(1))  # stream 0 at position 7 (mid-chunk)
        _, second = layer.prefill(x[1:, :10], layer.init_state(1))  # stream 1 at position 10 (a boundary)
        state = {kind: torch.cat([first[kind], second[kind]]) for kind in first}
        y, _ = layer.prefill(x[:, 10:], state)
        y0, _ = layer.prefill(x[:1, 10:], first)
        y1, _ = layer.prefill(x[1:, 10:], second)
    assert state["position"].tolist() == [7, 10]
    torch.testing.assert_close(y, torch.cat([y0, y1]), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", LAYERS)
def test_state_size_is_constant_over_positions(name):
    layer = LAYERS[name]()
    init = layer.init_state(2)
    layout = {kind: (t.shape, t.dtype) for kind, t in init.items()}
    assert all(dtype in (torch.float32, torch.int64) for _, dtype in layout.values())
    snapshot = {kind: t.clone() for kind, t in init.items()}
    state = init
    with torch.no_grad():
        for _ in range(4 * max(CHUNK, WINDOW) + 2):
            _, state = layer.step(torch.randn(2, D), state)
            assert {kind: (t.shape, t.dtype) for kind, t in state.items()} == layout
        for length in (1, 3, CHUNK, 3 * CHUNK + 1):
            _, state = layer.prefill(torch.randn(2, length, D), state)
            assert {kind: (t.shape, t.dtype) for kind, t in state.items()} == layout
    for kind in init:  # states are never modified in place
        torch.testing.assert_close(init[kind], snapshot[kind], rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["simple", "local"])
def test_aft_is_stable_for_large_logits(mode):
    torch.manual_seed(3)
    layer = AFT(16, mode=mode, window=WINDOW if mode == "local" else None)
    with torch.no_grad():
        layer.qkv.weight[16:32].normal_(0, 80 / 16**0.5)  # keys ~ N(0, 80²): e^K overflows fp32
        if mode == "local":
            layer.pos_bias.normal_(0, 5)
    x = torch.randn(2, 500, 16)
    with torch.no_grad():
        keys = x @ layer.qkv.weight[16:32].T
        assert torch.exp(keys).isinf().any() and keys.abs().max() > 150
        y = layer(x)
        expected = aft_reference(layer.double(), x.double()).float()
        layer.float()
        stepped, state = run_pieces(layer, x, layer.init_state(2), {1, 2, 3, 100, 101, 317})
    assert torch.isfinite(y).all() and torch.isfinite(stepped).all()
    assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point() and t.dim() == 2)
    torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(stepped, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", LAYERS)
def test_every_parameter_gets_a_gradient(name):
    torch.manual_seed(4)
    layer = LAYERS[name]()
    x = torch.randn(2, 3 * CHUNK + 2, D)
    _, state = layer.prefill(x[:, :3], layer.init_state(2))
    y, _ = layer.prefill(x[:, 3:], state)  # from mid-chunk, through the state
    y.square().sum().backward()
    missing = [n for n, p in layer.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters())


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: GAU(0), "d_model"),
        (lambda: GAU(32, expansion=0), "expansion"),
        (lambda: GAU(32, s=-1), "s must"),
        (lambda: GAU(32, chunk_size=2.5), "chunk_size"),
        (lambda: GAU(32, chunk_size=True), "chunk_size"),
        (lambda: AFT(0), "d_model"),
        (lambda: AFT(32, mode="full"), "mode"),
        (lambda: AFT(32, mode="local"), "window"),
        (lambda: AFT(32, mode="local", window=0), "window"),
        (lambda: AFT(32, window=8), "window"),
    ],
)
def test_bad_arguments_raise_config_error(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_gau_offset_form_equals_blocked_form():
    """The form traced for a symbolic prompt length (export) is the eager blocked form."""
    torch.manual_seed(0)
    layer = GAU(32, s=16, chunk_size=8).double()
    with torch.no_grad():
        layer.rel_bias.normal_()
    b, t, c = 3, 21, 8
    q_quad, q_lin = torch.randn(2, b, t, 16, dtype=torch.float64)
    k_quad, k_lin = torch.randn(2, b, c + t, 16, dtype=torch.float64)
    values = torch.randn(b, c + t, 64, dtype=torch.float64)
    position = torch.tensor([0, 5, 17])
    blocked = layer._window(q_quad, q_lin, k_quad, k_lin, values, position)
    by_offset = layer._window_by_offset(q_quad, q_lin, k_quad, k_lin, values, position)
    torch.testing.assert_close(by_offset, blocked, rtol=1e-12, atol=1e-12)
