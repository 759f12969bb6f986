"""The TensorRT backend (`edgemem.runtime.trt`) and what `edgemem build` records for it (engines.json).

Without TensorRT and a GPU: the checks made before TensorRT is touched (engines directory,
engines.json against the export and the engine files, the plugin library), the binding plan
(which state tensors share one buffer, shapes per batch and block), and the stream logic itself
on a stand-in device — host memory addressed by integers, and "engines" that run the same export's
generic graphs in onnxruntime at the addresses the runtime binds — compared with the onnxruntime
engine. With TensorRT, cuda-python, a GPU and $EDGEMEM_TRT_PLUGINS: real engines, built and run.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from edgemem.errors import ConfigError, EdgememError
from edgemem.files import sha256
from edgemem.manifest import Manifest, StateSpec
from edgemem.manifest import load as load_manifest
from edgemem.runtime import BackendError, BatchError, Engine, engines
from edgemem.runtime import trt as trt_runtime
from edgemem.runtime.engines import ENGINES_JSON
from edgemem.runtime.ort import ORT_TYPES
from edgemem.trt_build import (
    ENCODER_ENGINE,
    ENGINE,
    STEP_SEQUENCE,
    build_engines,
    dim_names,
    in_place_states,
    max_encoded,
    profile,
)

RECURRENT = "past_key_values.0.recurrent_state"
CONV = "past_key_values.0.conv_state"

_EXPORT = textwrap.dedent("""
    import sys
    from edgemem.export import export
    from edgemem.models import build
    export(build("gated-deltanet", seed=0, d_model=32, mlp_hidden=32, n_layers=1), sys.argv[1],
           targets=["generic", "trt"], extra_config={"seed": 0})
""")


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> Path:
    """A small gated DeltaNet (recurrent_state: plugin, in place; conv_state: Concat+Slice, ping-pong)."""
    out = tmp_path_factory.mktemp("trt-runtime") / "gated-deltanet"
    subprocess.run([sys.executable, "-c", _EXPORT, str(out)], check=True, capture_output=True)
    return out


TENSORRT = engines.Toolkit("tensorrt", "10.13.0")
RTX = engines.Toolkit("tensorrt_rtx", "1.7.1.116", ["SM86", "SM120"])


def _fake_engines(
    export: Path, folder: Path, max_batch: int = 4, max_sequence: int = 5, toolkit: engines.Toolkit = TENSORRT
) -> Path:
    """engines.json as `edgemem build` writes it (one engine from the prefill graph, a profile per graph; an
    encoder-decoder's encoder engine apart), over placeholder engine files and a placeholder plugin library."""
    folder.mkdir(parents=True, exist_ok=True)
    manifest = load_manifest(export)
    library = folder / "libedgemem_trt_plugins.so"
    library.write_bytes(b"placeholder plugin library")
    encoded = max_encoded(manifest)
    model = onnx.load(str(export / "trt" / "prefill.onnx"))
    path = folder / ENGINE
    path.write_bytes(b"placeholder engine")
    entries = {
        kind: engines.entry(
            path,
            index,
            profile(dim_names(model), max_batch, max_sequence, STEP_SEQUENCE if kind == "step" else None, encoded),
            in_place_states(model, manifest),
            _plugins(model),
        )
        for index, kind in enumerate(("step", "prefill"))
    }
    if "encoder" in manifest.graphs_of("trt"):  # an engine of its own, one profile
        model = onnx.load(str(export / "trt" / "encoder.onnx"))
        path = folder / ENCODER_ENGINE
        path.write_bytes(b"placeholder encoder engine")
        shapes = profile(dim_names(model), max_batch, max_sequence, max_encoded=encoded)
        entries["encoder"] = engines.entry(path, 0, shapes, [], _plugins(model))
    engines.write(folder, manifest, toolkit, library, max_batch, max_sequence, entries)
    return library


def _plugins(model: onnx.ModelProto) -> list[dict[str, str]]:
    return [
        {"op": n.op_type, "namespace": "edgemem", "version": "1"} for n in model.graph.node if n.domain == "edgemem"
    ]


def _separate_engines(export: Path, folder: Path) -> None:
    """Rewrite engines.json of `_fake_engines` as edgemem-engines/2 wrote it: a step and a prefill engine."""
    info = json.loads((folder / ENGINES_JSON).read_text())
    info["format"] = "edgemem-engines/2"
    del info["shared"]
    for kind, record in info["engines"].items():
        (folder / f"{kind}.engine").write_bytes(f"placeholder {kind} engine".encode())
        del record["profile_index"]
        record.update(file=f"{kind}.engine", sha256=sha256(folder / f"{kind}.engine"))
        model = onnx.load(str(export / "trt" / f"{kind}.onnx"))
        record["profile"] = profile(dim_names(model), info["max_batch"], info["max_sequence"])
    (folder / ENGINE).unlink()
    (folder / ENGINES_JSON).write_text(json.dumps(info))


# ---------------------------------------------------------------------- what the build records
def test_in_place_only_for_state_a_plugin_alone_reads_and_writes(export_dir):
    manifest = load_manifest(export_dir)
    for kind in ("step", "prefill"):
        assert in_place_states(onnx.load(str(export_dir / "trt" / f"{kind}.onnx")), manifest) == [RECURRENT]
    # a state that another node also reads (Titans' position: Unsqueeze, Reshape) is not updated in place
    specs = [
        StateSpec("past.a", "present.a", ["batch", 2], "float32", "0", "memory.0", "zeros"),
        StateSpec("past.p", "present.p", ["batch"], "int64", "0", "position", "zeros"),
    ]
    nodes = [
        helper.make_node("NeuralMemory", ["x", "past.a", "past.p"], ["y", "present.a", "present.p"], domain="edgemem"),
        helper.make_node("Shape", ["past.a"], ["s"]),  # dims only: no reader
        helper.make_node("Unsqueeze", ["past.p", "s"], ["u"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("x", "past.a", "past.p")],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "u", "present.a", "present.p")],
    )
    manifest = Manifest("custom", {"vocab_size": 4}, 20, ["trt"], specs, {"step": True})
    assert in_place_states(helper.make_model(graph), manifest) == ["past.a"]


