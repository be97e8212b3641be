/*
 * v2.c - the Open Inference Protocol V2 (KServe v2, Triton): input tensors
 * from JSON "data" or the binary tensor data extension (md_v2_decode*), and
 * the one-pass request walker (md_v2_parse) that reads inputs[0].data with
 * the row scanner of tensor.c where it lies and leaves the rest of the
 * request, small, to jansson. Fuzzed by tests/fuzz_v2.c (differential).
 */
#include <ctype.h>
#include <errno.h>
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "../config/md_json.h"
#include "numparse.h"
#include "predictor.h"
#include "tensor_internal.h"

/* ---- the Open Inference Protocol V2 input tensor ---- */

/* The V2 datatypes modeld reads (every numeric one), their element sizes. */
static const struct {
    const char *name;
    int size;
} v2_types[] = {{"FP32", 4},  {"FP64", 8},  {"FP16", 2},  {"BF16", 2},  {"INT64", 8},
                {"INT32", 4}, {"INT16", 2}, {"INT8", 1},  {"UINT64", 8}, {"UINT32", 4},
                {"UINT16", 2}, {"UINT8", 1}, {"BOOL", 1}};

/* The element size of V2 datatype `dt`, 0 when modeld does not read it. */
static int v2_type_size(const char *dt)
{
    for (size_t i = 0; dt && i < sizeof v2_types / sizeof v2_types[0]; i++)
        if (!strcmp(dt, v2_types[i].name))
            return v2_types[i].size;
    return 0;
}

/* Datatype and shape of a V2 input into t->shape/ndim and *count, bounded
 * by `max_vals` before anything is allocated. */
static md_status v2_header(json_t *in, size_t max_vals, md_tensor *t, size_t *count, md_err *err)
{
    const char *dt = json_string_value(json_object_get(in, "datatype"));
    json_t *shape = json_object_get(in, "shape");
    memset(t, 0, sizeof *t);
    if (!v2_type_size(dt))
        return md_err_set(err, MD_EINVAL,
                          "input datatype %s is not supported; use a numeric one: FP32, FP64, "
                          "FP16, BF16, INT8..INT64, UINT8..UINT64 or BOOL",
                          dt ? dt : "(missing)");
    if (!json_is_array(shape) || json_array_size(shape) == 0 ||
        json_array_size(shape) > MD_MAX_DIMS)
        return md_err_set(err, MD_EINVAL, "input shape must be an array of 1 to 8 integers");
    int64_t values = 1;
    int overflow = 0;
    for (size_t i = 0; i < json_array_size(shape); i++) {
        json_t *d = json_array_get(shape, i);
        if (!json_is_integer(d) || json_integer_value(d) < 1)
            return md_err_set(err, MD_EINVAL, "input shape[%zu] must be a positive integer", i);
        t->shape[t->ndim++] = json_integer_value(d);
        overflow |= md_mul_i64(values, json_integer_value(d), &values);
    }
    /* the shape sizes the buffer: bound it before allocating, by the same
     * limit as every other body (the data cannot hold more values anyway) */
    if (overflow || (uint64_t)values > (uint64_t)max_vals)
        return md_err_setc(err, MD_ETOOBIG, "too_many_values",
                           "input shape holds %s%lld values, more than the limit of %zu; send "
                           "fewer rows per request",
                           overflow ? "more than " : "", overflow ? (long long)INT64_MAX
                                                                  : (long long)values,
                           max_vals);
    *count = (size_t)values;
    return MD_OK;
}

