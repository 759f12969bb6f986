"""The native runtime (libedgemem, native/) beside the Python runtime on one export, in one run.

    python benchmarks/native.py                               # deltanet, d_model 64, 1 layer
    python benchmarks/native.py --arch gated-deltanet --long 100000 --json benchmarks/results/native.json

Per runtime: the median microseconds of a batch-1 step (threads 1) after a 40-token prefill, the same
tokens on both; the C runtime's resident memory sampled along a `--long`-token stream (it should stay
flat: the state is fixed-size); and the resident memory `Engine.load` / `em_engine_load` add on a wider
export (`--footprint-d`), each in a fresh process, beside its weight bytes. The library is built with
CMake (Release) into `--build`; the exports go to a temporary folder. Needs the `[export]` extra.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PYTHON_PROBE = r"""
import json, sys, time
import numpy as np
from edgemem.runtime import Engine

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
start = rss()
engine = Engine.load(sys.argv[1], threads=1)
loaded = rss()
steps = int(sys.argv[2])
stream = engine.new_stream()
vocab = engine.vocab_size
logits = stream.prefill([(i * 7 + 3) % vocab for i in range(40)], all_logits=False)
token, times = 1, []
for _ in range(steps):
    t = time.perf_counter()
    stream.step(token)
    times.append((time.perf_counter() - t) * 1e6)
    token = (token * 31 + 7) % vocab
times.sort()
print(json.dumps({"rss_start": start, "rss_loaded": loaded, "median_us": times[steps // 2] if steps else 0,
                  "mean_us": sum(times) / steps if steps else 0}))
"""


def export(arch: str, out: Path, d_model: int, n_layers: int) -> int:
    """Export `arch` at `d_model` × `n_layers` (target ort) to `out`; its weight bytes."""
    from edgemem.export import export as run_export
    from edgemem.models import build

    model = build(arch, seed=0, d_model=d_model, n_layers=n_layers)
    run_export(model, out, targets=["ort"])
    return sum(p.numel() * p.element_size() for p in model.parameters())


def build_library(build: Path) -> Path:
    subprocess.run(
        [
            "cmake",
            "-S",
            ROOT / "native",
            "-B",
            build,
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DPython3_EXECUTABLE={sys.executable}",
        ],
        check=True,
        capture_output=True,
    )
    subprocess.run(["cmake", "--build", build, "-j", str(os.cpu_count() or 1)], check=True, capture_output=True)
    return build


def c_run(build: Path, directory: Path, steps: int, every: int = 0) -> dict:
    out = subprocess.run(
        [build / "em_bench", directory, str(steps), str(every)], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout)


def python_run(directory: Path, steps: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PYTHON_PROBE, directory, str(steps)], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="deltanet")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2000, help="timed steps per runtime")
    parser.add_argument("--repeats", type=int, default=3, help="runs per runtime, alternating; the best median counts")
    parser.add_argument("--long", type=int, default=100_000, help="tokens of the C stream whose memory is sampled")
    parser.add_argument("--every", type=int, default=5000)
    parser.add_argument(
        "--footprint-d", type=int, default=768, help="d_model of the export whose load footprint is measured"
    )
    parser.add_argument("--build", type=Path, default=ROOT / "build" / "native-bench")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    build = build_library(args.build)
    library = next(p for p in build.glob("libedgemem.so.*") if not p.is_symlink())
    with tempfile.TemporaryDirectory() as tmp:
        tiny, wide = Path(tmp) / "tiny", Path(tmp) / "wide"
        export(args.arch, tiny, args.d_model, args.layers)
        wide_bytes = export(args.arch, wide, args.footprint_d, 4)
        c, python = [], []
        for _ in range(args.repeats):  # alternating, so both see the same machine load
            c.append(c_run(build, tiny, args.steps))
            python.append(python_run(tiny, args.steps))
        long = c_run(build, tiny, args.long, args.every)
        c_wide, python_wide = c_run(build, wide, 0), python_run(wide, 0)
    rss = [r for _, r in long["rss"]]
    result = {
        "arch": args.arch,
        "d_model": args.d_model,
        "layers": args.layers,
        "threads": 1,
        "steps": args.steps,
        "c_step_us": min(r["median_us"] for r in c),
        "python_step_us": min(r["median_us"] for r in python),
        "c_step_us_runs": [r["median_us"] for r in c],
        "python_step_us_runs": [r["median_us"] for r in python],
        "long_tokens": args.long,
        "long_rss": long["rss"],
        "long_rss_growth_bytes": rss[-1] - rss[0],
        "long_median_us": long["median_us"],
        "state_bytes": long["state_bytes"],
        "footprint": {
            "d_model": args.footprint_d,
            "layers": 4,
            "weight_bytes": wide_bytes,
            "c_load_bytes": c_wide["rss_loaded"] - c_wide["rss_start"],
            "python_load_bytes": python_wide["rss_loaded"] - python_wide["rss_start"],
        },
        "library_bytes": library.stat().st_size,
        "date": time.strftime("%Y-%m-%d"),
    }
    print(
        f"{args.arch} d_model {args.d_model} × {args.layers} layers, batch 1, 1 thread: step {result['c_step_us']:.1f} µs in C, "  # noqa: E501
        f"{result['python_step_us']:.1f} µs in Python (medians, best of {args.repeats})"
    )
    print(
        f"C stream of {args.long} tokens: RSS {rss[0] / 2**20:.1f} MiB at {long['rss'][0][0]} → {rss[-1] / 2**20:.1f} MiB at "  # noqa: E501
        f"{long['rss'][-1][0]} (max {max(rss) / 2**20:.1f}); state {long['state_bytes']} bytes"
    )
    f = result["footprint"]
    print(
        f"load footprint, d_model {f['d_model']} × 4 layers ({f['weight_bytes'] / 2**20:.1f} MiB of weights): C "
        f"{f['c_load_bytes'] / 2**20:.1f} MiB, Python {f['python_load_bytes'] / 2**20:.1f} MiB"
    )
    print(f"libedgemem: {result['library_bytes']} bytes")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
