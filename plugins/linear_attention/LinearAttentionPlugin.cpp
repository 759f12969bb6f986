#include "LinearAttentionPlugin.h"

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
// inputs
enum : int32_t
{
    kQuery,
    kKey,
    kValue,
    kPastState,
    kDecay,
    kBeta,
};
static_assert(kBeta + 1 == LinearAttentionPlugin::kInputs, "one enumerator per input");
char const* const kRules[] = {"linear", "gated", "delta", "gated_delta"};
} // namespace

std::vector<FieldSpec> LinearAttentionPlugin::fieldSpecs()
{
    return {
        {"update_rule", FieldKind::kString, false},
        {"scale", FieldKind::kFloat, false},
        {"q_num_heads", FieldKind::kInt, true},
        {"kv_num_heads", FieldKind::kInt, true},
        {"chunk_size", FieldKind::kInt, false},
    };
}

LinearAttentionPlugin::LinearAttentionPlugin(std::string layer, Attributes const& a)
    : PluginImpl(std::move(layer))
    , mRule(-1)
    , mRuleName(a.getString("update_rule", "gated_delta")) // the ONNX opset-27 default
    , mScale(a.getFloat("scale", 0.0f))
    , mQHeads(a.getInt("q_num_heads", 0))
    , mKvHeads(a.getInt("kv_num_heads", 0))
    , mChunk(a.getInt("chunk_size", 64))
{
    for (int32_t r = 0; r < 4; ++r)
        if (mRuleName == kRules[r])
            mRule = r;
}

std::string LinearAttentionPlugin::invalid() const
{
    if (mRule < 0)
        return "update_rule must be linear, gated, delta or gated_delta; got '" + mRuleName + "'";
    if (mQHeads <= 0 || mKvHeads <= 0 || mQHeads % mKvHeads != 0)
        return "q_num_heads (" + std::to_string(mQHeads) + ") must be a positive multiple of kv_num_heads ("
            + std::to_string(mKvHeads) + ")";
    return {};
}

void LinearAttentionPlugin::writeAttributes(Attributes& out) const
{
    out.setString("update_rule", mRuleName);
    out.setFloat("scale", mScale);
    out.setInt("q_num_heads", mQHeads);
    out.setInt("kv_num_heads", mKvHeads);
    out.setInt("chunk_size", mChunk);
}

void LinearAttentionPlugin::outputTypes(DataType* out, DataType const* in) const
{
    out[0] = in[kQuery];
    out[1] = DataType::kFLOAT;
}

std::string LinearAttentionPlugin::outputShapes(DimsExprs const* in, DimsExprs* out, IExprBuilder& eb) const
{
    if (in[kQuery].nbDims != 3 || in[kValue].nbDims != 3 || in[kPastState].nbDims != 4)
        return "expected query, key, value [B, T, H*D] and past_state [B, H_kv, d_k, d_v]";
    // output [B, T, H_q * d_v] with d_v = value width / H_kv
    auto const* dv = eb.operation(DimensionOperation::kFLOOR_DIV, *in[kValue].d[2], *eb.constant(mKvHeads));
    out[0].nbDims = 3;
    out[0].d[0] = in[kQuery].d[0];
    out[0].d[1] = in[kQuery].d[1];
    out[0].d[2] = eb.operation(DimensionOperation::kPROD, *dv, *eb.constant(mQHeads));
    out[1] = in[kPastState];
    return {};
}

bool LinearAttentionPlugin::supports(int32_t pos, DynamicPluginTensorDesc const* inOut) const
{
    PluginTensorDesc const& d = inOut[pos].desc;
    switch (pos)
    {
    case kQuery: return isFloatType(d.type);
    case kPastState:
    case kInputs + 1: return d.type == DataType::kFLOAT; // past/present state are float32
    default: return d.type == inOut[kQuery].desc.type;   // key, value, decay, beta, output
    }
}

