"""The exporter (`edgemem.export.export`): any module following the stateful protocol → an export directory.

    DIR/edgemem.json                 the manifest (edgemem.manifest)
    DIR/<target>/prefill.onnx        prompt of any length, from and to a state (a Loop over segments
                                     for Titans MAC, edgemem.export.segments; absent when the model's
                                     prefill is a data-dependent loop without segments: prompts are stepped)
    DIR/<target>/step.onnx           one token (absent for bidirectional models)
    DIR/<target>/encoder.onnx        an encoder-decoder's encoder: input → the decoder states it fills
    DIR/<target>/weights.data        the weights of the target's graphs, each tensor once (edgemem.weights)
    DIR/state_init.safetensors       initial values of the states that do not start at zero
    DIR/tokenizer/                   the model's tokenizer files, when given (config["tokenizer"]
                                     names the tokenizer.json the runtime reads)

The directory is built beside DIR under a temporary name and renamed into place, so an
interrupted export never leaves a half-written DIR.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as save_safetensors
from torch import nn

from edgemem import kinds, weights
from edgemem.config import fits_memory, size_text
from edgemem.errors import ConfigError, EdgememError, named
from edgemem.export import genai
from edgemem.export.graphs import (
    TRACE_TOKENS,
    encoder_fills,
    export_encoder,
    export_graph,
    graph_io,
    input_name,
    named_dims,
    output_name,
)
from edgemem.export.lower import last_position_logits, lower
from edgemem.export.segments import loop_over_segments, position_input, prefill_segment
from edgemem.files import check_output_dir, save_onnx, sha256, staged_directory, write_atomic
from edgemem.manifest import MANIFEST, PREFILL_LAST, STATE_INIT, TARGETS, TOKENIZER_DIR, Manifest, StateSpec
from edgemem.models.source import Source

log = logging.getLogger(__name__)

OPSET = 20
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_ONNX_DTYPES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
    torch.int64: "int64",
}


def _check_protocol(model: nn.Module) -> None:
    missing = [m for m in ("init_state", "prefill", "step") if not callable(getattr(model, m, None))]
    if missing:
        raise EdgememError(
            f"{type(model).__name__} does not follow the stateful protocol: missing {', '.join(missing)} "
            "(see edgemem.layers.base.StatefulLayer)"
        )
    if not isinstance(getattr(getattr(model, "config", None), "vocab_size", None), int):
        raise EdgememError(f"{type(model).__name__} needs `config.vocab_size` (an int) to be exported")


def state_specs(model: nn.Module, dtype: torch.dtype | None = None) -> list[StateSpec]:
    """Manifest entries for the model's state: names, shapes (with "batch", "past_sequence",
    "encoder_sequence"), init."""
    state = model.init_state(1, dtype=dtype)
    named = named_dims(model, dtype)
    read_only = set(getattr(model, "read_only", ()))
    specs = []
    for key, tensor in state.items():
        shape: list[int | str] = ["batch", *tensor.shape[1:]]
        for d, symbol in named.get(key, {}).items():
            shape[d] = symbol
        layer, _, kind = key.partition(".")
        specs.append(
            StateSpec(
                input=input_name(key),
                output="" if key in read_only else output_name(key),
                shape=shape,
                dtype=_ONNX_DTYPES[tensor.dtype],
                layer=layer if kind else "",
                kind=kind or key,
                init="zeros" if not tensor.any() else "file",
            )
        )
    return specs


def _config(model: nn.Module) -> dict[str, Any]:
    config = model.config
    data = config.to_dict() if hasattr(config, "to_dict") else {}
    return {**data, "vocab_size": config.vocab_size}


def _prefill_steps(model: nn.Module) -> bool:
    """Whether every layer's prefill form costs about a step on one token (`StatefulLayer.prefill_steps`)."""
    return all(getattr(m, "prefill_steps", True) for m in model.modules())


def _kv_cache(model: nn.Module, targets: Sequence[str]) -> dict[str, Any] | None:
    """The manifest's `kv_cache` entry from the model's (`model.kv_cache`, e.g. `LM.kv_cache`)."""
    kv = getattr(model, "kv_cache", None)
    if kv is None:
        return None
    window = kv["sinks"] is not None
    return {
        "max_length": kv["max_length"],
        "overflow": "sink_window" if window else "error",
        "sinks": kv["sinks"] or 0,
        "states": [input_name(k) for k in kv["states"]],
        "in_place": [] if window or "ort" not in targets else ["ort"],  # GroupQueryAttention (export.lower)
    }


