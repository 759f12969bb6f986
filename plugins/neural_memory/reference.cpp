// NeuralMemory on the CPU: per (batch, head) the memory MLP's forward, loss gradient, momentum and
// forgetting update and read-out, token by token (neural_memory.h).
#include "core/reference.h"
#include "core/attention.h"
#include "launch.h"

#include <algorithm>
#include <cstring>
#include <vector>

using namespace edgemem;
using ref::F;
using ref::Row;

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
    int const positions = p.position_per_batch ? p.batch : 1;
    for (int i = 0; i < positions; ++i)
        io->present_position[i] = io->position[i] + p.seq;
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
