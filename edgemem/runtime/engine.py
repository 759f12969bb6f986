"""Engine and Stream on onnxruntime: step by step in fixed memory.

State lives in `OrtValue`s allocated once with `OrtValue.ortvalue_from_shape_and_type` and owned
by the stream (never `ortvalue_from_numpy` on a temporary: it does not keep the array alive).

Fixed-size state (every recurrent preset). Each stream owns two sets of state buffers, A and B,
and two IOBindings of the step graph built when the stream is made: binding 0 reads A and writes
B, binding 1 reads B and writes A. A step writes the token into a bound int64 buffer, runs the
binding of the current side and flips the side, so state goes A→B, then B→A, with no allocation
and no copy of state (binding one buffer as both input and output is not guaranteed safe in
onnxruntime, hence two). The logits output is a bound buffer too; `step` returns a copy [V].

Growing state (a dim named "past_sequence": the softmax preset's KV cache). The step graph outputs
`present = concat(past, new)`, a tensor one token longer than its input, so it cannot go into a
pre-allocated buffer. Here each step binds the current caches as inputs and leaves the cache
outputs unallocated: onnxruntime allocates the new caches, which become the stream's state, and
the old ones are freed when the step returns (a fresh binding per step, so no binding keeps an old
cache alive). onnxruntime's CPU arena is off for such models: it keeps its high-water mark and
fragments on ever-larger requests, without bound. Cost: O(position) time, fresh pages and a
transient 2× cache per step, which is the point of the comparison — recurrent presets do not grow.

Batching (`Engine.step_batch`). A batch slot per batch size n (the last few sizes are kept) holds
[n, ...] state sides A and B with two pre-built bindings, the batch-level form of the same
ping-pong. The first batched step of a set of streams copies their states into rows of the slot
(gather); from then on their fixed-size state lives there, and stepping the same streams in the
same order again runs the other binding with no copy at all. A stream used on its own again
(step, prefill, reset) first copies its row back (`Stream._sync`); reads (save, fork, state_dict)
view the row; a slot gives its members their rows back before it takes other streams or is
dropped. Streams may be at different positions: every row carries its own state (Titans and
Longformer keep a per-row position tensor). For growing state, rows must have KV caches of equal
length (a rectangular tensor), else `BatchError`; the new [n, ...] caches are not copied out:
each stream keeps a view of its row (`_Row`), the same streams batched again reuse the batch's
output as input, and a stream stepped alone binds its row by address. A batch's caches are freed
once every stream of it has moved on (stepped alone or in another batch, reset, or deleted).

Prefill runs the prefill graph in chunks (`chunk_size` tokens per run, 512 by default) so that
activations and logits stay bounded whatever the prompt length; prefilling in chunks equals
prefilling at once (the stateful protocol's law). Without a prefill graph (titans-mac), prompts
are stepped.

Streams are not thread-safe; different streams may be stepped from different threads.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnxruntime as ort

from edgemem.errors import ConfigError, EdgememError
from edgemem.manifest import Manifest
from edgemem.manifest import load as load_manifest
from edgemem.runtime.base import DEFAULT_CHUNK, EngineBase, StreamBase
from edgemem.runtime.errors import BackendError, BatchError
from edgemem.runtime.state import GROWING, concrete_shape, initial_state, is_growing

BACKENDS = ("ort", "ort-cuda", "trt")
_BATCH_SLOTS = 4  # batch sizes whose [n, ...] buffers are kept
_ORT_TYPES = {
    "tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32,
}

if TYPE_CHECKING:
    from edgemem.runtime.trt import TrtEngine



class _Memory:
    """Where state lives: host memory (numpy views, zero-copy) or a CUDA device."""

    def __init__(self, device: str):
        self.device = device
        self.host = device == "cpu"

    def alloc(self, shape: Sequence[int], dtype: Any) -> ort.OrtValue:
        return ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, self.device, 0)

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


class _Row:
    """Row `index` of a batched KV-cache tensor: a stream's cache after `step_batch`, not copied out."""

    __slots__ = ("index", "rows", "value")

    def __init__(self, value: ort.OrtValue, index: int, rows: int):
        self.value, self.index, self.rows = value, index, rows

    def shape(self) -> list[int]:
        return [1, *self.value.shape()[1:]]

    def nbytes(self) -> int:
        return self.value.tensor_size_in_bytes() // self.rows


