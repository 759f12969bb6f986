"""The onnxruntime backend ("ort" on CPU, "ort-cuda"): state in `OrtValue`s, graphs run through IOBindings.

State lives in `OrtValue`s allocated once with `OrtValue.ortvalue_from_shape_and_type` and owned
by the stream (never `ortvalue_from_numpy` on a temporary: it does not keep the array alive).

Fixed-size state (every recurrent preset). Each stream owns two sets of state buffers, A and B,
and two IOBindings of the step graph built when the stream is made: binding 0 reads A and writes
B, binding 1 reads B and writes A. A step writes the token into a bound int64 buffer, runs the
binding of the current side and flips the side, so state goes A→B, then B→A, with no allocation
and no copy of state (binding one buffer as both input and output is not guaranteed safe in
onnxruntime, hence two). The logits output is a bound buffer too; `step` returns a copy [V].
A batch slot (`edgemem.runtime.base`) does the same with [n, ...] buffers and two bindings.

Preallocated KV caches (manifest `kv_cache`) are fixed-size state. On a target that updates them
in place (`kv_cache.in_place`: the `ort` target's GroupQueryAttention) sides A and B share one
buffer per cache, bound as both the input and the output of every run: a step writes one row per
stream there, and the buffers' addresses never change. On other targets they ping-pong like any
state (the graph rewrites the whole cache: a copy of max_length rows per run).

Growing state (a dim named "past_sequence": the softmax preset's KV cache). The step graph outputs
`present = concat(past, new)`, a tensor one token longer than its input, so it cannot go into a
pre-allocated buffer. Here each step binds the current caches as inputs and leaves the cache
outputs unallocated: onnxruntime allocates the new caches, which become the stream's state, and
the old ones are freed when the step returns (a fresh binding per step, so no binding keeps an old
cache alive). onnxruntime's CPU arena is off for such models' prefill graph: it keeps its
high-water mark and fragments on ever-larger chunks, without bound (the step graph keeps it: a
step grows its tensors by one row). Cost: O(position) time and a transient 2× cache per step,
which is the point of the comparison — recurrent presets do not grow.
In a batch, rows must have KV caches of equal length (a rectangular tensor), else `BatchError`;
the new [n, ...] caches are not copied out: each stream keeps a view of its row (`_Row`), the same
streams batched again reuse the batch's output as input, and a stream stepped alone binds its row
by address. A batch's caches are freed once every stream of it has moved on (stepped alone or in
another batch, reset, or deleted).

Every binding, of the step or prefill graph, for a stream or a batch slot, comes from
`OrtEngine._bind`.

Weights (manifest `weights`): the target's `weights.data` is mapped once, read-only, and every
initializer of every graph is handed to its session as an `OrtValue` viewing the mapping
(`SessionOptions.add_initializer` uses the caller's buffer; `add_external_initializers` copies it),
so the prefill and step sessions share one copy, which the page cache may also share between
processes. Pre-packing (MLAS's packed copy of a MatMul/Gemm/MatMulNBits weight) is per session, and
onnxruntime's Python API cannot share one packed copy between sessions. So on the CPU, where the
export has the last-position prefill graph, no growing cache, and a manifest whose `steps` says that
graph serves steps, one session serves both (as in libedgemem): that graph at T = 1 is the step
graph (the stateful protocol), it pre-packs, and it loads the weights only its pre-packing kernels
read (the store's `packed`) from the file itself, one tensor at a time, so that neither the mapping
nor a second copy is resident beside the packed one. A tied head's table is the exception: the export
lists it as a graph input too (`edgemem.export.lower.read_table_in_place`), so no session packs it and
the head reads the mapped table that the lookups read. Otherwise the step session pre-packs (decode
reads the packed copy) and a prefill session reads the mapped weights in place. A session that
opens later (the full prefill graph, an encoder) reads the mapping in place, except where the graph
holds 4-bit MatMulNBits: unpacked, that kernel dequantizes each whole matrix to float in every run,
which costs more memory at the peak than a packed copy and is slower, so there every session
pre-packs. While a session is made, the pages it has read are dropped from the mapping every
millisecond, so that the pages a packed copy was made from are not all resident beside it, and once
more when the sessions are made; what runs later faults back only what it reads. A prefill run ends
with arena shrinkage: the arena gives back what it holds beyond the live tensors (benchmarks/README.md,
"Footprint", measures each choice).
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import onnxruntime as ort

from edgemem.config import threads as check_threads
from edgemem.errors import EdgememError, named
from edgemem.manifest import ORT_TARGETS, PREFILL_LAST, Manifest, StateSpec, check_io
from edgemem.runtime.base import BatchSlot, Engine, Stream
from edgemem.runtime.errors import BackendError, BatchError
from edgemem.runtime.state import concrete_shape, variable_dim

ORT_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
}
Sides = list[dict[str, ort.OrtValue]]  # state input name → buffer, for side A and side B


def _summary(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__


def _host(shape: Sequence[int], dtype: Any) -> tuple[ort.OrtValue, np.ndarray]:
    """A zeroed host buffer to bind (token ids, logits) and its numpy view."""
    value = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype)
    view = value.numpy()
    view.fill(0)  # allocated memory is not initialised
    return value, view


class _Memory:
    """Where state lives: host memory (numpy views, zero-copy) or a CUDA device."""

    def __init__(self, device: str):
        self.device = device
        self.host = device == "cpu"

    def alloc(self, shape: Sequence[int], dtype: Any) -> ort.OrtValue:
        return ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, self.device, 0)

    def sides(
        self, specs: Sequence[StateSpec], rows: int, shared: frozenset[str] = frozenset()
    ) -> tuple[Sides, list[dict[str, np.ndarray]] | None]:
        """Side A and side B buffers of `rows` rows for each state in `specs` (one buffer for both sides of
        the `shared` ones, updated in place), and their host views (None on a device)."""
        a = {s.input: self.alloc(concrete_shape(s, rows), s.dtype) for s in specs}
        b = {s.input: a[s.input] if s.input in shared else self.alloc(concrete_shape(s, rows), s.dtype) for s in specs}
        bufs = [a, b]
        return bufs, [{k: v.numpy() for k, v in side.items()} for side in bufs] if self.host else None

    def read(self, value: ort.OrtValue) -> np.ndarray:
        """A view on the host, a copy from a device."""
        return value.numpy()

    def write(self, value: ort.OrtValue, array: np.ndarray) -> None:
        if self.host:
            np.copyto(value.numpy(), array)
        else:
            value.update_inplace(np.ascontiguousarray(array))

    def new(self, array: np.ndarray) -> ort.OrtValue:
        value = self.alloc(array.shape, array.dtype)
        self.write(value, array)
        return value


class _Kept(NamedTuple):
    """A stream's state left where it is (`OrtStream._mark`): its side, position, KV caches and logits."""

    side: int
    position: int
    grown: dict[str, Any]
    logits: np.ndarray | None


