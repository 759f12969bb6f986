// edgemem::NeuralMemory (version 1) as a TensorRT IPluginV3.
#pragma once

#include "core/plugin.h"

namespace edgemem
{
namespace trt
{

class NeuralMemoryPlugin : public PluginImpl<NeuralMemoryPlugin>
{
public:
    static constexpr char const* kName = "NeuralMemory";
    static constexpr int32_t kInputs = 15;
    static constexpr int32_t kOutputs = 8;
    static std::vector<FieldSpec> fieldSpecs();

protected:
    void writeAttributes(Attributes& out) const override;
    std::string checkShapes(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs) const override;

private:
    friend class PluginImpl<NeuralMemoryPlugin>;
    friend class Creator<NeuralMemoryPlugin>;
    NeuralMemoryPlugin(std::string layer, Attributes const& attrs);
    std::string invalid() const;
    void outputTypes(nvinfer1::DataType* out, nvinfer1::DataType const* in) const;
    std::string outputShapes(nvinfer1::DimsExprs const* in, nvinfer1::DimsExprs* out, nvinfer1::IExprBuilder& eb) const;
    bool supports(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut) const;
    int32_t launch(nvinfer1::PluginTensorDesc const* in, void const* const* inputs, void* const* outputs, void*,
        cudaStream_t stream);

    int32_t mHeads;
    int32_t mChunk;
    int32_t mDepth;
    int32_t mResidualNorm;
    int32_t mActivation; // index into silu, gelu, relu, identity
    std::string mActivationName;
};

} // namespace trt
} // namespace edgemem
