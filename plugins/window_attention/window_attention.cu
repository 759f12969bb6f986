// WindowAttention kernel: streaming decode / prefill over a ring buffer (core/attention.h).
//
// A block per (batch, head) owns that head's ring; its 16 warps split the window+1+P keys of a
// token (each warp's online softmax, core/warp_attention.cuh, is a serial chain, so more warps
// mean shorter chains), merge their partial softmaxes in shared memory, and only then is the
// token's key/value written into ring slot position mod L (that slot may still hold a key the
// token attends). Tokens run in order; the ring may be updated in place.
// A single token (decode) with a workspace splits the keys over several blocks instead
// (flash-decoding): each block writes its partial softmax (m, l, sum p v) to the workspace, and a
// second kernel merges them, writes the output and only then the ring slot. A warp loads a key's
// row and value row together, and in the split kernel two keys at a time.
#include <atomic>

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
constexpr int kKeysPerWarp = 4; // decode splits: about this many keys for each warp of each split
constexpr int kMaxSplits = 64;
// Fewer splits than this and one block per head is faster: the merge's launch costs more than the
// split saves (benchmarks/README.md).
constexpr int kMinSplits = 3;

// Loads key idx of token t (at position pos) into k and v (WarpAttention::loadRow): 0 is the
// token itself, 1..window the ring (ring_key/ring_value: the ring as it was before this token),
// then the persistent keys. False for a window key before position 0: it does not exist.
template <typename T, typename S, typename P>
__device__ __forceinline__ bool loadWindowKey(WarpAttention const& a, attn::WindowParams const& p,
    WindowAttentionIO const& io, void const* ring_key, void const* ring_value, int b, int h, int dil, int64_t pos,
    int t, int idx, float (&k)[kPerLane], float (&v)[kPerLane])
{
    if (idx == 0)
    {
        a.loadRow<T>(io.key, attn::rowOffset(p.seq, p.heads, p.d, b, t, h), p.d, k);
        a.loadRow<T>(io.value, attn::rowOffset(p.seq, p.heads, p.dv, b, t, h), p.dv, v);
    }
    else if (idx <= p.window)
    {
        int64_t const at = attn::windowKeyPosition(pos, idx, dil);
        if (at < 0)
            return false;
        int64_t const slot = attn::ringSlot(at, p.ring);
        a.loadRow<S>(ring_key, attn::headRowOffset(p.heads, p.ring, p.d, b, h, 0) + slot * p.d, p.d, k);
        a.loadRow<S>(ring_value, attn::headRowOffset(p.heads, p.ring, p.dv, b, h, 0) + slot * p.dv, p.dv, v);
    }
    else
    {
        int const r = idx - p.window - 1;
        a.loadRow<P>(io.persistent_key, attn::headRowOffset(p.heads, p.persistent, p.d, b, h, r), p.d, k);
        a.loadRow<P>(io.persistent_value, attn::headRowOffset(p.heads, p.persistent, p.dv, b, h, r), p.dv, v);
    }
    return true;
}

// Adds a warp's keys idx0, idx0 + stride, ... below keys to its softmax, N at a time: the N keys'
// rows are loaded before any is added, so their round trips to memory overlap.
template <int N, typename T, typename S, typename P>
__device__ __forceinline__ void addWindowKeys(WarpAttention& a, attn::WindowParams const& p,
    WindowAttentionIO const& io, void const* ring_key, void const* ring_value, int b, int h, int dil, int64_t pos,
    int t, int idx0, int stride, int keys)
{
    for (int idx = idx0; idx < keys; idx += N * stride)
    {
        float k[N][kPerLane], v[N][kPerLane];
        bool has[N];
        EM_UNROLL
        for (int n = 0; n < N; ++n)
            has[n] = idx + n * stride < keys
                && loadWindowKey<T, S, P>(
                    a, p, io, ring_key, ring_value, b, h, dil, pos, t, idx + n * stride, k[n], v[n]);
        EM_UNROLL
        for (int n = 0; n < N; ++n)
            if (has[n])
                a.addRows(k[n], v[n]);
    }
}

__device__ __forceinline__ void savePartial(
    WarpAttention const& a, SoftmaxState* part_st, float (*part_acc)[kMaxHeadDim], int warp, int lane)
{
    if (lane == 0)
        part_st[warp] = a.st;
    EM_UNROLL
    for (int r = 0; r < kPerLane; ++r)
        if (lane + r * kWarp < a.dv)
            part_acc[warp][lane + r * kWarp] = a.acc[r];
}

// Column j of n partial softmaxes (acc rows `ld` floats apart) merged: returns sum p v
// relative to total.m; total.l is the matching sum of weights.
__device__ __forceinline__ float mergePartials(
    SoftmaxState const* st, float const* acc, int ld, int n, int j, SoftmaxState& total)
{
    total = softmax_empty();
    float o = 0.0f;
    for (int w = 0; w < n; ++w)
    {
        float fa, fb;
        softmax_merge(total, st[w], fa, fb);
        o = o * fa + acc[w * ld + j] * fb;
    }
    return o;
}

