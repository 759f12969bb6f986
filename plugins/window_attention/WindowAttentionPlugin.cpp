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
};
static_assert(kPersistentValue + 1 == WindowAttentionPlugin::kInputs, "one enumerator per input");
enum : int32_t
{
    kOutput = WindowAttentionPlugin::kInputs,
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
    : PluginImpl(std::move(layer))
    , mHeads(a.getInt("num_heads", 0))
    , mWindow(a.getInt("window", 0))
    , mDilation(a.getInts("dilation"))
    , mScale(a.getFloat("scale", 0.0f))
{
    if (mDilation.empty() && mHeads > 0)
        mDilation.assign(size_t(mHeads), 1);
}

std::string WindowAttentionPlugin::invalid() const { return checkHeadsWindowDilation(mHeads, mWindow, mDilation); }

void WindowAttentionPlugin::writeAttributes(Attributes& out) const
{
    out.setInt("num_heads", mHeads);
    out.setInt("window", mWindow);
    out.setInts("dilation", mDilation);
    out.setFloat("scale", mScale);
}

void WindowAttentionPlugin::outputTypes(DataType* out, DataType const* in) const
{
    out[0] = in[kQuery];
    out[1] = in[kPastKey];
    out[2] = in[kPastValue];
}

std::string WindowAttentionPlugin::outputShapes(DimsExprs const* in, DimsExprs* out, IExprBuilder&) const
{
    if (in[kQuery].nbDims != 3 || in[kValue].nbDims != 3)
        return "expected query, key, value [B, T, H*D]";
    out[0].nbDims = 3;
    out[0].d[0] = in[kQuery].d[0];
    out[0].d[1] = in[kQuery].d[1];
    out[0].d[2] = in[kValue].d[2];
    out[1] = in[kPastKey];
    out[2] = in[kPastValue];
    return {};
}

bool WindowAttentionPlugin::supports(int32_t pos, DynamicPluginTensorDesc const* inOut) const
{
    PluginTensorDesc const& d = inOut[pos].desc;
    switch (pos)
    {
    case kQuery: return isFloatType(d.type);
    case kPastKey:
    case kPersistentKey: return isStateType(d.type, inOut[kQuery].desc.type);
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

attn::WindowParams WindowAttentionPlugin::params(
    Dims const& q, Dims const& v, Dims const& ring, Dims const& persistent) const
{
    attn::WindowParams p{};
    p.batch = int32_t(q.d[0]);
    p.seq = int32_t(q.d[1]);
    p.heads = mHeads;
    p.d = int32_t(q.d[2] / mHeads);
    p.dv = int32_t(v.d[2] / mHeads);
    p.window = mWindow;
    p.ring = int32_t(ring.d[2]);
    p.persistent = int32_t(persistent.d[2]);
    p.scale = mScale != 0.0f ? mScale : 1.0f / std::sqrt(float(p.d));
    return p;
}

// The decode split's partial softmaxes at the profile's largest batch (one token a call).
size_t WindowAttentionPlugin::getWorkspaceSize(
    DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const*, int32_t) const noexcept
{
    if (nbInputs != kInputs)
        return 0;
    attn::WindowParams p = params(in[kQuery].max, in[kValue].max, in[kPastKey].max, in[kPersistentKey].max);
    p.seq = 1;
    return cuda::windowAttentionWorkspace(p);
}

int32_t WindowAttentionPlugin::launch(PluginTensorDesc const* inputDesc, void const* const* inputs,
    void* const* outputs, void* workspace, cudaStream_t stream)
{
    attn::WindowParams const p = params(
        inputDesc[kQuery].dims, inputDesc[kValue].dims, inputDesc[kPastKey].dims, inputDesc[kPersistentKey].dims);
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
        DType(dtypeOf(inputDesc[kPastKey].type)), DType(dtypeOf(inputDesc[kPersistentKey].type)), workspace,
        workspace ? cuda::windowAttentionWorkspace(p) : 0, stream));
}

nvinfer1::IPluginCreatorInterface* WindowAttentionCreator()
{
    static Creator<WindowAttentionPlugin> creator;
    return &creator;
}

} // namespace trt
} // namespace edgemem
