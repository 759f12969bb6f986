"""`edgemem triton DIR --out REPO`: a Triton Inference Server model repository for an export.

    REPO/<name>/config.pbtxt           Python backend: every export, through edgemem.runtime streams
    REPO/<name>/1/model.py             keyed by sequence id (edgemem.serve.python_model)
    REPO/<name>/export/                a copy of the export (edgemem.json and every file it lists)
    REPO/<name>/checkpoints/           idle and stopped sequences (created by the model)
    REPO/<name>-onnx/config.pbtxt      onnxruntime backend, when the graph allows it: the sequence
    REPO/<name>-onnx/1/model.onnx      batcher keeps the state (implicit state, one entry per
    REPO/<name>-onnx/initial_state/    manifest state tensor) and resets it on START

The onnxruntime-backend model is the export's prefill graph (the step graph when prompts are
stepped) of the `generic` target (`ort` if that is all there is), with the sequence batcher's control
inputs START, END, READY (int32 0/1) and CORRID (uint64), each `[batch, 1]`, added as graph inputs:
Triton's onnxruntime backend passes every control to the model and requires the model to take it.
Its state entries are the manifest's state tensors one to one (`initial_state`: zeros, or the
tensor of `state_init.safetensors` as a raw little-endian data file). It is written when every
state tensor has a fixed shape with at least one dimension besides batch (no growing KV cache,
no per-row scalar such as a `position`); `skipped` in the returned summary says why not.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper
from safetensors.numpy import load_file

from edgemem.config import MAX_THREADS, fits_memory, size_text
from edgemem.config import threads as check_threads
from edgemem.errors import EdgememError, named
from edgemem.files import check_output_dir, export_files, one_name, staged_directory, write_atomic
from edgemem.manifest import MANIFEST, ORT_TARGETS, STATE_INIT, Manifest, StateSpec, load
from edgemem.runtime import Engine
from edgemem.weights import check_single_link

TRITON_TYPES = {
    "float32": "TYPE_FP32",
    "float16": "TYPE_FP16",
    "float64": "TYPE_FP64",
    "int64": "TYPE_INT64",
    "int32": "TYPE_INT32",
}
CONTROLS = (
    ("START", "CONTROL_SEQUENCE_START"),
    ("END", "CONTROL_SEQUENCE_END"),
    ("READY", "CONTROL_SEQUENCE_READY"),
    ("CORRID", "CONTROL_SEQUENCE_CORRID"),
)
MODEL_PY = '''"""Triton Python-backend model written by `edgemem triton`: streams of edgemem.runtime keyed by sequence id."""

import os
import site
import sys

# The backend's embedded Python ignores PYTHONPATH; `edgemem serve` names its environment here.
for path in reversed([p for p in os.environ.get("EDGEMEM_PYTHONPATH", "").split(os.pathsep) if p]):
    sys.path.insert(0, path)
    site.addsitedir(path)  # .pth files: editable installs

from edgemem.serve.python_model import TritonPythonModel  # noqa: E402, F401
'''  # noqa: E501


class RepositoryError(EdgememError):
    """An export that cannot be written as a Triton model repository, or an output that would be overwritten."""


@dataclass
class Repository:
    path: Path
    python_model: str
    onnx_model: str | None
    skipped: list[str] = field(default_factory=list)  # why there is no onnxruntime-backend model


def onnx_reasons(manifest: Manifest) -> list[str]:
    """Why the export cannot be served by Triton's onnxruntime backend with implicit state ([] when it can)."""
    reasons = []
    if not manifest.graphs.get("step", False):
        reasons.append("bidirectional (no step graph): nothing to stream")
    if not {"generic", "ort"} & set(manifest.targets):
        reasons.append(f"no generic or ort target (exported: {', '.join(manifest.targets)})")
    for s in manifest.state:
        if any(isinstance(d, str) for d in s.shape[1:]):
            reasons.append(f"{s.input} grows with the position {s.shape}: implicit state here has fixed dims")
        elif len(s.shape) < 2:
            reasons.append(f"{s.input} is one scalar per row {s.shape}: implicit state needs a dim besides batch")
        if s.dtype not in TRITON_TYPES:
            reasons.append(f"{s.input} is {s.dtype}, which has no Triton type here")
    return reasons


CANDIDATES = 16  # sequences the onnxruntime model's batcher holds per batch slot


def _check_runnable(manifest: Manifest, export_dir: Path) -> None:
    """The Python model streams through edgemem.runtime on onnxruntime: a step graph and a target it runs."""
    if not manifest.graphs.get("step"):
        raise RepositoryError(
            f"{export_dir}: {manifest.arch} has no step graph (a bidirectional encoder does not "
            "stream), and the Triton models serve streams"
        )
    if not set(manifest.targets) & set(ORT_TARGETS):
        raise RepositoryError(
            f"{export_dir} has only the {', '.join(manifest.targets)} target, which onnxruntime "
            "does not run; export with --target ort (or generic) for Triton"
        )


