#include "runtime.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

namespace em {

namespace {
using json = nlohmann::json;

constexpr const char *MANIFEST = "edgemem.json";
constexpr const char *FORMAT = "edgemem/1";
constexpr const char *STATE_FORMAT = "edgemem-state/1";
constexpr const char *STATE_INIT = "state_init.safetensors";
constexpr size_t BATCH_SLOTS = 4;
enum { STEP = 0, PREFILL = 1, PREFILL_LAST = 2 };
const char *KINDS[] = {"step", "prefill", "prefill_last"};

Ort::Env &env() {
    static Ort::Env *instance = new Ort::Env(ORT_LOGGING_LEVEL_ERROR, "edgemem");  // one per process, never torn down
    return *instance;
}

Ort::Value alloc(const std::vector<int64_t> &shape, const DType *dtype) {
    Ort::AllocatorWithDefaultOptions allocator;
    Ort::Value value = Ort::Value::CreateTensor(allocator, shape.data(), shape.size(), static_cast<ONNXTensorElementDataType>(dtype->onnx));
    const size_t bytes = size_t(elements(shape)) * dtype->size;
    if (bytes) std::memset(value.GetTensorMutableRawData(), 0, bytes);  // an empty KV cache has no data pointer
    return value;
}

uint8_t *data(OrtValue *value) {
    void *p = nullptr;
    Ort::ThrowOnError(Ort::GetApi().GetTensorMutableData(value, &p));
    return static_cast<uint8_t *>(p);
}

std::vector<int64_t> shape_of(const OrtValue *value) {
    OrtTensorTypeAndShapeInfo *info = nullptr;
    Ort::ThrowOnError(Ort::GetApi().GetTensorTypeAndShape(value, &info));
    return Ort::TensorTypeAndShapeInfo(info).GetShape();
}

std::string join(const std::vector<std::string> &items) {
    std::string out;
    for (const auto &item : items) out += (out.empty() ? "" : ", ") + item;
    return out;
}

std::string shape_text(const std::vector<int64_t> &shape) {
    std::string out = "[";
    for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
    return out + "]";
}
}  // namespace

std::vector<int64_t> Spec::shape(int64_t batch, int64_t past) const {
    std::vector<int64_t> out;
    for (int64_t d : dims) out.push_back(d == -1 ? batch : d == -2 ? past : d);
    return out;
}

size_t Spec::row_bytes() const { return size_t(elements(shape(1))) * dtype->size; }

// ---------------------------------------------------------------- loading

Engine::Engine(const std::string &dir, const em_engine_options &options) : directory(dir) {
    if (!is_dir(dir)) fail(EM_ERR_MANIFEST, dir + ": no such directory (an edgemem export: the output of `edgemem export`)");
    const std::string path = dir + "/" + MANIFEST;
    if (!is_file(path)) fail(EM_ERR_MANIFEST, dir + " is not an edgemem export: " + MANIFEST + " is missing (run `edgemem export`)");
    const auto text = read_file(path, EM_ERR_MANIFEST, "manifest");
    const json m = json::parse(text.begin(), text.end(), nullptr, false);
    const std::string bad = path + " is not a valid edgemem manifest: ";
    if (m.is_discarded() || !m.is_object()) fail(EM_ERR_MANIFEST, bad + "not a JSON object");
    if (m.value("format", json()) != FORMAT)
        fail(EM_ERR_MANIFEST, path + ": format is " + m.value("format", json()).dump() + ", expected \"" + FORMAT + "\"");
    try {
        arch = m.at("arch").get<std::string>();
        const json &vocab_size = m.at("config").at("vocab_size");
        if (!vocab_size.is_number_integer() || vocab_size.get<int64_t>() < 1)
            fail(EM_ERR_MANIFEST, path + ": config.vocab_size must be a positive integer; got " + vocab_size.dump());
        vocab = vocab_size.get<int64_t>();
        if (m.contains("encoder"))
            fail(EM_ERR_BACKEND, dir + ": " + arch +
                                     " is an encoder-decoder, whose streams start from its encoder "
                                     "(Engine.encode); libedgemem streams decoder-only exports: use the Python runtime");
        tokens_name = m.contains("inputs") ? m["inputs"].at("tokens").get<std::string>() : "input_ids";
        logits_name = m.contains("outputs") ? m["outputs"].at("logits").get<std::string>() : "logits";
        std::set<std::string> caches, in_place_targets;
        const json kv = m.value("kv_cache", json());
        if (!kv.is_null()) {
            if (!kv.is_object() || !kv.value("max_length", json()).is_number_integer() || kv["max_length"].get<int64_t>() < 1 ||
                !kv.value("states", json()).is_array() || !kv.value("in_place", json()).is_array() ||
                !(kv.value("overflow", json()) == "error" || kv.value("overflow", json()) == "sink_window"))
                fail(EM_ERR_MANIFEST, path + ": kv_cache is " + kv.dump() +
                                          "; expected max_length (a positive integer), overflow "
                                          "('error' or 'sink_window'), sinks, states (state inputs) and in_place (targets)");
            filled_limit = kv["max_length"].get<int64_t>();
            if (kv["overflow"] == "error") max_length = filled_limit;
            for (const auto &s : kv["states"]) caches.insert(s.get<std::string>());
            for (const auto &t : kv["in_place"]) in_place_targets.insert(t.get<std::string>());
        }
        for (const json &s : m.at("state")) {
            Spec spec;
            spec.input = s.at("input").get<std::string>();
            spec.output = s.at("output").get<std::string>();
            spec.dtype = dtype_named(s.at("dtype").get<std::string>());
            if (!spec.dtype)
                fail(EM_ERR_MANIFEST, path + ": state " + spec.input + " has dtype " + s["dtype"].dump() +
                                          "; expected one of float32, float16, float64, int64");
            for (const json &d : s.at("shape")) {
                if (d == "batch") spec.dims.push_back(-1);
                else if (d == "past_sequence") spec.dims.push_back(-2), spec.growing = true;
                else if (d.is_number_integer() && d.get<int64_t>() >= 0) spec.dims.push_back(d.get<int64_t>());
                else
                    fail(EM_ERR_MANIFEST, path + ": state " + spec.input + " has shape " + s["shape"].dump() +
                                              "; expected non-negative sizes, 'batch' or 'past_sequence'");
            }
            spec.from_file = s.value("init", "zeros") == "file";
            spec.cache = caches.count(spec.input) > 0;
            specs.push_back(std::move(spec));
        }
        for (const auto &name : caches)
            if (std::none_of(specs.begin(), specs.end(), [&](const Spec &s) { return s.input == name; }))
                fail(EM_ERR_MANIFEST, path + ": kv_cache names " + name + ", which is no state input");
        const json graphs = m.value("graphs", json::object());
        if (!graphs.value("step", false))
            fail(EM_ERR_BACKEND, dir + ": " + arch + " has no step graph (a bidirectional model does not stream); the runtime needs one");
        // target, as the Python runtime picks it
        std::vector<std::string> targets = m.at("targets").get<std::vector<std::string>>();
        auto has = [&](const std::string &t) { return std::find(targets.begin(), targets.end(), t) != targets.end(); };
        backend = options.backend ? options.backend : "ort";
        if (backend != "ort" && backend != "ort-cuda" && backend != "trt")
            fail(EM_ERR_BACKEND, "unknown backend '" + backend + "'; choose from ort, ort-cuda, trt");
        if (backend == "trt") {  // edgemem/runtime/trt.py `_open`, `check_model`
            if (options.target && std::string(options.target) != "trt")
                fail(EM_ERR_BACKEND, std::string("backend 'trt' runs the engines built from the trt target, not '") + options.target + "'");
            if (options.threads > 0) fail(EM_ERR_ARGUMENT, "threads is an onnxruntime setting; backend 'trt' runs on the GPU (pass 0)");
            if (!has("trt"))
                fail(EM_ERR_BACKEND, dir + " has no trt target (it has " + join(targets) +
                                         "); export with `edgemem export --target trt`, then `edgemem build`");
            std::vector<std::string> grows;
            for (const auto &spec : specs)
                if (spec.growing) grows.push_back(spec.input);
            if (!grows.empty())
                fail(EM_ERR_BACKEND, arch + "'s state grows (" +
                                         join({grows.begin(), grows.begin() + long(std::min<size_t>(2, grows.size()))}) +
                                         ": a KV cache); backend 'trt' runs fixed-size state only: use backend 'ort' or 'ort-cuda'");
            target = "trt";
        } else if (options.target) {
            target = options.target;
            if (!has(target)) fail(EM_ERR_BACKEND, dir + " has no '" + target + "' target (it has " + join(targets) + ")");
            if (target == "trt")
                fail(EM_ERR_BACKEND,
                     "the trt target is for TensorRT with edgemem's plugins, not onnxruntime; load the ort or generic target");
        } else {
            for (const char *t : {"ort", "generic", "onnx27"})
                if (target.empty() && has(t)) target = t;
            if (target.empty())
                fail(EM_ERR_BACKEND,
                     dir + " has no target onnxruntime can run (it has " + join(targets) + "); export with --target ort or generic");
        }
        for (auto &spec : specs) spec.in_place = spec.cache && in_place_targets.count(target) > 0;
        // every file against its sha256, and the identity checkpoints carry
        std::vector<std::pair<std::string, std::string>> files;
        for (auto it = m.at("files").begin(); it != m.at("files").end(); ++it) files.emplace_back(it.key(), it->get<std::string>());
        std::sort(files.begin(), files.end());
        std::string listed = "[";
        for (size_t i = 0; i < files.size(); ++i)
            listed += (i ? ", [" : "[") + py_json_string(files[i].first) + ", " + py_json_string(files[i].second) + "]";
        listed += "]";
        identity = sha256_hex(listed.data(), listed.size());
        if (options.check_files) {
            for (const auto &[name, digest] : files) {
                const std::string file = dir + "/" + name;
                if (!is_file(file)) fail(EM_ERR_MANIFEST, dir + ": " + name + " listed in " + MANIFEST + " is missing");
                if (sha256_file(file) != digest)
                    fail(EM_ERR_MANIFEST, dir + ": " + name + " does not match its sha256 in " + MANIFEST + " (modified or corrupt)");
            }
        }
        static_int8_ = m.contains("quantization") && m["quantization"].is_object() && m["quantization"].value("method", "") == "static";
        graph_weights_.resize(3);
        // A prefill here returns the last position's logits only: the graph that projects only that row serves it.
        if (graphs.value("prefill", false)) prefill_kind_ = graphs.value("prefill_last", false) ? PREFILL_LAST : PREFILL;
        const json stores = m.value("weights", json());
        // On the CPU the last-position prefill graph serves steps too where the export allows it (`steps`): one
        // session, which loads what only its pre-packing kernels read (the store's `packed`) from the file itself,
        // one tensor at a time, so that neither the mapping nor a second copy is resident beside the packed one.
        const json steps = m.value("steps", json("step"));
        if (steps != "step" && !(steps == "prefill_last" && graphs.value("prefill_last", false)))
            fail(EM_ERR_MANIFEST, path + ": steps is " + steps.dump() + "; expected 'step', or 'prefill_last' where graphs has it");
        one_session_ = backend == "ort" && prefill_kind_ == PREFILL_LAST && steps == "prefill_last" &&
                       std::none_of(specs.begin(), specs.end(), [](const Spec &s) { return s.growing; }) && stores.is_object() &&
                       stores.contains(target);
        if (backend != "trt" && stores.is_object() && stores.contains(target)) {
            const json &store = stores[target];
            const std::string file = dir + "/" + store.at("file").get<std::string>();
            const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
            struct stat info {};
            if (fd < 0 || ::fstat(fd, &info) != 0 || info.st_size == 0) {
                if (fd >= 0) ::close(fd);
                fail(EM_ERR_BACKEND, "cannot map " + file + ": missing or empty");
            }
            void *mapped = ::mmap(nullptr, size_t(info.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
            ::close(fd);
            if (mapped == MAP_FAILED) fail(EM_ERR_BACKEND, "cannot map " + file);
            mapping.data = mapped;
            mapping.size = size_t(info.st_size);
            std::map<std::tuple<int64_t, std::string, std::vector<int64_t>>, size_t> shared;
            std::vector<int> kinds{one_session_ ? prefill_kind_ : int(STEP)};
            if (!one_session_ && prefill_kind_ >= 0) kinds.push_back(prefill_kind_);
            for (int kind : kinds) {
                if (!store.at("tensors").contains(KINDS[kind])) continue;
                std::set<std::string> packed_only;
                if (one_session_ && store.contains("packed") && store["packed"].contains(KINDS[kind]))
                    packed_only = store["packed"][KINDS[kind]].get<std::set<std::string>>();
                for (auto it = store["tensors"][KINDS[kind]].begin(); it != store["tensors"][KINDS[kind]].end(); ++it) {
                    const int64_t offset = it->at(0).get<int64_t>();
                    const std::string dtype = it->at(1).get<std::string>();
                    const auto shape = it->at(2).get<std::vector<int64_t>>();
                    static const std::map<std::string, std::pair<ONNXTensorElementDataType, size_t>> types = {
                        {"float32", {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, 4}},  {"float16", {ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16, 2}},
                        {"float64", {ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE, 8}}, {"int64", {ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64, 8}},
                        {"int32", {ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32, 4}},    {"int8", {ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8, 1}},
                        {"uint8", {ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8, 1}},    {"bool", {ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL, 1}}};
                    const auto type = types.find(dtype);
                    if (type == types.end() || packed_only.count(it.key())) continue;  // onnxruntime reads it from the file itself
                    const auto key = std::make_tuple(offset, dtype, shape);
                    auto found = shared.find(key);
                    if (found == shared.end()) {
                        const size_t bytes = size_t(elements(shape)) * type->second.second;
                        if (offset < 0 || size_t(offset) + bytes > mapping.size)
                            fail(EM_ERR_BACKEND, file + " is shorter than edgemem.json says (" + std::to_string(mapping.size) + " bytes; " +
                                                     it.key() + " ends past it): the file is truncated; copy or export it again");
                        weights.push_back(Ort::Value::CreateTensor(host, static_cast<uint8_t *>(mapping.data) + offset, bytes, shape.data(),
                                                                   shape.size(), type->second.first));
                        found = shared.emplace(key, weights.size() - 1).first;
                    }
                    graph_weights_[size_t(kind)].emplace_back(it.key(), found->second);
                }
            }
        }
        chunk = options.chunk_size > 0 ? options.chunk_size : 128;
        for (size_t i = 0; i < specs.size(); ++i) (specs[i].growing ? growing : fixed).push_back(i);
        // a fresh stream's state
        std::map<std::string, Blob> stored;
        if (std::any_of(specs.begin(), specs.end(), [](const Spec &s) { return s.from_file; })) {
            const std::string init = dir + "/" + STATE_INIT;
            if (!is_file(init)) fail(EM_ERR_MANIFEST, dir + ": " + STATE_INIT + " is missing but edgemem.json says states start from it");
            stored = read_safetensors(read_file(init, EM_ERR_MANIFEST, "file"), init, EM_ERR_MANIFEST, nullptr);
        }
        for (const auto &spec : specs) {
            Blob blob;
            blob.dtype = spec.dtype;
            blob.shape = spec.shape(1);
            const size_t bytes = size_t(elements(blob.shape)) * spec.dtype->size;
            if (spec.from_file) {
                auto it = stored.find(spec.input);
                if (it == stored.end() || it->second.dtype != spec.dtype || it->second.shape.empty() || it->second.shape[0] < 1 ||
                    std::vector<int64_t>(it->second.shape.begin() + 1, it->second.shape.end()) !=
                        std::vector<int64_t>(blob.shape.begin() + 1, blob.shape.end()))
                    fail(EM_ERR_MANIFEST, dir + "/" + STATE_INIT + ": " + spec.input + " is missing or not " + spec.dtype->name);
                blob.data.assign(it->second.data.begin(), it->second.data.begin() + long(bytes));  // row 0: stored with batch 1
                if (!all_finite(blob)) fail(EM_ERR_MANIFEST, dir + "/" + STATE_INIT + ": " + spec.input + " holds NaN or infinite values");
            } else {
                blob.data.assign(bytes, 0);
            }
            (spec.growing ? growth : fixed_bytes) +=
                spec.growing ? int64_t(elements(spec.shape(1, 1)) * int64_t(spec.dtype->size)) : int64_t(bytes);
            initial.push_back(std::move(blob));
        }
    } catch (const json::exception &e) {
        fail(EM_ERR_MANIFEST, bad + e.what());
    }
    if (backend == "trt") {
#ifdef EDGEMEM_TENSORRT
        TrtExport model{directory, arch, identity, tokens_name, logits_name, vocab, &specs};
        trt = open_trt(model, options.engines, options.plugins);
        logits_dtype = dtype_named("float32");  // the backend hands logits over as float32
        return;
#else
        fail(EM_ERR_BACKEND, "backend 'trt': this libedgemem was built without the TensorRT backend; configure native/ with "
                             "-DEDGEMEM_TENSORRT=ON -DTENSORRT_INCLUDE_DIR=<TensorRT include folder> (native/README.md)");
#endif
    }
    in_names.push_back(tokens_name.c_str());
    out_names.push_back(logits_name.c_str());
    for (const auto *group : {&fixed, &growing})
        for (size_t i : *group) {
            in_names.push_back(specs[i].input.c_str());
            out_names.push_back(specs[i].output.c_str());
        }
    const bool cuda = backend == "ort-cuda";
    if (cuda) {
        const auto providers = Ort::GetAvailableProviders();
        if (std::find(providers.begin(), providers.end(), "CUDAExecutionProvider") == providers.end())
            fail(EM_ERR_BACKEND, "backend 'ort-cuda' needs onnxruntime's CUDAExecutionProvider, which this onnxruntime library does "
                                 "not have (it has " +
                                     join(providers) + "): link onnxruntime-gpu's library, or use backend 'ort'");
    }
    const bool grows = !growing.empty();
    if (prefill_kind_ >= 0) prefill = open(prefill_kind_, !grows, options.threads, cuda);
    if (!one_session_) step_graph = open(STEP, true, options.threads, cuda);
    step = one_session_ ? prefill.get() : step_graph.get();
    if (prefill && !grows) {
        shrink = std::make_unique<Ort::RunOptions>();
        shrink->AddConfigEntry("memory.enable_memory_arena_shrinkage", "cpu:0");
    }
    mapping.drop();  // set-up's reads; later runs fault back what they read
    size_t index = 0;
    for (size_t i = 0; i < step->GetOutputCount(); ++i) {
        Ort::AllocatorWithDefaultOptions allocator;
        if (step->GetOutputNameAllocated(i, allocator).get() == logits_name) index = i;
    }
    logits_dtype = dtype_of_onnx(step->GetOutputTypeInfo(index).GetTensorTypeAndShapeInfo().GetElementType());
    if (!logits_dtype || (logits_dtype->name != "float32" && logits_dtype->name != "float16"))
        fail(EM_ERR_BACKEND, "the step graph's logits are neither float32 nor float16");
}

namespace {

// While a session is made, the pages it has read from the mapping are dropped every millisecond: it packs
// each weight it is handed into a copy of its own, and the pages it read would otherwise stay resident until it
// is made, the source of every packed weight beside all of the packed copies. The mapping is read-only: a page
// dropped while it is still being read faults back from the page cache.
class Dropping {
  public:
    explicit Dropping(const Engine::Mapping &mapping) {
        if (!mapping.data) return;
        thread_ = std::thread([this, &mapping] {
            std::unique_lock<std::mutex> lock(mutex_);
            while (!done_changed_.wait_for(lock, std::chrono::milliseconds(1), [this] { return done_; })) mapping.drop();
        });
    }
    Dropping(const Dropping &) = delete;
    Dropping &operator=(const Dropping &) = delete;
    ~Dropping() {
        if (!thread_.joinable()) return;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            done_ = true;
        }
        done_changed_.notify_one();
        thread_.join();
    }

  private:
    std::mutex mutex_;
    std::condition_variable done_changed_;
    bool done_ = false;
    std::thread thread_;
};

}  // namespace

std::unique_ptr<Ort::Session> Engine::open(int kind, bool arena, int threads, bool cuda) {
    const std::string path = directory + "/" + target + "/" + KINDS[kind] + ".onnx";
    std::unique_ptr<Ort::Session> session;
    try {
        Ort::SessionOptions options;
        options.SetIntraOpNumThreads(threads > 0 ? threads : 0);
        options.SetInterOpNumThreads(1);
        options.SetExecutionMode(ORT_SEQUENTIAL);
        options.SetLogSeverityLevel(3);
        if (arena) options.EnableCpuMemArena();
        else options.DisableCpuMemArena();
        // In a QDQ graph this pass merges QuantizeLinear nodes that then no longer fuse into integer MatMuls.
        if (static_int8_) options.AddConfigEntry("optimization.disable_specified_optimizers", "CommonSubexpressionElimination");
        for (const auto &[name, index] : graph_weights_[size_t(kind)]) options.AddInitializer(name.c_str(), weights[index]);
        if (cuda) {
            OrtCUDAProviderOptionsV2 *cuda_options = nullptr;
            Ort::ThrowOnError(Ort::GetApi().CreateCUDAProviderOptions(&cuda_options));
            std::unique_ptr<OrtCUDAProviderOptionsV2, void (*)(OrtCUDAProviderOptionsV2 *)> owner(
                cuda_options, [](OrtCUDAProviderOptionsV2 *p) { Ort::GetApi().ReleaseCUDAProviderOptions(p); });
            options.AppendExecutionProvider_CUDA_V2(*cuda_options);
        }
        // Sessions given the mapped weights pack each of them once, into `packed`, and read that one copy.
        const Dropping dropping(mapping);
        session = mapping.data && !one_session_ ? std::make_unique<Ort::Session>(env(), path.c_str(), options, packed)
                                                : std::make_unique<Ort::Session>(env(), path.c_str(), options);
    } catch (const Ort::Exception &e) {
        fail(EM_ERR_BACKEND, "onnxruntime cannot load " + path + ": " + e.what());
    }
    std::set<std::string> inputs, outputs, want_in(in_names.begin(), in_names.end()), want_out(out_names.begin(), out_names.end());
    Ort::AllocatorWithDefaultOptions allocator;
    for (size_t i = 0; i < session->GetInputCount(); ++i) inputs.insert(session->GetInputNameAllocated(i, allocator).get());
    for (size_t i = 0; i < session->GetOutputCount(); ++i) outputs.insert(session->GetOutputNameAllocated(i, allocator).get());
    if (inputs != want_in || !std::includes(outputs.begin(), outputs.end(), want_out.begin(), want_out.end()))
        fail(EM_ERR_BACKEND, path + " does not match edgemem.json: its inputs or outputs differ from the manifest's");
    return session;
}

Engine::Mapping::~Mapping() {
    if (data) ::munmap(data, size);
}

void Engine::Mapping::drop() const {
    if (data) ::madvise(data, size, MADV_DONTNEED);
}

// ---------------------------------------------------------------- streams

Snapshot Engine::fresh() const {
    Snapshot snap;
    snap.state = initial;
    return snap;
}

em_stream *Engine::new_stream(const Snapshot *from) {
    auto s = std::make_unique<em_stream>();
    s->engine = this;
    if (trt) {
        s->device = trt->alloc();
        assign(s.get(), from ? *from : fresh());
        return s.release();
    }
    for (size_t i : fixed) {
        const Spec &spec = specs[i];
        s->owned.push_back(alloc(spec.shape(1), spec.dtype));
        OrtValue *a = s->owned.back();
        if (!spec.in_place) s->owned.push_back(alloc(spec.shape(1), spec.dtype));
        s->fixed.push_back({a, s->owned.back()});
    }
    s->ids = alloc({1, 1}, dtype_named("int64"));
    s->logits = alloc({1, 1, vocab}, logits_dtype);
    assign(s.get(), from ? *from : fresh());
    return s.release();
}

void Engine::assign(em_stream *s, const Snapshot &snap) {
    std::vector<Ort::Value> caches;
    for (size_t i : growing) {
        caches.push_back(alloc(snap.state[i].shape, specs[i].dtype));
        if (!snap.state[i].data.empty())
            std::memcpy(caches.back().GetTensorMutableRawData(), snap.state[i].data.data(), snap.state[i].data.size());
    }
    for (size_t f = 0; f < fixed.size(); ++f) {
        if (trt) trt->upload(*s->device, fixed[f], 0, snap.state[fixed[f]].data.data());
        else std::memcpy(data(s->fixed[f][0]), snap.state[fixed[f]].data.data(), specs[fixed[f]].row_bytes());
    }
    s->caches = std::move(caches);
    s->side = 0;
    s->slot = nullptr;
    s->position = snap.position;
    s->has_logits = snap.has_logits;
    s->next = snap.has_logits ? snap.logits : std::vector<float>(size_t(vocab), 0.0f);
}

Snapshot Engine::snapshot(const em_stream *s) {
    std::lock_guard<std::recursive_mutex> hold(mutex);
    Snapshot snap;
    snap.state.resize(specs.size());
    for (size_t f = 0; f < fixed.size(); ++f) {
        const Spec &spec = specs[fixed[f]];
        const size_t bytes = spec.row_bytes();
        Blob &blob = snap.state[fixed[f]];
        blob.dtype = spec.dtype;
        blob.shape = spec.shape(1);
        if (trt) {
            blob.data.resize(bytes);
            trt->download(blob.data.data(), *s->device, fixed[f], s->side);
            continue;
        }
        const uint8_t *p = s->slot ? data(s->slot->fixed[f][size_t(s->slot->side)]) + s->row * bytes : data(s->fixed[f][size_t(s->side)]);
        blob.data.assign(p, p + bytes);
    }
    for (size_t g = 0; g < growing.size(); ++g) {
        Blob &blob = snap.state[growing[g]];
        OrtValue *value = const_cast<OrtValue *>(static_cast<const OrtValue *>(s->caches[g]));
        blob.dtype = specs[growing[g]].dtype;
        blob.shape = shape_of(value);
        const size_t bytes = size_t(elements(blob.shape)) * blob.dtype->size;
        if (bytes) blob.data.assign(data(value), data(value) + bytes);
    }
    snap.position = s->position;
    snap.has_logits = s->has_logits;
    snap.logits = s->next;
    return snap;
}

void Engine::sync(em_stream *s) {
    Slot *slot = s->slot;
    if (!slot) return;
    for (size_t f = 0; f < fixed.size(); ++f) {
        const size_t bytes = specs[fixed[f]].row_bytes();
        std::memcpy(data(s->fixed[f][size_t(s->side)]), data(slot->fixed[f][size_t(slot->side)]) + s->row * bytes, bytes);
    }
    s->slot = nullptr;
}

void Engine::detach(em_stream *s) {
    std::lock_guard<std::recursive_mutex> hold(mutex);
    if (s->slot)
        for (auto &member : s->slot->members)
            if (member == s) member = nullptr;
    s->slot = nullptr;
}

void Engine::check_token(int64_t token) const {
    if (token < 0 || token >= vocab)
        fail(EM_ERR_TOKEN, "token id " + std::to_string(token) + " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
}

void Engine::check_room(int64_t position, int64_t tokens) const {
    if (max_length >= 0 && position + tokens > max_length)
        fail(EM_ERR_CACHE_FULL, "the KV cache holds max_length=" + std::to_string(max_length) + " tokens: a stream at position " +
                                    std::to_string(position) + " cannot take " + std::to_string(tokens) +
                                    " more; export with a larger --max-length, or with --sinks S for a sliding window");
}

// ---------------------------------------------------------------- runs

void Engine::run(Ort::Session &session, std::vector<OrtValue *> &inputs, std::vector<OrtValue *> &outputs, const char *kind) {
    // A prefill's arena gives back what it holds beyond the live tensors once the run ends (benchmarks/README.md).
    const OrtRunOptions *options = std::strcmp(kind, "prefill") == 0 && shrink ? static_cast<const OrtRunOptions *>(*shrink) : nullptr;
    OrtStatus *status = Ort::GetApi().Run(session, options, in_names.data(), inputs.data(), inputs.size(), out_names.data(), outputs.size(),
                                          outputs.data());
    if (status) {
        const std::string message = Ort::GetApi().GetErrorMessage(status);
        Ort::GetApi().ReleaseStatus(status);
        fail(EM_ERR_RUN, std::string("onnxruntime failed running the ") + kind + " graph of " + arch + ": " + message);
    }
}

void Engine::step_one(em_stream *s, int64_t token) {
    check_token(token);
    check_room(s->position, 1);
    if (s->slot) {
        std::lock_guard<std::recursive_mutex> hold(mutex);
        sync(s);
    }
    if (trt) {
        trt->step(*s->device, s->side, token, s->next.data());
        s->side ^= 1;
        s->position += 1;
        s->has_logits = true;
        return;
    }
    *reinterpret_cast<int64_t *>(data(s->ids)) = token;
    std::vector<OrtValue *> inputs{s->ids}, outputs{s->logits};
    for (auto &sides : s->fixed) inputs.push_back(sides[size_t(s->side)]), outputs.push_back(sides[size_t(1 - s->side)]);
    for (auto &cache : s->caches) inputs.push_back(cache), outputs.push_back(nullptr);
    run(*step, inputs, outputs, "step");
    for (size_t g = 0; g < growing.size(); ++g) s->caches[g] = Ort::Value(outputs[1 + fixed.size() + g]);
    s->side ^= 1;
    s->position += 1;
    to_float(data(s->logits), logits_dtype, size_t(vocab), s->next.data());
    s->has_logits = true;
}

void Engine::prefill_tokens(em_stream *s, const int64_t *tokens, size_t n) {
    if (n == 0) fail(EM_ERR_TOKEN, "the prompt is empty: give at least one token");
    for (size_t i = 0; i < n; ++i)
        if (tokens[i] < 0 || tokens[i] >= vocab)
            fail(EM_ERR_TOKEN, "token id " + std::to_string(tokens[i]) + " at index " + std::to_string(i) +
                                   " of the prompt is outside the vocabulary [0, " + std::to_string(vocab) + ")");
    check_room(s->position, int64_t(n));
    if (trt ? !trt->has_prefill : !prefill) {
        for (size_t i = 0; i < n; ++i) step_one(s, tokens[i]);
        return;
    }
    if (trt) {
        const size_t most = std::min(size_t(chunk), trt->max_tokens());
        for (size_t start = 0; start < n; start += most) {
            const size_t count = std::min(n - start, most);
            trt->prefill(*s->device, s->side, tokens + start, count, s->next.data());
            s->side ^= 1;
            s->position += int64_t(count);
            s->has_logits = true;
        }
        return;
    }
    if (s->slot) {
        std::lock_guard<std::recursive_mutex> hold(mutex);
        sync(s);
    }
    for (size_t start = 0; start < n; start += size_t(chunk)) {
        const size_t count = std::min(n - start, size_t(chunk));
        const int64_t shape[2] = {1, int64_t(count)};
        Ort::Value ids = Ort::Value::CreateTensor<int64_t>(host, const_cast<int64_t *>(tokens + start), count, shape, 2);
        std::vector<OrtValue *> inputs{ids}, outputs{nullptr};
        for (auto &sides : s->fixed) inputs.push_back(sides[size_t(s->side)]), outputs.push_back(sides[size_t(1 - s->side)]);
        for (auto &cache : s->caches) inputs.push_back(cache), outputs.push_back(nullptr);
        run(*prefill, inputs, outputs, "prefill");
        Ort::Value logits(outputs[0]);
        for (size_t g = 0; g < growing.size(); ++g) s->caches[g] = Ort::Value(outputs[1 + fixed.size() + g]);
        const auto shape_out = shape_of(logits);
        const DType *dtype = dtype_of_onnx(logits.GetTensorTypeAndShapeInfo().GetElementType());
        const size_t rows = size_t(elements(shape_out)) / size_t(vocab);
        to_float(data(logits) + (rows - 1) * size_t(vocab) * dtype->size, dtype, size_t(vocab), s->next.data());
        s->side ^= 1;
        s->position += int64_t(count);
        s->has_logits = true;
    }
}

void Engine::step_batch(em_stream *const *streams, const int64_t *tokens, size_t n, float *logits_out) {
    for (size_t i = 0; i < n; ++i) {
        if (!streams[i]) fail(EM_ERR_ARGUMENT, "em_step_batch: stream " + std::to_string(i) + " is NULL");
        if (streams[i]->engine != this) fail(EM_ERR_BATCH, "em_step_batch: every stream must come from one engine");
        for (size_t j = 0; j < i; ++j)
            if (streams[j] == streams[i]) fail(EM_ERR_BATCH, "em_step_batch: a stream appears more than once in the batch");
        if (tokens[i] < 0 || tokens[i] >= vocab)
            fail(EM_ERR_TOKEN, "token id " + std::to_string(tokens[i]) + " at index " + std::to_string(i) +
                                   " of the batch's token ids is outside the vocabulary [0, " + std::to_string(vocab) + ")");
    }
    std::vector<em_stream *> order(streams, streams + n);
    std::sort(order.begin(), order.end(), std::less<em_stream *>());  // one order for every batch: no deadlock
    std::vector<std::unique_lock<std::mutex>> held;
    for (em_stream *s : order) {
        std::unique_lock<std::mutex> lock(s->mutex, std::try_to_lock);
        if (!lock.owns_lock()) {
            if (s->in_batch)
                fail(EM_ERR_BATCH,
                     "em_step_batch: a stream is being stepped in another batch right now; a stream takes part in one batch at a time");
            lock.lock();
        }
        held.push_back(std::move(lock));
    }
    for (size_t i = 0; i < n; ++i) check_room(streams[i]->position, 1);
    std::vector<int64_t> pasts;
    if (!growing.empty()) {
        const Spec &spec = specs[growing[0]];
        const size_t axis = size_t(std::find(spec.dims.begin(), spec.dims.end(), -2) - spec.dims.begin());
        for (size_t i = 0; i < n; ++i) pasts.push_back(shape_of(streams[i]->caches[0])[axis]);
        if (std::any_of(pasts.begin(), pasts.end(), [&](int64_t p) { return p != pasts[0]; }))
            fail(EM_ERR_BATCH, arch + "'s state grows (KV cache): a batch needs streams with caches of equal length; batch streams at the "
                                      "same position or step them one by one");
    }
    struct Flags {
        std::vector<em_stream *> &streams;
        ~Flags() {
            for (em_stream *s : streams) s->in_batch = false;
        }
    } flags{order};
    for (em_stream *s : order) s->in_batch = true;

    if (trt) {
        std::vector<DeviceState *> states;
        std::vector<int> sides;
        std::vector<float *> next;
        for (size_t i = 0; i < n; ++i)
            states.push_back(streams[i]->device.get()), sides.push_back(streams[i]->side), next.push_back(streams[i]->next.data());
        trt->step_batch(states, sides, tokens, next);
        for (size_t i = 0; i < n; ++i) {
            if (logits_out) std::memcpy(logits_out + i * size_t(vocab), streams[i]->next.data(), size_t(vocab) * sizeof(float));
            streams[i]->has_logits = true;
            streams[i]->position += 1;
        }
        return;
    }
    std::lock_guard<std::recursive_mutex> hold(mutex);
    Slot *slot = nullptr;
    for (size_t k = 0; k < slots.size(); ++k)
        if (slots[k]->n == n) {
            std::rotate(slots.begin() + long(k), slots.begin() + long(k) + 1, slots.end());  // most recent last
            slot = slots.back().get();
        }
    if (!slot) {
        auto made = std::make_unique<Slot>();
        made->n = n;
        for (size_t i : fixed) {
            made->owned.push_back(alloc(specs[i].shape(int64_t(n)), specs[i].dtype));
            OrtValue *a = made->owned.back();
            if (!specs[i].in_place) made->owned.push_back(alloc(specs[i].shape(int64_t(n)), specs[i].dtype));
            made->fixed.push_back({a, made->owned.back()});
        }
        made->ids = alloc({int64_t(n), 1}, dtype_named("int64"));
        made->logits = alloc({int64_t(n), 1, vocab}, logits_dtype);
        slots.push_back(std::move(made));
        slot = slots.back().get();
        while (slots.size() > BATCH_SLOTS) {
            for (em_stream *m : slots.front()->members)
                if (m && m->slot == slots.front().get()) sync(m);
            slots.erase(slots.begin());
        }
    }
    bool holds = slot->members.size() == n;
    for (size_t i = 0; holds && i < n; ++i) holds = slot->members[i] == streams[i] && streams[i]->slot == slot && streams[i]->row == i;
    if (!holds) {
        for (em_stream *m : slot->members)
            if (m && m->slot == slot) sync(m);
        for (size_t i = 0; i < n; ++i) sync(streams[i]);  // a member of another slot takes its state back first
        for (size_t f = 0; f < fixed.size(); ++f) {
            const size_t bytes = specs[fixed[f]].row_bytes();
            for (size_t i = 0; i < n; ++i)
                std::memcpy(data(slot->fixed[f][size_t(slot->side)]) + i * bytes, data(streams[i]->fixed[f][size_t(streams[i]->side)]),
                            bytes);
        }
        for (size_t i = 0; i < n; ++i) streams[i]->slot = slot, streams[i]->row = i;
        slot->members.assign(streams, streams + n);
    }
    std::memcpy(data(slot->ids), tokens, n * sizeof(int64_t));
    std::vector<OrtValue *> inputs{slot->ids}, outputs{slot->logits};
    for (auto &sides : slot->fixed) inputs.push_back(sides[size_t(slot->side)]), outputs.push_back(sides[size_t(1 - slot->side)]);
    std::vector<Ort::Value> batched;  // growing caches: [n, ...] copies of equal-length rows
    for (size_t g = 0; g < growing.size(); ++g) {
        auto shape = shape_of(streams[0]->caches[g]);
        const size_t bytes = size_t(elements(shape)) * specs[growing[g]].dtype->size;
        shape[0] = int64_t(n);
        batched.push_back(alloc(shape, specs[growing[g]].dtype));
        for (size_t i = 0; i < n && bytes; ++i) std::memcpy(data(batched.back()) + i * bytes, data(streams[i]->caches[g]), bytes);
        inputs.push_back(batched.back());
        outputs.push_back(nullptr);
    }
    run(*step, inputs, outputs, "step");
    for (size_t g = 0; g < growing.size(); ++g) {
        Ort::Value out(outputs[1 + fixed.size() + g]);
        auto shape = shape_of(out);
        const size_t bytes = size_t(elements(shape)) / n * specs[growing[g]].dtype->size;
        shape[0] = 1;
        for (size_t i = 0; i < n; ++i) {
            Ort::Value row = alloc(shape, specs[growing[g]].dtype);
            if (bytes) std::memcpy(row.GetTensorMutableRawData(), data(out) + i * bytes, bytes);
            streams[i]->caches[g] = std::move(row);
        }
    }
    slot->side ^= 1;
    const size_t row = size_t(vocab) * logits_dtype->size;
    for (size_t i = 0; i < n; ++i) {
        to_float(data(slot->logits) + i * row, logits_dtype, size_t(vocab), streams[i]->next.data());
        if (logits_out) std::memcpy(logits_out + i * size_t(vocab), streams[i]->next.data(), size_t(vocab) * sizeof(float));
        streams[i]->has_logits = true;
        streams[i]->position += 1;
    }
}

// ---------------------------------------------------------------- checkpoints (edgemem/runtime/state.py)

std::vector<uint8_t> Engine::encode(const Snapshot &snap) const {
    std::map<std::string, Blob> tensors;
    const int64_t filled = filled_limit >= 0 ? std::min(snap.position, filled_limit) : 0;
    for (size_t i = 0; i < specs.size(); ++i) {
        const Blob &blob = snap.state[i];
        if (!specs[i].cache) {
            tensors[specs[i].input] = blob;
            continue;
        }
        Blob part;  // [1, H, L, D] → [1, H, filled, D]
        part.dtype = blob.dtype;
        part.shape = {blob.shape[0], blob.shape[1], filled, blob.shape[3]};
        const size_t block = size_t(blob.shape[2] * blob.shape[3]) * blob.dtype->size,
                     keep = size_t(filled * blob.shape[3]) * blob.dtype->size;
        for (int64_t h = 0; h < blob.shape[0] * blob.shape[1]; ++h)
            part.data.insert(part.data.end(), blob.data.begin() + long(size_t(h) * block),
                             blob.data.begin() + long(size_t(h) * block + keep));
        tensors[specs[i].input] = std::move(part);
    }
    if (snap.has_logits) {
        Blob logits;
        logits.dtype = dtype_named("float32");
        logits.shape = {vocab};
        logits.data.resize(size_t(vocab) * 4);
        std::memcpy(logits.data.data(), snap.logits.data(), logits.data.size());
        tensors["logits"] = std::move(logits);
    }
    std::map<std::string, std::string> metadata{
        {"format", STATE_FORMAT}, {"arch", arch}, {"identity", identity}, {"position", std::to_string(snap.position)}};
    metadata["sha256"] = state_checksum(metadata, tensors);
    return write_safetensors(tensors, metadata);
}

Snapshot Engine::decode(const std::vector<uint8_t> &bytes, const std::string &where) const {
    std::map<std::string, std::string> metadata;
    auto tensors = read_safetensors(bytes, where, EM_ERR_STATE_FILE, &metadata);
    if (metadata.count("format") == 0 || metadata["format"] != STATE_FORMAT)
        fail(EM_ERR_STATE_FILE, where + " is not an edgemem state checkpoint, or its header is corrupt (metadata format " +
                                    (metadata.count("format") ? "'" + metadata["format"] + "'" : std::string("None")) + ", expected '" +
                                    STATE_FORMAT + "')");
    if (metadata["sha256"] != state_checksum(metadata, tensors))
        fail(EM_ERR_STATE_FILE, where + " is corrupt: its checksum does not match its contents (modified or damaged)");
    if (metadata["identity"] != identity)
        fail(EM_ERR_STATE_FILE, where + " was saved from another model (arch " + metadata["arch"] + ", identity " +
                                    metadata["identity"].substr(0, 12) + ") — this export is " + arch + ", identity " +
                                    identity.substr(0, 12));
    const std::string &text = metadata["position"];
    if (text.empty() || text.size() > 18 || !std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; }))
        fail(EM_ERR_STATE_FILE, where + ": invalid position '" + text + "'");
    Snapshot snap;
    snap.position = std::stoll(text);
    auto logits = tensors.find("logits");
    if (logits != tensors.end()) {
        if (logits->second.dtype->name != "float32" || logits->second.shape != std::vector<int64_t>{vocab})
            fail(EM_ERR_STATE_FILE, where + ": logits are " + logits->second.dtype->name + " " + shape_text(logits->second.shape) +
                                        ", expected float32 [" + std::to_string(vocab) + "]");
        if (!all_finite(logits->second)) fail(EM_ERR_STATE_FILE, where + ": the logits hold NaN or infinite values");
        snap.has_logits = true;
        snap.logits.resize(size_t(vocab));
        std::memcpy(snap.logits.data(), logits->second.data.data(), size_t(vocab) * 4);
        tensors.erase(logits);
    }
    std::vector<std::string> missing, unexpected;
    for (const auto &spec : specs)
        if (!tensors.count(spec.input)) missing.push_back(spec.input);
    for (const auto &entry : tensors)
        if (std::none_of(specs.begin(), specs.end(), [&](const Spec &s) { return s.input == entry.first; }))
            unexpected.push_back(entry.first);
    if (!missing.empty() || !unexpected.empty())
        fail(EM_ERR_STATE_FILE,
             where + " does not hold this model's state tensors: " + (missing.empty() ? "" : "missing " + join(missing)) +
                 (missing.empty() || unexpected.empty() ? "" : "; ") + (unexpected.empty() ? "" : "unexpected " + join(unexpected)));
    const int64_t filled = filled_limit >= 0 ? std::min(snap.position, filled_limit) : 0;
    int64_t past = -1;
    for (const auto &spec : specs) {
        Blob blob = std::move(tensors[spec.input]);
        if (blob.dtype != spec.dtype)
            fail(EM_ERR_STATE_FILE, where + ": " + spec.input + " is " + blob.dtype->name + ", expected " + spec.dtype->name);
        if (spec.cache) {
            const auto want = spec.shape(1);
            const std::vector<int64_t> part{want[0], want[1], filled, want[3]};
            if (blob.shape != part)
                fail(EM_ERR_STATE_FILE, where + ": " + spec.input + " has shape " + shape_text(blob.shape) + ", expected its filled part " +
                                            shape_text(part) + " at position " + std::to_string(snap.position));
            Blob full;
            full.dtype = blob.dtype;
            full.shape = want;
            full.data.assign(size_t(elements(want)) * blob.dtype->size, 0);
            const size_t block = size_t(want[2] * want[3]) * blob.dtype->size, keep = size_t(filled * want[3]) * blob.dtype->size;
            for (int64_t h = 0; keep && h < want[0] * want[1]; ++h)
                std::memcpy(full.data.data() + size_t(h) * block, blob.data.data() + size_t(h) * keep, keep);
            blob = std::move(full);
        }
        if (spec.growing) {
            const size_t axis = size_t(std::find(spec.dims.begin(), spec.dims.end(), -2) - spec.dims.begin());
            if (blob.shape.size() == spec.dims.size()) {
                if (past >= 0 && blob.shape[axis] != past)
                    fail(EM_ERR_STATE_FILE, where + ": KV caches of different lengths (" + std::to_string(past) + " and " +
                                                std::to_string(blob.shape[axis]) + " at " + spec.input + ")");
                past = blob.shape[axis];
            }
        }
        const auto want = spec.shape(1, past < 0 ? 0 : past);
        if (blob.shape != want)
            fail(EM_ERR_STATE_FILE,
                 where + ": " + spec.input + " has shape " + shape_text(blob.shape) + ", expected " + shape_text(want) + " (batch 1)");
        if (!all_finite(blob)) fail(EM_ERR_STATE_FILE, where + ": " + spec.input + " holds NaN or infinite values");
        snap.state.push_back(std::move(blob));
    }
    return snap;
}

}  // namespace em
