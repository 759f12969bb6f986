"""Checks the edgemem CUDA kernels on a GPU: numerics, in-place state, odd shapes, decode timing.

Driven by gpu_check.sh (which builds the libraries and runs compute-sanitizer); run alone as

    python plugins/scripts/gpu_check.py --build BUILD_DIR [--quick] [--no-timing] [--report FILE] [--op OP ...]

BUILD_DIR holds libedgemem_kernels.so and libedgemem_reference.so (cmake -S plugins -B BUILD_DIR).
Every case runs the kernels through their C ABI on torch CUDA tensors and compares with
  - truth: the edgemem.ops implementation in float64 on the CPU, fed the inputs as the kernel saw
    them (rounded to float16 / bfloat16 for the 16-bit cases);
  - the CPU reference library (float32 cases): the same math headers compiled for the host.
Modes: "prefill" (T tokens, separate state buffers), "in-place" (state-in and state-out one
buffer), "steps" (T single-token calls on one in-place state, compared with the one-call truth);
LinearAttention also "chunked" (its tensor-core form forced) and "segments" (that form with a
workspace of one chunk, so the state passes from segment to segment; for 16-bit I/O and per-head
decay these run the prepare and output passes on mma.sync, elsewhere on WMMA); NeuralMemory
"chunked" and "chunked in-place" (its tensor-core form, where d and e are multiples of 16);
BandedAttention "tiled" (its tensor-core form, where d and d_v are multiples of 16 up to 128).
Timing: each decode kernel (T = 1, in place) against the memory floor of the design,
t >= bytes / bandwidth, with bandwidth both the device's peak (memory clock x bus width) and a
measured device-to-device copy; LinearAttention prefill in both forms beside
flash-linear-attention's chunk_gated_delta_rule (chunk_kda for per-key decay); NeuralMemory prefill
in both forms; BandedAttention in both forms beside a dense attention with a [T, T] mask (PyTorch's
scaled_dot_product_attention); and each kernel's share of a chunked prefill (ours and fla's) and of
a WindowAttention decode split, from PyTorch's profiler. `--baseline BUILD` times an earlier
libedgemem_kernels.so beside these in every table (the same inputs, one process, one device).

`--cpu-self-test` runs the same harness with the CPU reference standing in for the kernels
(float32, no timing): a check of this script on a machine without a GPU. `--emulate` runs it on the
kernels themselves compiled for the CPU (BUILD_DIR/libedgemem_kernels_emu.so from emulate.py; every
dtype, no timing).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
import zlib
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python"))

from edgemem_native import Native, NativeError, workspace_buffer  # noqa: E402

F64 = torch.float64
# max |got - truth| / max(1, max |truth|); bfloat16: float16's times the ratio of their unit roundoffs, 2^-8 / 2^-11
TOL = {torch.float32: 5e-5, torch.float16: 4e-3, torch.bfloat16: 3.2e-2}
REF_TOL = 5e-5  # kernels vs CPU reference, float32


@dataclass
class Row:
    op: str
    case: str
    dtype: str
    mode: str
    err_truth: float
    err_ref: float | None
    tol: float
    ok: bool


@dataclass
class Timing:
    op: str
    case: str
    dtype: str
    us: float
    bytes: int
    floor_bytes: int
    peak_gbs: float
    copy_gbs: float
    graph_us: float | None  # the same calls replayed from a CUDA graph: device time, no launch overhead
    fla: tuple[float, float | None] | None = None  # flash-linear-attention's fused_recurrent: (us, graph_us)
    base_us: float | None = None  # the baseline library's graph µs on the same step

    @property
    def device_us(self) -> float:
        return self.graph_us if self.graph_us is not None else self.us

    @property
    def achieved(self) -> float:
        return self.bytes / (self.device_us * 1e-6) / 1e9


@dataclass
class Harness:
    dev: Native
    ref: Native
    device: torch.device
    dtypes: list[torch.dtype]
    base: Native | None = None  # an earlier kernel library, timed beside dev (--baseline)
    rows: list[Row] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def record(self, op, case, dtype, mode, got, truth, ref=None, storage=None):
        """storage: the dtype state is kept in, when it may be narrower than the I/O (a float16 ring)."""
        got = [g.detach().to("cpu", F64) for g in got]
        errs = [_err(g, t) for g, t in zip(got, truth)]
        err_ref = max(_err(g, r) for g, r in zip(got, ref)) if ref is not None else None
        tol = max(TOL[dtype], TOL[storage or dtype])
        ok = max(errs) <= tol and (err_ref is None or err_ref <= REF_TOL)
        self.rows.append(Row(op, case, _dt(dtype), mode, max(errs), err_ref, tol, ok))

    def put(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return x.to(self.device, dtype if dtype is not None else x.dtype).contiguous()


def _natives(h: Harness) -> list[Native]:
    """The kernel library under test, then the baseline where there is one."""
    return [h.dev] + ([h.base] if h.base else [])


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.to("cpu", F64), want.to("cpu", F64)
    if got.shape != want.shape:
        return math.inf
    if got.numel() == 0:
        return 0.0
    if not torch.isfinite(got).all():
        return math.inf
    return ((got - want).abs().max() / want.abs().max().clamp_min(1.0)).item()


def _dt(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]


def _cpu(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to("cpu", torch.float32).contiguous()


def _seen(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the kernel sees it: rounded to the I/O dtype, then widened for the truth."""
    return x.to(dtype).to(F64)


# ---------------------------------------------------------------------------------------------
# LinearAttention

LA_CASES = [  # name, b, t, hq, hkv, dk, dv, per_key_decay, beta_per_head, largest log decay
    ("mha 64x64", 2, 9, 4, 4, 64, 64, False, True, 0.5),
    ("gqa odd 5x7", 3, 7, 6, 2, 5, 7, True, False, 0.5),
    ("dk 33 dv 130", 1, 5, 2, 1, 33, 130, True, True, 0.5),
    ("dk 100", 2, 4, 2, 2, 100, 24, False, True, 0.5),
    ("dk 128 gqa", 2, 6, 8, 2, 128, 128, True, True, 0.5),
    ("dk 256", 1, 3, 1, 1, 256, 40, False, True, 0.5),
    ("b0 t1", 1, 1, 3, 3, 16, 16, True, True, 0.5),
]
LA_QUICK = [LA_CASES[1], LA_CASES[4]]
# prompts long enough for the chunked form: several chunks, a partial last one, GQA, d_k != d_v,
# per-key decay mild and strong (exp(-G) past float32 inside a chunk)
LA_LONG = [
    ("long gqa 128", 2, 333, 8, 2, 128, 128, False, True, 0.5),
    ("long 64 dv 96", 1, 700, 4, 4, 64, 96, False, False, 0.5),
    ("long dk 20 dv 130", 1, 130, 2, 1, 20, 130, False, True, 0.5),
    ("long per-key gqa 128", 1, 333, 8, 2, 128, 128, True, True, 0.5),
    ("long per-key strong 64 dv 80", 2, 200, 2, 2, 64, 80, True, True, 8.0),
]
LA_LONG_QUICK = [
    ("long quick", 1, 150, 4, 2, 64, 80, False, True, 0.5),
    ("long quick per-key strong", 1, 100, 2, 1, 32, 16, True, True, 8.0),
]


