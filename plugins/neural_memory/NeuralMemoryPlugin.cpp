#include "NeuralMemoryPlugin.h"

#include "launch.h"

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
    kTheta,
    kEta,
    kAlpha,
    kPosition,
    kNormWeight,
    kNormBias,
    kWeights1,
    kMomentum1,
    kChunkWeights1,
    kWeights2,
    kMomentum2,
    kChunkWeights2,
};
static_assert(kChunkWeights2 + 1 == NeuralMemoryPlugin::kInputs, "one enumerator per input");
enum : int32_t
{
    kOutput = NeuralMemoryPlugin::kInputs,
    kPresentPosition,
    kPresentWeights1, // .. kPresentChunkWeights2: the six state inputs in order
};
char const* const kActivations[] = {"silu", "gelu", "relu", "identity"};
} // namespace

std::vector<FieldSpec> NeuralMemoryPlugin::fieldSpecs()
{
    return {
        {"num_heads", FieldKind::kInt, true},
        {"chunk_size", FieldKind::kInt, false},
        {"depth", FieldKind::kInt, true},
        {"residual_norm", FieldKind::kInt, false},
        {"activation", FieldKind::kString, false},
    };
}

NeuralMemoryPlugin::NeuralMemoryPlugin(std::string layer, Attributes const& a)
    : PluginImpl(std::move(layer))
    , mHeads(a.getInt("num_heads", 0))
    , mChunk(a.getInt("chunk_size", 1))
    , mDepth(a.getInt("depth", 0))
    , mResidualNorm(a.getInt("residual_norm", 0))
    , mActivation(-1)
    , mActivationName(a.getString("activation", "silu"))
{
    for (int32_t i = 0; i < 4; ++i)
        if (mActivationName == kActivations[i])
            mActivation = i;
}

std::string NeuralMemoryPlugin::invalid() const
{
    if (mHeads <= 0 || mChunk < 1)
        return "num_heads and chunk_size must be positive";
    if (mDepth != 1 && mDepth != 2)
        return "depth must be 1 or 2";
    if (mResidualNorm != 0 && mResidualNorm != 1)
        return "residual_norm must be 0 or 1";
    if (mActivation < 0)
        return "activation must be silu, gelu, relu or identity; got '" + mActivationName + "'";
    return {};
}

void NeuralMemoryPlugin::writeAttributes(Attributes& out) const
{
    out.setInt("num_heads", mHeads);
    out.setInt("chunk_size", mChunk);
    out.setInt("depth", mDepth);
    out.setInt("residual_norm", mResidualNorm);
    out.setString("activation", kActivations[mActivation]);
}

void NeuralMemoryPlugin::outputTypes(DataType* out, DataType const* in) const
{
    out[0] = in[kQuery];
    out[1] = in[kPosition];
    for (int32_t i = 2; i < kOutputs; ++i)
        out[i] = DataType::kFLOAT;
}

std::string NeuralMemoryPlugin::outputShapes(DimsExprs const* in, DimsExprs* out, IExprBuilder&) const
{
    out[0] = in[kQuery];
    out[1] = in[kPosition];
    for (int32_t i = 0; i < 6; ++i)
        out[2 + i] = in[kWeights1 + i];
    return {};
}

bool NeuralMemoryPlugin::supports(int32_t pos, DynamicPluginTensorDesc const* inOut) const
{
    PluginTensorDesc const& d = inOut[pos].desc;
    if (pos == kQuery)
        return isFloatType(d.type);
    if (pos <= kAlpha || pos == kOutput)
        return d.type == inOut[kQuery].desc.type;
    if (pos == kPosition || pos == kPresentPosition)
        return d.type == DataType::kINT64;
    return d.type == DataType::kFLOAT; // norm parameters and the memory state
}

