"""`edgemem.json`: the one file that describes an export to every later tool.

Pure Python (json, hashlib): the runtime reads it without torch or onnx.

    {"format": "edgemem/1", "arch": ..., "config": {...}, "opset": 20, "targets": [...],
     "inputs": {"tokens": "input_ids"}, "outputs": {"logits": "logits"},
     "graphs": {"prefill": true, "step": true, "prefill_last": true},
     "state": [{"input": "past_key_values.0.recurrent_state", "output": "present.0.recurrent_state",
                "shape": ["batch", 4, 64, 64], "dtype": "float32", "layer": "0",
                "kind": "recurrent_state", "init": "zeros" | "file"}, ...],
     "files": {"generic/step.onnx": "<sha256>", ...},
     "kv_cache": {"max_length": 4096, "overflow": "error" | "sink_window", "sinks": 4,
                  "states": ["past_key_values.3.key", ...], "in_place": ["ort"]},   (only with one)
     "weights": {"ort": {"file": "ort/weights.data",
                         "tensors": {"step": {"<initializer>": [offset, "float32", [512, 1024]], ...}, ...},
                         "packed": {"step": ["<initializer>", ...], ...}}},
     "steps": "prefill_last" | "step",
     "kind": "lm" | "encoder" | "encoder_decoder",
     "source": {"origin": "preset" | "checkpoint" | "hf", "path", "seed", "kind", "kv_cache"},
     "encoder": {"inputs": {"input_ids": ..., "global_attention_mask": ...}, "max_length": 16384,
                 "fills": {"past_key_values.0.cross_key": "present.0.cross_key", ...}}}   (encoder-decoders)

`kv_cache`: the softmax-attention layers' preallocated caches: `max_length` slots; past them an
error, or a sliding window keeping the first `sinks` tokens; `in_place`: the targets whose graphs
write these states in place (the runtime binds one buffer as their input and output).
`graphs.prefill_last`: every target but trt also has `prefill_last.onnx`, the prefill graph with the head
on the last position only (logits [batch, 1, vocab]), which the runtime runs when it needs only the next
token's logits; its weights are the prefill graph's, in the same store.
`weights`: per target, the one file its graphs' initializers live in and where each graph's are
(edgemem.weights); exports written before it have none, their graphs hold their weights. `packed`
(optional): the initializers of each graph that only pre-packing kernels read (MatMul/Gemm weights,
MatMulNBits blocks), which a session that pre-packs loads from the file itself (edgemem.runtime.ort).
`steps`: "prefill_last" where that graph at T = 1 costs about what the step graph does (every layer's
prefill form, `StatefulLayer.prefill_steps`): a runtime may then serve steps with it, one session
holding one packed copy of the weights (edgemem.runtime.ort); "step" otherwise.
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
ORT_TARGETS = ("ort", "generic", "onnx27")  # the targets onnxruntime runs, in order of preference
DTYPES = ("fp32", "fp16", "bf16")  # of the weights and activations (config.dtype); bf16: trt target only
MIN_OPSET, MAX_OPSET = 18, 27  # what edgemem's graphs are written at (edgemem.export.OPSET, onnx27's LinearAttention)
ONNX_DTYPES = {
    "float32": "float",
    "float16": "float16",
    "float64": "double",
    "int64": "int64",
}  # as onnxruntime names them
PREFILL_LAST = "prefill_last"  # graphs[...]: the prefill graph with last-position logits (see the module docstring)
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
    genai: dict[str, Any] | None = (
        None  # fits onnxruntime-genai: {"fits", "config", "target"} or {"fits": false, "reasons"} (edgemem.export.genai)  # noqa: E501
    )
    weights: dict[str, Any] | None = None  # per target: the shared weight file and its index (module docstring)
    kind: str = kinds.DEFAULT  # the model kind (edgemem.kinds)
    source: dict[str, Any] | None = None  # where the model came from (edgemem.models.source)
    encoder: dict[str, Any] | None = None  # an encoder-decoder's encoder graph (module docstring)
    steps: str = "step"  # the graph one CPU session serves steps with: "step" or PREFILL_LAST (module docstring)

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def max_positions(self) -> int | None:
        """The positions a stream holds: a preallocated KV cache's max_length where it has no sliding window;
        None: no limit."""
        kv = self.kv_cache
        return kv["max_length"] if kv and kv["overflow"] == "error" else None

    def to_json(self) -> str:
        data = asdict(self)
        if data["quantization"] is None:
            del data["quantization"]  # float exports read as before by tools that predate quantization
        for optional in ("kv_cache", "weights", "source", "encoder"):
            if data[optional] is None:
                del data[optional]
        return json.dumps(data, indent=2) + "\n"

    def state_bytes(self) -> int:
        """Bytes of one stream's state (a growing cache counted at one token)."""
        itemsize = {"float32": 4, "float16": 2, "float64": 8, "int64": 8}
        total = 0
        for spec in self.state:
            count = 1
            for d in spec.shape:
                count *= d if isinstance(d, int) else 1
            total += count * itemsize[spec.dtype]
        return total

    def graphs_of(self, target: str) -> list[str]:
        """The graph kinds a target's folder holds: every kind the manifest marks present, but no
        `prefill_last` on trt (its engines are built from the full prefill graph)."""
        return [k for k, present in self.graphs.items() if present and not (k == PREFILL_LAST and target == "trt")]

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
    if not isinstance(manifest.config, dict):
        raise ManifestError(f"{path}: config must be an object; got {manifest.config!r}")
    if manifest.config.get("dtype", "fp32") not in DTYPES:
        raise ManifestError(
            f"{path}: config.dtype is {manifest.config.get('dtype')!r}; expected one of {', '.join(DTYPES)}"
        )
    if manifest.config.get("arch", manifest.arch) != manifest.arch:
        raise ManifestError(
            f"{path}: arch is {manifest.arch!r} but config.arch is {manifest.config['arch']!r} "
            "(edited by hand?); re-export the model"
        )
    if type(manifest.opset) is not int or not MIN_OPSET <= manifest.opset <= MAX_OPSET:
        raise ManifestError(f"{path}: opset is {manifest.opset!r}; expected an integer in {MIN_OPSET}..{MAX_OPSET}")
    bad = (
        [t for t in manifest.targets if t not in TARGETS] if isinstance(manifest.targets, list) else [manifest.targets]
    )
    if bad or not manifest.targets:
        raise ManifestError(f"{path}: targets {manifest.targets!r}; expected a list of {', '.join(TARGETS)}")
    vocab = manifest.config.get("vocab_size")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ManifestError(f"{path}: config.vocab_size must be a positive integer; got {vocab!r}")
    if manifest.kind not in kinds.KINDS:
        raise ManifestError(
            f"{path}: kind {manifest.kind!r} is not a model kind this edgemem knows ({', '.join(kinds.KINDS)})"
        )
    for spec in manifest.state:
        if spec.dtype not in STATE_DTYPES:
            raise ManifestError(
                f"{path}: state {spec.input} has dtype {spec.dtype!r}; expected one of {', '.join(STATE_DTYPES)}"
            )
        if not isinstance(spec.shape, list) or not all(
            d in SYMBOLIC_DIMS or (type(d) is int and d >= 0) for d in spec.shape
        ):
            raise ManifestError(
                f"{path}: state {spec.input} has shape {spec.shape!r}; expected non-negative sizes, "
                "or one of " + ", ".join(map(repr, SYMBOLIC_DIMS))
            )
    if manifest.steps not in ("step", PREFILL_LAST) or (
        manifest.steps == PREFILL_LAST and not manifest.graphs.get(PREFILL_LAST)
    ):
        raise ManifestError(
            f"{path}: steps is {manifest.steps!r}; expected 'step', or {PREFILL_LAST!r} where graphs has it"
        )
    kv = manifest.kv_cache
    if kv is not None:
        inputs = {s.input for s in manifest.state}
        ok = (
            isinstance(kv, dict)
            and type(kv.get("max_length")) is int
            and kv["max_length"] > 0
            and kv.get("overflow") in ("error", "sink_window")
            and isinstance(kv.get("states"), list)
            and set(kv["states"]) <= inputs
            and isinstance(kv.get("in_place"), list)
            and type(kv.get("sinks")) is int
        )
        if not ok:
            raise ManifestError(
                f"{path}: kv_cache is {kv!r}; expected max_length (a positive integer), overflow "
                "('error' or 'sink_window'), sinks, states (state inputs) and in_place (targets)"
            )
    encoder = manifest.encoder
    if (encoder is not None or "encoder" in kinds.get(manifest.kind).graphs) and not (
        isinstance(encoder, dict)
        and type(encoder.get("max_length")) is int
        and encoder["max_length"] > 0
        and isinstance(encoder.get("inputs"), dict)
        and isinstance(encoder.get("fills"), dict)
        and set(encoder["fills"]) <= {s.input for s in manifest.state}
    ):
        raise ManifestError(
            f"{path}: encoder is {encoder!r}; an {manifest.kind} export needs inputs, max_length (a "
            "positive integer) and fills (state input → encoder output)"
        )
    stores = manifest.weights
    if stores is not None and not (
        isinstance(stores, dict)
        and all(
            isinstance(w, dict)
            and w.get("file") in manifest.files
            and isinstance(w.get("tensors"), dict)
            and all(
                isinstance(t, dict)
                and all(
                    isinstance(e, list)
                    and len(e) == 3
                    and type(e[0]) is int
                    and e[0] >= 0
                    and isinstance(e[1], str)
                    and isinstance(e[2], list)
                    for e in t.values()
                )
                for t in w["tensors"].values()
            )
            and isinstance(w.get("packed", {}), dict)
            and all(
                isinstance(names, list) and all(isinstance(n, str) and n in w["tensors"].get(g, {}) for n in names)
                for g, names in w.get("packed", {}).items()
            )
            for w in stores.values()
        )
    ):
        raise ManifestError(
            f"{path}: weights is not a map of target to {{file (one of files), tensors: {{graph: "
            "{initializer: [offset, dtype, shape]}}, packed: {graph: [initializer of tensors]}}}"
        )
    if check_files:
        for name, digest in manifest.files.items():
            file = directory / name
            if not file.is_file():
                raise ManifestError(f"{directory}: {name} listed in {MANIFEST} is missing")
            if sha256(file) != digest:
                raise ManifestError(
                    f"{directory}: {name} does not match its sha256 in {MANIFEST} (modified or corrupt)"
                )
    return manifest


