// LinearAttention, sequential form: decode step (T = 1) and short prefills, one kernel (the
// chunked prefill is linear_attention_chunk.cu).
//
// Work split: a block per (batch, kv head, tile of value columns). A warp owns LC * C
// consecutive value columns of one kv head's state S [d_k, d_v], and its lanes form an
// LR x LC grid (LR * LC = 32): lane (rl, cl) holds the C columns col0 + cl * C + c at the R
// rows rl + LR * r, so a lane keeps R * C state values in registers (32 for d_k = 128). One
// state load or store instruction covers LR rows of the warp's LC * C consecutive floats:
// whole 32-byte sectors. The sums over d_k (S^T k for the delta rules, S^T q for the
// read-out) are an in-lane sum over R rows plus log2(LR) shuffles between the lanes that
// share cl. Each state element is read once at the start and written once at the end by its
// owning lane: state-in and state-out may be one buffer.
//
// Tokens run in sequence with the state in registers. The block stages the inputs of up to
// kLaStage tokens at a time in shared memory (key, exp(decay), beta, the G query heads and
// the block's value columns; one coalesced pass with many loads in flight), so the
// per-token loop waits on shared memory instead of a global-memory round trip per token.
#include "device.cuh"
#include "launch.h"

namespace edgemem
{
namespace cuda
{
namespace
{

constexpr int kLaWarps = 4;
constexpr int kLaThreads = kLaWarps * kWarp;
constexpr int kLaStage = 32;                   // tokens staged at a time, at most
constexpr int kLaStageBytes = 48 * 1024 - 256; // and at most 48 KiB of shared memory with the sources
constexpr int kLaStageFloats = kLaStageBytes / 4;
constexpr int kLaRound = 4; // staged loads a thread keeps in flight (benchmarks/README.md)
// Resident blocks per SM the register budget is sized for: 4 caps a thread at 128 registers,
// which the d_k > 64 tiles fit up to sm_90; Blackwell's code for them spills under that cap
// (ptxas counts in plugins/README.md), so 3 there (cap 168).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
constexpr int kLaMinBlocks = 3;
#else
constexpr int kLaMinBlocks = 4;
#endif

// Sum over the LR lanes of a warp that hold one column's rows (lane = rl * LC + cl).
template <int LR>
struct ColumnSum
{
    __device__ __forceinline__ float operator()(float x) const
    {
        EM_UNROLL
        for (int offset = kWarp / 2; offset >= kWarp / LR; offset >>= 1)
            x += __shfl_xor_sync(kFullMask, x, offset);
        return x;
    }
};

// One staged token's floats: key [dk] | w = exp(decay) [dk or 1] | beta [1] | query [G * dk] | value [block columns]
struct Stage
{
    int w;      // offset of w
    int beta;   // offset of beta
    int query;  // offset of the G query heads
    int value;  // offset of the block's value columns
    int stride; // floats per token
    int tokens; // tokens per pass

