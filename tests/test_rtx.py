"""TensorRT for RTX builds engines with edgemem's plugins ahead of time, on a machine without a GPU,
and `edgemem build --rtx` does so for an export, with engines.json.

Needs `tensorrt_rtx` (pip: tensorrt-rtx-cu13==1.7.1.116; the module skips without it), the
TensorRT 11.1 headers under ../shared/third_party/tensorrt (or `EDGEMEM_RTX_TENSORRT_ROOT`),
g++ and the CUDA toolkit (cmake + nvcc for edgemem's plugin library). Everything TensorRT runs
in a child process: a parser abort fails one test instead of the session.

Why TensorRT-RTX 1.7.1's ONNX parser aborted after creating an edgemem plugin
(`terminate called without an active exception`): to add any IPluginV3 layer it resolves a
private entry point with `dlopen("libtensorrt_rtx.so")` (the unversioned name) and
`dlsym("getPrivateApi_INTERNAL")`, inside a noexcept function. The wheel ships only
`libtensorrt_rtx.so.1`; dlopen fails, the parser throws "Handle to library is nullptr." and the
noexcept boundary turns it into std::terminate. Nothing of the plugin is involved: a minimal
identity plugin that shares no code with edgemem aborts the same way, and both import and build
once the name resolves. The workaround: a directory holding a `libtensorrt_rtx.so` symlink to
the wheel's `libtensorrt_rtx.so.1`, on LD_LIBRARY_PATH of the building process (ld.so reads it
at start-up, so a child process; dlopen then finds the already loaded library, not a copy).

LinearAttention: the parser first looks the node up in the plugin registry by (op type,
`plugin_version`, `plugin_namespace`); with edgemem's library loaded the trt target's nodes
become edgemem's plugin, and only without it does the built-in `importLinearAttention` take
the node (and fail on a machine without a GPU, its creator not being registered there).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from plugin_build import cmake_build
from plugin_build import run as _run

if importlib.util.find_spec("tensorrt_rtx") is None:
    pytest.skip("tensorrt_rtx is not installed (pip install tensorrt-rtx-cu13==1.7.1.116)", allow_module_level=True)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = ROOT / "plugins"
HEADERS = Path(
    os.environ.get("EDGEMEM_RTX_TENSORRT_ROOT") or ROOT.parent / "shared" / "third_party" / "tensorrt" / "v11.1"
)
OPS = {"LinearAttention", "NeuralMemory", "WindowAttention", "BandedAttention"}
ARCHS = ("deltanet", "gated-deltanet", "titans-mag", "ttt-linear", "longformer", "longformer-encoder")
SM = (86, 120)  # two RTX generations (Ampere, Blackwell), the engines' targets


def _cuda_home() -> Path | None:
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda", Path(os.path.realpath(nvcc)).parents[1]):
        if home and (Path(home) / "include" / "cuda_runtime_api.h").is_file():
            return Path(home)
    return None


@pytest.fixture(scope="module")
def headers() -> Path:
    if not (HEADERS / "include" / "NvInferRuntime.h").is_file():
        pytest.skip(f"no TensorRT 11.1 headers at {HEADERS} (../shared is absent; set EDGEMEM_RTX_TENSORRT_ROOT)")
    return HEADERS


@pytest.fixture(scope="module")
def name_fix(tmp_path_factory) -> dict[str, str]:
    """Environment for a child process in which dlopen("libtensorrt_rtx.so") finds the wheel's library."""
    spec = importlib.util.find_spec("tensorrt_rtx_libs")
    assert spec and spec.submodule_search_locations, "tensorrt_rtx_libs (the wheel's libraries) not found"
    real = Path(list(spec.submodule_search_locations)[0]) / "libtensorrt_rtx.so.1"
    assert real.is_file(), real
    shim = tmp_path_factory.mktemp("rtx_name")
    (shim / "libtensorrt_rtx.so").symlink_to(real)
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(shim), env.get("LD_LIBRARY_PATH")) if p)
    return env


