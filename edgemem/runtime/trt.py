"""The TensorRT backend ("trt"): the engines of `edgemem build`, edgemem's plugins, state on the GPU.

    engine = Engine.load("out/gated-deltanet", backend="trt", plugins="build/libedgemem_trt_plugins.so")
    stream = engine.new_stream()                 # the same Stream API as on onnxruntime

Loading reads DIR/engines/engines.json (or `engines=`) and refuses, before touching TensorRT, what
`edgemem.runtime.engines` refuses (engines of another export, changed engine files, another plugin
library); then it needs the library that built the engines (engines.json's "library": TensorRT's
`tensorrt`, or TensorRT for RTX's `tensorrt_rtx` for `edgemem build --rtx` engines, same Python API),
cuda-python (`cuda.bindings.runtime`) and a GPU, and says which is missing. Those are imported here,
lazily: `import edgemem.runtime` imports none of them.

State. Each stream allocates its state on the GPU once (cudaMalloc) and keeps it there; reads
(`state_dict`, `save`, `fork`) copy it to the host. A state tensor that an edgemem plugin reads
and writes, and that nothing else in the graph reads (recurrent_state, WindowAttention's K/V ring,
NeuralMemory's memory / momentum: `engines.json` lists them per engine, see
`edgemem.trt_build.in_place_states`), is bound as input and output to the same buffer: the plugins
read each state element before writing it and each element has one owner (plugins/README.md), and
no other layer reads the input once the plugin may have written it. Every other state tensor gets
two buffers, ping-ponged like the onnxruntime backend's A/B sides (`binding_plan`): conv_state comes
from TensorRT's own layers (Concat + Slice), which may read an input after writing part of an
output, and a position that other layers read too could be read after the plugin wrote it.
No step allocates or copies state. Batch slots (`edgemem.runtime.base`) keep [n, ...] buffers of
the same plan; gathering into them and giving rows back are device-to-device copies.

Engines. `edgemem build` writes one engine that serves both graphs, so the weights are on the GPU
once: its optimisation profile 0 takes one token (step), profile 1 a block (prefill), as
engines.json's "profile_index" says (`edgemem.runtime.engines`). `open_graphs` deserializes each
engine file once and gives each graph kind an execution context of its own on its profile; the
contexts share the engine's weights and each holds the scratch of its own profile. Engine sets
of format edgemem-engines/2 (a step engine and a prefill engine) load the same way, with two
copies of the weights. An encoder-decoder's encoder engine is a file of its own (one profile).

Encoder-decoders. `Engine.encode` runs the encoder engine, which writes the cross keys and values
(the manifest's `encoder.fills`) straight into the new stream's read-only state buffers on the GPU
(`_ReadOnly`: sized by the input's length); the decoder's step and prefill engines then bind them as
inputs only, one buffer each: never ping-ponged, never copied per run. A fork shares them (no run
writes them; they are freed with the last stream that holds them). A batch slot copies its members'
rows in once, when it takes them; streams encoded from inputs of different lengths do not batch.

Runs. One execution context per graph kind (step, prefill, encoder) serves every stream: a run sets
the input shapes and the tensor addresses of the stream, then `execute_async_v3` on the engine's
CUDA stream, under a lock. Token ids go up and logits come down through pageable host memory (the
logits copy synchronises the stream). Prefill runs in chunks of at most the profile's longest sequence, each
with its own token and logits blocks on the device. Models whose state grows (the softmax
baseline's KV cache) are refused: the engine's outputs would change size at every step.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from edgemem.errors import ConfigError, EdgememError, named
from edgemem.manifest import Manifest, StateSpec
from edgemem.runtime import engines
from edgemem.runtime.base import BatchSlot, Engine, Stream
from edgemem.runtime.errors import BackendError, StateFileError
from edgemem.runtime.state import concrete_shape, is_growing, variable_dim

INSTALL = (
    "pip install 'edgemem-toolkit[gpu]' (TensorRT and cuda-python; on Jetson, JetPack's python3-libnvinfer and "
    "`pip install cuda-python`; for TensorRT for RTX engines, 'edgemem-toolkit[rtx]' and cuda-python)"
)


# ---------------------------------------------------------------------- checks (no TensorRT needed)
def check_model(manifest: Manifest, directory: Path) -> None:
    """The export can run on this backend: a trt target, fixed-size state."""
    if "trt" not in manifest.targets:
        raise BackendError(
            f"{directory} has no trt target (it has {', '.join(manifest.targets)}); export with "
            "`edgemem export --target trt`, then `edgemem build`"
        )
    growing = [s.input for s in manifest.state if is_growing(s) and s.output]  # read-only states are sized per stream
    if growing:
        raise BackendError(
            f"{manifest.arch}'s state grows ({', '.join(growing[:2])}: a KV cache); backend 'trt' "
            "runs fixed-size state only: use backend 'ort' or 'ort-cuda'"
        )


# ---------------------------------------------------------------------- the binding plan (pure)
def buffer_count(spec: StateSpec, shared: Collection[str]) -> int:
    """Device buffers a stream keeps for one state tensor: 1 in place or read only, 2 ping-ponged."""
    return 1 if spec.input in shared or not spec.output else 2


def binding_plan(specs: Sequence[StateSpec], shared: Collection[str], side: int) -> dict[str, tuple[str, int]]:
    """Tensor name → (state input owning the buffers, buffer index) for a run that reads side `side`.

    In place: input and output name buffer 0. Read only (no output): the input names buffer 0 on
    both sides. Ping-pong: the input reads buffer `side`, the output writes buffer `1 - side`; after
    the run the stream's side flips.
    """
    plan = {}
    for spec in specs:
        if not spec.output:
            plan[spec.input] = (spec.input, 0)
        elif spec.input in shared:
            plan[spec.input] = plan[spec.output] = (spec.input, 0)
        else:
            plan[spec.input], plan[spec.output] = (spec.input, side), (spec.input, 1 - side)
    return plan


def io_shapes(manifest: Manifest, batch: int, tokens: int, encoded: int = 0) -> dict[str, list[int]]:
    """The shape of every input and output of a run over `batch` streams and `tokens` tokens each (streams
    encoded from inputs of `encoded` tokens, for an encoder-decoder)."""
    shapes = {
        manifest.inputs["tokens"]: [batch, tokens],
        manifest.outputs["logits"]: [batch, tokens, manifest.vocab_size],
    }
    for spec in manifest.state:
        shapes[spec.input] = concrete_shape(spec, batch, encoded=encoded)
        if spec.output:
            shapes[spec.output] = shapes[spec.input]
    return shapes


def encoder_shapes(manifest: Manifest, batch: int, encoded: int) -> dict[str, list[int]]:
    """The shape of every input and output of an encoder run over `batch` inputs of `encoded` tokens."""
    encoder = manifest.encoder
    shapes = {name: [batch, encoded] for name in encoder["inputs"].values()}
    for spec in manifest.state:
        if spec.input in encoder["fills"]:
            shapes[encoder["fills"][spec.input]] = concrete_shape(spec, batch, encoded=encoded)
    return shapes


# ---------------------------------------------------------------------- CUDA and TensorRT
class Device(Protocol):
    """What the engine needs from CUDA (`_Cuda`; tests pass a host-memory stand-in)."""

    handle: int

    def alloc(self, nbytes: int) -> int: ...
    def free(self, pointers: Sequence[int]) -> None: ...
    def upload(self, pointer: int, array: np.ndarray) -> None: ...
    def download(self, array: np.ndarray, pointer: int) -> None: ...
    def copy(self, dst: int, src: int, nbytes: int) -> None: ...
    def synchronize(self) -> None: ...


class EngineContext(Protocol):
    """An execution context on the profile of one graph kind (`_TrtGraph`; tests pass a stand-in)."""

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

    def synchronize(self) -> None:
        self._call(self._rt.cudaStreamSynchronize(self._stream), "cudaStreamSynchronize")


class _TrtGraph:
    """An execution context of a deserialized engine, on the optimisation profile of one graph kind."""

    def __init__(self, trt: Any, engine: Any, path: Path, kind: str, index: int, stream: int):
        self.kind, self.engine = kind, engine  # the context must not outlive its engine
        # ON_PROFILE_CHANGE: scratch for this context's profile only, not for the largest of the engine's
        self.context = engine.create_execution_context(trt.ExecutionContextAllocationStrategy.ON_PROFILE_CHANGE)
        if self.context is None:
            raise BackendError(f"TensorRT could not create an execution context for {path} (out of GPU memory?)")
        if not 0 <= index < engine.num_optimization_profiles or not self.context.set_optimization_profile_async(
            index, stream
        ):
            raise BackendError(
                f"TensorRT could not select optimisation profile {index} of {path} for the {kind} graph "
                f"(the engine has {engine.num_optimization_profiles}); rebuild with `edgemem build`"
            )
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self.inputs = frozenset(n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT)
        self.outputs = frozenset(names) - self.inputs
        self.dtypes = {n: np.dtype(trt.nptype(engine.get_tensor_dtype(n))) for n in names}

    def run(self, shapes: Mapping[str, Sequence[int]], addresses: Mapping[str, int], stream: int) -> None:
        for name in self.inputs:
            if not self.context.set_input_shape(name, list(shapes[name])):
                raise BackendError(f"TensorRT refused shape {list(shapes[name])} for {name} of the {self.kind} engine")
        for name, pointer in addresses.items():
            if not self.context.set_tensor_address(name, pointer):
                raise BackendError(f"TensorRT refused the address of {name} in the {self.kind} engine")
        if not self.context.execute_async_v3(stream):
            raise EdgememError(f"TensorRT failed running the {self.kind} engine (see its log)")


def open_graphs(trt: Any, runtime: Any, files: Mapping[Path, Mapping[str, int]], stream: int) -> dict[str, _TrtGraph]:
    """Graph kind → its execution context: each engine file (`engines.files`) deserialized once, one context
    per kind it serves, on that kind's profile. Contexts of one engine share its weights."""
    graphs = {}
    for path, kinds in files.items():
        engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if engine is None:
            raise BackendError(
                f"TensorRT could not deserialize {path} (see its log: another GPU, or a plugin the "
                "library lacks?); rebuild with `edgemem build`"
            )
        for kind, index in kinds.items():
            graphs[kind] = _TrtGraph(trt, engine, path, kind, index, stream)
    return graphs