def check_linear_attention(h: Harness, quick: bool) -> None:
    from edgemem.ops.linear_attention import UPDATE_RULES, linear_attention

    cases = (LA_QUICK + LA_LONG_QUICK) if quick else (LA_CASES + LA_LONG)
    for name, b, t, hq, hkv, dk, dv, per_key, beta_heads, strength in cases:
        for rule in UPDATE_RULES:
            for dtype in h.dtypes:
                g = torch.Generator().manual_seed(zlib.crc32(f"{name} {rule}".encode()))
                rand = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
                q = rand(b, t, hq * dk)
                k = torch.nn.functional.normalize(rand(b, t, hkv, dk), dim=-1).flatten(2)
                v = rand(b, t, hkv * dv)
                s0 = rand(b, hkv, dk, dv)
                gated, delta = rule in ("gated", "gated_delta"), rule in ("delta", "gated_delta")
                decay = -torch.rand(b, t, hkv * (dk if per_key else 1), generator=g, dtype=F64) * strength
                beta = torch.rand(b, t, hkv if beta_heads else 1, generator=g, dtype=F64)
                if not gated:
                    decay = torch.zeros(b, t, hkv, dtype=F64)
                if not delta:
                    beta = torch.ones(b, t, hkv, dtype=F64)
                seen = [_seen(x, dtype) for x in (q, k, v, decay, beta)]
                want = linear_attention(
                    seen[0],
                    seen[1],
                    seen[2],
                    s0.float().double(),
                    seen[3] if gated else None,
                    seen[4] if delta else None,
                    update_rule=rule,
                    q_num_heads=hq,
                    kv_num_heads=hkv,
                )
                kw = dict(update_rule=rule, scale=1 / math.sqrt(dk), q_num_heads=hq, kv_num_heads=hkv)
                args = (
                    [h.put(x, dtype) for x in (q, k, v)]
                    + [h.put(s0, torch.float32)]
                    + [h.put(x, dtype) for x in (decay, beta)]
                )
                ref = None
                if dtype == torch.float32:
                    ref = h.ref.linear_attention(*[_cpu(x) for x in args], **kw)
                got = h.dev.linear_attention(*args, **kw)
                h.record("LinearAttention", f"{name} {rule}", dtype, "prefill", got, want, ref)
                # the chunked form alone, then in segments of one chunk (the state passing through)
                if dk <= 128:
                    got = h.dev.linear_attention(*args, path="chunked", **kw)
                    h.record("LinearAttention", f"{name} {rule}", dtype, "chunked", got, want, ref)
                    if t > 64:
                        first = [x[:, :64].contiguous() for x in (args[0], args[2], args[4], args[5])]
                        budget = h.dev.linear_attention_workspace(*first, path="chunked", **kw)  # one chunk's worth
                        ws = budget if not h.dev.cuda else workspace_buffer(budget, h.device)
                        got = h.dev.linear_attention(*args, path="chunked", workspace=ws, **kw)
                        h.record("LinearAttention", f"{name} {rule}", dtype, "segments", got, want, ref)
                if t > 64:
                    continue  # the step modes below are the decode kernel's, checked on the short cases
                # in place: present_state is past_state
                state = args[3].clone()
                got = h.dev.linear_attention(*args[:3], state, *args[4:], present_state=state, **kw)
                h.record("LinearAttention", f"{name} {rule}", dtype, "in-place", got, want)
                # steps: T single-token calls on one state
                state = args[3].clone()
                outs = [
                    h.dev.linear_attention(
                        *[x[:, i : i + 1].contiguous() for x in args[:3]],
                        state,
                        *[x[:, i : i + 1].contiguous() for x in args[4:]],
                        present_state=state,
                        **kw,
                    )[0]
                    for i in range(t)
                ]
                h.record("LinearAttention", f"{name} {rule}", dtype, "steps", (torch.cat(outs, 1), state), want)


# ---------------------------------------------------------------------------------------------
# WindowAttention

WA_CASES = [  # name, b, t, heads, d, dv, window, dilation, persistent, positions
    ("step small", 2, 1, 3, 5, 7, 4, (1, 2, 3), 2, (0, 41)),
    ("step 64", 2, 1, 4, 64, 64, 64, (1, 1, 1, 1), 4, (10, 300)),
    ("step 512", 2, 1, 4, 128, 96, 512, (1, 2, 1, 1), 3, (5, 2000)),
    ("step d 256", 1, 1, 2, 256, 200, 40, (1, 3), 2, (90,)),
    ("step d 256 window 300", 1, 1, 2, 256, 256, 300, (1, 2), 2, (1000,)),
    ("prefill wrap", 2, 37, 3, 32, 48, 8, (1, 2, 1), 0, (3, 100)),
    ("d 128 dv 96", 1, 5, 2, 128, 96, 16, (2, 1), 3, (7,)),
    ("d 256", 1, 3, 1, 256, 256, 5, (1,), 1, (2,)),
    ("step 1100", 1, 1, 2, 32, 24, 1100, (1, 2), 1, (1500,)),  # more splits than the merge takes at once
]
WA_QUICK = [WA_CASES[0], WA_CASES[2], WA_CASES[-1]]


def check_window_attention(h: Harness, quick: bool) -> None:
    from edgemem.ops import window_attention_prefill

    for name, b, t, heads, d, dv, window, dil, persistent, positions in WA_QUICK if quick else WA_CASES:
        for dtype in h.dtypes:
            # the ring: float32 or the I/O's 16-bit type (bfloat16 beside bfloat16, else float16)
            narrow = torch.bfloat16 if dtype == torch.bfloat16 else torch.float16
            for rdtype in [torch.float32, narrow] if len(h.dtypes) > 1 else [torch.float32]:
                g = torch.Generator().manual_seed(len(name) + t)
                rand = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
                ring = window * max(dil)
                q, k, v = rand(b, t, heads * d), rand(b, t, heads * d), rand(b, t, heads * dv)
                pk, pv = rand(b, heads, persistent, d), rand(b, heads, persistent, dv)
                rk, rv = rand(b, heads, ring, d), rand(b, heads, ring, dv)
                pos = torch.tensor(positions, dtype=torch.int64).expand(b).contiguous()
                kw = dict(num_heads=heads, window=window, dilation=list(dil), scale=d**-0.5)
                want = window_attention_prefill(
                    _seen(q, dtype),
                    _seen(k, dtype),
                    _seen(v, dtype),
                    _seen(rk, rdtype),
                    _seen(rv, rdtype),
                    pos,
                    persistent_key=_seen(pk, dtype) if persistent else None,
                    persistent_value=_seen(pv, dtype) if persistent else None,
                    **kw,
                )
                args = (
                    [h.put(x, dtype) for x in (q, k, v)]
                    + [h.put(x, rdtype) for x in (rk, rv)]
                    + [h.put(pos)]
                    + [h.put(x, dtype) for x in (pk, pv)]
                )
                ref = None
                if dtype == torch.float32 and rdtype == torch.float32:
                    ref = h.ref.window_attention(*[_cpu(x) if x.is_floating_point() else x.cpu() for x in args], **kw)
                case = f"{name} ring {_dt(rdtype)}"
                got = h.dev.window_attention(*args, **kw)
                h.record("WindowAttention", case, dtype, "prefill", got, want, ref, storage=rdtype)
                if t == 1 and h.dev.window_attention_workspace(
                    *args[:1], args[2], args[3], args[6], num_heads=heads, window=window
                ):
                    got = h.dev.window_attention(
                        *args, **kw, workspace=torch.empty(0, dtype=torch.uint8, device=args[0].device)
                    )
                    h.record("WindowAttention", case, dtype, "one block per head", got, want, storage=rdtype)
                rk2, rv2 = args[3].clone(), args[4].clone()
                got = h.dev.window_attention(*args[:3], rk2, rv2, *args[5:], present_key=rk2, present_value=rv2, **kw)
                h.record("WindowAttention", case, dtype, "in-place", got, want, storage=rdtype)
                rk2, rv2 = args[3].clone(), args[4].clone()
                outs = []
                for i in range(t):
                    tok = [x[:, i : i + 1].contiguous() for x in args[:3]]
                    outs.append(
                        h.dev.window_attention(
                            *tok, rk2, rv2, args[5] + i, *args[6:], present_key=rk2, present_value=rv2, **kw
                        )[0]
                    )
                h.record("WindowAttention", case, dtype, "steps", (torch.cat(outs, 1), rk2, rv2), want, storage=rdtype)