def check_io(
    manifest: Manifest,
    where: str | Path,
    inputs: dict[str, tuple[str, list]],
    outputs: dict[str, tuple[str, list]],
    graph: str = "step",
) -> None:
    """The manifest against one graph's inputs and outputs (name → (element type as onnxruntime names it,
    e.g. "float", and dims: ints, or names/None for symbolic ones)): the state tensors by name, dtype and fixed
    sizes (a read-only state, output "", is an input only), the token input, the outputs, and logits as wide as
    config.vocab_size; an encoder graph (`graph` "encoder"): its inputs and the states it fills. A cheap check,
    no hashing."""

    def differ(what: str, spec: StateSpec, graph: tuple[str, list]) -> str | None:
        kind, dims = graph
        if kind != ONNX_DTYPES[spec.dtype]:
            return f"{what} is {kind} in the graph, {spec.dtype} in {MANIFEST}"
        fixed = [(d, g) for d, g in zip(spec.shape, dims) if isinstance(d, int) and isinstance(g, int)]
        if len(dims) != len(spec.shape) or any(d != g for d, g in fixed):
            return f"{what} has shape {dims} in the graph, {spec.shape} in {MANIFEST}"
        return None

    problems = []
    if graph == "encoder":
        encoder = manifest.encoder or {}
        problems += [
            f"encoder input {name!r} is not in the graph"
            for name in encoder.get("inputs", {}).values()
            if name not in inputs
        ]
        specs = {s.input: s for s in manifest.state}
        for state, name in encoder.get("fills", {}).items():
            if name not in outputs:
                problems.append(f"encoder output {name!r} is not in the graph")
            elif (why := differ(name, specs[state], outputs[name])) is not None:
                problems.append(why)
        if problems:
            raise ManifestError(
                f"{where} does not match {MANIFEST}: {problems[0]}; edited by hand? re-export the model"
            )
        return
    for spec in manifest.state:
        for name, side in ((spec.input, inputs), (spec.output, outputs)):
            if not name:
                continue
            if name not in side:
                problems.append(f"state {name} is not in the graph")
            elif (why := differ(name, spec, side[name])) is not None:
                problems.append(why)
    if manifest.inputs.get("tokens") not in inputs:
        problems.append(f"token input {manifest.inputs.get('tokens')!r} is not in the graph")
    problems += [f"output {name!r} is not in the graph" for name in manifest.outputs.values() if name not in outputs]
    logits = outputs.get(manifest.outputs.get("logits", ""))
    if logits and logits[1] and isinstance(logits[1][-1], int) and logits[1][-1] != manifest.vocab_size:
        problems.append(f"logits are {logits[1][-1]} wide in the graph, config.vocab_size is {manifest.vocab_size}")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ManifestError(
            f"{where} does not match {MANIFEST}: {problems[0]}{more}; edited by hand? re-export the model"
        )


