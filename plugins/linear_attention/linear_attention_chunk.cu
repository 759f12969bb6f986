// LinearAttention prefill in the chunked (UT/WY) form of edgemem/linear_attention.h, on tensor
// cores: TF32 products on float32 tiles staged in shared memory (core/mma.cuh), one product per
// tile for 16-bit inputs, 3xTF32 for float32.
//
// Three kernels per segment, 256 threads (8 warps) each; in prepare and output a warp computes a
// row of 16 x 16 WMMA tiles with one A fragment per k step (rowTiles), so its tiles' products run
// side by side:
//   prepare  a block per (chunk, kv head, batch): G, A, T = (I + A)^-1 (16 x 16 diagonal blocks
//            by substitution, the blocks below by products), W, U0 and K~ into the workspace (W and
//            K~ rounded to TF32 for 16-bit I/O, the walk's one-pass operands);
//   state    a block per (32 value columns, kv head, batch), or 16 where 32 would leave SMs idle,
//            walks the chunks in order with its state tiles in m16n8k8 accumulators (mma.sync,
//            fragments read from shared memory by plain loads, warpProduct):
//            U = U0 - W S (16 columns: two warps share a tile's k sum), S <- exp(G_last) S + K~^T U; it
//            stores the state at every chunk start. The next chunk's W, K~ and U0 are copied in
//            (cp.async) while the current one is multiplied where shared memory holds two stages;
//   output   a block per (chunk, query head, batch x value tile): (Q K^T masked) U + (Q e^G) S.
// Per-key decay: G [C][DK] goes through the workspace, K K^T and Q K^T become decayedBlocks, the
// walk scales its state rows in the accumulators.
// With per-head decay the prepare and output passes are chunkPrepareMma and chunkOutputMma
// instead, where their shared memory fits: 4 warps on mma.sync, K (and Q) staged in the I/O type,
// the score tiles kept in registers.
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

constexpr int kThreads = 256;
// 8 warps: in the parallel passes warp w takes row block w / 2 and half of its column tiles
constexpr int C = la::kChunk;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 // TF32 tensor cores; the kernels are empty below

// (I + A)^-1 of a strictly lower C x C matrix A, blockwise over 16 x 16 blocks: the diagonal
// blocks by forward substitution (a thread per column), then block row I from the ones above it,
// T_IJ = -T_II sum_{J <= M < I} A_IM T_MJ. Blocks above the diagonal are zeroed. THREADS: the
// block's threads.
template <int P, int THREADS = kThreads>
__device__ __forceinline__ void unitLowerInverse(float const* a, int lda, float* t, int ldt)
{
    static_assert(THREADS >= C && THREADS / kWarp >= C / 16 - 1, "a thread per column, a warp per block");
    int const tid = threadIdx.x, warp = tid / kWarp;
    if (tid < C)
    {
        int const blk = tid / 16;
        la::unitLowerInverseColumn(
            a + blk * 16 * lda + blk * 16, lda, t + blk * 16 * ldt + blk * 16, ldt, tid % 16, 16);
    }
    for (int i = tid; i < C * C; i += THREADS)
    {
        int const r = i / C, c = i % C;
        if (c / 16 > r / 16)
            t[r * ldt + c] = 0.0f;
    }
    __syncthreads();
    for (int bi = 1; bi < C / 16; ++bi)
    {
        if (warp < bi)
        {
            int const bj = warp;
            Acc x[1];
            zero(x);
            // sum over M = bj .. bi-1 of A_{bi,M} T_{M,bj}: k runs over rows 16 bj .. 16 bi of T
            rowTiles<P, C, 1, RowA, RowB>(
                x, a + bi * 16 * lda + bj * 16, lda, 8, t + bj * 16 * ldt + bj * 16, ldt, 8 * ldt, 0, (bi - bj) * 16);
            float* tij = t + bi * 16 * ldt + bj * 16;
            wm::store_matrix_sync(tij, x[0], ldt, wm::mem_row_major);
            __syncwarp();
            Acc y[1];
            zero(y);
            rowTiles<P, 16, 1, RowA, RowB>(y, t + bi * 16 * ldt + bi * 16, ldt, 8, tij, ldt, 8 * ldt, 0, 16, -1.0f);
            __syncwarp();
            wm::store_matrix_sync(tij, y[0], ldt, wm::mem_row_major);
        }
        __syncthreads();
    }
}

