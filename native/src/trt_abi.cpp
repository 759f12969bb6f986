// The TensorRT calls of the trt backend, for the vtable layout of the headers it is compiled with
// (EM_TRT_ABI: their major; see trt_abi.hpp).
#include "trt_abi.hpp"

#include <dlfcn.h>

#include <NvInferRuntime.h>
#include <mutex>

#include "util.hpp"

#if NV_TENSORRT_MAJOR != EM_TRT_ABI
#error "trt_abi.cpp: the TensorRT headers' major differs from EM_TRT_ABI"
#endif
#define EM_CAT2(a, b) a##b
#define EM_CAT(a, b) EM_CAT2(a, b)

namespace em {
namespace {
using namespace nvinfer1;

// The first error since the last `take`: the cause, for the message of a refused call. One per process,
// never destroyed: TensorRT logs through the logger of the first runtime made, whichever later ones are given.
struct Logger : ILogger {
    std::mutex mutex;
    std::string first;
    void log(Severity severity, const char *message) noexcept override {
        if (severity > Severity::kERROR) return;
        std::lock_guard<std::mutex> hold(mutex);
        if (first.empty()) first = message;
    }
    std::string take() {
        std::lock_guard<std::mutex> hold(mutex);
        std::string out;
        out.swap(first);
        return out;
    }
};

std::string dtype_name(DataType type) {
    switch (type) {
    case DataType::kFLOAT: return "float32";
    case DataType::kHALF: return "float16";
    case DataType::kINT32: return "int32";
    case DataType::kINT64: return "int64";
    case DataType::kINT8: return "int8";
    case DataType::kUINT8: return "uint8";
    case DataType::kBOOL: return "bool";
    case DataType::kBF16: return "bfloat16";
    default: return "other:" + std::to_string(int(type));
    }
}

struct Graph : TrtGraph {
    std::unique_ptr<IExecutionContext> context;
    bool set_shape(const std::string &name, const std::vector<int64_t> &shape) override {
        Dims dims{};
        if (shape.size() > size_t(Dims::MAX_DIMS)) return false;
        dims.nbDims = int32_t(shape.size());
        for (size_t i = 0; i < shape.size(); ++i) dims.d[i] = shape[i];
        return context->setInputShape(name.c_str(), dims);
    }
    bool set_address(const std::string &name, void *pointer) override { return context->setTensorAddress(name.c_str(), pointer); }
    bool enqueue(void *cuda_stream) override { return context->enqueueV3(static_cast<cudaStream_t>(cuda_stream)); }
};

Logger &logger() {
    static Logger *instance = new Logger;
    return *instance;
}

std::vector<int64_t> dims_of(const Dims &dims) { return std::vector<int64_t>(dims.d, dims.d + dims.nbDims); }

struct Engine : TrtEngine {
    std::unique_ptr<ICudaEngine> engine;
    int32_t profiles() const override { return engine->getNbOptimizationProfiles(); }
    std::unique_ptr<TrtGraph> context(int32_t profile, void *cuda_stream, std::string &error) override {
        auto graph = std::make_unique<Graph>();
        logger().take();
        // ON_PROFILE_CHANGE (TensorRT 10 and later): scratch for the selected profile, not the largest of all
        graph->context.reset(engine->createExecutionContext(ExecutionContextAllocationStrategy::kON_PROFILE_CHANGE));
        if (!graph->context) {
            error = "no execution context (out of GPU memory?) " + logger().take();
            return nullptr;
        }
        if (!graph->context->setOptimizationProfileAsync(profile, static_cast<cudaStream_t>(cuda_stream))) {
            error = "optimisation profile " + std::to_string(profile) + " refused: " + logger().take();
            return nullptr;
        }
        for (int32_t i = 0; i < engine->getNbIOTensors(); ++i) {
            const char *name = engine->getIOTensorName(i);
            const bool input = engine->getTensorIOMode(name) == TensorIOMode::kINPUT;
            graph->inputs[name] = input;
            graph->dtypes[name] = dtype_name(engine->getTensorDataType(name));
            if (!input) continue;
            const Dims lo = engine->getProfileShape(name, profile, OptProfileSelector::kMIN);
            const Dims hi = engine->getProfileShape(name, profile, OptProfileSelector::kMAX);
            if (lo.nbDims >= 0 && lo.nbDims == hi.nbDims) graph->ranges[name] = {dims_of(lo), dims_of(hi)};
        }
        return graph;
    }
};

struct Runtime : TrtRuntime {
    std::unique_ptr<IRuntime> runtime;
    std::unique_ptr<TrtEngine> deserialize(const std::vector<uint8_t> &blob, std::string &error) override {
        auto out = std::make_unique<Engine>();
        logger().take();
        out->engine.reset(runtime->deserializeCudaEngine(blob.data(), blob.size()));
        if (!out->engine) {
            error = logger().take();
            return nullptr;
        }
        return out;
    }
};
}  // namespace

std::unique_ptr<TrtRuntime> EM_CAT(trt_open_abi, EM_TRT_ABI)(void *library, const std::string &plugins) {
    using Create = void *(*)(void *, int32_t);
    using Registry = IPluginRegistry *(*)();
    auto create = reinterpret_cast<Create>(::dlsym(library, "createInferRuntime_INTERNAL"));
    auto registry = reinterpret_cast<Registry>(::dlsym(library, "getPluginRegistry"));
    if (!create || !registry)
        fail(EM_ERR_BACKEND, "the TensorRT library lacks createInferRuntime_INTERNAL or getPluginRegistry: not TensorRT's runtime");
    auto out = std::make_unique<Runtime>();
    logger().take();
    void *made = create(&logger(), NV_TENSORRT_VERSION);
    // A refusal (TensorRT 11.4 without a GPU) may log an error and still return a pointer that is no runtime.
    const std::string refused = logger().take();
    if (!made || !refused.empty()) fail(EM_ERR_BACKEND, "TensorRT could not create a runtime: " + refused);
    out->runtime.reset(static_cast<IRuntime *>(made));
    logger().take();
    if (!registry()->loadLibrary(plugins.c_str()))
        fail(EM_ERR_BACKEND,
             "TensorRT could not load the plugin library " + plugins + " (built for another TensorRT major?): " + logger().take());
    return out;
}

}  // namespace em