def _summary(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__


class Engine(EngineBase):
    """An exported model loaded into onnxruntime; makes streams and steps batches of them.

    Use `Engine.load(directory)`. One engine serves any number of streams.
    """

    def __init__(self, directory: Path, manifest: Manifest, backend: str, target: str, threads: int | None,
                 chunk_size: int):
        self.directory, self.manifest, self.backend, self.target = directory, manifest, backend, target
        self.threads, self.chunk_size = threads, chunk_size
        self.vocab_size = manifest.vocab_size
        self.has_prefill = bool(manifest.graphs.get("prefill"))
        if not manifest.graphs.get("step"):
            raise BackendError(f"{directory}: {manifest.arch} has no step graph (a bidirectional model does not "
                               "stream); the runtime needs one")
        self._specs = list(manifest.state)
        self._fixed = [s for s in self._specs if not is_growing(s)]
        self._growing = [s for s in self._specs if is_growing(s)]
        self.grows = bool(self._growing)
        self._memory = _Memory("cuda" if backend == "ort-cuda" else "cpu")
        self._initial = initial_state(manifest, directory, 1)
        self._fixed_bytes = sum(self._initial[s.input].nbytes for s in self._fixed)
        self._growth = sum(  # bytes per token of the KV caches
            int(np.prod(concrete_shape(s, 1, 1))) * np.dtype(s.dtype).itemsize for s in self._growing
        )
        # A growing cache asks for larger tensors at every step and chunk. onnxruntime's CPU arena keeps
        # its high-water mark and fragments on ever-larger requests (prefilling in chunks to 100k tokens
        # grew it past 24 GB; with arena shrinkage, RSS still rose ~10x faster than the cache). Such
        # models allocate from the system instead: memory follows the cache, at the price of fresh
        # pages for every new cache (at 100k tokens a step takes ~2.8x longer than with the arena).
        self._sessions = {kind: self._session(kind, self._options(arena=not self.grows))
                          for kind in ("step", "prefill") if manifest.graphs.get(kind)}
        self._step_session = self._sessions["step"]
        logits = next(o for o in self._step_session.get_outputs() if o.name == manifest.outputs["logits"])
        self.logits_dtype = np.dtype(_ORT_TYPES.get(logits.type, np.float32))
        self._batch_slots: OrderedDict[int, _BatchSlot] = OrderedDict()
        self._lock = threading.RLock()  # reentrant: a slot gives states back while a batch holds it

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, directory: str | Path, backend: str = "ort", target: str | None = None, threads: int | None = None,
             *, chunk_size: int = DEFAULT_CHUNK, check_files: bool = True, engines: str | Path | None = None,
             plugins: str | Path | None = None) -> Engine | TrtEngine:
        """Load the export in `directory` (its `edgemem.json`; every file's sha256 is checked).

        backend: "ort" (CPU), "ort-cuda" (onnxruntime's CUDA execution provider) or "trt" (the TensorRT
            engines of `edgemem build` in DIR/engines or `engines`, with the plugin library `plugins` or
            $EDGEMEM_TRT_PLUGINS: `edgemem.runtime.trt`).
        target: which lowered graphs to run; default "ort" if the export has it, else "generic".
        threads: onnxruntime intra-op threads (default: onnxruntime's choice, one per core).
        chunk_size: tokens per prefill-graph run.
        """
        directory = Path(directory)
        if backend == "trt":
            from edgemem.runtime.trt import TrtEngine  # noqa: PLC0415 — imports TensorRT lazily itself

            return TrtEngine.load(directory, target, threads, chunk_size=chunk_size, check_files=check_files,
                                  engines=engines, plugins=plugins)
        if engines is not None or plugins is not None:
            raise ConfigError("engines= and plugins= are for backend 'trt'")
        manifest = load_manifest(directory, check_files=check_files)
        if backend not in BACKENDS:
            raise BackendError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ConfigError(f"threads must be a positive integer; got {threads!r}")
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ConfigError(f"chunk_size must be a positive integer; got {chunk_size!r}")
        if target is None:
            target = next((t for t in ("ort", "generic", "onnx27") if t in manifest.targets), None)
            if target is None:
                raise BackendError(f"{directory} has no target onnxruntime can run (it has {', '.join(manifest.targets)}); "
                                   "export with --target ort or generic")
        elif target not in manifest.targets:
            raise BackendError(f"{directory} has no {target!r} target (it has {', '.join(manifest.targets)})")
        if target == "trt":
            raise BackendError("the trt target is for TensorRT with edgemem's plugins, not onnxruntime; "
                               "load the ort or generic target")
        if backend == "ort-cuda" and "CUDAExecutionProvider" not in ort.get_available_providers():
            raise BackendError(
                f"backend 'ort-cuda' needs onnxruntime's CUDAExecutionProvider, which this onnxruntime "
                f"{ort.__version__} does not have (it has {', '.join(ort.get_available_providers())}): install "
                "onnxruntime-gpu (`pip install 'edgemem[gpu]'`, then uninstall onnxruntime) with the CUDA and cuDNN "
                "libraries it needs, or use backend 'ort'"
            )
        return cls(directory, manifest, backend, target, threads, chunk_size)

    def _options(self, arena: bool) -> ort.SessionOptions:
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.threads or 0
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.log_severity_level = 3
        options.enable_cpu_mem_arena = arena
        return options

    def _session(self, kind: str, options: ort.SessionOptions) -> ort.InferenceSession:
        path = self.directory / self.target / f"{kind}.onnx"
        providers: list[Any] = ["CPUExecutionProvider"]
        if self.backend == "ort-cuda":
            providers = [("CUDAExecutionProvider", {"device_id": 0}), "CPUExecutionProvider"]
        # In a QDQ graph, common-subexpression elimination merges the QuantizeLinear nodes of
        # projections that read one input, and the merged node no longer fuses into an integer
        # MatMul: static INT8 then ran ~4x slower than float on CPU.
        static_int8 = (self.manifest.quantization or {}).get("method") == "static"
        disabled = ["CommonSubexpressionElimination"] if static_int8 else None
        try:
            session = ort.InferenceSession(str(path), options, providers=providers, disabled_optimizers=disabled)
        except Exception as e:  # noqa: BLE001 — onnxruntime raises its own, varied exception types
            raise BackendError(f"onnxruntime cannot load {path}: {_summary(e)}") from None
        if self.backend == "ort-cuda" and "CUDAExecutionProvider" not in session.get_providers():
            raise BackendError("onnxruntime's CUDAExecutionProvider failed to initialise (CUDA or cuDNN libraries "
                               "missing or no GPU visible); use backend 'ort'")
        inputs = {i.name for i in session.get_inputs()}
        outputs = {o.name for o in session.get_outputs()}
        want_in = {self.manifest.inputs["tokens"], *(s.input for s in self._specs)}
        want_out = {self.manifest.outputs["logits"], *(s.output for s in self._specs)}
        if inputs != want_in or not want_out <= outputs:
            raise BackendError(f"{path} does not match edgemem.json: inputs {sorted(inputs ^ want_in)} or outputs "
                               f"{sorted(want_out - outputs)} differ")
        return session

    # ------------------------------------------------------------------ streams
    def _new(self, state: Mapping[str, np.ndarray], position: int, logits: np.ndarray | None) -> Stream:
        return Stream(self, state, position, logits)

    # ------------------------------------------------------------------ running
    def _run(self, kind: str, binding: ort.IOBinding) -> None:
        try:
            self._sessions[kind].run_with_iobinding(binding)
        except Exception as e:  # noqa: BLE001 — onnxruntime raises its own, varied exception types
            raise EdgememError(f"onnxruntime failed running the {kind} graph of {self.manifest.arch}: {_summary(e)}") from None

    def step_batch(self, streams: Sequence[Stream], token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """One token for each stream in one run of the step graph; returns logits [n, V].

        Streams may be at different positions. For a model whose state grows (a KV cache), their
        caches must have equal lengths. Equivalent to `stream.step(token)` for each stream.
        """
        streams, tokens = self._check_batch(streams, token_ids)
        n = len(streams)
        if self.grows:
            lengths = sorted({s._past_length() for s in streams})
            if len(lengths) > 1:
                raise BatchError(
                    f"{self.manifest.arch}'s state grows (KV cache): a batch needs streams with caches of equal length, "
                    f"got lengths {', '.join(map(str, lengths[:6]))}{'…' if len(lengths) > 6 else ''}; batch streams at "
                    "the same position or step them one by one"
                )
        with self._lock:
            slot = self._slot(n)
            if not slot.holds(streams):
                slot.adopt(streams)  # gather: the streams' states become the slot's rows
            slot.ids_view[:, 0] = tokens
            binding = slot.bindings[slot.side]
            if self.grows:
                binding = self._step_session.io_binding()  # fresh: see the module docstring
                slot.bind(binding, slot.side)
                for spec in self._growing:
                    binding.bind_ortvalue_input(spec.input, self._gather_cache(spec, streams))
                    binding.bind_output(spec.output, self._memory.device)
            self._run("step", binding)
            slot.side ^= 1  # the members' states are now the other side's rows
            if self.grows:
                outputs = dict(zip(slot.output_order + [s.output for s in self._growing], binding.get_outputs()))
                for spec in self._growing:  # each stream views its row of the new cache
                    for i, s in enumerate(streams):
                        s._grown[spec.input] = _Row(outputs[spec.output], i, n)
            logits = slot.logits_view[:, 0].copy()
        for i, s in enumerate(streams):
            s._logits_view[0, 0] = logits[i]
            s._has_logits = True
            s._position += 1
        return logits

    def _gather_cache(self, spec: Any, streams: list[Stream]) -> ort.OrtValue:
        """The [n, ...] cache input: the previous batch's output itself when these streams are its rows in
        order (the usual serving loop), else their caches copied into a new tensor."""
        rows = [s._grown[spec.input] for s in streams]
        first = rows[0]
        if isinstance(first, _Row) and first.rows == len(rows) and all(
            isinstance(r, _Row) and r.value is first.value and r.index == i for i, r in enumerate(rows)
        ):
            return first.value
        memory = self._memory
        shape = [len(rows), *rows[0].shape()[1:]]
        if not memory.host:
            return memory.new(np.concatenate([s._read(spec.input) for s in streams]))
        value = memory.alloc(shape, spec.dtype)
        view = value.numpy()
        for i, s in enumerate(streams):
            view[i] = s._read(spec.input)[0]
        return value

    def _slot(self, n: int) -> _BatchSlot:
        slot = self._batch_slots.get(n)
        if slot is None:
            slot = self._batch_slots[n] = _BatchSlot(self, n)
            while len(self._batch_slots) > _BATCH_SLOTS:
                self._batch_slots.popitem(last=False)[1].release()
        else:
            self._batch_slots.move_to_end(n)
        return slot

    def __repr__(self) -> str:
        return (f"Engine({self.manifest.arch}, {self.directory}, backend={self.backend}, target={self.target}, "
                f"threads={self.threads or 'auto'})")


class _BatchSlot:
    """Batch-size-n buffers: state sides A and B [n, ...] with two bindings (A→B, B→A), token ids, logits.

    The streams last batched here (`members`) keep their fixed-size state as rows of the current side:
    batching the same streams again in the same order runs the other binding with no copy at all,
    the batch-level form of a stream's ping-pong. A member that is used on its own (step, prefill,
    reset) first copies its row back into its own buffers (`Stream._sync`); reads (save, fork) view
    the row. Before the slot takes other streams, or is dropped, its members get their rows back.
    """

    def __init__(self, engine: Engine, n: int):
        memory = engine._memory
        self.engine, self.n, self.side = engine, n, 0
        self.bufs = [{s.input: memory.alloc(concrete_shape(s, n), s.dtype) for s in engine._fixed} for _ in range(2)]
        self.views = [{k: v.numpy() for k, v in b.items()} for b in self.bufs] if memory.host else None
        self.ids = ort.OrtValue.ortvalue_from_shape_and_type([n, 1], np.int64)
        self.ids_view = self.ids.numpy()
        self.ids_view.fill(0)
        self.logits = ort.OrtValue.ortvalue_from_shape_and_type([n, 1, engine.vocab_size], engine.logits_dtype)
        self.logits_view = self.logits.numpy()
        self.output_order = [engine.manifest.outputs["logits"], *(s.output for s in engine._fixed)]
        self.bindings = []
        for side in (0, 1):
            binding = engine._step_session.io_binding()
            self.bind(binding, side)
            self.bindings.append(binding)
        self.members: list[weakref.ref[Stream]] = []

    def bind(self, binding: ort.IOBinding, side: int) -> None:
        manifest = self.engine.manifest
        binding.bind_ortvalue_input(manifest.inputs["tokens"], self.ids)
        binding.bind_ortvalue_output(manifest.outputs["logits"], self.logits)
        for spec in self.engine._fixed:
            binding.bind_ortvalue_input(spec.input, self.bufs[side][spec.input])
            binding.bind_ortvalue_output(spec.output, self.bufs[1 - side][spec.input])

    def row(self, name: str, index: int) -> np.ndarray:
        """Row `index` of the current side: a view on the host."""
        if self.views is not None:
            return self.views[self.side][name][index : index + 1]
        return self.engine._memory.read(self.bufs[self.side][name])[index : index + 1]

    def holds(self, streams: list[Stream]) -> bool:
        return len(self.members) == len(streams) and all(
            s._batch_slot is self and s._row == i for i, s in enumerate(streams)
        )

    def adopt(self, streams: list[Stream]) -> None:
        """Copy the streams' states into the current side's rows and make them the members."""
        self.release()
        memory = self.engine._memory
        for spec in self.engine._fixed:
            if self.views is not None:
                rows = self.views[self.side][spec.input]
                for i, s in enumerate(streams):
                    rows[i] = s._read(spec.input)[0]
            else:
                memory.write(self.bufs[self.side][spec.input], np.concatenate([s._read(spec.input) for s in streams]))
        for i, s in enumerate(streams):
            s._batch_slot, s._row = self, i  # a member of another slot leaves it: that slot's row goes stale
        self.members = [weakref.ref(s) for s in streams]

    def release(self) -> None:
        """Give every member still here its state back (into its own buffers)."""
        for ref in self.members:
            stream = ref()
            if stream is not None and stream._batch_slot is self:
                stream._sync()
        self.members = []


class Stream(StreamBase):
    """One sequence's state and position. Make it with `engine.new_stream()` or `engine.load_stream(path)`."""

    def __init__(self, engine: Engine, state: Mapping[str, np.ndarray], position: int, logits: np.ndarray | None):
        self._engine = engine
        memory = engine._memory
        tokens, logits_name = engine.manifest.inputs["tokens"], engine.manifest.outputs["logits"]
        # fixed-size state: two sides, A and B, ping-ponged by two pre-built bindings
        self._bufs = [{s.input: memory.alloc(concrete_shape(s, 1), s.dtype) for s in engine._fixed} for _ in range(2)]
        self._views = [{k: v.numpy() for k, v in b.items()} for b in self._bufs] if memory.host else None
        self._grown: dict[str, ort.OrtValue | _Row] = {}  # KV caches: replaced every step
        self._side = 0
        self._batch_slot: _BatchSlot | None = None  # set while the fixed-size state is a row of a batch slot
        self._row = 0
        self._ids = ort.OrtValue.ortvalue_from_shape_and_type([1, 1], np.int64)
        self._ids_view = self._ids.numpy()
        self._ids_view.fill(0)  # allocated memory is not initialised
        self._logits = ort.OrtValue.ortvalue_from_shape_and_type([1, 1, engine.vocab_size], engine.logits_dtype)
        self._logits_view = self._logits.numpy()
        self._logits_view.fill(0)
        self._has_logits = False
        self._bindings = []
        for side in (0, 1) if not engine.grows else ():  # with a KV cache, each step binds afresh
            binding = engine._step_session.io_binding()
            binding.bind_ortvalue_input(tokens, self._ids)
            binding.bind_ortvalue_output(logits_name, self._logits)
            for spec in engine._fixed:
                binding.bind_ortvalue_input(spec.input, self._bufs[side][spec.input])
                binding.bind_ortvalue_output(spec.output, self._bufs[1 - side][spec.input])
            self._bindings.append(binding)
        self._assign(state, position, logits)

    # ------------------------------------------------------------------ state access
    def _read(self, name: str) -> np.ndarray:
        """The current value of one state tensor: a view on the host (do not keep it across steps)."""
        if name in self._grown:
            value = self._grown[name]
            if isinstance(value, _Row):
                return self._engine._memory.read(value.value)[value.index : value.index + 1]
            return self._engine._memory.read(value)
        if self._batch_slot is not None:
            return self._batch_slot.row(name, self._row)
        if self._views is not None:
            return self._views[self._side][name]
        return self._engine._memory.read(self._bufs[self._side][name])

    def _sync(self) -> None:
        """Take the fixed-size state back from a batch slot before using the stream on its own."""
        slot = self._batch_slot
        if slot is None:
            return
        with self._engine._lock:
            if self._batch_slot is slot:
                for spec in self._engine._fixed:
                    self._write(spec.input, slot.row(spec.input, self._row))
                self._batch_slot = None

    def _write(self, name: str, value: np.ndarray) -> None:
        if self._views is not None:
            np.copyto(self._views[self._side][name], value)
        else:
            self._engine._memory.write(self._bufs[self._side][name], value)

    def _assign(self, state: Mapping[str, np.ndarray], position: int, logits: np.ndarray | None) -> None:
        self._batch_slot = None  # every tensor is overwritten: nothing to take back from a batch slot
        for spec in self._engine._fixed:
            self._write(spec.input, state[spec.input])
        self._grown = {s.input: self._engine._memory.new(np.ascontiguousarray(state[s.input])) for s in self._engine._growing}
        self._position = position
        self._has_logits = logits is not None
        if logits is not None:
            self._logits_view[0, 0] = logits

    def _past_length(self) -> int:
        spec = self._engine._growing[0]
        return self._grown[spec.input].shape()[spec.shape.index(GROWING)]  # OrtValue or _Row

    @property
    def state_bytes(self) -> int:
        """Bytes of this stream's state (constant for recurrent models; grows with a KV cache)."""
        return self._engine._fixed_bytes + sum(
            v.nbytes() if isinstance(v, _Row) else v.tensor_size_in_bytes() for v in self._grown.values()
        )

    # ------------------------------------------------------------------ running
    def step(self, token_id: int) -> np.ndarray:
        """Consume one token; returns the logits [V] for the next one."""
        engine = self._engine
        self._ids_view[0, 0] = engine._token(token_id)
        if self._batch_slot is not None:
            self._sync()
        binding = self._grow_binding() if engine.grows else self._bindings[self._side]
        engine._run("step", binding)
        if engine.grows:
            outputs = binding.get_outputs()
            for spec, value in zip(engine._growing, outputs[len(engine._fixed) + 1 :]):
                self._grown[spec.input] = value
        self._side ^= 1
        self._position += 1
        self._has_logits = True
        return self._logits_view[0, 0].copy()

    def _grow_binding(self) -> ort.IOBinding:
        """A fresh binding (see the module docstring): fixed buffers as the prebuilt one, caches by the current value."""
        engine = self._engine
        binding = engine._step_session.io_binding()
        binding.bind_ortvalue_input(engine.manifest.inputs["tokens"], self._ids)
        binding.bind_ortvalue_output(engine.manifest.outputs["logits"], self._logits)
        for spec in engine._fixed:
            binding.bind_ortvalue_input(spec.input, self._bufs[self._side][spec.input])
            binding.bind_ortvalue_output(spec.output, self._bufs[1 - self._side][spec.input])
        for spec in engine._growing:
            self._bind_cache(binding, spec)
            binding.bind_output(spec.output, engine._memory.device)
        return binding

    def _bind_cache(self, binding: ort.IOBinding, spec: Any) -> None:
        value = self._grown[spec.input]
        if isinstance(value, _Row):  # a row of a batch's cache: bind it by address, no copy
            row = value.value
            binding.bind_input(spec.input, self._engine._memory.device, 0, np.dtype(spec.dtype), value.shape(),
                               row.data_ptr() + value.index * value.nbytes())
        else:
            binding.bind_ortvalue_input(spec.input, value)

    def _prefill_chunk(self, ids: np.ndarray) -> np.ndarray:
        self._sync()
        engine, memory = self._engine, self._engine._memory
        manifest = engine.manifest
        binding = engine._sessions["prefill"].io_binding()
        tokens = ort.OrtValue.ortvalue_from_shape_and_type([1, ids.size], np.int64)
        tokens.numpy()[0] = ids
        binding.bind_ortvalue_input(manifest.inputs["tokens"], tokens)
        binding.bind_output(manifest.outputs["logits"], "cpu")
        for spec in engine._fixed:
            binding.bind_ortvalue_input(spec.input, self._bufs[self._side][spec.input])
            binding.bind_ortvalue_output(spec.output, self._bufs[1 - self._side][spec.input])
        for spec in engine._growing:
            self._bind_cache(binding, spec)
            binding.bind_output(spec.output, memory.device)
        engine._run("prefill", binding)
        outputs = binding.get_outputs()
        logits = np.array(outputs[0].numpy()[0], copy=True)  # [T, V]
        for spec, value in zip(engine._growing, outputs[len(engine._fixed) + 1 :]):
            self._grown[spec.input] = value
        self._side ^= 1
        self._position += int(ids.size)
        self._logits_view[0, 0] = logits[-1]
        self._has_logits = True
        return logits

    # ------------------------------------------------------------------ lifecycle
    def fork(self) -> Stream:
        """An independent copy: same state, position and next-token logits, its own buffers."""
        return Stream(self._engine, {s.input: self._read(s.input) for s in self._engine._specs}, self._position,
                      self.logits)

    def reset(self) -> None:
        """Back to a fresh stream at position 0 (buffers are reused)."""
        self._assign(self._engine._initial, 0, None)
