// Tensor pointers of one call of each op, in the order of the ONNX node's inputs and outputs.
// Plain pointers: the CPU reference takes host memory, the CUDA launchers device memory.
// Element types follow the node contract; the launchers take the dtypes separately.
#pragma once

#include <cstdint>

namespace edgemem
{

enum DType : int32_t
{
    kFloat32 = 0,
    kFloat16 = 1,
};

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

struct NeuralMemoryIO
{
    void const* query;         // T
    void const* key;           // T
    void const* value;         // T
    void const* theta;         // T
    void const* eta;           // T
    void const* alpha;         // T
    int64_t const* position;   // [B] or [1]
    float const* norm_weight;  // [H, D]
    float const* norm_bias;    // [H, D]
    float const* weights[2];   // layer 1, layer 2 (unused for depth 1)
    float const* momentum[2];
    float const* chunk_weights[2];
    void* output;              // T
    int64_t* present_position; // may equal position
    float* present_weights[2]; // each may equal its input
    float* present_momentum[2];
    float* present_chunk_weights[2];
};

} // namespace edgemem
