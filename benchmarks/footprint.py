"""Footprint of an export: bytes on disk and resident memory, each measured in a fresh process.

    python benchmarks/footprint.py                       # the Qwen3.5-shaped import below, fp32 and int4
    python benchmarks/footprint.py --json benchmarks/results/footprint.json
    python benchmarks/footprint.py --native build/native-bench/libedgemem.so   # libedgemem's rows too

The model: a Qwen3.5 text model (hidden 512, 8 layers of 3 gated-DeltaNet : 1 attention, vocab 32000,
tied embeddings, about 45M parameters) with random weights, saved with `save_pretrained` and imported
with `edgemem export --hf DIR --target ort --max-length 1024`, then `edgemem calibrate --method int4`.
Per export: the files' bytes, the resident memory `Engine.load` adds, the peak after a 256-token
prefill and 64 steps, and how much of what is resident at the end is mapped file pages (clean page
cache the kernel may reclaim: onnxruntime's library, and the embedding rows the lookups read in the page
cache's folios), each as a multiple of the fp32 weight bytes (what llama.cpp holds once); and onnxruntime's own
cost, which every Python load counts: its import, and a session of a one-node graph.
Greedy tokens of the fp32 export are compared with transformers' `generate`. With `--native LIB`, the
same probe runs through libedgemem (`em_engine_load`, `em_stream_prefill`, `em_stream_step`) by ctypes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

# Both probes, once their imports are done: the resident set before the engine loads, and the peak (VmHWM) reset
# to it.
MEASURE = r"""
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
base, file_base = status("VmRSS:"), status("RssFile:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak (VmHWM) to the current resident set
"""

PROBE = (
    r"""
import json, sys
import numpy as np
from edgemem.runtime import Engine
"""
    + MEASURE
    + r"""
engine = Engine.load(sys.argv[1], threads=2)
loaded = status("VmRSS:")
stream = engine.new_stream()
ids = np.random.default_rng(0).integers(0, engine.vocab_size, 256)
logits = stream.prefill(ids, all_logits=False)
tokens = []
for _ in range(64):
    token = int(np.argmax(logits))
    tokens.append(token)
    logits = stream.step(token)
print(json.dumps({"load": loaded - base, "peak": status("VmHWM:") - base, "file": status("RssFile:") - file_base,
                  "tokens": tokens}))
"""
)

NATIVE_PROBE = (
    r"""
import ctypes, json, sys
import numpy as np
"""
    + MEASURE
    + r"""
lib = ctypes.CDLL(sys.argv[2])
lib.em_engine_load.restype = lib.em_stream_new.restype = ctypes.c_void_p
lib.em_engine_load.argtypes = [ctypes.c_char_p, ctypes.c_int]
lib.em_engine_vocab_size.restype = ctypes.c_int64
lib.em_engine_vocab_size.argtypes = lib.em_stream_new.argtypes = [ctypes.c_void_p]
lib.em_stream_prefill.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
lib.em_stream_step.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
engine = lib.em_engine_load(sys.argv[1].encode(), 2)
loaded = status("VmRSS:")
vocab = lib.em_engine_vocab_size(engine)
stream = lib.em_stream_new(engine)
ids = np.random.default_rng(0).integers(0, vocab, 256)
logits = np.zeros(vocab, np.float32)
assert lib.em_stream_prefill(stream, ids.ctypes.data, len(ids), logits.ctypes.data) == 0
tokens = []
for _ in range(64):
    token = int(np.argmax(logits))
    tokens.append(token)
    assert lib.em_stream_step(stream, token, logits.ctypes.data) == 0
print(json.dumps({"load": loaded - base, "peak": status("VmHWM:") - base, "file": status("RssFile:") - file_base,
                  "tokens": tokens}))
"""
)


# onnxruntime's own cost, which no export changes: its import, and a session of a one-node graph made and run as
# the runtime makes its own (2 threads, the arena on)
FIXED = (
    r"""
import json
import numpy as np
from onnx import TensorProto, helper
"""
    + MEASURE
    + r"""
import onnxruntime as ort
imported = status("VmRSS:")
value = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, [1])
graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "one", [value("x")], [value("y")])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
options = ort.SessionOptions()
options.intra_op_num_threads = 2
session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
session.run(None, {"x": np.zeros(1, np.float32)})
print(json.dumps({"import": imported - base, "session": status("VmRSS:") - imported}))
"""
)


def build_model(path: Path) -> int:
    """The Qwen3.5-shaped model with random weights in `path`; returns its fp32 weight bytes."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    layers = (["linear_attention"] * 3 + ["full_attention"]) * 2
    config = Qwen3_5TextConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=len(layers),
        layer_types=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        tie_word_embeddings=True,
        eos_token_id=None,
        pad_token_id=None,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape) * 0.1 + (1.0 if "linear_attn.norm" in name else 0.0))
            elif not (name.endswith("A_log") or name.endswith("dt_bias")):
                p.copy_(torch.randn(p.shape) * 0.02)
    model.save_pretrained(path)
    return sum(p.numel() * 4 for p in model.parameters())


