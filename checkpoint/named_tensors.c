/*
 * named_tensors.c - md_tensors, the ordered list of named tensors that the
 * checkpoint readers produce and the safetensors writer consumes, plus the
 * small helpers of formats.h (element sizes, format sniffing, the DDP prefix).
 *
 * Names are looked up through an open-addressing hash of indices (a
 * state_dict may have thousands of entries and averaging looks each up).
 */
#include <stdlib.h>
#include <string.h>

#include "formats.h"

typedef struct tensor {
    char *name;
    md_ckpt_dtype dtype;
    int ndim;
    int64_t shape[MD_CKPT_MAX_NDIM];
    void *data;
    size_t nbytes;
} tensor;

typedef struct kv {
    char *key;
    char *str;
    double num;
} kv;

struct md_tensors {
    tensor *items;
    size_t count, cap;
    long *slots; /* hash of names: index + 1, 0 empty; nslots a power of two */
    size_t nslots;
    unsigned long long total_bytes;
    kv *scalars;
    size_t nscalars;
    kv *meta;
    size_t nmeta;
};

static const struct {
    const char *name;
    size_t size;
} dtypes[MD_CKPT_DTYPE_COUNT] = {
    [MD_CKPT_F32] = {"F32", 4}, [MD_CKPT_F16] = {"F16", 2}, [MD_CKPT_BF16] = {"BF16", 2},
    [MD_CKPT_F64] = {"F64", 8}, [MD_CKPT_I64] = {"I64", 8}, [MD_CKPT_I32] = {"I32", 4},
    [MD_CKPT_I16] = {"I16", 2}, [MD_CKPT_I8] = {"I8", 1},   [MD_CKPT_U8] = {"U8", 1},
    [MD_CKPT_BOOL] = {"BOOL", 1},
};

size_t md_ckpt_dtype_size(md_ckpt_dtype dtype)
{
    return (unsigned)dtype < MD_CKPT_DTYPE_COUNT ? dtypes[dtype].size : 0;
}

const char *md_ckpt_dtype_name(md_ckpt_dtype dtype)
{
    return (unsigned)dtype < MD_CKPT_DTYPE_COUNT ? dtypes[dtype].name : "?";
}

int md_ckpt_dtype_is_float(md_ckpt_dtype dtype)
{
    return dtype == MD_CKPT_F32 || dtype == MD_CKPT_F16 || dtype == MD_CKPT_BF16 ||
           dtype == MD_CKPT_F64;
}

md_tensors *md_tensors_new(void) { return md_xcalloc(1, sizeof(md_tensors)); }

void md_tensors_free(md_tensors *t)
{
    if (!t)
        return;
    for (size_t i = 0; i < t->count; i++) {
        free(t->items[i].name);
        free(t->items[i].data);
    }
    for (size_t i = 0; i < t->nscalars; i++)
        free(t->scalars[i].key);
    for (size_t i = 0; i < t->nmeta; i++) {
        free(t->meta[i].key);
        free(t->meta[i].str);
    }
    free(t->items);
    free(t->slots);
    free(t->scalars);
    free(t->meta);
    free(t);
}

static size_t hash_name(const char *s)
{
    size_t h = 1469598103934665603ULL; /* FNV-1a */
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 1099511628211ULL;
    return h;
}

static void rehash(md_tensors *t)
{
    size_t n = t->nslots ? t->nslots * 2 : 64;
    free(t->slots);
    t->slots = md_xcalloc(n, sizeof(long));
    t->nslots = n;
    for (size_t i = 0; i < t->count; i++) {
        size_t s = hash_name(t->items[i].name) & (n - 1);
        while (t->slots[s])
            s = (s + 1) & (n - 1);
        t->slots[s] = (long)i + 1;
    }
}

long md_tensors_find(const md_tensors *t, const char *name)
{
    if (!t->nslots)
        return -1;
    for (size_t s = hash_name(name) & (t->nslots - 1); t->slots[s]; s = (s + 1) & (t->nslots - 1))
        if (strcmp(t->items[t->slots[s] - 1].name, name) == 0)
            return t->slots[s] - 1;
    return -1;
}

