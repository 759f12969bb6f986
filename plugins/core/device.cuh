// Device-side helpers shared by the kernels: typed loads/stores (float32 / float16 / bfloat16 I/O,
// float32 math), the dispatch from a DType to its type, and the warp all-reduce that plugs into the math headers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/common.h"
#include "core/io.h"

namespace edgemem
{
namespace cuda
{

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float toFloat(float x) { return x; }
__device__ __forceinline__ float toFloat(__half x) { return __half2float(x); }
__device__ __forceinline__ float toFloat(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T fromFloat(float x);
template <>
__device__ __forceinline__ float fromFloat<float>(float x)
{
    return x;
}
template <>
__device__ __forceinline__ __half fromFloat<__half>(float x)
{
    return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 fromFloat<__nv_bfloat16>(float x)
{
    return __float2bfloat16_rn(x);
}

// Calls f(T{}) with the element type of d (float, __half or __nv_bfloat16); kUnsupported for another d.
template <class F>
int withType(DType d, F&& f)
{
    switch (d)
    {
    case kFloat32: return f(float{});
    case kFloat16: return f(__half{});
    case kBFloat16: return f(__nv_bfloat16{});
    }
    return kUnsupported;
}

// A state kept narrower than its float32 math (a window's K/V ring, persistent memory) is float32
// or the 16-bit type of its op's I/O: bfloat16 beside bfloat16, float16 otherwise.
template <typename T>
struct Narrow
{
    using type = __half;
};
template <>
struct Narrow<__nv_bfloat16>
{
    using type = __nv_bfloat16;
};
inline bool validState(DType state, DType io)
{
    return state == kFloat32 || state == (io == kBFloat16 ? kBFloat16 : kFloat16);
}

template <typename T>
__device__ __forceinline__ float load(void const* base, int64_t i)
{
    return toFloat(static_cast<T const*>(base)[i]);
}

// The same from an input no kernel of the call writes, through the read-only data path (a global
// load where the compiler cannot tell base is global memory).
template <typename T>
__device__ __forceinline__ float loadInput(void const* base, int64_t i)
{
    return toFloat(__ldg(static_cast<T const*>(base) + i));
}

template <typename T>
__device__ __forceinline__ void store(void* base, int64_t i, float x)
{
    static_cast<T*>(base)[i] = fromFloat<T>(x);
}

// Sum over the 32 lanes of a warp; every lane gets the total. All lanes must call it.
struct WarpSum
{
    __device__ __forceinline__ float operator()(float x) const
    {
        EM_UNROLL
        for (int offset = kWarp / 2; offset > 0; offset >>= 1)
            x += __shfl_xor_sync(kFullMask, x, offset);
        return x;
    }
};

// Per-head dilations passed by value (kernel parameter space), so no device allocation.
constexpr int kMaxHeads = 128;
struct Dilation
{
    int32_t v[kMaxHeads];
};

inline int launchStatus() { return cudaGetLastError() == cudaSuccess ? kOk : kCudaError; }

} // namespace cuda
} // namespace edgemem
