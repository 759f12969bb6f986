// NeuralMemory prefill in the chunked form of neural_memory.h on tensor cores (core/mma.cuh: 3xTF32
// products for every I/O type: the gradient steps compound one TF32 pass's rounding beyond float16's
// tolerance). A block per (batch, head), 256 threads, walks the call's
// pieces (up to 16 tokens sharing the chunk weights) in order; per piece, in phases separated by
// __syncthreads():
//   load      q, k, v rows (zero past the piece's n tokens), the gates, the coefficients
//             (pieceRows on one thread, pieceColumn a thread per column)
//   key path  h = k C1, a = act(h), z = a C2 (depth 1: z = k C1): [16 x K] products, B read from
//             the state in global memory
//   dl/dz     a warp per row (neural_memory.h), zero past n; depth 2: dh = (dz C2^T) * act'(h)
//   reads     per layer: scores = (x x_k^T) * K theta, y = (A x) W + (c x) S - scores d
//   read-out  a warp per row: y = z or q + gamma LN(z) + beta
//   update    a warp per 16 x 16 state tile: C <- W where the piece starts a chunk, then
//             W <- A_n W + c_n S - x_k^T (wt d), S <- P_n S - x_k^T (st d)
// Each state tile is read and written by one warp in the update, after every other read of the
// piece, so the state may be updated in place (present == past).
#include "device.cuh"
#include "launch.h"
#include "mma.cuh"

