// C++ over edgemem.h: RAII handles; a failed call throws edgemem::Error (the C code and message).
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "edgemem/edgemem.h"

namespace edgemem {

class Error : public std::runtime_error {
  public:
    Error(int code, const std::string &message) : std::runtime_error(message), code_(code) {}
    int code() const noexcept { return code_; }

  private:
    int code_;
};

namespace detail {
inline void check(int status) {
    if (status != EM_OK) throw Error(status, em_last_error());
}
template <typename T> T *check(T *handle) {
    if (!handle) throw Error(em_last_error_code(), em_last_error());
    return handle;
}
struct FreeEngine {
    void operator()(em_engine *e) const noexcept { em_engine_free(e); }
};
struct FreeStream {
    void operator()(em_stream *s) const noexcept { em_stream_free(s); }
};
struct FreeSampler {
    void operator()(em_sampler *s) const noexcept { em_sampler_free(s); }
};
}  // namespace detail

class Stream;

// An export loaded into onnxruntime. Outlives its streams.
class Engine {
  public:
    explicit Engine(const std::string &dir, int threads = 0) : handle_(detail::check(em_engine_load(dir.c_str(), threads))) {}
    Engine(const std::string &dir, const em_engine_options &options) : handle_(detail::check(em_engine_load_ex(dir.c_str(), &options))) {}
    int64_t vocab_size() const { return em_engine_vocab_size(handle_.get()); }
    std::string arch() const { return em_engine_arch(handle_.get()); }
    int64_t state_bytes(int64_t position = 0) const { return em_engine_state_bytes(handle_.get(), position); }
    Stream new_stream();
    Stream load_stream(const std::string &path);
    // One token per stream in one run; logits [n × vocab].
    std::vector<float> step_batch(const std::vector<Stream *> &streams, const std::vector<int64_t> &tokens);
    em_engine *get() const noexcept { return handle_.get(); }

  private:
    std::unique_ptr<em_engine, detail::FreeEngine> handle_;
};

class Stream {
  public:
    explicit Stream(em_stream *handle) : handle_(detail::check(handle)) {}
    Stream fork() const { return Stream(em_stream_fork(handle_.get())); }
    // Consume tokens (at least one); the next-token logits.
    std::vector<float> prefill(const std::vector<int64_t> &tokens) {
        std::vector<float> logits(static_cast<size_t>(vocab()));
        detail::check(em_stream_prefill(handle_.get(), tokens.data(), tokens.size(), logits.data()));
        return logits;
    }
    std::vector<float> step(int64_t token) {
        std::vector<float> logits(static_cast<size_t>(vocab()));
        detail::check(em_stream_step(handle_.get(), token, logits.data()));
        return logits;
    }
    std::vector<float> logits() const {
        std::vector<float> out(static_cast<size_t>(vocab()));
        detail::check(em_stream_logits(handle_.get(), out.data()));
        return out;
    }
    void reset() { detail::check(em_stream_reset(handle_.get())); }
    void save(const std::string &path) const { detail::check(em_stream_save(handle_.get(), path.c_str())); }
    int64_t position() const { return em_stream_position(handle_.get()); }
    int64_t state_bytes() const { return em_stream_state_bytes(handle_.get()); }
    em_stream *get() const noexcept { return handle_.get(); }

  private:
    int64_t vocab() const { return em_stream_vocab_size(handle_.get()); }
    std::unique_ptr<em_stream, detail::FreeStream> handle_;
};

// Greedy at temperature 0; otherwise sampled with top-k (0: off) and top-p (1: off), reproducibly per seed.
class Sampler {
  public:
    explicit Sampler(float temperature = 0, int top_k = 0, float top_p = 1, uint64_t seed = 0)
        : handle_(detail::check(em_sampler_new(temperature, top_k, top_p, seed))) {}
    int64_t operator()(const std::vector<float> &logits) {
        const int64_t token = em_sampler_sample(handle_.get(), logits.data(), int64_t(logits.size()));
        if (token < 0) throw Error(em_last_error_code(), em_last_error());
        return token;
    }

  private:
    std::unique_ptr<em_sampler, detail::FreeSampler> handle_;
};

inline Stream Engine::new_stream() { return Stream(em_stream_new(handle_.get())); }

inline Stream Engine::load_stream(const std::string &path) { return Stream(em_stream_load(handle_.get(), path.c_str())); }

inline std::vector<float> Engine::step_batch(const std::vector<Stream *> &streams, const std::vector<int64_t> &tokens) {
    if (streams.size() != tokens.size()) throw Error(EM_ERR_BATCH, "step_batch: one token per stream");
    std::vector<em_stream *> handles;
    for (Stream *s : streams) handles.push_back(s->get());
    std::vector<float> logits(streams.size() * size_t(vocab_size()));
    detail::check(em_step_batch(handles.data(), tokens.data(), handles.size(), logits.data()));
    return logits;
}

}  // namespace edgemem
