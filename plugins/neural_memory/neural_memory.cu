// NeuralMemory kernel: decode step (T = 1) and sequential prefill (T > 1), one kernel; the node's
// launchers around it and the chunked kernel (neural_memory_chunk.cu).
//
// A block per (batch, head) owns that head's memory (W, S, C of one or two layers) and runs
// the tokens in order. Per token, in phases separated by __syncthreads():
//   forward at the chunk weights   h = k C1 (+ act, z = a C2)   column sums, thread per column
//   dl/dz                          one warp, edgemem/neural_memory.h (LayerNorm backward)
//   back through layer 2           dh = (C2 dz) * act'(h)        warp per row
//   update layer 1, then layer 2   S <- eta S - theta grad, W <- (1 - alpha) W + S, and at a
//                                  chunk start C <- W; fused with the read-out column sums
//                                  hq = q W1_new (+ act, zq = aq W2_new)
//   read-out                       one warp, y = zq or q + gamma LN(zq) + beta
// In the update phases every state element is read and written by one thread only, and all
// reads of C happen in earlier phases, so the state may be updated in place (present == past).
// Column sums with fewer columns than threads split the rows over thread groups and add the
// partial sums in shared memory; a warp's threads always read consecutive columns of a row.
// The position output is written by a second, tiny kernel after this one.
#include "device.cuh"
#include "launch.h"

