"""edgemem's runtime next to its peers on one CPU, in one run, on the same randomly initialised model.

    python benchmarks/peers.py [--config qwen3.5-0.8b|tiny] [--positions 1024,10240,16384] [--quick]
                               [--engines edgemem,edgemem-growing,genai,llama.cpp,transformers] [--precisions fp32,int4]

The model is Qwen3.5's smallest published text configuration (0.8B; numbers in CONFIGS, sources in
benchmarks/README.md) with random weights, made offline (seed 0) and saved with `save_pretrained` into
the cache folder. From that one directory:

- edgemem: `edgemem export --hf --max-length L` (ort target; a preallocated KV cache of L, the stream's length
  rounded up to a power of two, written in place) and `edgemem calibrate --method int4`; `edgemem.runtime`.
- edgemem-growing: the same runtime on the export without --max-length, whose KV cache grows each step: the
  export onnxruntime-genai runs, so this row and genai's compare two runtimes on one export (genai decodes
  with its prefill graph, edgemem with its step graph).
- onnxruntime-genai: those growing-cache graphs (`genai_config.json` beside them).
- llama.cpp through llama-cpp-python: the directory converted by llama.cpp's own `convert_hf_to_gguf.py`
  (`--llama-cpp-src`, a llama.cpp source tree matching the installed llama-cpp-python; f32), then
  `llama_model_quantize` to Q4_0 (4-bit, blocks of 32) for int4.
- transformers eager: `from_pretrained` of the directory (fp32 only: it has no int4 CPU path here).

Each engine × precision runs in its own subprocess (so its peak RSS is its own) and is fed the same
random token ids. A stream is brought from position 0 to each position (ascending) by a real chunked
prefill (128-token chunks, edgemem's default; llama.cpp's batch and micro-batch too), which gives
prefill tokens/s; transformers alone reaches the positions after the first by appending random rows to
its attention caches (its eager 16K prefill would take longer than
everything else together; a decode step costs the same whatever the values). At each position batch-1
decode is timed over `--steps` tokens (median). The weight-bandwidth floor is the bytes of weights a decode
step reads (the step graph's initializers except those only gathered from, i.e. the embedding table unless
it is also the tied output head) divided by the measured copy bandwidth (numpy copy of a 512 MiB buffer,
read + write bytes / s, best of 5). An engine that is not installed, or that cannot run a precision, is
listed with the reason.

Writes `<out>/peers[-quick][-<config>].json`, `.png` and `.md` (the table).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's edgemem, whatever else is installed
from edgemem.config import DEFAULT_CHUNK  # noqa: E402 — after the path above

ENGINES = ("edgemem", "edgemem-growing", "genai", "llama.cpp", "transformers")
GRAPHS = {  # what each engine runs
    "edgemem": "edgemem export --max-length (preallocated KV cache written in place)",
    "edgemem-growing": "edgemem export (growing KV cache: the export genai runs)",
    "genai": "edgemem export (growing KV cache), genai_config.json",
    "llama.cpp": "convert_hf_to_gguf.py (f32) / llama_model_quantize (Q4_0)",
    "transformers": "Qwen3_5ForCausalLM, DynamicCache",
}
PRECISIONS = ("fp32", "int4")
CHUNK = DEFAULT_CHUNK  # every engine's prefill chunk: edgemem's default (llama.cpp's batch and micro-batch)
CONFIGS: dict[str, dict[str, Any]] = {
    # Qwen3.5-0.8B's text model (see benchmarks/README.md for the sources of these numbers)
    "qwen3.5-0.8b": dict(
        vocab_size=248320,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=24,
        full_attention_interval=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_theta=10_000_000.0,
        partial_rotary_factor=0.25,
    ),
    # the same shape of model, small enough for a test
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        full_attention_interval=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_theta=10_000_000.0,
        partial_rotary_factor=0.25,
    ),
}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the model, made once into the cache


def hf_config(name: str):
    from transformers import Qwen3_5TextConfig

    c = dict(CONFIGS[name])
    every = c.pop("full_attention_interval")
    rope = {
        "rope_type": "default",
        "rope_theta": c.pop("rope_theta"),
        "partial_rotary_factor": c.pop("partial_rotary_factor"),
    }
    layers = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(c["num_hidden_layers"])]
    return Qwen3_5TextConfig(
        **c,
        layer_types=layers,
        rope_parameters=rope,
        max_position_embeddings=262144,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
    )


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """A byte-level BPE of exactly `vocab_size` tokens (the 256 byte symbols, then merges of a token and a byte
    symbol): llama.cpp's converter needs a tokenizer of the model's vocabulary; the benchmark feeds ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens, merges = list(alphabet), []
    seen = set(tokens)
    left = 0
    while len(tokens) < vocab_size:
        for symbol in alphabet:
            new = tokens[left] + symbol
            if new not in seen and len(tokens) < vocab_size:
                tokens.append(new)
                seen.add(new)
                merges.append((tokens[left], symbol))
        left += 1
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 262144})
    )


