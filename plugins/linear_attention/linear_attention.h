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

#include "core/common.h"

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
EM_HD void columnUpdate(
    float (&s)[N], float const (&k)[N], float const (&w)[N], float v, float beta, int rule, AllSum const& allsum)
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

// ---------------------------------------------------------------------------------------------
// Chunked form (prefill on tensor cores). Per kv head, tokens in chunks of C = kChunk; inside a
// chunk, with G_i the cumulative log decay from the chunk start (per head, or a vector over the
// key dims; G = 0 ungated), S_0 the state at the chunk start and beta = 1, A = 0 for the
// non-delta rules (per-head decay: exp(G_i - G_j) is a scalar and comes out of the sums):
//   A_ij = beta_i sum_d exp(G_id - G_jd) k_id k_jd   (j < i)          T = (I + A)^-1
//   W    = T diag(beta) (exp(G) . K)        U = T diag(beta) V - W S_0   (WY form of the delta rule)
//   o_i  = scale ((exp(G_i) . q_i)^T S_0 + sum_{j <= i} (sum_d exp(G_id - G_jd) q_id k_jd) u_j)
//   S_C  = diag(exp(G_last)) S_0 + (exp(G_last - G) . K)^T U
// (. is the elementwise product, row by row). Three passes per segment of tokens: prepare (every
// chunk at once: G, T, W, U0 = T diag(beta) V, K~ = exp(G_last - G) . K), state (chunks in order
// per value tile: U = U0 - W S, the state at each chunk start), output (every chunk at once). The
// passes share a float32 workspace laid out by ChunkLayout; a sequence longer than one segment
// runs segment after segment, the state passing through present_state.
//
// With per-key decay the kernels take the decayed products of 16-row blocks I > J as plain
// products of exp(G_i - G_r) . x_i and exp(G_r - G_j) . k_j, r the first row of block I (both
// factors at most 1 while log decays are at most 0), and the blocks on the diagonal entry by entry.
constexpr int kChunk = 64;
constexpr int kChunkMaxDk = 128;
constexpr int64_t kChunkBudget = int64_t(64) << 20; // workspace bytes a segment is sized to

EM_HD bool chunkable(Params const& p) { return p.dk <= kChunkMaxDk; }
// Whether G is a vector over the key dims.
EM_HD bool keyedDecay(Params const& p) { return p.decay_per_key && isGated(p.rule); }

// Float offsets of the workspace arrays for segments of `tokens` tokens (a multiple of C):
//   gcum [B, Hkv, tokens, GW], w and kt [B, Hkv, tokens, DK], u [B, Hkv, tokens, DV],
//   s [B, Hkv, tokens / C, DK, DV]. DK, DV: d_k and d_v padded with zeros to the kernels' tiles;
//   GW: 1, or DK for per-key decay. For 16-bit I/O, whose products take one TF32 pass, w and kt
//   hold TF32 values (the state walk's operands) and the walk writes u (U over U0) and s as TF32
//   values too (the output pass's).
struct ChunkLayout
{
    int32_t dk;     // DK
    int32_t dv;     // DV
    int32_t gw;     // GW
    int32_t tokens; // per segment
    int64_t gcum, w, kt, u, s, floats;

    EM_HD int64_t row(Params const& p, int b, int h, int t) const { return (int64_t(b) * p.kv_heads + h) * tokens + t; }
    EM_HD int64_t stateAt(Params const& p, int b, int h, int chunk) const
    {
        return s + ((int64_t(b) * p.kv_heads + h) * (tokens / kChunk) + chunk) * dk * dv;
    }
};

// The layout for segments as long as `budget` bytes allow (tokens = 0: not one chunk fits).
inline ChunkLayout chunkLayout(Params const& p, int64_t budget = kChunkBudget)
{
    ChunkLayout l{};
    l.dk = p.dk <= 32 ? 32 : p.dk <= 64 ? 64 : 128;
    l.dv = (p.dv + 63) / 64 * 64;
    l.gw = keyedDecay(p) ? l.dk : 1;
    int64_t const heads = int64_t(p.batch) * p.kv_heads;
    int64_t const per_chunk = heads * (int64_t(kChunk) * (l.gw + 2 * l.dk + l.dv) + int64_t(l.dk) * l.dv) * 4;
    int64_t const needed = (int64_t(p.seq) + kChunk - 1) / kChunk;
    int64_t chunks = per_chunk > 0 ? budget / per_chunk : 0;
    chunks = chunks > needed ? needed : chunks;
    l.tokens = int32_t(chunks * kChunk);
    l.gcum = 0;
    l.w = l.gcum + heads * l.tokens * l.gw;
    l.kt = l.w + heads * l.tokens * l.dk;
    l.u = l.kt + heads * l.tokens * l.dk;
    l.s = l.u + heads * l.tokens * l.dv;
    l.floats = l.s + heads * chunks * l.dk * l.dv; // every array starts at a multiple of 32 floats
    return l;
}

// The decayed product sum_d exp(gx_d - gk_d) x_d k_d of a row x below or at a row k (the
// entries of the diagonal blocks).
EM_HD float decayedDot(float const* x, float const* k, float const* gx, float const* gk, int n)
{
    float acc = 0.0f;
    for (int d = 0; d < n; ++d)
        acc += em_exp(gx[d] - gk[d]) * x[d] * k[d];
    return acc;
}

// The same below the diagonal blocks, as the kernels' scaled tiles factor it:
// sum_d (exp(gx_d - gr_d) x_d) (exp(gr_d - gk_d) k_d), gr the decay of the first row of x's block.
EM_HD float decayedDotVia(float const* x, float const* k, float const* gx, float const* gk, float const* gr, int n)
{
    float acc = 0.0f;
    for (int d = 0; d < n; ++d)
        acc += (em_exp(gx[d] - gr[d]) * x[d]) * (em_exp(gr[d] - gk[d]) * k[d]);
    return acc;
}

// Column c of T = (I + A)^-1 for a strictly lower A (n x n, row stride lda) by forward
// substitution: T_ic = [i == c] - sum_{c <= m < i} A_im T_mc. Reads column c of T only, so one
// owner per column (a thread, a loop) fills T in parallel.
EM_HD void unitLowerInverseColumn(float const* a, int lda, float* t, int ldt, int c, int n)
{
    for (int i = 0; i < c; ++i)
        t[i * ldt + c] = 0.0f;
    t[c * ldt + c] = 1.0f;
    for (int i = c + 1; i < n; ++i)
    {
        float acc = 0.0f;
        for (int m = c; m < i; ++m)
            acc += a[i * lda + m] * t[m * ldt + c];
        t[i * ldt + c] = -acc;
    }
}

} // namespace la
} // namespace edgemem