namespace edgemem
{
namespace cuda
{
namespace
{

constexpr int kNmThreads = 512;
constexpr int kNmWarps = kNmThreads / kWarp;
constexpr int kPerLane = kMaxHeadDim / kWarp; // 8: a row of D <= 256 over one warp

// out[c] = sum_r f(r, c) for c < cols; f visits every (r, c) exactly once. Ends synchronised.
template <class F>
__device__ __forceinline__ void columnSums(int rows, int cols, float* out, float* scratch, F const& f)
{
    int const tid = threadIdx.x;
    int const nt = blockDim.x;
    if (cols >= nt)
    {
        for (int c = tid; c < cols; c += nt)
        {
            float acc = 0.0f;
            for (int r = 0; r < rows; ++r)
                acc += f(r, c);
            out[c] = acc;
        }
    }
    else
    {
        int const groups = nt / cols;
        int const g = tid / cols;
        int const c = tid % cols;
        if (g < groups)
        {
            float acc = 0.0f;
            for (int r = g; r < rows; r += groups)
                acc += f(r, c);
            scratch[g * cols + c] = acc;
        }
        __syncthreads();
        for (int c2 = tid; c2 < cols; c2 += nt)
        {
            float acc = 0.0f;
            for (int g2 = 0; g2 < groups; ++g2)
                acc += scratch[g2 * cols + c2];
            out[c2] = acc;
        }
    }
    __syncthreads();
}

// One state element's update; returns the new weight.
__device__ __forceinline__ float updateElement(
    MemoryLayer const& L, int64_t idx, float grad, float eta, float theta, float alpha, bool first, bool start)
{
    float w = first ? L.w_in[idx] : L.w_out[idx];
    float s = first ? L.s_in[idx] : L.s_out[idx];
    if (start)
        L.c_out[idx] = w; // chunk weights = the weights before this token's update
    else if (first && L.c_out != L.c_in)
        L.c_out[idx] = L.c_in[idx];
    nm::momentumUpdate(w, s, grad, eta, theta, alpha);
    L.w_out[idx] = w;
    L.s_out[idx] = s;
    return w;
}

template <typename T>
__global__ void __launch_bounds__(kNmThreads, 1) neuralMemoryKernel(nm::Params const p, NeuralMemoryIO const io)
{
    extern __shared__ float smem[];
    int const D = p.d;
    int const E = p.e;
    float* k = smem;
    float* v = k + D;
    float* q = v + D;
    float* z = q + D;
    float* dz = z + D;
    float* zq = dz + D;
    float* hid = zq + D;
    float* act = hid + E;
    float* dh = act + E;
    float* hq = dh + E;
    float* scratch = hq + E; // blockDim.x floats

    int const tid = threadIdx.x;
    int const lane = tid & (kWarp - 1);
    int const warp = tid / kWarp;
    int const b = blockIdx.x / p.heads;
    int const h = blockIdx.x % p.heads;
    bool const norm = p.residual_norm != 0;
    bool const deep = p.depth == 2;
    int64_t const off = (int64_t(b) * p.heads + h) * int64_t(D) * E; // both layers hold D*E elements
    MemoryLayer const L[2] = {memoryLayer(p, io, 0, off), memoryLayer(p, io, 1, off)};
    int64_t const p0 = io.position[p.position_per_batch ? b : 0];
    WarpSum const allsum;

    for (int t = 0; t < p.seq; ++t)
    {
        bool const first = t == 0;
        bool const start = nm::chunkStart(p0 + t, p.chunk);
        int64_t const row = attn::rowOffset(p.seq, p.heads, D, b, t, h);
        int64_t const gate = (int64_t(b) * p.seq + t) * p.heads + h;
        float const theta = load<T>(io.theta, gate);
        float const eta = load<T>(io.eta, gate);
        float const alpha = load<T>(io.alpha, gate);
        for (int i = tid; i < D; i += blockDim.x)
        {
            k[i] = load<T>(io.key, row + i);
            v[i] = load<T>(io.value, row + i);
            q[i] = load<T>(io.query, row + i);
        }
        __syncthreads();

        // forward at the chunk weights (the current weights when this token starts a chunk)
        float const* c1 = start ? (first ? L[0].w_in : L[0].w_out) : (first ? L[0].c_in : L[0].c_out);
        float const* c2 = start ? (first ? L[1].w_in : L[1].w_out) : (first ? L[1].c_in : L[1].c_out);
        if (!deep)
            columnSums(D, D, z, scratch, [&](int r, int c) { return k[r] * c1[int64_t(r) * D + c]; });
        else
        {
            columnSums(D, E, hid, scratch, [&](int r, int c) { return k[r] * c1[int64_t(r) * E + c]; });
            for (int e = tid; e < E; e += blockDim.x)
                act[e] = nm::activate(hid[e], p.activation);
            __syncthreads();
            columnSums(E, D, z, scratch, [&](int r, int c) { return act[r] * c2[int64_t(r) * D + c]; });
        }

        // dl/dz on one warp
        if (warp == 0)
        {
            float zr[kPerLane], kr[kPerLane], vr[kPerLane], gr[kPerLane], br[kPerLane], mr[kPerLane], out[kPerLane];
            EM_UNROLL
            for (int r = 0; r < kPerLane; ++r)
            {
                int const i = lane + r * kWarp;
                bool const in = i < D;
                zr[r] = in ? z[i] : 0.0f;
                kr[r] = in ? k[i] : 0.0f;
                vr[r] = in ? v[i] : 0.0f;
                gr[r] = in && norm ? io.norm_weight[int64_t(h) * D + i] : 1.0f;
                br[r] = in && norm ? io.norm_bias[int64_t(h) * D + i] : 0.0f;
                mr[r] = in ? 1.0f : 0.0f;
            }
            nm::outputDelta<kPerLane>(zr, kr, vr, gr, br, mr, D, norm, allsum, out);
            EM_UNROLL
            for (int r = 0; r < kPerLane; ++r)
                if (lane + r * kWarp < D)
                    dz[lane + r * kWarp] = out[r];
        }
        __syncthreads();

        if (deep) // dh = (C2 dz) * act'(h), a warp per row of C2
        {
            for (int e = warp; e < E; e += kNmWarps)
            {
                float acc = 0.0f;
                for (int c = lane; c < D; c += kWarp)
                    acc += c2[int64_t(e) * D + c] * dz[c];
                acc = allsum(acc);
                if (lane == 0)
                    dh[e] = acc * nm::activateGrad(hid[e], p.activation);
            }
            __syncthreads();
        }

        // updates fused with the read-out at the new weights
        float const* g1 = deep ? dh : dz;
        columnSums(D, E, hq, scratch, [&](int r, int c)
            { return q[r] * updateElement(L[0], int64_t(r) * E + c, k[r] * g1[c], eta, theta, alpha, first, start); });
        float const* zread = hq;
        if (deep)
        {
            for (int e = tid; e < E; e += blockDim.x)
                hq[e] = nm::activate(hq[e], p.activation);
            __syncthreads();
            columnSums(E, D, zq, scratch,
                [&](int r, int c) {
                    return hq[r]
                        * updateElement(L[1], int64_t(r) * D + c, act[r] * dz[c], eta, theta, alpha, first, start);
                });
            zread = zq;
        }

        if (warp == 0)
        {
            float zr[kPerLane], xr[kPerLane], gr[kPerLane], br[kPerLane], mr[kPerLane], y[kPerLane];
            EM_UNROLL
            for (int r = 0; r < kPerLane; ++r)
            {
                int const i = lane + r * kWarp;
                bool const in = i < D;
                zr[r] = in ? zread[i] : 0.0f;
                xr[r] = in ? q[i] : 0.0f;
                gr[r] = in && norm ? io.norm_weight[int64_t(h) * D + i] : 1.0f;
                br[r] = in && norm ? io.norm_bias[int64_t(h) * D + i] : 0.0f;
                mr[r] = in ? 1.0f : 0.0f;
            }
            nm::readOut<kPerLane>(zr, xr, gr, br, mr, D, norm, allsum, y);
            EM_UNROLL
            for (int r = 0; r < kPerLane; ++r)
                if (lane + r * kWarp < D)
                    store<T>(io.output, row + lane + r * kWarp, y[r]);
        }
        __syncthreads(); // shared vectors are rewritten by the next token
    }
}

__global__ void advancePositionKernel(int64_t const* position, int64_t* present_position, int n, int seq)
{
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        present_position[i] = position[i] + seq;
}

size_t sharedBytes(nm::Params const& p) { return (6 * size_t(p.d) + 4 * size_t(p.e) + kNmThreads) * sizeof(float); }

template <typename T>
int launch(nm::Params const& p, NeuralMemoryIO const& io, cudaStream_t stream)
{
    size_t const smem = sharedBytes(p);
    if (smem > 48 * 1024)
    {
        if (cudaFuncSetAttribute(neuralMemoryKernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem))
            != cudaSuccess)
            return kUnsupported;
    }
    neuralMemoryKernel<T><<<unsigned(p.batch) * unsigned(p.heads), kNmThreads, smem, stream>>>(p, io);
    return launchStatus();
}

// The node around a kernel: the checks, an empty call's state copy, the position output.
template <class Kernel>
int node(nm::Params const& p, NeuralMemoryIO const& io, DType dtype, cudaStream_t stream, Kernel const& kernel)
{
    if (dtype != kFloat32 && dtype != kFloat16 && dtype != kBFloat16)
        return kUnsupported;
    if (p.batch == 0)
        return kOk;
    if (p.seq == 0)
    {
        for (int l = 0; l < p.depth; ++l)
        {
            size_t const bytes = size_t(p.batch) * p.heads * p.d * p.e * sizeof(float);
            float const* in[3] = {io.weights[l], io.momentum[l], io.chunk_weights[l]};
            float* out[3] = {io.present_weights[l], io.present_momentum[l], io.present_chunk_weights[l]};
            for (int x = 0; x < 3; ++x)
                if (out[x] != in[x]
                    && cudaMemcpyAsync(out[x], in[x], bytes, cudaMemcpyDeviceToDevice, stream) != cudaSuccess)
                    return kCudaError;
        }
    }
    else if (int const st = kernel())
        return st;
    int const n = p.position_per_batch ? p.batch : 1;
    advancePositionKernel<<<1, kWarp, 0, stream>>>(io.position, io.present_position, n, p.seq);
    return launchStatus();
}

} // namespace

int neuralMemory(nm::Params const& p, NeuralMemoryIO const& io, DType dtype, cudaStream_t stream)
{
    if (int const st = nm::check(p))
        return st;
    return node(p, io, dtype, stream,
        [&] { return withType(dtype, [&](auto t) { return launch<decltype(t)>(p, io, stream); }); });
}

int neuralMemoryChunked(nm::Params const& p, NeuralMemoryIO const& io, DType dtype, cudaStream_t stream)
{
    if (int const st = nm::check(p))
        return st;
    if (!nm::pieceable(p))
        return kUnsupported;
    return node(p, io, dtype, stream, [&] { return neuralMemoryPieces(p, io, dtype, stream); });
}

int neuralMemoryPrefill(nm::Params const& p, NeuralMemoryIO const& io, DType dtype, cudaStream_t stream)
{
    if (piecesPay(p))
        if (int const st = neuralMemoryChunked(p, io, dtype, stream); st != kUnsupported)
            return st;
    return neuralMemory(p, io, dtype, stream);
}

} // namespace cuda
} // namespace edgemem

EM_CUDA_API int em_cuda_neural_memory(
    edgemem::nm::Params const* p, edgemem::NeuralMemoryIO const* io, int dtype, int, int, void* stream)
{
    return edgemem::cuda::neuralMemory(*p, *io, edgemem::DType(dtype), static_cast<cudaStream_t>(stream));
}

EM_CUDA_API int em_cuda_neural_memory_chunked(
    edgemem::nm::Params const* p, edgemem::NeuralMemoryIO const* io, int dtype, int, int, void* stream)
{
    return edgemem::cuda::neuralMemoryChunked(*p, *io, edgemem::DType(dtype), static_cast<cudaStream_t>(stream));
}
