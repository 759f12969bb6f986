/* Time libedgemem's step on one export and sample the process's resident memory along a long stream.
 *
 *   em_bench DIR STEPS [EVERY]
 *
 * Prints JSON: the resident set size before and after loading, the median and mean microseconds of a batch-1 step over STEPS steps after a
 * 40-token prefill, and the resident set size (bytes, /proc/self/statm) every EVERY steps.
 */
#include <edgemem/edgemem.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static long long rss_bytes(void) {
    long pages = 0, resident = 0;
    FILE *f = fopen("/proc/self/statm", "r");
    if (!f) return -1;
    if (fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = -1;
    fclose(f);
    return (long long)resident * sysconf(_SC_PAGESIZE);
}

static int by_value(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s DIR STEPS [EVERY]\n", argv[0]);
        return 2;
    }
    const long steps = atol(argv[2]), every = argc > 3 ? atol(argv[3]) : 0;
    const long long start = rss_bytes();
    em_engine *engine = em_engine_load(argv[1], 1);
    if (!engine) {
        fprintf(stderr, "error: %s\n", em_last_error());
        return 1;
    }
    const long long loaded = rss_bytes();
    const int64_t vocab = em_engine_vocab_size(engine);
    float *logits = malloc((size_t)vocab * sizeof(float));
    double *times = malloc((size_t)steps * sizeof(double) + 1);
    memset(times, 0, (size_t)steps * sizeof(double)); /* resident before the stream starts: not counted as its growth */
    int64_t prompt[40];
    for (int i = 0; i < 40; ++i) prompt[i] = (i * 7 + 3) % vocab;
    em_stream *stream = em_stream_new(engine);
    if (em_stream_prefill(stream, prompt, 40, logits) != EM_OK) {
        fprintf(stderr, "error: %s\n", em_last_error());
        return 1;
    }
    printf("{\"arch\": \"%s\", \"rss_start\": %lld, \"rss_loaded\": %lld, \"rss\": [", em_engine_arch(engine), start, loaded);
    int64_t token = 1;
    double total = 0;
    for (long i = 0; i < steps; ++i) {
        const double start = now_us();
        if (em_stream_step(stream, token, logits) != EM_OK) {
            fprintf(stderr, "error at step %ld: %s\n", i, em_last_error());
            return 1;
        }
        times[i] = now_us() - start;
        total += times[i];
        token = (token * 31 + 7) % vocab;
        if (every && (i + 1) % every == 0)
            printf("%s[%lld, %lld]", (i + 1) / every > 1 ? ", " : "", (long long)em_stream_position(stream), rss_bytes());
    }
    qsort(times, (size_t)steps, sizeof(double), by_value);
    printf("], \"steps\": %ld, \"median_us\": %.3f, \"mean_us\": %.3f, \"state_bytes\": %lld}\n", steps, steps ? times[steps / 2] : 0.0,
           steps ? total / steps : 0.0, (long long)em_stream_state_bytes(stream));
    em_stream_free(stream);
    em_engine_free(engine);
    free(times);
    free(logits);
    return 0;
}
