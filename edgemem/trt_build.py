"""`edgemem build`: a TensorRT (or TensorRT for RTX) engine from the `trt` target of an export directory.

    DIR/trt/prefill.onnx  ──TensorRT ONNX parser + libedgemem_trt_plugins.so──▶  OUT/model.engine
    (DIR/trt/step.onnx: checked to be it at one token)                           OUT/engines.json
    DIR/trt/encoder.onnx (an encoder-decoder's)  ──────────────────────────────▶  OUT/encoder.engine

One engine serves every graph of the decoder, so the engine set holds its weights once: it is built from the
prefill graph with one optimisation profile per graph kind, the step's (sequence 1..2, optimised
for 1: `STEP_SEQUENCE`) first, then the prefill's; an execution context on the step profile runs
steps. That is the step graph's computation: both graphs trace the same `prefill` of the model
(`edgemem.export.graphs`), and `_check_step` refuses a step graph whose inputs and outputs are not
the prefill graph's at one token. (Weight-stripped engines refitted at load, the other way to one
weight file, would still hold a device copy per engine, and TensorRT for RTX 1.7 builds them only
on a GPU.) An encoder-decoder's encoder, with weights of its own, is an engine apart with one profile;
its banded attention is edgemem's BandedAttention plugin.

The edgemem nodes of the trt target carry `plugin_namespace="edgemem"` and `plugin_version="1"`,
so the parser takes them from the plugin library (built from plugins/ for the installed
TensorRT major; see plugins/README.md). Needs TensorRT's Python package and an NVIDIA GPU;
without them this raises an EdgememError saying which is missing.

`rtx=True` (`--rtx`) builds with TensorRT for RTX (`tensorrt_rtx`) instead: the same parse, profile
and build, ahead of time and without a GPU, for the compute capabilities `sm` (`--sm 86,89,120`; the
plugin library must hold kernels for them). Its parse and build run in a child process (`_child`):
see `_rtx_environment` for why.

Networks are strongly typed (`NetworkDefinitionCreationFlag.STRONGLY_TYPED`; TensorRT 11 builds
nothing else): every tensor keeps the type the ONNX graph gives it, so precision is chosen at
export (`edgemem export --dtype fp16`: FP16 weights and activations, FP32 state), not by a builder
flag. `fp16=True` (`--fp16`) asks for FP16 engines and is refused unless the export is FP16.

Dynamic dims get their range in each profile: batch 1..max_batch, sequence 1..max_sequence (1..2 in
the step profile), past_sequence 0..max_sequence, and an encoder-decoder's encoder_sequence (the
encoder engine's input, the decoder profiles' cross keys and values) 1..the encoder's positions (the
manifest's `encoder.max_length`). The engine set is written in a staged directory that replaces OUT at
the end (an interrupted build leaves OUT as it was); OUT must be empty or, with `force`, hold only an
earlier engine set (`edgemem.files.engine_files`), and may not hold the export's files.
`engines.json` records what the runtime (`edgemem.runtime.trt`) checks before loading them: the library
(tensorrt or tensorrt_rtx), its version and target compute capabilities, the plugin library's
sha256, the export they come from (`Manifest.identity()`), per graph kind the engine file, its
sha256, the profile index and shapes, and the plugin layers (op, namespace, version: every edgemem
node, LinearAttention included, is edgemem's plugin), and which state tensors may be bound to one
buffer for input and output (`in_place_states`); `edgemem.runtime.engines` owns that format. Imports neither torch nor
tensorrt nor onnx at module import.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edgemem.errors import EdgememError, named
from edgemem.files import check_output_dir, engine_files, staged_directory, write_atomic
from edgemem.manifest import MANIFEST, Manifest, check_graph_file
from edgemem.manifest import load as load_manifest
from edgemem.opset import DOMAIN
from edgemem.runtime import engines as engines_json
from edgemem.runtime.state import ENCODED, GROWING, concrete_shape

log = logging.getLogger(__name__)

GRAPHS = ("step", "prefill", engines_json.ENCODER)  # the decoder's in the order of its engine's profiles
ENGINE = "model.engine"
ENCODER_ENGINE = "encoder.engine"
RTX = "tensorrt_rtx"
SHAPE_ONLY = ("Shape", "Size")  # ONNX ops that read a tensor's dims, never its values


def _graphs(directory: Path) -> list[Path]:
    trt_dir = directory / "trt"
    found = [trt_dir / f"{g}.onnx" for g in GRAPHS if (trt_dir / f"{g}.onnx").is_file()]
    if not found:
        raise EdgememError(
            f"{directory} has no trt target ({trt_dir}/step.onnx or prefill.onnx); "
            "export with `edgemem export --target trt`"
        )
    return found


def _check_precision(manifest: Manifest, directory: Path, fp16: bool) -> None:
    dtype = manifest.config.get("dtype", "fp32")
    if fp16 and dtype != "fp16":
        raise EdgememError(
            f"--fp16: {directory} is an {dtype} export, and TensorRT's strongly typed engines keep the ONNX types "
            f"(no builder flag turns them into FP16); re-export with `edgemem export --dtype fp16 --target trt`, "
            "or build without --fp16"
        )


VOLUME = 2**31 - 1  # TensorRT indexes a tensor's elements with 32-bit integers


def _check_shapes(manifest: Manifest, max_batch: int, max_sequence: int) -> None:
    """Before any work: the engines can hold the largest shapes asked for, and the trt runtime can run them."""
    growing = [s.input for s in manifest.state if GROWING in s.shape]
    if growing:
        raise EdgememError(
            f"{manifest.arch}'s KV cache grows ({growing[0]}), and the trt runtime runs fixed-size state "
            "only: export with --max-length N (a preallocated cache) and build that"
        )
    kv = manifest.kv_cache
    if kv and kv["overflow"] == "error" and max_sequence > kv["max_length"]:
        raise EdgememError(
            f"--max-sequence {max_sequence:,} is past the export's KV cache of --max-length "
            f"{kv['max_length']:,} tokens; give --max-sequence {kv['max_length']} or less"
        )
    if max_batch * max_sequence * manifest.vocab_size > VOLUME:
        most = VOLUME // (max_batch * manifest.vocab_size)
        hint = f"--max-sequence {most:,} or less" if most else "a smaller --max-batch"
        raise EdgememError(
            f"--max-batch {max_batch} × --max-sequence {max_sequence:,} × a vocabulary of "
            f"{manifest.vocab_size:,} logits is past TensorRT's 2**31 elements per tensor; give {hint}"
        )
    encoded = max_encoded(manifest)
    for spec in manifest.state:
        if ENCODED in spec.shape and max_batch * int(np.prod(concrete_shape(spec, 1, encoded=encoded))) > VOLUME:
            raise EdgememError(
                f"--max-batch {max_batch} × {spec.input} of an input of {encoded:,} tokens (the encoder's "
                "positions) is past TensorRT's 2**31 elements per tensor; give a smaller --max-batch"
            )


def max_encoded(manifest: Manifest) -> int:
    """The longest input an encoder-decoder's engines take: the encoder's positions (0: no encoder)."""
    return manifest.encoder["max_length"] if manifest.encoder else 0


def _import_library(module: str) -> Any:
    """tensorrt or tensorrt_rtx."""
    import importlib  # noqa: PLC0415

    try:
        return importlib.import_module(module)
    except ImportError as e:
        hint = (
            "`pip install 'edgemem-toolkit[rtx]'` (tensorrt-rtx-cu13); it builds without a GPU"
            if module == RTX
            else "`pip install tensorrt`, or JetPack's python3-libnvinfer; `edgemem build` needs TensorRT and an "
            "NVIDIA GPU (or `--rtx`: TensorRT for RTX, no GPU needed)"
        )
        raise EdgememError(
            f"{engines_json.LIBRARIES[module]}'s Python package is not installed: {hint} ({e})"
        ) from None


def compute_capabilities(trt: Any, sm: Sequence[int]) -> list[Any]:
    """TensorRT for RTX's `ComputeCapability` members for `sm` (86 → SM86); an unknown one is refused."""
    known = {name: value for name, value in trt.ComputeCapability.__members__.items() if name.startswith("SM")}
    wrong = [s for s in sm if f"SM{s}" not in known]
    if wrong:
        raise EdgememError(
            f"--sm {','.join(map(str, wrong))}: TensorRT for RTX {trt.__version__} targets compute "
            f"capabilities {','.join(n[2:] for n in known)}"
        )
    return [known[f"SM{s}"] for s in sm]


