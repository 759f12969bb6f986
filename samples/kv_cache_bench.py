"""Step time at positions 1K and 10K: growing vs preallocated KV cache, softmax-only and hybrid.

    python samples/kv_cache_bench.py --out kv_cache_bench.json [--threads 1] [--max-length 16384]

Exports small models (random weights, byte vocabulary) to a temporary folder, each with a growing
cache and with a cache preallocated to --max-length (`ort` target):
- `softmax`: the preset (2 softmax-attention layers, d_model 256, 4 heads of 64);
- `hybrid-256`: 3 gated DeltaNet layers + 1 softmax-attention layer (the Qwen3.5 ratio), d_model 256,
  4 query / 2 KV heads of 64: 14.8 MB of fp32 weights for 1 KB of KV cache per token;
- `hybrid-512`: the same at d_model 512 with 8 query / 2 KV heads: 57 MB of weights per 1 KB of
  KV cache per token, closer to real hybrids, whose weights outweigh a token of cache further still.
A stream is made at each position with random state (`Engine.stream_from_state`: a step costs the
same whatever the values, and no 10K-token prefill is needed) and its single-token steps are timed
(median, `edgemem.runtime.bench.time_steps`). Prints the table and the ratio step(10K) / step(1K),
and saves them as JSON. A memory-bound step costs (weights + KV bytes read) / bandwidth, so the
ratio is about (W + 10K·c) / (W + 1K·c) for W bytes of weights and c bytes of cache per token.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from edgemem.export import export
from edgemem.models import build
from edgemem.models.lm import LM, LMConfig, set_kv_cache
from edgemem.runtime import Engine, bench

POSITIONS = (1024, 10240)


def hybrid(d_model: int, heads: int) -> LM:
    return LM(
        LMConfig(
            arch=f"hybrid-{d_model}",
            mixer="gated_deltanet",
            d_model=d_model,
            n_layers=4,
            mlp_hidden=3 * d_model,
            mixer_options={"num_heads": 4},
            layer_types=["gated_deltanet"] * 3 + ["softmax"],
            layer_type_options={"softmax": {"num_heads": heads, "num_kv_heads": 2}},
        )
    )


def models(max_length: int) -> dict[str, LM]:
    makers = {
        "softmax": lambda: build("softmax", seed=0),
        "hybrid-256": lambda: hybrid(256, 4),
        "hybrid-512": lambda: hybrid(512, 8),
    }
    out = {}
    for name, make in makers.items():
        torch.manual_seed(0)
        out[f"{name}/growing"] = make().eval()
        model = make().eval()
        set_kv_cache(model, max_length)
        out[f"{name}/preallocated"] = model
    return out


def step_us(engine: Engine, position: int, rng: np.random.Generator) -> float:
    """Median µs of one step of a stream at `position` with random state."""
    fresh = engine.new_stream().state_dict()
    cache = engine.manifest.kv_cache
    state = {}
    for name, value in fresh.items():
        shape = list(value.shape)
        if "past_sequence" in next(s.shape for s in engine.manifest.state if s.input == name):
            shape[2] = position
        state[name] = (
            np.full(shape, position, value.dtype)
            if value.dtype == np.int64
            else rng.standard_normal(shape).astype(value.dtype) * 0.1
        )
    if cache:  # slots past the position stay empty
        for name in cache["states"]:
            state[name][:, :, position:] = 0
    stream = engine.stream_from_state(state, position)
    tokens = rng.integers(0, engine.vocab_size, 400)
    seconds, _ = bench.time_steps(lambda i: stream.step(int(tokens[i])), 200, 5, 3.0)
    return seconds * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("kv_cache_bench.json"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-length", type=int, default=16384)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in models(args.max_length).items():
            directory = Path(tmp) / name.replace("/", "-")
            export(model, directory, targets=("ort",))
            engine = Engine.load(directory, threads=args.threads)
            rng = np.random.default_rng(0)
            us = {p: round(step_us(engine, p, rng), 1) for p in POSITIONS}
            results[name] = {
                "us_per_step": us,
                "ratio_10k_1k": round(us[POSITIONS[1]] / us[POSITIONS[0]], 2),
                "weight_bytes": sum(p.numel() * 4 for p in model.parameters()),
                "state_bytes": {p: engine.state_bytes(p) for p in POSITIONS},
            }
            print(
                f"{name:26s} step µs at {POSITIONS[0]}: {us[POSITIONS[0]]:9.1f}  at {POSITIONS[1]}: "
                f"{us[POSITIONS[1]]:9.1f}  ratio {results[name]['ratio_10k_1k']:.2f}",
                flush=True,
            )
    info = {"max_length": args.max_length, "threads": args.threads, "cpus": os.cpu_count(), "load_avg": os.getloadavg()}
    args.out.write_text(json.dumps({**info, "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
