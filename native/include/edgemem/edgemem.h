/* edgemem's native runtime: stream an edgemem export (its edgemem.json) token by token in fixed memory.
 *
 * Opaque handles, plain types. Every call that can fail returns an error code (0 = EM_OK), or NULL
 * (or -1 where it returns a count), and sets a thread-local message, em_last_error(), and code,
 * em_last_error_code(). A refused call leaves its stream as it was. Free every stream of an engine
 * before the engine. A stream runs one call at a time: calls on one stream from several threads wait
 * for each other; different streams of one engine may run at once.
 *
 * Semantics and file formats are those of the Python runtime (edgemem.runtime): every file of the
 * export is checked against its sha256; checkpoints (em_stream_save) are the same safetensors files as
 * Stream.save, so a stream saved by either continues on the other.
 */
#ifndef EDGEMEM_H
#define EDGEMEM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define EM_API __declspec(dllexport)
#else
#define EM_API __attribute__((visibility("default")))
#endif

#define EM_VERSION_MAJOR 0
#define EM_VERSION_MINOR 2

typedef enum em_status {
    EM_OK = 0,
    EM_ERR_ARGUMENT = 1,   /* a NULL handle, a bad option or size */
    EM_ERR_MANIFEST = 2,   /* not an export, or its files do not match edgemem.json */
    EM_ERR_BACKEND = 3,    /* the backend or target cannot run here (a library, driver or GPU missing), or it refused the graphs */
    EM_ERR_TOKEN = 4,      /* a token id outside [0, vocab), or an empty prompt */
    EM_ERR_STATE_FILE = 5, /* a checkpoint that is missing, corrupt, or of another model */
    EM_ERR_CACHE_FULL = 6, /* past the preallocated KV cache's max_length (an export without a window) */
    EM_ERR_BATCH = 7,      /* streams that cannot run in one batch */
    EM_ERR_RUN = 8,        /* onnxruntime, TensorRT or CUDA failed running a graph */
    EM_ERR_IO = 9,         /* a file that cannot be written */
    EM_ERR_NO_LOGITS = 10, /* a fresh stream has no next-token logits yet */
    EM_ERR_INTERNAL = 11   /* out of memory, or a bug */
} em_status;

typedef struct em_engine em_engine;
typedef struct em_stream em_stream;
typedef struct em_sampler em_sampler;

/* ------------------------------------------------------------------ errors */
/* The message of the last failed call on this thread ("" if none). Valid until the next failing call. */
EM_API const char *em_last_error(void);
EM_API int em_last_error_code(void);

/* ------------------------------------------------------------------ engines */
typedef struct em_engine_options {
    int threads;         /* onnxruntime intra-op threads; 0: one per core (backend "trt": must be 0) */
    const char *backend; /* "ort" (CPU), "ort-cuda" (onnxruntime's CUDA provider, state in host memory) or "trt"
                            (the TensorRT engines of `edgemem build`, state on the GPU); NULL: "ort" */
    const char *target;  /* which lowered graphs; NULL: "ort" if the export has it, else "generic", else "onnx27"
                            (backend "trt": "trt") */
    int chunk_size;      /* tokens per prefill-graph run; 0: 128 (backend "trt": at most the prefill engine's profile) */
    int check_files;     /* nonzero (the default): check every file's sha256 */
    const char *engines; /* backend "trt": the folder of engines.json; NULL: DIR/engines */
    const char *plugins; /* backend "trt": libedgemem_trt_plugins.so the engines were built with; NULL: $EDGEMEM_TRT_PLUGINS */
} em_engine_options;

EM_API em_engine_options em_engine_default_options(void);
/* Load the export in `dir`; NULL on error. `threads` as in em_engine_options. */
EM_API em_engine *em_engine_load(const char *dir, int threads);
EM_API em_engine *em_engine_load_ex(const char *dir, const em_engine_options *options);
EM_API void em_engine_free(em_engine *engine);
EM_API int64_t em_engine_vocab_size(const em_engine *engine);
EM_API const char *em_engine_arch(const em_engine *engine); /* the manifest's arch */
/* Bytes of one stream's state at `position` (constant unless the export has a growing KV cache). */
EM_API int64_t em_engine_state_bytes(const em_engine *engine, int64_t position);

/* ------------------------------------------------------------------ streams */
EM_API em_stream *em_stream_new(em_engine *engine);        /* a fresh stream at position 0; NULL on error */
EM_API em_stream *em_stream_fork(const em_stream *stream); /* an independent copy; NULL on error */
EM_API void em_stream_free(em_stream *stream);
EM_API int em_stream_reset(em_stream *stream); /* back to a fresh stream */
/* Consume `n` >= 1 tokens; the next-token logits (vocab floats) into `last_logits` unless NULL. */
EM_API int em_stream_prefill(em_stream *stream, const int64_t *tokens, size_t n, float *last_logits);
/* Consume one token; the next-token logits (vocab floats) into `logits` unless NULL. */
EM_API int em_stream_step(em_stream *stream, int64_t token, float *logits);
/* One token for each of `n` distinct streams of one engine in one run; logits n × vocab unless NULL.
 * Streams may be at different positions (where the export keeps per-row positions, e.g. a preallocated
 * KV cache; a growing KV cache batches streams of equal length only). */
EM_API int em_step_batch(em_stream *const *streams, const int64_t *tokens, size_t n, float *logits);
EM_API int em_stream_logits(const em_stream *stream, float *logits); /* EM_ERR_NO_LOGITS if fresh */
EM_API int64_t em_stream_vocab_size(const em_stream *stream);        /* its engine's; -1 on error */
EM_API int64_t em_stream_position(const em_stream *stream);          /* tokens consumed; -1 on error */
EM_API int64_t em_stream_state_bytes(const em_stream *stream);       /* -1 on error */
/* Checkpoint (atomically: a temp file beside `path`, fsync, rename). */
EM_API int em_stream_save(const em_stream *stream, const char *path);
/* A stream from a checkpoint of this export (written by either runtime); NULL on error. */
EM_API em_stream *em_stream_load(em_engine *engine, const char *path);

/* ------------------------------------------------------------------ sampling */
/* temperature 0: greedy (top_k, top_p then do nothing); top_k 0: off; top_p 1: off. NULL on bad values. */
EM_API em_sampler *em_sampler_new(float temperature, int top_k, float top_p, uint64_t seed);
EM_API void em_sampler_free(em_sampler *sampler);
/* A token id from `n` logits; -1 on error. */
EM_API int64_t em_sampler_sample(em_sampler *sampler, const float *logits, int64_t n);

#ifdef __cplusplus
}
#endif
#endif
