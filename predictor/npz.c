/*
 * npz.c - NPZ request bodies (numpy.savez / savez_compressed) to named
 * arrays: md_npz_decode. Fuzzed by tests/fuzz_npz.c, tested by
 * tests/test_npz.c over archives numpy wrote.
 *
 * DESIGN
 * An NPZ is a zip of NAME.npy members, stored (savez) or deflated
 * (savez_compressed), each an NPY file. The zip is read from its central
 * directory, found as checkpoint/zipdir.c finds it (the last end-of-central-
 * directory record; the zip64 record when a locator sits before it, and the
 * two must agree), because the directory is where every writer puts the
 * sizes and CRC: numpy's zipfile writes to an unseekable stream leave them
 * out of the local headers (flag bit 3, a data descriptor after the data).
 * A zip can say one thing to a reader of its directory and another to a
 * reader of its local headers, so where both are given they must agree: the
 * name always, the method, and the CRC and sizes when no descriptor stands
 * in for them. Records lie in the order of the directory, one after the
 * other, before the directory, so no two members share bytes.
 *
 * Memory: every size the zip declares is checked before anything is
 * allocated. A member may declare no more bytes than the values still
 * allowed (max_values) take at 8 bytes each plus an NPY header, and no more
 * than deflate can make of its compressed bytes (1032:1; a stored member's
 * two sizes are equal). A deflated member is inflated into a buffer that
 * grows with what inflate actually gives, so a member that lies about its
 * size costs what it really inflates to, not what it declares; it must then
 * give exactly its declared size and CRC. Stored members are read in place.
 * So a request costs at most its own size, the values it is allowed (8
 * bytes each, once inflated and once converted), and a 64 KiB header.
 */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "predictor.h"
#include "tensor_internal.h"

#define SIG_LOCAL 0x04034b50u
#define SIG_CENTRAL 0x02014b50u
#define SIG_EOCD 0x06054b50u
#define SIG_ZIP64_EOCD 0x06064b50u
#define SIG_ZIP64_LOCATOR 0x07064b50u
#define EOCD_SIZE 22
#define ZIP64_EOCD_SIZE 56
#define ZIP64_LOCATOR_SIZE 20
#define CENTRAL_SIZE 46
#define LOCAL_SIZE 30
/* deflate's best ratio: a 258-byte match in 2 bits (zlib's FAQ), plus room
 * for the block headers of a tiny stream */
#define DEFLATE_MAX_RATIO 1032
#define DEFLATE_SLACK 1024
/* what an NPY member holds besides its values: the preamble and header */
#define NPY_SLACK (12 + MD_NPY_HEADER_MAX)

static const char fix[] = "save it with numpy.savez(buf, name=array, ...) or "
                          "numpy.savez_compressed";