# ---------------------------------------------------------------------------------------------
# BandedAttention

BA_CASES = [  # name, b, t, heads, d, dv, window, dilation, persistent, global fraction
    ("small", 2, 23, 3, 6, 5, 2, (1, 2, 3), 2, 0.15),
    ("64 dims", 2, 130, 4, 64, 64, 16, (1, 1, 2, 4), 0, 0.02),
    ("wide", 1, 300, 2, 128, 96, 32, (1, 3), 4, 0.01),
    ("no globals", 1, 65, 2, 33, 17, 5, (2, 1), 0, 0.0),
    ("tiles, many globals", 2, 300, 2, 64, 64, 8, (1, 2), 20, 0.1),
    ("tiles 16x32", 1, 150, 2, 16, 32, 4, (1, 3), 5, 0.05),
]
BA_QUICK = [BA_CASES[0], BA_CASES[4], BA_CASES[5]]


def check_banded_attention(h: Harness, quick: bool) -> None:
    from edgemem.ops import banded_attention

    for name, b, t, heads, d, dv, window, dil, persistent, frac in BA_QUICK if quick else BA_CASES:
        for causal in (False, True):
            for dtype in h.dtypes:
                g = torch.Generator().manual_seed(t)
                rand = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
                q, k, v = rand(b, t, heads * d), rand(b, t, heads * d), rand(b, t, heads * dv)
                pk, pv = rand(b, heads, persistent, d), rand(b, heads, persistent, dv)
                mask = torch.rand(b, t, generator=g) < frac
                kw = dict(num_heads=heads, window=window, dilation=list(dil), causal=causal, scale=d**-0.5)
                want = banded_attention(
                    _seen(q, dtype),
                    _seen(k, dtype),
                    _seen(v, dtype),
                    global_mask=mask,
                    persistent_key=_seen(pk, dtype) if persistent else None,
                    persistent_value=_seen(pv, dtype) if persistent else None,
                    **kw,
                )
                args = [h.put(x, dtype) for x in (q, k, v)] + [h.put(mask)] + [h.put(x, dtype) for x in (pk, pv)]
                ref = None
                if dtype == torch.float32:
                    ref = [h.ref.banded_attention(*[_cpu(x) if x.is_floating_point() else x.cpu() for x in args], **kw)]
                got = h.dev.banded_attention(*args, **kw)
                case = f"{name} {'causal' if causal else 'bidir'}"
                h.record("BandedAttention", case, dtype, "prefill", [got], [want], ref)
                if d % 16 == 0 and dv % 16 == 0 and max(d, dv) <= 128:
                    got = h.dev.banded_attention(*args, **kw, tiled=True)
                    h.record("BandedAttention", case, dtype, "tiled", [got], [want], ref)
                    if persistent and dtype != torch.float32:
                        # float32 persistent memory beside 16-bit I/O: the tiled kernel rounds it to the I/O type
                        seen = [_seen(x, dtype) for x in (q, k, v)]
                        mem = [_seen(x, torch.float32) for x in (pk, pv)]
                        want32 = banded_attention(
                            *seen, global_mask=mask, persistent_key=mem[0], persistent_value=mem[1], **kw
                        )
                        args32 = args[:4] + [h.put(x, torch.float32) for x in (pk, pv)]
                        got = h.dev.banded_attention(*args32, **kw, tiled=True)
                        h.record("BandedAttention", case, dtype, "tiled, fp32 memory", [got], [want32])


# ---------------------------------------------------------------------------------------------
# NeuralMemory

NM_CASES = [  # name, b, t, heads, d, e, depth, chunk, activation, norm, positions
    ("titans 64x128", 2, 9, 4, 64, 128, 2, 4, "silu", False, (0, 5)),
    ("ttt-linear 64", 2, 6, 2, 64, 64, 1, 3, "identity", True, (0,)),
    ("odd 6x10 gelu", 3, 7, 2, 6, 10, 2, 3, "gelu", True, (1, 2, 9)),
    ("relu 100x256", 1, 5, 2, 100, 256, 2, 2, "relu", False, (3,)),
    ("d 256 e 512", 1, 3, 1, 256, 512, 2, 16, "silu", True, (15,)),
    ("depth1 odd", 2, 4, 3, 33, 33, 1, 1, "silu", False, (0, 1)),
    ("titans-mag 64x128, pieces", 2, 45, 4, 64, 128, 2, 16, "silu", True, (0, 7)),
    ("16x32 gelu, short chunks", 2, 21, 2, 16, 32, 2, 5, "gelu", True, (3, 0)),
    ("ttt-linear 64, long chunks", 1, 50, 2, 64, 64, 1, 40, "identity", True, (9,)),
]
NM_QUICK = [NM_CASES[2], NM_CASES[5], NM_CASES[6], NM_CASES[7]]


