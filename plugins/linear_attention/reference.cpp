// LinearAttention on the CPU: the sequential form column by column, and the chunked form pass for
// pass as the kernels run it (linear_attention.h), over the same workspace layout.
#include "core/reference.h"
#include "launch.h"

#include <algorithm>
#include <cstring>
#include <vector>

using namespace edgemem;
using ref::F;

namespace
{

template <int N>
void linearAttentionN(la::Params const& p, LinearAttentionIO const& io)
{
    float const* q = F(io.query);
    float const* k = F(io.key);
    float const* v = F(io.value);
    float const* g = F(io.decay);
    float const* be = F(io.beta);
    float* out = F(io.output);
    int const group = p.q_heads / p.kv_heads;
    bool const gated = la::isGated(p.rule);
    bool const delta = la::isDelta(p.rule);
    SerialSum const sum;
    for (int b = 0; b < p.batch; ++b)
        for (int h = 0; h < p.kv_heads; ++h)
            for (int j = 0; j < p.dv; ++j)
            {
                float s[N] = {};
                for (int i = 0; i < p.dk; ++i)
                    s[i] = io.past_state[la::stateOffset(p, b, h, i, j)];
                for (int t = 0; t < p.seq; ++t)
                {
                    float kr[N] = {};
                    float w[N];
                    for (int i = 0; i < N; ++i)
                        w[i] = 1.0f;
                    for (int i = 0; i < p.dk; ++i)
                    {
                        kr[i] = k[la::keyOffset(p, b, t, h, i)];
                        if (gated)
                            w[i] = em_exp(g[la::decayOffset(p, b, t, h, i)]);
                    }
                    float const beta = delta ? be[la::betaOffset(p, b, t, h)] : 1.0f;
                    la::columnUpdate<N>(s, kr, w, v[la::valueOffset(p, b, t, h, j)], beta, p.rule, sum);
                    for (int gq = 0; gq < group; ++gq)
                    {
                        int const hq = h * group + gq;
                        float qr[N] = {};
                        for (int i = 0; i < p.dk; ++i)
                            qr[i] = q[la::queryOffset(p, b, t, hq, i)];
                        out[la::outputOffset(p, b, t, hq, j)] = la::columnRead<N>(s, qr, p.scale, sum);
                    }
                }
                for (int i = 0; i < p.dk; ++i)
                    io.present_state[la::stateOffset(p, b, h, i, j)] = s[i];
            }
}

// The chunked form of the same op (edgemem/linear_attention.h), pass for pass as the kernels run
// it, over the same workspace layout.
struct Chunked
{
    la::Params const& p;
    LinearAttentionIO const& io;
    la::ChunkLayout l;
    std::vector<float> ws;
    int group;
    bool gated, delta;

    Chunked(la::Params const& p_, LinearAttentionIO const& io_, int64_t budget)
        : p(p_)
        , io(io_)
        , l(la::chunkLayout(p_, budget))
        , ws(size_t(l.floats))
        , group(p_.q_heads / p_.kv_heads)
        , gated(la::isGated(p_.rule))
        , delta(la::isDelta(p_.rule))
    {
    }

    float key(int b, int t, int h, int d) const { return d < p.dk ? F(io.key)[la::keyOffset(p, b, t, h, d)] : 0.0f; }

    // G_i at key dim d (one value per row for per-head decay).
    float g(float const* G, int i, int d) const { return G[int64_t(i) * l.gw + (l.gw > 1 ? d : 0)]; }

    // The decayed product of row x (token i) and row k (token j <= i) as the kernels factor it.
    float decayedDot(float const* G, float const* x, int i, float const* k, int j) const
    {
        std::vector<float> gi(l.dk), gj(l.dk), gr(l.dk);
        for (int d = 0; d < l.dk; ++d)
        {
            gi[d] = g(G, i, d);
            gj[d] = g(G, j, d);
            gr[d] = g(G, i / 16 * 16, d);
        }
        return i / 16 == j / 16 ? la::decayedDot(x, k, gi.data(), gj.data(), l.dk)
                                : la::decayedDotVia(x, k, gi.data(), gj.data(), gr.data(), l.dk);
    }

