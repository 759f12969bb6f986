"""`edgemem bench DIR`, the runtime's side: step latency and memory at given positions and batch sizes.

For every position p (ascending) one stream is brought to p by prefilling random bytes in chunks
with the prefill graph (stepping 100k tokens one by one would take minutes; an export without a
prefill graph is stepped), then forked into `batch` streams whose steps are timed
(`stream.step` at batch 1, `engine.step_batch` above). Reported per configuration: µs per token
and tokens/s (median step time), state bytes per stream at the position and the process RSS.
A configuration whose memory would not fit (softmax's KV cache × batch) is skipped with a reason.

With `checkpoints`, the stream at each position is saved there too, so that a baseline can start
from exactly the runtime's state (the PyTorch eager comparison, `edgemem.eager_bench`, which this
package never imports).
"""

from __future__ import annotations

import os
import platform
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from edgemem.config import DEFAULT_CHUNK
from edgemem.errors import EdgememError
from edgemem.files import save_figure
from edgemem.runtime.base import Engine, Stream

Progress = Callable[[str], None]


def rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc), else its peak (getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if platform.system() == "Darwin" else peak * 1024


def reset_peak() -> None:
    """Start this process's peak resident set (VmHWM) again from its current size, where Linux allows it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_bytes() -> int:
    """This process's peak resident set since start or `reset_peak` (Linux VmHWM), else getrusage's maxrss."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if platform.system() == "Darwin" else peak * 1024


def available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def time_steps(step: Callable[[int], Any], steps: int, warmup: int, time_limit: float) -> tuple[float, int]:
    """Median seconds per call of `step(i)` over up to `steps` timed calls (at least 3, at most `time_limit` s)."""
    start = time.perf_counter()
    for i in range(warmup):
        step(i)
        if time.perf_counter() - start > time_limit / 4:  # slow configurations: a short warm-up is enough
            break
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < steps and (len(times) < 3 or time.perf_counter() - start < time_limit):
        t0 = time.perf_counter()
        step(len(times))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), len(times)


def _fits(engine: Engine, position: int, batch: int) -> str:
    """'' when `batch` streams at `position` fit comfortably in memory, else why not."""
    per_stream = engine.state_bytes(position)
    need = batch * per_stream * (4 if engine.grows else 3)  # streams + gather/scatter buffers (+ new caches)
    free = available_bytes()
    if free is not None and need > 0.5 * free:
        return f"needs ~{need / 2**30:.1f} GiB of state ({free / 2**30:.1f} GiB available)"
    return ""


