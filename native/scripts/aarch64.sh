#!/usr/bin/env bash
# Cross-build libedgemem and em_check for aarch64 (the Jetson CPU) and run tests/test_native_runtime.py
# with em_check under qemu-user, against the aarch64 onnxruntime wheel's library of the same version as
# the Python runtime beside it. Not part of the default test run. Needs (Debian):
#   dpkg --add-architecture arm64 && apt-get update && apt-get install g++-aarch64-linux-gnu qemu-user libssl-dev:arm64
# and pip (downloads the aarch64 wheel). WORK (default build/aarch64) keeps the wheel and the build.
#
# Status: the cross-build (libedgemem, em_check, em_bench) links against the aarch64 wheel's library.
# Under Debian 12's qemu-user (7.2) with onnxruntime 1.32's aarch64 library, em_check does not get past
# em_engine_load: with the host's /proc/cpuinfo onnxruntime crashes in its CPU detection (the ARM
# cpuinfo below avoids that), then its session creation spins in pthread_create and never returns
# (with -cpu cortex-a57 or max, and with glibc's rseq off). So no test has passed under emulation yet.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=${WORK:-$ROOT/build/aarch64}
PYTHON=${PYTHON:-python}
HEADERS=${ONNXRUNTIME_INCLUDE_DIR:-$ROOT/../shared/third_party/onnxruntime/v1.24.4/include}
VERSION=$($PYTHON -c "import onnxruntime; print(onnxruntime.__version__)")
PYVER=$($PYTHON -c "import sys; print(f'{sys.version_info[0]}{sys.version_info[1]}')")
mkdir -p "$WORK/wheel" "$WORK/onnxruntime"
if [ ! -e "$WORK/onnxruntime/lib" ]; then
  $PYTHON -m pip download "onnxruntime==$VERSION" --platform manylinux_2_28_aarch64 --platform manylinux_2_27_aarch64 \
    --only-binary=:all: --no-deps --python-version "$PYVER" -d "$WORK/wheel" -q
  $PYTHON -m zipfile -e "$WORK"/wheel/onnxruntime-"$VERSION"-*.whl "$WORK/wheel/x"
  ln -sfn "$WORK/wheel/x/onnxruntime/capi" "$WORK/onnxruntime/lib"
fi
cmake -S "$ROOT/native" -B "$WORK/build" -DCMAKE_TOOLCHAIN_FILE="$ROOT/native/cmake/aarch64-linux-gnu.cmake" \
  -DCMAKE_BUILD_TYPE=Release -DONNXRUNTIME_ROOT="$WORK/onnxruntime" -DONNXRUNTIME_INCLUDE_DIR="$HEADERS" >/dev/null
cmake --build "$WORK/build" -j "$(nproc)"
file "$WORK/build/em_check" "$WORK"/build/libedgemem.so.*.*.*
# qemu-user shows the host's /proc/cpuinfo, from which onnxruntime's CPU detection (cpuinfo) cannot
# read an ARM core and crashes at load: the prefix qemu reads files from first (-L) gets an ARM one
# (Cortex-A78AE, Jetson Orin's core) beside the cross toolchain's libraries.
mkdir -p "$WORK/sysroot/proc"
ln -sfn /usr/aarch64-linux-gnu/lib "$WORK/sysroot/lib"
for i in $(seq 0 $(($(nproc) - 1))); do
  printf 'processor\t: %d\nBogoMIPS\t: 62.50\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: 0xd42\nCPU revision\t: 1\n\n' "$i"
done > "$WORK/sysroot/proc/cpuinfo"
EDGEMEM_EM_CHECK="qemu-aarch64 -L $WORK/sysroot $WORK/build/em_check" \
  $PYTHON -m pytest -q -n 0 "$ROOT/tests/test_native_runtime.py" --durations=0 "$@"
