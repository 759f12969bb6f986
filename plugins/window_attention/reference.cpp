// WindowAttention on the CPU: each token's window of the ring plus the persistent tokens, one
// online softmax per (token, head); the token's key/value then written into its ring slot.
#include "core/reference.h"
#include "launch.h"

#include <algorithm>
#include <cstring>
#include <vector>

using namespace edgemem;
using ref::F;
using ref::Row;

EM_REF_API int em_ref_window_attention(
    attn::WindowParams const* params, int32_t const* dilation, WindowAttentionIO const* io)
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

void edgemem::ref::layout_window_attention(Layout& out)
{
    EM_LAYOUT_STRUCT(out, attn::WindowParams);
    EM_LAYOUT_FIELD(out, attn::WindowParams, batch);
    EM_LAYOUT_FIELD(out, attn::WindowParams, seq);
    EM_LAYOUT_FIELD(out, attn::WindowParams, heads);
    EM_LAYOUT_FIELD(out, attn::WindowParams, d);
    EM_LAYOUT_FIELD(out, attn::WindowParams, dv);
    EM_LAYOUT_FIELD(out, attn::WindowParams, window);
    EM_LAYOUT_FIELD(out, attn::WindowParams, ring);
    EM_LAYOUT_FIELD(out, attn::WindowParams, persistent);
    EM_LAYOUT_FIELD(out, attn::WindowParams, scale);
    EM_LAYOUT_STRUCT(out, WindowAttentionIO);
    EM_LAYOUT_FIELD(out, WindowAttentionIO, query);
    EM_LAYOUT_FIELD(out, WindowAttentionIO, key);
    EM_LAYOUT_FIELD(out, WindowAttentionIO, value);
    EM_LAYOUT_FIELD(out, WindowAttentionIO, past_key);
    EM_LAYOUT_FIELD(out, WindowAttentionIO, past_value);
    EM_LAYOUT_FIELD(out, WindowAttentionIO, position);
    EM_LAYOUT_FIELD(out, WindowAttentionIO, persistent_key);
    EM_LAYOUT_FIELD(out, WindowAttentionIO, persistent_value);
    EM_LAYOUT_FIELD(out, WindowAttentionIO, output);
    EM_LAYOUT_FIELD(out, WindowAttentionIO, present_key);
    EM_LAYOUT_FIELD(out, WindowAttentionIO, present_value);
}
