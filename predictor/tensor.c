/*
 * tensor.c - JSON request bodies to tensors (the row scanner), and the
 * helpers every wire format shares: md_tensor, sizes, finiteness, top-k.
 * NPY is in npy.c and the Open Inference Protocol V2 in v2.c; what they
 * share with this file is declared in tensor_internal.h.
 *
 * DESIGN
 * jansson builds a node per number (about 140 us for one 784-float row),
 * which would cap a core near 7k rows/s. So prediction bodies are decoded by
 * a small hand-written scanner: it walks the nested arrays once, checks that
 * they are rectangular, and writes each number straight into a float buffer.
 * Numbers take Clinger's fast path (mantissa <= 2^53, |exp10| <= 22: exact
 * in double) and fast_float otherwise (numparse.h), exact too, so results
 * match strtod bit for bit (tests/fuzz_number.c checks it).
 * The scanner is fuzzed (tests/fuzz_tensor.c) and unit-tested on every
 * malformed input class. Only the few object keys of the dialects are parsed.
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

void md_tensor_free(md_tensor *t)
{
    if (!t)
        return;
    free(t->data);
    memset(t, 0, sizeof *t);
}

void md_arrays_free(md_arrays *a)
{
    if (!a)
        return;
    for (int i = 0; i < a->n && i < MD_MAX_IO; i++) {
        free(a->a[i].f32);
        free(a->a[i].i64);
    }
    memset(a, 0, sizeof *a);
}

md_array *md_arrays_find(md_arrays *a, const char *name)
{
    for (int i = 0; i < a->n; i++)
        if (strcmp(a->a[i].name, name) == 0)
            return &a->a[i];
    return NULL;
}

/* ---- JSON scanner ---- */

typedef struct scan {
    const char *p, *end;
    float *buf;
    size_t n, cap, max_values;
    int ndim;              /* depth of numbers, 0 until the first number */
    int64_t shape[MD_MAX_DIMS];
    int known[MD_MAX_DIMS];
    int64_t idx[MD_MAX_DIMS];
    md_err *err;
} scan;

