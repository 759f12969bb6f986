#include "trt.hpp"

#include <cuda.h>
#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>

#include "trt_abi.hpp"

namespace em {

namespace {
using json = nlohmann::ordered_json;  // in file order: the first bad record is the one engines.py names

constexpr const char *ENGINES_DIR = "engines";
constexpr const char *ENGINES_JSON = "engines.json";
constexpr const char *FORMAT = "edgemem-engines/3";
constexpr const char *SEPARATE_FORMAT = "edgemem-engines/2";  // one engine per graph: read as "shared": "none"
constexpr const char *PLUGINS_ENV = "EDGEMEM_TRT_PLUGINS";
constexpr size_t BATCH_SLOTS = 4;

[[noreturn]] void backend(const std::string &message) { fail(EM_ERR_BACKEND, message); }

std::string shape_text(const std::vector<int64_t> &shape) {
    std::string out = "[";
    for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
    return out + "]";
}

// ---------------------------------------------------------------- engines.json (edgemem/runtime/engines.py)

// A JSON value as Python's repr writes it, for messages that read as engines.py's.
std::string repr(const json &value) {
    if (value.is_string()) return "'" + value.get<std::string>() + "'";
    if (value.is_null()) return "None";
    if (value.is_boolean()) return value.get<bool>() ? "True" : "False";
    return value.dump();
}

std::string text(const json &value) { return value.is_string() ? value.get<std::string>() : value.dump(); }  // as str() would

// Every field the runtime reads is there, else what is wrong; an edgemem-engines/2 `info` gains its implied
// "shared" and "profile_index" fields (engines.py `_check_format`).
std::string format_problem(json &info) {
    const json found = info.is_object() ? info.value("format", json()) : json();
    if (found != FORMAT && found != SEPARATE_FORMAT) return "format " + repr(found) + ", expected '" + FORMAT + "'";
    const bool separate = found == SEPARATE_FORMAT;
    const std::pair<const char *, bool> fields[] = {{"library", true},    {"plugins", true},       {"export", true},
                                                    {"max_batch", false}, {"max_sequence", false}, {"engines", true}};
    for (const auto &[key, object] : fields)
        if (!info.contains(key) || (object ? !info[key].is_object() : !info[key].is_number_integer()))
            return std::string("no ") + (object ? "dict" : "int") + " '" + key + "'";
    const json &library = info["library"];
    if (!(library.value("module", json()) == "tensorrt" || library.value("module", json()) == "tensorrt_rtx") ||
        !library.value("version", json()).is_string())
        return "'library' needs a module (tensorrt or tensorrt_rtx) and a version";
    if (!info["plugins"].contains("file") || !info["plugins"].contains("sha256")) return "'plugins' needs file and sha256";
    for (auto it = info["engines"].begin(); it != info["engines"].end(); ++it) {
        json &record = *it;
        bool complete = record.is_object();
        for (const char *key : {"file", "sha256", "profile", "in_place", "plugins"}) complete = complete && record.contains(key);
        if (!complete) return "engine '" + it.key() + "' needs file, sha256, profile, in_place and plugins";
        const json index = record.value("profile_index", json());
        if (separate) record["profile_index"] = 0;
        else if (!index.is_number_integer() || index.get<int64_t>() < 0)
            return "engine '" + it.key() + "' needs a profile_index (0, 1, ...)";
    }
    if (separate) info["shared"] = "none";
    std::vector<std::string> order;  // the engine files, in the order of the records that name them
    std::map<std::string, std::vector<const json *>> served;
    for (const json &record : info["engines"]) {
        const std::string file = record["file"].dump();
        if (!served.count(file)) order.push_back(file);
        served[file].push_back(&record);
    }
    for (const std::string &file : order) {
        std::set<int64_t> indices;
        std::set<std::string> digests;
        for (const json *record : served[file]) {
            indices.insert((*record)["profile_index"].get<int64_t>());
            digests.insert((*record)["sha256"].dump());
        }
        if (indices.size() < served[file].size() || digests.size() > 1)
            return "the graphs that " + text((*served[file][0])["file"]) + " serves need distinct profile_index values and one sha256";
    }
    // an encoder-decoder's encoder is an engine file of its own; "shared" says whether the decoder's graphs share one
    if (info["engines"].contains("encoder") && served[info["engines"]["encoder"]["file"].dump()].size() > 1)
        return "the encoder's engine " + text(info["engines"]["encoder"]["file"]) + " serves other graphs too";
    std::set<std::string> decoder;
    for (auto it = info["engines"].begin(); it != info["engines"].end(); ++it)
        if (it.key() != "encoder") decoder.insert((*it)["file"].dump());
    const char *shared = decoder.size() == 1 ? "profiles" : "none";
    if (info.value("shared", json()) != shared)
        return "'shared' is " + repr(info.value("shared", json())) + " for " + std::to_string(decoder.size()) + " engine file(s)";
    return "";
}

// ---------------------------------------------------------------- the CUDA driver, opened at run time

struct Cuda {
    void *library = nullptr;
    CUcontext context = nullptr;
    CUdevice device = 0;
    CUstream stream = nullptr;
    decltype(&::cuInit) init = nullptr;
    decltype(&::cuGetErrorString) error_string = nullptr;
    decltype(&::cuDeviceGetCount) device_count = nullptr;
    decltype(&::cuDeviceGet) device_get = nullptr;
    decltype(&::cuDevicePrimaryCtxRetain) retain = nullptr;
    decltype(&::cuDevicePrimaryCtxRelease_v2) release = nullptr;
    decltype(&::cuCtxSetCurrent) set_current = nullptr;
    decltype(&::cuStreamCreate) stream_create = nullptr;
    decltype(&::cuStreamDestroy_v2) stream_destroy = nullptr;
    decltype(&::cuStreamSynchronize) synchronize = nullptr;
    decltype(&::cuMemAlloc_v2) mem_alloc = nullptr;
    decltype(&::cuMemFree_v2) mem_free = nullptr;
    decltype(&::cuMemcpyHtoDAsync_v2) htod = nullptr;
    decltype(&::cuMemcpyDtoHAsync_v2) dtoh = nullptr;
    decltype(&::cuMemcpyDtoDAsync_v2) dtod = nullptr;

