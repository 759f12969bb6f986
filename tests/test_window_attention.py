"""WindowAttention: streaming from a ring buffer reproduces causal banded attention at any split."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from edgemem.errors import ShapeError
from edgemem.ops.banded_attention import banded_attention
from edgemem.ops.window_attention import (
    OP_TYPE,
    init_window_state,
    ring_length,
    window_attention_chunk,
    window_attention_naive,
    window_attention_prefill,
    window_attention_step,
)

B, H, D, DV = 2, 3, 4, 5
WINDOW, DILATION = 3, [1, 2, 3]
L = WINDOW * 3


def make_inputs(t, *, p=2, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    q, k, v = rand(B, t, H * D), rand(B, t, H * D), rand(B, t, H * DV)
    pk, pv = (rand(H, p, D), rand(H, p, DV)) if p else (None, None)
    return q, k, v, dict(num_heads=H, window=WINDOW, dilation=DILATION, persistent_key=pk, persistent_value=pv)


def empty_state(dtype=torch.float64):
    return init_window_state(B, H, D, window=WINDOW, dilation=DILATION, value_dim=DV, dtype=dtype)


def run(q, k, v, kw, ends):
    """Feed the tokens in pieces ending at `ends` (and at T): pieces of one token by step, others by prefill."""
    state, outputs, start = empty_state(q.dtype), [], 0
    for end in sorted(set(ends) | {q.shape[1]}):
        fn = window_attention_step if end - start == 1 else window_attention_prefill
        out, *state = fn(q[:, start:end], k[:, start:end], v[:, start:end], *state, start, **kw)
        outputs.append(out)
        start = end
    return torch.cat(outputs, 1), state


@pytest.mark.parametrize("persistent", [0, 2])
def test_steps_from_empty_state_equal_causal_banded(persistent):
    t = 3 * L + 4
    q, k, v, kw = make_inputs(t, p=persistent)
    ref = banded_attention(q, k, v, causal=True, **kw)
    out, state = run(q, k, v, kw, range(1, t))
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert [tuple(s.shape) for s in state] == [(B, H, L, D), (B, H, L, DV)]


@pytest.mark.parametrize("ends", [[1], [5], [L], [L + 1, L + 2], [3, 4, 20], [2, 17, 18, 19, 30], [*range(1, 12), 30]])
def test_prefill_step_prefill_equals_one_call(ends):
    t = 3 * L + 4
    q, k, v, kw = make_inputs(t)
    whole = window_attention_prefill(q, k, v, *empty_state(), 0, **kw)[0]
    torch.testing.assert_close(whole, banded_attention(q, k, v, causal=True, **kw), rtol=1e-12, atol=1e-12)
    out, _ = run(q, k, v, kw, ends)
    torch.testing.assert_close(out, whole, rtol=1e-12, atol=1e-12)


def test_state_is_the_last_ring_of_tokens():
    t = 2 * L + 5
    q, k, v, kw = make_inputs(t)
    _, present_key, present_value = window_attention_prefill(q, k, v, *empty_state(), 0, **kw)
    slots = torch.arange(t - L, t) % L
    keys = k.unflatten(2, (H, D))[:, t - L :].transpose(1, 2)
    torch.testing.assert_close(present_key[:, :, slots], keys, rtol=0, atol=0)
    assert present_value.shape == (B, H, L, DV)


def test_fp32_stream_and_half_state():
    t = 2 * L + 3
    q, k, v, kw = make_inputs(t, dtype=torch.float32, seed=1)
    out, _ = run(q, k, v, kw, [7, 10, *range(11, t)])
    torch.testing.assert_close(out, banded_attention(q, k, v, causal=True, **kw), rtol=1e-5, atol=1e-5)
    assert out.dtype == torch.float32
    half = [s.half() for s in empty_state(torch.float32)]
    _, *present = window_attention_prefill(q, k, v, *half, 0, **kw)
    assert all(s.dtype == torch.float16 for s in present)


def test_streams_at_different_positions_batch_together():
    q, k, v, kw = make_inputs(L + 6)
    seen = [L + 5, 2]
    states = [
        window_attention_prefill(
            q[i : i + 1, :n], k[i : i + 1, :n], v[i : i + 1, :n], *[s[i : i + 1] for s in empty_state()], 0, **kw
        )[1:]
        for i, n in enumerate(seen)
    ]
    past = [torch.cat(parts) for parts in zip(*states)]
    pick = lambda x: torch.stack([x[i, n] for i, n in enumerate(seen)])[:, None]  # noqa: E731
    out, *_ = window_attention_step(pick(q), pick(k), pick(v), *past, torch.tensor(seen), **kw)
    torch.testing.assert_close(out, pick(banded_attention(q, k, v, causal=True, **kw)), rtol=1e-12, atol=1e-12)


def unpacked(q, k, v, kw):
    heads = lambda x: x.unflatten(2, (H, -1))  # noqa: E731
    return (heads(q), heads(k), heads(v)), {
        n: kw[n] for n in ("window", "dilation", "persistent_key", "persistent_value")
    }


@pytest.mark.parametrize("position", [[0, 2], [L - 1, 3 * L + 1]])
def test_naive_and_fast_forms_agree_from_any_state(position):
    q, k, v, kw = make_inputs(7)
    g = torch.Generator().manual_seed(3)
    past = (
        torch.randn(B, H, L, D, generator=g, dtype=torch.float64),
        torch.randn(B, H, L, DV, generator=g, dtype=torch.float64),
    )
    pos = torch.tensor(position)
    (uq, uk, uv), ukw = unpacked(q, k, v, kw)
    ref = window_attention_naive(uq, uk, uv, *past, pos, **ukw)
    for got in (
        window_attention_chunk(uq, uk, uv, *past, pos, **ukw),
        window_attention_prefill(uq, uk, uv, *past, pos, **kw),
    ):
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_unwritten_slots_are_never_read():
    q, k, v, kw = make_inputs(4)
    noise = [torch.randn_like(s) for s in empty_state()]
    clean = window_attention_prefill(q, k, v, *empty_state(), 0, **kw)
    dirty = window_attention_prefill(q, k, v, *noise, 0, **kw)
    torch.testing.assert_close(dirty[0], clean[0], rtol=0, atol=0)


def test_custom_op_opcheck_fake_tensors_and_gradients():
    q, k, v, kw = make_inputs(5)
    g = torch.Generator().manual_seed(4)
    past = [torch.randn(B, H, L, n, generator=g, dtype=torch.float64).requires_grad_() for n in (D, DV)]
    pk, pv = (kw[n].requires_grad_() for n in ("persistent_key", "persistent_value"))
    inputs = [x.requires_grad_() for x in (q, k, v)] + past + [pk, pv]
    position = torch.tensor([1, L + 2])
    args = (q, k, v, *past, position, pk, pv, H, WINDOW, DILATION, 0.7)
    torch.library.opcheck(torch.ops.edgemem.window_attention.default, args)

    outputs = window_attention_prefill(q, k, v, *past, position, **kw)
    (uq, uk, uv), ukw = unpacked(q, k, v, kw)
    expected = window_attention_naive(uq, uk, uv, *past, position, **ukw)
    cotangents = [torch.randn_like(x) for x in outputs]
    grads = torch.autograd.grad(outputs, inputs, cotangents)
    want = torch.autograd.grad((expected[0].flatten(2), *expected[1:]), inputs, cotangents)
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)

    plain = [x.detach() for x in (q, k, v, *past)]
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(x) for x in plain]
        out, present_key, present_value = window_attention_step(
            *(x[:, :1] for x in fake[:3]), *fake[3:], 4, num_heads=H, window=WINDOW, dilation=DILATION
        )
    assert out.shape == (B, 1, H * DV) and present_key.shape == (B, H, L, D) and present_value.shape == (B, H, L, DV)
    assert OP_TYPE == "WindowAttention" and ring_length(WINDOW, DILATION) == L and ring_length(4) == 4


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(past_key=torch.zeros(B, H, L - 1, D)), f"past_key is shape ({B}, {H}, {L - 1}, {D})"),
        (
            dict(past_value=torch.zeros(B, H, L, D)),
            f"expected a floating tensor [B, H, L, {DV}] = [{B}, {H}, {L}, {DV}]",
        ),
        (dict(position=torch.tensor([0, 1, 2])), "position is shape (3,)"),
        (dict(position=torch.tensor(1.0)), "position"),
        (dict(dilation=[1, 2]), "dilation"),
        (dict(window=0), "window must be an int >= 1; got 0"),
        (dict(query=torch.zeros(B, 1, H * (D + 1), dtype=torch.float64)), "key has shape"),
        (dict(persistent_key=torch.zeros(H, 2, D + 1, dtype=torch.float64)), "persistent_key is shape"),
    ],
)
def test_bad_inputs_raise_shape_error(change, message):
    q, k, v, kw = make_inputs(1)
    past_key, past_value = empty_state()
    kwargs = dict(query=q, key=k, value=v, past_key=past_key, past_value=past_value, position=0) | kw | change
    with pytest.raises(ShapeError) as err:
        window_attention_step(**kwargs)
    assert message in str(err.value)


def test_step_takes_one_token():
    q, k, v, kw = make_inputs(2)
    with pytest.raises(ShapeError, match="expected one token"):
        window_attention_step(q, k, v, *empty_state(), 0, **kw)
