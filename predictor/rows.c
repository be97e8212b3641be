/*
 * rows.c - JSON bodies for a version with named inputs (md_named_decode):
 * rows as objects keyed by input name (TF Serving's row format, KServe V1's
 * instances), TF Serving's columnar {"inputs": {name: rows}}, and for a
 * version with one declared input its rows as a plain array.
 *
 * DESIGN
 * The declared shapes are known before the body is read, so the decoder is
 * a recursive descent that expects exactly them: each value goes straight
 * into its input's array (float32, or int64 for integer inputs: an integer
 * is read from its digits, never through a double, and a number with a
 * fraction or an exponent there is refused, not rounded), and the first
 * thing that does not fit is answered, naming the row, the input and what
 * was expected. Nothing is built but the arrays, which grow by doubling
 * under max_values, so a body costs at most about twice its values' size.
 * Keys it does not know are refused rather than ignored (a misspelt input
 * would otherwise read as missing, or be lost); "signature_name" (TF
 * Serving's) is skipped.
 */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../config/md_json.h"
#include "numparse.h"
#include "predictor.h"

typedef struct rd {
    const char *s;
    size_t len, i;
    const md_io_info *in;
    int n;
    size_t max_values, values;
    md_arrays *out;
    size_t cap[MD_MAX_IO]; /* values each array has room for */
    int64_t row;           /* the row being read (rows format), -1: columns */
    md_err *err;
} rd;

static void ws(rd *r) { r->i = md_json_blank(r->s, r->len, r->i); }

static int at(rd *r, char c)
{
    ws(r);
    return r->i < r->len && r->s[r->i] == c;
}

static md_status fail(rd *r, int input, const char *fmt, const char *detail)
{
    char where[160] = "";
    if (input >= 0 && r->row >= 0)
        snprintf(where, sizeof where, "row %lld, input \"%s\": ", (long long)r->row,
                 r->in[input].name);
    else if (input >= 0)
        snprintf(where, sizeof where, "input \"%s\": ", r->in[input].name);
    else if (r->row >= 0)
        snprintf(where, sizeof where, "row %lld: ", (long long)r->row);
    char msg[400];
    snprintf(msg, sizeof msg, fmt, detail);
    return md_err_setc(r->err, MD_EINVAL, "invalid_input", "%s%s (at byte %zu)", where, msg,
                       r->i);
}

static md_status expect(rd *r, int input, char c, const char *what)
{
    if (at(r, c)) {
        r->i++;
        return MD_OK;
    }
    return fail(r, input, "expected %s", what);
}

/* Room for one more value in input k's array. */
static md_status room(rd *r, int k)
{
    md_array *a = &r->out->a[k];
    if (r->values >= r->max_values)
        return md_err_setc(r->err, MD_ETOOBIG, "too_many_values",
                           "the request holds more than the limit of %zu values; send fewer "
                           "rows per request",
                           r->max_values);
    if (a->count < r->cap[k])
        return MD_OK;
    size_t cap = r->cap[k] ? r->cap[k] * 2 : 256;
    if (cap > r->max_values)
        cap = r->max_values;
    void *p = r->in[k].is_int ? realloc(a->i64, cap * sizeof(int64_t))
                              : realloc(a->f32, cap * sizeof(float));
    if (!p)
        return md_err_setc(r->err, MD_ENOMEM, "out_of_memory",
                           "no memory for %zu values of input \"%s\"", cap, r->in[k].name);
    if (r->in[k].is_int)
        a->i64 = p;
    else
        a->f32 = p;
    r->cap[k] = cap;
    return MD_OK;
}

