/*
 * npy.c - NPY request bodies to tensors and tensors to NPY answers (numpy's
 * format: a magic, a version, a Python-literal header dict, raw data). Every
 * size in the header is checked against the body and max_values before
 * anything is allocated; fuzzed by tests/fuzz_tensor.c.
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
    if (kind <= 1 && (bad = md_first_not_finite(buf, count)) < count) {
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
