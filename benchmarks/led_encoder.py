"""LED's encoder on a long input: edgemem's `encoder.onnx` on onnxruntime next to transformers'
`LEDForConditionalGeneration` encoder, same weights, same input, each in a fresh process.

    python benchmarks/led_encoder.py                          # 16384 tokens → benchmarks/results/led-encoder.json
    python benchmarks/led_encoder.py --length 4096 --window 256 --out /tmp/led.json

Makes a random LED (no download) with `save_pretrained`, imports and exports it with edgemem
(`ort` target), then runs each side on the same ids with global tokens at the first and middle
positions and reports its peak RSS (ru_maxrss), its RSS before the run (imports and weights), the
wall time of the run and how far the outputs agree. edgemem's encoder graph outputs every decoder
layer's cross keys and values; transformers' side is its encoder plus the same projections
(`encoder_attn.k_proj` / `v_proj`), so both produce the same tensors. One layer's dense T×T scores
(H·T²·4 bytes) are printed for scale. Needs transformers (`pip install 'edgemem-toolkit[hf]'`).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).parent / "results" / "led-encoder.json"


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _inputs(length: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.random.default_rng(0).integers(3, vocab, (1, length), dtype=np.int64)
    mask = np.zeros((1, length), np.int64)
    mask[0, [0, length // 2]] = 1
    return ids, mask


def worker(side: str, directory: Path, length: int, threads: int) -> None:
    """One measurement in this process; prints a JSON line and saves the first layer's cross keys."""
    vocab = json.loads((directory / "hf" / "config.json").read_text())["vocab_size"]
    ids, mask = _inputs(length, vocab)
    if side == "onnxruntime":
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        session = ort.InferenceSession(str(directory / "export" / "ort" / "encoder.onnx"), options)
        before = _rss_mib()
        start = time.perf_counter()
        out = session.run(["present.0.cross_key"], {"input_ids": ids, "global_attention_mask": mask})[0]
    else:
        import torch
        import transformers

        torch.set_num_threads(threads)
        model = transformers.LEDForConditionalGeneration.from_pretrained(directory / "hf").eval()
        before = _rss_mib()
        start = time.perf_counter()
        with torch.no_grad():
            encoded = model.get_encoder()(
                input_ids=torch.from_numpy(ids), global_attention_mask=torch.from_numpy(mask)
            ).last_hidden_state
            heads = model.config.decoder_attention_heads
            out = [
                layer.encoder_attn.k_proj(encoded).unflatten(2, (heads, -1)).transpose(1, 2)
                for layer in model.get_decoder().layers
            ][0].numpy()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    np.save(directory / f"{side}.npy", out)
    print(
        json.dumps(
            {
                "side": side,
                "peak_rss_mib": round(peak),
                "rss_before_run_mib": round(before),
                "seconds": round(seconds, 2),
            }
        )
    )


def measure(directory: Path, args: argparse.Namespace) -> dict:
    import torch
    import transformers

    from edgemem.export import export
    from edgemem.models.hf import from_hf

    config = transformers.LEDConfig(
        vocab_size=1000,
        d_model=args.hidden,
        encoder_layers=args.layers,
        decoder_layers=args.layers,
        encoder_attention_heads=args.heads,
        decoder_attention_heads=args.heads,
        encoder_ffn_dim=4 * args.hidden,
        decoder_ffn_dim=4 * args.hidden,
        attention_window=args.window,
        max_encoder_position_embeddings=args.length,
        max_decoder_position_embeddings=64,
    )
    torch.manual_seed(0)
    transformers.LEDForConditionalGeneration(config).save_pretrained(directory / "hf")
    start = time.perf_counter()
    export(from_hf(directory / "hf"), directory / "export", targets=("ort",))
    export_seconds = time.perf_counter() - start
    sides = []
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
        sides.append(json.loads(line))
    ours, theirs = (np.load(directory / f"{s['side']}.npy") for s in sides)
    return {
        "model": {
            "length": args.length,
            "d_model": args.hidden,
            "heads": args.heads,
            "layers": args.layers,
            "attention_window": args.window,
            "global_tokens": 2,
        },
        "threads": args.threads,
        "machine": platform.machine(),
        "export_seconds": round(export_seconds, 1),
        "sides": sides,
        "dense_scores_one_layer_mib": round(args.heads * args.length**2 * 4 / 2**20),
        "max_rel_difference": float(np.abs(ours - theirs).max() / np.abs(theirs).max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=16384, help="tokens in the input")
    parser.add_argument("--window", type=int, default=512, help="LED attention_window (full width, even)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS, help="JSON results file")
    parser.add_argument("--worker", choices=["onnxruntime", "transformers"], help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.dir, args.length, args.threads)
        return
    with tempfile.TemporaryDirectory(prefix="led-encoder-") as tmp:
        result = measure(Path(tmp), args)
    m = result["model"]
    print(
        f"{m['length']} tokens, d_model {m['d_model']}, {m['heads']} heads, {m['layers']} layers, attention_window "
        f"{m['attention_window']}, 2 global tokens, {result['threads']} thread(s)"
    )
    for s in result["sides"]:
        print(
            f"  {s['side']:<13} peak RSS {s['peak_rss_mib']:>6} MiB  (before the run {s['rss_before_run_mib']} MiB)  "
            f"{s['seconds']:.2f} s"
        )
    print(f"  one layer's dense T×T scores would take {result['dense_scores_one_layer_mib']} MiB")
    print(f"  layer 0 cross keys: max |difference| / max |value| = {result['max_rel_difference']:.2e}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