_ELEMENT = {1: "float", 10: "float16", 11: "double", 7: "int64"}


def check_graph_file(manifest: Manifest, path: Path, target: str) -> None:
    """One graph file (read without its weights, needs onnx) against the manifest: it parses, its ONNX opset is
    the manifest's (27 for the onnx27 target) and its inputs and outputs are the manifest's (`check_io`)."""
    import onnx
    from google.protobuf.message import DecodeError

    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, OSError, ValueError) as e:
        raise ManifestError(
            f"{path} is not a readable ONNX graph (truncated or corrupt?): {str(e).splitlines()[0]}"
        ) from None
    if not model.graph.node and not model.opset_import:  # protobuf reads an empty file as an empty message
        raise ManifestError(f"{path} is not a readable ONNX graph (empty or truncated?)")
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    want = 27 if target == "onnx27" else manifest.opset
    if opset != want:
        raise ManifestError(
            f"{path} is written at ONNX opset {opset}, {MANIFEST} says {want} (edited by hand?); re-export the model"
        )

    def values(items) -> dict[str, tuple[str, list]]:
        found = {}
        for v in items:
            t = v.type.tensor_type
            dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]
            found[v.name] = (_ELEMENT.get(t.elem_type, onnx.TensorProto.DataType.Name(t.elem_type).lower()), dims)
        return found

    weights = {t.name for t in model.graph.initializer}  # an input that is also an initializer is not fed
    inputs = [v for v in model.graph.input if v.name not in weights]
    check_io(manifest, path, values(inputs), values(model.graph.output), graph=path.stem)
