"""Specifications of the neural memory op (Titans long-term memory, TTT as its special case)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from edgemem.errors import ShapeError
from edgemem.ops.neural_memory import (
    OP_TYPE,
    Memory,
    Options,
    ResidualNorm,
    Tokens,
    neural_memory,
    neural_memory_chunk,
    neural_memory_naive,
    neural_memory_step,
)

F64 = torch.float64
ACTS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu, "identity": lambda h: h}


def make(depth, *, seed=0, b=2, t=10, h=2, d=3, e=5, dtype=F64):
    """Unpacked q/k/v `[B, T, H, D]`, gates `[B, T, H]`, weights and momentum."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=F64) * scale).to(dtype)

    q, k, v = rand(b, t, h, d), rand(b, t, h, d, scale=0.5), rand(b, t, h, d)
    theta = (0.2 * torch.rand(b, t, h, generator=g, dtype=F64)).to(dtype)
    eta = torch.rand(b, t, h, generator=g, dtype=F64).to(dtype)
    alpha = (0.3 * torch.rand(b, t, h, generator=g, dtype=F64)).to(dtype)
    shapes = [(b, h, d, d)] if depth == 1 else [(b, h, d, e), (b, h, e, d)]
    weights = tuple(rand(*s, scale=0.5) for s in shapes)
    momentum = tuple(rand(*s, scale=0.1) for s in shapes)
    return q, k, v, theta, eta, alpha, weights, momentum


def make_norm(seed=0, h=2, d=3, dtype=F64):
    """TTT's per-head LayerNorm scale γ and shift β `[H, D]`, away from (1, 0)."""
    g = torch.Generator().manual_seed(1000 + seed)
    gamma = 1 + 0.5 * torch.randn(h, d, generator=g, dtype=F64)
    beta = 0.3 * torch.randn(h, d, generator=g, dtype=F64)
    return gamma.to(dtype), beta.to(dtype)


def reference(q, k, v, theta, eta, alpha, weights, momentum, chunk_size, activation, norm=None):
    """The update equations with gradients from torch autograd at each chunk's start weights;
    `norm` = (γ, β): TTT's inner model x + γ ⊙ LN(f(x)) + β (torch's layer_norm, eps 1e-6)."""
    act = ACTS[activation]

    def memory(x, ws):
        z = x @ ws[0] if len(ws) == 1 else act(x @ ws[0]) @ ws[1]
        if norm is None:
            return z
        gamma, beta = (p[:, None] for p in norm)  # [H, 1, D] over [B, H, 1, D]
        return x + gamma * F.layer_norm(z, z.shape[-1:], eps=1e-6) + beta

    w, s, ys = list(weights), list(momentum), []
    for t in range(q.shape[1]):
        if t % chunk_size == 0:
            start = [x.detach().requires_grad_() for x in w]
        with torch.enable_grad():
            loss = 0.5 * (memory(k[:, t, :, None], start) - v[:, t, :, None]).pow(2).sum()
            grads = torch.autograd.grad(loss, start)
        th, et, al = (x[:, t, :, None, None] for x in (theta, eta, alpha))
        s = [et * si - th * gi for si, gi in zip(s, grads)]
        w = [(1 - al) * wi + si for wi, si in zip(w, s)]
        ys.append(memory(q[:, t, :, None], w)[:, :, 0])
    return torch.stack(ys, 1), w, s


def run_form(form, q, k, v, theta, eta, alpha, weights, momentum, chunk_weights=None, position=None, **options):
    """`form` (naive or chunk, unpacked tensors) over the public step's arguments and results:
    (y, weights, momentum, chunk_weights, position)."""
    norm = ResidualNorm.of(options.pop("norm_weight", None), options.pop("norm_bias", None))
    memory = Memory(weights, momentum, chunk_weights, position)
    y, out = form(Tokens(q, k, v, theta, eta, alpha), memory, Options(q.shape[2], **options), norm)
    return y, out.weights, out.momentum, out.chunk_weights, out.position