def _encoder_entry(model: nn.Module) -> dict[str, Any]:
    """The manifest's `encoder` entry: its graph's inputs, longest input and the states it fills (state
    input → the encoder graph's output)."""
    return {
        "inputs": {"tokens": "input_ids", "global_attention_mask": "global_attention_mask"},
        "max_length": model.config.max_encoder_positions,
        "fills": {input_name(k): output_name(k) for k in encoder_fills(model)},
    }


def check_cache_length(max_length: int, sinks: int | None) -> None:
    """A preallocated KV cache without a sliding window must hold the streams the export traces its graphs on."""
    if sinks is None and max_length < TRACE_TOKENS:
        option = named("max_length", "--max-length")
        raise ConfigError(
            f"{option} {max_length} is too short: the export traces its graphs on streams of "
            f"{TRACE_TOKENS} tokens, so the KV cache needs {option} {TRACE_TOKENS} or more "
            f"(or a sliding window: {named('sinks', '--sinks')})"
        )


TRACE_COPIES = 8  # streams' worth of state the export holds at once while tracing (batch-2 examples, outputs, copies)


def _check_state_fits(model: nn.Module) -> None:
    """Refuse, before tracing, a state (a KV cache of --max-length, a window) too large for this machine's memory."""
    try:
        state = model.init_state(1, device="meta")
    except Exception:  # noqa: BLE001 - a model whose state cannot be sized without memory: the export finds out
        return
    per_stream = sum(t.numel() * t.element_size() for t in state.values())
    arch = getattr(getattr(model, "config", None), "arch", "the model")
    fits_memory(
        TRACE_COPIES * per_stream,
        f"exporting {arch} (its state is {size_text(per_stream)} per stream; "
        "the export traces several streams at once)",
    )


def _check_finite(model: nn.Module, where: str = "") -> None:
    """Every floating-point weight and buffer is finite: a NaN would export fine and then generate nonsense."""
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise EdgememError(
                f"weight {name} holds {bad} NaN or infinite value{'s' if bad > 1 else ''}{where}; nothing was exported"
            )


def _check_tokenizer(files: Sequence[Path], vocab_size: int) -> None:
    """A tokenizer.json that travels with the export parses and gives no id past the model's vocabulary."""
    path = next((p for p in files if p.name == "tokenizer.json"), None)
    if path is None:
        return
    try:
        json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EdgememError(f"{path} is not a valid tokenizer file: {e}") from None
    try:
        from tokenizers import Tokenizer
    except ModuleNotFoundError:  # the runtime then refuses it as `run --prompt` reads it
        return
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception for a malformed file
        raise EdgememError(f"{path} is not a valid tokenizer file: {str(e).splitlines()[0]}") from None
    largest = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)
    if largest >= vocab_size:
        raise EdgememError(
            f"{path} has token ids up to {largest}, past the model's vocab_size {vocab_size}: "
            "the model cannot take them (a tokenizer of another model?)"
        )


