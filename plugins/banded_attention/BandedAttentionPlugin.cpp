#include "BandedAttentionPlugin.h"

#include "launch.h"

#include <cmath>

using namespace nvinfer1;

namespace edgemem
{
namespace trt
{

namespace
{
enum : int32_t
{
    kQuery,
    kKey,
    kValue,
    kGlobalMask,
    kPersistentKey,
    kPersistentValue,
};
constexpr int32_t kOutput = BandedAttentionPlugin::kInputs;
static_assert(kPersistentValue + 1 == BandedAttentionPlugin::kInputs, "one enumerator per input");
} // namespace

std::vector<FieldSpec> BandedAttentionPlugin::fieldSpecs()
{
    return {
        {"num_heads", FieldKind::kInt, true},
        {"window", FieldKind::kInt, true},
        {"dilation", FieldKind::kInts, false},
        {"causal", FieldKind::kInt, false},
        {"scale", FieldKind::kFloat, false},
    };
}

BandedAttentionPlugin::BandedAttentionPlugin(std::string layer, Attributes const& a)
    : PluginImpl(std::move(layer))
    , mHeads(a.getInt("num_heads", 0))
    , mWindow(a.getInt("window", 0))
    , mDilation(a.getInts("dilation"))
    , mCausal(a.getInt("causal", 0))
    , mScale(a.getFloat("scale", 0.0f))
{
    if (mDilation.empty() && mHeads > 0)
        mDilation.assign(size_t(mHeads), 1);
}

std::string BandedAttentionPlugin::invalid() const
{
    if (mCausal != 0 && mCausal != 1)
        return "causal must be 0 or 1";
    return checkHeadsWindowDilation(mHeads, mWindow, mDilation);
}

void BandedAttentionPlugin::writeAttributes(Attributes& out) const
{
    out.setInt("num_heads", mHeads);
    out.setInt("window", mWindow);
    out.setInts("dilation", mDilation);
    out.setInt("causal", mCausal);
    out.setFloat("scale", mScale);
}

void BandedAttentionPlugin::outputTypes(DataType* out, DataType const* in) const { out[0] = in[kQuery]; }

std::string BandedAttentionPlugin::outputShapes(DimsExprs const* in, DimsExprs* out, IExprBuilder&) const
{
    if (in[kQuery].nbDims != 3 || in[kValue].nbDims != 3)
        return "expected query, key, value [B, T, H*D]";
    out[0].nbDims = 3;
    out[0].d[0] = in[kQuery].d[0];
    out[0].d[1] = in[kQuery].d[1];
    out[0].d[2] = in[kValue].d[2];
    return {};
}

bool BandedAttentionPlugin::supports(int32_t pos, DynamicPluginTensorDesc const* inOut) const
{
    PluginTensorDesc const& d = inOut[pos].desc;
    switch (pos)
    {
    case kQuery: return isFloatType(d.type);
    case kPersistentKey: return isStateType(d.type, inOut[kQuery].desc.type);
    case kGlobalMask: return d.type == DataType::kBOOL;
    case kPersistentValue: return d.type == inOut[kPersistentKey].desc.type;
    default: return d.type == inOut[kQuery].desc.type; // key, value, output
    }
}

std::string BandedAttentionPlugin::checkShapes(PluginTensorDesc const* in, int32_t) const
{
    Dims const& q = in[kQuery].dims;
    Dims const& k = in[kKey].dims;
    Dims const& v = in[kValue].dims;
    Dims const& g = in[kGlobalMask].dims;
    Dims const& pk = in[kPersistentKey].dims;
    Dims const& pv = in[kPersistentValue].dims;
    if (q.nbDims != 3 || k.nbDims != 3 || v.nbDims != 3 || g.nbDims != 2 || pk.nbDims != 4 || pv.nbDims != 4)
        return "expected query/key/value rank 3, global_mask rank 2, persistent rank 4";
    if (q.d[2] % mHeads != 0 || v.d[2] % mHeads != 0 || k.d[2] != q.d[2])
        return "query/key/value widths must divide by num_heads and key must match query";
    if (k.d[0] != q.d[0] || k.d[1] != q.d[1] || v.d[0] != q.d[0] || v.d[1] != q.d[1] || g.d[0] != q.d[0]
        || g.d[1] != q.d[1])
        return "key, value and global_mask must share query's [B, T]";
    int64_t const d = q.d[2] / mHeads;
    int64_t const dv = v.d[2] / mHeads;
    if (pk.d[0] != q.d[0] || pk.d[1] != mHeads || pk.d[3] != d || pv.d[0] != q.d[0] || pv.d[1] != mHeads
        || pv.d[2] != pk.d[2] || pv.d[3] != dv)
        return "persistent_key/value must be [B, H, P, D] and [B, H, P, D_v]";
    if (d > kMaxHeadDim || dv > kMaxHeadDim)
        return "head dims above " + std::to_string(kMaxHeadDim) + " are not supported";
    return {};
}

int32_t BandedAttentionPlugin::launch(
    PluginTensorDesc const* inputDesc, void const* const* inputs, void* const* outputs, void*, cudaStream_t stream)
{
    Dims const& q = inputDesc[kQuery].dims;
    attn::BandedParams p{};
    p.batch = int32_t(q.d[0]);
    p.seq = int32_t(q.d[1]);
    p.heads = mHeads;
    p.d = int32_t(q.d[2] / mHeads);
    p.dv = int32_t(inputDesc[kValue].dims.d[2] / mHeads);
    p.window = mWindow;
    p.causal = mCausal;
    p.persistent = int32_t(inputDesc[kPersistentKey].dims.d[2]);
    p.scale = mScale != 0.0f ? mScale : 1.0f / std::sqrt(float(p.d));
    BandedAttentionIO io{};
    io.query = inputs[kQuery];
    io.key = inputs[kKey];
    io.value = inputs[kValue];
    io.global_mask = static_cast<bool const*>(inputs[kGlobalMask]);
    io.persistent_key = inputs[kPersistentKey];
    io.persistent_value = inputs[kPersistentValue];
    io.output = outputs[0];
    return status(cuda::bandedAttentionPrefill(p, mDilation.data(), io, DType(dtypeOf(inputDesc[kQuery].type)),
        DType(dtypeOf(inputDesc[kPersistentKey].type)), stream));
}

nvinfer1::IPluginCreatorInterface* BandedAttentionCreator()
{
    static Creator<BandedAttentionPlugin> creator;
    return &creator;
}

} // namespace trt
} // namespace edgemem
