// C ABI over the launchers (libedgemem_kernels.so), mirroring the CPU reference's C ABI.
#include "launch.h"

#include <cuda_runtime.h>

using namespace edgemem;

namespace
{
constexpr int kAbiVersion = 3;
cudaStream_t asStream(void* s) { return static_cast<cudaStream_t>(s); }
} // namespace

EM_CUDA_API int em_cuda_abi_version() { return kAbiVersion; }

EM_CUDA_API int em_cuda_linear_attention(la::Params const* p, LinearAttentionIO const* io, int dtype, int path,
    void* workspace, size_t workspace_bytes, void* stream)
{
    if (path < int(cuda::LaPath::kAuto) || path > int(cuda::LaPath::kChunked))
        return kBadArgument;
    return cuda::linearAttention(*p, *io, DType(dtype), workspace, workspace_bytes, asStream(stream), cuda::LaPath(path));
}

EM_CUDA_API size_t em_cuda_linear_attention_workspace(la::Params const* p, int path)
{
    if (path < int(cuda::LaPath::kAuto) || path > int(cuda::LaPath::kChunked))
        return 0;
    return cuda::linearAttentionWorkspace(*p, cuda::LaPath(path));
}

EM_CUDA_API int em_cuda_window_attention(attn::WindowParams const* p, int32_t const* dilation, WindowAttentionIO const* io,
    int dtype, int ring_dtype, int persistent_dtype, void* workspace, size_t workspace_bytes, void* stream)
{
    return cuda::windowAttention(*p, dilation, *io, DType(dtype), DType(ring_dtype), DType(persistent_dtype), workspace,
        workspace_bytes, asStream(stream));
}

EM_CUDA_API size_t em_cuda_window_attention_workspace(attn::WindowParams const* p)
{
    return cuda::windowAttentionWorkspace(*p);
}

EM_CUDA_API int em_cuda_banded_attention(attn::BandedParams const* p, int32_t const* dilation, BandedAttentionIO const* io,
    int dtype, int persistent_dtype, int, void* stream)
{
    return cuda::bandedAttention(*p, dilation, *io, DType(dtype), DType(persistent_dtype), asStream(stream));
}

EM_CUDA_API int em_cuda_neural_memory(nm::Params const* p, NeuralMemoryIO const* io, int dtype, int, int, void* stream)
{
    return cuda::neuralMemory(*p, *io, DType(dtype), asStream(stream));
}

EM_CUDA_API double em_cuda_peak_bandwidth_gbs(int device)
{
    int clock_khz = 0;
    int bus_bits = 0;
    if (cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device) != cudaSuccess
        || cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device) != cudaSuccess)
        return 0.0;
    return 2.0 * clock_khz * 1e3 * (bus_bits / 8.0) / 1e9; // double data rate
}