def export(
    model: nn.Module,
    out_dir: str | Path,
    *,
    targets: Sequence[str] = ("generic", "ort", "trt"),
    dtype: str = "fp32",
    force: bool = False,
    extra_config: dict[str, Any] | None = None,
    tokenizer: Sequence[str | Path] = (),
    source: Source | None = None,
) -> Manifest:
    """Export `model` (stateful protocol, `config.vocab_size`) to `out_dir` for `targets`; `tokenizer`:
    files that travel with it (a tokenizer.json among them is what the runtime encodes text with);
    `source`: where the model came from (recorded in the manifest; verify and bench rebuild from it)."""
    _check_protocol(model)
    tokenizer = [Path(p) for p in tokenizer]
    missing = [str(p) for p in tokenizer if not p.is_file()]
    if missing:
        raise EdgememError(f"tokenizer file(s) not found: {', '.join(missing)}")
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        raise EdgememError(
            f"unknown target(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(TARGETS)}"
        )
    if dtype not in DTYPES:
        raise EdgememError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    if dtype == "bf16" and set(targets) != {"trt"}:
        raise EdgememError(
            f"dtype bf16 exports the trt target only (onnxruntime's CPU kernels take no bfloat16); got targets "
            f"{', '.join(targets)}: pass --target trt, or export at fp16/fp32"
        )
    if len(set(targets)) != len(targets):
        raise EdgememError(f"targets repeat: {', '.join(targets)}; name each at most once")
    kv = getattr(model, "kv_cache", None)
    if kv is not None:
        check_cache_length(kv["max_length"], kv["sinks"])
    _check_state_fits(model)
    _check_finite(model)
    _check_tokenizer(tokenizer, model.config.vocab_size)
    extra_config = {**(extra_config or {}), **(source.config_entries() if source else {})}
    origin = extra_config.get("checkpoint") or extra_config.get("source")
    out_dir = check_output_dir(out_dir, force=force, inputs=[origin] if origin else [])
    kind = kinds.of(model)

    model = model.eval()
    if dtype != "fp32":
        model = copy.deepcopy(model).to(DTYPES[dtype])
        if dtype == "fp16":
            _check_finite(model, " in float16 (a value past ±65504: export at fp32)")
    state_dtype = torch.float32  # state stays fp32 whatever the weights
    segment = prefill_segment(model)
    position = position_input(model) if segment else ""
    graphs = {"prefill": segment is not None, "step": bool(getattr(model, "streaming", True))}
    if "encoder" in kind.graphs:
        graphs = {"encoder": True, **graphs}
    with staged_directory(out_dir) as tmp:
        files: dict[str, str] = {}
        written: dict[str, list[Path]] = {target: [] for target in targets}
        for graph in [k for k, present in graphs.items() if present]:
            log.info("exporting the %s graph", graph)
            proto = (
                export_encoder(model, OPSET) if graph == "encoder" else export_graph(model, graph, OPSET, state_dtype)
            )
            for target in targets:
                path = tmp / target / f"{graph}.onnx"
                path.parent.mkdir(exist_ok=True)
                lowered = lower(proto, target)
                if graph == "prefill" and segment:  # lowered first: the Loop body holds the lowered nodes
                    lowered = loop_over_segments(lowered, segment, position, ["input_ids", *graph_io(model)[0]])
                save_onnx(lowered, path)
                written[target].append(path)
                del lowered  # each in-memory copy of the graph holds the weights: one at a time beside `proto`
            # the prefill graph with the head on the last position only, for the runtime's next-token prefill
            streams = graph == "prefill" and graphs["step"] and not segment and kind.name == "lm"  # one-pass LM prefill
            last = last_position_logits(proto, graph_io(model)[1]) if streams else None
            del proto
            if last is not None and any(t != "trt" for t in targets):
                for target in targets:
                    if target != "trt":  # TensorRT's prefill engine stays the one prefill graph
                        path = tmp / target / f"{PREFILL_LAST}.onnx"
                        save_onnx(lower(last, target), path)
                        written[target].append(path)
                graphs[PREFILL_LAST] = True
            del last
        stores = {}
        for target, paths in written.items():
            if (store := weights.share(tmp / target, paths)) is not None:
                stores[target] = store
                files[store["file"]] = sha256(tmp / store["file"])
            for path in paths:
                files[f"{target}/{path.name}"] = sha256(path)
        specs = state_specs(model, state_dtype)
        initial = {
            s.input: t.contiguous()
            for s, t in zip(specs, model.init_state(1, dtype=state_dtype).values())
            if s.init == "file"
        }
        if initial:
            write_atomic(tmp / STATE_INIT, save_safetensors(initial))
            files[STATE_INIT] = sha256(tmp / STATE_INIT)
        config = {**_config(model), **(extra_config or {}), "dtype": dtype}
        for path in tokenizer:
            (tmp / TOKENIZER_DIR).mkdir(exist_ok=True)
            shutil.copyfile(path, tmp / TOKENIZER_DIR / path.name)
            files[f"{TOKENIZER_DIR}/{path.name}"] = sha256(tmp / TOKENIZER_DIR / path.name)
            if path.name == "tokenizer.json":
                config["tokenizer"] = f"{TOKENIZER_DIR}/{path.name}"
        extras, output = graph_io(model)
        manifest = Manifest(
            arch=str(getattr(model.config, "arch", "custom")),
            config=config,
            opset=OPSET,
            targets=list(targets),
            state=specs,
            graphs=graphs,
            files=files,
            inputs={"tokens": "input_ids", **{name: name for name in extras}},
            outputs={output: output},
            kv_cache=_kv_cache(model, targets),
            weights=stores or None,
            kind=kind.name,
            source=source.to_dict() if source else None,
            encoder=_encoder_entry(model) if graphs.get("encoder") else None,
            steps=PREFILL_LAST if graphs.get(PREFILL_LAST) and _prefill_steps(model) else "step",
        )
        manifest.genai, genai_config = genai.entry(manifest)
        if genai_config is not None:
            write_atomic(tmp / genai.GENAI_CONFIG, genai_config)
            files[genai.GENAI_CONFIG] = sha256(tmp / genai.GENAI_CONFIG)
        write_atomic(tmp / MANIFEST, manifest.to_json().encode())
    log.info("wrote %s", out_dir)
    return manifest


__all__ = ["OPSET", "check_cache_length", "export", "lower", "state_specs"]
