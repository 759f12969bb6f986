// Backend "trt": the engines of `edgemem build` (engines/engines.json) run by TensorRT's C++ runtime,
// each stream's state resident on the GPU; the counterpart of edgemem/runtime/trt.py.
//
// Loading refuses, before touching TensorRT, what edgemem/runtime/engines.py refuses: an engines.json
// that is not edgemem-engines/3 or /2 (read as one engine per graph, each on profile 0), engines of another
// export, engine files changed since the build, a plugin library other than the one they were built with.
// Then it opens at run time (dlopen) the library engines.json names, TensorRT (libnvinfer.so.<major>)
// or TensorRT for RTX (libtensorrt_rtx.so.<major>), and the CUDA driver (libcuda.so.1); without them, or
// without a GPU, the load fails with a message naming what to install.
//
// State. A stream allocates its state on the GPU once and keeps it there; reads (save, fork) copy it to
// the host. A state input that engines.json lists as in place for every engine is bound as input and
// output to one buffer; every other state tensor has two, ping-ponged (sides A and B). Each engine file
// is deserialized once (`edgemem build` writes one, whose optimisation profiles serve the step and the
// prefill); each graph kind has one execution context of it, on the profile engines.json names
// (profile_index), with scratch for that profile only. The contexts serve every stream, under the
// backend's lock, on one CUDA stream. A batch copies its streams' rows into [n, ...] buffers, runs, and
// copies them back (device to device).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "util.hpp"

namespace em {

// One stream's buffers on the GPU.
struct DeviceState {
    virtual ~DeviceState() = default;
};

struct TrtBackend {
    virtual ~TrtBackend() = default;
    bool has_prefill = false;
    virtual std::unique_ptr<DeviceState> alloc() = 0;
    virtual void upload(DeviceState &state, size_t spec, int side, const void *host) = 0;
    virtual void download(void *host, const DeviceState &state, size_t spec, int side) = 0;
    // A run reads side `side` and writes side 1 - side; the last position's logits into `logits` (vocab floats).
    virtual void step(DeviceState &state, int side, int64_t token, float *logits) = 0;
    virtual void prefill(DeviceState &state, int side, const int64_t *tokens, size_t count, float *logits) = 0;  // count <= max_tokens()
    virtual size_t max_tokens() const = 0;  // the longest block one prefill run takes
    // One step of several streams, each reading and keeping its side `sides[i]`.
    virtual void step_batch(const std::vector<DeviceState *> &states, const std::vector<int> &sides, const int64_t *tokens,
                            const std::vector<float *> &logits) = 0;
};

// What the backend is given of the export (the manifest's reading, runtime.cpp).
struct TrtExport {
    std::string directory, arch, identity, tokens, logits;
    int64_t vocab = 0;
    const std::vector<Spec> *specs = nullptr;
};

// The engines (`engines`, else DIR/engines) with the plugin library (`plugins`, else $EDGEMEM_TRT_PLUGINS).
std::unique_ptr<TrtBackend> open_trt(const TrtExport &model, const char *engines, const char *plugins);

}  // namespace em
