#!/usr/bin/env bash
# Cross-build libedgemem and em_check for aarch64 (the Jetson CPU) and run tests/test_native_runtime.py
# with em_check under qemu-user, against the aarch64 onnxruntime wheel's library of the same version as
# the Python runtime beside it. Not part of the default test run. Needs (Debian):
#   dpkg --add-architecture arm64 && apt-get update && apt-get install g++-aarch64-linux-gnu qemu-user libssl-dev:arm64
# and pip (downloads the aarch64 wheel). WORK (default build/aarch64) keeps the wheel and the build.
#
# What runs: tests/test_native_runtime.py with EDGEMEM_EM_CHECK set, i.e. the aarch64 em_check (Release,
# no sanitizers) on the five exports that file builds (deltanet, titans-mag, softmax, softmax with
# --max-length, a tiny Qwen3.5 hybrid import), each checked against the host's Python runtime: em_check's
# own checks (fork, batch, misuse refused), logits after a 40-token prefill and 24 greedy steps, a batch at
# positions 5 and 11, checkpoints handed over both ways: 20 tests. The sample-app test is skipped (it builds
# for the host), and so are the trt backend's (their placeholder engines are made on the host); the trt
# backend itself compiles in when TensorRT's and CUDA's headers are found (headers only: TensorRT and the
# CUDA driver are opened at run time). Extra arguments go to pytest (e.g. -k deltanet).
#
# Under qemu-user two things break onnxruntime unless the emulated process is given them:
# - an ARM /proc/cpuinfo: qemu shows the host's, from which onnxruntime's CPU detection cannot read an ARM
#   core and crashes at load;
# - one glibc: qemu's prefix (-L) gives the cross toolchain's loader, but with libc6:arm64 installed (which
#   libssl-dev:arm64 brings) that loader finds the multiarch libc in /lib/aarch64-linux-gnu, of another
#   build, and the first pthread_create (onnxruntime's session creation) walks a corrupt stack cache
#   forever. LD_LIBRARY_PATH puts the cross toolchain's libc beside its loader.
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
# The prefix qemu reads files from first (-L): the cross toolchain's libraries and an ARM /proc/cpuinfo
# (Cortex-A78AE, Jetson Orin's core).
CROSS=/usr/aarch64-linux-gnu/lib
mkdir -p "$WORK/sysroot/proc"
ln -sfn "$CROSS" "$WORK/sysroot/lib"
for i in $(seq 0 $(($(nproc) - 1))); do
  printf 'processor\t: %d\nBogoMIPS\t: 62.50\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: 0xd42\nCPU revision\t: 1\n\n' "$i"
done > "$WORK/sysroot/proc/cpuinfo"
EM_CHECK="qemu-aarch64 -L $WORK/sysroot -E LD_LIBRARY_PATH=$CROSS $WORK/build/em_check"
# Which libraries the emulated em_check loads (one glibc, from $CROSS), and qemu's version.
qemu-aarch64 --version | head -1
LIBS=$(qemu-aarch64 -L "$WORK/sysroot" -E LD_LIBRARY_PATH="$CROSS" -E LD_TRACE_LOADED_OBJECTS=1 "$WORK/build/em_check")
echo "$LIBS"
if ! grep -q "libc.so.6 => $CROSS/libc.so.6 " <<<"$LIBS"; then
  echo "the emulated em_check does not load $CROSS/libc.so.6, the libc of its loader: onnxruntime would hang in pthread_create" >&2
  exit 1
fi
EDGEMEM_EM_CHECK="$EM_CHECK" $PYTHON -m pytest -q -n 0 "$ROOT/tests/test_native_runtime.py" --durations=0 "$@"