std::string LinearAttentionPlugin::checkShapes(PluginTensorDesc const* in, int32_t) const
{
    Dims const& q = in[kQuery].dims;
    Dims const& k = in[kKey].dims;
    Dims const& v = in[kValue].dims;
    Dims const& s = in[kPastState].dims;
    Dims const& g = in[kDecay].dims;
    Dims const& b = in[kBeta].dims;
    if (q.nbDims != 3 || k.nbDims != 3 || v.nbDims != 3 || s.nbDims != 4 || g.nbDims != 3 || b.nbDims != 3)
        return "query/key/value/decay/beta must be rank 3 and past_state rank 4";
    if (q.d[2] % mQHeads != 0 || v.d[2] % mKvHeads != 0)
        return "query/value widths must divide by their head counts";
    int64_t const dk = q.d[2] / mQHeads;
    int64_t const dv = v.d[2] / mKvHeads;
    for (Dims const* x : {&k, &v, &g, &b})
        if (x->d[0] != q.d[0] || x->d[1] != q.d[1])
            return "key/value/decay/beta must share query's [B, T]";
    if (k.d[2] != mKvHeads * dk)
        return "key width must be kv_num_heads * d_k";
    if (s.d[0] != q.d[0] || s.d[1] != mKvHeads || s.d[2] != dk || s.d[3] != dv)
        return "past_state must be [B, kv_num_heads, d_k, d_v]";
    if (g.d[2] != mKvHeads && g.d[2] != mKvHeads * dk)
        return "decay must be [B, T, H_kv] or [B, T, H_kv*d_k]";
    if (b.d[2] != mKvHeads && b.d[2] != 1)
        return "beta must be [B, T, H_kv] or [B, T, 1]";
    if (dk > kMaxHeadDim)
        return "d_k above " + std::to_string(kMaxHeadDim) + " is not supported";
    return {};
}

la::Params LinearAttentionPlugin::params(Dims const& q, Dims const& v, Dims const& decay, Dims const& beta) const
{
    la::Params p{};
    p.batch = int32_t(q.d[0]);
    p.seq = int32_t(q.d[1]);
    p.q_heads = mQHeads;
    p.kv_heads = mKvHeads;
    p.dk = int32_t(q.d[2] / mQHeads);
    p.dv = int32_t(v.d[2] / mKvHeads);
    p.rule = mRule;
    p.scale = mScale != 0.0f ? mScale : 1.0f / std::sqrt(float(p.dk));
    p.decay_per_key = decay.d[2] == int64_t(mKvHeads) * p.dk && p.dk > 1;
    p.beta_per_head = beta.d[2] == mKvHeads;
    return p;
}

// The chunked prefill's workspace: its fixed budget when some call of the profile takes that form
// (the longest sequence at the smallest batch; a longer sequence runs in segments), else none.
size_t LinearAttentionPlugin::getWorkspaceSize(
    DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const*, int32_t) const noexcept
{
    if (nbInputs != kInputs)
        return 0;
    la::Params p = params(in[kQuery].max, in[kValue].max, in[kDecay].max, in[kBeta].max);
    p.batch = int32_t(std::max<int64_t>(1, in[kQuery].min.d[0]));
    return cuda::linearAttentionWorkspace(p) > 0 ? size_t(la::kChunkBudget) : 0;
}

int32_t LinearAttentionPlugin::launch(PluginTensorDesc const* inputDesc, void const* const* inputs,
    void* const* outputs, void* workspace, cudaStream_t stream)
{
    la::Params const p
        = params(inputDesc[kQuery].dims, inputDesc[kValue].dims, inputDesc[kDecay].dims, inputDesc[kBeta].dims);
    LinearAttentionIO io{};
    io.query = inputs[kQuery];
    io.key = inputs[kKey];
    io.value = inputs[kValue];
    io.past_state = static_cast<float const*>(inputs[kPastState]);
    io.decay = inputs[kDecay];
    io.beta = inputs[kBeta];
    io.output = outputs[0];
    io.present_state = static_cast<float*>(outputs[1]);
    return status(cuda::linearAttention(
        p, io, DType(dtypeOf(inputDesc[kQuery].type)), workspace, workspace ? size_t(la::kChunkBudget) : 0, stream));
}

nvinfer1::IPluginCreatorInterface* LinearAttentionCreator()
{
    static Creator<LinearAttentionPlugin> creator;
    return &creator;
}

} // namespace trt
} // namespace edgemem
