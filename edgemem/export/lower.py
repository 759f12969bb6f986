"""Lowering: one exported model, one artifact per target.

- generic: edgemem nodes + their model-local functions (any ONNX runtime runs them).
- ort:     `LinearAttention` → onnxruntime's native `com.microsoft::LinearAttention` (same contract
           as ONNX opset 27; the inputs its update rule does not read are dropped); `CacheAttention`
           of a linear cache → `com.microsoft::GroupQueryAttention` (seqlens_k = position + T − 1
           per row): bound to one buffer as past and present, it writes the new rows in place and
           reads each row's filled part only. Its CPU kernel takes T > 1 with a past for batch 1 only.
           A batch-1 step folds the query heads of each KV head into tokens (one read of the cache).
- onnx27:  `LinearAttention` → `ai.onnx::LinearAttention`, the model moved to opset 27.
- trt:     every edgemem node gets `plugin_namespace` (the edgemem domain) and `plugin_version`
           (its version, as the string TensorRT's parser reads) and the edgemem functions are
           removed, so TensorRT's ONNX parser takes our plugins (TensorRT ≤ 10.6 would otherwise
           prefer a local function of the same name). `CacheAttention` has no plugin: its function
           body is inlined (standard ops).

A tied output head reads its table through Gemm(transB=1) on every target; where onnxruntime runs the
graph (generic, ort, onnx27) the table is listed among the inputs too (`read_table_in_place`).
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper, inliner, version_converter

from edgemem.errors import EdgememError
from edgemem.manifest import ORT_TARGETS, TARGETS
from edgemem.ops import onnx_functions
from edgemem.ops.cache_attention import OP_TYPE as CACHE_ATTENTION
from edgemem.ops.linear_attention import ATTRIBUTES as LINEAR_ATTRIBUTES
from edgemem.ops.linear_attention import OP_TYPE as LINEAR_ATTENTION
from edgemem.opset import DOMAIN, VERSION, Graph


def _attr(node: onnx.NodeProto, name: str):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    raise EdgememError(f"{node.op_type} node {node.name!r} lacks attribute {name!r}")


def _standard_linear_attention(node: onnx.NodeProto, domain: str) -> None:
    """edgemem's node always carries decay and beta; the standard contract forbids the unused ones."""
    rule = _attr(node, "update_rule").decode()
    inputs = list(node.input)
    if rule not in ("gated", "gated_delta"):
        inputs[4] = ""
    if rule not in ("delta", "gated_delta"):
        inputs[5] = ""
    while inputs[-1] == "":
        inputs.pop()
    del node.input[:]
    node.input.extend(inputs)
    keep = [a for a in node.attribute if a.name in LINEAR_ATTRIBUTES]
    del node.attribute[:]
    node.attribute.extend(keep)
    node.domain = domain


