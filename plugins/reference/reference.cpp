// CPU reference: the op math of include/edgemem/ driven by plain loops, one owner per value
// column / query row / head holding every row (SerialSum), so it checks the same formulas the
// kernels run without a GPU. Float32 I/O only.
#include "edgemem_reference.h"

#include <algorithm>
#include <cstring>
#include <vector>

using namespace edgemem;

namespace
{

constexpr int kAbiVersion = 3;

float const* F(void const* p) { return static_cast<float const*>(p); }
float* F(void* p) { return static_cast<float*>(p); }

// ---------------------------------------------------------------------------------------------
// LinearAttention

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

// ---------------------------------------------------------------------------------------------
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
        : p(p_), io(io_), l(la::chunkLayout(p_, budget)), ws(size_t(l.floats)), group(p_.q_heads / p_.kv_heads),
          gated(la::isGated(p_.rule)), delta(la::isDelta(p_.rule))
    {
    }

    float key(int b, int t, int h, int d) const { return d < p.dk ? F(io.key)[la::keyOffset(p, b, t, h, d)] : 0.0f; }

    // Pass 1 for the chunk of `n` tokens at t0 (segment row r0).
    void prepare(int b, int h, int t0, int r0, int n)
    {
        int const C = la::kChunk;
        float* G = &ws[l.gcum + l.row(p, b, h, r0)];
        std::vector<float> beta(C, 0.0f), A(C * C, 0.0f), T(C * C, 0.0f);
        float acc = 0.0f;
        for (int i = 0; i < C; ++i)
        {
            acc += gated && i < n ? F(io.decay)[la::decayOffset(p, b, t0 + i, h, 0)] : 0.0f;
            G[i] = acc;
            beta[i] = i < n ? (delta ? F(io.beta)[la::betaOffset(p, b, t0 + i, h)] : 1.0f) : 0.0f;
        }
        for (int i = 0; i < n; ++i)
            for (int j = 0; j < i; ++j)
            {
                float dot = 0.0f;
                for (int d = 0; d < p.dk; ++d)
                    dot += key(b, t0 + i, h, d) * key(b, t0 + j, h, d);
                A[i * C + j] = delta ? beta[i] * em_exp(G[i] - G[j]) * dot : 0.0f;
            }
        for (int c = 0; c < C; ++c)
            la::unitLowerInverseColumn(A.data(), C, T.data(), C, c, C);
        for (int i = 0; i < C; ++i)
        {
            int64_t const r = l.row(p, b, h, r0 + i);
            for (int d = 0; d < l.dk; ++d)
            {
                float w = 0.0f;
                for (int m = 0; m <= i && m < n; ++m)
                    w += T[i * C + m] * beta[m] * em_exp(G[m]) * key(b, t0 + m, h, d);
                ws[l.w + r * l.dk + d] = delta ? w : 0.0f;
                ws[l.kt + r * l.dk + d] = i < n ? em_exp(G[C - 1] - G[i]) * key(b, t0 + i, h, d) : 0.0f;
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
            float const last = em_exp(ws[l.gcum + r0 + C - 1]);
            for (int d = 0; d < l.dk; ++d)
                for (int j = 0; j < l.dv; ++j)
                {
                    float add = 0.0f;
                    for (int i = 0; i < C; ++i)
                        add += ws[l.kt + (r0 + i) * l.dk + d] * u[i * l.dv + j];
                    state[d * l.dv + j] = last * state[d * l.dv + j] + add;
                }
        }
    }

    // Pass 3 for the chunk of `n` tokens at t0 (segment chunk c), query head hq.
    void output(int b, int hq, int t0, int c, int n)
    {
        int const C = la::kChunk;
        int const h = hq / group;
        int64_t const r0 = l.row(p, b, h, c * C);
        float const* G = &ws[l.gcum + r0];
        float const* S = &ws[l.stateAt(p, b, h, c)];
        auto q = [&](int i, int d) { return d < p.dk ? F(io.query)[la::queryOffset(p, b, t0 + i, hq, d)] : 0.0f; };
        for (int i = 0; i < n; ++i)
            for (int j = 0; j < p.dv; ++j)
            {
                float o = 0.0f;
                for (int d = 0; d < l.dk; ++d)
                    o += em_exp(G[i]) * q(i, d) * S[d * l.dv + j];
                for (int m = 0; m <= i; ++m)
                {
                    float dot = 0.0f;
                    for (int d = 0; d < p.dk; ++d)
                        dot += q(i, d) * key(b, t0 + m, h, d);
                    o += em_exp(G[i] - G[m]) * dot * ws[l.u + (r0 + m) * l.dv + j];
                }
                F(io.output)[la::outputOffset(p, b, t0 + i, hq, j)] = p.scale * o;
            }
    }

    void run()
    {
        int const C = la::kChunk;
        std::vector<std::vector<float>> states(size_t(p.batch) * p.kv_heads, std::vector<float>(size_t(l.dk) * l.dv, 0.0f));
        for (int b = 0; b < p.batch; ++b)
            for (int h = 0; h < p.kv_heads; ++h)
                for (int i = 0; i < p.dk; ++i)
                    for (int j = 0; j < p.dv; ++j)
                        states[size_t(b) * p.kv_heads + h][size_t(i) * l.dv + j] = io.past_state[la::stateOffset(p, b, h, i, j)];
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
                        io.present_state[la::stateOffset(p, b, h, i, j)] = states[size_t(b) * p.kv_heads + h][size_t(i) * l.dv + j];
    }
};

} // namespace

