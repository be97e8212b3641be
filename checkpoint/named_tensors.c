/*
 * named_tensors.c - md_tensors, the ordered list of named tensors that the
 * checkpoint readers produce and the safetensors writer consumes, plus the
 * small helpers of formats.h (element sizes, format sniffing, the DDP prefix).
 *
 * Names (tensors', scalars' and metadata keys) are looked up through an
 * open-addressing hash of indices: a state_dict may have thousands of
 * entries, averaging looks each up, and a file may hold 100k metadata
 * entries or top-level numbers, which a linear search per insert made
 * quadratic (issue 24).
 */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

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

/* An open-addressing hash of indices into an array of named entries: slot
 * values are index + 1, 0 is empty; nslots is a power of two, at least twice
 * the count. */
typedef struct name_index {
    long *slots;
    size_t nslots;
} name_index;

struct md_tensors {
    tensor *items;
    size_t count, cap;
    name_index names;
    unsigned long long total_bytes;
    kv *scalars;
    size_t nscalars;
    name_index scalar_names;
    kv *meta;
    size_t nmeta;
    name_index meta_names;
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
    free(t->names.slots);
    free(t->scalars);
    free(t->scalar_names.slots);
    free(t->meta);
    free(t->meta_names.slots);
    free(t);
}

/* The names come from files: FNV-1a from a per-process random basis, as
 * jansson seeds its hashtable, so nobody can precompute names that all land
 * in one probe chain. Drawn once; racing first calls agree on one value. */
static size_t hash_basis(void)
{
    static _Atomic size_t basis; /* 0: not drawn yet */
    size_t b = atomic_load_explicit(&basis, memory_order_relaxed);
    if (b)
        return b;
    if (getrandom(&b, sizeof b, GRND_NONBLOCK) != (ssize_t)sizeof b)
        b = (size_t)time(NULL) ^ (size_t)(uintptr_t)&basis;
    b = b ? b : 1469598103934665603ULL;
    size_t unset = 0;
    if (!atomic_compare_exchange_strong(&basis, &unset, b))
        b = unset; /* another thread's draw won */
    return b;
}

static size_t hash_name(const char *s)
{
    size_t h = hash_basis(); /* FNV-1a */
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 1099511628211ULL;
    return h;
}

static const char *tensor_key(const void *items, size_t i) { return ((const tensor *)items)[i].name; }
static const char *kv_key(const void *items, size_t i) { return ((const kv *)items)[i].key; }

/* Index of `name` among `items` (keys read through `key`), or -1. */
static long index_find(const name_index *ix, const void *items,
                       const char *(*key)(const void *, size_t), const char *name)
{
    if (!ix->nslots)
        return -1;
    for (size_t s = hash_name(name) & (ix->nslots - 1); ix->slots[s];
         s = (s + 1) & (ix->nslots - 1))
        if (strcmp(key(items, (size_t)ix->slots[s] - 1), name) == 0)
            return ix->slots[s] - 1;
    return -1;
}

/* Index entry `count - 1`, just appended to `items`; grows (rehashing all
 * `count`) to keep the table at most half full. */
static void index_add(name_index *ix, const void *items,
                      const char *(*key)(const void *, size_t), size_t count)
{
    size_t first = count - 1;
    if (count * 2 > ix->nslots) {
        size_t n = ix->nslots ? ix->nslots * 2 : 64;
        free(ix->slots);
        ix->slots = md_xcalloc(n, sizeof(long));
        ix->nslots = n;
        first = 0;
    }
    for (size_t i = first; i < count; i++) {
        size_t s = hash_name(key(items, i)) & (ix->nslots - 1);
        while (ix->slots[s])
            s = (s + 1) & (ix->nslots - 1);
        ix->slots[s] = (long)i + 1;
    }
}

long md_tensors_find(const md_tensors *t, const char *name)
{
    return index_find(&t->names, t->items, tensor_key, name);
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
    index_add(&t->names, t->items, tensor_key, t->count);
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

/* A new key at the end of a kv array grown by doubling (`*n` entries). */
static void kv_append(kv **items, size_t *n, name_index *ix, kv entry)
{
    if ((*n & (*n - 1)) == 0) { /* 0 or a power of two: full */
        kv *grown = realloc(*items, (*n ? *n * 2 : 8) * sizeof **items);
        if (!grown)
            md_assert(!"out of memory");
        *items = grown;
    }
    (*items)[(*n)++] = entry;
    index_add(ix, *items, kv_key, *n);
}

void md_tensors_set_scalar(md_tensors *t, const char *name, double value)
{
    long i = index_find(&t->scalar_names, t->scalars, kv_key, name);
    if (i >= 0) {
        t->scalars[i].num = value;
        return;
    }
    kv_append(&t->scalars, &t->nscalars, &t->scalar_names, (kv){md_xstrdup(name), NULL, value});
}

size_t md_tensors_meta_count(const md_tensors *t) { return t->nmeta; }
const char *md_tensors_meta_key(const md_tensors *t, size_t i) { return t->meta[i].key; }
const char *md_tensors_meta_value(const md_tensors *t, size_t i) { return t->meta[i].str; }

const char *md_tensors_meta_get(const md_tensors *t, const char *key)
{
    long i = index_find(&t->meta_names, t->meta, kv_key, key);
    return i >= 0 ? t->meta[i].str : NULL;
}

void md_tensors_set_meta(md_tensors *t, const char *key, const char *value)
{
    long i = index_find(&t->meta_names, t->meta, kv_key, key);
    if (i >= 0) {
        free(t->meta[i].str);
        t->meta[i].str = md_xstrdup(value);
        return;
    }
    kv_append(&t->meta, &t->nmeta, &t->meta_names, (kv){md_xstrdup(key), md_xstrdup(value), 0});
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
        /* the format's own bound (100 MB), not modeld's smaller one: a
         * file past modeld's is still safetensors, refused by the reader
         * with the limit named */
        if (n >= 2 && n <= (uint64_t)100000000)
            return MD_CKPT_SAFETENSORS;
    }
    return MD_CKPT_UNKNOWN;
}
