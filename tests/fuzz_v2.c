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
 * and what modeld reads of the rest (id, outputs[0], parameters, inputs[0]'s
 * shape, datatype, parameters) must be the same JSON (the members it ignores
 * are null in md_v2_parse's root); the one difference allowed is a number
 * out of jansson's range (which refused the whole body). And md_json_check,
 * the skipper that decides validity there, accepts exactly what jansson does.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../config/md_json.h"
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

/* md_v2_decode_array: on success the shape's product of values, the name
 * and datatype kept, integers for integer datatypes (JSON integers the same
 * as jansson's), finite floats otherwise; a failure says why. */
static void check_array(json_t *in, const void *bytes, size_t nbytes)
{
    md_array a;
    md_err err;
    md_err_clear(&err);
    md_status st = md_v2_decode_array(in, bytes, nbytes, MAX_VALUES, &a, &err);
    if (st != MD_OK) {
        if (err.msg[0] == '\0' || a.f32 || a.i64)
            abort();
        return;
    }
    size_t count = 1;
    for (int d = 0; d < a.ndim; d++)
        count *= (size_t)a.shape[d];
    if (count != a.count || a.count > MAX_VALUES || a.ndim < 1 ||
        strcmp(a.name, json_string_value(json_object_get(in, "name"))) != 0)
        abort();
    const char *dt = json_string_value(json_object_get(in, "datatype"));
    int is_int = dt && (!strncmp(dt, "INT", 3) || !strncmp(dt, "UINT", 4) || !strcmp(dt, "BOOL"));
    if (is_int != a.is_int)
        abort();
    json_t *data = json_object_get(in, "data");
    for (size_t i = 0; i < a.count; i++) {
        if (!a.is_int && !isfinite(a.f32[i]))
            abort();
        /* flat JSON integers read exactly */
        json_t *v = json_array_get(data, i);
        if (a.is_int && !bytes && json_array_size(data) == a.count && json_is_integer(v) &&
            a.i64[i] != (int64_t)json_integer_value(v))
            abort();
    }
    free(a.f32);
    free(a.i64);
}

/* md_v2_parse_spans + md_v2_text_array read each input's data where it
 * lies as md_v2_decode_array reads jansson's tree of it: the same values,
 * integers exactly, or both refuse. */
static void spans_differential(const char *body, size_t len, json_t *old)
{
    md_err err;
    md_err_clear(&err);
    size_t a[MD_MAX_IO], b[MD_MAX_IO];
    json_t *root = md_v2_parse_spans(body, len, MAX_VALUES, a, b, &err);
    if (!root)
        return; /* a limit (the other path may count differently) or not JSON */
    json_t *ri = json_object_get(root, "inputs"), *oi = json_object_get(old, "inputs");
    for (size_t k = 0; k < json_array_size(ri) && k < MD_MAX_IO; k++) {
        json_t *r = json_array_get(ri, k), *o = json_array_get(oi, k);
        if (!json_is_object(r) || !json_object_get(o, "data") || b[k] <= a[k])
            continue;
        md_array x, y;
        md_err e1, e2;
        md_err_clear(&e1);
        md_err_clear(&e2);
        md_status s1 = md_v2_text_array(r, body + a[k], b[k] - a[k], MAX_VALUES, &x, &e1);
        md_status s2 = md_v2_decode_array(o, NULL, 0, MAX_VALUES, &y, &e2);
        if (s1 == MD_OK && s2 == MD_OK) {
            if (x.count != y.count || x.is_int != y.is_int || x.ndim != y.ndim)
                abort();
            for (size_t v = 0; v < x.count; v++)
                if (x.is_int ? x.i64[v] != y.i64[v] : x.f32[v] != y.f32[v])
                    abort();
        } else if (s1 == MD_OK && y.is_int == 0 && x.is_int) {
            abort();
        }
        if (s1 != MD_OK && e1.msg[0] == '\0')
            abort();
        free(x.f32);
        free(x.i64);
        free(y.f32);
        free(y.i64);
    }
    json_decref(root);
}

static int eq(json_t *a, json_t *b) { return (!a && !b) || (a && b && json_equal(a, b)); }

#define AT(v, k) json_object_get((v), (k))

/* md_json_check accepts exactly what jansson loads, numbers out of
 * jansson's range aside (the skipper never converts one), in bodies without
 * NUL bytes (jansson takes some for the end, the skipper refuses every one) */
static void skipper_differential(const char *body, size_t len)
{
    md_json_scan sc;
    memset(&sc, 0, sizeof sc);
    json_error_t jerr;
    int ok = md_json_check(body, len, MD_JSON_MAX_DEPTH, &sc);
    json_t *j = json_loadb(body, len, 0, &jerr);
    if (j && !ok)
        abort(); /* the skipper refused JSON */
    if (!j && ok && !strstr(jerr.text, "too big") && !strstr(jerr.text, "overflow"))
        abort(); /* the skipper accepted what is not JSON */
    json_decref(j);
}

static void differential(const char *body, size_t len)
{
    json_error_t jerr;
    md_err err;
    md_err_clear(&err);
    md_tensor fast;
    int decoded = 0;
    json_t *root = md_v2_parse(body, len, MAX_VALUES, 1, &fast, &decoded, &err);
    json_t *old = json_loadb(body, len, 0, &jerr);
    if (!root) {
        /* refused: not JSON (as jansson says), or past a count limit */
        if (old && err.status != MD_ETOOBIG)
            abort();
        if (err.status != MD_EINVAL && err.status != MD_ETOOBIG)
            abort();
        json_decref(old);
        return;
    }
    if (!old) {
        if (!strstr(jerr.text, "too big") && !strstr(jerr.text, "overflow"))
            abort(); /* md_v2_parse read a body that is not JSON */
        json_decref(root);
        md_tensor_free(&fast);
        return;
    }
    /* what modeld reads is the same in both roots */
    json_t *oi = AT(old, "inputs"), *ri = AT(root, "inputs");
    json_t *o0 = json_array_get(oi, 0), *r0 = json_array_get(ri, 0);
    json_t *oo = json_array_get(AT(old, "outputs"), 0), *ro = json_array_get(AT(root, "outputs"), 0);
    if (json_is_array(oi) != json_is_array(ri) || json_array_size(oi) != json_array_size(ri) ||
        !eq(AT(old, "id"), AT(root, "id")) ||
        !eq(AT(AT(old, "parameters"), "binary_data_output"),
            AT(AT(root, "parameters"), "binary_data_output")) ||
        !eq(AT(oo, "name"), AT(ro, "name")) ||
        !eq(AT(AT(oo, "parameters"), "binary_data"), AT(AT(ro, "parameters"), "binary_data")) ||
        !eq(AT(o0, "shape"), AT(r0, "shape")) || !eq(AT(o0, "datatype"), AT(r0, "datatype")) ||
        !eq(AT(AT(o0, "parameters"), "binary_data_size"),
            AT(AT(r0, "parameters"), "binary_data_size")))
        abort();
    if (!decoded) {
        /* several inputs: every data array is [] (read with md_v2_parse_spans) */
        if (json_array_size(oi) > 1 ? json_array_size(AT(r0, "data")) != 0 &&
                                          json_is_array(AT(o0, "data"))
                                    : !eq(AT(o0, "data"), AT(r0, "data")))
            abort();
        if (json_array_size(oi) > 1)
            spans_differential(body, len, old);
        json_decref(old);
        json_decref(root);
        return;
    }
    if (fast.count == 0)
        abort();
    md_tensor t;
    if (json_array_size(oi) != 1 || md_v2_decode(o0, MAX_VALUES, &t, &err) != MD_OK)
        abort();
    if (t.ndim != fast.ndim || t.count != fast.count ||
        memcmp(t.shape, fast.shape, sizeof t.shape) != 0)
        abort();
    /* equal values are the same bits, but for zero: jansson reads "-0" as
     * the integer 0, the row scanner as -0.0f, as strtod does */
    for (size_t i = 0; i < t.count; i++)
        if (!(t.data[i] == fast.data[i]))
            abort();
    if (!json_is_array(AT(r0, "data")) || json_array_size(AT(r0, "data")) != 0)
        abort();
    md_tensor_free(&t);
    md_tensor_free(&fast);
    json_decref(old);
    json_decref(root);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!memchr(data, 0, size)) { /* jansson reads some NUL bytes as the end */
        skipper_differential((const char *)data, size);
        differential((const char *)data, size);
    }
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
    /* every input as a named array (several inputs, integers exact) */
    json_t *inputs = json_is_object(root) ? json_object_get(root, "inputs") : NULL;
    for (size_t k = 0; k < json_array_size(inputs) && k < 4; k++)
        check_array(json_array_get(inputs, k), nul ? nul + 1 : NULL,
                    nul ? size - json_len - 1 : 0);
    json_decref(root);
    return 0;
}
