"""`edgemem build`: TensorRT engines from the `trt` target of an export directory.

    DIR/trt/{prefill,step}.onnx  ──TensorRT ONNX parser + libedgemem_trt_plugins.so──▶  OUT/{prefill,step}.engine

The edgemem nodes of the trt target carry `plugin_namespace="edgemem"` and `plugin_version="1"`,
so the parser takes them from the plugin library (built from plugins/ for the installed
TensorRT major; see plugins/README.md). Needs TensorRT's Python package and an NVIDIA GPU;
without them this raises an EdgememError saying which is missing. Dynamic dims get one
optimisation profile: batch 1..max_batch, sequence 1..max_sequence, past_sequence 0..max_sequence.
Imports neither torch nor tensorrt at module import.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from edgemem.errors import EdgememError

log = logging.getLogger(__name__)

GRAPHS = ("step", "prefill")
PLUGINS_ENV = "EDGEMEM_TRT_PLUGINS"


def _graphs(directory: Path) -> list[Path]:
    trt_dir = directory / "trt"
    found = [trt_dir / f"{g}.onnx" for g in GRAPHS if (trt_dir / f"{g}.onnx").is_file()]
    if not found:
        raise EdgememError(
            f"{directory} has no trt target ({trt_dir}/step.onnx or prefill.onnx); "
            "export with `edgemem export --target trt`"
        )
    return found


def _import_tensorrt():
    try:
        import tensorrt as trt  # noqa: PLC0415
    except ImportError as e:
        raise EdgememError(
            "TensorRT's Python package is not installed (`pip install tensorrt`, or JetPack's "
            f"python3-libnvinfer); `edgemem build` needs TensorRT and an NVIDIA GPU ({e})"
        ) from None
    return trt


def _plugin_library(plugins: str | os.PathLike | None) -> Path:
    path = plugins or os.environ.get(PLUGINS_ENV)
    if not path:
        raise EdgememError(
            f"no plugin library: pass --plugins libedgemem_trt_plugins.so (or set {PLUGINS_ENV}); "
            "build it from plugins/ against this TensorRT (see plugins/README.md)"
        )
    path = Path(path)
    if not path.is_file():
        raise EdgememError(f"plugin library {path} does not exist")
    return path


def _dim_names(onnx_path: Path) -> dict[str, list[str | int]]:
    import onnx  # noqa: PLC0415

    model = onnx.load(str(onnx_path), load_external_data=False)
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


def build_engines(
    directory: str | os.PathLike,
    *,
    fp16: bool = False,
    plugins: str | os.PathLike | None = None,
    max_batch: int = 1,
    max_sequence: int = 2048,
    out: str | os.PathLike | None = None,
) -> list[Path]:
    """Builds one serialized engine per ONNX graph of DIR/trt; returns their paths."""
    directory = Path(directory)
    graphs = _graphs(directory)
    if max_batch < 1 or max_sequence < 1:
        raise EdgememError("--max-batch and the maximum sequence must be at least 1")
    trt = _import_tensorrt()
    library = _plugin_library(plugins)
    logger = trt.Logger(trt.Logger.WARNING)
    registry = trt.get_plugin_registry()
    if not registry.load_library(str(library)):
        raise EdgememError(f"TensorRT could not load the plugin library {library} (built for another TensorRT major?)")
    try:
        builder = trt.Builder(logger)
    except Exception as e:  # CUDA initialisation fails without a GPU/driver
        raise EdgememError(f"TensorRT could not create a builder: no usable NVIDIA GPU or driver ({e})") from None
    if builder is None:
        raise EdgememError("TensorRT could not create a builder: no usable NVIDIA GPU or driver")
    out_dir = Path(out) if out else directory / "engines"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for onnx_path in graphs:
        network = builder.create_network(0)
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(onnx_path)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise EdgememError(f"TensorRT's ONNX parser rejected {onnx_path}: {errors}")
        config = builder.create_builder_config()
        if fp16:
            config.set_flag(trt.BuilderFlag.FP16)
        names = _dim_names(onnx_path)
        profile = builder.create_optimization_profile()
        for i in range(network.num_inputs):
            tensor = network.get_input(i)
            dims = names.get(tensor.name, [])
            ranges = [_profile_range(d, max_batch, max_sequence) for d in dims]
            if ranges and any(lo != hi for lo, _, hi in ranges):
                profile.set_shape(tensor.name, *(tuple(r[k] for r in ranges) for k in range(3)))
        config.add_optimization_profile(profile)
        engine = builder.build_serialized_network(network, config)
        if engine is None:
            raise EdgememError(f"TensorRT failed to build an engine from {onnx_path} (see its log above)")
        path = out_dir / f"{onnx_path.stem}.engine"
        path.write_bytes(bytes(engine))
        log.info("wrote %s", path)
        written.append(path)
    return written
