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

#include "../predictor/numparse.h"
#include "../predictor/predictor.h"

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* How the values of a body are written: what clients send varies. */
enum style { INTS, DEC4, FULL };
static const char *const style_name[] = {"int 0..255", "4 decimals", "full precision"};

/* The shortest text that reads back as `d`, as Python's repr (and so
 * json.dumps(x.tolist()) of a float32 tensor) writes it. */
static int shortest(char *out, size_t size, double d)
{
    for (int prec = 1; prec <= 17; prec++) {
        int n = snprintf(out, size, "%.*g", prec, d);
        if (strtod(out, NULL) == d)
            return n;
    }
    return snprintf(out, size, "%.17g", d);
}

/* A body of `rows` rows of 784 pixel values: integers 0..255, the same
 * scaled to [0, 1] with 4 decimals, or scaled as a float32 (x / 255.0f, what
 * ToTensor() makes) and printed in full, as json.dumps(x.tolist()) does. */
static char *make_body(int rows, enum style st, size_t *len)
{
    size_t cap = (size_t)rows * 784 * 26 + 16, n = 0;
    char *b = malloc(cap);
    b[n++] = '[';
    unsigned seed = 1;
    for (int r = 0; r < rows; r++) {
        b[n++] = '[';
        for (int i = 0; i < 784; i++) {
            seed = seed * 1103515245u + 12345u;
            unsigned px = (seed >> 16) % 256;
            if (i)
                b[n++] = ',';
            if (st == INTS)
                n += (size_t)snprintf(b + n, cap - n, "%u", px);
            else if (st == DEC4)
                n += (size_t)snprintf(b + n, cap - n, "%.4f", px / 255.0);
            else
                n += (size_t)shortest(b + n, cap - n, (double)((float)px / 255.0f));
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
    printf("{\"number_parser\": \"%s\"}\n", md_numparse_backend());
    for (int st = INTS; st <= FULL; st++) {
        for (int s = 0; s < 2; s++) {
            size_t len;
            char *body = make_body(sizes[s], (enum style)st, &len);
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
            printf("{\"values\": \"%s\", \"rows\": %d, \"body_bytes\": %zu, \"jansson_us\": %.1f, "
                   "\"modeld_us\": %.1f, \"speedup\": %.1f, \"modeld_mb_per_s\": %.0f, "
                   "\"modeld_rows_per_s_per_core\": %.0f}\n",
                   style_name[st], sizes[s], len, jt * 1e6, mt * 1e6, jt / mt, len / mt / 1e6,
                   sizes[s] / mt);
            free(body);
            free(out);
        }
    }
    return 0;
}
