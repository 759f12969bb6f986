"""The prefix state cache and speculative decoding on the CPU (onnxruntime, one thread).

    python benchmarks/prefix_spec.py [--out benchmarks/results] [--repeats 5]

1. Time to first token of a second stream whose prompt shares a long prefix with an earlier one:
   the gated-DeltaNet preset (2,048 shared tokens) and a Qwen3.5 hybrid import with a preallocated
   KV cache (random weights, hidden 256, 2 gated-DeltaNet + 2 attention layers; 1,024 shared tokens),
   each with and without `prefix_cache_bytes`; median of `--repeats` second streams.
2. Greedy tokens/s with and without speculation (prompt lookup; a draft model) on the trained byte
   model `checkpoints/deltanet-bytes.safetensors` and a modest random shape (gated-DeltaNet preset,
   d_model 512, 4 layers): a repetitive input (a document, then an edited copy of its first part, so
   the continuation is in the prompt) and a non-repetitive one (a document followed by the start of
   another); the acceptance rate of each. checkpoints/ has no smaller trained byte model, so the
   draft model is a random one (its row is the cost of drafting when nothing is accepted).
3. Rollback costs on a modest shape (gated-DeltaNet preset, d_model 512, 4 layers): one step, one
   verify run of k + 1 tokens, keeping the state by flipping sides vs copying it, and re-applying
   accepted tokens with one prefill run vs step by step.

Writes `<out>/prefix-spec.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def export_models(work: Path) -> dict[str, Path]:
    from test_hf_qwen3_5 import randomise, save, text_config
    from transformers import Qwen3_5ForCausalLM

    from edgemem.export import export
    from edgemem.models import build, from_hf, load_checkpoint
    from edgemem.models.lm import set_kv_cache

    out = {name: work / name for name in ("gdn", "modest", "hybrid", "trained", "draft")}
    export(build("gated-deltanet", seed=0), out["gdn"], targets=["ort"])
    export(build("gated-deltanet", seed=0, d_model=512, n_layers=4), out["modest"], targets=["ort"])
    config = text_config(
        ["linear_attention", "full_attention"] * 2, heads=4, kv_heads=2, head_dim=64, k_heads=2, v_heads=4, dk=64, dv=64
    )
    config.vocab_size, config.hidden_size, config.intermediate_size = 256, 256, 512
    hybrid = from_hf(save(randomise(Qwen3_5ForCausalLM(config), seed=3), work / "hf"))
    set_kv_cache(hybrid, 1280)
    export(hybrid, out["hybrid"], targets=["ort"])
    export(load_checkpoint(ROOT / "checkpoints" / "deltanet-bytes.safetensors"), out["trained"], targets=["ort"])
    export(build("deltanet", seed=0, d_model=32, n_layers=1, mlp_hidden=32), out["draft"], targets=["ort"])
    return out


def time_to_first_token(directory: Path, shared: int, repeats: int) -> dict:
    from edgemem.runtime import Engine

    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 256, shared)
    prompts = [np.concatenate([prefix, rng.integers(0, 256, 16)]) for _ in range(repeats + 1)]
    row = {"shared_tokens": shared, "suffix_tokens": 16}
    logits = {}
    for label, options in (("uncached", {}), ("cached", {"prefix_cache_bytes": 1 << 30})):
        engine = Engine.load(directory, threads=1, **options)
        engine.new_stream().prefill(prompts[0], all_logits=False)  # the earlier stream (and a warm-up)
        times = []
        for prompt in prompts[1:]:
            start = time.perf_counter()
            out = engine.new_stream().prefill(prompt, all_logits=False)
            times.append(time.perf_counter() - start)
        logits[label] = out
        row[f"{label}_ms"] = round(statistics.median(times) * 1e3, 2)
        if engine.prefix_cache is not None:
            row["cache_bytes"] = engine.prefix_cache.bytes
            row["snapshot_bytes"] = engine.snapshot_bytes(shared)
    row["speedup"] = round(row["uncached_ms"] / row["cached_ms"], 1)
    row["max_rel_diff"] = float(np.abs(logits["cached"] - logits["uncached"]).max() / np.abs(logits["uncached"]).max())
    return row


def documents() -> tuple[bytes, bytes]:
    """(repetitive, non-repetitive) prompts from the project's own sources: a 300-byte document, then an
    edited copy of its first 120 bytes (the trained model saw 256-byte windows: the copy is within reach);
    the same document, then the start of another."""
    doc = (ROOT / "edgemem" / "runtime" / "state.py").read_bytes()[:300]
    edited = doc[:120].replace(b"state", b"snapshot")
    other = (ROOT / "edgemem" / "runtime" / "sampling.py").read_bytes()[:120]
    return doc + b"\n\n" + edited, doc + b"\n\n" + other


def speculation(directories: dict[str, Path], new_tokens: int, k: int) -> list[dict]:
    """Greedy generation of `new_tokens` after each input, plain and speculative (best of 3 runs each)."""
    from edgemem.runtime import Engine

    draft = Engine.load(directories["draft"], threads=1)
    rows = []
    for name, label_model in (("trained", "deltanet-bytes (trained)"), ("modest", "gated-deltanet d512 L4 (random)")):
        target = Engine.load(directories[name], threads=1)
        drafters = [("plain", None), ("prompt-lookup", "prompt-lookup")]
        if name == "trained":
            drafters.append(("draft model (random deltanet d32)", draft))
        for kind, prompt in zip(("repetitive", "non-repetitive"), documents()):
            plain = None
            for label, drafter in drafters:
                best = None
                for _ in range(3):
                    stream = target.new_stream()
                    out = stream.generate(prompt, new_tokens, draft=drafter, draft_tokens=k)
                    stats = stream.generation
                    best = stats if best is None or stats.tokens_per_s > best.tokens_per_s else best
                plain = plain if plain is not None else (out, best.tokens_per_s)
                rows.append(
                    {
                        "model": label_model,
                        "input": kind,
                        "decoding": label,
                        "draft_tokens": k,
                        "tokens": best.tokens,
                        "tokens_per_s": round(best.tokens_per_s, 1),
                        "speedup": round(best.tokens_per_s / plain[1], 2),
                        "acceptance": None if best.acceptance_rate is None else round(best.acceptance_rate, 3),
                        "same_output": out == plain[0],
                    }
                )
    return rows


def rollback_costs(directory: Path, k: int, repeats: int = 100) -> dict:
    """Median µs of each part of a speculation round on one stream (its state put back after each)."""
    from edgemem.runtime import Engine, Stream

    engine = Engine.load(directory, threads=1)
    stream = engine.new_stream()
    stream.prefill(np.arange(64) % 256, all_logits=False)
    block = list(range(1, k + 2))

    def timed(fn) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return round(statistics.median(times) * 1e6, 1)

    def run_back(tokens: list[int], by_steps: bool = False) -> None:
        mark = Stream._mark(stream, len(tokens), one_run=False) if by_steps else stream._mark(len(tokens), one_run=True)
        if by_steps:
            for t in tokens:
                stream.step(t)
            Stream._rollback(stream, mark)
        else:
            stream._run_block(tokens)
            stream._rollback(mark)

    def step_back() -> None:
        mark = stream._mark(1, one_run=True)  # a step is one run too
        stream.step(1)
        stream._rollback(mark)

    row = {
        "k": k,
        "state_bytes": engine.state_bytes(0),
        "step_us": timed(step_back),
        "verify_run_us": timed(lambda: run_back(block)),
        "keep_by_flipping_sides_us": timed(lambda: stream._rollback(stream._mark(k + 1, one_run=True))),
        "keep_by_copy_us": timed(lambda: Stream._rollback(stream, Stream._mark(stream, k + 1, one_run=False))),
    }
    for m in range(1, k + 1):
        tokens = block[:m]
        row[f"reapply_{m}_one_run_us"] = timed(lambda t=tokens: run_back(t))
        row[f"reapply_{m}_steps_us"] = round(
            timed(lambda t=tokens: run_back(t, by_steps=True)) - row["keep_by_copy_us"], 1
        )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--draft-tokens", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dirs = export_models(Path(tmp))
        result = {
            "environment": {
                "cpus": os.cpu_count(),
                "machine": platform.machine(),
                "threads": 1,
                "load_avg": os.getloadavg(),
            },
            "time_to_first_token": {
                "gated-deltanet preset": time_to_first_token(dirs["gdn"], 2048, args.repeats),
                "qwen3.5 hybrid (KV cache 1280)": time_to_first_token(dirs["hybrid"], 1024, args.repeats),
            },
            "speculation": speculation(dirs, args.new_tokens, args.draft_tokens),
            "rollback": rollback_costs(dirs["modest"], args.draft_tokens),
        }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefix-spec.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
