/*
 * weights.c - a version's weights apart from its architecture: telling a
 * file's format by content, reading a state_dict or safetensors file without
 * running code from it (checkpoint/formats.h), loading it strictly into an
 * architecture, the architecture's parameter table, a version's weights as
 * its model uses them (for export and averaging), and weighted averaging.
 *
 * Names and dtypes: a file may carry DistributedDataParallel's "module."
 * prefix and float16/bfloat16/float64 tensors. Loading leaves that to
 * md_torch_load_state; the "effective" weights resolve it the same way (strip
 * only when every name has the prefix and stripping matches more names), so
 * an export or an average is in the architecture's own names and dtypes and
 * loads back with load_state_dict(strict=True).
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#include "../checkpoint/formats.h"
#include "predictor.h"
#include "torch_backend.h"

/* Bytes a state_dict may copy out beyond what its architecture holds. */
#ifndef MD_WEIGHTS_ARCH_SLACK
#define MD_WEIGHTS_ARCH_SLACK (64LL << 20)
#endif

md_status md_weights_format(const char *path, const char **format, md_err *err)
{
    *format = NULL;
    uint8_t head[16];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return md_err_set(err, MD_EIO, "cannot open the checkpoint file");
    ssize_t n = read(fd, head, sizeof head);
    close(fd);
    md_ckpt_format f = md_ckpt_sniff(head, n > 0 ? (size_t)n : 0);
    if (f == MD_CKPT_SAFETENSORS) {
        *format = MD_FORMAT_SAFETENSORS;
        return MD_OK;
    }
    if (f == MD_CKPT_LEGACY)
        return md_err_setc(err, MD_EUNPROC, "legacy_checkpoint",
                           "the checkpoint is in the legacy (pre-1.6) torch.save format; re-save "
                           "it with torch.save(..., _use_new_zipfile_serialization=True)");
    if (f != MD_CKPT_ZIP)
        return md_err_setc(err, MD_EUNPROC, "invalid_checkpoint",
                           "the checkpoint is neither a TorchScript archive (torch.jit.save), a "
                           "torch.save file (PyTorch >= 1.6) nor a safetensors file");
    md_torch_zip *z = NULL;
    md_status st = md_torch_zip_open(path, &z, err);
    if (st != MD_OK)
        return md_err_setc(err, MD_EUNPROC, "invalid_checkpoint",
                           "the checkpoint is a damaged zip archive: %.300s", err->msg);
    if (md_torch_zip_has_record(z, "constants.pkl") || md_torch_zip_has_record(z, "code/"))
        *format = MD_FORMAT_TORCHSCRIPT;
    else if (md_torch_zip_has_record(z, "data.pkl"))
        *format = MD_FORMAT_TORCH_SAVE;
    else
        st = md_err_setc(err, MD_EUNPROC, "invalid_checkpoint",
                         "the checkpoint is a zip archive without data.pkl: neither a TorchScript "
                         "archive nor a torch.save file");
    md_torch_zip_close(z);
    return st;
}

md_status md_weights_read(const char *path, const char *format, int64_t arch_numel,
                          md_tensors **out, md_err *err)
{
    *out = NULL;
    md_status st;
    /* a state_dict that loads into the architecture strictly holds its
     * elements, each at most 8 bytes (float64, int64) in the file; the slack
     * lets the file of another, smaller model be read and its mismatch
     * reported key by key */
    md_ckpt_budget budget = {0, NULL};
    char limit[200];
    if (arch_numel >= 0) {
        if (__builtin_mul_overflow((unsigned long long)arch_numel, 8ULL, &budget.max_bytes) ||
            __builtin_add_overflow(budget.max_bytes, (unsigned long long)MD_WEIGHTS_ARCH_SLACK,
                                   &budget.max_bytes))
            budget.max_bytes = 0; /* past any limit: the build's applies */
        snprintf(limit, sizeof limit,
                 "the architecture holds (%lld elements, 8 bytes each at most, plus %lld MiB, "
                 "MD_WEIGHTS_ARCH_SLACK)",
                 (long long)arch_numel, (long long)MD_WEIGHTS_ARCH_SLACK >> 20);
        budget.limit = limit;
    }
    if (strcmp(format, MD_FORMAT_SAFETENSORS) == 0)
        st = md_safetensors_read_file(path, out, err); /* no views: the file's size is the bound */
    else if (strcmp(format, MD_FORMAT_TORCH_SAVE) == 0)
        st = md_ckpt_read_torch_zip(path, &budget, out, err);
    else
        return md_err_set(err, MD_EINVAL, "checkpoint format %s holds no state_dict", format);
    if (st != MD_OK && err->code[0] == '\0' && st == MD_EUNPROC)
        md_err_setc(err, st, "invalid_checkpoint", "%s", err->msg);
    return st;
}

md_status md_weights_arch_numel(const char *arch_path, int64_t *numel, md_err *err)
{
    *numel = 0;
    md_torch_model *m = NULL;
    md_status st = md_torch_load(arch_path, "cpu", MD_F32, &m, err);
    if (st == MD_OK)
        st = md_torch_state_numel(m, numel, err);
    md_torch_free(m);
    return st;
}

