"""HOPE (Nested Learning): the protocol law at random split points, constant state, causality,
the self-modifying memory and every CMS level against float64 token-by-token references whose
updates come from torch.autograd.grad, the period structure of a level, bad settings, and the
preset's export, verify and runtime streaming."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_protocol import TOLERANCE, run_pieces, split_points

from edgemem.errors import ConfigError, EdgememError
from edgemem.layers import HOPE, CMSLevel, SelfModifyingMemory
from edgemem.models import build, state_bytes

SMALL_LEVELS = {"d_model": 32, "mlp_hidden": 0, "levels": [2, 5, 8], "chunk_size": 3}


def _hope(**options) -> HOPE:
    return HOPE(32, 4, **{"levels": [2, 5, 8], "chunk_size": 3, "max_lr": 0.01, **options})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_layer_forward_equals_prefill_and_steps_at_random_splits(dtype, seed):
    torch.manual_seed(seed)
    layer = _hope().to(dtype)
    x = torch.randn(2, 37, 32, dtype=dtype)
    with torch.no_grad():
        expected = layer(x)
        got, state = run_pieces(layer, x, layer.init_state(2), split_points(37, seed))
        _, whole = layer.prefill(x, layer.init_state(2))
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    assert list(state) == list(whole)
    for key in whole:
        torch.testing.assert_close(state[key], whole[key], **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_preset_forward_equals_prefill_and_steps_at_random_splits(dtype):
    model = build("hope", seed=0, **SMALL_LEVELS).to(dtype)
    tokens = torch.randint(0, 256, (2, 41), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = model(tokens)
        got, _ = run_pieces(model, tokens, model.init_state(2), split_points(41, seed=9))
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])


def test_state_keeps_its_size_and_a_token_changes_no_earlier_output():
    model = build("hope", seed=0, **SMALL_LEVELS).double()
    tokens = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    state = model.init_state(1)
    layout, size = {k: (t.shape, t.dtype) for k, t in state.items()}, state_bytes(state)
    with torch.no_grad():
        for n in (1, 9, 70):  # every CMS period (2, 5, 8) passes several times
            _, state = model.prefill(torch.randint(0, 256, (1, n)), state)
            assert {k: (t.shape, t.dtype) for k, t in state.items()} == layout and state_bytes(state) == size
        base = model(tokens)
        for t in (3, 16, 29):
            changed = tokens.clone()
            changed[0, t] = (changed[0, t] + 1) % 256
            diff = (model(changed) - base).abs().amax(-1)[0]
            assert diff[:t].max() == 0 and (diff[t:] > 0).all()


# ---------------------------------------------------------------- float64 references


def _l2(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * weight


def _mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Per-head act(x W1) W2: x `[B, H, D]`, W1 `[B, H, D, E]`, W2 `[B, H, E, D]`."""
    return torch.einsum("bhe,bhed->bhd", F.silu(torch.einsum("bhd,bhde->bhe", x, w1)), w2)


def _residual_memory(x, weights, gamma, beta):
    """The paper's M(x) = x + f(x), in TTT's form x + γ ⊙ LN(f(x)) + β."""
    z = _mlp(x, *weights)
    return x + gamma * F.layer_norm(z, z.shape[-1:], eps=1e-6) + beta


