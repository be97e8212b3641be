/*
 * tensor.c - request bodies to tensors and tensors to responses.
 *
 * Over 800 lines, to be split by wire format: the JSON scanner (the DESIGN
 * below) stays here; NPY (md_npy_*) and the Open Inference Protocol V2
 * tensors (md_v2_decode*) share only md_tensor and the size helpers, and can
 * each have a file (npy.c, v2.c) with no private header.
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

void md_tensor_free(md_tensor *t)
{
    if (!t)
        return;
    free(t->data);
    memset(t, 0, sizeof *t);
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

/* ---- NPY ---- */

md_npy_pre_status md_npy_preamble(const unsigned char *pre, size_t n, int *version,
                                  size_t *header_len, size_t *header_off)
{
    if (n < 10 || memcmp(pre, "\x93NUMPY", 6) != 0)
        return MD_NPY_PRE_NOT_NPY;
    *version = pre[6];
    if (pre[6] == 1) {
        *header_len = (size_t)pre[8] | (size_t)pre[9] << 8;
        *header_off = 10;
    } else if (pre[6] == 2 || pre[6] == 3) {
        if (n < 12)
            return MD_NPY_PRE_MORE;
        *header_len = (size_t)pre[8] | (size_t)pre[9] << 8 | (size_t)pre[10] << 16 |
                      (size_t)pre[11] << 24;
        *header_off = 12;
    } else {
        return MD_NPY_PRE_VERSION;
    }
    return *header_len > MD_NPY_HEADER_MAX ? MD_NPY_PRE_LARGE : MD_NPY_PRE_OK;
}

static int npy_blank(char c) { return c == ' ' || c == '\t'; }

md_npy_dict_status md_npy_parse_dict(const char *header, md_npy_dict *out)
{
    memset(out, 0, sizeof *out);
    const char *descr = strstr(header, "'descr'");
    const char *fortran = strstr(header, "'fortran_order'");
    const char *shape = strstr(header, "'shape'");
    if (!descr || !fortran || !shape)
        return MD_NPY_DICT_KEYS;
    const char *q = strchr(descr + 7, '\'');
    if (q)
        sscanf(q + 1, "%15[^']", out->descr);
    const char *fv = fortran + 15;
    while (npy_blank(*fv) || *fv == ':')
        fv++;
    if (strncmp(fv, "False", 5) != 0)
        return MD_NPY_DICT_FORTRAN;
    out->shape_status = MD_NPY_DICT_OK;
    const char *p = strchr(shape, '(');
    if (!p) {
        out->shape_status = MD_NPY_DICT_NO_SHAPE;
        return MD_NPY_DICT_OK;
    }
    p++;
    while (*p && *p != ')') {
        while (npy_blank(*p) || *p == ',')
            p++;
        if (*p == ')')
            break;
        char *end;
        long long d = strtoll(p, &end, 10);
        if (end == p || d < 0 || out->ndim >= MD_MAX_DIMS) {
            out->shape_status = MD_NPY_DICT_SHAPE;
            return MD_NPY_DICT_OK;
        }
        out->shape[out->ndim++] = d;
        p = end;
    }
    if (*p != ')')
        out->shape_status = MD_NPY_DICT_SHAPE;
    return MD_NPY_DICT_OK;
}

/* The index of the first NaN or infinity among `count` floats, or `count`:
 * one branch-free pass (a float is NaN or infinite when its exponent bits
 * are all ones; the compiler vectorizes it), then a search only when one is
 * there. */
static size_t first_not_finite(const float *buf, size_t count)
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

