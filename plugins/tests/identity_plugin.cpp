// The smallest IPluginV3 plugin library TensorRT's ONNX parser can import: one op, `Identity`
// in namespace `edgemem_test`, version "1", one float input copied to one output, no fields.
// It shares no code with the edgemem plugins: tests/test_rtx.py uses it to tell a fault of a
// TensorRT parser from a fault of edgemem's plugin glue (plugins/core).
//
//   g++ -std=c++17 -shared -fPIC -I<TensorRT include> -I<CUDA include> identity_plugin.cpp
//       -L<CUDA lib64> -lcudart_static -ldl -lrt -lpthread -o libidentity_plugin.so
#include <NvInferRuntime.h>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

using namespace nvinfer1;

namespace
{

char const* const kName = "Identity";
char const* const kNamespace = "edgemem_test";
char const* const kVersion = "1";

class IdentityPlugin : public IPluginV3, public IPluginV3OneCore, public IPluginV3OneBuild, public IPluginV3OneRuntime
{
public:
    IPluginCapability* getCapabilityInterface(PluginCapabilityType type) noexcept override
    {
        switch (type)
        {
        case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
        case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuild*>(this);
        case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
        }
        return nullptr;
    }
    IPluginV3* clone() noexcept override { return new (std::nothrow) IdentityPlugin(*this); }

    char const* getPluginName() const noexcept override { return kName; }
    char const* getPluginVersion() const noexcept override { return kVersion; }
    char const* getPluginNamespace() const noexcept override { return kNamespace; }

    int32_t configurePlugin(DynamicPluginTensorDesc const*, int32_t nbInputs, DynamicPluginTensorDesc const*,
        int32_t nbOutputs) noexcept override
    {
        return nbInputs == 1 && nbOutputs == 1 ? 0 : -1;
    }
    int32_t getOutputDataTypes(
        DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept override
    {
        if (nbInputs != 1 || nbOutputs != 1)
            return -1;
        outputTypes[0] = inputTypes[0];
        return 0;
    }
    int32_t getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const*, int32_t, DimsExprs* outputs,
        int32_t nbOutputs, IExprBuilder&) noexcept override
    {
        if (nbInputs != 1 || nbOutputs != 1)
            return -1;
        outputs[0] = inputs[0];
        return 0;
    }
    bool supportsFormatCombination(
        int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept override
    {
        if (nbInputs != 1 || nbOutputs != 1 || pos < 0 || pos > 1)
            return false;
        PluginTensorDesc const& d = inOut[pos].desc;
        return d.format == TensorFormat::kLINEAR && d.type == DataType::kFLOAT
            && (pos == 0 || d.type == inOut[0].desc.type);
    }
    int32_t getNbOutputs() const noexcept override { return 1; }

    int32_t onShapeChange(PluginTensorDesc const*, int32_t, PluginTensorDesc const*, int32_t) noexcept override
    {
        return 0;
    }
    int32_t enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const*, void const* const* inputs,
        void* const* outputs, void*, cudaStream_t stream) noexcept override
    {
        int64_t n = 1;
        for (int32_t i = 0; i < inputDesc[0].dims.nbDims; ++i)
            n *= inputDesc[0].dims.d[i];
        return cudaMemcpyAsync(outputs[0], inputs[0], size_t(n) * sizeof(float), cudaMemcpyDeviceToDevice, stream)
                == cudaSuccess
            ? 0
            : -1;
    }
    IPluginV3* attachToContext(IPluginResourceContext*) noexcept override { return clone(); }
    PluginFieldCollection const* getFieldsToSerialize() noexcept override { return &mNoFields; }

private:
    PluginFieldCollection mNoFields{0, nullptr};
};

class IdentityCreator : public IPluginCreatorV3One
{
public:
    IPluginV3* createPlugin(char const*, PluginFieldCollection const*, TensorRTPhase) noexcept override
    {
        return new (std::nothrow) IdentityPlugin();
    }
    PluginFieldCollection const* getFieldNames() noexcept override { return &mNoFields; }
    char const* getPluginName() const noexcept override { return kName; }
    char const* getPluginVersion() const noexcept override { return kVersion; }
    char const* getPluginNamespace() const noexcept override { return kNamespace; }

private:
    PluginFieldCollection mNoFields{0, nullptr};
};

} // namespace

extern "C" __attribute__((visibility("default"))) IPluginCreatorInterface* const* getCreators(int32_t& nbCreators)
{
    static IdentityCreator creator;
    static IPluginCreatorInterface* const creators[] = {&creator};
    nbCreators = 1;
    return creators;
}

extern "C" __attribute__((visibility("default"))) void setLoggerFinder(ILoggerFinder*) {}