def _group_query_attention(node: onnx.NodeProto, names: set[str]) -> list[onnx.NodeProto]:
    """`CacheAttention` of a linear cache as onnxruntime's GroupQueryAttention (float32, like the
    cache); `names` holds every value name of the model and takes the new ones.

    A batch-1 step folds its query heads when a KV head serves G > 1 of them: onnxruntime's CPU
    kernel scores each query head on its own, so it would read each KV head G times. Folded, the G
    query heads of a KV head are G query tokens of one head (num_heads = kv_num_heads, sequence G):
    one G-row GEMM per KV head, one read of the cache. The kernel writes those G tokens' keys and
    values (the new ones, repeated) at slots p … p+G−1 and lets token i see slots up to p+i; an
    additive bias hides the slots past p, and the next tokens overwrite p+1 … p+G−1. Batches, blocks
    of tokens and the last G−1 slots of the cache take the plain form.
    """
    query, key, value, past_key, past_value, position, _ = node.input
    output, present_key, present_value = node.output
    heads, kv_heads, scale = _attr(node, "num_heads"), _attr(node, "kv_num_heads"), _attr(node, "scale")
    group = heads // kv_heads
    g = Graph({}, names)

    def attend(
        sub: Graph, q: str, k: str, v: str, last: str, total: str, num_heads: int, out: list, *bias: str
    ) -> list[str]:
        seqlens, total = sub.Cast(last, to=TensorProto.INT32), sub.Cast(total, to=TensorProto.INT32)
        extra = ("", "", "", *bias) if bias else ()
        return sub.GroupQueryAttention(
            q,
            k,
            v,
            past_key,
            past_value,
            seqlens,
            total,
            *extra,
            out=out,
            domain="com.microsoft",
            num_heads=num_heads,
            kv_num_heads=kv_heads,
            scale=scale,
        )

    total = g.Add(position, g.Shape(query, start=1, end=2))  # [B]: tokens per row after this run
    last, longest = g.Sub(total, g.const([1])), g.ReduceMax(total, keepdims=0)
    q, k, v = (g.Cast(x, to=TensorProto.FLOAT) for x in (query, key, value))
    outs = [f"{node.name or output}/y", present_key, present_value]
    if group == 1:
        y = attend(g, q, k, v, last, longest, heads, outs)[0]
    else:
        end = g.Add(longest, g.const(group - 1))  # p + G
        one_token = g.Equal(g.Mul(g.Shape(query, start=0, end=1), g.Shape(query, start=1, end=2)), g.const([1]))
        fits = g.LessOrEqual(g.Unsqueeze(end, g.const([0])), g.Shape(past_key, start=2, end=3))

        def fold(sub: Graph) -> list[str]:
            # [1, 1, H_kv*G*D] → [1, G, H_kv*D]: token i, head j is query head j*G + i
            folded = sub.Reshape(
                sub.Transpose(sub.Reshape(q, sub.const([1, 1, kv_heads, group, -1])), perm=[0, 1, 3, 2, 4]),
                sub.const([1, group, -1]),
            )
            kf, vf = (sub.Tile(x, sub.const([1, group, 1])) for x in (k, v))
            late = sub.Greater(sub.Range(sub.const(0), end, sub.const(1)), position)
            bias = sub.Expand(
                sub.Reshape(sub.Where(late, sub.const(float("-inf")), sub.const(0.0)), sub.const([1, 1, 1, -1])),
                sub.const([1, 1, group, 1]),
            )  # [1, 1, G, p+G]
            y, pk, pv = attend(
                sub, folded, kf, vf, sub.Add(last, sub.const(group - 1)), end, kv_heads, [None] * 3, bias
            )
            y = sub.Reshape(
                sub.Transpose(sub.Reshape(y, sub.const([1, group, kv_heads, -1])), perm=[0, 2, 1, 3]),
                sub.const([1, 1, -1]),
            )
            return [y, pk, pv]

        def plain(sub: Graph) -> list[str]:
            return attend(sub, q, k, v, last, longest, heads, [None] * 3)

        y = g.branch(g.Squeeze(g.And(one_token, fits)), fold, plain, outs)[0]
    g.CastLike(y, query, out=output)
    return g.nodes


def _value_names(graph: onnx.GraphProto) -> set[str]:
    names = {v.name for v in (*graph.input, *graph.output)} | {t.name for t in graph.initializer}
    return names | {x for n in graph.node for x in (*n.input, *n.output, n.name)}


