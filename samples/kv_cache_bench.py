"""Step time at positions 1K and 10K: growing vs preallocated KV cache, softmax-only and hybrid.

    python samples/kv_cache_bench.py --out kv_cache_bench.json [--threads 1] [--max-length 16384]

Exports four small models (d_model 256, byte vocabulary, random weights) to a temporary folder:
`softmax` (2 softmax-attention layers, the preset) and `hybrid` (3 gated DeltaNet layers + 1
softmax-attention layer, the Qwen3.5 ratio), each with a growing cache and with a cache
preallocated to --max-length. Each is timed with `edgemem.runtime.bench.run` (one stream prefilled
to the position, then the median of its single-token steps, `ort` target), and the table and the
ratio step(10K) / step(1K) are printed and saved as JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from edgemem.export import export
from edgemem.models import build
from edgemem.models.lm import LM, LMConfig, set_kv_cache
from edgemem.runtime import bench

POSITIONS = (1024, 10240)


def models(max_length: int) -> dict[str, LM]:
    torch.manual_seed(0)
    hybrid = LMConfig(arch="hybrid", mixer="gated_deltanet", d_model=256, n_layers=4, mlp_hidden=768,
                      mixer_options={"num_heads": 4}, layer_types=["gated_deltanet"] * 3 + ["softmax"],
                      layer_type_options={"softmax": {"num_heads": 4, "num_kv_heads": 2}})
    out = {}
    for name, make in (("softmax", lambda: build("softmax", seed=0)), ("hybrid", lambda: LM(hybrid))):
        out[f"{name}/growing"] = make().eval()
        model = make().eval()
        set_kv_cache(model, max_length)
        out[f"{name}/preallocated"] = model
    return out


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
            result = bench.run(directory, positions=POSITIONS, batches=[1], steps=200, time_limit=3.0, threads=args.threads)
            us = {r["position"]: r["us_per_step"] for r in result["rows"]}
            results[name] = {"us_per_step": us, "ratio_10k_1k": round(us[POSITIONS[1]] / us[POSITIONS[0]], 2),
                             "state_bytes": {r["position"]: r["state_bytes"] for r in result["rows"]},
                             "environment": result["environment"]}
            print(f"{name:24s} step µs at {POSITIONS[0]}: {us[POSITIONS[0]]:9.1f}  at {POSITIONS[1]}: "
                  f"{us[POSITIONS[1]]:9.1f}  ratio {results[name]['ratio_10k_1k']:.2f}", flush=True)
    args.out.write_text(json.dumps({"max_length": args.max_length, "d_model": 256, "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
