"""Lowering: one exported model, one artifact per target.

- generic: edgemem nodes + their model-local functions (any ONNX runtime runs them).
- ort:     `LinearAttention` → onnxruntime's native `com.microsoft::LinearAttention` (same contract
           as ONNX opset 27; the inputs its update rule does not read are dropped); `CacheAttention`
           of a linear cache → `com.microsoft::GroupQueryAttention` (seqlens_k = position + T − 1
           per row): bound to one buffer as past and present, it writes the new rows in place and
           reads each row's filled part only. Its CPU kernel takes T > 1 with a past for batch 1 only.
- onnx27:  `LinearAttention` → `ai.onnx::LinearAttention`, the model moved to opset 27.
- trt:     every edgemem node gets `plugin_namespace` (the edgemem domain) and `plugin_version`
           (its version, as the string TensorRT's parser reads) and the edgemem functions are
           removed, so TensorRT's ONNX parser takes our plugins (TensorRT ≤ 10.6 would otherwise
           prefer a local function of the same name). `CacheAttention` has no plugin: its function
           body is inlined (standard ops).
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper, inliner, version_converter

from edgemem.errors import EdgememError
from edgemem.manifest import TARGETS
from edgemem.opset import DOMAIN, VERSION
from edgemem.ops import onnx_functions
from edgemem.ops.cache_attention import OP_TYPE as CACHE_ATTENTION
from edgemem.ops.linear_attention import ATTRIBUTES as LINEAR_ATTRIBUTES
from edgemem.ops.linear_attention import OP_TYPE as LINEAR_ATTENTION


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


def _group_query_attention(node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """`CacheAttention` of a linear cache as onnxruntime's GroupQueryAttention (float32, like the cache)."""
    query, key, value, past_key, past_value, position, _ = node.input
    output, present_key, present_value = node.output
    name = node.name or output
    n = {k: f"{name}/{k}" for k in ("one", "t", "total", "last", "seqlens", "max64", "max", "q", "k", "v", "y")}
    return [
        helper.make_node("Constant", [], [n["one"]], value=helper.make_tensor("one", TensorProto.INT64, [1], [1])),
        helper.make_node("Shape", [query], [n["t"]], start=1, end=2),
        helper.make_node("Add", [position, n["t"]], [n["total"]]),  # [B]: tokens per row after this run
        helper.make_node("Sub", [n["total"], n["one"]], [n["last"]]),
        helper.make_node("Cast", [n["last"]], [n["seqlens"]], to=TensorProto.INT32),
        helper.make_node("ReduceMax", [n["total"]], [n["max64"]], keepdims=0),
        helper.make_node("Cast", [n["max64"]], [n["max"]], to=TensorProto.INT32),
        *(helper.make_node("Cast", [src], [n[k]], to=TensorProto.FLOAT) for src, k in ((query, "q"), (key, "k"), (value, "v"))),
        helper.make_node(
            "GroupQueryAttention", [n["q"], n["k"], n["v"], past_key, past_value, n["seqlens"], n["max"]],
            [n["y"], present_key, present_value], name=name, domain="com.microsoft",
            num_heads=_attr(node, "num_heads"), kv_num_heads=_attr(node, "kv_num_heads"), scale=_attr(node, "scale"),
        ),
        helper.make_node("CastLike", [n["y"], query], [output]),
    ]


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


def lower(model: onnx.ModelProto, target: str) -> onnx.ModelProto:
    """A copy of `model` lowered for `target` (one of TARGETS)."""
    if target not in TARGETS:
        raise EdgememError(f"unknown target {target!r}; known: {', '.join(TARGETS)}")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes = [n for n in out.graph.node if n.domain == DOMAIN]
    if target == "ort":
        for node in nodes:
            if node.op_type == LINEAR_ATTENTION:
                _standard_linear_attention(node, "com.microsoft")
        graph = []
        for node in out.graph.node:
            in_place = node.domain == DOMAIN and node.op_type == CACHE_ATTENTION and _attr(node, "sinks") < 0
            graph.extend(_group_query_attention(node) if in_place else [node])
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
        out.functions.extend(fresh[f.name] if f.domain == DOMAIN else f for f in functions if f.domain != DOMAIN or f.name in used)
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
    return out
