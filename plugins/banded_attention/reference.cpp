// BandedAttention on the CPU: one online softmax per (query row, head) over the keys the band,
// the global tokens and the persistent tokens allow (core/attention.h); and the tiled form as
// banded_attention_tile.cu runs it.
#include "core/reference.h"
#include "launch.h"

#include <algorithm>
#include <cstring>
#include <vector>

using namespace edgemem;
using ref::F;
using ref::Row;

namespace
{

// One query row of the row-per-warp form: every key the rule allows, then the persistent keys.
void attendRow(attn::BandedParams const& p, int32_t const* dilation, BandedAttentionIO const& io, int b, int h, int i)
{
    float const* q = F(io.query);
    float const* k = F(io.key);
    float const* v = F(io.value);
    float const* pk = F(io.persistent_key);
    float const* pv = F(io.persistent_value);
    bool const* gm = io.global_mask + int64_t(b) * p.seq;
    float const* qr = q + attn::rowOffset(p.seq, p.heads, p.d, b, i, h);
    Row row(p.dv);
    for (int j = 0; j < p.seq; ++j)
        if (attn::bandAllowed(i, j, p.window, dilation[h], p.causal != 0, gm[i], gm[j]))
            row.add(qr, k + attn::rowOffset(p.seq, p.heads, p.d, b, j, h),
                v + attn::rowOffset(p.seq, p.heads, p.dv, b, j, h), p.d, p.scale);
    for (int r = 0; r < p.persistent; ++r)
        row.add(qr, pk + attn::headRowOffset(p.heads, p.persistent, p.d, b, h, r),
            pv + attn::headRowOffset(p.heads, p.persistent, p.dv, b, h, r), p.d, p.scale);
    row.write(F(io.output) + attn::rowOffset(p.seq, p.heads, p.dv, b, i, h));
}

enum TileKind
{
    kBandTile,
    kGlobalTile,
    kPersistentTile,
};

// The tiled form for one block of query rows: its key tiles in the kernel's order, one
// softmax_tile per (row, tile); global rows by attendRow.
void tiledBlock(attn::BandedParams const& p, int32_t const* dilation, BandedAttentionIO const& io, int b, int h, int i0)
{
    constexpr int KT = attn::kKeyTile;
    int const i1 = std::min(i0 + attn::kBandRows, p.seq) - 1;
    int const rows = i1 - i0 + 1;
    bool const* gm = io.global_mask + int64_t(b) * p.seq;
    int lo = 0, hi = -1;
    attn::bandSpan(p, dilation[h], i0, i1, lo, hi);
    std::vector<SoftmaxState> st(rows, softmax_empty());
    std::vector<float> acc(size_t(rows) * p.dv, 0.0f);
    SerialSum const all;
    auto tile = [&](TileKind kind, int const(&keys)[KT])
    {
        for (int r = 0; r < rows; ++r)
        {
            int const i = i0 + r;
            if (gm[i])
                continue;
            float const* qr = F(io.query) + attn::rowOffset(p.seq, p.heads, p.d, b, i, h);
            float s[KT];
            float const* vr[KT] = {};
            for (int c = 0; c < KT; ++c)
            {
                int const j = keys[c];
                bool const ok = j >= 0
                    && (kind == kBandTile ? attn::bandAllowed(i, j, p.window, dilation[h], p.causal != 0, false, gm[j])
                                          : kind == kPersistentTile || !p.causal || j <= i);
                s[c] = -INFINITY;
                if (!ok)
                    continue;
                float const* kr = kind == kPersistentTile
                    ? F(io.persistent_key) + attn::headRowOffset(p.heads, p.persistent, p.d, b, h, j)
                    : F(io.key) + attn::rowOffset(p.seq, p.heads, p.d, b, j, h);
                vr[c] = kind == kPersistentTile
                    ? F(io.persistent_value) + attn::headRowOffset(p.heads, p.persistent, p.dv, b, h, j)
                    : F(io.value) + attn::rowOffset(p.seq, p.heads, p.dv, b, j, h);
                float dot = 0.0f;
                for (int x = 0; x < p.d; ++x)
                    dot += qr[x] * kr[x];
                s[c] = p.scale * dot;
            }
            float const rescale = softmax_tile<KT>(st[r], s, all, all);
            for (int x = 0; x < p.dv; ++x)
            {
                float o = 0.0f;
                for (int c = 0; c < KT; ++c)
                    o += vr[c] ? s[c] * vr[c][x] : 0.0f;
                acc[size_t(r) * p.dv + x] = rescale * acc[size_t(r) * p.dv + x] + o;
            }
        }
    };
    int keys[KT];
    auto range = [&](TileKind kind, int first, int last) // keys first..last, 16 a tile
    {
        for (int j0 = first; j0 <= last; j0 += KT)
        {
            for (int c = 0; c < KT; ++c)
                keys[c] = j0 + c <= last ? j0 + c : -1;
            tile(kind, keys);
        }
    };
    range(kBandTile, lo, hi);
    int n = 0;
    for (int j = 0; j <= p.seq; ++j)
    {
        bool const last = j == p.seq;
        if (!last && gm[j] && attn::globalOutsideSpan(p, j, lo, hi, i1))
            keys[n++] = j;
        if (n == KT || (last && n > 0))
        {
            for (int c = n; c < KT; ++c)
                keys[c] = -1;
            tile(kGlobalTile, keys);
            n = 0;
        }
    }
    range(kPersistentTile, 0, p.persistent - 1);
    for (int r = 0; r < rows; ++r)
    {
        int const i = i0 + r;
        if (gm[i])
        {
            attendRow(p, dilation, io, b, h, i);
            continue;
        }
        float* out = F(io.output) + attn::rowOffset(p.seq, p.heads, p.dv, b, i, h);
        for (int x = 0; x < p.dv; ++x)
            out[x] = acc[size_t(r) * p.dv + x] / st[r].l;
    }
}

int checkCall(attn::BandedParams const& p, int32_t const* dilation)
{
    int mx = 0;
    if (int const st = attn::check(p))
        return st;
    return attn::checkDilation(dilation, p.heads, &mx);
}

} // namespace

EM_REF_API int em_ref_banded_attention_tiled(
    attn::BandedParams const* params, int32_t const* dilation, BandedAttentionIO const* io)
{
    attn::BandedParams const& p = *params;
    if (int const st = checkCall(p, dilation))
        return st;
    if (!attn::tileable(p))
        return kUnsupported;
    for (int b = 0; b < p.batch; ++b)
        for (int h = 0; h < p.heads; ++h)
            for (int i0 = 0; i0 < p.seq; i0 += attn::kBandRows)
                tiledBlock(p, dilation, *io, b, h, i0);
    return kOk;
}

EM_REF_API int em_ref_banded_attention(
    attn::BandedParams const* params, int32_t const* dilation, BandedAttentionIO const* io)
{
    attn::BandedParams const& p = *params;
    if (int const st = checkCall(p, dilation))
        return st;
    for (int b = 0; b < p.batch; ++b)
        for (int h = 0; h < p.heads; ++h)
            for (int i = 0; i < p.seq; ++i)
                attendRow(p, dilation, *io, b, h, i);
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
