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

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace em {

// One execution context of a deserialized engine, on the optimisation profile of one graph.
struct TrtGraph {
    std::map<std::string, bool> inputs;                                 // every I/O tensor: true for an input
    std::map<std::string, std::string> dtypes;                          // "float32", "float16", "int32", "int64", ... ("other:N" if none)
    std::map<std::string, std::array<std::vector<int64_t>, 2>> ranges;  // input → its [min, max] shapes in the profile
    virtual ~TrtGraph() = default;
    virtual bool set_shape(const std::string &name, const std::vector<int64_t> &shape) = 0;
    virtual bool set_address(const std::string &name, void *pointer) = 0;
    virtual bool enqueue(void *cuda_stream) = 0;
};

// One deserialized engine: one copy of its weights, shared by its contexts, which must not outlive it.
struct TrtEngine {
    virtual ~TrtEngine() = default;
    virtual int32_t profiles() const = 0;  // its number of optimisation profiles
    // A context with scratch for `profile` only, that profile selected on `cuda_stream`; nullptr with `error`
    // set when TensorRT refuses. `profile` < profiles().
    virtual std::unique_ptr<TrtGraph> context(int32_t profile, void *cuda_stream, std::string &error) = 0;
};

// The library's runtime with the plugin library registered; keeps what TensorRT logged last.
struct TrtRuntime {
    virtual ~TrtRuntime() = default;
    // nullptr with `error` set when TensorRT refuses the engine
    virtual std::unique_ptr<TrtEngine> deserialize(const std::vector<uint8_t> &blob, std::string &error) = 0;
};

// `library`: the dlopen handle of libnvinfer / libtensorrt_rtx; `plugins`: the plugin library's path.
// Throws em::Error (EM_ERR_BACKEND) when TensorRT cannot create a runtime or load the plugins.
using TrtOpen = std::unique_ptr<TrtRuntime> (*)(void *library, const std::string &plugins);
std::unique_ptr<TrtRuntime> trt_open_abi10(void *library, const std::string &plugins);
std::unique_ptr<TrtRuntime> trt_open_abi11(void *library, const std::string &plugins);

}  // namespace em