def make_model(cache: Path, name: str) -> Path:
    hf = cache / "hf"
    if (hf / "config.json").is_file():
        return hf
    import torch
    from transformers import Qwen3_5ForCausalLM

    log(f"making a random {name} (seed 0)")
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(hf_config(name)).eval()
    tmp = cache / "hf.partial"
    model.save_pretrained(tmp)
    write_tokenizer(tmp, CONFIGS[name]["vocab_size"])
    tmp.rename(hf)
    return hf


def make_exports(
    cache: Path, hf: Path, max_length: int, preallocated: bool, precisions: list[str], growing: bool = True
) -> dict[str, dict[str, Path]]:
    """{"growing" | "preallocated": {precision: export directory}}; the preallocated cache holds `max_length`.
    The growing export is made unless `growing` is false (this benchmark's floor counts its weights); the
    preallocated one only for the edgemem row, and int4 only when asked for."""
    from edgemem.export import export
    from edgemem.models.hf import from_hf, tokenizer_files
    from edgemem.models.lm import set_kv_cache
    from edgemem.quant import calibrate

    out = {
        "growing": {"fp32": cache / "edgemem-fp32", "int4": cache / "edgemem-int4"},
        "preallocated": {
            "fp32": cache / f"edgemem-fp32-cache{max_length}",
            "int4": cache / f"edgemem-int4-cache{max_length}",
        },
    }
    if not preallocated:
        del out["preallocated"]
    if not growing:
        del out["growing"]
    for kind, dirs in out.items():
        if not (dirs["fp32"] / "edgemem.json").is_file():
            log(f"edgemem export (ort target, {kind} KV cache)")
            model = from_hf(hf)
            if kind == "preallocated":
                set_kv_cache(model, max_length)
            export(
                model,
                dirs["fp32"],
                targets=["ort"],
                extra_config={"source": str(hf)},
                tokenizer=tokenizer_files(hf),
                force=True,
            )
        if "int4" in precisions and not (dirs["int4"] / "edgemem.json").is_file():
            log(f"edgemem calibrate --method int4 ({kind} KV cache)")
            calibrate(dirs["fp32"], "int4", out=dirs["int4"], force=True)
    return out


def stream_length(positions: list[int], steps: int) -> int:
    """Tokens a worker's stream holds at most: every position, the decoded tokens after each, some slack."""
    return max(positions) + steps * len(positions) + 16


def cache_length(positions: list[int], steps: int) -> int:
    """The preallocated cache: the stream's length rounded up to a power of two (one export serves nearby runs)."""
    return 1 << (stream_length(positions, steps) - 1).bit_length()