@pytest.fixture(scope="module")
def identity_plugin(tmp_path_factory, headers) -> Path:
    """plugins/tests/identity_plugin.cpp: the smallest IPluginV3 library, no edgemem code."""
    cxx, cuda = shutil.which("g++") or shutil.which("c++"), _cuda_home()
    if not cxx or not cuda:
        pytest.skip(
            "g++ and the CUDA toolkit (cuda_runtime_api.h, libcudart_static) are needed for the identity plugin"
        )
    lib = tmp_path_factory.mktemp("identity") / "libidentity_plugin.so"
    _run(
        [
            cxx,
            "-std=c++17",
            "-O1",
            "-shared",
            "-fPIC",
            "-fvisibility=hidden",
            "-Wno-deprecated-declarations",
            f"-I{headers / 'include'}",
            f"-I{cuda / 'include'}",
            str(PLUGINS / "tests" / "identity_plugin.cpp"),
            f"-L{cuda / 'lib64'}",
            "-lcudart_static",
            "-ldl",
            "-lrt",
            "-lpthread",
            "-Wl,--no-undefined",
            "-o",
            str(lib),
        ]
    )
    return lib


@pytest.fixture(scope="module")
def edgemem_plugins(tmp_path_factory, headers) -> Path:
    """libedgemem_trt_plugins.so against the TensorRT 11.1 headers. An engine build runs no plugin kernel, so
    they are compiled for sm_75 alone, where the tensor-core ones compile empty (the cheapest build); their
    compile for SM is test_kernel_archs.py's."""
    if not shutil.which("cmake") or not (shutil.which("nvcc") or Path("/usr/local/cuda/bin/nvcc").exists()):
        pytest.skip("cmake and nvcc are needed to build libedgemem_trt_plugins.so")
    build = tmp_path_factory.mktemp("rtx_plugins")
    cmake_build(
        build,
        f"-DTensorRT_ROOT={headers}",
        "-DCMAKE_CUDA_ARCHITECTURES=75",
        targets=("edgemem_trt_plugins",),
    )
    return build / "libedgemem_trt_plugins.so"


# What TensorRT-RTX can tell about an engine without a GPU: its validity verdict (and that of a
# copy with a broken magic number) and the 64-byte header as observed (undocumented): b"vtrt", ...,
# u64 size at 16, u8 version at 24..27.
ENGINE_REPORT = textwrap.dedent(
    """
    import struct

    def engine_report(trt, logger, blob):
        runtime = trt.Runtime(logger)

        def validity(data):
            verdict, diagnostics = runtime.get_engine_validity(data)
            flags = trt.EngineInvalidityDiagnostics.__members__.items()
            return [verdict.name, [name for name, flag in flags if diagnostics & int(flag)]]

        return dict(engine_bytes=len(blob), header_bytes=runtime.engine_header_size, validity=validity(blob),
                    corrupt_validity=validity(b"\\0" + blob[1:]), magic=blob[:4].decode("latin-1"),
                    size_field=struct.unpack_from("<Q", blob, 16)[0],
                    version_field=".".join(str(b) for b in blob[24:28]), version=trt.__version__)
    """
)

# The child: plain tensorrt_rtx + onnx, no edgemem build code. Parses, lists the plugin layers,
# builds with one optimisation profile (batch 1..2, sequence 1..64, past_sequence 0..64) for
# the default compute capabilities, checks the engine without a GPU, prints one JSON line.
RTX_BUILD = ENGINE_REPORT + textwrap.dedent(
    """
    import json, sys, time
    import onnx
    import tensorrt_rtx as trt

    library, model_path, engine_path = sys.argv[1:4]
    logger = trt.Logger(trt.Logger.WARNING)
    if library != "-":
        assert trt.get_plugin_registry().load_library(library), library
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    start = time.perf_counter()
    parsed = parser.parse_from_file(model_path)
    report = dict(parsed=parsed, parse_s=time.perf_counter() - start, version=trt.__version__,
                  errors=[str(parser.get_error(i)) for i in range(parser.num_errors)], plugins=[])
    if parsed:
        for i in range(network.num_layers):
            layer = network.get_layer(i)
            if layer.type == trt.LayerType.PLUGIN_V3:
                layer.__class__ = trt.IPluginV3Layer
                core = layer.plugin.get_capability_interface(trt.PluginCapabilityType.CORE)
                build = layer.plugin.get_capability_interface(trt.PluginCapabilityType.BUILD)
                report["plugins"].append(dict(name=core.plugin_name, namespace=core.plugin_namespace,
                                              version=core.plugin_version, metadata=build.metadata_string))
        ranges = {"batch": (1, 1, 2), "past_sequence": (0, 16, 64)}
        profile = builder.create_optimization_profile()
        for graph_input in onnx.load(model_path, load_external_data=False).graph.input:
            dims = [d.dim_param or d.dim_value for d in graph_input.type.tensor_type.shape.dim]
            r = [(d, d, d) if isinstance(d, int) else ranges.get(d, (1, 16, 64)) for d in dims]
            if any(lo != hi for lo, _, hi in r):
                profile.set_shape(graph_input.name, *[[x[k] for x in r] for k in range(3)])
        config = builder.create_builder_config()
        config.add_optimization_profile(profile)
        start = time.perf_counter()
        serialized = builder.build_serialized_network(network, config)
        report["build_s"] = time.perf_counter() - start
        if serialized is not None:
            blob = bytes(serialized)
            with open(engine_path, "wb") as f:
                f.write(blob)
            report.update(engine_report(trt, logger, blob))
    with open("/proc/self/maps") as maps:  # the libtensorrt_rtx files mapped: one, not a second copy
        report["mapped"] = sorted({line.split()[-1] for line in maps if "/libtensorrt_rtx.so" in line})
    print(json.dumps(report))
    """
)

