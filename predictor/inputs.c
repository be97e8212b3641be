/*
 * inputs.c - a version's declared inputs (config.inputs): named arrays
 * packed into the rows its batcher moves (md_model_pack).
 *
 * DESIGN
 * The batcher moves rows of 4-byte words and knows nothing of names: it
 * concatenates requests' rows into a batch and splits the outputs back. So a
 * request for a version with several inputs becomes one row per sample, the
 * inputs' values side by side in forward's order, float32 in one word each
 * and integers as int64 in two (native byte order), never through float:
 * token ids and categorical indices past 2^24 stay exact. The backend cuts
 * the batch back into one tensor per input (md_torch_forward_io). Two
 * requests share a batch only when their rows are the same version's, so
 * every row of a batch has the same layout; a tensor not packed by
 * md_model_pack for that version is refused at submit.
 * Each input's preprocess applies at submit (md_inputs_preprocess), with the
 * version the rows go to: a shadow's copy of a request gets its own.
 * Costs: the arrays as decoded plus the packed rows, each about the values'
 * size: a small multiple of the request's.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model_impl.h"

static md_status bad(md_err *err, const md_model *m, const char *fmt, const char *name,
                     const char *detail)
{
    char msg[512];
    snprintf(msg, sizeof msg, fmt, name, detail);
    return md_err_setc(err, MD_EINVAL, "invalid_input", "%s (model %s version %d)", msg,
                       m->name, md_model_version(m));
}

/* The range an integer input's dtype holds; refused past it rather than wrapped. */
static int int_fits(md_dtype t, int64_t v)
{
    switch (t) {
    case MD_U8:
        return v >= 0 && v <= 255;
    case MD_I32:
        return v >= INT32_MIN && v <= INT32_MAX;
    case MD_BOOL:
        return v == 0 || v == 1;
    default:
        return 1;
    }
}

static void names_of(const md_model *m, char *out, size_t size)
{
    int len = 0;
    out[0] = 0;
    for (int i = 0; i < m->n_in && len >= 0 && (size_t)len < size; i++)
        len += snprintf(out + len, size - (size_t)len, "%s\"%s\"", i ? ", " : "", m->in[i].name);
}

md_status md_model_pack(const md_model *m, const md_arrays *a, md_tensor *out, md_err *err)
{
    memset(out, 0, sizeof *out);
    char names[256], detail[256];
    names_of(m, names, sizeof names);
    if (!m->n_in)
        return md_err_setc(err, MD_EINVAL, "invalid_input",
                           "model %s version %d declares no named inputs: send its rows as a "
                           "JSON array",
                           m->name, md_model_version(m));
    /* every array names an input */
    for (int k = 0; k < a->n; k++) {
        int known = 0;
        for (int i = 0; i < m->n_in && !known; i++)
            known = strcmp(a->a[k].name, m->in[i].name) == 0;
        if (!known)
            return bad(err, m, "the request has an input \"%s\" the model does not take; it "
                               "takes %s",
                       a->a[k].name, names);
    }
    const md_array *by[MD_MAX_IO];
    int64_t rows = -1;
    const char *rows_from = NULL;
    for (int i = 0; i < m->n_in; i++) {
        const md_io *io = &m->in[i];
        by[i] = NULL;
        for (int k = 0; k < a->n && !by[i]; k++)
            if (strcmp(a->a[k].name, io->name) == 0)
                by[i] = &a->a[k];
        const md_array *x = by[i];
        if (!x) {
            snprintf(detail, sizeof detail, "%s", names);
            return bad(err, m, "input \"%s\" is missing; the model takes %s", io->name, detail);
        }
        char want[128], got[128];
        md_fmt_dims(want, sizeof want, io->shape, io->ndim);
        int same = x->ndim == io->ndim + 1;
        for (int d = 0; same && d < io->ndim; d++)
            same = x->shape[d + 1] == io->shape[d];
        if (!same) {
            if (x->ndim >= 1)
                snprintf(detail, sizeof detail, "its rows have shape %s where the model declares "
                         "%s", md_fmt_dims(got, sizeof got, x->shape + 1, x->ndim - 1), want);
            else
                snprintf(detail, sizeof detail, "it is one value where rows of shape %s are "
                         "expected", want);
            return bad(err, m, "input \"%s\": %s", io->name, detail);
        }
        if (rows >= 0 && x->shape[0] != rows) {
            snprintf(detail, sizeof detail, "%lld rows, and input \"%s\" has %lld; every input "
                     "needs one row per sample",
                     (long long)x->shape[0], rows_from, (long long)rows);
            return bad(err, m, "input \"%s\" has %s", io->name, detail);
        }
        rows = x->shape[0];
        rows_from = io->name;
        if (x->datatype[0]) { /* V2 names the datatype: it must be the declared one */
            static const struct {
                const char *v2, *dtype;
            } same[] = {{"FP32", "float32"}, {"FP64", "float64"}, {"INT64", "int64"},
                        {"INT32", "int32"},  {"UINT8", "uint8"},  {"BOOL", "bool"}};
            const char *want = NULL;
            for (size_t k = 0; k < sizeof same / sizeof same[0]; k++)
                if (strcmp(same[k].dtype, io->dtype_name) == 0)
                    want = same[k].v2;
            if (want && strcmp(want, x->datatype) != 0) {
                snprintf(detail, sizeof detail, "is %s, and the model declares %s: send "
                         "datatype %s", x->datatype, io->dtype_name, want);
                return bad(err, m, "input \"%s\" %s", io->name, detail);
            }
        }
        if (io->is_int && !x->is_int) {
            snprintf(detail, sizeof detail, "%s", io->dtype_name);
            return bad(err, m, "input \"%s\" is declared %s: send integers (floats are not "
                               "rounded)",
                       io->name, detail);
        }
    }
    if (rows < 1)
        return md_err_setc(err, MD_EINVAL, "invalid_input",
                           "the request has no rows; send at least one");
    size_t words;
    if (md_mul_size((size_t)rows, (size_t)m->row_size, &words))
        return md_err_setc(err, MD_ETOOBIG, "too_many_values", "the request has too many rows");
    float *buf = md_mallocarray_checked(words, sizeof(float), "the request's rows", err);
    if (!buf)
        return MD_ENOMEM;
    for (int i = 0; i < m->n_in; i++) {
        const md_io *io = &m->in[i];
        const md_array *x = by[i];
        for (int64_t r = 0; r < rows; r++) {
            float *row = buf + r * m->row_size + io->off;
            if (io->is_int) {
                const int64_t *src = x->i64 + r * io->values;
                for (int64_t v = 0; v < io->values; v++)
                    if (!int_fits(io->dtype, src[v])) {
                        free(buf);
                        snprintf(detail, sizeof detail, "%lld in row %lld does not fit its dtype "
                                 "%s", (long long)src[v], (long long)r, io->dtype_name);
                        return bad(err, m, "input \"%s\": %s", io->name, detail);
                    }
                memcpy(row, src, (size_t)io->values * sizeof(int64_t));
                continue;
            }
            for (int64_t v = 0; v < io->values; v++)
                row[v] = x->is_int ? (float)x->i64[r * io->values + v]
                                   : x->f32[r * io->values + v];
        }
    }
    out->ndim = 2;
    out->shape[0] = rows;
    out->shape[1] = m->row_size;
    out->count = words;
    out->data = buf;
    out->packed = m->layout;
    return MD_OK;
}