def memory_reference(m: SelfModifyingMemory, x: torch.Tensor) -> torch.Tensor:
    """Titans eq. 13–14 on self-generated targets v̂_t = M_chunk(v_t), one token at a time;
    the gradient of ½‖M(k_t) − v̂_t‖² at the chunk-start weights from autograd."""
    b, t, _ = x.shape
    h, c = m.num_heads, m.chunk_size
    gamma, beta = m.inner_norm_weight, m.inner_norm_bias
    weights = [w.expand(b, *w.shape).clone() for w in m.initial_memory]
    momentum = [torch.zeros_like(w) for w in weights]
    outputs = []
    for i in range(t):
        xi = x[:, i]
        q, k, v = F.silu(xi @ m.qkv.weight.T).reshape(b, 3, h, -1).unbind(1)
        q, k = _l2(q), _l2(k)
        theta, eta, alpha = (
            g[..., None, None]
            for g in (m.max_lr * torch.sigmoid(m.theta(xi)), torch.sigmoid(m.eta(xi)), torch.sigmoid(m.alpha(xi)))
        )
        if i % c == 0:
            start = [w.clone() for w in weights]
        target = _residual_memory(v, start, gamma, beta)
        at = [w.detach().requires_grad_() for w in start]
        loss = 0.5 * (_residual_memory(k, at, gamma, beta) - target.detach()).pow(2).sum()
        grads = torch.autograd.grad(loss, at)
        momentum = [eta * s - theta * g for s, g in zip(momentum, grads)]
        weights = [(1 - alpha) * w + s for w, s in zip(weights, momentum)]
        y = _residual_memory(q, weights, gamma, beta)
        gate = F.silu(xi @ m.g.weight.T).reshape(b, h, -1)
        outputs.append((_rms(y, m.norm.weight) * gate).reshape(b, -1) @ m.out.weight.T)
    return torch.stack(outputs, 1)


def level_reference(level: CMSLevel, h: torch.Tensor, lr: float, period: int) -> tuple[torch.Tensor, list]:
    """One CMS level: weights fixed within each period of `period` tokens; at its end one step
    W ← W − Σ θ_t ∇ℓ_t(W) with ℓ_t = ½‖MLP(k_t) − v_t‖² (autograd). Returns the outputs and the
    weights after the last complete period."""
    b, t, d = h.shape
    heads = level.num_heads
    weights = [w.expand(b, *w.shape).clone() for w in level.initial_memory]
    step = [torch.zeros_like(w) for w in weights]
    outputs = []
    for i in range(t):
        x = _rms(h[:, i], level.norm.weight)
        q = _l2(x.reshape(b, heads, -1))
        v = (x @ level.value.weight.T).reshape(b, heads, -1)
        theta = (lr / period * torch.sigmoid(x @ level.theta.weight.T + level.theta.bias))[..., None, None]
        outputs.append(h[:, i] + _mlp(q, *weights).reshape(b, d) @ level.out.weight.T)
        at = [w.detach().requires_grad_() for w in weights]
        loss = 0.5 * (_mlp(q, *at) - v).pow(2).sum()
        step = [s + theta * g for s, g in zip(step, torch.autograd.grad(loss, at))]
        if i % period == period - 1:  # the period ends: its one update
            weights = [w - s for w, s in zip(weights, step)]
            step = [torch.zeros_like(w) for w in weights]
    return torch.stack(outputs, 1), weights


def test_self_modifying_memory_matches_a_token_by_token_autograd_reference():
    torch.manual_seed(0)
    m = SelfModifyingMemory(32, 4, chunk_size=4, conv_size=0, max_lr=0.5).double()
    with torch.no_grad():  # non-trivial residual norm parameters and memory
        m.inner_norm_weight.uniform_(0.5, 1.5)
        m.inner_norm_bias.normal_(0, 0.1)
    x = torch.randn(2, 23, 32, dtype=torch.float64)
    with torch.no_grad():
        got = m(x)
    expected = memory_reference(m, x).detach()
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-11)
    # the values are the memory's own: plain Titans targets give other outputs
    with torch.no_grad():
        plain = super(SelfModifyingMemory, m).prefill(x, m.init_state(2))[0]
    assert (plain - got).abs().max() > 1e-3


@pytest.mark.parametrize("period", [1, 3, 8])
def test_cms_level_matches_a_token_by_token_autograd_reference(period):
    torch.manual_seed(period)
    level = CMSLevel(32, 4, period, expansion=2, lr=0.7).double()
    h = torch.randn(2, 24, 32, dtype=torch.float64)
    with torch.no_grad():
        got, state = level.prefill(h, level.init_state(2))
    expected, weights = level_reference(level, h, lr=0.7, period=period)
    torch.testing.assert_close(got, expected.detach(), rtol=1e-9, atol=1e-11)
    for i, w in enumerate(weights):  # 24 tokens: whole periods, the state holds the last update
        torch.testing.assert_close(state[f"memory.{i}"], w.detach(), rtol=1e-9, atol=1e-11)
    assert (weights[0] - level.initial_memory[0]).abs().max() > 1e-4  # the level did learn


