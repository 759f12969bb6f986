"""The prefix state cache and speculative decoding on the CPU (onnxruntime, one thread).

    python benchmarks/prefix_spec.py [--out benchmarks/results] [--repeats 5] [--parts ...] [--cache DIR]

Parts (`--parts`; by default all but the two Qwen3.5-0.8B ones; the results of parts not run are kept
from the earlier file):

- `ttft`: time to first token of a second stream whose prompt shares a long prefix with an earlier
  one: the gated-DeltaNet preset (2,048 shared tokens) and a Qwen3.5 hybrid import with a preallocated
  KV cache (random weights, hidden 256, 2 gated-DeltaNet + 2 attention layers; 1,024 shared tokens),
  each with and without `prefix_cache_bytes`; median of `--repeats` second streams.
- `speculation`: greedy tokens/s with and without speculation (prompt lookup; a draft model) on the
  trained byte model `checkpoints/deltanet-bytes.safetensors` (drafted for by the much smaller trained
  `checkpoints/deltanet-bytes-draft.safetensors`) and a modest random shape (gated-DeltaNet preset,
  d_model 512, 4 layers): a repetitive input (a document, then an edited copy of its first part, so
  the continuation is in the prompt) and a non-repetitive one (a document followed by the start of
  another); the acceptance rate of each. Every speculative output must equal plain greedy's.
- `rollback`: the costs of a round on the modest shape: one step, one verify run of k + 1 tokens,
  keeping the state by flipping sides vs copying it, and re-applying accepted tokens with one prefill
  run vs step by step.
- `qwen`: the Qwen3.5-0.8B shape (random weights, made and exported as `peers.py` does, into
  `--cache`; `--max-length 4096`, `calibrate --method int4`): the speculation cells (plain, prompt
  lookup) on the same two inputs as byte ids, best of `--qwen-runs`. `qwen-ttft`: its time to first
  token at 2,048 shared tokens (`--qwen-repeats` second streams). The first run exports and quantises
  the 3 GB model (tens of minutes); later runs reuse the cache.

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


CHECKPOINTS = ROOT / "checkpoints"
PARTS = ("ttft", "speculation", "rollback", "qwen", "qwen-ttft")
NEEDS = {"ttft": ("gdn", "hybrid"), "speculation": ("trained", "draft", "modest"), "rollback": ("modest",)}
QWEN = "qwen3.5-0.8b"
QWEN_MAX_LENGTH = 4096  # the preallocated KV cache: 2,048 shared + 16 tokens, and the speculation streams


def export_models(work: Path, names: set[str]) -> dict[str, Path]:
    from edgemem.export import export
    from edgemem.models import build, load_checkpoint

    def hybrid():
        from test_hf_qwen3_5 import randomise, save, text_config
        from transformers import Qwen3_5ForCausalLM

        from edgemem.models import from_hf
        from edgemem.models.lm import set_kv_cache

        config = text_config(
            ["linear_attention", "full_attention"] * 2,
            heads=4,
            kv_heads=2,
            head_dim=64,
            k_heads=2,
            v_heads=4,
            dk=64,
            dv=64,
        )
        config.vocab_size, config.hidden_size, config.intermediate_size = 256, 256, 512
        model = from_hf(save(randomise(Qwen3_5ForCausalLM(config), seed=3), work / "hf"))
        set_kv_cache(model, 1280)
        return model

    makers = {
        "gdn": lambda: build("gated-deltanet", seed=0),
        "modest": lambda: build("gated-deltanet", seed=0, d_model=512, n_layers=4),
        "hybrid": hybrid,
        "trained": lambda: load_checkpoint(CHECKPOINTS / "deltanet-bytes.safetensors"),
        "draft": lambda: load_checkpoint(CHECKPOINTS / "deltanet-bytes-draft.safetensors"),
    }
    for name in names:
        export(makers[name](), work / name, targets=["ort"])
    return {name: work / name for name in names}


def qwen_export(cache: Path, config: str = QWEN) -> Path:
    """The int4 export of the random Qwen3.5-0.8B shape (`peers.py`'s model, a preallocated KV cache); `config`: one
    of `peers.CONFIGS` ("tiny": the same code on a small model)."""
    import peers

    hf = peers.make_model(cache, config)
    return peers.make_exports(cache, hf, QWEN_MAX_LENGTH, True, ["int4"], growing=False)["preallocated"]["int4"]


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


def speculation(
    target, label: str, drafters: list, new_tokens: int, k: int, runs: int = 3, ids: bool = False
) -> list[dict]:
    """Greedy generation of `new_tokens` after each input by `target` (an Engine), plain and with each of
    `drafters` ((label, draft) pairs), best of `runs` each; `ids`: the inputs as a list of byte ids."""
    rows = []
    for kind, prompt in zip(("repetitive", "non-repetitive"), documents()):
        prompt = list(prompt) if ids else prompt
        plain = None
        for decoding, drafter in [("plain", None), *drafters]:
            best = None
            for _ in range(runs):
                stream = target.new_stream()
                out = stream.generate(prompt, new_tokens, draft=drafter, draft_tokens=k)
                stats = stream.generation
                best = stats if best is None or stats.tokens_per_s > best.tokens_per_s else best
            plain = plain if plain is not None else (out, best.tokens_per_s)
            if out != plain[0]:
                raise AssertionError(f"{label}, {kind} input: greedy output with {decoding} differs from plain greedy")
            rows.append(
                {
                    "model": label,
                    "input": kind,
                    "decoding": decoding,
                    "draft_tokens": k,
                    "tokens": best.tokens,
                    "tokens_per_s": round(best.tokens_per_s, 2),
                    "speedup": round(best.tokens_per_s / plain[1], 2),
                    "acceptance": None if best.acceptance_rate is None else round(best.acceptance_rate, 3),
                    "verify_runs": best.verify_runs,
                    "same_output": True,
                }
            )
    return rows


def byte_models(directories: dict[str, Path], new_tokens: int, k: int, runs: int) -> list[dict]:
    from edgemem.runtime import Engine

    draft = Engine.load(directories["draft"], threads=1)
    trained = Engine.load(directories["trained"], threads=1)
    modest = Engine.load(directories["modest"], threads=1)
    lookup = ("prompt-lookup", "prompt-lookup")
    return [
        *speculation(
            trained,
            "deltanet-bytes (trained)",
            [lookup, ("draft model (deltanet-bytes-draft, trained)", draft)],
            new_tokens,
            k,
            runs,
        ),
        *speculation(modest, "gated-deltanet d512 L4 (random)", [lookup], new_tokens, k, runs),
    ]


def qwen_speculation(directory: Path, new_tokens: int, k: int, runs: int, label: str) -> dict:
    from edgemem.runtime import Engine

    target = Engine.load(directory, threads=1)
    rows = speculation(target, f"{label} (random)", [("prompt-lookup", "prompt-lookup")], new_tokens, k, runs, ids=True)
    size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
    return {"max_length": QWEN_MAX_LENGTH, "method": "int4", "export_bytes": size, "rows": rows}


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
    from peers import CONFIGS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--runs", type=int, default=5, help="generations per speculation cell (best kept)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS[:3]))
    parser.add_argument("--cache", type=Path, help="qwen parts (default ~/.cache/edgemem-bench/CONFIG)")
    parser.add_argument(
        "--qwen-config",
        default=QWEN,
        choices=sorted(CONFIGS),
        help="qwen parts: peers.py's model (tiny: a quick check)",
    )
    parser.add_argument("--qwen-runs", type=int, default=3, help="generations per speculation cell (best kept)")
    parser.add_argument("--qwen-repeats", type=int, default=2, help="second streams timed for time to first token")
    args = parser.parse_args()
    path = args.out / "prefix-spec.json"
    result = json.loads(path.read_text()) if path.is_file() else {"time_to_first_token": {}}
    result["environment"] = {"cpus": os.cpu_count(), "machine": platform.machine(), "threads": 1}
    loads = result.setdefault("load_avg", {})  # per part: the 1, 5 and 15-minute load averages as it started
    for part in args.parts:
        loads[part] = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        dirs = export_models(Path(tmp), {name for part in args.parts for name in NEEDS.get(part, ())})
        if "ttft" in args.parts:
            result["time_to_first_token"].update(
                {
                    "gated-deltanet preset": time_to_first_token(dirs["gdn"], 2048, args.repeats),
                    "qwen3.5 hybrid (KV cache 1280)": time_to_first_token(dirs["hybrid"], 1024, args.repeats),
                }
            )
        if "speculation" in args.parts:
            result["speculation"] = byte_models(dirs, args.new_tokens, args.draft_tokens, args.runs)
        if "rollback" in args.parts:
            result["rollback"] = rollback_costs(dirs["modest"], args.draft_tokens)
    if "qwen" in args.parts or "qwen-ttft" in args.parts:
        cache = args.cache or Path.home() / ".cache" / "edgemem-bench" / args.qwen_config
        cache.mkdir(parents=True, exist_ok=True)
        directory = qwen_export(cache, args.qwen_config)
        label = f"{args.qwen_config} int4"
        if "qwen" in args.parts:
            result[f"{label} speculation"] = qwen_speculation(
                directory, args.new_tokens, args.draft_tokens, args.qwen_runs, label
            )
            write(path, result)
        if "qwen-ttft" in args.parts:
            result["time_to_first_token"][f"{label} (KV cache {QWEN_MAX_LENGTH})"] = time_to_first_token(
                directory, 2048, args.qwen_repeats
            )
    write(path, result)
    print(json.dumps(result, indent=2))


def write(path: Path, result: dict) -> None:
    from edgemem.files import write_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (json.dumps(result, indent=2) + "\n").encode())


if __name__ == "__main__":
    main()
