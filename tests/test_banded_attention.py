"""BandedAttention: both forms and the custom op agree with a dense masked softmax; no T×T tensor."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from edgemem.errors import ShapeError
from edgemem.ops.banded_attention import (
    OP_TYPE,
    banded_attention,
    banded_attention_chunk,
    banded_attention_naive,
)

B, T, H, D, DV = 2, 13, 3, 4, 5


def make_inputs(*, b=B, t=T, h=H, d=D, dv=DV, p=0, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    q, k, v = rand(b, t, h, d), rand(b, t, h, d), rand(b, t, h, dv)
    pk, pv = (rand(h, p, d), rand(h, p, dv)) if p else (None, None)
    return q, k, v, pk, pv


def global_mask(b=B, t=T, positions=((0, 5), (3, 7, 12))):
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i, pos in enumerate(positions[:b]):
        mask[i, list(pos)] = True
    return mask


def dense_reference(q, k, v, *, window, dilation, causal=False, global_mask=None, scale=None, pk=None, pv=None):
    """The rule as a [B, H, T, T] mask over a float64 softmax."""
    b, t, h, d = q.shape
    dil = torch.tensor([dilation] * h if isinstance(dilation, int) else dilation)[None, :, None, None]
    dist = torch.arange(t)[:, None] - torch.arange(t)[None, :]  # i − j
    mask = (dist.abs() <= window * dil) & (dist % dil == 0)
    if global_mask is not None:
        mask = mask | global_mask[:, None, None, :] | global_mask[:, None, :, None]
    if causal:
        mask = mask & (dist >= 0)
    scale = d**-0.5 if scale is None else scale
    scores = torch.einsum("bihd,bjhd->bhij", q.double(), k.double()) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    values = v.double().transpose(1, 2)
    if pk is not None:
        extra = torch.einsum("bihd,hpd->bhip", q.double(), pk.double()) * scale
        scores = torch.cat([scores, extra], -1)
        values = torch.cat([values, pv.double().expand(b, -1, -1, -1)], 2)
    return torch.einsum("bhij,bhjd->bihd", scores.softmax(-1), values)


FORMS = {
    "naive": banded_attention_naive,
    "chunk": banded_attention_chunk,
    "op": lambda q, k, v, **kw: banded_attention(q, k, v, num_heads=q.shape[2], **kw),
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dilation", [1, 2, 3, [1, 3, 2]])
@pytest.mark.parametrize("globals_", [False, True])
@pytest.mark.parametrize("persistent", [0, 3])
def test_forms_equal_dense_reference_fp64(form, causal, dilation, globals_, persistent):
    q, k, v, pk, pv = make_inputs(p=persistent)
    mask = global_mask() if globals_ else None
    kw = dict(window=2, dilation=dilation, causal=causal, global_mask=mask)
    out = FORMS[form](q, k, v, **kw, persistent_key=pk, persistent_value=pv)
    ref = dense_reference(q, k, v, **kw, pk=pk, pv=pv)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("causal", [False, True])
def test_forms_equal_dense_reference_fp32(form, causal):
    q, k, v, pk, pv = make_inputs(t=33, p=2, dtype=torch.float32, seed=1)
    kw = dict(window=3, dilation=[1, 2, 4], causal=causal, global_mask=global_mask(t=33), scale=0.3)
    out = FORMS[form](q, k, v, **kw, persistent_key=pk, persistent_value=pv)
    assert out.dtype == torch.float32
    ref = dense_reference(q, k, v, **kw, pk=pk, pv=pv)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [T - 1, T, 100])
def test_window_covering_the_sequence_is_full_attention(form, causal, window):
    q, k, v, _, _ = make_inputs(dv=D)
    out = FORMS[form](q, k, v, window=window, causal=causal)
    full = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal)
    torch.testing.assert_close(out, full.transpose(1, 2), rtol=1e-12, atol=1e-12)


def test_global_everywhere_is_full_attention_and_nowhere_is_none():
    q, k, v, _, _ = make_inputs(dv=D)
    everywhere = torch.ones(B, T, dtype=torch.bool)
    full = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
    torch.testing.assert_close(banded_attention_chunk(q, k, v, window=1, global_mask=everywhere), full)
    nowhere = banded_attention_chunk(q, k, v, window=1, global_mask=torch.zeros(B, T, dtype=torch.bool))
    torch.testing.assert_close(nowhere, banded_attention_chunk(q, k, v, window=1), rtol=0, atol=0)
    assert (banded_attention_chunk(q, k, v, window=1) - full).abs().max() > 1e-2


def test_persistent_per_sequence_and_shared_agree():
    q, k, v, pk, pv = make_inputs(p=2)
    shared = banded_attention(q, k, v, num_heads=H, window=2, persistent_key=pk, persistent_value=pv)
    per_seq = banded_attention(
        q,
        k,
        v,
        num_heads=H,
        window=2,
        persistent_key=pk.expand(B, -1, -1, -1),
        persistent_value=pv.expand(B, -1, -1, -1),
    )
    torch.testing.assert_close(shared, per_seq, rtol=0, atol=0)


def test_layouts_and_dtypes():
    q, k, v, _, _ = make_inputs(dtype=torch.float32)
    kw = dict(num_heads=H, window=2, dilation=2, causal=True, global_mask=global_mask())
    unpacked = banded_attention(q, k, v, **kw)
    packed = banded_attention(q.flatten(2), k.flatten(2), v.flatten(2), **kw)
    assert unpacked.shape == (B, T, H, DV) and packed.shape == (B, T, H * DV)
    torch.testing.assert_close(packed, unpacked.flatten(2), rtol=0, atol=0)
    half = banded_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), **kw)
    assert half.dtype == torch.bfloat16
    upcast = banded_attention(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), **kw)
    torch.testing.assert_close(half, upcast.bfloat16(), rtol=0, atol=0)  # float32 math, one final rounding


class LargestTensor(TorchDispatchMode):
    """Records the largest storage (in elements) any op produces."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.untyped_storage().nbytes() // x.element_size())
        return out