def dim_names(model: Any) -> dict[str, list[str | int]]:
    """Each graph input's dims (`onnx.ModelProto`): a name for symbolic dims, else the size."""
    return {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}


# The step profile's sequence range: [min, opt, max]. Its max of 2 keeps the dim dynamic: with every dim of
# a profile fixed, TensorRT for RTX 1.7 builds that profile on a copy of the weights of its own.
STEP_SEQUENCE = (1, 1, 2)


def _profile_range(
    name: str | int, max_batch: int, max_sequence: int, sequence: tuple[int, int, int] | None, max_encoded: int
) -> tuple[int, int, int]:
    if isinstance(name, int) and name > 0:
        return name, name, name
    if name == "sequence" and sequence is not None:
        return sequence
    if name == "batch":
        return 1, max_batch, max_batch
    if name == GROWING:
        return 0, max_sequence // 2, max_sequence
    if name == ENCODED:
        return 1, min(64, max_encoded), max_encoded
    return 1, min(64, max_sequence), max_sequence  # sequence and any other symbolic dim


def profile(
    dims: dict[str, list[str | int]],
    max_batch: int,
    max_sequence: int,
    sequence: tuple[int, int, int] | None = None,
    max_encoded: int = 0,
) -> dict[str, list[list[int]]]:
    """An optimisation profile: each input's [min, opt, max] shapes (inputs with symbolic dims only; every one
    of them, even where min = max, as with max_batch 1: TensorRT builds nothing while a dynamic input has no range).
    `sequence`: the "sequence" dim's range instead of 1..max_sequence (the step profile's: STEP_SEQUENCE).
    `max_encoded`: the longest encoder input (`encoder_sequence` dims)."""
    shapes = {}
    for name, names in dims.items():
        if any(not isinstance(d, int) or d < 1 for d in names):
            ranges = [_profile_range(d, max_batch, max_sequence, sequence, max_encoded) for d in names]
            shapes[name] = [[r[k] for r in ranges] for k in range(3)]
    return shapes


