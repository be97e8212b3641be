/*
 * answer.c - the JSON answers of the prediction routes (answer.h).
 */
#include "answer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../predictor/predictor.h"

/* ---- a growable string that fails instead of aborting ---- */

typedef struct sbuf {
    char *p;
    size_t len, cap;
    int oom; /* an allocation failed: everything after is dropped */
} sbuf;

/* Room for n more bytes (and a NUL); 0 when there is none. */
static int sb_reserve(sbuf *b, size_t n)
{
    if (b->oom)
        return 0;
    if (n <= b->cap && b->len + 1 <= b->cap - n)
        return 1;
    size_t cap = b->cap ? b->cap : 256;
    while (cap - 1 - b->len < n) {
        if (cap > SIZE_MAX / 2) {
            b->oom = 1;
            return 0;
        }
        cap *= 2;
    }
    char *p = realloc(b->p, cap);
    if (!p) {
        b->oom = 1;
        return 0;
    }
    b->p = p;
    b->cap = cap;
    return 1;
}

static void sb_add(sbuf *b, const char *s, size_t n)
{
    if (!sb_reserve(b, n))
        return;
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

static void sb_str(sbuf *b, const char *s) { sb_add(b, s, strlen(s)); }

static void sb_char(sbuf *b, char c)
{
    if (!sb_reserve(b, 1))
        return;
    b->p[b->len++] = c;
    b->p[b->len] = '\0';
}

static void sb_float(sbuf *b, float v)
{
    if (!sb_reserve(b, 32))
        return;
    b->len += (size_t)md_float_format(v, b->p + b->len, 32);
}

static void sb_int(sbuf *b, long long v)
{
    char n[24];
    sb_add(b, n, (size_t)snprintf(n, sizeof n, "%lld", v));
}

/* A JSON string: '"', '\\' and control characters escaped, UTF-8 as it is
 * (the names and labels come from JSON that jansson checked). */
static void sb_json_string(sbuf *b, const char *s)
{
    static const char hex[] = "0123456789abcdef";
    size_t n = strlen(s);
    if (n > (SIZE_MAX - 2) / 6 || !sb_reserve(b, n * 6 + 2))
        return;
    char *o = b->p + b->len;
    *o++ = '"';
    for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
        if (*c == '"' || *c == '\\') {
            *o++ = '\\';
            *o++ = (char)*c;
        } else if (*c < 0x20) {
            switch (*c) {
            case '\n': *o++ = '\\'; *o++ = 'n'; break;
            case '\r': *o++ = '\\'; *o++ = 'r'; break;
            case '\t': *o++ = '\\'; *o++ = 't'; break;
            case '\b': *o++ = '\\'; *o++ = 'b'; break;
            case '\f': *o++ = '\\'; *o++ = 'f'; break;
            default:
                memcpy(o, "\\u00", 4);
                o[4] = hex[*c >> 4];
                o[5] = hex[*c & 15];
                o += 6;
            }
        } else {
            *o++ = (char)*c;
        }
    }
    *o++ = '"';
    b->len = (size_t)(o - b->p);
    b->p[b->len] = '\0';
}

/* Nested JSON array of shape[d..] from data. */
static const float *sb_nested(sbuf *b, const float *data, const int64_t *shape, int ndim, int d)
{
    sb_char(b, '[');
    if (d == ndim - 1) {
        for (int64_t i = 0; i < shape[d]; i++) {
            if (i)
                sb_char(b, ',');
            sb_float(b, *data++);
        }
    } else {
        for (int64_t i = 0; i < shape[d]; i++) {
            if (i)
                sb_char(b, ',');
            data = sb_nested(b, data, shape, ndim, d + 1);
        }
    }
    sb_char(b, ']');
    return data;
}

/* ,"labels":[[...],...],"scores":[[...],...] by the version's rule
 * (md_classes): the top k classes of each row (1 when not asked), best first,
 * or for a multi-label output without top_k every class present; each named
 * by the version's labels or its index. */
