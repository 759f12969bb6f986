"""Which nodes of an exported graph are INT8/INT4 projections, and the float boundary around state.

A projection is a MatMul/Gemm of the main graph (or of a Loop body, for dynamic INT8) whose B is a weight (an initializer) and whose
activation input is neither a state tensor nor a tensor that a custom node (edgemem's ops, or
their com.microsoft lowering) reads or writes. Everything else stays float: state inputs and
outputs, the recurrence inside custom nodes and their local-function bodies, decays, gates, norms.
"""  # noqa: E501

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from fnmatch import fnmatchcase

import onnx

PROJECTION_OPS = ("MatMul", "Gemm")
QUANT_OPS = frozenset(
    {
        "QuantizeLinear",
        "DequantizeLinear",
        "DynamicQuantizeLinear",
        "MatMulInteger",
        "QLinearMatMul",
        "MatMulIntegerToFloat",
        "DynamicQuantizeMatMul",
        "QGemm",
        "MatMulNBits",
        "GatherBlockQuantized",
    }
)
_STANDARD_DOMAINS = ("", "ai.onnx")


@dataclass(frozen=True)
class Projection:
    node: str  # node name (what onnxruntime.quantization selects by)
    op_type: str  # MatMul or Gemm
    module: str  # PyTorch module path from the exporter's metadata, e.g. model.blocks.0.mixer.qkv; "" if absent
    tensors: tuple[str, ...]  # inputs and outputs
    quantizable: bool  # False when structurally excluded (no weight, or touching state / a custom node)
    head: bool = False  # a Gemm reading its weight transposed: the tied output head (see _head)

    def names(self) -> tuple[str, ...]:
        return (self.node, self.module, *self.tensors)

    def matches(self, pattern: str) -> bool:
        return any(name and fnmatchcase(name, pattern) for name in self.names())


def is_custom(node: onnx.NodeProto) -> bool:
    """A custom-domain node that is not a quantization op (edgemem's ops and their lowerings)."""
    return node.domain not in _STANDARD_DOMAINS and node.op_type not in QUANT_OPS