def in_place_states(model: Any, manifest: Manifest) -> list[str]:
    """State inputs that may share one device buffer with their output (`onnx.ModelProto` of a trt graph).

    Safe only where an edgemem plugin node reads the state input, is its only reader, and writes
    the state output: the plugins read each state element before writing it, one owner per element
    (plugins/README.md). Not so for conv_state (Concat + Slice: TensorRT's own layers may read the
    input after writing part of the output) or for a position that other nodes also read (they
    could run after the plugin wrote it). Shape and Size nodes read dims, not data: not readers.
    """
    producer = {out: node for node in model.graph.node for out in node.output}
    readers: dict[str, int] = {}
    for node in model.graph.node:
        if node.op_type in SHAPE_ONLY and not node.domain:
            continue
        for name in set(node.input):
            readers[name] = readers.get(name, 0) + 1
    outputs = {o.name for o in model.graph.output}
    found = []
    for spec in manifest.state:
        node = producer.get(spec.output)
        if (
            node is not None
            and node.domain == DOMAIN
            and spec.input in node.input
            and readers.get(spec.input) == 1
            and spec.output in outputs
        ):
            found.append(spec.input)
    return found


def plugin_layers(trt: Any, network: Any) -> list[dict[str, str]]:
    """The network's IPluginV3 layers as {op, namespace, version}: which plugin each custom node became."""
    found = []
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type == trt.LayerType.PLUGIN_V3:
            layer.__class__ = trt.IPluginV3Layer  # get_layer returns the ILayer base
            core = layer.plugin.get_capability_interface(trt.PluginCapabilityType.CORE)
            found.append({"op": core.plugin_name, "namespace": core.plugin_namespace, "version": core.plugin_version})
    return found


