"""Engine and Stream on TensorRT: the engines of `edgemem build`, edgemem's plugins, state on the GPU.

    engine = Engine.load("out/gated-deltanet", backend="trt", plugins="build/libedgemem_trt_plugins.so")
    stream = engine.new_stream()                 # same Stream API as the onnxruntime engine

Loading reads DIR/engines/engines.json (or `engines=`), which `edgemem build` writes last, and
refuses, before touching TensorRT, engines built from another export (its `Manifest.identity()`),
engine files that changed since, and a plugin library other than the one they were built with
(sha256); then it needs TensorRT's Python package, cuda-python (`cuda.bindings.runtime`) and a GPU,
and says which is missing. tensorrt and cuda are imported here, lazily: `import edgemem.runtime`
imports neither.

State. Each stream allocates its state on the GPU once (cudaMalloc) and keeps it there; reads
(`state_dict`, `save`, `fork`) copy it to the host. A state tensor that an edgemem plugin reads
and writes, and that nothing else in the graph reads (recurrent_state, WindowAttention's K/V ring,
NeuralMemory's memory / momentum: `engines.json` lists them per engine, see
`edgemem.trt_build.in_place_states`), is bound as input and output to the same buffer: the plugins
read each state element before writing it and each element has one owner (plugins/README.md), and
no other layer reads the input once the plugin may have written it. Every other state tensor gets
two buffers, ping-ponged like the onnxruntime engine's A/B sides (`binding_plan`): conv_state comes
from TensorRT's own layers (Concat + Slice), which may read an input after writing part of an
output, and a position that other layers read too could be read after the plugin wrote it.
No step allocates or copies state.

Runs. One execution context per engine (step, prefill) serves every stream: a run sets the input
shapes and the tensor addresses of the stream, then `execute_async_v3` on the engine's CUDA stream,
under a lock. Token ids go up and logits come down through pageable host memory (the logits copy
synchronises the stream). Prefill runs in chunks of at most the profile's longest sequence, each
with its own token and logits blocks on the device.
`step_batch` gathers the streams' states into [n, ...] buffers with device-to-device copies and
scatters them back (2 × state bytes copied per stream and batched step; onnxruntime's copy-free
batch slots are not ported). Models whose state grows (the softmax baseline's KV cache) are
refused: the engine's outputs would change size at every step.

Sampling, generation, prefill in chunks, checkpoints and token checks come from the backend-neutral
`EngineBase` / `StreamBase` (`edgemem.runtime.base`) that the onnxruntime engine uses too.
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from edgemem.errors import ConfigError, EdgememError
from edgemem.manifest import Manifest, StateSpec, sha256
from edgemem.manifest import load as load_manifest
from edgemem.runtime.base import DEFAULT_CHUNK, EngineBase, StreamBase
from edgemem.runtime.errors import BackendError
from edgemem.runtime.state import concrete_shape, initial_state, is_growing

# kept in step with edgemem.trt_build (which imports onnx and TensorRT lazily; importing it is cheap)
from edgemem.trt_build import ENGINES_DIR, ENGINES_FORMAT, ENGINES_JSON, PLUGINS_ENV

INSTALL = ("pip install 'edgemem[gpu]' (TensorRT and cuda-python; on Jetson, JetPack's python3-libnvinfer and "
           "`pip install cuda-python`)")


# ---------------------------------------------------------------------- checks (no TensorRT needed)
def check_model(manifest: Manifest, directory: Path) -> None:
    """The export can run on this backend: a step graph, a trt target, fixed-size state."""
    if not manifest.graphs.get("step"):
        raise BackendError(f"{directory}: {manifest.arch} has no step graph (a bidirectional model does not "
                           "stream); the runtime needs one")
    if "trt" not in manifest.targets:
        raise BackendError(f"{directory} has no trt target (it has {', '.join(manifest.targets)}); export with "
                           "`edgemem export --target trt`, then `edgemem build`")
    growing = [s.input for s in manifest.state if is_growing(s)]
    if growing:
        raise BackendError(f"{manifest.arch}'s state grows ({', '.join(growing[:2])}: a KV cache); backend 'trt' "
                           "runs fixed-size state only: use backend 'ort' or 'ort-cuda'")


def read_engines(directory: Path, manifest: Manifest, engines: str | os.PathLike | None = None) -> tuple[Path, dict]:
    """The engine directory and its engines.json, checked against this export and the engine files."""
    folder = Path(engines) if engines is not None else directory / ENGINES_DIR
    build = f"`edgemem build {directory} --plugins libedgemem_trt_plugins.so`"
    if not folder.is_dir():
        raise BackendError(f"{folder}: no TensorRT engines; build them with {build}")
    path = folder / ENGINES_JSON
    if not path.is_file():
        raise BackendError(f"{folder} has no {ENGINES_JSON} (engines from an older edgemem?); rebuild with {build}")
    try:
        info = json.loads(path.read_text())
        source, entries = info["export"], info["engines"]
        if info.get("format") != ENGINES_FORMAT or not isinstance(entries, dict):
            raise ValueError(f"format {info.get('format')!r}, expected {ENGINES_FORMAT!r}")
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise BackendError(f"{path} is not a valid {ENGINES_JSON} ({e}); rebuild with {build}") from None
    if source.get("identity") != manifest.identity():
        raise BackendError(
            f"{folder} holds engines built from another export (arch {source.get('arch')}, identity "
            f"{str(source.get('identity'))[:12]}); {directory} is {manifest.arch}, identity {manifest.identity()[:12]}: "
            f"rebuild with {build}"
        )
    if "step" not in entries:
        raise BackendError(f"{path} lists no step engine; rebuild with {build}")
    for kind, entry in entries.items():
        file = folder / entry["file"]
        if not file.is_file():
            raise BackendError(f"{folder}: the {kind} engine {entry['file']} listed in {ENGINES_JSON} is missing; "
                               f"rebuild with {build}")
        if sha256(file) != entry["sha256"]:
            raise BackendError(f"{file} does not match its sha256 in {ENGINES_JSON} (modified, or a build that did "
                               f"not finish); rebuild with {build}")
    return folder, info


def plugin_library(plugins: str | os.PathLike | None, info: Mapping[str, Any]) -> Path:
    """The plugin library to load (`plugins`, else $EDGEMEM_TRT_PLUGINS): the one the engines were built with."""
    name = plugins or os.environ.get(PLUGINS_ENV)
    built = info["plugins"]
    if not name:
        raise BackendError(f"no plugin library: pass plugins='libedgemem_trt_plugins.so' (or set {PLUGINS_ENV}); "
                           f"the engines were built with {built['file']}")
    path = Path(name)
    if not path.is_file():
        raise BackendError(f"plugin library {path} does not exist (the engines were built with {built['file']})")
    if sha256(path) != built["sha256"]:
        raise BackendError(f"plugin library {path} is not the one the engines were built with ({built['file']}, "
                           f"sha256 {built['sha256'][:12]}); pass that library or rebuild the engines with this one")
    return path


def check_tensorrt_version(info: Mapping[str, Any], version: str) -> None:
    """Engines load only into the TensorRT version that built them."""
    if info["tensorrt"] != version:
        raise BackendError(f"the engines were built by TensorRT {info['tensorrt']}, this is TensorRT {version}; "
                           "rebuild them with `edgemem build` here (engines are not portable across versions)")


# ---------------------------------------------------------------------- the binding plan (pure)
def in_place(info: Mapping[str, Any], kinds: Collection[str]) -> frozenset[str]:
    """State inputs bound to one buffer: those every engine of `kinds` may update in place."""
    sets = [set(info["engines"][k]["in_place"]) for k in kinds]
    return frozenset(set.intersection(*sets)) if sets else frozenset()


def buffer_count(spec: StateSpec, shared: Collection[str]) -> int:
    """Device buffers a stream keeps for one state tensor: 1 in place, 2 ping-ponged."""
    return 1 if spec.input in shared else 2


def binding_plan(specs: Sequence[StateSpec], shared: Collection[str], side: int) -> dict[str, tuple[str, int]]:
    """Tensor name → (state input owning the buffers, buffer index) for a run that reads side `side`.

    In place: input and output name buffer 0. Ping-pong: the input reads buffer `side`, the output
    writes buffer `1 - side`; after the run the stream's side flips.
    """
    plan = {}
    for spec in specs:
        if spec.input in shared:
            plan[spec.input] = plan[spec.output] = (spec.input, 0)
        else:
            plan[spec.input], plan[spec.output] = (spec.input, side), (spec.input, 1 - side)
    return plan


def io_shapes(manifest: Manifest, batch: int, tokens: int) -> dict[str, list[int]]:
    """The shape of every input and output of a run over `batch` streams and `tokens` tokens each."""
    shapes = {manifest.inputs["tokens"]: [batch, tokens], manifest.outputs["logits"]: [batch, tokens, manifest.vocab_size]}
    for spec in manifest.state:
        shapes[spec.input] = shapes[spec.output] = concrete_shape(spec, batch)
    return shapes


def check_profile(info: Mapping[str, Any], kind: str, shapes: Mapping[str, Sequence[int]]) -> None:
    """Every input shape lies inside the engine's optimisation profile."""
    for name, (lo, _, hi) in info["engines"][kind]["profile"].items():
        shape = shapes[name]
        if any(not a <= s <= b for s, a, b in zip(shape, lo, hi)):
            raise BackendError(
                f"the {kind} engine takes {name} from {lo} to {hi}, this run needs {list(shape)}; rebuild with "
                f"`edgemem build --max-batch N --max-sequence N` (built with --max-batch {info['max_batch']} "
                f"--max-sequence {info['max_sequence']})"
            )


