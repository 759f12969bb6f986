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
// BandedAttention over a whole sequence (prefill / encoder). dilation: host array. A warp per query row.
int bandedAttention(attn::BandedParams const& p, int32_t const* dilation, BandedAttentionIO const& io, DType dtype,
    DType persistent_dtype, cudaStream_t stream);
// The tiled form (banded_attention_tile.cu: blocks of 64 query rows against tiles of keys on tensor
// cores, sm_80 or later; global query rows by the row-per-warp kernel); kUnsupported where it does
// not apply: d or d_v not a multiple of 16 or above 128, or 16-bit I/O whose query, key, value or
// persistent tensors are not 16-byte aligned.
int bandedAttentionTiled(attn::BandedParams const& p, int32_t const* dilation, BandedAttentionIO const& io, DType dtype,
    DType persistent_dtype, cudaStream_t stream);
// The tiled kernel alone (sizes checked, T >= 1): every row but the global ones; kUnsupported below
// sm_80, beyond the device's shared memory or for unaligned 16-bit tensors.
int bandedTiles(attn::BandedParams const& p, int32_t const* dilation, BandedAttentionIO const& io, DType dtype,
    DType persistent_dtype, cudaStream_t stream);
// The plugin's form: the tiled one where it applies and tilesPay says so, else a warp per row.
// tilesPay, from measurement (benchmarks/README.md): the tiled form was timed, and won, from
// kTiledFrom tokens on undilated bands (it scores a dilated band's span densely).
constexpr int kTiledFrom = 1024;
bool tilesPay(attn::BandedParams const& p, int32_t const* dilation);
int bandedAttentionPrefill(attn::BandedParams const& p, int32_t const* dilation, BandedAttentionIO const& io,
    DType dtype, DType persistent_dtype, cudaStream_t stream);
} // namespace cuda
} // namespace edgemem

EM_CUDA_API int em_cuda_banded_attention(edgemem::attn::BandedParams const* p, int32_t const* dilation,
    edgemem::BandedAttentionIO const* io, int dtype, int persistent_dtype, int, void* stream);
EM_CUDA_API int em_cuda_banded_attention_tiled(edgemem::attn::BandedParams const* p, int32_t const* dilation,
    edgemem::BandedAttentionIO const* io, int dtype, int persistent_dtype, int, void* stream);
EM_REF_API int em_ref_banded_attention(
    edgemem::attn::BandedParams const* params, int32_t const* dilation, edgemem::BandedAttentionIO const* io);
// The tiled form the CUDA prefill runs (core/attention.h); kUnsupported where d or d_v is not a
// multiple of 16 or above 128.
EM_REF_API int em_ref_banded_attention_tiled(
    edgemem::attn::BandedParams const* params, int32_t const* dilation, edgemem::BandedAttentionIO const* io);