__device__ __forceinline__ void copy16(float* smem, float const* gmem)
{
    unsigned const s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void copyCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void copyWait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Per-key decay: the decayed products M_ij = sum_d exp(G_id - G_jd) x_id k_jd (j <= i) of the
// chunk into m (C x C, ld ldm; entries above the diagonal are left as they are). g: G by token
// [C][DK] (global). The diagonal blocks entry by entry; block I > J as the tile product of
// rows 16 I.. of x scaled by exp(G_i - G_r) with rows 16 J.. of k scaled by exp(G_r - G_j), r = 16 I
// (linear_attention.h). y [C][DK + 4] starts as k (y may be k) and holds the scaled rows: for round
// I, rows < 16 I the right factors (block I - 1 fresh, the older ones rescaled from the last round's
// r, all factors at most 1), rows 48.. the left ones; k's last block is not needed once the
// diagonal is done. The scaled rows are not exact in TF32 even for 16-bit inputs, so their six
// tile products are 3xTF32.
template <int DK>
__device__ __forceinline__ void decayedBlocks(
    float const* x, float const* k, float* y, float const* g, float* m, int ldm)
{
    constexpr int LK = DK + 4;
    int const tid = threadIdx.x, warp = tid / kWarp;
    for (int e = tid; e < C * 16; e += kThreads)
    {
        int const i = e / 16, j = i / 16 * 16 + e % 16;
        if (j <= i)
            m[i * ldm + j] = la::decayedDot(x + i * LK, k + j * LK, g + i * DK, g + j * DK, DK);
    }
    __syncthreads();
    if (y != k)
    {
        for (int e = tid; e < (C - 16) * DK; e += kThreads)
            y[e / DK * LK + e % DK] = k[e / DK * LK + e % DK];
        __syncthreads();
    }
    for (int bi = 1; bi < C / 16; ++bi)
    {
        int const r = bi * 16;
        for (int e = tid; e < (r + 16) * DK; e += kThreads)
        {
            int const j = e / DK, d = e % DK;
            float const gr = g[r * DK + d];
            if (j < r - 16)
                y[j * LK + d] *= em_exp(gr - g[(r - 16) * DK + d]);
            else if (j < r)
                y[j * LK + d] *= em_exp(gr - g[j * DK + d]);
            else
                y[(C - 16 + j - r) * LK + d] = em_exp(g[j * DK + d] - gr) * x[j * LK + d];
        }
        __syncthreads();
        if (warp < bi)
        {
            Acc acc[1];
            zero(acc);
            rowTiles<3, DK, 1, RowA, ColB>(acc, y + (C - 16) * LK, LK, 8, y + warp * 16 * LK, LK, 8, 0);
            wm::store_matrix_sync(m + r * ldm + warp * 16, acc[0], ldm, wm::mem_row_major);
        }
        __syncthreads();
    }
}

// Warp 0's part of a prepare pass: G, the inclusive scan of the chunk's per-head log decays (0 where
// gated is false), beta (1 for the non-delta rules, 0 past the n tokens) and beta exp(G) into sG, sBeta
// and sE [C], and G into g unless it is null. Lane l takes tokens l and l + 32.
static_assert(C == 2 * kWarp, "scanChunk: a lane takes two tokens of the chunk");
template <typename T>
__device__ __forceinline__ void scanChunk(la::Params const& p, LinearAttentionIO const& io, int b, int h, int t0, int n,
    bool gated, bool delta, float* sG, float* sBeta, float* sE, float* g)
{
    int const lane = threadIdx.x % kWarp;
    float g0 = gated && lane < n ? load<T>(io.decay, la::decayOffset(p, b, t0 + lane, h, 0)) : 0.0f;
    float g1 = gated && lane + kWarp < n ? load<T>(io.decay, la::decayOffset(p, b, t0 + lane + kWarp, h, 0)) : 0.0f;
    EM_UNROLL
    for (int o = 1; o < kWarp; o <<= 1)
    {
        float const x0 = __shfl_up_sync(kFullMask, g0, o);
        float const x1 = __shfl_up_sync(kFullMask, g1, o);
        if (lane >= o)
        {
            g0 += x0;
            g1 += x1;
        }
    }
    g1 += __shfl_sync(kFullMask, g0, kWarp - 1);
    sG[lane] = g0;
    sG[lane + kWarp] = g1;
    if (g != nullptr)
    {
        g[lane] = g0;
        g[lane + kWarp] = g1;
    }
    for (int i = lane; i < C; i += kWarp) // i is lane or lane + 32: sG[i] is this lane's
    {
        float const beta = i < n ? (delta ? load<T>(io.beta, la::betaOffset(p, b, t0 + i, h)) : 1.0f) : 0.0f;
        sBeta[i] = beta;
        sE[i] = beta * em_exp(sG[i]);
    }
}

#endif

template <int DK>
__host__ __device__ constexpr int prepareFloats()
{
    return lines(C * (DK + 4)) + 2 * lines(C * (C + 4)) + lines(C * (64 + 4)) + 3 * C;
}

template <typename T, int DK, int P>
__global__ void __launch_bounds__(kThreads, 2) chunkPrepare(
    la::Params const p, LinearAttentionIO const io, la::ChunkLayout const l, int const s0, int const len, float* ws)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    constexpr int LK = DK + 4, LC = C + 4, BV = 64, LV = BV + 4;
    extern __shared__ __align__(128) float sm[];
    float* sK = sm;                 // [C][LK]
    float* sA = sK + lines(C * LK); // [C][LC]
    float* sT = sA + lines(C * LC); // [C][LC]
    float* sV = sT + lines(C * LC); // [C][LV]
    float* sG = sV + lines(C * LV); // [C]
    float* sBeta = sG + C;          // [C]
    float* sE = sBeta + C;          // [C] beta exp(G)
    // per-key decay: the chunk's log decays, then decayedBlocks' scaled rows, where T and V go
    static_assert(C * LK <= lines(C * LC) + lines(C * LV), "per-key scratch");
    int const tid = threadIdx.x, warp = tid / kWarp;
    int const mi = warp / 2, half = warp % 2;
    int const c = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    int const r0 = c * C;
    int const t0 = s0 + r0;
    int const n = min(C, len - r0);
    bool const keyed = la::keyedDecay(p);
    bool const gated = la::isGated(p.rule) && !keyed; // per-head G in sG; 0 there for per-key decay
    bool const delta = la::isDelta(p.rule);
    int64_t const row0 = l.row(p, b, h, r0);
    float* gChunk = ws + l.gcum + row0 * l.gw; // per-key G [C][DK]

    for (int i = tid; i < C * DK; i += kThreads)
    {
        int const r = i / DK, d = i % DK;
        sK[r * LK + d] = r < n && d < p.dk ? load<T>(io.key, la::keyOffset(p, b, t0 + r, h, d)) : 0.0f;
    }
    if (keyed)
    {
        // per-key G: the chunk's log decays staged where T goes, then a thread per key dim scans them
        for (int i = tid; i < C * DK; i += kThreads)
        {
            int const r = i / DK, d = i % DK;
            sT[i] = r < n && d < p.dk ? load<T>(io.decay, la::decayOffset(p, b, t0 + r, h, d)) : 0.0f;
        }
        __syncthreads();
        if (tid < DK)
        {
            float acc = 0.0f;
            for (int r = 0; r < C; ++r)
            {
                acc += sT[r * DK + tid];
                gChunk[r * DK + tid] = acc;
            }
        }
    }
    if (warp == 0)
        scanChunk<T>(p, io, b, h, t0, n, gated, delta, sG, sBeta, sE, keyed ? nullptr : gChunk);
    __syncthreads();
    for (int i = tid; i < C * DK; i += kThreads)
    {
        int const r = i / DK, d = i % DK;
        float const g = keyed ? gChunk[(C - 1) * DK + d] - gChunk[r * DK + d] : sG[C - 1] - sG[r];
        float const kt = em_exp(g) * sK[r * LK + d];
        ws[l.kt + (row0 + r) * DK + d] = P == 1 ? wm::__float_to_tf32(kt) : kt;
    }
    if (delta)
    {
        if (keyed)
            decayedBlocks<DK>(sK, sK, sT, gChunk, sA, LC);
        else
        {
            Acc acc[2]; // A = K K^T: row block mi, column blocks half and half + 2
            zero(acc);
            rowTiles<P, DK, 2, RowA, ColB>(acc, sK + mi * 16 * LK, LK, 8, sK + half * 16 * LK, LK, 8, 32 * LK);
            storeTiles(sA + mi * 16 * LC + half * 16, LC, 32, acc);
            __syncthreads();
        }
        for (int i = tid; i < C * C; i += kThreads)
        {
            int const r = i / C, j = i % C;
            sA[r * LC + j] = j < r ? sBeta[r] * em_exp(sG[r] - sG[j]) * sA[r * LC + j] : 0.0f;
        }
        __syncthreads();
        unitLowerInverse<P>(sA, LC, sT, LC);
        for (int i = tid; i < C * DK; i += kThreads)
        {
            int const r = i / DK, d = i % DK;
            sK[r * LK + d] *= keyed ? sE[r] * em_exp(gChunk[r * DK + d]) : sE[r];
        }
        __syncthreads();
        constexpr int NW = DK / 32; // W = T diag(beta e^G) K: row block mi, half of the DK / 16 column blocks
        Acc w[NW];
        zero(w);
        rowTiles<P, C, NW, RowA, RowB>(w, sT + mi * 16 * LC, LC, 8, sK + half * NW * 16, LK, 8 * LK, 16, (mi + 1) * 16);
        if constexpr (P == 1) // TF32 values: the walk's one-pass operands
        {
            EM_UNROLL
            for (int j = 0; j < NW; ++j)
                round(w[j]);
        }
        storeTiles(ws + l.w + (row0 + mi * 16) * DK + half * NW * 16, DK, 16, w);
    }
    for (int v0 = 0; v0 < l.dv; v0 += BV) // U0 = T diag(beta) V; V itself for the non-delta rules
    {
        __syncthreads();
        for (int i = tid; i < C * BV; i += kThreads)
        {
            int const r = i / BV, j = i % BV;
            float const x = r < n && v0 + j < p.dv ? load<T>(io.value, la::valueOffset(p, b, t0 + r, h, v0 + j)) : 0.0f;
            if (delta)
                sV[r * LV + j] = sBeta[r] * x;
            else
                ws[l.u + (row0 + r) * l.dv + v0 + j] = x;
        }
        if (!delta)
            continue;
        __syncthreads();
        Acc u[2];
        zero(u);
        rowTiles<P, C, 2, RowA, RowB>(u, sT + mi * 16 * LC, LC, 8, sV + half * 32, LV, 8 * LV, 16, (mi + 1) * 16);
        storeTiles(ws + l.u + (row0 + mi * 16) * l.dv + v0 + half * 32, l.dv, 16, u);
    }
#endif
}

