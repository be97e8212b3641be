/*
 * npzset.c - NPZ datasets for jobs (npzset.h).
 *
 * DESIGN
 * The file is mapped read-only and its zip directory checked by the same
 * code as NPZ request bodies (md_npz_list: names, local headers, sizes).
 * Each array the job reads is then a stream of its own over the mapping: a
 * stored member (numpy.savez) is read where it lies, a deflated one
 * (savez_compressed) is inflated as rows are taken, 64 KiB at a time, so a
 * job holds one row per input and the inflate windows, never a whole
 * member: the mapping's pages are the page cache's, given back as the
 * kernel sees fit. The members are read in lockstep, one row of each per
 * data row; each member's CRC is checked when its last byte has been read.
 * A file that is not a regular file (a pipe) cannot be mapped: NPZ datasets
 * come from a path or a downloaded URL.
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <float.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "npzset.h"

#define INFLATE_CHUNK (64 * 1024)

typedef enum { K_F2, K_F4, K_F8, K_B1, K_I1, K_U1, K_I2, K_U2, K_I4, K_U4, K_I8, K_U8 } kind;

typedef struct member {
    md_npz_entry e;
    const unsigned char *src; /* the member's bytes in the mapping */
    uint64_t taken;           /* of src (compressed bytes for a deflated one) */
    uint64_t produced;        /* NPY bytes read so far */
    z_stream z;
    int z_live;
    unsigned char *buf;       /* inflated bytes not yet read: buf[at..have) */
    size_t at, have;
    uLong crc;
    kind k;
    int esize;
    int is_int;
    int64_t rows, values;
    unsigned char *row;       /* one row's bytes */
} member;

struct md_npzset {
    char *name;
    unsigned char *map;
    size_t len;
    const md_io_info *in;
    int n;
    member m[MD_MAX_IO];
    member label;
    int has_label;
    int64_t rows;
};

static md_status fail(md_npzset *s, md_err *err, const char *fmt, const char *member,
                      const char *detail)
{
    char msg[400];
    snprintf(msg, sizeof msg, fmt, member, detail);
    return md_err_setc(err, MD_EINVAL, "invalid_dataset", "%s: %s", s->name, msg);
}

/* n NPY bytes of member m into out (inflating as needed); 0, or -1 when the
 * member ends first or does not inflate. */
static int take(member *m, unsigned char *out, size_t n)
{
    if (!m->e.deflated) {
        if (n > m->e.usize - m->produced)
            return -1;
        memcpy(out, m->src + m->produced, n);
        m->crc = crc32(m->crc, out, (uInt)n);
        m->produced += n;
        return 0;
    }
    while (n > 0) {
        if (m->at == m->have) {
            m->z.next_out = m->buf;
            m->z.avail_out = INFLATE_CHUNK;
            uint64_t left = m->e.csize - m->taken;
            m->z.next_in = (Bytef *)(m->src + m->taken);
            m->z.avail_in = left > (1u << 30) ? (1u << 30) : (uInt)left;
            uInt before = m->z.avail_in;
            int rc = inflate(&m->z, Z_NO_FLUSH);
            m->taken += before - m->z.avail_in;
            m->at = 0;
            m->have = INFLATE_CHUNK - m->z.avail_out;
            if ((rc != Z_OK && rc != Z_STREAM_END) || m->have == 0)
                return -1;
            if (m->produced + m->have > m->e.usize)
                return -1; /* more than it declared */
        }
        size_t k = m->have - m->at < n ? m->have - m->at : n;
        memcpy(out, m->buf + m->at, k);
        m->crc = crc32(m->crc, out, (uInt)k);
        m->at += k;
        m->produced += k;
        out += k;
        n -= k;
    }
    return 0;
}

static int kind_of(const char *d, kind *k, int *esize)
{
    static const struct {
        const char *descr;
        kind k;
        int size;
    } t[] = {{"<f2", K_F2, 2}, {"<f4", K_F4, 4}, {"<f8", K_F8, 8}, {"|b1", K_B1, 1},
             {"|i1", K_I1, 1}, {"|u1", K_U1, 1}, {"<i2", K_I2, 2}, {"<u2", K_U2, 2},
             {"<i4", K_I4, 4}, {"<u4", K_U4, 4}, {"<i8", K_I8, 8}, {"<u8", K_U8, 8}};
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++)
        if (!strcmp(d, t[i].descr)) {
            *k = t[i].k;
            *esize = t[i].size;
            return 0;
        }
    return -1;
}