def make_gguf(cache: Path, hf: Path, src: Path | None) -> tuple[dict[str, Path], str]:
    """{precision: gguf} and '' or ({}, why not)."""
    try:
        import llama_cpp
    except ImportError:
        return {}, "llama-cpp-python is not installed (pip install llama-cpp-python: a source build)"
    out = {"fp32": cache / "llama-f32.gguf", "int4": cache / "llama-q4_0.gguf"}
    if not out["fp32"].is_file():
        script = src / "convert_hf_to_gguf.py" if src else None
        if script is None or not script.is_file():
            return {}, "no llama.cpp source tree (--llama-cpp-src DIR with convert_hf_to_gguf.py) to convert the model"
        log("convert_hf_to_gguf.py (f32)")
        # the random model's tokenizer is not one the converter knows by hash: name Qwen's pre-tokenizer (ids only here)
        runner = (
            f"import sys, runpy; sys.path[:0] = [{str(src)!r}, {str(src / 'gguf-py')!r}]; "
            "import conversion.base as b; b.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'qwen2'; "
            f"sys.argv = ['convert_hf_to_gguf.py', {str(hf)!r}, '--outtype', 'f32', '--no-mtp', '--outfile', {str(out['fp32'])!r}]; "  # noqa: E501
            f"runpy.run_path({str(script)!r}, run_name='__main__')"
        )
        done = subprocess.run([sys.executable, "-c", runner], capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:]
            return {}, f"llama.cpp's converter failed: {' '.join(tail)}"
    if not out["int4"].is_file():
        log("llama_model_quantize (Q4_0)")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
        params.nthread = os.cpu_count() or 1
        if llama_cpp.llama_model_quantize(str(out["fp32"]).encode(), str(out["int4"]).encode(), params) != 0:
            return {}, "llama_model_quantize failed"
    return out, ""


# ---------------------------------------------------------------- machine numbers


def copy_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes/s of a numpy copy (read + write traffic), best of `repeats`."""
    src = np.ones(megabytes << 18, dtype=np.float32)
    dst = np.empty_like(src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeats))
    return 2 * src.nbytes / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def decode_weight_bytes(export_dir: Path) -> int:
    """Bytes of weights one decode step reads: the step graph's initializers, less those only gathered from."""
    import onnx

    model = onnx.load(str(export_dir / "ort" / "step.onnx"), load_external_data=False)
    readers: dict[str, set[str]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, set()).add(node.op_type)
    total = 0
    for init in model.graph.initializer:
        if readers.get(init.name, set()) <= {"Gather"}:
            continue
        total += int(np.prod(init.dims, dtype=np.int64)) * onnx.helper.tensor_dtype_to_np_dtype(init.data_type).itemsize
    return total


# ---------------------------------------------------------------- engines (each in a worker process)


def peak_rss() -> int:
    """This process's peak resident set (VmHWM: getrusage's maxrss would include the parent's, kept across exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss() -> int:
    """This process's resident set now (VmRSS)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


class Runner:
    """prefill(ids) continues the stream; step(token) decodes one token. A runner whose cache can be filled
    (`fills`) reaches positions after the first by fill(n): n random rows appended to every attention cache."""

    fills = False

    def fill(self, n: int) -> None:
        raise NotImplementedError

    def prefill(self, ids: np.ndarray) -> None:
        raise NotImplementedError

    def step(self, token: int) -> None:
        raise NotImplementedError


class EdgememRunner(Runner):
    def __init__(self, path: Path, threads: int, max_len: int):
        from edgemem.runtime import Engine

        self.stream = Engine.load(path, threads=threads, chunk_size=CHUNK).new_stream()

    def prefill(self, ids):
        self.stream.prefill(ids, all_logits=False)

    def step(self, token):
        self.stream.step(token)


class GenaiRunner(Runner):
    """genai 0.18 cannot append a prompt after generated tokens on a graph with a KV cache (the pending token
    makes its preallocated `present.*.key` one longer than computed): a prefill after decoding starts a new
    generator and appends the whole history again (the table's prefill figure is the first, clean one)."""

    def __init__(self, path: Path, threads: int, max_len: int):
        import onnxruntime_genai as og

        config = og.Config(str(path))
        config.overlay(
            json.dumps(
                {
                    "model": {
                        "context_length": max_len,
                        "decoder": {"session_options": {"intra_op_num_threads": threads}},
                    },
                    "search": {"max_length": max_len},
                }
            )
        )
        self.og, self.model, self.max_len = og, og.Model(config), max_len
        self.history: list[int] = []
        self.generated = False
        self.generator = self._new()

    def _new(self):
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=self.max_len, do_sample=False)
        return self.og.Generator(self.model, params)

    def prefill(self, ids):
        ids = [int(t) for t in ids]
        if self.generated:
            self.generator, self.generated, ids = self._new(), False, self.history + ids
            self.history = []
        for begin in range(0, len(ids), CHUNK):
            self.generator.append_tokens(np.asarray([ids[begin : begin + CHUNK]], dtype=np.int32))
        self.history += ids

    def step(self, token):
        self.generator.generate_next_token()
        self.history.append(int(self.generator.get_next_tokens()[0]))
        self.generated = True


