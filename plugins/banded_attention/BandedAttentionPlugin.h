// edgemem::BandedAttention (version 1) as a TensorRT IPluginV3.
#pragma once

#include "core/plugin.h"

namespace edgemem
{
namespace trt
{

class BandedAttentionPlugin : public PluginImpl<BandedAttentionPlugin>
{
public:
    static constexpr char const* kName = "BandedAttention";
    static constexpr int32_t kInputs = 6;
    static constexpr int32_t kOutputs = 1;
    static std::vector<FieldSpec> fieldSpecs();

protected:
    void writeAttributes(Attributes& out) const override;
    std::string checkShapes(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs) const override;

private:
    friend class PluginImpl<BandedAttentionPlugin>;
    friend class Creator<BandedAttentionPlugin>;
    BandedAttentionPlugin(std::string layer, Attributes const& attrs);
    std::string invalid() const;
    void outputTypes(nvinfer1::DataType* out, nvinfer1::DataType const* in) const;
    std::string outputShapes(nvinfer1::DimsExprs const* in, nvinfer1::DimsExprs* out, nvinfer1::IExprBuilder& eb) const;
    bool supports(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut) const;
    int32_t launch(nvinfer1::PluginTensorDesc const* in, void const* const* inputs, void* const* outputs, void*,
        cudaStream_t stream);

    int32_t mHeads;
    int32_t mWindow;
    std::vector<int32_t> mDilation;
    int32_t mCausal;
    float mScale;
};

} // namespace trt
} // namespace edgemem
