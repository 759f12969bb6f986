// LinearAttention kernels: decode step (T = 1) and sequential prefill (T > 1), one kernel.
//
// Work split: a block per (batch, kv head, tile of value columns). A warp owns LC * C
// consecutive value columns of one kv head's state S [d_k, d_v], and its lanes form an
// LR x LC grid (LR * LC = 32): lane (rl, cl) holds the C columns col0 + cl * C + c at the R
// rows rl + LR * r, so a lane keeps R * C state values in registers (32 for d_k = 128). One
// state load or store instruction covers LR rows of the warp's LC * C consecutive floats:
// whole 32-byte sectors. The sums over d_k (S^T k for the delta rules, S^T q for the
// read-out) are an in-lane sum over R rows plus log2(LR) shuffles between the lanes that
// share cl. Each state element is read once at the start and written once at the end by its
// owning lane: state-in and state-out may be one buffer. Tokens run in sequence with the
// state in registers.
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

template <typename T, int R, int C, int LR>
__global__ void __launch_bounds__(kLaThreads, 4) linearAttentionKernel(la::Params const p, LinearAttentionIO const io)
{
    constexpr int LC = kWarp / LR;
    int const lane = threadIdx.x & (kWarp - 1);
    int const rl = lane / LC;
    int const cl = lane % LC;
    int const warp = threadIdx.x / kWarp;
    int const b = blockIdx.x / p.kv_heads;
    int const h = blockIdx.x % p.kv_heads;
    int const warp0 = (blockIdx.y * kLaWarps + warp) * LC * C;
    if (warp0 >= p.dv)
        return; // the whole warp: no block-level synchronisation below
    int const col0 = warp0 + cl * C;
    int const group = p.q_heads / p.kv_heads;
    bool const gated = la::isGated(p.rule);
    bool const delta = la::isDelta(p.rule);
    ColumnSum<LR> const allsum;

    float s[C][R];
    EM_UNROLL
    for (int r = 0; r < R; ++r)
    {
        int const i = rl + r * LR;
        EM_UNROLL
        for (int c = 0; c < C; ++c)
        {
            int const j = col0 + c;
            s[c][r] = (i < p.dk && j < p.dv) ? io.past_state[la::stateOffset(p, b, h, i, j)] : 0.0f;
        }
    }

    for (int t = 0; t < p.seq; ++t)
    {
        float k[R];
        float w[R];
        EM_UNROLL
        for (int r = 0; r < R; ++r)
        {
            int const i = rl + r * LR;
            bool const row = i < p.dk;
            k[r] = row ? load<T>(io.key, la::keyOffset(p, b, t, h, i)) : 0.0f;
            w[r] = (gated && row) ? em_exp(load<T>(io.decay, la::decayOffset(p, b, t, h, i))) : 1.0f;
        }
        float const beta = delta ? load<T>(io.beta, la::betaOffset(p, b, t, h)) : 1.0f;
        EM_UNROLL
        for (int c = 0; c < C; ++c)
        {
            int const j = col0 + c;
            float const v = j < p.dv ? load<T>(io.value, la::valueOffset(p, b, t, h, j)) : 0.0f;
            la::columnUpdate<R>(s[c], k, w, v, beta, p.rule, allsum);
        }
        for (int g = 0; g < group; ++g)
        {
            int const hq = h * group + g;
            float q[R];
            EM_UNROLL
            for (int r = 0; r < R; ++r)
            {
                int const i = rl + r * LR;
                q[r] = i < p.dk ? load<T>(io.query, la::queryOffset(p, b, t, hq, i)) : 0.0f;
            }
            EM_UNROLL
            for (int c = 0; c < C; ++c)
            {
                float const o = la::columnRead<R>(s[c], q, p.scale, allsum);
                if (rl == 0 && col0 + c < p.dv)
                    store<T>(io.output, la::outputOffset(p, b, t, hq, col0 + c), o);
            }
        }
    }

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
    int const tiles = (p.dv + columns - 1) / columns;
    dim3 const grid(unsigned(p.batch) * unsigned(p.kv_heads), unsigned(tiles));
    linearAttentionKernel<T, R, C, LR><<<grid, kLaThreads, 0, stream>>>(p, io);
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

int linearAttention(la::Params const& p, LinearAttentionIO const& io, DType dtype, cudaStream_t stream)
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
            if (cudaMemcpyAsync(io.present_state, io.past_state, bytes, cudaMemcpyDeviceToDevice, stream) != cudaSuccess)
                return kCudaError;
        }
        return kOk;
    }
    switch (dtype)
    {
    case kFloat32: return dispatch<float>(p, io, stream);
    case kFloat16: return dispatch<__half>(p, io, stream);
    }
    return kUnsupported;
}

} // namespace cuda
} // namespace edgemem
