// Tensor-core tiles shared by the chunked and tiled kernels. First, 16 x 16 x 8 TF32 warp matrix
// operations on float32 tiles (shared or global memory), accumulated in float32. P = 1: one TF32
// product per tile (float16 and bfloat16 inputs are exact in TF32; values computed from them are
// rounded). P = 3: each operand split x = hi + lo into two TF32 numbers and multiplied as
// hi.hi + hi.lo + lo.hi (the dropped lo.lo term is below float32 rounding), for float32 inputs and
// where one pass's rounding compounds (NeuralMemory's gradient steps). Then mma.sync, m16n8k16 on
// 16-bit operands and m16n8k8 on TF32 ones, in registers, whose fragment layouts are known, so a
// kernel can keep its accumulators in registers and work on them row by row (attention's softmax)
// or feed them to the next product (masked scores into M U). sm_80 and later;
// below, the helpers are not defined and the kernels that use them compile empty.
#pragma once

#include <cuda_runtime.h>
#include <mma.h>

#include <type_traits>

#include "core/device.cuh"

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

// mma.sync m16n8k16, float16 or bfloat16 operands O, float32 accumulators, in the PTX ISA's
// fragment layouts; lane = 4 g + q. A (16 x 16, row major): a[0] row g, columns 2q and 2q + 1;
// a[1] row g + 8; a[2], a[3] the same 8 columns on. B (16 x 8): b0 rows 2q and 2q + 1 of column g,
// b1 8 rows on. C (16 x 8): c[0], c[1] row g, columns 2q and 2q + 1; c[2], c[3] row g + 8. Two C
// tiles side by side (16 columns), rounded and packed, are therefore an A operand.
template <typename O>
__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t const (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma16816<__half>(float (&c)[4], uint32_t const (&a)[4], uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&c)[4], uint32_t const (&a)[4], uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats rounded to O, lo in the low half (the lower column of a fragment register).
template <typename O>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi)
{
    __half2 const x = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t const*>(&x);
}

template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi)
{
    __nv_bfloat162 const x = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t const*>(&x);
}

// 8 consecutive elements of x (type X: O or float) from element i on, 16-byte aligned, as O.
template <typename O, typename X>
__device__ __forceinline__ uint4 load8(void const* x, int64_t i)
{
    if constexpr (std::is_same<O, X>::value)
        return *reinterpret_cast<uint4 const*>(static_cast<X const*>(x) + i);
    else
    {
        static_assert(std::is_same<X, float>::value, "O or float");
        float4 const* f = reinterpret_cast<float4 const*>(static_cast<float const*>(x) + i);
        float4 const u = f[0], v = f[1];
        return make_uint4(pack2<O>(u.x, u.y), pack2<O>(u.z, u.w), pack2<O>(v.x, v.y), pack2<O>(v.z, v.w));
    }
}

// A float32 as TF32 operands of mma.sync m16n8k8, as rowTiles rounds them: P = 1, hi = x rounded;
// P = 3, also lo = (x - hi) rounded.
template <int P>
struct Tf32
{
    uint32_t hi, lo;
    __device__ __forceinline__ explicit Tf32(float x)
    {
        float const h = wm::__float_to_tf32(x);
        hi = __float_as_uint(h);
        lo = P == 3 ? __float_as_uint(wm::__float_to_tf32(x - h)) : 0u;
    }
    // x as the operand it already is for P = 1 (a TF32 value, its low 13 bits zero: no rounding
    // instructions); split as above for P = 3.
    __device__ __forceinline__ static Tf32 of(float x)
    {
        if constexpr (P == 1)
            return Tf32(x, 0);
        else
            return Tf32(x);
    }

private:
    __device__ __forceinline__ Tf32(float x, int)
        : hi(__float_as_uint(x))
        , lo(0u)
    {
    }
};

// Accumulators as the operands a P-pass product reads through Tf32::of: rounded to TF32 for P = 1,
// as they are for P = 3.
template <int P, int NT>
__device__ __forceinline__ void tf32Operands(float (&out)[NT][4], float const (&acc)[NT][4])
{
    EM_UNROLL
    for (int n = 0; n < NT; ++n)
        EM_UNROLL
    for (int i = 0; i < 4; ++i)
        out[n][i] = P == 1 ? wm::__float_to_tf32(acc[n][i]) : acc[n][i];
}

// mma.sync m16n8k8 on TF32 operands, float32 accumulators (lane = 4 g + q). A (16 x 8, row major):
// a[0] row g, column q; a[1] row g + 8; a[2], a[3] the same rows, column q + 4. B (8 x 8): b0 row q
// of column g, b1 row q + 4. C as m16n8k16's: c[0], c[1] row g, columns 2q and 2q + 1; c[2], c[3]
// row g + 8. A k step may take its 8 columns in any order if B's rows take the same one, so a C
// tile is an A operand as {c[0], c[2], c[1], c[3]} (k slot q is column 2q, slot q + 4 column 2q + 1)
// with b0, b1 from rows 2q and 2q + 1. P = 3: lo.hi + hi.lo + hi.hi, as rowTiles.
template <int P>
__device__ __forceinline__ void mma1688(float (&c)[4], Tf32<P> const (&a)[4], Tf32<P> b0, Tf32<P> b1)
{
    auto step = [&](uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t x0, uint32_t x1)
    {
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                     "{%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(x0), "r"(x1));
    };
    if constexpr (P == 3)
    {
        step(a[0].lo, a[1].lo, a[2].lo, a[3].lo, b0.hi, b1.hi);
        step(a[0].hi, a[1].hi, a[2].hi, a[3].hi, b0.lo, b1.lo);
    }
    step(a[0].hi, a[1].hi, a[2].hi, a[3].hi, b0.hi, b1.hi);
}

