"""`edgemem bench DIR` against PyTorch: the runtime's numbers (`edgemem.runtime.bench`) next to two baselines.

- PyTorch eager `step` of the same model (rebuilt from the manifest), started from exactly the
  runtime's state at each position (read back from the runtime's checkpoint there, so no second
  prefill) and timed the same way (`time_steps`).
- the softmax preset's KV cache at each position: bytes per token (from
  `edgemem.models.describe("softmax")` at the benchmarked model's width and depth) × position.

The runtime is measured first; torch is imported only after that, so the runtime's RSS figures do
not include torch.
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from edgemem.errors import EdgememError
from edgemem.manifest import Manifest
from edgemem.manifest import load as load_manifest
from edgemem.runtime import bench
from edgemem.runtime.state import decode_checkpoint


def run_with_eager(
    directory: str | Path,
    *,
    steps: int = 100,
    warmup: int = 5,
    time_limit: float = 2.0,
    threads: int | None = 1,
    seed: int = 0,
    progress: bench.Progress | None = None,
    **runtime: Any,
) -> dict[str, Any]:
    """`edgemem.runtime.bench.run(directory, ..., **runtime)`, then the baselines: every row that was timed
    gains `eager_us_per_token`, `eager_tokens_per_s`, `speedup_vs_eager`; every row `softmax_kv_bytes`."""
    if importlib.util.find_spec("torch") is None:  # say so before minutes of runtime measurements
        raise EdgememError(
            "the PyTorch eager baseline needs torch, which is not installed: pass --no-eager for the "
            "runtime alone, or install PyTorch"
        )
    progress = progress or (lambda _: None)
    with tempfile.TemporaryDirectory(prefix="edgemem-bench-") as checkpoints:
        result = bench.run(
            directory,
            steps=steps,
            warmup=warmup,
            time_limit=time_limit,
            threads=threads,
            seed=seed,
            checkpoints=Path(checkpoints),
            progress=progress,
            **runtime,
        )
        manifest = load_manifest(directory, check_files=False)  # the runtime has just checked the files
        _eager(manifest, result, Path(checkpoints), steps, warmup, time_limit, threads, seed, progress)
    return result


def _eager(
    manifest: Manifest,
    result: dict[str, Any],
    checkpoints: Path,
    steps: int,
    warmup: int,
    time_limit: float,
    threads: int | None,
    seed: int,
    progress: bench.Progress,
) -> None:
    import torch  # noqa: PLC0415 — after every runtime measurement

    from edgemem.export.verify import rebuild  # noqa: PLC0415
    from edgemem.models import describe  # noqa: PLC0415

    progress("PyTorch: rebuilding the model")
    if threads:
        torch.set_num_threads(threads)
    model = rebuild(manifest)
    config = manifest.config
    sizes = {k: config[k] for k in ("d_model", "n_layers") if isinstance(config.get(k), int)}
    softmax = describe("softmax", **sizes)
    result["model"].update(
        params=sum(p.numel() for p in model.parameters()),
        softmax_baseline={
            "d_model": softmax["d_model"],
            "layers": softmax["layers"],
            "kv_bytes_per_token": softmax["state_bytes_per_token"],
        },
        torch=torch.__version__,
    )
    keys = {s.input: s.input.removeprefix("past_key_values.") for s in manifest.state}
    rng = np.random.default_rng(seed + 1)

    def time_eager(state: dict[str, Any], tokens: Any, steps: int, warmup: int) -> float:
        def step(i: int) -> None:
            nonlocal state
            _, state = model.step(tokens[i], state)

        with torch.inference_mode():
            return bench.time_steps(step, steps, warmup, time_limit)[0]

    time_eager(model.init_state(1), torch.zeros(20, 1, dtype=torch.long), 15, 5)  # torch's first calls: not in row 1
    for row in result["rows"]:
        row["softmax_kv_bytes"] = softmax["state_bytes_per_token"] * row["position"]
        if "skipped" in row:
            continue
        progress(f"PyTorch eager: position {row['position']:,}, batch {row['batch']}")
        checkpoint = decode_checkpoint(bench.checkpoint_path(checkpoints, row["position"]).read_bytes(), manifest)
        batch = row["batch"]
        state = {
            keys[name]: torch.from_numpy(a).expand(batch, *a.shape[1:]).contiguous()
            for name, a in checkpoint.state.items()
        }
        tokens = torch.from_numpy(rng.integers(0, manifest.vocab_size, (max(steps, 3) + warmup, batch)))
        seconds = time_eager(state, tokens, steps, warmup)
        del state
        row["eager_us_per_token"] = round(seconds * 1e6 / batch, 2)
        row["eager_tokens_per_s"] = round(batch / seconds, 1)
        row["speedup_vs_eager"] = round(row["eager_us_per_token"] / row["us_per_token"], 2)
