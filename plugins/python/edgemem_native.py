"""ctypes bindings of edgemem's native libraries, shared by the tests and scripts/gpu_check.py.

Two libraries expose the same C ABI over the same structs (each op's `launch.h` in plugins/):
`libedgemem_reference.so` (`em_ref_*`: the CPU reference, float32 host tensors) and
`libedgemem_kernels.so` (`em_cuda_*`: the CUDA kernels, float32/float16/bfloat16 device tensors, run on
torch's current stream). `Native(path)` picks the prefix from the library it loads; every op
takes torch tensors in the ONNX node's layout and returns new output tensors, or writes into
`present_*` tensors given by the caller (pass the past tensors themselves to run in place).

The ctypes structs below mirror the C structs of each op's `launch.h`; loading the reference library
compares them with the compiled layout (`em_ref_abi_layout`: every struct's size and every field's
offset) and refuses a mismatch, so the mirror cannot drift from the headers silently.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_float, c_int32, c_int64, c_size_t, c_void_p

import torch

UPDATE_RULES = {"linear": 0, "gated": 1, "delta": 2, "gated_delta": 3}
ACTIVATIONS = {"silu": 0, "gelu": 1, "relu": 2, "identity": 3}
DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
STATUS = {1: "bad argument", 2: "unsupported", 3: "CUDA error"}
LA_PATHS = {"auto": 0, "sequential": 1, "chunked": 2}  # edgemem::cuda::LaPath


def _check_path(path: str) -> None:
    if path not in LA_PATHS:
        raise ValueError(f"LinearAttention path {path!r}: expected one of {', '.join(LA_PATHS)}")


def _struct(name, c_name, fields):
    return type(name, (ctypes.Structure,), {"_fields_": fields, "c_name": c_name})


LAParams = _struct(
    "LAParams",
    "la::Params",
    [(n, c_int32) for n in ("batch", "seq", "q_heads", "kv_heads", "dk", "dv", "rule")]
    + [("scale", c_float), ("decay_per_key", c_int32), ("beta_per_head", c_int32)],
)
LAIO = _struct(
    "LAIO",
    "LinearAttentionIO",
    [(n, c_void_p) for n in ("query", "key", "value", "past_state", "decay", "beta", "output", "present_state")],
)
WindowParams = _struct(
    "WindowParams",
    "attn::WindowParams",
    [(n, c_int32) for n in ("batch", "seq", "heads", "d", "dv", "window", "ring", "persistent")] + [("scale", c_float)],
)
WindowIO = _struct(
    "WindowIO",
    "WindowAttentionIO",
    [
        (n, c_void_p)
        for n in (
            "query",
            "key",
            "value",
            "past_key",
            "past_value",
            "position",
            "persistent_key",
            "persistent_value",
            "output",
            "present_key",
            "present_value",
        )
    ],
)
BandedParams = _struct(
    "BandedParams",
    "attn::BandedParams",
    [(n, c_int32) for n in ("batch", "seq", "heads", "d", "dv", "window", "causal", "persistent")]
    + [("scale", c_float)],
)
BandedIO = _struct(
    "BandedIO",
    "BandedAttentionIO",
    [(n, c_void_p) for n in ("query", "key", "value", "global_mask", "persistent_key", "persistent_value", "output")],
)
NMParams = _struct(
    "NMParams",
    "nm::Params",
    [
        (n, c_int32)
        for n in (
            "batch",
            "seq",
            "heads",
            "d",
            "e",
            "depth",
            "chunk",
            "activation",
            "residual_norm",
            "position_per_batch",
        )
    ],
)
NMIO = _struct(
    "NMIO",
    "NeuralMemoryIO",
    [(n, c_void_p) for n in ("query", "key", "value", "theta", "eta", "alpha", "position", "norm_weight", "norm_bias")]
    + [(n, c_void_p * 2) for n in ("weights", "momentum", "chunk_weights")]
    + [(n, c_void_p) for n in ("output", "present_position")]
    + [(n, c_void_p * 2) for n in ("present_weights", "present_momentum", "present_chunk_weights")],
)


STRUCTS = (LAParams, LAIO, WindowParams, WindowIO, BandedParams, BandedIO, NMParams, NMIO)


class NativeError(RuntimeError):
    pass


def layout_mismatches(layout: str) -> list[str]:
    """What differs between the ctypes mirror and `layout` (em_ref_abi_layout's text); empty when they agree."""
    compiled: dict[str, list[tuple[str, int]]] = {}
    sizes: dict[str, int] = {}
    for line in layout.splitlines():
        name, value = line.rsplit(" ", 1)
        struct, _, field = name.partition(".")
        if field:
            compiled.setdefault(struct, []).append((field, int(value)))
        else:
            sizes[struct] = int(value)
    out = []
    for s in STRUCTS:
        if s.c_name not in sizes:
            out.append(f"{s.c_name}: not in the library")
            continue
        mirror = [(name, getattr(s, name).offset) for name, _ in s._fields_]
        if mirror != compiled.get(s.c_name, []):
            out.append(f"{s.c_name}: fields {mirror} in Python, {compiled.get(s.c_name)} in C")
        if ctypes.sizeof(s) != sizes[s.c_name]:
            out.append(f"{s.c_name}: {ctypes.sizeof(s)} bytes in Python, {sizes[s.c_name]} in C")
    out += [f"{name}: in the library, not in Python" for name in sizes.keys() - {s.c_name for s in STRUCTS}]
    return out


def _stream() -> c_void_p:
    """The current CUDA stream; the null stream where PyTorch has no CUDA (the kernels' emulator on the CPU,
    scripts/emulate.py)."""
    return c_void_p(torch.cuda.current_stream().cuda_stream if torch.cuda.is_available() else None)


def workspace_buffer(nbytes: int, device: torch.device | str) -> torch.Tensor:
    """A uint8 workspace of nbytes starting on a 256-byte boundary, as the kernels take it (CUDA's allocations
    are; the CPU's, for the emulator, are cut to it)."""
    buf = torch.empty(nbytes + 255, dtype=torch.uint8, device=device)
    start = -buf.data_ptr() % 256
    return buf[start : start + nbytes]


def _ptr(x: torch.Tensor | None) -> int | None:
    if x is None:
        return None
    if not x.is_contiguous():
        raise ValueError("native ops take contiguous tensors")
    return x.data_ptr() or None


class Native:
    """One native library: the CPU reference or the CUDA kernels."""

    def __init__(self, path: str) -> None:
        self.lib = ctypes.CDLL(str(path))
        self.cuda = hasattr(self.lib, "em_cuda_abi_version")
        self.prefix = "em_cuda_" if self.cuda else "em_ref_"
        if not self.cuda:
            self.lib.em_ref_abi_layout.restype = ctypes.c_char_p
            wrong = layout_mismatches(self.lib.em_ref_abi_layout().decode())
            if wrong:
                raise NativeError(
                    f"{path}: the ctypes structs of edgemem_native.py do not match the C ABI: " + "; ".join(wrong)
                )
        p = POINTER
        sigs = {
            "linear_attention": [p(LAParams), p(LAIO)],
            "window_attention": [p(WindowParams), p(c_int32), p(WindowIO)],
            "banded_attention": [p(BandedParams), p(c_int32), p(BandedIO)],
            "banded_attention_tiled": [p(BandedParams), p(c_int32), p(BandedIO)],
            "neural_memory": [p(NMParams), p(NMIO)],
            "neural_memory_chunked": [p(NMParams), p(NMIO)],
        }
        for name, args in sigs.items():
            fn = getattr(self.lib, self.prefix + name)
            fn.argtypes = args + ([c_int32, c_int32, c_int32, c_void_p] if self.cuda else [])
            fn.restype = c_int32
        if self.cuda:
            self.lib.em_cuda_linear_attention.argtypes = [
                p(LAParams),
                p(LAIO),
                c_int32,
                c_int32,
                c_void_p,
                c_size_t,
                c_void_p,
            ]
            self.lib.em_cuda_linear_attention_workspace.argtypes = [p(LAParams), c_int32]
            self.lib.em_cuda_linear_attention_workspace.restype = c_size_t
            self.lib.em_cuda_window_attention.argtypes = [
                p(WindowParams),
                p(c_int32),
                p(WindowIO),
                c_int32,
                c_int32,
                c_int32,
                c_void_p,
                c_size_t,
                c_void_p,
            ]
            self.lib.em_cuda_window_attention_workspace.argtypes = [p(WindowParams)]
            self.lib.em_cuda_window_attention_workspace.restype = c_size_t
        else:
            self.lib.em_ref_linear_attention_chunked.argtypes = [p(LAParams), p(LAIO), c_int64]
            self.lib.em_ref_linear_attention_chunked.restype = c_int32
            self.lib.em_ref_linear_attention_workspace.argtypes = [p(LAParams)]
            self.lib.em_ref_linear_attention_workspace.restype = c_size_t

    def _call(self, name: str, *args, dtypes=(0, 0, 0)) -> None:
        fn = getattr(self.lib, self.prefix + name)
        if self.cuda:
            args = (*args, *dtypes, _stream())
        status = fn(*args)
        if status:
            raise NativeError(f"{self.prefix}{name}: {STATUS.get(status, status)}")

    def _check_dtype(self, x: torch.Tensor) -> int:
        if x.dtype not in DTYPES or (not self.cuda and x.dtype != torch.float32):
            raise ValueError(f"{self.prefix}: unsupported dtype {x.dtype}")
        return DTYPES[x.dtype]

    # -----------------------------------------------------------------------------------------
    def linear_attention(
        self,
        query,
        key,
        value,
        past_state,
        decay,
        beta,
        *,
        update_rule,
        scale,
        q_num_heads,
        kv_num_heads,
        output=None,
        present_state=None,
        path="auto",
        workspace=None,
    ):
        """The `edgemem::LinearAttention` node: all six inputs present, packed layouts.

        CUDA: `path` picks the form (auto, sequential, chunked); `workspace` is a uint8 device tensor for the
        chunked form (default: as large as `linear_attention_workspace` says; a smaller one runs it in shorter
        segments). CPU reference: `path="chunked"` runs the chunked form there, in segments sized to
        `workspace` bytes (an int) if given."""
        _check_path(path)
        params, (b, t, dv) = self._la_params(query, value, decay, beta, update_rule, scale, q_num_heads, kv_num_heads)
        if output is None:
            output = query.new_empty(b, t, q_num_heads * dv)
        if present_state is None:
            present_state = torch.empty_like(past_state)
        io = LAIO(*(_ptr(x) for x in (query, key, value, past_state, decay, beta, output, present_state)))
        dtype = self._check_dtype(query)
        if self.cuda:
            if workspace is None:
                nbytes = self.lib.em_cuda_linear_attention_workspace(ctypes.byref(params), LA_PATHS[path])
                workspace = workspace_buffer(nbytes, query.device) if nbytes else None
            ws, nbytes = (_ptr(workspace), workspace.numel()) if workspace is not None else (None, 0)
            status = self.lib.em_cuda_linear_attention(
                ctypes.byref(params),
                ctypes.byref(io),
                dtype,
                LA_PATHS[path],
                ws,
                nbytes,
                _stream(),
            )
            if status:
                raise NativeError(f"em_cuda_linear_attention: {STATUS.get(status, status)}")
        elif path == "chunked":
            status = self.lib.em_ref_linear_attention_chunked(ctypes.byref(params), ctypes.byref(io), workspace or 0)
            if status:
                raise NativeError(f"em_ref_linear_attention_chunked: {STATUS.get(status, status)}")
        else:
            self._call("linear_attention", ctypes.byref(params), ctypes.byref(io))
        return output, present_state

    def linear_attention_workspace(
        self, query, value, decay, beta, *, update_rule, scale, q_num_heads, kv_num_heads, path="auto"
    ) -> int:
        """Bytes of workspace a call on `path` uses for these shapes (0: none); the CPU reference's chunked form
        lays out the same bytes (on the CPU, pass them as `workspace`, an int)."""
        _check_path(path)
        params, _ = self._la_params(query, value, decay, beta, update_rule, scale, q_num_heads, kv_num_heads)
        if self.cuda:
            return self.lib.em_cuda_linear_attention_workspace(ctypes.byref(params), LA_PATHS[path])
        return 0 if path == "sequential" else self.lib.em_ref_linear_attention_workspace(ctypes.byref(params))

    @staticmethod
    def _la_params(query, value, decay, beta, update_rule, scale, q_num_heads, kv_num_heads):
        b, t, _ = query.shape
        dk = query.shape[2] // q_num_heads
        dv = value.shape[2] // kv_num_heads
        params = LAParams(
            b,
            t,
            q_num_heads,
            kv_num_heads,
            dk,
            dv,
            UPDATE_RULES[update_rule],
            scale,
            int(decay.shape[2] == kv_num_heads * dk and dk > 1),
            int(beta.shape[2] == kv_num_heads),
        )
        return params, (b, t, dv)

    def window_attention(
        self,
        query,
        key,
        value,
        past_key,
        past_value,
        position,
        persistent_key,
        persistent_value,
        *,
        num_heads,
        window,
        dilation,
        scale,
        output=None,
        present_key=None,
        present_value=None,
        workspace=None,
    ):
        """The `edgemem::WindowAttention` node: position int64 [B], persistent [B, H, P, D].

        CUDA: `workspace` (a uint8 device tensor) lets a one-token call split its keys over blocks; default:
        as large as the kernels ask for; an empty tensor runs one block per head."""
        b, t, _ = query.shape
        dv = value.shape[2] // num_heads
        params = self._window_params(query, value, past_key, persistent_key, num_heads, window, scale)
        dil = (c_int32 * num_heads)(*dilation)
        output = query.new_empty(b, t, num_heads * dv) if output is None else output
        present_key = torch.empty_like(past_key) if present_key is None else present_key
        present_value = torch.empty_like(past_value) if present_value is None else present_value
        io = WindowIO(
            *(
                _ptr(x)
                for x in (
                    query,
                    key,
                    value,
                    past_key,
                    past_value,
                    position,
                    persistent_key,
                    persistent_value,
                    output,
                    present_key,
                    present_value,
                )
            )
        )
        dtypes = (self._check_dtype(query), self._check_dtype(past_key), self._check_dtype(persistent_key))
        if not self.cuda:
            self._call("window_attention", ctypes.byref(params), dil, ctypes.byref(io), dtypes=dtypes)
            return output, present_key, present_value
        if workspace is None:
            nbytes = self.window_attention_workspace(
                query, value, past_key, persistent_key, num_heads=num_heads, window=window
            )
            workspace = workspace_buffer(nbytes, query.device)
        status = self.lib.em_cuda_window_attention(
            ctypes.byref(params),
            dil,
            ctypes.byref(io),
            *dtypes,
            _ptr(workspace) if workspace.numel() else None,
            workspace.numel(),
            _stream(),
        )
        if status:
            raise NativeError(f"em_cuda_window_attention: {STATUS.get(status, status)}")
        return output, present_key, present_value

    def window_attention_workspace(self, query, value, past_key, persistent_key, *, num_heads, window) -> int:
        """CUDA: bytes of workspace a call with these shapes can use (0: it runs one block per head)."""
        params = self._window_params(query, value, past_key, persistent_key, num_heads, window, 1.0)
        return self.lib.em_cuda_window_attention_workspace(ctypes.byref(params)) if self.cuda else 0

    @staticmethod
    def _window_params(query, value, past_key, persistent_key, num_heads, window, scale):
        b, t, _ = query.shape
        return WindowParams(
            b,
            t,
            num_heads,
            query.shape[2] // num_heads,
            value.shape[2] // num_heads,
            window,
            past_key.shape[2],
            persistent_key.shape[2],
            scale,
        )

    def banded_attention(
        self,
        query,
        key,
        value,
        global_mask,
        persistent_key,
        persistent_value,
        *,
        num_heads,
        window,
        dilation,
        causal,
        scale,
        output=None,
        tiled=False,
    ):
        """The `edgemem::BandedAttention` node: global_mask bool [B, T], persistent [B, H, P, D].
        `tiled`: the tiled form (blocks of query rows against tiles of keys) instead of a row at a time."""
        b, t, _ = query.shape
        d, dv = query.shape[2] // num_heads, value.shape[2] // num_heads
        params = BandedParams(b, t, num_heads, d, dv, window, int(causal), persistent_key.shape[2], scale)
        dil = (c_int32 * num_heads)(*dilation)
        output = query.new_empty(b, t, num_heads * dv) if output is None else output
        io = BandedIO(*(_ptr(x) for x in (query, key, value, global_mask, persistent_key, persistent_value, output)))
        dtypes = (self._check_dtype(query), self._check_dtype(persistent_key), 0)
        name = "banded_attention_tiled" if tiled else "banded_attention"
        self._call(name, ctypes.byref(params), dil, ctypes.byref(io), dtypes=dtypes)
        return output

    def neural_memory(
        self,
        query,
        key,
        value,
        theta,
        eta,
        alpha,
        position,
        norm_weight,
        norm_bias,
        weights,
        momentum,
        chunk_weights,
        *,
        num_heads,
        chunk_size,
        activation,
        residual_norm,
        output=None,
        present=None,
        chunked=False,
    ):
        """The `edgemem::NeuralMemory` node. weights/momentum/chunk_weights: one tensor per layer.

        Returns (output, present_position, present_weights, present_momentum, present_chunk_weights);
        `present` = (position, weights, momentum, chunk_weights) to write into given tensors.
        `chunked`: the chunked form (pieces of up to 16 tokens as matrix products) instead of the
        sequential one."""
        b, t, _ = query.shape
        depth = len(weights)
        d = query.shape[2] // num_heads
        e = weights[0].shape[-1]
        params = NMParams(
            b,
            t,
            num_heads,
            d,
            e,
            depth,
            chunk_size,
            ACTIVATIONS[activation],
            int(residual_norm),
            int(position.numel() == b),
        )
        output = query.new_empty(query.shape) if output is None else output
        if present is None:
            present = (
                torch.empty_like(position),
                [torch.empty_like(w) for w in weights],
                [torch.empty_like(w) for w in momentum],
                [torch.empty_like(w) for w in chunk_weights],
            )
        pos_out, w_out, s_out, c_out = present
        pair = lambda xs: (c_void_p * 2)(*[_ptr(x) for x in xs] + [None] * (2 - len(xs)))  # noqa: E731
        io = NMIO(
            *(_ptr(x) for x in (query, key, value, theta, eta, alpha, position, norm_weight, norm_bias)),
            pair(weights),
            pair(momentum),
            pair(chunk_weights),
            _ptr(output),
            _ptr(pos_out),
            pair(w_out),
            pair(s_out),
            pair(c_out),
        )
        name = "neural_memory_chunked" if chunked else "neural_memory"
        self._call(name, ctypes.byref(params), ctypes.byref(io), dtypes=(self._check_dtype(query), 0, 0))
        return output, pos_out, tuple(w_out), tuple(s_out), tuple(c_out)