namespace edgemem
{
namespace cuda
{
namespace
{

constexpr int P = 3; // 3xTF32 (core/mma.cuh)
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kWarp;
constexpr int R = nm::kPieceRows;
constexpr int LS = R + 4;                     // row stride of the [16][16] score and coefficient tiles
constexpr int kPerLane = kMaxHeadDim / kWarp; // a row of D <= 256 over one warp

// Shared memory: row strides and float offsets of the block's arrays.
struct Smem
{
    int ldd, lde, ldm; // D + 4, E + 4, max(D, E) + 4
    int q, k, v, z, y, h, a, x, xa, xc, s, kt, coef, floats;
};

__host__ __device__ inline Smem smemLayout(int d, int e)
{
    Smem m{};
    m.ldd = d + 4;
    m.lde = e + 4;
    m.ldm = (d > e ? d : e) + 4;
    int at = 0;
    auto take = [&at](int floats) { return at += lines(floats), at - lines(floats); };
    m.q = take(R * m.ldd);
    m.k = take(R * m.ldd);
    m.v = take(R * m.ldd);
    m.z = take(R * m.ldd);
    m.y = take(R * m.ldd);
    m.h = take(R * m.lde);
    m.a = take(R * m.lde);
    m.x = take(R * m.lde);
    m.xa = take(R * m.ldm);
    m.xc = take(R * m.ldm);
    m.s = take(R * LS);
    m.kt = take(R * LS);
    m.coef = take(7 * R + 1); // a, c, wt, st, eta, alpha, theta, P
    m.floats = at;
    return m;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800

// out[16 x cols] = x[16 x k] . m, a warp per 16-column tile; x in shared memory (row stride ldx), m
// [k x cols] row-major (Transposed: m^T, m being [cols x k] row-major).
template <int KMAX, bool Transposed>
__device__ __forceinline__ void product(float* out, int ldo, float const* x, int ldx, float const* m, int k, int cols)
{
    int const warp = threadIdx.x / kWarp;
    for (int j = warp; j < cols / 16; j += kWarps)
    {
        Acc acc[1];
        zero(acc);
        if constexpr (Transposed)
            rowTiles<P, KMAX, 1, RowA, ColB>(acc, x, ldx, 8, m + j * 16 * k, k, 8, 0, k);
        else
            rowTiles<P, KMAX, 1, RowA, RowB>(acc, x, ldx, 8, m + j * 16, cols, 8 * cols, 0, k);
        wm::store_matrix_sync(out + j * 16, acc[0], ldo, wm::mem_row_major);
    }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) neuralMemoryChunkKernel(nm::Params const p, NeuralMemoryIO const io)
{
    extern __shared__ __align__(128) float sm[];
    int const D = p.d, E = p.e;
    Smem const L = smemLayout(D, E);
    float* sQ = sm + L.q;
    float* sK = sm + L.k;
    float* sV = sm + L.v;
    float* sZ = sm + L.z; // z of the keys, then dl/dz
    float* sY = sm + L.y; // the last layer's read
    float* sH = sm + L.h; // h = k C1, then dh
    float* sA = sm + L.a; // act(h)
    float* sX = sm + L.x; // the first layer's read, then its activation
    float* sXa = sm + L.xa;
    float* sXc = sm + L.xc;
    float* sS = sm + L.s;
    float* sKt = sm + L.kt;
    float* cA = sm + L.coef;
    float* cC = cA + R;
    float* cWt = cC + R;
    float* cSt = cWt + R;
    float* gEta = cSt + R;
    float* gAlpha = gEta + R;
    float* gTheta = gAlpha + R;
    float* cLast = gTheta + R;

    int const tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp;
    int const b = blockIdx.x / p.heads, h = blockIdx.x % p.heads;
    bool const norm = p.residual_norm != 0;
    bool const deep = p.depth == 2;
    int64_t const off = (int64_t(b) * p.heads + h) * int64_t(D) * E;
    MemoryLayer const lay1 = memoryLayer(p, io, 0, off), lay2 = memoryLayer(p, io, 1, off);
    int64_t const p0 = io.position[p.position_per_batch ? b : 0];
    WarpSum const allsum;
    float gam[kPerLane], bet[kPerLane], msk[kPerLane]; // this lane's entries of the residual norm
    EM_UNROLL
    for (int j = 0; j < kPerLane; ++j)
    {
        int const i = lane + j * kWarp;
        gam[j] = i < D && norm ? io.norm_weight[int64_t(h) * D + i] : 1.0f;
        bet[j] = i < D && norm ? io.norm_bias[int64_t(h) * D + i] : 0.0f;
        msk[j] = i < D ? 1.0f : 0.0f;
    }

    for (int t0 = 0; t0 < p.seq;)
    {
        int const n = nm::pieceLength(p0 + t0, p.chunk, p.seq - t0);
        bool const first = t0 == 0;
        bool const start = nm::chunkStart(p0 + t0, p.chunk);

        // load
        for (int i = tid; i < R * D; i += kThreads)
        {
            int const r = i / D, c = i % D;
            bool const in = r < n;
            int64_t const row = attn::rowOffset(p.seq, p.heads, D, b, t0 + (in ? r : 0), h);
            sQ[r * L.ldd + c] = in ? load<T>(io.query, row + c) : 0.0f;
            sK[r * L.ldd + c] = in ? load<T>(io.key, row + c) : 0.0f;
            sV[r * L.ldd + c] = in ? load<T>(io.value, row + c) : 0.0f;
        }
        if (tid < R)
        {
            bool const in = tid < n;
            int64_t const gate = (int64_t(b) * p.seq + t0 + (in ? tid : 0)) * p.heads + h;
            gEta[tid] = in ? load<T>(io.eta, gate) : 0.0f;
            gAlpha[tid] = in ? load<T>(io.alpha, gate) : 0.0f;
            gTheta[tid] = in ? load<T>(io.theta, gate) : 0.0f;
        }
        __syncthreads();
        if (tid == 0)
            *cLast = nm::pieceRows(gEta, gAlpha, n, cA, cC);
        if (tid < R)
            nm::pieceColumn(gEta, gAlpha, gTheta, n, tid, sKt, LS, cWt[tid], cSt[tid]);

        // key path at the chunk weights (the current weights when the piece starts a chunk)
        float const* c1 = start ? (first ? lay1.w_in : lay1.w_out) : (first ? lay1.c_in : lay1.c_out);
        float const* c2 = start ? (first ? lay2.w_in : lay2.w_out) : (first ? lay2.c_in : lay2.c_out);
        if (deep)
        {
            product<kMaxHeadDim, false>(sH, L.lde, sK, L.ldd, c1, D, E);
            __syncthreads();
            for (int i = tid; i < R * E; i += kThreads)
            {
                int const r = i / E, c = i % E;
                sA[r * L.lde + c] = nm::activate(sH[r * L.lde + c], p.activation);
            }
            __syncthreads();
            product<nm::kMaxHidden, false>(sZ, L.ldd, sA, L.lde, c2, E, D);
        }
        else
            product<kMaxHeadDim, false>(sZ, L.ldd, sK, L.ldd, c1, D, D);
        __syncthreads();

        // dl/dz, a warp per row
        for (int r = warp; r < R; r += kWarps)
        {
            float zr[kPerLane], kr[kPerLane], vr[kPerLane], dz[kPerLane];
            EM_UNROLL
            for (int j = 0; j < kPerLane; ++j)
            {
                int const i = lane + j * kWarp;
                zr[j] = i < D ? sZ[r * L.ldd + i] : 0.0f;
                kr[j] = i < D ? sK[r * L.ldd + i] : 0.0f;
                vr[j] = i < D ? sV[r * L.ldd + i] : 0.0f;
            }
            nm::outputDelta<kPerLane>(zr, kr, vr, gam, bet, msk, D, norm, allsum, dz);
            EM_UNROLL
            for (int j = 0; j < kPerLane; ++j)
                if (lane + j * kWarp < D)
                    sZ[r * L.ldd + lane + j * kWarp] = r < n ? dz[j] : 0.0f;
        }
        __syncthreads();
        if (deep) // dh = (dz C2^T) * act'(h)
        {
            product<kMaxHeadDim, true>(sXa, L.ldm, sZ, L.ldd, c2, D, E);
            __syncthreads();
            for (int i = tid; i < R * E; i += kThreads)
            {
                int const r = i / E, c = i % E;
                sH[r * L.lde + c] = sXa[r * L.ldm + c] * nm::activateGrad(sH[r * L.lde + c], p.activation);
            }
            __syncthreads();
        }

        // reads through the weights after each token, layer by layer
        for (int l = 0; l < p.depth; ++l)
        {
            int const in = l == 0 ? D : E;
            int const out = deep && l == 0 ? E : D;
            float const* x = l == 0 ? sQ : sX;
            int const ldx = l == 0 ? L.ldd : L.lde;
            float const* xk = l == 0 ? sK : sA;
            float const* delta = deep && l == 0 ? sH : sZ;
            int const ldd = deep && l == 0 ? L.lde : L.ldd;
            float* dest = deep && l == 0 ? sX : sY;
            int const ldo = deep && l == 0 ? L.lde : L.ldd;
            MemoryLayer const g = l == 0 ? lay1 : lay2;
            float const* w = first ? g.w_in : g.w_out;
            float const* s = first ? g.s_in : g.s_out;
            for (int i = tid; i < R * in; i += kThreads)
            {
                int const r = i / in, c = i % in;
                sXa[r * L.ldm + c] = cA[r] * x[r * ldx + c];
                sXc[r * L.ldm + c] = cC[r] * x[r * ldx + c];
            }
            if (warp == 0)
            {
                Acc acc[1];
                zero(acc);
                rowTiles<P, nm::kMaxHidden, 1, RowA, ColB>(acc, x, ldx, 8, xk, ldx, 8, 0, in);
                wm::store_matrix_sync(sS, acc[0], LS, wm::mem_row_major);
                __syncwarp();
                for (int i = lane; i < R * R; i += kWarp)
                    sS[(i / R) * LS + i % R] *= sKt[(i / R) * LS + i % R];
            }
            __syncthreads();
            for (int j = warp; j < out / 16; j += kWarps)
            {
                Acc acc[1];
                zero(acc);
                rowTiles<P, nm::kMaxHidden, 1, RowA, RowB>(acc, sXa, L.ldm, 8, w + j * 16, out, 8 * out, 0, in);
                rowTiles<P, nm::kMaxHidden, 1, RowA, RowB>(acc, sXc, L.ldm, 8, s + j * 16, out, 8 * out, 0, in);
                rowTiles<P, R, 1, RowA, RowB>(acc, sS, LS, 8, delta + j * 16, ldd, 8 * ldd, 0, R, -1.0f);
                wm::store_matrix_sync(dest + j * 16, acc[0], ldo, wm::mem_row_major);
            }
            __syncthreads();
            if (deep && l == 0)
            {
                for (int i = tid; i < R * E; i += kThreads)
                {
                    int const r = i / E, c = i % E;
                    sX[r * L.lde + c] = nm::activate(sX[r * L.lde + c], p.activation);
                }
                __syncthreads();
            }
        }

        // read-out, a warp per row
        for (int r = warp; r < n; r += kWarps)
        {
            float zr[kPerLane], xr[kPerLane], y[kPerLane];
            EM_UNROLL
            for (int j = 0; j < kPerLane; ++j)
            {
                int const i = lane + j * kWarp;
                zr[j] = i < D ? sY[r * L.ldd + i] : 0.0f;
                xr[j] = i < D ? sQ[r * L.ldd + i] : 0.0f;
            }
            nm::readOut<kPerLane>(zr, xr, gam, bet, msk, D, norm, allsum, y);
            int64_t const row = attn::rowOffset(p.seq, p.heads, D, b, t0 + r, h);
            EM_UNROLL
            for (int j = 0; j < kPerLane; ++j)
                if (lane + j * kWarp < D)
                    store<T>(io.output, row + lane + j * kWarp, y[j]);
        }

        // the state after the piece, a warp per 16 x 16 tile
        float const aN = cA[n - 1], cN = cC[n - 1], pN = *cLast;
        for (int l = 0; l < p.depth; ++l)
        {
            int const in = l == 0 ? D : E;
            int const out = deep && l == 0 ? E : D;
            float const* xk = l == 0 ? sK : sA;
            int const ldk = l == 0 ? L.ldd : L.lde;
            float const* delta = deep && l == 0 ? sH : sZ;
            int const ldd = deep && l == 0 ? L.lde : L.ldd;
            MemoryLayer const g = l == 0 ? lay1 : lay2;
            for (int i = tid; i < R * out; i += kThreads)
            {
                int const r = i / out, c = i % out;
                sXa[r * L.ldm + c] = cWt[r] * delta[r * ldd + c];
                sXc[r * L.ldm + c] = cSt[r] * delta[r * ldd + c];
            }
            __syncthreads();
            int const cols = out / 16;
            for (int tile = warp; tile < (in / 16) * cols; tile += kWarps)
            {
                int64_t const at = int64_t(tile / cols) * 16 * out + (tile % cols) * 16;
                int const m0 = (tile / cols) * 16, o0 = (tile % cols) * 16;
                Acc w[1], s[1];
                wm::load_matrix_sync(w[0], (first ? g.w_in : g.w_out) + at, out, wm::mem_row_major);
                wm::load_matrix_sync(s[0], (first ? g.s_in : g.s_out) + at, out, wm::mem_row_major);
                if (start)
                    wm::store_matrix_sync(g.c_out + at, w[0], out, wm::mem_row_major);
                else if (first && g.c_out != g.c_in)
                {
                    Acc c;
                    wm::load_matrix_sync(c, g.c_in + at, out, wm::mem_row_major);
                    wm::store_matrix_sync(g.c_out + at, c, out, wm::mem_row_major);
                }
                EM_UNROLL
                for (int i = 0; i < w[0].num_elements; ++i)
                {
                    w[0].x[i] = aN * w[0].x[i] + cN * s[0].x[i];
                    s[0].x[i] *= pN;
                }
                rowTiles<P, R, 1, ColA, RowB>(w, xk + m0, ldk, 8 * ldk, sXa + o0, L.ldm, 8 * L.ldm, 0, R, -1.0f);
                rowTiles<P, R, 1, ColA, RowB>(s, xk + m0, ldk, 8 * ldk, sXc + o0, L.ldm, 8 * L.ldm, 0, R, -1.0f);
                wm::store_matrix_sync(g.w_out + at, w[0], out, wm::mem_row_major);
                wm::store_matrix_sync(g.s_out + at, s[0], out, wm::mem_row_major);
            }
            __syncthreads();
        }
        t0 += n;
    }
}

#else

template <typename T>
__global__ void neuralMemoryChunkKernel(nm::Params const, NeuralMemoryIO const)
{
}

#endif

template <typename T>
int launch(nm::Params const& p, NeuralMemoryIO const& io, cudaStream_t stream)
{
    auto kernel = neuralMemoryChunkKernel<T>;
    size_t const smem = size_t(smemLayout(p.d, p.e).floats) * sizeof(float);
    if (int const st = allowSharedMemory(kernel, smem))
        return st;
    kernel<<<unsigned(p.batch) * unsigned(p.heads), kThreads, smem, stream>>>(p, io);
    return launchStatus();
}

} // namespace

int neuralMemoryPieces(nm::Params const& p, NeuralMemoryIO const& io, DType dtype, cudaStream_t stream)
{
    for (int l = 0; l < p.depth; ++l)
        for (float const* x : {io.weights[l], io.momentum[l], io.chunk_weights[l],
                 static_cast<float const*>(io.present_weights[l]), static_cast<float const*>(io.present_momentum[l]),
                 static_cast<float const*>(io.present_chunk_weights[l])})
            if (reinterpret_cast<uintptr_t>(x) % 32 != 0) // wmma reads and writes the state tiles in place
                return kUnsupported;
    return withType(dtype, [&](auto t) { return launch<decltype(t)>(p, io, stream); });
}

} // namespace cuda
} // namespace edgemem