# The GPU-free check of engine files (argv), in a plain environment: {path: engine_report}.
RTX_CHECK = ENGINE_REPORT + textwrap.dedent(
    """
    import json, sys
    import tensorrt_rtx as trt

    logger = trt.Logger(trt.Logger.WARNING)
    reports = {}
    for path in sys.argv[1:]:
        with open(path, "rb") as f:
            reports[path] = engine_report(trt, logger, f.read())
    print(json.dumps(reports))
    """
)


# The child for the engine set `edgemem build` wrote before one engine served both graphs: a step engine
# and a prefill engine, each from its own graph with its own profile; their bytes and, for the shared
# engine too, how often each weight tensor occurs in an engine.
SEPARATE_ENGINES = textwrap.dedent(
    """
    import json, sys
    import onnx
    from onnx import numpy_helper
    import tensorrt_rtx as trt
    from edgemem.trt_build import dim_names, profile

    library, export, max_batch, max_sequence, shared = sys.argv[1:6]
    logger = trt.Logger(trt.Logger.WARNING)
    assert trt.get_plugin_registry().load_library(library), library
    builder = trt.Builder(logger)
    # each weight tensor's first 256 bytes: its first row, which TensorRT keeps whole where it fuses or
    # interleaves a tensor with others
    weights = [numpy_helper.to_array(t).tobytes() for t in onnx.load(export + "/trt/prefill.onnx").graph.initializer]
    weights = [w[:256] for w in weights if len(w) >= 4096]
    report = {"weights": len(weights)}
    for kind in ("step", "prefill"):
        path = f"{export}/trt/{kind}.onnx"
        network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
        assert trt.OnnxParser(network, logger).parse_from_file(path), path
        config = builder.create_builder_config()
        optimisation = builder.create_optimization_profile()
        for name, (lo, opt, hi) in profile(dim_names(onnx.load(path, load_external_data=False)),
                                           int(max_batch), int(max_sequence)).items():
            optimisation.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(optimisation)
        blob = bytes(builder.build_serialized_network(network, config))
        report[kind] = {"bytes": len(blob), "copies": sorted({blob.count(w) for w in weights})}
    with open(shared, "rb") as f:
        blob = f.read()
    report["shared"] = {"bytes": len(blob), "copies": sorted({blob.count(w) for w in weights})}
    print(json.dumps(report))
    """
)


def _rtx(library: Path | None, model: Path, engine: Path, env: dict[str, str] | None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", RTX_BUILD, str(library or "-"), str(model), str(engine)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )


def _report(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check_engine(report: dict, engine: Path) -> None:
    """What TensorRT-RTX can say about an engine without a GPU, and the header fields it carries."""
    assert engine.stat().st_size == report["engine_bytes"] > report["header_bytes"]
    # no GPU: the library stops after the header format check (INVALID, no diagnostics); with a
    # GPU a good engine is VALID or SUBOPTIMAL; never malformed or from another version
    assert not {"MALFORMED_ENGINE", "VERSION_MISMATCH"} & set(report["validity"][1]), report["validity"]
    assert "MALFORMED_ENGINE" in report["corrupt_validity"][1], "the header check does not look at the engine"
    assert report["magic"] == "vtrt" and report["size_field"] == report["engine_bytes"]
    assert report["version_field"] == report["version"], (report["version_field"], report["version"])


def _identity_model(path: Path) -> Path:
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])
    node = helper.make_node(
        "Identity", ["x"], ["y"], domain="edgemem_test", plugin_namespace="edgemem_test", plugin_version="1"
    )
    graph = helper.make_graph([node], "identity", [x], [y])
    onnx.save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("edgemem_test", 1)]),
        path,
    )
    return path


