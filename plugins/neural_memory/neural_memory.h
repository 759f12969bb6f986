// NeuralMemory (Titans long-term memory; TTT is the case eta = alpha = 0) — the math.
//
// Per head, memory f(x) = x W1 (depth 1) or act(x W1) W2 (depth 2), optionally TTT's
// M(x) = x + gamma * LN(f(x)) + beta (LayerNorm over D, eps 1e-6); loss l = 1/2 |M(k) - v|^2.
// Per token at absolute position p (chunk_size c):
//   if p mod c == 0:  C <- W                       (chunk weights: gradients are taken there)
//   grad_l = closed-form gradient of l at C:
//     depth 1:  z = k C1, dz = dl/dz,              grad1 = k^T dz
//     depth 2:  h = k C1, a = act(h), z = a C2,    grad2 = a^T dz,  grad1 = k^T ((dz C2^T) * act'(h))
//   S <- eta S - theta grad,   W <- (1 - alpha) W + S
//   y = M(q; W)
// dl/dz is z - v without the norm; with it, for zhat = LN(z), sigma = sqrt(var z + eps),
// g = gamma * (k + gamma * zhat + beta - v):  dz = (g - mean g - zhat * mean(g * zhat)) / sigma.
//
// Row-wise reductions (the LayerNorm over D) take an all-reduce like the LinearAttention
// math: the CPU reference holds all D entries, a CUDA warp splits them over its lanes.
#pragma once

#include "core/common.h"

