/*
 * safetensors.c - the safetensors format (huggingface/safetensors): an
 * 8-byte little-endian header length N, N bytes of JSON mapping each name to
 * {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the
 * data that follows the header) plus an optional "__metadata__" object of
 * strings, then the raw little-endian data. The reader trusts nothing: N is
 * bounded by MD_SAFETENSORS_MAX_HEADER and the file, every offset by the
 * data, end - begin must equal numel x element size (checked arithmetic),
 * names are unique, and the tensors must cover the data exactly once, in
 * order, without holes or overlaps, as the format's specification requires.
 * The writer makes files the reference implementation reads: the header
 * padded with spaces to a multiple of 8 bytes, tensors back to back.
 */
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "formats.h"
#include "../config/md_json.h"

typedef struct entry {
    const char *name; /* borrowed from the JSON header */
    md_ckpt_dtype dtype;
    int ndim;
    int64_t shape[MD_CKPT_MAX_NDIM];
    uint64_t begin, end;
} entry;

static int by_begin(const void *a, const void *b)
{
    const entry *x = a, *y = b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

/* A printable, shortened copy of a name from the file, for messages. */
static const char *quoted(const char *s, char *buf, size_t size)
{
    size_t o = 0;
    for (; *s && o + 5 < size; s++) {
        unsigned char c = (unsigned char)*s;
        if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\')
            buf[o++] = (char)c;
        else
            o += (size_t)snprintf(buf + o, size - o, "\\x%02x", c);
    }
    buf[o] = 0;
    return buf;
}

static md_status parse_entry(const char *name, json_t *v, uint64_t data_size, entry *e,
                             md_err *err)
{
    char q[160];
    quoted(name, q, sizeof q);
    if (!json_is_object(v))
        return md_err_set(err, MD_EUNPROC, "safetensors: entry \"%s\" is not an object", q);
    const char *dt = json_string_value(json_object_get(v, "dtype"));
    json_t *shape = json_object_get(v, "shape"), *offs = json_object_get(v, "data_offsets");
    if (!dt || !json_is_array(shape) || !json_is_array(offs) || json_array_size(offs) != 2)
        return md_err_set(err, MD_EUNPROC, "safetensors: entry \"%s\" needs \"dtype\", "
                          "\"shape\" and \"data_offsets\": [begin, end]", q);
    int found = 0;
    for (int d = 0; d < MD_CKPT_DTYPE_COUNT; d++)
        if (strcmp(dt, md_ckpt_dtype_name((md_ckpt_dtype)d)) == 0) {
            e->dtype = (md_ckpt_dtype)d;
            found = 1;
        }
    if (!found) {
        char qd[40];
        return md_err_set(err, MD_EUNPROC, "safetensors: tensor \"%s\" has dtype \"%s\"; "
                          "supported are F32, F16, BF16, F64, I64, I32, I16, I8, U8 and BOOL", q,
                          quoted(dt, qd, sizeof qd));
    }
    if (json_array_size(shape) > MD_CKPT_MAX_NDIM)
        return md_err_set(err, MD_EUNPROC, "safetensors: tensor \"%s\" has %zu dimensions; at "
                          "most %d are supported", q, json_array_size(shape), MD_CKPT_MAX_NDIM);
    e->ndim = (int)json_array_size(shape);
    uint64_t numel = 1, bytes;
    for (int d = 0; d < e->ndim; d++) {
        json_t *x = json_array_get(shape, (size_t)d);
        if (!json_is_integer(x) || json_integer_value(x) < 0 ||
            __builtin_mul_overflow(numel, (uint64_t)json_integer_value(x), &numel))
            return md_err_set(err, MD_EUNPROC, "safetensors: tensor \"%s\" has an invalid shape "
                              "(dimension %d)", q, d);
        e->shape[d] = json_integer_value(x);
    }
    json_t *b = json_array_get(offs, 0), *en = json_array_get(offs, 1);
    if (!json_is_integer(b) || !json_is_integer(en) || json_integer_value(b) < 0 ||
        json_integer_value(en) < json_integer_value(b))
        return md_err_set(err, MD_EUNPROC, "safetensors: tensor \"%s\" has invalid data_offsets "
                          "(two integers, begin <= end)", q);
    e->begin = (uint64_t)json_integer_value(b);
    e->end = (uint64_t)json_integer_value(en);
    if (e->end > data_size)
        return md_err_set(err, MD_EUNPROC, "safetensors: tensor \"%s\" ends at byte %llu of the "
                          "data, which holds %llu bytes; the file is truncated or corrupt", q,
                          (unsigned long long)e->end, (unsigned long long)data_size);
    if (__builtin_mul_overflow(numel, (uint64_t)md_ckpt_dtype_size(e->dtype), &bytes))
        return md_err_set(err, MD_EUNPROC, "safetensors: tensor \"%s\" has a shape whose size "
                          "overflows 64 bits", q);
    if (bytes != e->end - e->begin)
        return md_err_set(err, MD_EUNPROC, "safetensors: tensor \"%s\" has %llu bytes of data; "
                          "its shape and dtype %s need %llu", q,
                          (unsigned long long)(e->end - e->begin), dt, (unsigned long long)bytes);
    e->name = name;
    return MD_OK;
}

/* jansson's heap for a tree, in bytes per node as measured with glibc
 * (jansson 2.14): an empty object ~224, an empty array ~136, a scalar ~48,
 * an object member ~64 more than its key. A well-formed header costs ~15-17x
 * its size this way (tensor entries, __metadata__ strings). */
#define HEAP_PER_OBJECT 224
#define HEAP_PER_ARRAY 136
#define HEAP_PER_SCALAR 48
#define HEAP_PER_MEMBER 64
/* what jansson may spend on a header of N bytes: HEADER_HEAP_RATIO x N plus
 * a fixed HEADER_HEAP_SLACK; "[{},{},...]" would need ~75x */
#define HEADER_HEAP_RATIO 20
#define HEADER_HEAP_SLACK (1u << 20)

/* Before jansson builds the header (json_loadb builds the whole tree, ~80
 * bytes of heap per byte of "[{},{},...]"): one pass that validates it,
 * nests it at most 3 deep (the header, an entry, its shape) and refuses it
 * when its tree would take more than HEADER_HEAP_RATIO x its size. */
static md_status header_bounded(const char *h, size_t n, md_err *err)
{
    md_json_scan sc;
    memset(&sc, 0, sizeof sc);
    if (!md_json_check(h, n, 3, &sc))
        return md_err_set(err, MD_EUNPROC, "safetensors: the header is not valid JSON nested "
                          "at most 3 deep (header, entry, shape) at byte %zu; it must map each "
                          "name to {\"dtype\", \"shape\", \"data_offsets\"}", sc.bad);
    size_t arrays = sc.containers - sc.objects, scalars = sc.values - sc.containers;
    /* counts are below n, so the sum cannot overflow a size_t of 64 bits */
    uint64_t heap = (uint64_t)sc.objects * HEAP_PER_OBJECT + (uint64_t)arrays * HEAP_PER_ARRAY +
                    (uint64_t)scalars * HEAP_PER_SCALAR + (uint64_t)sc.members * HEAP_PER_MEMBER;
    if (heap > (uint64_t)n * HEADER_HEAP_RATIO + HEADER_HEAP_SLACK)
        return md_err_set(err, MD_EUNPROC, "safetensors: the %zu-byte header holds %zu objects, "
                          "%zu arrays and %zu other values, which would take ~%llu MB to parse "
                          "(the limit is %dx the header plus 1 MB); a safetensors header holds "
                          "only {\"dtype\", \"shape\", \"data_offsets\"} entries and "
                          "__metadata__ strings", n, sc.objects, arrays, scalars,
                          (unsigned long long)(heap >> 20), HEADER_HEAP_RATIO);
    return MD_OK;
}

/* Parse and check the file in `buf`; then each tensor, in data order, into
 * `t` (fn NULL) or to `fn` (with its data when `with_data`). The metadata
 * goes into `t` either way. */
static md_status read_buf(const uint8_t *buf, size_t len, md_tensors *t, md_ckpt_tensor_fn fn,
                          void *ctx, int with_data, md_err *err)
{
    if (len < 8)
        return md_err_set(err, MD_EUNPROC, "safetensors: the file is %zu bytes, shorter than "
                          "its 8-byte header length", len);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--)
        n = n << 8 | buf[i];
    if (n > (uint64_t)MD_SAFETENSORS_MAX_HEADER)
        return md_err_set(err, MD_EUNPROC, "safetensors: the header is %llu bytes; modeld's limit is "
                          "%lld (MD_SAFETENSORS_MAX_HEADER: about 150,000 tensors); save "
                          "fewer, larger tensors", (unsigned long long)n,
                          (long long)MD_SAFETENSORS_MAX_HEADER);
    if (n > len - 8)
        return md_err_set(err, MD_EUNPROC, "safetensors: the header claims %llu bytes but the "
                          "file has %zu after the length; the file is truncated",
                          (unsigned long long)n, len - 8);
    if (n < 2 || buf[8] != '{')
        return md_err_set(err, MD_EUNPROC, "safetensors: the header is not a JSON object");
    md_status pre = header_bounded((const char *)buf + 8, (size_t)n, err);
    if (pre != MD_OK)
        return pre;
    json_error_t jerr;
    json_t *h = json_loadb((const char *)buf + 8, (size_t)n, JSON_REJECT_DUPLICATES, &jerr);
    if (!h || !json_is_object(h)) {
        json_decref(h);
        return md_err_set(err, MD_EUNPROC, "safetensors: the header is not valid JSON (%s at "
                          "byte %d); names must be unique", jerr.text, jerr.position);
    }
    const uint8_t *data = buf + 8 + n;
    uint64_t data_size = len - 8 - n;
    size_t count = json_object_size(h);
    entry *entries = md_malloc_checked((count ? count : 1) * sizeof *entries,
                                       "safetensors header", err);
    md_status st = entries ? MD_OK : MD_ENOMEM;
    size_t ne = 0;
    const char *key;
    json_t *v;
    json_object_foreach(h, key, v)
    {
        if (st != MD_OK)
            break;
        if (strcmp(key, "__metadata__") == 0) {
            const char *mk;
            json_t *mv;
            if (!json_is_object(v)) {
                st = md_err_set(err, MD_EUNPROC, "safetensors: __metadata__ is not an object of "
                                "strings");
                break;
            }
            json_object_foreach(v, mk, mv)
            {
                if (!json_is_string(mv)) {
                    char q[160];
                    st = md_err_set(err, MD_EUNPROC, "safetensors: __metadata__ entry \"%s\" is "
                                    "not a string", quoted(mk, q, sizeof q));
                    break;
                }
                md_tensors_set_meta(t, mk, json_string_value(mv));
            }
            continue;
        }
        if (strlen(key) > MD_CKPT_MAX_NAME || ne >= MD_CKPT_MAX_TENSORS) {
            st = md_err_set(err, MD_EUNPROC, "safetensors: a name is longer than %d bytes or "
                            "there are more than %d tensors", MD_CKPT_MAX_NAME,
                            MD_CKPT_MAX_TENSORS);
            break;
        }
        st = parse_entry(key, v, data_size, &entries[ne], err);
        if (st == MD_OK)
            ne++;
    }
    if (st == MD_OK) {
        /* the spec: the data is indexed entirely, without holes or overlaps */
        qsort(entries, ne, sizeof *entries, by_begin);
        uint64_t at = 0;
        for (size_t i = 0; i < ne && st == MD_OK; i++) {
            char q[160];
            if (entries[i].begin != at)
                st = md_err_set(err, MD_EUNPROC, "safetensors: tensor \"%s\" starts at byte %llu "
                                "of the data, but the previous tensor ends at %llu; tensors must "
                                "cover the data without %s", quoted(entries[i].name, q, sizeof q),
                                (unsigned long long)entries[i].begin, (unsigned long long)at,
                                entries[i].begin > at ? "holes" : "overlapping");
            at = entries[i].end;
        }
        if (st == MD_OK && at != data_size)
            st = md_err_set(err, MD_EUNPROC, "safetensors: the tensors cover %llu bytes of data "
                            "but the file holds %llu; the file has trailing bytes or is corrupt",
                            (unsigned long long)at, (unsigned long long)data_size);
        if (st == MD_OK && ne == 0)
            st = md_err_set(err, MD_EUNPROC, "safetensors: the file holds no tensors");
    }
    for (size_t i = 0; i < ne && st == MD_OK; i++) {
        const entry *e = &entries[i];
        if (fn)
            st = fn(ctx, e->name, e->dtype, e->ndim, e->shape,
                    with_data ? data + e->begin : NULL, (size_t)(e->end - e->begin), err);
        else
            st = md_tensors_add(t, e->name, e->dtype, e->ndim, e->shape, data + e->begin,
                                (size_t)(e->end - e->begin), err);
    }
    free(entries);
    json_decref(h);
    return st;
}