static inline int blank(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

static void ws(scan *s)
{
    while (s->p < s->end && blank(*s->p))
        s->p++;
}

/* After an element: skip blanks, then consume ',' (returns 1, more follow)
 * or `close` (returns 0, the list ended); -1 when neither is there. */
static int separator(scan *s, char close)
{
    ws(s);
    if (s->p < s->end && (*s->p == ',' || *s->p == close))
        return *s->p++ == ',';
    return -1;
}

/* "row 3, column 7" for the current position. */
static void where(scan *s, int depth, char *out, size_t size)
{
    int n = snprintf(out, size, "row %lld", (long long)s->idx[0]);
    if (depth > 0)
        n += snprintf(out + n, size - (size_t)n, ", column %lld", (long long)s->idx[1]);
    for (int d = 2; d <= depth && (size_t)n < size; d++)
        n += snprintf(out + n, size - (size_t)n, "[%lld]", (long long)s->idx[d]);
}

static md_status fail_at(scan *s, int depth, const char *what)
{
    char pos[96];
    where(s, depth, pos, sizeof pos);
    return md_err_setc(s->err, MD_EINVAL, "invalid_input", "%s: %s", pos, what);
}


static const double pow10_tab[23] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,
                                     1e8,  1e9,  1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
                                     1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

/* Eight ASCII digits at once (SWAR): the value of the 8 bytes of `v`
 * (little-endian load), all '0'..'9'. What clients send are float32s printed
 * by Python with 17 significant digits; taking them 8 at a time halves the
 * decoder's time per number (perf: number() was 21% of a 64-row
 * full-precision request's CPU). tests/fuzz_number.c checks the results
 * against strtod. */
static inline uint64_t eight_value(uint64_t v)
{
    v -= 0x3030303030303030ull;
    v = v * 10 + (v >> 8); /* pairs of digits in every other byte */
    v = (((v & 0x000000FF000000FFull) * 0x000F424000000064ull) +
         (((v >> 16) & 0x000000FF000000FFull) * 0x0000271000000001ull)) >> 32;
    return v;
}

static inline uint64_t load8(const char *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline int is_digit(char c) { return (unsigned)(c - '0') < 10u; }

/* How many of the 8 bytes of `v` (little-endian load) are digits before the
 * first that is not, 0..8. A byte below '0' borrows into the bytes after it
 * only, and a carry runs upward only from a byte already flagged, so the
 * lowest flagged byte is exactly the first non-digit. */
static inline int digit_run(uint64_t v)
{
    uint64_t nd = ((v + 0x4646464646464646ull) | (v - 0x3030303030303030ull)) & 0x8080808080808080ull;
    return nd ? __builtin_ctzll(nd) >> 3 : 8;
}

/* The value of the first k (1..7) digits of `v`: shifted to the top, with
 * '0's filled in before them, they read as eight digits. */
static inline uint64_t run_value(uint64_t v, int k)
{
    return eight_value((v << (8 * (8 - k))) | (0x3030303030303030ull >> (8 * k)));
}

static const uint64_t pow10_u64[9] = {1, 10, 100, 1000, 10000, 100000, 1000000, 10000000,
                                      100000000};

/* A run of digits at p into mant (while it has fewer than 19 digits):
 * eight at a time, and the rest of the run, up to seven, in one step more,
 * so a number's length costs no mispredicted loop exit. `frac`: digits after
 * the point, which lower exp10, where digits dropped past the 19th raise it
 * in the integer part. Returns the end of the run. */
static inline __attribute__((always_inline)) const char *
digits(const char *p, const char *end, int frac, unsigned long long *mant, int *ndig,
       int64_t *exp10, int *dropped)
{
    while (end - p >= 8) {
        uint64_t w = load8(p);
        int k = digit_run(w);
        if (*ndig + k > 19)
            break; /* more digits than a uint64 holds: one by one below */
        if (k == 8) {
            *mant = *mant * 100000000ull + eight_value(w);
        } else if (k > 0) {
            *mant = *mant * pow10_u64[k] + run_value(w, k);
        }
        *ndig += k;
        if (frac)
            *exp10 -= k;
        p += k;
        if (k < 8)
            return p;
    }
    while (p < end && is_digit(*p)) {
        if (*ndig < 19) {
            *mant = *mant * 10 + (unsigned)(*p - '0');
            ++*ndig;
            if (frac)
                --*exp10;
        } else {
            if (!frac)
                ++*exp10;
            *dropped |= *p != '0';
        }
        p++;
    }
    return p;
}

/* Parse a JSON number at *pp (before end) into *v, and move *pp past it.
 * Returns 0 or -1 if not a number. */
static inline __attribute__((always_inline)) int number(const char **pp, const char *end, double *v)
{
    const char *p = *pp, *start = p;
    int neg = 0;
    if (p < end && *p == '-')
        neg = 1, p++;
    if (p >= end || !is_digit(*p))
        return -1;
    unsigned long long mant = 0;
    int ndig = 0, dropped = 0; /* dropped: a nonzero digit past the 19th */
    int64_t exp10 = 0; /* 64 bits: a body of 2^31 digits is possible (max_body_bytes) */
    if (*p == '0')
        p++;
    else
        p = digits(p, end, 0, &mant, &ndig, &exp10, &dropped);
    if (p < end && *p == '.') {
        p++;
        if (p >= end || !is_digit(*p))
            return -1;
        if (mant == 0) { /* leading zeros of the fraction do not count */
            while (end - p >= 8) {
                uint64_t z = load8(p) ^ 0x3030303030303030ull;
                int k = z ? __builtin_ctzll(z) >> 3 : 8;
                p += k;
                exp10 -= k;
                if (k < 8)
                    break;
            }
            while (p < end && *p == '0')
                p++, exp10--;
        }
        p = digits(p, end, 1, &mant, &ndig, &exp10, &dropped);
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        p++;
        int eneg = 0, e = 0;
        if (p < end && (*p == '+' || *p == '-'))
            eneg = *p == '-', p++;
        if (p >= end || !is_digit(*p))
            return -1;
        while (p < end && is_digit(*p)) {
            if (e < 100000)
                e = e * 10 + (*p - '0');
            p++;
        }
        exp10 += eneg ? -e : e;
    }
    *pp = p;
    if (mant == 0) { /* half the pixels of an image: no division for them */
        *v = neg ? -0.0 : 0.0;
        return 0;
    }
    if (ndig <= 15 && mant < (1ULL << 53) && exp10 >= -22 && exp10 <= 22) {
        double d = (double)mant;
        d = exp10 < 0 ? d / pow10_tab[-exp10] : d * pow10_tab[exp10];
        *v = neg ? -d : d;
        return 0;
    }
    /* the rest (more digits, bigger exponents): fast_float, exact like
     * strtod and several times faster on the 17 digits of a float32 printed
     * by Python (numparse.h). Its Eisel-Lemire step takes the significand
     * accumulated above when no digit was dropped; the digits are read again
     * only when that cannot decide. */
    double r; /* not v: its address would keep the caller's value in memory */
    if ((dropped || md_double_from_parts(mant, exp10, neg, &r) != 0) &&
        md_parse_double(start, p, &r) != 0)
        return -1;
    *v = r;
    return 0;
}

/* Room for more values (s->n == s->cap): double, up to max_values. */
static md_status grow(scan *s)
{
    if (s->n >= s->max_values)
        return md_err_setc(s->err, MD_ETOOBIG, "too_many_values",
                           "the input has more than %zu numbers; send fewer rows per request",
                           s->max_values);
    size_t cap = s->cap ? s->cap * 2 : 1024;
    if (cap > s->max_values)
        cap = s->max_values;
    float *b = realloc(s->buf, cap * sizeof(float));
    if (!b)
        return md_err_set(s->err, MD_ENOMEM, "out of memory for %zu input values", cap);
    s->buf = b;
    s->cap = cap;
    return MD_OK;
}

static md_status push(scan *s, float v)
{
    md_status st;
    if (s->n == s->cap && (st = grow(s)) != MD_OK)
        return st;
    s->buf[s->n++] = v;
    return MD_OK;
}

/* The fast path of an innermost array, once the depth of numbers is known
 * (every row after the first, and the first after its first number; a V2
 * "data" array is one flat row): number after number, with the cursor, the
 * output and the count in registers, and none of the per-element checks of
 * array()'s loop (nesting, ragged depth, blanks before each element). It
 * stops at the first element it does not take as it is (not a number, not
 * finite in float32) and leaves it, at its start, to array()'s loop, which
 * reports it exactly as it would have; `start`: the elements of the array
 * taken before, *count: those and the ones taken here, *closed: whether the
 * array closed. Half the decode time of an integer body went to those
 * checks. */
static md_status leaf(scan *s, int d, int64_t start, int64_t *count, int *closed)
{
    md_status st;
    *closed = 0;
    const char *p = s->p, *end = s->end;
    size_t n = s->n;
    int64_t c = start;
    for (;;) {
        const char *q = p;
        double v;
        if (number(&q, end, &v) != 0)
            break;
        float f = (float)v;
        if (!isfinite(f))
            break;
        if (n == s->cap) { /* after the number: a bad one is named as push() names it */
            s->n = n;
            if ((st = grow(s)) != MD_OK)
                return st;
        }
        s->buf[n++] = f;
        c++;
        p = q;
        while (p < end && blank(*p))
            p++;
        if (p < end && *p == ',') {
            p++;
            while (p < end && blank(*p))
                p++;
            continue;
        }
        if (p < end && *p == ']') {
            s->p = p + 1;
            s->n = n;
            *count = c;
            *closed = 1;
            return MD_OK;
        }
        s->p = p;
        s->n = n;
        s->idx[d] = c - 1;
        return fail_at(s, d, p < end ? "expected ',' or ']'" : "the body ends inside an array");
    }
    s->p = p;
    s->n = n;
    *count = c;
    return MD_OK;
}

static md_status value_error(scan *s, int depth)
{
    const char *p = s->p;
    if (p >= s->end)
        return fail_at(s, depth, "the body ends inside an array");
    if (*p == '"')
        return fail_at(s, depth, "a string is not a number; send numbers");
    if (*p == 'N' || *p == 'I' || (*p == '-' && p + 1 < s->end && p[1] == 'I'))
        return fail_at(s, depth, "NaN and Infinity are not allowed; send finite numbers");
    if (*p == 'n')
        return fail_at(s, depth, "null is not a number");
    if (*p == 't' || *p == 'f')
        return fail_at(s, depth, "true/false is not a number");
    if (*p == '{')
        return fail_at(s, depth, "an object is not a number");
    return fail_at(s, depth, "expected a number");
}

static md_status array(scan *s, int d)
{
    s->p++; /* '[' */
    ws(s);
    int64_t count = 0;
    md_status st;
    if (s->p < s->end && *s->p == ']') {
        s->p++;
        return d == 0 ? md_err_setc(s->err, MD_EINVAL, "invalid_input",
                                    "the input has no rows; send at least one row")
                      : fail_at(s, d - 1, "an empty array is not a row");
    }
    if (s->ndim == d + 1) {
        int closed;
        if ((st = leaf(s, d, 0, &count, &closed)) != MD_OK)
            return st;
        if (closed)
            goto shape;
    }
    for (;;) {
        ws(s);
        s->idx[d] = count;
        if (s->p < s->end && *s->p == '[') {
            if (s->ndim && d + 1 >= s->ndim)
                return fail_at(s, d, "expected a number, found an array (rows are ragged)");
            if (d + 1 >= MD_MAX_DIMS)
                return fail_at(s, d, "arrays are nested too deeply (8 dimensions at most)");
            if ((st = array(s, d + 1)) != MD_OK)
                return st;
        } else {
            if (!s->ndim) {
                s->ndim = d + 1;
            } else if (s->ndim != d + 1) {
                if (s->p < s->end && (*s->p == '-' || isdigit((unsigned char)*s->p)))
                    return fail_at(s, d, "expected an array, found a number (rows are ragged)");
                return value_error(s, d);
            }
            double v;
            if (number(&s->p, s->end, &v) != 0)
                return value_error(s, d);
            if (!isfinite((float)v))
                return fail_at(s, d, "the number is outside the float32 range");
            if ((st = push(s, (float)v)) != MD_OK)
                return st;
        }
        count++;
        int more = separator(s, ']');
        if (more == 1 && s->ndim == d + 1) { /* the element was a number */
            /* the first row's depth is known now: the rest of it goes fast */
            int closed;
            ws(s);
            if ((st = leaf(s, d, count, &count, &closed)) != MD_OK)
                return st;
            if (closed)
                goto shape;
            continue;
        }
        if (more == 1)
            continue;
        if (more == 0)
            break;
        return fail_at(s, d, s->p < s->end ? "expected ',' or ']'" : "the body ends inside an array");
    }
shape:
    if (d > 0) {
        if (!s->known[d]) {
            s->known[d] = 1;
            s->shape[d] = count;
        } else if (s->shape[d] != count) {
            char what[128];
            snprintf(what, sizeof what, "has %lld values where the first row has %lld (rows are ragged)",
                     (long long)count, (long long)s->shape[d]);
            return fail_at(s, d - 1, what);
        }
    } else {
        s->shape[0] = count;
    }
    return MD_OK;
}

/* Parse "rows" at s->p into a tensor. */
static md_status rows(scan *s, md_tensor *out)
{
    ws(s);
    if (s->p >= s->end || *s->p != '[')
        return md_err_setc(s->err, MD_EINVAL, "invalid_input",
                           "expected a JSON array of rows, e.g. [[0.1, 0.2], [0.3, 0.4]]");
    md_status st = array(s, 0);
    if (st != MD_OK)
        return st;
    out->ndim = s->ndim;
    memcpy(out->shape, s->shape, sizeof s->shape);
    out->count = s->n;
    out->data = s->buf;
    s->buf = NULL;
    return MD_OK;
}

/* A key string without escapes beyond \" (keys of the dialects are plain). */
static int key(scan *s, char *out, size_t size)
{
    if (s->p >= s->end || *s->p != '"')
        return -1;
    s->p++;
    size_t n = 0;
    while (s->p < s->end && *s->p != '"') {
        if (*s->p == '\\')
            return -1;
        if (n + 1 < size)
            out[n++] = *s->p;
        s->p++;
    }
    if (s->p >= s->end)
        return -1;
    s->p++;
    out[n] = '\0';
    return 0;
}

static md_status object(scan *s, md_tensor *out)
{
    int64_t shape[MD_MAX_DIMS];
    int shape_n = -1;
    int have = 0;
    s->p++; /* '{' */
    for (;;) {
        ws(s);
        char k[32];
        if (key(s, k, sizeof k) != 0)
            return md_err_setc(s->err, MD_EINVAL, "invalid_json",
                               "the body is not valid JSON: expected a key string");
        ws(s);
        if (s->p >= s->end || *s->p != ':')
            return md_err_setc(s->err, MD_EINVAL, "invalid_json", "the body is not valid JSON: expected ':'");
        s->p++;
        ws(s);
        if (strcmp(k, "instances") == 0 || strcmp(k, "array") == 0) {
            if (have)
                return md_err_setc(s->err, MD_EINVAL, "invalid_input",
                                   "give only one of \"instances\" and \"array\"");
            md_status st = rows(s, out);
            if (st != MD_OK)
                return st;
            have = 1;
        } else if (strcmp(k, "shape") == 0) {
            if (s->p >= s->end || *s->p != '[')
                return md_err_setc(s->err, MD_EINVAL, "invalid_input", "shape must be an array of integers");
            s->p++;
            shape_n = 0;
            for (;;) {
                ws(s);
                double v;
                if (number(&s->p, s->end, &v) != 0 || v < 1 || v != floor(v) || v > 2147483647.0 ||
                    shape_n >= MD_MAX_DIMS)
                    return md_err_setc(s->err, MD_EINVAL, "invalid_input",
                                       "shape must be 1 to 8 positive integers below 2^31");
                shape[shape_n++] = (int64_t)v;
                int more = separator(s, ']');
                if (more == 1)
                    continue;
                if (more == 0)
                    break;
                return md_err_setc(s->err, MD_EINVAL, "invalid_input", "shape must be an array of integers");
            }
        } else {
            return md_err_setc(s->err, MD_EINVAL, "unknown_field",
                               "unknown key \"%s\"; send rows as an array, {\"instances\": rows} "
                               "or {\"array\": data, \"shape\": [...]}",
                               k);
        }
        int more = separator(s, '}');
        if (more == 1)
            continue;
        if (more == 0)
            break;
        return md_err_setc(s->err, MD_EINVAL, "invalid_json", "the body is not valid JSON: expected ',' or '}'");
    }
    if (!have) {
        md_tensor_free(out);
        return md_err_setc(s->err, MD_EINVAL, "invalid_input",
                           "the object has no \"instances\" or \"array\" key");
    }
    if (shape_n > 0) {
        size_t total = 1;
        for (int i = 0; i < shape_n; i++) {
            if (total > out->count)
                break; /* already too many: stop before the product can overflow */
            total *= (size_t)shape[i];
        }
        if (total != out->count) {
            size_t have_n = out->count;
            md_tensor_free(out);
            return md_err_setc(s->err, MD_EINVAL, "invalid_input",
                               "shape holds %zu values but the array has %zu", total, have_n);
        }
        out->ndim = shape_n;
        memcpy(out->shape, shape, sizeof(int64_t) * (size_t)shape_n);
    }
    return MD_OK;
}

int md_tensor_json_type(const char *content_type)
{
    return !content_type || strncasecmp(content_type, "application/json", 16) == 0 ||
           strncasecmp(content_type, "application/x-www-form-urlencoded", 33) == 0 ||
           strncasecmp(content_type, "text/plain", 10) == 0;
}

md_status md_tensor_decode(const char *body, size_t len, const char *content_type,
                           size_t max_values, md_tensor *out, md_err *err)
{
    memset(out, 0, sizeof *out);
    if (content_type && strncasecmp(content_type, "application/x-npy", 17) == 0)
        return md_npy_decode(body, len, max_values, out, err);
    if (!md_tensor_json_type(content_type))
        return md_err_setc(err, MD_EMEDIA, "unsupported_media_type",
                           "Content-Type %.60s is not accepted; send application/json or "
                           "application/x-npy",
                           content_type);
    if (!body || len == 0)
        return md_err_setc(err, MD_EINVAL, "empty_body",
                           "the request has no body; send rows such as [[0.1, 0.2]]");
    scan s = {.p = body, .end = body + len, .max_values = max_values, .err = err};
    ws(&s);
    md_status st;
    if (s.p < s.end && *s.p == '{')
        st = object(&s, out);
    else
        st = rows(&s, out);
    if (st == MD_OK) {
        ws(&s);
        if (s.p != s.end) {
            md_tensor_free(out);
            st = md_err_setc(err, MD_EINVAL, "invalid_json",
                             "unexpected text after the JSON value at byte %zu",
                             (size_t)(s.p - body));
        }
    }
    free(s.buf);
    if (st != MD_OK)
        md_tensor_free(out);
    return st;
}


md_status md_tensor_scan_rows(const char *p, const char *end, size_t max_values, md_tensor *out,
                              const char **stop, md_err *err)
{
    memset(out, 0, sizeof *out);
    scan s = {.p = p, .end = end, .max_values = max_values, .err = err};
    md_status st = rows(&s, out);
    free(s.buf); /* NULL when rows() handed it to out */
    if (st != MD_OK)
        md_tensor_free(out);
    *stop = s.p;
    return st;
}

/* The index of the first NaN or infinity among `count` floats, or `count`:
 * one branch-free pass (a float is NaN or infinite when its exponent bits
 * are all ones; the compiler vectorizes it), then a search only when one is
 * there. */
size_t md_first_not_finite(const float *buf, size_t count)
{
    uint32_t bad = 0;
    for (size_t i = 0; i < count; i++) {
        uint32_t bits;
        memcpy(&bits, &buf[i], 4);
        bad |= (uint32_t)((bits & 0x7f800000u) == 0x7f800000u);
    }
    size_t i = 0;
    if (bad)
        while (isfinite(buf[i]))
            i++;
    return bad ? i : count;
}

/* ---- sizes and top-k selection ---- */

int md_shape_product(const int64_t *dims, int ndim, int64_t *out)
{
    int64_t p = 1;
    for (int d = 0; d < ndim; d++)
        if (md_mul_i64(p, dims[d], &p))
            return -1;
    *out = p;
    return 0;
}

/* 1 when x[i] ranks before x[j]: larger first, NaN last, ties by index. */
static int ranks_before(const float *x, int64_t i, int64_t j)
{
    float a = x[i], b = x[j];
    int an = isnan(a), bn = isnan(b);
    if (an || bn)
        return an == bn ? i < j : bn;
    if (a != b)
        return a > b;
    return i < j;
}

/* Restore the heap below `at`: each parent ranks after its children, so the
 * root is the worst of those kept. */
static void sift_down(const float *x, int64_t *h, int64_t m, int64_t at)
{
    for (;;) {
        int64_t worst = at, l = 2 * at + 1, r = l + 1;
        if (l < m && ranks_before(x, h[worst], h[l]))
            worst = l;
        if (r < m && ranks_before(x, h[worst], h[r]))
            worst = r;
        if (worst == at)
            return;
        int64_t t = h[at];
        h[at] = h[worst];
        h[worst] = t;
        at = worst;
    }
}

/*
 * DESIGN: a heap of the k best seen so far with the worst of them at the
 * root; every other value is compared with the root once and replaces it
 * when it ranks before it: O(n log k). A heap sort of the k kept then puts
 * them best first. The order (value, then lower index) is a strict total
 * order, so the answer is the same as the former k passes of "the best not
 * yet taken", which cost O(k^2 n) and stalled a worker for seconds.
 */
int64_t md_top_k(const float *x, int64_t n, int64_t k, int64_t *idx)
{
    if (k <= 0 || n <= 0)
        return 0;
    int64_t m = k < n ? k : n;
    for (int64_t j = 0; j < m; j++)
        idx[j] = j;
    for (int64_t at = m / 2 - 1; at >= 0; at--)
        sift_down(x, idx, m, at);
    for (int64_t j = m; j < n; j++) {
        if (ranks_before(x, j, idx[0])) {
            idx[0] = j;
            sift_down(x, idx, m, 0);
        }
    }
    for (int64_t end = m - 1; end > 0; end--) {
        int64_t t = idx[0];
        idx[0] = idx[end];
        idx[end] = t;
        sift_down(x, idx, end, 0);
    }
    return m;
}