@pytest.mark.parametrize("causal", [False, True])
def test_fast_form_allocates_no_t_by_t_tensor_and_no_band_gather(causal):
    """Blocks of s = window·max(dilation) = 24 queries: no tensor outgrows three copies of the keys
    or the [B, H, T/s, s, 3s] block scores; a gathered band ([B, H, T, 2w+1, D]) would be 4.4× that."""
    t, d, size = 512, 64, 24
    q, k, v, pk, pv = make_inputs(b=1, t=t, h=2, d=d, dv=d, p=4, dtype=torch.float32)
    mask = torch.zeros(1, t, dtype=torch.bool)
    mask[0, [0, 100, 400]] = True
    for x in (q, k, v, pk, pv):
        x.requires_grad_()
    kw = dict(window=8, dilation=[1, 3], causal=causal, global_mask=mask)
    with LargestTensor() as fast:
        out = banded_attention_chunk(q, k, v, **kw, persistent_key=pk, persistent_value=pv)
        torch.autograd.grad(out.sum(), (q, k, v, pk, pv))
    padded = -(-t // size) * size
    assert fast.largest <= 3 * 2 * padded * max(d, 3 * size) < 2 * t * 17 * d
    with LargestTensor() as dense:  # the check can fail
        dense_reference(q.detach(), k.detach(), v.detach(), **kw)
    assert dense.largest >= t * t


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("t", [1, 5, 6, 7, 12, 19])
def test_fast_form_at_block_boundaries(t, causal):
    """Blocks of s = 3·2 = 6 queries: lengths below, at and past one and several blocks, with global
    tokens first, last and between, and persistent keys."""
    q, k, v, pk, pv = make_inputs(t=t, p=2)
    kw = dict(
        window=3, dilation=[1, 2, 1], causal=causal, global_mask=global_mask(t=t, positions=((0,), (t // 2, t - 1)))
    )
    out = banded_attention_chunk(q, k, v, **kw, persistent_key=pk, persistent_value=pv)
    torch.testing.assert_close(out, dense_reference(q, k, v, **kw, pk=pk, pv=pv), rtol=1e-12, atol=1e-12)


def test_custom_op_opcheck_and_fake_tensors():
    q, k, v, pk, pv = make_inputs(t=7, p=2)
    args = (
        q.flatten(2).requires_grad_(),
        k.flatten(2).requires_grad_(),
        v.flatten(2).requires_grad_(),
        global_mask(t=7, positions=((0,), (2, 6))),
        pk.requires_grad_(),
        pv.requires_grad_(),
        H,
        2,
        [1, 2, 1],
        True,
        0.5,
    )
    torch.library.opcheck(torch.ops.edgemem.banded_attention.default, args)
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(x) for x in (q, k, v))
        out = banded_attention(fq, fk, fv, num_heads=H, window=2, global_mask=mode.from_tensor(global_mask(t=7)))
    assert out.shape == (B, 7, H, DV) and out.dtype == torch.float64
    assert OP_TYPE == "BandedAttention"


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_equal_autograd_through_naive(causal):
    q, k, v, pk, pv = make_inputs(t=9, p=2)
    inputs = [x.requires_grad_() for x in (q, k, v, pk, pv)]
    kw = dict(window=2, dilation=[1, 2, 3], causal=causal, global_mask=global_mask(t=9, positions=((4,), (0, 8))))
    out = banded_attention(q, k, v, num_heads=H, **kw, persistent_key=pk, persistent_value=pv)
    ref = banded_attention_naive(q, k, v, **kw, persistent_key=pk, persistent_value=pv)
    cotangent = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, cotangent)
    expected = torch.autograd.grad(ref, inputs, cotangent)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_gradients_only_for_inputs_that_need_them():
    q, k, v, pk, pv = make_inputs(t=6, p=2)
    q.requires_grad_()
    out = banded_attention(q, k, v, num_heads=H, window=1, persistent_key=pk, persistent_value=pv)
    (grad,) = torch.autograd.grad(out.sum(), q)
    assert grad.shape == q.shape and k.grad is None and pk.grad is None


def zeros(*shape):
    return torch.zeros(*shape, dtype=torch.float64)


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(query=torch.zeros(2, 5)), "query is shape (2, 5) torch.float32; expected [B, T, H*D] or [B, T, H, D]"),
        (dict(key=zeros(B, T + 1, H * D)), "key has shape"),
        (dict(value=zeros(B, T, H * DV + 1)), "value has shape"),
        (dict(query=zeros(B, T, H, D)), "key has shape"),  # layouts mixed
        (
            dict(query=torch.zeros(B, T, H * D, dtype=torch.float32)),
            "key is shape (2, 13, 12) torch.float64; expected a floating tensor of query's dtype",
        ),
        (dict(value=torch.zeros(B, T, H * DV, dtype=torch.int64)), "value is shape"),
        (dict(num_heads=0), "num_heads"),
        (dict(window=0), "window must be an int >= 1; got 0"),
        (dict(dilation=[1, 2]), "one such int per head (3); got [1, 2]"),
        (dict(dilation=0), "dilation"),
        (dict(global_mask=torch.zeros(B, T + 1, dtype=torch.bool)), f"expected a bool tensor [B, T] = [{B}, {T}]"),
        (dict(global_mask=torch.zeros(B, T)), "global_mask is shape"),
        (dict(persistent_key=zeros(H, 2, D)), "persistent_value is None"),
        (dict(persistent_key=zeros(H, 2, D + 1), persistent_value=zeros(H, 2, DV)), "persistent_key"),
        (dict(persistent_key=zeros(H, 2, D), persistent_value=zeros(H, 3, DV)), "leading dims"),
        (dict(scale="big"), "scale"),
    ],
)
def test_bad_inputs_raise_shape_error(change, message):
    q, k, v, _, _ = make_inputs()
    kwargs = dict(query=q.flatten(2), key=k.flatten(2), value=v.flatten(2), num_heads=H, window=2) | change
    with pytest.raises(ShapeError) as err:
        banded_attention(**kwargs)
    assert message in str(err.value)
    assert isinstance(err.value, ValueError)