class _Row:
    """Row `index` of a batched KV-cache tensor: a stream's cache after `step_batch`, not copied out."""

    __slots__ = ("index", "rows", "value")

    def __init__(self, value: ort.OrtValue, index: int, rows: int):
        self.value, self.index, self.rows = value, index, rows

    def shape(self) -> list[int]:
        return [1, *self.value.shape()[1:]]

    def nbytes(self) -> int:
        return self.value.tensor_size_in_bytes() // self.rows

    def address(self) -> int:
        return self.value.data_ptr() + self.index * self.nbytes()


class _Weights:
    """A target's `weights.data` mapped once; each graph's initializers as OrtValues viewing it."""

    DTYPES = frozenset({"float32", "float16", "float64", "int64", "int32", "int8", "uint8", "bool"})

    def __init__(
        self,
        path: Path,
        mapped: mmap.mmap,
        tensors: Mapping[str, Mapping[str, list]],
        packed: Mapping[str, Sequence[str]],
    ):
        self.path, self._mapped = path, mapped
        self.packed = {kind: frozenset(names) for kind, names in packed.items()}  # read by pre-packing kernels only
        self._arrays: list[np.ndarray] = []  # the views the OrtValues point into, kept alive with them
        self._values: dict[str, dict[str, ort.OrtValue]] = {}
        shared: dict[tuple, ort.OrtValue] = {}
        for kind, entries in tensors.items():
            values = self._values.setdefault(kind, {})
            for name, (offset, dtype, shape) in entries.items():
                if dtype not in self.DTYPES:
                    continue  # onnxruntime reads it from the file itself
                key = (offset, dtype, tuple(shape))
                if key not in shared:
                    count = int(np.prod(shape, dtype=np.int64))
                    if offset + count * np.dtype(dtype).itemsize > len(mapped):
                        raise BackendError(
                            f"{path} is shorter than edgemem.json says ({len(mapped)} bytes; {name} "
                            "ends past it): the file is truncated; copy or export it again"
                        )
                    array = np.frombuffer(mapped, dtype=dtype, count=count, offset=offset).reshape(shape)
                    self._arrays.append(array)
                    shared[key] = ort.OrtValue.ortvalue_from_numpy(array)
                values[name] = shared[key]

    @classmethod
    def open(cls, directory: Path, store: Mapping[str, Any] | None) -> _Weights | None:
        if store is None:
            return None
        path = directory / store["file"]
        try:
            with path.open("rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:  # ValueError: an empty file
            raise BackendError(f"cannot map {path}: {e}") from None
        return cls(path, mapped, store["tensors"], store.get("packed", {}))

    def graph(self, kind: str) -> dict[str, ort.OrtValue]:
        return self._values.get(kind, {})

    def release(self) -> None:
        """Drop the mapped pages from this process (the file and its page cache stay; a later read faults in)."""
        if hasattr(mmap, "MADV_DONTNEED"):
            self._mapped.madvise(mmap.MADV_DONTNEED)

    DROP_EVERY = 0.001  # seconds between drops while a session is made; None: never

    @contextmanager
    def streamed(self) -> Iterator[None]:
        """While a session is made, drop the pages it has read from the mapping every `DROP_EVERY` seconds.

        A session packs each weight it is handed from the mapping into a copy of its own, and the pages it read
        would otherwise stay resident until it is made: the source of every packed weight beside all of the
        packed copies. Dropped as it goes, what is resident of the source is what the last millisecond or so
        read. The mapping is read-only: a page dropped while it is still being read faults back from the page
        cache."""
        if self.DROP_EVERY is None or not hasattr(mmap, "MADV_DONTNEED"):
            yield
            return
        done = threading.Event()

        def drop() -> None:
            while not done.wait(self.DROP_EVERY):
                self.release()

        dropper = threading.Thread(target=drop, name="edgemem-weights", daemon=True)
        dropper.start()
        try:
            yield
        finally:
            done.set()
            dropper.join()


class OrtEngine(Engine):
    """An export's graphs in onnxruntime sessions. Use `Engine.load(directory)` (backend "ort" or "ort-cuda")."""

    def __init__(
        self, directory: Path, manifest: Manifest, backend: str, target: str, threads: int | None, chunk_size: int
    ):
        super().__init__(directory, manifest, chunk_size, has_prefill=bool(manifest.graphs.get("prefill")))
        self.backend, self.target, self.threads = backend, target, threads
        self._tokens_name, self._logits_name = manifest.inputs["tokens"], manifest.outputs["logits"]
        self._memory = _Memory("cuda" if backend == "ort-cuda" else "cpu")
        self._weights = _Weights.open(directory, (manifest.weights or {}).get(target))
        self._blocks = (manifest.quantization or {}).get("method") == "int4"  # 4-bit MatMulNBits weights
        kv = manifest.kv_cache or {}
        self._in_place = frozenset(kv.get("states", ()) if target in kv.get("in_place", ()) else ())
        # A growing cache asks for larger tensors at every chunk. onnxruntime's CPU arena keeps its
        # high-water mark and fragments on ever-larger requests, so the prefill graph of such a model
        # allocates from the system. A step grows its tensors by one row: the arena costs it no more
        # memory, and without it every tensor of a step is fresh pages. The step graph always keeps the
        # arena (benchmarks/README.md, "Figures behind choices in the code").
        # The prefill graph that projects only the last position (`prefill_last`) serves prompts whose
        # next-token logits are all that is wanted (generate, run, serving); the full prefill graph, whose
        # [T, V] logits are a chunk's largest tensor, opens at the first prefill that asks for every row.
        self._last = PREFILL_LAST if PREFILL_LAST in manifest.graphs_of(target) else "prefill"
        self._opening = threading.Lock()
        self._shrink = ort.RunOptions()  # a prefill run's arena gives back what it holds past the live tensors
        self._shrink.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        self._sessions: dict[str, ort.InferenceSession] = {}
        # one session on the CPU: the last-position prefill graph serves steps (the module docstring)
        self._one = (
            self._memory.host
            and self._last == PREFILL_LAST
            and manifest.steps == PREFILL_LAST
            and not self.grows
            and self._weights is not None
        )
        if self._one:
            self._sessions["step"] = self._sessions[self._open_session(PREFILL_LAST)]
        else:
            for kind in ("step", self._last):
                if manifest.graphs.get(kind):
                    self._open_session(kind)
        self._step_session = self._sessions["step"]
        self._encoder = (
            self._session("encoder", self._options("encoder", arena=True)) if manifest.graphs.get("encoder") else None
        )
        if self._weights is not None:
            self._weights.release()
        logits = next(o for o in self._step_session.get_outputs() if o.name == self._logits_name)
        self.logits_dtype = np.dtype(ORT_TYPES.get(logits.type, np.float32))

    def _open_session(self, kind: str) -> str:
        with self._opening:
            if kind not in self._sessions:
                self._sessions[kind] = self._session(kind, self._options(kind, arena=kind == "step" or not self.grows))
        return kind

    def _prefill_kind(self, last_only: bool) -> str:
        """The prefill graph to run, opened on first use: the last-position one when only the last row is wanted."""
        return self._open_session(self._last if last_only else "prefill")

    @classmethod
    def _open(
        cls,
        directory: Path,
        manifest: Manifest,
        target: str | None,
        threads: int | None,
        chunk_size: int,
        *,
        backend: str,
    ) -> OrtEngine:
        if threads is not None:
            check_threads(threads, named("threads", "--threads"))
        if target is None:
            target = next((t for t in ORT_TARGETS if t in manifest.targets), None)
            if target is None:
                raise BackendError(
                    f"{directory} has no target onnxruntime can run (it has {', '.join(manifest.targets)}); "
                    "export with --target ort or generic"
                )
        elif target not in manifest.targets:
            raise BackendError(f"{directory} has no {target!r} target (it has {', '.join(manifest.targets)})")
        if target == "trt":
            raise BackendError(
                "the trt target is for TensorRT with edgemem's plugins, not onnxruntime; load the ort or generic target"
            )
        if backend == "ort-cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
            raise BackendError(
                f"backend 'ort-cuda' needs onnxruntime's CUDAExecutionProvider, which this onnxruntime "
                f"{ort.__version__} does not have (it has {', '.join(ort.get_available_providers())}): install "
                "onnxruntime-gpu (`pip install 'edgemem-toolkit[gpu]'`, then uninstall onnxruntime) with the CUDA and cuDNN "  # noqa: E501
                "libraries it needs, or use backend 'ort'"
            )
        return cls(directory, manifest, backend, target, threads, chunk_size)

    def _options(self, kind: str, arena: bool) -> ort.SessionOptions:
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.threads or 0
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.log_severity_level = 3
        options.enable_cpu_mem_arena = arena
        if self._weights is not None:
            primary = kind == (PREFILL_LAST if self._one else "step")
            if not primary and not self._blocks:
                options.add_session_config_entry("session.disable_prepacking", "1")
            # the one session loads what only its pre-packing kernels read from the file itself: it maps, packs
            # and lets go of one tensor at a time, where the engine's mapping would hold every page it packed
            packed = self._weights.packed.get(kind, frozenset()) if primary and self._one else frozenset()
            for name, value in self._weights.graph(kind).items():
                if name not in packed:
                    options.add_initializer(name, value)
        return options

    def _session(self, kind: str, options: ort.SessionOptions) -> ort.InferenceSession:
        path = self.directory / self.target / f"{kind}.onnx"
        providers: list[Any] = ["CPUExecutionProvider"]
        if self.backend == "ort-cuda":
            providers = [("CUDAExecutionProvider", {"device_id": 0}), "CPUExecutionProvider"]
        # In a QDQ graph, common-subexpression elimination merges the QuantizeLinear nodes of
        # projections that read one input, and the merged node no longer fuses into an integer
        # MatMul: static INT8 then runs slower than float on CPU (benchmarks/README.md).
        static_int8 = (self.manifest.quantization or {}).get("method") == "static"
        disabled = ["CommonSubexpressionElimination"] if static_int8 else None
        try:
            with self._weights.streamed() if self._weights is not None else nullcontext():
                session = ort.InferenceSession(str(path), options, providers=providers, disabled_optimizers=disabled)
        except Exception as e:  # noqa: BLE001 — onnxruntime raises its own, varied exception types
            raise BackendError(f"onnxruntime cannot load {path}: {_summary(e)}") from None
        if self.backend == "ort-cuda" and "CUDAExecutionProvider" not in session.get_providers():
            raise BackendError(
                "onnxruntime's CUDAExecutionProvider failed to initialise (CUDA or cuDNN libraries "
                "missing or no GPU visible); use backend 'ort'"
            )
        inputs = {i.name for i in session.get_inputs()}
        outputs = {o.name for o in session.get_outputs()}
        if kind == "encoder":
            encoder = self.manifest.encoder
            want_in = set(encoder["inputs"].values())
            want_out = set(encoder["fills"].values())
        else:
            want_in = {self._tokens_name, *(s.input for s in self._specs)}
            want_out = {self._logits_name, *(s.output for s in self._specs if s.output)}
        if inputs != want_in or not want_out <= outputs:
            raise BackendError(
                f"{path} does not match edgemem.json: inputs {sorted(inputs ^ want_in)} or outputs "
                f"{sorted(want_out - outputs)} differ"
            )
        check_io(
            self.manifest,
            path,
            *(
                {v.name: (v.type.removeprefix("tensor(").rstrip(")"), v.shape) for v in values}
                for values in (session.get_inputs(), session.get_outputs())
            ),
            graph=kind,
        )
        return session

    # ------------------------------------------------------------------ bindings and runs
    def _bind(
        self,
        session: ort.InferenceSession,
        ids: ort.OrtValue,
        logits: ort.OrtValue | None,
        reads: Mapping[str, ort.OrtValue],
        writes: Mapping[str, ort.OrtValue],
        caches: Mapping[str, ort.OrtValue | _Row] | None = None,
    ) -> ort.IOBinding:
        """A binding of `session`'s graph: token ids `ids`; fixed-size state read from `reads` and written to
        `writes`; logits into `logits` (None: onnxruntime allocates them on the host); KV caches read from
        `caches` (a tensor, or a batch's row by address) and written where onnxruntime allocates them."""
        binding = session.io_binding()
        binding.bind_ortvalue_input(self._tokens_name, ids)
        if logits is None:
            binding.bind_output(self._logits_name, "cpu")
        else:
            binding.bind_ortvalue_output(self._logits_name, logits)
        for spec in self._fixed:
            binding.bind_ortvalue_input(spec.input, reads[spec.input])
            binding.bind_ortvalue_output(spec.output, writes[spec.input])
        for spec in self._growing:
            value = caches[spec.input]
            if isinstance(value, _Row):
                binding.bind_input(
                    spec.input, self._memory.device, 0, np.dtype(spec.dtype), value.shape(), value.address()
                )
            else:
                binding.bind_ortvalue_input(spec.input, value)
            if spec.output:  # a read-only state (an encoder-decoder's cross keys/values) is an input only
                binding.bind_output(spec.output, self._memory.device)
        return binding

    def _encode(self, input_ids: np.ndarray, global_attention_mask: np.ndarray) -> dict[str, np.ndarray]:
        fills = self.manifest.encoder["fills"]
        outputs = list(fills.values())
        try:
            values = self._encoder.run(
                outputs, {"input_ids": input_ids, "global_attention_mask": global_attention_mask}
            )
        except Exception as e:  # noqa: BLE001 — onnxruntime raises its own, varied exception types
            raise EdgememError(
                f"onnxruntime failed running the encoder graph of {self.manifest.arch}: {_summary(e)}"
            ) from None
        return dict(zip(fills, values))

    def _caches(self, binding: ort.IOBinding) -> list[ort.OrtValue]:
        """The new KV caches a run of a `_bind` binding produced, in the order of `_written`."""
        return binding.get_outputs()[1 + len(self._fixed) :]

    def _run(self, kind: str, binding: ort.IOBinding) -> None:
        try:
            self._sessions[kind].run_with_iobinding(binding, None if kind == "step" or self.grows else self._shrink)
        except Exception as e:  # noqa: BLE001 — onnxruntime raises its own, varied exception types
            raise EdgememError(
                f"onnxruntime failed running the {kind} graph of {self.manifest.arch}: {_summary(e)}"
            ) from None

    # ------------------------------------------------------------------ streams and batches
    def _new(self, state: Mapping[str, np.ndarray], position: int, logits: np.ndarray | None) -> OrtStream:
        return OrtStream(self, state, position, logits)

    def _new_slot(self, n: int) -> _OrtSlot:
        return _OrtSlot(self, n)

    def _check_batch(self, streams: Sequence[Stream], token_ids: Any) -> tuple[list[Stream], np.ndarray]:
        streams, tokens = super()._check_batch(streams, token_ids)
        if self._written:
            lengths = sorted({s._past_length() for s in streams})
            if len(lengths) > 1:
                raise BatchError(
                    f"{self.manifest.arch}'s state grows (KV cache): a batch needs streams with caches of equal length, "  # noqa: E501
                    f"got lengths {', '.join(map(str, lengths[:6]))}{'…' if len(lengths) > 6 else ''}; batch streams at "  # noqa: E501
                    "the same position, step them one by one, or re-export with "
                    f"{named('set_kv_cache(model, max_length=N)', '`edgemem export --max-length N`')} (a preallocated cache: "  # noqa: E501
                    "streams at any positions batch together)"
                )
        return streams, tokens

    def _run_batch(self, slot: _OrtSlot, streams: list[OrtStream], tokens: np.ndarray) -> np.ndarray:
        slot.ids_view[:, 0] = tokens
        if not self.grows:
            self._run("step", slot.bindings[slot.side])
            return slot.logits_view[:, 0].copy()
        caches = {spec.input: self._gather_cache(spec, streams) for spec in self._growing}
        binding = self._bind(
            self._step_session, slot.ids, slot.logits, slot.bufs[slot.side], slot.bufs[1 - slot.side], caches
        )  # fresh: see the module docstring
        self._run("step", binding)
        for spec in self._growing:
            if (
                not spec.output
            ):  # read only: the streams view their rows of the gathered input, the next batch reuses it
                for i, s in enumerate(streams):
                    s._grown[spec.input] = _Row(caches[spec.input], i, len(streams))
        for spec, value in zip(self._written, self._caches(binding)):  # each stream views its row of the new cache
            for i, s in enumerate(streams):
                s._grown[spec.input] = _Row(value, i, len(streams))
        return slot.logits_view[:, 0].copy()

    def _gather_cache(self, spec: StateSpec, streams: list[OrtStream]) -> ort.OrtValue:
        """The [n, ...] cache input: the previous batch's output itself when these streams are its rows in
        order (the usual serving loop), else their caches copied into a new tensor."""
        rows = [s._grown[spec.input] for s in streams]
        first = rows[0]
        if (
            isinstance(first, _Row)
            and first.rows == len(rows)
            and all(isinstance(r, _Row) and r.value is first.value and r.index == i for i, r in enumerate(rows))
        ):
            return first.value
        memory = self._memory
        if not memory.host:
            return memory.new(np.concatenate([s._read(spec.input) for s in streams]))
        value = memory.alloc([len(rows), *rows[0].shape()[1:]], spec.dtype)
        view = value.numpy()
        for i, s in enumerate(streams):
            view[i] = s._read(spec.input)[0]
        return value

    def __repr__(self) -> str:
        return (
            f"OrtEngine({self.manifest.arch}, {self.directory}, backend={self.backend}, target={self.target}, "
            f"threads={self.threads or 'auto'})"
        )


class _OrtSlot(BatchSlot):
    """[n, ...] state sides A and B with two bindings (A→B, B→A), token ids and logits."""

    def __init__(self, engine: OrtEngine, n: int):
        super().__init__(engine, n)
        self.bufs, self.views = engine._memory.sides(engine._fixed, n, engine._in_place)
        self.ids, self.ids_view = _host([n, 1], np.int64)
        self.logits, self.logits_view = _host([n, 1, engine.vocab_size], engine.logits_dtype)
        self.bindings = (
            []
            if engine.grows
            else [  # with a KV cache, each batch binds afresh
                engine._bind(engine._step_session, self.ids, self.logits, self.bufs[side], self.bufs[1 - side])
                for side in (0, 1)
            ]
        )

    def row(self, name: str, index: int) -> np.ndarray:
        if self.views is not None:
            return self.views[self.side][name][index : index + 1]
        return self.engine._memory.read(self.bufs[self.side][name])[index : index + 1]

    def _gather(self, streams: list[OrtStream]) -> None:
        for spec in self.engine._fixed:
            if self.views is not None:
                rows = self.views[self.side][spec.input]
                for i, s in enumerate(streams):
                    rows[i] = s._own(spec.input)[0]
            else:
                self.engine._memory.write(
                    self.bufs[self.side][spec.input], np.concatenate([s._own(spec.input) for s in streams])
                )


class OrtStream(Stream):
    """A stream whose state lives in onnxruntime `OrtValue`s (see the module docstring)."""

    def __init__(self, engine: OrtEngine, state: Mapping[str, np.ndarray], position: int, logits: np.ndarray | None):
        super().__init__(engine)
        self._bufs, self._views = engine._memory.sides(engine._fixed, 1, engine._in_place)  # fixed-size state: A and B
        self._grown: dict[str, ort.OrtValue | _Row] = {}  # KV caches: replaced every step
        self._ids, self._ids_view = _host([1, 1], np.int64)
        self._logits, self._logits_view = _host([1, 1, engine.vocab_size], engine.logits_dtype)
        self._bindings = (
            []
            if engine.grows
            else [  # with a KV cache, each step binds afresh
                engine._bind(engine._step_session, self._ids, self._logits, self._bufs[side], self._bufs[1 - side])
                for side in (0, 1)
            ]
        )
        self._assign(state, position, logits)

    # ------------------------------------------------------------------ state
    def _read(self, name: str) -> np.ndarray:
        value = self._grown.get(name)
        if value is None:
            return super()._read(name)
        if isinstance(value, _Row):
            return self._engine._memory.read(value.value)[value.index : value.index + 1]
        return self._engine._memory.read(value)

    def _own(self, name: str) -> np.ndarray:
        if self._views is not None:
            return self._views[self._side][name]
        return self._engine._memory.read(self._bufs[self._side][name])

    def _write(self, name: str, value: np.ndarray) -> None:
        if self._views is not None:
            np.copyto(self._views[self._side][name], value)
        else:
            self._engine._memory.write(self._bufs[self._side][name], value)

    def _assign(self, state: Mapping[str, Any], position: int, logits: np.ndarray | None) -> None:
        super()._assign(state, position, logits)
        memory = self._engine._memory
        self._grown = {}
        for spec in self._engine._growing:
            value = state[spec.input]  # a read-only state's buffer handed over by `_share` is kept, not copied
            shared = isinstance(value, (ort.OrtValue, _Row))
            self._grown[spec.input] = value if shared else memory.new(np.ascontiguousarray(value))

    def _share(self, name: str) -> ort.OrtValue | _Row:
        return self._grown[name]

    def _input_length(self) -> int:
        spec = self._engine._read_only[0]
        return self._grown[spec.input].shape()[variable_dim(spec)]

    def _mark(self, tokens: int, one_run: bool) -> Any:
        """One run from side A writes side B only: the state before it stays in A, and flipping back restores it.
        A KV cache updated in place gets the new tokens in slots past the position, which later tokens overwrite,
        unless they wrap around a sliding window: then (and for several runs) the state is copied."""
        kv = self._engine.manifest.kv_cache
        if not one_run or (self._engine._in_place and self._position + tokens > kv["max_length"]):
            return super()._mark(tokens, one_run)
        self._sync()
        return _Kept(self._side, self._position, dict(self._grown), self.logits)

    def _rollback(self, mark: Any) -> None:
        if not isinstance(mark, _Kept):
            return super()._rollback(mark)
        self._side, self._position, self._grown = mark.side, mark.position, mark.grown
        self._has_logits = mark.logits is not None
        if mark.logits is not None:
            self._logits_view[0, 0] = mark.logits

    def _past_length(self) -> int:
        spec = self._engine._written[0]
        return self._grown[spec.input].shape()[variable_dim(spec)]  # OrtValue or _Row

    @property
    def state_bytes(self) -> int:
        return self._engine._fixed_bytes + sum(
            v.nbytes() if isinstance(v, _Row) else v.tensor_size_in_bytes() for v in self._grown.values()
        )

    # ------------------------------------------------------------------ runs
    def _run_step(self, token: int) -> None:
        engine = self._engine
        self._ids_view[0, 0] = token
        if not engine.grows:
            engine._run("step", self._bindings[self._side])
            return
        binding = engine._bind(
            engine._step_session,
            self._ids,
            self._logits,
            self._bufs[self._side],
            self._bufs[1 - self._side],
            self._grown,
        )
        engine._run("step", binding)
        self._grown.update(zip((s.input for s in engine._written), engine._caches(binding)))

    def _prefill_chunk(self, ids: np.ndarray, last_only: bool) -> np.ndarray:
        engine = self._engine
        tokens, view = _host([1, ids.size], np.int64)
        view[0] = ids
        kind = engine._prefill_kind(last_only)
        binding = engine._bind(
            engine._sessions[kind], tokens, None, self._bufs[self._side], self._bufs[1 - self._side], self._grown
        )
        engine._run(kind, binding)
        logits = binding.get_outputs()[0].numpy()[
            0
        ]  # [T, V] ([1, V] from prefill_last), a view on onnxruntime's output
        logits = np.array(logits[-1:] if last_only else logits, copy=True)
        self._grown.update(zip((s.input for s in engine._written), engine._caches(binding)))
        return logits