def test_parser_abort_is_the_missing_library_name_not_the_plugin(identity_plugin, name_fix, tmp_path):
    """A minimal identity plugin aborts the parser exactly as edgemem's did, and imports and
    builds once `libtensorrt_rtx.so` resolves: the cause is the parser's dlopen, not the plugin ABI."""
    import ctypes

    try:
        ctypes.CDLL("libtensorrt_rtx.so")
        pytest.skip("libtensorrt_rtx.so resolves on this machine's library path: the abort cannot occur here")
    except OSError:
        pass
    model, engine = _identity_model(tmp_path / "identity.onnx"), tmp_path / "identity.engine"
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    aborted = _rtx(identity_plugin, model, engine, env)
    assert aborted.returncode == -signal.SIGABRT and "terminate called" in aborted.stderr, (
        f"TensorRT-RTX no longer aborts without libtensorrt_rtx.so (rc {aborted.returncode}): "
        f"drop the LD_LIBRARY_PATH workaround\n{aborted.stderr[-2000:]}"
    )
    report = _report(_rtx(identity_plugin, model, engine, name_fix))
    assert report["parsed"], report["errors"]
    assert report["plugins"] == [dict(name="Identity", namespace="edgemem_test", version="1", metadata=None)]
    assert [Path(p).name for p in report["mapped"]] == ["libtensorrt_rtx.so.1"], report["mapped"]
    _check_engine(report, engine)


@pytest.fixture(scope="module")
def trt_graphs(small_exports) -> dict[str, Path]:
    """The trt target's graphs of ARCHS (conftest's small exports: one layer, width 64): `<arch>-<kind>` -> path."""
    graphs = {}
    for arch in ARCHS:
        for kind in ("step", "prefill"):
            path = small_exports[arch] / "trt" / f"{kind}.onnx"
            if path.is_file():
                graphs[f"{arch}-{kind}"] = path
    return graphs


def _edgemem_nodes(path: Path) -> list[tuple[str, dict[str, str]]]:
    import onnx
    from onnx import helper

    nodes = []
    for node in onnx.load(str(path), load_external_data=False).graph.node:
        if node.domain == "edgemem":
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute if not a.name.startswith("plugin_")}
            nodes.append((node.op_type, attrs))
    return nodes


def _metadata(attrs: dict) -> dict[str, str]:
    """The plugin's metadata string (`name=value;...`) expected from the node's attributes."""
    out = {}
    for name, value in attrs.items():
        if isinstance(value, bytes):
            out[name] = value.decode()
        elif isinstance(value, float):
            out[name] = f"{value:.9g}"
        elif isinstance(value, list):
            out[name] = ",".join(map(str, value))
        else:
            out[name] = str(value)
    return out


def test_every_graph_builds_with_edgemem_plugins(edgemem_plugins, name_fix, trt_graphs, tmp_path):
    """Step and prefill graphs of six presets: every edgemem node (LinearAttention included)
    becomes edgemem's plugin, the engine builds without a GPU and passes the GPU-free checks."""
    assert {"longformer-encoder-prefill", "deltanet-step", "titans-mag-step"} <= set(trt_graphs)
    seen, rows = set(), []
    for name, path in trt_graphs.items():
        engine = tmp_path / f"{name}.engine"
        report = _report(_rtx(edgemem_plugins, path, engine, name_fix))
        assert report["parsed"], (name, report["errors"])
        nodes = _edgemem_nodes(path)
        assert nodes, f"{name} has no edgemem node"
        assert [(p["name"], p["namespace"], p["version"]) for p in report["plugins"]] == [
            (op, "edgemem", "1") for op, _ in nodes
        ], name
        for (op, attrs), plugin in zip(nodes, report["plugins"]):
            meta = dict(item.split("=", 1) for item in plugin["metadata"].split(";"))
            for key, value in _metadata(attrs).items():  # the plugin parsed every attribute
                assert meta.get(key) == value, (name, op, key, meta)
        assert "build_s" in report and "engine_bytes" in report, (name, report)
        _check_engine(report, engine)
        seen |= {op for op, _ in nodes}
        rows.append(
            f"{name:<28} {len(nodes):>2} plugin layers  parse {report['parse_s']:6.2f} s  "
            f"build {report['build_s']:6.2f} s  engine {report['engine_bytes'] / 2**20:7.2f} MiB"
        )
    assert seen == OPS, f"ops without an engine: {OPS - seen}"
    print("\n" + "\n".join(rows))