def io_dims(model: Any) -> list[tuple[str, int, list[str | int]]]:
    """A graph's inputs then outputs (`onnx.ModelProto`): name, element type, dims (a name where symbolic)."""
    values = [*model.graph.input, *model.graph.output]
    return [
        (v.name, v.type.tensor_type.elem_type, [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim])
        for v in values
    ]


def _one_token(dim: str | int) -> str | int:
    """A prefill graph's dim at sequence 1 ("sequence" → 1, "past_sequence + sequence" → "past_sequence + 1")."""
    if not isinstance(dim, str):
        return dim
    dim = re.sub(r"\bsequence\b", "1", dim)
    return 1 if dim == "1" else dim


def _check_step(step: Any, prefill: Any, step_path: Path) -> None:
    """The step graph's inputs and outputs are the prefill graph's at one token ("sequence" = 1), so the
    prefill graph's engine on its step profile takes the step's bindings."""
    want = [(name, kind, [_one_token(d) for d in dims]) for name, kind, dims in io_dims(prefill)]
    got = io_dims(step)
    if got != want:
        first = next((g, w) for g, w in itertools.zip_longest(got, want) if g != w)
        raise EdgememError(
            f"{step_path} is not the prefill graph at one token ({first[0]} there, {first[1]} expected), "
            "so one engine cannot serve both; re-export with `edgemem export --target trt`"
        )


def _parse(
    trt: Any, name: str, builder: Any, logger: Any, source: Path, library: Path
) -> tuple[Any, Any, list[dict[str, str]]]:
    """`source` parsed by `name` (TensorRT or TensorRT for RTX) into a strongly typed network: the network, its
    parser (which owns the weights until the build) and its plugin layers, every one edgemem's."""
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(source)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EdgememError(f"{name}'s ONNX parser rejected {source}: {errors}")
    plugins = plugin_layers(trt, network)
    foreign = [p for p in plugins if p["namespace"] != DOMAIN]
    if foreign:
        raise EdgememError(
            f"{source}: {foreign[0]['op']} became another library's plugin (namespace "
            f"{foreign[0]['namespace']!r}), not edgemem's: is {library} the edgemem plugin library?"
        )
    return network, parser, plugins


def _build(
    name: str,
    builder: Any,
    network: Any,
    targets: Sequence[Any],
    profiles: Sequence[dict[str, list[list[int]]]],
    source: Path,
    path: Path,
) -> None:
    """Build `network` with `profiles` (profile i: `profiles[i]`) for `targets`; write the engine to `path`."""
    config = builder.create_builder_config()
    if targets:
        config.num_compute_capabilities = len(targets)
        for i, target in enumerate(targets):
            config.set_compute_capability(target, i)
    for shapes in profiles:
        optimisation = builder.create_optimization_profile()
        for tensor, (lo, opt, hi) in shapes.items():
            optimisation.set_shape(tensor, lo, opt, hi)
        config.add_optimization_profile(optimisation)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise EdgememError(f"{name} failed to build an engine from {source} (see its log above)")
    write_atomic(path, bytes(serialized))