    Cuda() {
        library = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (!library)
            backend(std::string("backend 'trt' needs an NVIDIA GPU and its driver: libcuda.so.1 cannot be loaded (") + ::dlerror() +
                    "); install the NVIDIA driver (on Jetson: JetPack)");
        bool found = true;
        auto load = [&](auto &fn, const char *name) {
            fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(library, name));
            found = found && fn;
        };
        load(init, "cuInit"), load(error_string, "cuGetErrorString"), load(device_count, "cuDeviceGetCount");
        load(device_get, "cuDeviceGet"), load(retain, "cuDevicePrimaryCtxRetain"), load(release, "cuDevicePrimaryCtxRelease_v2");
        load(set_current, "cuCtxSetCurrent"), load(stream_create, "cuStreamCreate"), load(stream_destroy, "cuStreamDestroy_v2");
        load(synchronize, "cuStreamSynchronize"), load(mem_alloc, "cuMemAlloc_v2"), load(mem_free, "cuMemFree_v2");
        load(htod, "cuMemcpyHtoDAsync_v2"), load(dtoh, "cuMemcpyDtoHAsync_v2"), load(dtod, "cuMemcpyDtoDAsync_v2");
        if (!found)
            backend("backend 'trt' needs CUDA driver API 11 or later: this libcuda.so.1 lacks entry points; update the NVIDIA driver");
        const CUresult started = init(0);
        if (started != CUDA_SUCCESS) backend("backend 'trt' needs an NVIDIA GPU and its driver: " + message(started, "cuInit"));
        int count = 0;
        check(device_count(&count), "cuDeviceGetCount");
        if (count < 1) backend("backend 'trt' needs an NVIDIA GPU: CUDA sees none");
        check(device_get(&device, 0), "cuDeviceGet");
        check(retain(&context, device), "cuDevicePrimaryCtxRetain");  // the context TensorRT's CUDA runtime uses
        current();
        check(stream_create(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    }
    ~Cuda() {
        if (stream) set_current(context), stream_destroy(stream);
        if (context) release(device);
        // the driver stays loaded: TensorRT holds it too
    }
    Cuda(const Cuda &) = delete;
    Cuda &operator=(const Cuda &) = delete;

    std::string message(CUresult result, const char *what) const {
        const char *text = nullptr;
        if (error_string) error_string(result, &text);
        return std::string("CUDA ") + what + " failed: " + (text ? text : "error " + std::to_string(int(result)));
    }
    void check(CUresult result, const char *what) const {
        if (result != CUDA_SUCCESS) fail(EM_ERR_RUN, message(result, what));
    }
    void current() const { check(set_current(context), "cuCtxSetCurrent"); }  // on the calling thread
    CUdeviceptr alloc(size_t bytes) const {
        CUdeviceptr p = 0;
        check(mem_alloc(&p, std::max<size_t>(bytes, 1)), "cuMemAlloc");
        return p;
    }
    // pageable host memory: the upload is staged before it returns, the download completes before it returns
    void upload(CUdeviceptr dst, const void *src, size_t bytes) const { check(htod(dst, src, bytes, stream), "cuMemcpyHtoDAsync"); }
    void download(void *dst, CUdeviceptr src, size_t bytes) const {
        check(dtoh(dst, src, bytes, stream), "cuMemcpyDtoHAsync");
        check(synchronize(stream), "cuStreamSynchronize");
    }
    void copy(CUdeviceptr dst, CUdeviceptr src, size_t bytes) const { check(dtod(dst, src, bytes, stream), "cuMemcpyDtoDAsync"); }
};

// Device memory freed with its owner.
struct Memory {
    const Cuda *cuda = nullptr;
    CUdeviceptr pointer = 0;
    Memory(const Cuda &c, size_t bytes) : cuda(&c), pointer(c.alloc(bytes)) {}
    Memory(const Memory &) = delete;
    Memory &operator=(const Memory &) = delete;
    ~Memory() {
        if (pointer) cuda->set_current(cuda->context), cuda->mem_free(pointer);
    }
};

// `rows` streams' buffers: per spec one (in place) or two, token ids [rows, 1] and logits [rows, 1, vocab].
struct Buffers : DeviceState {
    std::vector<std::unique_ptr<Memory>> owned;
    std::vector<std::array<CUdeviceptr, 2>> state;
    CUdeviceptr ids = 0, logits = 0;
};

// ---------------------------------------------------------------- the TensorRT library, opened at run time

struct Library {
    std::string name, soname;  // "TensorRT for RTX", "libtensorrt_rtx.so.1"
    int abi = 0;               // whose headers' vtable layout (trt_abi.hpp)
};

Library library_of(const json &record) {
    const std::string module = record["module"], version = record["version"];
    const int major = std::atoi(version.c_str());
    if (module == "tensorrt_rtx") return {"TensorRT for RTX", "libtensorrt_rtx.so." + std::to_string(major), 11};
    return {"TensorRT", "libnvinfer.so." + std::to_string(major), major};
}

TrtOpen abi_open(int abi) {
#ifdef EDGEMEM_TRT_ABI10
    if (abi == 10) return trt_open_abi10;
#endif
#ifdef EDGEMEM_TRT_ABI11
    if (abi == 11) return trt_open_abi11;
#endif
    (void)abi;
    return nullptr;
}

class Backend final : public TrtBackend {
  public:
    Backend(const TrtExport &model, const char *engines, const char *plugins);
    ~Backend() override;