class LlamaRunner(Runner):
    def __init__(self, path: Path, threads: int, max_len: int):
        from llama_cpp import Llama

        self.llm = Llama(
            model_path=str(path),
            n_ctx=max_len,
            n_batch=CHUNK,
            n_ubatch=CHUNK,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )

    def prefill(self, ids):
        self.llm.eval([int(t) for t in ids])

    def step(self, token):
        self.llm.eval([token])


class TransformersRunner(Runner):
    fills = True  # a 16K real prefill in eager mode takes longer than the rest of the benchmark

    def __init__(self, path: Path, threads: int, max_len: int):
        import torch
        from transformers import DynamicCache, Qwen3_5ForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.cache = DynamicCache(config=self.model.config)

    def fill(self, n):
        """Append n random rows to each full-attention layer's keys and values; the gated-DeltaNet layers' states
        have a fixed size and stay as the real prefill left them. Decode time does not depend on the values."""
        from transformers.cache_utils import DynamicLayer

        for layer in self.cache.layers:
            if isinstance(layer, DynamicLayer) and layer.get_seq_length():
                shape = (*layer.keys.shape[:-2], n, layer.keys.shape[-1])
                layer.keys = self.torch.cat([layer.keys, self.torch.randn(shape, dtype=layer.keys.dtype)], dim=-2)
                layer.values = self.torch.cat([layer.values, self.torch.randn(shape, dtype=layer.values.dtype)], dim=-2)

    def _run(self, ids):
        with self.torch.inference_mode():
            self.model(
                input_ids=self.torch.as_tensor(np.asarray(ids)[None]),
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=1,
            )

    def prefill(self, ids):
        for begin in range(0, len(ids), CHUNK):
            self._run(ids[begin : begin + CHUNK])

    def step(self, token):
        self._run([token])


RUNNERS = {
    "edgemem": EdgememRunner,
    "edgemem-growing": EdgememRunner,
    "genai": GenaiRunner,
    "llama.cpp": LlamaRunner,
    "transformers": TransformersRunner,
}


def worker(args: argparse.Namespace) -> None:
    """One engine × precision: load, prefill to each position, time decode there; JSON on stdout."""
    positions = sorted(args.positions)
    length = stream_length(positions, args.steps)
    ids = np.random.default_rng(1).integers(2, CONFIGS[args.config]["vocab_size"], length)
    t0 = time.perf_counter()
    runner = RUNNERS[args.worker](Path(args.path), args.threads, length)
    result: dict[str, Any] = {
        "load_s": round(time.perf_counter() - t0, 2),
        "load_rss_bytes": rss(),  # the whole process once the model is loaded, as the peak is
        "prefill": {},
        "decode": {},
    }
    position = 0
    for target in positions:
        if target > position and position and runner.fills:
            runner.fill(target - position)
            result.setdefault("filled", []).append(f"{position}-{target}")
            position = target
        elif target > position:
            t0 = time.perf_counter()
            runner.prefill(ids[position:target])
            seconds = time.perf_counter() - t0
            result["prefill"][f"{position}-{target}"] = {
                "tokens": target - position,
                "seconds": round(seconds, 3),
                "tok_s": round((target - position) / seconds, 1),
            }
            position = target
        times = []
        for i in range(args.steps):
            t0 = time.perf_counter()
            runner.step(int(ids[position + i]))
            times.append(time.perf_counter() - t0)
        position += args.steps  # the decoded tokens are part of the stream now
        us = statistics.median(times[1:] if len(times) > 2 else times) * 1e6
        result["decode"][str(target)] = {"us_per_token": round(us, 1), "tok_s": round(1e6 / us, 2), "steps": len(times)}
    result["peak_rss_bytes"] = peak_rss()
    print(json.dumps(result))