/* Borrowed views of `t`'s tensors for the backend; NULL (with err) on OOM. */
static md_torch_named_tensor *views_of(const md_tensors *t, md_err *err)
{
    size_t n = md_tensors_count(t);
    md_torch_named_tensor *v = md_calloc_checked(n ? n : 1, sizeof *v, "tensor list", err);
    for (size_t i = 0; v && i < n; i++) {
        v[i].name = md_tensors_name(t, i);
        v[i].dtype = md_tensors_dtype(t, i);
        v[i].ndim = md_tensors_ndim(t, i);
        v[i].shape = md_tensors_shape(t, i);
        v[i].data = md_tensors_data(t, i);
    }
    return v;
}

md_status md_weights_load(const char *arch_path, const char *weights_path, const char *format,
                          const char *device, md_dtype input_dtype, md_torch_model **out,
                          md_err *err)
{
    *out = NULL;
    /* the architecture first: what it holds bounds what reading the file may
     * allocate (a view in a torch.save file can copy out to any size) */
    md_torch_model *m = NULL;
    md_tensors *t = NULL;
    md_torch_named_tensor *v = NULL;
    int64_t numel = 0;
    md_status st = md_torch_load(arch_path, device, input_dtype, &m, err);
    if (st == MD_OK)
        st = md_torch_state_numel(m, &numel, err);
    if (st == MD_OK)
        st = md_weights_read(weights_path, format, numel, &t, err);
    if (st == MD_OK && !(v = views_of(t, err)))
        st = MD_ENOMEM;
    if (st == MD_OK)
        st = md_torch_set_state(m, v, md_tensors_count(t), err);
    free(v);
    md_tensors_free(t);
    if (st != MD_OK) {
        md_torch_free(m);
        return st;
    }
    *out = m;
    return MD_OK;
}

/*
 * ---- the architectures' tables, cached ----
 * An architecture's table (names, dtypes, shapes, in state_dict order) costs a
 * libtorch load of its archive. Even onto the meta device (each record read,
 * then dropped) that load can leave glibc's heap grown by about the archive's
 * size: every record is read into a 64-byte-aligned buffer between small
 * allocations that last, so the freed buffers do not fit the next one
 * (measured: 21 to 129 MB from one run to the next for a 128 MB archive of
 * 4 MB tensors; 9 MB every time with a fixed mmap threshold). Archives are content-addressed and never change, so each table
 * is read once per process (at PUT, or on first use) and kept, the last
 * ARCH_TABLES of them; an export or an average of a state_dict version then
 * loads nothing of the architecture.
 */
#define ARCH_TABLES 32

typedef struct arch_table {
    char *sha256;               /* the key: the archive's content */
    size_t n;
    md_torch_named_tensor *ent; /* names and shapes owned here, data NULL */
    unsigned char *is_buffer;
    int refs;                   /* under tables_mu; the cache holds one */
    unsigned long used;         /* last use, for eviction */
} arch_table;

static pthread_mutex_t tables_mu = PTHREAD_MUTEX_INITIALIZER;
static arch_table *tables[ARCH_TABLES];
static unsigned long tables_clock;

static void table_free(arch_table *t)
{
    if (!t)
        return;
    for (size_t j = 0; j < t->n; j++) {
        free((char *)t->ent[j].name);
        free((int64_t *)t->ent[j].shape);
    }
    free(t->ent);
    free(t->is_buffer);
    free(t->sha256);
    free(t);
}

/* A new table (refs 1) from the archive at `path`. */
static md_status table_read(const char *path, arch_table **out, md_err *err)
{
    *out = NULL;
    md_torch_state *s = NULL;
    md_status st = md_torch_state_read_shapes(path, &s, err);
    if (st != MD_OK)
        return st;
    arch_table *t = md_xcalloc(1, sizeof *t);
    t->n = md_torch_state_count(s);
    t->refs = 1;
    t->ent = md_xcalloc(t->n ? t->n : 1, sizeof *t->ent);
    t->is_buffer = md_xcalloc(t->n ? t->n : 1, 1);
    for (size_t j = 0; j < t->n; j++) {
        md_torch_named_tensor a;
        int is_buffer = 0;
        md_torch_state_get(s, j, &a, &is_buffer);
        int64_t *shape = md_xcalloc(a.ndim > 0 ? (size_t)a.ndim : 1, sizeof *shape);
        if (a.ndim > 0)
            memcpy(shape, a.shape, sizeof *shape * (size_t)a.ndim);
        t->ent[j] = (md_torch_named_tensor){md_xstrdup(a.name), a.dtype, a.ndim, shape, NULL};
        t->is_buffer[j] = (unsigned char)is_buffer;
    }
    md_torch_state_free(s);
    *out = t;
    return MD_OK;
}

/* The table of the archive at `path` whose content is `sha256` (NULL: not
 * cached), a reference the caller gives back with table_put. Thread-safe. */