def test_profile_ranges():
    dims = {"input_ids": ["batch", "sequence"], "past": ["batch", 4, 8], "fixed": [1, 4]}
    assert profile(dims, 8, 100) == {
        "input_ids": [[1, 1], [8, 64], [8, 100]],
        "past": [[1, 4, 8], [8, 4, 8], [8, 4, 8]],
    }
    # max_batch 1: a step graph's dims all collapse, yet its symbolic inputs still need their range (or nothing builds)
    assert profile({"input_ids": ["batch", 1], "fixed": [1, 4]}, 1, 100) == {"input_ids": [[1, 1], [1, 1], [1, 1]]}
    # the step profile of the one engine: the prefill graph's dims, sequence 1..2 optimised for 1
    assert profile(dims, 8, 100, STEP_SEQUENCE) == {
        "input_ids": [[1, 1], [8, 1], [8, 2]],
        "past": [[1, 4, 8], [8, 4, 8], [8, 4, 8]],
    }


def test_fp16_needs_an_fp16_export(export_dir):
    with pytest.raises(EdgememError, match=r"fp32 export.*strongly typed.*--dtype fp16"):
        build_engines(export_dir, fp16=True, plugins="/nonexistent.so")


# ---------------------------------------------------------------------- the binding plan
def test_binding_plan_aliases_in_place_state_and_ping_pongs_the_rest():
    specs = [
        StateSpec(
            RECURRENT, "present.0.recurrent_state", ["batch", 4, 8, 8], "float32", "0", "recurrent_state", "zeros"
        ),
        StateSpec(CONV, "present.0.conv_state", ["batch", 96, 3], "float32", "0", "conv_state", "zeros"),
    ]
    shared = {RECURRENT}
    assert [trt_runtime.buffer_count(s, shared) for s in specs] == [1, 2]
    for side in (0, 1):
        plan = trt_runtime.binding_plan(specs, shared, side)
        assert plan[RECURRENT] == plan["present.0.recurrent_state"] == (RECURRENT, 0)
        assert plan[CONV] == (CONV, side) and plan["present.0.conv_state"] == (CONV, 1 - side)
    info = {"engines": {"step": {"in_place": [RECURRENT, CONV]}, "prefill": {"in_place": [RECURRENT]}}}
    assert engines.in_place(info, ["step"]) == {RECURRENT, CONV}
    assert engines.in_place(info, ["step", "prefill"]) == {RECURRENT}  # a stream's buffers serve both engines


def test_binding_plan_binds_read_only_state_as_input_only():
    """An encoder-decoder's cross keys (no output: filled by the encoder) have one buffer, bound as the input of
    every run on both sides and never as an output; their shape follows the stream's input length."""
    cross = StateSpec("past.0.cross_key", "", ["batch", 2, "encoder_sequence", 8], "float32", "0", "cross_key", "zeros")
    key = StateSpec("past.0.key", "present.0.key", ["batch", 2, 16, 8], "float32", "0", "key", "zeros")
    assert [trt_runtime.buffer_count(s, set()) for s in (cross, key)] == [1, 2]
    for side in (0, 1):
        plan = trt_runtime.binding_plan([cross, key], set(), side)
        assert plan == {
            "past.0.cross_key": ("past.0.cross_key", 0),
            "past.0.key": ("past.0.key", side),
            "present.0.key": ("past.0.key", 1 - side),
        }
    manifest = Manifest("led", {"vocab_size": 4}, 20, ["trt"], [cross, key], {"step": True})
    shapes = trt_runtime.io_shapes(manifest, 3, 1, encoded=9)
    assert shapes["past.0.cross_key"] == [3, 2, 9, 8] and "" not in shapes and shapes["present.0.key"] == [3, 2, 16, 8]
    assert profile({"past.0.cross_key": ["batch", 2, "encoder_sequence", 8]}, 2, 16, max_encoded=100) == {
        "past.0.cross_key": [[1, 2, 1, 8], [2, 2, 64, 8], [2, 2, 100, 8]]
    }