static void add_labels_scores(sbuf *b, const md_answer_opts *o, const float *out,
                              const int64_t *shape, int ndim)
{
    const md_classes *c = &o->classes;
    int64_t rows = shape[0], width = ndim >= 2 ? shape[1] : 1;
    for (int d = 2; d < ndim; d++)
        width *= shape[d];
    int64_t n = c->classes > 0 ? c->classes : 1;
    int64_t k = o->top_k ? o->top_k : 1;
    int all_present = c->kind == MD_CLASSES_MULTI && !o->top_k;
    if (all_present)
        k = n;
    if (k > n)
        k = n;
    sbuf sco = {0};
    float *p = malloc(sizeof(float) * (size_t)n), *score = malloc(sizeof(float) * (size_t)n);
    int64_t *top = malloc(sizeof(int64_t) * (size_t)n);
    if (!p || !top || !score) {
        b->oom = 1;
        goto out;
    }
    sb_str(b, ",\"labels\":[");
    sb_str(&sco, ",\"scores\":[");
    for (int64_t r = 0; r < rows; r++) {
        const float *x = out + r * width;
        int64_t got = md_classes_top_k(c, x, k, p, top, score);
        if (r) {
            sb_char(b, ',');
            sb_char(&sco, ',');
        }
        sb_char(b, '[');
        sb_char(&sco, '[');
        int first = 1;
        for (int64_t t = 0; t < got; t++) {
            if (all_present && !md_classes_present(c, x, top[t]))
                break; /* ranked best first: the rest are below the threshold too */
            if (!first) {
                sb_char(b, ',');
                sb_char(&sco, ',');
            }
            first = 0;
            json_t *name = o->labels ? json_array_get(o->labels, (size_t)top[t]) : NULL;
            if (json_is_string(name))
                sb_json_string(b, json_string_value(name));
            else
                sb_int(b, (long long)top[t]);
            sb_float(&sco, score[t]);
        }
        sb_char(b, ']');
        sb_char(&sco, ']');
    }
    sb_char(b, ']');
    sb_char(&sco, ']');
    if (sco.oom)
        b->oom = 1;
    else
        sb_add(b, sco.p, sco.len);
out:
    free(sco.p);
    free(p);
    free(score);
    free(top);
}

/* One row of output `io` (from a packed answer row): a number for a
 * per-row shape [], else nested arrays. */
static void sb_row(sbuf *b, const float *row, const md_io_info *io)
{
    if (io->ndim == 0)
        sb_float(b, row[io->off]);
    else
        sb_nested(b, row + io->off, io->shape, io->ndim, 0);
}

/* Every row of output `io` as one nested array ([rows, shape...]). */
static void sb_column(sbuf *b, const float *out, int64_t rows, int64_t stride,
                      const md_io_info *io)
{
    sb_char(b, '[');
    for (int64_t r = 0; r < rows; r++) {
        if (r)
            sb_char(b, ',');
        sb_row(b, out + r * stride, io);
    }
    sb_char(b, ']');
}

/* labels and scores of the classes output, from a contiguous copy of it */
static void multi_labels(sbuf *b, const md_answer_opts *o, const float *out, int64_t rows)
{
    if (o->class_out < 0 || !(o->top_k || o->labels) || o->classes.kind == MD_CLASSES_NONE)
        return;
    const md_io_info *io = &o->outs[o->class_out];
    size_t n;
    if (md_mul_size((size_t)rows, (size_t)io->values, &n)) {
        b->oom = 1;
        return;
    }
    float *cls = malloc((n ? n : 1) * sizeof(float));
    if (!cls) {
        b->oom = 1;
        return;
    }
    for (int64_t r = 0; r < rows; r++)
        memcpy(cls + r * io->values, out + r * o->out_values + io->off,
               (size_t)io->values * sizeof(float));
    int64_t shape[2] = {rows, io->values};
    add_labels_scores(b, o, cls, shape, 2);
    free(cls);
}