md_status md_safetensors_read(const uint8_t *buf, size_t len, md_tensors **out, md_err *err)
{
    *out = NULL;
    md_tensors *t = md_tensors_new();
    md_status st = read_buf(buf, len, t, NULL, NULL, 1, err);
    if (st != MD_OK) {
        md_tensors_free(t);
        return st;
    }
    *out = t;
    return MD_OK;
}

/* The file at `path` mapped read-only: *map NULL for an empty file. */
static md_status map_file(const char *path, void **map, size_t *len, md_err *err)
{
    *map = NULL;
    *len = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return md_err_set(err, MD_EIO, "cannot open the safetensors file: %s", strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) < 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return md_err_set(err, MD_EIO, "the safetensors file is not a regular file");
    }
    size_t n = (size_t)sb.st_size;
    if (n == 0) {
        close(fd);
        return MD_OK;
    }
    void *m = mmap(NULL, n, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (m == MAP_FAILED)
        return md_err_set(err, MD_EIO, "cannot map the safetensors file: %s", strerror(errno));
    *map = m;
    *len = n;
    return MD_OK;
}

md_status md_safetensors_read_file(const char *path, md_tensors **out, md_err *err)
{
    *out = NULL;
    void *map;
    size_t len;
    md_status st = map_file(path, &map, &len, err);
    if (st != MD_OK)
        return st;
    st = md_safetensors_read(map ? map : (const void *)"", len, out, err);
    if (map)
        munmap(map, len);
    return st;
}