def test_linear_attention_without_edgemem_library_goes_to_the_builtin_importer(name_fix, trt_graphs, tmp_path):
    """Without edgemem's library the parser hands LinearAttention to its own importer, which
    needs its built-in plugin (not registered without a GPU): a clear parse error, no silent swap."""
    report = _report(_rtx(None, trt_graphs["deltanet-step"], tmp_path / "x.engine", name_fix))
    assert not report["parsed"]
    assert any(
        "importLinearAttention" in e and "failed to load LinearAttention plugin" in e for e in report["errors"]
    ), report["errors"]


def test_build_command_makes_rtx_engines_with_edgemem_plugins(edgemem_plugins, small_exports, tmp_path):
    """`edgemem build --rtx --sm 86,120`, from this process's plain environment (the parser workaround is
    edgemem's), on the step and prefill graphs of six presets: every edgemem node became edgemem's plugin
    (engines.json says so per engine), engines.json records the library, targets, plugin library, export,
    profile and in-place states, and every engine passes the GPU-free checks."""
    import onnx
    import tensorrt_rtx
    from click.testing import CliRunner

    from edgemem.cli import main
    from edgemem.files import sha256
    from edgemem.manifest import load
    from edgemem.trt_build import STEP_SEQUENCE, dim_names, in_place_states, profile

    assert "libtensorrt_rtx.so" not in os.environ.get("LD_LIBRARY_PATH", "")
    seen, built = set(), []
    for i, arch in enumerate(ARCHS):
        export, out, max_batch = small_exports[arch], tmp_path / arch, 1 + i % 2  # batch 1: a step graph of fixed dims
        result = CliRunner().invoke(
            main,
            [
                "build",
                str(export),
                "--rtx",
                "--sm",
                ",".join(map(str, SM)),
                "--plugins",
                str(edgemem_plugins),
                "--max-batch",
                str(max_batch),
                "--max-sequence",
                "64",
                "--out",
                str(out),
            ],
        )
        assert result.exit_code == 0, (arch, result.output)
        manifest = load(export)
        info = json.loads((out / "engines.json").read_text())
        assert info["format"] == "edgemem-engines/3"
        assert info["library"] == {
            "module": "tensorrt_rtx",
            "version": tensorrt_rtx.__version__,
            "compute_capabilities": [f"SM{s}" for s in SM],
        }
        assert info["plugins"] == {"file": str(edgemem_plugins.resolve()), "sha256": sha256(edgemem_plugins)}
        assert info["export"] == {"arch": arch, "identity": manifest.identity(), "dtype": "fp32"}
        assert (info["max_batch"], info["max_sequence"]) == (max_batch, 64)
        kinds = [k for k in ("step", "prefill") if k in manifest.graphs_of("trt")]  # the profiles' order
        assert set(info["engines"]) == set(kinds)
        # one engine from the prefill graph serves every graph, each on its optimisation profile
        assert info["shared"] == "profiles" and {r["file"] for r in info["engines"].values()} == {"model.engine"}
        assert {k: r["profile_index"] for k, r in info["engines"].items()} == {k: i for i, k in enumerate(kinds)}
        graph = export / "trt" / "prefill.onnx"
        model = onnx.load(str(graph), load_external_data=False)
        nodes = _edgemem_nodes(graph)
        for kind, record in info["engines"].items():
            assert record["plugins"] == [{"op": op, "namespace": "edgemem", "version": "1"} for op, _ in nodes], (
                arch,
                kind,
            )
            assert record["profile"] == profile(
                dim_names(model), max_batch, 64, STEP_SEQUENCE if kind == "step" else None
            )
            assert record["profile"]["input_ids"][1:] == (
                [[max_batch, 1], [max_batch, 2]] if kind == "step" else [[max_batch, 64], [max_batch, 64]]
            )  # every profile: batch dynamic; the step's optimised for one token
            assert record["in_place"] == in_place_states(model, manifest)
            assert record["sha256"] == sha256(out / record["file"])
        seen |= {op for op, _ in nodes}
        built.append(out / "model.engine")
    assert seen == OPS, f"ops without an engine: {OPS - seen}"
    assert len(built) == 6  # one engine per export
    reports = json.loads(_run([sys.executable, "-c", RTX_CHECK, *map(str, built)]).stdout.strip().splitlines()[-1])
    for engine in built:
        _check_engine(reports[str(engine)], engine)