/* The V2 answer of a version with declared outputs: each one asked for
 * (all by default), its values in JSON or, with binary data, after it. */
static void encode_multi_v2(sbuf *b, const md_answer_opts *o, const float *out, int64_t rows,
                            size_t *json_len)
{
    int64_t stride = o->out_values;
    sb_str(b, "{\"model_name\":");
    sb_json_string(b, o->model);
    sb_str(b, ",\"model_version\":\"");
    sb_int(b, o->version);
    sb_char(b, '"');
    if (o->v2_id && o->v2_id[0]) {
        sb_str(b, ",\"id\":");
        sb_json_string(b, o->v2_id);
    }
    sb_str(b, ",\"outputs\":[");
    int n = o->n_pick ? o->n_pick : o->n_out;
    for (int k = 0; k < n; k++) {
        const md_io_info *io = &o->outs[o->n_pick ? o->pick[k] : k];
        if (k)
            sb_char(b, ',');
        sb_str(b, "{\"name\":");
        sb_json_string(b, io->name);
        sb_str(b, ",\"shape\":[");
        sb_int(b, (long long)rows);
        for (int d = 0; d < io->ndim; d++) {
            sb_char(b, ',');
            sb_int(b, (long long)io->shape[d]);
        }
        sb_str(b, "],\"datatype\":\"FP32\"");
        if (o->v2_binary) {
            sb_str(b, ",\"parameters\":{\"binary_data_size\":");
            sb_int(b, (long long)((size_t)rows * (size_t)io->values * sizeof(float)));
            sb_str(b, "}}");
            continue;
        }
        sb_str(b, ",\"data\":[");
        for (int64_t r = 0; r < rows; r++)
            for (int64_t v = 0; v < io->values; v++) {
                if (r || v)
                    sb_char(b, ',');
                sb_float(b, out[r * stride + io->off + v]);
            }
        sb_str(b, "]}");
    }
    sb_str(b, "]}");
    if (!o->v2_binary) {
        sb_char(b, '\n');
        return;
    }
    *json_len = b->len;
    for (int k = 0; k < n; k++) {
        const md_io_info *io = &o->outs[o->n_pick ? o->pick[k] : k];
        for (int64_t r = 0; r < rows; r++)
            sb_add(b, (const char *)(out + r * stride + io->off),
                   (size_t)io->values * sizeof(float));
    }
}

/* The answer of a version with declared outputs: one output as rows of its
 * shape, several as an object a row (or, for a columnar request, an object
 * of columns), with labels and scores read from the classes output. */
static void encode_multi(sbuf *b, const md_answer_opts *o, const float *out, int64_t rows,
                         size_t *json_len)
{
    int64_t stride = o->out_values;
    if (o->kind == MD_ANSWER_V2) {
        encode_multi_v2(b, o, out, rows, json_len);
        return;
    }
    if (o->kind == MD_ANSWER_V1) {
        sb_str(b, "{\"predictions\":");
    } else {
        sb_str(b, "{\"model\":");
        sb_json_string(b, o->model);
        sb_str(b, ",\"version\":");
        sb_int(b, o->version);
        sb_str(b, o->columnar ? ",\"outputs\":" : ",\"predictions\":");
    }
    if (o->n_out == 1) {
        sb_column(b, out, rows, stride, &o->outs[0]);
    } else if (o->columnar && o->kind != MD_ANSWER_V1) {
        sb_char(b, '{');
        for (int j = 0; j < o->n_out; j++) {
            if (j)
                sb_char(b, ',');
            sb_json_string(b, o->outs[j].name);
            sb_char(b, ':');
            sb_column(b, out, rows, stride, &o->outs[j]);
        }
        sb_char(b, '}');
    } else {
        sb_char(b, '[');
        for (int64_t r = 0; r < rows; r++) {
            if (r)
                sb_char(b, ',');
            sb_char(b, '{');
            for (int j = 0; j < o->n_out; j++) {
                if (j)
                    sb_char(b, ',');
                sb_json_string(b, o->outs[j].name);
                sb_char(b, ':');
                sb_row(b, out + r * stride, &o->outs[j]);
            }
            sb_char(b, '}');
        }
        sb_char(b, ']');
    }
    if (o->kind == MD_ANSWER_PREDICT)
        multi_labels(b, o, out, rows);
    sb_str(b, "}\n");
}