    std::unique_ptr<DeviceState> alloc() override {
        std::lock_guard<std::mutex> hold(mutex_);
        cuda_->current();
        return make(1);
    }
    void upload(DeviceState &state, size_t spec, int side, const void *host) override {
        std::lock_guard<std::mutex> hold(mutex_);
        cuda_->current();
        cuda_->upload(side_of(state, spec, side), host, row_bytes_[spec]);
    }
    void download(void *host, const DeviceState &state, size_t spec, int side) override {
        std::lock_guard<std::mutex> hold(mutex_);
        cuda_->current();
        cuda_->download(host, side_of(state, spec, side), row_bytes_[spec]);
    }
    void step(DeviceState &state, int side, int64_t token, float *logits) override {
        std::lock_guard<std::mutex> hold(mutex_);
        cuda_->current();
        auto &b = static_cast<Buffers &>(state);
        upload_tokens(b.ids, &token, 1);
        run("step", b, 1, 1, side, b.ids, b.logits);
        download_logits(logits, b.logits, 0);
    }
    void prefill(DeviceState &state, int side, const int64_t *tokens, size_t count, float *logits) override {
        std::lock_guard<std::mutex> hold(mutex_);
        cuda_->current();
        auto &b = static_cast<Buffers &>(state);
        Memory ids(*cuda_, count * token_bytes()), out(*cuda_, count * size_t(vocab_) * logits_dtype_->size);
        upload_tokens(ids.pointer, tokens, count);
        run("prefill", b, 1, count, side, ids.pointer, out.pointer);
        download_logits(logits, out.pointer, count - 1);
    }
    size_t max_tokens() const override { return max_tokens_; }
    void step_batch(const std::vector<DeviceState *> &states, const std::vector<int> &sides, const int64_t *tokens,
                    const std::vector<float *> &logits) override;

