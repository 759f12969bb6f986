"""Trace a stateful model into two ONNX graphs: prefill (any length) and step (one token).

Both graphs take `input_ids` (and any per-token inputs the model declares, see `graph_io`) and
every state tensor and return `logits` (or the model's own output name) and every new state,
so a prompt is prefilled and then streamed. The layers' ops emit one opaque `edgemem::<Op>`
node each under the exporter; their model-local functions are attached here.
"""

from __future__ import annotations

import logging
import warnings

import onnx
import torch
from onnx import helper
from torch import nn

from edgemem.errors import EdgememError
from edgemem.ops import CONTRACTS, onnx_functions
from edgemem.opset import DOMAIN, VERSION

log = logging.getLogger(__name__)


def input_name(key: str) -> str:
    return f"past_key_values.{key}"


def output_name(key: str) -> str:
    return f"present.{key}"


def graph_io(model: nn.Module) -> tuple[dict[str, torch.dtype], str]:
    """The model's per-token inputs besides `input_ids` (`model.extra_inputs`, name → dtype, each
    `[B, T]` and passed to `prefill` by keyword; none by default) and the name of its first
    output (`model.output_name`, "logits" by default)."""
    return dict(getattr(model, "extra_inputs", {})), str(getattr(model, "output_name", "logits"))


def written_states(model: nn.Module, names: list[str]) -> list[str]:
    """The states a graph outputs: all but those the model only reads (`model.read_only`, e.g. an
    encoder-decoder's cross keys/values, set once by its encoder)."""
    read_only = set(getattr(model, "read_only", ()))
    return [n for n in names if n not in read_only]


