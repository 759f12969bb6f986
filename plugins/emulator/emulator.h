// The CUDA kernels on the CPU: what a kernel file needs from CUDA besides its headers, so that g++
// compiles it as host code (scripts/emulate.py passes this file with -include, after rewriting each
// launch `k<<<grid, block, smem, stream>>>(args)` as emu::launch, each inline PTX statement as
// emu::ptx and each dynamic shared array as emu::dynamicShared). A launch runs its blocks one after
// another; a block's threads are fibers that switch only at __syncthreads and warp collectives,
// which resolve once every live thread of the block (or lane of the warp) has arrived. A thread
// that exits while others wait for it, or waits at another barrier, ends the launch with an error.
// For checking kernels' indexing, synchronisation and math without a GPU; no timing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>

#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __shared__
#undef __launch_bounds__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)

namespace emu
{

struct Thread
{
    dim3 tid;
};
struct Block
{
    dim3 idx, dim, grid;
};
Thread const& thread();
Block const& block();

// Runs body on grid x block threads; a launch that fails records the error cudaGetLastError returns.
void launch(dim3 grid, dim3 block, size_t smem, cudaStream_t stream, std::function<void()> const& body);
void* dynamicSharedBytes();
template <typename T>
T* dynamicShared()
{
    return static_cast<T*>(dynamicSharedBytes());
}

void syncthreads();
// Every live lane of the calling warp posts its in/out; once all have, fn(ins, outs) runs for the
// warp (32 entries each, lane order) and the lanes go on.
void warpCollective(void const* in, void* out, void (*fn)(void const* const* ins, void* const* outs));

// The calling thread's lane: its linear index in the block mod 32.
inline int lane()
{
    Thread const& t = thread();
    Block const& b = block();
    return int((t.tid.x + b.dim.x * (t.tid.y + b.dim.y * t.tid.z)) % 32);
}

// Lane `from`'s v (from mod 32, as __shfl_sync takes it).
template <typename T>
T shflIndex(T v, int from)
{
    struct In
    {
        T v;
        int from;
    } const in{v, from};
    T out;
    warpCollective(&in, &out,
        [](void const* const* ins, void* const* outs)
        {
            for (int l = 0; l < 32; ++l)
            {
                int const from = static_cast<In const*>(ins[l])->from;
                *static_cast<T*>(outs[l]) = static_cast<In const*>(ins[from & 31])->v;
            }
        });
    return out;
}

unsigned ballot(int pred);
void syncwarp();

// The PTX instructions the kernels write as inline assembly (scripts/emulate.py rewrites each
// `asm volatile("text" : outputs : inputs)` as ptx("text", outputs..., inputs...)): mma.sync
// m16n8k16 (f16, bf16) and m16n8k8 (tf32), ldmatrix .x4 (.trans), cp.async (done at once) and its
// commit and wait (nothing to do then). Anything else ends the program with its text.
[[noreturn]] void unknown(char const* text);
// Ends the program with a message (a kernel broke a rule of CUDA that the emulator checks).
[[noreturn]] void fail(char const* why);
inline bool starts(char const* text, char const* prefix)
{
    return std::strncmp(text, prefix, std::strlen(prefix)) == 0;
}
void mma(char const* text, float* c, uint32_t const* a, uint32_t b0, uint32_t b1);
void ldmatrix(char const* text, uint32_t* r, uint32_t handle);
// A shared-memory address as a 32-bit handle (__cvta_generic_to_shared) and back.
uint32_t sharedHandle(void const* p);
void* sharedPointer(uint32_t handle);

inline void ptx(char const* text, float& c0, float& c1, float& c2, float& c3, uint32_t a0, uint32_t a1, uint32_t a2,
    uint32_t a3, uint32_t b0, uint32_t b1)
{
    float c[4] = {c0, c1, c2, c3};
    uint32_t const a[4] = {a0, a1, a2, a3};
    mma(text, c, a, b0, b1);
    c0 = c[0], c1 = c[1], c2 = c[2], c3 = c[3];
}
inline void ptx(char const* text, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3, uint32_t handle)
{
    uint32_t r[4];
    ldmatrix(text, r, handle);
    r0 = r[0], r1 = r[1], r2 = r[2], r3 = r[3];
}
inline void ptx(char const* text, uint32_t handle, void const* global)
{
    if (!starts(text, "cp.async.cg.shared.global") || !std::strstr(text, "], 16;"))
        unknown(text);
    std::memcpy(sharedPointer(handle), global, 16);
}
inline void ptx(char const* text, int)
{
    if (!starts(text, "cp.async.wait_group"))
        unknown(text);
}
inline void ptx(char const* text)
{
    if (!starts(text, "cp.async.commit_group"))
        unknown(text);
}

// What a tensor core reads of a TF32 operand held in a float32: its top 19 bits.
inline float tf32Operand(float x)
{
    uint32_t u;
    std::memcpy(&u, &x, 4);
    u &= 0xffffe000u;
    std::memcpy(&x, &u, 4);
    return x;
}

// TF32 from float32 as cvt.rna.tf32.f32 rounds: to nearest, ties away from zero, 10 mantissa bits.
inline float tf32(float x)
{
    uint32_t u;
    std::memcpy(&u, &x, 4);
    if ((u & 0x7f800000u) != 0x7f800000u)
        u = (u + 0x1000u) & 0xffffe000u;
    std::memcpy(&x, &u, 4);
    return x;
}

} // namespace emu