def run_worker(engine: str, precision: str, path: Path, args: argparse.Namespace) -> dict[str, Any]:
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        engine,
        "--path",
        str(path),
        "--config",
        args.config,
        "--positions",
        ",".join(map(str, args.positions)),
        "--steps",
        str(args.steps),
        "--threads",
        str(args.threads),
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    }
    log(f"{engine} {precision}: {path.name}")
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        return {"error": lines[-1] if lines else f"exit status {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- the table and the plot


def table(report: dict[str, Any]) -> str:
    positions = report["positions"]
    first, last = positions[0], positions[-1]
    head = [
        "engine",
        "precision",
        *(f"decode tok/s @{p}" for p in positions),
        f"step time @{last} / @{first}",
        f"prefill tok/s (0→{first})",
        "RSS after load (GiB)",
        "peak RSS (GiB)",
        "model files (GB)",
        "floor tok/s",
        "note",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for engine, rows in report["engines"].items():
        for precision, row in rows.items():
            floor = report["floor"].get(precision, {}).get("tok_s", "")
            if "decode" not in row:
                lines.append(
                    f"| {engine} | {precision} | "
                    + " | ".join([""] * (len(head) - 3))
                    + f" | {row.get('skipped') or row.get('error')} |"
                )
                continue
            decode = row["decode"]
            prefill = next(iter(row["prefill"].values()))["tok_s"]
            note = f"reached {', '.join(row['filled'])} by filling its cache" if row.get("filled") else ""
            lines.append(
                "| "
                + " | ".join(
                    [
                        engine,
                        precision,
                        *(f"{decode[str(p)]['tok_s']:.2f}" for p in positions),
                        f"{decode[str(last)]['us_per_token'] / decode[str(first)]['us_per_token']:.2f}",
                        f"{prefill:.1f}",
                        f"{row['load_rss_bytes'] / 2**30:.2f}" if "load_rss_bytes" in row else "",
                        f"{row['peak_rss_bytes'] / 2**30:.2f}",
                        f"{row.get('model_bytes', 0) / 1e9:.2f}",
                        f"{floor}",
                        note,
                    ]
                )
                + " |"
            )
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    positions = report["positions"]
    fig, axes = plt.subplots(1, len(report["precisions"]) + 1, figsize=(5 * (len(report["precisions"]) + 1), 4.8))
    for ax, precision in zip(axes, report["precisions"]):
        ran = [(e, rows[precision]) for e, rows in report["engines"].items() if "decode" in rows.get(precision, {})]
        width = 0.8 / max(len(ran), 1)
        for i, (engine, row) in enumerate(ran):
            ax.bar(
                np.arange(len(positions)) + i * width,
                [row["decode"][str(p)]["tok_s"] for p in positions],
                width,
                label=engine,
            )
        floor = report["floor"].get(precision)
        if floor:
            ax.axhline(floor["tok_s"], color="k", ls="--", lw=1, label="bandwidth floor")
        ax.set(
            xticks=np.arange(len(positions)) + 0.4 - width / 2,
            xticklabels=[f"{p:,}" for p in positions],
            xlabel="position (tokens)",
            ylabel="batch-1 decode tokens/s",
            title=f"decode, {precision}",
        )
        ax.legend(fontsize="x-small", loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3)
    ax = axes[-1]
    names = [(e, p) for e, rows in report["engines"].items() for p, row in rows.items() if "prefill" in row]
    ax.barh(
        [f"{e} {p}" for e, p in names],
        [next(iter(report["engines"][e][p]["prefill"].values()))["tok_s"] for e, p in names],
    )
    ax.set(xlabel=f"prefill tokens/s (0→{positions[0]})", title="prefill")
    fig.suptitle(
        f"{report['model']['name']}, {report['machine']['threads']} thread(s), {report['machine']['cpu']}",
        fontsize="small",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- main


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="qwen3.5-0.8b")
    parser.add_argument(
        "--positions",
        type=lambda s: [int(p) for p in s.split(",")],
        default=None,
        help="decode positions, comma-separated (default 1024,10240,16384; --quick: 256,1024)",
    )
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated subset of {', '.join(ENGINES)}")
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="fp32, int4 or both")
    parser.add_argument(
        "--steps", type=int, default=None, help="decode steps timed per position (default 32; --quick: 8)"
    )
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="threads per engine (default: all cores)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="short positions and few steps: a check that everything runs"
    )
    parser.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="where the model and its conversions are kept (default ~/.cache/edgemem-bench/<config>)",
    )
    parser.add_argument(
        "--llama-cpp-src",
        type=Path,
        default=os.environ.get("LLAMA_CPP_SRC"),
        help="llama.cpp source tree for convert_hf_to_gguf.py (or $LLAMA_CPP_SRC)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.positions = args.positions or ([256, 1024] if args.quick else [1024, 10240, 16384])
    args.steps = args.steps or (8 if args.quick else 32)
    if min(args.positions) < 1 or args.steps < 1 or args.threads < 1:
        parser.error("positions, --steps and --threads must be positive")
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    args.precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    unknown = sorted(set(args.engines) - set(ENGINES)) + sorted(set(args.precisions) - set(PRECISIONS))
    if unknown:
        parser.error(f"unknown engine or precision: {', '.join(unknown)}")
    return args


def main() -> None:
    args = parse()
    if args.worker:
        worker(args)
        return
    import importlib.util

    cache = args.cache or Path.home() / ".cache" / "edgemem-bench" / args.config
    cache.mkdir(parents=True, exist_ok=True)
    hf = make_model(cache, args.config)
    exports = make_exports(
        cache, hf, cache_length(args.positions, args.steps), "edgemem" in args.engines, args.precisions
    )
    ggufs, no_llama = make_gguf(cache, hf, args.llama_cpp_src) if "llama.cpp" in args.engines else ({}, "")
    bandwidth = copy_bandwidth(64 if args.config == "tiny" else 512)
    floor = {}
    for precision in args.precisions:
        weights = decode_weight_bytes(exports["growing"][precision])
        us = weights / bandwidth * 1e6
        floor[precision] = {"weight_bytes": weights, "us_per_token": round(us, 1), "tok_s": round(1e6 / us, 2)}
    installed = {"genai": "onnxruntime_genai", "llama.cpp": "llama_cpp", "transformers": "transformers"}
    engines: dict[str, dict[str, Any]] = {}
    for engine in args.engines:
        engines[engine] = {}
        for precision in args.precisions:
            module = installed.get(engine)
            if module and importlib.util.find_spec(module) is None:
                engines[engine][precision] = {"skipped": f"{module} is not installed"}
            elif engine == "llama.cpp" and no_llama:
                engines[engine][precision] = {"skipped": no_llama}
            elif engine == "transformers" and precision == "int4":
                engines[engine][precision] = {"skipped": "transformers has no int4 CPU path in this environment"}
            else:
                path = {
                    "edgemem": exports.get("preallocated"),
                    "edgemem-growing": exports["growing"],
                    "genai": exports["growing"],
                    "llama.cpp": ggufs,
                    "transformers": {"fp32": hf},
                }[engine][precision]
                engines[engine][precision] = {"graph": GRAPHS[engine], **run_worker(engine, precision, path, args)}
                engines[engine][precision]["model_bytes"] = sum(
                    f.stat().st_size
                    for f in ([path] if path.is_file() else path.rglob("*"))
                    if f.is_file() and f.suffix in (".onnx", ".data", ".gguf", ".safetensors")
                )
    report = {
        "model": {"name": f"{args.config} (random weights, seed 0)", "config": CONFIGS[args.config]},
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "threads": args.threads,
            "copy_bandwidth_GBps": round(bandwidth / 1e9, 2),
        },
        "positions": sorted(args.positions),
        "steps": args.steps,
        "precisions": args.precisions,
        "prefill_chunk": CHUNK,
        "floor": floor,
        "engines": engines,
        "kv_cache_length": cache_length(args.positions, args.steps),
        "method": "each engine in its own process; positions reached by a real chunked prefill, except where a row "
        "lists `filled` (random rows appended to its attention caches); decode = median of `steps` batch-1 "
        "tokens; floor = decode weight bytes / copy bandwidth",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "peers" + ("-quick" if args.quick else "") + ("" if args.config == "qwen3.5-0.8b" else f"-{args.config}")
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / f"{stem}.md").write_text(table(report))
    plot(report, args.out / f"{stem}.png")
    print(table(report))
    log(f"wrote {args.out / stem}.json, .md, .png")


if __name__ == "__main__":
    main()