def max_tokens(info: Mapping[str, Any], kind: str, tokens: str) -> int:
    """The longest token block one run of the `kind` engine takes (1 when its sequence dim is fixed)."""
    ranges = info["engines"][kind]["profile"].get(tokens)
    return ranges[2][1] if ranges else 1


# ---------------------------------------------------------------------- CUDA and TensorRT
class Device(Protocol):
    """What the engine needs from CUDA (`_Cuda`; tests pass a host-memory stand-in)."""

    handle: int

    def alloc(self, nbytes: int) -> int: ...
    def free(self, pointers: Sequence[int]) -> None: ...
    def upload(self, pointer: int, array: np.ndarray) -> None: ...
    def download(self, array: np.ndarray, pointer: int) -> None: ...
    def copy(self, dst: int, src: int, nbytes: int) -> None: ...


class Graph(Protocol):
    """One engine and its execution context (`_TrtGraph`; tests pass a stand-in)."""

    inputs: frozenset[str]
    outputs: frozenset[str]
    dtypes: dict[str, np.dtype]

    def run(self, shapes: Mapping[str, Sequence[int]], addresses: Mapping[str, int], stream: int) -> None: ...


class _Cuda:
    """cuda-python's runtime API on one CUDA stream; a failing call raises BackendError."""

    def __init__(self, cudart: Any):
        self._rt = cudart
        try:
            count = self._call(cudart.cudaGetDeviceCount(), "cudaGetDeviceCount")
        except BackendError as e:
            raise BackendError(f"backend 'trt' needs an NVIDIA GPU and its driver: {e}") from None
        if count < 1:
            raise BackendError("backend 'trt' needs an NVIDIA GPU: CUDA sees none")
        self._stream = self._call(cudart.cudaStreamCreate(), "cudaStreamCreate")
        self.handle = int(self._stream)

    def _call(self, result: tuple, what: str) -> Any:
        err, *rest = result
        if err != self._rt.cudaError_t.cudaSuccess:
            raise BackendError(f"CUDA {what} failed: {self._rt.cudaGetErrorString(err)[1].decode()}")
        return rest[0] if rest else None

    def alloc(self, nbytes: int) -> int:
        return int(self._call(self._rt.cudaMalloc(max(nbytes, 1)), "cudaMalloc"))

    def free(self, pointers: Sequence[int]) -> None:
        for pointer in pointers:
            self._rt.cudaFree(pointer)  # at teardown: nothing to do about a failure

    def _copy(self, dst: int, src: int, nbytes: int, kind: Any) -> None:
        self._call(self._rt.cudaMemcpyAsync(dst, src, nbytes, kind, self._stream), "cudaMemcpyAsync")

    def upload(self, pointer: int, array: np.ndarray) -> None:
        # pageable host memory: the copy is staged before cudaMemcpyAsync returns, so `array` may go
        self._copy(pointer, array.ctypes.data, array.nbytes, self._rt.cudaMemcpyKind.cudaMemcpyHostToDevice)

    def download(self, array: np.ndarray, pointer: int) -> None:
        self._copy(array.ctypes.data, pointer, array.nbytes, self._rt.cudaMemcpyKind.cudaMemcpyDeviceToHost)
        self._call(self._rt.cudaStreamSynchronize(self._stream), "cudaStreamSynchronize")

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self._copy(dst, src, nbytes, self._rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice)