def _import(module: str, what: str) -> Any:
    import importlib  # noqa: PLC0415

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise BackendError(f"backend 'trt' needs {what}, which is not installed ({e}): {INSTALL}") from None


# ---------------------------------------------------------------------- engine, buffers, slots, streams
class TrtEngine(Engine):
    """An export's TensorRT engines. Use `Engine.load(DIR, backend="trt")`."""

    backend = "trt"
    target = "trt"
    threads = None

    def __init__(
        self,
        directory: Path,
        manifest: Manifest,
        info: Mapping[str, Any],
        graphs: Mapping[str, EngineContext],
        device: Device,
        chunk_size: int,
    ):
        super().__init__(directory, manifest, chunk_size, has_prefill="prefill" in graphs)
        self.info = info
        self._graphs, self._device = dict(graphs), device
        self._tokens_name, self._logits_name = manifest.inputs["tokens"], manifest.outputs["logits"]
        if self._read_only and "encoder" not in graphs:
            raise BackendError(f"{manifest.arch} is an encoder-decoder and its engines lack the encoder; rebuild them")
        fills = manifest.encoder["fills"] if manifest.encoder else {}
        for kind, graph in graphs.items():
            if kind == "encoder":
                want = {*manifest.encoder["inputs"].values(), *fills.values()}
                typed = {fills[s.input]: s for s in self._read_only}
            else:
                want = {self._tokens_name, self._logits_name, *(s.input for s in self._specs)}
                want |= {s.output for s in self._specs if s.output}
                typed = {s.input: s for s in self._specs}
            if set(graph.inputs) | set(graph.outputs) != want:
                raise BackendError(
                    f"the {kind} engine does not match edgemem.json: tensors "
                    f"{sorted(want ^ (set(graph.inputs) | set(graph.outputs)))} differ; rebuild it"
                )
            wrong = [name for name, s in typed.items() if graph.dtypes[name] != np.dtype(s.dtype)]
            if wrong:
                raise BackendError(
                    f"the {kind} engine's state {', '.join(wrong)} has not edgemem.json's dtype; rebuild it"
                )
        step = graphs["step"]
        self.logits_dtype = step.dtypes[self._logits_name]
        self._token_dtype = step.dtypes[self._tokens_name]
        self._shared = engines.in_place(info, [k for k in graphs if k != "encoder"])
        self._plans = [binding_plan(self._specs, self._shared, side) for side in (0, 1)]
        self._max_tokens = engines.max_tokens(info, "prefill", self._tokens_name) if self.has_prefill else 1
        engines.check_profile(info, "step", io_shapes(manifest, 1, 1, 1 if self._read_only else 0))
        self._keep: tuple = ()  # what the graphs must not outlive (TensorRT's runtime, logger, plugin library)

    @classmethod
    def _open(
        cls,
        directory: Path,
        manifest: Manifest,
        target: str | None,
        threads: int | None,
        chunk_size: int,
        *,
        engines_dir: str | Path | None,
        plugins: str | Path | None,
    ) -> TrtEngine:
        """DIR's engines (DIR/engines, or `engines_dir`) with the plugin library (`plugins` or $EDGEMEM_TRT_PLUGINS)."""
        if target not in (None, "trt"):
            raise BackendError(f"backend 'trt' runs the engines built from the trt target, not {target!r}")
        if threads is not None:
            raise ConfigError(
                named(
                    "threads is an onnxruntime setting; backend 'trt' runs on the GPU",
                    "--threads is an onnxruntime setting; --backend trt runs on the GPU",
                )
            )
        check_model(manifest, directory)
        folder, info = engines.read(directory, manifest, engines_dir)
        library = engines.plugin_library(plugins, info["plugins"])
        module = info["library"]["module"]
        trt = _import(module, f"{engines.LIBRARIES[module]}'s Python package (`import {module}`)")
        engines.check_library_version(info, trt.__version__)
        cudart = _import("cuda.bindings.runtime", "cuda-python (`import cuda.bindings.runtime`)")
        device = _Cuda(cudart)
        logger = trt.Logger(trt.Logger.WARNING)
        handle = engines.load_plugins(trt, library)
        runtime = trt.Runtime(logger)
        if runtime is None:
            raise BackendError("TensorRT could not create a runtime: no usable NVIDIA GPU or driver")
        graphs = open_graphs(trt, runtime, engines.files(folder, info), device.handle)
        engine = cls(directory, manifest, info, graphs, device, chunk_size)
        engine._keep = (runtime, logger, handle)
        return engine

    def _run(self, kind: str, shapes: Mapping[str, Sequence[int]], addresses: Mapping[str, int]) -> None:
        with self._lock:
            self._graphs[kind].run(shapes, addresses, self._device.handle)

    def _new(self, state: Mapping[str, Any], position: int, logits: np.ndarray | None) -> TrtStream:
        return TrtStream(self, state, position, logits)

    def _encoded_stream(self, input_ids: np.ndarray, global_attention_mask: np.ndarray) -> TrtStream:
        """The encoder engine writes the cross keys and values into a new stream's read-only buffers."""
        length, device, graph = input_ids.shape[1], self._device, self._graphs["encoder"]
        shapes = encoder_shapes(self.manifest, 1, length)
        engines.check_profile(self.info, "encoder", shapes)
        engines.check_profile(self.info, "step", io_shapes(self.manifest, 1, 1, length))
        encoded = _ReadOnly(self, 1, length)
        names = self.manifest.encoder["inputs"]
        feeds = {names["tokens"]: input_ids, names["global_attention_mask"]: global_attention_mask}
        fills = self.manifest.encoder["fills"]
        addresses = {fills[name]: pointer for name, pointer in encoded.pointers.items()}
        pointers: list[int] = []
        try:
            for name, array in feeds.items():
                array = np.ascontiguousarray(array, dtype=graph.dtypes[name])
                pointers.append(device.alloc(array.nbytes))
                device.upload(pointers[-1], array)
                addresses[name] = pointers[-1]
            self._run("encoder", shapes, addresses)
            device.synchronize()  # before the inputs are freed
        finally:
            device.free(pointers)
        return TrtStream(self, {**self._initial, **dict.fromkeys(encoded.pointers, encoded)}, 0, None)

    def _new_slot(self, n: int) -> _TrtSlot:
        return _TrtSlot(self, n)

    def _check_batch(self, streams: Sequence[Stream], token_ids: Any) -> tuple[list[Stream], np.ndarray]:
        streams, tokens = super()._check_batch(streams, token_ids)
        encoded = streams[0]._input_length() if self._read_only else 0
        engines.check_profile(self.info, "step", io_shapes(self.manifest, len(streams), 1, encoded))
        return streams, tokens

    def _run_batch(self, slot: _TrtSlot, streams: list[Stream], tokens: np.ndarray) -> np.ndarray:
        n, buffers, device = len(streams), slot.buffers, self._device
        device.upload(buffers.ids, tokens.astype(self._token_dtype).reshape(n, 1))
        encoded = slot.encoded.length if slot.encoded else 0
        self._run("step", io_shapes(self.manifest, n, 1, encoded), slot.addresses[slot.side])
        logits = np.empty((n, 1, self.vocab_size), self.logits_dtype)
        device.download(logits, buffers.logits)
        return logits[:, 0]

    def __repr__(self) -> str:
        return f"TrtEngine({self.manifest.arch}, {self.directory}, in place: {len(self._shared)}/{len(self._specs)} states)"  # noqa: E501


