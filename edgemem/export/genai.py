"""onnxruntime-genai: does an export fit its decoder contract, and its `genai_config.json` when it does.

onnxruntime-genai (0.18) drives one decoder graph for both the prompt and each new token. It
feeds `input_ids` `[batch, sequence]` and, per layer `L`, either a recurrent layer's
`past_key_values.L.conv_state` + `past_key_values.L.recurrent_state` (fixed shapes, the same for
every recurrent layer) or an attention layer's `past_key_values.L.key` / `.value`
(`[batch, heads, past_sequence, head_size]`), all starting at zero, and reads `logits` and the
matching `present.L.*`. An export fits when its prefill graph has exactly that interface: a
state of any other kind (Titans' memory, a `position`, a ring buffer), a state that starts from
`state_init.safetensors`, a dimension other than batch (and a KV cache's length) that is not
fixed, or a graph that cannot take a prompt (no prefill graph, or a bidirectional encoder) does
not. Custom ops must run as model-local functions: the `ort` or `generic` target.

Pure Python (json): `decide` reads only the manifest.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from edgemem.manifest import STATE_INIT, Manifest

GENAI_CONFIG = "genai_config.json"
TARGETS = ("ort", "generic")  # custom ops as model-local functions, runnable by the ORT inside genai
RECURRENT = ("conv_state", "recurrent_state")
ATTENTION = ("key", "value")
TOKENIZER_PREFIXES = ("tokenizer", "special_tokens_map", "vocab", "merges")
CONTEXT_LENGTH = 4096  # search.max_length in the config; recurrent state sets no limit, a request may raise it


def decide(manifest: Manifest) -> tuple[str | None, list[str]]:
    """(target whose prefill graph genai runs, []) when the export fits; (None, reasons) when not."""
    reasons: list[str] = []
    target = next((t for t in TARGETS if t in manifest.targets), None)
    if target is None:
        reasons.append(
            f"no ort or generic target (exported: {', '.join(manifest.targets)}): genai runs custom ops "
            "only as model-local functions"
        )
    if not manifest.graphs.get("step", False):
        reasons.append("bidirectional (no step graph): genai generates token by token")
    elif not manifest.graphs.get("prefill", False):
        reasons.append("no prefill graph (prompts are stepped): genai runs one graph for the whole prompt")
    if manifest.quantization and manifest.quantization.get("method") != "int4":
        reasons.append(
            "an INT8 export: edgemem calibrate writes no genai_config.json (the float export and an int4 "
            "export have one)"
        )
    nonzero = [s.input for s in manifest.state if s.init != "zeros"]
    if nonzero:
        reasons.append(
            f"non-zero initial state ({', '.join(nonzero)} start from {STATE_INIT}): genai starts every state at zero"
        )
    unknown = sorted({s.kind for s in manifest.state if s.kind not in RECURRENT + ATTENTION or not s.layer.isdigit()})
    if unknown:
        reasons.append(
            f"state of kind {', '.join(unknown)}: genai knows only conv_state, recurrent_state, key and value "
            "per numbered layer"
        )
    other_dtypes = sorted({s.dtype for s in manifest.state if s.dtype != "float32"})
    if other_dtypes:
        reasons.append(f"{', '.join(other_dtypes)} state: genai carries float32 state for a float32 model")
    layers: dict[str, dict[str, list[int | str]]] = defaultdict(dict)
    for s in manifest.state:
        if s.kind in RECURRENT + ATTENTION and s.layer.isdigit():
            layers[s.layer][s.kind] = s.shape
    shapes: dict[str, set[str]] = defaultdict(set)
    misshapen: set[str] = set()
    for layer, kinds in sorted(layers.items(), key=lambda item: int(item[0])):
        have = set(kinds)
        if have & set(RECURRENT) and have & set(ATTENTION):
            reasons.append(f"layer {layer} has both recurrent state and a KV cache: genai expects one or the other")
        for group in (RECURRENT, ATTENTION):
            if have & set(group) and not have >= set(group):
                missing = ", ".join(k for k in group if k not in have)
                reasons.append(
                    f"layer {layer} has {', '.join(k for k in group if k in have)} but no {missing}: "
                    f"genai needs {' and '.join(group)} together"
                )
        for kind, shape in kinds.items():
            shapes[kind].add(json.dumps(shape))
            fixed = all(isinstance(d, int) for d in shape[1:])
            if kind in ATTENTION:
                ok = len(shape) == 4 and shape[2] == "past_sequence" and all(isinstance(shape[i], int) for i in (1, 3))
                expected = "[batch, heads, past_sequence, head_size]" + (
                    " (this is a fixed-size window)" if fixed else ""
                )
            else:
                ok, expected = fixed, "[batch, fixed dims...]"
            if (shape[0] != "batch" or not ok) and kind not in misshapen:
                misshapen.add(kind)
                reasons.append(f"state past_key_values.{layer}.{kind} has shape {shape}; genai needs {expected}")
    for kind, seen in shapes.items():
        if len(seen) > 1:
            reasons.append(f"{kind} shapes differ between layers ({', '.join(sorted(seen))}): genai needs one shape")
    if layers and sorted(map(int, layers)) != list(range(len(layers))):
        reasons.append(
            f"state layers {sorted(map(int, layers))} are not numbered 0..{len(layers) - 1}: genai "
            "expects state for every layer"
        )
    if not layers:
        reasons.append("the model has no state: nothing for genai to carry between tokens")
    return (None, reasons) if reasons else (target, [])


def genai_config(manifest: Manifest, target: str) -> dict[str, Any]:
    """The `genai_config.json` for an export that fits (`decide`): its `target/prefill.onnx` as the decoder."""
    kinds = {s.kind for s in manifest.state}
    layer_kinds = {s.layer: s.kind for s in manifest.state}
    inputs: dict[str, str] = {"input_ids": manifest.inputs["tokens"]}
    outputs: dict[str, str] = {"logits": manifest.outputs["logits"]}
    for kind, role in (("conv_state", "conv"), ("recurrent_state", "recurrent"), ("key", "key"), ("value", "value")):
        if kind in kinds:
            inputs[f"past_{role}_names"] = f"past_key_values.%d.{kind}"
            outputs[f"present_{role}_names"] = f"present.%d.{kind}"
    kv = next((s.shape for s in manifest.state if s.kind == "key"), None)
    recurrent = next((s.shape for s in manifest.state if s.kind == "recurrent_state"), None)
    heads, head_size = (kv[1], kv[3]) if kv else (recurrent[1], recurrent[2])
    n_layers = len(layer_kinds)
    config = manifest.config
    vocab = manifest.vocab_size
    eos = config.get("eos_token_id", 0)  # byte-level presets have no end token: byte 0 (NUL) ends generation
    return {
        "model": {
            "type": "qwen3_5_text" if recurrent else "llama",
            "bos_token_id": config.get("bos_token_id", eos),
            "eos_token_id": eos,
            "pad_token_id": config.get("pad_token_id", eos),
            "vocab_size": vocab,
            "context_length": CONTEXT_LENGTH,
            "decoder": {
                "filename": f"{target}/prefill.onnx",
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "hidden_size": int(config.get("d_model", heads * head_size)),
                "num_attention_heads": heads,
                "num_key_value_heads": heads,
                "head_size": head_size,
                "num_hidden_layers": n_layers,
                "layer_types": [
                    "linear_attention" if layer_kinds[str(i)] in RECURRENT else "full_attention"
                    for i in range(n_layers)
                ],
                "inputs": inputs,
                "outputs": outputs,
            },
        },
        "search": {
            "do_sample": False,
            "num_beams": 1,
            "num_return_sequences": 1,
            "max_length": CONTEXT_LENGTH,
            "min_length": 0,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
            "repetition_penalty": 1.0,
            "length_penalty": 1.0,
            "no_repeat_ngram_size": 0,
            "diversity_penalty": 0.0,
            "early_stopping": True,
            "past_present_share_buffer": False,
        },
    }


def entry(manifest: Manifest) -> tuple[dict[str, Any], bytes | None]:
    """The manifest's `genai` entry and, when the export fits, the bytes of its `genai_config.json`.

    `{"fits": true, "config": "genai_config.json", "target": T, "tokenizer": [files]}` or
    `{"fits": false, "reasons": [...]}`. genai reads tokenizer files from beside `genai_config.json`.
    """
    target, why = decide(manifest)
    if target is None:
        return {"fits": False, "reasons": why}, None
    data = (json.dumps(genai_config(manifest, target), indent=2) + "\n").encode()
    tokenizer = sorted(name for name in manifest.files if "/" not in name and name.startswith(TOKENIZER_PREFIXES))
    return {"fits": True, "config": GENAI_CONFIG, "target": target, "tokenizer": tokenizer}, data


def unfit_reasons(manifest: Manifest) -> list[str]:
    """Why an export does not fit onnxruntime-genai ([] when it does); manifests that predate the entry are judged now."""  # noqa: E501
    recorded = manifest.genai
    if recorded is None:
        return decide(manifest)[1]
    return [] if recorded.get("fits") else list(recorded.get("reasons", []))


__all__ = ["GENAI_CONFIG", "decide", "entry", "genai_config", "unfit_reasons"]
