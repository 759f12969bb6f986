"""A long stream on one fp16 export: no NaN, resident memory flat, resume from every checkpoint bit-exact.

    python benchmarks/long_run.py                              # 1,000,000 tokens, a checkpoint every 100,000
    python benchmarks/long_run.py --tokens 200000 --every 50000

The model is a small recurrent preset (random weights, seed 0) exported at fp16 for the ort target and
run by `edgemem.runtime` on one thread. The stream takes a fixed random token sequence in blocks of
`--block` tokens: nine blocks in ten by the prefill graph, the tenth token by token through the step graph.
After every block the logits are checked finite and the process's resident memory is sampled. At every
checkpoint the stream is saved (`Stream.save`); afterwards each checkpoint is loaded and fed the next
`--resume-blocks` blocks, and its state and logits must equal the uninterrupted stream's bit for bit.
Results go to benchmarks/results/long_run.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent


def rss() -> int:
    """Resident bytes of this process now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def feed(stream, tokens: np.ndarray, block: int, index: int) -> np.ndarray:
    """Block number `index` of `tokens`: by the step graph every tenth block, else by the prefill graph."""
    piece = tokens[index * block : (index + 1) * block]
    if index % 10 == 9:
        for token in piece.tolist():
            logits = stream.step(token)
        return logits
    return stream.prefill(piece, chunk_size=block, all_logits=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="gated-deltanet")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--every", type=int, default=100_000, help="tokens between checkpoints")
    parser.add_argument("--block", type=int, default=1000)
    parser.add_argument("--resume-blocks", type=int, default=10)
    parser.add_argument("--time-limit", type=float, default=None, help="stop the stream after this many seconds")
    parser.add_argument("--out", default=str(ROOT / "results" / "long_run.json"))
    args = parser.parse_args()
    if args.tokens % args.block or args.every % args.block:
        sys.exit("--tokens and --every must be multiples of --block")

    from edgemem.export import export
    from edgemem.models import build
    from edgemem.runtime import Engine

    work = Path(tempfile.mkdtemp(prefix="edgemem-long-run-"))
    model = build(args.arch, seed=0, d_model=args.d_model, n_layers=args.layers)
    export(model, work / "export", targets=["ort"], dtype="fp16")
    engine = Engine.load(work / "export", threads=1)
    tokens = np.random.default_rng(0).integers(0, engine.vocab_size, args.tokens + args.every, dtype=np.int64)
    blocks, per = args.tokens // args.block, args.every // args.block

    stream = engine.new_stream()
    samples: list[tuple[int, int]] = []  # (position, resident bytes)
    checkpoints: dict[int, Path] = {}
    expected: dict[int, tuple[dict[str, np.ndarray], np.ndarray]] = {}  # checkpoint index → after its resume span
    nonfinite, start, done = 0, time.perf_counter(), 0
    for index in range(blocks):
        if index % per == 0 and index:
            checkpoints[index] = work / f"{index * args.block}.state"
            stream.save(checkpoints[index])
        logits = feed(stream, tokens, args.block, index)
        nonfinite += int(not np.isfinite(logits).all())
        done = index + 1
        for first, _ in checkpoints.items():
            if done == first + args.resume_blocks:
                expected[first] = (stream.state_dict(), logits)
        samples.append((stream.position, rss()))
        if index % 50 == 49:
            elapsed = time.perf_counter() - start
            print(
                f"{stream.position:,} tokens, {stream.position / elapsed:,.0f} tok/s, RSS {rss() / 2**20:.1f} MiB",
                flush=True,
            )
        if args.time_limit and time.perf_counter() - start > args.time_limit:
            break
    seconds = time.perf_counter() - start
    reached = stream.position

    resumes = []
    for first, path in checkpoints.items():
        if first not in expected:
            continue
        again = engine.load_stream(path)
        for index in range(first, first + args.resume_blocks):
            logits = feed(again, tokens, args.block, index)
        state, want = expected[first]
        same = all(np.array_equal(v, state[k]) for k, v in again.state_dict().items()) and np.array_equal(logits, want)
        resumes.append({"checkpoint_position": first * args.block, "compared_at": again.position, "bit_exact": same})

    warm = [r for p, r in samples if p >= min(args.every, reached)]
    half = len(warm) // 2
    result = {
        "model": f"{args.arch}, d_model {args.d_model}, {args.layers} layers, fp16 export, ort target, 1 thread",
        "machine": f"{platform.machine()}, {platform.python_implementation()} {platform.python_version()}",
        "tokens_asked": args.tokens,
        "tokens_streamed": reached,
        "seconds": round(seconds, 1),
        "tokens_per_second": round(reached / seconds),
        "step_share": "every tenth block of %d tokens through the step graph" % args.block,  # noqa: UP031
        "blocks_with_nonfinite_logits": nonfinite,
        "state_bytes": engine.state_bytes(),
        "rss_mib": {
            "after_first_checkpoint_span_min": round(min(warm) / 2**20, 2),
            "after_first_checkpoint_span_max": round(max(warm) / 2**20, 2),
            "first_half_mean": round(float(np.mean(warm[:half])) / 2**20, 2) if half else None,
            "second_half_mean": round(float(np.mean(warm[half:])) / 2**20, 2) if half else None,
            "final": round(samples[-1][1] / 2**20, 2),
        },
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "checkpoints": len(checkpoints),
        "resumes": resumes,
        "all_resumes_bit_exact": bool(resumes) and all(r["bit_exact"] for r in resumes),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