/* IEEE half-precision bits to float (tensor_internal.h). */
float md_half_to_float(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        float f = (float)man * (1.0f / 16777216.0f); /* man * 2^-24: exact */
        return sign ? -f : f;
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* bfloat16 bits to float: the upper half of a float32. */
static float bf16_to_float(uint16_t h)
{
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

md_status md_v2_decode_binary(json_t *in, const void *bytes, size_t nbytes, size_t max_vals,
                              md_tensor *t, md_err *err)
{
    size_t count;
    md_status st = v2_header(in, max_vals, t, &count, err);
    if (st != MD_OK)
        return st;
    const char *dt = json_string_value(json_object_get(in, "datatype"));
    size_t esize = (size_t)v2_type_size(dt);
    if (nbytes / esize != count || nbytes % esize) {
        memset(t, 0, sizeof *t);
        return md_err_set(err, MD_EINVAL,
                          "input binary_data_size is %zu bytes, but %zu values of %s take %zu; "
                          "send shape and data that agree",
                          nbytes, count, dt, count * esize);
    }
    float *buf = md_mallocarray_checked(count, sizeof(float), "the input", err);
    if (!buf) {
        memset(t, 0, sizeof *t);
        return MD_ENOMEM;
    }
    /* one tight loop per datatype (no per-value test of the type: it cost
     * the binary path a third of its decode), then one pass for NaN,
     * infinities and values past float32's range (made infinite here) */
    const unsigned char *src = bytes;
#define V2_CONVERT(ctype, expr)                                                                    \
    for (size_t i = 0; i < count; i++) {                                                       \
        ctype v;                                                                               \
        memcpy(&v, src + i * sizeof v, sizeof v);                                              \
        buf[i] = (expr);                                                                       \
    }
    if (!strcmp(dt, "FP32")) {
        memcpy(buf, src, count * sizeof(float));
    } else if (!strcmp(dt, "FP64")) {
        /* past float32's range the cast is undefined */
        V2_CONVERT(double, fabs(v) <= (double)FLT_MAX ? (float)v : INFINITY)
    } else if (!strcmp(dt, "FP16")) {
        V2_CONVERT(uint16_t, md_half_to_float(v))
    } else if (!strcmp(dt, "BF16")) {
        V2_CONVERT(uint16_t, bf16_to_float(v))
    } else if (!strcmp(dt, "INT64")) {
        V2_CONVERT(int64_t, (float)v)
    } else if (!strcmp(dt, "INT32")) {
        V2_CONVERT(int32_t, (float)v)
    } else if (!strcmp(dt, "INT16")) {
        V2_CONVERT(int16_t, (float)v)
    } else if (!strcmp(dt, "INT8")) {
        V2_CONVERT(int8_t, (float)v)
    } else if (!strcmp(dt, "UINT64")) {
        V2_CONVERT(uint64_t, (float)v)
    } else if (!strcmp(dt, "UINT32")) {
        V2_CONVERT(uint32_t, (float)v)
    } else if (!strcmp(dt, "UINT16")) {
        V2_CONVERT(uint16_t, (float)v)
    } else if (!strcmp(dt, "BOOL")) {
        V2_CONVERT(uint8_t, v ? 1.0f : 0.0f)
    } else { /* UINT8 */
        V2_CONVERT(uint8_t, (float)v)
    }
#undef V2_CONVERT
    size_t bad = md_first_not_finite(buf, count);
    if (bad < count) {
        free(buf);
        memset(t, 0, sizeof *t);
        return md_err_set(err, MD_EINVAL,
                          "input value %zu is NaN, infinite or outside float32's range", bad);
    }
    t->data = buf;
    t->count = count;
    return MD_OK;
}

md_status md_v2_decode(json_t *in, size_t max_vals, md_tensor *t, md_err *err)
{
    json_t *data = json_object_get(in, "data");
    size_t count;
    md_status st = v2_header(in, max_vals, t, &count, err);
    if (st != MD_OK)
        return st;
    if (!json_is_array(data))
        return md_err_set(err, MD_EINVAL, "input data must be an array (flat or nested)");
    float *buf = md_mallocarray_checked(count, sizeof(float), "the input", err);
    if (!buf)
        return MD_ENOMEM;
    /* flatten nested data depth-first */
    json_t *stack[MD_MAX_DIMS + 1];
    size_t pos[MD_MAX_DIMS + 1];
    int depth = 0;
    size_t n = 0;
    stack[0] = data;
    pos[0] = 0;
    while (depth >= 0) {
        if (pos[depth] >= json_array_size(stack[depth])) {
            depth--;
            if (depth >= 0)
                pos[depth]++;
            continue;
        }
        json_t *v = json_array_get(stack[depth], pos[depth]);
        if (json_is_array(v)) {
            if (depth + 1 > MD_MAX_DIMS) {
                free(buf);
                return md_err_set(err, MD_EINVAL, "input data is nested too deeply");
            }
            stack[++depth] = v;
            pos[depth] = 0;
            continue;
        }
        if (n >= count) {
            free(buf);
            return md_err_set(err, MD_EINVAL, "input data has more values than its shape (%zu)",
                              count);
        }
        if (json_is_number(v)) {
            double d = json_number_value(v);
            /* past float32's range the cast is undefined; NaN never decodes */
            if (!(fabs(d) <= (double)FLT_MAX)) {
                free(buf);
                return md_err_set(err, MD_EINVAL,
                                  "input data value %zu is outside float32's range", n);
            }
            buf[n++] = (float)d;
        }
        else if (json_is_boolean(v))
            buf[n++] = json_is_true(v) ? 1.0f : 0.0f;
        else {
            free(buf);
            return md_err_set(err, MD_EINVAL, "input data value %zu is not a number", n);
        }
        pos[depth]++;
    }
    if (n != count) {
        free(buf);
        return md_err_set(err, MD_EINVAL, "input data has %zu values but its shape needs %zu", n,
                          count);
    }
    t->data = buf;
    t->count = count;
    return MD_OK;
}

/* ---- V2 requests: what modeld reads, and only that, built by jansson ----
 *
 * DESIGN
 * jansson builds a node for every value of a document (~75 bytes of heap a
 * byte for "[{},{},...]"), whether or not anything reads it: a 60 MB request
 * once peaked at 4.9 GB. So a request is walked twice in place. The first
 * pass validates it as jansson would (md_json_skip), follows only the members
 * modeld reads (inputs[0]'s name, shape, datatype, data and parameters.
 * binary_data_size; id; outputs[0]'s name and parameters.binary_data;
 * parameters.binary_data_output), counts the values jansson will build from
 * them (at most MD_V2_MAX_JSON_VALUES, data aside) and reads inputs[0].data
 * with the row scanner. The second pass writes the copy jansson reads: every
 * other value replaced by null, and "data": [] when the scanner read it (a
 * data array jansson reads instead holds at most max_values values). Peak
 * memory is the body, its copy, the tensor and a bounded tree.
 */

typedef struct v2_walk {
    const char *s;
    size_t len;
    char *out;         /* pass 2: the copy jansson reads; NULL in pass 1 */
    size_t out_len, copied;
    size_t max_values;
    int read_data;     /* pass 1: read inputs[0].data with the row scanner */
    int use_rows;      /* pass 2: "[]" in place of s[a..b) */
    int depth;         /* containers around the value being walked */
    int inputs, data;  /* how many "inputs" (top level) and "data" (inputs[0]) keys */
    int too_many_data; /* a data array jansson would read holds more than max_values */
    size_t a, b;       /* the data the row scanner read: s[a..b) */
    md_tensor rows;
    size_t kept;       /* values and members jansson builds, data aside */
    size_t data_values; /* values in the data arrays jansson builds */
    /* spans mode (md_v2_parse_spans): every input's data is left out of the
     * copy jansson reads, and where it lies in the body is recorded */
    int spans;
    int element;                  /* the index of the list element being walked */
    int in_inputs;                /* walking the inputs list */
    int input_elements;           /* how many it has */
    int drop_data;                /* pass 2: every data array becomes [] (several inputs:
                                   * the caller reads them with md_v2_parse_spans) */
    size_t span_a[MD_MAX_IO], span_b[MD_MAX_IO];
    size_t bad;        /* where the body stops being JSON */
} v2_walk;

static size_t v2_bad(v2_walk *w, size_t at)
{
    w->bad = at;
    return 0;
}

/* pass 2: s[copied..at) into the copy, then `with` in place of s[at..to) */
static void v2_replace(v2_walk *w, size_t at, size_t to, const char *with)
{
    size_t n = strlen(with);
    memcpy(w->out + w->out_len, w->s + w->copied, at - w->copied);
    w->out_len += at - w->copied;
    memcpy(w->out + w->out_len, with, n);
    w->out_len += n;
    w->copied = to;
}

/* A value jansson builds: validated and counted. */
static size_t v2_keep(v2_walk *w, size_t v)
{
    md_json_scan sc;
    memset(&sc, 0, sizeof sc);
    size_t end = md_json_skip(w->s, w->len, v, MD_JSON_MAX_DEPTH - w->depth, &sc);
    if (!end)
        return v2_bad(w, sc.bad);
    w->kept += sc.values + sc.members;
    return end;
}

/* A value modeld ignores: validated, and null in the copy (never longer). */
static size_t v2_drop(v2_walk *w, size_t v)
{
    md_json_scan sc;
    memset(&sc, 0, sizeof sc);
    size_t end = md_json_skip(w->s, w->len, v, MD_JSON_MAX_DEPTH - w->depth, &sc);
    if (!end)
        return v2_bad(w, sc.bad);
    if (end - v <= 4)
        w->kept += sc.values; /* as short as null: kept as it is */
    else if (w->out)
        v2_replace(w, v, end, "null");
    return end;
}

static unsigned v2_hex(const char *p)
{
    unsigned v = 0;
    for (int k = 0; k < 4; k++)
        v = v << 4 | (unsigned)(isdigit((unsigned char)p[k]) ? p[k] - '0'
                                                              : (tolower((unsigned char)p[k]) - 'a' + 10));
    return v;
}

/* The key string at s[i] == '"', unescaped as jansson would into `out`
 * (known keys are ASCII: any other character becomes 0x01, and a key longer
 * than `size` - 1 is cut and matches none). Returns the index past it or 0. */
static size_t v2_key(v2_walk *w, size_t i, char *out, size_t size, size_t *klen)
{
    md_json_scan sc;
    memset(&sc, 0, sizeof sc);
    size_t end = md_json_skip_string(w->s, w->len, i, NULL, &sc), n = 0;
    if (!end)
        return v2_bad(w, sc.bad);
    for (size_t k = i + 1; k + 1 < end && n < size; k++) {
        char c = w->s[k];
        if (c == '\\') {
            char e = w->s[++k];
            if (e == 'u') {
                unsigned cp = v2_hex(w->s + k + 1);
                c = cp < 0x80 ? (char)cp : '\x01';
                k += 4;
            } else {
                c = e == 'b' ? '\b' : e == 'f' ? '\f' : e == 'n' ? '\n' : e == 'r' ? '\r'
                  : e == 't' ? '\t' : e;
            }
        }
        out[n++] = c;
    }
    *klen = n;
    return end;
}

typedef size_t (*v2_member_fn)(v2_walk *w, const char *key, size_t klen, size_t value);

/* The object at s[i] == '{': each member's value to on_member, which
 * returns the index past it (0: not JSON). The index past the object, or 0. */
static size_t v2_object(v2_walk *w, size_t i, v2_member_fn on_member)
{
    const char *s = w->s;
    size_t len = w->len;
    w->kept++;
    w->depth++;
    i = md_json_blank(s, len, i + 1);
    if (i < len && s[i] == '}') {
        w->depth--;
        return i + 1;
    }
    for (;;) {
        char key[24];
        size_t klen;
        if (i >= len || s[i] != '"')
            return v2_bad(w, i);
        if (!(i = v2_key(w, i, key, sizeof key, &klen)))
            return 0;
        i = md_json_blank(s, len, i);
        if (i >= len || s[i] != ':')
            return v2_bad(w, i);
        w->kept++;
        if (!(i = on_member(w, key, klen, md_json_blank(s, len, i + 1))))
            return 0;
        i = md_json_blank(s, len, i);
        if (i < len && s[i] == ',') {
            i = md_json_blank(s, len, i + 1);
            continue;
        }
        if (i < len && s[i] == '}') {
            w->depth--;
            return i + 1;
        }
        return v2_bad(w, i);
    }
}

/* The array at s[i] == '[' of inputs or outputs: each element, an object,
 * walked with on_first (a version may have several named inputs and
 * outputs; MD_V2_MAX_JSON_VALUES bounds what is kept of them, and
 * max_values their data together). */
static size_t v2_list(v2_walk *w, size_t i, v2_member_fn on_first)
{
    const char *s = w->s;
    size_t len = w->len;
    w->kept++;
    w->depth++;
    i = md_json_blank(s, len, i + 1);
    if (i < len && s[i] == ']') {
        w->depth--;
        return i + 1;
    }
    for (int element = 0;; element++) {
        w->element = element;
        if (w->in_inputs && element >= w->input_elements)
            w->input_elements = element + 1;
        size_t end = i < len && s[i] == '{' ? v2_object(w, i, on_first) : v2_keep(w, i);
        if (!end)
            return 0;
        i = md_json_blank(s, len, end);
        if (i < len && s[i] == ',') {
            i = md_json_blank(s, len, i + 1);
            continue;
        }
        if (i < len && s[i] == ']') {
            w->depth--;
            return i + 1;
        }
        return v2_bad(w, i);
    }
}

#define V2_KEY(k) (klen == sizeof(k) - 1 && memcmp(key, k, klen) == 0)

static size_t v2_is(v2_walk *w, size_t v, char c) { return v < w->len && w->s[v] == c; }

static size_t v2_params_top(v2_walk *w, const char *key, size_t klen, size_t v)
{
    return V2_KEY("binary_data_output") ? v2_keep(w, v) : v2_drop(w, v);
}

static size_t v2_params_input(v2_walk *w, const char *key, size_t klen, size_t v)
{
    return V2_KEY("binary_data_size") ? v2_keep(w, v) : v2_drop(w, v);
}

static size_t v2_params_output(v2_walk *w, const char *key, size_t klen, size_t v)
{
    return V2_KEY("binary_data") ? v2_keep(w, v) : v2_drop(w, v);
}

static size_t v2_output0(v2_walk *w, const char *key, size_t klen, size_t v)
{
    if (V2_KEY("parameters") && v2_is(w, v, '{'))
        return v2_object(w, v, v2_params_output);
    return V2_KEY("name") || V2_KEY("parameters") ? v2_keep(w, v) : v2_drop(w, v);
}

/* inputs[0].data: read by the row scanner in pass 1 when it can, else
 * validated and bounded by max_values for jansson */
static size_t v2_data(v2_walk *w, size_t v)
{
    w->data++;
    if (w->out && w->drop_data) {
        md_json_scan sc;
        memset(&sc, 0, sizeof sc);
        size_t end = md_json_skip(w->s, w->len, v, MD_JSON_MAX_DEPTH - w->depth, &sc);
        if (end)
            v2_replace(w, v, end, "[]");
        return end;
    }
    if (w->spans) {
        md_json_scan sc;
        memset(&sc, 0, sizeof sc);
        size_t end = md_json_skip(w->s, w->len, v, MD_JSON_MAX_DEPTH - w->depth, &sc);
        if (!end)
            return v2_bad(w, sc.bad);
        if (w->out) {
            v2_replace(w, v, end, "[]");
            return end;
        }
        /* every input's data together holds at most max_values numbers */
        w->data_values += sc.values - sc.containers;
        if (w->data_values > w->max_values || sc.containers > w->max_values)
            w->too_many_data = 1;
        if (w->element < MD_MAX_IO) {
            w->span_a[w->element] = v;
            w->span_b[w->element] = end;
        }
        return end;
    }
    if (!w->out && w->data == 1 && w->read_data && v2_is(w, v, '[')) {
        md_err err;
        const char *stop = NULL;
        if (md_tensor_scan_rows(w->s + v, w->s + w->len, w->max_values, &w->rows, &stop,
                                &err) == MD_OK &&
            w->rows.count > 0) {
            w->a = v;
            w->b = (size_t)(stop - w->s);
            return w->b;
        }
        md_tensor_free(&w->rows);
    } else if (w->out && w->use_rows && v == w->a) {
        v2_replace(w, w->a, w->b, "[]");
        return w->b;
    }
    md_json_scan sc;
    memset(&sc, 0, sizeof sc);
    size_t end = md_json_skip(w->s, w->len, v, MD_JSON_MAX_DEPTH - w->depth, &sc);
    if (!end)
        return v2_bad(w, sc.bad);
    /* a rectangular array has no more arrays than numbers; every input's
     * data together is bounded as one input's is */
    w->data_values += sc.values;
    if (sc.values - sc.containers > w->max_values || sc.containers > w->max_values ||
        w->data_values > 2 * w->max_values)
        w->too_many_data = 1;
    return end;
}

static size_t v2_input0(v2_walk *w, const char *key, size_t klen, size_t v)
{
    if (V2_KEY("data"))
        return v2_data(w, v);
    if (V2_KEY("parameters") && v2_is(w, v, '{'))
        return v2_object(w, v, v2_params_input);
    return V2_KEY("name") || V2_KEY("shape") || V2_KEY("datatype") || V2_KEY("parameters")
               ? v2_keep(w, v)
               : v2_drop(w, v);
}

static size_t v2_top(v2_walk *w, const char *key, size_t klen, size_t v)
{
    if (V2_KEY("inputs")) {
        w->inputs++;
        if (!v2_is(w, v, '['))
            return v2_keep(w, v);
        w->in_inputs = 1;
        size_t end = v2_list(w, v, v2_input0);
        w->in_inputs = 0;
        return end;
    }
    if (V2_KEY("outputs"))
        return v2_is(w, v, '[') ? v2_list(w, v, v2_output0) : v2_keep(w, v);
    if (V2_KEY("parameters"))
        return v2_is(w, v, '{') ? v2_object(w, v, v2_params_top) : v2_keep(w, v);
    return V2_KEY("id") ? v2_keep(w, v) : v2_drop(w, v);
}

/* One pass over the whole body: the index past it, or 0 (w->bad). */
static size_t v2_walk_body(v2_walk *w)
{
    w->depth = 0;
    w->inputs = w->data = w->too_many_data = 0;
    w->kept = w->data_values = 0;
    size_t i = md_json_blank(w->s, w->len, 0);
    if (i < w->len && w->s[i] != '{' && w->s[i] != '[')
        return v2_bad(w, i); /* jansson reads only an object or an array */
    size_t end = v2_is(w, i, '{') ? v2_object(w, i, v2_top) : v2_keep(w, i);
    if (end && md_json_blank(w->s, w->len, end) != w->len)
        return v2_bad(w, md_json_blank(w->s, w->len, end));
    return end;
}

json_t *md_v2_parse(const char *body, size_t len, size_t max_vals, int read_data, md_tensor *t,
                    int *decoded, md_err *err)
{
    *decoded = 0;
    memset(t, 0, sizeof *t);
    v2_walk w;
    memset(&w, 0, sizeof w);
    w.s = body ? body : "";
    w.len = body ? len : 0;
    w.max_values = max_vals;
    w.read_data = read_data;
    if (!v2_walk_body(&w)) {
        md_tensor_free(&w.rows);
        md_err_set(err, MD_EINVAL, "the body is not a JSON inference request (not JSON at byte "
                   "%zu)", w.bad);
        return NULL;
    }
    if (w.kept > MD_V2_MAX_JSON_VALUES || w.too_many_data) {
        md_tensor_free(&w.rows);
        if (w.too_many_data)
            md_err_setc(err, MD_ETOOBIG, "too_many_values",
                        "input data holds more than the limit of %zu values; send fewer rows "
                        "per request", max_vals);
        else
            md_err_setc(err, MD_ETOOBIG, "too_many_json_values",
                        "the request holds %zu JSON values and keys outside the input's data, "
                        "more than the limit of %d (MD_V2_MAX_JSON_VALUES); modeld reads only "
                        "inputs, id, outputs and parameters: send less there", w.kept,
                        MD_V2_MAX_JSON_VALUES);
        return NULL;
    }
    /* the data the scanner read is used when it is the only one; anything
     * else (an error to report, a duplicate key) goes to jansson whole */
    w.use_rows = w.rows.data && w.inputs == 1 && w.data == 1;
    if (!w.use_rows)
        md_tensor_free(&w.rows);
    /* several inputs: no jansson node per value; the caller reads them by
     * name where they lie (md_v2_parse_spans) */
    w.drop_data = w.input_elements > 1;
    for (;;) {
        w.out = malloc(w.len + 1);
        if (!w.out) {
            md_tensor_free(&w.rows);
            md_err_set(err, MD_ENOMEM, "no memory for a copy of the %zu-byte request", len);
            return NULL;
        }
        w.out_len = w.copied = 0;
        v2_walk_body(&w); /* as pass 1: it cannot fail now */
        v2_replace(&w, w.len, w.len, "");
        json_error_t jerr;
        json_t *root = json_loadb(w.out, w.out_len, 0, &jerr);
        free(w.out);
        w.out = NULL;
        if (!root) { /* a number out of jansson's range */
            md_tensor_free(&w.rows);
            md_err_set(err, MD_EINVAL, "the body is not a JSON inference request (%s)",
                       jerr.text);
            return NULL;
        }
        if (!w.use_rows)
            return root;
        json_t *inputs = json_object_get(root, "inputs");
        json_t *in = json_array_get(inputs, 0);
        json_t *data = json_object_get(in, "data");
        size_t count;
        md_err herr;
        int ok = json_array_size(inputs) == 1 && json_is_array(data) &&
                 json_array_size(data) == 0 &&
                 !json_object_get(json_object_get(in, "parameters"), "binary_data_size") &&
                 v2_header(in, max_vals, t, &count, &herr) == MD_OK && w.rows.count == count;
        /* the whole-body path refuses a value past FLT_MAX that rounds to it */
        for (size_t i = 0; ok && i < w.rows.count; i++)
            ok = fabsf(w.rows.data[i]) != FLT_MAX;
        if (ok) {
            t->data = w.rows.data;
            t->count = count;
            *decoded = 1;
            return root;
        }
        md_tensor_free(&w.rows);
        memset(t, 0, sizeof *t);
        json_decref(root);
        w.use_rows = 0; /* again, with the data for jansson, to answer as it always has */
    }
}

static int v2_is_int_type(const char *dt);

json_t *md_v2_parse_spans(const char *body, size_t len, size_t max_vals, size_t *span_a,
                          size_t *span_b, md_err *err)
{
    v2_walk w;
    memset(&w, 0, sizeof w);
    w.s = body ? body : "";
    w.len = body ? len : 0;
    w.max_values = max_vals;
    w.spans = 1;
    if (!v2_walk_body(&w)) {
        md_err_set(err, MD_EINVAL, "the body is not a JSON inference request (not JSON at byte "
                   "%zu)", w.bad);
        return NULL;
    }
    if (w.kept > MD_V2_MAX_JSON_VALUES || w.too_many_data) {
        if (w.too_many_data)
            md_err_setc(err, MD_ETOOBIG, "too_many_values",
                        "the inputs' data hold more than the limit of %zu values; send fewer "
                        "rows per request", max_vals);
        else
            md_err_setc(err, MD_ETOOBIG, "too_many_json_values",
                        "the request holds %zu JSON values and keys outside the inputs' data, "
                        "more than the limit of %d (MD_V2_MAX_JSON_VALUES); modeld reads only "
                        "inputs, id, outputs and parameters: send less there", w.kept,
                        MD_V2_MAX_JSON_VALUES);
        return NULL;
    }
    w.out = malloc(w.len + 1);
    if (!w.out) {
        md_err_set(err, MD_ENOMEM, "no memory for a copy of the %zu-byte request", len);
        return NULL;
    }
    w.out_len = w.copied = 0;
    v2_walk_body(&w); /* as pass 1: it cannot fail now */
    v2_replace(&w, w.len, w.len, "");
    json_error_t jerr;
    json_t *root = json_loadb(w.out, w.out_len, 0, &jerr);
    free(w.out);
    if (!root) {
        md_err_set(err, MD_EINVAL, "the body is not a JSON inference request (%s)", jerr.text);
        return NULL;
    }
    memcpy(span_a, w.span_a, sizeof w.span_a);
    memcpy(span_b, w.span_b, sizeof w.span_b);
    return root;
}

/* The numbers of JSON data s[0..len) (nested arrays flattened), exactly
 * `count` of them, into f32 or (is_int) i64: integers from their digits,
 * true and false as 1 and 0. */
static md_status v2_text_values(const char *s, size_t len, const char *name, int is_int,
                                size_t count, float *f32, int64_t *i64, md_err *err)
{
    size_t n = 0, i = 0;
    int depth = 0;
    while (i < len) {
        char c = s[i];
        if (c == '[') {
            if (++depth > MD_MAX_DIMS)
                return md_err_set(err, MD_EINVAL, "input \"%s\": data is nested too deeply",
                                  name);
            i++;
            continue;
        }
        if (c == ']') {
            depth--;
            i++;
            continue;
        }
        if (c == ',' || c == ' ' || c == '\t' || c == '\n' || c == '\r') {
            i++;
            continue;
        }
        if (n >= count)
            return md_err_set(err, MD_EINVAL,
                              "input \"%s\": data has more values than its shape (%zu)", name,
                              count);
        if (len - i >= 4 && !memcmp(s + i, "true", 4)) {
            if (is_int)
                i64[n++] = 1;
            else
                f32[n++] = 1.0f;
            i += 4;
            continue;
        }
        if (len - i >= 5 && !memcmp(s + i, "false", 5)) {
            if (is_int)
                i64[n++] = 0;
            else
                f32[n++] = 0.0f;
            i += 5;
            continue;
        }
        /* md_json_skip validated the grammar: a number, or a value that is
         * no number (a string, null, an object) */
        size_t j = i + (s[i] == '-');
        if (j >= len || s[j] < '0' || s[j] > '9')
            return md_err_set(err, MD_EINVAL, "input \"%s\": data value %zu is not a number",
                              name, n);
        size_t k = j;
        int integer = 1;
        while (k < len && ((s[k] >= '0' && s[k] <= '9') || s[k] == '.' || s[k] == 'e' ||
                           s[k] == 'E' || s[k] == '+' || s[k] == '-')) {
            integer &= s[k] >= '0' && s[k] <= '9';
            k++;
        }
        if (is_int) {
            uint64_t v = 0;
            int over = !integer;
            for (size_t q = j; q < k && !over; q++) {
                over = v > (UINT64_MAX - 9) / 10;
                v = v * 10 + (uint64_t)(s[q] - '0');
            }
            if (!integer)
                return md_err_set(err, MD_EINVAL,
                                  "input \"%s\": data value %zu is not an integer, and its "
                                  "datatype is an integer type (values are not rounded)",
                                  name, n);
            if (over || v > (uint64_t)INT64_MAX + (uint64_t)(s[i] == '-'))
                return md_err_set(err, MD_EINVAL, "input \"%s\": data value %zu is past "
                                  "int64's range", name, n);
            i64[n++] = s[i] == '-' ? (int64_t)(0 - v) : (int64_t)v;
        } else {
            double d;
            if (md_parse_double(s + i, s + k, &d) != 0 || !(fabs(d) <= (double)FLT_MAX))
                return md_err_set(err, MD_EINVAL, "input \"%s\": data value %zu is outside "
                                  "float32's range", name, n);
            f32[n++] = (float)d;
        }
        i = k;
    }
    if (n != count)
        return md_err_set(err, MD_EINVAL, "input \"%s\": data has %zu values but its shape "
                          "needs %zu", name, n, count);
    return MD_OK;
}

/* The name and datatype of V2 input `in` into a cleared `out`: every named
 * input needs a name. */
static md_status v2_array_name(json_t *in, md_array *out, md_err *err)
{
    memset(out, 0, sizeof *out);
    const char *name = json_string_value(json_object_get(in, "name"));
    if (!name || !name[0] || strlen(name) >= sizeof out->name)
        return md_err_set(err, MD_EINVAL, "every input needs a \"name\" of 1 to %zu characters, "
                          "the model's input it is for", sizeof out->name - 1);
    snprintf(out->name, sizeof out->name, "%s", name);
    const char *dt = json_string_value(json_object_get(in, "datatype"));
    if (dt && strlen(dt) < sizeof out->datatype)
        snprintf(out->datatype, sizeof out->datatype, "%s", dt);
    return MD_OK;
}

/* err's message, failing with `st`, prefixed with the input's name. */
static md_status v2_input_error(md_status st, const char *name, md_err *err)
{
    char msg[sizeof err->msg];
    snprintf(msg, sizeof msg, "%s", err->msg);
    md_err_setc(err, st, md_err_code(err), "input \"%s\": %s", name, msg);
    return st;
}

/* v2_header for a named array: its shape into out, its value count. */
static md_status v2_array_header(json_t *in, size_t max_vals, md_array *out, size_t *count,
                                 md_err *err)
{
    md_tensor t;
    md_status st = v2_header(in, max_vals, &t, count, err);
    if (st != MD_OK)
        return v2_input_error(st, out->name, err);
    out->ndim = t.ndim;
    memcpy(out->shape, t.shape, sizeof out->shape);
    return MD_OK;
}

md_status md_v2_text_array(json_t *in, const char *data, size_t len, size_t max_vals,
                           md_array *out, md_err *err)
{
    size_t count;
    md_status st = v2_array_name(in, out, err);
    if (st != MD_OK || (st = v2_array_header(in, max_vals, out, &count, err)) != MD_OK)
        return st;
    const char *name = out->name;
    out->is_int = v2_is_int_type(out->datatype);
    if (!data || len == 0 || data[0] != '[')
        return md_err_set(err, MD_EINVAL, "input \"%s\": data must be an array (flat or "
                          "nested)", name);
    void *buf = md_mallocarray_checked(count ? count : 1, out->is_int ? 8 : 4, "the input", err);
    if (!buf)
        return MD_ENOMEM;
    st = v2_text_values(data, len, name, out->is_int, count, out->is_int ? NULL : buf,
                        out->is_int ? buf : NULL, err);
    if (st != MD_OK) {
        free(buf);
        memset(out, 0, sizeof *out);
        return st;
    }
    out->count = count;
    if (out->is_int)
        out->i64 = buf;
    else
        out->f32 = buf;
    return MD_OK;
}

/* ---- several named inputs: one V2 input into an md_array ---- */

static int v2_is_int_type(const char *dt)
{
    return dt && (!strncmp(dt, "INT", 3) || !strncmp(dt, "UINT", 4) || !strcmp(dt, "BOOL"));
}

/* The integers of JSON `data` (flat or nested) into buf[0..count). */
static md_status v2_json_ints(json_t *data, const char *name, int64_t *buf, size_t count,
                              md_err *err)
{
    json_t *stack[MD_MAX_DIMS + 1];
    size_t pos[MD_MAX_DIMS + 1], n = 0;
    int depth = 0;
    stack[0] = data;
    pos[0] = 0;
    while (depth >= 0) {
        if (pos[depth] >= json_array_size(stack[depth])) {
            if (--depth >= 0)
                pos[depth]++;
            continue;
        }
        json_t *v = json_array_get(stack[depth], pos[depth]);
        if (json_is_array(v)) {
            if (depth + 1 > MD_MAX_DIMS)
                return md_err_set(err, MD_EINVAL, "input \"%s\": data is nested too deeply", name);
            stack[++depth] = v;
            pos[depth] = 0;
            continue;
        }
        if (n >= count)
            return md_err_set(err, MD_EINVAL,
                              "input \"%s\": data has more values than its shape (%zu)", name,
                              count);
        if (json_is_integer(v))
            buf[n++] = (int64_t)json_integer_value(v);
        else if (json_is_boolean(v))
            buf[n++] = json_is_true(v);
        else
            return md_err_set(err, MD_EINVAL,
                              "input \"%s\": data value %zu is not an integer, and its datatype "
                              "is an integer type (values are not rounded)",
                              name, n);
        pos[depth]++;
    }
    if (n != count)
        return md_err_set(err, MD_EINVAL, "input \"%s\": data has %zu values but its shape needs "
                          "%zu", name, n, count);
    return MD_OK;
}

md_status md_v2_decode_array(json_t *in, const void *bytes, size_t nbytes, size_t max_vals,
                             md_array *out, md_err *err)
{
    md_status st = v2_array_name(in, out, err);
    if (st != MD_OK)
        return st;
    const char *name = out->name;
    const char *dt = json_string_value(json_object_get(in, "datatype"));
    md_tensor t;
    if (!v2_is_int_type(dt)) {
        st = bytes ? md_v2_decode_binary(in, bytes, nbytes, max_vals, &t, err)
                   : md_v2_decode(in, max_vals, &t, err);
        if (st != MD_OK)
            return v2_input_error(st, name, err);
        out->ndim = t.ndim;
        memcpy(out->shape, t.shape, sizeof out->shape);
        out->count = t.count;
        out->f32 = t.data;
        return MD_OK;
    }
    size_t count;
    if ((st = v2_array_header(in, max_vals, out, &count, err)) != MD_OK)
        return st;
    out->is_int = 1;
    int64_t *buf = md_mallocarray_checked(count ? count : 1, sizeof(int64_t), "the input", err);
    if (!buf)
        return MD_ENOMEM;
    if (!bytes) {
        json_t *data = json_object_get(in, "data");
        st = json_is_array(data) ? v2_json_ints(data, name, buf, count, err)
                                 : md_err_set(err, MD_EINVAL, "input \"%s\": data must be an "
                                              "array (flat or nested)", name);
    } else {
        size_t esize = (size_t)v2_type_size(dt);
        const unsigned char *src = bytes;
        st = MD_OK;
        if (nbytes / esize != count || nbytes % esize)
            st = md_err_set(err, MD_EINVAL,
                            "input \"%s\": binary_data_size is %zu bytes, but %zu values of %s "
                            "take %zu", name, nbytes, count, dt, count * esize);
        for (size_t i = 0; st == MD_OK && i < count; i++) {
            const unsigned char *p = src + i * esize;
            if (!strcmp(dt, "INT64")) {
                memcpy(&buf[i], p, 8);
            } else if (!strcmp(dt, "UINT64")) {
                uint64_t v;
                memcpy(&v, p, 8);
                if (v > (uint64_t)INT64_MAX)
                    st = md_err_set(err, MD_EINVAL, "input \"%s\": value %zu is past int64's "
                                    "range", name, i);
                buf[i] = (int64_t)v;
            } else if (!strcmp(dt, "INT32")) {
                int32_t v;
                memcpy(&v, p, 4);
                buf[i] = v;
            } else if (!strcmp(dt, "UINT32")) {
                uint32_t v;
                memcpy(&v, p, 4);
                buf[i] = v;
            } else if (!strcmp(dt, "INT16")) {
                int16_t v;
                memcpy(&v, p, 2);
                buf[i] = v;
            } else if (!strcmp(dt, "UINT16")) {
                uint16_t v;
                memcpy(&v, p, 2);
                buf[i] = v;
            } else if (!strcmp(dt, "INT8")) {
                buf[i] = (int8_t)p[0];
            } else if (!strcmp(dt, "BOOL")) {
                buf[i] = p[0] != 0;
            } else {
                buf[i] = p[0];
            }
        }
    }
    if (st != MD_OK) {
        free(buf);
        memset(out, 0, sizeof *out);
        return st;
    }
    out->count = count;
    out->i64 = buf;
    return MD_OK;
}
