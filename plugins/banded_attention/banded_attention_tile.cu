// BandedAttention prefill in the tiled form of core/attention.h on tensor cores (core/mma.cuh: TF32
// products, 3xTF32 for float32 I/O). A block per (64 query rows, head, batch), 4 warps of 16 rows.
// Per key tile (16 keys: the band's span, then the global keys outside it gathered in order, then
// the persistent keys) the block stages K and V as float32, and each warp
//   scores   S = Q K^T (16 x 16) to shared memory;
//   softmax  two lanes a row: scale, mask (band rule, causality), softmax_tile, the weights P back
//            in place and the row's rescale factor;
//   values   O <- diag(rescale) O + P V, O a [16 x D_v] float32 array in shared memory.
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
constexpr int LS = KT + 4;           // row stride of a warp's [16][16] score and product tiles
constexpr int kList = kThreads + KT; // gathered global keys: fewer than a tile left, plus one round

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
    m.list = take(kList);
    m.counts = take(kWarps);
    m.floats = at;
    return m;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800

// Max and sum over the two lanes that hold a row.
struct PairMax
{
    __device__ __forceinline__ float operator()(float x) const { return fmaxf(x, __shfl_xor_sync(kFullMask, x, 1)); }
};
struct PairSum
{
    __device__ __forceinline__ float operator()(float x) const { return x + __shfl_xor_sync(kFullMask, x, 1); }
};

// One block's state and its key tile step.
template <typename T, typename PT, int P>
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
                    : load<T>(x, attn::rowOffset(p.seq, p.heads, width, b, j, h) + e);
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
        rowTiles<P, 128, 1, RowA, ColB>(acc, sQ + warp * 16 * L.ldq, L.ldq, 8, sK, L.ldq, 8, 0, D);
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
            rowTiles<P, KT, 1, RowA, RowB>(o, sS, LS, 8, sV + c0, L.ldv, 8 * L.ldv, 0, KT);
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

template <typename T, typename PT, int P>
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
    int* sList = reinterpret_cast<int*>(sm + L.list);
    int* sCounts = reinterpret_cast<int*>(sm + L.counts);
    float* sWarp = sm + L.warp + warp * Smem::kWarpFloats;
    // a lane holds half of the columns of one of its warp's 16 rows
    Block<T, PT, P> blk{p, io, L, sm + L.q, sm + L.k, sm + L.v, sm + L.o, sWarp, sWarp + lines(16 * LS), sKeys,
        io.global_mask + int64_t(b) * p.seq, tid, warp, lane / 2, lane % 2, i0 + warp * 16 + lane / 2, b, h,
        dilation.v[h], softmax_empty()};
    int const D = p.d, DV = p.dv;

    for (int x = tid; x < kRows * D; x += kThreads)
    {
        int const r = x / D, c = x % D;
        blk.sQ[r * L.ldq + c]
            = i0 + r < p.seq ? load<T>(io.query, attn::rowOffset(p.seq, p.heads, D, b, i0 + r, h) + c) : 0.0f;
    }
    for (int x = tid; x < kRows * DV; x += kThreads)
        blk.sO[(x / DV) * L.ldv + x % DV] = 0.0f;

    int lo = 0, hi = -1;
    attn::bandSpan(p, blk.dil, i0, i1, lo, hi);
    for (int j0 = lo; j0 <= hi; j0 += KT)
    {
        if (tid < KT)
            sKeys[tid] = j0 + tid <= hi ? j0 + tid : -1;
        blk.tile(kBandTile);
    }

    // the global keys outside the span, ascending: a round of kThreads positions is compacted onto
    // the list (ballot prefix per warp), then scored 16 at a time
    int count = 0; // entries on the list, the same in every thread
    for (int j0 = 0; j0 < p.seq; j0 += kThreads)
    {
        int const j = j0 + tid;
        bool const take = j < p.seq && blk.mask[j] && attn::globalOutsideSpan(p, j, lo, hi, i1);
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
            blk.tile(kGlobalTile);
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
        blk.tile(kGlobalTile);
    }

    for (int r0 = 0; r0 < p.persistent; r0 += KT)
    {
        if (tid < KT)
            sKeys[tid] = r0 + tid < p.persistent ? r0 + tid : -1;
        blk.tile(kPersistentTile);
    }

    if (blk.i <= i1 && !blk.mask[blk.i])
    {
        float const inv = 1.0f / blk.st.l;
        int64_t const out = attn::rowOffset(p.seq, p.heads, DV, b, blk.i, h);
        for (int e = blk.half * (DV / 2); e < (blk.half + 1) * (DV / 2); ++e)
            store<T>(io.output, out + e, blk.sO[(warp * 16 + blk.row) * L.ldv + e] * inv);
    }
}

#else

template <typename T, typename PT, int P>
__global__ void bandedTileKernel(attn::BandedParams const, Dilation const, BandedAttentionIO const)
{
}

#endif

template <typename T, typename PT>
int launch(attn::BandedParams const& p, Dilation const& dil, BandedAttentionIO const& io, cudaStream_t stream)
{
    constexpr int P = std::is_same<T, float>::value ? 3 : 1;
    auto kernel = bandedTileKernel<T, PT, P>;
    size_t const smem = size_t(smemLayout(p.d, p.dv).floats) * sizeof(float);
    if (int const st = allowSharedMemory(kernel, smem))
        return st;
    dim3 const grid(unsigned((p.seq + kRows - 1) / kRows), unsigned(p.heads), unsigned(p.batch));
    kernel<<<grid, kThreads, smem, stream>>>(p, dil, io);
    return launchStatus();
}

} // namespace

int bandedTiles(attn::BandedParams const& p, int32_t const* dilation, BandedAttentionIO const& io, DType dtype,
    DType persistent_dtype, cudaStream_t stream)
{
    Dilation dil{};
    for (int h = 0; h < p.heads; ++h)
        dil.v[h] = dilation[h];
    return withType(dtype,
        [&](auto t)
        {
            using T = decltype(t);
            return persistent_dtype == kFloat32 ? launch<T, float>(p, dil, io, stream)
                                                : launch<T, typename Narrow<T>::type>(p, dil, io, stream);
        });
}

} // namespace cuda
} // namespace edgemem
