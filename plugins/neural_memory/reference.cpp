// NeuralMemory on the CPU: per (batch, head) the memory MLP's forward, loss gradient, momentum and
// forgetting update and read-out, token by token (neural_memory.h); and the chunked form pass for
// pass as neural_memory_chunk.cu runs it.
#include "core/reference.h"
#include "core/attention.h"
#include "launch.h"

#include <algorithm>
#include <cstring>
#include <vector>

using namespace edgemem;
using ref::F;
using ref::Row;

namespace
{

constexpr int N = kMaxHeadDim;

// present_* start as copies of past_*; both forms work on them in place.
void copyState(nm::Params const& p, NeuralMemoryIO const& io)
{
    for (int l = 0; l < p.depth; ++l)
    {
        size_t const n = size_t(p.batch) * p.heads * p.d * p.e;
        float const* in[3] = {io.weights[l], io.momentum[l], io.chunk_weights[l]};
        float* out[3] = {io.present_weights[l], io.present_momentum[l], io.present_chunk_weights[l]};
        for (int x = 0; x < 3; ++x)
            if (out[x] != in[x])
                std::memmove(out[x], in[x], n * sizeof(float));
    }
}

void advancePosition(nm::Params const& p, NeuralMemoryIO const& io)
{
    int const positions = p.position_per_batch ? p.batch : 1;
    for (int i = 0; i < positions; ++i)
        io.present_position[i] = io.position[i] + p.seq;
}

// Row i of a [kPieceRows][D] array as a neural_memory.h row (zeros past D).
struct RowView
{
    int d;
    void get(std::vector<float> const& x, int i, float (&r)[N]) const
    {
        for (int j = 0; j < N; ++j)
            r[j] = j < d ? x[size_t(i) * d + j] : 0.0f;
    }
};

// The chunked form for one (batch, head), pieces in order (neural_memory.h). Arrays are
// [kPieceRows][width] row-major; rows past the piece's n tokens are zero.
struct Pieces
{
    nm::Params const& p;
    NeuralMemoryIO const& io;
    int D, E, b, h;
    bool norm, deep;
    float* W[2];
    float* S[2];
    float* C[2];
    float gamma[N] = {}, beta[N] = {}, mask[N] = {};

    Pieces(nm::Params const& p_, NeuralMemoryIO const& io_, int b_, int h_)
        : p(p_)
        , io(io_)
        , D(p_.d)
        , E(p_.e)
        , b(b_)
        , h(h_)
        , norm(p_.residual_norm != 0)
        , deep(p_.depth == 2)
    {
        size_t const off = (size_t(b) * p.heads + h) * size_t(D) * E;
        for (int l = 0; l < p.depth; ++l)
        {
            W[l] = io.present_weights[l] + off;
            S[l] = io.present_momentum[l] + off;
            C[l] = io.present_chunk_weights[l] + off;
        }
        for (int d = 0; d < D; ++d)
        {
            gamma[d] = norm ? io.norm_weight[int64_t(h) * D + d] : 1.0f;
            beta[d] = norm ? io.norm_bias[int64_t(h) * D + d] : 0.0f;
            mask[d] = 1.0f;
        }
    }

    // out = x . m for x [R][K] (row stride K) and m [K][cols]
    static void times(std::vector<float>& out, std::vector<float> const& x, float const* m, int K, int cols)
    {
        out.assign(size_t(nm::kPieceRows) * cols, 0.0f);
        for (int i = 0; i < nm::kPieceRows; ++i)
            for (int j = 0; j < cols; ++j)
            {
                float acc = 0.0f;
                for (int k = 0; k < K; ++k)
                    acc += x[size_t(i) * K + k] * m[size_t(k) * cols + j];
                out[size_t(i) * cols + j] = acc;
            }
    }

