#include "WindowAttentionPlugin.h"

#include "launch.h"

#include <algorithm>
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
    kPastKey,
    kPastValue,
    kPosition,
    kPersistentKey,
    kPersistentValue,
    kInputs
};
enum : int32_t
{
    kOutput = kInputs,
    kPresentKey,
    kPresentValue,
};
} // namespace

std::vector<FieldSpec> WindowAttentionPlugin::fieldSpecs()
{
    return {
        {"num_heads", FieldKind::kInt, true},
        {"window", FieldKind::kInt, true},
        {"dilation", FieldKind::kInts, false},
        {"scale", FieldKind::kFloat, false},
    };
}

WindowAttentionPlugin::WindowAttentionPlugin(std::string layer, Attributes const& a)
    : PluginBase(std::move(layer))
    , mHeads(a.getInt("num_heads", 0))
    , mWindow(a.getInt("window", 0))
    , mDilation(a.getInts("dilation"))
    , mScale(a.getFloat("scale", 0.0f))
{
    if (mDilation.empty() && mHeads > 0)
        mDilation.assign(size_t(mHeads), 1);
}

WindowAttentionPlugin* WindowAttentionPlugin::create(char const* layer, Attributes const& a)
{
    auto* p = new WindowAttentionPlugin(layer, a);
    std::string why;
    if (p->mHeads <= 0 || p->mWindow < 1)
        why = "num_heads must be positive and window >= 1";
    else if (int32_t(p->mDilation.size()) != p->mHeads
        || *std::min_element(p->mDilation.begin(), p->mDilation.end()) < 1)
        why = "dilation must hold one positive int per head";
    else if (p->mHeads > 128)
        why = "more than 128 heads is not supported";
    if (!why.empty())
    {
        log(ILogger::Severity::kERROR, kName, layer, why);
        delete p;
        return nullptr;
    }
    return p;
}

IPluginV3* WindowAttentionPlugin::clone() noexcept
{
    try
    {
        return new WindowAttentionPlugin(*this);
    }
    catch (...)
    {
        error("clone failed");
    }
    return nullptr;
}

void WindowAttentionPlugin::writeAttributes(Attributes& out) const
{
    out.setInt("num_heads", mHeads);
    out.setInt("window", mWindow);
    out.setInts("dilation", mDilation);
    out.setFloat("scale", mScale);
}

int32_t WindowAttentionPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    if (nbInputs != kInputs || nbOutputs != 3)
        return -1;
    outputTypes[0] = inputTypes[kQuery];
    outputTypes[1] = inputTypes[kPastKey];
    outputTypes[2] = inputTypes[kPastValue];
    return 0;
}

int32_t WindowAttentionPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const*, int32_t,
    DimsExprs* outputs, int32_t nbOutputs, IExprBuilder&) noexcept
{
    if (nbInputs != kInputs || nbOutputs != 3 || inputs[kQuery].nbDims != 3 || inputs[kValue].nbDims != 3)
    {
        error("expected query, key, value [B, T, H*D]");
        return -1;
    }
    outputs[0].nbDims = 3;
    outputs[0].d[0] = inputs[kQuery].d[0];
    outputs[0].d[1] = inputs[kQuery].d[1];
    outputs[0].d[2] = inputs[kValue].d[2];
    outputs[1] = inputs[kPastKey];
    outputs[2] = inputs[kPastValue];
    return 0;
}

bool WindowAttentionPlugin::supportsFormatCombination(
    int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (nbInputs != kInputs || nbOutputs != 3 || pos < 0 || pos >= kInputs + 3)
        return false;
    PluginTensorDesc const& d = inOut[pos].desc;
    if (!isLinear(d))
        return false;
    switch (pos)
    {
    case kQuery:
    case kPastKey:
    case kPersistentKey: return isFloatType(d.type);
    case kPosition: return d.type == DataType::kINT64;
    case kKey:
    case kValue:
    case kOutput: return d.type == inOut[kQuery].desc.type;
    case kPastValue:
    case kPresentKey:
    case kPresentValue: return d.type == inOut[kPastKey].desc.type;
    case kPersistentValue: return d.type == inOut[kPersistentKey].desc.type;
    }
    return false;
}

