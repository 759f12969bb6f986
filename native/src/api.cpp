// The C boundary: every entry point catches everything and turns it into a code and a thread-local message.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <new>
#include <numeric>
#include <random>

#include "edgemem/edgemem.h"
#include "runtime.hpp"

namespace {
thread_local std::string last_error;
thread_local int last_code = EM_OK;

void set_error(int code, const std::string &message) {
    last_code = code;
    last_error = message;
}

// Runs `body`; returns its result, or `failed` with the error recorded.
template <typename T, typename F> T guard(T failed, F &&body) noexcept {
    try {
        return body();
    } catch (const em::Error &e) {
        set_error(e.code, e.what());
    } catch (const Ort::Exception &e) {
        set_error(EM_ERR_RUN, std::string("onnxruntime: ") + e.what());
    } catch (const std::bad_alloc &) {
        set_error(EM_ERR_INTERNAL, "out of memory");
    } catch (const std::exception &e) {
        set_error(EM_ERR_INTERNAL, e.what());
    } catch (...) {
        set_error(EM_ERR_INTERNAL, "unknown error");
    }
    return failed;
}

// Runs `body` (which returns EM_OK); on failure the error's code.
template <typename F> int status(F &&body) noexcept {
    const int failed = guard<int>(-1, body);
    return failed == -1 ? last_code : failed;
}

void need(const void *handle, const char *what) {
    if (!handle) em::fail(EM_ERR_ARGUMENT, std::string(what) + " is NULL");
}
}  // namespace

struct em_engine {
    std::unique_ptr<em::Engine> engine;
};

struct em_sampler {
    double temperature;
    int top_k;
    double top_p;
    std::mt19937_64 rng;
};

