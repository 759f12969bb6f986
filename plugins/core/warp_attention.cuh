// The attention ops' device building block: a warp scores keys one at a time (lanes split the
// head dim: lane l holds dims l, l+32, ...; D, D_v <= 256 so 8 per lane), a warp all-reduce gives
// q.k, and an online softmax (common.h) accumulates the values, so no score vector is materialised.
#pragma once

#include "core/device.cuh"
#include "core/io.h"

namespace edgemem
{
namespace cuda
{

constexpr int kPerLane = kMaxHeadDim / kWarp; // 8

// A warp's running softmax over keys and its weighted sum of values.
struct WarpAttention
{
    float q[kPerLane];
    float acc[kPerLane];
    SoftmaxState st;
    int lane;
    int d;
    int dv;
    float scale;

    template <typename T>
    __device__ __forceinline__ void init(void const* query, int64_t row, int lane_, int d_, int dv_, float scale_)
    {
        lane = lane_;
        d = d_;
        dv = dv_;
        scale = scale_;
        st = softmax_empty();
        EM_UNROLL
        for (int r = 0; r < kPerLane; ++r)
        {
            int const i = lane + r * kWarp;
            q[r] = i < d ? load<T>(query, row + i) : 0.0f;
            acc[r] = 0.0f;
        }
    }

    // key row k_base[k_row .. k_row + d), value row v_base[v_row .. v_row + dv)
    template <typename K>
    __device__ __forceinline__ void add(void const* k_base, int64_t k_row, void const* v_base, int64_t v_row)
    {
        float dot = 0.0f;
        EM_UNROLL
        for (int r = 0; r < kPerLane; ++r)
        {
            int const i = lane + r * kWarp;
            if (r * kWarp < d && i < d)
                dot += q[r] * load<K>(k_base, k_row + i);
        }
        dot = WarpSum()(dot);
        float rescale;
        float const p = softmax_add(st, scale * dot, rescale);
        EM_UNROLL
        for (int r = 0; r < kPerLane; ++r)
        {
            int const j = lane + r * kWarp;
            if (r * kWarp < dv)
                acc[r] = acc[r] * rescale + (j < dv ? p * load<K>(v_base, v_row + j) : 0.0f);
        }
    }
};

inline bool validDType(DType d) { return d == kFloat32 || d == kFloat16 || d == kBFloat16; }

} // namespace cuda
} // namespace edgemem
