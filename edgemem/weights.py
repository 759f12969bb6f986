"""One weight store per target: the graphs of a target folder read their weights from one file.

    DIR/<target>/weights.data      every initializer of the folder's graphs, each distinct tensor once
                                   (the prefill and step graphs hold the same weights, under the same or
                                   other names), at offsets aligned to ALIGN bytes

Each graph stays a valid ONNX file: its initializers are ONNX external data pointing into
`weights.data`, so onnxruntime, onnxruntime-genai, TensorRT's parser and onnx.checker read it on
their own. The index this returns goes into the manifest (`weights`), from which edgemem's runtime
maps the file once and hands every session the same buffers.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import onnx
from onnx import TensorProto, helper, numpy_helper

from edgemem.errors import EdgememError
from edgemem.files import umask

WEIGHTS = "weights.data"
ALIGN = 4096  # a page: the runtime maps the file and views each tensor in place
SMALLEST = 1024  # bytes; smaller initializers stay inside their graph


def check_single_link(folder: Path) -> None:
    """Refuse, in one line, a `folder/weights.data` with more than one hard link: onnx will not read external
    data from such a file (a guard against hard-link attacks), so loading the folder's graphs with onnx would
    fail deep inside it."""
    data = folder / WEIGHTS
    links = data.stat().st_nlink if data.is_file() else 1
    if links > 1:
        raise EdgememError(
            f"{data} has {links} hard links, and onnx refuses to read weights from a file with more than one; "
            f"give this export its own copy (cp {data} {data}.copy && mv {data}.copy {data}) and run again"
        )


def _raw(tensor: TensorProto) -> bytes:
    return tensor.raw_data if tensor.HasField("raw_data") else numpy_helper.to_array(tensor).tobytes()


# The weight inputs onnxruntime's CPU kernels pre-pack (a packed copy in their own layout).
PACKED_INPUTS = {"MatMul": (1,), "Gemm": (1,), "MatMulNBits": (1, 2, 3)}


def _packed(model: onnx.ModelProto) -> list[str]:
    """The initializers of `model` that only pre-packing kernels read (as the inputs PACKED_INPUTS names)."""
    readers: dict[str, list[bool]] = {}

    def walk(graph: onnx.GraphProto) -> None:
        for node in graph.node:
            for i, name in enumerate(node.input):
                readers.setdefault(name, []).append(i in PACKED_INPUTS.get(node.op_type, ()))
            for attribute in node.attribute:
                for sub in [attribute.g] if attribute.HasField("g") else attribute.graphs:
                    walk(sub)

    walk(model.graph)
    return [t.name for t in model.graph.initializer if all(readers.get(t.name, [False]))]


def share(folder: Path, graphs: list[Path]) -> dict[str, Any] | None:
    """Move the main-graph initializers of `graphs` (ONNX files in `folder`, external data beside them
    allowed) into `folder/weights.data` and rewrite the graphs to read it, one graph in memory at a time
    (tensors of equal bytes and dtype are stored once, also under different shapes: a tied 4-bit head and
    the embedding lookup read the same blocks);
    their old data files are removed. Returns the index {"file", "tensors": {graph stem: {name: [offset,
    dtype, shape]}}, "packed": {graph stem: [name, ...]}} ("packed": the moved initializers that only
    pre-packing kernels read and whose bytes no other reader of the graph shares, which a session that
    pre-packs may load from the file itself), or None when no initializer is large enough to move."""
    offsets: dict[tuple[str, int], int] = {}
    index: dict[str, dict[str, list]] = {}
    packed: dict[str, list[str]] = {}
    data = folder / WEIGHTS
    tmp = data.with_name(data.name + ".partial")
    size = 0
    with tmp.open("wb") as out:
        for path in graphs:
            model = onnx.load(str(path))
            entries = index.setdefault(path.name.removesuffix(".onnx"), {})
            only_packed = set(_packed(model))
            for tensor in model.graph.initializer:
                raw = _raw(tensor)
                if len(raw) < SMALLEST:
                    continue
                key = (hashlib.sha256(raw).hexdigest(), tensor.data_type)  # one copy of equal bytes, whatever the shape
                if key not in offsets:
                    start = -size % ALIGN + size
                    out.write(b"\0" * (start - size))
                    out.write(raw)
                    offsets[key], size = start, start + len(raw)
                tensor.ClearField("raw_data")
                for field in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data"):
                    tensor.ClearField(field)
                del tensor.external_data[:]
                tensor.data_location = TensorProto.EXTERNAL
                for k, v in (("location", WEIGHTS), ("offset", str(offsets[key])), ("length", str(len(raw)))):
                    entry = tensor.external_data.add()
                    entry.key, entry.value = k, v
                dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type).name
                entries[tensor.name] = [offsets[key], dtype, list(tensor.dims)]
            # bytes that another reader of this graph shares (a tied 4-bit head's blocks, which the lookup reads)
            # come from the one mapping of the file, not from a second one of onnxruntime's
            shared = {entries[name][0] for name in entries if name not in only_packed}
            if names := [name for name in entries if name in only_packed and entries[name][0] not in shared]:
                packed[path.name.removesuffix(".onnx")] = names
            path.with_name(path.name + ".data").unlink(missing_ok=True)  # edgemem.files.save_onnx's, now inside
            onnx.save(model, str(path))
    if not offsets:
        tmp.unlink()
        return None
    tmp.chmod(0o666 & ~umask())
    tmp.replace(data)
    return {"file": f"{folder.name}/{WEIGHTS}", "tensors": index, "packed": packed}
