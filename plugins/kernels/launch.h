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

// LinearAttention, T >= 1 tokens (T = 1 is the decode step; T > 1 runs the tokens in
// sequence with the state held in registers). io dtype: query/key/value/decay/beta/output.
int linearAttention(la::Params const& p, LinearAttentionIO const& io, DType dtype, cudaStream_t stream);

// WindowAttention: T tokens continuing a ring buffer. dilation: host array of p.heads ints.
int windowAttention(attn::WindowParams const& p, int32_t const* dilation, WindowAttentionIO const& io, DType dtype,
    DType ring_dtype, DType persistent_dtype, cudaStream_t stream);

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
EM_CUDA_API int em_cuda_linear_attention(
    edgemem::la::Params const* p, edgemem::LinearAttentionIO const* io, int dtype, int, int, void* stream);
EM_CUDA_API int em_cuda_window_attention(edgemem::attn::WindowParams const* p, int32_t const* dilation,
    edgemem::WindowAttentionIO const* io, int dtype, int ring_dtype, int persistent_dtype, void* stream);
EM_CUDA_API int em_cuda_banded_attention(edgemem::attn::BandedParams const* p, int32_t const* dilation,
    edgemem::BandedAttentionIO const* io, int dtype, int persistent_dtype, int, void* stream);
EM_CUDA_API int em_cuda_neural_memory(
    edgemem::nm::Params const* p, edgemem::NeuralMemoryIO const* io, int dtype, int, int, void* stream);
// Peak DRAM bandwidth of a device in GB/s from its memory clock and bus width (0 on error).
EM_CUDA_API double em_cuda_peak_bandwidth_gbs(int device);
