"""The CUDA kernels compile without spills or local memory for the architectures beyond the default
build's (sm_87/89/90, tests/test_plugins.py): TensorRT for RTX's other targets (Turing, Ampere,
consumer Blackwell) and Blackwell (B200, Thor). A file of its own, so that this long compile runs on
whichever test worker is free rather than after test_plugins.py's other slow tests."""

from __future__ import annotations

import shutil

import pytest
from plugin_build import assert_no_spills, cmake_build, need_nvcc, run

pytestmark = pytest.mark.slow

# Left out, as ptxas of CUDA 13.0 gives every kernel the same registers, stack and spills there as on an
# architecture compiled here or in the default build (plugins/README.md): sm_121 (GB10) as sm_120, sm_86
# (RTX 30) as sm_87 and sm_89
EXTRA_ARCHS = ("75", "80", "100", "110", "120")


def test_kernels_compile_without_spills_beyond_the_defaults(tmp_path_factory):
    need_nvcc()
    listed = run([shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc", "--list-gpu-arch"]).stdout.split()
    archs = tuple(a for a in EXTRA_ARCHS if f"compute_{a}" in listed)
    if not archs:
        pytest.skip(f"this nvcc compiles none of sm_{', sm_'.join(EXTRA_ARCHS)}")
    build = tmp_path_factory.mktemp("kernels_extra")
    info = cmake_build(
        build, "-DEDGEMEM_BUILD_TRT=OFF", f"-DCMAKE_CUDA_ARCHITECTURES={';'.join(archs)}", targets=("edgemem_kernels",)
    )
    if info.get("cuda") != "ON":
        pytest.skip("CMake found no usable CUDA compiler (put nvcc on PATH or set CUDACXX)")
    assert_no_spills(build, archs)
