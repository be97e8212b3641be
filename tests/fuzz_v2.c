/*
 * fuzz_v2.c - libFuzzer harness for the Open Inference Protocol V2 input
 * decoders (md_v2_decode, and md_v2_decode_binary for the binary tensor data
 * extension) behind jansson's parser, as /v2/.../infer runs them on each
 * request's first input. A NUL byte in the input splits it: the JSON header
 * before, the binary data after (as Inference-Header-Content-Length does). Checks beyond "no crash": a decoded tensor's
 * count equals its shape's product and the limit, every value is finite, and
 * every failure explains itself.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../predictor/predictor.h"

#define MAX_VALUES (1u << 16)

static void check(md_status st, md_tensor *t, const md_err *err)
{
    if (st == MD_OK) {
        size_t count = 1;
        for (int d = 0; d < t->ndim; d++)
            count *= (size_t)t->shape[d];
        if (count != t->count || t->count > MAX_VALUES || t->ndim < 1 || t->ndim > MD_MAX_DIMS)
            abort();
        for (size_t i = 0; i < t->count; i++)
            if (!isfinite(t->data[i]))
                abort();
        md_tensor_free(t);
    } else if (err->msg[0] == '\0') {
        abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *nul = memchr(data, 0, size);
    size_t json_len = nul ? (size_t)(nul - data) : size;
    json_error_t jerr;
    json_t *root = json_loadb((const char *)data, json_len, JSON_DECODE_ANY, &jerr);
    if (!root)
        return 0;
    json_t *in = json_is_object(root) ? json_array_get(json_object_get(root, "inputs"), 0) : NULL;
    if (!in)
        in = root;
    md_err err;
    md_err_clear(&err);
    md_tensor t;
    if (nul) {
        md_status st = md_v2_decode_binary(in, nul + 1, size - json_len - 1, MAX_VALUES, &t, &err);
        check(st, &t, &err);
    } else {
        check(md_v2_decode(in, MAX_VALUES, &t, &err), &t, &err);
    }
    json_decref(root);
    return 0;
}
