// Host launchers of the edgemem CUDA kernels: raw device pointers and a cudaStream_t.
// Each returns an edgemem::Status (0 = launched). Outputs may alias the matching state
// inputs (present_* == past_*): every kernel reads a state element before it writes it, and
// each state element is read and written by one owner only (a warp's lane, a thread block),
// so binding state-in and state-out to one buffer is safe.
#pragma once

#include <cuda_runtime_api.h>

#include "edgemem/attention.h"
#include "edgemem/io.h"
#include "edgemem/linear_attention.h"
#include "edgemem/neural_memory.h"

namespace edgemem
{
namespace cuda
{

// LinearAttention, T >= 1 tokens. Two forms: sequential (the tokens one after another with the
// state in registers: decode steps, short prompts) and chunked (linear_attention_chunk.cu: tensor
// cores, needs a workspace, per-head decay, d_k <= 128, sm_80 or later). kAuto takes the chunked
// form where it applies and chunkedPays says so; kChunked returns kUnsupported where it does not
// apply. io dtype: query/key/value/decay/beta/output.
enum class LaPath : int
{
    kAuto = 0,
    kSequential = 1,
    kChunked = 2,
};
// kAuto's choice, from measurement (benchmarks/README.md): the chunked form from kChunkedFrom
// tokens on, while batch x kv heads is at most kChunkedMaxHeads (beyond, the sequential kernel's
// blocks alone fill the GPU and it keeps up).
constexpr int kChunkedFrom = 128;
constexpr int64_t kChunkedMaxHeads = 64;
inline bool chunkedPays(la::Params const& p)
{
    return p.seq >= kChunkedFrom && int64_t(p.batch) * p.kv_heads <= kChunkedMaxHeads;
}
// Workspace bytes a call on `path` uses for p (0: none); fewer bytes, down to one chunk's worth,
// run the chunked form in shorter segments.
size_t linearAttentionWorkspace(la::Params const& p, LaPath path = LaPath::kAuto);
int linearAttention(la::Params const& p, LinearAttentionIO const& io, DType dtype, void* workspace,
    size_t workspace_bytes, cudaStream_t stream, LaPath path = LaPath::kAuto);
int linearAttentionChunked(la::Params const& p, LinearAttentionIO const& io, DType dtype, void* workspace,
    size_t workspace_bytes, cudaStream_t stream);

// WindowAttention: T tokens continuing a ring buffer. dilation: host array of p.heads ints.
// A single token (decode) splits its keys over blocks where the workspace holds
// windowAttentionWorkspace(p) bytes (256-byte aligned); else one block per head runs them.
size_t windowAttentionWorkspace(attn::WindowParams const& p);
int windowAttention(attn::WindowParams const& p, int32_t const* dilation, WindowAttentionIO const& io, DType dtype,
    DType ring_dtype, DType persistent_dtype, void* workspace, size_t workspace_bytes, cudaStream_t stream);

// BandedAttention over a whole sequence (prefill / encoder). dilation: host array.
int bandedAttention(attn::BandedParams const& p, int32_t const* dilation, BandedAttentionIO const& io, DType dtype,
    DType persistent_dtype, cudaStream_t stream);

// NeuralMemory, T >= 1 tokens. Depth 1 reads and writes the first layer only.
int neuralMemory(nm::Params const& p, NeuralMemoryIO const& io, DType dtype, cudaStream_t stream);

} // namespace cuda
} // namespace edgemem

// C ABI of the same launchers (libedgemem_kernels.so), mirroring the CPU reference's, for
// tests and benchmarks driven from Python. stream: a cudaStream_t (0 = the legacy stream).
#if defined(_WIN32)
#define EM_CUDA_API extern "C" __declspec(dllexport)
#else
#define EM_CUDA_API extern "C" __attribute__((visibility("default")))
#endif

EM_CUDA_API int em_cuda_abi_version();
// path: an edgemem::cuda::LaPath; workspace: device memory, 256-byte aligned (may be null).
EM_CUDA_API int em_cuda_linear_attention(edgemem::la::Params const* p, edgemem::LinearAttentionIO const* io, int dtype,
    int path, void* workspace, size_t workspace_bytes, void* stream);
EM_CUDA_API size_t em_cuda_linear_attention_workspace(edgemem::la::Params const* p, int path);
// workspace: device memory, 256-byte aligned (may be null: no decode split).
EM_CUDA_API int em_cuda_window_attention(edgemem::attn::WindowParams const* p, int32_t const* dilation,
    edgemem::WindowAttentionIO const* io, int dtype, int ring_dtype, int persistent_dtype, void* workspace,
    size_t workspace_bytes, void* stream);
EM_CUDA_API size_t em_cuda_window_attention_workspace(edgemem::attn::WindowParams const* p);
EM_CUDA_API int em_cuda_banded_attention(edgemem::attn::BandedParams const* p, int32_t const* dilation,
    edgemem::BandedAttentionIO const* io, int dtype, int persistent_dtype, int, void* stream);
EM_CUDA_API int em_cuda_neural_memory(
    edgemem::nm::Params const* p, edgemem::NeuralMemoryIO const* io, int dtype, int, int, void* stream);
// Peak DRAM bandwidth of a device in GB/s from its memory clock and bus width (0 on error).
EM_CUDA_API double em_cuda_peak_bandwidth_gbs(int device);
