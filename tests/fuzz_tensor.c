/*
 * fuzz_tensor.c - libFuzzer harness for the hand-written request decoders
 * (md_tensor_decode: JSON rows / instances / array+shape; md_npy_decode).
 * `make fuzz` builds it with clang's -fsanitize=fuzzer,address,undefined and
 * runs it for FUZZ_SECONDS over the corpus in tests/fuzz_corpus/.
 * Checks beyond "no crash": a decoded tensor's count equals the product of
 * its shape, and every value is finite; a body of bare JSON rows that jansson
 * reads too gives the same numbers in the same order, each (float) of
 * jansson's double (the scanner's fast path for inner rows, leaf(), against
 * a parser that shares none of its code).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "../predictor/predictor.h"

/* The numbers of nested arrays, depth first, into out (at most max); -1 if
 * anything but arrays and numbers is there. */
static long flatten(json_t *j, float *out, size_t max, size_t *n)
{
    if (json_is_number(j)) {
        if (*n >= max)
            return -1;
        out[(*n)++] = (float)json_number_value(j);
        return 0;
    }
    if (!json_is_array(j))
        return -1;
    size_t i;
    json_t *v;
    json_array_foreach(j, i, v)
    {
        if (flatten(v, out, max, n) != 0)
            return -1;
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    md_err err;
    md_tensor t;
    /* the first byte picks the content type, the rest is the body */
    const char *ct = size && (data[0] & 1) ? "application/x-npy" : "application/json";
    const char *body = size ? (const char *)data + 1 : (const char *)data;
    size_t len = size ? size - 1 : 0;
    if (md_tensor_decode(body, len, ct, 1 << 20, &t, &err) == MD_OK) {
        size_t count = 1;
        for (int d = 0; d < t.ndim; d++)
            count *= (size_t)t.shape[d];
        if (count != t.count || t.ndim < 1 || t.ndim > MD_MAX_DIMS)
            abort();
        for (size_t i = 0; i < t.count; i++)
            if (!isfinite(t.data[i]))
                abort();
        size_t at = 0;
        while (at < len && (body[at] == ' ' || body[at] == '\n' || body[at] == '\r' ||
                            body[at] == '\t'))
            at++;
        json_t *j = at < len && body[at] == '[' && ct[12] == 'j'
                        ? json_loadb(body, len, JSON_DECODE_ANY, NULL)
                        : NULL;
        if (j) {
            float *ref = malloc(t.count * sizeof(float) + 1);
            size_t n = 0;
            if (!ref)
                abort();
            if (flatten(j, ref, t.count, &n) == 0) {
                if (n != t.count)
                    abort();
                for (size_t i = 0; i < n; i++)
                    if (ref[i] != t.data[i])
                        abort(); /* (jansson reads "-0" as the integer 0: no sign compare) */
            }
            free(ref);
            json_decref(j);
        }
        md_tensor_free(&t);
    } else if (err.msg[0] == '\0') {
        abort(); /* every failure explains itself */
    }
    return 0;
}