static uint64_t le(const unsigned char *p, int n)
{
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

static md_status bad_zip(md_err *err, const char *why)
{
    return md_err_setc(err, MD_EINVAL, "bad_npz", "the NPZ body %s; %s", why, fix);
}

/* A member's name as the client sent it, printable, for a message. */
static const char *quote(const unsigned char *name, size_t len, char *out, size_t size)
{
    char raw[100];
    size_t n = len < sizeof raw - 1 ? len : sizeof raw - 1;
    for (size_t i = 0; i < n; i++)
        raw[i] = name[i] ? (char)name[i] : '?';
    raw[n] = '\0';
    md_text_escape(out, size, raw);
    return out;
}

/* Where the central directory is, as zipdir.c's locate() finds it. */
typedef struct npz_dir {
    uint64_t entries, cd_size, cd_off;
    uint64_t end; /* where the directory must end: the zip64 record or the EOCD */
} npz_dir;

static md_status locate(const unsigned char *d, size_t len, npz_dir *pos, md_err *err)
{
    if (len < EOCD_SIZE)
        return bad_zip(err, "is too short to be a zip archive");
    size_t lowest = len - EOCD_SIZE > 65535 ? len - EOCD_SIZE - 65535 : 0;
    size_t at = SIZE_MAX;
    for (size_t i = len - EOCD_SIZE + 1; i-- > lowest;)
        if (le(d + i, 4) == SIG_EOCD) {
            at = i;
            break;
        }
    if (at == SIZE_MAX)
        return bad_zip(err, "is not a zip archive (no end-of-central-directory record; "
                            "truncated?)");
    const unsigned char *e = d + at;
    /* bytes after the record's comment are a second file glued on */
    if (le(e + 20, 2) != len - at - EOCD_SIZE)
        return bad_zip(err, "has bytes after the end of its zip archive");
    uint64_t disk = le(e + 4, 2), cd_disk = le(e + 6, 2), on_disk = le(e + 8, 2),
             entries = le(e + 10, 2), cd_size = le(e + 12, 4), cd_off = le(e + 16, 4);
    uint64_t end = at;
    if (at >= ZIP64_LOCATOR_SIZE && le(d + at - ZIP64_LOCATOR_SIZE, 4) == SIG_ZIP64_LOCATOR) {
        const unsigned char *loc = d + at - ZIP64_LOCATOR_SIZE;
        uint64_t z_off = le(loc + 8, 8);
        if (le(loc + 4, 4) != 0 || le(loc + 16, 4) != 1)
            return bad_zip(err, "spans several disks");
        if (z_off > at - ZIP64_LOCATOR_SIZE || at - ZIP64_LOCATOR_SIZE - z_off < ZIP64_EOCD_SIZE ||
            le(d + z_off, 4) != SIG_ZIP64_EOCD || le(d + z_off + 4, 8) < ZIP64_EOCD_SIZE - 12)
            return bad_zip(err, "has a zip64 locator but no valid zip64 end-of-central-"
                                "directory record");
        const unsigned char *z = d + z_off;
        uint64_t z_disk = le(z + 16, 4), z_cd_disk = le(z + 20, 4), z_on_disk = le(z + 24, 8),
                 z_entries = le(z + 32, 8), z_cd_size = le(z + 40, 8), z_cd_off = le(z + 48, 8);
        /* a classic field is saturated or the same number: anything else is
         * two archives in one body, and readers differ in which they take */
        if ((disk != 0xFFFF && disk != z_disk) || (cd_disk != 0xFFFF && cd_disk != z_cd_disk) ||
            (on_disk != 0xFFFF && on_disk != z_on_disk) ||
            (entries != 0xFFFF && entries != z_entries) ||
            (cd_size != 0xFFFFFFFF && cd_size != z_cd_size) ||
            (cd_off != 0xFFFFFFFF && cd_off != z_cd_off))
            return bad_zip(err, "has two end-of-central-directory records that disagree");
        disk = z_disk;
        cd_disk = z_cd_disk;
        on_disk = z_on_disk;
        entries = z_entries;
        cd_size = z_cd_size;
        cd_off = z_cd_off;
        end = z_off;
    } else if (entries == 0xFFFF || cd_size == 0xFFFFFFFF || cd_off == 0xFFFFFFFF) {
        return bad_zip(err, "marks its directory as zip64 but has no zip64 record");
    }
    if (disk != 0 || cd_disk != 0 || on_disk != entries)
        return bad_zip(err, "spans several disks");
    if (cd_off > end || cd_size != end - cd_off)
        return bad_zip(err, "has a central directory that is not where its end record says "
                            "(truncated or joined?)");
    if (entries == 0)
        return bad_zip(err, "holds no arrays");
    if (entries > MD_MAX_IO)
        return md_err_setc(err, MD_ETOOBIG, "too_many_inputs",
                           "the NPZ body holds %llu arrays; the limit is %d (MD_MAX_IO): send "
                           "one array per model input",
                           (unsigned long long)entries, MD_MAX_IO);
    if (entries > cd_size / CENTRAL_SIZE)
        return bad_zip(err, "has a damaged central directory");
    pos->entries = entries;
    pos->cd_size = cd_size;
    pos->cd_off = cd_off;
    pos->end = end;
    return MD_OK;
}

/* The zip64 extra field's sizes: a 64-bit value for each saturated 32-bit
 * field, in this order (APPNOTE 4.5.3). -1 when a saturated one is missing. */
static int zip64_sizes(const unsigned char *x, size_t xlen, uint64_t *usize, uint64_t *csize,
                       uint64_t *local_off)
{
    while (xlen >= 4) {
        size_t id = (size_t)le(x, 2), n = (size_t)le(x + 2, 2);
        if (n > xlen - 4)
            return -1;
        if (id == 1) {
            const unsigned char *f = x + 4;
            uint64_t *fields[3] = {usize, csize, local_off};
            for (int k = 0; k < 3; k++) {
                if (!fields[k] || *fields[k] != 0xFFFFFFFF)
                    continue;
                if (n < 8)
                    return -1;
                *fields[k] = le(f, 8);
                f += 8;
                n -= 8;
            }
            return 0;
        }
        x += 4 + n;
        xlen -= 4 + n;
    }
    return -1;
}

/* One member of the directory, checked against its local header. */
typedef struct npz_member {
    const unsigned char *name;
    size_t name_len;
    int deflated;
    uint32_t crc;
    uint64_t csize, usize;
    const unsigned char *data; /* csize bytes */
} npz_member;

/* Inflate m's data into a new buffer of exactly m->usize bytes (checked:
 * no more, no less, its CRC); the buffer grows with what inflate gives. */
static md_status inflate_member(const npz_member *m, const char *q, unsigned char **out,
                                md_err *err)
{
    *out = NULL;
    size_t want = (size_t)m->usize;
    size_t cap = want < 65536 ? want : 65536;
    if (cap < want && m->csize * 4 > cap)
        cap = m->csize * 4 < want ? (size_t)m->csize * 4 : want;
    unsigned char *buf = md_malloc_checked(cap ? cap : 1, "the NPZ member", err);
    if (!buf)
        return MD_ENOMEM;
    z_stream zs;
    memset(&zs, 0, sizeof zs);
    if (inflateInit2(&zs, -MAX_WBITS) != Z_OK) {
        free(buf);
        return md_err_set(err, MD_ENOMEM, "cannot start inflating the NPZ member \"%s\"", q);
    }
    const unsigned char *in = m->data;
    uint64_t in_left = m->csize;
    size_t got = 0;
    unsigned char spare; /* room for one byte past the declared size */
    int zr = Z_OK;
    md_status st = MD_OK;
    for (;;) {
        if (got == cap && cap < want) {
            size_t grown = cap > want / 2 ? want : cap * 2;
            unsigned char *nb = realloc(buf, grown);
            if (!nb) {
                st = md_err_set(err, MD_ENOMEM, "out of memory inflating the NPZ member \"%s\"",
                                q);
                break;
            }
            buf = nb;
            cap = grown;
        }
        if (zs.avail_in == 0) {
            uInt chunk = in_left > (1u << 30) ? (1u << 30) : (uInt)in_left;
            zs.next_in = (Bytef *)in;
            zs.avail_in = chunk;
            in += chunk;
            in_left -= chunk;
        }
        size_t room = cap - got;
        uInt avail = room > (1u << 30) ? (1u << 30) : (uInt)room;
        zs.next_out = room ? buf + got : &spare;
        zs.avail_out = room ? avail : 1;
        uInt before = zs.avail_out;
        zr = inflate(&zs, Z_NO_FLUSH);
        size_t made = before - zs.avail_out;
        if (!room && made) {
            st = md_err_setc(err, MD_EINVAL, "bad_npz",
                             "the NPZ member \"%s\" inflates past its declared size of %zu "
                             "bytes; %s",
                             q, want, fix);
            break;
        }
        got += made;
        if (zr == Z_STREAM_END)
            break;
        if (zr != Z_OK && zr != Z_BUF_ERROR) {
            st = md_err_setc(err, MD_EINVAL, "bad_npz",
                             "the NPZ member \"%s\" is not valid deflate data (%s); %s", q,
                             zs.msg ? zs.msg : "corrupt", fix);
            break;
        }
        if (made == 0 && zs.avail_in == 0 && in_left == 0) {
            st = md_err_setc(err, MD_EINVAL, "bad_npz",
                             "the NPZ member \"%s\" is truncated (its deflate data ends "
                             "early); %s",
                             q, fix);
            break;
        }
    }
    inflateEnd(&zs);
    if (st == MD_OK && got != want)
        st = md_err_setc(err, MD_EINVAL, "bad_npz",
                         "the NPZ member \"%s\" inflates to %zu bytes, not the %zu its "
                         "directory declares; %s",
                         q, got, want, fix);
    if (st == MD_OK && (zs.avail_in != 0 || in_left != 0))
        st = md_err_setc(err, MD_EINVAL, "bad_npz",
                         "the NPZ member \"%s\" has bytes after its deflate data; %s", q, fix);
    if (st != MD_OK) {
        free(buf);
        return st;
    }
    *out = buf;
    return MD_OK;
}

static uint32_t crc_of(const unsigned char *p, size_t n)
{
    uLong c = crc32(0L, Z_NULL, 0);
    while (n > 0) {
        uInt chunk = n > (1u << 30) ? (1u << 30) : (uInt)n;
        c = crc32(c, p, chunk);
        p += chunk;
        n -= chunk;
    }
    return (uint32_t)c;
}

/* dtype kinds an NPZ member may hold */
enum { K_F16, K_F32, K_F64, K_BOOL, K_U8, K_I8, K_I16, K_U16, K_I32, K_U32, K_I64, K_U64 };

static int dtype_kind(const char *descr, int *kind, int *esize, int *swap)
{
    if (strlen(descr) != 3)
        return -1;
    char order = descr[0], k = descr[1];
    int size = descr[2] - '0';
    static const struct { char k; int size, kind; } types[] = {
        {'f', 2, K_F16}, {'f', 4, K_F32}, {'f', 8, K_F64}, {'b', 1, K_BOOL},
        {'u', 1, K_U8},  {'i', 1, K_I8},  {'i', 2, K_I16}, {'u', 2, K_U16},
        {'i', 4, K_I32}, {'u', 4, K_U32}, {'i', 8, K_I64}, {'u', 8, K_U64},
    };
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        if (types[i].k != k || types[i].size != size)
            continue;
        /* numpy writes '|' for one byte, '<' or '>' for more */
        if (size == 1 ? (order != '|' && order != '<' && order != '>')
                      : (order != '<' && order != '>'))
            return -1;
        *kind = types[i].kind;
        *esize = size;
        *swap = size > 1 && order == '>';
        return 0;
    }
    return -1;
}