static md_status table_get(const char *path, const char *sha256, arch_table **out, md_err *err)
{
    if (!sha256 || !*sha256)
        return table_read(path, out, err);
    pthread_mutex_lock(&tables_mu);
    for (int i = 0; i < ARCH_TABLES; i++)
        if (tables[i] && strcmp(tables[i]->sha256, sha256) == 0) {
            tables[i]->refs++;
            tables[i]->used = ++tables_clock;
            *out = tables[i];
            pthread_mutex_unlock(&tables_mu);
            return MD_OK;
        }
    pthread_mutex_unlock(&tables_mu);
    arch_table *t = NULL;
    md_status st = table_read(path, &t, err); /* outside the lock: it takes a while */
    if (st != MD_OK)
        return st;
    pthread_mutex_lock(&tables_mu);
    int slot = -1, dup = 0; /* an empty slot, else the least recently used */
    for (int i = 0; i < ARCH_TABLES && !dup; i++) {
        if (!tables[i]) {
            if (slot < 0 || tables[slot])
                slot = i;
        } else if (strcmp(tables[i]->sha256, sha256) == 0) {
            dup = 1; /* another caller read it meanwhile: this copy is the caller's alone */
        } else if (slot < 0 || (tables[slot] && tables[i]->used < tables[slot]->used)) {
            slot = i;
        }
    }
    if (!dup) {
        t->sha256 = md_xstrdup(sha256);
        arch_table *old = tables[slot];
        if (old && --old->refs == 0)
            table_free(old);
        t->refs++; /* the cache's */
        t->used = ++tables_clock;
        tables[slot] = t;
    }
    pthread_mutex_unlock(&tables_mu);
    *out = t;
    return MD_OK;
}

static void table_put(arch_table *t)
{
    if (!t)
        return;
    pthread_mutex_lock(&tables_mu);
    int last = --t->refs == 0;
    pthread_mutex_unlock(&tables_mu);
    if (last)
        table_free(t);
}

md_status md_weights_table(const char *arch_path, const char *arch_sha256, json_t **out,
                           md_err *err)
{
    *out = NULL;
    arch_table *s = NULL;
    md_status st = table_get(arch_path, arch_sha256, &s, err);
    if (st != MD_OK)
        return st;
    json_t *params = json_array();
    long long numel_total = 0;
    for (size_t i = 0; i < s->n; i++) {
        const md_torch_named_tensor *t = &s->ent[i];
        json_t *shape = json_array();
        for (int d = 0; d < t->ndim; d++)
            json_array_append_new(shape, json_integer(t->shape[d]));
        int64_t numel = 0;
        if (md_shape_product(t->shape, t->ndim, &numel) != 0 ||
            __builtin_add_overflow(numel_total, (long long)numel, &numel_total)) {
            json_decref(shape);
            json_decref(params);
            st = md_err_setc(err, MD_EUNPROC, "invalid_checkpoint",
                             "the architecture's tensor \"%.200s\" has an invalid shape",
                             t->name);
            table_put(s);
            return st;
        }
        json_array_append_new(params, json_pack("{s:s,s:o,s:s,s:s}", "name", t->name, "shape",
                                                shape, "dtype", md_ckpt_dtype_name(t->dtype),
                                                "kind", s->is_buffer[i] ? "buffer" : "parameter"));
    }
    table_put(s);
    *out = json_pack("{s:o,s:I,s:I}", "parameters", params, "count",
                     (json_int_t)json_array_size(params), "numel", (json_int_t)numel_total);
    return MD_OK;
}

/* Copy a TorchScript state into a new md_tensors. */
static md_status state_to_tensors(md_torch_state *s, md_tensors **out, md_err *err)
{
    md_tensors *t = md_tensors_new();
    for (size_t i = 0; i < md_torch_state_count(s); i++) {
        md_torch_named_tensor v;
        md_torch_state_get(s, i, &v, NULL);
        int64_t numel = 1;
        if (md_shape_product(v.shape, v.ndim, &numel) != 0) {
            md_tensors_free(t);
            return md_err_set(err, MD_EINVAL, "tensor \"%.200s\" has a bad shape", v.name);
        }
        size_t nbytes = (size_t)numel * md_ckpt_dtype_size(v.dtype);
        md_status st = md_tensors_add(t, v.name, v.dtype, v.ndim, v.shape, v.data, nbytes, err);
        if (st != MD_OK) {
            md_tensors_free(t);
            return st;
        }
    }
    *out = t;
    return MD_OK;
}

/* Index in `file` of the architecture's tensor `name`, looked up as
 * "module.NAME" when `prefixed`; -1 when absent. */
static long find_name(const md_tensors *file, const char *name, int prefixed)
{
    if (!prefixed)
        return md_tensors_find(file, name);
    char buf[MD_CKPT_MAX_NAME + 1];
    if (strlen(name) + 7 > MD_CKPT_MAX_NAME)
        return -1; /* no file name is that long */
    snprintf(buf, sizeof buf, "module.%s", name);
    return md_tensors_find(file, buf);
}

