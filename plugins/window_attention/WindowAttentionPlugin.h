// edgemem::WindowAttention (version 1) as a TensorRT IPluginV3.
#pragma once

#include "core/attention.h"
#include "core/plugin.h"

namespace edgemem
{
namespace trt
{

class WindowAttentionPlugin : public PluginImpl<WindowAttentionPlugin>
{
public:
    static constexpr char const* kName = "WindowAttention";
    static constexpr int32_t kInputs = 8;
    static constexpr int32_t kOutputs = 3;
    static std::vector<FieldSpec> fieldSpecs();

    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) const noexcept override;

protected:
    void writeAttributes(Attributes& out) const override;
    std::string checkShapes(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs) const override;

private:
    friend class PluginImpl<WindowAttentionPlugin>;
    friend class Creator<WindowAttentionPlugin>;
    WindowAttentionPlugin(std::string layer, Attributes const& attrs);
    std::string invalid() const;
    void outputTypes(nvinfer1::DataType* out, nvinfer1::DataType const* in) const;
    std::string outputShapes(nvinfer1::DimsExprs const* in, nvinfer1::DimsExprs* out, nvinfer1::IExprBuilder& eb) const;
    bool supports(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut) const;
    int32_t launch(nvinfer1::PluginTensorDesc const* in, void const* const* inputs, void* const* outputs,
        void* workspace, cudaStream_t stream);
    // The launcher's sizes from the dims of query, value, past key and persistent key.
    attn::WindowParams params(nvinfer1::Dims const& q, nvinfer1::Dims const& v, nvinfer1::Dims const& ring,
        nvinfer1::Dims const& persistent) const;

    int32_t mHeads;
    int32_t mWindow;
    std::vector<int32_t> mDilation;
    float mScale;
};

} // namespace trt
} // namespace edgemem
