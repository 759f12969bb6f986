"""Peak memory of a Longformer encoder on a long input: edgemem's ONNX export on onnxruntime next
to transformers' LongformerModel, same weights, same input.

    python samples/longformer_memory.py                      # 16384 tokens
    python samples/longformer_memory.py --length 4096 --window 256

Makes a random Longformer (no download) with `save_pretrained`, imports and exports it with
edgemem (prefill-only encoder, any length), then runs each side in a fresh process on the same
ids with global tokens at the first and middle positions, and reports each process's peak RSS
(ru_maxrss), its RSS before the run (imports and weights), the wall time of the run, and how
far the two outputs agree. A dense T×T attention would need H·T²·4 bytes for one layer's
scores; that figure is printed for scale. Needs transformers (`pip install transformers`).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _rss_mb() -> float:
    """Current resident set size of this process in MiB (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _inputs(length: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.random.default_rng(0).integers(3, vocab, (1, length), dtype=np.int64)
    mask = np.zeros((1, length), np.int64)
    mask[0, [0, length // 2]] = 1
    return ids, mask


def worker(side: str, directory: Path, length: int, threads: int) -> None:
    """One measurement in this process; prints a JSON line and saves the output beside the model."""
    if side == "onnxruntime":
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        session = ort.InferenceSession(str(directory / "export" / "generic" / "prefill.onnx"), options)
        vocab = json.loads((directory / "hf" / "config.json").read_text())["vocab_size"]
        ids, mask = _inputs(length, vocab)
        before = _rss_mb()
        start = time.perf_counter()
        (out,) = session.run(None, {"input_ids": ids, "global_attention_mask": mask})
    else:
        import torch
        import transformers

        torch.set_num_threads(threads)
        model = transformers.LongformerModel.from_pretrained(directory / "hf").eval()
        ids, mask = _inputs(length, model.config.vocab_size)
        before = _rss_mb()
        start = time.perf_counter()
        with torch.no_grad():
            out = model(input_ids=torch.from_numpy(ids), global_attention_mask=torch.from_numpy(mask)).last_hidden_state
        out = out.numpy()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    np.save(directory / f"{side}.npy", out)
    print(
        json.dumps(
            {"side": side, "peak_rss_mb": round(peak), "rss_before_run_mb": round(before), "seconds": round(seconds, 2)}
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=16384, help="tokens in the input")
    parser.add_argument("--window", type=int, default=128, help="Longformer attention_window (full width, even)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--worker", choices=["onnxruntime", "transformers"], help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.dir, args.length, args.threads)
        return

    with tempfile.TemporaryDirectory(prefix="longformer-memory-") as tmp:
        measure(Path(tmp), args)


def measure(directory: Path, args: argparse.Namespace) -> None:
    """Save, import and export the model under `directory`, then run both sides and print the table."""
    import torch
    import transformers
    from safetensors.torch import load_file

    from edgemem.export import export
    from edgemem.models.hf.longformer import build

    config = transformers.LongformerConfig(
        vocab_size=1000,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=4 * args.hidden,
        attention_window=args.window,
        max_position_embeddings=args.length + 2,
    )
    torch.manual_seed(0)
    transformers.LongformerModel(config).save_pretrained(directory / "hf")
    model = build(
        json.loads((directory / "hf" / "config.json").read_text()), load_file(directory / "hf" / "model.safetensors")
    )
    start = time.perf_counter()
    export(model, directory / "export", targets=("generic",))
    print(f"exported in {time.perf_counter() - start:.1f} s")

    results = []
    for side in ("onnxruntime", "transformers"):
        command = [
            sys.executable,
            __file__,
            "--worker",
            side,
            "--dir",
            str(directory),
            "--length",
            str(args.length),
            "--threads",
            str(args.threads),
        ]
        line = subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        results.append(json.loads(line))
    ours, theirs = (np.load(directory / f"{r['side']}.npy") for r in results)
    dense_mb = args.heads * args.length**2 * 4 / 2**20
    print(
        f"{args.length} tokens, hidden {args.hidden}, {args.heads} heads, {args.layers} layers, "
        f"attention_window {args.window}, 2 global tokens, {args.threads} thread(s)"
    )
    for r in results:
        print(
            f"  {r['side']:<13} peak RSS {r['peak_rss_mb']:>6} MiB  (before the run {r['rss_before_run_mb']} MiB)  "
            f"{r['seconds']:.2f} s"
        )
    print(f"  one layer's dense T×T scores would take {dense_mb:.0f} MiB")
    print(f"  max |difference| relative to max |output|: {np.abs(ours - theirs).max() / np.abs(theirs).max():.2e}")


if __name__ == "__main__":
    main()