class _Buffers:
    """Device buffers of `rows` streams, freed when `owner` is collected: per written state tensor one buffer
    (in place) or two (sides), token ids and logits; `addresses[side]`: every tensor of a run reading `side`
    but the read-only states (`_ReadOnly`)."""

    def __init__(self, engine: TrtEngine, rows: int, owner: object):
        specs, device = engine._fixed, engine._device
        counts = [buffer_count(s, engine._shared) for s in specs]
        self.row_bytes = {s.input: engine._initial[s.input].nbytes for s in specs}
        sizes = [rows * self.row_bytes[s.input] for s, c in zip(specs, counts) for _ in range(c)]
        sizes += [rows * engine._token_dtype.itemsize, rows * engine.vocab_size * engine.logits_dtype.itemsize]
        pointers = []
        try:
            for size in sizes:
                pointers.append(device.alloc(size))
        except BaseException:
            device.free(pointers)
            raise
        weakref.finalize(owner, device.free, pointers)
        it = iter(pointers)
        self.state = {s.input: [next(it) for _ in range(c)] for s, c in zip(specs, counts)}
        self.ids, self.logits = next(it), next(it)
        self.addresses = [
            {
                **{t: self.state[name][i] for t, (name, i) in plan.items() if name in self.state},
                engine._tokens_name: self.ids,
                engine._logits_name: self.logits,
            }
            for plan in engine._plans
        ]

    def pointer(self, name: str, side: int, row: int = 0) -> int:
        """Where row `row` of state `name` is when side `side` is current."""
        buffers = self.state[name]
        return buffers[side if len(buffers) == 2 else 0] + row * self.row_bytes[name]


