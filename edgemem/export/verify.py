"""`edgemem verify DIR`: run each target that can run here against the PyTorch model.

The PyTorch model is rebuilt from the manifest (arch, config, seed) or loaded from the
checkpoint or Hugging Face directory it was exported from. One random stream is prefilled and then stepped; every
output and state of every graph is compared, and prefill ≡ prefill + steps is checked inside
ONNX Runtime itself.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

from edgemem.errors import EdgememError
from edgemem.export.genai import unfit_reasons
from edgemem.export.graphs import graph_io
from edgemem.manifest import PREFILL_LAST, Manifest, check_graph_file, load
from edgemem.models.source import Source
from edgemem.runtime.state import initial_state  # one definition of a fresh stream's state, shared with the runtime

log = logging.getLogger(__name__)

TOLERANCE = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 1.6e-1}


@dataclass
class Check:
    target: str
    graph: str
    tensor: str
    max_abs: float
    max_rel: float
    ok: bool


def rebuild(manifest: Manifest, checkpoint: str | Path | None = None) -> nn.Module:
    """The PyTorch model an export came from (its `source` record, `edgemem.models.source`)."""
    source = Source.from_manifest(manifest.source, manifest.config, manifest.kind, manifest.kv_cache)
    return source.load(manifest.config, checkpoint)


def _check_config(manifest: Manifest, model: nn.Module) -> None:
    """The model the manifest's config describes has the state the graphs take (a hand-edited width, arch or
    head count shows here)."""
    from edgemem.export import state_specs

    built = {s.input: s.shape for s in state_specs(model)}
    recorded = {s.input: s.shape for s in manifest.state}
    if built != recorded:
        name = next(n for n in sorted(built.keys() | recorded.keys()) if built.get(n) != recorded.get(n))
        raise EdgememError(
            f"the config in edgemem.json does not describe these graphs: state {name} is "
            f"{recorded.get(name, 'absent')} in the graphs, {built.get(name, 'absent')} for the config "
            "(edited by hand?); re-export the model"
        )


def _session(path: Path, options: ort.SessionOptions) -> ort.InferenceSession:
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - onnxruntime raises its own, varied exception types
        raise EdgememError(f"onnxruntime cannot load {path}: {str(e).strip().splitlines()[0]}") from None


def _compare(a: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    diff = np.abs(a.astype(np.float64) - ref.astype(np.float64))
    scale = max(float(np.abs(ref).max()) if ref.size else 0.0, 1e-6)
    return (float(diff.max()) if diff.size else 0.0), (float(diff.max()) / scale if diff.size else 0.0)


TRT_SKIPPED = (
    "its graphs hold edgemem's TensorRT plugin nodes, which onnxruntime does not run: build engines with "
    "`edgemem build` and run them with backend 'trt' on a GPU"
)


def runnable_targets(manifest: Manifest) -> dict[str, str]:
    """target → why it is skipped ("" when it runs here). verify runs onnxruntime: never the trt target."""
    reasons = {}
    for target in manifest.targets:
        if target == "trt":
            reasons[target] = TRT_SKIPPED if importlib.util.find_spec("tensorrt") else "TensorRT is not installed"
        else:
            reasons[target] = ""
    return reasons


def verify(
    directory: str | Path,
    *,
    checkpoint: str | Path | None = None,
    batch: int = 2,
    prompt: int = 11,
    steps: int = 6,
    seed: int = 0,
    threads: int | None = None,
) -> tuple[list[Check], dict[str, str]]:
    """Compare every runnable target with PyTorch; returns the checks and the skipped targets."""
    directory = Path(directory)
    manifest = load(directory)
    if manifest.quantization:
        source = manifest.quantization.get("source", {}).get("directory", "the float export")
        method = manifest.quantization.get("method")
        kind = "INT4" if method == "int4" else "INT8"
        raise EdgememError(
            f"{directory} is an {kind} export ({method} quantization): verify compares float exports with PyTorch "
            f"at float tolerances. Verify {source} instead, and judge the {kind} export by its drift report "
            f"(`edgemem calibrate SOURCE --method {method} --report drift.json`)"
        )
    unfit = unfit_reasons(manifest)
    if unfit:  # `edgemem verify` says so itself
        log.info("%s does not fit onnxruntime-genai: %s", directory, "; ".join(unfit))
    for target in manifest.targets:
        for kind in manifest.graphs_of(target):
            check_graph_file(manifest, directory / target / f"{kind}.onnx", target)
    model = rebuild(manifest, checkpoint)
    _check_config(manifest, model)
    kv = manifest.kv_cache
    if kv and kv["overflow"] == "error" and prompt + steps > kv["max_length"]:  # a short cache: a shorter stream
        steps = min(steps, max(1, kv["max_length"] // 3))
        prompt = kv["max_length"] - steps
    tolerance = TOLERANCE[manifest.config.get("dtype", "fp32")]
    rng = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, manifest.vocab_size, (batch, prompt + steps), generator=rng)
    state0 = initial_state(manifest, directory, batch)
    written = [s for s in manifest.state if s.output]  # a read-only state (output "") is fed, never returned
    names = [s.input for s in written]
    extras, output = graph_io(model)
    if extras and manifest.graphs["step"]:
        raise EdgememError(
            f"{directory}: verify feeds per-token inputs ({', '.join(extras)}) to prefill-only models only"
        )
    # per-token inputs such as Longformer's global_attention_mask: about one token in four set
    extra = {name: (torch.rand(batch, prompt, generator=rng) < 0.25).to(dtype) for name, dtype in extras.items()}
    outputs = [output, *(s.output for s in written)]
    encoded = None
    if manifest.encoder:  # an encoder-decoder: decoder streams start from an encoded random input
        length = min(13, manifest.encoder["max_length"])
        encoded = {
            "input_ids": torch.randint(0, manifest.vocab_size, (batch, length), generator=rng),
            "global_attention_mask": (torch.rand(batch, length, generator=rng) < 0.25).long(),
        }
        with torch.no_grad():
            start = model.start(*encoded.values())
        state0 = {spec.input: start[key].numpy() for spec, key in zip(manifest.state, start)}
    read_only = {s.input: state0[s.input] for s in manifest.state if not s.output}

    # the PyTorch run: prefill the prompt, then one step per token
    with torch.no_grad():
        keys = list(model.init_state(batch))
        torch_state = {k: torch.from_numpy(v.copy()) for k, v in zip(keys, state0.values())}
        keys = [k for k, spec in zip(keys, manifest.state) if spec.output]
        logits, torch_state = model.prefill(tokens[:, :prompt], torch_state, **extra)
        expected = {"prefill": [logits.numpy(), *(torch_state[k].numpy() for k in keys)], "step": []}
        for i in range(prompt, prompt + steps if manifest.graphs["step"] else prompt):
            logits, torch_state = model.step(tokens[:, i], torch_state)
            expected["step"].append([logits.numpy(), *(torch_state[k].numpy() for k in keys)])

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    checks, skipped = [], {t: why for t, why in runnable_targets(manifest).items() if why}
    for target in manifest.targets:
        if target in skipped:
            continue
        sessions = {
            kind: _session(directory / target / f"{kind}.onnx", options)
            for kind in manifest.graphs_of(target)
            if kind != "encoder"
        }

        def prefill(ids: np.ndarray, state: dict[str, np.ndarray]) -> list[np.ndarray]:
            """The prefill graph, or token by token through the step graph when there is none."""
            if "prefill" in sessions:
                return sessions["prefill"].run(
                    outputs, {"input_ids": ids, **{k: v.numpy() for k, v in extra.items()}, **state}
                )
            logits = []
            for i in range(ids.shape[1]):
                result = sessions["step"].run(outputs, {"input_ids": ids[:, i : i + 1], **read_only, **state})
                logits.append(result[0])
                state = dict(zip(names, result[1:]))
            return [np.concatenate(logits, axis=1), *(state[n] for n in names)]

        if encoded is not None:
            fills = manifest.encoder["fills"]
            session = ort.InferenceSession(
                str(directory / target / "encoder.onnx"), options, providers=["CPUExecutionProvider"]
            )
            got = session.run(list(fills.values()), {k: v.numpy() for k, v in encoded.items()})
            checks += [Check(target, "encoder", n, *_compare(a, state0[n]), True) for n, a in zip(fills, got)]
        got = prefill(tokens[:, :prompt].numpy(), state0)
        checks += [
            Check(target, "prefill", n, *_compare(a, e), True) for n, a, e in zip(outputs, got, expected["prefill"])
        ]
        if PREFILL_LAST in sessions:  # the last position's logits only, the same state
            last = sessions[PREFILL_LAST].run(outputs, {"input_ids": tokens[:, :prompt].numpy(), **state0})
            checks += [
                Check(target, PREFILL_LAST, n, *_compare(a, e[:, -1:] if n == output else e), True)
                for n, a, e in zip(outputs, last, expected["prefill"])
            ]
        if "step" in sessions:
            state = dict(zip(names, got[1:]))
            worst: dict[str, tuple[float, float]] = {}
            for j, i in enumerate(range(prompt, prompt + steps)):
                feed = {"input_ids": tokens[:, i : i + 1].numpy(), **read_only, **state}
                result = sessions["step"].run(outputs, feed)
                state = dict(zip(names, result[1:]))
                for n, a, e in zip(outputs, result, expected["step"][j]):
                    e = e[:, None] if n == output else e
                    worst[n] = tuple(map(max, worst.get(n, (0.0, 0.0)), _compare(a, e)))
            checks += [Check(target, "step", n, *err, True) for n, err in worst.items()]
            if "prefill" in sessions:  # inside ONNX Runtime: prefill of everything ≡ the prefill then the steps
                whole = prefill(tokens.numpy(), state0)
                for n, a, e in zip(outputs[1:], result[1:], whole[1:]):
                    checks.append(Check(target, "prefill≡step", n, *_compare(a, e), True))
    for c in checks:
        c.ok = c.max_rel <= tolerance
    return checks, skipped