def check_neural_memory(h: Harness, quick: bool) -> None:
    from edgemem.ops import neural_memory_step

    for name, b, t, heads, d, e, depth, chunk, act, norm, positions in NM_QUICK if quick else NM_CASES:
        for dtype in h.dtypes:
            g = torch.Generator().manual_seed(d + e)
            rand = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
            unit = lambda x: torch.nn.functional.normalize(x.view(b, t, heads, d), dim=-1).flatten(2)  # noqa: E731
            q, k, v = unit(rand(b, t, heads * d)), unit(rand(b, t, heads * d)), rand(b, t, heads * d)
            theta = torch.rand(b, t, heads, generator=g, dtype=F64) * 0.2
            eta = torch.rand(b, t, heads, generator=g, dtype=F64)
            alpha = torch.rand(b, t, heads, generator=g, dtype=F64) * 0.1
            shapes = [(b, heads, d, d)] if depth == 1 else [(b, heads, d, e), (b, heads, e, d)]
            w = [rand(*s) * 0.3 / math.sqrt(s[2]) for s in shapes]
            s = [rand(*s) * 0.1 / math.sqrt(s[2]) for s in shapes]
            c = [rand(*s) * 0.3 / math.sqrt(s[2]) for s in shapes]
            nw = rand(heads, d) * 0.2 + 1 if norm else torch.ones(heads, d, dtype=F64)
            nb = rand(heads, d) * 0.1 if norm else torch.zeros(heads, d, dtype=F64)
            pos = torch.tensor(positions, dtype=torch.int64)
            f32 = lambda xs: [x.float().double() for x in xs]  # noqa: E731  (state is float32)
            want = neural_memory_step(
                *[_seen(x, dtype) for x in (q, k, v, theta, eta, alpha)],
                f32(w),
                f32(s),
                f32(c),
                pos,
                num_heads=heads,
                chunk_size=chunk,
                activation=act,
                norm_weight=nw.float().double() if norm else None,
                norm_bias=nb.float().double() if norm else None,
            )
            want_flat = [want[0], *want[1], *want[2], *want[3]]
            kw = dict(num_heads=heads, chunk_size=chunk, activation=act, residual_norm=norm)
            args = (
                [h.put(x, dtype) for x in (q, k, v, theta, eta, alpha)]
                + [h.put(pos)]
                + [h.put(x, torch.float32) for x in (nw, nb)]
            )
            state = [[h.put(x, torch.float32) for x in xs] for xs in (w, s, c)]
            ref = None
            if dtype == torch.float32:
                r = h.ref.neural_memory(
                    *[_cpu(x) if x.is_floating_point() else x.cpu() for x in args],
                    *[[_cpu(x) for x in xs] for xs in state],
                    **kw,
                )
                ref = [r[0], *r[2], *r[3], *r[4]]
            got = h.dev.neural_memory(*args, *state, **kw)
            pos_ok = torch.equal(got[1].cpu(), want[4])
            h.record("NeuralMemory", name, dtype, "prefill", [got[0], *got[2], *got[3], *got[4]], want_flat, ref)
            if not pos_ok:
                h.errors.append(f"NeuralMemory {name}: present_position {got[1].cpu().tolist()} != {want[4].tolist()}")
            # in place, then steps on one in-place state
            st = [[x.clone() for x in xs] for xs in state]
            p2 = args[6].clone()
            got = h.dev.neural_memory(*args[:6], p2, *args[7:], *st, present=(p2, *st), **kw)
            h.record("NeuralMemory", name, dtype, "in-place", [got[0], *st[0], *st[1], *st[2]], want_flat)
            st = [[x.clone() for x in xs] for xs in state]
            p2 = args[6].clone()
            ys = []
            for i in range(t):
                tok = [x[:, i : i + 1].contiguous() for x in args[:6]]
                ys.append(h.dev.neural_memory(*tok, p2, *args[7:], *st, present=(p2, *st), **kw)[0])
            h.record("NeuralMemory", name, dtype, "steps", [torch.cat(ys, 1), *st[0], *st[1], *st[2]], want_flat)
            if d % 16 or e % 16:
                continue
            try:
                got = h.dev.neural_memory(*args, *state, **kw, chunked=True)
            except NativeError as err:  # more shared memory than the device gives a block
                h.notes.append(f"NeuralMemory {name} {_dt(dtype)}: chunked form refused ({err})")
                continue
            h.record("NeuralMemory", name, dtype, "chunked", [got[0], *got[2], *got[3], *got[4]], want_flat, ref)
            st = [[x.clone() for x in xs] for xs in state]
            p2 = args[6].clone()
            got = h.dev.neural_memory(*args[:6], p2, *args[7:], *st, present=(p2, *st), **kw, chunked=True)
            h.record("NeuralMemory", name, dtype, "chunked in-place", [got[0], *st[0], *st[1], *st[2]], want_flat)


# ---------------------------------------------------------------------------------------------
# Timing: decode steps against the memory floor


def _time_us(fn, iters: int = 200, warmup: int = 20) -> float:
    """Host-timed µs per call of `fn` run back to back: device time plus launch overhead."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def _graph_us(fn, iters: int = 100, replays: int = 10) -> float | None:
    """µs per call with `iters` calls captured in one CUDA graph: the kernel's device time without the
    host's launch overhead (what a TensorRT engine or a CUDA-graph decode loop sees). None if `fn`
    cannot be captured."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                fn()
        graph.replay()
        torch.cuda.synchronize()
    except Exception:  # capture is not supported by every launcher
        torch.cuda.synchronize()
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (iters * replays)


def _copy_gbs(device) -> float:
    x = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    us = _time_us(lambda: y.copy_(x), iters=20, warmup=3)
    return 2 * x.numel() / (us * 1e-6) / 1e9


def _fla_step():
    """flash-linear-attention's fused_recurrent gated delta rule, or None (with the reason) if not installed."""
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except Exception as e:  # not installed, or built for another torch/triton
        return None, f"{type(e).__name__}: {e}"
    return fused_recurrent_gated_delta_rule, None


def _prefill_inputs(dev, b: int, t: int, heads: int, d: int, dtype: torch.dtype, per_key: bool) -> tuple:
    """A gated-delta prefill's inputs for timing: q, k (unit rows), v, log decay -0.01 (per head or per
    key dim), beta 0.5, zero states in and out."""
    q = torch.randn(b, t, heads * d, device=dev, dtype=dtype)
    k = torch.nn.functional.normalize(torch.randn(b, t, heads, d, device=dev), dim=-1).flatten(2).to(dtype)
    v = torch.randn(b, t, heads * d, device=dev, dtype=dtype)
    g = torch.full((b, t, heads * (d if per_key else 1)), -0.01, device=dev, dtype=dtype)
    beta = torch.full((b, t, heads), 0.5, device=dev, dtype=dtype)
    s0, s1 = torch.zeros(b, heads, d, d, device=dev), torch.zeros(b, heads, d, d, device=dev)
    return q, k, v, g, beta, s0, s1


def _window_step(h: Harness, b: int, heads: int, d: int, window: int, persistent: int, dtype: torch.dtype):
    """A WindowAttention decode step on a full ring, in place: the call's tensors and keywords, and the
    workspace bytes its split form takes (0: none)."""
    dev = h.device
    q, k, v = (torch.randn(b, 1, heads * d, device=dev, dtype=dtype) for _ in range(3))
    rk, rv = (torch.randn(b, heads, window, d, device=dev, dtype=dtype) for _ in range(2))
    pk, pv = (torch.randn(b, heads, persistent, d, device=dev, dtype=dtype) for _ in range(2))
    pos = torch.full((b,), 10 * window, dtype=torch.int64, device=dev)
    kw = dict(
        num_heads=heads,
        window=window,
        dilation=[1] * heads,
        scale=d**-0.5,
        output=torch.empty_like(q),
        present_key=rk,
        present_value=rv,
    )
    nbytes = max(n.window_attention_workspace(q, v, rk, pk, num_heads=heads, window=window) for n in _natives(h))
    return (q, k, v, rk, rv, pos, pk, pv), kw, nbytes


