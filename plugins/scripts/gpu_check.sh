#!/usr/bin/env bash
# One command, one report: the edgemem CUDA kernels on this machine's GPU.
#
#   plugins/scripts/gpu_check.sh [BUILD_DIR]
#
# Needs an NVIDIA GPU with its driver, nvcc, CMake >= 3.25, and a Python with PyTorch (CUDA build)
# and edgemem importable (e.g. the repository's virtual environment: PYTHON=.venv/bin/python).
# TensorRT's library is not needed; with TensorRT headers (TensorRT_ROOT, else the newest under
# ../shared/third_party/tensorrt beside the repository) step 4 runs as well. Steps:
#   1. builds plugins/ for this GPU's architecture (CUDA_ARCH=87 etc. to override);
#   2. gpu_check.py: every op, float32 and float16 I/O, odd shapes, in-place state, step-by-step
#      vs prefill, LinearAttention's chunked form, against edgemem.ops (float64) and the CPU
#      reference; decode timing against the memory-bandwidth floor; prefill timing; both beside
#      flash-linear-attention where it is installed;
#   3. compute-sanitizer memcheck and racecheck over the quick case set, one job per tool and op,
#      SANITIZER_JOBS of them at a time (default 2; a large GPU host takes 8: every job at once)
#      (skipped with a note if compute-sanitizer is not installed);
#   4. the plugin harness with --enqueue (tests/plugin_harness.cpp): every plugin through TensorRT's
#      build and runtime calls, then enqueue against the op's kernel and the CPU reference (skipped
#      with a note without TensorRT headers);
# and writes BUILD_DIR/gpu_check_report.md. Exit status 0 only if every step passed.
# BASELINE=DIR (an earlier version's plugins/ tree, e.g. from `git archive REV plugins`) is built
# into BUILD_DIR/baseline too, and step 2 times its kernels beside these (gpu_check.py --baseline).
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
plugins=$(dirname "$here")
repo=$(dirname "$plugins")
build=${1:-$repo/build/gpu_check}
python=${PYTHON:-python3}
jobs_max=${SANITIZER_JOBS:-2}
if ! [[ $jobs_max =~ ^[1-9][0-9]*$ ]]; then
    echo "error: SANITIZER_JOBS='$jobs_max': expected a whole number of jobs, 1 or more" >&2
    exit 2
fi
report=$build/gpu_check_report.md
status=0
baseline=${BASELINE:-}
if [ -n "$baseline" ] && [ ! -f "$baseline/CMakeLists.txt" ]; then
    echo "error: BASELINE='$baseline': expected an earlier version's plugins/ tree (a folder with its CMakeLists.txt)" >&2
    exit 2
fi

note() { printf '\n== %s\n' "$*"; }

# the GPU as PyTorch sees it (works on Jetson, which has no nvidia-smi)
cap=$("$python" -c 'import torch; assert torch.cuda.is_available(); print("%d%d" % torch.cuda.get_device_capability())' 2>/dev/null)
if [ -z "$cap" ]; then
    echo "error: $python sees no CUDA GPU (needs PyTorch built with CUDA and a working driver)" >&2
    exit 2
fi
arch=${CUDA_ARCH:-$cap}

trt=${TensorRT_ROOT:-}
if [ -z "$trt" ]; then
    trt=$(ls -d "$repo"/../shared/third_party/tensorrt/v* 2>/dev/null | sort -V | tail -n1)
fi
if [ -n "$trt" ]; then trt_args=(-DEDGEMEM_BUILD_TRT=ON "-DTensorRT_ROOT=$trt"); else trt_args=(-DEDGEMEM_BUILD_TRT=OFF); fi

note "build (sm_$arch) in $build${trt:+, TensorRT headers $trt}"
mkdir -p "$build"
if ! cmake -S "$plugins" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$arch" \
        "${trt_args[@]}" >"$build/configure.log" 2>&1 \
   || ! cmake --build "$build" -j "$(nproc)" >"$build/build.log" 2>&1; then
    tail -n 40 "$build/configure.log" "$build/build.log" >&2
    echo "error: build failed (logs in $build)" >&2
    exit 1
