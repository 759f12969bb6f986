// NeuralMemory: the node's tensors, the CUDA launcher (raw device pointers, a cudaStream_t) and the
// C ABI of the kernel (libedgemem_kernels.so) and of the CPU reference (libedgemem_reference.so).
// Each launcher returns an edgemem::Status (0 = launched). Outputs may alias the matching state
// inputs (present_* == past_*): every kernel reads a state element before it writes it, and each
// state element is read and written by one owner only, so state-in and state-out may be one buffer.
#pragma once

#include "core/attention.h"
#include "core/io.h"
#include "neural_memory/neural_memory.h"

namespace edgemem
{

struct NeuralMemoryIO
{
    void const* query;        // T
    void const* key;          // T
    void const* value;        // T
    void const* theta;        // T
    void const* eta;          // T
    void const* alpha;        // T
    int64_t const* position;  // [B] or [1]
    float const* norm_weight; // [H, D]
    float const* norm_bias;   // [H, D]
    float const* weights[2];  // layer 1, layer 2 (unused for depth 1)
    float const* momentum[2];
    float const* chunk_weights[2];
    void* output;              // T
    int64_t* present_position; // may equal position
    float* present_weights[2]; // each may equal its input
    float* present_momentum[2];
    float* present_chunk_weights[2];
};

// One layer's state tensors of the (batch, head) at element offset `off` (both layers hold D*E
// elements a head); all null for depth 1's second layer.
struct MemoryLayer
{
    float const* w_in;
    float const* s_in;
    float const* c_in;
    float* w_out;
    float* s_out;
    float* c_out;
};

EM_HD MemoryLayer memoryLayer(nm::Params const& p, NeuralMemoryIO const& io, int l, int64_t off)
{
    if (l == 1 && p.depth == 1)
        return MemoryLayer{};
    return MemoryLayer{io.weights[l] + off, io.momentum[l] + off, io.chunk_weights[l] + off,
        io.present_weights[l] + off, io.present_momentum[l] + off, io.present_chunk_weights[l] + off};
}

namespace cuda
{
// T >= 1 tokens. Depth 1 reads and writes the first layer only. The sequential kernel: the tokens
// in order, one block per (batch, head).
int neuralMemory(nm::Params const& p, NeuralMemoryIO const& io, DType dtype, cudaStream_t stream);
// The chunked form (neural_memory_chunk.cu: pieces of up to 16 tokens as tensor-core products, sm_80
// or later); kUnsupported where it does not apply: d or e not a multiple of 16, state tensors not
// 32-byte aligned, or more shared memory than the device gives a block.
int neuralMemoryChunked(nm::Params const& p, NeuralMemoryIO const& io, DType dtype, cudaStream_t stream);
// The chunked kernel alone (T >= 1, B >= 1, sizes checked): launched, or kUnsupported.
int neuralMemoryPieces(nm::Params const& p, NeuralMemoryIO const& io, DType dtype, cudaStream_t stream);
// The plugin's prefill: the chunked form where it applies and piecesPay says so, else the
// sequential kernel. piecesPay, from measurement (benchmarks/README.md): a piece costs what a few
// sequential tokens cost, so the chunked form wins once a call holds a whole piece and chunks are
// that long (shorter chunks cut every piece short).
inline bool piecesPay(nm::Params const& p) { return p.seq >= nm::kPieceRows && p.chunk >= nm::kPieceRows; }
int neuralMemoryPrefill(nm::Params const& p, NeuralMemoryIO const& io, DType dtype, cudaStream_t stream);
} // namespace cuda
} // namespace edgemem

EM_CUDA_API int em_cuda_neural_memory(
    edgemem::nm::Params const* p, edgemem::NeuralMemoryIO const* io, int dtype, int, int, void* stream);
EM_CUDA_API int em_cuda_neural_memory_chunked(
    edgemem::nm::Params const* p, edgemem::NeuralMemoryIO const* io, int dtype, int, int, void* stream);
EM_REF_API int em_ref_neural_memory(edgemem::nm::Params const* params, edgemem::NeuralMemoryIO const* io);
// The chunked form the CUDA prefill runs (neural_memory.h); kUnsupported where d or e is not a multiple of 16.
EM_REF_API int em_ref_neural_memory_chunked(edgemem::nm::Params const* params, edgemem::NeuralMemoryIO const* io);
