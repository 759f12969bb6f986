// LinearAttention (ONNX opset-27 contract, edgemem node with all six inputs) — the math.
//
// Per kv head, state S [d_k, d_v] (float32), per token t (rule: linear | gated | delta | gated_delta):
//   S   <- diag(w_t) S,        w_t = exp(g_t), g_t per head or per key dim   (gated rules)
//   S   <- S + beta_t k_t (v_t - S^T k_t)^T                                  (delta rules)
//   S   <- S + k_t v_t^T                                                     (linear, gated)
//   o_t  = scale * S^T q_t     for each of the G = H_q / H_kv query heads of the kv head
//
// Every value column j of S evolves on its own given (k_t, w_t, beta_t, v_t[j]), so an
// owner of a column (a thread, a warp, a CPU loop) can update it in place. The functions
// below take the N rows of one column that the caller holds plus an all-reduce over the
// rows held elsewhere: the CPU reference holds every row (SerialSum), a CUDA warp splits
// the rows over its 32 lanes (a shuffle butterfly). Rows past d_k are padded with
// k = q = 0 and w = 1, which leaves the sums and the padded state unchanged.
#pragma once

#include "edgemem/common.h"

namespace edgemem
{
namespace la
{

enum Rule : int
{
    kLinear = 0,
    kGated = 1,
    kDelta = 2,
    kGatedDelta = 3,
};

EM_HD bool isGated(int rule) { return rule == kGated || rule == kGatedDelta; }
EM_HD bool isDelta(int rule) { return rule == kDelta || rule == kGatedDelta; }

// Sizes and attributes of one call. Packed layouts:
//   query [B, T, Hq*dk], key [B, T, Hkv*dk], value [B, T, Hkv*dv], output [B, T, Hq*dv],
//   state [B, Hkv, dk, dv], decay [B, T, Hkv] or [B, T, Hkv*dk] (log-space),
//   beta [B, T, Hkv] or [B, T, 1].
struct Params
{
    int32_t batch;
    int32_t seq;
    int32_t q_heads;
    int32_t kv_heads;
    int32_t dk;
    int32_t dv;
    int32_t rule;
    float scale;
    int32_t decay_per_key; // 1: decay [B,T,Hkv*dk]; 0: [B,T,Hkv]
    int32_t beta_per_head; // 1: beta [B,T,Hkv]; 0: [B,T,1]
};

// Validates the sizes (no pointers). Returns kOk, kBadArgument or kUnsupported.
inline int check(Params const& p)
{
    if (p.batch < 0 || p.seq < 0 || p.q_heads <= 0 || p.kv_heads <= 0 || p.dk <= 0 || p.dv <= 0)
        return kBadArgument;
    if (p.q_heads % p.kv_heads != 0 || p.rule < kLinear || p.rule > kGatedDelta)
        return kBadArgument;
    if (p.dk > kMaxHeadDim)
        return kUnsupported;
    return kOk;
}

// Element offsets into the packed tensors.
EM_HD int64_t keyOffset(Params const& p, int b, int t, int h, int i)
{
    return ((int64_t(b) * p.seq + t) * p.kv_heads + h) * p.dk + i;
}
EM_HD int64_t queryOffset(Params const& p, int b, int t, int hq, int i)
{
    return ((int64_t(b) * p.seq + t) * p.q_heads + hq) * p.dk + i;
}
EM_HD int64_t valueOffset(Params const& p, int b, int t, int h, int j)
{
    return ((int64_t(b) * p.seq + t) * p.kv_heads + h) * p.dv + j;
}
EM_HD int64_t outputOffset(Params const& p, int b, int t, int hq, int j)
{
    return ((int64_t(b) * p.seq + t) * p.q_heads + hq) * p.dv + j;
}
EM_HD int64_t stateOffset(Params const& p, int b, int h, int i, int j)
{
    return ((int64_t(b) * p.kv_heads + h) * p.dk + i) * p.dv + j;
}
EM_HD int64_t decayOffset(Params const& p, int b, int t, int h, int i)
{
    return p.decay_per_key ? keyOffset(p, b, t, h, i) : (int64_t(b) * p.seq + t) * p.kv_heads + h;
}
EM_HD int64_t betaOffset(Params const& p, int b, int t, int h)
{
    return p.beta_per_head ? (int64_t(b) * p.seq + t) * p.kv_heads + h : int64_t(b) * p.seq + t;
}

// One token's update of one value column. s: the N rows of the column this owner holds;
// k, w: the key and the decay factors exp(g) of those rows; v: the column's value;
// beta: the token's beta (read by the delta rules only).
template <int N, class AllSum>
EM_HD void columnUpdate(float (&s)[N], float const (&k)[N], float const (&w)[N], float v, float beta, int rule,
    AllSum const& allsum)
{
    if (isGated(rule))
    {
EM_UNROLL
        for (int r = 0; r < N; ++r)
            s[r] *= w[r];
    }
    float u = v;
    if (isDelta(rule))
    {
        float retrieved = 0.0f; // (S^T k)[j]
EM_UNROLL
        for (int r = 0; r < N; ++r)
            retrieved += s[r] * k[r];
        retrieved = allsum(retrieved);
        u = beta * (v - retrieved);
    }
EM_UNROLL
    for (int r = 0; r < N; ++r)
        s[r] += k[r] * u;
}

// scale * (S^T q)[j] for one value column.
template <int N, class AllSum>
EM_HD float columnRead(float const (&s)[N], float const (&q)[N], float scale, AllSum const& allsum)
{
    float o = 0.0f;
EM_UNROLL
    for (int r = 0; r < N; ++r)
        o += q[r] * s[r];
    return scale * allsum(o);
}

} // namespace la
} // namespace edgemem
