// What the CPU reference of every op shares: float32 views of the ABI's void pointers, one
// attention row's online softmax, and the struct layout record behind em_ref_abi_layout (core/abi.h).
// The reference runs the op math of each <op>/ header with plain loops, one owner per value
// column / query row / head holding every row (SerialSum), so it checks the same formulas the
// kernels run without a GPU. Float32 I/O only; each function returns 0 or an edgemem::Status.
#pragma once

#include "core/common.h"

#include <cstddef>
#include <string>
#include <vector>

namespace edgemem
{
namespace ref
{

inline float const* F(void const* p) { return static_cast<float const*>(p); }
inline float* F(void* p) { return static_cast<float*>(p); }

// Attention: one online softmax per query row.
struct Row
{
    SoftmaxState st = softmax_empty();
    std::vector<float> acc;
    explicit Row(int dv)
        : acc(dv, 0.0f)
    {
    }
    void add(float const* q, float const* key, float const* value, int d, float scale)
    {
        float dot = 0.0f;
        for (int i = 0; i < d; ++i)
            dot += q[i] * key[i];
        float rescale;
        float const w = softmax_add(st, scale * dot, rescale);
        for (size_t j = 0; j < acc.size(); ++j)
            acc[j] = acc[j] * rescale + w * value[j];
    }
    void write(float* out) const
    {
        for (size_t j = 0; j < acc.size(); ++j)
            out[j] = acc[j] / st.l;
    }
};

// Lines of em_ref_abi_layout: "<struct> <sizeof>", then "<struct>.<field> <offsetof>" per field.
struct Layout
{
    std::string text;
    void add(char const* name, size_t value) { text += std::string(name) + ' ' + std::to_string(value) + '\n'; }
};

// Each op's structs, in its <op>/reference.cpp.
#define EM_OP(Name, op) void layout_##op(Layout& out);
#include "ops.def"
#undef EM_OP

} // namespace ref
} // namespace edgemem

#define EM_LAYOUT_STRUCT(out, S) (out).add(#S, sizeof(S))
#define EM_LAYOUT_FIELD(out, S, f) (out).add(#S "." #f, offsetof(S, f))