def time_decode(h: Harness, peak: float) -> list[Timing]:
    dev, out = h.device, []
    copy = _copy_gbs(dev)
    fp16 = torch.float16
    fla, why = _fla_step()
    if fla is None:
        h.notes.append(f"flash-linear-attention not compared ({why})")

    def la(case, b, hq, hkv, dk, dv, dtype, rule="gated_delta"):
        e = torch.tensor([], dtype=dtype).element_size()
        q = torch.randn(b, 1, hq * dk, device=dev, dtype=dtype)
        k = torch.nn.functional.normalize(torch.randn(b, 1, hkv, dk, device=dev), dim=-1).flatten(2).to(dtype)
        v = torch.randn(b, 1, hkv * dv, device=dev, dtype=dtype)
        s = torch.zeros(b, hkv, dk, dv, device=dev)
        g = torch.full((b, 1, hkv), -0.01, device=dev, dtype=dtype)
        beta = torch.full((b, 1, hkv), 0.5, device=dev, dtype=dtype)
        o = torch.empty(b, 1, hq * dv, device=dev, dtype=dtype)
        kw = dict(update_rule=rule, scale=dk**-0.5, q_num_heads=hq, kv_num_heads=hkv, output=o, present_state=s)
        step = lambda n=h.dev: n.linear_attention(q, k, v, s, g, beta, **kw)  # noqa: E731
        us, graph_us = _time_us(step), _graph_us(step)
        base = _graph_us(partial(step, h.base)) if h.base else None
        state = s.numel() * 4
        io = (q.numel() + k.numel() + v.numel() + o.numel() + 2 * b * hkv) * e
        fla_t = None
        if fla is not None and hq == hkv:
            fq, fk, fv = (x.view(b, 1, hkv, -1) for x in (q, k, v))
            s0 = torch.zeros(b, hkv, dk, dv, device=dev)
            fla_step = lambda: fla(  # noqa: E731
                fq,
                fk,
                fv,
                g,
                beta,
                scale=dk**-0.5,
                initial_state=s0,  # noqa: E731
                output_final_state=True,
            )
            try:
                fla_t = (_time_us(fla_step), _graph_us(fla_step))
            except Exception as e:
                h.notes.append(f"flash-linear-attention failed on {case} {_dt(dtype)}: {type(e).__name__}: {e}")
        out.append(
            Timing(
                "LinearAttention", case, _dt(dtype), us, 2 * state + io, 2 * state, peak, copy, graph_us, fla_t, base
            )
        )

    def wa(case, b, heads, d, window, persistent, dtype):
        e = torch.tensor([], dtype=dtype).element_size()
        args, kw, nbytes = _window_step(h, b, heads, d, window, persistent, dtype)
        q, rk, pk = args[0], args[3], args[6]
        ring = 2 * rk.numel() * e  # every slot is read once (window keys) and one slot written
        io = (4 * q.numel() + 2 * pk.numel()) * e
        forms = [("one block per head", torch.empty(0, dtype=torch.uint8, device=dev))]
        if nbytes:
            forms.append(("keys split over blocks", torch.empty(nbytes, dtype=torch.uint8, device=dev)))
        for form, ws in forms:
            step = partial(h.dev.window_attention, *args, **kw, workspace=ws)
            us, graph_us = _time_us(step), _graph_us(step)
            base = _graph_us(partial(h.base.window_attention, *args, **kw, workspace=ws)) if h.base else None
            row = Timing("WindowAttention", f"{case}, {form}", _dt(dtype), us, ring + io, ring, peak, copy, graph_us)
            out.append(replace(row, base_us=base))

    def nm(case, b, heads, d, e_, depth, dtype):
        el = torch.tensor([], dtype=dtype).element_size()
        x = [torch.randn(b, 1, heads * d, device=dev, dtype=dtype) * 0.1 for _ in range(3)]
        gates = [torch.full((b, 1, heads), val, device=dev, dtype=dtype) for val in (0.01, 0.9, 0.001)]
        pos = torch.full((b,), 1, dtype=torch.int64, device=dev)  # not a chunk start at chunk 16
        nw, nb = torch.ones(heads, d, device=dev), torch.zeros(heads, d, device=dev)
        shapes = [(b, heads, d, d)] if depth == 1 else [(b, heads, d, e_), (b, heads, e_, d)]
        st = [[torch.randn(*s, device=dev) * 0.01 for s in shapes] for _ in range(3)]
        o = torch.empty_like(x[0])
        kw = dict(
            num_heads=heads, chunk_size=1 << 30, activation="silu", residual_norm=False, output=o, present=(pos, *st)
        )
        step = lambda n=h.dev: n.neural_memory(*x, *gates, pos, nw, nb, *st, **kw)  # noqa: E731
        us, graph_us = _time_us(step), _graph_us(step)
        base = _graph_us(partial(step, h.base)) if h.base else None
        state = sum(t.numel() for xs in st for t in xs) * 4
        moved = state // 3 * 5  # read C, W, S; write W, S (no chunk start)
        row = Timing("NeuralMemory", case, _dt(dtype), us, moved + 4 * o.numel() * el, 2 * state, peak, copy, graph_us)
        out.append(replace(row, base_us=base))

    for dtype in (torch.float32, fp16):
        la("4 heads 64x64 (design figure)", 1, 4, 4, 64, 64, dtype)
        la("16 heads 128x128", 1, 16, 16, 128, 128, dtype)
        la("batch 8, 16 heads 128x128", 8, 16, 16, 128, 128, dtype)
        la("GQA 32/8 heads 128x128", 1, 32, 8, 128, 128, dtype)
        wa("titans-mag: 4 heads, window 64, 4 persistent", 1, 4, 64, 64, 4, dtype)
        wa("16 heads d128, window 512", 1, 16, 128, 512, 0, dtype)
        nm("titans-mag: 4 heads 64x128 depth 2", 1, 4, 64, 128, 2, dtype)
        nm("ttt-linear: 4 heads 64x64 depth 1", 1, 4, 64, 64, 1, dtype)
        nm("batch 8, 8 heads 128x512 depth 2", 8, 8, 128, 512, 2, dtype)
    return out


# LinearAttention prefill timing shapes: batch, heads (q = kv), d_k = d_v, T, per-key decay; --quick
# times the two of the table, which spares fla's tuning of the others
PREFILL_SHAPES = [(1, 16, 128, t, False) for t in (16, 32, 64, 128)] + [
    (1, 4, 64, 64, False),
    (1, 16, 128, 512, False),
    (1, 16, 128, 4096, False),
    (8, 16, 128, 512, False),
    (1, 32, 64, 4096, False),
    (1, 16, 128, 512, True),
    (1, 16, 128, 4096, True),
]
PREFILL_QUICK = [(1, 16, 128, 4096, False), (1, 16, 128, 512, False)]


# an earlier library's two forms of a table row (--baseline), or None
Baseline = tuple[float | None, float | None] | None