def _prune(model: onnx.ModelProto) -> None:
    """Drop edgemem functions no node calls, and the edgemem opset if nothing uses it."""
    used = {n.op_type for n in model.graph.node if n.domain == DOMAIN}
    keep = [f for f in model.functions if f.domain != DOMAIN or f.name in used]
    del model.functions[:]
    model.functions.extend(keep)
    if not used:
        keep_opsets = [o for o in model.opset_import if o.domain != DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(keep_opsets)


def _set_opset(model: onnx.ModelProto, domain: str, version: int) -> None:
    for o in model.opset_import:
        if o.domain == domain:
            o.version = version
            return
    model.opset_import.append(helper.make_opsetid(domain, version))


def _subgraph_names(node: onnx.NodeProto) -> set[str]:
    """Every value name the subgraphs of `node` (If branches, Loop and Scan bodies) read, nested ones too."""
    names: set[str] = set()
    for attr in node.attribute:
        for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
            for inner in sub.node:
                names.update(inner.input)
                names |= _subgraph_names(inner)
    return names


def leaves_last(graph: onnx.GraphProto) -> None:
    """Move the nodes nothing in `graph` reads (those that only write graph outputs: a layer's new state, the
    logits) to the end, the first to be ready last; the graph stays topologically sorted and computes the same.
    onnxruntime's default execution order walks back depth-first from the last of these nodes first, so
    each now runs right after the layer that feeds it and its input is freed there: written where the
    exporter put it, a layer's new convolution state ran after the logits, and every layer's [T, channels]
    input to it stayed alive through the whole run (benchmarks/README.md, "Footprint")."""
    read = {name for node in graph.node for name in (*node.input, *_subgraph_names(node))}
    made = {name: i for i, node in enumerate(graph.node) for name in node.output}
    leaves = [node for node in graph.node if not read & set(node.output)]
    leaves.sort(key=lambda node: max((made.get(name, -1) for name in node.input), default=-1))  # as they become ready
    others = [node for node in graph.node if read & set(node.output)]
    del graph.node[:]
    graph.node.extend(others + leaves[::-1])


def _tied_head_as_gemm(graph: onnx.GraphProto) -> None:
    """MatMul(x, Transpose(W)) of a 2-D initializer W (a tied output head reading the embedding table) as
    Gemm(x, W, transB=1) on x flattened to 2-D: onnxruntime folds a Transpose of an initializer into a
    transposed copy in every session, a second table per graph. The Gemm keeps the MatMul's name."""
    inits = {i.name: i for i in graph.initializer}
    transposes = {
        n.output[0]: n
        for n in graph.node
        if n.op_type == "Transpose"
        and n.domain in ("", "ai.onnx")
        and len(getattr(inits.get(n.input[0]), "dims", ())) == 2
    }
    readers: dict[str, list[onnx.NodeProto | None]] = {}
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in transposes:
                readers.setdefault(name, []).append(node if node.op_type == "MatMul" and i == 1 else None)
        for name in _subgraph_names(node) & transposes.keys():  # read inside a branch or loop body: keep it
            readers.setdefault(name, []).append(None)
    heads = {t for t, nodes in readers.items() if None not in nodes}
    if not heads:
        return
    rewritten: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.op_type == "Transpose" and node.output[0] in heads:
            continue
        if node.op_type != "MatMul" or node.input[1] not in heads:
            rewritten.append(node)
            continue
        x, weight, y = node.input[0], transposes[node.input[1]].input[0], node.output[0]
        rows, cols = inits[weight].dims
        consts = {f"{y}/flat": [-1, cols], f"{y}/cols": [rows], f"{y}/start": [0], f"{y}/end": [-1]}
        graph.initializer.extend(helper.make_tensor(k, TensorProto.INT64, [len(v)], v) for k, v in consts.items())
        gemm = helper.make_node("Gemm", [f"{y}/x2", weight], [f"{y}/y2"], name=node.name, transB=1)
        gemm.metadata_props.extend(node.metadata_props)
        rewritten += [
            helper.make_node("Shape", [x], [f"{y}/shape"]),
            helper.make_node("Slice", [f"{y}/shape", f"{y}/start", f"{y}/end"], [f"{y}/lead"]),
            helper.make_node("Reshape", [x, f"{y}/flat"], [f"{y}/x2"]),
            gemm,
            helper.make_node("Concat", [f"{y}/lead", f"{y}/cols"], [f"{y}/shape_out"], axis=0),
            helper.make_node("Reshape", [f"{y}/y2", f"{y}/shape_out"], [y]),
        ]
    del graph.node[:]
    graph.node.extend(rewritten)


def read_table_in_place(graph: onnx.GraphProto) -> None:
    """List a tied head's table (the weight of a Gemm(transB=1) that another node, the embedding lookup, also
    reads) among the graph's inputs as well. onnxruntime takes an initializer that is also an input as
    overridable: it neither pre-packs it nor folds through it, so the head reads the one mapped table in place,
    where a packed copy would sit beside the table pages the lookups map. For the graphs onnxruntime runs
    (`ORT_TARGETS`; TensorRT packs what it builds from); idempotent."""
    tables = {t.name: t for t in graph.initializer if len(t.dims) == 2}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in {*node.input, *_subgraph_names(node)}:
            readers[name] = readers.get(name, 0) + 1
    listed = {v.name for v in graph.input}
    for node in graph.node:
        weight = node.input[1] if node.op_type == "Gemm" and len(node.input) > 1 else ""
        transposed = any(a.name == "transB" and a.i for a in node.attribute)
        if transposed and weight in tables and weight not in listed and readers[weight] > 1:
            table = tables[weight]
            graph.input.append(helper.make_tensor_value_info(weight, table.data_type, list(table.dims)))
            listed.add(weight)


_HEAD_OPS = ("MatMul", "Gemm")
_PASS_THROUGH = ("Cast", "Identity")  # between the head and the logits output


def last_position_logits(model: onnx.ModelProto, output: str) -> onnx.ModelProto | None:
    """A copy of the prefill graph `model` whose head projects only the last position: `output` becomes
    [batch, 1, vocab] (the runtime's prefill when it wants the next token's logits only; the [T, V] logits
    of a long chunk are the prefill's largest tensor). The head is the MatMul that `output` comes from
    (through Cast/Identity); its activation input [batch, sequence, d] is sliced to the last row. None when
    `output` does not come from such a MatMul."""
    producers = {o: n for n in model.graph.node for o in n.output}
    node, path = producers.get(output), {output}
    while node is not None and node.op_type in _PASS_THROUGH and node.domain in ("", "ai.onnx"):
        path.add(node.input[0])
        node = producers.get(node.input[0])
    if node is None or node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
        return None
    out = onnx.ModelProto()
    out.CopyFrom(model)
    head = next(n for n in out.graph.node if n.output == node.output)
    x = head.input[0]
    last = f"{x}/last"
    consts = {f"{last}/start": [-1], f"{last}/end": [2**62], f"{last}/axis": [1]}
    out.graph.initializer.extend(helper.make_tensor(k, TensorProto.INT64, [1], v) for k, v in consts.items())
    nodes = []
    for n in out.graph.node:
        if n is head:
            nodes.append(helper.make_node("Slice", [x, *consts], [last], name=f"{head.name}/last"))
            n.input[0] = last
        nodes.append(n)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    for value in out.graph.output:
        if value.name == output and len(value.type.tensor_type.shape.dim) == 3:
            dim = value.type.tensor_type.shape.dim[1]
            dim.Clear()
            dim.dim_value = 1
    kept = [v for v in out.graph.value_info if v.name not in path]  # the sliced path's shapes changed
    del out.graph.value_info[:]
    out.graph.value_info.extend(kept)
    return out


def lower(model: onnx.ModelProto, target: str) -> onnx.ModelProto:
    """A copy of `model` lowered for `target` (one of TARGETS); a tied output head reads its table
    through Gemm(transB=1) on every target, in place where onnxruntime runs it (`read_table_in_place`)."""
    if target not in TARGETS:
        raise EdgememError(f"unknown target {target!r}; known: {', '.join(TARGETS)}")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    _tied_head_as_gemm(out.graph)
    nodes = [n for n in out.graph.node if n.domain == DOMAIN]
    if target == "ort":
        for node in nodes:
            if node.op_type == LINEAR_ATTENTION:
                _standard_linear_attention(node, "com.microsoft")
        names = _value_names(out.graph)
        graph = []
        for node in out.graph.node:
            in_place = node.domain == DOMAIN and node.op_type == CACHE_ATTENTION and _attr(node, "sinks") < 0
            if in_place:
                names.difference_update(node.output)
            graph.extend(_group_query_attention(node, names) if in_place else [node])
        del out.graph.node[:]
        out.graph.node.extend(graph)
        if any(n.domain == "com.microsoft" for n in out.graph.node):
            _set_opset(out, "com.microsoft", 1)
        _prune(out)
    elif target == "onnx27":
        functions = list(out.functions)
        del out.functions[:]
        out = version_converter.convert_version(out, 27)
        for node in out.graph.node:
            if node.domain == DOMAIN and node.op_type == LINEAR_ATTENTION:
                _standard_linear_attention(node, "")
        used = {n.op_type for n in out.graph.node if n.domain == DOMAIN}
        fresh = onnx_functions(27, sorted(used))
        out.functions.extend(
            fresh[f.name] if f.domain == DOMAIN else f for f in functions if f.domain != DOMAIN or f.name in used
        )
        _prune(out)
    elif target == "trt":
        if any(n.op_type == CACHE_ATTENTION for n in nodes):
            out = inliner.inline_selected_functions(out, [(DOMAIN, CACHE_ATTENTION)])
            nodes = [n for n in out.graph.node if n.domain == DOMAIN]
        plugin = [
            helper.make_attribute("plugin_namespace", DOMAIN),
            helper.make_attribute("plugin_version", str(VERSION)),
        ]
        for node in nodes:
            node.attribute.extend(plugin)
        keep = [f for f in out.functions if f.domain != DOMAIN]
        del out.functions[:]
        out.functions.extend(keep)
    if target in ORT_TARGETS:
        read_table_in_place(out.graph)
    leaves_last(out.graph)
    return out