def naive(*args, **options):
    return run_form(neural_memory_naive, *args, **options)


def chunk(*args, **options):
    return run_form(neural_memory_chunk, *args, **options)


def assert_all_close(got, want, rtol, atol):
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


def flat(result):
    """(y, weights, momentum, ...) -> list of tensors."""
    return [t for part in result for t in (part if isinstance(part, tuple) else (part,))]


def norm_kwargs(norm):
    return {} if norm is None else dict(norm_weight=norm[0], norm_bias=norm[1])


def norm_tol(tol, dtype, residual_norm):
    """float32 with the residual norm: LN's 1/σ over 3-wide rows amplifies rounding. With torch 2.13,
    depth 2 / gelu / chunk 3 puts both float32 forms up to 2.2e-3 (naive 1.5e-3) from float64 while
    the float64 forms agree to 2e-12, so float32 is held to 1e-3 there (exactness is the float64 case)."""
    return 1e-3 if residual_norm and dtype == torch.float32 else tol


@pytest.mark.parametrize("residual_norm", [False, True])
@pytest.mark.parametrize("activation", ["silu", "gelu", "relu", "identity"])
@pytest.mark.parametrize("chunk_size", [1, 3, 4])
@pytest.mark.parametrize("depth", [1, 2])
def test_naive_matches_autograd_reference(depth, chunk_size, activation, residual_norm):
    inputs = make(depth, seed=chunk_size)
    norm = make_norm(chunk_size) if residual_norm else None
    y, w, s, _, _ = naive(*inputs, chunk_size=chunk_size, activation=activation, **norm_kwargs(norm))
    y_ref, w_ref, s_ref = reference(*inputs, chunk_size, activation, norm)
    assert_all_close([y, *w, *s], [y_ref, *w_ref, *s_ref], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("residual_norm", [False, True])
@pytest.mark.parametrize(("dtype", "tol"), [(F64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("chunk_size", [1, 3, 4, 16])
@pytest.mark.parametrize(("depth", "activation"), [(1, "silu"), (2, "silu"), (2, "gelu")])
def test_chunk_matches_naive(depth, activation, chunk_size, dtype, tol, residual_norm):
    inputs = make(depth, seed=7, t=11, dtype=dtype)
    norm = norm_kwargs(make_norm(7, dtype=dtype) if residual_norm else None)
    got = chunk(*inputs, chunk_size=chunk_size, activation=activation, **norm)
    want = naive(*inputs, chunk_size=chunk_size, activation=activation, **norm)
    tol = norm_tol(tol, dtype, residual_norm)
    assert_all_close(flat(got), flat(want), rtol=tol, atol=tol)


@pytest.mark.parametrize("residual_norm", [False, True])
@pytest.mark.parametrize(("dtype", "tol"), [(F64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("depth", [1, 2])
def test_chunk_matches_naive_from_mid_chunk_positions(depth, dtype, tol, residual_norm):
    q, k, v, theta, eta, alpha, weights, momentum = make(depth, seed=3, b=3, t=10, dtype=dtype)
    chunk_weights = tuple(w.flip(0) for w in weights)
    position = torch.tensor([0, 5, 11])
    args = (q, k, v, theta, eta, alpha, weights, momentum, chunk_weights, position)
    norm = norm_kwargs(make_norm(3, dtype=dtype) if residual_norm else None)
    got = chunk(*args, chunk_size=4, **norm)
    want = naive(*args, chunk_size=4, **norm)
    tol = norm_tol(tol, dtype, residual_norm)
    assert_all_close(flat(got), flat(want), rtol=tol, atol=tol)
    assert got[-1].tolist() == [10, 15, 21]


def test_residual_norm_is_ttt_inner_model():
    """One token, chunk 1, no momentum or forgetting: W ← W − θ ∇W ½‖k + γ⊙LN(kW) + β − v‖², y = M(q; W)."""
    q, k, v, theta, _, _, (w,), _ = make(1, seed=11, b=1, t=1)
    gamma, beta = make_norm(11)
    zero = torch.zeros_like(theta)
    y, (w_new,), _ = neural_memory(
        q, k, v, theta, zero, zero, (w,), (torch.zeros_like(w),), num_heads=2, norm_weight=gamma, norm_bias=beta
    )
    for head in range(2):
        qh, kh, vh = (x[0, 0, head] for x in (q, k, v))

        def model(x, weights):
            return x + gamma[head] * F.layer_norm(x @ weights, (3,), eps=1e-6) + beta[head]

        wh = w[0, head].detach().requires_grad_()
        with torch.enable_grad():
            (grad,) = torch.autograd.grad(0.5 * (model(kh, wh) - vh).pow(2).sum(), wh)
        w_want = wh.detach() - theta[0, 0, head] * grad
        torch.testing.assert_close(w_new[0, head], w_want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(y[0, 0, head], model(qh, w_want), rtol=1e-12, atol=1e-12)


def test_half_inputs_compute_in_float32():
    q, k, v, theta, eta, alpha, weights, momentum = make(2, seed=4, t=8, dtype=torch.bfloat16)
    y, w, s = neural_memory(q, k, v, theta, eta, alpha, weights, momentum, num_heads=2, chunk_size=3)
    up = [x.float() for x in (q, k, v, theta, eta, alpha)]
    w32, s32 = (tuple(x.float() for x in xs) for xs in (weights, momentum))
    y32, w32, s32 = neural_memory(*up, w32, s32, num_heads=2, chunk_size=3)
    assert y.dtype == torch.bfloat16 and y.shape == q.shape
    assert all(x.dtype == torch.float32 for x in (*w, *s))
    torch.testing.assert_close(y, y32.to(torch.bfloat16), rtol=0, atol=0)
    assert_all_close([*w, *s], [*w32, *s32], rtol=0, atol=0)


def test_packed_and_unpacked_layouts_agree():
    q, k, v, theta, eta, alpha, weights, momentum = make(2, seed=5)
    kw = dict(num_heads=2, chunk_size=4, activation="gelu")
    y4, w4, _ = neural_memory(q, k, v, theta, eta, alpha, weights, momentum, **kw)
    packed = (x.flatten(2) for x in (q, k, v))
    y3, w3, _ = neural_memory(*packed, theta, eta, alpha, weights, momentum, **kw)
    assert y4.shape == q.shape and y3.shape == (2, 10, 6)
    assert_all_close([y4.flatten(2), *w4], [y3, *w3], rtol=0, atol=0)


def run_in_pieces(inputs, cuts, chunk_size, activation, norm=None):
    """prefill / step / prefill over consecutive pieces through the streaming state."""
    q, k, v, theta, eta, alpha, weights, momentum = inputs
    chunk_weights, position = weights, torch.zeros(1, dtype=torch.int64)
    ys = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        piece = [x[:, lo:hi] for x in (q, k, v, theta, eta, alpha)]
        y, weights, momentum, chunk_weights, position = neural_memory_step(
            *piece,
            weights,
            momentum,
            chunk_weights,
            position,
            num_heads=q.shape[2],
            chunk_size=chunk_size,
            activation=activation,
            **norm_kwargs(norm),
        )
        ys.append(y)
    assert position.tolist() == [q.shape[1]]
    return torch.cat(ys, 1), weights, momentum


@pytest.mark.parametrize("residual_norm", [False, True])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("depth", "chunk_size"), [(1, 4), (2, 4), (2, 5), (2, 1)])
def test_prefill_step_prefill_equals_one_call(depth, chunk_size, seed, residual_norm):
    t = 23
    inputs = make(depth, seed=seed, t=t)
    norm = make_norm(seed) if residual_norm else None
    g = torch.Generator().manual_seed(100 + seed)
    a, b = sorted(torch.randint(1, t - 1, (2,), generator=g).tolist())
    b = max(b, a + 1)
    cuts = [0, a, *range(a + 1, b + 1), t]  # prefill, a step per token, prefill
    want = neural_memory(*inputs, num_heads=2, chunk_size=chunk_size, activation="silu", **norm_kwargs(norm))
    got = run_in_pieces(inputs, cuts, chunk_size, "silu", norm)
    assert_all_close(flat(got), flat(want), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("residual_norm", [False, True])
@pytest.mark.parametrize("cuts", [[0, 2, 9, 10, 17], [0, 1, 2, 3, 4, 17], [0, 16, 17]])
def test_pieces_split_inside_chunks_equal_one_call(cuts, residual_norm):
    inputs = make(2, seed=9, t=17)
    norm = make_norm(9) if residual_norm else None
    want = neural_memory(*inputs, num_heads=2, chunk_size=8, activation="gelu", **norm_kwargs(norm))
    got = run_in_pieces(inputs, cuts, 8, "gelu", norm)
    assert_all_close(flat(got), flat(want), rtol=1e-10, atol=1e-10)


def test_calls_split_at_chunk_boundaries_continue():
    q, k, v, theta, eta, alpha, weights, momentum = make(2, seed=2, t=12)
    want = neural_memory(q, k, v, theta, eta, alpha, weights, momentum, num_heads=2, chunk_size=4)
    head = [x[:, :8] for x in (q, k, v, theta, eta, alpha)]
    tail = [x[:, 8:] for x in (q, k, v, theta, eta, alpha)]
    y1, w, s = neural_memory(*head, weights, momentum, num_heads=2, chunk_size=4)
    y2, w, s = neural_memory(*tail, w, s, num_heads=2, chunk_size=4)
    assert_all_close([torch.cat([y1, y2], 1), *w, *s], flat(want), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("depth", [1, 2])
def test_rows_at_different_positions(depth):
    """A batch whose rows sit at different stream positions equals each row streamed alone."""
    q, k, v, theta, eta, alpha, weights, momentum = make(depth, seed=6, b=2, t=20)
    zero = torch.zeros(1, dtype=torch.int64)
    pieces, alone = [], []
    for row, split in ((0, 6), (1, 11)):  # 6 = 1 chunk + 2 tokens, 11 = 2 chunks + 3 (chunk 4)
        tokens = [x[row : row + 1] for x in (q, k, v, theta, eta, alpha)]
        w, s = (tuple(x[row : row + 1] for x in xs) for xs in (weights, momentum))
        head = neural_memory_step(*(x[:, :split] for x in tokens), w, s, w, zero, num_heads=2, chunk_size=4)
        tail = [x[:, split : split + 7] for x in tokens]
        pieces.append((tail, head[1:]))
        alone.append(neural_memory_step(*tail, *head[1:], num_heads=2, chunk_size=4))
    (tail0, state0), (tail1, state1) = pieces
    tail = [torch.cat(pair) for pair in zip(tail0, tail1)]
    state = [tuple(map(torch.cat, zip(a, b))) for a, b in zip(state0[:3], state1[:3])]
    position = torch.cat([state0[3], state1[3]])
    got = neural_memory_step(*tail, *state, position, num_heads=2, chunk_size=4)
    want = [torch.cat(pair) for pair in zip(flat(alone[0]), flat(alone[1]))]
    assert position.tolist() == [6, 11]
    assert_all_close(flat(got), want, rtol=1e-10, atol=1e-10)


def test_fake_tensors_give_shapes_and_dtypes():
    q, k, v, theta, eta, alpha, weights, momentum = make(2, dtype=torch.float16)
    real = (q.flatten(2), k.flatten(2), v.flatten(2), theta, eta, alpha)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(x) for x in real]
        w = tuple(mode.from_tensor(x) for x in weights)
        s = tuple(mode.from_tensor(x) for x in momentum)
        y, w_out, s_out, wc_out, position = neural_memory_step(
            *fake, w, s, w, torch.zeros(2, dtype=torch.int64), num_heads=2, chunk_size=4
        )
    assert y.shape == (2, 10, 6) and y.dtype == torch.float16
    for got, want in zip((*w_out, *s_out, *wc_out), (*weights, *momentum, *weights)):
        assert got.shape == want.shape and got.dtype == torch.float32
    assert position.shape == (2,) and position.dtype == torch.int64


@pytest.mark.parametrize("residual_norm", [False, True])
@pytest.mark.parametrize("streaming", [False, True])
def test_custom_op_passes_opcheck(streaming, residual_norm):
    q, k, v, theta, eta, alpha, weights, momentum = make(2, b=2, t=3, h=1, d=2, e=2)
    chunk_weights = list(weights) if streaming else []
    position = torch.tensor([2, 7]) if streaming else None
    norm = list(make_norm(h=1, d=2)) if residual_norm else [None, None]
    args = [*(x.flatten(2) for x in (q, k, v)), theta, eta, alpha, list(weights), list(momentum)]
    args += [chunk_weights, position, *norm, 1, 2, "silu"]
    op = torch.ops.edgemem.neural_memory.default
    torch.library.opcheck(op, args)
    args[0] = args[0].requires_grad_()
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    assert OP_TYPE == "NeuralMemory"


@pytest.mark.parametrize("residual_norm", [False, True])
@pytest.mark.parametrize(("depth", "chunk_size", "streaming"), [(1, 4, False), (2, 3, False), (2, 4, True)])
def test_op_gradients_match_autograd_through_naive(depth, chunk_size, streaming, residual_norm):
    """The op's recompute backward equals autograd through the per-token form (γ, β included)."""
    inputs = make(depth, seed=8, t=11)
    leaves = [x.clone().requires_grad_() for x in inputs[:6]]
    states = [tuple(w.clone().requires_grad_() for w in inputs[i]) for i in (6, 7)]
    chunk_weights = tuple(w.flip(0).requires_grad_() for w in inputs[6])
    position = torch.tensor([1, 6])
    norm = [p.requires_grad_() for p in make_norm(8)] if residual_norm else []
    kw = dict(chunk_size=chunk_size, **norm_kwargs(norm or None))
    if streaming:
        out = neural_memory_step(*leaves, *states, chunk_weights, position, num_heads=2, **kw)
        ref = naive(*leaves, *states, chunk_weights, position, **kw)
        wrt = [*leaves, *states[0], *states[1], *chunk_weights, *norm]
    else:
        out = neural_memory(*leaves, *states, num_heads=2, **kw)
        ref = naive(*leaves, *states, **kw)[:3]
        wrt = [*leaves, *states[0], *states[1], *norm]
    got_out, ref_out = flat(out[:4]), flat(ref[:4])
    g = torch.Generator().manual_seed(0)
    cotangents = [torch.randn(x.shape, generator=g, dtype=F64) for x in ref_out]

    def grads(outputs):
        return torch.autograd.grad(sum((o * c).sum() for o, c in zip(outputs, cotangents)), wrt)

    assert_all_close(grads(got_out), grads(ref_out), rtol=1e-10, atol=1e-10)


def valid_step_args():
    q, k, v, theta, eta, alpha, weights, momentum = make(2, b=2, t=5, h=2, d=3, e=4)
    return dict(
        query=q.flatten(2),
        key=k.flatten(2),
        value=v.flatten(2),
        theta=theta,
        eta=eta,
        alpha=alpha,
        past_weights=weights,
        past_momentum=momentum,
        past_chunk_weights=weights,
        past_position=torch.zeros(1, dtype=torch.int64),
        num_heads=2,
        chunk_size=2,
        activation="silu",
    )


def heads4(x):
    return x.unflatten(2, (2, 3))


BAD_INPUTS = [  # (changes to the valid arguments, the message expected)
    (lambda a: {"key": a["key"][..., :4]}, r"key has shape \(2, 5, 4\), expected \(2, 5, 6\)"),
    (lambda a: {"query": a["query"][0]}, r"query has shape \(5, 6\), expected \(B, T, H\*D\) or \(B, T, H, D\)"),
    (lambda a: {"query": a["query"][..., :5]}, r"query has shape \(2, 5, 5\), expected .*divisible by num_heads=2"),
    (lambda a: {"num_heads": 4}, r"query has shape \(2, 5, 6\), expected .*divisible by num_heads=4"),
    (
        lambda a: {"query": heads4(a["query"]), "key": heads4(a["key"]), "value": a["value"]},
        r"value has shape \(2, 5, 6\), expected \(2, 5, 2, 3\)",
    ),
    (
        lambda a: {"query": heads4(a["query"]), "num_heads": 3},
        r"query has shape \(2, 5, 2, 3\), expected \(B, T, num_heads=3, D\)",
    ),
    (lambda a: {"theta": a["theta"][:, :4]}, r"theta has shape \(2, 4, 2\), expected \(2, 5, 2\)"),
    (lambda a: {"alpha": a["alpha"].long()}, r"alpha has dtype torch.int64, expected a floating dtype"),
    (lambda a: {"past_weights": a["past_weights"] * 2}, r"past_weights has 4 tensors, expected 1 \(depth 1\) or 2"),
    (
        lambda a: {"past_weights": a["past_weights"][:1]},
        r"past_weights\[0\] has shape \(2, 2, 3, 4\), expected \(2, 2, 3, 3\)",
    ),
    (
        lambda a: {"past_weights": (a["past_weights"][0], a["past_weights"][1][..., :3, :])},
        r"past_weights\[1\] has shape \(2, 2, 3, 3\), expected \(2, 2, 4, 3\)",
    ),
    (lambda a: {"past_momentum": a["past_momentum"][:1]}, r"past_momentum must be a tuple of 2 tensors"),
    (
        lambda a: {"past_chunk_weights": a["past_weights"][:1] * 2},
        r"past_chunk_weights\[1\] has shape \(2, 2, 3, 4\), expected \(2, 2, 4, 3\)",
    ),
    (
        lambda a: {"past_position": torch.zeros(3, dtype=torch.int64)},
        r"past_position has shape \(3,\), expected \(2,\) or \(1,\)",
    ),
    (lambda a: {"past_position": torch.zeros(2)}, r"past_position must be an int64 tensor"),
    (lambda a: {"chunk_size": 0}, r"chunk_size is 0, expected an integer >= 1"),
    (lambda a: {"activation": "tanh"}, r"activation is 'tanh', expected one of"),
    (lambda a: {"norm_weight": torch.ones(2, 3)}, r"give both norm_weight and norm_bias .* or neither"),
    (
        lambda a: {"norm_weight": torch.ones(2, 4), "norm_bias": torch.zeros(2, 3)},
        r"norm_weight has shape \(2, 4\), expected \(2, 3\)",
    ),
    (
        lambda a: {"norm_weight": torch.ones(2, 3), "norm_bias": torch.zeros(2, 3, dtype=torch.int64)},
        r"norm_bias has dtype torch.int64, expected a floating dtype",
    ),
]


@pytest.mark.parametrize(("change", "message"), BAD_INPUTS)
def test_bad_inputs_raise_shape_error(change, message):
    args = valid_step_args()
    neural_memory_step(**args)  # the valid arguments pass
    with pytest.raises(ShapeError, match=message):
        neural_memory_step(**{**args, **change(args)})


def test_neural_memory_rejects_bad_input_too():
    q, k, v, theta, eta, alpha, weights, momentum = make(1)
    with pytest.raises(ShapeError, match=r"eta has shape \(2, 10\), expected \(2, 10, 2\)"):
        neural_memory(q, k, v, theta, eta[..., 0], alpha, weights, momentum, num_heads=2)