def time_prefill(
    h: Harness, shapes: list[tuple[int, int, int, int, bool]]
) -> list[tuple[str, str, float | None, float | None, float | None, Baseline]]:
    """LinearAttention prefill (T tokens in one call, gated delta rule) at each shape: the sequential and
    the chunked kernels' µs per call (CUDA-graph device time), and flash-linear-attention's chunked form
    (chunk_gated_delta_rule in fp32 and fp16; chunk_kda for per-key decay in fp16) where installed."""
    dev, rows = h.device, []
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
        from fla.ops.kda import chunk_kda as fla_keyed
    except Exception:
        fla_chunk = fla_keyed = None
    for b, heads, d, t, per_key in shapes:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            q, k, v, g, beta, s0, s1 = _prefill_inputs(dev, b, t, heads, d, dtype, per_key)
            o = torch.empty_like(v)
            kw = dict(
                update_rule="gated_delta",
                scale=d**-0.5,
                q_num_heads=heads,
                kv_num_heads=heads,
                output=o,
                present_state=s1,
            )
            sizes = {k_: kw[k_] for k_ in ("update_rule", "scale", "q_num_heads", "kv_num_heads")}
            nbytes = max(n.linear_attention_workspace(q, v, g, beta, path="chunked", **sizes) for n in _natives(h))
            ws = torch.empty(nbytes, dtype=torch.uint8, device=dev)

            def timed(fn):
                return _graph_us(fn, iters=5, replays=4) or _time_us(fn, iters=10, warmup=3)

            def forms(n: Native) -> tuple[float | None, float | None]:
                seq = timed(lambda: n.linear_attention(q, k, v, s0, g, beta, path="sequential", **kw))
                chunked = timed(lambda: n.linear_attention(q, k, v, s0, g, beta, path="chunked", workspace=ws, **kw))
                return seq, chunked

            seq, chunked = forms(h.dev)
            base = forms(h.base) if h.base else None
            theirs = None
            # fla's Triton kernels tune themselves on first use in each dtype (chunk_kda's over many
            # configurations each): its peers are timed in fp32 and fp16, chunk_kda in fp16
            if fla_chunk is not None and dtype in ((torch.float16,) if per_key else (torch.float32, torch.float16)):
                fq, fk, fv = (x.view(b, t, heads, d) for x in (q, k, v))
                try:
                    fn = lambda: (fla_keyed if per_key else fla_chunk)(  # noqa: E731
                        fq,
                        fk,
                        fv,
                        g.view(b, t, heads, d) if per_key else g,
                        beta,
                        scale=d**-0.5,
                        initial_state=s0,  # noqa: E731
                        output_final_state=True,
                    )
                    theirs = timed(fn)
                except Exception as e:
                    op = "chunk_kda" if per_key else "chunk_gated_delta_rule"
                    h.notes.append(f"fla {op} failed at T={t}: {type(e).__name__}: {e}")
            keyed = ", per-key decay" if per_key else ""
            rows.append((f"b{b} {heads} heads {d}x{d}{keyed}, T={t}", _dt(dtype), seq, chunked, theirs, base))
    return rows


def time_memory_prefill(h: Harness) -> list[tuple[str, str, float | None, float | None, Baseline]]:
    """NeuralMemory prefill (T tokens in one call, chunks of 16): the sequential and the chunked kernels'
    µs per call (CUDA-graph device time); None where a form refuses the shape."""
    dev, rows = h.device, []
    shapes = [  # b, heads, d, e, depth, T
        (1, 4, 64, 128, 2, 64),
        (1, 4, 64, 128, 2, 1024),
        (1, 4, 64, 64, 1, 1024),
        (8, 8, 128, 512, 2, 1024),
    ]
    for b, heads, d, e, depth, t in shapes:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            x = [torch.randn(b, t, heads * d, device=dev, dtype=dtype) * 0.1 for _ in range(3)]
            gates = [torch.full((b, t, heads), val, device=dev, dtype=dtype) for val in (0.01, 0.9, 0.001)]
            pos = torch.zeros(b, dtype=torch.int64, device=dev)
            nw, nb = torch.ones(heads, d, device=dev), torch.zeros(heads, d, device=dev)
            shapes_ = [(b, heads, d, d)] if depth == 1 else [(b, heads, d, e), (b, heads, e, d)]
            st = [[torch.randn(*s_, device=dev) * 0.01 for s_ in shapes_] for _ in range(3)]
            out = [[torch.empty_like(w) for w in xs] for xs in st]
            kw = dict(
                num_heads=heads,
                chunk_size=16,
                activation="silu",
                residual_norm=False,
                output=torch.empty_like(x[0]),
                present=(torch.empty_like(pos), *out),
            )

            def timed(chunked, n=h.dev):
                fn = lambda: n.neural_memory(*x, *gates, pos, nw, nb, *st, **kw, chunked=chunked)  # noqa: E731
                try:
                    fn()
                except NativeError:
                    return None
                return _graph_us(fn, iters=5, replays=4) or _time_us(fn, iters=10, warmup=3)

            case = f"b{b} {heads} heads {d}x{e} depth {depth}, T={t}"
            base = (timed(False, h.base), timed(True, h.base)) if h.base else None
            rows.append((case, _dt(dtype), timed(False), timed(True), base))
    return rows


def time_banded(h: Harness) -> list[tuple[str, str, float | None, float | None, float | None, Baseline]]:
    """BandedAttention over T tokens (Longformer-base: 12 heads of 64, one-sided window 256, a global
    first token): the row-per-warp and the tiled kernels' µs per call, and PyTorch's dense
    scaled_dot_product_attention with the same rule as a [T, T] mask."""
    dev, rows = h.device, []
    for b, heads, d, window, t in [(1, 12, 64, 256, 1024), (1, 12, 64, 256, 4096), (4, 12, 64, 256, 4096)]:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            q, k, v = (torch.randn(b, t, heads * d, device=dev, dtype=dtype) for _ in range(3))
            mask = torch.zeros(b, t, dtype=torch.bool, device=dev)
            mask[:, 0] = True
            pk = torch.zeros(b, heads, 0, d, device=dev, dtype=dtype)
            kw = dict(num_heads=heads, window=window, dilation=[1] * heads, causal=False, scale=d**-0.5)
            out = torch.empty_like(q)

            def timed(fn):
                try:
                    fn()
                except (NativeError, RuntimeError):
                    return None
                return _graph_us(fn, iters=5, replays=4) or _time_us(fn, iters=10, warmup=3)

            def forms(n: Native) -> tuple[float | None, float | None]:
                rows_us = timed(lambda: n.banded_attention(q, k, v, mask, pk, pk, **kw, output=out))
                return rows_us, timed(lambda: n.banded_attention(q, k, v, mask, pk, pk, **kw, output=out, tiled=True))

            rows_us, tiled_us = forms(h.dev)
            base = forms(h.base) if h.base else None
            pos = torch.arange(t, device=dev)
            dense = ((pos[:, None] - pos).abs() <= window) | mask[0][None, :] | mask[0][:, None]
            qh, kh, vh = (x.view(b, t, heads, d).transpose(1, 2) for x in (q, k, v))
            sdpa = torch.nn.functional.scaled_dot_product_attention
            dense_us = timed(lambda: sdpa(qh, kh, vh, attn_mask=dense))
            case = f"b{b} {heads} heads d{d}, window {window}, T={t}"
            rows.append((case, _dt(dtype), rows_us, tiled_us, dense_us, base))
    return rows


# ---------------------------------------------------------------------------------------------


def _kernel_name(name: str) -> str:
    """A profiler's kernel name without return type, namespaces and arguments."""
    name = name.removeprefix("void ").replace("(anonymous namespace)::", "")
    base = re.split(r"[<(]", name, maxsplit=1)[0]
    return base.rsplit("::", 1)[-1] or name[:60]