#define threadIdx (::emu::thread().tid)
#define blockIdx (::emu::block().idx)
#define blockDim (::emu::block().dim)
#define gridDim (::emu::block().grid)

inline void __syncthreads() { ::emu::syncthreads(); }
template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int mask)
{
    return ::emu::shflIndex(v, ::emu::lane() ^ mask);
}
template <typename T>
inline T __shfl_sync(unsigned, T v, int from)
{
    return ::emu::shflIndex(v, from);
}
template <typename T>
inline T __shfl_up_sync(unsigned, T v, unsigned delta)
{
    int const lane = ::emu::lane();
    return ::emu::shflIndex(v, lane >= int(delta) ? lane - int(delta) : lane);
}
inline unsigned __ballot_sync(unsigned, int pred) { return ::emu::ballot(pred); }
inline void __syncwarp(unsigned = 0xffffffffu) { ::emu::syncwarp(); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline uint32_t __cvta_generic_to_shared(void const* p) { return ::emu::sharedHandle(p); }
template <typename T>
inline T __ldg(T const* p)
{
    return *p;
}
inline uint32_t __float_as_uint(float x)
{
    uint32_t u;
    std::memcpy(&u, &x, 4);
    return u;
}

// cuda_runtime.h's overloads for kernel pointers, which it declares for nvcc only.
template <class Kernel>
cudaError_t cudaFuncSetAttribute(Kernel* kernel, cudaFuncAttribute attr, int value)
{
    return cudaFuncSetAttribute(reinterpret_cast<void const*>(kernel), attr, value);
}
template <class Kernel>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, Kernel* kernel, int threads, size_t smem)
{
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, reinterpret_cast<void const*>(kernel), threads, smem);
}