/* md_safetensors_each_file's callee: the caller's, then the mapped pages
 * let go (they count in the process's RSS while mapped; the page cache
 * keeps them for whoever reads them next). */
typedef struct each_mapped {
    md_ckpt_tensor_fn fn;
    void *ctx;
    void *map;
    size_t len;
} each_mapped;

static md_status each_then_drop(void *c, const char *name, md_ckpt_dtype dtype, int ndim,
                                const int64_t *shape, const void *data, size_t nbytes,
                                md_err *err)
{
    each_mapped *e = c;
    md_status st = e->fn(e->ctx, name, dtype, ndim, shape, data, nbytes, err);
    if (data)
        madvise(e->map, e->len, MADV_DONTNEED);
    return st;
}

md_status md_safetensors_each_file(const char *path, int with_data, md_ckpt_tensor_fn fn,
                                   void *ctx, md_err *err)
{
    void *map;
    size_t len;
    md_status st = map_file(path, &map, &len, err);
    if (st != MD_OK)
        return st;
    each_mapped e = {fn, ctx, map, len};
    md_tensors *meta = md_tensors_new();
    st = read_buf(map ? map : (const void *)"", len, meta, each_then_drop, &e, with_data, err);
    md_tensors_free(meta);
    if (map)
        munmap(map, len);
    return st;
}