// The prepare pass on mma.sync (per-head decay): a block of 4 warps per (chunk, kv head, batch),
// warp w the rows 16 w .. of the chunk. K is staged in the I/O type; K K^T (scoreTiles) is masked
// and scaled in its accumulators, A_rj = [j < r] beta_r exp(G_r - G_j) (K K^T)_rj, before
// unitLowerInverse takes it as float32; W = (T diag(beta e^G)) K and U0 = (T diag(beta)) V take the
// scaled rows of T's row block as m16n8k8 A operands, K and V as B operands. 16-bit I/O: exact
// K K^T products, then one TF32 pass (16-bit values are TF32 ones), as chunkPrepare's; float32 I/O:
// 3xTF32 throughout. V is staged 64 columns at a time, the first 64 with K.
constexpr int kPrepMmaThreads = 4 * kWarp;
constexpr int kPrepMmaColumns = 64;

template <typename T, int DK>
__host__ __device__ constexpr int prepareMmaBytes()
{
    // A, T [C][C + 4] and G, beta, beta e^G [C] float32; K [C][DK + 8] and V [C][64 + 8] in T (rows
    // 4 words apart mod 32 for 16 bits, 8 for 32: a warp's fragment reads hit distinct banks)
    return (2 * C * (C + 4) + 3 * C) * int(sizeof(float)) + C * (DK + 8 + kPrepMmaColumns + 8) * int(sizeof(T));
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
// Two 16-bit elements as one fragment register, x the lower.
template <typename T>
__device__ __forceinline__ uint32_t word(T const* x)
{
    return *reinterpret_cast<uint32_t const*>(x);
}

// One warp's causal score tiles m[j] += X K^T for key tiles j <= jmax (8 keys each; the rest stay
// as they are): X's rows g and g + 8 of the warp at xa and xb, K's rows at keys (ld apart), both
// [.][DK] in the I/O type T, offset by 2 q. 16-bit T: m16n8k16, exact products and float32 sums.
// Float32: 3xTF32 on m16n8k8, a k step's columns 2 q and 2 q + 1 as one 8-byte pair (slots q and
// q + 4).
template <typename T, int DK, int NT>
__device__ __forceinline__ void scoreTiles(float (&m)[NT][4], T const* xa, T const* xb, T const* keys, int ld, int jmax)
{
    int const g = threadIdx.x % kWarp / 4;
    if constexpr (std::is_same<T, float>::value)
    {
        using F = Tf32<3>;
        EM_UNROLL
        for (int k = 0; k < DK / 8; ++k)
        {
            float2 const x0 = *reinterpret_cast<float2 const*>(xa + 8 * k);
            float2 const x1 = *reinterpret_cast<float2 const*>(xb + 8 * k);
            F const a[4] = {F(x0.x), F(x1.x), F(x0.y), F(x1.y)};
            EM_UNROLL
            for (int j = 0; j < NT; ++j)
            {
                if (j > jmax)
                    break;
                float2 const y = *reinterpret_cast<float2 const*>(keys + (8 * j + g) * ld + 8 * k);
                mma1688<3>(m[j], a, F(y.x), F(y.y));
            }
        }
    }
    else
    {
        EM_UNROLL
        for (int k = 0; k < DK / 16; ++k)
        {
            uint32_t const a[4] = {word(xa + 16 * k), word(xb + 16 * k), word(xa + 16 * k + 8), word(xb + 16 * k + 8)};
            EM_UNROLL
            for (int j = 0; j < NT; ++j)
            {
                if (j > jmax)
                    break;
                T const* kr = keys + (8 * j + g) * ld + 16 * k;
                mma16816<T>(m[j], a, word(kr), word(kr + 8));
            }
        }
    }
}

// The chunk's rows of a token-major tensor into shared memory, W elements a row: row r to
// dst + r * ld (ld a multiple of 16 bytes), elements from src + at(r) on; zeros past row n and past
// element `width`. With `whole` (width >= W, src 16-byte aligned, every at(r) a whole number of
// 16 bytes) the rows go as 16-byte cp.async copies, which the caller commits and waits for; else
// element by element.
template <typename T, int W, int THREADS, class At>
__device__ __forceinline__ void stageRows(T* dst, int ld, T const* src, At at, int n, int width, bool whole)
{
    constexpr int E = 16 / int(sizeof(T)); // elements a piece
    static_assert(W % E == 0, "rows of whole 16-byte pieces");
    int const tid = threadIdx.x;
    if (whole)
    {
        for (int i = tid; i < C * (W / E); i += THREADS)
        {
            int const r = i / (W / E), x = i % (W / E) * E;
            T* d = dst + r * ld + x;
            if (r < n)
                copy16(reinterpret_cast<float*>(d), reinterpret_cast<float const*>(src + at(r) + x));
            else
                *reinterpret_cast<uint4*>(d) = make_uint4(0u, 0u, 0u, 0u);
        }
        return;
    }
    T const zero = fromFloat<T>(0.0f);
    for (int i = tid; i < C * W; i += THREADS)
    {
        int const r = i / W, x = i % W;
        dst[r * ld + x] = r < n && x < width ? src[at(r) + x] : zero;
    }
}

// Whether rows that start at multiples of `stride` elements from x start on 16-byte boundaries
// (stageRows' copies).
template <typename T>
__device__ __forceinline__ bool aligned16(T const* x, int stride)
{
    return reinterpret_cast<uintptr_t>(x) % 16 == 0 && stride % (16 / int(sizeof(T))) == 0;
}

// One warp's 16 rows of T diag(s) X into out (float32, ld ldo; 16 x 8 NV columns; TF32 values
// where tf32 is set), T's rows from t (float32, ld ldt) over its first 8 ksteps columns (the rest is
// zero), X [C][ldx] in the I/O type, s [C]: the rows of T diag(s) as m16n8k8 A operands, X's rows as
// B operands. P = 1 (16-bit X, whose values are TF32 ones): one TF32 pass; P = 3: 3xTF32.
template <int NV, int P, typename T>
__device__ __forceinline__ void rowBlockProduct(
    float const* t, int ldt, int ksteps, float const* s, T const* x, int ldx, float* out, int ldo, bool tf32)
{
    using F = Tf32<P>;
    int const lane = threadIdx.x % kWarp, g = lane / 4, q = lane % 4;
    float const* ta = t + g * ldt + q;
    float const* tb = ta + 8 * ldt;
    float acc[NV][4] = {};
    EM_UNROLL
    for (int k = 0; k < C / 8; ++k)
    {
        if (k >= ksteps)
            break;
        float const s0 = s[8 * k + q], s1 = s[8 * k + q + 4];
        F const a[4] = {F(s0 * ta[8 * k]), F(s0 * tb[8 * k]), F(s1 * ta[8 * k + 4]), F(s1 * tb[8 * k + 4])};
        T const* xr = x + (8 * k + q) * ldx + g;
        EM_UNROLL
        for (int v = 0; v < NV; ++v)
            mma1688<P>(acc[v], a, F::of(toFloat(xr[8 * v])), F::of(toFloat(xr[4 * ldx + 8 * v])));
    }
    if (tf32)
        tf32Operands<1>(acc, acc);
    storeAcc(out, ldo, acc);
}
#endif

template <typename T, int DK>
__global__ void __launch_bounds__(kPrepMmaThreads, 3) chunkPrepareMma(
    la::Params const p, LinearAttentionIO const io, la::ChunkLayout const l, int const s0, int const len, float* ws)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    constexpr int P = std::is_same<T, float>::value ? 3 : 1;
    constexpr int BV = kPrepMmaColumns, LQ = DK + 8, LV = BV + 8, LC = C + 4, NT = C / 8;
    extern __shared__ __align__(128) float sm[];
    float* sA = sm;                       // [C][LC]
    float* sT = sA + C * LC;              // [C][LC]
    float* sG = sT + C * LC;              // [C]
    float* sBeta = sG + C;                // [C]
    float* sE = sBeta + C;                // [C] beta exp(G)
    T* sK = reinterpret_cast<T*>(sE + C); // [C][LQ]
    T* sV = sK + C * LQ;                  // [C][LV]
    int const tid = threadIdx.x, w = tid / kWarp, lane = tid % kWarp, g = lane / 4, q = lane % 4;
    int const c = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    int const r0 = c * C, t0 = s0 + r0, n = min(C, len - r0);
    bool const gated = la::isGated(p.rule), delta = la::isDelta(p.rule);
    int64_t const row0 = l.row(p, b, h, r0);
    T const* key = static_cast<T const*>(io.key);
    T const* value = static_cast<T const*>(io.value);
    bool const wholeV = aligned16(value, p.dv);
    auto stageV = [&](int v0)
    {
        auto at = [&](int r) { return la::valueOffset(p, b, t0 + r, h, v0); };
        stageRows<T, BV, kPrepMmaThreads>(sV, LV, value, at, n, p.dv - v0, wholeV && p.dv - v0 >= BV);
        copyCommit();
        copyWait<0>();
    };

    auto keyAt = [&](int r) { return la::keyOffset(p, b, t0 + r, h, 0); };
    stageRows<T, DK, kPrepMmaThreads>(sK, LQ, key, keyAt, n, p.dk, p.dk == DK && aligned16(key, p.dk));
    if (delta)
        stageV(0);
    else
    {
        copyCommit();
        copyWait<0>();
    }
    if (w == 0)
        scanChunk<T>(p, io, b, h, t0, n, gated, delta, sG, sBeta, sE, ws + l.gcum + row0);
    __syncthreads();
    for (int i = tid; i < C * DK / 4; i += kPrepMmaThreads) // K~ = exp(G_last - G) . K (P = 1: as TF32 values)
    {
        int const r = i / (DK / 4), d = i % (DK / 4) * 4;
        float const e = em_exp(sG[C - 1] - sG[r]);
        T const* k = sK + r * LQ + d;
        auto x = [&](int j)
        {
            float const v = e * toFloat(k[j]);
            return P == 1 ? wm::__float_to_tf32(v) : v;
        };
        *reinterpret_cast<float4*>(ws + l.kt + (row0 + r) * DK + d) = make_float4(x(0), x(1), x(2), x(3));
    }
    if (!delta)
    {
        for (int i = tid; i < C * l.dv; i += kPrepMmaThreads) // U0 = V
        {
            int const r = i / l.dv, j = i % l.dv;
            ws[l.u + (row0 + r) * l.dv + j]
                = r < n && j < p.dv ? toFloat(value[la::valueOffset(p, b, t0 + r, h, j)]) : 0.0f;
        }
        return;
    }

    int const ra = 16 * w + g, rb = ra + 8; // this lane's rows
    {
        // K K^T over the key tiles (8 columns) j <= 2 w + 1: the rest of the row block is above the diagonal
        float m[NT][4] = {};
        scoreTiles<T, DK>(m, sK + ra * LQ + 2 * q, sK + rb * LQ + 2 * q, sK + 2 * q, LQ, 2 * w + 1);
        float const ga = sG[ra], gb = sG[rb], ba = sBeta[ra], bb = sBeta[rb];
        EM_UNROLL
        for (int j = 0; j < NT; ++j)
        {
            int const col = 8 * j + 2 * q;
            float2 x, y;
            x.x = col < ra ? ba * em_exp(ga - sG[col]) * m[j][0] : 0.0f;
            x.y = col + 1 < ra ? ba * em_exp(ga - sG[col + 1]) * m[j][1] : 0.0f;
            y.x = col < rb ? bb * em_exp(gb - sG[col]) * m[j][2] : 0.0f;
            y.y = col + 1 < rb ? bb * em_exp(gb - sG[col + 1]) * m[j][3] : 0.0f;
            *reinterpret_cast<float2*>(sA + ra * LC + col) = x;
            *reinterpret_cast<float2*>(sA + rb * LC + col) = y;
        }
    }
    __syncthreads();
    unitLowerInverse<P, kPrepMmaThreads>(sA, LC, sT, LC);
    // W = T diag(beta e^G) K, then U0 = T diag(beta) V 64 columns at a time
    rowBlockProduct<DK / 8, P>(
        sT + 16 * w * LC, LC, 2 * w + 2, sE, sK, LQ, ws + l.w + (row0 + 16 * w) * DK, DK, P == 1);
    for (int v0 = 0; v0 < l.dv; v0 += BV)
    {
        if (v0 > 0)
        {
            __syncthreads(); // the last tile is consumed
            stageV(v0);
            __syncthreads();
        }
        rowBlockProduct<BV / 8, P>(
            sT + 16 * w * LC, LC, 2 * w + 2, sBeta, sV, LV, ws + l.u + (row0 + 16 * w) * l.dv + v0, l.dv, false);
    }
#endif
}