def all_graphs(model: onnx.ModelProto) -> Iterator[tuple[str, list[onnx.NodeProto]]]:
    """(where, nodes) of the main graph, every subgraph in node attributes, and every local function."""

    def walk(where: str, nodes: list[onnx.NodeProto]) -> Iterator[tuple[str, list[onnx.NodeProto]]]:
        yield where, nodes
        for node in nodes:
            for attr in node.attribute:
                for i, graph in enumerate([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                    yield from walk(f"{where}/{node.name}.{attr.name}[{i}]", list(graph.node))

    yield from walk("graph", list(model.graph.node))
    for function in model.functions:
        yield from walk(f"function {function.domain}::{function.name}", list(function.node))


def protected_tensors(model: onnx.ModelProto, state_names: set[str]) -> set[str]:
    """State tensors plus every input and output of a custom node (main graph)."""
    protected = set(state_names)
    for node in model.graph.node:
        if is_custom(node):
            protected.update(n for n in (*node.input, *node.output) if n)
    return protected


def _module(node: onnx.NodeProto) -> str:
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            try:
                scopes = ast.literal_eval(prop.value)
            except (ValueError, SyntaxError):
                return ""
            return str(scopes[-2]) if isinstance(scopes, list) and len(scopes) >= 2 else ""
    return ""


def _head(node: onnx.NodeProto) -> bool:
    """A Gemm reading its weight transposed: the tied output head as edgemem.export.lower writes it."""
    return node.op_type == "Gemm" and any(a.name == "transB" and a.i for a in node.attribute)


def _transposed_weights(model: onnx.ModelProto) -> dict[str, str]:
    """{output: initializer} of 2-D Transposes of an initializer: a tied output head reads the embedding so when the
    exporter did not fold the transpose (it leaves large tensors alone)."""
    shapes = {i.name: len(i.dims) for i in model.graph.initializer}
    return {
        n.output[0]: n.input[0]
        for n in model.graph.node
        if n.op_type == "Transpose" and n.domain in _STANDARD_DOMAINS and shapes.get(n.input[0]) == 2
    }


def graph_bodies(model: onnx.ModelProto) -> Iterator[list[onnx.NodeProto]]:
    """The nodes of the main graph and of every subgraph a node holds (a Loop's body: the segment loop of a
    MAC or HOPE prefill), local functions left out."""
    for where, nodes in all_graphs(model):
        if not where.startswith("function"):
            yield nodes


def projections(
    model: onnx.ModelProto, state_names: set[str], *, transposed: bool = False, subgraphs: bool = False
) -> list[Projection]:
    """Every MatMul/Gemm of the main graph (with `subgraphs`, of the Loop bodies too: their weights are the
    main graph's), marked quantizable or not (see the module docstring). With `transposed`, a weight read
    transposed (a Transpose, or the tied head's Gemm; see `fold_transposed_weights`) counts as a weight."""
    weights = {i.name for i in model.graph.initializer}
    weights |= {
        n.output[0]
        for nodes in graph_bodies(model)
        for n in nodes
        if n.op_type == "Constant" and n.domain in _STANDARD_DOMAINS
    }
    if transposed:
        weights |= set(_transposed_weights(model))
    protected = protected_tensors(model, state_names)
    found = []
    for node in (n for nodes in graph_bodies(model) for n in nodes) if subgraphs else model.graph.node:
        if node.op_type not in PROJECTION_OPS or node.domain not in _STANDARD_DOMAINS:
            continue
        ok = len(node.input) >= 2 and node.input[1] in weights and node.input[0] not in weights
        ok = ok and (transposed or not _head(node))
        ok = ok and not protected & {node.input[0], *node.output}
        found.append(
            Projection(
                node.name,
                node.op_type,
                _module(node),
                (*filter(None, node.input), *node.output),
                ok and bool(node.name),
                _head(node),
            )
        )
    return found


def boundary_violations(model: onnx.ModelProto, state_names: set[str]) -> list[str]:
    """Quantization nodes that touch a state tensor or a custom node's tensors, or sit inside a local function."""
    protected = protected_tensors(model, state_names)
    problems = []
    for where, nodes in all_graphs(model):
        for node in nodes:
            if node.op_type not in QUANT_OPS:
                continue
            if where.startswith("function"):
                problems.append(f"{where}: {node.op_type} {node.name} inside a custom op's body")
            touched = protected & {*node.input, *node.output}
            if touched:
                problems.append(f"{where}: {node.op_type} {node.name} touches {', '.join(sorted(touched))}")
    return problems


def quantized_projections(model: onnx.ModelProto) -> int:
    """Quantized projections: MatMul/Gemm fed by a DequantizeLinear (QDQ), integer matmuls (dynamic), MatMulNBits (int4)."""  # noqa: E501
    nodes = [n for body in graph_bodies(model) for n in body]
    produced_by = {o: n.op_type for n in nodes for o in n.output}
    count = 0
    for node in nodes:
        if node.op_type in ("MatMulInteger", "DynamicQuantizeMatMul", "QLinearMatMul", "QGemm", "MatMulNBits"):
            count += 1
        elif node.op_type in PROJECTION_OPS and node.input and produced_by.get(node.input[0]) == "DequantizeLinear":
            count += 1
    return count


def isolate_inputs(model: onnx.ModelProto, nodes: list[str]) -> int:
    """Give each of `nodes` whose activation input is also read elsewhere its own copy (an Identity).

    onnxruntime's QDQ quantizer rewires every reader of a quantized tensor to the dequantized value,
    so without this a float-only reader (a kept-float projection, a gate) would see INT8-rounded
    input. Modifies `model`; returns the number of Identity nodes inserted."""
    chosen = set(nodes)
    readers: dict[str, int] = {}
    for node in model.graph.node:
        for name in set(node.input):
            readers[name] = readers.get(name, 0) + 1
    outputs = {o.name for o in model.graph.output}
    graph_nodes: list[onnx.NodeProto] = []
    inserted = 0
    for node in model.graph.node:
        if node.name in chosen and (readers.get(node.input[0], 0) > 1 or node.input[0] in outputs):
            copy = f"{node.name}.input"
            graph_nodes.append(onnx.helper.make_node("Identity", [node.input[0]], [copy], name=f"{node.name}.isolate"))
            node.input[0] = copy
            inserted += 1
        graph_nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(graph_nodes)
    return inserted


def fold_transposed_weights(model: onnx.ModelProto, nodes: list[str]) -> int:
    """Give each MatMul of `nodes` that reads a transposed initializer, and each tied head's Gemm (as a MatMul),
    its own transposed copy as an initializer (what a weight-only quantizer needs); a Transpose no longer read
    is dropped. Modifies `model` (its weights must be loaded); returns the number of weights folded."""
    from onnx import numpy_helper

    sources = _transposed_weights(model)
    values = {i.name: i for i in model.graph.initializer}
    chosen = set(nodes)
    folded = 0
    for node in model.graph.node:
        if node.name not in chosen:
            continue
        if _head(node) and node.input[1] in values:  # Gemm(x, W, transB=1) → MatMul(x, Wᵀ)
            sources[node.input[1]] = node.input[1]
            node.op_type = "MatMul"
            del node.attribute[:]
        if node.op_type == "MatMul" and node.input[1] in sources:
            name = f"{sources[node.input[1]]}.transposed"
            if name not in values:
                array = numpy_helper.to_array(values[sources[node.input[1]]]).T.copy()
                values[name] = numpy_helper.from_array(array, name)
                model.graph.initializer.append(values[name])
            node.input[1] = name
            folded += 1
    read = {name for n in model.graph.node for name in n.input} | {o.name for o in model.graph.output}
    kept = [
        n
        for n in model.graph.node
        if not (n.op_type == "Transpose" and n.output[0] in sources and n.output[0] not in read)
    ]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    return folded


def embedding_tables(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Main-graph Gathers that look rows up (axis 0) in a 2-D float32 initializer by ids the graph computes:
    the token embedding (and learned position tables)."""
    tables = {i.name for i in model.graph.initializer if len(i.dims) == 2 and i.data_type == onnx.TensorProto.FLOAT}
    constants = {i.name for i in model.graph.initializer}
    return [
        n
        for n in model.graph.node
        if n.op_type == "Gather"
        and n.domain in _STANDARD_DOMAINS
        and n.input[0] in tables
        and n.input[1] not in constants
        and all(a.i == 0 for a in n.attribute if a.name == "axis")
    ]