def write_repository(
    export_dir: str | Path,
    out: str | Path,
    *,
    name: str | None = None,
    max_live: int = 64,
    idle_seconds: float = 600.0,
    checkpoints: str = "checkpoints",
    threads: int = 1,
    max_batch_size: int = 8,
    force: bool = False,
    prefix_cache_bytes: int | None = None,
) -> Repository:
    """Write the model repository `out` for the export in `export_dir` (see the module docstring);
    `prefix_cache_bytes`: the Python model's prefix state cache, shared by its sequences (off by default)."""
    export_dir, out = Path(export_dir), Path(out)
    if name is not None:
        one_name(name, f"model {named('name', '--name')}")
    manifest = load(export_dir)
    name = name or manifest.arch
    if not all(c.isalnum() or c in "-_." for c in one_name(name, "model name")):
        raise RepositoryError(f"model name {name!r}: use letters, digits, '-', '_' or '.'")
    if max_live < 1 or idle_seconds <= 0 or threads < 1 or max_batch_size < 1:
        raise RepositoryError("max_live, threads and max_batch_size must be at least 1 and idle_seconds positive")
    check_threads(threads, named("threads", "--threads"), limit=MAX_THREADS, error=RepositoryError)
    _check_runnable(manifest, export_dir)
    per_stream = manifest.state_bytes()
    fits_memory(
        max_live * per_stream,
        f"{named('max_live', '--max-live')} {max_live:,} streams of {size_text(per_stream)} state",
        error=RepositoryError,
    )
    if max_batch_size * CANDIDATES > 2**31 - 1:
        raise RepositoryError(
            f"{named('max_batch_size', '--max-batch-size')} {max_batch_size:,} is past Triton's limit "
            f"({(2**31 - 1) // CANDIDATES:,}: the sequence batcher keeps {CANDIDATES} candidates per slot)"
        )
    fits_memory(
        max_batch_size * CANDIDATES * per_stream,
        f"{named('max_batch_size', '--max-batch-size')} "
        f"{max_batch_size:,} ({max_batch_size * CANDIDATES:,} candidate sequences of {size_text(per_stream)} "
        "implicit state)",
        error=RepositoryError,
    )
    if prefix_cache_bytes is not None:  # refused now (too small for one snapshot), not when Triton loads the model
        Engine.load(export_dir, check_files=False, prefix_cache_bytes=prefix_cache_bytes)
    out = check_output_dir(out, force=force, inputs=[export_dir], what=named("out", "--out"), own=repository_files)
    skipped = onnx_reasons(manifest)
    onnx_name = None if skipped else f"{name}-onnx"
    if onnx_name:
        check_single_link((export_dir / _graph(manifest)).parent)  # the ONNX model is written with onnx
    with staged_directory(out) as tmp:
        model = tmp / name
        (model / "1").mkdir(parents=True)
        for file in [MANIFEST, *manifest.files]:
            (model / "export" / file).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(export_dir / file, model / "export" / file)
        write_atomic(model / "1" / "model.py", MODEL_PY.encode())
        params = {
            "export": "export",
            "checkpoints": checkpoints,
            "max_live": str(max_live),
            "idle_seconds": repr(float(idle_seconds)),
            "threads": str(threads),
        }
        if prefix_cache_bytes is not None:
            params["prefix_cache_bytes"] = str(prefix_cache_bytes)
        write_atomic(model / "config.pbtxt", python_config(name, manifest, params).encode())
        if onnx_name:
            _write_onnx_model(tmp / onnx_name, onnx_name, manifest, export_dir, max_batch_size, idle_seconds)
    return Repository(out, name, onnx_name, skipped)


def repository_files(repo: Path) -> set[str] | None:
    """What `write_repository` (and the models it wrote, their checkpoints) put in `repo`; None if it holds no
    model with an export."""
    own: set[str] = set()
    for model in Path(repo).iterdir():
        exported = export_files(model / "export") if model.is_dir() and not model.is_symlink() else None
        if exported is None:
            continue
        own |= {f"{model.name}/{f}" for f in ("config.pbtxt", "1/model.py", *(f"export/{e}" for e in exported))}
        found = re.search(
            r'key: "checkpoints" value \{ string_value: ("(?:[^"\\]|\\.)*")', _text(model / "config.pbtxt")
        )
        checkpoints = (model / json.loads(found.group(1))).resolve() if found else None
        if checkpoints is not None and checkpoints.is_dir() and model.resolve() in checkpoints.parents:
            inside = checkpoints.relative_to(model.resolve()).as_posix()
            own.add(f"{model.name}/{inside}")
            own |= {
                f"{model.name}/{inside}/{Path(root, f).relative_to(checkpoints).as_posix()}"
                for root, dirs, files in os.walk(checkpoints)
                for f in [*dirs, *files]
            }
        onnx_model = model.with_name(f"{model.name}-onnx")
        if (onnx_model / "config.pbtxt").is_file():
            own |= {f"{onnx_model.name}/config.pbtxt", f"{onnx_model.name}/1/model.onnx"}
            own |= {f"{onnx_model.name}/initial_state/{p.name}" for p in (onnx_model / "initial_state").glob("*.bin")}
    return own or None


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return ""