/* One number (or true/false for an integer input) into input k. */
static md_status number(rd *r, int k)
{
    ws(r);
    const char *s = r->s + r->i, *end = r->s + r->len, *p = s;
    md_array *a = &r->out->a[k];
    md_status st = room(r, k);
    if (st != MD_OK)
        return st;
    if (r->in[k].is_int && (end - p >= 4 && (!memcmp(p, "true", 4) || (end - p >= 5 && !memcmp(p, "false", 5))))) {
        int t = *p == 't';
        a->i64[a->count++] = t;
        r->values++;
        r->i += t ? 4 : 5;
        return MD_OK;
    }
    int neg = p < end && *p == '-';
    p += neg;
    if (p >= end || *p < '0' || *p > '9')
        return fail(r, k, "expected a number%s", p < end && *p == '"' ? ", not a string" : "");
    const char *digits = p;
    if (*p == '0')
        p++;
    else
        while (p < end && *p >= '0' && *p <= '9')
            p++;
    int is_integer = 1;
    if (p < end && *p == '.') {
        is_integer = 0;
        p++;
        if (p >= end || *p < '0' || *p > '9')
            return fail(r, k, "expected a number%s", "");
        while (p < end && *p >= '0' && *p <= '9')
            p++;
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        is_integer = 0;
        p++;
        if (p < end && (*p == '+' || *p == '-'))
            p++;
        if (p >= end || *p < '0' || *p > '9')
            return fail(r, k, "expected a number%s", "");
        while (p < end && *p >= '0' && *p <= '9')
            p++;
    }
    char text[40];
    snprintf(text, sizeof text, "%.*s%s", (int)(p - s < 32 ? p - s : 32), s, p - s > 32 ? "..." : "");
    if (r->in[k].is_int) {
        if (!is_integer)
            return fail(r, k, "%s is not an integer, and the input is declared an integer type: "
                              "send whole numbers (they are not rounded)",
                        text);
        uint64_t v = 0;
        for (const char *q = digits; q < p; q++) {
            if (v > (UINT64_MAX - 9) / 10)
                return fail(r, k, "%s is past int64's range", text);
            v = v * 10 + (uint64_t)(*q - '0');
        }
        if (v > (uint64_t)INT64_MAX + (uint64_t)neg)
            return fail(r, k, "%s is past int64's range", text);
        a->i64[a->count++] = neg ? (int64_t)(0 - v) : (int64_t)v;
    } else {
        double d;
        if (md_parse_double(s, p, &d) != 0)
            return fail(r, k, "expected a number%s", "");
        if (!(fabs(d) <= FLT_MAX))
            return fail(r, k, "%s is past float32's range", text);
        a->f32[a->count++] = (float)d;
    }
    r->values++;
    r->i += (size_t)(p - s);
    return MD_OK;
}

/* A value of input k's shape from dim `d` on: nested arrays of exactly the
 * declared lengths, numbers at the bottom. */
static md_status value(rd *r, int k, int d)
{
    const md_io_info *io = &r->in[k];
    if (d == io->ndim)
        return number(r, k);
    char what[96];
    snprintf(what, sizeof what, "an array of %lld values (the input's shape at dimension %d)",
             (long long)io->shape[d], d);
    md_status st = expect(r, k, '[', what);
    if (st != MD_OK)
        return st;
    for (int64_t j = 0; j < io->shape[d]; j++) {
        if (j && (st = expect(r, k, ',', what)) != MD_OK)
            return st;
        if (at(r, ']'))
            return fail(r, k, "%s; it has fewer", what);
        if ((st = value(r, k, d + 1)) != MD_OK)
            return st;
    }
    if (at(r, ','))
        return fail(r, k, "%s; it has more", what);
    return expect(r, k, ']', what);
}

/* A key string into out (at most size - 1 bytes; longer ones are cut, and
 * so match no input). */
static md_status key(rd *r, char *out, size_t size)
{
    ws(r);
    md_json_scan sc;
    memset(&sc, 0, sizeof sc);
    int escaped = 0;
    size_t end = r->i < r->len && r->s[r->i] == '"'
                     ? md_json_skip_string(r->s, r->len, r->i, &escaped, &sc)
                     : 0;
    if (!end)
        return fail(r, -1, "expected a key string%s", "");
    size_t n = end - r->i - 2;
    if (escaped || n >= size)
        n = size - 1 < n ? size - 1 : n; /* an escaped key matches only if unescaped alike */
    memcpy(out, r->s + r->i + 1, n);
    out[n] = 0;
    r->i = end;
    return expect(r, -1, ':', "':' after the key");
}

