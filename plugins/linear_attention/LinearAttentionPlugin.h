// edgemem::LinearAttention (version 1) as a TensorRT IPluginV3.
#pragma once

#include "core/plugin.h"
#include "linear_attention/linear_attention.h"

namespace edgemem
{
namespace trt
{

class LinearAttentionPlugin : public PluginImpl<LinearAttentionPlugin>
{
public:
    static constexpr char const* kName = "LinearAttention";
    static constexpr int32_t kInputs = 6;
    static constexpr int32_t kOutputs = 2;
    static std::vector<FieldSpec> fieldSpecs();

    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) const noexcept override;

protected:
    void writeAttributes(Attributes& out) const override;
    std::string checkShapes(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs) const override;

private:
    friend class PluginImpl<LinearAttentionPlugin>;
    friend class Creator<LinearAttentionPlugin>;
    LinearAttentionPlugin(std::string layer, Attributes const& attrs);
    std::string invalid() const;
    void outputTypes(nvinfer1::DataType* out, nvinfer1::DataType const* in) const;
    std::string outputShapes(nvinfer1::DimsExprs const* in, nvinfer1::DimsExprs* out, nvinfer1::IExprBuilder& eb) const;
    bool supports(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut) const;
    int32_t launch(nvinfer1::PluginTensorDesc const* in, void const* const* inputs, void* const* outputs,
        void* workspace, cudaStream_t stream);
    // The launcher's sizes from the dims of query, value, decay and beta.
    la::Params params(nvinfer1::Dims const& q, nvinfer1::Dims const& v, nvinfer1::Dims const& decay,
        nvinfer1::Dims const& beta) const;

    int32_t mRule; // index into linear, gated, delta, gated_delta
    std::string mRuleName;
    float mScale;
    int32_t mQHeads;
    int32_t mKvHeads;
    int32_t mChunk;
};

} // namespace trt
} // namespace edgemem