    // Pass 1 for the chunk of `n` tokens at t0 (segment row r0).
    void prepare(int b, int h, int t0, int r0, int n)
    {
        int const C = la::kChunk;
        float* G = &ws[l.gcum + l.row(p, b, h, r0) * l.gw];
        std::vector<float> beta(C, 0.0f), A(C * C, 0.0f), T(C * C, 0.0f), K(size_t(C) * l.dk, 0.0f);
        for (int i = 0; i < n; ++i)
            for (int d = 0; d < p.dk; ++d)
                K[size_t(i) * l.dk + d] = key(b, t0 + i, h, d);
        for (int d = 0; d < l.gw; ++d)
        {
            float acc = 0.0f;
            for (int i = 0; i < C; ++i)
            {
                acc += gated && i < n && d < p.dk ? F(io.decay)[la::decayOffset(p, b, t0 + i, h, d)] : 0.0f;
                G[i * l.gw + d] = acc;
            }
        }
        for (int i = 0; i < C; ++i)
            beta[i] = i < n ? (delta ? F(io.beta)[la::betaOffset(p, b, t0 + i, h)] : 1.0f) : 0.0f;
        for (int i = 0; i < n; ++i)
            for (int j = 0; j < i; ++j)
                A[i * C + j] = delta ? beta[i] * decayedDot(G, &K[size_t(i) * l.dk], i, &K[size_t(j) * l.dk], j) : 0.0f;
        for (int c = 0; c < C; ++c)
            la::unitLowerInverseColumn(A.data(), C, T.data(), C, c, C);
        for (int i = 0; i < C; ++i)
        {
            int64_t const r = l.row(p, b, h, r0 + i);
            for (int d = 0; d < l.dk; ++d)
            {
                float w = 0.0f;
                for (int m = 0; m <= i && m < n; ++m)
                    w += T[i * C + m] * beta[m] * em_exp(g(G, m, d)) * K[size_t(m) * l.dk + d];
                ws[l.w + r * l.dk + d] = delta ? w : 0.0f;
                ws[l.kt + r * l.dk + d] = em_exp(g(G, C - 1, d) - g(G, i, d)) * K[size_t(i) * l.dk + d];
            }
            for (int j = 0; j < l.dv; ++j)
            {
                float u = 0.0f;
                for (int m = 0; m <= i && m < n; ++m)
                    u += T[i * C + m] * beta[m] * (j < p.dv ? F(io.value)[la::valueOffset(p, b, t0 + m, h, j)] : 0.0f);
                ws[l.u + r * l.dv + j] = u;
            }
        }
    }

    // Pass 2: the chunks of one segment in order; `state` [DK, DV] in, out.
    void walk(int b, int h, int chunks, std::vector<float>& state)
    {
        int const C = la::kChunk;
        for (int c = 0; c < chunks; ++c)
        {
            std::copy(state.begin(), state.end(), ws.begin() + l.stateAt(p, b, h, c));
            int64_t const r0 = l.row(p, b, h, c * C);
            float* u = &ws[l.u + r0 * l.dv];
            for (int i = 0; i < C; ++i)
                for (int j = 0; j < l.dv; ++j)
                {
                    float ws_ = 0.0f;
                    for (int d = 0; d < l.dk; ++d)
                        ws_ += ws[l.w + (r0 + i) * l.dk + d] * state[d * l.dv + j];
                    u[i * l.dv + j] -= ws_;
                }
            float const* G = &ws[l.gcum + r0 * l.gw];
            for (int d = 0; d < l.dk; ++d)
            {
                float const last = em_exp(g(G, C - 1, d));
                for (int j = 0; j < l.dv; ++j)
                {
                    float add = 0.0f;
                    for (int i = 0; i < C; ++i)
                        add += ws[l.kt + (r0 + i) * l.dk + d] * u[i * l.dv + j];
                    state[d * l.dv + j] = last * state[d * l.dv + j] + add;
                }
            }
        }
    }

    // Pass 3 for the chunk of `n` tokens at t0 (segment chunk c), query head hq.
    void output(int b, int hq, int t0, int c, int n)
    {
        int const C = la::kChunk;
        int const h = hq / group;
        int64_t const r0 = l.row(p, b, h, c * C);
        float const* G = &ws[l.gcum + r0 * l.gw];
        float const* S = &ws[l.stateAt(p, b, h, c)];
        std::vector<float> q(l.dk, 0.0f), k(l.dk, 0.0f);
        for (int i = 0; i < n; ++i)
        {
            for (int d = 0; d < p.dk; ++d)
                q[d] = F(io.query)[la::queryOffset(p, b, t0 + i, hq, d)];
            std::vector<float> o(p.dv, 0.0f);
            for (int d = 0; d < l.dk; ++d)
                for (int j = 0; j < p.dv; ++j)
                    o[j] += em_exp(g(G, i, d)) * q[d] * S[d * l.dv + j];
            for (int m = 0; m <= i; ++m)
            {
                for (int d = 0; d < p.dk; ++d)
                    k[d] = key(b, t0 + m, h, d);
                float const dot = decayedDot(G, q.data(), i, k.data(), m);
                for (int j = 0; j < p.dv; ++j)
                    o[j] += dot * ws[l.u + (r0 + m) * l.dv + j];
            }
            for (int j = 0; j < p.dv; ++j)
                F(io.output)[la::outputOffset(p, b, t0 + i, hq, j)] = p.scale * o[j];
        }
    }

