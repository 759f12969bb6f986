// CPU reference of the edgemem ops: the same math headers the CUDA kernels use, compiled by a
// plain C++17 compiler, behind a small C ABI (float32 tensors in host memory; int64 positions;
// bool global mask). Each function returns 0 on success or an edgemem::Status code.
// Outputs may alias the matching state inputs (present_* == past_*), as in the kernels.
#pragma once

#include "edgemem/attention.h"
#include "edgemem/io.h"
#include "edgemem/linear_attention.h"
#include "edgemem/neural_memory.h"

#if defined(_WIN32)
#define EM_REF_API extern "C" __declspec(dllexport)
#else
#define EM_REF_API extern "C" __attribute__((visibility("default")))
#endif

EM_REF_API int em_ref_abi_version();
EM_REF_API int em_ref_linear_attention(edgemem::la::Params const* params, edgemem::LinearAttentionIO const* io);
// The chunked form the CUDA prefill runs, in segments sized to `budget` workspace bytes (0: the
// default); kUnsupported for per-key decay, d_k > 128 or a budget below one chunk.
EM_REF_API int em_ref_linear_attention_chunked(
    edgemem::la::Params const* params, edgemem::LinearAttentionIO const* io, int64_t budget);
// Workspace bytes the chunked form lays out for p in one segment (0: it does not apply), as the kernels'.
EM_REF_API size_t em_ref_linear_attention_workspace(edgemem::la::Params const* params);
EM_REF_API int em_ref_window_attention(
    edgemem::attn::WindowParams const* params, int32_t const* dilation, edgemem::WindowAttentionIO const* io);
EM_REF_API int em_ref_banded_attention(
    edgemem::attn::BandedParams const* params, int32_t const* dilation, edgemem::BandedAttentionIO const* io);
EM_REF_API int em_ref_neural_memory(edgemem::nm::Params const* params, edgemem::NeuralMemoryIO const* io);
