// Tensor-core tiles shared by the chunked kernels: 16 x 16 x 8 TF32 warp matrix operations on
// float32 tiles (shared or global memory), accumulated in float32. P = 1: one TF32 product per tile
// (float16 and bfloat16 inputs are exact in TF32; values computed from them are rounded). P = 3:
// each operand split x = hi + lo into two TF32 numbers and multiplied as hi.hi + hi.lo + lo.hi (the
// dropped lo.lo term is below float32 rounding), for float32 inputs and where one pass's rounding
// compounds (NeuralMemory's gradient steps). sm_80 and later; below, the helpers are not defined and the kernels
// that use them compile empty.
#pragma once

#include <cuda_runtime.h>
#include <mma.h>

#include "core/common.h"

namespace edgemem
{
namespace cuda
{

namespace wm = nvcuda::wmma;

// Before launching a tensor-core kernel that takes `smem` bytes of dynamic shared memory: kOk once
// the current device is sm_80 or later and the kernel's limit is raised to `smem`; kUnsupported
// when the device is older or gives a block less; kCudaError when it cannot be queried.
template <class Kernel>
int allowSharedMemory(Kernel kernel, size_t smem)
{
    int device = 0, major = 0, optin = 0;
    if (cudaGetDevice(&device) != cudaSuccess
        || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess
        || cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess)
        return kCudaError;
    if (major < 8 || smem > size_t(optin))
        return kUnsupported;
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)) == cudaSuccess
        ? kOk
        : kCudaError;
}

// Smem floats rounded up to whole 128-byte lines (keeps every array 32-byte aligned).
__host__ __device__ constexpr int lines(int floats) { return (floats + 31) / 32 * 32; }

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800

using Acc = wm::fragment<wm::accumulator, 16, 16, 8, float>;
using RowA = wm::fragment<wm::matrix_a, 16, 16, 8, wm::precision::tf32, wm::row_major>;
using ColA = wm::fragment<wm::matrix_a, 16, 16, 8, wm::precision::tf32, wm::col_major>;
using RowB = wm::fragment<wm::matrix_b, 16, 16, 8, wm::precision::tf32, wm::row_major>;
using ColB = wm::fragment<wm::matrix_b, 16, 16, 8, wm::precision::tf32, wm::col_major>;

template <class F>
__device__ __forceinline__ void split(F& hi, F& lo)
{
    EM_UNROLL
    for (int i = 0; i < hi.num_elements; ++i)
    {
        float const x = hi.x[i];
        hi.x[i] = wm::__float_to_tf32(x);
        lo.x[i] = wm::__float_to_tf32(x - hi.x[i]);
    }
}

template <class F>
__device__ __forceinline__ void round(F& f)
{
    EM_UNROLL
    for (int i = 0; i < f.num_elements; ++i)
        f.x[i] = wm::__float_to_tf32(f.x[i]);
}

// One row block of tiles: acc[j] += sign * A . B_j over k < kend (a multiple of 8, at most K),
// A the 16 x K block at `a` (ak floats further per 8 k), B_j the K x 16 block at b + j * bj (bk
// floats further per 8 k). A's fragment is loaded once per k step for all NT tiles, whose
// products are independent. P = 1: one TF32 product, P = 3: hi.hi + hi.lo + lo.hi.
template <int P, int K, int NT, class FA, class FB>
__device__ __forceinline__ void rowTiles(Acc (&acc)[NT], float const* a, int lda, int ak, float const* b, int ldb,
    int bk, int bj, int kend = K, float sign = 1.0f)
{
#pragma unroll 2
    for (int k0 = 0; k0 < K; k0 += 8)
    {
        if (k0 >= kend)
            break;
        FA ah, al;
        wm::load_matrix_sync(ah, a + (k0 / 8) * ak, lda);
        EM_UNROLL
        for (int i = 0; i < ah.num_elements; ++i)
            ah.x[i] *= sign;
        if constexpr (P == 1)
            round(ah);
        else
            split(ah, al);
        EM_UNROLL
        for (int j = 0; j < NT; ++j)
        {
            FB bh, bl;
            wm::load_matrix_sync(bh, b + (k0 / 8) * bk + j * bj, ldb);
            if constexpr (P == 1)
            {
                round(bh);
                wm::mma_sync(acc[j], ah, bh, acc[j]);
            }
            else
            {
                split(bh, bl);
                wm::mma_sync(acc[j], al, bh, acc[j]);
                wm::mma_sync(acc[j], ah, bl, acc[j]);
                wm::mma_sync(acc[j], ah, bh, acc[j]);
            }
        }
    }
}

template <int NT>
__device__ __forceinline__ void zero(Acc (&acc)[NT])
{
    EM_UNROLL
    for (int j = 0; j < NT; ++j)
        wm::fill_fragment(acc[j], 0.0f);
}

// acc tiles to row-major memory: tile j at p + j * step.
template <int NT>
__device__ __forceinline__ void storeTiles(float* p, int ld, int step, Acc const (&acc)[NT])
{
    EM_UNROLL
    for (int j = 0; j < NT; ++j)
        wm::store_matrix_sync(p + j * step, acc[j], ld, wm::mem_row_major);
}

#endif

} // namespace cuda
} // namespace edgemem