md_status md_weights_effective(const char *path, const char *format, const char *arch_path,
                               const char *arch_sha256, md_tensors **out, md_err *err)
{
    *out = NULL;
    md_torch_state *s = NULL;
    md_status st;
    if (strcmp(format, MD_FORMAT_TORCHSCRIPT) == 0) {
        if ((st = md_torch_state_read(path, &s, err)) != MD_OK)
            return st;
        st = state_to_tensors(s, out, err);
        md_torch_state_free(s);
        return st;
    }
    if (!arch_path)
        return md_err_setc(err, MD_EUNPROC, "no_architecture",
                           "the version is a state_dict and its architecture is unknown");
    arch_table *arch = NULL;
    if ((st = table_get(arch_path, arch_sha256, &arch, err)) != MD_OK)
        return st;
    /* what the architecture holds bounds what reading the file may copy
     * out (a view in a torch.save file can expand to any size) */
    int64_t arch_numel = 0;
    for (size_t j = 0; j < arch->n; j++) {
        md_torch_named_tensor a = arch->ent[j];
        int64_t numel;
        if (md_shape_product(a.shape, a.ndim, &numel) != 0 ||
            md_add_i64(arch_numel, numel, &arch_numel) != 0) {
            table_put(arch);
            return md_err_setc(err, MD_EUNPROC, "invalid_checkpoint",
                               "the architecture's tensor \"%.200s\" has an invalid shape",
                               a.name);
        }
    }
    md_tensors *file = NULL;
    if ((st = md_weights_read(path, format, arch_numel, &file, err)) != MD_OK) {
        table_put(arch);
        return st;
    }
    /* the strip rule of md_torch_load_state; names are unique on both sides,
     * so counting architecture names found in the file (hashed lookups) is
     * counting matches */
    size_t n = md_tensors_count(file), raw_hits = 0, stripped_hits = 0;
    int all_prefixed = n > 0;
    for (size_t i = 0; i < n && all_prefixed; i++)
        all_prefixed = strncmp(md_tensors_name(file, i), "module.", 7) == 0;
    for (size_t j = 0; j < arch->n; j++) {
        md_torch_named_tensor a = arch->ent[j];
        raw_hits += find_name(file, a.name, 0) >= 0;
        stripped_hits += all_prefixed && find_name(file, a.name, 1) >= 0;
    }
    int strip = all_prefixed && stripped_hits > raw_hits;
    md_tensors *t = md_tensors_new();
    for (size_t j = 0; j < arch->n && st == MD_OK; j++) {
        md_torch_named_tensor a = arch->ent[j];
        long k = find_name(file, a.name, strip);
        int64_t numel = 0;
        if (k < 0 || md_tensors_ndim(file, (size_t)k) != a.ndim ||
            memcmp(md_tensors_shape(file, (size_t)k), a.shape, sizeof(int64_t) * (size_t)a.ndim) !=
                0 ||
            md_shape_product(a.shape, a.ndim, &numel) != 0) {
            st = md_err_setc(err, MD_EUNPROC, "state_dict_mismatch",
                             "the checkpoint does not match the architecture at \"%.200s\"",
                             a.name);
            break;
        }
        size_t nbytes = (size_t)numel * md_ckpt_dtype_size(a.dtype);
        void *data = md_malloc_checked(nbytes ? nbytes : 1, "converted tensor", err);
        if (!data) {
            st = MD_ENOMEM;
            break;
        }
        st = md_torch_cast(md_tensors_data(file, (size_t)k), md_tensors_dtype(file, (size_t)k),
                           data, a.dtype, (size_t)numel, err);
        if (st != MD_OK) {
            free(data);
            break;
        }
        st = md_tensors_adopt(t, a.name, a.dtype, a.ndim, a.shape, data, nbytes, err);
    }
    table_put(arch);
    md_tensors_free(file);
    if (st != MD_OK) {
        md_tensors_free(t);
        return st;
    }
    *out = t;
    return MD_OK;
}

/*
 * ---- export, tensor by tensor ----
 * md_weights_effective holds the whole file, the architecture and the result
 * at once, and a safetensors reply of it one more copy (1.85x the model per
 * request, issue 24). The export needs none of that: the file's layout
 * follows from the architecture's table alone (names, dtypes, shapes: read
 * without the data), so the header is written first and every tensor at its
 * own offset as the version's file yields it, in the file's order, converted
 * to the architecture's dtype. Two passes over the file: names and shapes
 * only (the "module." rule and the strict match, checked before a byte is
 * written), then the data, one tensor mapped at a time.
 */

typedef struct arch_name {
    const char *name;
    size_t index;
} arch_name;

static int by_arch_name(const void *a, const void *b)
{
    return strcmp(((const arch_name *)a)->name, ((const arch_name *)b)->name);
}

/* What pass 1 saw of each architecture tensor, as-is and with "module." stripped. */
enum { SEEN_NONE = 0, SEEN_OTHER_SHAPE, SEEN_SAME_SHAPE };