// Element offsets of ring slot pos mod L's key row and value row.
struct SlotRows
{
    int64_t key, value;
};
__device__ __forceinline__ SlotRows slotRows(attn::WindowParams const& p, int b, int h, int64_t pos)
{
    int64_t const slot = attn::ringSlot(pos, p.ring);
    return {attn::headRowOffset(p.heads, p.ring, p.d, b, h, 0) + slot * p.d,
        attn::headRowOffset(p.heads, p.ring, p.dv, b, h, 0) + slot * p.dv};
}

// The token's key and value into ring slot pos mod L, after every read of that slot.
template <typename T, typename S>
__device__ __forceinline__ void writeSlot(
    attn::WindowParams const& p, WindowAttentionIO const& io, int b, int h, int64_t pos, int t)
{
    SlotRows const slot = slotRows(p, b, h, pos);
    int64_t const k_row = attn::rowOffset(p.seq, p.heads, p.d, b, t, h);
    int64_t const v_row = attn::rowOffset(p.seq, p.heads, p.dv, b, t, h);
    for (int i = threadIdx.x; i < p.d; i += blockDim.x)
        store<S>(io.present_key, slot.key + i, load<T>(io.key, k_row + i));
    for (int j = threadIdx.x; j < p.dv; j += blockDim.x)
        store<S>(io.present_value, slot.value + j, load<T>(io.value, v_row + j));
}

template <typename T, typename S, typename P>
__global__ void __launch_bounds__(kWaThreads, 1)
    windowAttentionKernel(attn::WindowParams const p, Dilation const dilation, WindowAttentionIO const io)
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
        addWindowKeys<1, T, S, P>(a, p, io, io.present_key, io.present_value, b, h, dil, pos, t, warp, kWaWarps, keys);
        savePartial(a, part_st, part_acc, warp, lane);
        __syncthreads(); // every read of the ring for this token is done

        for (int j = threadIdx.x; j < p.dv; j += blockDim.x)
        {
            SoftmaxState total;
            float const o = mergePartials(part_st, &part_acc[0][0], kMaxHeadDim, kWaWarps, j, total);
            store<T>(io.output, v_row + j, o / total.l);
        }
        writeSlot<T, S>(p, io, b, h, pos, t);
        __syncthreads(); // the slot is written and part_* may be reused
    }
}

// Decode split over blocks: block (s, h, b) takes keys s, s + splits, ... of the one token
// (strided, so every split gets near the same share of window, self and persistent keys) and
// writes its merged partial to ws[((b * heads + h) * splits + s) * (dv + 2)]: dv sums, then m, l.
template <typename T, typename S, typename P>
__global__ void __launch_bounds__(kWaThreads, 1)
    windowSplitKernel(attn::WindowParams const p, Dilation const dilation, WindowAttentionIO const io, float* ws)
{
    __shared__ SoftmaxState part_st[kWaWarps];
    __shared__ float part_acc[kWaWarps][kMaxHeadDim];

    int const lane = threadIdx.x & (kWarp - 1);
    int const warp = threadIdx.x / kWarp;
    int const s = blockIdx.x, splits = gridDim.x, h = blockIdx.y, b = blockIdx.z;
    int64_t const pos = io.position[b];
    int const keys = p.window + 1 + p.persistent;
    WarpAttention a{};
    a.init<T>(io.query, attn::rowOffset(1, p.heads, p.d, b, 0, h), lane, p.d, p.dv, p.scale);
    addWindowKeys<2, T, S, P>(
        a, p, io, io.past_key, io.past_value, b, h, dilation.v[h], pos, 0, s + warp * splits, kWaWarps * splits, keys);
    savePartial(a, part_st, part_acc, warp, lane);
    __syncthreads();
    float* out = ws + ((int64_t(b) * p.heads + h) * splits + s) * (p.dv + 2);
    SoftmaxState total{};
    for (int j = threadIdx.x; j < p.dv; j += blockDim.x)
        out[j] = mergePartials(part_st, &part_acc[0][0], kMaxHeadDim, kWaWarps, j, total);
    if (threadIdx.x == 0) // thread 0 merged column 0 (dv >= 1)
    {
        out[p.dv] = total.m;
        out[p.dv + 1] = total.l;
    }
}

