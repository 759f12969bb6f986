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

import operator
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from edgemem.errors import ConfigError, EdgememError
from edgemem.manifest import Manifest
from edgemem.manifest import load as load_manifest
from edgemem.runtime.errors import BackendError, BatchError, StateFileError, TokenError
from edgemem.runtime.sampling import check_sampling, sample
from edgemem.runtime.state import (
    GROWING,
    check_state,
    concrete_shape,
    decode_checkpoint,
    initial_state,
    is_growing,
    save_checkpoint,
)

BACKENDS = ("ort", "ort-cuda")
DEFAULT_CHUNK = 512
_BATCH_SLOTS = 4  # batch sizes whose [n, ...] buffers are kept
_ORT_TYPES = {
    "tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32,
}

TokenIds = Sequence[int] | np.ndarray | bytes | bytearray


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


class Engine:
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
             *, chunk_size: int = DEFAULT_CHUNK, check_files: bool = True) -> Engine:
        """Load the export in `directory` (its `edgemem.json`; every file's sha256 is checked).

        backend: "ort" (CPU) or "ort-cuda" (onnxruntime's CUDA execution provider).
        target: which lowered graphs to run; default "ort" if the export has it, else "generic".
        threads: onnxruntime intra-op threads (default: onnxruntime's choice, one per core).
        chunk_size: tokens per prefill-graph run.
        """
        directory = Path(directory)
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
        try:
            session = ort.InferenceSession(str(path), options, providers=providers)
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
    def new_stream(self) -> Stream:
        """A fresh stream at position 0 (Titans' memory starts from `state_init.safetensors`)."""
        return Stream(self, self._initial, 0, None)

    def load_stream(self, path: str | Path) -> Stream:
        """A stream restored from `Stream.save`: refused unless it is this model's, intact and well-formed."""
        path = Path(path)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise StateFileError(f"{path}: no such state file") from None
        except OSError as e:
            raise StateFileError(f"{path}: cannot read ({e.strerror})") from None
        checkpoint = decode_checkpoint(data, self.manifest, str(path))
        return Stream(self, checkpoint.state, checkpoint.position, checkpoint.logits)

    def stream_from_state(self, state: Mapping[str, np.ndarray], position: int = 0,
                          logits: np.ndarray | None = None) -> Stream:
        """A stream from numpy state tensors of batch 1 (names as in edgemem.json), checked like a checkpoint."""
        check_state(self.manifest, state)
        return Stream(self, state, int(position), logits)

    def state_bytes(self, position: int = 0) -> int:
        """Bytes of one stream's state at `position` (constant unless the model has a KV cache)."""
        return self._fixed_bytes + self._growth * position

    @property
    def state_bytes_per_token(self) -> int:
        return self._growth

    # ------------------------------------------------------------------ tokens
    def _token(self, token: Any) -> int:
        if type(token) is int and 0 <= token < self.vocab_size:  # the fast path
            return token
        if isinstance(token, (bool, np.bool_)) or not isinstance(token, (int, np.integer)):
            raise TokenError(f"a token id must be an integer; got {type(token).__name__} {token!r}")
        token = operator.index(token)
        if not 0 <= token < self.vocab_size:
            raise TokenError(f"token id {token} is outside the vocabulary [0, {self.vocab_size})")
        return token

    def _tokens(self, token_ids: Any, what: str = "prompt") -> np.ndarray:
        if isinstance(token_ids, (bytes, bytearray, memoryview)):
            ids = np.frombuffer(bytes(token_ids), dtype=np.uint8).astype(np.int64)
        elif isinstance(token_ids, str):
            raise TokenError(f"the {what} is text: pass token ids (for a byte-level model, text.encode())")
        else:
            ids = np.asarray(token_ids)
            if ids.dtype == object or (ids.size and ids.dtype.kind not in "iu"):
                raise TokenError(f"the {what} must hold integer token ids; got dtype {ids.dtype}")
            ids = ids.astype(np.int64, copy=False).reshape(-1) if ids.ndim <= 1 else None
            if ids is None:
                raise TokenError(f"the {what} must be one sequence of token ids (1-D)")
        if ids.size == 0:
            raise TokenError(f"the {what} is empty: give at least one token")
        bad = np.flatnonzero((ids < 0) | (ids >= self.vocab_size))
        if bad.size:
            raise TokenError(f"token id {int(ids[bad[0]])} at index {int(bad[0])} of the {what} is outside the "
                             f"vocabulary [0, {self.vocab_size})")
        return ids

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
        streams = list(streams)
        n = len(streams)
        if n == 0:
            raise BatchError("step_batch needs at least one stream")
        if any(not isinstance(s, Stream) or s._engine is not self for s in streams):
            raise BatchError("step_batch: every stream must come from this engine (engine.new_stream())")
        if len({id(s) for s in streams}) != n:
            raise BatchError("step_batch: a stream appears more than once in the batch")
        tokens = self._tokens(token_ids, "batch's token ids")
        if tokens.size != n:
            raise BatchError(f"step_batch: {n} streams but {tokens.size} token ids")
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

    # ------------------------------------------------------------------ convenience
    def generate(self, prompt: bytes | str | Sequence[int], max_new_tokens: int = 64, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None) -> bytes | list[int]:
        """Generate from a fresh stream (see `Stream.generate`)."""
        return self.new_stream().generate(prompt, max_new_tokens, temperature, top_k, top_p, seed)

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