std::string WindowAttentionPlugin::checkShapes(PluginTensorDesc const* in, int32_t) const
{
    Dims const& q = in[kQuery].dims;
    Dims const& k = in[kKey].dims;
    Dims const& v = in[kValue].dims;
    Dims const& rk = in[kPastKey].dims;
    Dims const& rv = in[kPastValue].dims;
    Dims const& pk = in[kPersistentKey].dims;
    Dims const& pv = in[kPersistentValue].dims;
    if (q.nbDims != 3 || k.nbDims != 3 || v.nbDims != 3 || rk.nbDims != 4 || rv.nbDims != 4 || pk.nbDims != 4
        || pv.nbDims != 4 || in[kPosition].dims.nbDims != 1)
        return "expected query/key/value rank 3, rings and persistent rank 4, position rank 1";
    if (q.d[2] % mHeads != 0 || v.d[2] % mHeads != 0 || k.d[2] != q.d[2])
        return "query/key/value widths must divide by num_heads and key must match query";
    int64_t const d = q.d[2] / mHeads;
    int64_t const dv = v.d[2] / mHeads;
    int64_t const ring = int64_t(mWindow) * *std::max_element(mDilation.begin(), mDilation.end());
    if (rk.d[0] != q.d[0] || rk.d[1] != mHeads || rk.d[2] != ring || rk.d[3] != d)
        return "past_key must be [B, H, window*max(dilation), D] = [B, " + std::to_string(mHeads) + ", "
            + std::to_string(ring) + ", " + std::to_string(d) + "]";
    if (rv.d[0] != q.d[0] || rv.d[1] != mHeads || rv.d[2] != ring || rv.d[3] != dv)
        return "past_value must be [B, H, L, D_v]";
    if (in[kPosition].dims.d[0] != q.d[0])
        return "position must be [B]";
    if (pk.d[0] != q.d[0] || pk.d[1] != mHeads || pk.d[3] != d || pv.d[0] != q.d[0] || pv.d[1] != mHeads
        || pv.d[2] != pk.d[2] || pv.d[3] != dv)
        return "persistent_key/value must be [B, H, P, D] and [B, H, P, D_v]";
    if (d > kMaxHeadDim || dv > kMaxHeadDim)
        return "head dims above " + std::to_string(kMaxHeadDim) + " are not supported";
    return {};
}

int32_t WindowAttentionPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const*,
    void const* const* inputs, void* const* outputs, void*, cudaStream_t stream) noexcept
{
    try
    {
        std::string const why = checkShapes(inputDesc, kInputs);
        if (!why.empty())
        {
            error(why);
            return -1;
        }
        Dims const& q = inputDesc[kQuery].dims;
        attn::WindowParams p{};
        p.batch = int32_t(q.d[0]);
        p.seq = int32_t(q.d[1]);
        p.heads = mHeads;
        p.d = int32_t(q.d[2] / mHeads);
        p.dv = int32_t(inputDesc[kValue].dims.d[2] / mHeads);
        p.window = mWindow;
        p.ring = int32_t(inputDesc[kPastKey].dims.d[2]);
        p.persistent = int32_t(inputDesc[kPersistentKey].dims.d[2]);
        p.scale = mScale != 0.0f ? mScale : 1.0f / std::sqrt(float(p.d));
        WindowAttentionIO io{};
        io.query = inputs[kQuery];
        io.key = inputs[kKey];
        io.value = inputs[kValue];
        io.past_key = inputs[kPastKey];
        io.past_value = inputs[kPastValue];
        io.position = static_cast<int64_t const*>(inputs[kPosition]);
        io.persistent_key = inputs[kPersistentKey];
        io.persistent_value = inputs[kPersistentValue];
        io.output = outputs[0];
        io.present_key = outputs[1];
        io.present_value = outputs[2];
        return status(cuda::windowAttention(p, mDilation.data(), io, DType(dtypeOf(inputDesc[kQuery].type)),
            DType(dtypeOf(inputDesc[kPastKey].type)), DType(dtypeOf(inputDesc[kPersistentKey].type)), stream));
    }
    catch (std::exception const& e)
    {
        error(e.what());
    }
    return -1;
}

} // namespace trt
} // namespace edgemem
