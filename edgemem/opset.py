"""The ONNX definitions every edgemem op shares: the domain and version of its nodes, attribute
tables, and one builder for the model-local function that gives a node its body.

`Graph` writes a body the way ONNX reads: `g.MatMul(a, b, out="ab")` appends one node of the
default domain and returns its output's name. Names are unique over the body and all its If /
Loop subgraphs (a name that is taken gets a `_2`, `_3`, ... suffix), so a name says where a value
comes from. Imports neither torch nor, until a body is built, onnx.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from edgemem.errors import ConfigError

if TYPE_CHECKING:
    import onnx

DOMAIN = "edgemem"
VERSION = 1

AttributeValue = int | float | str | Sequence[int]


@dataclass(frozen=True)
class Attribute:
    """One attribute of an op: its kind (int | ints | float | string) and default (None: required)."""

    kind: str
    default: AttributeValue | None = None

    def cast(self, value: AttributeValue) -> AttributeValue:
        """`value` as the Python type ONNX stores for this kind."""
        if self.kind == "ints":
            return [int(x) for x in value]
        return {"int": int, "float": float, "string": str}[self.kind](value)


Attributes = Mapping[str, Attribute]


def node_attributes(op_type: str, table: Attributes, values: Mapping[str, AttributeValue]) -> dict:
    """The attributes an `edgemem::<op_type>` node carries: every one of `table`, cast to its kind."""
    if set(values) != set(table):
        raise ConfigError(f"{DOMAIN}::{op_type} takes attributes {sorted(table)}; got {sorted(values)}")
    return {name: spec.cast(values[name]) for name, spec in table.items()}


# A subgraph's contents: given its graph, the names of its outputs.
Build = Callable[["Graph"], Sequence[str]]
# A Loop body: given its graph, the iteration number and the carried values, (next carried, scan outputs).
LoopBody = Callable[["Graph", str, list[str]], tuple[Sequence[str], Sequence[str]]]


class Graph:
    """The nodes of a function body (or one of its subgraphs) over the attributes of `table`."""

    def __init__(self, table: Attributes, names: set[str] | None = None, consts: dict | None = None) -> None:
        self.table = table
        self.nodes: list[onnx.NodeProto] = []
        self.produced: set[str] = set()
        self._names = set() if names is None else names  # shared by a body and its subgraphs
        self._consts = {} if consts is None else consts  # unnamed constants in scope, by value

    def fresh(self, name: str | None = None) -> str:
        """A name no value of the body has: `name`, or `name` with a suffix; `_<n>` for None."""
        base = name or f"_{len(self._names)}"
        name, i = base, 1
        while name in self._names:
            i += 1
            name = f"{base}_{i}"
        self._names.add(name)
        return name

    def reserve(self, *names: str) -> None:
        """Names taken from outside, such as the function's inputs."""
        self._names.update(names)

    def node(self, op_type: str, inputs: Sequence[str], outputs: Sequence[str | None], **attrs) -> list[str]:
        from onnx import helper

        names = [self.fresh(o) for o in outputs]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=names[0], **attrs))
        self.produced.update(names)
        return names

    def __getattr__(self, op_type: str) -> Callable[..., str | list[str]]:
        """`g.<OpType>(*inputs, out=..., **attrs)`: one node; `out` a name (or None) gives one
        output and returns its name, a list of names (or None) gives those and returns the list."""
        if not op_type[:1].isupper():
            raise AttributeError(op_type)

        def add(*inputs: str, out: str | Sequence[str | None] | None = None, **attrs) -> str | list[str]:
            if out is None or isinstance(out, str):
                return self.node(op_type, inputs, [out], **attrs)[0]
            return self.node(op_type, inputs, out, **attrs)

        return add

    def const(self, value: float | Sequence[int], dtype: type | None = None, out: str | None = None) -> str:
        """A constant: a scalar for a number, 1-D for a list; int64, float32 or bool unless
        `dtype` says otherwise. Unnamed ones are made once per value and scope."""
        from onnx import numpy_helper

        array = np.asarray(value)
        array = array.astype(dtype or {"b": np.bool_, "i": np.int64, "f": np.float32}[array.dtype.kind])
        key = (array.dtype.str, array.shape, array.tobytes())
        if out is None and key in self._consts:
            return self._consts[key]
        name = self.Constant(value=numpy_helper.from_array(array), out=out)
        self._consts.setdefault(key, name)
        return name

    def attr(self, name: str, out: str | None = None) -> str:
        """The function attribute `name` as a constant: int64 / float32 / string scalar, int64 1-D for ints."""
        from onnx import AttributeProto, helper

        kind = self.table[name].kind
        field, proto_type = {
            "int": ("value_int", AttributeProto.INT),
            "ints": ("value_ints", AttributeProto.INTS),
            "float": ("value_float", AttributeProto.FLOAT),
            "string": ("value_string", AttributeProto.STRING),
        }[kind]
        (value,) = self.node("Constant", [], [out or name])
        self.nodes[-1].attribute.append(helper.make_attribute_ref(field, proto_type, ref_attr_name=name))
        return value

    def subgraph(
        self,
        name: str,
        build: Build,
        inputs: Sequence[tuple[str, int, list[int] | None]] = (),
        types: Sequence[int] | None = None,
    ) -> onnx.GraphProto:
        """A subgraph with formal `inputs` (name, element type, shape) and the outputs `build` returns,
        float32 unless `types` says otherwise; an outer value it returns passes an Identity."""
        from onnx import TensorProto, helper

        sub = Graph(self.table, self._names, dict(self._consts))
        sub.produced.update(n for n, _, _ in inputs)
        outs = [o if o in sub.produced else sub.Identity(o, out=f"{o}_out") for o in build(sub)]
        types = types or [TensorProto.FLOAT] * len(outs)
        return helper.make_graph(
            sub.nodes,
            self.fresh(name),
            [helper.make_tensor_value_info(n, t, shape) for n, t, shape in inputs],
            [helper.make_tensor_value_info(o, t, None) for o, t in zip(outs, types, strict=True)],
        )

    def branch(self, cond: str, then: Build, otherwise: Build, out: Sequence[str]) -> list[str]:
        """If(cond): the float32 values `out` from `then` or `otherwise`."""
        then_graph = self.subgraph(f"{out[0]}_then", then)
        else_graph = self.subgraph(f"{out[0]}_else", otherwise)
        return self.node("If", [cond], out, then_branch=then_graph, else_branch=else_graph)

    def loop(self, trip_count: str, carried: Sequence[str], body: LoopBody, out: Sequence[str]) -> list[str]:
        """Loop `trip_count` times over float32 `carried` values: `body` gets its graph, the
        iteration number and the carried values and returns the next ones and the scan outputs
        (float32, stacked on a new first axis). Returns `out`: the final carried values, then the scans."""
        from onnx import TensorProto

        t, cond = self.fresh("t"), self.fresh("cond_in")
        carried_in = [self.fresh(f"{name}_in") for name in carried]

        def build(sub: Graph) -> list[str]:
            next_carried, scans = body(sub, t, carried_in)
            return [sub.Identity(cond, out="cond_out"), *next_carried, *scans]

        formal = [(t, TensorProto.INT64, []), (cond, TensorProto.BOOL, [])]
        formal += [(n, TensorProto.FLOAT, None) for n in carried_in]
        types = [TensorProto.BOOL] + [TensorProto.FLOAT] * len(out)
        body_graph = self.subgraph(f"{out[0]}_body", build, formal, types)
        keep_going = self.const(True)  # explicit: onnx.reference runs no iteration without it
        return self.node("Loop", [trip_count, keep_going, *carried], out, body=body_graph)

    def function(
        self, op_type: str, inputs: Sequence[str], outputs: Sequence[str], opset: int, doc: str
    ) -> onnx.FunctionProto:
        """`edgemem::<op_type>` with these nodes as its body in the default domain at `opset`,
        declaring every attribute of the table (with its default, if any)."""
        from onnx import helper

        required = [name for name, spec in self.table.items() if spec.default is None]
        defaults = [helper.make_attribute(n, a.default) for n, a in self.table.items() if a.default is not None]
        missing = [o for o in outputs if o not in self.produced]
        if missing:
            raise ValueError(f"{DOMAIN}::{op_type}: the body does not produce {missing}")
        return helper.make_function(
            DOMAIN,
            op_type,
            list(inputs),
            list(outputs),
            self.nodes,
            [helper.make_opsetid("", opset)],
            attributes=required,
            attribute_protos=defaults,
            doc_string=doc,
        )


def body(op_type: str, inputs: Sequence[str], table: Attributes, opset: int, min_opset: int) -> Graph:
    """An empty body for `edgemem::<op_type>` over `inputs` at `opset`, refused below `min_opset`."""
    if opset < min_opset:
        raise ConfigError(f"{DOMAIN}::{op_type}: the function body needs opset >= {min_opset}; got {opset}")
    g = Graph(table)
    g.reserve(*inputs)
    return g