// acc[n] += X Y_n on m16n8k8 (one warp): X 16 x K, entry (i, k) at x + i * xi + k * XK; Y K x 8 NT,
// entry (k, j) at y + k * ly + j; both read through Tf32::of, so for P = 1 they must hold TF32
// values already. A k step takes its 8 columns in the C tiles' order (slot q is column 2 q, slot
// q + 4 column 2 q + 1): X's reads are 8-byte pairs where XK = 1 (distinct banks for xi = 8 mod
// 32), X's and Y's rows 2 q and 2 q + 1 fall on distinct banks for a stride of 4 mod 8. Plain
// pointer arithmetic on shared arrays, so the compiler issues shared loads (wmma's tf32 fragment
// loads become generic ones).
template <int P, int K, int NT, int XK>
__device__ __forceinline__ void warpProduct(float (&acc)[NT][4], float const* x, int xi, float const* y, int ly)
{
    int const lane = threadIdx.x % kWarp, g = lane / 4, q = lane % 4;
    EM_UNROLL
    for (int k = 0; k < K; k += 8)
    {
        float const* xa = x + g * xi + (k + 2 * q) * XK;
        float2 lo, hi; // rows g and g + 8, columns 2 q and 2 q + 1 of the step
        if constexpr (XK == 1)
        {
            lo = *reinterpret_cast<float2 const*>(xa);
            hi = *reinterpret_cast<float2 const*>(xa + 8 * xi);
        }
        else
        {
            lo = make_float2(xa[0], xa[XK]);
            hi = make_float2(xa[8 * xi], xa[8 * xi + XK]);
        }
        using F = Tf32<P>;
        F const a[4] = {F::of(lo.x), F::of(hi.x), F::of(lo.y), F::of(hi.y)};
        float const* yb = y + (k + 2 * q) * ly + g;
        EM_UNROLL
        for (int n = 0; n < NT; ++n)
            mma1688<P>(acc[n], a, F::of(yb[8 * n]), F::of(yb[ly + 8 * n]));
    }
}

// m16n8 accumulator tiles acc[n] (columns 8 n ..) to and from the row-major 16 x 8 NT block at p
// (ld even, p 8-byte aligned), shared or global.
template <int NT>
__device__ __forceinline__ void storeAcc(float* p, int ld, float const (&acc)[NT][4])
{
    int const lane = threadIdx.x % kWarp;
    float* r = p + (lane / 4) * ld + 2 * (lane % 4);
    EM_UNROLL
    for (int n = 0; n < NT; ++n)
    {
        *reinterpret_cast<float2*>(r + 8 * n) = make_float2(acc[n][0], acc[n][1]);
        *reinterpret_cast<float2*>(r + 8 * ld + 8 * n) = make_float2(acc[n][2], acc[n][3]);
    }
}

template <int NT>
__device__ __forceinline__ void loadAcc(float (&acc)[NT][4], float const* p, int ld)
{
    int const lane = threadIdx.x % kWarp;
    float const* r = p + (lane / 4) * ld + 2 * (lane % 4);
    EM_UNROLL
    for (int n = 0; n < NT; ++n)
    {
        float2 const x = *reinterpret_cast<float2 const*>(r + 8 * n);
        float2 const y = *reinterpret_cast<float2 const*>(r + 8 * ld + 8 * n);
        acc[n][0] = x.x;
        acc[n][1] = x.y;
        acc[n][2] = y.x;
        acc[n][3] = y.y;
    }
}

template <int NT>
__device__ __forceinline__ void negate(float (&acc)[NT][4])
{
    EM_UNROLL
    for (int n = 0; n < NT; ++n)
        EM_UNROLL
    for (int i = 0; i < 4; ++i)
        acc[n][i] = -acc[n][i];
}

// ldmatrix .x4 from shared memory: lane l passes the address of row l % 8 (16 bytes, 16-byte
// aligned) of 8 x 8 matrix l / 8 of 16-bit elements, and r[m] receives matrix m's fragment: row g,
// columns 2q and 2q + 1; with Trans, rows 2q and 2q + 1 of column g (a B operand from a row-major
// [k][n] array).
template <bool Trans>
__device__ __forceinline__ void ldmatrix4(uint32_t (&r)[4], void const* row)
{
    unsigned const at = static_cast<unsigned>(__cvta_generic_to_shared(row));
    if constexpr (Trans)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(at));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(at));
}

#endif

} // namespace cuda
} // namespace edgemem