    void run()
    {
        int const C = la::kChunk;
        std::vector<std::vector<float>> states(
            size_t(p.batch) * p.kv_heads, std::vector<float>(size_t(l.dk) * l.dv, 0.0f));
        for (int b = 0; b < p.batch; ++b)
            for (int h = 0; h < p.kv_heads; ++h)
                for (int i = 0; i < p.dk; ++i)
                    for (int j = 0; j < p.dv; ++j)
                        states[size_t(b) * p.kv_heads + h][size_t(i) * l.dv + j]
                            = io.past_state[la::stateOffset(p, b, h, i, j)];
        for (int s0 = 0; s0 < p.seq; s0 += l.tokens)
        {
            int const len = std::min(l.tokens, p.seq - s0);
            int const chunks = (len + C - 1) / C;
            for (int b = 0; b < p.batch; ++b)
                for (int h = 0; h < p.kv_heads; ++h)
                {
                    for (int c = 0; c < chunks; ++c)
                        prepare(b, h, s0 + c * C, c * C, std::min(C, len - c * C));
                    walk(b, h, chunks, states[size_t(b) * p.kv_heads + h]);
                }
            for (int b = 0; b < p.batch; ++b)
                for (int hq = 0; hq < p.q_heads; ++hq)
                    for (int c = 0; c < chunks; ++c)
                        output(b, hq, s0 + c * C, c, std::min(C, len - c * C));
        }
        for (int b = 0; b < p.batch; ++b)
            for (int h = 0; h < p.kv_heads; ++h)
                for (int i = 0; i < p.dk; ++i)
                    for (int j = 0; j < p.dv; ++j)
                        io.present_state[la::stateOffset(p, b, h, i, j)]
                            = states[size_t(b) * p.kv_heads + h][size_t(i) * l.dv + j];
    }
};

} // namespace

EM_REF_API int em_ref_linear_attention(la::Params const* params, LinearAttentionIO const* io)
{
    la::Params const& p = *params;
    if (int const st = la::check(p))
        return st;
    if (p.dk <= 8)
        linearAttentionN<8>(p, *io);
    else if (p.dk <= 32)
        linearAttentionN<32>(p, *io);
    else if (p.dk <= 64)
        linearAttentionN<64>(p, *io);
    else if (p.dk <= 128)
        linearAttentionN<128>(p, *io);
    else
        linearAttentionN<kMaxHeadDim>(p, *io);
    return kOk;
}

EM_REF_API int em_ref_linear_attention_chunked(la::Params const* params, LinearAttentionIO const* io, int64_t budget)
{
    la::Params const& p = *params;
    if (int const st = la::check(p))
        return st;
    if (p.batch == 0 || p.seq == 0)
        return em_ref_linear_attention(params, io);
    if (!la::chunkable(p) || la::chunkLayout(p, budget > 0 ? budget : la::kChunkBudget).tokens == 0)
        return kUnsupported;
    Chunked(p, *io, budget > 0 ? budget : la::kChunkBudget).run();
    return kOk;
}

EM_REF_API size_t em_ref_linear_attention_workspace(la::Params const* params)
{
    la::Params const& p = *params;
    if (la::check(p) != kOk || !la::chunkable(p) || p.batch == 0 || p.seq == 0)
        return 0;
    return size_t(la::chunkLayout(p).floats) * sizeof(float);
}

void edgemem::ref::layout_linear_attention(Layout& out)
{
    EM_LAYOUT_STRUCT(out, la::Params);
    EM_LAYOUT_FIELD(out, la::Params, batch);
    EM_LAYOUT_FIELD(out, la::Params, seq);
    EM_LAYOUT_FIELD(out, la::Params, q_heads);
    EM_LAYOUT_FIELD(out, la::Params, kv_heads);
    EM_LAYOUT_FIELD(out, la::Params, dk);
    EM_LAYOUT_FIELD(out, la::Params, dv);
    EM_LAYOUT_FIELD(out, la::Params, rule);
    EM_LAYOUT_FIELD(out, la::Params, scale);
    EM_LAYOUT_FIELD(out, la::Params, decay_per_key);
    EM_LAYOUT_FIELD(out, la::Params, beta_per_head);
    EM_LAYOUT_STRUCT(out, LinearAttentionIO);
    EM_LAYOUT_FIELD(out, LinearAttentionIO, query);
    EM_LAYOUT_FIELD(out, LinearAttentionIO, key);
    EM_LAYOUT_FIELD(out, LinearAttentionIO, value);
    EM_LAYOUT_FIELD(out, LinearAttentionIO, past_state);
    EM_LAYOUT_FIELD(out, LinearAttentionIO, decay);
    EM_LAYOUT_FIELD(out, LinearAttentionIO, beta);
    EM_LAYOUT_FIELD(out, LinearAttentionIO, output);
    EM_LAYOUT_FIELD(out, LinearAttentionIO, present_state);
}