/* The JSON header of `count` tensors and `meta`'s metadata (may be NULL),
 * padded with spaces to a multiple of 8; a new string. */
static char *header_json(const md_ckpt_tensor_info *info, size_t count, const md_tensors *meta,
                         size_t *hlen, md_err *err)
{
    json_t *h = json_object();
    if (meta && md_tensors_meta_count(meta)) {
        json_t *m = json_object();
        for (size_t i = 0; i < md_tensors_meta_count(meta); i++)
            json_object_set_new(m, md_tensors_meta_key(meta, i),
                                json_string(md_tensors_meta_value(meta, i)));
        json_object_set_new(h, "__metadata__", m);
    }
    uint64_t at = 0;
    for (size_t i = 0; i < count; i++) {
        json_t *shape = json_array();
        uint64_t numel = 1, bytes, end;
        for (int d = 0; d < info[i].ndim; d++) {
            json_array_append_new(shape, json_integer(info[i].shape[d]));
            if (info[i].shape[d] < 0 ||
                __builtin_mul_overflow(numel, (uint64_t)info[i].shape[d], &numel))
                numel = UINT64_MAX;
        }
        if (numel == UINT64_MAX ||
            __builtin_mul_overflow(numel, (uint64_t)md_ckpt_dtype_size(info[i].dtype), &bytes) ||
            __builtin_add_overflow(at, bytes, &end)) {
            json_decref(shape);
            json_decref(h);
            md_err_set(err, MD_ETOOBIG, "tensor \"%.200s\" is too large for one file",
                       info[i].name);
            return NULL;
        }
        if (strcmp(info[i].name, "__metadata__") == 0 ||
            json_object_set_new(h, info[i].name,
                                json_pack("{s:s, s:o, s:[I,I]}", "dtype",
                                          md_ckpt_dtype_name(info[i].dtype), "shape", shape,
                                          "data_offsets", (json_int_t)at, (json_int_t)end)) < 0) {
            json_decref(h);
            md_err_set(err, MD_EINVAL, "tensor name \"%.200s\" cannot be written (reserved or "
                       "not UTF-8)", info[i].name);
            return NULL;
        }
        at = end;
    }
    char *s = json_dumps(h, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(h);
    if (!s) {
        md_err_set(err, MD_EINVAL, "a tensor name or metadata string is not valid UTF-8");
        return NULL;
    }
    size_t n = strlen(s), padded = (n + 7) & ~(size_t)7;
    char *p = realloc(s, padded + 1);
    if (!p) {
        free(s);
        md_err_set(err, MD_ENOMEM, "out of memory writing a safetensors header");
        return NULL;
    }
    memset(p + n, ' ', padded - n);
    p[padded] = 0;
    *hlen = padded;
    return p;
}

/* header_json of an md_tensors' own tensors and metadata. */
static char *list_header_json(const md_tensors *t, size_t *hlen, md_err *err)
{
    size_t n = md_tensors_count(t);
    md_ckpt_tensor_info *info = md_calloc_checked(n ? n : 1, sizeof *info,
                                                  "safetensors header", err);
    if (!info)
        return NULL;
    for (size_t i = 0; i < n; i++)
        info[i] = (md_ckpt_tensor_info){md_tensors_name(t, i), md_tensors_dtype(t, i),
                                        md_tensors_ndim(t, i), md_tensors_shape(t, i)};
    char *h = header_json(info, n, t, hlen, err);
    free(info);
    return h;
}

md_status md_safetensors_header(const md_ckpt_tensor_info *info, size_t count,
                                const md_tensors *meta, uint8_t **out, size_t *len, md_err *err)
{
    *out = NULL;
    *len = 0;
    size_t hlen;
    char *h = header_json(info, count, meta, &hlen, err);
    if (!h)
        return err ? err->status : MD_EINVAL;
    uint8_t *b = md_malloc_checked(hlen + 8, "safetensors header", err);
    if (!b) {
        free(h);
        return MD_ENOMEM;
    }
    for (int i = 0; i < 8; i++)
        b[i] = (uint8_t)((uint64_t)hlen >> (8 * i));
    memcpy(b + 8, h, hlen);
    free(h);
    *out = b;
    *len = hlen + 8;
    return MD_OK;
}

md_status md_safetensors_write(const md_tensors *t, uint8_t **buf, size_t *len, md_err *err)
{
    *buf = NULL;
    *len = 0;
    size_t hlen, total;
    char *h = list_header_json(t, &hlen, err);
    if (!h)
        return err ? err->status : MD_EINVAL;
    total = 8 + hlen;
    for (size_t i = 0; i < md_tensors_count(t); i++)
        if (__builtin_add_overflow(total, md_tensors_nbytes(t, i), &total)) {
            free(h);
            return md_err_set(err, MD_ETOOBIG, "the tensors are too large for one file");
        }
    uint8_t *out = md_malloc_checked(total, "safetensors file", err);
    if (!out) {
        free(h);
        return MD_ENOMEM;
    }
    for (int i = 0; i < 8; i++)
        out[i] = (uint8_t)((uint64_t)hlen >> (8 * i));
    memcpy(out + 8, h, hlen);
    free(h);
    size_t at = 8 + hlen;
    for (size_t i = 0; i < md_tensors_count(t); i++) {
        if (md_tensors_nbytes(t, i))
            memcpy(out + at, md_tensors_data(t, i), md_tensors_nbytes(t, i));
        at += md_tensors_nbytes(t, i);
    }
    *buf = out;
    *len = total;
    return MD_OK;
}

static md_status write_all(int fd, const void *p, size_t n, md_err *err)
{
    const uint8_t *b = p;
    while (n) {
        ssize_t w = write(fd, b, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return md_err_set(err, MD_EIO, "writing the safetensors file failed: %s",
                              w < 0 ? strerror(errno) : "no progress");
        b += w;
        n -= (size_t)w;
    }
    return MD_OK;
}

md_status md_safetensors_write_fd(const md_tensors *t, int fd, md_err *err)
{
    size_t hlen;
    char *h = list_header_json(t, &hlen, err);
    if (!h)
        return err ? err->status : MD_EINVAL;
    uint8_t lenbuf[8];
    for (int i = 0; i < 8; i++)
        lenbuf[i] = (uint8_t)((uint64_t)hlen >> (8 * i));
    md_status st = write_all(fd, lenbuf, 8, err);
    if (st == MD_OK)
        st = write_all(fd, h, hlen, err);
    free(h);
    for (size_t i = 0; i < md_tensors_count(t) && st == MD_OK; i++)
        st = write_all(fd, md_tensors_data(t, i), md_tensors_nbytes(t, i), err);
    return st;
}