class _TrtGraph:
    """A deserialized engine with one execution context."""

    def __init__(self, trt: Any, runtime: Any, path: Path, kind: str):
        self.kind = kind
        self.engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if self.engine is None:
            raise BackendError(f"TensorRT could not deserialize {path} (see its log: another GPU, or a plugin the "
                               "library lacks?); rebuild with `edgemem build`")
        self.context = self.engine.create_execution_context()
        if self.context is None:
            raise BackendError(f"TensorRT could not create an execution context for {path} (out of GPU memory?)")
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = frozenset(n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT)
        self.outputs = frozenset(names) - self.inputs
        self.dtypes = {n: np.dtype(trt.nptype(self.engine.get_tensor_dtype(n))) for n in names}

    def run(self, shapes: Mapping[str, Sequence[int]], addresses: Mapping[str, int], stream: int) -> None:
        for name in self.inputs:
            if not self.context.set_input_shape(name, list(shapes[name])):
                raise BackendError(f"TensorRT refused shape {list(shapes[name])} for {name} of the {self.kind} engine")
        for name, pointer in addresses.items():
            if not self.context.set_tensor_address(name, pointer):
                raise BackendError(f"TensorRT refused the address of {name} in the {self.kind} engine")
        if not self.context.execute_async_v3(stream):
            raise EdgememError(f"TensorRT failed running the {self.kind} engine (see its log)")


