// LinearAttention: the node's tensors, the CUDA launchers (raw device pointers, a cudaStream_t)
// and the C ABI of the kernels (libedgemem_kernels.so) and of the CPU reference
// (libedgemem_reference.so, float32 host tensors).
// Each launcher returns an edgemem::Status (0 = launched). Outputs may alias the matching state
// inputs (present_* == past_*): every kernel reads a state element before it writes it, and each
// state element is read and written by one owner only, so state-in and state-out may be one buffer.
#pragma once

#include "core/io.h"
#include "linear_attention/linear_attention.h"

namespace edgemem
{

struct LinearAttentionIO
{
    void const* query;       // T
    void const* key;         // T
    void const* value;       // T
    float const* past_state; // float32
    void const* decay;       // T
    void const* beta;        // T
    void* output;            // T
    float* present_state;    // float32; may equal past_state
};

namespace cuda
{

// LinearAttention, T >= 1 tokens. Two forms: sequential (the tokens one after another with the
// state in registers: decode steps, short prompts) and chunked (linear_attention_chunk.cu: tensor
// cores, needs a workspace, d_k <= 128, sm_80 or later). kAuto takes the chunked
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
// blocks alone fill the GPU and it keeps up), for per-head decay: the per-key form has not been
// timed on a GPU yet, so kAuto keeps the sequential kernel there.
constexpr int kChunkedFrom = 128;
constexpr int64_t kChunkedMaxHeads = 64;
inline bool chunkedPays(la::Params const& p)
{
    return p.seq >= kChunkedFrom && int64_t(p.batch) * p.kv_heads <= kChunkedMaxHeads && !la::keyedDecay(p);
}
// Workspace bytes a call on `path` uses for p (0: none); fewer bytes, down to one chunk's worth,
// run the chunked form in shorter segments.
size_t linearAttentionWorkspace(la::Params const& p, LaPath path = LaPath::kAuto);
int linearAttention(la::Params const& p, LinearAttentionIO const& io, DType dtype, void* workspace,
    size_t workspace_bytes, cudaStream_t stream, LaPath path = LaPath::kAuto);
int linearAttentionChunked(la::Params const& p, LinearAttentionIO const& io, DType dtype, void* workspace,
    size_t workspace_bytes, cudaStream_t stream);

} // namespace cuda
} // namespace edgemem

// path: an edgemem::cuda::LaPath; workspace: device memory, 256-byte aligned (may be null).
EM_CUDA_API int em_cuda_linear_attention(edgemem::la::Params const* p, edgemem::LinearAttentionIO const* io, int dtype,
    int path, void* workspace, size_t workspace_bytes, void* stream);
EM_CUDA_API size_t em_cuda_linear_attention_workspace(edgemem::la::Params const* p, int path);

EM_REF_API int em_ref_linear_attention(edgemem::la::Params const* params, edgemem::LinearAttentionIO const* io);
// The chunked form the CUDA prefill runs, in segments sized to `budget` workspace bytes (0: the
// default); kUnsupported for d_k > 128 or a budget below one chunk.
EM_REF_API int em_ref_linear_attention_chunked(
    edgemem::la::Params const* params, edgemem::LinearAttentionIO const* io, int64_t budget);
// Workspace bytes the chunked form lays out for p in one segment (0: it does not apply), as the kernels'.
EM_REF_API size_t em_ref_linear_attention_workspace(edgemem::la::Params const* params);
