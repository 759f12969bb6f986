"""Building plugins/ for the tests that load its libraries or read its compile (test_plugins.py,
test_kernel_archs.py, test_rtx.py): one CMake configure + build per tree, a failing command shown with
the end of its output, and the kept ptxas output read back (registers, spills, local memory)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
JOBS = str(os.cpu_count() or 2)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if proc.returncode:
        raise AssertionError(
            f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


def cmake_build(build: Path, *args: str, targets: tuple[str, ...] = ()) -> dict[str, str]:
    """Configure `plugins/` into `build` (a new tree, or an existing one with new `args`: CMake redoes only what
    they change) and build `targets` (default: all); returns edgemem_build.txt. The fatbinaries are left at
    nvcc's default compression unless `args` ask for it (-DEDGEMEM_COMPRESS_KERNELS=ON): it costs compile time."""
    if args or not (build / "CMakeCache.txt").exists():
        run(
            [
                "cmake",
                "-S",
                str(PLUGINS),
                "-B",
                str(build),
                "-DCMAKE_BUILD_TYPE=Release",
                "-DEDGEMEM_COMPRESS_KERNELS=OFF",
                *args,
            ]
        )
    cmd = ["cmake", "--build", str(build), "-j", JOBS]
    for t in targets:
        cmd += ["--target", t]
    run(cmd)
    return dict(line.split("=", 1) for line in (build / "edgemem_build.txt").read_text().splitlines() if "=" in line)


def need_nvcc() -> None:
    if not shutil.which("cmake"):
        pytest.skip("cmake is not installed")
    if not shutil.which("nvcc") and not os.environ.get("CUDACXX") and not Path("/usr/local/cuda/bin/nvcc").exists():
        pytest.skip("nvcc (the CUDA compiler) is not installed: the kernels cannot be compiled here")


# ---------------------------------------------------------------------------------------------
# CUDA kernels: every kernel compiled for every architecture asked for, with no spills, no local memory

PTXAS_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(sm_\d+)'")
PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
PTXAS_USED = re.compile(r"Used (\d+) registers")
KERNELS = (
    "linearAttentionKernel",
    "chunkPrepare",
    "chunkPrepareMma",
    "chunkState",
    "chunkOutput",
    "chunkOutputMma",
    "windowAttentionKernel",
    "bandedAttentionKernel",
    "bandedTileKernel",
    "bandedMmaKernel",
    "neuralMemoryKernel",
    "neuralMemoryChunkKernel",
)


def ptxas_report(build: Path) -> list[dict]:
    """One row per (kernel instantiation, architecture) from the kept ptxas -v output."""
    rows, current = [], None
    for log in sorted((build / "ptxas").glob("*.log")):
        for line in log.read_text().splitlines():
            if m := PTXAS_ENTRY.search(line):
                current = dict(kernel=m.group(1), arch=m.group(2), file=log.name)
                rows.append(current)
            elif current and (m := PTXAS_FRAME.search(line)):
                current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
            elif current and (m := PTXAS_USED.search(line)):
                current["registers"] = int(m.group(1))
                current["lmem"] = "lmem" in line
    return rows


def _demangle(symbols: list[str]) -> dict[str, str]:
    """Readable kernel names (c++filt when present), without the namespaces."""
    filt = shutil.which("c++filt")
    out = run([filt], input="\n".join(symbols)).stdout.splitlines() if filt else symbols
    tidy = lambda s: re.sub(r"\(.*\)$", "", re.sub(r"edgemem::cuda::(\(anonymous namespace\)::)?", "", s))  # noqa: E731
    return {sym: tidy(name).removeprefix("void ") for sym, name in zip(symbols, out)}


def assert_no_spills(build: Path, archs: tuple[str, ...]) -> None:
    """Every kernel family of KERNELS compiled for every arch in `archs`, none spilling or using local memory."""
    rows = ptxas_report(build)
    assert rows, "no ptxas output kept under <build>/ptxas"
    for family in KERNELS:
        for arch in archs:
            assert any(family in r["kernel"] and r["arch"] == f"sm_{arch}" for r in rows), (family, arch)
    bad = [r for r in rows if r.get("stack", 1) or r.get("spill_stores", 1) or r.get("spill_loads", 1) or r.get("lmem")]
    assert not bad, "kernels using local memory or spilling:\n" + "\n".join(map(str, bad))
    # the table in the test log (pytest -s)
    names = _demangle([r["kernel"] for r in rows])
    for r in rows:
        print(f"{r['arch']:>6} {names[r['kernel']]:<60} {r['registers']:>4} registers")