/* Validate and append; `copy` (owned, NULL to copy `data`) is adopted. */
static md_status add(md_tensors *t, const char *name, md_ckpt_dtype dtype, int ndim,
                     const int64_t *shape, const void *data, void *owned, size_t nbytes,
                     md_err *err)
{
    md_status st = MD_OK;
#define FAIL(...) do { st = md_err_set(err, __VA_ARGS__); goto fail; } while (0)
    if ((unsigned)dtype >= MD_CKPT_DTYPE_COUNT)
        FAIL(MD_EINVAL, "tensor \"%.100s\" has an unknown dtype %d", name,
                          (int)dtype);
    if (ndim < 0 || ndim > MD_CKPT_MAX_NDIM)
        FAIL(MD_EINVAL, "tensor \"%.100s\" has %d dimensions; at most %d are "
                          "supported", name, ndim, MD_CKPT_MAX_NDIM);
    size_t numel = 1;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] < 0 || __builtin_mul_overflow(numel, (uint64_t)shape[d], &numel))
            FAIL(MD_EINVAL, "tensor \"%.100s\" has an invalid shape "
                              "(dimension %d is %lld)", name, d, (long long)shape[d]);
    }
    size_t want;
    if (__builtin_mul_overflow(numel, md_ckpt_dtype_size(dtype), &want) || want != nbytes)
        FAIL(MD_EINVAL, "tensor \"%.100s\" has %zu bytes of data; its shape "
                          "and dtype %s need %zu", name, nbytes, md_ckpt_dtype_name(dtype), want);
    if (strlen(name) > MD_CKPT_MAX_NAME)
        FAIL(MD_EINVAL, "a tensor name is %zu bytes long; at most %d are "
                          "allowed", strlen(name), MD_CKPT_MAX_NAME);
    if (md_tensors_find(t, name) >= 0)
        FAIL(MD_ECONFLICT, "tensor \"%.200s\" appears twice; names must be "
                          "unique", name);
    if (t->count >= MD_CKPT_MAX_TENSORS)
        FAIL(MD_ETOOBIG, "more than %d tensors; the limit is "
                          "MD_CKPT_MAX_TENSORS", MD_CKPT_MAX_TENSORS);
    unsigned long long total;
    if (__builtin_add_overflow(t->total_bytes, (unsigned long long)nbytes, &total) ||
        total > (unsigned long long)MD_CKPT_MAX_TOTAL_BYTES)
        FAIL(MD_ETOOBIG, "the tensors hold more than %lld bytes; the limit "
                          "is MD_CKPT_MAX_TOTAL_BYTES", (long long)MD_CKPT_MAX_TOTAL_BYTES);
    void *copy = owned;
    if (!copy) {
        copy = md_malloc_checked(nbytes ? nbytes : 1, "tensor data", err);
        if (!copy)
            return MD_ENOMEM;
        if (nbytes)
            memcpy(copy, data, nbytes);
    }
    if (t->count == t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 16;
        tensor *items = realloc(t->items, cap * sizeof *items);
        if (!items) {
            owned = copy;
            FAIL(MD_ENOMEM, "out of memory listing tensors");
        }
        t->items = items;
        t->cap = cap;
    }
    tensor *x = &t->items[t->count++];
    memset(x, 0, sizeof *x);
    x->name = md_xstrdup(name);
    x->dtype = dtype;
    x->ndim = ndim;
    if (ndim)
        memcpy(x->shape, shape, (size_t)ndim * sizeof(int64_t));
    x->data = copy;
    x->nbytes = nbytes;
    t->total_bytes = total;
    if (t->count * 2 > t->nslots)
        rehash(t);
    else {
        size_t s = hash_name(name) & (t->nslots - 1);
        while (t->slots[s])
            s = (s + 1) & (t->nslots - 1);
        t->slots[s] = (long)t->count;
    }
    return MD_OK;
fail:
    free(owned);
    return st;
#undef FAIL
}

md_status md_tensors_add(md_tensors *t, const char *name, md_ckpt_dtype dtype, int ndim,
                         const int64_t *shape, const void *data, size_t nbytes, md_err *err)
{
    return add(t, name, dtype, ndim, shape, data, NULL, nbytes, err);
}