static int input_index(rd *r, const char *name)
{
    for (int k = 0; k < r->n; k++)
        if (strcmp(r->in[k].name, name) == 0)
            return k;
    return -1;
}

static void input_names(rd *r, char *out, size_t size)
{
    int len = 0;
    out[0] = 0;
    for (int k = 0; k < r->n && len >= 0 && (size_t)len < size; k++)
        len += snprintf(out + len, size - (size_t)len, "%s\"%s\"", k ? ", " : "", r->in[k].name);
}

static md_status unknown_input(rd *r, const char *name)
{
    char names[256], msg[400];
    input_names(r, names, sizeof names);
    snprintf(msg, sizeof msg, "\"%.64s\" is not an input of the model; it takes %s", name, names);
    return fail(r, -1, "%s", msg);
}

/* One row: an object with every input once, or (one input) its value. */
static md_status row(rd *r)
{
    md_status st;
    if (!at(r, '{')) {
        if (r->n == 1)
            return value(r, 0, 0);
        char names[256], msg[400];
        input_names(r, names, sizeof names);
        snprintf(msg, sizeof msg, "expected an object with the inputs %s", names);
        return fail(r, -1, "%s", msg);
    }
    r->i++;
    int seen[MD_MAX_IO] = {0};
    if (!at(r, '}'))
        for (;;) {
            char name[MD_IO_NAME_MAX + 1];
            if ((st = key(r, name, sizeof name)) != MD_OK)
                return st;
            int k = input_index(r, name);
            if (k < 0)
                return unknown_input(r, name);
            if (seen[k])
                return fail(r, k, "the input is given twice%s", "");
            seen[k] = 1;
            if ((st = value(r, k, 0)) != MD_OK)
                return st;
            if (at(r, ',')) {
                r->i++;
                continue;
            }
            break;
        }
    if ((st = expect(r, -1, '}', "',' or '}' in the row's object")) != MD_OK)
        return st;
    for (int k = 0; k < r->n; k++)
        if (!seen[k])
            return fail(r, k, "the input is missing from the row's object%s", "");
    return MD_OK;
}

/* '[' rows ']' */
static md_status rows(rd *r)
{
    ws(r);
    size_t open = r->i; /* the '[': a one-input row without the batch's brackets starts here */
    md_status st = expect(r, -1, '[', "an array of rows");
    if (st != MD_OK)
        return st;
    r->row = 0;
    if (at(r, ']'))
        return fail(r, -1, "the array of rows is empty; send at least one row%s", "");
    /* one row of a one-input version, sent without the batch's brackets */
    ws(r);
    if (r->n == 1 && r->in[0].ndim > 0 && r->i < r->len && r->s[r->i] != '[' &&
        r->s[r->i] != '{') {
        r->i = open; /* back to '[': the array is the row */
        st = value(r, 0, 0);
        r->out->a[0].shape[0] = 1;
        return st;
    }
    for (;;) {
        if ((st = row(r)) != MD_OK)
            return st;
        r->row++;
        if (at(r, ',')) {
            r->i++;
            continue;
        }
        break;
    }
    for (int k = 0; k < r->n; k++)
        r->out->a[k].shape[0] = r->row;
    return expect(r, -1, ']', "',' or ']' between rows");
}

