/* Load an edgemem export, prefill a prompt of token ids, generate, save the stream, resume it from the file
 * and generate more: the C API end to end.
 *
 *   generate EXPORT_DIR STATE_FILE [--tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S] ID...
 */
#include <edgemem/edgemem.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int generate(em_stream *stream, em_sampler *sampler, float *logits, int64_t vocab, int n) {
    for (int i = 0; i < n; ++i) {
        const int64_t token = em_sampler_sample(sampler, logits, vocab);
        if (token < 0 || em_stream_step(stream, token, logits) != EM_OK) return -1;
        printf(" %lld", (long long)token);
    }
    printf("\n");
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s EXPORT_DIR STATE_FILE [--tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S] ID...\n",
                argv[0]);
        return 2;
    }
    int n = 16, top_k = 0;
    float temperature = 0.0f, top_p = 1.0f;
    unsigned long long seed = 0;
    int64_t *prompt = calloc((size_t)argc, sizeof(int64_t));
    size_t length = 0;
    for (int i = 3; i < argc; ++i) {
        if (!strcmp(argv[i], "--tokens") && i + 1 < argc) n = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--temperature") && i + 1 < argc) temperature = strtof(argv[++i], NULL);
        else if (!strcmp(argv[i], "--top-k") && i + 1 < argc) top_k = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--top-p") && i + 1 < argc) top_p = strtof(argv[++i], NULL);
        else if (!strcmp(argv[i], "--seed") && i + 1 < argc) seed = strtoull(argv[++i], NULL, 10);
        else prompt[length++] = strtoll(argv[i], NULL, 10);
    }
    em_engine *engine = em_engine_load(argv[1], 0);
    em_sampler *sampler = em_sampler_new(temperature, top_k, top_p, seed);
    if (!engine || !sampler) {
        fprintf(stderr, "error: %s\n", em_last_error());
        return 1;
    }
    const int64_t vocab = em_engine_vocab_size(engine);
    float *logits = malloc((size_t)vocab * sizeof(float));
    em_stream *stream = em_stream_new(engine);
    int status = 1;
    if (stream && em_stream_prefill(stream, prompt, length, logits) == EM_OK) {
        printf("%s, vocabulary %lld, state %lld bytes\ngenerated:", em_engine_arch(engine), (long long)vocab,
               (long long)em_stream_state_bytes(stream));
        if (generate(stream, sampler, logits, vocab, n) == 0 && em_stream_save(stream, argv[2]) == EM_OK) {
            em_stream_free(stream);
            stream = em_stream_load(engine, argv[2]); /* resume from the checkpoint */
            if (stream && em_stream_logits(stream, logits) == EM_OK) {
                printf("saved %s at position %lld; resumed:", argv[2], (long long)em_stream_position(stream));
                status = generate(stream, sampler, logits, vocab, n) == 0 ? 0 : 1;
            }
        }
    }
    if (status) fprintf(stderr, "error: %s\n", em_last_error());
    em_stream_free(stream);
    em_sampler_free(sampler);
    em_engine_free(engine);
    free(logits);
    free(prompt);
    return status;
}