md_status md_tensors_adopt(md_tensors *t, const char *name, md_ckpt_dtype dtype, int ndim,
                           const int64_t *shape, void *data, size_t nbytes, md_err *err)
{
    return add(t, name, dtype, ndim, shape, data, data, nbytes, err);
}

size_t md_tensors_count(const md_tensors *t) { return t->count; }
const char *md_tensors_name(const md_tensors *t, size_t i) { return t->items[i].name; }
md_ckpt_dtype md_tensors_dtype(const md_tensors *t, size_t i) { return t->items[i].dtype; }
int md_tensors_ndim(const md_tensors *t, size_t i) { return t->items[i].ndim; }
const int64_t *md_tensors_shape(const md_tensors *t, size_t i) { return t->items[i].shape; }
const void *md_tensors_data(const md_tensors *t, size_t i) { return t->items[i].data; }
void *md_tensors_data_mut(md_tensors *t, size_t i) { return t->items[i].data; }
size_t md_tensors_nbytes(const md_tensors *t, size_t i) { return t->items[i].nbytes; }

size_t md_tensors_scalar_count(const md_tensors *t) { return t->nscalars; }
const char *md_tensors_scalar_name(const md_tensors *t, size_t i) { return t->scalars[i].key; }
double md_tensors_scalar_value(const md_tensors *t, size_t i) { return t->scalars[i].num; }

void md_tensors_set_scalar(md_tensors *t, const char *name, double value)
{
    for (size_t i = 0; i < t->nscalars; i++)
        if (strcmp(t->scalars[i].key, name) == 0) {
            t->scalars[i].num = value;
            return;
        }
    kv *s = realloc(t->scalars, (t->nscalars + 1) * sizeof *s);
    if (!s)
        md_assert(!"out of memory");
    t->scalars = s;
    t->scalars[t->nscalars++] = (kv){md_xstrdup(name), NULL, value};
}

size_t md_tensors_meta_count(const md_tensors *t) { return t->nmeta; }
const char *md_tensors_meta_key(const md_tensors *t, size_t i) { return t->meta[i].key; }
const char *md_tensors_meta_value(const md_tensors *t, size_t i) { return t->meta[i].str; }

const char *md_tensors_meta_get(const md_tensors *t, const char *key)
{
    for (size_t i = 0; i < t->nmeta; i++)
        if (strcmp(t->meta[i].key, key) == 0)
            return t->meta[i].str;
    return NULL;
}

void md_tensors_set_meta(md_tensors *t, const char *key, const char *value)
{
    for (size_t i = 0; i < t->nmeta; i++)
        if (strcmp(t->meta[i].key, key) == 0) {
            free(t->meta[i].str);
            t->meta[i].str = md_xstrdup(value);
            return;
        }
    kv *m = realloc(t->meta, (t->nmeta + 1) * sizeof *m);
    if (!m)
        md_assert(!"out of memory");
    t->meta = m;
    t->meta[t->nmeta++] = (kv){md_xstrdup(key), md_xstrdup(value), 0};
}

const char *md_ckpt_strip_module(const char *name)
{
    return strncmp(name, "module.", 7) == 0 ? name + 7 : name;
}

md_ckpt_format md_ckpt_sniff(const uint8_t *head, size_t len)
{
    if (len >= 4 && memcmp(head, "PK\x03\x04", 4) == 0)
        return MD_CKPT_ZIP;
    /* pre-1.6 torch.save: PROTO 2, then LONG1 of 10 bytes: the magic number
     * 0x1950a86a20f9469cfc6c (little-endian) */
    static const uint8_t legacy[] = {0x80, 0x02, 0x8a, 0x0a, 0x6c, 0xfc, 0x9c, 0x46,
                                     0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19};
    if (len >= sizeof legacy && memcmp(head, legacy, sizeof legacy) == 0)
        return MD_CKPT_LEGACY;
    if (len >= 9 && head[8] == '{') {
        uint64_t n = 0;
        for (int i = 7; i >= 0; i--)
            n = n << 8 | head[i];
        if (n >= 2 && n <= (uint64_t)MD_SAFETENSORS_MAX_HEADER)
            return MD_CKPT_SAFETENSORS;
    }
    return MD_CKPT_UNKNOWN;
}
