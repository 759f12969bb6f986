// BandedAttention kernel: whole-sequence Longformer attention (core/attention.h).
//
// A warp per (batch, head, query row) runs one online softmax (core/warp_attention.cuh) over the
// band keys, then the global keys outside the band (found 32 at a time with a ballot over the
// mask), then the persistent ones. The launchers of both forms (the tiled kernel:
// banded_attention_tile.cu), which leaves the global query rows to this one.
#include "core/warp_attention.cuh"
#include "launch.h"

namespace edgemem
{
namespace cuda
{
namespace
{

constexpr int kBaWarps = 4;
constexpr int kBaThreads = kBaWarps * kWarp;

template <typename T, typename P>
__global__ void __launch_bounds__(kBaThreads, 4) bandedAttentionKernel(
    attn::BandedParams const p, Dilation const dilation, BandedAttentionIO const io, bool const global_rows)
{
    int const lane = threadIdx.x & (kWarp - 1);
    int const i = blockIdx.x * kBaWarps + threadIdx.x / kWarp;
    int const h = blockIdx.y;
    int const b = blockIdx.z;
    bool const* mask = io.global_mask + int64_t(b) * p.seq;
    if (i >= p.seq || (global_rows && !mask[i]))
        return; // the whole warp
    int const dil = dilation.v[h];
    bool const causal = p.causal != 0;
    int64_t const q_row = attn::rowOffset(p.seq, p.heads, p.d, b, i, h);
    WarpAttention a{};
    a.init<T>(io.query, q_row, lane, p.d, p.dv, p.scale);
    auto key = [&](int j)
    {
        a.add<T>(io.key, attn::rowOffset(p.seq, p.heads, p.d, b, j, h), io.value,
            attn::rowOffset(p.seq, p.heads, p.dv, b, j, h));
    };
    int const last = causal ? i : p.seq - 1; // no key after `last`
    if (mask[i])
    {
        for (int j = 0; j <= last; ++j) // a global query attends every key
            key(j);
    }
    else
    {
        for (int o = causal ? 0 : -p.window; o <= p.window; ++o)
        {
            int64_t const j = int64_t(i) - int64_t(o) * dil;
            if (j >= 0 && j <= last)
                key(int(j));
        }
        for (int j0 = 0; j0 <= last; j0 += kWarp) // global keys outside the band
        {
            int const j = j0 + lane;
            bool const extra = j <= last && mask[j] && !attn::bandAllowed(i, j, p.window, dil, causal, false, false);
            unsigned bits = __ballot_sync(kFullMask, extra);
            while (bits)
            {
                int const l = __ffs(bits) - 1;
                bits &= bits - 1;
                key(j0 + l);
            }
        }
    }
    for (int r = 0; r < p.persistent; ++r)
        a.add<P>(io.persistent_key, attn::headRowOffset(p.heads, p.persistent, p.d, b, h, r), io.persistent_value,
            attn::headRowOffset(p.heads, p.persistent, p.dv, b, h, r));
    int64_t const o_row = attn::rowOffset(p.seq, p.heads, p.dv, b, i, h);
    float const inv = 1.0f / a.st.l;
    EM_UNROLL
    for (int r = 0; r < kPerLane; ++r)
    {
        int const j = lane + r * kWarp;
        if (j < p.dv)
            store<T>(io.output, o_row + j, a.acc[r] * inv);
    }
}

// global_rows: only the rows of global queries (the tiled kernel computes the others).
template <typename T>
int launchBanded(attn::BandedParams const& p, Dilation const& dil, BandedAttentionIO const& io, DType pd,
    bool global_rows, cudaStream_t stream)
{
    dim3 const grid(unsigned((p.seq + kBaWarps - 1) / kBaWarps), unsigned(p.heads), unsigned(p.batch));
    if (pd == kFloat32)
        bandedAttentionKernel<T, float><<<grid, kBaThreads, 0, stream>>>(p, dil, io, global_rows);
    else
        bandedAttentionKernel<T, typename Narrow<T>::type><<<grid, kBaThreads, 0, stream>>>(p, dil, io, global_rows);
    return launchStatus();
}

// The checks both forms share; kOk with nothing to run sets `empty`.
int checkCall(attn::BandedParams const& p, int32_t const* dilation, DType dtype, DType persistent_dtype, bool& empty)
{
    int mx = 0;
    if (int const st = attn::check(p))
        return st;
    if (int const st = attn::checkDilation(dilation, p.heads, &mx))
        return st;
    if (p.heads > kMaxHeads || p.heads > 65535 || p.batch > 65535 || !validDType(dtype)
        || !validState(persistent_dtype, dtype))
        return kUnsupported;
    empty = p.batch == 0 || p.seq == 0;
    return kOk;
}

int rows(attn::BandedParams const& p, int32_t const* dilation, BandedAttentionIO const& io, DType dtype,
    DType persistent_dtype, bool global_rows, cudaStream_t stream)
{
    Dilation dil{};
    for (int h = 0; h < p.heads; ++h)
        dil.v[h] = dilation[h];
    return withType(
        dtype, [&](auto t) { return launchBanded<decltype(t)>(p, dil, io, persistent_dtype, global_rows, stream); });
}

} // namespace

int bandedAttention(attn::BandedParams const& p, int32_t const* dilation, BandedAttentionIO const& io, DType dtype,
    DType persistent_dtype, cudaStream_t stream)
{
    bool empty = false;
    if (int const st = checkCall(p, dilation, dtype, persistent_dtype, empty))
        return st;
    return empty ? kOk : rows(p, dilation, io, dtype, persistent_dtype, false, stream);
}

int bandedAttentionTiled(attn::BandedParams const& p, int32_t const* dilation, BandedAttentionIO const& io, DType dtype,
    DType persistent_dtype, cudaStream_t stream)
{
    bool empty = false;
    if (int const st = checkCall(p, dilation, dtype, persistent_dtype, empty))
        return st;
    if (!attn::tileable(p))
        return kUnsupported;
    if (empty)
        return kOk;
    if (int const st = bandedTiles(p, dilation, io, dtype, persistent_dtype, stream))
        return st;
    return rows(p, dilation, io, dtype, persistent_dtype, true, stream);
}

bool tilesPay(attn::BandedParams const& p, int32_t const* dilation)
{
    if (p.seq < kTiledFrom)
        return false;
    for (int h = 0; h < p.heads; ++h)
        if (dilation[h] != 1)
            return false;
    return true;
}

int bandedAttentionPrefill(attn::BandedParams const& p, int32_t const* dilation, BandedAttentionIO const& io,
    DType dtype, DType persistent_dtype, cudaStream_t stream)
{
    if (tilesPay(p, dilation))
        if (int const st = bandedAttentionTiled(p, dilation, io, dtype, persistent_dtype, stream); st != kUnsupported)
            return st;
    return bandedAttention(p, dilation, io, dtype, persistent_dtype, stream);
}

} // namespace cuda
} // namespace edgemem

EM_CUDA_API int em_cuda_banded_attention(edgemem::attn::BandedParams const* p, int32_t const* dilation,
    edgemem::BandedAttentionIO const* io, int dtype, int persistent_dtype, int, void* stream)
{
    using edgemem::DType;
    return edgemem::cuda::bandedAttention(
        *p, dilation, *io, DType(dtype), DType(persistent_dtype), static_cast<cudaStream_t>(stream));
}

EM_CUDA_API int em_cuda_banded_attention_tiled(edgemem::attn::BandedParams const* p, int32_t const* dilation,
    edgemem::BandedAttentionIO const* io, int dtype, int persistent_dtype, int, void* stream)
{
    using edgemem::DType;
    return edgemem::cuda::bandedAttentionTiled(
        *p, dilation, *io, DType(dtype), DType(persistent_dtype), static_cast<cudaStream_t>(stream));
}