// The state walk takes 16 or 32 value columns a block: 16 where blocks of 32 would leave SMs idle.
constexpr int kWarps = kThreads / kWarp;

template <int DK, int BV>
__host__ __device__ constexpr int stageFloats()
{
    // W [C][DK + 8] (rows 8 words apart mod 32: a warp's 8-byte reads of 4 rows hit distinct banks),
    // K~ [C][DK + 4], U [C][BV + 4], G_last [DK]
    return lines(C * (DK + 8)) + lines(C * (DK + 4)) + lines(C * (BV + 4)) + DK;
}

template <int DK, int BV, int STAGES>
__host__ __device__ constexpr int stateFloats()
{
    // the state, the stages, and for BV = 16 the second halves of U's split k sums
    return lines(DK * (BV + 4)) + STAGES * stageFloats<DK, BV>() + (BV == 16 ? lines(C * (BV + 4)) : 0);
}

template <int DK, int BV, int P, int STAGES>
__global__ void __launch_bounds__(kThreads, 1) chunkState(la::Params const p, LinearAttentionIO const io,
    la::ChunkLayout const l, int const len, float const* past, float* ws)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    constexpr int LW = DK + 8, LK = DK + 4, LS = BV + 4;
    // state tiles (DK / 16) x (BV / 16), NS consecutive ones (one row block) a warp; warps past
    // the last tile hold none
    constexpr int tiles = DK / 16 * (BV / 16), NS = tiles > kWarps ? tiles / kWarps : 1;
    // U = U0 - W S: (C / 16) x (BV / 16) tiles; with fewer tiles than warps, KS warps share one
    // tile's k sum
    constexpr int utiles = C / 16 * (BV / 16), KS = kWarps / utiles;
    static_assert(NS <= BV / 16 && (KS == 1 || KS == 2), "tile split");
    extern __shared__ __align__(128) float sm[];
    float* sS = sm;                                         // [DK][LS]
    float* sStage = sS + lines(DK * LS);                    // STAGES x {W [C][LW], K~ [C][LK], U [C][LS], G_last [DK]}
    float* sPart = sStage + STAGES * stageFloats<DK, BV>(); // KS = 2: [C][LS]
    int const tid = threadIdx.x, warp = tid / kWarp;
    int const v0 = blockIdx.x * BV, h = blockIdx.y, b = blockIdx.z;
    int const chunks = (len + C - 1) / C;
    bool const delta = la::isDelta(p.rule);
    bool const keyed = la::keyedDecay(p);
    int const ri = warp * NS / (BV / 16);
    int const ci = warp * NS % (BV / 16);
    bool const holds = warp * NS < tiles;

    for (int i = tid; i < DK * BV; i += kThreads)
    {
        int const d = i / BV, j = i % BV;
        sS[d * LS + j] = d < p.dk && v0 + j < p.dv ? past[la::stateOffset(p, b, h, d, v0 + j)] : 0.0f;
    }
    __syncthreads();
    // the warp's state tiles as m16n8 accumulators: rows 16 ri .., columns 16 ci + 8 n ..
    float s[2 * NS][4];
    if (holds)
        loadAcc(s, sS + ri * 16 * LS + ci * 16, LS);

    auto fetch = [&](int c, float* st)
    {
        // rows of W and K~ (DK / 4 pieces of 16 bytes) and of U (BV / 4): a thread takes the same
        // piece of every (kThreads / pieces)-th row
        constexpr int RQ = DK / 4, UQ = BV / 4;
        static_assert(C * RQ % kThreads == 0 && C * UQ % kThreads == 0, "whole rounds");
        int64_t const row0 = l.row(p, b, h, c * C);
        int const x = tid % RQ * 4, y = tid % UQ * 4;
        float const* w = ws + l.w + row0 * DK + x;
        float const* kt = ws + l.kt + row0 * DK + x;
        float const* u = ws + l.u + row0 * l.dv + v0 + y;
        float* su = st + lines(C * LW) + lines(C * LK);
        EM_UNROLL
        for (int k = 0; k < C * RQ / kThreads; ++k)
        {
            int const r = tid / RQ + k * (kThreads / RQ);
            if (delta)
                copy16(st + r * LW + x, w + r * DK);
            copy16(st + lines(C * LW) + r * LK + x, kt + r * DK);
        }
        EM_UNROLL
        for (int k = 0; k < C * UQ / kThreads; ++k)
        {
            int const r = tid / UQ + k * (kThreads / UQ);
            copy16(su + r * LS + y, u + int64_t(r) * l.dv);
        }
        if (keyed && tid < DK / 4)
            copy16(su + lines(C * LS) + 4 * tid, ws + l.gcum + (row0 + C - 1) * DK + 4 * tid);
        else if (!keyed && tid == 0)
            copy16(su + lines(C * LS), ws + l.gcum + row0 + C - 4);
        copyCommit();
    };

    if constexpr (STAGES == 2)
        fetch(0, sStage);
    for (int c = 0; c < chunks; ++c)
    {
        float* st = sStage + (STAGES == 2 ? (c & 1) * stageFloats<DK, BV>() : 0);
        __syncthreads(); // the buffer the next fetch fills and sS are free
        if constexpr (STAGES == 2)
        {
            if (c + 1 < chunks)
            {
                fetch(c + 1, sStage + ((c + 1) & 1) * stageFloats<DK, BV>());
                copyWait<1>();
            }
            else
                copyWait<0>();
        }
        else
        {
            fetch(c, st);
            copyWait<0>();
        }
        if (holds)
        {
            // S as the products read it (TF32 values for P = 1): W S here, Q S in the output pass
            float x[2 * NS][4];
            tf32Operands<P>(x, s);
            storeAcc(sS + ri * 16 * LS + ci * 16, LS, x);
            storeAcc(ws + l.stateAt(p, b, h, c) + ri * 16 * l.dv + v0 + ci * 16, l.dv, x);
        }
        __syncthreads();
        float const* sW = st;
        float const* sKt = st + lines(C * LW);
        float* sU = st + lines(C * LW) + lines(C * LK);
        if (delta)
        {
            // U = -(-U0 + W S): tile (mi, ni), k part kp of KS (the sign on the accumulators, not
            // on every operand)
            int const ut = warp % utiles, kp = warp / utiles;
            int const mi = ut / (BV / 16), ni = ut % (BV / 16);
            constexpr int KK = DK / KS;
            float u[2][4] = {};
            if (kp == 0)
            {
                loadAcc(u, sU + mi * 16 * LS + ni * 16, LS);
                negate(u);
            }
            warpProduct<P, KK, 2, 1>(u, sW + mi * 16 * LW + kp * KK, LW, sS + kp * KK * LS + ni * 16, LS);
            if constexpr (KS == 2)
            {
                if (kp == 1)
                    storeAcc(sPart + mi * 16 * LS + ni * 16, LS, u);
                __syncthreads();
                if (kp == 0)
                {
                    float v[2][4];
                    loadAcc(v, sPart + mi * 16 * LS + ni * 16, LS);
                    EM_UNROLL
                    for (int n = 0; n < 2; ++n)
                        EM_UNROLL
                    for (int i = 0; i < 4; ++i)
                        u[n][i] += v[n][i];
                }
            }
            if (kp == 0)
            {
                negate(u);
                float x[2][4];
                tf32Operands<P>(x, u);
                storeAcc(sU + mi * 16 * LS + ni * 16, LS, x);
                storeAcc(ws + l.u + (l.row(p, b, h, c * C) + mi * 16) * l.dv + v0 + ni * 16, l.dv, x);
            }
            __syncthreads();
        }
        if (holds)
        {
            // S <- diag(exp(G_last)) S + K~^T U; G_last: [DK] per key, at [3] per head; this lane's
            // rows of S are 16 ri + g and + 8
            float const* last = sU + lines(C * LS);
            int const g = threadIdx.x % kWarp / 4;
            float const e0 = em_exp(keyed ? last[ri * 16 + g] : last[3]);
            float const e1 = keyed ? em_exp(last[ri * 16 + g + 8]) : e0;
            EM_UNROLL
            for (int n = 0; n < 2 * NS; ++n)
            {
                s[n][0] *= e0;
                s[n][1] *= e0;
                s[n][2] *= e1;
                s[n][3] *= e1;
            }
            warpProduct<P, C, 2 * NS, LK>(s, sKt + ri * 16, 1, sU + ci * 16, LS);
        }
    }
    __syncthreads();
    if (holds)
        storeAcc(sS + ri * 16 * LS + ci * 16, LS, s);
    __syncthreads();
    for (int i = tid; i < DK * BV; i += kThreads)
    {
        int const d = i / BV, j = i % BV;
        if (d < p.dk && v0 + j < p.dv)
            io.present_state[la::stateOffset(p, b, h, d, v0 + j)] = sS[d * LS + j];
    }
