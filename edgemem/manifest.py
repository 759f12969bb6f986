"""`edgemem.json`: the one file that describes an export to every later tool.

Pure Python (json, hashlib): the runtime reads it without torch or onnx.

    {"format": "edgemem/1", "arch": ..., "config": {...}, "opset": 20, "targets": [...],
     "inputs": {"tokens": "input_ids"}, "outputs": {"logits": "logits"},
     "graphs": {"prefill": true, "step": true},
     "state": [{"input": "past_key_values.0.recurrent_state", "output": "present.0.recurrent_state",
                "shape": ["batch", 4, 64, 64], "dtype": "float32", "layer": "0",
                "kind": "recurrent_state", "init": "zeros" | "file"}, ...],
     "files": {"generic/step.onnx": "<sha256>", ...},
     "kv_cache": {"max_length": 4096, "overflow": "error" | "sink_window", "sinks": 4,
                  "states": ["past_key_values.3.key", ...], "in_place": ["ort"]},   (only with one)
     "weights": {"ort": {"file": "ort/weights.data",
                         "tensors": {"step": {"<initializer>": [offset, "float32", [512, 1024]], ...}, ...}}},
     "kind": "lm" | "encoder" | "encoder_decoder",
     "source": {"origin": "preset" | "checkpoint" | "hf", "path", "seed", "kind", "kv_cache"},
     "encoder": {"inputs": {"input_ids": ..., "global_attention_mask": ...}, "max_length": 16384,
                 "fills": {"past_key_values.0.cross_key": "present.0.cross_key", ...}}}   (encoder-decoders)

`kv_cache`: the softmax-attention layers' preallocated caches: `max_length` slots; past them an
error, or a sliding window keeping the first `sinks` tokens; `in_place`: the targets whose graphs
write these states in place (the runtime binds one buffer as their input and output).
`weights`: per target, the one file its graphs' initializers live in and where each graph's are
(edgemem.weights); exports written before it have none, their graphs hold their weights.
`kind`: the model kind (`edgemem.kinds`: which graphs exist, how a stream starts); `source`: where
the model came from (`edgemem.models.source`). `encoder`: an encoder-decoder's `encoder.onnx`
takes `inputs` of up to `max_length` tokens and outputs the states of `fills` (state input → its
output name: the cross keys and values, whose `encoder_sequence` dim is the input's length); a
decoder stream starts from them, every other state at its initial value. A state whose `output`
is "" is read only: the decoder graphs take it and do not return it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edgemem import kinds
from edgemem.errors import EdgememError
from edgemem.files import as_path, sha256

FORMAT = "edgemem/1"
MANIFEST = "edgemem.json"
STATE_DTYPES = ("float32", "float16", "float64", "int64")
STATE_INIT = "state_init.safetensors"
TOKENIZER_DIR = "tokenizer"  # the tokenizer files an export carries
TARGETS = ("generic", "ort", "onnx27", "trt")
SYMBOLIC_DIMS = ("batch", "past_sequence", "encoder_sequence")  # state dims sized per stream


class ManifestError(EdgememError):
    """A directory that is not an edgemem export, or one whose files do not match its manifest."""


@dataclass
class StateSpec:
    input: str
    output: str
    shape: list[int | str]
    dtype: str
    layer: str
    kind: str
    init: str  # "zeros" or "file" (state_init.safetensors, batch 1)


@dataclass
class Manifest:
    arch: str
    config: dict[str, Any]
    opset: int
    targets: list[str]
    state: list[StateSpec]
    graphs: dict[str, bool]
    files: dict[str, str] = field(default_factory=dict)
    inputs: dict[str, str] = field(default_factory=lambda: {"tokens": "input_ids"})
    outputs: dict[str, str] = field(default_factory=lambda: {"logits": "logits"})
    format: str = FORMAT
    quantization: dict[str, Any] | None = None  # how an INT8 export was made (edgemem.quant); None: not quantized
    kv_cache: dict[str, Any] | None = None  # preallocated KV caches (module docstring); None: none, or growing
    genai: dict[str, Any] | None = None  # fits onnxruntime-genai: {"fits", "config", "target"} or {"fits": false, "reasons"} (edgemem.export.genai)
    weights: dict[str, Any] | None = None  # per target: the shared weight file and its index (module docstring)
    kind: str = kinds.DEFAULT  # the model kind (edgemem.kinds)
    source: dict[str, Any] | None = None  # where the model came from (edgemem.models.source)
    encoder: dict[str, Any] | None = None  # an encoder-decoder's encoder graph (module docstring)

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    def to_json(self) -> str:
        data = asdict(self)
        if data["quantization"] is None:
            del data["quantization"]  # float exports read as before by tools that predate quantization
        for optional in ("kv_cache", "weights", "source", "encoder"):
            if data[optional] is None:
                del data[optional]
        return json.dumps(data, indent=2) + "\n"

    def identity(self) -> str:
        """A hash of the model files: what a state checkpoint must match."""
        return hashlib.sha256(json.dumps(sorted(self.files.items())).encode()).hexdigest()


def load(directory: str | Path, *, check_files: bool = True) -> Manifest:
    """Read and validate `DIR/edgemem.json`; with `check_files`, verify every file's sha256."""
    directory = as_path(directory, "an export directory")
    path = directory / MANIFEST
    if not path.is_file():
        raise ManifestError(f"{directory} is not an edgemem export: {MANIFEST} is missing (run `edgemem export`)")
    try:
        raw = json.loads(path.read_text())
        if raw.get("format") != FORMAT:
            raise ManifestError(f"{path}: format is {raw.get('format')!r}, expected {FORMAT!r}")
        raw["state"] = [StateSpec(**s) for s in raw["state"]]
        manifest = Manifest(**raw)
    except (json.JSONDecodeError, TypeError, KeyError, AttributeError) as e:
        raise ManifestError(f"{path} is not a valid edgemem manifest: {e}") from None
    vocab = manifest.config.get("vocab_size") if isinstance(manifest.config, dict) else None
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ManifestError(f"{path}: config.vocab_size must be a positive integer; got {vocab!r}")
    if manifest.kind not in kinds.KINDS:
        raise ManifestError(f"{path}: kind {manifest.kind!r} is not a model kind this edgemem knows "
                            f"({', '.join(kinds.KINDS)})")
    for spec in manifest.state:
        if spec.dtype not in STATE_DTYPES:
            raise ManifestError(f"{path}: state {spec.input} has dtype {spec.dtype!r}; expected one of {', '.join(STATE_DTYPES)}")
        if not isinstance(spec.shape, list) or not all(
                d in SYMBOLIC_DIMS or (type(d) is int and d >= 0) for d in spec.shape):
            raise ManifestError(f"{path}: state {spec.input} has shape {spec.shape!r}; expected non-negative sizes, "
                                "or one of " + ", ".join(map(repr, SYMBOLIC_DIMS)))
    kv = manifest.kv_cache
    if kv is not None:
        inputs = {s.input for s in manifest.state}
        ok = (isinstance(kv, dict) and type(kv.get("max_length")) is int and kv["max_length"] > 0
              and kv.get("overflow") in ("error", "sink_window") and isinstance(kv.get("states"), list)
              and set(kv["states"]) <= inputs and isinstance(kv.get("in_place"), list) and type(kv.get("sinks")) is int)
        if not ok:
            raise ManifestError(f"{path}: kv_cache is {kv!r}; expected max_length (a positive integer), overflow "
                                "('error' or 'sink_window'), sinks, states (state inputs) and in_place (targets)")
    encoder = manifest.encoder
    if (encoder is not None or "encoder" in kinds.get(manifest.kind).graphs) and not (
            isinstance(encoder, dict) and type(encoder.get("max_length")) is int and encoder["max_length"] > 0
            and isinstance(encoder.get("inputs"), dict) and isinstance(encoder.get("fills"), dict)
            and set(encoder["fills"]) <= {s.input for s in manifest.state}):
        raise ManifestError(f"{path}: encoder is {encoder!r}; an {manifest.kind} export needs inputs, max_length (a "
                            "positive integer) and fills (state input → encoder output)")
    stores = manifest.weights
    if stores is not None and not (
            isinstance(stores, dict) and all(
                isinstance(w, dict) and w.get("file") in manifest.files and isinstance(w.get("tensors"), dict)
                and all(isinstance(t, dict) and all(isinstance(e, list) and len(e) == 3 and type(e[0]) is int
                                                    and e[0] >= 0 and isinstance(e[1], str) and isinstance(e[2], list)
                                                    for e in t.values()) for t in w["tensors"].values())
                for w in stores.values())):
        raise ManifestError(f"{path}: weights is not a map of target to {{file (one of files), tensors: {{graph: "
                            "{initializer: [offset, dtype, shape]}}}}}")
    if check_files:
        for name, digest in manifest.files.items():
            file = directory / name
            if not file.is_file():
                raise ManifestError(f"{directory}: {name} listed in {MANIFEST} is missing")
            if sha256(file) != digest:
                raise ManifestError(f"{directory}: {name} does not match its sha256 in {MANIFEST} (modified or corrupt)")
    return manifest