/* The value at p of esize bytes, little-endian unless swap, as unsigned bits. */
static inline uint64_t load_bits(const unsigned char *p, int esize, int swap)
{
    uint64_t v = 0;
    if (swap)
        for (int i = 0; i < esize; i++)
            v = v << 8 | p[i];
    else
        for (int i = esize - 1; i >= 0; i--)
            v = v << 8 | p[i];
    return v;
}

/* Decode the NPY file p[0..n) of member `q` into `a` (name set by the
 * caller); *budget is the values still allowed, lowered by its count. */
static md_status decode_npy(const unsigned char *p, size_t n, const char *q, size_t *budget,
                            md_array *a, md_err *err)
{
    size_t hlen = 0, off = 0;
    int version = 0;
    md_npy_pre_status ps = md_npy_preamble(p, n, &version, &hlen, &off);
    if (ps == MD_NPY_PRE_NOT_NPY)
        return md_err_setc(err, MD_EINVAL, "bad_npz",
                           "the NPZ member \"%s\" is not an NPY file (no \\x93NUMPY magic); %s",
                           q, fix);
    if (ps == MD_NPY_PRE_VERSION || ps == MD_NPY_PRE_MORE)
        return md_err_setc(err, MD_EINVAL, "bad_npz",
                           "the NPZ member \"%s\" is NPY version %d, which is not supported; "
                           "%s",
                           q, version, fix);
    if (ps == MD_NPY_PRE_LARGE || hlen > n - off)
        return md_err_setc(err, MD_EINVAL, "bad_npz",
                           "the NPY header of NPZ member \"%s\" is truncated; %s", q, fix);
    char header[MD_NPY_HEADER_MAX + 1];
    memcpy(header, p + off, hlen);
    header[hlen] = '\0';
    md_npy_dict dict;
    md_npy_dict_status ds = md_npy_parse_dict(header, &dict);
    if (ds == MD_NPY_DICT_KEYS)
        return md_err_setc(err, MD_EINVAL, "bad_npz",
                           "the NPY header of NPZ member \"%s\" lacks descr, fortran_order or "
                           "shape; %s",
                           q, fix);
    if (ds == MD_NPY_DICT_FORTRAN)
        return md_err_setc(err, MD_EINVAL, "bad_npz",
                           "the NPZ member \"%s\" is in Fortran order; save a C-order array "
                           "(numpy.ascontiguousarray)",
                           q);
    int kind, esize, swap;
    if (dtype_kind(dict.descr, &kind, &esize, &swap) < 0)
        return md_err_setc(err, MD_EINVAL, "bad_npz",
                           "the NPZ member \"%s\" has dtype %s, which is not supported; use "
                           "float16/32/64, bool, int8/16/32/64 or uint8/16/32/64",
                           q, dict.descr[0] ? dict.descr : "(unreadable)");
    if (dict.shape_status != MD_NPY_DICT_OK)
        return md_err_setc(err, MD_EINVAL, "bad_npz",
                           "the NPZ member \"%s\" has a malformed shape or more than %d dims; %s",
                           q, MD_MAX_DIMS, fix);
    size_t count = 1;
    for (int d = 0; d < dict.ndim; d++)
        if (md_mul_size(count, (size_t)dict.shape[d], &count))
            return md_err_setc(err, MD_ETOOBIG, "too_many_values",
                               "the NPZ member \"%s\" holds more values than fit in memory; the "
                               "limit is %zu",
                               q, *budget);
    if (count > *budget)
        return md_err_setc(err, MD_ETOOBIG, "too_many_values",
                           "the NPZ member \"%s\" has %zu values, more than the %zu left of the "
                           "request's limit",
                           q, count, *budget);
    off += hlen;
    /* count <= budget, which the caller bounded by the member's size / 8 */
    if ((n - off) / (size_t)esize != count || (n - off) % (size_t)esize)
        return md_err_setc(err, MD_EINVAL, "bad_npz",
                           "the NPZ member \"%s\" has %zu bytes of data, but its shape holds "
                           "%zu values of %d bytes; %s",
                           q, n - off, count, esize, fix);
    a->ndim = dict.ndim;
    for (int d = 0; d < dict.ndim; d++)
        a->shape[d] = dict.shape[d];
    a->count = count;
    a->is_int = kind >= K_BOOL;
    *budget -= count;
    if (count == 0)
        return MD_OK;
    const unsigned char *src = p + off;
    if (!a->is_int) {
        float *f = md_mallocarray_checked(count, sizeof *f, "the NPZ member's values", err);
        if (!f)
            return MD_ENOMEM;
        a->f32 = f;
        if (kind == K_F32 && !swap) /* what numpy writes for float32: one copy */
            memcpy(f, src, count * sizeof *f);
        for (size_t i = 0; i < count && !(kind == K_F32 && !swap); i++) {
            uint64_t bits = load_bits(src + i * (size_t)esize, esize, swap);
            if (kind == K_F16) {
                f[i] = md_half_to_float((uint16_t)bits);
            } else if (kind == K_F32) {
                uint32_t b32 = (uint32_t)bits;
                memcpy(&f[i], &b32, 4);
            } else {
                double v;
                memcpy(&v, &bits, 8);
                /* past float32's range the cast is undefined */
                if (!(fabs(v) <= (double)FLT_MAX))
                    return md_err_setc(err, MD_EINVAL, "invalid_input",
                                       "value %zu of NPZ member \"%s\" is %s; send finite "
                                       "values within float32's range",
                                       i, q, isnan(v) ? "NaN" : isinf(v) ? "infinite" :
                                       "outside float32's range");
                f[i] = (float)v;
            }
        }
        size_t bad = md_first_not_finite(f, count);
        if (bad < count)
            return md_err_setc(err, MD_EINVAL, "invalid_input",
                               "value %zu of NPZ member \"%s\" is NaN or infinite; send finite "
                               "values",
                               bad, q);
        return MD_OK;
    }
    int64_t *v = md_mallocarray_checked(count, sizeof *v, "the NPZ member's values", err);
    if (!v)
        return MD_ENOMEM;
    a->i64 = v;
    if (kind == K_I64 && !swap) { /* numpy's default integer: one copy */
        memcpy(v, src, count * sizeof *v);
        return MD_OK;
    }
    for (size_t i = 0; i < count; i++) {
        uint64_t bits = load_bits(src + i * (size_t)esize, esize, swap);
        switch (kind) {
        case K_BOOL:
            if (bits > 1)
                return md_err_setc(err, MD_EINVAL, "bad_npz",
                                   "value %zu of NPZ member \"%s\" is a bool of %llu, not 0 "
                                   "or 1; %s",
                                   i, q, (unsigned long long)bits, fix);
            v[i] = (int64_t)bits;
            break;
        case K_I8:
            v[i] = (int8_t)(uint8_t)bits;
            break;
        case K_I16:
            v[i] = (int16_t)(uint16_t)bits;
            break;
        case K_I32:
            v[i] = (int32_t)(uint32_t)bits;
            break;
        case K_I64:
            memcpy(&v[i], &bits, 8);
            break;
        case K_U64:
            if (bits > (uint64_t)INT64_MAX)
                return md_err_setc(err, MD_EINVAL, "invalid_input",
                                   "value %zu of NPZ member \"%s\" is %llu, past int64's "
                                   "range; send values up to 9223372036854775807",
                                   i, q, (unsigned long long)bits);
            v[i] = (int64_t)bits;
            break;
        default: /* u8, u16, u32 */
            v[i] = (int64_t)bits;
        }
    }
    return MD_OK;
}