#endif
}

template <int DK, int BV>
__host__ __device__ constexpr int outputFloats()
{
    return lines(C * (DK + 4)) + lines(C * (DK + 4) > DK * (BV + 4) ? C * (DK + 4) : DK * (BV + 4)) + lines(C * (C + 4))
        + lines(C * (BV + 4)) + 2 * C;
}

template <typename T, int DK, int P, int BV>
__global__ void __launch_bounds__(kThreads, 2) chunkOutput(la::Params const p, LinearAttentionIO const io,
    la::ChunkLayout const l, int const s0, int const len, float const* ws)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    constexpr int LK = DK + 4, LC = C + 4, LV = BV + 4, NO = BV / 32;
    extern __shared__ __align__(128) float sm[];
    float* sQ = sm;                                               // [C][LK]
    float* sKS = sQ + lines(C * LK);                              // K [C][LK], then S [DK][LV]
    float* sA = sKS + lines(C * LK > DK * LV ? C * LK : DK * LV); // [C][LC]
    float* sU = sA + lines(C * LC);                               // [C][LV], then the output
    float* sG = sU + lines(C * LV);                               // [C]
    float* sE = sG + C;                                           // [C] exp(G)
    int const tid = threadIdx.x, warp = tid / kWarp;
    int const mi = warp / 2, half = warp % 2;
    int const c = blockIdx.x, hq = blockIdx.y;
    int const tiles = l.dv / BV;
    int const b = blockIdx.z / tiles, v0 = blockIdx.z % tiles * BV;
    int const h = hq / (p.q_heads / p.kv_heads);
    int const r0 = c * C;
    int const t0 = s0 + r0;
    int const n = min(C, len - r0);
    int64_t const row0 = l.row(p, b, h, r0);
    bool const keyed = la::keyedDecay(p);
    float const* gChunk = ws + l.gcum + row0 * l.gw; // per-key G [C][DK]

    for (int i = tid; i < C * DK; i += kThreads)
    {
        int const r = i / DK, d = i % DK;
        bool const in = r < n && d < p.dk;
        sQ[r * LK + d] = in ? load<T>(io.query, la::queryOffset(p, b, t0 + r, hq, d)) : 0.0f;
        sKS[r * LK + d] = in ? load<T>(io.key, la::keyOffset(p, b, t0 + r, h, d)) : 0.0f;
    }
    for (int i = tid; i < C; i += kThreads)
    {
        float const g = keyed ? 0.0f : gChunk[i];
        sG[i] = g;
        sE[i] = em_exp(g);
    }
    __syncthreads();
    if (keyed)
        decayedBlocks<DK>(sQ, sKS, sKS, gChunk, sA, LC);
    else
    {
        Acc acc[2]; // Q K^T: row block mi, column blocks half and half + 2
        zero(acc);
        rowTiles<P, DK, 2, RowA, ColB>(acc, sQ + mi * 16 * LK, LK, 8, sKS + half * 16 * LK, LK, 8, 32 * LK);
        storeTiles(sA + mi * 16 * LC + half * 16, LC, 32, acc);
        __syncthreads();
    }
    for (int i = tid; i < C * C; i += kThreads)
    {
        int const r = i / C, j = i % C;
        sA[r * LC + j] = j <= r ? em_exp(sG[r] - sG[j]) * sA[r * LC + j] : 0.0f;
    }
    for (int i = tid; i < C * DK; i += kThreads)
    {
        int const r = i / DK, d = i % DK;
        sQ[r * LK + d] *= keyed ? em_exp(gChunk[r * DK + d]) : sE[r];
    }
    float const* gS = ws + l.stateAt(p, b, h, c);
    for (int i = tid; i < DK * BV; i += kThreads)
    {
        int const d = i / BV, j = i % BV;
        sKS[d * LV + j] = gS[d * l.dv + v0 + j];
    }
    for (int i = tid; i < C * BV; i += kThreads)
    {
        int const r = i / BV, j = i % BV;
        sU[r * LV + j] = ws[l.u + (row0 + r) * l.dv + v0 + j];
    }
    __syncthreads();
    Acc o[NO]; // row block mi, the column blocks of half `half`
    zero(o);
    rowTiles<P, DK, NO, RowA, RowB>(o, sQ + mi * 16 * LK, LK, 8, sKS + half * BV / 2, LV, 8 * LV, 16);
    rowTiles<P, C, NO, RowA, RowB>(o, sA + mi * 16 * LC, LC, 8, sU + half * BV / 2, LV, 8 * LV, 16, (mi + 1) * 16);
    __syncthreads();
    EM_UNROLL
    for (int f = 0; f < NO; ++f)
        EM_UNROLL
    for (int i = 0; i < o[f].num_elements; ++i)
        o[f].x[i] *= p.scale;
    storeTiles(sU + mi * 16 * LV + half * BV / 2, LV, 16, o);
    __syncthreads();
    for (int i = tid; i < C * BV; i += kThreads)
    {
        int const r = i / BV, j = i % BV;
        if (r < n && v0 + j < p.dv)
            store<T>(io.output, la::outputOffset(p, b, t0 + r, hq, v0 + j), sU[r * LV + j]);
    }