EM_REF_API int em_ref_abi_version() { return kAbiVersion; }

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

EM_REF_API int em_ref_window_attention(attn::WindowParams const* params, int32_t const* dilation, WindowAttentionIO const* io)
{
    attn::WindowParams const& p = *params;
    if (int const st = attn::check(p, dilation))
        return st;
    size_t const key_ring = size_t(p.batch) * p.heads * p.ring * p.d;
    size_t const value_ring = size_t(p.batch) * p.heads * p.ring * p.dv;
    float* rk = F(io->present_key);
    float* rv = F(io->present_value);
    if (rk != io->past_key)
        std::memmove(rk, io->past_key, key_ring * sizeof(float));
    if (rv != io->past_value)
        std::memmove(rv, io->past_value, value_ring * sizeof(float));
    float const* q = F(io->query);
    float const* k = F(io->key);
    float const* v = F(io->value);
    float const* pk = F(io->persistent_key);
    float const* pv = F(io->persistent_value);
    for (int b = 0; b < p.batch; ++b)
        for (int h = 0; h < p.heads; ++h)
            for (int t = 0; t < p.seq; ++t)
            {
                int64_t const pos = io->position[b] + t;
                float const* qr = q + attn::rowOffset(p.seq, p.heads, p.d, b, t, h);
                float const* kr = k + attn::rowOffset(p.seq, p.heads, p.d, b, t, h);
                float const* vr = v + attn::rowOffset(p.seq, p.heads, p.dv, b, t, h);
                Row row(p.dv);
                row.add(qr, kr, vr, p.d, p.scale); // o = 0: the token itself
                for (int o = 1; o <= p.window; ++o)
                {
                    int64_t const a = attn::windowKeyPosition(pos, o, dilation[h]);
                    if (a < 0)
                        continue;
                    int const slot = attn::ringSlot(a, p.ring);
                    row.add(qr, rk + attn::headRowOffset(p.heads, p.ring, p.d, b, h, slot),
                        rv + attn::headRowOffset(p.heads, p.ring, p.dv, b, h, slot), p.d, p.scale);
                }
                for (int i = 0; i < p.persistent; ++i)
                    row.add(qr, pk + attn::headRowOffset(p.heads, p.persistent, p.d, b, h, i),
                        pv + attn::headRowOffset(p.heads, p.persistent, p.dv, b, h, i), p.d, p.scale);
                row.write(F(io->output) + attn::rowOffset(p.seq, p.heads, p.dv, b, t, h));
                int const slot = attn::ringSlot(pos, p.ring);
                std::copy(kr, kr + p.d, rk + attn::headRowOffset(p.heads, p.ring, p.d, b, h, slot));
                std::copy(vr, vr + p.dv, rv + attn::headRowOffset(p.heads, p.ring, p.dv, b, h, slot));
            }
    return kOk;
}

