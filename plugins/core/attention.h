// BandedAttention (Longformer) and WindowAttention (its streaming form) — the math.
//
// BandedAttention, query row i, head h with dilation d_h, window w (one-sided): key j is
// attended when
//     (|i - j| <= w*d_h and (i - j) mod d_h == 0) or global[j] or global[i]
// and, if causal, j <= i in every case; the P persistent tokens are always attended.
// One softmax (scale * q.k, float32) runs over the attended keys.
//
// WindowAttention, token at absolute position p, head h: keys at positions p - o*d_h for
// o = 0..w that are >= 0 (o = 0 is the token itself), plus the persistent tokens. The ring
// buffer of length L = w*max(d) holds position a in slot a mod L; positions p - o*d_h with
// o*d_h <= L are all in the ring (slot p mod L still holds p - L until the token is written).
#pragma once

#include "core/common.h"

namespace edgemem
{
namespace attn
{

// Packed layouts (both ops): query/key [B, T, H*D], value [B, T, H*Dv], output [B, T, H*Dv],
// persistent key/value [B, H, P, D | Dv].
struct BandedParams
{
    int32_t batch;
    int32_t seq;
    int32_t heads;
    int32_t d;
    int32_t dv;
    int32_t window;
    int32_t causal;
    int32_t persistent; // P
    float scale;
};

// Ring layouts: past/present key [B, H, L, D], value [B, H, L, Dv]; position int64 [B].
struct WindowParams
{
    int32_t batch;
    int32_t seq;
    int32_t heads;
    int32_t d;
    int32_t dv;
    int32_t window;
    int32_t ring;       // L
    int32_t persistent; // P
    float scale;
};

inline int checkDilation(int32_t const* dilation, int heads, int* max_dilation)
{
    int mx = 0;
    for (int h = 0; h < heads; ++h)
    {
        if (dilation[h] <= 0)
            return kBadArgument;
        mx = dilation[h] > mx ? dilation[h] : mx;
    }
    *max_dilation = mx;
    return kOk;
}

inline int check(BandedParams const& p)
{
    if (p.batch < 0 || p.seq < 0 || p.heads <= 0 || p.d <= 0 || p.dv <= 0 || p.window < 1 || p.persistent < 0)
        return kBadArgument;
    if (p.d > kMaxHeadDim || p.dv > kMaxHeadDim)
        return kUnsupported;
    return kOk;
}

inline int check(WindowParams const& p, int32_t const* dilation)
{
    int mx = 0;
    if (p.batch < 0 || p.seq < 0 || p.heads <= 0 || p.d <= 0 || p.dv <= 0 || p.window < 1 || p.persistent < 0)
        return kBadArgument;
    if (checkDilation(dilation, p.heads, &mx) != kOk || p.ring != p.window * mx)
        return kBadArgument;
    if (p.d > kMaxHeadDim || p.dv > kMaxHeadDim)
        return kUnsupported;
    return kOk;
}

EM_HD int64_t rowOffset(int seq, int heads, int dim, int b, int t, int h)
{
    return ((int64_t(b) * seq + t) * heads + h) * dim;
}
EM_HD int64_t headRowOffset(int heads, int rows, int dim, int b, int h, int r)
{
    return ((int64_t(b) * heads + h) * rows + r) * dim;
}

// The banded rule for query i and key j.
EM_HD bool bandAllowed(int64_t i, int64_t j, int window, int dilation, bool causal, bool global_i, bool global_j)
{
    int64_t const dist = i - j;
    int64_t const adist = dist < 0 ? -dist : dist;
    // positions are below 2^31, so the remainder is taken in 32 bits (a 64-bit one is a call on the GPU)
    bool ok = (adist <= int64_t(window) * dilation && int32_t(dist) % dilation == 0) || global_i || global_j;
    return causal ? ok && dist >= 0 : ok;
}

// BandedAttention's tiled form (prefill on tensor cores): queries in blocks of kBandRows, keys in
// tiles of kKeyTile. A block's key tiles are, in order: the span of its band, [lo, hi] with lo
// rounded down to a tile (band rule and global keys inside it by bandAllowed); then the global keys
// outside the span, ascending, that a causal block can reach (j <= its last row), 16 a tile; then
// the persistent keys. One online softmax per row runs over them (softmax_tile). Global query
// rows attend every key: the row-per-warp form computes them. The kernel for 16-bit I/O takes the
// same keys in the same order 64 a tile.
constexpr int kBandRows = 64;
constexpr int kKeyTile = 16;

// The tiled form takes head dims in whole 16 x 16 tiles, up to 128.
EM_HD bool tileable(BandedParams const& p) { return p.d % 16 == 0 && p.dv % 16 == 0 && p.d <= 128 && p.dv <= 128; }

// The band's key span [lo, hi] of query rows [i0, i1] (hi < lo: none).
EM_HD void bandSpan(BandedParams const& p, int dilation, int i0, int i1, int& lo, int& hi)
{
    int64_t const reach = int64_t(p.window) * dilation;
    int64_t const first = i0 - reach > 0 ? i0 - reach : 0;
    int64_t const last = p.causal ? i1 : i1 + reach;
    lo = int(first / kKeyTile * kKeyTile);
    hi = int(last < p.seq - 1 ? last : p.seq - 1);
}

// Whether global key j is scored in a gathered tile by the block whose band span is [lo, hi] and
// whose last row is i1.
EM_HD bool globalOutsideSpan(BandedParams const& p, int j, int lo, int hi, int i1)
{
    return (j < lo || j > hi) && (!p.causal || j <= i1);
}

// WindowAttention: the absolute position of the o-th key of the token at p (o = 0..window),
// or -1 when it lies before the stream.
EM_HD int64_t windowKeyPosition(int64_t p, int o, int dilation)
{
    int64_t const a = p - int64_t(o) * dilation;
    return a >= 0 ? a : -1;
}

EM_HD int ringSlot(int64_t position, int ring) { return int(position % ring); }

} // namespace attn
} // namespace edgemem
