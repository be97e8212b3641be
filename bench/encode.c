/*
 * encode.c - the cost of a prediction's JSON answer on the worker thread:
 * md_answer_encode of 64 rows x 10 logits (FashionMNIST's labels, top 1 and
 * top 3, as POST /models/NAME/predict answers them), and md_float_format
 * alone, in microseconds a value on one core. Issue 14's target: <= 1 us a
 * value. Prints one JSON line per case.
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../handlers/answer.h"
#include "../predictor/predictor.h"

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* logits like a trained classifier's: full float32 precision, -15..15 */
static void fill(float *x, size_t n)
{
    uint64_t s = 0x9E3779B97F4A7C15ull;
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        x[i] = (float)((double)(s >> 11) / 9007199254740992.0 * 30.0 - 15.0);
    }
}

int main(void)
{
    enum { ROWS = 64, CLASSES = 10, N = ROWS * CLASSES };
    static float out[N];
    fill(out, N);
    json_t *labels = json_pack("[ssssssssss]", "T-shirt/top", "Trouser", "Pullover", "Dress",
                               "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot");
    int64_t shape[2] = {ROWS, CLASSES};
    const struct { const char *name; int top_k; md_answer_kind kind; } cases[] = {
        {"predict 64x10, labels, top 1", 0, MD_ANSWER_PREDICT},
        {"predict 64x10, labels, top_k=3", 3, MD_ANSWER_PREDICT},
        {"v2 64x10 JSON", 0, MD_ANSWER_V2},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        md_answer_opts o = {.kind = cases[c].kind, .model = "fashion", .version = 3,
                            .labels = labels, .top_k = cases[c].top_k,
                            .classes = {.kind = MD_CLASSES_ARGMAX, .width = CLASSES,
                                        .classes = CLASSES, .logits = 1}};
        size_t len = 0, jl;
        int iters = 0;
        double t0 = now(), t;
        do {
            for (int i = 0; i < 50; i++, iters++) {
                char *b = md_answer_encode(&o, out, shape, 2, &len, &jl);
                if (!b)
                    return 1;
                free(b);
            }
            t = now() - t0;
        } while (t < 1.0);
        printf("{\"case\": \"%s\", \"bytes\": %zu, \"us_per_answer\": %.1f, "
               "\"us_per_value\": %.3f}\n",
               cases[c].name, len, t / iters * 1e6, t / iters * 1e6 / N);
    }
    char buf[32];
    long iters = 0;
    double t0 = now(), t;
    size_t sink = 0;
    do {
        for (int i = 0; i < N; i++, iters++)
            sink += (size_t)md_float_format(out[i], buf, sizeof buf);
        t = now() - t0;
    } while (t < 1.0);
    printf("{\"case\": \"md_float_format\", \"us_per_value\": %.3f, \"sink\": %zu}\n",
           t / (double)iters * 1e6, sink % 7);
    json_decref(labels);
    return 0;
}
