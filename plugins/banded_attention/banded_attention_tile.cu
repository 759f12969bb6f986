// BandedAttention prefill in the tiled form of core/attention.h on tensor cores (core/mma.cuh). A
// block per (64 query rows, head, batch), 4 warps of 16 rows; per key tile (the band's span, then
// the global keys outside it gathered in order, then the persistent keys) the block stages the
// tile's K and V in shared memory and each warp runs one online softmax per row over it. Two kernels:
//   float32 I/O (bandedTileKernel): 16-key tiles as float32, 3xTF32 products;
//            scores S = Q K^T (16 x 16) to shared memory; softmax two lanes a row (scale, mask by
//            the band rule and causality, softmax_tile), the weights P back in place and the row's
//            rescale factor; O <- diag(rescale) O + P V, O a [16 x D_v] float32 array in shared memory.
//   float16 / bfloat16 I/O (bandedMmaKernel): 64-key tiles as 16-bit numbers, mma.sync m16n8k16;
//            S (16 x 64), P and O (16 x D_v) stay in a warp's registers in the C fragment layout, a
//            row's four lanes reduce its max, and P, rounded to the I/O type, is the A operand of P V.
// Global query rows attend every key: the row-per-warp kernel computes them (bandedAttentionTiled).
#include "device.cuh"
#include "launch.h"
#include "mma.cuh"

#include <type_traits>

