"""Titans MAC prompt prefill through the runtime: the prefill graph (a Loop over segments) against
stepping the same prompt token by token.

    python samples/titans_mac_prefill.py                          # 512 and 2048 tokens, full-size preset
    python samples/titans_mac_prefill.py --lengths 256 --repeats 1 --json mac.json

Exports the `titans-mac` preset (random weights, seed 0; ort target) to a temporary directory, loads
it with `Engine.load(..., threads=N)` and for every prompt length times, on fresh streams, one
`stream.prefill(ids)` (in the engine's chunks of 128 tokens) and `stream.step` over the same ids.
Reports the best of `--repeats` wall times of each, tokens/s, the speed-up and the largest
difference between the two runs' logits; prints a JSON document and saves it with `--json`.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np


def _best(run, repeats: int) -> tuple[float, np.ndarray]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - start)
    return min(times), out


def measure(directory: Path, lengths: list[int], repeats: int, threads: int) -> dict:
    from edgemem.runtime import Engine

    engine = Engine.load(directory, threads=threads)
    rows = []
    for length in lengths:
        ids = np.random.default_rng(length).integers(0, engine.vocab_size, length)
        engine.new_stream().prefill(ids[:64])  # warm-up: sessions allocate on their first runs
        prefill_s, prefilled = _best(lambda: engine.new_stream().prefill(ids), repeats)

        def step() -> np.ndarray:
            stream = engine.new_stream()
            return np.stack([stream.step(int(t)) for t in ids])

        step_s, stepped = _best(step, repeats)
        rows.append(
            {
                "tokens": length,
                "prefill_s": prefill_s,
                "step_s": step_s,
                "prefill_tokens_per_s": length / prefill_s,
                "step_tokens_per_s": length / step_s,
                "speedup": step_s / prefill_s,
                "max_abs_logit_diff": float(np.abs(prefilled - stepped).max()),
            }
        )
        print(
            f"{length:6d} tokens: prefill {prefill_s * 1e3:9.1f} ms ({length / prefill_s:8.0f} tok/s)   "
            f"steps {step_s * 1e3:9.1f} ms ({length / step_s:7.0f} tok/s)   ×{step_s / prefill_s:.1f}",
            flush=True,
        )
    return {
        "engine": {
            "backend": engine.backend,
            "target": engine.target,
            "threads": threads,
            "chunk_size": engine.chunk_size,
        },
        "results": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="512,2048", help="comma-separated prompt lengths")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each; the fastest is reported")
    parser.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads")
    parser.add_argument("--json", type=Path, help="also save the results here")
    args = parser.parse_args()

    from edgemem.export import export
    from edgemem.models import build

    with tempfile.TemporaryDirectory() as tmp:
        model = build("titans-mac", seed=0)
        export(model, Path(tmp) / "mac", targets=["ort"], extra_config={"seed": 0})
        report = {
            "arch": "titans-mac",
            "d_model": model.config.d_model,
            "n_layers": model.config.n_layers,
            "segment": model.prefill_segment,
            "machine": platform.machine(),
            "processor": platform.processor(),
            **measure(Path(tmp) / "mac", [int(n) for n in args.lengths.split(",")], args.repeats, args.threads),
        }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