class _Graph(nn.Module):
    """Flat positional I/O around `model.prefill`, as the exporter needs it."""

    def __init__(self, model: nn.Module, names: list[str], extras: list[str]):
        super().__init__()
        self.model, self.names, self.extras = model, names, extras
        self.written = written_states(model, names)

    def forward(self, input_ids: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        extras, state = dict(zip(self.extras, rest)), rest[len(self.extras) :]
        out, new = self.model.prefill(input_ids, dict(zip(self.names, state)), **extras)
        if out.dtype == torch.bfloat16:  # a bf16 export's logits reach the host as float32: numpy has no bfloat16
            out = out.float()
        return (out, *(new[n] for n in self.written))


TRACE_TOKENS = 5  # the longest example stream an export prefills: a preallocated KV cache must hold it


EXAMPLE_SIZE = 7  # the size a state dim set per stream (`model.state_dims`) takes in the tracing examples


def example_state(model: nn.Module, batch: int, tokens: int, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The state after `tokens` random tokens: a real, mid-stream example for tracing. The dims a
    model sets per stream (`state_dims`, e.g. an encoder-decoder's cross keys) get random values of
    `EXAMPLE_SIZE`, as if an input had been encoded."""
    state = model.init_state(batch, dtype=dtype)
    generator = torch.Generator().manual_seed(2)
    for name, dims in getattr(model, "state_dims", {}).items():
        shape = [EXAMPLE_SIZE if d in dims else n for d, n in enumerate(state[name].shape)]
        state[name] = torch.randn(shape, generator=generator, dtype=state[name].dtype)
    if tokens and getattr(model, "streaming", True):
        ids = torch.randint(0, model.config.vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            _, state = model.prefill(ids, state)
    return state


def named_dims(model: nn.Module, dtype: torch.dtype | None) -> dict[str, dict[int, str]]:
    """Per state tensor, its dims (besides batch) of no fixed size, by name: "past_sequence" for a
    growing KV cache, and those the model sets per stream (`model.state_dims`)."""
    dims = {k: {d: "past_sequence" for d in v} for k, v in growing_dims(model, dtype).items()}
    for name, named in getattr(model, "state_dims", {}).items():
        dims[name] = {**dims.get(name, {}), **named}
    return dims


def growing_dims(model: nn.Module, dtype: torch.dtype | None) -> dict[str, list[int]]:
    """Per state tensor, the dims (besides batch) whose size depends on the position (a KV cache)."""
    if not getattr(model, "streaming", True):
        return {}
    a, b = example_state(model, 2, 3, dtype), example_state(model, 2, TRACE_TOKENS, dtype)
    return {k: [i for i in range(1, a[k].dim()) if a[k].shape[i] != b[k].shape[i]] for k in a}


def export_graph(model: nn.Module, kind: str, opset: int, dtype: torch.dtype | None) -> onnx.ModelProto:
    """`kind` is "prefill" or "step"; returns the ONNX model with edgemem functions attached."""
    streaming = getattr(model, "streaming", True)
    state = example_state(model, 2, 3, dtype) if streaming else model.init_state(2, dtype=dtype)
    names = list(state)
    named = named_dims(model, dtype)
    batch = torch.export.Dim("batch", min=1, max=4096)
    symbols = {
        "past_sequence": torch.export.Dim("past_sequence", min=0, max=1 << 20),
        "encoder_sequence": torch.export.Dim("encoder_sequence", min=1, max=1 << 20),
    }
    seq_len = 1 if kind == "step" else 4
    ids = torch.randint(0, model.config.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(1))
    ids_dims = {0: batch} if kind == "step" else {0: batch, 1: torch.export.Dim("sequence", min=1, max=1 << 20)}
    state_dims = tuple({0: batch, **{d: symbols[s] for d, s in named.get(n, {}).items()}} for n in names)
    extras, output = graph_io(model)
    extra_values = [torch.zeros(ids.shape, dtype=d) for d in extras.values()]
    rest_dims = (*(ids_dims for _ in extras), *state_dims)
    dynamic_shapes = (ids_dims, rest_dims) if rest_dims else (ids_dims,)
    program = trace(
        _Graph(model, names, list(extras)).eval(),
        (ids, *extra_values, *state.values()),
        opset,
        ["input_ids", *extras, *map(input_name, names)],
        [output, *map(output_name, written_states(model, names))],
        dynamic_shapes,
        kind,
    )
    proto = program.model_proto
    _check_dynamic(proto, kind)
    attach_functions(proto, opset)
    proto.graph.name = f"{getattr(model.config, 'arch', 'model')}-{kind}"
    return proto


def trace(
    module: nn.Module,
    args: tuple,
    opset: int,
    input_names: list[str],
    output_names: list[str],
    dynamic_shapes: tuple,
    kind: str,
):
    """`torch.onnx.export` (dynamo) of `module` on `args`; its errors as one EdgememError line."""
    # the exporter logs a warning per missing optional library (torchvision); not the user's concern
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return torch.onnx.export(
                module,
                args,
                dynamo=True,
                opset_version=opset,
                input_names=input_names,
                output_names=output_names,
                dynamic_shapes=dynamic_shapes,
                verbose=False,
            )
        except ModuleNotFoundError:  # a missing optional module (onnxscript): the CLI names its extra
            raise
        except Exception as e:  # the exporter's own errors are long reports; keep the cause
            cause = f"{type(e).__name__}: {str(e).splitlines()[0]}"
            raise EdgememError(f"exporting the {kind} graph failed: {cause}") from e


class _Encoder(nn.Module):
    """An encoder-decoder's encoder graph: input ids and global mask → the states it fills."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, global_attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.model.memory(self.model.encode(input_ids, global_attention_mask)).values())


def encoder_fills(model: nn.Module) -> list[str]:
    """The states (by key) an encoder-decoder's encoder graph outputs, in order."""
    return list(model.memory(torch.zeros(1, 2, model.config.d_model)))


def export_encoder(model: nn.Module, opset: int) -> onnx.ModelProto:
    """The encoder graph of an encoder-decoder (`model.encode` + `model.memory`): `input_ids` and
    `global_attention_mask` (int64 [batch, encoder_sequence]) → `present.{i}.cross_key` / `cross_value`."""
    batch = torch.export.Dim("batch", min=1, max=4096)
    length = torch.export.Dim("encoder_sequence", min=1, max=model.config.max_encoder_positions)
    ids = torch.randint(0, model.config.vocab_size, (2, EXAMPLE_SIZE), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros_like(ids)
    mask[0, 0] = 1
    dims = {0: batch, 1: length}
    program = trace(
        _Encoder(model).eval(),
        (ids, mask),
        opset,
        ["input_ids", "global_attention_mask"],
        [output_name(k) for k in encoder_fills(model)],
        (dims, dims),
        "encoder",
    )
    proto = program.model_proto
    _check_dynamic(proto, "prefill")
    attach_functions(proto, opset)
    proto.graph.name = f"{getattr(model.config, 'arch', 'model')}-encoder"
    return proto


def _check_dynamic(proto: onnx.ModelProto, kind: str) -> None:
    """The exporter can fall back to specialising a dim to the example's size; refuse that."""
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    wanted = {"batch": dims[0]} if kind == "step" else {"batch": dims[0], "sequence": dims[1]}
    fixed = [name for name, d in wanted.items() if not d.dim_param]
    if fixed:
        raise EdgememError(
            f"the {kind} graph came out specialised to the example's {' and '.join(fixed)}: some layer's "
            "prefill does not trace for any length (make its shapes follow T without data-dependent Python)"
        )


def attach_functions(proto: onnx.ModelProto, opset: int) -> None:
    """Add the model-local function of every edgemem op the graph uses, and the edgemem opset."""
    used = sorted({n.op_type for n in proto.graph.node if n.domain == DOMAIN})
    if not used:
        return
    missing = [op for op in used if op not in CONTRACTS]
    if missing:
        raise EdgememError(f"no ONNX function for edgemem op(s) {', '.join(missing)}")
    functions = onnx_functions(opset, used)
    have = {(f.domain, f.name) for f in proto.functions}
    proto.functions.extend(functions[op] for op in used if (DOMAIN, op) not in have)
    if all(o.domain != DOMAIN for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid(DOMAIN, VERSION))
