// edgemem::BandedAttention (version 1) as a TensorRT IPluginV3.
#pragma once

#include "../common/plugin.h"

namespace edgemem
{
namespace trt
{

class BandedAttentionPlugin : public PluginBase
{
public:
    static constexpr char const* kName = "BandedAttention";
    static std::vector<FieldSpec> fieldSpecs();
    static BandedAttentionPlugin* create(char const* layer, Attributes const& attrs);

    nvinfer1::IPluginV3* clone() noexcept override;
    char const* getPluginName() const noexcept override { return kName; }
    int32_t getNbOutputs() const noexcept override { return 1; }
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
    BandedAttentionPlugin(std::string layer, Attributes const& attrs);
    // attributes
    int32_t mHeads;
    int32_t mWindow;
    std::vector<int32_t> mDilation;
    int32_t mCausal;
    float mScale;
};

using BandedAttentionCreator = Creator<BandedAttentionPlugin>;

} // namespace trt
} // namespace edgemem
