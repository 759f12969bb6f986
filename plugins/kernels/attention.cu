// WindowAttention (streaming decode / prefill over a ring buffer) and BandedAttention
// (whole-sequence Longformer attention) kernels.
//
// Both score keys one at a time with a warp: lanes split the head dim (lane l holds dims
// l, l+32, ...; D, D_v <= 256 so 8 per lane), a warp all-reduce gives q.k, and an online
// softmax (edgemem/common.h) accumulates the values, so no score vector is materialised.
//  - WindowAttention: a block per (batch, head) owns that head's ring; its 16 warps split the
//    window+1+P keys of a token (each warp's online softmax is a serial chain, so more warps
//    mean shorter chains), merge their partial softmaxes in shared memory, and only then
//    is the token's key/value written into ring slot position mod L (that slot may still hold
//    a key the token attends). Tokens run in order; the ring may be updated in place.
//  - BandedAttention: a warp per (batch, head, query row): the band keys, then the global keys
//    outside the band (found 32 at a time with a ballot over the mask), then the persistent ones.
#include "device.cuh"
#include "launch.h"

namespace edgemem
{
namespace cuda
{
namespace
{

constexpr int kPerLane = kMaxHeadDim / kWarp; // 8

// A warp's running softmax over keys and its weighted sum of values.
struct WarpAttention
{
    float q[kPerLane];
    float acc[kPerLane];
    SoftmaxState st;
    int lane;
    int d;
    int dv;
    float scale;

    template <typename T>
    __device__ __forceinline__ void init(void const* query, int64_t row, int lane_, int d_, int dv_, float scale_)
    {
        lane = lane_;
        d = d_;
        dv = dv_;
        scale = scale_;
        st = softmax_empty();
        EM_UNROLL
        for (int r = 0; r < kPerLane; ++r)
        {
            int const i = lane + r * kWarp;
            q[r] = i < d ? load<T>(query, row + i) : 0.0f;
            acc[r] = 0.0f;
        }
    }

