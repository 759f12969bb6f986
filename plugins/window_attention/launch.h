// WindowAttention: the node's tensors, the CUDA launcher (raw device pointers, a cudaStream_t) and
// the C ABI of the kernel (libedgemem_kernels.so) and of the CPU reference (libedgemem_reference.so).
// Each launcher returns an edgemem::Status (0 = launched). Outputs may alias the matching state
// inputs (present_* == past_*): every kernel reads a state element before it writes it, and each
// state element is read and written by one owner only, so state-in and state-out may be one buffer.
#pragma once

#include "core/attention.h"
#include "core/io.h"

namespace edgemem
{

struct WindowAttentionIO
{
    void const* query;            // T
    void const* key;              // T
    void const* value;            // T
    void const* past_key;         // S (ring)
    void const* past_value;       // S
    int64_t const* position;      // [B]
    void const* persistent_key;   // P (may be null when P = 0)
    void const* persistent_value; // P
    void* output;                 // T
    void* present_key;            // S; may equal past_key
    void* present_value;          // S; may equal past_value
};

namespace cuda
{
// T tokens continuing a ring buffer. dilation: host array of p.heads ints. A single token (decode)
// splits its keys over blocks where the workspace holds windowAttentionWorkspace(p) bytes
// (256-byte aligned); else one block per head runs them.
size_t windowAttentionWorkspace(attn::WindowParams const& p);
int windowAttention(attn::WindowParams const& p, int32_t const* dilation, WindowAttentionIO const& io, DType dtype,
    DType ring_dtype, DType persistent_dtype, void* workspace, size_t workspace_bytes, cudaStream_t stream);
} // namespace cuda
} // namespace edgemem

// workspace: device memory, 256-byte aligned (may be null: no decode split).
EM_CUDA_API int em_cuda_window_attention(edgemem::attn::WindowParams const* p, int32_t const* dilation,
    edgemem::WindowAttentionIO const* io, int dtype, int ring_dtype, int persistent_dtype, void* workspace,
    size_t workspace_bytes, void* stream);
EM_CUDA_API size_t em_cuda_window_attention_workspace(edgemem::attn::WindowParams const* p);
EM_REF_API int em_ref_window_attention(
    edgemem::attn::WindowParams const* params, int32_t const* dilation, edgemem::WindowAttentionIO const* io);