def kernel_breakdown(h: Harness, quick: bool = False) -> list[tuple[str, str, float, float]]:
    """Device µs per call of every kernel a call launches (PyTorch's profiler over CUPTI): the
    chunked LinearAttention prefill beside flash-linear-attention's on the same inputs (quick: per-head
    decay only), and the WindowAttention decode split. Rows: call, kernel, launches per call, µs per call."""
    from torch.profiler import ProfilerActivity, profile

    dev, rows, reps = h.device, [], 5
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
        from fla.ops.kda import chunk_kda as fla_keyed
    except Exception:
        fla_chunk = fla_keyed = None

    def profiled(label: str, fn) -> None:
        try:
            fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(reps):
                    fn()
                torch.cuda.synchronize()
        except Exception as e:
            h.notes.append(f"kernel breakdown of {label} failed: {type(e).__name__}: {e}")
            return
        for ev in prof.key_averages():
            us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
            if us > 0:
                rows.append((label, _kernel_name(ev.key), ev.count / reps, us / reps))

    b, heads, d, t = 1, 16, 128, 4096
    for dtype, per_key in (
        (torch.float16, False),
        (torch.float32, False),
        *(() if quick else ((torch.float16, True),)),
    ):
        q, k, v, g, beta, s0, s1 = _prefill_inputs(dev, b, t, heads, d, dtype, per_key)
        kw = dict(update_rule="gated_delta", scale=d**-0.5, q_num_heads=heads, kv_num_heads=heads)
        nbytes = max(n.linear_attention_workspace(q, v, g, beta, path="chunked", **kw) for n in _natives(h))
        ws = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        o = torch.empty_like(v)
        case = f"16 heads 128x128{', per-key decay' if per_key else ''}, T={t}, {_dt(dtype)}"
        for n, name in zip(_natives(h), ("edgemem", "baseline")):
            run = partial(
                n.linear_attention, q, k, v, s0, g, beta, path="chunked", workspace=ws, output=o, present_state=s1, **kw
            )
            profiled(f"{name} chunked, {case}", run)
        if dtype == torch.float16 and not per_key:
            # the chunked path in one segment (the default 64 MiB budget runs T = 4096 at 16 heads in three)
            big = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
            run = partial(
                h.dev.linear_attention,
                q,
                k,
                v,
                s0,
                g,
                beta,
                path="chunked",
                workspace=big,
                output=o,
                present_state=s1,
                **kw,
            )
            profiled(f"edgemem chunked in one segment (256 MiB workspace), {case}", run)
            del big
        if fla_chunk is not None:
            fq, fk, fv = (x.view(b, t, heads, d) for x in (q, k, v))
            fg = g.view(b, t, heads, d) if per_key else g
            op, name = (fla_keyed, "chunk_kda") if per_key else (fla_chunk, "chunk_gated_delta_rule")
            run = partial(op, fq, fk, fv, fg, beta, scale=d**-0.5, initial_state=s0, output_final_state=True)
            profiled(f"fla {name}, {case}", run)
    args, kw, nbytes = _window_step(h, 1, heads, d, 512, 0, torch.float32)
    ws = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    for n, name in zip(_natives(h), ("edgemem", "baseline")):
        run = partial(n.window_attention, *args, **kw, workspace=ws)
        profiled(f"{name} WindowAttention decode, 16 heads d128, window 512, fp32", run)
    return rows


def _us(x: float | None) -> str:
    return f"{x:.1f}" if x is not None else "-"


def _speedup(slow: float | None, fast: float | None) -> str:
    return f"{slow / fast:.2f}×" if slow and fast else "-"


def _per_token(case: str, us: float | None) -> str:
    """µs per token of a call whose case name ends in "T=<tokens>"."""
    return f"{us / int(case.rsplit('T=', 1)[1]):.3f}" if us is not None else "-"


def report(
    h: Harness,
    timings: list[Timing],
    prefill: list,
    memory: list,
    banded: list,
    breakdown: list,
    device_name: str,
    elapsed: float,
) -> str:
    lines = [f"# edgemem kernel check — {device_name}", ""]
    # --baseline: each timing table gains the earlier library's µs and the speed-up (baseline µs / ours)
    base_head = " baseline µs | speed-up |" if h.base else ""
    base_rule = "---|---|" if h.base else ""

    def base_cells(base: Baseline, ours: tuple) -> str:
        if not h.base:
            return ""
        return "".join(f" {_us(b)} | {_speedup(b, o)} |" for b, o in zip(base or (None, None), ours))

    failed = [r for r in h.rows if not r.ok]
    lines.append(
        f"{len(h.rows) - len(failed)} of {len(h.rows)} numerical checks passed "
        f"({elapsed:.0f} s); tolerances: fp32 {TOL[torch.float32]:.0e}, fp16 {TOL[torch.float16]:.0e}, "
        f"bf16 {TOL[torch.bfloat16]:.1e} "
        f"relative to truth, fp32 {REF_TOL:.0e} to the CPU reference."
    )
    lines += ["", "| op | case | dtype | mode | err vs truth | err vs CPU ref | ok |", "|---|---|---|---|---|---|---|"]
    for r in h.rows:
        ref = f"{r.err_ref:.1e}" if r.err_ref is not None else "-"
        lines.append(
            f"| {r.op} | {r.case} | {r.dtype} | {r.mode} | {r.err_truth:.1e} | {ref} | {'ok' if r.ok else 'FAIL'} |"
        )
    worst = {}
    for r in h.rows:
        key = (r.op, r.dtype)
        worst[key] = max(worst.get(key, 0.0), r.err_truth)
    lines += ["", "Worst error vs truth per op and dtype:", ""]
    lines += [f"- {op} {dt}: {err:.1e}" for (op, dt), err in sorted(worst.items())]
    for e in h.errors:
        lines.append(f"- ERROR: {e}")
    if timings:
        t0 = timings[0]
        lines += [
            "",
            f"## Decode timing (T = 1, state in place); peak {t0.peak_gbs:.0f} GB/s, "
            f"measured copy {t0.copy_gbs:.0f} GB/s",
            "",
            "µs/step: device time from a CUDA graph of back-to-back steps; launched: one host launch "
            "per step (Python + ctypes overhead included). fla: flash-linear-attention's "
            "fused_recurrent_gated_delta_rule on the same step (graph / launched)."
            + (" baseline: the --baseline library on the same calls; speed-up = its µs / these µs." if h.base else ""),
            "",
            "| op | case | dtype | µs/step | launched µs | bytes moved | achieved GB/s | % of copy | "
            "floor µs (2×state / copy) | step / floor | fla µs (graph / launched) |" + base_head,
            "|---|---|---|---|---|---|---|---|---|---|---|" + base_rule,
        ]
        us = lambda x: f"{x:.2f}" if x is not None else "-"  # noqa: E731
        for t in timings:
            floor_us = t.floor_bytes / (t.copy_gbs * 1e9) * 1e6
            fla = f"{us(t.fla[1])} / {us(t.fla[0])}" if t.fla else "-"
            base = f" {us(t.base_us)} | {_speedup(t.base_us, t.graph_us)} |" if h.base else ""
            lines.append(
                f"| {t.op} | {t.case} | {t.dtype} | {us(t.graph_us)} | {t.us:.2f} | {t.bytes:,} | "
                f"{t.achieved:.0f} | {100 * t.achieved / t.copy_gbs:.0f}% | {floor_us:.2f} | "
                f"{t.device_us / floor_us:.1f}× | {fla} |" + base
            )
    if prefill:
        lines += [
            "",
            "## LinearAttention prefill (one call of T tokens, gated delta rule, CUDA-graph device time)",
            "",
            "sequential: the tokens in order with the state in registers; chunked: the tensor-core form "
            "(auto takes it from 128 tokens at batch x kv heads <= 64, per-head decay); fla: "
            "chunk_gated_delta_rule (chunk_kda for per-key decay) on the same inputs; "
            "speed vs fla = fla µs / chunked µs.",
            "",
            "| case | dtype | sequential µs | chunked µs | chunked µs/token | fla µs | speed vs fla |"
            + base_head.replace("baseline", "baseline sequential")
            + base_head.replace("baseline", "baseline chunked"),
            "|---|---|---|---|---|---|---|" + 2 * base_rule,
        ]
        for case, dt, seq, chunked, theirs, base in prefill:
            per = _per_token(case, chunked)
            ratio = _speedup(theirs, chunked)
            lines.append(
                f"| {case} | {dt} | {_us(seq)} | {_us(chunked)} | {per} | {_us(theirs)} | {ratio} |"
                + base_cells(base, (seq, chunked))
            )
    if memory:
        lines += [
            "",
            "## NeuralMemory prefill (one call of T tokens, chunks of 16, CUDA-graph device time)",
            "",
            "sequential: the tokens in order; chunked: pieces of up to 16 tokens as tensor-core products; "
            "speed-up = sequential µs / chunked µs.",
            "",
            "| case | dtype | sequential µs | chunked µs | chunked µs/token | speed-up |"
            + base_head.replace("baseline", "baseline sequential")
            + base_head.replace("baseline", "baseline chunked"),
            "|---|---|---|---|---|---|" + 2 * base_rule,
        ]
        for case, dt, seq, chunked, base in memory:
            per = _per_token(case, chunked)
            ratio = _speedup(seq, chunked)
            lines.append(
                f"| {case} | {dt} | {_us(seq)} | {_us(chunked)} | {per} | {ratio} |" + base_cells(base, (seq, chunked))
            )
    if banded:
        lines += [
            "",
            "## BandedAttention (one call over T tokens, CUDA-graph device time)",
            "",
            "rows: a warp per query row; tiled: 64 query rows against 16-key tiles on tensor cores; dense: "
            "PyTorch's scaled_dot_product_attention with the rule as a [T, T] mask.",
            "",
            "| case | dtype | rows µs | tiled µs | dense µs | tiled vs rows | tiled vs dense |"
            + base_head.replace("baseline", "baseline rows")
            + base_head.replace("baseline", "baseline tiled"),
            "|---|---|---|---|---|---|---|" + 2 * base_rule,
        ]
        for case, dt, rows_us, tiled_us, dense_us, base in banded:
            lines.append(
                f"| {case} | {dt} | {_us(rows_us)} | {_us(tiled_us)} | {_us(dense_us)} | "
                f"{_speedup(rows_us, tiled_us)} | {_speedup(dense_us, tiled_us)} |"
                + base_cells(base, (rows_us, tiled_us))
            )
    if breakdown:
        lines += [
            "",
            "## Where a call's time goes (PyTorch profiler over CUPTI, device µs per call, 5 calls)",
            "",
            "| call | kernel | launches per call | µs per call |",
            "|---|---|---|---|",
        ]
        for call, kernel, launches, us in breakdown:
            lines.append(f"| {call} | {kernel} | {launches:g} | {us:.1f} |")
    for n in h.notes:
        lines.append(f"- note: {n}")
    return "\n".join(lines) + "\n"