EM_REF_API int em_ref_banded_attention(attn::BandedParams const* params, int32_t const* dilation, BandedAttentionIO const* io)
{
    attn::BandedParams const& p = *params;
    int mx = 0;
    if (int const st = attn::check(p))
        return st;
    if (int const st = attn::checkDilation(dilation, p.heads, &mx))
        return st;
    float const* q = F(io->query);
    float const* k = F(io->key);
    float const* v = F(io->value);
    float const* pk = F(io->persistent_key);
    float const* pv = F(io->persistent_value);
    bool const* gm = io->global_mask;
    for (int b = 0; b < p.batch; ++b)
        for (int h = 0; h < p.heads; ++h)
            for (int i = 0; i < p.seq; ++i)
            {
                float const* qr = q + attn::rowOffset(p.seq, p.heads, p.d, b, i, h);
                Row row(p.dv);
                bool const gi = gm[int64_t(b) * p.seq + i];
                for (int j = 0; j < p.seq; ++j)
                    if (attn::bandAllowed(i, j, p.window, dilation[h], p.causal != 0, gi, gm[int64_t(b) * p.seq + j]))
                        row.add(qr, k + attn::rowOffset(p.seq, p.heads, p.d, b, j, h),
                            v + attn::rowOffset(p.seq, p.heads, p.dv, b, j, h), p.d, p.scale);
                for (int r = 0; r < p.persistent; ++r)
                    row.add(qr, pk + attn::headRowOffset(p.heads, p.persistent, p.d, b, h, r),
                        pv + attn::headRowOffset(p.heads, p.persistent, p.dv, b, h, r), p.d, p.scale);
                row.write(F(io->output) + attn::rowOffset(p.seq, p.heads, p.dv, b, i, h));
            }
    return kOk;
}

// ---------------------------------------------------------------------------------------------
// NeuralMemory

