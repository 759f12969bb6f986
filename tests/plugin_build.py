"""Building plugins/ for the tests that load its libraries (test_plugins.py, test_rtx.py): one CMake
configure + build per tree, a failing command shown with the end of its output."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

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
    """Configure `plugins/` into `build` (once) and build `targets` (default: all); returns edgemem_build.txt."""
    if not (build / "CMakeCache.txt").exists():
        run(["cmake", "-S", str(PLUGINS), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", *args])
    cmd = ["cmake", "--build", str(build), "-j", JOBS]
    for t in targets:
        cmd += ["--target", t]
    run(cmd)
    return dict(line.split("=", 1) for line in (build / "edgemem_build.txt").read_text().splitlines() if "=" in line)