def python_config(name: str, manifest: Manifest, params: dict[str, str]) -> str:
    parameters = "".join(
        f'parameters {{ key: "{k}" value {{ string_value: {json.dumps(v)} }} }}\n' for k, v in params.items()
    )
    return (
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "TOKENS" data_type: TYPE_INT64 dims: [ -1 ] } ]\n'
        f'output [ {{ name: "LOGITS" data_type: TYPE_FP32 dims: [ {manifest.vocab_size} ] }},\n'
        '         { name: "POSITION" data_type: TYPE_INT64 dims: [ 1 ] } ]\n'
        "# one instance: a sequence lives in the memory of that instance or in its checkpoint, never in two places\n"
        "instance_group [ { count: 1 kind: KIND_CPU } ]\n" + parameters
    )


def _graph(manifest: Manifest) -> str:
    target = "generic" if "generic" in manifest.targets else "ort"
    return f"{target}/{'prefill' if manifest.graphs.get('prefill') else 'step'}.onnx"


def _dims(values: list[int]) -> str:
    return "[ " + ", ".join(str(v) for v in values) + " ]"


def onnx_config(
    name: str,
    manifest: Manifest,
    max_batch_size: int,
    idle_seconds: float,
    data_files: dict[str, str],
    logits_dtype: str = "float32",
) -> str:
    """config.pbtxt of the onnxruntime-backend model; `data_files`: state input → initial_state file name."""
    sequence = "-1" if manifest.graphs.get("prefill") else "1"
    controls = ",\n".join(
        f'    {{ name: "{n}" control [ {{ kind: {kind} '
        + ("data_type: TYPE_UINT64" if n == "CORRID" else "int32_false_true: [ 0, 1 ]")
        + " } ] }"
        for n, kind in CONTROLS
    )
    states = ",\n".join(_state_entry(s, data_files.get(s.input)) for s in manifest.state)
    return (
        f'name: "{name}"\nbackend: "onnxruntime"\nmax_batch_size: {max_batch_size}\n'
        f'input [ {{ name: "{manifest.inputs["tokens"]}" data_type: TYPE_INT64 dims: [ {sequence} ] }} ]\n'
        f'output [ {{ name: "{manifest.outputs["logits"]}" data_type: {TRITON_TYPES[logits_dtype]} dims: [ {sequence}, '
        f"{manifest.vocab_size} ] }} ]\n"
        "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
        "sequence_batching {\n"
        f"  max_sequence_idle_microseconds: {int(idle_seconds * 1e6)}\n"
        f"  oldest {{ max_candidate_sequences: {max_batch_size * CANDIDATES} max_queue_delay_microseconds: 100 }}\n"
        f"  control_input [\n{controls}\n  ]\n"
        f"  state [\n{states}\n  ]\n"
        "}\n"
    )


def _state_entry(spec: StateSpec, data_file: str | None) -> str:
    dims, dtype = _dims([int(d) for d in spec.shape[1:]]), TRITON_TYPES[spec.dtype]
    init = f'data_file: "{data_file}"' if data_file else "zero_data: true"
    return (
        f'    {{ input_name: "{spec.input}" output_name: "{spec.output}" data_type: {dtype} dims: {dims}\n'
        f'      initial_state {{ name: "{spec.input}" data_type: {dtype} dims: {dims} {init} }} }}'
    )


def _write_onnx_model(
    model: Path, name: str, manifest: Manifest, export_dir: Path, max_batch_size: int, idle_seconds: float
) -> None:
    (model / "1").mkdir(parents=True)
    graph = onnx.load(str(export_dir / _graph(manifest)))
    batch = graph.graph.input[0].type.tensor_type.shape.dim[0]
    for control, _ in CONTROLS:
        dtype = TensorProto.UINT64 if control == "CORRID" else TensorProto.INT32
        graph.graph.input.append(helper.make_tensor_value_info(control, dtype, [batch.dim_param or "batch", 1]))
    write_atomic(model / "1" / "model.onnx", graph.SerializeToString())
    data_files: dict[str, str] = {}
    if any(s.init == "file" for s in manifest.state):
        stored = load_file(str(export_dir / STATE_INIT))
        (model / "initial_state").mkdir()
        for s in manifest.state:
            if s.init == "file":
                data_files[s.input] = f"{s.input}.bin"
                raw = np.ascontiguousarray(stored[s.input][0], dtype=np.dtype(s.dtype).newbyteorder("<"))
                write_atomic(model / "initial_state" / data_files[s.input], raw.tobytes())
    logits = next(o for o in graph.graph.output if o.name == manifest.outputs["logits"])
    logits_dtype = helper.tensor_dtype_to_np_dtype(logits.type.tensor_type.elem_type).name
    config = onnx_config(name, manifest, max_batch_size, idle_seconds, data_files, logits_dtype)
    write_atomic(model / "config.pbtxt", config.encode())


__all__ = [
    "Repository",
    "RepositoryError",
    "onnx_config",
    "onnx_reasons",
    "python_config",
    "repository_files",
    "write_repository",
]
