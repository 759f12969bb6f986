// Shared host/device helpers for the edgemem op math. No CUDA or TensorRT headers needed:
// the same code compiles under nvcc (kernels) and a plain C++17 compiler (CPU reference).
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define EM_HD __host__ __device__ __forceinline__
#else
#define EM_HD inline
#endif

#if defined(__CUDACC__)
#define EM_UNROLL _Pragma("unroll")
#else
#define EM_UNROLL
#endif

namespace edgemem
{

// Largest head dims the kernels support (per-lane register arrays are sized from these).
constexpr int kMaxHeadDim = 256;
constexpr int kWarp = 32;

// Error codes returned by launchers and the CPU reference (0 = success).
enum Status : int
{
    kOk = 0,
    kBadArgument = 1, // a size or attribute outside the contract
    kUnsupported = 2, // a valid combination this build does not implement (e.g. head dim > 256)
    kCudaError = 3,   // a CUDA launch or copy failed
};

EM_HD float em_exp(float x) { return ::expf(x); }
EM_HD float em_sqrt(float x) { return ::sqrtf(x); }
EM_HD float em_max(float a, float b) { return a > b ? a : b; }
EM_HD float em_erf(float x) { return ::erff(x); }
EM_HD float em_sigmoid(float x) { return 1.0f / (1.0f + ::expf(-x)); }

// The identity "all-reduce": used where one owner holds every term of a sum (CPU reference).
struct SerialSum
{
    EM_HD float operator()(float x) const { return x; }
};

// Online softmax over a stream of scores (flash-attention style, base e).
// m: running maximum, l: running sum of exp(score - m). Empty state: m = -inf, l = 0.
struct SoftmaxState
{
    float m;
    float l;
};

EM_HD SoftmaxState softmax_empty() { return SoftmaxState{-INFINITY, 0.0f}; }

// Adds one finite score. Returns the weight of the new value; `rescale` multiplies the
// accumulated weighted values so that they stay relative to the new maximum.
EM_HD float softmax_add(SoftmaxState& st, float score, float& rescale)
{
    float const m = em_max(st.m, score);
    rescale = em_exp(st.m - m); // exp(-inf) = 0 for the first score
    float const p = em_exp(score - m);
    st.l = st.l * rescale + p;
    st.m = m;
    return p;
}

// Merges partial state b into a; returns the factors for a's and b's accumulators.
EM_HD void softmax_merge(SoftmaxState& a, SoftmaxState const& b, float& fa, float& fb)
{
    float const m = em_max(a.m, b.m);
    fa = a.l > 0.0f ? em_exp(a.m - m) : 0.0f;
    fb = b.l > 0.0f ? em_exp(b.m - m) : 0.0f;
    a.l = a.l * fa + b.l * fb;
    a.m = m;
}

// One row's scores for a tile of keys, N of them held by this owner (the row's other owners
// combine theirs through allmax / allsum; the CPU reference holds them all). A masked score is
// -inf. Updates st, turns s into the weights exp(s - m) and returns the factor for the row's
// accumulated values (1 while every score so far is masked).
template <int N, class AllMax, class AllSum>
EM_HD float softmax_tile(SoftmaxState& st, float (&s)[N], AllMax const& allmax, AllSum const& allsum)
{
    float m = st.m;
    EM_UNROLL
    for (int r = 0; r < N; ++r)
        m = em_max(m, s[r]);
    m = allmax(m);
    bool const none = m == -INFINITY;
    float sum = 0.0f;
    EM_UNROLL
    for (int r = 0; r < N; ++r)
    {
        s[r] = none ? 0.0f : em_exp(s[r] - m);
        sum += s[r];
    }
    sum = allsum(sum); // every owner reaches both reductions, masked or not
    if (none)
        return 1.0f;
    float const rescale = em_exp(st.m - m); // exp(-inf) = 0 for the first unmasked tile
    st.l = st.l * rescale + sum;
    st.m = m;
    return rescale;
}

} // namespace edgemem