    void run()
    {
        int const R = nm::kPieceRows;
        int64_t const p0 = io.position[p.position_per_batch ? b : 0];
        std::vector<float> q, k, v, hid, act, z, dz, dh, x, y;
        RowView const rowD{D};
        SerialSum const sum;
        for (int t0 = 0; t0 < p.seq;)
        {
            int const n = nm::pieceLength(p0 + t0, p.chunk, p.seq - t0);
            bool const start = nm::chunkStart(p0 + t0, p.chunk);
            float eta[R] = {}, alpha[R] = {}, theta[R] = {}, a[R], c[R], kt[R * R], wt[R], st[R];
            q.assign(size_t(R) * D, 0.0f);
            k.assign(size_t(R) * D, 0.0f);
            v.assign(size_t(R) * D, 0.0f);
            for (int i = 0; i < n; ++i)
            {
                int64_t const row = attn::rowOffset(p.seq, p.heads, D, b, t0 + i, h);
                int64_t const gate = (int64_t(b) * p.seq + t0 + i) * p.heads + h;
                theta[i] = F(io.theta)[gate];
                eta[i] = F(io.eta)[gate];
                alpha[i] = F(io.alpha)[gate];
                for (int d = 0; d < D; ++d)
                {
                    q[size_t(i) * D + d] = F(io.query)[row + d];
                    k[size_t(i) * D + d] = F(io.key)[row + d];
                    v[size_t(i) * D + d] = F(io.value)[row + d];
                }
            }
            float const last = nm::pieceRows(eta, alpha, n, a, c);
            for (int j = 0; j < R; ++j)
                nm::pieceColumn(eta, alpha, theta, n, j, kt, R, wt[j], st[j]);

            // the key path at the chunk weights (the current weights when the piece starts a chunk)
            float const* c1 = start ? W[0] : C[0];
            float const* c2 = deep ? (start ? W[1] : C[1]) : nullptr;
            if (deep)
            {
                times(hid, k, c1, D, E);
                act.resize(hid.size());
                for (size_t i = 0; i < hid.size(); ++i)
                    act[i] = nm::activate(hid[i], p.activation);
                times(z, act, c2, E, D);
            }
            else
                times(z, k, c1, D, D);
            dz.assign(size_t(R) * D, 0.0f);
            for (int i = 0; i < n; ++i)
            {
                float zr[N], kr[N], vr[N], out[N];
                rowD.get(z, i, zr);
                rowD.get(k, i, kr);
                rowD.get(v, i, vr);
                nm::outputDelta<N>(zr, kr, vr, gamma, beta, mask, D, norm, sum, out);
                std::copy(out, out + D, dz.begin() + size_t(i) * D);
            }
            if (deep) // dh = (dz C2^T) * act'(h)
            {
                dh.assign(size_t(R) * E, 0.0f);
                for (int i = 0; i < R; ++i)
                    for (int e = 0; e < E; ++e)
                    {
                        float acc = 0.0f;
                        for (int d = 0; d < D; ++d)
                            acc += dz[size_t(i) * D + d] * c2[size_t(e) * D + d];
                        dh[size_t(i) * E + e] = acc * nm::activateGrad(hid[size_t(i) * E + e], p.activation);
                    }
            }

            // reads through the weights after each token, layer by layer
            x = q;
            for (int l = 0; l < p.depth; ++l)
            {
                int const in = l == 0 ? D : E;
                int const out = deep && l == 0 ? E : D;
                std::vector<float> const& xk = l == 0 ? k : act;
                std::vector<float> const& delta = deep && l == 0 ? dh : dz;
                y.assign(size_t(R) * out, 0.0f);
                for (int i = 0; i < R; ++i)
                {
                    float score[R];
                    for (int j = 0; j < R; ++j)
                    {
                        float acc = 0.0f;
                        for (int m = 0; m < in; ++m)
                            acc += x[size_t(i) * in + m] * xk[size_t(j) * in + m];
                        score[j] = acc * kt[i * R + j];
                    }
                    for (int o = 0; o < out; ++o)
                    {
                        float acc = 0.0f;
                        for (int m = 0; m < in; ++m)
                            acc += a[i] * x[size_t(i) * in + m] * W[l][size_t(m) * out + o];
                        for (int m = 0; m < in; ++m)
                            acc += c[i] * x[size_t(i) * in + m] * S[l][size_t(m) * out + o];
                        for (int j = 0; j < R; ++j)
                            acc -= score[j] * delta[size_t(j) * out + o];
                        y[size_t(i) * out + o] = acc;
                    }
                }
                if (deep && l == 0)
                    for (float& value : y)
                        value = nm::activate(value, p.activation);
                x.swap(y);
            }
            for (int i = 0; i < n; ++i)
            {
                float zr[N], xr[N], out[N];
                rowD.get(x, i, zr);
                rowD.get(q, i, xr);
                nm::readOut<N>(zr, xr, gamma, beta, mask, D, norm, sum, out);
                int64_t const row = attn::rowOffset(p.seq, p.heads, D, b, t0 + i, h);
                std::copy(out, out + D, F(io.output) + row);
            }

            // the state after the piece: W <- a W + c S - xk^T diag(wt) delta, S <- P S - xk^T diag(st) delta
            for (int l = 0; l < p.depth; ++l)
            {
                int const in = l == 0 ? D : E;
                int const out = deep && l == 0 ? E : D;
                std::vector<float> const& xk = l == 0 ? k : act;
                std::vector<float> const& delta = deep && l == 0 ? dh : dz;
                if (start)
                    std::copy(W[l], W[l] + size_t(in) * out, C[l]);
                for (int m = 0; m < in; ++m)
                    for (int o = 0; o < out; ++o)
                    {
                        size_t const idx = size_t(m) * out + o;
                        float w = a[n - 1] * W[l][idx] + c[n - 1] * S[l][idx];
                        float s = last * S[l][idx];
                        for (int j = 0; j < R; ++j)
                        {
                            w -= xk[size_t(j) * in + m] * (wt[j] * delta[size_t(j) * out + o]);
                            s -= xk[size_t(j) * in + m] * (st[j] * delta[size_t(j) * out + o]);
                        }
                        W[l][idx] = w;
                        S[l][idx] = s;
                    }
            }
            t0 += n;
        }
    }
};

} // namespace