class _ReadOnly:
    """Device buffers of the read-only states of `rows` streams encoded from inputs of `length` tokens (an
    encoder-decoder's cross keys and values), one per tensor, freed with the last holder: written once (by
    the encoder engine, or uploaded from a checkpoint), then bound as inputs only. Forks share it."""

    def __init__(self, engine: TrtEngine, rows: int, length: int):
        device = engine._device
        self.length = length
        self.shapes = {s.input: concrete_shape(s, 1, encoded=length) for s in engine._read_only}
        self.row_bytes = {
            s.input: int(np.prod(self.shapes[s.input])) * np.dtype(s.dtype).itemsize for s in engine._read_only
        }
        pointers: list[int] = []
        try:
            for size in self.row_bytes.values():
                pointers.append(device.alloc(rows * size))
        except BaseException:
            device.free(pointers)
            raise
        weakref.finalize(self, device.free, pointers)
        self.pointers = dict(zip(self.row_bytes, pointers))

    @classmethod
    def of(cls, engine: TrtEngine, state: Mapping[str, Any]) -> _ReadOnly:
        """The read-only states in `state`: a stream's `_ReadOnly` itself (a fork's), or arrays uploaded anew."""
        first = state[engine._read_only[0].input]
        if isinstance(first, _ReadOnly):
            return first
        lengths = {int(np.shape(state[s.input])[variable_dim(s)]) for s in engine._read_only}
        if len(lengths) != 1:
            raise StateFileError(
                f"the cross keys and values come from inputs of {', '.join(map(str, sorted(lengths)))} tokens; "
                "a stream's are all of one input"
            )
        length = lengths.pop()
        engines.check_profile(engine.info, "step", io_shapes(engine.manifest, 1, 1, length))
        encoded = cls(engine, 1, length)
        for spec in engine._read_only:
            engine._device.upload(encoded.pointers[spec.input], np.ascontiguousarray(state[spec.input], spec.dtype))
        return encoded


