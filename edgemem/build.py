"""`edgemem build`: TensorRT engines from the `trt` target of an export directory.

    DIR/trt/{prefill,step}.onnx  ──TensorRT ONNX parser + libedgemem_trt_plugins.so──▶  OUT/{prefill,step}.engine
                                                                                        OUT/engines.json

The edgemem nodes of the trt target carry `plugin_namespace="edgemem"` and `plugin_version="1"`,
so the parser takes them from the plugin library (built from plugins/ for the installed
TensorRT major; see plugins/README.md). Needs TensorRT's Python package and an NVIDIA GPU;
without them this raises an EdgememError saying which is missing.

Networks are strongly typed (`NetworkDefinitionCreationFlag.STRONGLY_TYPED`; TensorRT 11 builds
nothing else): every tensor keeps the type the ONNX graph gives it, so precision is chosen at
export (`edgemem export --dtype fp16`: FP16 weights and activations, FP32 state), not by a builder
flag. `fp16=True` (`--fp16`) asks for FP16 engines and is refused unless the export is FP16.

Dynamic dims get one optimisation profile: batch 1..max_batch, sequence 1..max_sequence,
past_sequence 0..max_sequence. Engines are written atomically, then `engines.json` (written last)
records what the runtime (`edgemem.runtime.trt`) checks before loading them: the TensorRT version,
the plugin library's sha256, the export they come from (`Manifest.identity()`), each engine's
sha256 and profile, and which state tensors may be bound to one buffer for input and output
(`in_place_states`); `edgemem.runtime.engines` owns that format. Imports neither torch nor
tensorrt nor onnx at module import.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from edgemem.errors import EdgememError
from edgemem.files import write_atomic
from edgemem.manifest import Manifest
from edgemem.manifest import load as load_manifest
from edgemem.opset import DOMAIN
from edgemem.runtime import engines as engines_json

log = logging.getLogger(__name__)

GRAPHS = ("step", "prefill")
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


def _import_tensorrt():
    try:
        import tensorrt as trt  # noqa: PLC0415
    except ImportError as e:
        raise EdgememError(
            "TensorRT's Python package is not installed (`pip install tensorrt`, or JetPack's "
            f"python3-libnvinfer); `edgemem build` needs TensorRT and an NVIDIA GPU ({e})"
        ) from None
    return trt


def dim_names(model: Any) -> dict[str, list[str | int]]:
    """Each graph input's dims (`onnx.ModelProto`): a name for symbolic dims, else the size."""
    return {
        i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input
    }


def _profile_range(name: str | int, max_batch: int, max_sequence: int) -> tuple[int, int, int]:
    if isinstance(name, int) and name > 0:
        return name, name, name
    if name == "batch":
        return 1, max_batch, max_batch
    if name == "past_sequence":
        return 0, max_sequence // 2, max_sequence
    return 1, min(64, max_sequence), max_sequence  # sequence and any other symbolic dim


def profile(dims: dict[str, list[str | int]], max_batch: int, max_sequence: int) -> dict[str, list[list[int]]]:
    """The optimisation profile: each input's [min, opt, max] shapes (inputs with dynamic dims only)."""
    shapes = {}
    for name, names in dims.items():
        ranges = [_profile_range(d, max_batch, max_sequence) for d in names]
        if ranges and any(lo != hi for lo, _, hi in ranges):
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
        if (node is not None and node.domain == DOMAIN and spec.input in node.input
                and readers.get(spec.input) == 1 and spec.output in outputs):
            found.append(spec.input)
    return found


def build_engines(
    directory: str | os.PathLike,
    *,
    fp16: bool = False,
    plugins: str | os.PathLike | None = None,
    max_batch: int = 1,
    max_sequence: int = 2048,
    out: str | os.PathLike | None = None,
) -> list[Path]:
    """Builds one serialized engine per ONNX graph of DIR/trt, then engines.json; returns the engines' paths."""
    import onnx  # noqa: PLC0415

    directory = Path(directory)
    graphs = _graphs(directory)
    manifest = load_manifest(directory)  # every file's sha256 checked: engines.json vouches for this export
    _check_precision(manifest, directory, fp16)
    if max_batch < 1 or max_sequence < 1:
        raise EdgememError("--max-batch and the maximum sequence must be at least 1")
    trt = _import_tensorrt()
    library = engines_json.plugin_library(plugins)
    logger = trt.Logger(trt.Logger.WARNING)
    engines_json.load_plugins(trt, library)
    try:
        builder = trt.Builder(logger)
    except Exception as e:  # CUDA initialisation fails without a GPU/driver
        raise EdgememError(f"TensorRT could not create a builder: no usable NVIDIA GPU or driver ({e})") from None
    if builder is None:
        raise EdgememError("TensorRT could not create a builder: no usable NVIDIA GPU or driver")
    out_dir = Path(out) if out else directory / engines_json.ENGINES_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    written, engines = [], {}
    for onnx_path in graphs:
        network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(onnx_path)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise EdgememError(f"TensorRT's ONNX parser rejected {onnx_path}: {errors}")
        config = builder.create_builder_config()
        model = onnx.load(str(onnx_path), load_external_data=False)
        shapes = profile(dim_names(model), max_batch, max_sequence)
        optimisation = builder.create_optimization_profile()
        for name, (lo, opt, hi) in shapes.items():
            optimisation.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(optimisation)
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise EdgememError(f"TensorRT failed to build an engine from {onnx_path} (see its log above)")
        path = out_dir / f"{onnx_path.stem}.engine"
        write_atomic(path, bytes(serialized))
        log.info("wrote %s", path)
        written.append(path)
        engines[onnx_path.stem] = engines_json.entry(path, shapes, in_place_states(model, manifest))
    log.info("wrote %s", engines_json.write(out_dir, manifest, trt.__version__, library, max_batch, max_sequence, engines))
    return written