// Merges the splits of one (batch, head), writes the output, then the token's ring slot (the
// present ring is the past one where they differ, copied by the split kernel's launcher; the split
// kernel has read the ring by the time this one runs). Thread j owns column j of the output and of
// the token's key and value rows (d, dv <= kMaxHeadDim threads). Every load that does not wait on
// another is issued first: the position, the token's key and value, each split's m and l and the
// column's first kMergeBatch split sums, so a merge of up to kMergeBatch splits waits on one round
// trip to memory. Each split's weight e^{m_s - M} (M the largest m_s of the splits that have keys)
// is computed once.
constexpr int kMergeBatch = 16;
static_assert(kMaxSplits <= kMaxHeadDim, "a merge thread per split");
template <typename T, typename S>
__global__ void __launch_bounds__(kMaxHeadDim)
    windowMergeKernel(attn::WindowParams const p, WindowAttentionIO const io, float const* ws, int const splits)
{
    __shared__ float m[kMaxSplits], l[kMaxSplits], weight[kMaxSplits];
    int const h = blockIdx.x, b = blockIdx.y;
    int const j = threadIdx.x;
    int64_t const stride = p.dv + 2;
    float const* part = ws + (int64_t(b) * p.heads + h) * splits * stride;
    int64_t const pos = io.position[b];
    float const key = j < p.d ? load<T>(io.key, attn::rowOffset(1, p.heads, p.d, b, 0, h) + j) : 0.0f;
    float const value = j < p.dv ? load<T>(io.value, attn::rowOffset(1, p.heads, p.dv, b, 0, h) + j) : 0.0f;
    float x[kMergeBatch];
    EM_UNROLL
    for (int u = 0; u < kMergeBatch; ++u)
        x[u] = u < splits && j < p.dv ? part[u * stride + j] : 0.0f;
    if (j < splits)
    {
        m[j] = part[j * stride + p.dv];
        l[j] = part[j * stride + p.dv + 1];
    }
    __syncthreads();
    if (j < splits)
    {
        float top = -INFINITY;
        for (int r = 0; r < splits; ++r)
            top = l[r] > 0.0f ? em_max(top, m[r]) : top;
        weight[j] = l[j] > 0.0f ? em_exp(m[j] - top) : 0.0f;
    }
    __syncthreads();
    float total = 0.0f;
    for (int s = 0; s < splits; ++s)
        total += weight[s] * l[s];
    float o = 0.0f;
    EM_UNROLL
    for (int u = 0; u < kMergeBatch; ++u)
        o += u < splits ? weight[u] * x[u] : 0.0f;
    for (int s0 = kMergeBatch; s0 < splits; s0 += kMergeBatch)
    {
        EM_UNROLL
        for (int u = 0; u < kMergeBatch; ++u)
            x[u] = s0 + u < splits && j < p.dv ? part[(s0 + u) * stride + j] : 0.0f;
        EM_UNROLL
        for (int u = 0; u < kMergeBatch; ++u)
            o += s0 + u < splits ? weight[s0 + u] * x[u] : 0.0f;
    }
    SlotRows const slot = slotRows(p, b, h, pos);
    if (j < p.dv)
    {
        store<T>(io.output, attn::rowOffset(1, p.heads, p.dv, b, 0, h) + j, o / total);
        store<S>(io.present_value, slot.value + j, value);
    }
    if (j < p.d)
        store<S>(io.present_key, slot.key + j, key);
}

int windowSplits(attn::WindowParams const& p)
{
    int const keys = p.window + 1 + p.persistent;
    int const n = (keys + kWaWarps * kKeysPerWarp - 1) / (kWaWarps * kKeysPerWarp);
    bool const split = p.seq == 1 && n >= kMinSplits && p.heads <= 65535 && p.batch <= 65535;
    return split ? (n < kMaxSplits ? n : kMaxSplits) : 1;
}

// Blocks of the split kernel the current device holds at once (SMs x resident blocks an SM), 0 where
// it cannot be queried. Asked once a device: a decode launches it every token.
template <typename T, typename S, typename P>
int64_t residentSplitBlocks()
{
    constexpr int kDevices = 64;
    static std::atomic<int64_t> known[kDevices]{};
    int dev = 0, sms = 0, per_sm = 0;
    if (cudaGetDevice(&dev) != cudaSuccess)
        return 0;
    if (dev < kDevices)
        if (int64_t const n = known[dev].load(std::memory_order_relaxed))
            return n;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess
        || cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, windowSplitKernel<T, S, P>, kWaThreads, 0)
            != cudaSuccess
        || sms <= 0 || per_sm <= 0)
        return 0;
    int64_t const n = int64_t(sms) * per_sm;
    if (dev < kDevices)
        known[dev].store(n, std::memory_order_relaxed);
    return n;
}

