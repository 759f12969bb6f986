"""A batch-1 step of a preallocated KV cache on the `ort` target: folded query heads against the plain op.

    python benchmarks/gqa_fold.py [--positions 1024,10240,16384] [--steps 30] [--threads N]

One softmax-attention layer in Qwen3.5-0.8B's attention shape (hidden 1024, 8 query heads on 2 KV heads
of 256, output gate, 25% partial RoPE; a byte vocabulary), random weights, exported with a KV cache of
32,768 slots. `edgemem.export.lower` gives its batch-1 step an `If`: folded (the 4 query heads of a KV
head as 4 tokens of one head, one read of the cache) or the plain GroupQueryAttention (each query head
on its own, each KV head read 4 times), which batches take. The plain row runs the same graph with that
`If` pinned to its plain branch. Both engines step streams whose caches are filled to each position
(random rows), interleaved step by step; median ms per step.

Writes `<out>/gqa-fold.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
LENGTH = 32768


def export_layer(directory: Path) -> None:
    import torch

    from edgemem.export import export
    from edgemem.models.lm import LM, LMConfig, set_kv_cache

    attention = dict(num_heads=8, num_kv_heads=2, head_dim=256, qk_norm=True, output_gate=True, rotary_dim=64)
    config = LMConfig(
        arch="qwen3.5-0.8b-attention",
        mixer="softmax",
        d_model=1024,
        n_layers=1,
        mlp_hidden=3584,
        mixer_options=attention,
    )
    torch.manual_seed(0)
    model = LM(config).eval()
    set_kv_cache(model, LENGTH)
    export(model, directory, targets=["ort"], force=True)


def pin_plain(directory: Path, out: Path) -> None:
    """A copy of the export whose step graph always takes the plain branch."""
    import onnx
    from onnx import TensorProto, helper

    from edgemem.files import sha256

    shutil.copytree(directory, out)
    step = out / "ort" / "step.onnx"
    model = onnx.load(str(step))
    model.graph.node.insert(
        0, helper.make_node("Constant", [], ["plain"], value=helper.make_tensor("plain", TensorProto.BOOL, [], [False]))
    )
    pinned = 0
    for node in model.graph.node:
        if node.op_type == "If":
            node.input[0] = "plain"
            pinned += 1
    if not pinned:
        raise SystemExit("the step graph has no If to pin: is the fold still in edgemem.export.lower?")
    onnx.save(model, str(step))
    manifest = json.loads((out / "edgemem.json").read_text())
    manifest["files"]["ort/step.onnx"] = sha256(step)
    (out / "edgemem.json").write_text(json.dumps(manifest))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", type=lambda s: [int(p) for p in s.split(",")], default=[1024, 10240, 16384])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be at least 3 (the first two steps are warm-up)")
    if max(args.positions) + args.steps > LENGTH:
        parser.error(f"positions + steps must stay within the {LENGTH}-slot cache")

    from edgemem.files import write_atomic
    from edgemem.runtime import Engine

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        folded, plain = Path(tmp) / "folded", Path(tmp) / "plain"
        export_layer(folded)
        pin_plain(folded, plain)
        engines = {
            "folded": Engine.load(folded, target="ort", threads=args.threads),
            "plain": Engine.load(plain, target="ort", threads=args.threads),
        }
        results = {}
        for position in args.positions:
            streams = {}
            for name, engine in engines.items():
                state = {}
                for spec in engine.manifest.state:
                    if spec.input.endswith(".position"):
                        state[spec.input] = np.array([position], np.int64)
                    else:
                        shape = [1 if d == "batch" else d for d in spec.shape]
                        cache = rng.standard_normal(shape).astype(np.float32)
                        cache[:, :, position:] = 0
                        state[spec.input] = cache
                streams[name] = engine.stream_from_state(state, position)
            times = {name: [] for name in streams}
            for i in range(args.steps):
                for name, stream in streams.items():
                    t0 = time.perf_counter()
                    stream.step(i % 256)
                    times[name].append(time.perf_counter() - t0)
            ms = {name: round(statistics.median(t[2:]) * 1e3, 3) for name, t in times.items()}
            results[str(position)] = {**ms, "speedup": round(ms["plain"] / ms["folded"], 2)}
            print(
                f"position {position:>6}: folded {ms['folded']:8.3f} ms   plain {ms['plain']:8.3f} ms   "
                f"{results[str(position)]['speedup']:.2f}x",
                flush=True,
            )
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "what": "one Qwen3.5-0.8B-shaped attention layer, batch-1 step, KV cache of 32768 slots",
        "threads": args.threads,
        "steps": args.steps,
        "machine": platform.processor() or platform.machine(),
        "ms_per_step": results,
    }
    path = args.out / "gqa-fold.json"
    write_atomic(path, (json.dumps(record, indent=1) + "\n").encode())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