static float half(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (e == 0x1f)
        bits = sign | 0x7f800000u | (man << 13);
    else if (e == 0) {
        float f = (float)man * (1.0f / 16777216.0f);
        return sign ? -f : f;
    } else
        bits = sign | ((e + 112) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Open member `mname` as a stream, read its NPY header: dtype and shape. */
static md_status open_member(md_npzset *s, const md_npz_entry *list, int nlist,
                             const char *mname, member *m, md_err *err)
{
    const md_npz_entry *e = NULL;
    for (int i = 0; i < nlist && !e; i++)
        if (!strcmp(list[i].name, mname))
            e = &list[i];
    if (!e) {
        char have[300] = "";
        int len = 0;
        for (int i = 0; i < nlist && len >= 0 && (size_t)len < sizeof have; i++)
            len += snprintf(have + len, sizeof have - (size_t)len, "%s%s", i ? ", " : "",
                            list[i].name);
        return fail(s, err, "it has no array \"%s\" (it has: %s); save one per model input "
                            "with numpy.savez(f, NAME=array, ...)",
                    mname, have);
    }
    m->e = *e;
    m->src = s->map + e->offset;
    m->crc = crc32(0, NULL, 0);
    if (e->deflated) {
        m->buf = md_xmalloc(INFLATE_CHUNK);
        if (inflateInit2(&m->z, -MAX_WBITS) != Z_OK)
            return md_err_set(err, MD_ENOMEM, "no memory to inflate %s", s->name);
        m->z_live = 1;
    }
    unsigned char pre[12];
    if (take(m, pre, 10) != 0)
        return fail(s, err, "array \"%s\" is %s", mname, "not an NPY file (truncated)");
    int version;
    size_t hlen, hoff;
    md_npy_pre_status ps = md_npy_preamble(pre, 10, &version, &hlen, &hoff);
    if (ps == MD_NPY_PRE_MORE) {
        if (take(m, pre + 10, 2) != 0)
            return fail(s, err, "array \"%s\" is %s", mname, "not an NPY file (truncated)");
        ps = md_npy_preamble(pre, 12, &version, &hlen, &hoff);
    }
    if (ps != MD_NPY_PRE_OK)
        return fail(s, err, "array \"%s\" is %s", mname,
                    "not an NPY file numpy can write (magic, version 1 to 3, header)");
    char *header = md_xmalloc(hlen + 1);
    if (take(m, (unsigned char *)header, hlen) != 0) {
        free(header);
        return fail(s, err, "array \"%s\" has %s", mname, "a truncated NPY header");
    }
    header[hlen] = '\0';
    md_npy_dict dict;
    md_npy_dict_status ds = md_npy_parse_dict(header, &dict);
    free(header);
    if (ds != MD_NPY_DICT_OK || dict.shape_status != MD_NPY_DICT_OK || dict.ndim < 1)
        return fail(s, err, "array \"%s\" has %s", mname,
                    "an NPY header without a C-order shape of at least one dimension");
    if (kind_of(dict.descr, &m->k, &m->esize) != 0)
        return fail(s, err, "array \"%s\" has dtype %s, which is not read: use little-endian "
                            "float16/32/64, bool, int8..int64 or uint8..uint64",
                    mname, dict.descr);
    m->is_int = m->k >= K_B1;
    m->rows = dict.shape[0];
    m->values = 1;
    for (int d = 1; d < dict.ndim; d++)
        if (md_mul_i64(m->values, dict.shape[d], &m->values) || m->values > MD_MAX_ROW_VALUES)
            return fail(s, err, "array \"%s\" has %s", mname, "rows of too many values");
    int64_t data;
    if (md_mul_i64(m->rows, m->values, &data) || md_mul_i64(data, m->esize, &data) ||
        (uint64_t)data != m->e.usize - m->produced)
        return fail(s, err, "array \"%s\" %s", mname,
                    "holds another number of bytes than its shape says (damaged?)");
    m->row = md_xmalloc((size_t)(m->values * m->esize) + 1);
    return MD_OK;
}

md_status md_npzset_open(const char *path, const char *name, const md_io_info *in, int n,
                         const char *label, md_npzset **out, md_err *err)
{
    *out = NULL;
    md_npzset *s = md_xcalloc(1, sizeof *s);
    s->name = md_xstrdup(name);
    s->in = in;
    s->n = n;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat sb;
    md_status st = MD_OK;
    if (fd < 0 || fstat(fd, &sb) != 0)
        st = md_err_setc(err, MD_EIO, "invalid_dataset", "%s: cannot open it: %s", name,
                         strerror(errno));
    else if (!S_ISREG(sb.st_mode) || sb.st_size <= 0)
        st = md_err_setc(err, MD_EINVAL, "invalid_dataset",
                         "%s: an NPZ dataset must be a regular, non-empty file (read from a "
                         "path or a downloaded url)", name);
    if (st == MD_OK) {
        s->len = (size_t)sb.st_size;
        s->map = mmap(NULL, s->len, PROT_READ, MAP_PRIVATE, fd, 0);
        if (s->map == MAP_FAILED) {
            s->map = NULL;
            st = md_err_setc(err, MD_EIO, "invalid_dataset", "%s: cannot map it: %s", name,
                             strerror(errno));
        } else {
            madvise(s->map, s->len, MADV_SEQUENTIAL);
        }
    }
    if (fd >= 0)
        close(fd);
    md_npz_entry list[MD_MAX_IO];
    int nlist = 0;
    if (st == MD_OK && (st = md_npz_list((const char *)s->map, s->len, list, &nlist, err)) != MD_OK) {
        char msg[sizeof err->msg];
        snprintf(msg, sizeof msg, "%s", err->msg);
        md_err_setc(err, st, "invalid_dataset", "%s: %s", name, msg);
    }
    for (int i = 0; st == MD_OK && i < n; i++) {
        member *m = &s->m[i];
        if ((st = open_member(s, list, nlist, in[i].name, m, err)) != MD_OK)
            break;
        char what[200];
        if (in[i].is_int && !m->is_int) {
            snprintf(what, sizeof what, "is floating point, and input \"%s\" is declared %s: "
                     "save it as integers (values are not rounded)", in[i].name, in[i].dtype);
            st = fail(s, err, "array \"%s\" %s", in[i].name, what);
        } else if (m->values != in[i].values) {
            snprintf(what, sizeof what, "has %lld values a row, and input \"%s\" takes %lld",
                     (long long)m->values, in[i].name, (long long)in[i].values);
            st = fail(s, err, "array \"%s\" %s", in[i].name, what);
        } else if (i > 0 && m->rows != s->rows) {
            snprintf(what, sizeof what, "has %lld rows, and array \"%s\" %lld: every input "
                     "needs one row a sample", (long long)m->rows, in[0].name,
                     (long long)s->rows);
            st = fail(s, err, "array \"%s\" %s", in[i].name, what);
        }
        s->rows = m->rows;
    }
    if (st == MD_OK && label) {
        if ((st = open_member(s, list, nlist, label, &s->label, err)) == MD_OK) {
            s->has_label = 1;
            if (!s->label.is_int || s->label.values != 1 || s->label.rows != s->rows)
                st = fail(s, err, "the label array \"%s\" %s", label,
                          "must hold one integer a row, as many rows as the inputs");
        }
    }
    if (st != MD_OK) {
        md_npzset_close(s);
        return st;
    }
    *out = s;
    return MD_OK;
}

int64_t md_npzset_rows(const md_npzset *s) { return s->rows; }

/* Value v of member m's current row as int64 (integer members). */
static int64_t as_int(const member *m, int64_t v)
{
    const unsigned char *p = m->row + v * m->esize;
    switch (m->k) {
    case K_B1: return p[0] != 0;
    case K_I1: return (int8_t)p[0];
    case K_U1: return p[0];
    case K_I2: { int16_t x; memcpy(&x, p, 2); return x; }
    case K_U2: { uint16_t x; memcpy(&x, p, 2); return x; }
    case K_I4: { int32_t x; memcpy(&x, p, 4); return x; }
    case K_U4: { uint32_t x; memcpy(&x, p, 4); return x; }
    case K_U8: { uint64_t x; memcpy(&x, p, 8); return x > (uint64_t)INT64_MAX ? INT64_MIN : (int64_t)x; }
    default: { int64_t x; memcpy(&x, p, 8); return x; }
    }
}

static double as_double(const member *m, int64_t v)
{
    const unsigned char *p = m->row + v * m->esize;
    switch (m->k) {
    case K_F2: { uint16_t x; memcpy(&x, p, 2); return half(x); }
    case K_F4: { float x; memcpy(&x, p, 4); return x; }
    case K_F8: { double x; memcpy(&x, p, 8); return x; }
    default: return (double)as_int(m, v);
    }
}

/* After a member's last row: nothing left, and its CRC. */
static int member_done(member *m)
{
    if (m->produced != m->e.usize)
        return -1;
    return m->crc == m->e.crc ? 0 : -1;
}

static int int_fits(const char *dtype, int64_t v)
{
    if (!strcmp(dtype, "uint8"))
        return v >= 0 && v <= 255;
    if (!strcmp(dtype, "int32"))
        return v >= INT32_MIN && v <= INT32_MAX;
    if (!strcmp(dtype, "bool"))
        return v == 0 || v == 1;
    return 1;
}

md_status md_npzset_next(md_npzset *s, int64_t rowno, float *row, int64_t *label, md_err *err)
{
    if (rowno >= s->rows)
        return MD_ENOTFOUND;
    char what[200];
    /* every member's row is taken first, so a bad value leaves the
     * streams in step for the next row (on_error: skip) */
    for (int i = 0; i < s->n; i++)
        if (take(&s->m[i], s->m[i].row, (size_t)(s->m[i].values * s->m[i].esize)) != 0)
            return md_err_setc(err, MD_EIO, "invalid_dataset",
                               "%s row %lld: array \"%s\" ends early or does not inflate "
                               "(damaged)", s->name, (long long)rowno, s->in[i].name);
    if (s->has_label && take(&s->label, s->label.row, (size_t)s->label.esize) != 0)
        return md_err_setc(err, MD_EIO, "invalid_dataset",
                           "%s row %lld: the label array ends early (damaged)", s->name,
                           (long long)rowno);
    for (int i = 0; i < s->n; i++) {
        member *m = &s->m[i];
        const md_io_info *io = &s->in[i];
        for (int64_t v = 0; v < m->values; v++) {
            if (io->is_int) {
                int64_t x = as_int(m, v);
                if ((m->k == K_U8 && x == INT64_MIN) || !int_fits(io->dtype, x)) {
                    snprintf(what, sizeof what, "value %lld of array \"%s\" does not fit "
                             "input \"%s\"'s dtype %s", (long long)v, io->name, io->name,
                             io->dtype);
                    return md_err_setc(err, MD_EINVAL, "invalid_dataset", "%s row %lld: %s",
                                       s->name, (long long)rowno, what);
                }
                memcpy(row + io->off + 2 * v, &x, sizeof x);
            } else {
                double d = as_double(m, v);
                if (!(fabs(d) <= FLT_MAX))
                    return md_err_setc(err, MD_EINVAL, "invalid_dataset",
                                       "%s row %lld: value %lld of array \"%s\" is not a "
                                       "finite float32 number",
                                       s->name, (long long)rowno, (long long)v, io->name);
                row[io->off + v] = (float)d;
            }
        }
        if (rowno + 1 == s->rows && member_done(m) != 0)
            return md_err_setc(err, MD_EIO, "invalid_dataset",
                               "%s: array \"%s\" fails its CRC check or has bytes past its "
                               "rows (damaged?)", s->name, io->name);
    }
    if (s->has_label)
        *label = as_int(&s->label, 0);
    return MD_OK;
}

void md_npzset_close(md_npzset *s)
{
    if (!s)
        return;
    for (int i = 0; i < MD_MAX_IO; i++) {
        if (s->m[i].z_live)
            inflateEnd(&s->m[i].z);
        free(s->m[i].buf);
        free(s->m[i].row);
    }
    if (s->label.z_live)
        inflateEnd(&s->label.z);
    free(s->label.buf);
    free(s->label.row);
    if (s->map)
        munmap(s->map, s->len);
    free(s->name);
    free(s);
}
