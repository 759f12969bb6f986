// The native runtime's checks on one export, driven by tests/test_native_runtime.py.
//
//   em_check DIR WORK [BACKEND]      (BACKEND: ort, the default, or trt)
//
// WORK/prompt.i64 holds 40 token ids; WORK/py.state, if present, a checkpoint written by the Python
// runtime. Writes, for the Python side to compare (float32 / int64, little-endian):
//   greedy.f32   the logits after prefilling the prompt, then after each of 24 greedy steps [25, V]
//   greedy.i64   those 24 tokens; c.state: the stream's checkpoint after them
//   c_cont.f32   8 more steps of that stream (tokens prompt[0:8]) [8, V]
//   batch.f32    3 batched steps of two streams at positions 5 and 11 (prompt[:5], prompt[:11]; with a
//                growing KV cache, which batches equal lengths only: prompt[:5], prompt[6:11]) [3, 2, V]
//   alone.f32    the same steps of each stream alone [3, 2, V]
//   from_py.f32  the logits stored in py.state, then 8 steps (prompt[0:8]) [9, V]
// and checks on its own that a fork steps like its parent and that misuse is refused with a message and
// leaves the stream as it was. Exit status 0 when every check passed.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "edgemem/edgemem.hpp"

namespace {
int failures = 0;

void expect(bool ok, const std::string &what) {
    std::cout << (ok ? "ok   " : "FAIL ") << what << "\n";
    if (!ok) ++failures;
}

template <typename T> std::vector<T> read(const std::string &path) {
    std::ifstream in(path, std::ios::binary | std::ios::ate);
    std::vector<T> out(size_t(in.tellg()) / sizeof(T));
    in.seekg(0);
    in.read(reinterpret_cast<char *>(out.data()), std::streamsize(out.size() * sizeof(T)));
    return out;
}

template <typename T> void write(const std::string &path, const std::vector<T> &data) {
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char *>(data.data()), std::streamsize(data.size() * sizeof(T)));
}

void append(std::vector<float> &to, const std::vector<float> &rows) { to.insert(to.end(), rows.begin(), rows.end()); }

int64_t argmax(const std::vector<float> &x) {
    size_t best = 0;
    for (size_t i = 1; i < x.size(); ++i)
        if (x[i] > x[best]) best = i;
    return int64_t(best);
}

// max |a - b| / max |b|
double rel(const std::vector<float> &a, const std::vector<float> &b) {
    double diff = 0, scale = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        diff = std::max(diff, std::fabs(double(a[i]) - double(b[i])));
        scale = std::max(scale, std::fabs(double(b[i])));
    }
    return diff / scale;
}

bool file_exists(const std::string &path) { return std::ifstream(path).good(); }

// A C call that returned a NULL handle: refused with `code` and a message.
void refused_handle(const void *handle, int code, const std::string &what) {
    const std::string message = em_last_error();
    expect(handle == nullptr && em_last_error_code() == code && !message.empty(),
           what + " -> code " + std::to_string(em_last_error_code()) + ": " + message);
}

// A C call that must fail with `code` and a message.
void refused(int status, int code, const std::string &what) {
    const std::string message = em_last_error();
    expect(status == code && !message.empty(), what + " -> code " + std::to_string(status) + ": " + message);
}
}  // namespace

