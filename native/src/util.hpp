// Shared inside libedgemem: errors, dtypes, host tensors, files, sha256 and Python-compatible JSON text.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "edgemem/edgemem.h"

namespace em {

// What every internal failure throws; the C boundary (api.cpp) turns it into a code and a message.
struct Error : std::runtime_error {
    int code;
    Error(int code, const std::string &message) : std::runtime_error(message), code(code) {}
};

[[noreturn]] inline void fail(int code, const std::string &message) { throw Error(code, message); }

// The state dtypes of edgemem.json and what each is called by onnxruntime, safetensors and numpy.
struct DType {
    std::string name;         // edgemem.json: "float32"
    int onnx;                 // ONNXTensorElementDataType
    std::string safetensors;  // "F32"
    std::string numpy;        // numpy's dtype.str, "<f4": what the checkpoint checksum hashes
    size_t size;
};
const DType *dtype_named(const std::string &name);           // nullptr if not a state dtype
const DType *dtype_of_safetensors(const std::string &code);  // any safetensors dtype numpy reads
const DType *dtype_of_onnx(int onnx);

// A host tensor of one stream (batch 1), as read from or written to a checkpoint.
struct Blob {
    const DType *dtype = nullptr;
    std::vector<int64_t> shape;
    std::vector<uint8_t> data;
};

// A state tensor of the manifest (edgemem.json "state").
struct Spec {
    std::string input, output;
    std::vector<int64_t> dims;  // -1: batch, -2: past_sequence
    const DType *dtype = nullptr;
    bool from_file = false;  // init "file": state_init.safetensors
    bool growing = false;
    bool in_place = false;  // one buffer for both sides
    bool cache = false;     // a preallocated KV cache (manifest kv_cache.states): checkpoints hold its filled part
    std::vector<int64_t> shape(int64_t batch, int64_t past = 0) const;
    size_t row_bytes() const;  // bytes of one batch row (fixed-size state)
};

void to_float(const uint8_t *src, const DType *dtype, size_t n, float *dst);  // float32 or float16 to float32
int64_t elements(const std::vector<int64_t> &shape);
bool all_finite(const Blob &blob);  // float dtypes: no NaN or infinity; others: true

std::vector<uint8_t> read_file(const std::string &path, int code, const std::string &what);
void write_atomic(const std::string &path, const std::vector<uint8_t> &data);  // temp beside, fsync, rename
bool is_dir(const std::string &path);
bool is_file(const std::string &path);
std::string sha256_hex(const void *data, size_t size);
std::string sha256_file(const std::string &path);  // "" if unreadable

// json.dumps(text) as Python writes it (ensure_ascii): what the manifest identity and checksums hash.
std::string py_json_string(const std::string &text);
std::string py_json_shape(const std::vector<int64_t> &shape);  // json.dumps(list of ints)

// The checksum of a state checkpoint (edgemem/runtime/state.py `_checksum`): sha256 over
// json.dumps(metadata without "sha256", sort_keys=True), then per tensor in name order
// json.dumps([name, numpy dtype, shape]) and its bytes.
std::string state_checksum(const std::map<std::string, std::string> &metadata, const std::map<std::string, Blob> &tensors);

// safetensors: the tensors and the string metadata of a file's bytes (errors name `where`, with `code`).
std::map<std::string, Blob> read_safetensors(const std::vector<uint8_t> &bytes, const std::string &where, int code,
                                             std::map<std::string, std::string> *metadata);
std::vector<uint8_t> write_safetensors(const std::map<std::string, Blob> &tensors, const std::map<std::string, std::string> &metadata);

}  // namespace em