class _TrtSlot(BatchSlot):
    """[n, ...] device buffers of the streams' binding plan; rows move by device-to-device copies. The
    members' read-only states are copied in once, when the slot takes them (`_gather`), never given back."""

    def __init__(self, engine: TrtEngine, n: int):
        super().__init__(engine, n)
        self.buffers = _Buffers(engine, n, self)
        self.encoded: _ReadOnly | None = None
        self.addresses = self.buffers.addresses

    def row(self, name: str, index: int) -> np.ndarray:
        array = np.empty_like(self.engine._initial[name])
        self.engine._device.download(array, self.buffers.pointer(name, self.side, index))
        return array

    def _gather(self, streams: list[TrtStream]) -> None:
        device = self.engine._device
        for name, size in self.buffers.row_bytes.items():
            for i, s in enumerate(streams):
                device.copy(self.buffers.pointer(name, self.side, i), s._buffers.pointer(name, s._side), size)
        if self.engine._read_only:
            length = streams[0]._encoded.length
            if self.encoded is None or self.encoded.length != length:
                self.encoded = _ReadOnly(self.engine, self.n, length)
            for name, size in self.encoded.row_bytes.items():
                for i, s in enumerate(streams):
                    device.copy(self.encoded.pointers[name] + i * size, s._encoded.pointers[name], size)
            self.addresses = [{**a, **self.encoded.pointers} for a in self.buffers.addresses]

    def _restore(self, stream: TrtStream, index: int) -> None:
        for name, size in self.buffers.row_bytes.items():
            self.engine._device.copy(
                stream._buffers.pointer(name, stream._side), self.buffers.pointer(name, self.side, index), size
            )


