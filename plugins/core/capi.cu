// The kernels library's own C functions; each op's launchers are exported by its kernel file
// (<op>/launch.h).
#include "core/abi.h"

#include <cuda_runtime.h>

namespace
{
constexpr int kAbiVersion = 4;
} // namespace

EM_CUDA_API int em_cuda_abi_version() { return kAbiVersion; }

EM_CUDA_API double em_cuda_peak_bandwidth_gbs(int device)
{
    int clock_khz = 0;
    int bus_bits = 0;
    if (cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device) != cudaSuccess
        || cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device) != cudaSuccess)
        return 0.0;
    return 2.0 * clock_khz * 1e3 * (bus_bits / 8.0) / 1e9; // double data rate
}