md_status md_npy_decode(const char *data, size_t len, size_t max_values, md_tensor *out,
                        md_err *err)
{
    memset(out, 0, sizeof *out);
    size_t hlen = 0, off = 0;
    int npy_version = 0;
    md_npy_pre_status ps =
        md_npy_preamble((const unsigned char *)data, len, &npy_version, &hlen, &off);
    if (ps == MD_NPY_PRE_NOT_NPY)
        return md_err_setc(err, MD_EINVAL, "invalid_npy",
                           "the body is not an NPY file (no \\x93NUMPY magic); write it with numpy.save");
    if (ps == MD_NPY_PRE_VERSION || ps == MD_NPY_PRE_MORE)
        return md_err_setc(err, MD_EINVAL, "invalid_npy", "NPY version %d is not supported",
                           npy_version);
    if (ps == MD_NPY_PRE_LARGE || off + hlen > len)
        return md_err_setc(err, MD_EINVAL, "invalid_npy", "the NPY header is truncated");
    char header[MD_NPY_HEADER_MAX + 1];
    memcpy(header, data + off, hlen);
    header[hlen] = '\0';
    md_npy_dict dict;
    md_npy_dict_status ds = md_npy_parse_dict(header, &dict);
    if (ds == MD_NPY_DICT_KEYS)
        return md_err_setc(err, MD_EINVAL, "invalid_npy", "the NPY header lacks descr, fortran_order or shape");
    if (ds == MD_NPY_DICT_FORTRAN)
        return md_err_setc(err, MD_EINVAL, "invalid_npy",
                           "the NPY array is in Fortran order; save a C-order array "
                           "(numpy.ascontiguousarray)");
    const char *type = dict.descr;
    int esize;
    int kind; /* 0 f4, 1 f8, 2 i8, 3 i4, 4 u1, 5 bool */
    if (!strcmp(type, "<f4") || !strcmp(type, "|f4"))
        kind = 0, esize = 4;
    else if (!strcmp(type, "<f8"))
        kind = 1, esize = 8;
    else if (!strcmp(type, "<i8"))
        kind = 2, esize = 8;
    else if (!strcmp(type, "<i4"))
        kind = 3, esize = 4;
    else if (!strcmp(type, "|u1") || !strcmp(type, "<u1"))
        kind = 4, esize = 1;
    else if (!strcmp(type, "|b1"))
        kind = 5, esize = 1;
    else
        return md_err_setc(err, MD_EINVAL, "invalid_npy",
                           "NPY dtype %s is not supported; use float32, float64, int64, int32, "
                           "uint8 or bool (little-endian)",
                           type);
    if (dict.shape_status == MD_NPY_DICT_NO_SHAPE)
        return md_err_setc(err, MD_EINVAL, "invalid_npy", "the NPY shape is malformed");
    if (dict.shape_status != MD_NPY_DICT_OK)
        return md_err_setc(err, MD_EINVAL, "invalid_npy", "the NPY shape is malformed or has more than 8 dims");
    size_t count = 1;
    for (int d = 0; d < dict.ndim; d++) {
        out->shape[out->ndim++] = dict.shape[d];
        if (md_mul_size(count, (size_t)dict.shape[d], &count))
            return md_err_setc(err, MD_ETOOBIG, "too_many_values",
                               "the NPY shape holds more values than fit in memory; the limit "
                               "is %zu", max_values);
    }
    if (out->ndim == 0)
        return md_err_setc(err, MD_EINVAL, "invalid_input", "the NPY array is a scalar; send rows");
    if (count == 0)
        return md_err_setc(err, MD_EINVAL, "invalid_input", "the NPY array is empty; send at least one row");
    if (count > max_values)
        return md_err_setc(err, MD_ETOOBIG, "too_many_values",
                           "the input has %zu numbers, more than the limit of %zu", count, max_values);
    off += hlen;
    if ((len - off) / (size_t)esize < count)
        return md_err_setc(err, MD_EINVAL, "invalid_npy",
                           "the NPY data is truncated: %zu bytes for %zu values of %d bytes",
                           len - off, count, esize);
    float *buf = md_mallocarray_checked(count, sizeof(float), "the NPY input values", err);
    if (!buf)
        return MD_ENOMEM;
    const char *src = data + off;
    /* one tight loop per dtype (the compiler vectorizes them), then one
     * pass for NaN and infinities: a per-value switch and early exit cost 8%
     * of a 64-row NPY request's CPU (perf) */
    switch (kind) {
    case 0:
        memcpy(buf, src, count * sizeof(float));
        break;
    case 1:
        for (size_t i = 0; i < count; i++) {
            double d;
            memcpy(&d, src + 8 * i, 8);
            buf[i] = (float)d;
        }
        break;
    case 2:
        for (size_t i = 0; i < count; i++) {
            long long v;
            memcpy(&v, src + 8 * i, 8);
            buf[i] = (float)v;
        }
        break;
    case 3:
        for (size_t i = 0; i < count; i++) {
            int v;
            memcpy(&v, src + 4 * i, 4);
            buf[i] = (float)v;
        }
        break;
    default:
        for (size_t i = 0; i < count; i++)
            buf[i] = (float)(unsigned char)src[i];
    }
    size_t bad;
    if (kind <= 1 && (bad = first_not_finite(buf, count)) < count) {
        free(buf);
        md_tensor_free(out);
        return md_err_setc(err, MD_EINVAL, "invalid_input",
                           "value %zu of the NPY array is NaN or infinite", bad);
    }
    out->data = buf;
    out->count = count;
    return MD_OK;
}

