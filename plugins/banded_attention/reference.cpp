// BandedAttention on the CPU: one online softmax per (query row, head) over the keys the band,
// the global tokens and the persistent tokens allow (core/attention.h).
#include "core/reference.h"
#include "launch.h"

#include <algorithm>
#include <cstring>
#include <vector>

using namespace edgemem;
using ref::F;
using ref::Row;

EM_REF_API int em_ref_banded_attention(
    attn::BandedParams const* params, int32_t const* dilation, BandedAttentionIO const* io)
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

void edgemem::ref::layout_banded_attention(Layout& out)
{
    EM_LAYOUT_STRUCT(out, attn::BandedParams);
    EM_LAYOUT_FIELD(out, attn::BandedParams, batch);
    EM_LAYOUT_FIELD(out, attn::BandedParams, seq);
    EM_LAYOUT_FIELD(out, attn::BandedParams, heads);
    EM_LAYOUT_FIELD(out, attn::BandedParams, d);
    EM_LAYOUT_FIELD(out, attn::BandedParams, dv);
    EM_LAYOUT_FIELD(out, attn::BandedParams, window);
    EM_LAYOUT_FIELD(out, attn::BandedParams, causal);
    EM_LAYOUT_FIELD(out, attn::BandedParams, persistent);
    EM_LAYOUT_FIELD(out, attn::BandedParams, scale);
    EM_LAYOUT_STRUCT(out, BandedAttentionIO);
    EM_LAYOUT_FIELD(out, BandedAttentionIO, query);
    EM_LAYOUT_FIELD(out, BandedAttentionIO, key);
    EM_LAYOUT_FIELD(out, BandedAttentionIO, value);
    EM_LAYOUT_FIELD(out, BandedAttentionIO, global_mask);
    EM_LAYOUT_FIELD(out, BandedAttentionIO, persistent_key);
    EM_LAYOUT_FIELD(out, BandedAttentionIO, persistent_value);
    EM_LAYOUT_FIELD(out, BandedAttentionIO, output);
}