class Stream:
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

    def state_dict(self) -> dict[str, np.ndarray]:
        """A copy of every state tensor (batch 1), named as the graph inputs in edgemem.json."""
        return {s.input: np.array(self._read(s.input), copy=True) for s in self._engine._specs}

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def position(self) -> int:
        """Tokens consumed since the stream started (kept through save/load and fork)."""
        return self._position

    @property
    def state_bytes(self) -> int:
        """Bytes of this stream's state (constant for recurrent models; grows with a KV cache)."""
        return self._engine._fixed_bytes + sum(
            v.nbytes() if isinstance(v, _Row) else v.tensor_size_in_bytes() for v in self._grown.values()
        )

    @property
    def logits(self) -> np.ndarray | None:
        """Logits [V] for the next token (after the last prefill or step), or None for a fresh stream."""
        return self._logits_view[0, 0].copy() if self._has_logits else None

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

    def prefill(self, token_ids: TokenIds, *, chunk_size: int | None = None, all_logits: bool = True) -> np.ndarray:
        """Consume a block of tokens; returns logits [T, V] (or only the last row [V] with `all_logits=False`).

        Runs the prefill graph on chunks of `chunk_size` tokens (default: the engine's), or steps
        through the tokens when the export has no prefill graph.
        """
        engine = self._engine
        ids = engine._tokens(token_ids)
        chunk = chunk_size or engine.chunk_size
        if not isinstance(chunk, int) or chunk < 1:
            raise ConfigError(f"chunk_size must be a positive integer; got {chunk!r}")
        rows: list[np.ndarray] = []
        if not engine.has_prefill:
            for token in ids.tolist():
                logits = self.step(token)
                if all_logits:
                    rows.append(logits)
            return np.stack(rows) if all_logits else logits
        for start in range(0, ids.size, chunk):
            part = self._prefill_chunk(ids[start : start + chunk])
            if all_logits:
                rows.append(part)
        return np.concatenate(rows) if all_logits else self._logits_view[0, 0].copy()

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

    def save(self, path: str | Path) -> None:
        """Checkpoint to a safetensors file, atomically (see `edgemem.runtime.state`)."""
        save_checkpoint(path, self._engine.manifest, {s.input: self._read(s.input) for s in self._engine._specs},
                        self._position, self.logits)

    # ------------------------------------------------------------------ generation
    def generate_iter(self, prompt: bytes | str | Sequence[int] = b"", max_new_tokens: int = 64,
                      temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                      seed: int | None = None) -> Iterator[int]:
        """Yield new token ids one by one. Each yielded token has already been fed to the stream, so
        stopping early leaves a stream ready to continue. An empty prompt continues from the stream's
        last logits (e.g. after `engine.load_stream`)."""
        check_sampling(temperature, top_k, top_p)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be a non-negative integer; got {max_new_tokens!r}")
        if isinstance(prompt, str):
            if self._engine.vocab_size != 256:
                raise TokenError("text prompts need a byte-level model (vocab 256); pass token ids")
            prompt = prompt.encode()
        if len(prompt):
            logits = self.prefill(prompt, all_logits=False)
        elif self._has_logits:
            logits = self._logits_view[0, 0].copy()
        else:
            raise TokenError("nothing to continue from: the stream is fresh, give a prompt")
        rng = np.random.default_rng(seed)
        for _ in range(max_new_tokens):
            token = sample(logits, temperature, top_k, top_p, rng)
            logits = self.step(token)
            yield token

    def generate(self, prompt: bytes | str | Sequence[int] = b"", max_new_tokens: int = 64, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None) -> bytes | list[int]:
        """The new tokens after `prompt`: bytes for a byte-level model (vocab 256), else a list of ids.
        Greedy at temperature 0; otherwise sampled with top-k / top-p, reproducibly with `seed`."""
        tokens = list(self.generate_iter(prompt, max_new_tokens, temperature, top_k, top_p, seed))
        return bytes(tokens) if self._engine.vocab_size == 256 else tokens

    def __repr__(self) -> str:
        return f"Stream({self._engine.manifest.arch}, position={self._position}, state_bytes={self.state_bytes})"