def test_shapes_and_profile_limits(export_dir, tmp_path):
    manifest = load_manifest(export_dir)
    shapes = trt_runtime.io_shapes(manifest, 3, 7)
    assert shapes["input_ids"] == [3, 7] and shapes["logits"] == [3, 7, manifest.vocab_size]
    assert shapes[RECURRENT] == shapes["present.0.recurrent_state"] == [3, 4, 8, 8]
    assert shapes[CONV] == [3, 96, 3]
    _fake_engines(export_dir, tmp_path / "engines", max_batch=4, max_sequence=5)
    info = json.loads((tmp_path / "engines" / ENGINES_JSON).read_text())
    engines.check_profile(info, "prefill", trt_runtime.io_shapes(manifest, 4, 5))
    assert engines.max_tokens(info, "prefill", "input_ids") == 5
    assert engines.max_tokens(info, "step", "input_ids") == STEP_SEQUENCE[2] == 2  # the step profile: 1..2, opt 1
    with pytest.raises(
        BackendError,
        match=r"step engine takes input_ids from \[1, 1\] to \[4, 2\], this run needs \[5, 1\].*--max-batch 4",
    ):
        engines.check_profile(info, "step", trt_runtime.io_shapes(manifest, 5, 1))


# ---------------------------------------------------------------------- errors before TensorRT
def test_load_says_what_is_missing(export_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("EDGEMEM_TRT_PLUGINS", raising=False)
    export = tmp_path / "export"
    shutil.copytree(export_dir, export)
    with pytest.raises(BackendError, match=r"engines: no TensorRT engines; build them with `edgemem build"):
        Engine.load(export, backend="trt")
    library = _fake_engines(export, export / "engines")
    with pytest.raises(ConfigError, match="threads is an onnxruntime setting"):
        Engine.load(export, backend="trt", threads=2)
    with pytest.raises(BackendError, match="runs the engines built from the trt target, not 'ort'"):
        Engine.load(export, backend="trt", target="ort")
    with pytest.raises(EdgememError, match="engines= and plugins= are for backend 'trt'"):
        Engine.load(export, plugins=library)
    with pytest.raises(BackendError, match=r"no plugin library: pass plugins=.*EDGEMEM_TRT_PLUGINS"):
        Engine.load(export, backend="trt")
    with pytest.raises(BackendError, match=r"plugin library .*missing.so does not exist"):
        Engine.load(export, backend="trt", plugins=tmp_path / "missing.so")
    other = tmp_path / "other.so"
    other.write_bytes(b"another build")
    with pytest.raises(BackendError, match="is not the one the engines were built with"):
        Engine.load(export, backend="trt", plugins=other)
    monkeypatch.setenv("EDGEMEM_TRT_PLUGINS", str(library))
    if importlib.util.find_spec("tensorrt") is None:  # every check passed: TensorRT itself is what is missing
        with pytest.raises(
            BackendError, match=r"needs TensorRT's Python package.*pip install 'edgemem-toolkit\[gpu\]'"
        ):
            Engine.load(export, backend="trt")
    (export / "engines" / ENGINE).write_bytes(b"changed")
    with pytest.raises(BackendError, match=r"model.engine does not match its sha256 in engines.json"):
        Engine.load(export, backend="trt")
    (export / "engines" / ENGINE).unlink()
    with pytest.raises(BackendError, match="step engine model.engine listed in engines.json is missing"):
        Engine.load(export, backend="trt")
    (export / "engines" / ENGINES_JSON).write_text("{")
    with pytest.raises(BackendError, match="is not a valid engines.json"):
        Engine.load(export, backend="trt")
    (export / "engines" / ENGINES_JSON).unlink()
    with pytest.raises(BackendError, match="has no engines.json"):
        Engine.load(export, backend="trt")


def test_engines_of_another_export_are_refused(export_dir, tmp_path):
    _fake_engines(export_dir, tmp_path / "engines")
    other = tmp_path / "other"
    shutil.copytree(export_dir, other)
    manifest = json.loads((other / "edgemem.json").read_text())
    manifest["files"]["extra.bin"] = "0" * 64  # another set of files: another identity
    (other / "edgemem.json").write_text(json.dumps(manifest))
    with pytest.raises(BackendError, match=r"engines built from another export \(arch gated-deltanet.*rebuild"):
        Engine.load(other, backend="trt", engines=tmp_path / "engines", check_files=False)


def test_models_the_backend_cannot_run():
    growing = StateSpec(
        "past_key_values.0.key", "present.0.key", ["batch", 2, "past_sequence", 8], "float32", "0", "key", "zeros"
    )
    manifest = Manifest("softmax", {"vocab_size": 4}, 20, ["trt"], [growing], {"step": True, "prefill": True})
    with pytest.raises(BackendError, match=r"state grows .*use backend 'ort'"):
        trt_runtime.check_model(manifest, Path("x"))
    manifest.targets = ["ort"]
    with pytest.raises(BackendError, match="has no trt target.*--target trt"):
        trt_runtime.check_model(manifest, Path("x"))


def test_engines_load_into_the_library_that_built_them(export_dir, tmp_path, monkeypatch):
    """engines.json's "library" picks the module the backend imports (tensorrt or tensorrt_rtx) and its version
    must match; stand-in modules make this independent of what is installed."""
    export = tmp_path / "export"
    shutil.copytree(export_dir, export)
    library = _fake_engines(export, export / "engines", toolkit=RTX)
    info = json.loads((export / "engines" / ENGINES_JSON).read_text())
    assert info["library"] == {
        "module": "tensorrt_rtx",
        "version": "1.7.1.116",
        "compute_capabilities": ["SM86", "SM120"],
    }
    assert [p["op"] for p in info["engines"]["step"]["plugins"]] == ["LinearAttention"]
    monkeypatch.setitem(sys.modules, "tensorrt_rtx", None)  # not importable
    with pytest.raises(
        BackendError, match=r"needs TensorRT for RTX's Python package \(`import tensorrt_rtx`\).*\[rtx\]"
    ):
        Engine.load(export, backend="trt", plugins=library)
    rtx = types.ModuleType("tensorrt_rtx")
    rtx.__version__ = "1.8.0.1"
    monkeypatch.setitem(sys.modules, "tensorrt_rtx", rtx)
    with pytest.raises(
        BackendError,
        match=r"built by TensorRT for RTX 1.7.1.116, this is TensorRT for RTX 1.8.0.1; rebuild them with `edgemem build --rtx`",  # noqa: E501
    ):
        Engine.load(export, backend="trt", plugins=library)
    library = _fake_engines(export, export / "engines", toolkit=TENSORRT)  # the same export, TensorRT engines
    trt = types.ModuleType("tensorrt")
    trt.__version__ = "10.3.0"
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    with pytest.raises(
        BackendError, match=r"built by TensorRT 10.13.0, this is TensorRT 10.3.0; rebuild them with `edgemem build`"
    ):
        Engine.load(export, backend="trt", plugins=library)
    info = json.loads((export / "engines" / ENGINES_JSON).read_text())
    info["library"]["module"] = "tensorrt_llm"
    (export / "engines" / ENGINES_JSON).write_text(json.dumps(info))
    with pytest.raises(
        BackendError, match=r"not a valid engines.json \('library' needs a module \(tensorrt or tensorrt_rtx"
    ):
        Engine.load(export, backend="trt", plugins=library)


def test_build_refuses_bad_targets(export_dir, tmp_path):
    from click.testing import CliRunner

    from edgemem.cli import main

    library = tmp_path / "lib.so"
    library.write_bytes(b"placeholder")
    runner = CliRunner()
    result = runner.invoke(main, ["build", str(export_dir), "--plugins", str(library), "--sm", "86"])
    assert result.exit_code == 2 and "--sm picks TensorRT for RTX's target GPUs: add --rtx" in result.output
    result = runner.invoke(main, ["build", str(export_dir), "--rtx", "--sm", "8.6"])
    assert result.exit_code == 2 and "expected compute capabilities as comma-separated numbers" in result.output
    if importlib.util.find_spec("tensorrt_rtx") is None:
        result = runner.invoke(main, ["build", str(export_dir), "--plugins", str(library), "--rtx"])
        assert result.exit_code == 2 and "TensorRT for RTX's Python package is not installed" in result.output
    else:  # 9.0 (H100) is not an RTX architecture
        result = runner.invoke(main, ["build", str(export_dir), "--plugins", str(library), "--rtx", "--sm", "86,90"])
        assert result.exit_code == 2 and "--sm 90: TensorRT for RTX" in result.output and "86,89,120" in result.output
    assert not (export_dir / "engines").exists()  # refused before anything was written


def test_verify_skips_the_trt_target_when_tensorrt_is_importable(export_dir, tmp_path, monkeypatch):
    """The bug: with `tensorrt` importable, verify raised instead of checking the other targets."""
    from click.testing import CliRunner

    from edgemem.cli import main
    from edgemem.export.verify import TRT_SKIPPED, verify

    (tmp_path / "tensorrt").mkdir()
    (tmp_path / "tensorrt" / "__init__.py").write_text('__version__ = "10.13.0"\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    assert importlib.util.find_spec("tensorrt") is not None
    checks, skipped = verify(export_dir, threads=1, steps=2)
    assert skipped == {"trt": TRT_SKIPPED}
    assert {c.target for c in checks} == {"generic"} and all(c.ok for c in checks), checks
    result = CliRunner().invoke(main, ["verify", str(export_dir), "--threads", "1"])
    assert result.exit_code == 0, result.output
    assert "trt: skipped (its graphs hold edgemem's TensorRT plugin nodes" in result.output


# ---------------------------------------------------------------------- the stream logic on a stand-in device
class HostDevice:
    """Device memory in host arrays addressed by integers, as cuda-python hands out pointers."""

    handle = 0

    def __init__(self):
        self.blocks: dict[int, np.ndarray] = {}
        self._next = 1 << 20
        self.copies = 0  # device-to-device copies

    def alloc(self, nbytes: int) -> int:
        pointer, self._next = self._next, self._next + ((nbytes + 255) // 256 + 1) * 256
        self.blocks[pointer] = np.zeros(nbytes, np.uint8)
        return pointer

    def free(self, pointers):
        for pointer in pointers:
            del self.blocks[pointer]

    def view(self, pointer: int, nbytes: int) -> np.ndarray:
        base = max(p for p in self.blocks if p <= pointer)
        assert pointer + nbytes <= base + self.blocks[base].size, "out of bounds"
        return self.blocks[base][pointer - base : pointer - base + nbytes]

    def upload(self, pointer, array):
        self.view(pointer, array.nbytes)[:] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)

    def download(self, array, pointer):
        array.reshape(-1).view(np.uint8)[:] = self.view(pointer, array.nbytes)

    def copy(self, dst, src, nbytes):
        self.copies += 1
        self.view(dst, nbytes)[:] = self.view(src, nbytes).copy()

    def synchronize(self):
        pass


class OrtGraph:
    """A stand-in engine: the export's generic graph in onnxruntime, reading and writing at bound addresses."""

    def __init__(self, path: Path, device: HostDevice):
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        self.session, self.device = ort.InferenceSession(str(path), options), device
        self.inputs = frozenset(i.name for i in self.session.get_inputs())
        self.outputs = frozenset(o.name for o in self.session.get_outputs())
        tensors = [*self.session.get_inputs(), *self.session.get_outputs()]
        self.dtypes = {t.name: np.dtype(ORT_TYPES[t.type]) for t in tensors}
        self.calls: list[dict[str, int]] = []

    def run(self, shapes, addresses, stream):
        def read(name):
            array = np.empty(shapes[name], self.dtypes[name])
            self.device.download(array, addresses[name])
            return array

        outputs = self.session.run(None, {n: read(n) for n in self.inputs})  # every input read before any write
        for output, value in zip(self.session.get_outputs(), outputs):
            assert list(value.shape) == list(shapes[output.name])
            self.device.upload(addresses[output.name], value)
        self.calls.append(dict(addresses))


@pytest.fixture(scope="module")
def stand_in(export_dir, tmp_path_factory):
    """A TrtEngine over the stand-in device, and the onnxruntime engine of the same export."""
    folder = tmp_path_factory.mktemp("engines")
    _fake_engines(export_dir, folder, max_batch=4, max_sequence=5)
    info = json.loads((folder / ENGINES_JSON).read_text())
    device = HostDevice()
    graphs = {kind: OrtGraph(export_dir / "generic" / f"{kind}.onnx", device) for kind in ("step", "prefill")}
    engine = trt_runtime.TrtEngine(export_dir, load_manifest(export_dir), info, graphs, device, chunk_size=512)
    return engine, Engine.load(export_dir, target="generic", threads=1), device


def test_rtx_engines_get_the_same_binding_plan(export_dir, tmp_path):
    """Engines of TensorRT for RTX (engines.json "library": tensorrt_rtx) bind state as TensorRT's do."""
    plans = {}
    for toolkit in (TENSORRT, RTX):
        folder = tmp_path / toolkit.module
        _fake_engines(export_dir, folder, toolkit=toolkit)
        device = HostDevice()
        graphs = {kind: OrtGraph(export_dir / "generic" / f"{kind}.onnx", device) for kind in ("step", "prefill")}
        engine = trt_runtime.TrtEngine(
            export_dir,
            load_manifest(export_dir),
            json.loads((folder / ENGINES_JSON).read_text()),
            graphs,
            device,
            chunk_size=512,
        )
        stream = engine.new_stream()
        stream.step(1)
        plans[toolkit.module] = (engine._shared, engine._plans, {k: len(v) for k, v in stream._buffers.state.items()})
    assert plans["tensorrt_rtx"] == plans["tensorrt"]
    assert plans["tensorrt_rtx"][0] == {RECURRENT} and plans["tensorrt_rtx"][2] == {RECURRENT: 1, CONV: 2}


class FakeEngine:
    """A deserialized engine as TensorRT's Python API shows it: the generic graph it was built from runs in
    onnxruntime at the bound addresses, for shapes inside the profile its context selected."""

    def __init__(self, graph: Path, profiles: dict[int, dict], device: HostDevice):
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        self.session, self.profiles, self.device = ort.InferenceSession(str(graph), options), profiles, device
        self.graph = graph.stem
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.names = self.inputs + [o.name for o in self.session.get_outputs()]
        tensors = [*self.session.get_inputs(), *self.session.get_outputs()]
        self.dtypes = {t.name: np.dtype(ORT_TYPES[t.type]) for t in tensors}
        self.num_io_tensors, self.num_optimization_profiles = len(self.names), len(profiles)
        self.contexts: list[FakeContext] = []

    def get_tensor_name(self, i: int) -> str:
        return self.names[i]

    def get_tensor_mode(self, name: str) -> str:
        return "input" if name in self.inputs else "output"

    def get_tensor_dtype(self, name: str) -> np.dtype:
        return self.dtypes[name]

    def create_execution_context(self, strategy: str) -> "FakeContext":
        self.contexts.append(FakeContext(self, strategy))
        return self.contexts[-1]


class FakeContext:
    def __init__(self, engine: FakeEngine, strategy: str):
        self.engine, self.strategy = engine, strategy
        self.profile: int | None = None
        self.shapes: dict[str, list[int]] = {}
        self.addresses: dict[str, int] = {}
        self.runs: list[list[int]] = []  # input_ids' shape per run

    def set_optimization_profile_async(self, index: int, stream: int) -> bool:
        self.profile, self.stream = index, stream
        return True

    def set_input_shape(self, name: str, shape: list[int]) -> bool:
        lo, _, hi = self.engine.profiles[self.profile].get(name, [shape] * 3)
        self.shapes[name] = shape
        return all(a <= s <= b for s, a, b in zip(shape, lo, hi))

    def set_tensor_address(self, name: str, pointer: int) -> bool:
        self.addresses[name] = pointer
        return True

    def execute_async_v3(self, stream: int) -> bool:
        device = self.engine.device
        feeds = {}
        for name in self.engine.inputs:
            feeds[name] = np.empty(self.shapes[name], self.engine.dtypes[name])
            device.download(feeds[name], self.addresses[name])
        outputs = self.engine.session.run(None, feeds)  # every input read before any write
        for output, value in zip(self.engine.session.get_outputs(), outputs):
            device.upload(self.addresses[output.name], value)
        self.runs.append(self.shapes["input_ids"])
        return True


FAKE_TRT = types.SimpleNamespace(
    ExecutionContextAllocationStrategy=types.SimpleNamespace(ON_PROFILE_CHANGE="on profile change"),
    TensorIOMode=types.SimpleNamespace(INPUT="input"),
    nptype=np.dtype,
)


class FakeRuntime:
    """`deserialize_cuda_engine` of the engine files engines.json lists: an engine built from the prefill graph
    where it serves the prefill, with the profiles engines.json gives it."""

    def __init__(self, export: Path, folder: Path, info: dict, device: HostDevice):
        self.export, self.folder, self.info, self.device = export, folder, info, device
        self.engines: list[FakeEngine] = []

    def deserialize_cuda_engine(self, blob: bytes) -> FakeEngine:
        served = {k: r for k, r in self.info["engines"].items() if (self.folder / r["file"]).read_bytes() == blob}
        graph = "prefill" if "prefill" in served else "step"
        profiles = {r["profile_index"]: r["profile"] for r in served.values()}
        self.engines.append(FakeEngine(self.export / "generic" / f"{graph}.onnx", profiles, self.device))
        return self.engines[-1]


def test_one_engine_serves_steps_and_prefills_through_its_profiles(export_dir, tmp_path):
    """engines.json as `edgemem build` writes it: the engine is deserialized once, the step and the prefill
    each get a context of it on their own profile (set once, on the engine's stream; scratch allocated per
    profile), steps and step batches run on profile 0 at one token, prefills on profile 1 in blocks, and
    the streams equal the onnxruntime engine's, the prefill graph computing every step."""
    _fake_engines(export_dir, tmp_path, max_batch=4, max_sequence=5)
    manifest = load_manifest(export_dir)
    folder, info = engines.read(export_dir, manifest, tmp_path)
    assert info["shared"] == "profiles"
    assert engines.files(folder, info) == {folder / ENGINE: {"step": 0, "prefill": 1}}
    device = HostDevice()
    runtime = FakeRuntime(export_dir, folder, info, device)
    graphs = trt_runtime.open_graphs(FAKE_TRT, runtime, engines.files(folder, info), stream=7)
    (shared,) = runtime.engines
    assert shared.graph == "prefill" and graphs["step"].engine is graphs["prefill"].engine is shared
    contexts = {kind: graph.context for kind, graph in graphs.items()}
    assert {k: (c.profile, c.stream, c.strategy) for k, c in contexts.items()} == {
        "step": (0, 7, "on profile change"),
        "prefill": (1, 7, "on profile change"),
    }
    with pytest.raises(BackendError, match=r"could not select optimisation profile 2 of .*model.engine for the pre"):
        trt_runtime._TrtGraph(FAKE_TRT, shared, folder / ENGINE, "prefill", 2, 7)  # the engine has 2 profiles
    engine = trt_runtime.TrtEngine(export_dir, manifest, info, graphs, device, chunk_size=512)
    reference = Engine.load(export_dir, target="generic", threads=1)
    ours, theirs = engine.new_stream(), reference.new_stream()
    prompt = bytes(range(60, 72))
    assert _close(ours.prefill(prompt), theirs.prefill(prompt))
    for token in (3, 4):
        assert _close(ours.step(token), theirs.step(token))
    other = ours.fork()
    assert _close(engine.step_batch([ours, other], [5, 5]), np.stack([theirs.step(5)] * 2))
    assert contexts["prefill"].runs == [[1, 5], [1, 5], [1, 2]]
    assert contexts["step"].runs == [[1, 1], [1, 1], [2, 1]]


def test_engines_of_format_2_still_load_as_two_engines(export_dir, tmp_path):
    """engines.json from before one engine served both graphs (edgemem-engines/2: a step and a prefill engine):
    read as "shared": "none", each engine deserialized, one context each on its only profile."""
    _fake_engines(export_dir, tmp_path, max_batch=4, max_sequence=5)
    _separate_engines(export_dir, tmp_path)
    manifest = load_manifest(export_dir)
    folder, info = engines.read(export_dir, manifest, tmp_path)
    assert info["shared"] == "none"
    assert engines.files(folder, info) == {
        folder / "step.engine": {"step": 0},
        folder / "prefill.engine": {"prefill": 0},
    }
    device = HostDevice()
    runtime = FakeRuntime(export_dir, folder, info, device)
    graphs = trt_runtime.open_graphs(FAKE_TRT, runtime, engines.files(folder, info), stream=0)
    assert [e.graph for e in runtime.engines] == ["step", "prefill"]
    assert graphs["step"].engine is not graphs["prefill"].engine
    engine = trt_runtime.TrtEngine(export_dir, manifest, info, graphs, device, chunk_size=512)
    reference = Engine.load(export_dir, target="generic", threads=1)
    ours, theirs = engine.new_stream(), reference.new_stream()
    assert _close(ours.prefill(b"abcdefg"), theirs.prefill(b"abcdefg"))
    assert _close(ours.step(1), theirs.step(1))


def test_engines_json_names_one_profile_per_graph_of_an_engine(export_dir, tmp_path):
    _fake_engines(export_dir, tmp_path)
    path = tmp_path / ENGINES_JSON
    good = json.loads(path.read_text())
    cases = [
        (lambda i: i["engines"]["prefill"].update(profile_index=0), "graphs that model.engine serves need distinct"),
        (lambda i: i["engines"]["prefill"].pop("profile_index"), "engine 'prefill' needs a profile_index"),
        (lambda i: i.update(shared="none"), "'shared' is 'none' for 1 engine file"),
        (
            lambda i: i["engines"].update(encoder={**i["engines"]["step"], "profile_index": 2}),
            "the encoder's engine model.engine serves other graphs too",
        ),
        (lambda i: i.update(format="edgemem-engines/1"), "format 'edgemem-engines/1', expected 'edgemem-engines/3'"),
    ]
    for change, message in cases:
        info = json.loads(json.dumps(good))
        change(info)
        path.write_text(json.dumps(info))
        with pytest.raises(BackendError, match=rf"not a valid engines.json \(.*{message}.*rebuild with"):
            engines.read(export_dir, load_manifest(export_dir), tmp_path)


def _close(a, b, tol=1e-5):
    return np.abs(np.asarray(a) - np.asarray(b)).max() <= tol * max(1.0, np.abs(np.asarray(b)).max())


def test_stream_binds_one_buffer_in_place_and_two_for_conv_state(stand_in):
    engine, _, device = stand_in
    stream = engine.new_stream()
    assert len(stream._buffers.state[RECURRENT]) == 1 and len(stream._buffers.state[CONV]) == 2
    step = engine._graphs["step"]
    before = len(step.calls)
    for token in (1, 2, 3):
        stream.step(token)
    calls = step.calls[before:]
    assert all(c[RECURRENT] == c["present.0.recurrent_state"] == stream._buffers.state[RECURRENT][0] for c in calls)
    assert [c[CONV] for c in calls] == [stream._buffers.state[CONV][i] for i in (0, 1, 0)]
    assert [c["present.0.conv_state"] for c in calls] == [stream._buffers.state[CONV][i] for i in (1, 0, 1)]
    blocks = len(device.blocks)
    stream.step(4)
    assert len(device.blocks) == blocks  # no allocation per step
    del stream, calls
    assert len(device.blocks) == blocks - 5  # 3 state buffers, token ids, logits freed with the stream


def test_stream_matches_the_onnxruntime_engine(stand_in, tmp_path):
    engine, reference, _ = stand_in
    prompt = bytes(range(40, 52))  # 12 tokens: prefill runs in blocks of the profile's 5
    ours, theirs = engine.new_stream(), reference.new_stream()
    assert _close(ours.prefill(prompt), theirs.prefill(prompt))
    last = engine.new_stream().prefill(prompt, all_logits=False)  # only the last row comes back from the device
    assert last.shape == (engine.vocab_size,) and _close(last, theirs.logits)
    for token in (7, 8, 9):
        assert _close(ours.step(token), theirs.step(token))
    assert ours.position == theirs.position == 15
    for name, value in theirs.state_dict().items():
        assert _close(ours.state_dict()[name], value)
    ours.save(tmp_path / "trt.safetensors")  # one checkpoint format for both backends
    restored = reference.load_stream(tmp_path / "trt.safetensors")
    assert _close(restored.step(5), engine.load_stream(tmp_path / "trt.safetensors").step(5))
    fork = ours.fork()
    assert _close(fork.step(3), ours.step(3))
    assert ours.generate(b"ab", max_new_tokens=6) == theirs.generate(b"ab", max_new_tokens=6)
    ours.reset()
    assert ours.position == 0 and ours.logits is None and not ours.state_dict()[RECURRENT].any()
    assert engine.generate(b"xy", max_new_tokens=5) == reference.generate(b"xy", max_new_tokens=5)
    assert engine.state_bytes() == reference.state_bytes() == ours.state_bytes


def test_step_batch_equals_single_steps(stand_in):
    engine, _, _ = stand_in
    streams = [engine.new_stream() for _ in range(3)]
    for i, s in enumerate(streams):
        s.prefill(bytes([65 + i] * (i + 1)))  # different positions
    singles = [s.fork() for s in streams]
    for tokens in ([1, 2, 3], [4, 5, 6]):
        batch = engine.step_batch(streams, tokens)
        assert _close(batch, np.stack([s.step(t) for s, t in zip(singles, tokens)]))
    for s, single in zip(streams, singles):
        assert s.position == single.position and _close(s.state_dict()[CONV], single.state_dict()[CONV])
    with pytest.raises(BackendError, match="--max-batch"):
        engine.step_batch([engine.new_stream() for _ in range(5)], [1] * 5)
    with pytest.raises(BatchError, match="more than once"):
        engine.step_batch([streams[0], streams[0]], [1, 2])


def test_batches_keep_state_on_the_device_and_mix_with_single_steps(stand_in):
    """The same streams batched again in the same order copy no state; streams stepped alone, regrouped,
    forked or reset in between take their state back first: each equals a twin only ever stepped alone."""
    engine, _, device = stand_in
    streams = [engine.new_stream() for _ in range(3)]
    for i, s in enumerate(streams):
        s.prefill(bytes([70 + i] * (i + 2)))
    twins = [s.fork() for s in streams]

    def check(got, who, tokens):
        assert _close(got, np.stack([twins[i].step(t) for i, t in zip(who, tokens)]))

    check(engine.step_batch(streams, [1, 2, 3]), [0, 1, 2], [1, 2, 3])
    copies = device.copies
    check(engine.step_batch(streams, [4, 5, 6]), [0, 1, 2], [4, 5, 6])
    assert device.copies == copies  # state stayed in the batch's buffers
    check(streams[1].step(7)[None], [1], [7])  # alone: its row comes back first
    check(engine.step_batch([streams[2], streams[0]], [8, 9]), [2, 0], [8, 9])  # another grouping, another size
    check(engine.step_batch(streams, [1, 1, 1]), [0, 1, 2], [1, 1, 1])
    original, streams[0] = streams[0], streams[0].fork()  # a fork of a row; the original goes elsewhere
    original.step(5)
    streams[2].reset()
    twins[2].reset()
    check(engine.step_batch(streams, [2, 3, 4]), [0, 1, 2], [2, 3, 4])
    for s, twin in zip(streams, twins):
        assert s.position == twin.position
        assert all(_close(s.state_dict()[name], value) for name, value in twin.state_dict().items())


# ---------------------------------------------------------------------- a real GPU
def _cuda_reason() -> str | None:
    if importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings") is None:
        return "cuda-python is not installed"
    from cuda.bindings import runtime as cudart

    err, count = cudart.cudaGetDeviceCount()
    if err != cudart.cudaError_t.cudaSuccess or count < 1:
        return "no NVIDIA GPU"
    return None


def _gpu_reason() -> str | None:
    if importlib.util.find_spec("tensorrt") is None:
        return "TensorRT's Python package is not installed"
    if not os.environ.get("EDGEMEM_TRT_PLUGINS"):
        return "EDGEMEM_TRT_PLUGINS does not name a plugin library built from plugins/"
    return _cuda_reason()


@pytest.mark.skipif(_cuda_reason() is not None, reason=f"needs cuda-python and a GPU: {_cuda_reason()}")
def test_state_on_a_real_cuda_device(export_dir, tmp_path):
    """The runtime's cuda-python calls (memory, copies, the stream) with stand-in engines: no TensorRT needed."""
    from cuda.bindings import runtime as cudart

    _fake_engines(export_dir, tmp_path, max_batch=4, max_sequence=5)
    device = trt_runtime._Cuda(cudart)
    graphs = {kind: OrtGraph(export_dir / "generic" / f"{kind}.onnx", device) for kind in ("step", "prefill")}
    engine = trt_runtime.TrtEngine(
        export_dir,
        load_manifest(export_dir),
        json.loads((tmp_path / ENGINES_JSON).read_text()),
        graphs,
        device,
        chunk_size=512,
    )
    reference = Engine.load(export_dir, target="generic", threads=1)
    ours, theirs = engine.new_stream(), reference.new_stream()
    assert _close(ours.prefill(b"hello world"), theirs.prefill(b"hello world"))
    for token in (1, 2, 3):
        assert _close(ours.step(token), theirs.step(token))
    other = ours.fork()
    assert _close(engine.step_batch([ours, other], [4, 4]), np.stack([theirs.step(4)] * 2))
    assert _close(ours.state_dict()[CONV], theirs.state_dict()[CONV])
    with pytest.raises(BackendError, match="CUDA cudaMalloc failed"):
        device.alloc(1 << 60)


@pytest.mark.skipif(
    _gpu_reason() is not None, reason=f"needs TensorRT, cuda-python, a GPU and the plugins: {_gpu_reason()}"
)
def test_real_engines_step_like_onnxruntime(export_dir, tmp_path):
    export = tmp_path / "export"
    shutil.copytree(export_dir, export)
    build_engines(export, max_batch=2, max_sequence=64)
    engine = Engine.load(export, backend="trt")
    reference = Engine.load(export, target="generic", threads=1)
    assert engine._graphs["step"].engine is engine._graphs["prefill"].engine  # one engine, two contexts
    ours, theirs = engine.new_stream(), reference.new_stream()
    assert len(ours._buffers.state[RECURRENT]) == 1  # state-in and state-out bound to one device buffer
    assert _close(ours.prefill(b"hello world"), theirs.prefill(b"hello world"), 1e-4)
    for token in range(20):
        assert _close(ours.step(token), theirs.step(token), 1e-4)
    assert _close(ours.state_dict()[RECURRENT], theirs.state_dict()[RECURRENT], 1e-4)
    assert _close(engine.step_batch([ours, engine.new_stream()], [1, 2])[0], theirs.step(1), 1e-4)
