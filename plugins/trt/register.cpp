// Entry points TensorRT looks up when it loads this library (IPluginRegistry::loadLibrary,
// trtexec --dynamicPlugins, the ONNX parser's plugin lookup after loading): getCreators
// for IPluginV3 creators and setLoggerFinder. Nothing here needs libnvinfer.
#include "banded_attention/BandedAttentionPlugin.h"
#include "linear_attention/LinearAttentionPlugin.h"
#include "neural_memory/NeuralMemoryPlugin.h"
#include "window_attention/WindowAttentionPlugin.h"

#define EM_PLUGIN_API extern "C" __attribute__((visibility("default")))

using namespace edgemem::trt;

EM_PLUGIN_API nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators)
{
    static LinearAttentionCreator linearAttention;
    static NeuralMemoryCreator neuralMemory;
    static BandedAttentionCreator bandedAttention;
    static WindowAttentionCreator windowAttention;
    static nvinfer1::IPluginCreatorInterface* const creators[]
        = {&linearAttention, &neuralMemory, &bandedAttention, &windowAttention};
    nbCreators = int32_t(sizeof(creators) / sizeof(creators[0]));
    return creators;
}

EM_PLUGIN_API void setLoggerFinder(nvinfer1::ILoggerFinder* finder)
{
    edgemem::trt::setLoggerFinder(finder);
}
