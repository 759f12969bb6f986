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

    // This lane's elements of a row of n (dims lane, lane + 32, ...; 0 past n) as float32.
    template <typename K>
    __device__ __forceinline__ void loadRow(void const* base, int64_t row, int n, float (&x)[kPerLane]) const
    {
        EM_UNROLL
        for (int r = 0; r < kPerLane; ++r)
        {
            int const i = lane + r * kWarp;
            x[r] = r * kWarp < n && i < n ? load<K>(base, row + i) : 0.0f;
        }
    }

    // One key whose rows loadRow has loaded: k (d) and v (dv).
    __device__ __forceinline__ void addRows(float const (&k)[kPerLane], float const (&v)[kPerLane])
    {
        float dot = 0.0f;
        EM_UNROLL
        for (int r = 0; r < kPerLane; ++r)
            if (r * kWarp < d)
                dot += q[r] * k[r];
        dot = WarpSum()(dot);
        float rescale;
        float const p = softmax_add(st, scale * dot, rescale);
        EM_UNROLL
        for (int r = 0; r < kPerLane; ++r)
            if (r * kWarp < dv)
                acc[r] = acc[r] * rescale + p * v[r];
    }

    // key row k_base[k_row .. k_row + d), value row v_base[v_row .. v_row + dv), loaded together
    template <typename K>
    __device__ __forceinline__ void add(void const* k_base, int64_t k_row, void const* v_base, int64_t v_row)
    {
        float k[kPerLane], v[kPerLane];
        loadRow<K>(k_base, k_row, d, k);
        loadRow<K>(v_base, v_row, dv, v);
        addRows(k, v);
    }
};

inline bool validDType(DType d) { return d == kFloat32 || d == kFloat16 || d == kBFloat16; }

} // namespace cuda
} // namespace edgemem