/* columns: {"name": [rows...], ...}, or for one input its rows. */
static md_status columns(rd *r)
{
    md_status st;
    r->row = -1;
    if (!at(r, '{')) {
        if (r->n != 1)
            return fail(r, -1, "\"inputs\" must be an object with one array of rows per "
                               "input%s", "");
        return rows(r);
    }
    r->i++;
    int seen[MD_MAX_IO] = {0};
    if (!at(r, '}'))
        for (;;) {
            char name[MD_IO_NAME_MAX + 1];
            if ((st = key(r, name, sizeof name)) != MD_OK)
                return st;
            int k = input_index(r, name);
            if (k < 0)
                return unknown_input(r, name);
            if (seen[k])
                return fail(r, k, "the input is given twice%s", "");
            seen[k] = 1;
            if ((st = expect(r, k, '[', "an array of rows")) != MD_OK)
                return st;
            int64_t n = 0;
            if (!at(r, ']'))
                for (;;) {
                    if ((st = value(r, k, 0)) != MD_OK)
                        return st;
                    n++;
                    if (at(r, ',')) {
                        r->i++;
                        continue;
                    }
                    break;
                }
            if ((st = expect(r, k, ']', "',' or ']' between rows")) != MD_OK)
                return st;
            r->out->a[k].shape[0] = n;
            if (at(r, ',')) {
                r->i++;
                continue;
            }
            break;
        }
    if ((st = expect(r, -1, '}', "',' or '}' in \"inputs\"")) != MD_OK)
        return st;
    for (int k = 0; k < r->n; k++)
        if (!seen[k])
            return fail(r, k, "the input is missing from \"inputs\"%s", "");
    return MD_OK;
}

md_status md_named_decode(const char *body, size_t len, const md_io_info *inputs, int n,
                          size_t max_values, md_arrays *out, int *columnar, md_err *err)
{
    memset(out, 0, sizeof *out);
    *columnar = 0;
    if (n < 1 || n > MD_MAX_IO)
        return md_err_set(err, MD_EINVAL, "1 to %d inputs", MD_MAX_IO);
    rd r = {.s = body ? body : "", .len = body ? len : 0, .in = inputs, .n = n,
            .max_values = max_values, .out = out, .row = -1, .err = err};
    out->n = n;
    for (int k = 0; k < n; k++) {
        md_array *a = &out->a[k];
        snprintf(a->name, sizeof a->name, "%s", inputs[k].name);
        a->is_int = inputs[k].is_int;
        a->ndim = 1 + inputs[k].ndim;
        memcpy(a->shape + 1, inputs[k].shape, sizeof(int64_t) * (size_t)inputs[k].ndim);
    }
    md_status st = MD_OK;
    if (at(&r, '[')) {
        st = rows(&r);
    } else if (at(&r, '{')) {
        r.i++;
        int got = 0;
        if (!at(&r, '}'))
            for (;;) {
                char k[32];
                if ((st = key(&r, k, sizeof k)) != MD_OK)
                    break;
                if (strcmp(k, "signature_name") == 0) {
                    md_json_scan sc;
                    memset(&sc, 0, sizeof sc);
                    size_t e = md_json_skip(r.s, r.len, md_json_blank(r.s, r.len, r.i), 16, &sc);
                    if (!e) {
                        st = fail(&r, -1, "\"signature_name\" is not a JSON value%s", "");
                        break;
                    }
                    r.i = e;
                } else if ((strcmp(k, "instances") == 0 || strcmp(k, "inputs") == 0) && !got) {
                    got = 1;
                    *columnar = k[1] == 'n' && k[2] == 'p';
                    if ((st = *columnar ? columns(&r) : rows(&r)) != MD_OK)
                        break;
                    r.row = -1;
                } else {
                    st = fail(&r, -1, got ? "give \"instances\" (rows) or \"inputs\" "
                                            "(columns), not both (\"%s\")"
                                          : "unknown key \"%s\"; give \"instances\" (rows as "
                                            "objects) or \"inputs\" (columns)",
                              k);
                    break;
                }
                if (at(&r, ',')) {
                    r.i++;
                    continue;
                }
                break;
            }
        if (st == MD_OK)
            st = expect(&r, -1, '}', "',' or '}'");
        if (st == MD_OK && !got)
            st = fail(&r, -1, "the object has no \"instances\" (rows) nor \"inputs\" "
                              "(columns)%s", "");
    } else {
        st = fail(&r, -1, "the body must be a JSON array of rows, {\"instances\": rows} or "
                          "{\"inputs\": {name: rows}}%s", "");
    }
    if (st == MD_OK && md_json_blank(r.s, r.len, r.i) != r.len)
        st = fail(&r, -1, "unexpected text after the JSON value%s", "");
    if (st != MD_OK) {
        md_arrays_free(out);
        return st;
    }
    return MD_OK;
}
