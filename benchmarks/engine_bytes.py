"""TensorRT for RTX engine bytes of one export: the one engine `edgemem build --rtx` writes (built from
the prefill graph, a step profile and a prefill profile) beside the two engines it wrote before (a step
engine from the step graph and a prefill engine from the prefill graph, one profile each), built here in
one run from the same export, plugin library and shapes. No GPU needed.

    python benchmarks/engine_bytes.py --plugins build/rtx/libedgemem_trt_plugins.so
    python benchmarks/engine_bytes.py --plugins P --json benchmarks/results/engine-bytes.json

Needs the `[export,rtx]` extras and a plugin library with kernels for `--sm` (README.md, TensorRT for RTX).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ARCHS = ("gated-deltanet", "titans-mag", "longformer")

# The former engine set, in a child process whose environment lets the parser add plugin layers
# (edgemem.trt_build._rtx_environment): per graph one engine with that graph's own profile.
SEPARATE = r"""
import json, sys
import onnx
import tensorrt_rtx as trt
from edgemem.trt_build import compute_capabilities, dim_names, profile

library, export, max_batch, max_sequence, sm = sys.argv[1:6]
logger = trt.Logger(trt.Logger.WARNING)
assert trt.get_plugin_registry().load_library(library), library
builder = trt.Builder(logger)
targets = compute_capabilities(trt, [int(s) for s in sm.split(",")])
sizes = {}
for kind in ("step", "prefill"):
    path = f"{export}/trt/{kind}.onnx"
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    assert trt.OnnxParser(network, logger).parse_from_file(path), path
    config = builder.create_builder_config()
    config.num_compute_capabilities = len(targets)
    for i, target in enumerate(targets):
        config.set_compute_capability(target, i)
    optimisation = builder.create_optimization_profile()
    dims = dim_names(onnx.load(path, load_external_data=False))
    for name, (lo, opt, hi) in profile(dims, int(max_batch), int(max_sequence)).items():
        optimisation.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(optimisation)
    sizes[kind] = len(bytes(builder.build_serialized_network(network, config)))
print(json.dumps(sizes))
"""


def _run(cmd: list[str], **kw) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


def measure(arch: str, work: Path, plugins: Path, sm: str, max_batch: int, max_sequence: int) -> dict:
    from edgemem.trt_build import _rtx_environment

    export, edgemem = work / arch, [sys.executable, "-c", "from edgemem.cli import main; main()"]
    _run([*edgemem, "export", "--arch", arch, "--target", "trt", "--out", str(export)])
    shape = ["--max-batch", str(max_batch), "--max-sequence", str(max_sequence)]
    _run([*edgemem, "build", str(export), "--rtx", "--sm", sm, "--plugins", str(plugins), *shape])
    info = json.loads((export / "engines" / "engines.json").read_text())
    (file,) = {r["file"] for r in info["engines"].values()}
    with tempfile.TemporaryDirectory() as folder:
        args = [str(plugins), str(export), str(max_batch), str(max_sequence), sm]
        separate = json.loads(
            _run([sys.executable, "-c", SEPARATE, *args], env=_rtx_environment(Path(folder))).splitlines()[-1]
        )
    return {
        "arch": arch,
        "weight_bytes": (export / "trt" / "weights.data").stat().st_size,
        "step_engine": separate["step"],
        "prefill_engine": separate["prefill"],
        "one_engine": (export / "engines" / file).stat().st_size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plugins", type=Path, required=True, help="libedgemem_trt_plugins.so built for --sm")
    parser.add_argument("--sm", default="86,120")
    parser.add_argument("--max-batch", type=int, default=1)
    parser.add_argument("--max-sequence", type=int, default=2048)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import tensorrt_rtx

    rows = []
    with tempfile.TemporaryDirectory() as work:
        for arch in ARCHS:
            rows.append(measure(arch, Path(work), args.plugins, args.sm, args.max_batch, args.max_sequence))
    print(
        f"TensorRT for RTX {tensorrt_rtx.__version__}, --sm {args.sm}, --max-batch {args.max_batch}, "
        f"--max-sequence {args.max_sequence}"
    )
    print(f"{'preset':<16}{'weights':>12}{'step':>12}{'prefill':>12}{'two engines':>13}{'one engine':>12}{'saved':>12}")
    for r in rows:
        apart = r["step_engine"] + r["prefill_engine"]
        r["saved_per_weight_byte"] = round((apart - r["one_engine"]) / r["weight_bytes"], 3)
        print(
            f"{r['arch']:<16}{r['weight_bytes']:>12,}{r['step_engine']:>12,}{r['prefill_engine']:>12,}{apart:>13,}"
            f"{r['one_engine']:>12,}{apart - r['one_engine']:>12,}"
        )
    if args.json:
        meta = {
            "library": f"tensorrt_rtx {tensorrt_rtx.__version__}",
            "sm": args.sm,
            "max_batch": args.max_batch,
            "max_sequence": args.max_sequence,
        }
        args.json.write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