class TrtStream(Stream):
    """A stream whose state is resident on the GPU (see the module docstring)."""

    def __init__(self, engine: TrtEngine, state: Mapping[str, Any], position: int, logits: np.ndarray | None):
        super().__init__(engine)
        self._buffers = _Buffers(engine, 1, self)
        self._encoded: _ReadOnly | None = None  # an encoder-decoder's cross keys and values
        self._ids = np.zeros((1, 1), engine._token_dtype)
        self._logits_view = np.zeros((1, 1, engine.vocab_size), engine.logits_dtype)
        self._assign(state, position, logits)

    def _assign(self, state: Mapping[str, Any], position: int, logits: np.ndarray | None) -> None:
        engine = self._engine
        if engine._read_only:
            self._encoded = _ReadOnly.of(engine, state)
            self._addresses = [{**a, **self._encoded.pointers} for a in self._buffers.addresses]
        else:
            self._addresses = self._buffers.addresses
        self._step_shapes = io_shapes(engine.manifest, 1, 1, self._encoded.length if self._encoded else 0)
        super()._assign(state, position, logits)

    def _own(self, name: str) -> np.ndarray:
        """A host copy."""
        if self._encoded is not None and name in self._encoded.pointers:
            array = np.empty(self._encoded.shapes[name], self._engine._initial[name].dtype)
            self._engine._device.download(array, self._encoded.pointers[name])
            return array
        array = np.empty_like(self._engine._initial[name])
        self._engine._device.download(array, self._buffers.pointer(name, self._side))
        return array

    def _read(self, name: str) -> np.ndarray:
        if self._encoded is not None and name in self._encoded.pointers:
            return self._own(name)  # the stream's own, whether or not a batch slot holds a copy
        return super()._read(name)

    def _share(self, name: str) -> _ReadOnly:
        return self._encoded

    def _input_length(self) -> int:
        return self._encoded.length

    @property
    def state_bytes(self) -> int:
        return self._engine._fixed_bytes + (sum(self._encoded.row_bytes.values()) if self._encoded else 0)

    def _write(self, name: str, value: np.ndarray) -> None:
        dtype = self._engine._initial[name].dtype
        self._engine._device.upload(self._buffers.pointer(name, self._side), np.ascontiguousarray(value, dtype=dtype))

    def _run_step(self, token: int) -> None:
        engine, device = self._engine, self._engine._device
        self._ids[0, 0] = token
        device.upload(self._buffers.ids, self._ids)
        engine._run("step", self._step_shapes, self._addresses[self._side])
        device.download(self._logits_view, self._buffers.logits)

    def _prefill_chunk(self, ids: np.ndarray, last_only: bool) -> np.ndarray:
        """One run of the prefill engine (`ids` fits its profile: see `Stream.prefill`)."""
        engine, device = self._engine, self._engine._device
        nbytes = ids.size * engine.vocab_size * np.dtype(engine.logits_dtype).itemsize  # the engine's [1, T, V]
        logits = np.empty((1, 1 if last_only else ids.size, engine.vocab_size), engine.logits_dtype)  # copied back
        tokens = ids.astype(engine._token_dtype).reshape(1, -1)
        pointers: list[int] = []
        try:
            pointers.append(device.alloc(tokens.nbytes))
            pointers.append(device.alloc(nbytes))
            device.upload(pointers[0], tokens)
            addresses = {
                **self._addresses[self._side],
                engine._tokens_name: pointers[0],
                engine._logits_name: pointers[1],
            }
            encoded = self._encoded.length if self._encoded else 0
            engine._run("prefill", io_shapes(engine.manifest, 1, ids.size, encoded), addresses)
            device.download(logits, pointers[1] + nbytes - logits.nbytes)  # the last rows
        finally:
            device.free(pointers)
        return logits[0]