char *md_answer_encode(const md_answer_opts *o, const float *out, const int64_t *shape, int ndim,
                       size_t *len, size_t *json_len)
{
    if (o->n_out > 0) {
        sbuf mb = {0};
        *len = *json_len = 0;
        encode_multi(&mb, o, out, ndim > 0 ? shape[0] : 0, json_len);
        if (mb.oom) {
            free(mb.p);
            return NULL;
        }
        *len = mb.len;
        if (!(o->kind == MD_ANSWER_V2 && o->v2_binary))
            *json_len = mb.len;
        return mb.p;
    }
    sbuf b = {0};
    *len = *json_len = 0;
    if (o->kind == MD_ANSWER_V2) {
        sb_str(&b, "{\"model_name\":");
        sb_json_string(&b, o->model);
        sb_str(&b, ",\"model_version\":\"");
        sb_int(&b, o->version);
        sb_char(&b, '"');
        if (o->v2_id && o->v2_id[0]) {
            sb_str(&b, ",\"id\":");
            sb_json_string(&b, o->v2_id);
        }
        sb_str(&b, ",\"outputs\":[{\"name\":");
        sb_json_string(&b, o->v2_output && o->v2_output[0] ? o->v2_output : "output0");
        sb_str(&b, ",\"shape\":[");
        size_t count = 1;
        for (int d = 0; d < ndim; d++) {
            if (d)
                sb_char(&b, ',');
            sb_int(&b, (long long)shape[d]);
            count *= (size_t)shape[d];
        }
        if (o->v2_binary) {
            /* binary tensor data extension: the JSON header, then the
             * values as little-endian float32 */
            char head[96];
            snprintf(head, sizeof head,
                     "],\"datatype\":\"FP32\",\"parameters\":{\"binary_data_size\":%zu}}]}",
                     count * sizeof(float));
            sb_str(&b, head);
            *json_len = b.len;
            sb_add(&b, (const char *)out, count * sizeof(float));
        } else {
            sb_str(&b, "],\"datatype\":\"FP32\",\"data\":[");
            for (size_t i = 0; i < count; i++) {
                if (i)
                    sb_char(&b, ',');
                sb_float(&b, out[i]);
            }
            sb_str(&b, "]}]}\n");
        }
    } else if (o->kind == MD_ANSWER_V1) {
        sb_str(&b, "{\"predictions\":");
        sb_nested(&b, out, shape, ndim, 0);
        sb_str(&b, "}\n");
    } else {
        sb_str(&b, "{\"model\":");
        sb_json_string(&b, o->model);
        sb_str(&b, ",\"version\":");
        sb_int(&b, o->version);
        /* a columnar request ({"inputs": ...}) is answered with "outputs" */
        sb_str(&b, o->columnar ? ",\"outputs\":" : ",\"predictions\":");
        sb_nested(&b, out, shape, ndim, 0);
        if ((o->top_k || o->labels) && o->classes.kind != MD_CLASSES_NONE)
            add_labels_scores(&b, o, out, shape, ndim);
        sb_str(&b, "}\n");
    }
    if (b.oom) {
        free(b.p);
        return NULL;
    }
    *len = b.len;
    if (!(o->kind == MD_ANSWER_V2 && o->v2_binary))
        *json_len = b.len;
    return b.p;
}
