"""Benchmark of the PyTorch eager `step` of the presets: µs per token at given positions.

    python -m edgemem.bench [--arch A ...] [--positions 0,1000] [--steps 200] [--json out.json]

Prints a table and optionally saves the numbers; the runtime's benchmarks compare against these.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from edgemem.models import archs, build, state_bytes
from edgemem.models.lm import LM
from edgemem.runtime.bench import time_steps


@torch.inference_mode()
def eager_step_us(model: LM, *, batch: int = 1, position: int = 0, steps: int = 200, warmup: int = 20) -> float:
    """Median wall time of one `model.step` in µs, after prefilling `position` tokens."""
    state = model.init_state(batch)
    if position:
        _, state = model.prefill(torch.zeros(batch, position, dtype=torch.long), state)
    token = torch.zeros(batch, dtype=torch.long)

    def step(_: int) -> None:
        nonlocal state
        _, state = model.step(token, state)

    return time_steps(step, steps, warmup, time_limit=60.0)[0] * 1e6


def run(names: list[str], positions: list[int], steps: int) -> list[dict[str, Any]]:
    rows = []
    for name in names:
        model = build(name, seed=0).eval()
        for position in positions:
            state = model.init_state(1)
            us = eager_step_us(model, position=position, steps=steps)
            if position:
                with torch.inference_mode():
                    _, state = model.prefill(torch.zeros(1, position, dtype=torch.long), state)
            rows.append({"arch": name, "position": position, "us_per_token": round(us, 1), "state_bytes": state_bytes(state)})
            print(f"{name:16s} position {position:>6d}  {us:8.1f} µs/token  state {state_bytes(state):>9d} B", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", choices=archs(), help="preset (repeatable; default: all)")
    parser.add_argument("--positions", default="0,1000", help="comma-separated positions to step at")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--json", help="save the rows to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    info = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    print(f"PyTorch eager step, batch 1, fp32, {info['threads']} threads, torch {info['torch']}")
    streaming = [a for a in (args.arch or archs()) if build(a, seed=0).streaming]  # an encoder has no step
    rows = run(streaming, [int(p) for p in args.positions.split(",")], args.steps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": info, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