#endif
}

// The output pass on mma.sync (per-head decay): a block of 4 warps per (chunk, query head, batch x
// 64 value columns), warp w the 16 query rows 16 w .. of the chunk. Q K^T stays in accumulators,
// is masked and decayed there, M_rj = [j <= r] exp(G_r - G_j) (Q K^T)_rj, and feeds M U as m16n8k8
// A operands (core/mma.cuh); (Q e^G) S is taken as diag(e^G) (Q S). Q and K are staged in the I/O
// type, S and U as float32; one barrier. Key tiles above a warp's rows are skipped (M is lower
// triangular). 16-bit I/O: Q K^T on m16n8k16 (exact products, float32 sums); Q's values are TF32
// ones and S and U come from the walk as TF32 values, so M is all it rounds. Float32 I/O: every
// product in 3xTF32 on m16n8k8, Q's and K's k steps read as 8-byte pairs.
constexpr int kOutMmaColumns = 64;

template <typename T, int DK>
__host__ __device__ constexpr int outputMmaBytes()
{
    // Q, K [C][DK + 8] in the I/O type (rows 4 words apart mod 32 for 16 bits, 8 for 32: a warp's
    // fragment reads hit distinct banks), S [DK][64 + 4], U [C][64 + 4] float32 (rows 2 q and 2 q + 1
    // of a k step on distinct banks), G [C]
    return 2 * C * (DK + 8) * int(sizeof(T))
        + (DK * (kOutMmaColumns + 4) + C * (kOutMmaColumns + 4) + C) * int(sizeof(float));
}