EM_REF_API int em_ref_neural_memory(nm::Params const* params, NeuralMemoryIO const* io)
{
    nm::Params const& p = *params;
    if (int const st = nm::check(p))
        return st;
    constexpr int N = kMaxHeadDim;
    int const D = p.d;
    int const E = p.e;
    bool const norm = p.residual_norm != 0;
    int const layers = p.depth;
    size_t const sizes[2] = {size_t(D) * E, size_t(E) * D};
    // present_* start as copies of past_*; everything below works on them in place.
    for (int l = 0; l < layers; ++l)
    {
        size_t const n = size_t(p.batch) * p.heads * sizes[l];
        float const* in[3] = {io->weights[l], io->momentum[l], io->chunk_weights[l]};
        float* out[3] = {io->present_weights[l], io->present_momentum[l], io->present_chunk_weights[l]};
        for (int x = 0; x < 3; ++x)
            if (out[x] != in[x])
                std::memmove(out[x], in[x], n * sizeof(float));
    }
    float const* q = F(io->query);
    float const* k = F(io->key);
    float const* v = F(io->value);
    SerialSum const sum;
    std::vector<float> hid(E), act(E), dh(E);
    for (int b = 0; b < p.batch; ++b)
        for (int h = 0; h < p.heads; ++h)
        {
            float* W[2];
            float* S[2];
            float* C[2];
            for (int l = 0; l < layers; ++l)
            {
                size_t const off = (size_t(b) * p.heads + h) * sizes[l];
                W[l] = io->present_weights[l] + off;
                S[l] = io->present_momentum[l] + off;
                C[l] = io->present_chunk_weights[l] + off;
            }
            float gamma[N] = {}, beta[N] = {}, mask[N] = {};
            for (int d = 0; d < D; ++d)
            {
                gamma[d] = norm ? io->norm_weight[int64_t(h) * D + d] : 1.0f;
                beta[d] = norm ? io->norm_bias[int64_t(h) * D + d] : 0.0f;
                mask[d] = 1.0f;
            }
            int64_t const p0 = io->position[p.position_per_batch ? b : 0];
            for (int t = 0; t < p.seq; ++t)
            {
                int64_t const row = attn::rowOffset(p.seq, p.heads, D, b, t, h);
                int64_t const gate = (int64_t(b) * p.seq + t) * p.heads + h;
                float const theta = F(io->theta)[gate];
                float const eta = F(io->eta)[gate];
                float const alpha = F(io->alpha)[gate];
                float kr[N] = {}, vr[N] = {}, qr[N] = {}, z[N] = {}, dz[N] = {}, y[N] = {};
                for (int d = 0; d < D; ++d)
                {
                    kr[d] = k[row + d];
                    vr[d] = v[row + d];
                    qr[d] = q[row + d];
                }
                if (nm::chunkStart(p0 + t, p.chunk))
                    for (int l = 0; l < layers; ++l)
                        std::copy(W[l], W[l] + sizes[l], C[l]);
                // gradient at the chunk weights
                if (layers == 1)
                {
                    for (int e = 0; e < E; ++e)
                    {
                        float a = 0.0f;
                        for (int d = 0; d < D; ++d)
                            a += kr[d] * C[0][size_t(d) * E + e];
                        z[e] = a;
                    }
                    nm::outputDelta<N>(z, kr, vr, gamma, beta, mask, D, norm, sum, dz);
                    for (int d = 0; d < D; ++d)
                        for (int e = 0; e < E; ++e)
                            nm::momentumUpdate(W[0][size_t(d) * E + e], S[0][size_t(d) * E + e], kr[d] * dz[e], eta,
                                theta, alpha);
                    for (int e = 0; e < E; ++e)
                    {
                        float a = 0.0f;
                        for (int d = 0; d < D; ++d)
                            a += qr[d] * W[0][size_t(d) * E + e];
                        z[e] = a;
                    }
                }
                else
                {
                    for (int e = 0; e < E; ++e)
                    {
                        float a = 0.0f;
                        for (int d = 0; d < D; ++d)
                            a += kr[d] * C[0][size_t(d) * E + e];
                        hid[e] = a;
                        act[e] = nm::activate(a, p.activation);
                    }
                    for (int d = 0; d < D; ++d)
                    {
                        float a = 0.0f;
                        for (int e = 0; e < E; ++e)
                            a += act[e] * C[1][size_t(e) * D + d];
                        z[d] = a;
                    }
                    nm::outputDelta<N>(z, kr, vr, gamma, beta, mask, D, norm, sum, dz);
                    for (int e = 0; e < E; ++e)
                    {
                        float a = 0.0f;
                        for (int d = 0; d < D; ++d)
                            a += dz[d] * C[1][size_t(e) * D + d];
                        dh[e] = a * nm::activateGrad(hid[e], p.activation);
                    }
                    for (int d = 0; d < D; ++d)
                        for (int e = 0; e < E; ++e)
                            nm::momentumUpdate(W[0][size_t(d) * E + e], S[0][size_t(d) * E + e], kr[d] * dh[e], eta,
                                theta, alpha);
                    for (int e = 0; e < E; ++e)
                        for (int d = 0; d < D; ++d)
                            nm::momentumUpdate(W[1][size_t(e) * D + d], S[1][size_t(e) * D + d], act[e] * dz[d], eta,
                                theta, alpha);
                    // read-out at the new weights
                    for (int e = 0; e < E; ++e)
                    {
                        float a = 0.0f;
                        for (int d = 0; d < D; ++d)
                            a += qr[d] * W[0][size_t(d) * E + e];
                        act[e] = nm::activate(a, p.activation);
                    }
                    for (int d = 0; d < D; ++d)
                    {
                        float a = 0.0f;
                        for (int e = 0; e < E; ++e)
                            a += act[e] * W[1][size_t(e) * D + d];
                        z[d] = a;
                    }
                }
                nm::readOut<N>(z, qr, gamma, beta, mask, D, norm, sum, y);
                for (int d = 0; d < D; ++d)
                    F(io->output)[row + d] = y[d];
            }
        }
    int const positions = p.position_per_batch ? p.batch : 1;
    for (int i = 0; i < positions; ++i)
        io->present_position[i] = io->position[i] + p.seq;
    return kOk;
}