// The split count a decode launches, of windowSplits' n and the counts down to n / 2 (kMinSplits at
// least): the one whose blocks fill the fewest waves of the `resident` blocks the device holds at once,
// the largest of those. A wave costs a block's fixed latency, which a few more keys a warp add little to
// (benchmarks/README.md); the workspace, sized for n, holds any fewer. n where `resident` is unknown (0).
int fitSplits(attn::WindowParams const& p, int n, int64_t resident)
{
    if (resident <= 0)
        return n;
    int64_t const rows = int64_t(p.batch) * p.heads;
    auto const waves = [&](int s) { return (rows * s + resident - 1) / resident; };
    int best = n;
    for (int s = n - 1; s >= kMinSplits && 2 * s >= n; --s)
        if (waves(s) < waves(best))
            best = s;
    return best;
}

template <typename T, typename S>
int launchWindow(attn::WindowParams const& p, Dilation const& dil, WindowAttentionIO const& io, DType pd, float* ws,
    size_t ws_bytes, cudaStream_t stream)
{
    int const n = windowSplits(p);
    if (n > 1 && ws != nullptr && ws_bytes >= windowAttentionWorkspace(p))
    {
        int const splits = fitSplits(p, n,
            pd == kFloat32 ? residentSplitBlocks<T, S, float>()
                           : residentSplitBlocks<T, S, typename Narrow<T>::type>());
        size_t const ring = size_t(p.batch) * p.heads * p.ring * sizeof(S);
        if (io.present_key != io.past_key
            && cudaMemcpyAsync(io.present_key, io.past_key, ring * p.d, cudaMemcpyDeviceToDevice, stream)
                != cudaSuccess)
            return kCudaError;
        if (io.present_value != io.past_value
            && cudaMemcpyAsync(io.present_value, io.past_value, ring * p.dv, cudaMemcpyDeviceToDevice, stream)
                != cudaSuccess)
            return kCudaError;
        dim3 const grid(unsigned(splits), unsigned(p.heads), unsigned(p.batch));
        if (pd == kFloat32)
            windowSplitKernel<T, S, float><<<grid, kWaThreads, 0, stream>>>(p, dil, io, ws);
        else
            windowSplitKernel<T, S, typename Narrow<T>::type><<<grid, kWaThreads, 0, stream>>>(p, dil, io, ws);
        windowMergeKernel<T, S>
            <<<dim3(unsigned(p.heads), unsigned(p.batch)), kMaxHeadDim, 0, stream>>>(p, io, ws, splits);
        return launchStatus();
    }
    dim3 const grid(unsigned(p.batch) * unsigned(p.heads));
    if (pd == kFloat32)
        windowAttentionKernel<T, S, float><<<grid, kWaThreads, 0, stream>>>(p, dil, io);
    else
        windowAttentionKernel<T, S, typename Narrow<T>::type><<<grid, kWaThreads, 0, stream>>>(p, dil, io);
    return launchStatus();
}

} // namespace

size_t windowAttentionWorkspace(attn::WindowParams const& p)
{
    int const splits = windowSplits(p);
    return splits > 1 ? size_t(p.batch) * p.heads * splits * (p.dv + 2) * sizeof(float) : 0;
}

int windowAttention(attn::WindowParams const& p, int32_t const* dilation, WindowAttentionIO const& io, DType dtype,
    DType ring_dtype, DType persistent_dtype, void* workspace, size_t workspace_bytes, cudaStream_t stream)
{
    if (int const st = attn::check(p, dilation))
        return st;
    if (p.heads > kMaxHeads || !validDType(dtype) || !validState(ring_dtype, dtype)
        || !validState(persistent_dtype, dtype))
        return kUnsupported;
    if (p.batch == 0)
        return kOk;
    Dilation dil{};
    for (int h = 0; h < p.heads; ++h)
        dil.v[h] = dilation[h];
    float* ws = reinterpret_cast<uintptr_t>(workspace) % 256 == 0 ? static_cast<float*>(workspace) : nullptr;
    return withType(dtype,
        [&](auto t)
        {
            using T = decltype(t);
            return ring_dtype == kFloat32
                ? launchWindow<T, float>(p, dil, io, persistent_dtype, ws, workspace_bytes, stream)
                : launchWindow<T, typename Narrow<T>::type>(p, dil, io, persistent_dtype, ws, workspace_bytes, stream);
        });
}

} // namespace cuda
} // namespace edgemem

EM_CUDA_API int em_cuda_window_attention(edgemem::attn::WindowParams const* p, int32_t const* dilation,
    edgemem::WindowAttentionIO const* io, int dtype, int ring_dtype, int persistent_dtype, void* workspace,
    size_t workspace_bytes, void* stream)
{
    using edgemem::DType;
    return edgemem::cuda::windowAttention(*p, dilation, *io, DType(dtype), DType(ring_dtype), DType(persistent_dtype),
        workspace, workspace_bytes, static_cast<cudaStream_t>(stream));
}

EM_CUDA_API size_t em_cuda_window_attention_workspace(edgemem::attn::WindowParams const* p)
{
    return edgemem::cuda::windowAttentionWorkspace(*p);
}
