/*
 * fuzz_v2.c - libFuzzer harness for the Open Inference Protocol V2 input
 * decoders (md_v2_decode, and md_v2_decode_binary for the binary tensor data
 * extension) behind jansson's parser, as /v2/.../infer runs them on each
 * request's first input. A NUL byte in the input splits it: the JSON header
 * before, the binary data after (as Inference-Header-Content-Length does). Checks beyond "no crash": a decoded tensor's
 * count equals its shape's product and the limit, every value is finite, and
 * every failure explains itself.
 *
 * Without binary data, also differential: md_v2_parse (a request's "data"
 * read by the row scanner, the rest by jansson) against the whole body
 * through jansson and md_v2_decode, as the server did before it. Where
 * md_v2_parse decodes, the old path must decode the same floats bit for bit
 * into the same shape (but for "-0", jansson's integer 0 and strtod's -0.0),
 * and the rest of the request must be the same JSON; the one difference
 * allowed is an integer too large for jansson (which refused the whole body)
 * that the row scanner reads as a number.
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

static void differential(const char *body, size_t len)
{
    json_error_t jerr;
    md_err err;
    md_err_clear(&err);
    md_tensor fast;
    int decoded = 0;
    json_t *root = md_v2_parse(body, len, MAX_VALUES, &fast, &decoded, &jerr);
    if (!decoded) {
        json_decref(root);
        return;
    }
    if (!root || fast.count == 0)
        abort();
    json_t *old = json_loadb(body, len, 0, &jerr);
    if (!old) {
        if (!strstr(jerr.text, "too big"))
            abort(); /* md_v2_parse read a body that is not JSON */
        json_decref(root);
        md_tensor_free(&fast);
        return;
    }
    json_t *in = json_array_get(json_object_get(old, "inputs"), 0);
    md_tensor t;
    if (json_array_size(json_object_get(old, "inputs")) != 1 ||
        md_v2_decode(in, MAX_VALUES, &t, &err) != MD_OK)
        abort();
    if (t.ndim != fast.ndim || t.count != fast.count ||
        memcmp(t.shape, fast.shape, sizeof t.shape) != 0)
        abort();
    /* equal values are the same bits, but for zero: jansson reads "-0" as
     * the integer 0, the row scanner as -0.0f, as strtod does */
    for (size_t i = 0; i < t.count; i++)
        if (!(t.data[i] == fast.data[i]))
            abort();
    json_object_set_new(in, "data", json_array());
    if (!json_equal(old, root))
        abort();
    md_tensor_free(&t);
    md_tensor_free(&fast);
    json_decref(old);
    json_decref(root);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!memchr(data, 0, size))
        differential((const char *)data, size);
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