def _build_graphs(
    module: str,
    directory: Path,
    graphs: Sequence[Path],
    library: Path,
    out_dir: Path,
    max_batch: int,
    max_sequence: int,
    sm: Sequence[int],
) -> dict[str, Any]:
    """Build with `module` (tensorrt or tensorrt_rtx) the decoder's engine from the last of its `graphs` (prefill,
    where the export has one) with a profile per graph, and an encoder-decoder's encoder engine; write them;
    each graph kind's record."""
    import onnx  # noqa: PLC0415

    trt = _import_library(module)
    manifest = load_manifest(directory, check_files=False)  # build_engines checked the files
    models = {path.stem: onnx.load(str(path), load_external_data=False) for path in graphs}
    decoder = [path for path in graphs if path.stem != engines_json.ENCODER]
    encoder = [path for path in graphs if path.stem == engines_json.ENCODER]
    source = decoder[-1]
    for path in decoder[:-1]:
        _check_step(models[path.stem], models[source.stem], path)
    logger = trt.Logger(trt.Logger.WARNING)
    engines_json.load_plugins(trt, library)
    try:
        builder = trt.Builder(logger)
    except Exception as e:  # CUDA initialisation fails without a GPU/driver (TensorRT, not TensorRT for RTX)
        raise EdgememError(f"TensorRT could not create a builder: no usable NVIDIA GPU or driver ({e})") from None
    if builder is None:
        raise EdgememError("TensorRT could not create a builder: no usable NVIDIA GPU or driver")
    name, targets = engines_json.LIBRARIES[module], compute_capabilities(trt, sm) if sm else []
    encoded = max_encoded(manifest)
    network, parser, plugins = _parse(trt, name, builder, logger, source, library)
    dims = dim_names(models[source.stem])
    shapes = {  # profile i serves decoder[i]
        path.stem: profile(dims, max_batch, max_sequence, STEP_SEQUENCE if path.stem == "step" else None, encoded)
        for path in decoder
    }
    path = out_dir / ENGINE
    _build(name, builder, network, targets, list(shapes.values()), source, path)
    log.info("built %s from %s (profiles: %s)", path.name, source.name, ", ".join(shapes))
    in_place = in_place_states(models[source.stem], manifest)
    records = {kind: engines_json.entry(path, i, shapes[kind], in_place, plugins) for i, kind in enumerate(shapes)}
    del network, parser  # the decoder's weights, before the encoder's are parsed
    for source in encoder:
        network, parser, plugins = _parse(trt, name, builder, logger, source, library)
        shapes = profile(dim_names(models[source.stem]), max_batch, max_sequence, max_encoded=encoded)
        path = out_dir / ENCODER_ENGINE
        _build(name, builder, network, targets, [shapes], source, path)
        log.info("built %s from %s", path.name, source.name)
        records[source.stem] = engines_json.entry(path, 0, shapes, [], plugins)
    return records


def _rtx_environment(folder: Path) -> dict[str, str]:
    """The environment of a child process in which TensorRT for RTX's ONNX parser can add plugin layers.

    TensorRT for RTX 1.7.1's parser adds an IPluginV3 layer through `dlopen("libtensorrt_rtx.so")`,
    the unversioned name, inside a noexcept function; the wheel ships only `libtensorrt_rtx.so.1`,
    so the failed dlopen ends in std::terminate (plugins/README.md, tests/test_rtx.py). A symlink of
    that name in FOLDER, first on LD_LIBRARY_PATH, resolves it to the library already loaded. ld.so
    reads LD_LIBRARY_PATH at process start only: hence a child process.
    """
    spec = importlib.util.find_spec("tensorrt_rtx_libs")
    libs = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    real = sorted((f for d in libs for f in d.glob("libtensorrt_rtx.so.*")), key=lambda f: len(f.name))
    if not real:
        raise EdgememError(
            "TensorRT for RTX's libraries (package tensorrt_rtx_libs, libtensorrt_rtx.so.*) were not "
            "found: reinstall `pip install 'edgemem-toolkit[rtx]'`"
        )
    (folder / "libtensorrt_rtx.so").symlink_to(real[0])
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(folder), env.get("LD_LIBRARY_PATH")) if p)
    return env


def _child() -> None:
    """`_build_graphs` in a child process: the job as JSON on stdin, {"engines"} or {"error"} as JSON on stdout."""
    job = json.loads(sys.stdin.read())
    logging.basicConfig(level=job["log_level"], format="%(levelname)s %(name)s: %(message)s")
    try:
        engines = _build_graphs(
            RTX,
            Path(job["directory"]),
            [Path(g) for g in job["graphs"]],
            Path(job["library"]),
            Path(job["out"]),
            job["max_batch"],
            job["max_sequence"],
            job["sm"],
        )
    except EdgememError as e:
        print(json.dumps({"error": str(e)}))
        return
    print(json.dumps({"engines": engines}))


