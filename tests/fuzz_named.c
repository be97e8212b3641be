/*
 * fuzz_named.c - libFuzzer harness for md_named_decode (predictor/rows.c),
 * the JSON bodies of a version with named inputs: rows as objects, TF
 * Serving's columns, and one input's plain rows. The first byte picks one of
 * a few input declarations (floats and integers, shapes [] to [2, 2], one to
 * three inputs); the rest is the body.
 *
 * Differential against jansson: whatever md_named_decode accepts, jansson
 * must load, and walking jansson's tree the same way (rows or columns, by
 * name, in declared order) must give the same values, the integers exactly
 * (an integer input never takes a real) and the floats as float32 of the
 * same double. Beyond that: every array holds its shape's product of values,
 * rows agree across inputs in the rows format, the total stays under the
 * limit, and every refusal says why.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "../predictor/predictor.h"

#define MAX_VALUES 4096

typedef struct decl {
    int n;
    md_io_info in[3];
} decl;

static const int64_t s_none[1] = {0}, s_4[1] = {4}, s_3[1] = {3}, s_22[2] = {2, 2};

static decl decl_of(unsigned k)
{
    decl d;
    memset(&d, 0, sizeof d);
    switch (k % 4) {
    case 0: /* one float input of 4 */
        d.n = 1;
        d.in[0] = (md_io_info){.name = "x", .ndim = 1, .shape = s_4, .values = 4};
        break;
    case 1: /* one integer a row */
        d.n = 1;
        d.in[0] = (md_io_info){.name = "ids", .is_int = 1, .ndim = 0, .shape = s_none, .values = 1};
        break;
    case 2: /* floats and integers */
        d.n = 2;
        d.in[0] = (md_io_info){.name = "numeric", .ndim = 1, .shape = s_3, .values = 3};
        d.in[1] = (md_io_info){.name = "category", .is_int = 1, .ndim = 0, .shape = s_none,
                               .values = 1};
        break;
    default:
        d.n = 3;
        d.in[0] = (md_io_info){.name = "a", .ndim = 2, .shape = s_22, .values = 4};
        d.in[1] = (md_io_info){.name = "b", .is_int = 1, .ndim = 1, .shape = s_3, .values = 3};
        d.in[2] = (md_io_info){.name = "c", .ndim = 0, .shape = s_none, .values = 1};
        break;
    }
    return d;
}

/* Flatten jansson value `v` (one row of input `io`, or nested further) into
 * the reference list; returns 0 when it does not have the input's shape. */
static int flat(json_t *v, const md_io_info *io, int d, double *f, int64_t *i, size_t *n)
{
    if (d == io->ndim) {
        if (*n >= MAX_VALUES)
            return 0;
        if (io->is_int) {
            if (json_is_integer(v))
                i[(*n)++] = (int64_t)json_integer_value(v);
            else if (json_is_boolean(v))
                i[(*n)++] = json_is_true(v);
            else
                return 0;
        } else {
            if (!json_is_number(v))
                return 0;
            f[(*n)++] = json_number_value(v);
        }
        return 1;
    }
    if (!json_is_array(v) || (int64_t)json_array_size(v) != io->shape[d])
        return 0;
    for (size_t k = 0; k < json_array_size(v); k++)
        if (!flat(json_array_get(v, k), io, d + 1, f, i, n))
            return 0;
    return 1;
}

static double ref_f[MAX_VALUES];
static int64_t ref_i[MAX_VALUES];

/* input k's values from jansson's tree, in the decoder's order */
static int reference(json_t *root, const decl *dc, int k, int columnar, size_t *n)
{
    const md_io_info *io = &dc->in[k];
    *n = 0;
    json_t *rows = json_is_array(root) ? root : json_object_get(root, "instances");
    if (columnar) {
        json_t *in = json_object_get(root, "inputs");
        json_t *col = json_is_object(in) ? json_object_get(in, io->name) : in;
        if (!json_is_array(col))
            return 0;
        for (size_t r = 0; r < json_array_size(col); r++)
            if (!flat(json_array_get(col, r), io, 0, ref_f, ref_i, n))
                return 0;
        return 1;
    }
    if (!json_is_array(rows))
        return 0;
    /* one input's single row sent without the batch's brackets */
    if (dc->n == 1 && io->ndim > 0 && json_array_size(rows) > 0 &&
        !json_is_array(json_array_get(rows, 0)) && !json_is_object(json_array_get(rows, 0)))
        return flat(rows, io, 0, ref_f, ref_i, n);
    for (size_t r = 0; r < json_array_size(rows); r++) {
        json_t *row = json_array_get(rows, r);
        json_t *v = json_is_object(row) ? json_object_get(row, io->name) : row;
        if (!v || !flat(v, io, 0, ref_f, ref_i, n))
            return 0;
    }
    return 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    decl dc = decl_of(data[0]);
    const char *body = (const char *)data + 1;
    size_t len = size - 1;
    md_arrays a;
    md_err err;
    md_err_clear(&err);
    int columnar = 0;
    md_status st = md_named_decode(body, len, dc.in, dc.n, MAX_VALUES, &a, &columnar, &err);
    if (st != MD_OK) {
        if (err.msg[0] == '\0' || a.n != 0)
            abort();
        return 0;
    }
    size_t total = 0;
    for (int k = 0; k < a.n; k++) {
        md_array *x = &a.a[k];
        int64_t prod = 1;
        for (int d = 0; d < x->ndim; d++)
            prod *= x->shape[d];
        if ((size_t)prod != x->count || x->shape[0] < 0 || x->is_int != dc.in[k].is_int ||
            strcmp(x->name, dc.in[k].name) != 0)
            abort();
        if (!columnar && x->shape[0] != a.a[0].shape[0])
            abort();
        if (x->count && !(x->is_int ? (void *)x->i64 : (void *)x->f32))
            abort();
        for (size_t v = 0; !x->is_int && v < x->count; v++)
            if (!isfinite(x->f32[v]))
                abort();
        total += x->count;
    }
    if (a.n != dc.n || total > MAX_VALUES)
        abort();
    /* jansson reads the same values (it refuses NUL bytes, and numbers past
     * its range, which the decoder reads as floats) */
    json_error_t jerr;
    json_t *root = memchr(body, 0, len) ? NULL : json_loadb(body, len, 0, &jerr);
    if (!root) {
        if (!memchr(body, 0, len) && !strstr(jerr.text, "too big") &&
            !strstr(jerr.text, "overflow"))
            abort(); /* the decoder accepted what is not JSON */
        md_arrays_free(&a);
        return 0;
    }
    for (int k = 0; k < a.n; k++) {
        size_t n;
        if (!reference(root, &dc, k, columnar, &n))
            abort(); /* accepted a body whose tree does not have the declared shape */
        md_array *x = &a.a[k];
        if (n != x->count)
            abort();
        for (size_t v = 0; v < n; v++)
            if (x->is_int ? x->i64[v] != ref_i[v] : x->f32[v] != (float)ref_f[v])
                abort();
    }
    json_decref(root);
    md_arrays_free(&a);
    return 0;
}