    // key row k_base[k_row .. k_row + d), value row v_base[v_row .. v_row + dv)
    template <typename K>
    __device__ __forceinline__ void add(void const* k_base, int64_t k_row, void const* v_base, int64_t v_row)
    {
        float dot = 0.0f;
        EM_UNROLL
        for (int r = 0; r < kPerLane; ++r)
        {
            int const i = lane + r * kWarp;
            if (r * kWarp < d && i < d)
                dot += q[r] * load<K>(k_base, k_row + i);
        }
        dot = WarpSum()(dot);
        float rescale;
        float const p = softmax_add(st, scale * dot, rescale);
        EM_UNROLL
        for (int r = 0; r < kPerLane; ++r)
        {
            int const j = lane + r * kWarp;
            if (r * kWarp < dv)
                acc[r] = acc[r] * rescale + (j < dv ? p * load<K>(v_base, v_row + j) : 0.0f);
        }
    }
};

// ---------------------------------------------------------------------------------------------
// WindowAttention

constexpr int kWaWarps = 16;
constexpr int kWaThreads = kWaWarps * kWarp;

template <typename T, typename S, typename P>
__global__ void __launch_bounds__(kWaThreads) windowAttentionKernel(
    attn::WindowParams const p, Dilation const dilation, WindowAttentionIO const io)
{
    __shared__ SoftmaxState part_st[kWaWarps];
    __shared__ float part_acc[kWaWarps][kMaxHeadDim];

    int const lane = threadIdx.x & (kWarp - 1);
    int const warp = threadIdx.x / kWarp;
    int const b = blockIdx.x / p.heads;
    int const h = blockIdx.x % p.heads;
    int const dil = dilation.v[h];
    int64_t const key_ring = attn::headRowOffset(p.heads, p.ring, p.d, b, h, 0);
    int64_t const value_ring = attn::headRowOffset(p.heads, p.ring, p.dv, b, h, 0);

    // present ring = past ring, then updated in place token by token
    if (io.present_key != io.past_key)
        for (int64_t i = threadIdx.x; i < int64_t(p.ring) * p.d; i += blockDim.x)
            static_cast<S*>(io.present_key)[key_ring + i] = static_cast<S const*>(io.past_key)[key_ring + i];
    if (io.present_value != io.past_value)
        for (int64_t i = threadIdx.x; i < int64_t(p.ring) * p.dv; i += blockDim.x)
            static_cast<S*>(io.present_value)[value_ring + i] = static_cast<S const*>(io.past_value)[value_ring + i];
    __syncthreads();

    int const keys = p.window + 1 + p.persistent;
    for (int t = 0; t < p.seq; ++t)
    {
        int64_t const pos = io.position[b] + t;
        int64_t const q_row = attn::rowOffset(p.seq, p.heads, p.d, b, t, h);
        int64_t const v_row = attn::rowOffset(p.seq, p.heads, p.dv, b, t, h);
        WarpAttention a{};
        a.init<T>(io.query, q_row, lane, p.d, p.dv, p.scale);
        for (int idx = warp; idx < keys; idx += kWaWarps)
        {
            if (idx == 0) // the token itself
                a.add<T>(io.key, q_row, io.value, v_row);
            else if (idx <= p.window)
            {
                int64_t const at = attn::windowKeyPosition(pos, idx, dil);
                if (at < 0)
                    continue;
                int const slot = attn::ringSlot(at, p.ring);
                a.add<S>(io.present_key, key_ring + int64_t(slot) * p.d, io.present_value,
                    value_ring + int64_t(slot) * p.dv);
            }
            else
            {
                int const r = idx - p.window - 1;
                a.add<P>(io.persistent_key, attn::headRowOffset(p.heads, p.persistent, p.d, b, h, r),
                    io.persistent_value, attn::headRowOffset(p.heads, p.persistent, p.dv, b, h, r));
            }
        }
        if (lane == 0)
            part_st[warp] = a.st;
        EM_UNROLL
        for (int r = 0; r < kPerLane; ++r)
            if (lane + r * kWarp < p.dv)
                part_acc[warp][lane + r * kWarp] = a.acc[r];
        __syncthreads(); // every read of the ring for this token is done

        for (int j = threadIdx.x; j < p.dv; j += blockDim.x)
        {
            SoftmaxState total = softmax_empty();
            float o = 0.0f;
            for (int w = 0; w < kWaWarps; ++w)
            {
                float fa, fb;
                softmax_merge(total, part_st[w], fa, fb);
                o = o * fa + part_acc[w][j] * fb;
            }
            store<T>(io.output, v_row + j, o / total.l);
        }
        int const slot = attn::ringSlot(pos, p.ring);
        for (int i = threadIdx.x; i < p.d; i += blockDim.x)
            store<S>(io.present_key, key_ring + int64_t(slot) * p.d + i, load<T>(io.key, q_row + i));
        for (int j = threadIdx.x; j < p.dv; j += blockDim.x)
            store<S>(io.present_value, value_ring + int64_t(slot) * p.dv + j, load<T>(io.value, v_row + j));
        __syncthreads(); // the slot is written and part_* may be reused
    }
}

template <typename T, typename S>
int launchWindow(attn::WindowParams const& p, Dilation const& dil, WindowAttentionIO const& io, DType pd, cudaStream_t stream)
{
    dim3 const grid(unsigned(p.batch) * unsigned(p.heads));
    if (pd == kFloat32)
        windowAttentionKernel<T, S, float><<<grid, kWaThreads, 0, stream>>>(p, dil, io);
    else
        windowAttentionKernel<T, S, __half><<<grid, kWaThreads, 0, stream>>>(p, dil, io);
    return launchStatus();
}

// ---------------------------------------------------------------------------------------------
// BandedAttention

constexpr int kBaWarps = 4;
constexpr int kBaThreads = kBaWarps * kWarp;

template <typename T, typename P>
__global__ void __launch_bounds__(kBaThreads) bandedAttentionKernel(
    attn::BandedParams const p, Dilation const dilation, BandedAttentionIO const io)
{
    int const lane = threadIdx.x & (kWarp - 1);
    int const i = blockIdx.x * kBaWarps + threadIdx.x / kWarp;
    int const h = blockIdx.y;
    int const b = blockIdx.z;
    if (i >= p.seq)
        return; // the whole warp
    int const dil = dilation.v[h];
    bool const causal = p.causal != 0;
    bool const* mask = io.global_mask + int64_t(b) * p.seq;
    int64_t const q_row = attn::rowOffset(p.seq, p.heads, p.d, b, i, h);
    WarpAttention a{};
    a.init<T>(io.query, q_row, lane, p.d, p.dv, p.scale);
    auto key = [&](int j) {
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

template <typename T>
int launchBanded(attn::BandedParams const& p, Dilation const& dil, BandedAttentionIO const& io, DType pd, cudaStream_t stream)
{
    dim3 const grid(unsigned((p.seq + kBaWarps - 1) / kBaWarps), unsigned(p.heads), unsigned(p.batch));
    if (pd == kFloat32)
        bandedAttentionKernel<T, float><<<grid, kBaThreads, 0, stream>>>(p, dil, io);
    else
        bandedAttentionKernel<T, __half><<<grid, kBaThreads, 0, stream>>>(p, dil, io);
    return launchStatus();
}

bool validDType(DType d) { return d == kFloat32 || d == kFloat16; }

} // namespace

int windowAttention(attn::WindowParams const& p, int32_t const* dilation, WindowAttentionIO const& io, DType dtype,
    DType ring_dtype, DType persistent_dtype, cudaStream_t stream)
{
    if (int const st = attn::check(p, dilation))
        return st;
    if (p.heads > kMaxHeads || !validDType(dtype) || !validDType(ring_dtype) || !validDType(persistent_dtype))
        return kUnsupported;
    if (p.batch == 0)
        return kOk;
    Dilation dil{};
    for (int h = 0; h < p.heads; ++h)
        dil.v[h] = dilation[h];
    if (dtype == kFloat32)
        return ring_dtype == kFloat32 ? launchWindow<float, float>(p, dil, io, persistent_dtype, stream)
                                      : launchWindow<float, __half>(p, dil, io, persistent_dtype, stream);
    return ring_dtype == kFloat32 ? launchWindow<__half, float>(p, dil, io, persistent_dtype, stream)
                                  : launchWindow<__half, __half>(p, dil, io, persistent_dtype, stream);
}

int bandedAttention(attn::BandedParams const& p, int32_t const* dilation, BandedAttentionIO const& io, DType dtype,
    DType persistent_dtype, cudaStream_t stream)
{
    int mx = 0;
    if (int const st = attn::check(p))
        return st;
    if (int const st = attn::checkDilation(dilation, p.heads, &mx))
        return st;
    if (p.heads > kMaxHeads || p.heads > 65535 || p.batch > 65535 || !validDType(dtype) || !validDType(persistent_dtype))
        return kUnsupported;
    if (p.batch == 0 || p.seq == 0)
        return kOk;
    Dilation dil{};
    for (int h = 0; h < p.heads; ++h)
        dil.v[h] = dilation[h];
    return dtype == kFloat32 ? launchBanded<float>(p, dil, io, persistent_dtype, stream)
                             : launchBanded<__half>(p, dil, io, persistent_dtype, stream);
}

} // namespace cuda
} // namespace edgemem