def reference_tokens(path: Path) -> list[int]:
    """transformers' greedy continuation of the probe's prompt (fp32)."""
    import numpy as np
    import torch
    from transformers import Qwen3_5ForCausalLM

    model = Qwen3_5ForCausalLM.from_pretrained(path).eval()
    ids = torch.tensor([np.random.default_rng(0).integers(0, 32000, 256)])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=64, do_sample=False)
    return out[0, 256:].tolist()


def measure(export: Path, native: Path | None = None) -> dict:
    files = sum(f.stat().st_size for f in export.rglob("*") if f.is_file())
    probe = [PROBE, str(export)] if native is None else [NATIVE_PROBE, str(export), str(native)]
    proc = subprocess.run([sys.executable, "-c", *probe], capture_output=True, text=True, check=True)
    return {"files": files, **json.loads(proc.stdout.strip().splitlines()[-1])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the results here too")
    ap.add_argument("--native", type=Path, help="libedgemem.so: measure the C runtime on the same exports too")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        weights = build_model(tmp / "hf")
        fp32, int4 = tmp / "fp32", tmp / "int4"
        edgemem = [sys.executable, "-c", "from edgemem.cli import main; main()"]
        subprocess.run(
            [
                *edgemem,
                "export",
                "--hf",
                str(tmp / "hf"),
                "--target",
                "ort",
                "--max-length",
                "1024",
                "--out",
                str(fp32),
            ],
            check=True,
            capture_output=True,
        )
        subprocess.run(
            [*edgemem, "calibrate", str(fp32), "--method", "int4", "--no-drift", "--out", str(int4)],
            check=True,
            capture_output=True,
        )
        rows = {"fp32": measure(fp32), "int4": measure(int4)}
        if args.native:
            rows.update({"fp32 libedgemem": measure(fp32, args.native), "int4 libedgemem": measure(int4, args.native)})
        proc = subprocess.run([sys.executable, "-c", FIXED], capture_output=True, text=True, check=True)
        fixed = json.loads(proc.stdout.strip().splitlines()[-1])
        reference = reference_tokens(tmp / "hf")
        same = all(r["tokens"] == reference for name, r in rows.items() if name.startswith("fp32"))
    print(f"fp32 weights: {weights / 1e6:.1f} MB; greedy tokens (fp32) equal transformers' generate: {same}")
    print(f"{'export':<16}{'files':>19}{'load':>19}{'peak':>19}{'mapped at end':>19}   (× fp32 weight bytes)")
    for name, r in rows.items():
        cells = "".join(f"{r[k] / 1e6:>9.1f} MB {r[k] / weights:>4.2f}×" for k in ("files", "load", "peak", "file"))
        print(f"{name:<16}{cells}")
    print(
        "onnxruntime itself, in every Python row: "
        + ", ".join(f"{k} {v / 1e6:.1f} MB {v / weights:.2f}×" for k, v in fixed.items())
        + " (a session of a one-node graph)"
    )
    if args.json:
        result = {
            "weights": weights,
            "greedy_equal": same,
            "onnxruntime": fixed,
            **{k: {m: v for m, v in r.items() if m != "tokens"} for k, r in rows.items()},
        }
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