typedef struct exporter {
    arch_table *table;            /* a state_dict version's architecture */
    md_torch_state *state;        /* a TorchScript version's own tensors */
    const md_torch_named_tensor *ent; /* the output's tensors, from one or the other */
    size_t n;
    arch_name *sorted;
    unsigned char *raw_seen, *strip_seen;
    size_t raw_hits, strip_hits, file_count;
    int all_prefixed, strip;
    uint64_t *offset; /* n + 1: each tensor's place in the output, then its end */
    unsigned char *written;
    int fd;
} exporter;

static long arch_find(const exporter *x, const char *name)
{
    arch_name probe = {name, 0};
    const arch_name *a = bsearch(&probe, x->sorted, x->n, sizeof *a, by_arch_name);
    return a ? (long)a->index : -1;
}

static int same_shape(const exporter *x, size_t j, int ndim, const int64_t *shape)
{
    const md_torch_named_tensor *a = &x->ent[j];
    return a->ndim == ndim &&
           (ndim == 0 || memcmp(a->shape, shape, sizeof(int64_t) * (size_t)ndim) == 0);
}

static md_status names_pass(void *ctx, const char *name, md_ckpt_dtype dtype, int ndim,
                            const int64_t *shape, const void *data, size_t nbytes, md_err *err)
{
    (void)dtype, (void)data, (void)nbytes, (void)err;
    exporter *x = ctx;
    x->file_count++;
    long j = arch_find(x, name);
    if (j >= 0) {
        x->raw_hits++;
        x->raw_seen[j] = same_shape(x, (size_t)j, ndim, shape) ? SEEN_SAME_SHAPE
                                                                 : SEEN_OTHER_SHAPE;
    }
    if (strncmp(name, "module.", 7) != 0) {
        x->all_prefixed = 0;
    } else if ((j = arch_find(x, name + 7)) >= 0) {
        x->strip_hits++;
        x->strip_seen[j] = same_shape(x, (size_t)j, ndim, shape) ? SEEN_SAME_SHAPE
                                                                   : SEEN_OTHER_SHAPE;
    }
    return MD_OK;
}

static md_status pwrite_all(int fd, const void *p, size_t n, uint64_t off, md_err *err)
{
    const unsigned char *b = p;
    while (n) {
        ssize_t w = pwrite(fd, b, n, (off_t)off);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return md_err_set(err, MD_EIO, "writing the export's temp file failed: %s; check "
                              "the store's disk space",
                              w < 0 ? strerror(errno) : "no progress");
        b += w;
        n -= (size_t)w;
        off += (uint64_t)w;
    }
    return MD_OK;
}

/* Tensor `j` of the architecture from `data` of `from` (`numel` elements). */
static md_status put_tensor(exporter *x, size_t j, const void *data, md_ckpt_dtype from,
                            size_t numel, md_err *err)
{
    md_ckpt_dtype to = x->ent[j].dtype;
    size_t bytes = (size_t)(x->offset[j + 1] - x->offset[j]);
    if (from == to)
        return pwrite_all(x->fd, data, bytes, x->offset[j], err);
    void *conv = md_malloc_checked(bytes ? bytes : 1, "converted tensor", err);
    if (!conv)
        return MD_ENOMEM;
    md_status st = md_torch_cast(data, from, conv, to, numel, err);
    if (st == MD_OK)
        st = pwrite_all(x->fd, conv, bytes, x->offset[j], err);
    free(conv);
    return st;
}

static md_status data_pass(void *ctx, const char *name, md_ckpt_dtype dtype, int ndim,
                           const int64_t *shape, const void *data, size_t nbytes, md_err *err)
{
    exporter *x = ctx;
    if (x->strip && strncmp(name, "module.", 7) != 0)
        return MD_OK;
    long j = arch_find(x, x->strip ? name + 7 : name);
    if (j < 0)
        return MD_OK; /* not the architecture's: md_torch_load_state ignores it too */
    if (x->written[j] || !same_shape(x, (size_t)j, ndim, shape))
        return md_err_setc(err, MD_EUNPROC, "state_dict_mismatch",
                           "the checkpoint does not match the architecture at \"%.200s\"%s",
                           x->ent[j].name, x->written[j] ? " (named twice)" : "");
    x->written[j] = 1;
    return put_tensor(x, (size_t)j, data, dtype, nbytes / md_ckpt_dtype_size(dtype), err);
}

/* The header from the architecture's table, written at offset 0; the
 * offsets of every tensor into x->offset. */