template <typename T, int DK>
__global__ void __launch_bounds__(4 * kWarp) chunkOutputMma(la::Params const p, LinearAttentionIO const io,
    la::ChunkLayout const l, int const s0, int const len, float const* ws)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    constexpr bool wide = std::is_same<T, float>::value;
    constexpr int P = wide ? 3 : 1, BV = kOutMmaColumns, LQ = DK + 8, LS = BV + 4, LU = BV + 4;
    constexpr int NT = C / 8, NV = BV / 8;
    extern __shared__ __align__(128) float sm[];
    float* sS = sm;                       // [DK][LS]
    float* sU = sS + DK * LS;             // [C][LU]
    float* sG = sU + C * LU;              // [C]
    T* sQ = reinterpret_cast<T*>(sG + C); // [C][LQ]
    T* sK = sQ + C * LQ;                  // [C][LQ]
    int const tid = threadIdx.x, w = tid / kWarp, lane = tid % kWarp, g = lane / 4, q = lane % 4;
    int const c = blockIdx.x, hq = blockIdx.y;
    int const tiles = l.dv / BV;
    int const b = blockIdx.z / tiles, v0 = blockIdx.z % tiles * BV;
    int const h = hq / (p.q_heads / p.kv_heads);
    int const r0 = c * C, t0 = s0 + r0, n = min(C, len - r0);
    int64_t const row0 = l.row(p, b, h, r0);

    float const* gS = ws + l.stateAt(p, b, h, c);
    for (int i = tid; i < DK * BV / 4; i += 4 * kWarp)
    {
        int const d = i / (BV / 4), x = i % (BV / 4) * 4;
        copy16(sS + d * LS + x, gS + d * l.dv + v0 + x);
    }
    for (int i = tid; i < C * BV / 4; i += 4 * kWarp)
    {
        int const r = i / (BV / 4), x = i % (BV / 4) * 4;
        copy16(sU + r * LU + x, ws + l.u + (row0 + r) * l.dv + v0 + x);
    }
    T const* query = static_cast<T const*>(io.query);
    T const* key = static_cast<T const*>(io.key);
    bool const whole = p.dk == DK && aligned16(query, p.dk) && aligned16(key, p.dk);
    auto queryAt = [&](int r) { return la::queryOffset(p, b, t0 + r, hq, 0); };
    auto keyAt = [&](int r) { return la::keyOffset(p, b, t0 + r, h, 0); };
    stageRows<T, DK, 4 * kWarp>(sQ, LQ, query, queryAt, n, p.dk, whole);
    stageRows<T, DK, 4 * kWarp>(sK, LQ, key, keyAt, n, p.dk, whole);
    copyCommit();
    for (int i = tid; i < C; i += 4 * kWarp)
        sG[i] = ws[l.gcum + row0 + i];
    copyWait<0>();
    __syncthreads();

    using F = Tf32<P>;
    int const ra = 16 * w + g, rb = ra + 8; // this lane's rows
    T const* qa = sQ + ra * LQ + 2 * q;
    T const* qb = sQ + rb * LQ + 2 * q;
    auto pair = [](T const* x) // elements 2 q and 2 q + 1 of a k step
    {
        if constexpr (wide)
            return *reinterpret_cast<float2 const*>(x);
        else
            return make_float2(toFloat(x[0]), toFloat(x[1]));
    };
    // m[j]: (Q K^T) rows ra, rb, keys 8 j + 2 q, + 1; tiles past the warp's last row stay zero
    float m[NT][4] = {};
    scoreTiles<T, DK>(m, qa, qb, sK + 2 * q, LQ, 2 * w + 1);
    float const ga = sG[ra], gb = sG[rb];
    EM_UNROLL
    for (int j = 0; j < NT; ++j)
        EM_UNROLL
    for (int i = 0; i < 4; ++i)
    {
        int const r = i < 2 ? ra : rb, col = 8 * j + 2 * q + i % 2;
        m[j][i] = col <= r ? em_exp((i < 2 ? ga : gb) - sG[col]) * m[j][i] : 0.0f;
    }
    // Q S: a k step's columns 2 q, 2 q + 1 of Q as one pair (slots q and q + 4)
    float o[NV][4] = {};
    EM_UNROLL
    for (int k = 0; k < DK / 8; ++k)
    {
        float2 const xa = pair(qa + 8 * k), xb = pair(qb + 8 * k);
        F const a[4] = {F::of(xa.x), F::of(xb.x), F::of(xa.y), F::of(xb.y)};
        float const* sr = sS + (8 * k + 2 * q) * LS + g;
        EM_UNROLL
        for (int v = 0; v < NV; ++v)
            mma1688<P>(o[v], a, F::of(sr[8 * v]), F::of(sr[LS + 8 * v]));
    }
    float const ea = em_exp(ga), eb = em_exp(gb);
    EM_UNROLL
    for (int v = 0; v < NV; ++v)
    {
        o[v][0] *= ea;
        o[v][1] *= ea;
        o[v][2] *= eb;
        o[v][3] *= eb;
    }
    EM_UNROLL
    for (int j = 0; j < NT; ++j)
    {
        if (j > 2 * w + 1)
            break;
        F const a[4] = {F(m[j][0]), F(m[j][2]), F(m[j][1]), F(m[j][3])};
        float const* ur = sU + (8 * j + 2 * q) * LU + g;
        EM_UNROLL
        for (int v = 0; v < NV; ++v)
            mma1688<P>(o[v], a, F::of(ur[8 * v]), F::of(ur[LU + 8 * v]));
    }
    EM_UNROLL
    for (int v = 0; v < NV; ++v)
        EM_UNROLL
    for (int i = 0; i < 4; ++i)
    {
        int const r = i < 2 ? ra : rb, col = v0 + 8 * v + 2 * q + i % 2;
        if (r < n && col < p.dv)
            store<T>(io.output, la::outputOffset(p, b, t0 + r, hq, col), p.scale * o[v][i]);
    }