    __host__ __device__ Stage(la::Params const& p, int columns)
    {
        w = p.dk;
        beta = w + (p.decay_per_key ? p.dk : 1);
        query = beta + 1;
        value = query + (p.q_heads / p.kv_heads) * p.dk;
        stride = value + columns;
        int const fit = kLaStageFloats / stride;
        tokens = p.seq < kLaStage ? p.seq : kLaStage;
        tokens = tokens < fit ? tokens : fit;
        tokens = tokens > 1 ? tokens : 1;
    }
};

// Where a field of the staged record comes from: element i < limit of token t is
// data[at + t * step + i] (type T elements); past limit the field holds fill. The decay and beta
// of rules without them are limit 0, fill 1.
struct Source
{
    void const* data;
    int64_t at; // token 0
    int32_t step;
    int32_t start; // offset in the record
    int32_t limit;
    float fill;
};
constexpr int kFields = 5; // key, w, beta, query, value: the record's order
static_assert(kFields * sizeof(Source) + kLaStageBytes <= 48 * 1024, "staged tokens and sources fit 48 KiB");

__device__ __forceinline__ Source source(
    la::Params const& p, LinearAttentionIO const& io, Stage const& st, int b, int h, int block0, int field)
{
    int const group = p.q_heads / p.kv_heads;
    switch (field)
    {
    case 0:
    {
        int64_t const at = la::keyOffset(p, b, 0, h, 0);
        return {io.key, at, int32_t(la::keyOffset(p, b, 1, h, 0) - at), 0, p.dk, 0.0f};
    }
    case 1:
    {
        int64_t const at = la::decayOffset(p, b, 0, h, 0);
        int const n = la::isGated(p.rule) ? st.beta - st.w : 0;
        return {io.decay, at, int32_t(la::decayOffset(p, b, 1, h, 0) - at), st.w, n, 1.0f};
    }
    case 2:
    {
        int64_t const at = la::betaOffset(p, b, 0, h);
        int const n = la::isDelta(p.rule) ? 1 : 0;
        return {io.beta, at, int32_t(la::betaOffset(p, b, 1, h) - at), st.beta, n, 1.0f};
    }
    case 3:
    {
        int64_t const at = la::queryOffset(p, b, 0, h * group, 0);
        return {io.query, at, int32_t(la::queryOffset(p, b, 1, h * group, 0) - at), st.query, group * p.dk, 0.0f};
    }
    default:
    {
        int64_t const at = la::valueOffset(p, b, 0, h, block0);
        int const columns = st.stride - st.value;
        int const n = p.dv - block0 < columns ? p.dv - block0 : columns;
        return {io.value, at, int32_t(la::valueOffset(p, b, 1, h, block0) - at), st.value, n, 0.0f};
    }
    }
}

// Stages tokens t0 .. t0 + n - 1: element e of the pass is record offset e % stride of token
// e / stride. A thread issues the loads of kLaRound elements before it stores one, so a pass waits
// on ceil(n * stride / (threads * kLaRound)) round trips to memory (one for a decode step at
// d_k = 128 with per-head decay and up to two query heads per kv head).
template <typename T>
__device__ __forceinline__ void stageTokens(
    Source const* sources, Stage const& st, bool gated, int t0, int n, float* out)
{
    int const total = n * st.stride;
    int const tid = int(threadIdx.x);
    int const dt = kLaThreads / st.stride, df = kLaThreads % st.stride;
    int t = tid / st.stride, f = tid % st.stride; // token and record offset of the thread's next element
    for (int e0 = 0; e0 < total; e0 += kLaThreads * kLaRound)
    {
        float x[kLaRound];
        bool decayed[kLaRound];
        EM_UNROLL
        for (int u = 0; u < kLaRound; ++u)
        {
            if (e0 + u * kLaThreads >= total)
                break; // the pass ends in this round, for every thread
            int const field = (f >= st.w) + (f >= st.beta) + (f >= st.query) + (f >= st.value);
            Source const s = sources[field];
            int const i = f - s.start;
            bool const in = e0 + u * kLaThreads + tid < total && i < s.limit;
            x[u] = in ? loadInput<T>(s.data, s.at + int64_t(t0 + t) * s.step + i) : s.fill;
            decayed[u] = gated && field == 1;
            t += dt;
            f += df;
            if (f >= st.stride)
            {
                f -= st.stride;
                ++t;
            }
        }
        EM_UNROLL
        for (int u = 0; u < kLaRound; ++u)
        {
            int const e = e0 + u * kLaThreads + tid;
            if (e < total)
                out[e] = decayed[u] ? em_exp(x[u]) : x[u];
        }
    }
}

template <typename T, int R, int C, int LR>
__global__ void __launch_bounds__(kLaThreads, kLaMinBlocks)
    linearAttentionKernel(la::Params const p, LinearAttentionIO const io)
{
    extern __shared__ float staged[];
    constexpr int LC = kWarp / LR;
    constexpr int kColumns = kLaWarps * LC * C; // per block
    int const lane = threadIdx.x & (kWarp - 1);
    int const rl = lane / LC;
    int const cl = lane % LC;
    int const warp = threadIdx.x / kWarp;
    int const b = blockIdx.x / p.kv_heads;
    int const h = blockIdx.x % p.kv_heads;
    int const block0 = blockIdx.y * kColumns;
    int const col0 = block0 + warp * LC * C + cl * C;
    bool const active = block0 + warp * LC * C < p.dv; // warp-uniform; idle warps still stage
    int const group = p.q_heads / p.kv_heads;
    bool const per_key = p.decay_per_key != 0;
    Stage const st(p, kColumns);
    ColumnSum<LR> const allsum;
    __shared__ Source sources[kFields];
    if (threadIdx.x < kFields)
        sources[threadIdx.x] = source(p, io, st, b, h, block0, int(threadIdx.x));

    float s[C][R];
    EM_UNROLL
    for (int r = 0; r < R; ++r)
    {
        int const i = rl + r * LR;
        EM_UNROLL
        for (int c = 0; c < C; ++c)
        {
            int const j = col0 + c;
            s[c][r] = (active && i < p.dk && j < p.dv) ? io.past_state[la::stateOffset(p, b, h, i, j)] : 0.0f;
        }
    }

    for (int t0 = 0; t0 < p.seq; t0 += st.tokens)
    {
        int const n = p.seq - t0 < st.tokens ? p.seq - t0 : st.tokens;
        __syncthreads(); // the previous pass is consumed
        stageTokens<T>(sources, st, la::isGated(p.rule), t0, n, staged);
        __syncthreads();
        if (!active)
            continue;
        for (int tt = 0; tt < n; ++tt)
        {
            float const* x = staged + tt * st.stride;
            float k[R];
            float w[R];
            EM_UNROLL
            for (int r = 0; r < R; ++r)
            {
                int const i = rl + r * LR;
                bool const row = i < p.dk;
                k[r] = row ? x[i] : 0.0f;
                w[r] = row ? x[st.w + (per_key ? i : 0)] : 1.0f;
            }
            float const beta = x[st.beta];
            EM_UNROLL
            for (int c = 0; c < C; ++c)
                la::columnUpdate<R>(s[c], k, w, x[st.value + col0 - block0 + c], beta, p.rule, allsum);
            for (int g = 0; g < group; ++g)
            {
                float q[R];
                EM_UNROLL
                for (int r = 0; r < R; ++r)
                {
                    int const i = rl + r * LR;
                    q[r] = i < p.dk ? x[st.query + g * p.dk + i] : 0.0f;
                }
                EM_UNROLL
                for (int c = 0; c < C; ++c)
                {
                    float const o = la::columnRead<R>(s[c], q, p.scale, allsum);
                    if (rl == 0 && col0 + c < p.dv)
                        store<T>(io.output, la::outputOffset(p, b, t0 + tt, h * group + g, col0 + c), o);
                }
            }
        }
    }

    if (!active)
        return;
    EM_UNROLL
    for (int r = 0; r < R; ++r)
    {
        int const i = rl + r * LR;
        EM_UNROLL
        for (int c = 0; c < C; ++c)
        {
            int const j = col0 + c;
            if (i < p.dk && j < p.dv)
                io.present_state[la::stateOffset(p, b, h, i, j)] = s[c][r];
        }
    }
}

template <typename T, int R, int C, int LR>
int launch(la::Params const& p, LinearAttentionIO const& io, cudaStream_t stream)
{
    constexpr int columns = kLaWarps * (kWarp / LR) * C; // per block
    Stage const st(p, columns);
    int const tiles = (p.dv + columns - 1) / columns;
    dim3 const grid(unsigned(p.batch) * unsigned(p.kv_heads), unsigned(tiles));
    size_t const smem = size_t(st.tokens) * st.stride * sizeof(float);
    if (smem > kLaStageFloats * sizeof(float))
        return kUnsupported; // one token's inputs exceed 48 KiB: over 40 query heads per kv head at d_k = 256
    linearAttentionKernel<T, R, C, LR><<<grid, kLaThreads, smem, stream>>>(p, io);
    return launchStatus();
}

// R * LR >= d_k rows; 8 lanes per column keep R <= 16 registers of key, decay and query per lane.
template <typename T>
int dispatch(la::Params const& p, LinearAttentionIO const& io, cudaStream_t stream)
{
    if (p.dk <= 32)
        return launch<T, 4, 2, 8>(p, io, stream);
    if (p.dk <= 64)
        return launch<T, 8, 2, 8>(p, io, stream);
    if (p.dk <= 128)
        return launch<T, 16, 2, 8>(p, io, stream);
    return launch<T, 16, 2, 16>(p, io, stream);
}

} // namespace

int linearAttention(la::Params const& p, LinearAttentionIO const& io, DType dtype, void* workspace,
    size_t workspace_bytes, cudaStream_t stream, LaPath path)
{
    if (int const st = la::check(p))
        return st;
    if (p.batch == 0)
        return kOk;
    if (p.seq == 0)
    {
        // no token: the state passes through
        if (io.present_state != io.past_state)
        {
            size_t const bytes = size_t(p.batch) * p.kv_heads * p.dk * p.dv * sizeof(float);
            if (cudaMemcpyAsync(io.present_state, io.past_state, bytes, cudaMemcpyDeviceToDevice, stream)
                != cudaSuccess)
                return kCudaError;
        }
        return kOk;
    }
    bool const forced = path == LaPath::kChunked;
    if (forced || (path == LaPath::kAuto && chunkedPays(p)))
    {
        int const st = linearAttentionChunked(p, io, dtype, workspace, workspace_bytes, stream);
        if (st != kUnsupported || forced)
            return st;
    }
    return withType(dtype, [&](auto t) { return dispatch<decltype(t)>(p, io, stream); });
}

} // namespace cuda
} // namespace edgemem

EM_CUDA_API int em_cuda_linear_attention(edgemem::la::Params const* p, edgemem::LinearAttentionIO const* io, int dtype,
    int path, void* workspace, size_t workspace_bytes, void* stream)
{
    using namespace edgemem;
    if (path < int(cuda::LaPath::kAuto) || path > int(cuda::LaPath::kChunked))
        return kBadArgument;
    return cuda::linearAttention(
        *p, *io, DType(dtype), workspace, workspace_bytes, static_cast<cudaStream_t>(stream), cuda::LaPath(path));
}

EM_CUDA_API size_t em_cuda_linear_attention_workspace(edgemem::la::Params const* p, int path)
{
    using namespace edgemem;
    if (path < int(cuda::LaPath::kAuto) || path > int(cuda::LaPath::kChunked))
        return 0;
    return cuda::linearAttentionWorkspace(*p, cuda::LaPath(path));
}
