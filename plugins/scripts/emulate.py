"""Builds libedgemem_kernels_emu.so: the CUDA kernels compiled for the CPU by a C++17 compiler, on the
emulator of plugins/emulator (a block's threads as fibers that meet at barriers and warp collectives).

    python plugins/scripts/emulate.py --build BUILD_DIR [--tensorrt-include DIR]

The library has the kernels' C ABI (em_cuda_*) on host memory; `gpu_check.py --emulate` runs its
checks through it. With TensorRT's headers, BUILD_DIR/edgemem_plugin_harness_emu is
tests/plugin_harness.cpp on those kernels: its `--enqueue` runs every plugin's enqueue on the CPU.
Each kernel file is copied with its launches `k<<<grid, block, smem, stream>>>(args)` rewritten as
`emu::launch(grid, block, smem, stream, [&] { k(args); })`, its inline PTX `asm volatile("text" :
outputs : inputs)` as `emu::ptx("text", outputs..., inputs...)` and its dynamic shared arrays as
`emu::dynamicShared<T>()`; the headers beside them alike.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PLUGINS = Path(__file__).resolve().parent.parent
LIBRARY = "libedgemem_kernels_emu.so"
HARNESS = "edgemem_plugin_harness_emu"
ARCH = 800  # __CUDA_ARCH__ of the emulated device: sm_80, the first with every instruction the kernels use
CUDA_INCLUDE = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include"
DYNAMIC_SHARED = re.compile(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([\w ]+?)\s+(\w+)\[\];")
ASM = re.compile(r"\basm\s+volatile\s*\(")
LITERALS = re.compile(r'\s*((?:"(?:[^"\\]|\\.)*"\s*)+)')
OPERAND = re.compile(r'"[^"]*"\s*\(')


def folders() -> list[str]:
    """core/ and each op's folder (ops.def)."""
    return ["core", *re.findall(r"^EM_OP\(\w+, *(\w+)\)", (PLUGINS / "ops.def").read_text(), re.M)]


def _matching(src: str, i: int, open_: str, close: str) -> int:
    """Index just past the bracket closing the one at src[i]."""
    depth = 0
    for j in range(i, len(src)):
        depth += (src[j] == open_) - (src[j] == close)
        if depth == 0:
            return j + 1
    raise ValueError(f"unbalanced {open_!r} at {i}")


def _split_top(text: str) -> list[str]:
    """text split at the commas outside parentheses, brackets and braces."""
    parts, depth, start = [], 0, 0
    for j, c in enumerate(text):
        depth += (c in "([{") - (c in ")]}")
        if c == "," and depth == 0:
            parts.append(text[start:j].strip())
            start = j + 1
    return parts + [text[start:].strip()]


def _callee_start(src: str, i: int) -> int:
    """Start of the kernel expression `name<targs>` that ends just before src[i] (its `<<<`)."""
    j = i
    while src[j - 1].isspace():
        j -= 1
    if src[j - 1] == ">":
        depth, k = 0, j - 1
        while True:
            depth += (src[k] == ">") - (src[k] == "<")
            if depth == 0:
                break
            k -= 1
        j = k
    while src[j - 1].isalnum() or src[j - 1] in "_:":
        j -= 1
    return j


def _asm(src: str) -> str:
    """Each `asm volatile("text" : outputs : inputs)` as `::emu::ptx("text", outputs..., inputs...)`."""
    out, pos = [], 0
    while m := ASM.search(src, pos):
        end = _matching(src, m.end() - 1, "(", ")")
        inner = src[m.end() : end - 1]
        lits = LITERALS.match(inner)
        operands, i = [], lits.end()
        while op := OPERAND.search(inner, i):
            close = _matching(inner, op.end() - 1, "(", ")")
            operands.append(inner[op.end() : close - 1].strip())
            i = close
        text = " ".join(lits[1].split("\n")).strip()
        call = f"::emu::ptx({', '.join([text, *operands])})"
        out += [src[pos : m.start()], call, "\n" * src[m.start() : end].count("\n")]
        pos = end
    return "".join(out) + src[pos:]


def rewrite(src: str) -> str:
    """A kernel file's text as the emulator compiles it (see the module docstring)."""
    src = _asm(src)
    out, pos = [], 0
    while (i := src.find("<<<", pos)) >= 0:
        start = _callee_start(src, i)
        end_cfg = src.index(">>>", i)
        config = _split_top(src[i + 3 : end_cfg])
        config += ["0"] * (4 - len(config))
        args_open = src.index("(", end_cfg)
        args_end = _matching(src, args_open, "(", ")")
        callee = " ".join(src[start:i].split())
        call = f"{callee}{src[args_open:args_end]}"
        lines = src[start:args_end].count("\n")
        out += [src[pos:start], f"::emu::launch({', '.join(config)}, [&] {{ {call}; }})", "\n" * lines]
        pos = args_end
    text = "".join(out) + src[pos:]
    return DYNAMIC_SHARED.sub(lambda m: f"{m[1]}* {m[2]} = ::emu::dynamicShared<{m[1]}>();", text)