#endif
}

// Opt-in shared memory per block and SMs of the current device, and whether it runs the chunked form.
struct Device
{
    int smem = 0;
    int sms = 0;
    bool tensorCores = false;
};

Device currentDevice()
{
    Device d;
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess
        || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess
        || cudaDeviceGetAttribute(&d.smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess
        || cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess)
        return Device{};
    d.tensorCores = major >= 8;
    return d;
}

template <class K>
bool allow(K kernel, size_t bytes)
{
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)) == cudaSuccess;
}

template <typename T, int DK>
int runChunked(la::Params const& p, LinearAttentionIO const& io, la::ChunkLayout const& l, float* ws, Device const& dev,
    cudaStream_t stream)
{
    constexpr int P = std::is_same<T, float>::value ? 3 : 1;
    constexpr size_t prep = prepareFloats<DK>() * sizeof(float);
    int64_t const heads = int64_t(p.kv_heads) * p.batch;
    // chunkState: 32 value columns a block unless that leaves SMs idle
    bool const narrow = int64_t(l.dv / 32) * heads < dev.sms;
    int const bv = narrow ? 16 : 32;
    auto stateBytes = [&](int stages)
    {
        return size_t(narrow ? (stages == 2 ? stateFloats<DK, 16, 2>() : stateFloats<DK, 16, 1>())
                             : (stages == 2 ? stateFloats<DK, 32, 2>() : stateFloats<DK, 32, 1>()))
            * sizeof(float);
    };
    bool const two = stateBytes(2) <= size_t(dev.smem);
    size_t const state = stateBytes(two ? 2 : 1);
    bool const wide = outputFloats<DK, 64>() * sizeof(float) <= size_t(dev.smem);
    int const ov = wide ? 64 : 32;
    size_t const out = (wide ? outputFloats<DK, 64>() : outputFloats<DK, 32>()) * sizeof(float);
    auto prepare = chunkPrepare<T, DK, P>;
    auto walk = narrow ? (two ? chunkState<DK, 16, P, 2> : chunkState<DK, 16, P, 1>)
                       : (two ? chunkState<DK, 32, P, 2> : chunkState<DK, 32, P, 1>);
    auto output = wide ? chunkOutput<T, DK, P, 64> : chunkOutput<T, DK, P, 32>;
    // chunkOutputMma: per-head decay, where its shared memory fits
    constexpr size_t outMmaBytes = outputMmaBytes<T, DK>();
    bool const mmaOut = !la::keyedDecay(p) && outMmaBytes <= size_t(dev.smem);
    auto outputMma = chunkOutputMma<T, DK>;
    // chunkPrepareMma on the same terms
    constexpr size_t prepMmaBytes = prepareMmaBytes<T, DK>();
    bool const mmaPrep = !la::keyedDecay(p) && prepMmaBytes <= size_t(dev.smem);
    auto prepareMma = chunkPrepareMma<T, DK>;
    if (prep > size_t(dev.smem) || state > size_t(dev.smem) || out > size_t(dev.smem))
        return kUnsupported;
    if (!(mmaPrep ? allow(prepareMma, prepMmaBytes) : allow(prepare, prep)) || !allow(walk, state)
        || !(mmaOut ? allow(outputMma, outMmaBytes) : allow(output, out)))
        return kCudaError;
    for (int s0 = 0; s0 < p.seq; s0 += l.tokens)
    {
        int const len = p.seq - s0 < l.tokens ? p.seq - s0 : l.tokens;
        unsigned const chunks = unsigned((len + C - 1) / C);
        float const* past = s0 == 0 ? io.past_state : io.present_state;
        dim3 const perChunk(chunks, unsigned(p.kv_heads), unsigned(p.batch));
        if (mmaPrep)
            prepareMma<<<perChunk, kPrepMmaThreads, prepMmaBytes, stream>>>(p, io, l, s0, len, ws);
        else
            prepare<<<perChunk, kThreads, prep, stream>>>(p, io, l, s0, len, ws);
        walk<<<dim3(unsigned(l.dv / bv), unsigned(p.kv_heads), unsigned(p.batch)), kThreads, state, stream>>>(
            p, io, l, len, past, ws);
        if (mmaOut)
            outputMma<<<dim3(chunks, unsigned(p.q_heads), unsigned(p.batch) * unsigned(l.dv / kOutMmaColumns)),
                4 * kWarp, outMmaBytes, stream>>>(p, io, l, s0, len, ws);
        else
            output<<<dim3(chunks, unsigned(p.q_heads), unsigned(p.batch) * unsigned(l.dv / ov)), kThreads, out,
                stream>>>(p, io, l, s0, len, ws);
        if (int const st = launchStatus())
            return st;
    }
    return kOk;
}

template <typename T>
int dispatchChunked(la::Params const& p, LinearAttentionIO const& io, la::ChunkLayout const& l, float* ws,
    Device const& dev, cudaStream_t stream)
{
    switch (l.dk)
    {
    case 32: return runChunked<T, 32>(p, io, l, ws, dev, stream);
    case 64: return runChunked<T, 64>(p, io, l, ws, dev, stream);
    case 128: return runChunked<T, 128>(p, io, l, ws, dev, stream);
    }
    return kUnsupported;
}

} // namespace

size_t linearAttentionWorkspace(la::Params const& p, LaPath path)
{
    if (la::check(p) != kOk || !la::chunkable(p) || p.batch == 0 || p.seq == 0 || path == LaPath::kSequential
        || (path == LaPath::kAuto && !chunkedPays(p)))
        return 0;
    return size_t(la::chunkLayout(p).floats) * sizeof(float);
}

int linearAttentionChunked(la::Params const& p, LinearAttentionIO const& io, DType dtype, void* workspace,
    size_t workspace_bytes, cudaStream_t stream)
{
    if (!la::chunkable(p) || workspace == nullptr || reinterpret_cast<uintptr_t>(workspace) % 256 != 0)
        return kUnsupported;
    if (p.batch > 65535 || p.kv_heads > 65535 || p.q_heads > 65535)
        return kUnsupported;
    la::ChunkLayout const l = la::chunkLayout(p, int64_t(workspace_bytes));
    Device const dev = currentDevice();
    if (l.tokens == 0 || !dev.tensorCores)
        return kUnsupported;
    float* ws = static_cast<float*>(workspace);
    return withType(dtype, [&](auto t) { return dispatchChunked<decltype(t)>(p, io, l, ws, dev, stream); });
}

} // namespace cuda
} // namespace edgemem