def test_bf16_export_builds_rtx_engines_through_the_plugins_in_bfloat16(edgemem_plugins, tmp_path):
    """A bf16 gated DeltaNet (`edgemem export --dtype bf16 --target trt`): its graphs keep bfloat16 weights and
    activations (LinearAttention's query, key and value included), float32 state, and widen the logits to float32
    for the host; TensorRT for RTX builds them, and as the engines are strongly typed, the build succeeds only if
    the plugin takes bfloat16 I/O beside its float32 state. engines.json records the export's dtype."""
    import onnx
    from click.testing import CliRunner

    from edgemem.cli import main
    from edgemem.export import export
    from edgemem.manifest import load
    from edgemem.models import build

    export(build("gated-deltanet", seed=0, d_model=32, mlp_hidden=32), tmp_path / "bf16", targets=["trt"], dtype="bf16")
    manifest = load(tmp_path / "bf16")
    assert manifest.config["dtype"] == "bf16" and {s.dtype for s in manifest.state} == {"float32"}
    bf16, fp32 = onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT
    for kind in ("prefill", "step"):
        graph = onnx.shape_inference.infer_shapes(onnx.load(tmp_path / "bf16" / "trt" / f"{kind}.onnx")).graph
        types = {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.output, *graph.value_info]}
        assert types["logits"] == fp32
        assert all(types[s.input] == types[s.output] == fp32 for s in manifest.state)
        assert any(t.data_type == bf16 and len(t.dims) == 2 for t in graph.initializer)
        nodes = [n for n in graph.node if n.op_type == "LinearAttention"]
        assert nodes and all([types[name] for name in n.input[:3]] == [bf16] * 3 for n in nodes)
    args = ["build", str(tmp_path / "bf16"), "--rtx", "--sm", "86", "--plugins", str(edgemem_plugins)]
    result = CliRunner().invoke(main, [*args, "--max-sequence", "16", "--out", str(tmp_path / "engines")])
    assert result.exit_code == 0, result.output
    info = json.loads((tmp_path / "engines" / "engines.json").read_text())
    assert info["export"]["dtype"] == "bf16" and set(info["engines"]) == {"prefill", "step"}
    for record in info["engines"].values():
        assert record["plugins"] and {p["op"] for p in record["plugins"]} == {"LinearAttention"}, record["plugins"]


def test_one_engine_holds_the_weights_once(edgemem_plugins, name_fix, small_exports, tmp_path):
    """Gated DeltaNet: `edgemem build --rtx` writes one engine in which each weight tensor occurs once,
    and which is smaller than the step and prefill engines built apart (as before), each with a copy of
    the weights. At this size what is not weights dominates the bytes; at the presets' size one engine
    saves about a copy of the weights (benchmarks/README.md)."""
    from edgemem.trt_build import build_engines

    export = small_exports["gated-deltanet"]
    (engine,) = build_engines(export, plugins=edgemem_plugins, max_batch=2, max_sequence=64, out=tmp_path, rtx=True)
    args = [str(edgemem_plugins), str(export), "2", "64", str(engine)]
    proc = subprocess.run(
        [sys.executable, "-c", SEPARATE_ENGINES, *args], capture_output=True, text=True, env=name_fix, timeout=900
    )
    report = _report(proc)
    weight_bytes = (export / "trt" / "weights.data").stat().st_size
    apart = report["step"]["bytes"] + report["prefill"]["bytes"]
    print(
        f"\ngated-deltanet (small): weights {weight_bytes:,} B; step + prefill engines {report['step']['bytes']:,} + "
        f"{report['prefill']['bytes']:,} = {apart:,} B; one engine {report['shared']['bytes']:,} B"
    )
    assert report["weights"] >= 5  # the embedding, the projections, the head
    # each weight tensor once per engine: twice in the engine set as it was, once in the one engine
    assert report["step"]["copies"] == report["prefill"]["copies"] == report["shared"]["copies"] == [1]
    assert report["shared"]["bytes"] == engine.stat().st_size < apart