std::string NeuralMemoryPlugin::checkShapes(PluginTensorDesc const* in, int32_t) const
{
    Dims const& q = in[kQuery].dims;
    if (q.nbDims != 3 || q.d[2] % mHeads != 0)
        return "query must be [B, T, H*D]";
    int64_t const b = q.d[0];
    int64_t const t = q.d[1];
    int64_t const d = q.d[2] / mHeads;
    for (int32_t i : {kKey, kValue})
        if (in[i].dims.nbDims != 3 || in[i].dims.d[0] != b || in[i].dims.d[1] != t || in[i].dims.d[2] != q.d[2])
            return "key and value must be shaped like query";
    for (int32_t i : {kTheta, kEta, kAlpha})
        if (in[i].dims.nbDims != 3 || in[i].dims.d[0] != b || in[i].dims.d[1] != t || in[i].dims.d[2] != mHeads)
            return "theta, eta and alpha must be [B, T, H]";
    Dims const& pos = in[kPosition].dims;
    if (pos.nbDims != 1 || (pos.d[0] != b && pos.d[0] != 1))
        return "position must be [B] or [1]";
    for (int32_t i : {kNormWeight, kNormBias})
        if (in[i].dims.nbDims != 2 || in[i].dims.d[0] != mHeads || in[i].dims.d[1] != d)
            return "norm_weight and norm_bias must be [H, D]";
    Dims const& w1 = in[kWeights1].dims;
    if (w1.nbDims != 4 || w1.d[0] != b || w1.d[1] != mHeads || w1.d[2] != d)
        return "weights_1 must be [B, H, D, E]";
    int64_t const e = w1.d[3];
    if (mDepth == 1 && e != d)
        return "depth 1 needs weights_1 [B, H, D, D]";
    for (int32_t i = kWeights1; i <= kChunkWeights2; ++i)
    {
        Dims const& x = in[i].dims;
        bool const second = i >= kWeights2;
        bool const ok = x.nbDims == 4 && x.d[0] == b && x.d[1] == mHeads
            && (!second || mDepth == 1 ? (x.d[2] == d && x.d[3] == e) : (x.d[2] == e && x.d[3] == d));
        if (!ok)
            return "memory state tensors must be [B, H, D, E] (layer 1) and [B, H, E, D] (layer 2)";
    }
    if (d > kMaxHeadDim || e > nm::kMaxHidden)
        return "D above " + std::to_string(kMaxHeadDim) + " or E above " + std::to_string(nm::kMaxHidden)
            + " is not supported";
    return {};
}

int32_t NeuralMemoryPlugin::launch(
    PluginTensorDesc const* inputDesc, void const* const* inputs, void* const* outputs, void*, cudaStream_t stream)
{
    Dims const& q = inputDesc[kQuery].dims;
    nm::Params p{};
    p.batch = int32_t(q.d[0]);
    p.seq = int32_t(q.d[1]);
    p.heads = mHeads;
    p.d = int32_t(q.d[2] / mHeads);
    p.e = int32_t(inputDesc[kWeights1].dims.d[3]);
    p.depth = mDepth;
    p.chunk = mChunk;
    p.activation = mActivation;
    p.residual_norm = mResidualNorm;
    p.position_per_batch = inputDesc[kPosition].dims.d[0] == q.d[0];
    if (mDepth == 1)
    {
        // the second-layer outputs pass the (unread) second-layer inputs through; copy
        // them first, as those inputs may be the first layer's tensors updated below
        for (int32_t i = 0; i < 3; ++i)
        {
            void const* src = inputs[kWeights2 + i];
            void* dst = outputs[2 + 3 + i];
            size_t const bytes = size_t(p.batch) * p.heads * p.d * p.d * sizeof(float);
            if (dst != src && cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream) != cudaSuccess)
                return status(kCudaError);
        }
    }
    NeuralMemoryIO io{};
    io.query = inputs[kQuery];
    io.key = inputs[kKey];
    io.value = inputs[kValue];
    io.theta = inputs[kTheta];
    io.eta = inputs[kEta];
    io.alpha = inputs[kAlpha];
    io.position = static_cast<int64_t const*>(inputs[kPosition]);
    io.norm_weight = static_cast<float const*>(inputs[kNormWeight]);
    io.norm_bias = static_cast<float const*>(inputs[kNormBias]);
    io.output = outputs[0];
    io.present_position = static_cast<int64_t*>(outputs[1]);
    for (int32_t l = 0; l < mDepth; ++l)
    {
        io.weights[l] = static_cast<float const*>(inputs[kWeights1 + 3 * l]);
        io.momentum[l] = static_cast<float const*>(inputs[kMomentum1 + 3 * l]);
        io.chunk_weights[l] = static_cast<float const*>(inputs[kChunkWeights1 + 3 * l]);
        io.present_weights[l] = static_cast<float*>(outputs[2 + 3 * l]);
        io.present_momentum[l] = static_cast<float*>(outputs[3 + 3 * l]);
        io.present_chunk_weights[l] = static_cast<float*>(outputs[4 + 3 * l]);
    }
    return status(cuda::neuralMemoryPrefill(p, io, DType(dtypeOf(inputDesc[kQuery].type)), stream));
}

nvinfer1::IPluginCreatorInterface* NeuralMemoryCreator()
{
    static Creator<NeuralMemoryPlugin> creator;
    return &creator;
}

} // namespace trt
} // namespace edgemem