char *md_npy_encode(const float *data, const int64_t *shape, int ndim, size_t *len)
{
    char dims[256] = "";
    size_t n = 0, count = 1;
    for (int i = 0; i < ndim; i++) {
        n += (size_t)snprintf(dims + n, sizeof dims - n, "%lld,%s", (long long)shape[i],
                              i + 1 < ndim ? " " : "");
        count *= (size_t)shape[i];
    }
    if (ndim > 1)
        dims[n - 1] = '\0'; /* (2, 3) not (2, 3,) */
    char header[512];
    int h = snprintf(header, sizeof header, "{'descr': '<f4', 'fortran_order': False, 'shape': (%s), }",
                     dims);
    /* magic(6) + version(2) + len(2) + header, padded with spaces to 64 and ended by \n */
    size_t total_h = 10 + (size_t)h + 1;
    size_t pad = (64 - total_h % 64) % 64;
    size_t hl = (size_t)h + pad + 1;
    *len = 10 + hl + count * sizeof(float);
    char *out = md_xmalloc(*len);
    memcpy(out, "\x93NUMPY\x01\x00", 8);
    out[8] = (char)(hl & 0xff);
    out[9] = (char)(hl >> 8);
    memcpy(out + 10, header, (size_t)h);
    memset(out + 10 + h, ' ', pad);
    out[10 + hl - 1] = '\n';
    memcpy(out + 10 + hl, data, count * sizeof(float));
    return out;
}

/* The shortest digits that read back as the same float, by std::to_chars
 * (numparse.cpp, Ryu): about 40 ns a value, where the strtof-checked digit
 * search it replaced took 300 ns (bench/encode.c). */
int md_float_format(float v, char *buf, size_t size)
{
    if (!isfinite(v))
        return snprintf(buf, size, "%g", (double)v);
    return md_format_float(v, buf, size);
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

/* IEEE half-precision bits to float. */
static float half_to_float(uint16_t h)
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
        V2_CONVERT(uint16_t, half_to_float(v))
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
    size_t bad = first_not_finite(buf, count);
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

/* The array at s[i] == '[' of inputs or outputs: its first element, an
 * object, walked with on_first; the others are dropped (null keeps their
 * count, which the request is answered on). */
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
    for (size_t n = 0;; n++) {
        size_t end = n ? v2_drop(w, i)
                   : i < len && s[i] == '{' ? v2_object(w, i, on_first) : v2_keep(w, i);
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
    if (!w->out && w->data == 1 && w->read_data && v2_is(w, v, '[')) {
        md_err err;
        scan sc = {.p = w->s + v, .end = w->s + w->len, .max_values = w->max_values,
                   .err = &err};
        if (rows(&sc, &w->rows) == MD_OK && w->rows.count > 0) {
            w->a = v;
            w->b = (size_t)(sc.p - w->s);
            return w->b;
        }
        free(sc.buf);
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
    /* a rectangular array has no more arrays than numbers */
    if (sc.values - sc.containers > w->max_values || sc.containers > w->max_values)
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
        return v2_is(w, v, '[') ? v2_list(w, v, v2_input0) : v2_keep(w, v);
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
    w->kept = 0;
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