fi
grep -h -E "Compiling entry|Used|spill" "$build"/ptxas/*.log >"$build/ptxas_summary.txt" || true
baseline_args=()
if [ -n "$baseline" ]; then
    note "build the baseline $baseline (sm_$arch) in $build/baseline"
    mkdir -p "$build/baseline"
    if ! cmake -S "$baseline" -B "$build/baseline" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$arch" \
            -DEDGEMEM_BUILD_TRT=OFF >"$build/baseline/configure.log" 2>&1 \
       || ! cmake --build "$build/baseline" -j "$(nproc)" >"$build/baseline/build.log" 2>&1; then
        tail -n 40 "$build/baseline/configure.log" "$build/baseline/build.log" >&2
        echo "error: the baseline's build failed (logs in $build/baseline)" >&2
        exit 1
    fi
    baseline_args=(--baseline "$build/baseline")
fi

note "numerics and timing"
"$python" "$here/gpu_check.py" --build "$build" --report "$report" ${baseline_args[@]+"${baseline_args[@]}"}
rc=$?
if [ $rc -ne 0 ]; then status=1; echo "gpu_check.py: FAILED (exit $rc)"; fi

sanitizer=$(command -v compute-sanitizer || true)
if [ -z "$sanitizer" ] && [ -x /usr/local/cuda/bin/compute-sanitizer ]; then sanitizer=/usr/local/cuda/bin/compute-sanitizer; fi
{
    echo
    echo "## compute-sanitizer"
    echo
} >>"$report"
# the ops gpu_check.py checks, as its --op names them
read -r -a ops < <("$python" -c "import sys; sys.path.insert(0, '$here'); import gpu_check; print(*gpu_check.CHECKS)")
# one tool over one op's quick cases; its exit status goes to the log's .rc beside it
sanitize() {
    local tool=$1 op=$2 log=$build/sanitizer_$1_$2.log rc
    local check=("$python" "$here/gpu_check.py" --build "$build" --quick --no-timing --op "$op")
    # only the edgemem kernels (their mangled names contain "edgemem"), not PyTorch's
    "$sanitizer" --tool "$tool" --error-exitcode 99 --kernel-name kns=edgemem "${check[@]}" >"$log" 2>&1
    rc=$?
    if grep -q -i -E "unrecognized option|invalid (value|option)|unknown option" "$log"; then
        # an older compute-sanitizer without kernel filters: check every kernel
        "$sanitizer" --tool "$tool" --error-exitcode 99 "${check[@]}" >"$log" 2>&1
        rc=$?
    fi
    echo $rc >"$log.rc"
}
if [ -z "$sanitizer" ]; then
    echo "compute-sanitizer not found: memcheck and racecheck skipped" | tee -a "$report"
elif [ ${#ops[@]} -eq 0 ]; then
    status=1
    echo "- compute-sanitizer: FAILED, gpu_check.py named no ops to check (its import failed)" | tee -a "$report"
else
    rm -f "$build"/sanitizer_*.log.rc # a job that dies before writing its status reads as failed, not as an old run's
    note "compute-sanitizer --tool memcheck and racecheck, one job per tool and op, $jobs_max at a time"
    for tool in memcheck racecheck; do
        for op in "${ops[@]}"; do
            while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n; done
            sanitize "$tool" "$op" &
        done
    done
    wait
    for tool in memcheck racecheck; do
        for op in "${ops[@]}"; do
            log=$build/sanitizer_${tool}_$op.log
            rc=$(cat "$log.rc" 2>/dev/null || echo "none")
            summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$log" | tail -n1)
            if [ "$rc" = 0 ]; then
                echo "- $tool, $op: clean (${summary:-no summary line})" | tee -a "$report"
            else
                status=1
                echo "- $tool, $op: FAILED, exit $rc (${summary:-see log}); log: $log" | tee -a "$report"
                grep -m 20 -E "=========" "$log" >&2 || true
            fi
        done
    done
fi

{
    echo
    echo "## plugin harness (enqueue)"
    echo
} >>"$report"
if [ ! -x "$build/edgemem_plugin_harness" ]; then
    echo "no TensorRT headers (set TensorRT_ROOT): the plugin harness was not built" | tee -a "$report"
else
    note "plugin harness --enqueue"
    if "$build/edgemem_plugin_harness" --enqueue >"$build/plugin_harness.log" 2>&1; then
        echo "- plugin harness: passed" | tee -a "$report"
    else
        status=1
        echo "- plugin harness: FAILED (log: $build/plugin_harness.log)" | tee -a "$report"
    fi
    { echo '```'; grep -E "^(enqueue|FAIL|harness:)" "$build/plugin_harness.log"; echo '```'; } >>"$report"
fi

note "report: $report"
if [ $status -eq 0 ]; then echo "gpu_check: all passed"; else echo "gpu_check: FAILURES (see $report)"; fi
exit $status