// WMMA on float32 tiles (TF32 products): each lane's fragment holds the whole tile, row by row, which
// is one of the layouts the API leaves open; loads and stores act on the whole tile in every lane.
namespace nvcuda
{
namespace wmma
{
struct matrix_a
{
};
struct matrix_b
{
};
struct accumulator
{
};
struct row_major
{
};
struct col_major
{
};
namespace precision
{
struct tf32
{
};
} // namespace precision
enum layout_t
{
    mem_row_major,
    mem_col_major,
};

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment
{
    static constexpr int rows = std::is_same<Use, matrix_b>::value ? K : M;
    static constexpr int cols = std::is_same<Use, matrix_a>::value ? K : N;
    static constexpr int num_elements = rows * cols;
    static constexpr bool row = !std::is_same<Layout, col_major>::value;
    float x[num_elements];
};

inline float __float_to_tf32(float x) { return ::emu::tf32(x); }

// Loads and stores are warp collectives, as on the device: every lane loads before any stores (a
// tile may be updated in place), from and to the one address the lanes must agree on.
struct TileAddress
{
    float* p;
    unsigned ld;
    bool row;
};

template <class F>
void loadWarp(void const* const* ins, void* const* outs)
{
    TileAddress const a = *static_cast<TileAddress const*>(ins[0]);
    for (int l = 1; l < 32; ++l)
    {
        TileAddress const b = *static_cast<TileAddress const*>(ins[l]);
        if (b.p != a.p || b.ld != a.ld || b.row != a.row)
            ::emu::fail("wmma::load_matrix_sync: the lanes of a warp pass different addresses");
    }
    F f;
    for (int r = 0; r < F::rows; ++r)
        for (int c = 0; c < F::cols; ++c)
            f.x[r * F::cols + c] = a.row ? a.p[size_t(r) * a.ld + c] : a.p[size_t(c) * a.ld + r];
    for (int l = 0; l < 32; ++l)
        *static_cast<F*>(outs[l]) = f;
}

template <class F>
void storeWarp(void const* const* ins, void* const* outs)
{
    TileAddress const a = *static_cast<TileAddress const*>(ins[0]);
    F const& f = *static_cast<F const*>(outs[0]);
    for (int l = 1; l < 32; ++l)
    {
        TileAddress const b = *static_cast<TileAddress const*>(ins[l]);
        if (b.p != a.p || b.ld != a.ld || b.row != a.row)
            ::emu::fail("wmma::store_matrix_sync: the lanes of a warp pass different addresses");
        if (std::memcmp(outs[l], &f, sizeof f) != 0)
            ::emu::fail("wmma::store_matrix_sync: the lanes of a warp hold different tiles (a kernel that "
                        "sets a fragment's elements by lane depends on a layout WMMA leaves open)");
    }
    for (int r = 0; r < F::rows; ++r)
        for (int c = 0; c < F::cols; ++c)
            (a.row ? a.p[size_t(r) * a.ld + c] : a.p[size_t(c) * a.ld + r]) = f.x[r * F::cols + c];
}

template <class Use, int M, int N, int K, class T, class L>
void load_matrix_sync(fragment<Use, M, N, K, T, L>& f, float const* p, unsigned ld)
{
    using F = fragment<Use, M, N, K, T, L>;
    TileAddress const a{const_cast<float*>(p), ld, F::row};
    ::emu::warpCollective(&a, &f, loadWarp<F>);
}
template <int M, int N, int K, class T>
void load_matrix_sync(fragment<accumulator, M, N, K, T>& f, float const* p, unsigned ld, layout_t layout)
{
    TileAddress const a{const_cast<float*>(p), ld, layout == mem_row_major};
    ::emu::warpCollective(&a, &f, loadWarp<fragment<accumulator, M, N, K, T>>);
}
template <int M, int N, int K, class T>
void store_matrix_sync(float* p, fragment<accumulator, M, N, K, T> const& f, unsigned ld, layout_t layout)
{
    TileAddress const a{p, ld, layout == mem_row_major};
    ::emu::warpCollective(
        &a, const_cast<fragment<accumulator, M, N, K, T>*>(&f), storeWarp<fragment<accumulator, M, N, K, T>>);
}
template <class Use, int M, int N, int K, class T, class L>
void fill_fragment(fragment<Use, M, N, K, T, L>& f, float v)
{
    for (float& e : f.x)
        e = v;
}
// d = a b + c, a warp collective computed once from lane 0's operands (every lane holds the same
// tiles: storeWarp checks it); the tensor cores read the TF32 bits of each operand.
template <class D, class A, class B>
struct MmaOperands
{
    A const* a;
    B const* b;
    D const* c;
};

template <class D, class A, class B, int M, int N, int K>
void mmaWarp(void const* const* ins, void* const* outs)
{
    MmaOperands<D, A, B> const& o = *static_cast<MmaOperands<D, A, B> const*>(ins[0]);
    D d;
    for (int i = 0; i < M; ++i)
        for (int j = 0; j < N; ++j)
        {
            float s = o.c->x[i * N + j];
            for (int k = 0; k < K; ++k)
                s += ::emu::tf32Operand(o.a->x[i * K + k]) * ::emu::tf32Operand(o.b->x[k * N + j]);
            d.x[i * N + j] = s;
        }
    for (int l = 0; l < 32; ++l)
        *static_cast<D*>(outs[l]) = d;
}

template <int M, int N, int K, class T, class LA, class LB>
void mma_sync(fragment<accumulator, M, N, K, float>& d, fragment<matrix_a, M, N, K, T, LA> const& a,
    fragment<matrix_b, M, N, K, T, LB> const& b, fragment<accumulator, M, N, K, float> const& c)
{
    using D = fragment<accumulator, M, N, K, float>;
    using A = fragment<matrix_a, M, N, K, T, LA>;
    using B = fragment<matrix_b, M, N, K, T, LB>;
    MmaOperands<D, A, B> const in{&a, &b, &c};
    D out;
    ::emu::warpCollective(&in, &out, mmaWarp<D, A, B, M, N, K>);
    d = out;
}
} // namespace wmma
} // namespace nvcuda

#define __CUDA_ARCH__ EMU_ARCH