namespace edgemem
{
namespace cuda
{
namespace
{

constexpr int kRows = attn::kBandRows;
constexpr int KT = attn::kKeyTile;
constexpr int kWarps = kRows / 16;
constexpr int kThreads = kWarps * kWarp;
constexpr int LS = KT + 4;   // row stride of a warp's [16][16] score and product tiles
constexpr int kMmaTile = 64; // keys a tile in bandedMmaKernel

enum TileKind : int
{
    kBandTile,
    kGlobalTile,
    kPersistentTile,
};

struct Smem
{
    int ldq, ldv; // D + 4, D_v + 4
    int q, k, v, o, warp, keys, list, counts, floats;
    static constexpr int kWarpFloats = 2 * lines(16 * LS); // a warp's scores (then weights) and a product tile
};

__host__ __device__ inline Smem smemLayout(int d, int dv)
{
    Smem m{};
    m.ldq = d + 4;
    m.ldv = dv + 4;
    int at = 0;
    auto take = [&at](int floats) { return at += lines(floats), at - lines(floats); };
    m.q = take(kRows * m.ldq);
    m.k = take(KT * m.ldq);
    m.v = take(KT * m.ldv);
    m.o = take(kRows * m.ldv);
    m.warp = take(kWarps * Smem::kWarpFloats);
    m.keys = take(KT);
    m.list = take(kThreads + KT); // gathered global keys: fewer than a tile left, plus one round
    m.counts = take(kWarps);
    m.floats = at;
    return m;
}

// bandedMmaKernel's shared memory in bytes: Q [kRows][ldq], K [kMmaTile][ldq], V [kMmaTile][ldv]
// as 16-bit numbers (rows padded by 8 elements: 16-byte aligned, and ldmatrix's 8 rows on distinct
// banks), then the key slots, the gathered list and the warps' counts.
struct MmaSmem
{
    int ldq, ldv; // D + 8, D_v + 8
    int q, k, v, keys, list, counts, bytes;
};

__host__ __device__ inline MmaSmem mmaLayout(int d, int dv)
{
    MmaSmem m{};
    m.ldq = d + 8;
    m.ldv = dv + 8;
    int at = 0;
    auto take = [&at](int bytes) { return at += (bytes + 127) / 128 * 128, at - (bytes + 127) / 128 * 128; };
    m.q = take(kRows * m.ldq * 2);
    m.k = take(kMmaTile * m.ldq * 2);
    m.v = take(kMmaTile * m.ldv * 2);
    m.keys = take(kMmaTile * 4);
    m.list = take((kThreads + kMmaTile) * 4);
    m.counts = take(kWarps * 4);
    m.bytes = at;
    return m;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800

// The block's key tiles of KT slots in core/attention.h's order, each handed to tile(kind) once
// sKeys holds its keys (-1: an empty slot): the band's span [lo, hi]; the global keys outside it,
// ascending (a round of kThreads positions is compacted onto the list by a ballot prefix per warp,
// then scored KT at a time); the persistent keys. The whole block calls it; tile() starts and ends
// with __syncthreads.
template <int KT, class Tile>
__device__ __forceinline__ void walkKeys(attn::BandedParams const& p, bool const* mask, int lo, int hi, int i1,
    int* sKeys, int* sList, int* sCounts, Tile&& tile)
{
    static_assert(KT <= kThreads, "a thread per key slot");
    int const tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;
    for (int j0 = lo; j0 <= hi; j0 += KT)
    {
        if (tid < KT)
            sKeys[tid] = j0 + tid <= hi ? j0 + tid : -1;
        tile(kBandTile);
    }

    int count = 0; // entries on the list, the same in every thread
    for (int j0 = 0; j0 < p.seq; j0 += kThreads)
    {
        int const j = j0 + tid;
        bool const take = j < p.seq && mask[j] && attn::globalOutsideSpan(p, j, lo, hi, i1);
        unsigned const bits = __ballot_sync(kFullMask, take);
        __syncthreads(); // the previous round's list moves and counts are done
        if (lane == 0)
            sCounts[warp] = __popc(bits);
        __syncthreads();
        int before = count, added = 0;
        for (int w = 0; w < kWarps; ++w)
        {
            before += w < warp ? sCounts[w] : 0;
            added += sCounts[w];
        }
        if (take)
            sList[before + __popc(bits & ((1u << lane) - 1))] = j;
        count += added;
        int head = 0;
        for (; count - head >= KT; head += KT)
        {
            __syncthreads(); // the list entries written
            if (tid < KT)
                sKeys[tid] = sList[head + tid];
            tile(kGlobalTile);
        }
        if (head > 0) // fewer than a tile left: to the front
        {
            __syncthreads();
            int const moved = tid < count - head ? sList[head + tid] : 0;
            __syncthreads();
            if (tid < count - head)
                sList[tid] = moved;
            count -= head;
        }
    }
    if (count > 0)
    {
        __syncthreads();
        if (tid < KT)
            sKeys[tid] = tid < count ? sList[tid] : -1;
        tile(kGlobalTile);
    }

    for (int r0 = 0; r0 < p.persistent; r0 += KT)
    {
        if (tid < KT)
            sKeys[tid] = r0 + tid < p.persistent ? r0 + tid : -1;
        tile(kPersistentTile);
    }
}

// Max and sum over the two lanes that hold a row.
struct PairMax
{
    __device__ __forceinline__ float operator()(float x) const { return fmaxf(x, __shfl_xor_sync(kFullMask, x, 1)); }
};
struct PairSum
{
    __device__ __forceinline__ float operator()(float x) const { return x + __shfl_xor_sync(kFullMask, x, 1); }
};

// One block's state and its key tile step (float32 I/O; PT: the persistent memory's type).
template <typename PT>
struct Block
{
    attn::BandedParams const& p;
    BandedAttentionIO const& io;
    Smem const L;
    float *sQ, *sK, *sV, *sO, *sS, *sT;
    int* sKeys;
    bool const* mask;
    int tid, warp, row, half, i, b, h, dil;
    SoftmaxState st;

    // The tile's rows of a key or value tensor (`width` per head) as float32, zeros for empty slots.
    __device__ __forceinline__ void stage(float* dst, int ld, int width, void const* x, void const* px, int kind)
    {
        for (int at = tid; at < KT * width; at += kThreads)
        {
            int const c = at / width, e = at % width, j = sKeys[c];
            float y = 0.0f;
            if (j >= 0)
                y = kind == kPersistentTile
                    ? load<PT>(px, attn::headRowOffset(p.heads, p.persistent, width, b, h, j) + e)
                    : load<float>(x, attn::rowOffset(p.seq, p.heads, width, b, j, h) + e);
            dst[c * ld + e] = y;
        }
    }

    // One tile of keys, sKeys[c] for its 16 slots (-1: none); the whole block calls it.
    __device__ __forceinline__ void tile(int kind)
    {
        int const D = p.d, DV = p.dv;
        bool const causal = p.causal != 0;
        __syncthreads(); // sKeys written
        stage(sK, L.ldq, D, io.key, io.persistent_key, kind);
        stage(sV, L.ldv, DV, io.value, io.persistent_value, kind);
        __syncthreads();

        Acc acc[1];
        zero(acc);
        rowTiles<3, 128, 1, RowA, ColB>(acc, sQ + warp * 16 * L.ldq, L.ldq, 8, sK, L.ldq, 8, 0, D);
        wm::store_matrix_sync(sS, acc[0], LS, wm::mem_row_major);
        __syncwarp();
        float s[8];
        EM_UNROLL
        for (int c8 = 0; c8 < 8; ++c8)
        {
            int const c = half * 8 + c8, j = sKeys[c];
            bool const ok = j >= 0
                && (kind == kBandTile ? attn::bandAllowed(i, j, p.window, dil, causal, false, mask[j])
                                      : kind == kPersistentTile || !causal || j <= i);
            s[c8] = ok ? p.scale * sS[row * LS + c] : -INFINITY;
        }
        float const rescale = softmax_tile<8>(st, s, PairMax{}, PairSum{});
        EM_UNROLL
        for (int c8 = 0; c8 < 8; ++c8)
            sS[row * LS + half * 8 + c8] = s[c8];
        __syncwarp();
        for (int c0 = 0; c0 < DV; c0 += 16)
        {
            Acc o[1];
            zero(o);
            rowTiles<3, KT, 1, RowA, RowB>(o, sS, LS, 8, sV + c0, L.ldv, 8 * L.ldv, 0, KT);
            wm::store_matrix_sync(sT, o[0], LS, wm::mem_row_major);
            __syncwarp();
            float* orow = sO + (warp * 16 + row) * L.ldv + c0 + half * 8;
            EM_UNROLL
            for (int c8 = 0; c8 < 8; ++c8)
                orow[c8] = rescale * orow[c8] + sT[row * LS + half * 8 + c8];
            __syncwarp();
        }
        __syncthreads(); // every warp is done with sKeys, sK and sV
    }
};

template <typename PT>
__global__ void __launch_bounds__(kThreads, 2)
    bandedTileKernel(attn::BandedParams const p, Dilation const dilation, BandedAttentionIO const io)
{
    extern __shared__ __align__(128) float sm[];
    Smem const L = smemLayout(p.d, p.dv);
    int const tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;
    int const h = blockIdx.y, b = blockIdx.z;
    int const i0 = blockIdx.x * kRows;
    int const i1 = (i0 + kRows < p.seq ? i0 + kRows : p.seq) - 1;
    int* sKeys = reinterpret_cast<int*>(sm + L.keys);
    float* sWarp = sm + L.warp + warp * Smem::kWarpFloats;
    // a lane holds half of the columns of one of its warp's 16 rows
    Block<PT> blk{p, io, L, sm + L.q, sm + L.k, sm + L.v, sm + L.o, sWarp, sWarp + lines(16 * LS), sKeys,
        io.global_mask + int64_t(b) * p.seq, tid, warp, lane / 2, lane % 2, i0 + warp * 16 + lane / 2, b, h,
        dilation.v[h], softmax_empty()};
    int const D = p.d, DV = p.dv;

    for (int x = tid; x < kRows * D; x += kThreads)
    {
        int const r = x / D, c = x % D;
        blk.sQ[r * L.ldq + c]
            = i0 + r < p.seq ? load<float>(io.query, attn::rowOffset(p.seq, p.heads, D, b, i0 + r, h) + c) : 0.0f;
    }
    for (int x = tid; x < kRows * DV; x += kThreads)
        blk.sO[(x / DV) * L.ldv + x % DV] = 0.0f;

    int lo = 0, hi = -1;
    attn::bandSpan(p, blk.dil, i0, i1, lo, hi);
    walkKeys<KT>(p, blk.mask, lo, hi, i1, sKeys, reinterpret_cast<int*>(sm + L.list),
        reinterpret_cast<int*>(sm + L.counts), [&](int kind) { blk.tile(kind); });

    if (blk.i <= i1 && !blk.mask[blk.i])
    {
        float const inv = 1.0f / blk.st.l;
        int64_t const out = attn::rowOffset(p.seq, p.heads, DV, b, blk.i, h);
        for (int e = blk.half * (DV / 2); e < (blk.half + 1) * (DV / 2); ++e)
            store<float>(io.output, out + e, blk.sO[(warp * 16 + blk.row) * L.ldv + e] * inv);
    }
}

// One block's online softmax over its key tiles with 16-bit operands: lane 4 g + q holds rows g
// and g + 8 of its warp's 16 (core/mma.cuh's C layout), their running max, its share of their sums
// and their O in C fragments, n-tile n for value columns 8 n + 2q and 8 n + 2q + 1.
template <typename T>
struct MmaBlock
{
    static constexpr int KT = kMmaTile;
    static constexpr int NV = 16; // value n-tiles: D_v <= 128
    attn::BandedParams const& p;
    BandedAttentionIO const& io;
    MmaSmem const L;
    T *sQ, *sK, *sV;
    int const* sKeys;
    bool const* mask;
    bool memory32; // persistent memory in float32, else in T
    int tid, lane, warp, b, h, dil;
    int rows[2];
    float m[2] = {-INFINITY, -INFINITY};
    float l[2] = {0.0f, 0.0f};
    float o[NV][4] = {};

    // The tile's rows of a key or value tensor (`width` per head) as T, 8 elements at a time, zeros
    // for empty slots.
    __device__ __forceinline__ void stage(T* dst, int ld, int width, void const* x, void const* px, int kind)
    {
        int const vecs = width / 8;
        for (int at = tid; at < KT * vecs; at += kThreads)
        {
            int const c = at / vecs, e = at % vecs * 8, j = sKeys[c];
            uint4 y = make_uint4(0, 0, 0, 0);
            if (j >= 0)
            {
                if (kind != kPersistentTile)
                    y = load8<T, T>(x, attn::rowOffset(p.seq, p.heads, width, b, j, h) + e);
                else
                {
                    int64_t const at = attn::headRowOffset(p.heads, p.persistent, width, b, h, j) + e;
                    y = memory32 ? load8<T, float>(px, at) : load8<T, T>(px, at);
                }
            }
            *reinterpret_cast<uint4*>(dst + c * ld + e) = y;
        }
    }

    // One tile of keys, sKeys[c] for its KT slots (-1: none); the whole block calls it.
    __device__ __forceinline__ void tile(int kind)
    {
        int const q = lane % 4;
        bool const causal = p.causal != 0;
        __syncthreads(); // sKeys written
        stage(sK, L.ldq, p.d, io.key, io.persistent_key, kind);
        stage(sV, L.ldv, p.dv, io.value, io.persistent_value, kind);
        __syncthreads();

        // S = Q K^T: A from the warp's 16 rows of Q, B from 16 keys' rows of K (both as stored)
        float s[KT / 8][4] = {};
        for (int k0 = 0; k0 < p.d; k0 += 16)
        {
            uint32_t a[4];
            ldmatrix4<false>(a, sQ + (warp * 16 + (lane & 7) + (lane >> 3 & 1) * 8) * L.ldq + k0 + (lane >> 4) * 8);
            EM_UNROLL
            for (int n = 0; n < KT / 8; n += 2)
            {
                uint32_t bk[4];
                ldmatrix4<false>(bk, sK + (n * 8 + (lane & 7) + (lane >> 4) * 8) * L.ldq + k0 + (lane >> 3 & 1) * 8);
                mma16816<T>(s[n], a, bk[0], bk[1]);
                mma16816<T>(s[n + 1], a, bk[2], bk[3]);
            }
        }

        // scale and mask; per row, the max over its four lanes, the weights and the rescale of O
        EM_UNROLL
        for (int n = 0; n < KT / 8; ++n)
            EM_UNROLL
        for (int e = 0; e < 4; ++e)
        {
            int const i = rows[e >> 1], j = sKeys[n * 8 + 2 * q + (e & 1)];
            bool const ok = j >= 0
                && (kind == kBandTile ? attn::bandAllowed(i, j, p.window, dil, causal, false, mask[j])
                                      : kind == kPersistentTile || !causal || j <= i);
            s[n][e] = ok ? p.scale * s[n][e] : -INFINITY;
        }
        EM_UNROLL
        for (int r = 0; r < 2; ++r)
        {
            float mx = m[r];
            EM_UNROLL
            for (int n = 0; n < KT / 8; ++n)
                mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
            bool const none = mx == -INFINITY; // every score so far masked: weights 0, O stays
            float const rescale = none ? 1.0f : em_exp(m[r] - mx);
            float sum = 0.0f;
            EM_UNROLL
            for (int n = 0; n < KT / 8; ++n)
                EM_UNROLL
            for (int e = 2 * r; e < 2 * r + 2; ++e)
            {
                s[n][e] = none ? 0.0f : em_exp(s[n][e] - mx);
                sum += s[n][e];
            }
            l[r] = l[r] * rescale + sum;
            m[r] = mx;
            EM_UNROLL
            for (int n = 0; n < NV; ++n)
            {
                o[n][2 * r] *= rescale;
                o[n][2 * r + 1] *= rescale;
            }
        }

        // O += P V: P's C tiles 2kc and 2kc + 1 as the A operand, B from V's rows transposed
        EM_UNROLL
        for (int kc = 0; kc < KT / 16; ++kc)
        {
            uint32_t const a[4] = {pack2<T>(s[2 * kc][0], s[2 * kc][1]), pack2<T>(s[2 * kc][2], s[2 * kc][3]),
                pack2<T>(s[2 * kc + 1][0], s[2 * kc + 1][1]), pack2<T>(s[2 * kc + 1][2], s[2 * kc + 1][3])};
            EM_UNROLL
            for (int n = 0; n < NV; n += 2)
            {
                if (n * 8 >= p.dv)
                    break;
                uint32_t bv[4];
                ldmatrix4<true>(
                    bv, sV + (kc * 16 + (lane & 7) + (lane >> 3 & 1) * 8) * L.ldv + n * 8 + (lane >> 4) * 8);
                mma16816<T>(o[n], a, bv[0], bv[1]);
                mma16816<T>(o[n + 1], a, bv[2], bv[3]);
            }
        }
        __syncthreads(); // every warp is done with sKeys, sK and sV
    }
};

template <typename T>
__global__ void __launch_bounds__(kThreads, 2) bandedMmaKernel(
    attn::BandedParams const p, Dilation const dilation, BandedAttentionIO const io, bool const memory32)
{
    extern __shared__ __align__(128) unsigned char raw[];
    MmaSmem const L = mmaLayout(p.d, p.dv);
    int const tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;
    int const h = blockIdx.y, b = blockIdx.z;
    int const i0 = blockIdx.x * kRows;
    int const i1 = (i0 + kRows < p.seq ? i0 + kRows : p.seq) - 1;
    int* sKeys = reinterpret_cast<int*>(raw + L.keys);
    MmaBlock<T> blk{p, io, L, reinterpret_cast<T*>(raw + L.q), reinterpret_cast<T*>(raw + L.k),
        reinterpret_cast<T*>(raw + L.v), sKeys, io.global_mask + int64_t(b) * p.seq, memory32, tid, lane, warp, b, h,
        dilation.v[h], {i0 + warp * 16 + lane / 4, i0 + warp * 16 + lane / 4 + 8}};

    int const vecs = p.d / 8;
    for (int x = tid; x < kRows * vecs; x += kThreads)
    {
        int const r = x / vecs, e = x % vecs * 8;
        *reinterpret_cast<uint4*>(blk.sQ + r * L.ldq + e) = i0 + r < p.seq
            ? load8<T, T>(io.query, attn::rowOffset(p.seq, p.heads, p.d, b, i0 + r, h) + e)
            : make_uint4(0, 0, 0, 0);
    }

    int lo = 0, hi = -1;
    attn::bandSpan(p, blk.dil, i0, i1, lo, hi);
    walkKeys<kMmaTile>(p, blk.mask, lo, hi, i1, sKeys, reinterpret_cast<int*>(raw + L.list),
        reinterpret_cast<int*>(raw + L.counts), [&](int kind) { blk.tile(kind); });

    int const q = lane % 4;
    EM_UNROLL
    for (int r = 0; r < 2; ++r)
    {
        float sum = blk.l[r];
        sum += __shfl_xor_sync(kFullMask, sum, 1);
        sum += __shfl_xor_sync(kFullMask, sum, 2);
        int const i = blk.rows[r];
        if (i > i1 || blk.mask[i])
            continue;
        float const inv = 1.0f / sum;
        int64_t const out = attn::rowOffset(p.seq, p.heads, p.dv, b, i, h);
        EM_UNROLL
        for (int n = 0; n < blk.NV; ++n)
            if (n * 8 < p.dv)
            {
                store<T>(io.output, out + n * 8 + 2 * q, blk.o[n][2 * r] * inv);
                store<T>(io.output, out + n * 8 + 2 * q + 1, blk.o[n][2 * r + 1] * inv);
            }
    }
}

#else

template <typename PT>
__global__ void bandedTileKernel(attn::BandedParams const, Dilation const, BandedAttentionIO const)
{
}

template <typename T>
__global__ void bandedMmaKernel(attn::BandedParams const, Dilation const, BandedAttentionIO const, bool const)
{
}

#endif

template <class Kernel, class... Extra>
int launch(Kernel kernel, size_t smem, attn::BandedParams const& p, Dilation const& dil, BandedAttentionIO const& io,
    cudaStream_t stream, Extra... extra)
{
    if (int const st = allowSharedMemory(kernel, smem))
        return st;
    dim3 const grid(unsigned((p.seq + kRows - 1) / kRows), unsigned(p.heads), unsigned(p.batch));
    kernel<<<grid, kThreads, smem, stream>>>(p, dil, io, extra...);
    return launchStatus();
}

} // namespace

int bandedTiles(attn::BandedParams const& p, int32_t const* dilation, BandedAttentionIO const& io, DType dtype,
    DType persistent_dtype, cudaStream_t stream)
{
    Dilation dil{};
    for (int h = 0; h < p.heads; ++h)
        dil.v[h] = dilation[h];
    bool const memory32 = persistent_dtype == kFloat32;
    return withType(dtype,
        [&](auto t) -> int
        {
            using T = decltype(t);
            if constexpr (std::is_same<T, float>::value)
            {
                size_t const smem = size_t(smemLayout(p.d, p.dv).floats) * sizeof(float);
                return memory32 ? launch(bandedTileKernel<float>, smem, p, dil, io, stream)
                                : launch(bandedTileKernel<__half>, smem, p, dil, io, stream);
            }
            else
            {
                // rows move 16 bytes at a time
                auto aligned = [](void const* x) { return reinterpret_cast<uintptr_t>(x) % 16 == 0; };
                if (!aligned(io.query) || !aligned(io.key) || !aligned(io.value)
                    || (p.persistent > 0 && (!aligned(io.persistent_key) || !aligned(io.persistent_value))))
                    return kUnsupported;
                return launch(bandedMmaKernel<T>, size_t(mmaLayout(p.d, p.dv).bytes), p, dil, io, stream, memory32);
            }
        });
}

} // namespace cuda
} // namespace edgemem