md_status md_model_pack_rows(const md_model *m, float *words, int64_t rows, md_tensor *out,
                             md_err *err)
{
    memset(out, 0, sizeof *out);
    if (!m->n_in || rows < 1) {
        free(words);
        return md_err_setc(err, MD_EINVAL, "invalid_input", "model %s version %d: no rows, or "
                           "no named inputs to pack them for", m->name, md_model_version(m));
    }
    for (int i = 0; i < m->n_in; i++) {
        const md_io *io = &m->in[i];
        for (int64_t r = 0; r < rows; r++) {
            float *row = words + r * m->row_size + io->off;
            if (io->is_int) { /* the reader checked its dtype's range: again, cheaply */
                for (int64_t v = 0; v < io->values; v++) {
                    int64_t x;
                    memcpy(&x, row + 2 * v, sizeof x);
                    if (!int_fits(io->dtype, x)) {
                        free(words);
                        return md_err_setc(err, MD_EINVAL, "invalid_input",
                                           "input \"%s\": %lld in row %lld does not fit its "
                                           "dtype %s",
                                           io->name, (long long)x, (long long)r, io->dtype_name);
                    }
                }
            }
        }
    }
    out->ndim = 2;
    out->shape[0] = rows;
    out->shape[1] = m->row_size;
    out->count = (size_t)rows * (size_t)m->row_size;
    out->data = words;
    out->packed = m->layout;
    return MD_OK;
}

void md_inputs_preprocess(const md_model *m, float *words, int64_t rows)
{
    for (int i = 0; i < m->n_in; i++) {
        const md_io *io = &m->in[i];
        if (io->is_int || (io->scale == 1.0 && io->n_norm == 0))
            continue;
        for (int64_t r = 0; r < rows; r++) {
            float *row = words + r * m->row_size + io->off;
            for (int64_t v = 0; v < io->values; v++) {
                float f = row[v];
                if (io->scale != 1.0)
                    f *= (float)io->scale;
                if (io->n_norm == 1)
                    f = (f - io->mean[0]) / io->std[0];
                else if (io->n_norm > 1)
                    f = (f - io->mean[v / io->norm_inner]) / io->std[v / io->norm_inner];
                row[v] = f;
            }
        }
    }
}