def _compile_all(commands: list[list[str]]) -> None:
    """Runs the compiler commands on every core; exits with the first failure's message."""
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        procs = list(pool.map(lambda cmd: subprocess.run(cmd, capture_output=True, text=True), commands))
    failed = [proc for proc in procs if proc.returncode]
    if failed and "boost/context" in failed[0].stderr:
        raise SystemExit("emulate.py: Boost.Context is needed (Debian: apt-get install libboost-context-dev)")
    if failed:
        raise SystemExit(f"emulate.py: the compiler failed:\n{failed[0].stderr[-6000:]}")


def _trt_version(include: Path) -> tuple[str, str]:
    """TensorRT's major and minor version from NvInferVersion.h, as CMakeLists.txt reads them."""
    if not (include / "NvInferVersion.h").is_file():
        raise SystemExit(f"emulate.py: no TensorRT headers in {include} (NvInferVersion.h): pass TensorRT's include/")
    text = (include / "NvInferVersion.h").read_text()
    major = re.search(r"#define (?:NV_TENSORRT_MAJOR|TRT_MAJOR_ENTERPRISE) (\d+)", text)
    minor = re.search(r"#define (?:NV_TENSORRT_MINOR|TRT_MINOR_ENTERPRISE) (\d+)", text)
    return major[1], minor[1]


def build(out: Path, tensorrt_include: Path | None = None) -> Path:
    """Compiles the emulated kernels library into out/ and returns its path; given TensorRT's headers, also
    out/HARNESS: tests/plugin_harness.cpp with the plugins on the emulated kernels."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise SystemExit("emulate.py: no C++ compiler (g++) found")
    if not (CUDA_INCLUDE / "cuda_runtime.h").is_file():
        raise SystemExit(f"emulate.py: no CUDA headers at {CUDA_INCLUDE} (set CUDA_HOME)")
    work = out / "emulator"
    sources = []
    for folder in folders():
        (work / folder).mkdir(parents=True, exist_ok=True)
        for path in sorted((PLUGINS / folder).iterdir()):
            if path.suffix not in (".cu", ".cuh", ".h"):
                continue
            target = work / folder / (path.stem + ".cpp" if path.suffix == ".cu" else path.name)
            target.write_text(f'#line 1 "{path}"\n' + rewrite(path.read_text()))
            if path.suffix == ".cu":
                sources.append(target)
    flags = ["-std=c++17", "-O2", "-fPIC", f"-DEMU_ARCH={ARCH}", "-include", str(PLUGINS / "emulator" / "emulator.h")]
    flags += [f"-I{work}", f"-I{work / 'core'}", f"-I{PLUGINS}", f"-isystem{CUDA_INCLUDE}"]
    units = [*sources, PLUGINS / "emulator" / "runtime.cpp"]
    objects = [work / f"kernel{i}.o" for i in range(len(units))]
    commands = [[compiler, *flags, "-c", str(u), "-o", str(o)] for u, o in zip(units, objects)]
    glue: list[Path] = []
    if tensorrt_include is not None:
        # the plugins and the harness as the CMake build compiles them (host code, the TensorRT headers)
        ops = re.findall(r"^EM_OP\((\w+), *(\w+)\)", (PLUGINS / "ops.def").read_text(), re.M)
        host = [PLUGINS / "tests" / "plugin_harness.cpp"]
        host += [PLUGINS / "core" / f for f in ("plugin.cpp", "register.cpp", "reference.cpp")]
        host += [PLUGINS / folder / f for name, folder in ops for f in (f"{name}Plugin.cpp", "reference.cpp")]
        major, minor = _trt_version(tensorrt_include)
        glue_flags = ["-std=c++17", "-O1", f"-DEDGEMEM_TRT_MAJOR={major}", f"-DEDGEMEM_TRT_MINOR={minor}"]
        glue_flags += [
            f"-I{PLUGINS}",
            f"-I{PLUGINS / 'core'}",
            f"-isystem{tensorrt_include}",
            f"-isystem{CUDA_INCLUDE}",
        ]
        glue = [work / f"glue{i}.o" for i in range(len(host))]
        commands += [[compiler, *glue_flags, "-c", str(u), "-o", str(o)] for u, o in zip(host, glue)]
    _compile_all(commands)
    library = out / LIBRARY
    links = [[compiler, "-shared", *map(str, objects), "-o", str(library), "-lboost_context"]]
    if glue:
        links.append([compiler, *map(str, glue + objects), "-o", str(out / HARNESS), "-lboost_context"])
    _compile_all(links)
    return library


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", type=Path, required=True, help="folder for the library (and its sources)")
    ap.add_argument("--tensorrt-include", type=Path, help="TensorRT's include/ folder: build the plugin harness too")
    args = ap.parse_args()
    print(build(args.build, args.tensorrt_include))


if __name__ == "__main__":
    sys.exit(main())
