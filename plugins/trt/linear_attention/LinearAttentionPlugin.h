// edgemem::LinearAttention (version 1) as a TensorRT IPluginV3.
#pragma once

#include "../common/plugin.h"

namespace edgemem
{
namespace trt
{

class LinearAttentionPlugin : public PluginBase
{
public:
    static constexpr char const* kName = "LinearAttention";
    static std::vector<FieldSpec> fieldSpecs();
    static LinearAttentionPlugin* create(char const* layer, Attributes const& attrs);

    LinearAttentionPlugin(std::string layer, int32_t rule, float scale, int32_t q_heads, int32_t kv_heads, int32_t chunk)
        : PluginBase(std::move(layer))
        , mRule(rule)
        , mScale(scale)
        , mQHeads(q_heads)
        , mKvHeads(kv_heads)
        , mChunk(chunk)
    {
    }

    nvinfer1::IPluginV3* clone() noexcept override;
    char const* getPluginName() const noexcept override { return kName; }
    int32_t getNbOutputs() const noexcept override { return 2; }
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs, nvinfer1::DataType const* inputTypes,
        int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* shapeInputs,
        int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
        nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;

protected:
    int32_t expectedInputs() const override { return 6; }
    void writeAttributes(Attributes& out) const override;
    std::string checkShapes(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs) const override;

private:
    int32_t mRule;
    float mScale;
    int32_t mQHeads;
    int32_t mKvHeads;
    int32_t mChunk;
};

using LinearAttentionCreator = Creator<LinearAttentionPlugin>;

} // namespace trt
} // namespace edgemem