/* md_npz_decode, or with `list` set (room for MD_MAX_IO) only the members'
 * checked directory entries into list[0..*nlist): nothing inflated, decoded
 * or allocated (a dataset file read member by member: md_npz_list). */
static md_status npz_read(const char *data, size_t len, size_t max_values, md_arrays *out,
                          md_npz_entry *list, int *nlist, md_err *err)
{
    memset(out, 0, sizeof *out);
    if (nlist)
        *nlist = 0;
    const unsigned char *d = (const unsigned char *)data;
    if (!d)
        len = 0;
    npz_dir pos = {0, 0, 0, 0};
    md_status st = locate(d, len, &pos, err);
    if (st != MD_OK)
        return st;
    const unsigned char *cd = d + pos.cd_off;
    size_t at = 0;
    uint64_t prev_end = 0; /* where the last record's data ended */
    size_t budget = max_values;
    char q[160];
    for (uint64_t e = 0; e < pos.entries; e++) {
        if (pos.cd_size - at < CENTRAL_SIZE || le(cd + at, 4) != SIG_CENTRAL) {
            st = bad_zip(err, "has a damaged central directory");
            break;
        }
        const unsigned char *h = cd + at;
        npz_member m;
        uint64_t flags = le(h + 8, 2), method = le(h + 10, 2), local_off = le(h + 42, 4);
        m.crc = (uint32_t)le(h + 16, 4);
        m.csize = le(h + 20, 4);
        m.usize = le(h + 24, 4);
        size_t nlen = (size_t)le(h + 28, 2), xlen = (size_t)le(h + 30, 2),
               clen = (size_t)le(h + 32, 2);
        if (pos.cd_size - at - CENTRAL_SIZE < (uint64_t)nlen + xlen + clen) {
            st = bad_zip(err, "has a damaged central directory");
            break;
        }
        at += CENTRAL_SIZE + nlen + xlen + clen;
        m.name = h + CENTRAL_SIZE;
        m.name_len = nlen;
        quote(m.name, nlen, q, sizeof q);
        if ((m.usize == 0xFFFFFFFF || m.csize == 0xFFFFFFFF || local_off == 0xFFFFFFFF) &&
            zip64_sizes(m.name + nlen, xlen, &m.usize, &m.csize, &local_off) < 0) {
            st = md_err_setc(err, MD_EINVAL, "bad_npz",
                             "the NPZ member \"%s\" has zip64 sizes that are missing or "
                             "damaged; %s",
                             q, fix);
            break;
        }
        if (nlen < 5 || memcmp(m.name + nlen - 4, ".npy", 4) != 0) {
            st = md_err_setc(err, MD_EINVAL, "bad_npz",
                             "the NPZ body holds \"%s\", which is not an array (NAME.npy); %s",
                             q, fix);
            break;
        }
        if (nlen - 4 >= MD_IO_NAME_MAX || memchr(m.name, '\0', nlen - 4)) {
            st = md_err_setc(err, MD_EINVAL, "bad_npz",
                             "the NPZ member \"%s\" has a name longer than %d bytes or with a "
                             "NUL byte; name arrays as the model's inputs",
                             q, MD_IO_NAME_MAX - 1);
            break;
        }
        md_array *a = &out->a[out->n];
        memcpy(a->name, m.name, nlen - 4);
        a->name[nlen - 4] = '\0';
        int twice = md_arrays_find(out, a->name) != NULL;
        for (int k = 0; list && k < *nlist; k++)
            twice |= strcmp(list[k].name, a->name) == 0;
        if (twice) {
            st = md_err_setc(err, MD_EINVAL, "bad_npz",
                             "the NPZ body holds two arrays named \"%s\"; %s", q, fix);
            memset(a, 0, sizeof *a);
            break;
        }
        if (flags & 1) {
            st = md_err_setc(err, MD_EINVAL, "bad_npz",
                             "the NPZ member \"%s\" is encrypted; %s", q, fix);
            break;
        }
        if (method != 0 && method != 8) {
            st = md_err_setc(err, MD_EINVAL, "bad_npz",
                             "the NPZ member \"%s\" is compressed with zip method %llu; only "
                             "stored (numpy.savez) and deflated (numpy.savez_compressed) "
                             "members are read",
                             q, (unsigned long long)method);
            break;
        }
        m.deflated = method == 8;
        /* the local header: inside the body, after the last record, before
         * the directory, and saying what the directory says */
        if (local_off < prev_end || local_off > pos.cd_off ||
            pos.cd_off - local_off < LOCAL_SIZE) {
            st = md_err_setc(err, MD_EINVAL, "bad_npz",
                             "the NPZ member \"%s\" lies outside the archive or over another "
                             "member; %s",
                             q, fix);
            break;
        }
        const unsigned char *l = d + local_off;
        uint64_t lflags = le(l + 6, 2), lmethod = le(l + 8, 2), lcrc = le(l + 14, 4),
                 lcsize = le(l + 18, 4), lusize = le(l + 22, 4);
        size_t lnlen = (size_t)le(l + 26, 2), lxlen = (size_t)le(l + 28, 2);
        uint64_t data_off = local_off + LOCAL_SIZE + lnlen + lxlen;
        if (le(l, 4) != SIG_LOCAL || data_off > pos.cd_off || lnlen != nlen ||
            memcmp(l + LOCAL_SIZE, m.name, nlen) != 0 || lmethod != method ||
            (!(lflags & 8) &&
             (lcrc != m.crc || (lcsize != 0xFFFFFFFF && lcsize != m.csize) ||
              (lusize != 0xFFFFFFFF && lusize != m.usize)))) {
            st = md_err_setc(err, MD_EINVAL, "bad_npz",
                             "the NPZ member \"%s\" has a local header that disagrees with the "
                             "archive's directory; %s",
                             q, fix);
            break;
        }
        if (m.csize > pos.cd_off - data_off) {
            st = md_err_setc(err, MD_EINVAL, "bad_npz",
                             "the NPZ member \"%s\" is truncated: it declares %llu bytes, the "
                             "body holds %llu; %s",
                             q, (unsigned long long)m.csize,
                             (unsigned long long)(pos.cd_off - data_off), fix);
            break;
        }
        prev_end = data_off + m.csize;
        m.data = d + data_off;
        if (list) {
            if (m.deflated ? m.usize > m.csize * DEFLATE_MAX_RATIO + DEFLATE_SLACK
                           : m.usize != m.csize) {
                st = md_err_setc(err, MD_EINVAL, "bad_npz",
                                 "the NPZ member \"%s\" declares %llu bytes, which its %llu "
                                 "%s bytes cannot hold; %s",
                                 q, (unsigned long long)m.usize, (unsigned long long)m.csize,
                                 m.deflated ? "deflated" : "stored", fix);
                break;
            }
            md_npz_entry *en = &list[(*nlist)++];
            snprintf(en->name, sizeof en->name, "%s", a->name);
            memset(a->name, 0, sizeof a->name);
            en->deflated = m.deflated;
            en->crc = m.crc;
            en->csize = m.csize;
            en->usize = m.usize;
            en->offset = data_off;
            continue;
        }
        /* bounded before anything is allocated: by the values still allowed */
        uint64_t allowed = (uint64_t)budget > (UINT64_MAX - NPY_SLACK) / 8
                               ? UINT64_MAX
                               : (uint64_t)budget * 8 + NPY_SLACK;
        if (m.usize > allowed) {
            st = md_err_setc(err, MD_ETOOBIG, "too_many_values",
                             "the NPZ member \"%s\" is %llu bytes, more than the %zu values "
                             "left of the request's limit of %zu can take",
                             q, (unsigned long long)m.usize, budget, max_values);
            break;
        }
        /* ... and by what its bytes can hold: a size deflate cannot make
         * from them is a lie, refused before inflating */
        if (m.deflated ? m.usize > m.csize * DEFLATE_MAX_RATIO + DEFLATE_SLACK
                       : m.usize != m.csize) {
            st = md_err_setc(err, MD_EINVAL, "bad_npz",
                             "the NPZ member \"%s\" declares %llu bytes, which its %llu %s "
                             "bytes cannot hold; %s",
                             q, (unsigned long long)m.usize, (unsigned long long)m.csize,
                             m.deflated ? "deflated" : "stored", fix);
            break;
        }
        unsigned char *inflated = NULL;
        const unsigned char *npy = m.data;
        if (m.deflated) {
            st = inflate_member(&m, q, &inflated, err);
            if (st != MD_OK)
                break;
            npy = inflated;
        }
        if (crc_of(npy, (size_t)m.usize) != m.crc) {
            free(inflated);
            st = md_err_setc(err, MD_EINVAL, "bad_npz",
                             "the NPZ member \"%s\" fails its CRC check (damaged in transit?); "
                             "%s",
                             q, fix);
            break;
        }
        out->n++; /* the array is out's from here: md_arrays_free frees it */
        st = decode_npy(npy, (size_t)m.usize, q, &budget, a, err);
        free(inflated);
        if (st != MD_OK)
            break;
    }
    /* bytes in the directory past its entries would be entries to another reader */
    if (st == MD_OK && at != pos.cd_size)
        st = bad_zip(err, "has a central directory longer than its entries");
    if (st != MD_OK)
        md_arrays_free(out);
    return st;
}

md_status md_npz_decode(const char *data, size_t len, size_t max_values, md_arrays *out,
                        md_err *err)
{
    return npz_read(data, len, max_values, out, NULL, NULL, err);
}

md_status md_npz_list(const char *data, size_t len, md_npz_entry *list, int *n, md_err *err)
{
    md_arrays none;
    return npz_read(data, len, 0, &none, list, n, err);
}

md_status md_npy_decode_array(const char *data, size_t len, size_t max_values, md_array *out,
                              md_err *err)
{
    memset(out, 0, sizeof *out);
    size_t budget = max_values;
    md_status st = decode_npy((const unsigned char *)(data ? data : ""), data ? len : 0,
                              "(the NPY body)", &budget, out, err);
    if (st != MD_OK) {
        free(out->f32);
        free(out->i64);
        memset(out, 0, sizeof *out);
    }
    return st;
}