static md_status write_header(exporter *x, const md_tensors *meta, md_err *err)
{
    md_ckpt_tensor_info *info = md_calloc_checked(x->n ? x->n : 1, sizeof *info,
                                                  "export header", err);
    x->offset = md_calloc_checked(x->n + 1, sizeof *x->offset, "export header", err);
    md_status st = info && x->offset ? MD_OK : MD_ENOMEM;
    for (size_t j = 0; j < x->n && st == MD_OK; j++)
        info[j] = (md_ckpt_tensor_info){x->ent[j].name, x->ent[j].dtype, x->ent[j].ndim,
                                        x->ent[j].shape};
    uint8_t *head = NULL;
    size_t hlen = 0;
    if (st == MD_OK)
        st = md_safetensors_header(info, x->n, meta, &head, &hlen, err);
    if (st == MD_OK) {
        x->offset[0] = hlen;
        for (size_t j = 0; j < x->n && st == MD_OK; j++) {
            int64_t numel = 0;
            uint64_t bytes;
            if (md_shape_product(info[j].shape, info[j].ndim, &numel) != 0 ||
                __builtin_mul_overflow((uint64_t)numel, md_ckpt_dtype_size(info[j].dtype),
                                       &bytes) ||
                __builtin_add_overflow(x->offset[j], bytes, &x->offset[j + 1]) ||
                x->offset[j + 1] - hlen > (uint64_t)MD_CKPT_MAX_TOTAL_BYTES)
                st = md_err_set(err, MD_ETOOBIG, "the export would be more than %lld bytes of "
                                "tensors (MD_CKPT_MAX_TOTAL_BYTES) at \"%.200s\"",
                                (long long)MD_CKPT_MAX_TOTAL_BYTES, info[j].name);
        }
    }
    if (st == MD_OK)
        st = pwrite_all(x->fd, head, hlen, 0, err);
    free(head);
    free(info);
    return st;
}

/* A TorchScript version: its module's own tensors (loaded whole). */
static md_status export_torchscript(exporter *x, const char *path, const md_tensors *meta,
                                    md_err *err)
{
    md_status st = md_torch_state_read(path, &x->state, err);
    if (st != MD_OK)
        return st;
    x->n = md_torch_state_count(x->state);
    md_torch_named_tensor *ent = md_calloc_checked(x->n ? x->n : 1, sizeof *ent,
                                                   "export header", err);
    if (!ent)
        return MD_ENOMEM;
    for (size_t j = 0; j < x->n; j++)
        md_torch_state_get(x->state, j, &ent[j], NULL);
    x->ent = ent;
    if ((st = write_header(x, meta, err)) != MD_OK)
        return st;
    for (size_t j = 0; j < x->n && st == MD_OK; j++)
        st = pwrite_all(x->fd, x->ent[j].data, (size_t)(x->offset[j + 1] - x->offset[j]),
                        x->offset[j], err);
    return st;
}

/* Read the version's file one way or the other (pass 1 or 2). */
static md_status each_tensor(const char *path, const char *format, int with_data,
                             md_ckpt_tensor_fn fn, exporter *x, md_err *err)
{
    md_status st;
    if (strcmp(format, MD_FORMAT_SAFETENSORS) == 0)
        st = md_safetensors_each_file(path, with_data, fn, x, err);
    else if (strcmp(format, MD_FORMAT_TORCH_SAVE) == 0)
        st = md_ckpt_each_torch_zip(path, with_data, fn, x, err);
    else
        return md_err_set(err, MD_EINVAL, "checkpoint format %s holds no state_dict", format);
    if (st == MD_EUNPROC && err->code[0] == '\0')
        md_err_setc(err, st, "invalid_checkpoint", "%s", err->msg);
    return st;
}

static md_status export_state_dict(exporter *x, const char *path, const char *format,
                                   const char *arch_path, const char *arch_sha256,
                                   const md_tensors *meta, md_err *err)
{
    md_status st = table_get(arch_path, arch_sha256, &x->table, err);
    if (st != MD_OK)
        return st;
    x->n = x->table->n;
    x->ent = x->table->ent;
    size_t n1 = x->n ? x->n : 1;
    x->sorted = md_calloc_checked(n1, sizeof *x->sorted, "architecture names", err);
    x->raw_seen = md_calloc_checked(n1, 1, "architecture names", err);
    x->strip_seen = md_calloc_checked(n1, 1, "architecture names", err);
    x->written = md_calloc_checked(n1, 1, "architecture names", err);
    if (!x->sorted || !x->raw_seen || !x->strip_seen || !x->written)
        return MD_ENOMEM;
    for (size_t j = 0; j < x->n; j++)
        x->sorted[j] = (arch_name){x->ent[j].name, j};
    qsort(x->sorted, x->n, sizeof *x->sorted, by_arch_name);
    x->all_prefixed = 1;
    if ((st = each_tensor(path, format, 0, names_pass, x, err)) != MD_OK)
        return st;
    /* md_torch_load_state's rule: strip only when every name has the prefix
     * and stripping matches more (names are unique on both sides) */
    x->strip = x->file_count > 0 && x->all_prefixed && x->strip_hits > x->raw_hits;
    const unsigned char *seen = x->strip ? x->strip_seen : x->raw_seen;
    for (size_t j = 0; j < x->n; j++)
        if (seen[j] != SEEN_SAME_SHAPE)
            return md_err_setc(err, MD_EUNPROC, "state_dict_mismatch",
                               "the checkpoint does not match the architecture at \"%.200s\"",
                               x->ent[j].name);
    if ((st = write_header(x, meta, err)) != MD_OK)
        return st;
    if ((st = each_tensor(path, format, 1, data_pass, x, err)) != MD_OK)
        return st;
    for (size_t j = 0; j < x->n; j++)
        if (!x->written[j]) /* the file changed between the passes */
            return md_err_setc(err, MD_EUNPROC, "state_dict_mismatch",
                               "the checkpoint does not match the architecture at \"%.200s\"",
                               x->ent[j].name);
    return MD_OK;
}

