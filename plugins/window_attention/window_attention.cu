// WindowAttention kernel: streaming decode / prefill over a ring buffer (core/attention.h).
//
// A block per (batch, head) owns that head's ring; its 16 warps split the window+1+P keys of a
// token (each warp's online softmax, core/warp_attention.cuh, is a serial chain, so more warps
// mean shorter chains), merge their partial softmaxes in shared memory, and only then is the
// token's key/value written into ring slot position mod L (that slot may still hold a key the
// token attends). Tokens run in order; the ring may be updated in place.
#include "core/warp_attention.cuh"
#include "launch.h"

namespace edgemem
{
namespace cuda
{
namespace
{

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

} // namespace cuda
} // namespace edgemem

EM_CUDA_API int em_cuda_window_attention(edgemem::attn::WindowParams const* p, int32_t const* dilation,
    edgemem::WindowAttentionIO const* io, int dtype, int ring_dtype, int persistent_dtype, void* stream)
{
    using edgemem::DType;
    return edgemem::cuda::windowAttention(*p, dilation, *io, DType(dtype), DType(ring_dtype), DType(persistent_dtype),
        static_cast<cudaStream_t>(stream));
}
