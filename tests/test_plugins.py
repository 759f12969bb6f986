"""plugins/: the CPU reference of the kernels' math ≡ edgemem.ops; the CUDA kernels compile for
Orin, Ada and Hopper with no register spills or local memory; the TensorRT glue builds against
the TensorRT 10.3 and 11.1 headers and registers into a real TensorRT plugin registry.

Levels and what each needs (missing tools skip with the reason):
  reference  CMake (or g++ alone) — runs everywhere, on every CI run;
  kernels    nvcc — compiled once per session for sm_87, sm_89, sm_90, ptxas output parsed;
  trt glue   TensorRT headers: `EDGEMEM_TENSORRT_ROOTS` (several, os.pathsep-separated) or
             `TensorRT_ROOT` (one) naming an installation or a TensorRT repository checkout;
             by default every version under ../shared/third_party/tensorrt (10.3.0 and 11.1);
  registry   the glue plus a TensorRT plugin registry, no GPU needed: `tensorrt_lean_bindings`
             (pip: tensorrt-lean-cu13-bindings and tensorrt-lean-cu13-libs) and/or `tensorrt_rtx`
             (pip: tensorrt-rtx-cu13; tests/test_rtx.py builds engines with it).
The kernels themselves run in plugins/scripts/gpu_check.sh on a machine with a GPU.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = ROOT / "plugins"
sys.path.insert(0, str(PLUGINS / "python"))

from edgemem_native import LA_PATHS, LAIO, Native, NativeError  # noqa: E402
from plugin_build import assert_no_spills, need_nvcc  # noqa: E402
from plugin_build import cmake_build as _cmake_build  # noqa: E402
from plugin_build import run as _run  # noqa: E402

from edgemem.ops import banded_attention, neural_memory_step, window_attention_prefill  # noqa: E402
from edgemem.ops.linear_attention import UPDATE_RULES, linear_attention  # noqa: E402

ARCHS = ("87", "89", "90")  # Orin, Ada, Hopper: the default CUDA architectures of the CMake build
FP32_TOL = 2e-6  # max |reference - truth| / max(1, max |truth|), truth = edgemem.ops in float64


# ---------------------------------------------------------------------------------------------
# fixtures: one build tree per session


@pytest.fixture(scope="session")
def build_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("plugins_build")


@pytest.fixture(scope="session")
def ref(build_dir) -> Native:
    """The CPU reference library: CMake target edgemem_reference, or g++ directly without CMake."""
    if shutil.which("cmake"):
        _cmake_build(build_dir, "-DEDGEMEM_BUILD_TRT=OFF", targets=("edgemem_reference",))
        return Native(build_dir / "libedgemem_reference.so")
    cxx = shutil.which("g++") or shutil.which("c++")
    if not cxx:
        pytest.skip("neither cmake nor a C++ compiler (g++) is installed")
    lib = build_dir / "libedgemem_reference.so"
    ops = re.findall(r"^EM_OP\(\w+, *(\w+)\)", (PLUGINS / "ops.def").read_text(), re.M)
    sources = [PLUGINS / "core" / "reference.cpp", *(PLUGINS / op / "reference.cpp" for op in ops)]
    _run(
        [
            cxx,
            "-std=c++17",
            "-O2",
            "-shared",
            "-fPIC",
            "-fvisibility=hidden",
            f"-I{PLUGINS}",
            f"-I{PLUGINS / 'core'}",
            *map(str, sources),
            "-o",
            str(lib),
        ]
    )
    return Native(lib)


@pytest.fixture(scope="session")
def kernels_build(build_dir, ref) -> Path:
    """Every target of the tree as shipped (the kernels for sm_87/89/90, fatbinaries compressed for size where
    nvcc can); skips without nvcc."""
    need_nvcc()
    info = _cmake_build(build_dir, "-DEDGEMEM_COMPRESS_KERNELS=ON")
    if info.get("cuda") != "ON":
        pytest.skip("CMake found no usable CUDA compiler (put nvcc on PATH or set CUDACXX)")
    return build_dir


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = FP32_TOL) -> float:
    err = ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1.0)).item()
    assert err <= tol, f"relative error {err:.2e} > {tol:.0e}"
    return err


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x.float().contiguous()


# ---------------------------------------------------------------------------------------------
# LinearAttention


def _la_inputs(rule, *, b, t, hq, hkv, dk, dv, per_key, beta_heads, seed=0):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    q = rand(b, t, hq * dk)
    k = torch.nn.functional.normalize(rand(b, t, hkv, dk), dim=-1).flatten(2)
    v = rand(b, t, hkv * dv)
    s0 = rand(b, hkv, dk, dv)
    gated, delta = rule in ("gated", "gated_delta"), rule in ("delta", "gated_delta")
    decay = -torch.rand(b, t, hkv * (dk if per_key else 1), generator=g, dtype=torch.float64) if gated else None
    beta = torch.rand(b, t, hkv if beta_heads else 1, generator=g, dtype=torch.float64) if delta else None
    # the node always carries decay and beta (zero log-decay, unit beta when the rule reads none)
    node = dict(
        decay=_f32(decay) if gated else torch.zeros(b, t, hkv), beta=_f32(beta) if delta else torch.ones(b, t, hkv)
    )
    return (q, k, v, s0, decay, beta), node


LA_SHAPES = {  # b, t, hq, hkv, dk, dv
    "mha": (2, 9, 2, 2, 16, 16),
    "gqa": (2, 7, 4, 2, 8, 12),
    "mqa-odd": (1, 5, 3, 1, 5, 7),
    "wide-dk": (1, 4, 2, 1, 160, 9),
    "dk128": (1, 3, 1, 1, 128, 64),
}


def test_ctypes_mirror_matches_the_c_structs(ref):
    """edgemem_native's ctypes structs have the size and field offsets of the compiled C structs (the
    reference library reports them), and a mirror that drifts is named, not used."""
    import edgemem_native

    layout = ref.lib.em_ref_abi_layout().decode()
    assert edgemem_native.layout_mismatches(layout) == []
    structs = {line.split(" ")[0] for line in layout.splitlines() if "." not in line.split(" ")[0]}
    assert structs == {s.c_name for s in edgemem_native.STRUCTS} and len(structs) == 8
    drifted = layout.replace("la::Params.scale 28", "la::Params.scale 32").replace("nm::Params 40", "nm::Params 44")
    wrong = edgemem_native.layout_mismatches(drifted)
    assert (
        len(wrong) == 2
        and wrong[0].startswith("la::Params: fields")
        and "nm::Params: 40 bytes in Python, 44 in C" in wrong[1]
    )


@pytest.mark.parametrize("shape", list(LA_SHAPES))
@pytest.mark.parametrize("rule,per_key", [(r, False) for r in UPDATE_RULES] + [("gated", True), ("gated_delta", True)])
def test_reference_linear_attention_prefill(ref, rule, per_key, shape):
    b, t, hq, hkv, dk, dv = LA_SHAPES[shape]
    (q, k, v, s0, decay, beta), node = _la_inputs(
        rule, b=b, t=t, hq=hq, hkv=hkv, dk=dk, dv=dv, per_key=per_key, beta_heads=shape != "mqa-odd"
    )
    want, want_state = linear_attention(q, k, v, s0, decay, beta, update_rule=rule, q_num_heads=hq, kv_num_heads=hkv)
    out, state = ref.linear_attention(
        _f32(q),
        _f32(k),
        _f32(v),
        _f32(s0),
        node["decay"],
        node["beta"],
        update_rule=rule,
        scale=1 / math.sqrt(dk),
        q_num_heads=hq,
        kv_num_heads=hkv,
    )
    _close(out, want)
    _close(state, want_state)


@pytest.mark.parametrize("rule", UPDATE_RULES)
def test_reference_linear_attention_steps_in_place(ref, rule):
    """T single-token calls on one state buffer (state-in = state-out) reproduce one prefill."""
    b, t, hq, hkv, dk, dv = 2, 6, 4, 2, 8, 5
    (q, k, v, s0, decay, beta), node = _la_inputs(
        rule, b=b, t=t, hq=hq, hkv=hkv, dk=dk, dv=dv, per_key=True, beta_heads=True, seed=1
    )
    want, want_state = linear_attention(q, k, v, s0, decay, beta, update_rule=rule, q_num_heads=hq, kv_num_heads=hkv)
    state = _f32(s0)
    outs = []
    for i in range(t):
        tok = lambda x: _f32(x[:, i : i + 1])  # noqa: E731
        out, same = ref.linear_attention(
            tok(q),
            tok(k),
            tok(v),
            state,
            tok(node["decay"]),
            tok(node["beta"]),
            update_rule=rule,
            scale=1 / math.sqrt(dk),
            q_num_heads=hq,
            kv_num_heads=hkv,
            present_state=state,
        )
        assert same is state
        outs.append(out)
    _close(torch.cat(outs, 1), want)
    _close(state, want_state)


CHUNKED_SHAPES = {  # b, t, hq, hkv, dk, dv: several chunks, a partial last one, GQA, d_k != d_v, padded tiles
    "gqa": (2, 150, 4, 2, 16, 24),
    "mha-odd": (1, 130, 2, 2, 33, 70),
    "one-chunk": (1, 64, 1, 1, 8, 8),
    "short": (2, 5, 2, 1, 5, 7),
}


@pytest.mark.parametrize("shape", list(CHUNKED_SHAPES))
@pytest.mark.parametrize("rule,per_key", [(r, False) for r in UPDATE_RULES] + [("gated", True), ("gated_delta", True)])
def test_reference_chunked_form_equals_the_op(ref, rule, per_key, shape):
    """The chunked (UT/WY) form the CUDA prefill runs, pass for pass on its workspace layout, against
    edgemem.ops in float64, per-head and per-key decay; in segments of one chunk too (the state
    passing through present_state)."""
    b, t, hq, hkv, dk, dv = CHUNKED_SHAPES[shape]
    (q, k, v, s0, decay, beta), node = _la_inputs(
        rule, b=b, t=t, hq=hq, hkv=hkv, dk=dk, dv=dv, per_key=per_key, beta_heads=shape != "short", seed=3
    )
    want, want_state = linear_attention(q, k, v, s0, decay, beta, update_rule=rule, q_num_heads=hq, kv_num_heads=hkv)
    args = (_f32(q), _f32(k), _f32(v), _f32(s0), node["decay"], node["beta"])
    kw = dict(update_rule=rule, scale=1 / math.sqrt(dk), q_num_heads=hq, kv_num_heads=hkv, path="chunked")
    one_chunk = ref.linear_attention_workspace(
        *(x[:, :64].contiguous() for x in (args[0], args[2], args[4], args[5])),
        **{k: v for k, v in kw.items() if k != "path"},
    )
    for budget in (None, one_chunk):
        out, state = ref.linear_attention(*args, workspace=budget, **kw)
        _close(out, want, 1e-5)
        _close(state, want_state, 1e-5)


def test_reference_chunked_form_keeps_strong_per_key_decay_finite(ref):
    """Log decays down to -8 a token and key dim (exp(-G) far past float32 inside a chunk): the
    chunked form's decayed products stay finite and equal the op in float64."""
    b, t, hq, hkv, dk, dv = 1, 140, 2, 1, 32, 16
    (q, k, v, s0, _, beta), node = _la_inputs(
        "gated_delta", b=b, t=t, hq=hq, hkv=hkv, dk=dk, dv=dv, per_key=True, beta_heads=True, seed=5
    )
    decay = -8 * torch.rand(b, t, hkv * dk, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    decay[..., : dk // 2] /= 64  # half the key dims keep their memory across chunks
    want, want_state = linear_attention(
        q, k, v, s0, decay, beta, update_rule="gated_delta", q_num_heads=hq, kv_num_heads=hkv
    )
    out, state = ref.linear_attention(
        _f32(q),
        _f32(k),
        _f32(v),
        _f32(s0),
        _f32(decay),
        node["beta"],
        update_rule="gated_delta",
        scale=1 / math.sqrt(dk),
        q_num_heads=hq,
        kv_num_heads=hkv,
        path="chunked",
    )
    assert torch.isfinite(out).all() and torch.isfinite(state).all()
    _close(out, want, 1e-5)
    _close(state, want_state, 1e-5)


def test_reference_chunked_form_refuses_what_it_does_not_cover(ref):
    """d_k > 128 keeps the sequential form; a budget below one chunk fits nothing."""
    for dk, budget in ((160, None), (16, 1000)):
        (q, k, v, s0, _, _), node = _la_inputs(
            "gated", b=1, t=70, hq=1, hkv=1, dk=dk, dv=8, per_key=False, beta_heads=True
        )
        with pytest.raises(NativeError, match="unsupported"):
            ref.linear_attention(
                _f32(q),
                _f32(k),
                _f32(v),
                _f32(s0),
                node["decay"],
                node["beta"],
                update_rule="gated",
                scale=0.5,
                q_num_heads=1,
                kv_num_heads=1,
                path="chunked",
                workspace=budget,
            )


def test_reference_rejects_contract_violations(ref):
    (q, k, v, s0, _, _), node = _la_inputs("linear", b=1, t=2, hq=3, hkv=2, dk=4, dv=4, per_key=False, beta_heads=True)
    with pytest.raises(NativeError, match="bad argument"):  # 3 query heads over 2 kv heads
        ref.linear_attention(
            _f32(q),
            _f32(k),
            _f32(v),
            _f32(s0),
            node["decay"],
            node["beta"],
            update_rule="linear",
            scale=0.5,
            q_num_heads=3,
            kv_num_heads=2,
        )


# ---------------------------------------------------------------------------------------------
# WindowAttention and BandedAttention


def _rand(g, *shape):
    return torch.randn(*shape, generator=g, dtype=torch.float64)


@pytest.mark.parametrize(
    "t,position,persistent,dilation",
    [
        (1, (0, 0), 2, (1, 1, 1)),
        (1, (5, 40), 0, (1, 2, 3)),
        (1, (11, 12), 3, (2, 2, 1)),  # steps
        (13, (0, 7), 2, (1, 2, 3)),
        (30, (3, 0), 0, (1, 1, 2)),
        (4, (100, 9), 1, (3, 1, 2)),
    ],  # prefill, ring wraps
)
def test_reference_window_attention(ref, t, position, persistent, dilation):
    g = torch.Generator().manual_seed(t)
    b, h, d, dv, window = 2, 3, 5, 7, 4
    ring = window * max(dilation)
    q, k, v = _rand(g, b, t, h * d), _rand(g, b, t, h * d), _rand(g, b, t, h * dv)
    pk, pv = _rand(g, b, h, persistent, d), _rand(g, b, h, persistent, dv)
    rk, rv = _rand(g, b, h, ring, d), _rand(g, b, h, ring, dv)
    pos = torch.tensor(position, dtype=torch.int64)
    kw = dict(num_heads=h, window=window, dilation=list(dilation), scale=0.3)
    want = window_attention_prefill(
        q,
        k,
        v,
        rk,
        rv,
        pos,
        persistent_key=pk if persistent else None,
        persistent_value=pv if persistent else None,
        **kw,
    )
    got = ref.window_attention(_f32(q), _f32(k), _f32(v), _f32(rk), _f32(rv), pos, _f32(pk), _f32(pv), **kw)
    for x, y in zip(got, want):
        _close(x, y)
    # in place: the ring buffers are both past and present
    rk32, rv32 = _f32(rk), _f32(rv)
    got = ref.window_attention(
        _f32(q), _f32(k), _f32(v), rk32, rv32, pos, _f32(pk), _f32(pv), present_key=rk32, present_value=rv32, **kw
    )
    for x, y in zip(got, want):
        _close(x, y)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "globals_,persistent,dilation", [(False, 0, (1, 1, 1)), (True, 2, (1, 2, 3)), (True, 0, (2, 1, 3))]
)
def test_reference_banded_attention(ref, causal, globals_, persistent, dilation):
    g = torch.Generator().manual_seed(3)
    b, t, h, d, dv, window = 2, 23, 3, 6, 5, 2
    q, k, v = _rand(g, b, t, h * d), _rand(g, b, t, h * d), _rand(g, b, t, h * dv)
    pk, pv = _rand(g, b, h, persistent, d), _rand(g, b, h, persistent, dv)
    mask = (torch.rand(b, t, generator=g) < 0.15) if globals_ else torch.zeros(b, t, dtype=torch.bool)
    if globals_:
        mask[0, 0] = mask[1, t - 1] = True
    kw = dict(num_heads=h, window=window, dilation=list(dilation), causal=causal, scale=0.4)
    want = banded_attention(
        q,
        k,
        v,
        global_mask=mask,
        persistent_key=pk if persistent else None,
        persistent_value=pv if persistent else None,
        **kw,
    )
    got = ref.banded_attention(_f32(q), _f32(k), _f32(v), mask.contiguous(), _f32(pk), _f32(pv), **kw)
    _close(got, want)


@pytest.mark.parametrize(
    "t,window,dilation,causal,frac,persistent",
    [
        (150, 8, (1, 3), False, 0.05, 20),  # three query blocks, two persistent tiles
        (150, 8, (1, 3), True, 0.05, 0),
        (70, 40, (2, 1), False, 0.0, 3),  # a band wider than a block
        (200, 2, (1, 1), True, 0.3, 0),  # several tiles of global keys outside the span
        (64, 1, (4, 1), False, 1.0, 0),  # every row global
    ],
)
def test_reference_tiled_banded_attention_equals_the_op(ref, t, window, dilation, causal, frac, persistent):
    """The tiled form the CUDA prefill runs (64 query rows against 16-key tiles: the band's span, then
    the global keys outside it, then the persistent keys, one online softmax) against edgemem.ops in float64."""
    g = torch.Generator().manual_seed(t + window)
    b, h, d, dv = 2, 2, 16, 32
    q, k, v = _rand(g, b, t, h * d), _rand(g, b, t, h * d), _rand(g, b, t, h * dv)
    pk, pv = _rand(g, b, h, persistent, d), _rand(g, b, h, persistent, dv)
    mask = torch.rand(b, t, generator=g) < frac
    kw = dict(num_heads=h, window=window, dilation=list(dilation), causal=causal, scale=d**-0.5)
    want = banded_attention(
        q,
        k,
        v,
        global_mask=mask,
        persistent_key=pk if persistent else None,
        persistent_value=pv if persistent else None,
        **kw,
    )
    got = ref.banded_attention(_f32(q), _f32(k), _f32(v), mask.contiguous(), _f32(pk), _f32(pv), **kw, tiled=True)
    _close(got, want)


def test_reference_tiled_banded_attention_refuses_partial_tiles(ref):
    """Head dims that are not whole 16 x 16 tiles, or above 128, keep the row-per-warp form."""
    for d, dv in ((12, 16), (16, 144)):
        q, k, v = torch.zeros(1, 4, d), torch.zeros(1, 4, d), torch.zeros(1, 4, dv)
        p = torch.zeros(1, 1, 0, d), torch.zeros(1, 1, 0, dv)
        with pytest.raises(NativeError, match="unsupported"):
            ref.banded_attention(
                q,
                k,
                v,
                torch.zeros(1, 4, dtype=torch.bool),
                *p,
                num_heads=1,
                window=1,
                dilation=[1],
                causal=False,
                scale=1.0,
                tiled=True,
            )


# ---------------------------------------------------------------------------------------------
# NeuralMemory


def _nm_case(*, b, t, h, d, e, depth, chunk, activation, norm, position, seed=0):
    g = torch.Generator().manual_seed(seed)
    unit = lambda x: torch.nn.functional.normalize(x.view(b, t, h, d), dim=-1).flatten(2)  # noqa: E731
    q, k, v = unit(_rand(g, b, t, h * d)), unit(_rand(g, b, t, h * d)), _rand(g, b, t, h * d)
    theta = torch.rand(b, t, h, generator=g, dtype=torch.float64) * 0.2
    eta = torch.rand(b, t, h, generator=g, dtype=torch.float64)
    alpha = torch.rand(b, t, h, generator=g, dtype=torch.float64) * 0.1
    shapes = [(b, h, d, d)] if depth == 1 else [(b, h, d, e), (b, h, e, d)]
    w = [_rand(g, *s) * 0.3 for s in shapes]
    s = [_rand(g, *s) * 0.1 for s in shapes]
    c = [_rand(g, *s) * 0.3 for s in shapes]
    nw = _rand(g, h, d) * 0.2 + 1 if norm else None
    nb = _rand(g, h, d) * 0.1 if norm else None
    pos = torch.tensor(position, dtype=torch.int64)
    return (q, k, v, theta, eta, alpha, w, s, c, pos, nw, nb)


def _nm_native(lib, case, *, h, chunk, activation, present=None, chunked=False):
    q, k, v, theta, eta, alpha, w, s, c, pos, nw, nb = case
    d = q.shape[2] // h
    norm_w = _f32(nw) if nw is not None else torch.ones(h, d)
    norm_b = _f32(nb) if nb is not None else torch.zeros(h, d)
    return lib.neural_memory(
        _f32(q),
        _f32(k),
        _f32(v),
        _f32(theta),
        _f32(eta),
        _f32(alpha),
        pos,
        norm_w,
        norm_b,
        [_f32(x) for x in w],
        [_f32(x) for x in s],
        [_f32(x) for x in c],
        num_heads=h,
        chunk_size=chunk,
        activation=activation,
        residual_norm=nw is not None,
        present=present,
        chunked=chunked,
    )


@pytest.mark.parametrize(
    "depth,activation,norm,chunk,t,position",
    [
        (2, "silu", False, 4, 9, (0, 3)),
        (2, "gelu", True, 3, 7, (5, 0)),
        (2, "relu", False, 1, 6, (2, 2)),
        (2, "identity", True, 16, 5, (14,)),
        (1, "silu", False, 2, 8, (1, 4)),
        (1, "silu", True, 5, 11, (0,)),
        (2, "silu", False, 4, 1, (3, 8)),
        (1, "silu", True, 3, 1, (6, 7)),
    ],  # the last two: decode steps
)
def test_reference_neural_memory(ref, depth, activation, norm, chunk, t, position):
    b, h, d, e = 2, 2, 6, 10
    case = _nm_case(
        b=b, t=t, h=h, d=d, e=e, depth=depth, chunk=chunk, activation=activation, norm=norm, position=position
    )
    q, k, v, theta, eta, alpha, w, s, c, pos, nw, nb = case
    want = neural_memory_step(
        q,
        k,
        v,
        theta,
        eta,
        alpha,
        w,
        s,
        c,
        pos,
        num_heads=h,
        chunk_size=chunk,
        activation=activation,
        norm_weight=nw,
        norm_bias=nb,
    )
    y, end, w_out, s_out, c_out = _nm_native(ref, case, h=h, chunk=chunk, activation=activation)
    _close(y, want[0])
    for got, exp in zip((*w_out, *s_out, *c_out), (*want[1], *want[2], *want[3])):
        _close(got, exp)
    assert torch.equal(end, want[4])


@pytest.mark.parametrize(
    "depth,activation,norm,chunk,t,position",
    [
        (2, "silu", False, 16, 37, (0, 5)),  # whole pieces, and a call that starts mid-chunk
        (2, "gelu", True, 5, 23, (3, 0)),  # chunks shorter than a piece
        (2, "relu", False, 40, 45, (7, 38)),  # chunks longer than a piece
        (2, "identity", True, 16, 3, (14,)),
        (1, "silu", False, 16, 33, (1, 16)),
        (1, "silu", True, 3, 10, (2,)),
        (2, "silu", True, 16, 1, (4, 15)),  # a decode step
    ],
)
def test_reference_chunked_neural_memory_equals_the_op(ref, depth, activation, norm, chunk, t, position):
    """The chunked form the CUDA prefill runs (pieces of up to 16 tokens sharing the chunk weights, as
    matrix products) against edgemem.ops in float64: outputs, weights, momentum, chunk weights."""
    b, h, d, e = len(position), 2, 16, 32
    case = _nm_case(
        b=b, t=t, h=h, d=d, e=e, depth=depth, chunk=chunk, activation=activation, norm=norm, position=position, seed=5
    )
    q, k, v, theta, eta, alpha, w, s, c, pos, nw, nb = case
    want = neural_memory_step(
        *case[:10],
        num_heads=h,
        chunk_size=chunk,
        activation=activation,
        norm_weight=nw,
        norm_bias=nb,
    )
    y, end, w_out, s_out, c_out = _nm_native(ref, case, h=h, chunk=chunk, activation=activation, chunked=True)
    _close(y, want[0])
    for got, exp in zip((*w_out, *s_out, *c_out), (*want[1], *want[2], *want[3])):
        _close(got, exp)
    assert torch.equal(end, want[4])
    # in place: present and past one set of buffers
    state = [pos.clone(), [_f32(x) for x in w], [_f32(x) for x in s], [_f32(x) for x in c]]
    inplace = (*case[:6], *state[1:], state[0], nw, nb)
    y2, *_ = _nm_native(ref, inplace, h=h, chunk=chunk, activation=activation, present=state, chunked=True)
    assert torch.equal(y2, y)
    for got, exp in zip((*state[1], *state[2], *state[3]), (*w_out, *s_out, *c_out)):
        assert torch.equal(got, exp)


def test_reference_chunked_neural_memory_refuses_partial_tiles(ref):
    """Head and hidden sizes that are not whole 16 x 16 tiles keep the sequential form."""
    case = _nm_case(b=1, t=4, h=1, d=12, e=32, depth=2, chunk=4, activation="silu", norm=False, position=(0,))
    with pytest.raises(NativeError, match="unsupported"):
        _nm_native(ref, case, h=1, chunk=4, activation="silu", chunked=True)


def test_reference_neural_memory_steps_in_place(ref):
    """Token-by-token calls updating one set of state buffers reproduce one prefill across chunk starts."""
    b, t, h, d, e, chunk = 2, 7, 2, 4, 8, 3
    case = _nm_case(
        b=b, t=t, h=h, d=d, e=e, depth=2, chunk=chunk, activation="gelu", norm=True, position=(1, 0), seed=4
    )
    q, k, v, theta, eta, alpha, w, s, c, pos, nw, nb = case
    want = neural_memory_step(
        q,
        k,
        v,
        theta,
        eta,
        alpha,
        w,
        s,
        c,
        pos,
        num_heads=h,
        chunk_size=chunk,
        activation="gelu",
        norm_weight=nw,
        norm_bias=nb,
    )
    state = [pos.clone(), [_f32(x) for x in w], [_f32(x) for x in s], [_f32(x) for x in c]]
    ys = []
    for i in range(t):
        tok = lambda x: x[:, i : i + 1]  # noqa: E731
        step = (tok(q), tok(k), tok(v), tok(theta), tok(eta), tok(alpha), *state[1:], state[0], nw, nb)
        y, *_ = _nm_native(ref, step, h=h, chunk=chunk, activation="gelu", present=state)
        ys.append(y)
    _close(torch.cat(ys, 1), want[0])
    for got, exp in zip((*state[1], *state[2], *state[3]), (*want[1], *want[2], *want[3])):
        _close(got, exp)
    assert torch.equal(state[0], want[4])


# ---------------------------------------------------------------------------------------------
# CUDA kernels: compile for every default architecture with no spills, no local memory


def test_gpu_check_harness_passes_on_the_cpu_reference(ref, build_dir):
    """gpu_check.py (the GPU acceptance script) run with the CPU reference standing in for the
    kernels: its cases, truths and tolerances hold up, so a failure on a GPU is the kernels'."""
    proc = subprocess.run(
        [
            sys.executable,
            str(PLUGINS / "scripts" / "gpu_check.py"),
            "--build",
            str(build_dir),
            "--cpu-self-test",
            "--quick",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    passed, total = map(int, re.search(r"(\d+) of (\d+) numerical checks passed", proc.stdout).groups())
    assert passed == total and total >= 30, proc.stdout[:500]


def _emulate():
    """scripts/emulate.py as a module; skips where the CUDA headers it compiles against are missing."""
    spec = importlib.util.spec_from_file_location("emulate", PLUGINS / "scripts" / "emulate.py")
    emulate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(emulate)
    if not (emulate.CUDA_INCLUDE / "cuda_runtime.h").is_file():
        pytest.skip(
            f"the CUDA headers (CUDA toolkit) are not at {emulate.CUDA_INCLUDE}: the kernels cannot be compiled"
        )
    return emulate


@pytest.fixture(scope="session")
def emulated(build_dir, ref) -> Path:
    """The CUDA kernels compiled for the CPU on the emulator (scripts/emulate.py), beside the CPU reference;
    with TensorRT headers at hand, the plugin harness on them too."""
    roots = _trt_roots()
    _emulate().build(build_dir, roots[0] / "include" if roots else None)
    return build_dir


def test_kernels_pass_the_gpu_check_on_the_cpu_emulator(emulated):
    """The CUDA kernels themselves, compiled for the CPU and run on the emulator (a block's threads as fibers
    that meet at barriers and warp collectives; mma.sync, ldmatrix and WMMA by their fragment layouts), pass
    gpu_check.py's quick set against float64 truth in fp32, fp16 and bf16, every form and path included: their
    indexing, synchronisation and tensor-core fragments, checked where no GPU is."""
    script = [sys.executable, str(PLUGINS / "scripts" / "gpu_check.py"), "--build", str(emulated), "--emulate"]
    proc = subprocess.run([*script, "--quick"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    passed, total = map(int, re.search(r"(\d+) of (\d+) numerical checks passed", proc.stdout).groups())
    assert passed == total and total >= 290, proc.stdout[:500]
    modes = set(re.findall(r"^\| \w+ \| .* \| (?:fp32|fp16|bf16) \| ([^|]+?) \| ", proc.stdout, re.M))
    assert {"chunked", "segments", "steps", "tiled", "chunked in-place"} <= modes, modes


def test_kernels_pass_in_the_forms_a_smaller_device_gets(emulated):
    """The emulator standing for a device with one SM and 99 KB of shared memory a block (what sm_86, 89 and
    120 parts allow), forms the default device never takes: the chunked LinearAttention walks the state in
    blocks of 32 value columns with one copy stage, and WindowAttention's decode splits its keys over fewer
    blocks (the fewest waves of resident blocks). Both pass their quick sets against float64 truth."""
    script = [sys.executable, str(PLUGINS / "scripts" / "gpu_check.py"), "--build", str(emulated), "--emulate"]
    env = {**os.environ, "EDGEMEM_EMULATE_SMS": "1", "EDGEMEM_EMULATE_SMEM": str(99 * 1024)}
    for op, least in (("linear", 160), ("window", 60)):
        proc = subprocess.run([*script, "--quick", "--op", op], capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        passed, total = map(int, re.search(r"(\d+) of (\d+) numerical checks passed", proc.stdout).groups())
        assert passed == total and total >= least, proc.stdout[:500]
        if op == "linear":
            assert re.search(r"^\| LinearAttention \| long quick \w+ \| fp16 \| chunked \| ", proc.stdout, re.M)
    env["EDGEMEM_EMULATE_SMS"] = "one"
    proc = subprocess.run([*script, "--quick", "--op", "linear"], capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and "EDGEMEM_EMULATE_SMS is 'one'; expected a positive integer" in proc.stderr, (
        proc.returncode,
        proc.stderr[-2000:],
    )


def test_plugin_harness_enqueues_every_plugin_on_the_cpu_emulator(emulated):
    """tests/plugin_harness.cpp with the plugins on the emulated kernels: every TensorRT entry point, then each
    plugin's enqueue against the kernel called through its C ABI and against the CPU reference, passes on the
    CPU (what gpu_check.sh runs on a GPU)."""
    harness = emulated / "edgemem_plugin_harness_emu"
    if not harness.exists():
        pytest.skip("no TensorRT headers (../shared/third_party/tensorrt or EDGEMEM_TENSORRT_ROOTS): no harness")
    proc = subprocess.run([str(harness), "--enqueue"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(re.search(r"^harness: (\{.*\})$", proc.stdout, re.M)[1])
    assert summary["enqueue"] and summary["failed"] == 0 and summary["by_entry_point"]["enqueue"] == 4, summary
    ops = set(re.findall(r"^enqueue (\w+) output \d+: vs kernel ", proc.stdout, re.M))
    assert ops == {"LinearAttention", "NeuralMemory", "BandedAttention", "WindowAttention"}, ops


EMULATED_PROGRAM = r"""
#include <cstdio>
// Each warp's sum through shuffles, then thread 0 adds the warps' sums after a barrier.
__global__ void blockSum(float const* x, float* out)
{
    __shared__ float part[4];
    float v = x[blockIdx.x * blockDim.x + threadIdx.x];
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    if (threadIdx.x % 32 == 0)
        part[threadIdx.x / 32] = v;
    __syncthreads();
    if (threadIdx.x == 0)
        out[blockIdx.x] = part[0] + part[1] + part[2] + part[3];
}
// Half a warp at a shuffle the other half never reaches.
__global__ void halfShuffle(float* out)
{
    float v = 1.0f;
    if (threadIdx.x % 32 < 16)
        v = __shfl_xor_sync(0xffffffffu, v, 1);
    out[threadIdx.x] = v;
}
int main()
{
    float x[256], out[128];
    for (int i = 0; i < 256; ++i)
        x[i] = float(i);
    blockSum<<<2, 128>>>(x, out);
    std::printf("sums %g %g status %d\n", out[0], out[1], int(cudaGetLastError()));
    halfShuffle<<<1, 64>>>(out);
    std::printf("diverged status %d\n", int(cudaGetLastError()));
}
"""


def test_emulator_runs_threads_to_their_barriers_and_refuses_a_diverged_shuffle(tmp_path):
    """A kernel built with the emulator (a launch rewritten by emulate.py, shuffles and a barrier) computes
    its block sums as on a device; a shuffle that half a warp never reaches ends the launch with an error
    naming it, rather than a result."""
    emulate = _emulate()
    cxx = shutil.which("g++")
    if not cxx:
        pytest.skip("g++ is needed to build for the emulator")
    (tmp_path / "program.cpp").write_text(emulate.rewrite(EMULATED_PROGRAM))
    flags = ["-std=c++17", f"-DEMU_ARCH={emulate.ARCH}", "-include", str(PLUGINS / "emulator" / "emulator.h")]
    flags += [f"-I{PLUGINS}", f"-isystem{emulate.CUDA_INCLUDE}"]
    _run(
        [cxx, *flags, str(tmp_path / "program.cpp"), str(PLUGINS / "emulator" / "runtime.cpp")]
        + ["-o", str(tmp_path / "program"), "-lboost_context"]
    )
    proc = subprocess.run([str(tmp_path / "program")], capture_output=True, text=True)
    assert "sums 8128 24512 status 0" in proc.stdout, proc.stdout + proc.stderr
    assert "diverged status 719" in proc.stdout, proc.stdout  # cudaErrorLaunchFailure
    assert "a warp collective that not every lane of the warp reached" in proc.stderr, proc.stderr


def test_gpu_check_takes_one_op_at_a_time(ref, build_dir):
    """--op narrows gpu_check.py to the named ops' checks (what gpu_check.sh runs each sanitizer job on)."""
    script = [sys.executable, str(PLUGINS / "scripts" / "gpu_check.py"), "--build", str(build_dir), "--cpu-self-test"]
    proc = subprocess.run([*script, "--quick", "--op", "banded"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ops = set(re.findall(r"^\| (\w+) \| .* \| \d\.\de[+-]\d+ \| .* \| (?:ok|FAIL) \|$", proc.stdout, re.M))
    assert ops == {"BandedAttention"}, ops


def _gpu_check():
    """plugins/scripts/gpu_check.py as a module."""
    spec = importlib.util.spec_from_file_location("gpu_check", PLUGINS / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _tables(text: str) -> list[list[list[str]]]:
    """The markdown tables of a report: each a list of rows, each a list of cells."""
    tables, rows = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif rows:
            tables.append(rows)
            rows = []
    return tables


def test_gpu_check_reports_a_baseline_library_beside_the_kernels(ref):
    """With --baseline, every timing table of gpu_check.py's report gains the earlier library's µs and the
    speed-up (its µs over ours) beside the forms it times, each row as wide as its header; without it the
    tables are as before. (The timings themselves need a GPU; these rows stand in for them.)"""
    gc = _gpu_check()
    timing = gc.Timing("LinearAttention", "16 heads", "fp32", 5.0, 2_000_000, 1_000_000, 4000.0, 3000.0, 4.0)
    for base in (ref, None):
        h = gc.Harness(ref, ref, torch.device("cpu"), [torch.float32], base)
        pair = lambda a, b: (a, b) if base else None  # noqa: E731
        text = gc.report(
            h,
            [gc.replace(timing, fla=(3.5, 3.0), base_us=6.0 if base else None)],
            [("b1 16 heads 128x128, T=512", "fp32", 500.0, 100.0, 80.0, pair(550.0, 150.0))],
            [("b1 4 heads 64x128 depth 2, T=64", "fp32", 1000.0, 200.0, pair(1000.0, None))],
            [("b1 12 heads d64, window 256, T=1024", "fp32", 1500.0, 1200.0, 180.0, pair(1500.0, 1300.0))],
            [],
            "test rows",
            1.0,
        )
        tables = _tables(text)[1:]  # after the numerical checks: decode, prefill, memory, banded
        assert len(tables) == 4, text
        for table in tables:
            assert {len(row) for row in table} == {len(table[0])}, table
        decode, prefill, memory, banded = (dict(zip(t[0], t[2])) for t in tables)
        if base:
            assert (decode["baseline µs"], decode["speed-up"]) == ("6.00", "1.50×"), decode
            assert prefill["baseline sequential µs"] == "550.0" and prefill["baseline chunked µs"] == "150.0", prefill
            assert [c for c in tables[1][2] if c.endswith("×")] == ["0.80×", "1.10×", "1.50×"], tables[1]
            assert memory["baseline chunked µs"] == "-" and banded["baseline tiled µs"] == "1300.0", (memory, banded)
        else:
            assert "baseline" not in text, text


def test_gpu_check_refuses_a_baseline_it_cannot_time(kernels_build, tmp_path):
    """--baseline is a library to time on a GPU: a build without one, or a run that times nothing, is refused in
    one line that says what to do."""
    script = [sys.executable, str(PLUGINS / "scripts" / "gpu_check.py"), "--build", str(kernels_build)]
    proc = subprocess.run([*script, "--baseline", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip() == (
        f"error: {tmp_path / 'libedgemem_kernels.so'} not found: build it with "
        f"`cmake -S <the earlier tree's plugins> -B {tmp_path}`"
    ), proc.stderr
    proc = subprocess.run(
        [*script, "--cpu-self-test", "--baseline", str(kernels_build)], capture_output=True, text=True
    )
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error: --baseline times kernels on a GPU"), (
        proc.stderr
    )


def test_gpu_check_sh_refuses_a_baseline_that_is_not_a_plugins_tree(tmp_path):
    """gpu_check.sh's BASELINE names an earlier plugins/ tree to build and time beside this one: anything else is
    refused in one line before any build starts."""
    env = {**os.environ, "BASELINE": str(tmp_path)}
    script = ["bash", str(PLUGINS / "scripts" / "gpu_check.sh"), str(tmp_path / "build")]
    proc = subprocess.run(script, capture_output=True, text=True, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip() == (
        f"error: BASELINE='{tmp_path}': expected an earlier version's plugins/ tree (a folder with its CMakeLists.txt)"
    ), proc.stderr
    assert not (tmp_path / "build").exists()


def test_kernels_compile_without_spills(kernels_build):
    info = dict(line.split("=", 1) for line in (kernels_build / "edgemem_build.txt").read_text().splitlines())
    assert info["architectures"].split(";") == list(ARCHS)
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    assert info["fatbin_compression"] == ("size" if "--compress-mode" in _run([nvcc, "--help"]).stdout else "default")
    assert_no_spills(kernels_build, ARCHS)
    assert (kernels_build / "libedgemem_kernels.so").exists()


def test_kernel_library_exposes_the_reference_abi(kernels_build):
    """The CUDA library loads without a GPU and has the C ABI the GPU check drives."""
    lib = Native(kernels_build / "libedgemem_kernels.so")
    assert lib.cuda and lib.lib.em_cuda_abi_version() == ref_abi(kernels_build)


def test_native_mirror_refuses_a_linear_attention_path_it_does_not_know(ref):
    """The ctypes mirror names the paths the C ABI takes; another, such as "chunked-mma" (a path that was
    removed when its prepare pass became the chunked form's), is refused by name rather than run as the
    default form."""
    q, v = torch.zeros(1, 4, 8), torch.zeros(1, 4, 8)
    g, beta = torch.zeros(1, 4, 1), torch.zeros(1, 4, 1)
    kw = dict(update_rule="gated_delta", scale=0.5, q_num_heads=1, kv_num_heads=1)
    with pytest.raises(ValueError, match="'chunked-mma': expected one of auto, sequential, chunked$"):
        ref.linear_attention(q, q, v, torch.zeros(1, 1, 8, 8), g, beta, path="chunked-mma", **kw)
    with pytest.raises(ValueError, match="expected one of"):
        ref.linear_attention_workspace(q, v, g, beta, path="fast", **kw)


def test_kernel_library_sizes_the_chunked_workspace(kernels_build, ref):
    """The CUDA C ABI's LinearAttention paths, in its host code (no GPU needed): auto and the chunked path
    size the workspace the CPU reference's chunked form lays out, the sequential path none, and a path it
    does not know is refused as a bad argument before anything runs."""
    lib = Native(kernels_build / "libedgemem_kernels.so").lib
    b, t, hq, hkv, dk, dv = 2, 300, 4, 2, 64, 96
    q, v = torch.zeros(b, t, hq * dk), torch.zeros(b, t, hkv * dv)
    g, beta = torch.zeros(b, t, hkv), torch.zeros(b, t, hkv)
    kw = dict(update_rule="gated_delta", scale=dk**-0.5, q_num_heads=hq, kv_num_heads=hkv)
    params, _ = Native._la_params(q, v, g, beta, *kw.values())
    want = ref.linear_attention_workspace(q, v, g, beta, path="chunked", **kw)
    assert want > 0
    sizes = {path: lib.em_cuda_linear_attention_workspace(ctypes.byref(params), n) for path, n in LA_PATHS.items()}
    assert sizes == {"auto": want, "sequential": 0, "chunked": want}
    unknown = max(LA_PATHS.values()) + 1
    assert lib.em_cuda_linear_attention_workspace(ctypes.byref(params), unknown) == 0
    status = lib.em_cuda_linear_attention(ctypes.byref(params), ctypes.byref(LAIO()), 0, unknown, None, 0, None)
    assert status == 1  # kBadArgument


def ref_abi(build: Path) -> int:
    return Native(build / "libedgemem_reference.so").lib.em_ref_abi_version()


# ---------------------------------------------------------------------------------------------
# TensorRT glue


SHARED_TRT = ROOT.parent / "shared" / "third_party" / "tensorrt"  # one include/ per TensorRT version


def _trt_roots() -> list[Path]:
    raw = os.environ.get("EDGEMEM_TENSORRT_ROOTS") or os.environ.get("TensorRT_ROOT") or ""
    if raw:
        return [Path(p) for p in raw.split(os.pathsep) if p]
    if not SHARED_TRT.is_dir():
        return []
    return sorted(p for p in SHARED_TRT.iterdir() if (p / "include" / "NvInferRuntime.h").is_file())


TRT_ROOTS = _trt_roots()
NO_TRT = (
    f"no TensorRT headers: {SHARED_TRT} is absent; set EDGEMEM_TENSORRT_ROOTS (os.pathsep-separated) or TensorRT_ROOT"
)


def _trt_id(root: Path) -> str:
    return root.name


@pytest.fixture(scope="session")
def trt_libs(tmp_path_factory) -> dict[Path, Path | str]:
    """Builds the plugin library and the harness against each TensorRT root, each into a folder of its own. One
    build tree serves them all, reconfigured for each root: the kernels compile once, the glue per root. The
    kernels are for sm_75, where the tensor-core ones compile empty (the cheapest build): these tests load the
    glue and never launch a kernel."""
    out: dict[Path, Path | str] = {}
    if not shutil.which("cmake") or not shutil.which("nvcc"):
        return {root: "cmake and nvcc are needed to build the plugin library" for root in TRT_ROOTS}
    build = tmp_path_factory.mktemp("trt_build")
    for root in TRT_ROOTS:
        info = _cmake_build(
            build,
            f"-DTensorRT_ROOT={root}",
            "-DCMAKE_CUDA_ARCHITECTURES=75",
            targets=("edgemem_trt_plugins", "edgemem_plugin_harness"),
        )
        if not info.get("tensorrt"):
            out[root] = f"no TensorRT headers under {root}"
            continue
        folder = tmp_path_factory.mktemp(f"trt_{root.name}")
        for name in ("libedgemem_trt_plugins.so", "edgemem_plugin_harness"):
            shutil.copy2(build / name, folder / name)
        out[root] = folder / "libedgemem_trt_plugins.so"
    return out


def _lib_for(trt_libs, root) -> Path:
    lib = trt_libs[root]
    if isinstance(lib, str):
        pytest.skip(lib)
    return lib


@pytest.mark.slow
@pytest.mark.skipif(not TRT_ROOTS, reason=NO_TRT)
@pytest.mark.parametrize("root", TRT_ROOTS, ids=_trt_id)
def test_trt_glue_builds_without_libnvinfer(trt_libs, root):
    lib = _lib_for(trt_libs, root)
    nm = shutil.which("nm")
    if nm:
        defined = _run([nm, "-D", "--defined-only", str(lib)]).stdout
        assert re.search(r" T getCreators$", defined, re.M) and re.search(r" T setLoggerFinder$", defined, re.M)
    ldd = shutil.which("ldd")
    if ldd:
        assert "nvinfer" not in _run([ldd, str(lib)]).stdout


@pytest.mark.slow
@pytest.mark.skipif(not TRT_ROOTS, reason=NO_TRT)
@pytest.mark.parametrize("root", TRT_ROOTS, ids=_trt_id)
def test_plugin_harness_drives_every_plugin_through_tensorrts_calls(trt_libs, root):
    """plugins/tests/plugin_harness.cpp, built against this TensorRT's headers (no TensorRT library): every
    op of ops.def through creator fields, createPlugin, output types and shapes (its own IExprBuilder),
    formats, configure, workspace, metadata, clone, serialize -> createPlugin, attach, onShapeChange and
    the logged refusals. enqueue runs in plugins/scripts/gpu_check.sh on a GPU."""
    harness = _lib_for(trt_libs, root).parent / "edgemem_plugin_harness"
    proc = subprocess.run([str(harness)], capture_output=True, text=True, timeout=60)
    summary = json.loads(proc.stdout.strip().splitlines()[-1].split("harness: ", 1)[1])
    assert proc.returncode == 0 and summary["failed"] == 0, proc.stdout
    ops = re.findall(r"^EM_OP\((\w+),", (PLUGINS / "ops.def").read_text(), re.M)
    assert summary["plugins"] == len(ops) == 4 and not summary["enqueue"]
    calls = summary["by_entry_point"]
    for entry in (
        "createPlugin",
        "getOutputDataTypes",
        "getOutputShapes",
        "supportsFormatCombination",
        "configurePlugin",
        "getWorkspaceSize",
        "clone",
        "getFieldsToSerialize",
        "attachToContext",
        "onShapeChange",
    ):
        assert calls.get(entry, 0) >= len(ops), (entry, calls)


# every edgemem node of trt exports covering the four ops: (arch, graph kind, overrides)
EXPORTS = [
    ("gated-deltanet", "step", {}),
    ("titans-mag", "step", {}),
    ("ttt-linear", "step", {}),
    ("longformer-encoder", "prefill", {}),
]


@pytest.fixture(scope="session")
def trt_nodes() -> list[dict]:
    """Op type and attributes of every edgemem node in the trt-lowered exports."""
    from onnx import helper

    from edgemem.export.graphs import export_graph
    from edgemem.export.lower import lower
    from edgemem.models import build

    nodes = []
    for arch, kind, overrides in EXPORTS:
        proto = lower(export_graph(build(arch, seed=0, n_layers=1, **overrides), kind, 20, None), "trt")
        for node in proto.graph.node:
            if node.domain != "edgemem":
                continue
            attrs = {}
            for a in node.attribute:
                value = helper.get_attribute_value(a)
                kind_ = {1: "FLOAT", 2: "INT", 3: "STRING", 7: "INTS"}[a.type]
                attrs[a.name] = (kind_, value.decode() if isinstance(value, bytes) else value)
            nodes.append(
                dict(arch=arch, op=node.op_type, inputs=len(node.input), outputs=len(node.output), attrs=attrs)
            )
    assert {n["op"] for n in nodes} == {"LinearAttention", "NeuralMemory", "WindowAttention", "BandedAttention"}
    return nodes


REGISTRY_CHECK = textwrap.dedent(
    """
    # Runs in its own process: one plugin library per registry, and a crash stays contained.
    import importlib, json, sys
    import numpy as np

    lib, trt, nodes = sys.argv[1], importlib.import_module(sys.argv[2]), json.loads(sys.stdin.read())
    logger = trt.Logger(trt.Logger.WARNING)
    registry = trt.get_plugin_registry()
    registry.load_library(lib)
    kinds = {"INT": (np.int32, trt.PluginFieldType.INT32), "INTS": (np.int32, trt.PluginFieldType.INT32),
             "FLOAT": (np.float32, trt.PluginFieldType.FLOAT32)}
    results = []
    for node in nodes:
        attrs = node["attrs"]
        creator = registry.get_creator(node["op"], attrs["plugin_version"][1], attrs["plugin_namespace"][1])
        if creator is None:
            results.append(dict(op=node["op"], error="no creator"))
            continue
        fields = {f.name: f.type for f in creator.field_names}
        # the ONNX parser's mapping: attributes named by the creator's fields become fields
        pfs = []
        for name, (kind, value) in attrs.items():
            if name in fields:
                if kind == "STRING":
                    data, ftype = np.frombuffer(value.encode(), dtype=np.int8), trt.PluginFieldType.CHAR
                else:
                    dtype, ftype = kinds[kind]
                    data = np.array(value if kind == "INTS" else [value], dtype=dtype)
                pfs.append(trt.PluginField(name, data, ftype))
        plugin = creator.create_plugin("node", trt.PluginFieldCollection(pfs), trt.TensorRTPhase.BUILD)
        core = plugin.get_capability_interface(trt.PluginCapabilityType.CORE) if plugin else None
        build = plugin.get_capability_interface(trt.PluginCapabilityType.BUILD) if plugin else None
        results.append(dict(
            op=node["op"], fields={k: str(v).split(".")[-1] for k, v in fields.items()},
            created=plugin is not None,
            name=core.plugin_name if core else None, namespace=core.plugin_namespace if core else None,
            version=core.plugin_version if core else None,
            outputs=build.num_outputs if build else None, metadata=build.metadata_string if build else None,
        ))
    bad = trt.PluginFieldCollection([
        trt.PluginField("update_rule", np.frombuffer(b"nope", dtype=np.int8), trt.PluginFieldType.CHAR),
        trt.PluginField("q_num_heads", np.array([2], dtype=np.int32), trt.PluginFieldType.INT32),
        trt.PluginField("kv_num_heads", np.array([2], dtype=np.int32), trt.PluginFieldType.INT32)])
    try:
        rejected = registry.get_creator("LinearAttention", "1", "edgemem").create_plugin(
            "bad", bad, trt.TensorRTPhase.BUILD) is None
    except Exception:
        rejected = True
    print(json.dumps(dict(results=results, rejected_bad=rejected)))
    """
)


def _expected_metadata(attrs: dict) -> dict[str, str]:
    out = {}
    for name, (kind, value) in attrs.items():
        if name.startswith("plugin_"):
            continue
        if kind == "FLOAT":
            out[name] = float(value)
        elif kind == "INTS":
            out[name] = ",".join(map(str, value))
        else:
            out[name] = str(value)
    return out


# Python bindings with a TensorRT plugin registry that works without a GPU, and where they come from
REGISTRIES = {
    "tensorrt_lean_bindings": "pip: tensorrt-lean-cu13-bindings tensorrt-lean-cu13-libs",
    "tensorrt_rtx": "pip: tensorrt-rtx-cu13",
}


@pytest.mark.slow
@pytest.mark.skipif(not TRT_ROOTS, reason=NO_TRT)
@pytest.mark.parametrize("bindings", list(REGISTRIES))
@pytest.mark.parametrize("root", TRT_ROOTS, ids=_trt_id)
def test_trt_registry_creates_every_exported_node(trt_libs, root, trt_nodes, bindings):
    lib = _lib_for(trt_libs, root)
    if importlib.util.find_spec(bindings) is None:
        pytest.skip(f"{bindings} is not installed ({REGISTRIES[bindings]})")
    proc = _run([sys.executable, "-c", REGISTRY_CHECK, str(lib), bindings], input=json.dumps(trt_nodes))
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["rejected_bad"], "an unknown update_rule must not create a plugin"
    assert "update_rule must be linear, gated, delta or gated_delta; got 'nope'" in proc.stderr  # logged, named
    field_types = {"INT": "INT32", "INTS": "INT32", "FLOAT": "FLOAT32", "STRING": "CHAR"}
    for node, got in zip(trt_nodes, report["results"]):
        assert got.get("created"), (node, got)
        assert (got["name"], got["namespace"], got["version"]) == (node["op"], "edgemem", "1")
        assert got["outputs"] == node["outputs"]
        for name, (kind, _) in node["attrs"].items():  # every attribute is a creator field of its ONNX type
            if not name.startswith("plugin_"):
                assert got["fields"].get(name) == field_types[kind], (node["op"], name, got["fields"])
        meta = dict(item.split("=", 1) for item in got["metadata"].split(";"))
        for name, value in _expected_metadata(node["attrs"]).items():  # the plugin parsed every value
            assert (
                (float(meta[name]) == pytest.approx(value, rel=1e-6))
                if isinstance(value, float)
                else meta[name] == value
            )


# ---------------------------------------------------------------------------------------------
# edgemem build: without TensorRT (or a GPU) a clear error, not a traceback


def _logits_graph(path: Path, vocab: int, opset: int) -> None:
    """input_ids [batch, sequence] -> logits [batch, sequence, vocab]: the I/O of a stateless step graph."""
    import onnx
    from onnx import TensorProto, helper

    nodes = [
        helper.make_node("Cast", ["input_ids"], ["x"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["x", "axis"], ["y"]),
        helper.make_node("Tile", ["y", "repeats"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "step",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "sequence", vocab])],
        [
            helper.make_tensor("axis", TensorProto.INT64, [1], [-1]),
            helper.make_tensor("repeats", TensorProto.INT64, [3], [1, 1, vocab]),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), str(path))


def test_build_command_says_what_is_missing(tmp_path):
    from click.testing import CliRunner

    from edgemem.cli import main
    from edgemem.manifest import Manifest

    runner = CliRunner()
    result = runner.invoke(main, ["build", str(tmp_path)])
    assert result.exit_code == 2 and "no trt target" in result.output and "--target trt" in result.output
    (tmp_path / "trt").mkdir()
    (tmp_path / "trt" / "step.onnx").write_bytes(b"")
    result = runner.invoke(main, ["build", str(tmp_path)])
    assert result.exit_code == 2 and "edgemem.json is missing" in result.output
    manifest = Manifest("custom", {"vocab_size": 4, "dtype": "fp32"}, 20, ["trt"], [], {"step": True})
    (tmp_path / "edgemem.json").write_text(manifest.to_json())
    result = runner.invoke(main, ["build", str(tmp_path), "--fp16"])  # strongly typed: FP16 comes from the export
    assert result.exit_code == 2 and "fp32 export" in result.output and "--dtype fp16" in result.output
    result = runner.invoke(main, ["build", str(tmp_path), "--max-batch", "4"])
    assert result.exit_code == 2 and "step.onnx is not a readable ONNX graph" in result.output, result.output
    _logits_graph(tmp_path / "trt" / "step.onnx", vocab=4, opset=20)  # a graph the manifest describes
    (library := tmp_path / "libedgemem_trt_plugins.so").write_bytes(b"")  # loaded only once TensorRT is imported
    result = runner.invoke(
        main,
        ["build", str(tmp_path), "--max-batch", "4", "--plugins", str(library), "--out", str(tmp_path / "engines")],
    )
    assert result.exit_code == 2, result.output
    if importlib.util.find_spec("tensorrt") is None:
        assert "TensorRT's Python package is not installed" in result.output
    else:  # TensorRT present: the plugin library or the GPU is what is missing here
        assert "plugin library" in result.output or "GPU" in result.output or "parser" in result.output