def run(
    directory: str | Path,
    *,
    positions: Sequence[int],
    batches: Sequence[int],
    steps: int = 100,
    warmup: int = 5,
    time_limit: float = 2.0,
    threads: int | None = 1,
    target: str | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    seed: int = 0,
    checkpoints: Path | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Measure; returns {"environment", "model", "rows"} (rows: one per position × batch). With `checkpoints`
    (a directory), the stream at each position p is saved as `checkpoint_path(checkpoints, p)`."""
    progress = progress or (lambda _: None)
    positions, batches = sorted(set(positions)), sorted(set(batches))
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    rss_before = rss_bytes()
    reset_peak()
    engine = Engine.load(directory, threads=threads, target=target, chunk_size=chunk_size)
    if engine.kind.streams != "fresh":
        raise EdgememError(
            f"bench times streams that start empty and reach positions by prefill; {engine.manifest.arch} "
            f"is an {engine.kind.name} export, whose streams start from Engine.encode (time those with "
            "benchmarks/led_encoder.py)"
        )
    load_rss = rss_bytes() - rss_before
    rng = np.random.default_rng(seed)
    rows: list[dict[str, Any]] = []
    base = engine.new_stream()
    for position in positions:
        progress(f"prefill to {position:,}")
        start = time.perf_counter()
        if position > base.position:
            base.prefill(rng.integers(0, engine.vocab_size, position - base.position), all_logits=False)
        reach_s = time.perf_counter() - start
        if checkpoints is not None:
            base.save(checkpoint_path(checkpoints, position))
        for batch in batches:
            progress(f"runtime: position {position:,}, batch {batch}")
            row: dict[str, Any] = {"position": position, "batch": batch, "reach_s": round(reach_s, 3)}
            rows.append(row)
            why = _fits(engine, position, batch)
            if why:
                row["skipped"] = why
                continue
            seconds, n, state_bytes, rss = _time_runtime(engine, base, batch, rng, steps, warmup, time_limit)
            row.update(
                timed_steps=n,
                us_per_step=round(seconds * 1e6, 1),
                us_per_token=round(seconds * 1e6 / batch, 2),
                tokens_per_s=round(batch / seconds, 1),
                state_bytes=state_bytes,
                rss_bytes=rss,
            )
    model_info: dict[str, Any] = {
        "arch": engine.manifest.arch,
        "target": engine.target,
        "config": engine.manifest.config,
        "state_bytes_at_0": engine.state_bytes(0),
        "state_bytes_per_token": engine.state_bytes_per_token,
        "file_bytes": sum(
            (Path(directory) / name).stat().st_size
            for name in engine.manifest.files
            if name.startswith(f"{engine.target}/")
        ),
        "load_rss_bytes": load_rss,
        "peak_rss_bytes": peak_rss_bytes() - rss_before,  # load, prefills and steps: the most held at once
    }
    environment = {
        "onnxruntime": ort.__version__,
        "threads": threads,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "load_avg_before": load_before,
        "chunk_size": chunk_size,
        "load_avg_after": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "runtime_peak_rss_bytes": peak_rss_bytes(),
    }
    return {"environment": environment, "model": model_info, "rows": rows}


def checkpoint_path(folder: Path, position: int) -> Path:
    return folder / f"{position}.safetensors"


def _time_runtime(
    engine: Engine, base: Stream, batch: int, rng: np.random.Generator, steps: int, warmup: int, time_limit: float
) -> tuple[float, int, int, int]:
    """`batch` forks of `base` stepped together: (median s per step, timed steps, state bytes, RSS while alive)."""
    streams = [base.fork() for _ in range(batch)]
    state_bytes = streams[0].state_bytes  # at the position itself, before the timed steps
    tokens = rng.integers(0, engine.vocab_size, (max(steps, 3) + warmup, batch))
    if batch == 1:
        stream = streams[0]
        seconds, n = time_steps(lambda i: stream.step(int(tokens[i, 0])), steps, warmup, time_limit)
    else:
        seconds, n = time_steps(lambda i: engine.step_batch(streams, tokens[i]), steps, warmup, time_limit)
    return seconds, n, state_bytes, rss_bytes()


def plot(result: dict[str, Any], path: str | Path) -> None:
    """Latency and memory vs position (log-log), one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "skipped" not in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for batch in sorted({r["batch"] for r in rows}):
        sel = [r for r in rows if r["batch"] == batch]
        x = [r["position"] for r in sel]
        left.plot(x, [r["us_per_token"] for r in sel], "o-", label=f"edgemem runtime, batch {batch}")
        if all("eager_us_per_token" in r for r in sel):
            left.plot(x, [r["eager_us_per_token"] for r in sel], "s--", label=f"PyTorch eager, batch {batch}")
    left.set(
        xscale="log",
        yscale="log",
        xlabel="position (tokens)",
        ylabel="µs per token",
        title=f"{result['model']['arch']}: step latency",
    )
    left.legend(fontsize=8)
    one = sorted((r for r in rows if r["batch"] == min(r["batch"] for r in rows)), key=lambda r: r["position"])
    x = [r["position"] for r in one]
    right.plot(x, [r["state_bytes"] for r in one], "o-", label="state per stream (runtime)")
    right.plot(x, [r["rss_bytes"] for r in one], "^-", label="process RSS (whole bench process)")
    if all("softmax_kv_bytes" in r for r in one):
        right.plot(x, [r["softmax_kv_bytes"] for r in one], "s--", label="softmax KV cache (same width)")
    right.set(xscale="log", yscale="log", xlabel="position (tokens)", ylabel="bytes", title="memory")
    right.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


__all__ = ["available_bytes", "checkpoint_path", "plot", "rss_bytes", "run", "time_steps"]