def test_build_command_makes_an_encoder_decoders_encoder_engine(edgemem_plugins, small_exports, tmp_path):
    """`edgemem build --rtx` on an encoder-decoder (conftest's tiny LED) builds its encoder engine, a file of its own
    with one profile, beside the decoder's one engine (step and prefill profiles): the encoder's BandedAttention
    nodes became edgemem's plugin, its inputs and both decoder profiles' cross keys and values take any input
    length up to the encoder's positions; engines.json lists it, the runtime's checks accept the set and refuse it
    with one line once the encoder engine changes or goes; every engine passes the GPU-free checks."""
    import onnx
    from click.testing import CliRunner

    from edgemem.cli import main
    from edgemem.manifest import load
    from edgemem.runtime import engines
    from edgemem.runtime.errors import BackendError
    from edgemem.trt_build import STEP_SEQUENCE, dim_names, profile

    export, out = small_exports["led"], tmp_path / "led"
    manifest = load(export)
    options = ["--rtx", "--sm", ",".join(map(str, SM)), "--plugins", str(edgemem_plugins), "--out", str(out)]
    result = CliRunner().invoke(main, ["build", str(export), *options, "--max-batch", "2", "--max-sequence", "16"])
    assert result.exit_code == 0, result.output
    info = json.loads((out / "engines.json").read_text())
    assert set(info["engines"]) == {"encoder", "prefill", "step"} == set(manifest.graphs_of("trt"))
    assert info["format"] == "edgemem-engines/3" and info["shared"] == "profiles"
    assert {k: (r["file"], r["profile_index"]) for k, r in info["engines"].items()} == {
        "step": ("model.engine", 0),
        "prefill": ("model.engine", 1),
        "encoder": ("encoder.engine", 0),
    }
    encoder = info["engines"]["encoder"]
    nodes = _edgemem_nodes(export / "trt" / "encoder.onnx")
    assert nodes and {op for op, _ in nodes} == {"BandedAttention"}
    assert encoder["plugins"] == [{"op": op, "namespace": "edgemem", "version": "1"} for op, _ in nodes]
    longest = manifest.encoder["max_length"]
    assert encoder["profile"] == {
        n: [[1, 1], [2, min(64, longest)], [2, longest]] for n in manifest.encoder["inputs"].values()
    }
    dims = dim_names(onnx.load(str(export / "trt" / "prefill.onnx"), load_external_data=False))
    for kind in ("step", "prefill"):
        sequence = STEP_SEQUENCE if kind == "step" else None
        assert info["engines"][kind]["profile"] == profile(dims, 2, 16, sequence, max_encoded=longest)
        for spec in manifest.state:
            if not spec.output:  # read only: the decoder engines take them at the input's length
                assert [shape[2] for shape in info["engines"][kind]["profile"][spec.input]] == [
                    1,
                    min(64, longest),
                    longest,
                ]
    assert engines.read(export, manifest, out)[1] == info
    built = [out / "model.engine", out / "encoder.engine"]
    reports = json.loads(_run([sys.executable, "-c", RTX_CHECK, *map(str, built)]).stdout.strip().splitlines()[-1])
    for engine in built:
        _check_engine(reports[str(engine)], engine)
    (out / "encoder.engine").write_bytes((out / "encoder.engine").read_bytes()[:-1])
    with pytest.raises(BackendError, match=r"encoder.engine does not match its sha256 in engines.json"):
        engines.read(export, manifest, out)
    (out / "encoder.engine").unlink()
    with pytest.raises(BackendError, match=r"the encoder engine encoder.engine listed in engines.json is missing"):
        engines.read(export, manifest, out)
