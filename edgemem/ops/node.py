"""The opaque `edgemem::<Op>` node an op writes while `torch.onnx.export` traces it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from edgemem.opset import DOMAIN, VERSION, Attributes, AttributeValue, node_attributes


def emit_node(
    op_type: str,
    table: Attributes,
    inputs: Sequence[torch.Tensor],
    attributes: Mapping[str, AttributeValue],
    dtypes: Sequence[torch.dtype],
    shapes: Sequence[Sequence[int]],
) -> list[torch.Tensor]:
    """One node with every attribute of `table`; returns its outputs (one per dtype / shape)."""
    return torch.onnx.ops.symbolic_multi_out(
        f"{DOMAIN}::{op_type}",
        list(inputs),
        attrs=node_attributes(op_type, table, attributes),
        dtypes=list(dtypes),
        shapes=[list(s) for s in shapes],
        version=VERSION,
    )