md_status md_weights_export(const char *path, const char *format, const char *arch_path,
                            const char *arch_sha256, const md_tensors *meta, int fd,
                            uint64_t *size, md_err *err)
{
    *size = 0;
    exporter x = {.fd = fd};
    md_status st;
    if (strcmp(format, MD_FORMAT_TORCHSCRIPT) == 0)
        st = export_torchscript(&x, path, meta, err);
    else if (!arch_path)
        st = md_err_setc(err, MD_EUNPROC, "no_architecture",
                         "the version is a state_dict and its architecture is unknown");
    else
        st = export_state_dict(&x, path, format, arch_path, arch_sha256, meta, err);
    if (st == MD_OK)
        *size = x.offset[x.n];
    if (x.state)
        free((md_torch_named_tensor *)x.ent);
    md_torch_state_free(x.state);
    table_put(x.table);
    free(x.sorted);
    free(x.raw_seen);
    free(x.strip_seen);
    free(x.written);
    free(x.offset);
    return st;
}

static void fmt_shape(char *buf, size_t size, const int64_t *shape, int ndim)
{
    size_t used = (size_t)snprintf(buf, size, "[");
    for (int d = 0; d < ndim && used < size; d++)
        used += (size_t)snprintf(buf + used, size - used, "%s%lld", d ? "," : "",
                                 (long long)shape[d]);
    if (used < size)
        snprintf(buf + used, size - used, "]");
}

/*
 * Averaging, one source at a time: the accumulator is itself a named-tensor
 * list (hashed names, the first source's shapes) whose floating tensors are
 * float64 running sums and whose integer and bool tensors hold the last
 * source's bytes. Each source is checked against it, added with its weight and
 * can be freed before the next is read, so n sources cost one source plus the
 * accumulator, never n models.
 */
struct md_weights_avg {
    md_tensors *acc;
    md_ckpt_dtype *dtype; /* each tensor's own dtype (acc holds floats as F64) */
    size_t sources;
    char first[64]; /* label of the first source, for messages */
};

md_weights_avg *md_weights_avg_new(void)
{
    md_weights_avg *a = md_xcalloc(1, sizeof *a);
    a->acc = md_tensors_new();
    return a;
}

void md_weights_avg_free(md_weights_avg *a)
{
    if (!a)
        return;
    md_tensors_free(a->acc);
    free(a->dtype);
    free(a);
}

/* The first source: the layout every later source must have. */
static md_status avg_first(md_weights_avg *a, const md_tensors *src, double w, md_err *err)
{
    size_t count = md_tensors_count(src);
    a->dtype = md_calloc_checked(count ? count : 1, sizeof *a->dtype, "average", err);
    if (!a->dtype)
        return MD_ENOMEM;
    md_status st = MD_OK;
    for (size_t i = 0; i < count && st == MD_OK; i++) {
        md_ckpt_dtype dt = md_tensors_dtype(src, i);
        size_t nbytes = md_tensors_nbytes(src, i);
        a->dtype[i] = dt;
        if (!md_ckpt_dtype_is_float(dt)) {
            st = md_tensors_add(a->acc, md_tensors_name(src, i), dt, md_tensors_ndim(src, i),
                                md_tensors_shape(src, i), md_tensors_data(src, i), nbytes, err);
            continue;
        }
        size_t numel = nbytes / md_ckpt_dtype_size(dt), bytes;
        if (__builtin_mul_overflow(numel, sizeof(double), &bytes))
            return md_err_set(err, MD_ETOOBIG, "tensor \"%.200s\" is too large to average",
                              md_tensors_name(src, i));
        double *sum = md_malloc_checked(bytes ? bytes : 1, "average", err);
        if (!sum)
            return MD_ENOMEM;
        st = md_torch_cast(md_tensors_data(src, i), dt, sum, MD_CKPT_F64, numel, err);
        for (size_t e = 0; st == MD_OK && e < numel; e++)
            sum[e] *= w;
        if (st == MD_OK)
            st = md_tensors_adopt(a->acc, md_tensors_name(src, i), MD_CKPT_F64,
                                  md_tensors_ndim(src, i), md_tensors_shape(src, i), sum, bytes,
                                  err);
        else
            free(sum);
    }
    return st;
}