extern "C" {

const char *em_last_error(void) { return last_error.c_str(); }
int em_last_error_code(void) { return last_code; }

em_engine_options em_engine_default_options(void) {
    em_engine_options options;
    options.threads = 0;
    options.backend = nullptr;
    options.target = nullptr;
    options.chunk_size = 0;
    options.check_files = 1;
    options.engines = nullptr;
    options.plugins = nullptr;
    return options;
}

em_engine *em_engine_load_ex(const char *dir, const em_engine_options *options) {
    return guard<em_engine *>(nullptr, [&] {
        need(dir, "the export directory");
        const em_engine_options chosen = options ? *options : em_engine_default_options();
        if (chosen.threads < 0) em::fail(EM_ERR_ARGUMENT, "threads must be >= 0 (0: onnxruntime's choice)");
        if (chosen.chunk_size < 0) em::fail(EM_ERR_ARGUMENT, "chunk_size must be >= 0 (0: 128)");
        auto handle = std::make_unique<em_engine>();
        handle->engine = std::make_unique<em::Engine>(dir, chosen);
        return handle.release();
    });
}

em_engine *em_engine_load(const char *dir, int threads) {
    em_engine_options options = em_engine_default_options();
    options.threads = threads;
    return em_engine_load_ex(dir, &options);
}

void em_engine_free(em_engine *engine) { delete engine; }

int64_t em_engine_vocab_size(const em_engine *engine) {
    return guard<int64_t>(-1, [&] {
        need(engine, "engine");
        return engine->engine->vocab;
    });
}

const char *em_engine_arch(const em_engine *engine) {
    return guard<const char *>(nullptr, [&] {
        need(engine, "engine");
        return engine->engine->arch.c_str();
    });
}

int64_t em_engine_state_bytes(const em_engine *engine, int64_t position) {
    return guard<int64_t>(-1, [&] {
        need(engine, "engine");
        if (position < 0) em::fail(EM_ERR_ARGUMENT, "position must be >= 0");
        return engine->engine->state_bytes(position);
    });
}

em_stream *em_stream_new(em_engine *engine) {
    return guard<em_stream *>(nullptr, [&] {
        need(engine, "engine");
        return engine->engine->new_stream(nullptr);
    });
}

em_stream *em_stream_fork(const em_stream *stream) {
    return guard<em_stream *>(nullptr, [&] {
        need(stream, "stream");
        std::lock_guard<std::mutex> lock(stream->mutex);
        const em::Snapshot snap = stream->engine->snapshot(stream);
        return stream->engine->new_stream(&snap);
    });
}

void em_stream_free(em_stream *stream) {
    if (!stream) return;
    guard<int>(0, [&] {
        stream->engine->detach(stream);
        return 0;
    });
    delete stream;
}

int em_stream_reset(em_stream *stream) {
    return status([&] {
        need(stream, "stream");
        std::lock_guard<std::mutex> lock(stream->mutex);
        stream->engine->detach(stream);
        stream->engine->assign(stream, stream->engine->fresh());
        return int(EM_OK);
    });
}

int em_stream_prefill(em_stream *stream, const int64_t *tokens, size_t n, float *last_logits) {
    return status([&] {
        need(stream, "stream");
        if (n > 0) need(tokens, "tokens");
        std::lock_guard<std::mutex> lock(stream->mutex);
        stream->engine->prefill_tokens(stream, tokens, n);
        if (last_logits) std::memcpy(last_logits, stream->next.data(), stream->next.size() * sizeof(float));
        return int(EM_OK);
    });
}

int em_stream_step(em_stream *stream, int64_t token, float *logits) {
    return status([&] {
        need(stream, "stream");
        std::lock_guard<std::mutex> lock(stream->mutex);
        stream->engine->step_one(stream, token);
        if (logits) std::memcpy(logits, stream->next.data(), stream->next.size() * sizeof(float));
        return int(EM_OK);
    });
}

int em_step_batch(em_stream *const *streams, const int64_t *tokens, size_t n, float *logits) {
    return status([&] {
        if (n == 0) em::fail(EM_ERR_BATCH, "em_step_batch needs at least one stream");
        need(streams, "streams");
        need(tokens, "tokens");
        need(streams[0], "stream 0");
        streams[0]->engine->step_batch(streams, tokens, n, logits);
        return int(EM_OK);
    });
}

int em_stream_logits(const em_stream *stream, float *logits) {
    return status([&] {
        need(stream, "stream");
        need(logits, "logits");
        std::lock_guard<std::mutex> lock(stream->mutex);
        const em::Snapshot snap = stream->engine->snapshot(stream);
        if (!snap.has_logits) em::fail(EM_ERR_NO_LOGITS, "the stream is fresh: it has no next-token logits until it consumes a token");
        std::memcpy(logits, snap.logits.data(), snap.logits.size() * sizeof(float));
        return int(EM_OK);
    });
}

int64_t em_stream_vocab_size(const em_stream *stream) {
    return guard<int64_t>(-1, [&] {
        need(stream, "stream");
        return stream->engine->vocab;
    });
}

int64_t em_stream_position(const em_stream *stream) {
    return guard<int64_t>(-1, [&] {
        need(stream, "stream");
        std::lock_guard<std::mutex> lock(stream->mutex);
        return stream->position;
    });
}

int64_t em_stream_state_bytes(const em_stream *stream) {
    return guard<int64_t>(-1, [&] {
        need(stream, "stream");
        std::lock_guard<std::mutex> lock(stream->mutex);
        const em::Engine &engine = *stream->engine;
        int64_t bytes = engine.fixed_bytes;
        for (size_t g = 0; g < engine.growing.size(); ++g)
            bytes += int64_t(stream->caches[g].GetTensorTypeAndShapeInfo().GetElementCount() * engine.specs[engine.growing[g]].dtype->size);
        return bytes;
    });
}

int em_stream_save(const em_stream *stream, const char *path) {
    return status([&] {
        need(stream, "stream");
        need(path, "path");
        std::vector<uint8_t> bytes;
        {
            std::lock_guard<std::mutex> lock(stream->mutex);
            bytes = stream->engine->encode(stream->engine->snapshot(stream));
        }
        em::write_atomic(path, bytes);
        return int(EM_OK);
    });
}

em_stream *em_stream_load(em_engine *engine, const char *path) {
    return guard<em_stream *>(nullptr, [&] {
        need(engine, "engine");
        need(path, "path");
        const auto bytes = em::read_file(path, EM_ERR_STATE_FILE, "state file");
        const em::Snapshot snap = engine->engine->decode(bytes, path);
        return engine->engine->new_stream(&snap);
    });
}

em_sampler *em_sampler_new(float temperature, int top_k, float top_p, uint64_t seed) {
    return guard<em_sampler *>(nullptr, [&] {
        if (!(temperature >= 0) || !std::isfinite(temperature))
            em::fail(EM_ERR_ARGUMENT, "temperature must be a finite number >= 0 (0 is greedy); got " + std::to_string(temperature));
        if (top_k < 0) em::fail(EM_ERR_ARGUMENT, "top_k must be >= 1, or 0 for off; got " + std::to_string(top_k));
        if (!(top_p > 0 && top_p <= 1)) em::fail(EM_ERR_ARGUMENT, "top_p must be in (0, 1]; got " + std::to_string(top_p));
        return new em_sampler{temperature, top_k, top_p, std::mt19937_64(seed)};
    });
}

void em_sampler_free(em_sampler *sampler) { delete sampler; }

int64_t em_sampler_sample(em_sampler *sampler, const float *logits, int64_t n) {
    return guard<int64_t>(-1, [&]() -> int64_t {
        need(sampler, "sampler");
        need(logits, "logits");
        if (n < 1) em::fail(EM_ERR_ARGUMENT, "n must be >= 1");
        const size_t size = size_t(n);
        if (sampler->temperature == 0) return int64_t(std::max_element(logits, logits + size) - logits);  // the first maximum
        std::vector<double> x(logits, logits + size);
        for (double &v : x) v /= sampler->temperature;
        if (sampler->top_k > 0 && size_t(sampler->top_k) < size) {
            std::vector<double> sorted(x);
            std::nth_element(sorted.begin(), sorted.begin() + (sampler->top_k - 1), sorted.end(), std::greater<double>());
            const double kth = sorted[size_t(sampler->top_k - 1)];
            for (double &v : x)
                if (v < kth) v = -INFINITY;
        }
        const double top = *std::max_element(x.begin(), x.end());
        std::vector<double> p(size);
        for (size_t i = 0; i < size; ++i) p[i] = std::exp(x[i] - top);
        if (sampler->top_p < 1) {  // the smallest set of the most likely tokens reaching top_p
            const double total = std::accumulate(p.begin(), p.end(), 0.0);
            std::vector<size_t> order(size);
            std::iota(order.begin(), order.end(), 0);
            std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return p[a] > p[b]; });
            double before = 0;
            for (size_t i : order) {
                const double mass = p[i] / total;
                if (before >= sampler->top_p) p[i] = 0;
                before += mass;
            }
        }
        std::discrete_distribution<size_t> pick(p.begin(), p.end());
        return int64_t(pick(sampler->rng));
    });
}

}  // extern "C"
