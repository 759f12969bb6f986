// The attention ops' device building block: a warp scores keys one at a time (lanes split the
// head dim: lane l holds dims l, l+32, ...; D, D_v <= 256 so at most 8 per lane), a warp
// all-reduce gives q.k, and an online softmax (common.h) accumulates the values, so no score
// vector is materialised. A key's rows can be loaded (fetch) before they are used (add), so a
// warp keeps several keys' loads in flight.
#pragma once

#include "core/device.cuh"
#include "core/io.h"

namespace edgemem
{
namespace cuda
{

constexpr int kPerLane = kMaxHeadDim / kWarp; // 8

// One key and its value in a lane's registers (the lane's dims: N of them, dims up to 32 N).
template <int N>
struct KeyRow
{
    float k[N];
    float v[N];
};

// A warp's running softmax over keys and its weighted sum of values, head dims up to 32 N.
template <int N = kPerLane>
struct WarpAttention
{
    float q[N];
    float acc[N];
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
        for (int r = 0; r < N; ++r)
        {
            int const i = lane + r * kWarp;
            q[r] = i < d ? load<T>(query, row + i) : 0.0f;
            acc[r] = 0.0f;
        }
    }

    // key row k_base[k_row .. k_row + d) and value row v_base[v_row .. v_row + dv), this lane's dims
    template <typename K>
    __device__ __forceinline__ void fetch(
        KeyRow<N>& x, void const* k_base, int64_t k_row, void const* v_base, int64_t v_row) const
    {
        EM_UNROLL
        for (int r = 0; r < N; ++r)
        {
            int const i = lane + r * kWarp;
            x.k[r] = r * kWarp < d && i < d ? load<K>(k_base, k_row + i) : 0.0f;
            x.v[r] = r * kWarp < dv && i < dv ? load<K>(v_base, v_row + i) : 0.0f;
        }
    }

    __device__ __forceinline__ void add(KeyRow<N> const& x)
    {
        float dot = 0.0f;
        EM_UNROLL
        for (int r = 0; r < N; ++r)
            if (r * kWarp < d)
                dot += q[r] * x.k[r];
        dot = WarpSum()(dot);
        float rescale;
        float const p = softmax_add(st, scale * dot, rescale);
        EM_UNROLL
        for (int r = 0; r < N; ++r)
            if (r * kWarp < dv)
                acc[r] = acc[r] * rescale + p * x.v[r];
    }

    template <typename K>
    __device__ __forceinline__ void add(void const* k_base, int64_t k_row, void const* v_base, int64_t v_row)
    {
        KeyRow<N> x;
        fetch<K>(x, k_base, k_row, v_base, v_row);
        add(x);
    }
};

inline bool validDType(DType d) { return d == kFloat32 || d == kFloat16; }

} // namespace cuda
} // namespace edgemem