md_status md_weights_avg_add(md_weights_avg *a, const md_tensors *src, double w,
                             const char *label, md_err *err)
{
    if (a->sources++ == 0) {
        snprintf(a->first, sizeof a->first, "%s", label);
        return avg_first(a, src, w, err);
    }
    const md_tensors *acc = a->acc;
    size_t count = md_tensors_count(acc);
    /* the same names, shapes and dtypes as the first source, checked before
     * anything is added so a mismatch leaves the sums untouched */
    for (size_t i = 0; i < count; i++) {
        const char *name = md_tensors_name(acc, i);
        long k = md_tensors_find(src, name);
        if (k < 0)
            return md_err_setc(err, MD_EINVAL, "average_mismatch",
                               "%s has tensor \"%.200s\" but %s does not; average versions of "
                               "one architecture",
                               a->first, name, label);
        int nd = md_tensors_ndim(acc, i);
        if (md_tensors_ndim(src, (size_t)k) != nd ||
            memcmp(md_tensors_shape(src, (size_t)k), md_tensors_shape(acc, i),
                   sizeof(int64_t) * (size_t)nd) != 0) {
            char x[96], y[96];
            fmt_shape(x, sizeof x, md_tensors_shape(acc, i), nd);
            fmt_shape(y, sizeof y, md_tensors_shape(src, (size_t)k),
                      md_tensors_ndim(src, (size_t)k));
            return md_err_setc(err, MD_EINVAL, "average_mismatch",
                               "tensor \"%.200s\" has shape %s in %s but %s in %s", name, x,
                               a->first, y, label);
        }
        if (md_tensors_dtype(src, (size_t)k) != a->dtype[i])
            return md_err_setc(err, MD_EINVAL, "average_mismatch",
                               "tensor \"%.200s\" is %s in %s but %s in %s", name,
                               md_ckpt_dtype_name(a->dtype[i]), a->first,
                               md_ckpt_dtype_name(md_tensors_dtype(src, (size_t)k)), label);
    }
    if (md_tensors_count(src) != count) {
        for (size_t i = 0; i < md_tensors_count(src); i++)
            if (md_tensors_find(acc, md_tensors_name(src, i)) < 0)
                return md_err_setc(err, MD_EINVAL, "average_mismatch",
                                   "%s has tensor \"%.200s\" but %s does not; average versions "
                                   "of one architecture",
                                   label, md_tensors_name(src, i), a->first);
    }
    md_status st = MD_OK;
    for (size_t i = 0; i < count && st == MD_OK; i++) {
        size_t k = (size_t)md_tensors_find(src, md_tensors_name(acc, i));
        md_ckpt_dtype dt = a->dtype[i];
        size_t nbytes = md_tensors_nbytes(src, k);
        if (!md_ckpt_dtype_is_float(dt)) {
            /* integer buffers (BatchNorm's num_batches_tracked): the last source's */
            memcpy(md_tensors_data_mut(a->acc, i), md_tensors_data(src, k), nbytes);
            continue;
        }
        size_t numel = nbytes / md_ckpt_dtype_size(dt);
        double *tmp = md_malloc_checked(md_tensors_nbytes(acc, i) ? md_tensors_nbytes(acc, i) : 1,
                                        "average", err);
        if (!tmp)
            return MD_ENOMEM;
        double *sum = md_tensors_data_mut(a->acc, i);
        st = md_torch_cast(md_tensors_data(src, k), dt, tmp, MD_CKPT_F64, numel, err);
        for (size_t e = 0; st == MD_OK && e < numel; e++)
            sum[e] += w * tmp[e];
        free(tmp);
    }
    return st;
}

md_status md_weights_avg_finish(md_weights_avg *a, md_tensors **out, md_err *err)
{
    *out = NULL;
    if (a->sources == 0)
        return md_err_set(err, MD_EINVAL, "averaging needs at least one source");
    const md_tensors *acc = a->acc;
    md_tensors *t = md_tensors_new();
    md_status st = MD_OK;
    for (size_t i = 0; i < md_tensors_count(acc) && st == MD_OK; i++) {
        const char *name = md_tensors_name(acc, i);
        md_ckpt_dtype dt = a->dtype[i];
        int nd = md_tensors_ndim(acc, i);
        if (!md_ckpt_dtype_is_float(dt)) {
            st = md_tensors_add(t, name, dt, nd, md_tensors_shape(acc, i), md_tensors_data(acc, i),
                                md_tensors_nbytes(acc, i), err);
            continue;
        }
        size_t numel = md_tensors_nbytes(acc, i) / sizeof(double);
        size_t nbytes = numel * md_ckpt_dtype_size(dt); /* <= the F64 bytes: no overflow */
        void *res = md_malloc_checked(nbytes ? nbytes : 1, "average", err);
        if (!res) {
            st = MD_ENOMEM;
            break;
        }
        st = md_torch_cast(md_tensors_data(acc, i), MD_CKPT_F64, res, dt, numel, err);
        if (st == MD_OK)
            st = md_tensors_adopt(t, name, dt, nd, md_tensors_shape(acc, i), res, nbytes, err);
        else
            free(res);
    }
    if (st != MD_OK) {
        md_tensors_free(t);
        return st;
    }
    *out = t;
    return MD_OK;
}
