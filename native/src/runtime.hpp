// The engine and streams behind edgemem.h: an export's manifest, its graphs in onnxruntime sessions, and
// each stream's state in onnxruntime tensors on the host; or, with backend "trt", its TensorRT engines
// and each stream's state on the GPU (trt.hpp: the backend keeps the buffers, this file the protocol).
//
// Fixed-size state (recurrent states, positions, preallocated KV caches) lives in two buffers per
// tensor, sides A and B: a run reads the current side and writes the other, then the side flips, so
// no step allocates or copies state. A state the target updates in place (manifest kv_cache.in_place)
// has one buffer bound as both the graph's input and output. A growing KV cache (a "past_sequence"
// dim) is one tensor per stream that each run replaces with the longer one onnxruntime allocates.
//
// Batches (em_step_batch): a slot per batch size n (the last four sizes are kept) holds [n, ...] sides A
// and B. The first batch of a set of streams copies their fixed-size state into rows of the slot; from
// then on it lives there, and the same streams batched again in the same order run with no copy. A
// stream used alone again (step, prefill, reset) first copies its row back; reads (save, fork) read the
// row. Lock order: stream, then engine.
#pragma once

#include <array>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <onnxruntime_cxx_api.h>

#include "trt.hpp"
#include "util.hpp"

namespace em {

struct Slot;
struct Engine;

struct Snapshot {
    std::vector<Blob> state;  // per spec, batch 1
    int64_t position = 0;
    bool has_logits = false;
    std::vector<float> logits;
};

}  // namespace em

struct em_stream {
    em::Engine *engine = nullptr;
    std::vector<Ort::Value> owned;
    std::vector<std::array<OrtValue *, 2>> fixed;  // per fixed spec: side A and side B
    std::vector<Ort::Value> caches;                // per growing spec: the current cache
    Ort::Value ids{nullptr}, logits{nullptr};
    std::vector<float> next;  // the next-token logits
    int side = 0;
    int64_t position = 0;
    bool has_logits = false;
    std::unique_ptr<em::DeviceState> device;  // backend "trt": the state on the GPU (`fixed` and `caches` stay empty)
    em::Slot *slot = nullptr;                 // set while the fixed-size state is a row of a batch slot
    size_t row = 0;
    mutable std::mutex mutex;
    std::atomic<bool> in_batch{false};
};

namespace em {

struct Slot {
    size_t n = 0;
    int side = 0;
    std::vector<Ort::Value> owned;
    std::vector<std::array<OrtValue *, 2>> fixed;
    Ort::Value ids{nullptr}, logits{nullptr};
    std::vector<em_stream *> members;
};

struct Engine {
    std::string directory, arch, identity, target, backend;
    int64_t vocab = 0;
    int chunk = 512;
    std::vector<Spec> specs;
    std::vector<size_t> fixed, growing;   // indices into specs
    std::vector<Blob> initial;            // per spec, batch 1 (a growing cache: empty)
    int64_t max_length = -1;              // a preallocated cache that refuses tokens past it; -1: no limit
    int64_t filled_limit = -1;            // kv_cache.max_length (checkpoint's filled part); -1: no cache
    int64_t fixed_bytes = 0, growth = 0;  // state bytes, and bytes per token of growing caches
    const DType *logits_dtype = nullptr;
    std::string tokens_name, logits_name;
    std::vector<const char *> in_names, out_names;

    // weights.data mapped read-only, and the initializers viewing it (declared before the sessions that
    // use them, so that they outlive those)
    struct Mapping {
        void *data = nullptr;
        size_t size = 0;
        Mapping() = default;
        Mapping(const Mapping &) = delete;
        Mapping &operator=(const Mapping &) = delete;
        ~Mapping();
        void drop() const;  // the mapped pages leave this process (the page cache keeps them; a read faults back)
    } mapping;
    Ort::MemoryInfo host = Ort::MemoryInfo::CreateCpu(OrtArenaAllocator, OrtMemTypeDefault);
    std::vector<Ort::Value> weights;
    Ort::PrepackedWeightsContainer packed;  // MLAS's packed copy of each weight, one for both sessions
    std::unique_ptr<Ort::Session> step_graph, prefill;
    Ort::Session *step = nullptr;             // the step graph's session, or the prefill's where one session serves both
    std::unique_ptr<Ort::RunOptions> shrink;  // prefill runs: arena shrinkage (null where the prefill has no arena)
    std::unique_ptr<TrtBackend> trt;          // backend "trt" (then no sessions)

    std::vector<std::unique_ptr<Slot>> slots;  // least recently used first
    std::recursive_mutex mutex;

    Engine(const std::string &dir, const em_engine_options &options);

    em_stream *new_stream(const Snapshot *from);  // nullptr: fresh
    void assign(em_stream *s, const Snapshot &snap);
    Snapshot fresh() const;
    Snapshot snapshot(const em_stream *s);  // stream lock held
    void sync(em_stream *s);                // engine lock held: a slot member takes its state back
    void detach(em_stream *s);              // before free
    void check_token(int64_t token) const;
    void check_room(int64_t position, int64_t tokens) const;
    void step_one(em_stream *s, int64_t token);
    void prefill_tokens(em_stream *s, const int64_t *tokens, size_t n);
    void step_batch(em_stream *const *streams, const int64_t *tokens, size_t n, float *logits);
    int64_t state_bytes(int64_t position) const { return fixed_bytes + growth * position; }
    Snapshot decode(const std::vector<uint8_t> &bytes, const std::string &where) const;
    std::vector<uint8_t> encode(const Snapshot &snap) const;

  private:
    std::vector<std::vector<std::pair<std::string, size_t>>> graph_weights_;  // step, prefill: (name, index in weights)
    bool static_int8_ = false;
    int prefill_kind_ = -1;     // the prefill graph opened (prefill or prefill_last); -1: none
    bool one_session_ = false;  // the prefill_last session serves steps (the constructor says when)
    std::unique_ptr<Ort::Session> open(int kind, bool arena, int threads, bool cuda);
    void run(Ort::Session &session, std::vector<OrtValue *> &inputs, std::vector<OrtValue *> &outputs, const char *kind);
};

}  // namespace em
