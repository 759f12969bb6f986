"""A prefill graph for any length from a traced prefill that is exact within one segment (Titans MAC).

A layer whose segments run one after another (`prefill_segment` S > 0, edgemem.layers.base) traces
to a graph that is exact on a piece: tokens that do not cross a multiple of S positions.
`loop_over_segments` puts that graph, unchanged, in the body of an ONNX Loop. With p the position
of row 0, T the number of tokens and d = p mod S, iteration i runs the piece graph on tokens
[max(0, iS − d), min(T, (i+1)S − d)), ⌈(d + T)/S⌉ iterations, carrying the state. Each piece's output is padded to S rows, its place in the segment grid, so the stacked
scan outputs flattened over (segment, row) hold the T rows at [d, d + T). The piece graph's weights
stay initializers of the outer graph, which the body reads from its enclosing scope. Rows whose
position differs from row 0's by a multiple of S are placed alike; any other row would need other
pieces, and its floating-point outputs come out NaN rather than quietly wrong (the runtime prefills
one stream per run; the PyTorch layer refuses such a batch).
"""  # noqa: E501

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import onnx
import torch
from onnx import TensorProto, helper

from edgemem.errors import EdgememError
from edgemem.export.graphs import input_name
from edgemem.opset import Graph


def prefill_segment(model: Any) -> int | None:
    """How `model`'s prefill exports: 0 as one graph for any length; S > 0 as a Loop over segments of S
    positions (`loop_over_segments`); None not at all (a layer loops with no segment: prompts are stepped)."""
    if getattr(model, "parallel_prefill", True):
        return 0
    return int(getattr(model, "prefill_segment", 0)) or None


def position_input(model: Any) -> str:
    """The graph input of `model`'s stream position (the first int64 state of kind `position`), by which
    a prompt's segments are placed."""
    for key, tensor in model.init_state(1).items():
        if key.rpartition(".")[2] == "position" and tensor.dtype == torch.int64:
            return input_name(key)
    raise EdgememError(
        f"{type(model).__name__} prefills segment by segment but has no int64 `position` state to "
        "place a prompt's segments by"
    )


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """`graph` and every subgraph inside it."""
    yield graph
    for node in graph.node:
        for a in node.attribute:
            for sub in [a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs:
                yield from _graphs(sub)


def _names(graph: onnx.GraphProto) -> set[str]:
    names = set()
    for g in _graphs(graph):
        names.update(v.name for v in [*g.input, *g.output, *g.initializer])
        for node in g.node:
            names.update([node.name, *node.input, *node.output])
    return names


def _renamed(node: onnx.NodeProto, names: dict[str, str]) -> onnx.NodeProto:
    """A copy of `node` reading and writing `names[x]` for every x in `names`, in its subgraphs too."""
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    subgraphs = [
        g
        for a in copy.attribute
        for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs)
        for g in _graphs(sub)
    ]
    for n in [copy, *(n for g in subgraphs for n in g.node)]:
        n.input[:] = [names.get(x, x) for x in n.input]
        n.output[:] = [names.get(x, x) for x in n.output]
    for v in (v for g in subgraphs for v in g.output):  # a subgraph may return an outer value as it is
        v.name = names.get(v.name, v.name)
    return copy


def _elem_type(value: onnx.ValueInfoProto) -> int:
    return value.type.tensor_type.elem_type


