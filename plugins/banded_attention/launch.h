// BandedAttention: the node's tensors, the CUDA launcher (raw device pointers, a cudaStream_t) and
// the C ABI of the kernel (libedgemem_kernels.so) and of the CPU reference (libedgemem_reference.so).
// Each launcher returns an edgemem::Status (0 = launched).
#pragma once

#include "core/attention.h"
#include "core/io.h"

namespace edgemem
{

struct BandedAttentionIO
{
    void const* query;            // T
    void const* key;              // T
    void const* value;            // T
    bool const* global_mask;      // [B, T]
    void const* persistent_key;   // P (may be null when P = 0)
    void const* persistent_value; // P
    void* output;                 // T
};

namespace cuda
{
// BandedAttention over a whole sequence (prefill / encoder). dilation: host array.
int bandedAttention(attn::BandedParams const& p, int32_t const* dilation, BandedAttentionIO const& io, DType dtype,
    DType persistent_dtype, cudaStream_t stream);
} // namespace cuda
} // namespace edgemem

EM_CUDA_API int em_cuda_banded_attention(edgemem::attn::BandedParams const* p, int32_t const* dilation,
    edgemem::BandedAttentionIO const* io, int dtype, int persistent_dtype, int, void* stream);
EM_REF_API int em_ref_banded_attention(
    edgemem::attn::BandedParams const* params, int32_t const* dilation, edgemem::BandedAttentionIO const* io);