EM_REF_API int em_ref_neural_memory_chunked(nm::Params const* params, NeuralMemoryIO const* io)
{
    nm::Params const& p = *params;
    if (int const st = nm::check(p))
        return st;
    if (!nm::pieceable(p))
        return kUnsupported;
    copyState(p, *io);
    for (int b = 0; b < p.batch; ++b)
        for (int h = 0; h < p.heads; ++h)
            Pieces(p, *io, b, h).run();
    advancePosition(p, *io);
    return kOk;
}

EM_REF_API int em_ref_neural_memory(nm::Params const* params, NeuralMemoryIO const* io)
{
    nm::Params const& p = *params;
    if (int const st = nm::check(p))
        return st;
    int const D = p.d;
    int const E = p.e;
    bool const norm = p.residual_norm != 0;
    int const layers = p.depth;
    size_t const sizes[2] = {size_t(D) * E, size_t(E) * D};
    copyState(p, *io);
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
                            nm::momentumUpdate(
                                W[0][size_t(d) * E + e], S[0][size_t(d) * E + e], kr[d] * dz[e], eta, theta, alpha);
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
                            nm::momentumUpdate(
                                W[0][size_t(d) * E + e], S[0][size_t(d) * E + e], kr[d] * dh[e], eta, theta, alpha);
                    for (int e = 0; e < E; ++e)
                        for (int d = 0; d < D; ++d)
                            nm::momentumUpdate(
                                W[1][size_t(e) * D + d], S[1][size_t(e) * D + d], act[e] * dz[d], eta, theta, alpha);
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
    advancePosition(p, *io);
    return kOk;
}

void edgemem::ref::layout_neural_memory(Layout& out)
{
    EM_LAYOUT_STRUCT(out, nm::Params);
    EM_LAYOUT_FIELD(out, nm::Params, batch);
    EM_LAYOUT_FIELD(out, nm::Params, seq);
    EM_LAYOUT_FIELD(out, nm::Params, heads);
    EM_LAYOUT_FIELD(out, nm::Params, d);
    EM_LAYOUT_FIELD(out, nm::Params, e);
    EM_LAYOUT_FIELD(out, nm::Params, depth);
    EM_LAYOUT_FIELD(out, nm::Params, chunk);
    EM_LAYOUT_FIELD(out, nm::Params, activation);
    EM_LAYOUT_FIELD(out, nm::Params, residual_norm);
    EM_LAYOUT_FIELD(out, nm::Params, position_per_batch);
    EM_LAYOUT_STRUCT(out, NeuralMemoryIO);
    EM_LAYOUT_FIELD(out, NeuralMemoryIO, query);
    EM_LAYOUT_FIELD(out, NeuralMemoryIO, key);
    EM_LAYOUT_FIELD(out, NeuralMemoryIO, value);
    EM_LAYOUT_FIELD(out, NeuralMemoryIO, theta);
    EM_LAYOUT_FIELD(out, NeuralMemoryIO, eta);
    EM_LAYOUT_FIELD(out, NeuralMemoryIO, alpha);
    EM_LAYOUT_FIELD(out, NeuralMemoryIO, position);
    EM_LAYOUT_FIELD(out, NeuralMemoryIO, norm_weight);
    EM_LAYOUT_FIELD(out, NeuralMemoryIO, norm_bias);
    EM_LAYOUT_FIELD(out, NeuralMemoryIO, weights);
    EM_LAYOUT_FIELD(out, NeuralMemoryIO, momentum);
    EM_LAYOUT_FIELD(out, NeuralMemoryIO, chunk_weights);
    EM_LAYOUT_FIELD(out, NeuralMemoryIO, output);
    EM_LAYOUT_FIELD(out, NeuralMemoryIO, present_position);
    EM_LAYOUT_FIELD(out, NeuralMemoryIO, present_weights);
    EM_LAYOUT_FIELD(out, NeuralMemoryIO, present_momentum);
    EM_LAYOUT_FIELD(out, NeuralMemoryIO, present_chunk_weights);
}