def loop_over_segments(piece: onnx.ModelProto, segment: int, position: str, tokens: Sequence[str]) -> onnx.ModelProto:
    """The prefill graph for any number of tokens from `piece`, the prefill graph exact within one segment of
    `segment` positions; `position`: the state input holding the stream position (int64 `[B]`); `tokens`: the
    per-token inputs `[B, T]` (the others are state, whose new values are the outputs after the first, in order)."""
    graph = piece.graph
    weights = {t.name for t in graph.initializer}  # an input that is also an initializer (a tied table) is no state
    inputs = [i.name for i in graph.input if i.name not in weights]
    missing = [n for n in (position, *tokens) if n not in inputs]
    if missing or segment < 1:
        raise EdgememError(f"cannot loop over segments of {segment} positions: the piece graph lacks {missing}")
    state_in = [n for n in inputs if n not in tokens]
    result, *state_out = graph.output
    if len(state_out) != len(state_in):
        raise EdgememError(f"the piece graph has {len(state_in)} state inputs but {len(state_out)} new states")
    dims = result.type.tensor_type.shape.dim
    rank, rest = len(dims), [d.dim_value if d.HasField("dim_value") else -1 for d in dims[2:]]
    if rank < 2 or rest.count(-1) > 1:
        raise EdgememError(
            f"the piece graph's output {result.name} is not [batch, tokens, ...] with at most one "
            f"dim after the tokens of unknown size: {rank} dims, {rest}"
        )

    g = Graph({})
    g.reserve(*(_names(graph) - {o.name for o in graph.output}))  # the outer graph's outputs keep their names
    size = g.const(segment, out="segment")
    # d: the positions of the first segment done before this prompt
    start = g.Mod(g.Gather(position, g.const(0), axis=0), size, out="segment_offset")
    length = g.Gather(g.Shape(tokens[0]), g.const(1), axis=0, out="length")
    trips = g.Div(g.Add(g.Add(start, length), g.const(segment - 1)), size, out="segments")

    cond, i = g.fresh("cond_in"), g.fresh("segment_index")
    carried = [g.fresh(f"{n}_carried") for n in state_in]

    def body(sub: Graph) -> list[str]:
        first = sub.Sub(sub.Mul(i, size), start, out="piece_grid_start")  # the segment's first row in prompt rows
        lo = sub.Max(first, sub.const(0), out="piece_start")
        hi = sub.Min(sub.Add(first, size), length, out="piece_end")
        axis, zero = sub.const([1]), sub.const([0])
        bounds = [sub.Unsqueeze(b, zero) for b in (lo, hi)]
        names = {t: sub.Slice(t, *bounds, axis, out=f"{t}_piece") for t in tokens}
        names.update(zip(state_in, carried))
        names.update({o.name: sub.fresh(f"{o.name}_piece") for o in graph.output})
        for node in graph.node:
            sub.nodes.append(_renamed(node, names))
            sub.produced.update(sub.nodes[-1].output)
        front = sub.Sub(lo, first, out="pad_front")
        back = sub.Sub(sub.Sub(size, front), sub.Sub(hi, lo), out="pad_back")
        others = [sub.const([0] * (rank - 2))] if rank > 2 else []
        pads = sub.Concat(zero, sub.Unsqueeze(front, zero), *others, zero, sub.Unsqueeze(back, zero), *others, axis=0)
        # flat: runtimes that stack the scan outputs on a new axis (onnxruntime, the ONNX spec) and those
        # that concatenate them on the first (onnx.reference) agree on 1-D ones
        padded = sub.Reshape(sub.Pad(names[result.name], pads), sub.const([-1]), out=f"{result.name}_padded")
        return [sub.Identity(cond, out="cond_out"), *(sub.Identity(names[o.name]) for o in state_out), padded]

    types = {v.name: _elem_type(v) for v in graph.input}
    formal = [(i, TensorProto.INT64, []), (cond, TensorProto.BOOL, [])]
    formal += [(c, types[n], None) for c, n in zip(carried, state_in)]
    out_types = [TensorProto.BOOL, *(_elem_type(o) for o in state_out), _elem_type(result)]
    loop_body = g.subgraph("segment", body, formal, out_types)
    finals = g.node(
        "Loop",
        [trips, g.const(True), *state_in],
        [*(f"{o.name}_looped" for o in state_out), "segment_outputs"],
        body=loop_body,
    )
    # [segments, B·S·…] → [segments, B, S, …] → [B, segments·S, …] → the prompt's rows [d, d + T)
    zero = g.const([0])
    batch = g.Shape(tokens[0], start=0, end=1)
    grid = g.Reshape(finals[-1], g.Concat(g.Unsqueeze(trips, zero), batch, g.const([segment, *rest]), axis=0))
    grid = g.Transpose(grid, perm=[1, 0, *range(2, rank + 1)])
    flat = g.Reshape(grid, g.Concat(batch, g.const([-1]), g.Shape(grid, start=3), axis=0))
    bounds = [g.Unsqueeze(b, zero) for b in (start, g.Add(start, length))]
    looped = [g.Slice(flat, *bounds, g.const([1]), out=f"{result.name}_looped"), *finals[:-1]]
    # a row whose position differs from row 0's modulo S needed other pieces: NaN, never a quietly wrong row
    offsets = g.Mod(position, size)
    same = g.Equal(offsets, g.Gather(offsets, g.const([0])), out="same_segment_offset")
    finals = []
    for value, o in zip(looped, graph.output):
        kind = _elem_type(o)
        if kind in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE):
            rows = g.Reshape(same, g.const([-1] + [1] * (len(o.type.tensor_type.shape.dim) - 1)))
            nan = g.const(float("nan"), dtype=helper.tensor_dtype_to_np_dtype(kind))
            finals.append(g.Where(rows, value, nan, out=o.name))
        else:
            finals.append(g.Identity(value, out=o.name))
    if finals != [o.name for o in graph.output]:  # a subgraph of the piece graph names an output: not the exporter's
        raise EdgememError(f"the piece graph's outputs {[o.name for o in graph.output]} could not keep their names")

    out = onnx.ModelProto()
    out.CopyFrom(piece)
    out.graph.ClearField("node")
    out.graph.ClearField("value_info")  # the piece graph's intermediate values now live in the Loop body
    out.graph.node.extend(g.nodes)
    return out


__all__ = ["loop_over_segments", "position_input", "prefill_segment"]