def test_hope_is_the_memory_followed_by_each_level():
    torch.manual_seed(3)
    layer = _hope(conv_size=0, level_lr=0.6, max_lr=0.3).double()
    x = torch.randn(2, 21, 32, dtype=torch.float64)
    with torch.no_grad():
        got = layer(x)
    h = memory_reference(layer.memory, x).detach()
    for level, period in zip(layer.levels, [2, 5, 8]):
        h = level_reference(level, h, lr=0.6, period=period)[0].detach()
    torch.testing.assert_close(got, h, rtol=1e-9, atol=1e-11)


def test_a_level_reads_the_weights_of_its_period_start():
    """Within a period the output at t ignores the earlier tokens of that period (the weights
    change only at the period's end); a token of the previous period does change it."""
    torch.manual_seed(0)
    level = CMSLevel(32, 4, period=6).double()
    h = torch.randn(1, 18, 32, dtype=torch.float64)
    with torch.no_grad():
        base = level(h)
        for changed_at, same_until in ((7, 12), (5, 6)):  # token 7 sits in period [6, 12); token 5 in [0, 6)
            other = h.clone()
            other[0, changed_at] += 1.0
            diff = (level(other) - base).abs().amax(-1)[0]
            assert diff[:changed_at].max() == 0 and diff[changed_at] > 0
            assert (diff[changed_at + 1 : same_until] == 0).all() and (diff[same_until:] > 0).all()


# ---------------------------------------------------------------- bad settings


@pytest.mark.parametrize("levels", [[], [16, 16], [64, 16], [0, 4], "16", [16.0]])
def test_levels_must_be_increasing_periods(levels):
    with pytest.raises(ConfigError, match="levels are the CMS update periods"):
        HOPE(32, 4, levels=levels)


def test_bad_hope_settings_say_what_is_expected():
    with pytest.raises(ConfigError, match="residual form"):
        HOPE(32, 4, levels=[4], residual_norm=False)
    with pytest.raises(ConfigError, match="period and expansion"):
        HOPE(32, 4, levels=[4], level_lr=0.0)
    with pytest.raises(ConfigError, match="levels"):
        build("hope", levels=[8, 4])
    layer = _hope()
    state = layer.init_state(2)
    _, moved = layer.prefill(torch.randn(1, 3, 32), {k: v[:1] for k, v in state.items()})
    mixed = {k: torch.cat([state[k][:1], moved[k]]) for k in state}
    with pytest.raises(EdgememError, match=r"sit at one position \(got \[0, 3\]\); step them"):
        layer.prefill(torch.randn(2, 4, 32), mixed)


# ---------------------------------------------------------------- export


def test_preset_exports_verify_and_stream_in_the_runtime(small_exports):
    from conftest import small

    from edgemem.export.verify import verify
    from edgemem.manifest import load
    from edgemem.runtime import Engine

    directory = small_exports["hope"]
    checks, skipped = verify(directory, threads=1)
    assert {c.target for c in checks} == {"generic", "ort", "onnx27"} and set(skipped) <= {"trt"}
    assert all(c.ok for c in checks), [c for c in checks if not c.ok]
    assert load(directory).graphs == {"prefill": True, "step": True}  # a Loop over segments (test_segment_prefill.py)
    model = build("hope", seed=0, **small("hope")).eval()
    tokens = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(2))  # crosses C_1, C_2
    with torch.no_grad():
        expected = model(tokens)[0].numpy()
    stream = Engine.load(directory, threads=1).new_stream()
    got = [stream.prefill(tokens[0, :37].tolist(), chunk_size=11)] + [stream.step(int(t))[None] for t in tokens[0, 37:]]
    np.testing.assert_allclose(np.concatenate(got), expected, rtol=1e-4, atol=1e-4)
