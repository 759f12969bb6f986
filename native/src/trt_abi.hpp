// What the trt backend needs from TensorRT's C++ runtime API, free of TensorRT's headers.
//
// TensorRT's classes are called through their vtables, whose layout changes between majors: the
// TensorRT 10 headers' and the TensorRT 11 headers' differ (methods removed), and TensorRT for RTX
// (libtensorrt_rtx.so.1, whose SDK headers no wheel ships) has the TensorRT 11 layout: through the 11.1
// headers its runtime, plugin registry and deserializeCudaEngine answer as documented, through the 10.3
// headers the first call on the runtime crashes. trt_abi.cpp is compiled once per set of
// headers (EM_TRT_ABI = their major, with nvinfer1 renamed so that the two never share a symbol),
// and the backend picks the build whose layout the loaded library has.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace em {

// One deserialized engine with one execution context.
struct TrtGraph {
    std::map<std::string, bool> inputs;        // every I/O tensor: true for an input
    std::map<std::string, std::string> dtypes;  // "float32", "float16", "int32", "int64", ... ("other:N" if none)
    virtual ~TrtGraph() = default;
    virtual bool set_shape(const std::string &name, const std::vector<int64_t> &shape) = 0;
    virtual bool set_address(const std::string &name, void *pointer) = 0;
    virtual bool enqueue(void *cuda_stream) = 0;
};

// The library's runtime with the plugin library registered; keeps what TensorRT logged last.
struct TrtRuntime {
    virtual ~TrtRuntime() = default;
    // nullptr with `error` set when TensorRT refuses the engine
    virtual std::unique_ptr<TrtGraph> deserialize(const std::vector<uint8_t> &blob, std::string &error) = 0;
};

// `library`: the dlopen handle of libnvinfer / libtensorrt_rtx; `plugins`: the plugin library's path.
// Throws em::Error (EM_ERR_BACKEND) when TensorRT cannot create a runtime or load the plugins.
using TrtOpen = std::unique_ptr<TrtRuntime> (*)(void *library, const std::string &plugins);
std::unique_ptr<TrtRuntime> trt_open_abi10(void *library, const std::string &plugins);
std::unique_ptr<TrtRuntime> trt_open_abi11(void *library, const std::string &plugins);

}  // namespace em
