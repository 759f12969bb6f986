// Entry points TensorRT looks up when it loads this library (IPluginRegistry::loadLibrary,
// trtexec --dynamicPlugins, the ONNX parser's plugin lookup after loading): getCreators
// for IPluginV3 creators (one per op of ops.def) and setLoggerFinder. Nothing here needs libnvinfer.
#include "core/plugin.h"

#define EM_PLUGIN_API extern "C" __attribute__((visibility("default")))

using namespace edgemem::trt;

EM_PLUGIN_API nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators)
{
    static nvinfer1::IPluginCreatorInterface* const creators[] = {
#define EM_OP(Name, op) Name##Creator(),
#include "ops.def"
#undef EM_OP
    };
    nbCreators = int32_t(sizeof(creators) / sizeof(creators[0]));
    return creators;
}

EM_PLUGIN_API void setLoggerFinder(nvinfer1::ILoggerFinder* finder) { edgemem::trt::setLoggerFinder(finder); }
