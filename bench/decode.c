/*
 * decode.c - why modeld decodes prediction bodies by hand: time jansson
 * (a DOM node per number, then a walk to floats) against md_tensor_decode
 * (one pass straight into a float buffer) on the same bodies, side by side.
 * Prints one JSON line per body size.
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../predictor/predictor.h"

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* A body of `rows` rows of 784 pixel values, as clients send them. */
static char *make_body(int rows, size_t *len)
{
    size_t cap = (size_t)rows * 784 * 12 + 16, n = 0;
    char *b = malloc(cap);
    b[n++] = '[';
    unsigned seed = 1;
    for (int r = 0; r < rows; r++) {
        b[n++] = '[';
        for (int i = 0; i < 784; i++) {
            seed = seed * 1103515245u + 12345u;
            n += (size_t)snprintf(b + n, cap - n, "%s%.4f", i ? "," : "", (seed >> 16) % 25600 / 100.0);
        }
        b[n++] = ']';
        if (r + 1 < rows)
            b[n++] = ',';
    }
    b[n++] = ']';
    b[n] = '\0';
    *len = n;
    return b;
}

static void jansson_decode(const char *body, size_t len, float *out)
{
    json_t *root = json_loadb(body, len, 0, NULL);
    size_t i, j, k = 0;
    json_t *row, *v;
    json_array_foreach(root, i, row)
    {
        json_array_foreach(row, j, v) out[k++] = (float)json_number_value(v);
    }
    json_decref(root);
}

int main(void)
{
    int sizes[] = {1, 64};
    for (int s = 0; s < 2; s++) {
        size_t len;
        char *body = make_body(sizes[s], &len);
        float *out = malloc(sizeof(float) * 784 * (size_t)sizes[s]);
        int iters = sizes[s] == 1 ? 20000 : 400;
        double t0 = now();
        for (int i = 0; i < iters; i++)
            jansson_decode(body, len, out);
        double jt = (now() - t0) / iters;
        md_err err;
        t0 = now();
        for (int i = 0; i < iters; i++) {
            md_tensor t;
            if (md_tensor_decode(body, len, "application/json", 1 << 24, &t, &err) != MD_OK) {
                fprintf(stderr, "decode failed: %s\n", err.msg);
                return 1;
            }
            md_tensor_free(&t);
        }
        double mt = (now() - t0) / iters;
        printf("{\"rows\": %d, \"body_bytes\": %zu, \"jansson_us\": %.1f, \"modeld_us\": %.1f, "
               "\"speedup\": %.1f, \"modeld_rows_per_s_per_core\": %.0f}\n",
               sizes[s], len, jt * 1e6, mt * 1e6, jt / mt, sizes[s] / mt);
        free(body);
        free(out);
    }
    return 0;
}