CHECKS = {
    "linear": check_linear_attention,
    "window": check_window_attention,
    "banded": check_banded_attention,
    "memory": check_neural_memory,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", type=Path, required=True, help="build dir with libedgemem_{kernels,reference}.so")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a few small cases (for compute-sanitizer); timing: the issue's two prefill shapes, per-head decay",
    )
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--report", type=Path, help="write the markdown report here too")
    ap.add_argument("--cpu-self-test", action="store_true", help="check this script with the CPU reference")
    ap.add_argument(
        "--emulate", action="store_true", help="check the kernels on the CPU emulator (scripts/emulate.py's library)"
    )
    ap.add_argument(
        "--op", action="append", choices=sorted(CHECKS), help="check these ops only (repeatable; default: every op)"
    )
    ap.add_argument(
        "--baseline",
        type=Path,
        help="build dir of an earlier libedgemem_kernels.so, timed beside this one in every table (not checked)",
    )
    args = ap.parse_args()

    if args.baseline and (args.cpu_self_test or args.emulate or args.no_timing):
        print(
            "error: --baseline times kernels on a GPU: not with --cpu-self-test, --emulate or --no-timing",
            file=sys.stderr,
        )
        return 2

    kernels = args.build / ("libedgemem_kernels_emu.so" if args.emulate else "libedgemem_kernels.so")
    baseline = [args.baseline / "libedgemem_kernels.so"] if args.baseline else []
    for lib in (args.build / "libedgemem_reference.so", *([] if args.cpu_self_test else [kernels]), *baseline):
        if not lib.is_file():
            how = "plugins/scripts/emulate.py --build" if lib.name.endswith("_emu.so") else "cmake -S plugins -B"
            if lib in baseline:
                how = "cmake -S <the earlier tree's plugins> -B"
            print(f"error: {lib} not found: build it with `{how} {lib.parent}`", file=sys.stderr)
            return 2
    ref = Native(args.build / "libedgemem_reference.so")
    if args.cpu_self_test:
        h = Harness(ref, ref, torch.device("cpu"), [torch.float32])
        device_name, args.no_timing = "CPU reference (self-test)", True
    elif args.emulate:
        h = Harness(
            Native(kernels),
            ref,
            torch.device("cpu"),
            [torch.float32, torch.float16, torch.bfloat16],
        )
        device_name, args.no_timing = "CUDA kernels on the CPU emulator", True
    else:
        if not torch.cuda.is_available():
            print("error: PyTorch sees no CUDA device", file=sys.stderr)
            return 2
        h = Harness(
            Native(kernels),
            ref,
            torch.device("cuda"),
            [torch.float32, torch.float16, torch.bfloat16],
            Native(baseline[0]) if baseline else None,
        )
        device_name = torch.cuda.get_device_name()
    t0 = time.time()
    parts: dict[str, list] = {"timings": [], "prefill": [], "memory": [], "banded": [], "breakdown": []}

    def text() -> str:
        return report(h, *parts.values(), device_name, time.time() - t0)

    def section(name: str, run) -> None:
        # each section's time on stderr, and the report so far on disk: a run cut short keeps what it measured
        start = time.time()
        run()
        print(f"gpu_check: {name} done in {time.time() - start:.0f} s", file=sys.stderr, flush=True)
        if args.report:
            args.report.write_text(text())

    for check in (CHECKS[op] for op in CHECKS if op in (args.op or CHECKS)):

        def numerics(check=check) -> None:
            try:
                check(h, args.quick)
            except NativeError as e:
                h.errors.append(f"{check.__name__}: {e}")
            if h.device.type == "cuda":
                torch.cuda.synchronize()

        section(check.__name__, numerics)
    if not args.no_timing:
        peak = h.dev.lib.em_cuda_peak_bandwidth_gbs
        peak.restype = __import__("ctypes").c_double
        section("time_decode", lambda: parts.update(timings=time_decode(h, peak(torch.cuda.current_device()))))
        section("time_memory_prefill", lambda: parts.update(memory=time_memory_prefill(h)))
        section("time_banded", lambda: parts.update(banded=time_banded(h)))
        # last of the tables, a section per shape (a run cut short keeps the shapes it timed): fla's kernels
        # tune themselves on first use
        for shape in PREFILL_QUICK if args.quick else PREFILL_SHAPES:
            section(f"time_prefill {shape}", lambda shape=shape: parts["prefill"].extend(time_prefill(h, [shape])))

        def breakdown() -> None:
            try:
                parts.update(breakdown=kernel_breakdown(h, args.quick))
            except Exception as e:  # the numbers above still get reported
                h.notes.append(f"kernel breakdown failed: {type(e).__name__}: {e}")

        section("kernel_breakdown", breakdown)
    print(text())
    return 0 if all(r.ok for r in h.rows) and not h.errors else 1


if __name__ == "__main__":
    sys.exit(main())