  private:
    const std::vector<Spec> &specs_;
    int64_t vocab_;
    std::string arch_, tokens_, logits_, build_;
    json info_;
    std::vector<bool> in_place_;     // per spec
    std::vector<size_t> row_bytes_;  // per spec
    const DType *logits_dtype_ = nullptr;
    bool tokens32_ = false;  // the engines take int32 token ids
    size_t max_tokens_ = 1;
    std::unique_ptr<Cuda> cuda_;
    std::unique_ptr<TrtRuntime> runtime_;
    std::vector<std::unique_ptr<TrtEngine>> engines_;                 // one per engine file
    std::map<std::string, std::unique_ptr<TrtGraph>> graphs_;         // graph kind → its context of one of engines_
    std::vector<std::pair<size_t, std::unique_ptr<Buffers>>> slots_;  // (batch size, buffers), least recently used first
    std::mutex mutex_;

    size_t token_bytes() const { return tokens32_ ? 4 : 8; }
    CUdeviceptr side_of(const DeviceState &state, size_t spec, int side) const {
        return static_cast<const Buffers &>(state).state[spec][size_t(side)];
    }
    std::unique_ptr<Buffers> make(size_t rows);  // lock held
    void upload_tokens(CUdeviceptr dst, const int64_t *tokens, size_t n);
    void download_logits(float *dst, CUdeviceptr logits, size_t position);  // row `position` of [1, T, vocab]
    void check_profile(const std::string &kind, const std::map<std::string, std::vector<int64_t>> &shapes) const;
    void run(const std::string &kind, Buffers &b, size_t rows, size_t count, int side, CUdeviceptr ids, CUdeviceptr logits);
};

Backend::Backend(const TrtExport &model, const char *engines, const char *plugins)
    : specs_(*model.specs), vocab_(model.vocab), arch_(model.arch), tokens_(model.tokens), logits_(model.logits) {
    const std::string dir = model.directory;
    // engines.json against the export and the engine files (engines.py `read`)
    const std::string folder = engines ? std::string(engines) : dir + "/" + ENGINES_DIR;
    build_ = "`edgemem build " + dir + " --plugins libedgemem_trt_plugins.so`";
    if (!is_dir(folder)) backend(folder + ": no TensorRT engines; build them with " + build_);
    const std::string path = folder + "/" + ENGINES_JSON;
    if (!is_file(path)) backend(folder + " has no " + ENGINES_JSON + " (engines from an older edgemem?); rebuild with " + build_);
    const auto text = read_file(path, EM_ERR_BACKEND, ENGINES_JSON);
    info_ = json::parse(text.begin(), text.end(), nullptr, false);
    const std::string problem = info_.is_discarded() ? "not JSON" : format_problem(info_);
    if (!problem.empty()) backend(path + " is not a valid " + ENGINES_JSON + " (" + problem + "); rebuild with " + build_);
    if (info_["library"]["module"] == "tensorrt_rtx") build_ = "`edgemem build " + dir + " --rtx --plugins libedgemem_trt_plugins.so`";
    const json &source = info_["export"];
    if (source.value("identity", json()) != model.identity) {
        const json arch = source.value("arch", json()), identity = source.value("identity", json());
        backend(folder + " holds engines built from another export (arch " + (arch.is_string() ? arch.get<std::string>() : arch.dump()) +
                ", identity " + (identity.is_string() ? identity.get<std::string>() : identity.dump()).substr(0, 12) + "); " + dir +
                " is " + arch_ + ", identity " + model.identity.substr(0, 12) + ": rebuild with " + build_);
    }
    if (!info_["engines"].contains("step")) backend(path + " lists no step engine; rebuild with " + build_);
    std::map<std::string, std::vector<std::pair<std::string, int64_t>>> files;  // engine file → (graph kind, profile index)
    for (auto it = info_["engines"].begin(); it != info_["engines"].end(); ++it) {
        const std::string name = (*it)["file"], file = folder + "/" + name;
        if (!is_file(file))
            backend(folder + ": the " + it.key() + " engine " + name + " listed in " + ENGINES_JSON + " is missing; rebuild with " +
                    build_);
        if (!files.count(file) && sha256_file(file) != (*it)["sha256"])
            backend(file + " does not match its sha256 in " + ENGINES_JSON + " (modified, or a build that did not finish); rebuild with " +
                    build_);
        files[file].emplace_back(it.key(), (*it)["profile_index"].get<int64_t>());
    }
    // the plugin library the engines were built with (engines.py `plugin_library`)
    const std::string built = info_["plugins"]["file"], digest = info_["plugins"]["sha256"];
    const char *chosen = plugins ? plugins : std::getenv(PLUGINS_ENV);
    if (!chosen || !*chosen)
        backend(std::string("no plugin library: set em_engine_options.plugins or ") + PLUGINS_ENV +
                "=PATH, PATH being libedgemem_trt_plugins.so; the engines were built with " + built);
    const std::string library_path = chosen;
    if (!is_file(library_path)) backend("plugin library " + library_path + " does not exist; the engines were built with " + built);
    if (sha256_file(library_path) != digest)
        backend("plugin library " + library_path + " is not the one the engines were built with (" + built + ", sha256 " +
                digest.substr(0, 12) + "); pass that library or rebuild the engines with this one");
    // the library that built the engines, and its version
    const Library lib = library_of(info_["library"]);
    const std::string version = info_["library"]["version"];
    const TrtOpen open = abi_open(lib.abi);
    if (!open)
        backend("the engines were built by " + lib.name + " " + version + ", whose runtime API this libedgemem was not compiled for " +
                "(TensorRT " + std::to_string(lib.abi) + " headers); rebuild libedgemem with -DTENSORRT_INCLUDE_DIR naming them");
    void *handle = ::dlopen(lib.soname.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle)
        backend("backend 'trt' needs " + lib.name + " " + version + ": " + lib.soname + " cannot be loaded (" + ::dlerror() +
                "); install " +
                (lib.name == "TensorRT for RTX" ? "it (pip install tensorrt-rtx-cu13==" + version + ", or the TensorRT-RTX SDK)"
                                                : "it (pip install tensorrt==" + version + ", or on Jetson JetPack's libnvinfer)") +
                " and put the folder of " + lib.soname + " on LD_LIBRARY_PATH");
    using Number = int32_t (*)();
    std::string found;
    for (const char *part : {"getInferLibMajorVersion", "getInferLibMinorVersion", "getInferLibPatchVersion", "getInferLibBuildVersion"}) {
        auto number = reinterpret_cast<Number>(::dlsym(handle, part));
        if (!number) backend(lib.soname + " has no " + part + ": not " + lib.name + "'s library");
        found += (found.empty() ? "" : ".") + std::to_string(number());
    }
    if (found != version)
        backend("the engines were built by " + lib.name + " " + version + ", this is " + lib.name + " " + found + "; rebuild them with `" +
                (lib.name == "TensorRT" ? "edgemem build" : "edgemem build --rtx") + "` here (engines are not portable across versions)");
    cuda_ = std::make_unique<Cuda>();
    runtime_ = open(handle, library_path);
    // the engines, checked against edgemem.json
    std::set<std::string> want{tokens_, logits_};
    for (const Spec &spec : specs_) want.insert(spec.input), want.insert(spec.output);
    for (const auto &[file, kinds] : files) {
        std::string error;
        engines_.push_back(runtime_->deserialize(read_file(file, EM_ERR_BACKEND, "engine"), error));
        if (!engines_.back())
            backend(lib.name + " could not deserialize " + file + " (" + error +
                    "; another GPU, or a plugin the library lacks?); rebuild with " + build_);
        TrtEngine &engine = *engines_.back();
        for (const auto &[kind, index] : kinds) {
            if (index >= engine.profiles())
                backend(lib.name + " could not select optimisation profile " + std::to_string(index) + " of " + file + " for the " + kind +
                        " graph (the engine has " + std::to_string(engine.profiles()) + "); rebuild with " + build_);
            auto graph = engine.context(int32_t(index), cuda_->stream, error);
            if (!graph) backend(lib.name + " could not give the " + kind + " graph a context of " + file + ": " + error);
            std::set<std::string> names;
            for (const auto &entry : graph->inputs) names.insert(entry.first);
            if (names != want)
                backend("the " + kind + " engine does not match edgemem.json: its tensors differ; rebuild it with " + build_);
            for (const Spec &spec : specs_)
                if (graph->dtypes[spec.input] != spec.dtype->name)
                    backend("the " + kind + " engine's state " + spec.input + " is " + graph->dtypes[spec.input] + ", edgemem.json says " +
                            spec.dtype->name + "; rebuild it with " + build_);
            graphs_[kind] = std::move(graph);
        }
    }
    const TrtGraph &step = *graphs_["step"];
    logits_dtype_ = dtype_named(step.dtypes.at(logits_));
    if (!logits_dtype_ || (logits_dtype_->name != "float32" && logits_dtype_->name != "float16"))
        backend("the step engine's logits are " + step.dtypes.at(logits_) + ", expected float32 or float16");
    const std::string ids = step.dtypes.at(tokens_);
    if (ids != "int64" && ids != "int32") backend("the step engine's token ids are " + ids + ", expected int64 or int32");
    tokens32_ = ids == "int32";
    for (const Spec &spec : specs_) {
        bool shared = true;
        for (const auto &entry : graphs_) {
            const json &listed = info_["engines"][entry.first]["in_place"];
            shared = shared && std::find(listed.begin(), listed.end(), spec.input) != listed.end();
        }
        in_place_.push_back(shared);
        row_bytes_.push_back(spec.row_bytes());
    }
    has_prefill = graphs_.count("prefill") > 0;
    if (has_prefill) {
        const auto &ranges = graphs_["prefill"]->ranges;
        const auto range = ranges.find(tokens_);
        max_tokens_ = range != ranges.end() && range->second[1].size() == 2 ? size_t(range->second[1][1]) : 1;
    }
    std::map<std::string, std::vector<int64_t>> shapes{{tokens_, {1, 1}}};
    for (const Spec &spec : specs_) shapes[spec.input] = spec.shape(1);
    check_profile("step", shapes);
}

Backend::~Backend() {
    slots_.clear();
    graphs_.clear();  // before their engines, the runtime and the CUDA context
    engines_.clear();
    runtime_.reset();
}

std::unique_ptr<Buffers> Backend::make(size_t rows) {
    auto b = std::make_unique<Buffers>();
    auto take = [&](size_t bytes) {
        b->owned.push_back(std::make_unique<Memory>(*cuda_, bytes));
        return b->owned.back()->pointer;
    };
    for (size_t i = 0; i < specs_.size(); ++i) {
        const CUdeviceptr a = take(rows * row_bytes_[i]);
        b->state.push_back({a, in_place_[i] ? a : take(rows * row_bytes_[i])});
    }
    b->ids = take(rows * token_bytes());
    b->logits = take(rows * size_t(vocab_) * logits_dtype_->size);
    return b;
}

void Backend::upload_tokens(CUdeviceptr dst, const int64_t *tokens, size_t n) {
    if (!tokens32_) return cuda_->upload(dst, tokens, n * 8);
    std::vector<int32_t> narrow(tokens, tokens + n);  // ids < vocab: they fit
    cuda_->upload(dst, narrow.data(), n * 4);
    cuda_->check(cuda_->synchronize(cuda_->stream), "cuStreamSynchronize");  // `narrow` goes out of scope
}

void Backend::download_logits(float *dst, CUdeviceptr logits, size_t position) {
    const size_t row = size_t(vocab_) * logits_dtype_->size;
    std::vector<uint8_t> host(row);
    cuda_->download(host.data(), logits + position * row, row);
    to_float(host.data(), logits_dtype_, size_t(vocab_), dst);
}

void Backend::check_profile(const std::string &kind, const std::map<std::string, std::vector<int64_t>> &shapes) const {
    for (const auto &[name, range] : graphs_.at(kind)->ranges) {  // the shapes of the kind's profile, as the engine has them
        const auto shape = shapes.find(name);
        if (shape == shapes.end()) continue;
        const auto &[lo, hi] = range;
        for (size_t d = 0; d < shape->second.size() && d < lo.size() && d < hi.size(); ++d)
            if (shape->second[d] < lo[d] || shape->second[d] > hi[d])
                fail(EM_ERR_BATCH, "the " + kind + " engine takes " + name + " from " + shape_text(lo) + " to " + shape_text(hi) +
                                       ", this run needs " + shape_text(shape->second) +
                                       "; rebuild with `edgemem build --max-batch N --max-sequence N` (built with --max-batch " +
                                       std::to_string(info_["max_batch"].get<int64_t>()) + " --max-sequence " +
                                       std::to_string(info_["max_sequence"].get<int64_t>()) + ")");
    }
}

void Backend::run(const std::string &kind, Buffers &b, size_t rows, size_t count, int side, CUdeviceptr ids, CUdeviceptr logits) {
    TrtGraph &graph = *graphs_.at(kind);
    if (!graph.set_shape(tokens_, {int64_t(rows), int64_t(count)}))
        fail(EM_ERR_RUN, "TensorRT refused shape [" + std::to_string(rows) + ", " + std::to_string(count) + "] for " + tokens_ +
                             " of the " + kind + " engine");
    bool ok = graph.set_address(tokens_, reinterpret_cast<void *>(ids)) && graph.set_address(logits_, reinterpret_cast<void *>(logits));
    for (size_t i = 0; i < specs_.size(); ++i) {
        if (!graph.set_shape(specs_[i].input, specs_[i].shape(int64_t(rows))))
            fail(EM_ERR_RUN, "TensorRT refused shape " + shape_text(specs_[i].shape(int64_t(rows))) + " for " + specs_[i].input +
                                 " of the " + kind + " engine");
        ok = ok && graph.set_address(specs_[i].input, reinterpret_cast<void *>(b.state[i][size_t(side)])) &&
             graph.set_address(specs_[i].output, reinterpret_cast<void *>(b.state[i][size_t(1 - side)]));
    }
    if (!ok) fail(EM_ERR_RUN, "TensorRT refused a tensor address in the " + kind + " engine");
    if (!graph.enqueue(cuda_->stream)) fail(EM_ERR_RUN, "TensorRT failed running the " + kind + " engine of " + arch_);
}

void Backend::step_batch(const std::vector<DeviceState *> &states, const std::vector<int> &sides, const int64_t *tokens,
                         const std::vector<float *> &logits) {
    const size_t n = states.size();
    std::map<std::string, std::vector<int64_t>> shapes{{tokens_, {int64_t(n), 1}}};
    for (const Spec &spec : specs_) shapes[spec.input] = spec.shape(int64_t(n));
    check_profile("step", shapes);
    std::lock_guard<std::mutex> hold(mutex_);
    cuda_->current();
    Buffers *slot = nullptr;
    for (size_t k = 0; k < slots_.size(); ++k)
        if (slots_[k].first == n) {
            std::rotate(slots_.begin() + long(k), slots_.begin() + long(k) + 1, slots_.end());  // most recent last
            slot = slots_.back().second.get();
        }
    if (!slot) {
        slots_.emplace_back(n, make(n));
        slot = slots_.back().second.get();
        if (slots_.size() > BATCH_SLOTS) slots_.erase(slots_.begin());
    }
    for (size_t i = 0; i < specs_.size(); ++i)
        for (size_t j = 0; j < n; ++j) cuda_->copy(slot->state[i][0] + j * row_bytes_[i], side_of(*states[j], i, sides[j]), row_bytes_[i]);
    upload_tokens(slot->ids, tokens, n);
    run("step", *slot, n, 1, 0, slot->ids, slot->logits);
    for (size_t i = 0; i < specs_.size(); ++i)
        for (size_t j = 0; j < n; ++j) cuda_->copy(side_of(*states[j], i, sides[j]), slot->state[i][1] + j * row_bytes_[i], row_bytes_[i]);
    const size_t row = size_t(vocab_) * logits_dtype_->size;
    std::vector<uint8_t> host(n * row);
    cuda_->download(host.data(), slot->logits, host.size());
    for (size_t j = 0; j < n; ++j) to_float(host.data() + j * row, logits_dtype_, size_t(vocab_), logits[j]);
}

}  // namespace

std::unique_ptr<TrtBackend> open_trt(const TrtExport &model, const char *engines, const char *plugins) {
    return std::make_unique<Backend>(model, engines, plugins);
}

}  // namespace em