// em_check --load EXPORT_DIR BACKEND [PLUGINS]: load through em_engine_load_ex and print "loaded", or the
// error code and message of the refusal (one line each).
int load(int argc, char **argv) {
    em_engine_options options = em_engine_default_options();
    options.backend = argv[3];
    options.plugins = argc > 4 ? argv[4] : nullptr;
    em_engine *engine = em_engine_load_ex(argv[2], &options);
    if (engine) std::cout << "loaded\n";
    else std::cout << "code " << em_last_error_code() << "\n" << em_last_error() << "\n";
    em_engine_free(engine);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 4 && argc <= 5 && std::string(argv[1]) == "--load") return load(argc, argv);
    if (argc != 3 && argc != 4) {
        std::cerr << "usage: em_check EXPORT_DIR WORK_DIR [BACKEND] | em_check --load EXPORT_DIR BACKEND [PLUGINS]\n";
        return 2;
    }
    const std::string dir = argv[1], work = argv[2];
    try {
        em_engine_options options = em_engine_default_options();
        options.backend = argc == 4 ? argv[3] : "ort";
        options.threads = std::string(options.backend) == "trt" ? 0 : 1;
        edgemem::Engine engine(dir, options);
        const int64_t vocab = engine.vocab_size();
        const auto prompt = read<int64_t>(work + "/prompt.i64");

        // prefill + 24 greedy steps, checkpoint, continuation
        edgemem::Stream stream = engine.new_stream();
        std::vector<float> greedy = stream.prefill(prompt), logits = greedy;
        std::vector<int64_t> tokens;
        for (int i = 0; i < 24; ++i) {
            tokens.push_back(argmax(logits));
            logits = stream.step(tokens.back());
            append(greedy, logits);
        }
        write(work + "/greedy.f32", greedy);
        write(work + "/greedy.i64", tokens);
        expect(stream.position() == 64, "position after 40 + 24 tokens is 64");
        stream.save(work + "/c.state");

        // a fork steps like its parent
        edgemem::Stream fork = stream.fork();
        std::vector<float> cont, forked;
        for (int i = 0; i < 8; ++i) {
            append(cont, stream.step(prompt[size_t(i)]));
            append(forked, fork.step(prompt[size_t(i)]));
        }
        write(work + "/c_cont.f32", cont);
        expect(cont == forked, "a fork steps like its parent (8 steps, bit-equal)");

        // a batch of two streams at positions 5 and 11, and each alone
        // (a growing KV cache batches streams of equal length only: then b is prompt[6:11], at position 5)
        const bool grows = engine.state_bytes(1) > engine.state_bytes(0);
        edgemem::Stream a = engine.new_stream(), b = engine.new_stream();
        a.prefill(std::vector<int64_t>(prompt.begin(), prompt.begin() + 5));
        b.prefill(std::vector<int64_t>(prompt.begin(), prompt.begin() + 11));
        if (grows) {
            em_stream *pair[2] = {a.get(), b.get()};
            const int64_t two[2] = {1, 2};
            refused(em_step_batch(pair, two, 2, nullptr), EM_ERR_BATCH, "a growing cache: a batch at positions 5 and 11");
            b = engine.new_stream();
            b.prefill(std::vector<int64_t>(prompt.begin() + 6, prompt.begin() + 11));
        }
        edgemem::Stream a1 = a.fork(), b1 = b.fork();
        std::vector<float> batch, alone;
        for (int k = 0; k < 3; ++k) {
            const std::vector<int64_t> step{prompt[size_t(20 + k)], prompt[size_t(30 + k)]};
            append(batch, engine.step_batch({&a, &b}, step));
            append(alone, a1.step(step[0]));
            append(alone, b1.step(step[1]));
        }
        write(work + "/batch.f32", batch);
        write(work + "/alone.f32", alone);
        expect(a.position() == 8 && b.position() == (grows ? 8 : 14), "batched streams advance one position per step");
        // a batch member used alone again continues from its row
        // (batched kernels round differently from batch-1 ones: equal to a tolerance)
        expect(rel(a.step(prompt[0]), a1.step(prompt[0])) <= 1e-5, "a batch member stepped alone continues where the batch left it");

        // a checkpoint written by the Python runtime
        if (file_exists(work + "/py.state")) {
            edgemem::Stream restored = engine.load_stream(work + "/py.state");
            std::vector<float> from_py = restored.logits();
            for (int i = 0; i < 8; ++i) append(from_py, restored.step(prompt[size_t(i)]));
            write(work + "/from_py.f32", from_py);
        }

        // misuse: an error code and a message, and the stream as it was
        em_stream *s = em_stream_new(engine.get());
        em_stream_prefill(s, prompt.data(), 7, nullptr);
        em_stream *twin = em_stream_fork(s);
        std::vector<float> before(static_cast<size_t>(vocab)), after(static_cast<size_t>(vocab));
        em_stream_logits(s, before.data());
        refused_handle(em_engine_load("/nonexistent/export", 1), EM_ERR_MANIFEST, "a missing export directory");
        refused(em_stream_step(s, -1, after.data()), EM_ERR_TOKEN, "token -1");
        refused(em_stream_step(s, vocab, after.data()), EM_ERR_TOKEN, "token = vocab");
        refused(em_stream_prefill(s, prompt.data(), 0, after.data()), EM_ERR_TOKEN, "an empty prefill");
        std::vector<int64_t> bad(prompt.begin(), prompt.begin() + 6);
        bad[4] = vocab + 3;
        refused(em_stream_prefill(s, bad.data(), bad.size(), after.data()), EM_ERR_TOKEN, "a prefill with a token >= vocab");
        em_stream *batch_streams[2] = {s, s};
        int64_t batch_tokens[2] = {1, 2};
        refused(em_step_batch(batch_streams, batch_tokens, 2, nullptr), EM_ERR_BATCH, "a stream twice in one batch");
        batch_streams[1] = twin;
        batch_tokens[1] = -5;
        refused(em_step_batch(batch_streams, batch_tokens, 2, nullptr), EM_ERR_TOKEN, "a batch with token -5");
        refused_handle(em_stream_load(engine.get(), (work + "/missing.state").c_str()), EM_ERR_STATE_FILE, "a missing state file");
        write<char>(work + "/garbage.state", std::vector<char>(100, 'x'));
        refused_handle(em_stream_load(engine.get(), (work + "/garbage.state").c_str()), EM_ERR_STATE_FILE, "a garbage state file");
        auto saved = read<char>(work + "/c.state");
        write<char>(work + "/half.state", std::vector<char>(saved.begin(), saved.begin() + long(saved.size() / 2)));
        refused_handle(em_stream_load(engine.get(), (work + "/half.state").c_str()), EM_ERR_STATE_FILE, "a truncated state file");
        saved[saved.size() - 3] ^= 0x10;
        write<char>(work + "/flipped.state", saved);
        refused_handle(em_stream_load(engine.get(), (work + "/flipped.state").c_str()), EM_ERR_STATE_FILE,
                       "a state file with a flipped byte");
        refused(em_stream_save(s, work.c_str()), EM_ERR_IO, "saving onto a directory");
        expect(em_stream_position(s) == 7, "the refused calls left the position at 7");
        em_stream_logits(s, after.data());
        expect(before == after, "the refused calls left the logits as they were");
        std::vector<float> x(static_cast<size_t>(vocab)), y(static_cast<size_t>(vocab));
        expect(em_stream_step(s, prompt[9], x.data()) == EM_OK && em_stream_step(twin, prompt[9], y.data()) == EM_OK && x == y,
               "the refused calls left the state as it was (next step equals its twin's)");
        em_stream_free(twin);
        em_stream_free(s);
    } catch (const edgemem::Error &e) {
        std::cout << "FAIL unexpected error " << e.code() << ": " << e.what() << "\n";
        return 1;
    }
    std::cout << (failures ? "FAILED " + std::to_string(failures) + " checks" : std::string("all checks passed")) << "\n";
    return failures ? 1 : 0;
}