def _import(module: str, what: str) -> Any:
    import importlib  # noqa: PLC0415

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise BackendError(f"backend 'trt' needs {what}, which is not installed ({e}): {INSTALL}") from None


# ---------------------------------------------------------------------- engine and streams
class TrtEngine(EngineBase):
    """An export's TensorRT engines; makes streams. The API of `edgemem.runtime.Engine`.

    Use `Engine.load(DIR, backend="trt")`.
    """

    backend = "trt"
    target = "trt"
    threads = None
    grows = False

    def __init__(self, directory: Path, manifest: Manifest, info: Mapping[str, Any], graphs: Mapping[str, Graph],
                 device: Device, chunk_size: int):
        self.directory, self.manifest, self.info, self.chunk_size = directory, manifest, info, chunk_size
        self.vocab_size = manifest.vocab_size
        self.has_prefill = "prefill" in graphs
        self._graphs, self._device = dict(graphs), device
        self._specs = list(manifest.state)
        self._tokens_name, self._logits_name = manifest.inputs["tokens"], manifest.outputs["logits"]
        want = {self._tokens_name, self._logits_name, *(s.input for s in self._specs), *(s.output for s in self._specs)}
        for kind, graph in graphs.items():
            if set(graph.inputs) | set(graph.outputs) != want:
                raise BackendError(f"the {kind} engine does not match edgemem.json: tensors "
                                   f"{sorted(want ^ (set(graph.inputs) | set(graph.outputs)))} differ; rebuild it")
            wrong = [s.input for s in self._specs if graph.dtypes[s.input] != np.dtype(s.dtype)]
            if wrong:
                raise BackendError(f"the {kind} engine's state {', '.join(wrong)} has not edgemem.json's dtype; rebuild it")
        step = graphs["step"]
        self.logits_dtype = step.dtypes[self._logits_name]
        self._token_dtype = step.dtypes[self._tokens_name]
        self._shared = in_place(info, graphs)
        self._plans = [binding_plan(self._specs, self._shared, side) for side in (0, 1)]
        self._max_tokens = max_tokens(info, "prefill", self._tokens_name) if self.has_prefill else 1
        self._initial = initial_state(manifest, directory, 1)
        self._fixed_bytes = sum(a.nbytes for a in self._initial.values())
        self._growth = 0
        self._step_shapes = io_shapes(manifest, 1, 1)
        check_profile(info, "step", self._step_shapes)
        self._lock = threading.Lock()
        self._batch: _BatchBuffers | None = None
        self._keep: tuple = ()  # what the graphs must not outlive (TensorRT's runtime, logger, plugin library)

    @classmethod
    def load(cls, directory: str | Path, target: str | None = None, threads: int | None = None, *,
             chunk_size: int = DEFAULT_CHUNK, check_files: bool = True,
             engines: str | os.PathLike | None = None, plugins: str | os.PathLike | None = None) -> TrtEngine:
        """Load DIR's engines (DIR/engines, or `engines`) with the plugin library (`plugins` or $EDGEMEM_TRT_PLUGINS)."""
        directory = Path(directory)
        if target not in (None, "trt"):
            raise BackendError(f"backend 'trt' runs the engines built from the trt target, not {target!r}")
        if threads is not None:
            raise ConfigError("threads is an onnxruntime setting; backend 'trt' runs on the GPU")
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ConfigError(f"chunk_size must be a positive integer; got {chunk_size!r}")
        manifest = load_manifest(directory, check_files=check_files)
        check_model(manifest, directory)
        folder, info = read_engines(directory, manifest, engines)
        library = plugin_library(plugins, info)
        trt = _import("tensorrt", "TensorRT's Python package (`import tensorrt`)")
        cudart = _import("cuda.bindings.runtime", "cuda-python (`import cuda.bindings.runtime`)")
        check_tensorrt_version(info, trt.__version__)
        device = _Cuda(cudart)
        logger = trt.Logger(trt.Logger.WARNING)
        handle = trt.get_plugin_registry().load_library(str(library))
        if not handle:
            raise BackendError(f"TensorRT could not load the plugin library {library} (built for another TensorRT major?)")
        runtime = trt.Runtime(logger)
        if runtime is None:
            raise BackendError("TensorRT could not create a runtime: no usable NVIDIA GPU or driver")
        graphs = {kind: _TrtGraph(trt, runtime, folder / entry["file"], kind) for kind, entry in info["engines"].items()}
        engine = cls(directory, manifest, info, graphs, device, chunk_size)
        engine._keep = (runtime, logger, handle)
        return engine

    # ------------------------------------------------------------------ streams
    def _new(self, state: Mapping[str, np.ndarray], position: int, logits: np.ndarray | None) -> TrtStream:
        return TrtStream(self, state, position, logits)

    # ------------------------------------------------------------------ running
    def _run(self, kind: str, shapes: Mapping[str, Sequence[int]], addresses: Mapping[str, int]) -> None:
        with self._lock:
            self._graphs[kind].run(shapes, addresses, self._device.handle)

    def step_batch(self, streams: Sequence[TrtStream], token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """One token for each stream in one run of the step engine; returns logits [n, V] (see the module docstring)."""
        streams, tokens = self._check_batch(streams, token_ids)
        n = len(streams)
        shapes = io_shapes(self.manifest, n, 1)
        check_profile(self.info, "step", shapes)
        device = self._device
        with self._lock:
            if self._batch is None or self._batch.n != n:
                self._batch = _BatchBuffers(self, n)
            batch = self._batch
            for spec in self._specs:
                size = batch.row_bytes[spec.input]
                for i, s in enumerate(streams):
                    device.copy(batch.bufs[spec.input][0] + i * size, s._bufs[spec.input][s._index(spec.input)], size)
            device.upload(batch.ids, tokens.astype(self._token_dtype).reshape(n, 1))
            self._graphs["step"].run(shapes, batch.addresses, device.handle)
            for spec in self._specs:
                size, out = batch.row_bytes[spec.input], batch.bufs[spec.input][-1]
                for i, s in enumerate(streams):
                    device.copy(s._bufs[spec.input][s._index(spec.input, output=True)], out + i * size, size)
            logits = np.empty((n, 1, self.vocab_size), self.logits_dtype)
            device.download(logits, batch.logits)
        for i, s in enumerate(streams):
            s._side ^= 1
            s._logits_view[0, 0] = logits[i, 0]
            s._has_logits = True
            s._position += 1
        return logits[:, 0]

    def __repr__(self) -> str:
        return f"TrtEngine({self.manifest.arch}, {self.directory}, in place: {len(self._shared)}/{len(self._specs)} states)"


def _allocate(device: Device, sizes: Sequence[int], owner: object) -> list[int]:
    """Device buffers freed when `owner` is collected."""
    pointers = []
    try:
        for size in sizes:
            pointers.append(device.alloc(size))
    except BaseException:
        device.free(pointers)
        raise
    weakref.finalize(owner, device.free, pointers)
    return pointers


class _BatchBuffers:
    """[n, ...] state buffers (ping-pong side 0 → 1, in place 0), token ids and logits for `step_batch`."""

    def __init__(self, engine: TrtEngine, n: int):
        self.n = n
        specs, shared = engine._specs, engine._shared
        self.row_bytes = {s.input: engine._initial[s.input].nbytes for s in specs}
        counts = [buffer_count(s, shared) for s in specs]
        sizes = [n * self.row_bytes[s.input] for s, c in zip(specs, counts) for _ in range(c)]
        pointers = iter(_allocate(engine._device, [*sizes, n * 8, n * engine.vocab_size * engine.logits_dtype.itemsize],
                                  self))
        self.bufs = {s.input: [next(pointers) for _ in range(c)] for s, c in zip(specs, counts)}
        self.ids, self.logits = next(pointers), next(pointers)
        self.addresses = {t: self.bufs[state][i] for t, (state, i) in engine._plans[0].items()}
        self.addresses.update({engine._tokens_name: self.ids, engine._logits_name: self.logits})


class TrtStream(StreamBase):
    """One sequence's state, resident on the GPU, and its position. API of `edgemem.runtime.Stream`."""

    def __init__(self, engine: TrtEngine, state: Mapping[str, np.ndarray], position: int, logits: np.ndarray | None):
        self._engine = engine
        specs, shared = engine._specs, engine._shared
        counts = [buffer_count(s, shared) for s in specs]
        sizes = [engine._initial[s.input].nbytes for s, c in zip(specs, counts) for _ in range(c)]
        pointers = iter(_allocate(engine._device, [*sizes, 8, engine.vocab_size * engine.logits_dtype.itemsize], self))
        self._bufs = {s.input: [next(pointers) for _ in range(c)] for s, c in zip(specs, counts)}
        self._ids_ptr, self._logits_ptr = next(pointers), next(pointers)
        self._ids = np.zeros((1, 1), engine._token_dtype)
        self._logits_view = np.zeros((1, 1, engine.vocab_size), engine.logits_dtype)
        self._addresses = []  # per side: every tensor's address, like the onnxruntime engine's two bindings
        for plan in engine._plans:
            addresses = {t: self._bufs[state][i] for t, (state, i) in plan.items()}
            addresses.update({engine._tokens_name: self._ids_ptr, engine._logits_name: self._logits_ptr})
            self._addresses.append(addresses)
        self._side = 0
        self._assign(state, position, logits)

    # ------------------------------------------------------------------ state access
    def _index(self, name: str, output: bool = False) -> int:
        """Which of the state's buffers holds it now (or receives it, for the run's output)."""
        return 0 if len(self._bufs[name]) == 1 else self._side ^ output

    def _read(self, name: str) -> np.ndarray:
        """The current value of one state tensor: a host copy."""
        array = np.empty_like(self._engine._initial[name])
        self._engine._device.download(array, self._bufs[name][self._index(name)])
        return array

    def _assign(self, state: Mapping[str, np.ndarray], position: int, logits: np.ndarray | None) -> None:
        device = self._engine._device
        for spec in self._engine._specs:
            device.upload(self._bufs[spec.input][self._index(spec.input)],
                          np.ascontiguousarray(state[spec.input], dtype=spec.dtype))
        self._position = position
        self._has_logits = logits is not None
        if logits is not None:
            self._logits_view[0, 0] = logits

    @property
    def state_bytes(self) -> int:
        """Bytes of this stream's state (constant: backend 'trt' runs fixed-size state only)."""
        return self._engine._fixed_bytes

    # the onnxruntime stream's backend-independent parts

    # ------------------------------------------------------------------ running
    def step(self, token_id: int) -> np.ndarray:
        """Consume one token; returns the logits [V] for the next one."""
        engine, device = self._engine, self._engine._device
        self._ids[0, 0] = engine._token(token_id)
        device.upload(self._ids_ptr, self._ids)
        engine._run("step", engine._step_shapes, self._addresses[self._side])
        device.download(self._logits_view, self._logits_ptr)
        self._side ^= 1
        self._position += 1
        self._has_logits = True
        return self._logits_view[0, 0].copy()

    def _prefill_chunk(self, ids: np.ndarray) -> np.ndarray:
        """Run the prefill engine on `ids` (split to the profile's longest sequence); returns logits [T, V]."""
        engine, device = self._engine, self._engine._device
        limit = engine._max_tokens
        if ids.size > limit:
            return np.concatenate([self._prefill_chunk(ids[i : i + limit]) for i in range(0, ids.size, limit)])
        logits = np.empty((1, ids.size, engine.vocab_size), engine.logits_dtype)
        tokens = ids.astype(engine._token_dtype).reshape(1, -1)
        pointers: list[int] = []
        try:
            pointers.append(device.alloc(tokens.nbytes))
            pointers.append(device.alloc(logits.nbytes))
            device.upload(pointers[0], tokens)
            addresses = {**self._addresses[self._side], engine._tokens_name: pointers[0], engine._logits_name: pointers[1]}
            engine._run("prefill", io_shapes(engine.manifest, 1, ids.size), addresses)
            device.download(logits, pointers[1])
        finally:
            device.free(pointers)
        self._side ^= 1
        self._position += int(ids.size)
        self._logits_view[0, 0] = logits[0, -1]
        self._has_logits = True
        return logits[0]

    # ------------------------------------------------------------------ lifecycle
    def fork(self) -> TrtStream:
        """An independent copy: same state, position and next-token logits, its own buffers."""
        return TrtStream(self._engine, {s.input: self._read(s.input) for s in self._engine._specs}, self._position,
                         self.logits)

    def reset(self) -> None:
        """Back to a fresh stream at position 0 (buffers are reused)."""
        self._assign(self._engine._initial, 0, None)