def _build_rtx(
    directory: Path,
    graphs: Sequence[Path],
    library: Path,
    out_dir: Path,
    max_batch: int,
    max_sequence: int,
    sm: Sequence[int],
) -> dict[str, Any]:
    """`_build_graphs` with TensorRT for RTX, in a child process (`_rtx_environment`)."""
    job = {
        "directory": str(directory),
        "graphs": [str(g) for g in graphs],
        "library": str(library),
        "out": str(out_dir),
        "max_batch": max_batch,
        "max_sequence": max_sequence,
        "sm": list(sm),
        "log_level": logging.getLogger("edgemem").getEffectiveLevel(),
    }
    with tempfile.TemporaryDirectory(prefix="edgemem-rtx-") as folder:
        proc = subprocess.run(
            [sys.executable, "-c", "from edgemem.trt_build import _child; _child()"],
            input=json.dumps(job),
            stdout=subprocess.PIPE,
            text=True,
            env=_rtx_environment(Path(folder)),
        )
    lines = proc.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if proc.returncode == 0 and lines else {}
    except ValueError:
        result = {}
    if "error" in result:
        raise EdgememError(result["error"])
    if "engines" not in result:
        raise EdgememError(
            f"TensorRT for RTX's build process ended with status {proc.returncode} and no result "
            f"(see its log above){': ' + lines[-1] if lines else ''}"
        )
    return result["engines"]


def build_engines(
    directory: str | os.PathLike,
    *,
    fp16: bool = False,
    plugins: str | os.PathLike | None = None,
    max_batch: int = 1,
    max_sequence: int = 2048,
    out: str | os.PathLike | None = None,
    rtx: bool = False,
    sm: Sequence[int] = (),
    force: bool = False,
) -> list[Path]:
    """Builds one serialized engine serving the decoder's ONNX graphs of DIR/trt (and an encoder-decoder's encoder
    engine), then engines.json; returns the engines' paths.

    `rtx`: with TensorRT for RTX, for the compute capabilities `sm` (e.g. (86, 89, 120); empty: its default set).
    `force`: replace an earlier engine set in `out` (nothing else).
    """
    directory = Path(directory)
    graphs = _graphs(directory)
    manifest = load_manifest(directory)  # every file's sha256 checked: engines.json vouches for this export
    _check_precision(manifest, directory, fp16)
    if max_batch < 1 or max_sequence < 1:
        raise EdgememError("--max-batch and the maximum sequence must be at least 1")
    if sm and not rtx:
        raise EdgememError(
            "--sm picks TensorRT for RTX's target GPUs: add --rtx (TensorRT builds for the GPU it runs on)"
        )
    _check_shapes(manifest, max_batch, max_sequence)
    for graph in graphs:
        check_graph_file(manifest, graph, "trt")
    library = engines_json.plugin_library(plugins)
    inputs = [library, directory / MANIFEST, *(directory / name for name in manifest.files)]
    out_dir = check_output_dir(
        Path(out) if out else directory / engines_json.ENGINES_DIR,
        force=force,
        inputs=inputs,
        what=named("out", "--out"),
        own=engine_files,
    )
    module = RTX if rtx else "tensorrt"
    trt = _import_library(module)
    targets = [c.name for c in compute_capabilities(trt, sm)] if rtx else []
    with staged_directory(out_dir) as tmp:
        if rtx:
            engines = _build_rtx(directory, graphs, library, tmp, max_batch, max_sequence, sm)
        else:
            engines = _build_graphs(module, directory, graphs, library, tmp, max_batch, max_sequence, sm)
        toolkit = engines_json.Toolkit(module, trt.__version__, targets)
        engines_json.write(tmp, manifest, toolkit, library, max_batch, max_sequence, engines)
    log.info("wrote %s", out_dir / engines_json.ENGINES_JSON)
    return list(dict.fromkeys(out_dir / record["file"] for record in engines.values()))
