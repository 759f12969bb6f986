"""Drift report: a quantized (INT8 or INT4) export against its fp32 export on held-out streams, at long horizons.

Both exports roll out the same held-out streams of the recipe's task (`Task.stream`) with the
runtime's chunked prefill (the prefill graph, `chunk_size` tokens per run; a model without one is
stepped). At each horizon h (32, 512, 4096, 32768 tokens by default):

- logits_rel_err: ‖logits_q − logits_fp32‖ / ‖logits_fp32‖ (Frobenius, all streams) over the
  `window` positions before h — the error *at* h, so the slope over horizons shows drift;
- state_rel_err: the same for the state at position h, per state kind (StateSpec.kind: every
  layer's tensors of one kind together);
- metric: the task's metric of the quantized model over the segment since the previous horizon
  (positions [previous h, h), scored positions only); `fp32_metric` is the fp32 model's.

Also: µs/token of single-stream steps at the last horizon (median, the runtime's `Stream.step`) and
the bytes of each export's ONNX files for the target run.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from edgemem.errors import EdgememError
from edgemem.files import save_figure
from edgemem.quant.recipe import Recipe, load_recipe

log = logging.getLogger(__name__)

Progress = Callable[[str], None]
WARMUP = 10  # steps before the timed ones at the last horizon


def _size(engine: Any) -> int:
    """Bytes of the ONNX files the engine runs (its target's prefill and step graphs)."""
    prefix = f"{engine.target}/"
    return sum(os.path.getsize(engine.directory / name) for name in engine.manifest.files if name.startswith(prefix))


class _Sums:
    """Squared error and squared reference norms, accumulated in float64."""

    def __init__(self) -> None:
        self.err = 0.0
        self.ref = 0.0

    def add(self, quantized: np.ndarray, reference: np.ndarray) -> None:
        q, r = quantized.astype(np.float64), reference.astype(np.float64)
        self.err += float(np.sum((q - r) ** 2))
        self.ref += float(np.sum(r**2))

    def relative(self) -> float | None:
        """sqrt(err / ref); None when not finite (a model that produced NaN or inf)."""
        value = float(np.sqrt(self.err / self.ref)) if self.ref > 0 else float(np.sqrt(self.err))
        return value if np.isfinite(value) else None


def drift_report(
    reference: str | Path,
    quantized: str | Path,
    recipe: str | Recipe | None = None,
    *,
    threads: int | None = 1,
    timing_steps: int = 200,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Compare `quantized` with the fp32 export `reference` (see the module docstring); a JSON-ready dict."""
    from edgemem.runtime import Engine
    from edgemem.runtime.bench import time_steps

    progress = progress or (lambda _: None)
    recipe = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    q = Engine.load(quantized, threads=threads)
    fp = Engine.load(reference, threads=threads, target=q.target)
    record = q.manifest.quantization or {}
    source = record.get("source", {}).get("identity")
    if source is not None and source != fp.manifest.identity():
        raise EdgememError(
            f"{quantized} was not quantized from {reference} (its manifest records another source export)"
        )
    if [s.input for s in q.manifest.state] != [s.input for s in fp.manifest.state]:
        raise EdgememError(f"{quantized} and {reference} have different state tensors: not the same model")
    recipe.check_vocabulary(fp.manifest.arch, fp.manifest.vocab_size)
    room = fp.manifest.max_positions
    recipe = recipe.drift_within(room, WARMUP + 3)  # room to time at least 3 steps at the last horizon
    if not recipe.horizons:
        raise EdgememError(
            f"recipe {recipe.source or recipe.name}: no drift horizon fits the export's {room:,} positions (its "
            f"--max-length) with {WARMUP + 3} steps to time after it; give [drift] horizons up to "
            f"{room - WARMUP - 3:,}, or export with a larger --max-length"
        )
    task = recipe.make_task()
    horizons = sorted(recipe.horizons)
    sample = task.stream(recipe.drift_streams, horizons[-1], recipe.drift_seed)
    kinds = list(dict.fromkeys(s.kind for s in fp.manifest.state))
    kind_of = {s.input: s.kind for s in fp.manifest.state}
    logits = {h: _Sums() for h in horizons}
    states = {h: {k: _Sums() for k in kinds} for h in horizons}
    scores = {h: {"quantized": [0.0, 0], "fp32": [0.0, 0]} for h in horizons}
    chunk = fp.chunk_size
    us: dict[str, float] = {}
    for b, (tokens, targets) in enumerate(zip(sample.tokens, sample.targets)):
        sf, sq = fp.new_stream(), q.new_stream()
        start = 0
        for h in horizons:
            progress(f"stream {b + 1}/{len(sample.tokens)}: to position {h:,}")
            window_start = max(start, h - recipe.window)
            for begin in range(start, h, chunk):
                end = min(begin + chunk, h)
                progress(f"stream {b + 1}/{len(sample.tokens)}: position {begin:,} of {h:,}")
                lf, lq = sf.prefill(tokens[begin:end]), sq.prefill(tokens[begin:end])
                scored = int((targets[begin:end] >= 0).sum())
                if scored:
                    for name, out in (("fp32", lf), ("quantized", lq)):
                        scores[h][name][0] += task.score(out[None], targets[None, begin:end]) * scored
                        scores[h][name][1] += scored
                if end > window_start:
                    first = max(window_start - begin, 0)
                    logits[h].add(lq[first:], lf[first:])
            ref_state, q_state = sf.state_dict(), sq.state_dict()
            for name, value in ref_state.items():
                states[h][kind_of[name]].add(q_state[name], value)
            start = h
        if not us:  # time steps at the last horizon: the state is as large as it gets
            progress("timing steps")
            steps = timing_steps if room is None else min(timing_steps, room - horizons[-1] - WARMUP)
            us = {
                name: time_steps(lambda i, s=s: s.step(int(tokens[i % len(tokens)])), steps, WARMUP, 2.0)[0] * 1e6
                for name, s in (("fp32", sf), ("quantized", sq))
            }

    def metric(h: int, name: str) -> float | None:
        total, n = scores[h][name]
        return total / n if n and np.isfinite(total) else None

    return {
        "horizons": {
            str(h): {
                "logits_rel_err": logits[h].relative(),
                "state_rel_err": {k: states[h][k].relative() for k in kinds},
                "metric": metric(h, "quantized"),
            }
            for h in horizons
        },
        "fp32_metric": {str(h): metric(h, "fp32") for h in horizons},
        "metric_name": task.metric,
        "task": {"name": task.name, "params": recipe.params, "streams": len(sample.tokens), "seed": recipe.drift_seed},
        "window": recipe.window,
        "us_per_token": {k: round(v, 2) for k, v in us.items()},
        "size_bytes": {"fp32": _size(fp), "quantized": _size(q)},
        "method": record.get("method"),
        "target": q.target,
        "threads": threads,
        "rollout": f"chunked prefill ({'prefill graph, ' if q.has_prefill else 'stepped, '}{chunk} tokens per run)",
        "reference": str(Path(reference).resolve()),
        "quantized": str(Path(quantized).resolve()),
    }


def _label(method: str | None) -> str:
    return "INT4" if method == "int4" else f"INT8 {method or ''}".strip()


def plot_report(report: dict[str, Any], path: str | Path) -> bool:
    """Error and metric against horizon as a PNG; False (and a log line) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no drift plot (pip install 'edgemem-toolkit[bench]')")
        return False
    horizons = [int(h) for h in report["horizons"]]
    rows = [report["horizons"][str(h)] for h in horizons]
    fig, (err_ax, metric_ax) = plt.subplots(1, 2, figsize=(10, 4))
    err_ax.plot(horizons, [r["logits_rel_err"] for r in rows], "o-", label="logits")
    for kind in rows[0]["state_rel_err"]:
        err_ax.plot(horizons, [r["state_rel_err"][kind] for r in rows], "s--", label=f"state: {kind}")
    err_ax.set(
        xscale="log",
        yscale="log",
        xlabel="position (tokens)",
        ylabel="relative error vs fp32",
        title=f"{_label(report.get('method'))} drift",
    )
    err_ax.legend(fontsize="small")
    metric_ax.plot(
        horizons, [r["metric"] for r in rows], "o-", label="int4" if report.get("method") == "int4" else "int8"
    )
    metric_ax.plot(horizons, [report["fp32_metric"][str(h)] for h in horizons], "s--", label="fp32")
    metric_ax.set(xscale="log", xlabel="position (tokens)", ylabel=report["metric_name"], title=report["task"]["name"])
    metric_ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return True