namespace edgemem
{
namespace nm
{

constexpr float kNormEps = 1e-6f;
constexpr int kMaxHidden = 2048; // E: the kernels keep a few E-vectors in shared memory

enum Activation : int
{
    kSilu = 0,
    kGelu = 1,
    kRelu = 2,
    kIdentity = 3,
};

// Layouts: query/key/value/output [B, T, H*D]; theta/eta/alpha [B, T, H]; position int64 [B]
// or [1]; norm weight/bias [H, D] (float32); W1/S1/C1 [B, H, D, E]; W2/S2/C2 [B, H, E, D]
// (depth 1: only the first layer, E = D).
struct Params
{
    int32_t batch;
    int32_t seq;
    int32_t heads;
    int32_t d;
    int32_t e;
    int32_t depth;
    int32_t chunk;
    int32_t activation;
    int32_t residual_norm;
    int32_t position_per_batch; // 1: position [B]; 0: [1], shared by every row
};

inline int check(Params const& p)
{
    if (p.batch < 0 || p.seq < 0 || p.heads <= 0 || p.d <= 0 || p.e <= 0 || p.chunk < 1)
        return kBadArgument;
    if ((p.depth != 1 && p.depth != 2) || p.activation < kSilu || p.activation > kIdentity)
        return kBadArgument;
    if (p.depth == 1 && p.e != p.d)
        return kBadArgument;
    if (p.d > kMaxHeadDim || p.e > kMaxHidden)
        return kUnsupported;
    return kOk;
}

EM_HD float activate(float x, int act)
{
    switch (act)
    {
    case kSilu: return x * em_sigmoid(x);
    case kGelu: return 0.5f * x * (1.0f + em_erf(x * 0.70710678118654752f));
    case kRelu: return x > 0.0f ? x : 0.0f;
    default: return x;
    }
}

EM_HD float activateGrad(float x, int act)
{
    switch (act)
    {
    case kSilu:
    {
        float const s = em_sigmoid(x);
        return s * (1.0f + x * (1.0f - s));
    }
    case kGelu:
    {
        float const cdf = 0.5f * (1.0f + em_erf(x * 0.70710678118654752f));
        float const pdf = em_exp(-0.5f * x * x) * 0.39894228040143268f;
        return cdf + x * pdf;
    }
    case kRelu: return x > 0.0f ? 1.0f : 0.0f;
    default: return 1.0f;
    }
}

// One state element: momentum then weights (Titans eq. 13/14).
EM_HD void momentumUpdate(float& w, float& s, float grad, float eta, float theta, float alpha)
{
    s = eta * s - theta * grad;
    w = (1.0f - alpha) * w + s;
}

// Whether the token at absolute position p starts a chunk.
EM_HD bool chunkStart(int64_t p, int chunk) { return p % chunk == 0; }

// LayerNorm statistics over the D entries of a row: returns the mean, sets sigma.
// mask: 1 for the entries this owner holds, 0 for padding.
template <int N, class AllSum>
EM_HD float layerNormStats(float const (&z)[N], float const (&mask)[N], int d, AllSum const& allsum, float& sigma)
{
    float sum = 0.0f;
    EM_UNROLL
    for (int r = 0; r < N; ++r)
        sum += z[r] * mask[r];
    float const mean = allsum(sum) / float(d);
    float sq = 0.0f;
    EM_UNROLL
    for (int r = 0; r < N; ++r)
    {
        float const c = (z[r] - mean) * mask[r];
        sq += c * c;
    }
    sigma = em_sqrt(allsum(sq) / float(d) + kNormEps);
    return mean;
}

// dl/dz for the memory output z = f(k) (see the file comment).
template <int N, class AllSum>
EM_HD void outputDelta(float const (&z)[N], float const (&k)[N], float const (&v)[N], float const (&gamma)[N],
    float const (&beta)[N], float const (&mask)[N], int d, bool norm, AllSum const& allsum, float (&dz)[N])
{
    if (!norm)
    {
        EM_UNROLL
        for (int r = 0; r < N; ++r)
            dz[r] = (z[r] - v[r]) * mask[r];
        return;
    }
    float sigma;
    float const mean = layerNormStats<N>(z, mask, d, allsum, sigma);
    float zhat[N];
    float g[N];
    float gsum = 0.0f;
    float gzsum = 0.0f;
    EM_UNROLL
    for (int r = 0; r < N; ++r)
    {
        zhat[r] = (z[r] - mean) / sigma * mask[r];
        g[r] = gamma[r] * (k[r] + gamma[r] * zhat[r] + beta[r] - v[r]) * mask[r];
        gsum += g[r];
        gzsum += g[r] * zhat[r];
    }
    float const gmean = allsum(gsum) / float(d);
    float const gzmean = allsum(gzsum) / float(d);
    EM_UNROLL
    for (int r = 0; r < N; ++r)
        dz[r] = (g[r] - gmean - zhat[r] * gzmean) / sigma * mask[r];
}

// The memory's read-out y = M(x) from z = f(x): z itself, or x + gamma * LN(z) + beta.
template <int N, class AllSum>
EM_HD void readOut(float const (&z)[N], float const (&x)[N], float const (&gamma)[N], float const (&beta)[N],
    float const (&mask)[N], int d, bool norm, AllSum const& allsum, float (&y)[N])
{
    if (!norm)
    {
        EM_UNROLL
        for (int r = 0; r < N; ++r)
            y[r] = z[r];
        return;
    }
    float sigma;
    float const mean = layerNormStats<N>(z, mask, d, allsum, sigma);
    EM_UNROLL
    for (int r = 0; r < N; ++r)
        y[r] = x[r] + gamma[r] * ((z[r] - mean) / sigma) + beta[r];
}

// ---------------------------------------------------------------------------------------------
// Chunked form (prefill on tensor cores; edgemem/ops/neural_memory/chunk.py). A piece is up to
// kPieceRows tokens that share the chunk weights C: a chunk, or the part of one that a piece
// boundary or the call's ends leave. Inside a piece every gradient is taken at C, so Titans
// eq. 13/14 are linear in the gradients; with, for tokens j <= i of the piece,
//   L_ij = prod_{j<m<=i} eta_m,  Lambda_ij = prod_{j<m<=i} (1 - alpha_m),  P_i = prod_{m<=i} eta_m,
//   A_i = prod_{m<=i} (1 - alpha_m),  K = Lambda L,  c = Lambda P,
// and each layer's gradient of token j written x_j^T d_j (x: the layer's input at C, d: dl/d of
// its output, from the closed forms above), the state after token i is
//   W_i = A_i W_0 + c_i S_0 - sum_j K_ij theta_j x_j^T d_j,  S_i = P_i S_0 - sum_j L_ij theta_j x_j^T d_j
// (W_0, S_0: at the piece start). A read x'_i W_i = A_i x'_i W_0 + c_i x'_i S_0
// - sum_j K_ij theta_j (x'_i . x_j) d_j is a masked product over the piece (no per-token weights),
// and the state after the piece is the last row of the same sums.
constexpr int kPieceRows = 16;

// The chunked form takes head and hidden sizes in whole 16 x 16 tiles.
EM_HD bool pieceable(Params const& p) { return p.d % 16 == 0 && p.e % 16 == 0; }

// Tokens in the piece that starts at absolute position pos, with `left` tokens of the call left.
EM_HD int pieceLength(int64_t pos, int chunk, int left)
{
    int64_t const to_chunk_end = chunk - pos % chunk;
    int64_t const n = to_chunk_end < kPieceRows ? to_chunk_end : kPieceRows;
    return n < left ? int(n) : left;
}

// The per-token coefficients of a piece of n tokens: a[i] = A_i, c[i] = c_i (0 past n); returns P_{n-1}.
EM_HD float pieceRows(float const* eta, float const* alpha, int n, float* a, float* c)
{
    float decay = 1.0f, product = 1.0f, mixed = 0.0f;
    for (int i = 0; i < kPieceRows; ++i)
    {
        if (i < n)
        {
            decay *= 1.0f - alpha[i];
            product *= eta[i];
            mixed = (1.0f - alpha[i]) * mixed + product;
        }
        a[i] = i < n ? decay : 0.0f;
        c[i] = i < n ? mixed : 0.0f;
    }
    return product;
}

// Column j of the piece's token mixing, one owner per column: kt[i * ld + j] = K_ij theta_j for
// j <= i < n (0 elsewhere); wt = K_{n-1,j} theta_j and st = L_{n-1,j} theta_j weigh token j's
// gradient in the weights and the momentum after the piece (0 for j >= n).
// K_ij = (1 - alpha_i) K_{i-1,j} + L_ij, K_jj = L_jj = 1.
EM_HD void pieceColumn(
    float const* eta, float const* alpha, float const* theta, int n, int j, float* kt, int ld, float& wt, float& st)
{
    float l = 1.0f, k = 1.0f;
    for (int i = 0; i < kPieceRows; ++i)
    {
        if (i > j && i < n)
        {
            l *= eta[i];
            k = (1.0f - alpha[i]) * k + l;
        }
        kt[i * ld + j] = i >= j && i < n ? k * theta[j] : 0.0f;
    }
    wt = j < n ? k * theta[j] : 0.0f;
    st = j < n ? l * theta[j] : 0.0f;
}

} // namespace nm
} // namespace edgemem
