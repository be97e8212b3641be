/*
 * torch_zip.c - read a torch.save (PyTorch >= 1.6) zip archive: data.pkl
 * through the restricted unpickler (pickle.c), storages from its data/<key>
 * records through libtorch's zip reader (predictor/torch_backend.h). Kept
 * apart from pickle.c so the unpickler builds and fuzzes without libtorch.
 *
 * libtorch's reader inflates a record whole into memory, so a deflated record
 * that declares gigabytes (a zip bomb) would be inflated before anything
 * could check it. So the central directory is read first, as libtorch will
 * read it (md_zip_dir_read, zipdir.c), and an archive with a record outside
 * the file or one that would inflate past MD_ZIP_MAX_INFLATED is refused
 * before libtorch reads any of it.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "../predictor/torch_backend.h"
#include "formats.h"

#define ZIP_MAX_CENTRAL_DIR (64 << 20)
#define ZIP_MAX_INFLATED (16 << 20) /* bytes one compressed record may inflate to */

static uint64_t le(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

static md_status not_stored(md_err *err, const char *why)
{
    return md_err_set(err, MD_EUNPROC, "the checkpoint's zip archive %s; torch.save writes "
                      "records uncompressed, so re-save the file with torch.save instead of "
                      "re-zipping it", why);
}

/* Where a storage record "<archive>/data/<key>" is in the file
 * (md_ckpt_each_torch_zip reads a stored one in place). */
typedef struct zip_record {
    char key[65];
    int stored;         /* method 0; else compressed (and small: checked) */
    uint64_t local_off; /* its local file header */
    uint64_t size;
} zip_record;

typedef struct zip_index {
    zip_record *rec;
    size_t count, cap;
    /* the archive's folder: libtorch's reader takes it from the first entry
     * and reads only "<it>/data/<key>"; records under another folder with
     * the same key must not be the ones read here */
    uint8_t top[256];
    size_t top_len;
    int top_set;
} zip_index;

/* Note entry `name` (nlen bytes) in `ix` when it is a storage record. */
static md_status index_entry(zip_index *ix, const uint8_t *name, size_t nlen, uint64_t method,
                             uint64_t size, uint64_t local_off, md_err *err)
{
    size_t top = 0;
    while (top < nlen && name[top] != '/')
        top++;
    if (!ix->top_set) { /* the first entry of the directory, as libtorch */
        ix->top_set = 1;
        ix->top_len = top < sizeof ix->top ? top : sizeof ix->top;
        memcpy(ix->top, name, ix->top_len);
    }
    if (top != ix->top_len || memcmp(name, ix->top, top) != 0)
        return MD_OK; /* another folder's record: libtorch never reads it */
    if (nlen < top + 7 || memcmp(name + top, "/data/", 6) != 0)
        return MD_OK;
    size_t klen = nlen - top - 6;
    if (klen == 0 || klen > 64 || memchr(name + top + 6, '/', klen))
        return MD_OK; /* no key the unpickler accepts */
    if (ix->count >= MD_CKPT_MAX_TENSORS)
        return md_err_set(err, MD_EUNPROC, "the checkpoint's zip archive holds more than %d "
                          "storage records (MD_CKPT_MAX_TENSORS)", MD_CKPT_MAX_TENSORS);
    if (ix->count == ix->cap) {
        size_t cap = ix->cap ? ix->cap * 2 : 64;
        zip_record *r = md_mallocarray_checked(cap, sizeof *r, "zip directory", err);
        if (!r)
            return MD_ENOMEM;
        if (ix->count)
            memcpy(r, ix->rec, ix->count * sizeof *r);
        free(ix->rec);
        ix->rec = r;
        ix->cap = cap;
    }
    zip_record *r = &ix->rec[ix->count++];
    memcpy(r->key, name + top + 6, klen);
    r->key[klen] = '\0';
    r->stored = method == 0;
    r->local_off = local_off;
    r->size = size;
    return MD_OK;
}

/* Every central-directory entry is stored (method 0) and no larger than the
 * file, or compressed and inflates to at most ZIP_MAX_INFLATED. Handles zip64
 * (archives past 4 GiB, or entries marked so). With `ix`, the storage
 * records are noted in it. */
static md_status check_records_stored(int fd, uint64_t file_size, zip_index *ix, md_err *err)
{
    uint8_t tail[65536 + 22];
    size_t tlen = file_size < sizeof tail ? (size_t)file_size : sizeof tail;
    if (pread(fd, tail, tlen, (off_t)(file_size - tlen)) != (ssize_t)tlen)
        return md_err_set(err, MD_EIO, "cannot read the checkpoint file");
    size_t eocd = SIZE_MAX;
    for (size_t i = tlen >= 22 ? tlen - 22 + 1 : 0; i-- > 0;)
        if (le(tail + i, 4) == 0x06054b50) {
            eocd = i;
            break;
        }
    if (eocd == SIZE_MAX)
        return not_stored(err, "has no end-of-central-directory record (truncated?)");
    uint64_t entries = le(tail + eocd + 10, 2), cd_size = le(tail + eocd + 12, 4),
             cd_off = le(tail + eocd + 16, 4);
    if (entries == 0xFFFF || cd_size == 0xFFFFFFFF || cd_off == 0xFFFFFFFF) {
        /* zip64: the locator just before the EOCD points at the zip64 EOCD */
        uint8_t z[56];
        if (eocd < 20 || le(tail + eocd - 20, 4) != 0x07064b50)
            return not_stored(err, "has a damaged zip64 directory");
        uint64_t z_off = le(tail + eocd - 20 + 8, 8);
        if (z_off > file_size || file_size - z_off < sizeof z ||
            pread(fd, z, sizeof z, (off_t)z_off) != (ssize_t)sizeof z ||
            le(z, 4) != 0x06064b50)
            return not_stored(err, "has a damaged zip64 directory");
        entries = le(z + 32, 8);
        cd_size = le(z + 40, 8);
        cd_off = le(z + 48, 8);
    }
    if (cd_off > file_size || cd_size > file_size - cd_off || cd_size > ZIP_MAX_CENTRAL_DIR)
        return not_stored(err, "has a central directory outside the file (truncated?)");
    uint8_t *cd = md_malloc_checked(cd_size ? (size_t)cd_size : 1, "zip directory", err);
    if (!cd)
        return MD_ENOMEM;
    md_status st = MD_OK;
    if (pread(fd, cd, (size_t)cd_size, (off_t)cd_off) != (ssize_t)cd_size)
        st = md_err_set(err, MD_EIO, "cannot read the checkpoint file");
    size_t at = 0;
    for (uint64_t e = 0; e < entries && st == MD_OK; e++) {
        if (cd_size - at < 46 || le(cd + at, 4) != 0x02014b50) {
            st = not_stored(err, "has a damaged central directory");
            break;
        }
        uint64_t method = le(cd + at + 10, 2), csize = le(cd + at + 20, 4),
                 usize = le(cd + at + 24, 4), local_off = le(cd + at + 42, 4);
        size_t nlen = (size_t)le(cd + at + 28, 2), xlen = (size_t)le(cd + at + 30, 2),
               clen = (size_t)le(cd + at + 32, 2);
        if (cd_size - at - 46 < (uint64_t)nlen + xlen + clen) {
            st = not_stored(err, "has a damaged central directory");
            break;
        }
        const uint8_t *x = cd + at + 46 + nlen, *xend = x + xlen;
        while ((usize == 0xFFFFFFFF || csize == 0xFFFFFFFF || local_off == 0xFFFFFFFF) &&
               xend - x >= 4) {
            size_t id = (size_t)le(x, 2), n = (size_t)le(x + 2, 2);
            if ((size_t)(xend - x - 4) < n)
                break;
            if (id == 1) { /* zip64: uncompressed, compressed size, offset, when marked */
                const uint8_t *f = x + 4;
                if (usize == 0xFFFFFFFF && n >= 8) {
                    usize = le(f, 8);
                    f += 8;
                    n -= 8;
                }
                if (csize == 0xFFFFFFFF && n >= 8) {
                    csize = le(f, 8);
                    f += 8;
                    n -= 8;
                }
                if (local_off == 0xFFFFFFFF && n >= 8)
                    local_off = le(f, 8);
                break;
            }
            x += 4 + n;
        }
        if (method != 0 && usize > ZIP_MAX_INFLATED)
            st = not_stored(err, "has a compressed record that would inflate past 16 MiB");
        else if (method == 0 && (usize != csize || usize > file_size))
            st = not_stored(err, "has a record larger than the file");
        else if (ix)
            st = index_entry(ix, cd + at + 46, nlen, method, usize, local_off, err);
        at += 46 + nlen + xlen + clen;
    }
    free(cd);
    return st;
}

static md_status storage_record(void *ctx, const char *key, const uint8_t **data, size_t *size,
                                md_err *err)
{
    char name[96];
    snprintf(name, sizeof name, "data/%s", key);
    md_status st = md_torch_zip_record(ctx, name, data, size, err);
    if (st == MD_ENOTFOUND)
        return md_err_set(err, MD_EUNPROC, "the checkpoint's data.pkl names storage %s, which "
                          "the archive does not hold; the file is truncated or corrupt", name);
    return st;
}

md_status md_ckpt_read_torch_zip(const char *path, const md_ckpt_budget *budget,
                                 md_tensors **out, md_err *err)
{
    *out = NULL;
    uint8_t head[16];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return md_err_set(err, MD_EIO, "cannot open the checkpoint file");
    ssize_t n = read(fd, head, sizeof head);
    md_ckpt_format f = md_ckpt_sniff(head, n > 0 ? (size_t)n : 0);
    md_status st = MD_OK;
    if (f == MD_CKPT_LEGACY)
        st = md_err_set(err, MD_EUNPROC, "the checkpoint is in the legacy (pre-1.6) torch.save "
                        "format; re-save it with torch.save(..., "
                        "_use_new_zipfile_serialization=True)");
    else if (f != MD_CKPT_ZIP)
        st = md_err_set(err, MD_EUNPROC, "the checkpoint is not a zip archive, so not what "
                        "torch.save writes (nor a TorchScript archive)");
    else {
        md_zip_dir *dir = NULL;
        st = md_zip_dir_read(fd, &dir, err);
        md_zip_dir_free(dir);
    }
    close(fd);
    if (st != MD_OK)
        return st;
    md_torch_zip *z = NULL;
    st = md_torch_zip_open(path, &z, err);
    if (st != MD_OK)
        return st;
    const uint8_t *pkl = NULL;
    size_t len = 0;
    if (md_torch_zip_has_record(z, "constants.pkl") || md_torch_zip_has_record(z, "code/"))
        st = md_err_set(err, MD_EUNPROC, "the file is a TorchScript archive, not a torch.save "
                        "checkpoint");
    else if (!md_torch_zip_has_record(z, "data.pkl"))
        st = md_err_set(err, MD_EUNPROC, "the zip archive has no data.pkl, so it is not what "
                        "torch.save writes");
    else
        st = md_torch_zip_record(z, "data.pkl", &pkl, &len, err);
    if (st == MD_OK)
        st = md_ckpt_unpickle(pkl, len, storage_record, z, "the checkpoint", budget, out,
                              err);
    md_torch_zip_close(z);
    return st;
}

/* ---- tensor by tensor, the archive mapped ---- */

typedef struct mapped_zip {
    const uint8_t *map;
    size_t len;
    zip_index ix; /* sorted by key */
    md_torch_zip *tz; /* libtorch's reader: data.pkl, and any compressed record */
    md_ckpt_tensor_fn fn;
    void *ctx;
} mapped_zip;

static int by_key(const void *a, const void *b)
{
    return strcmp(((const zip_record *)a)->key, ((const zip_record *)b)->key);
}

/* The unpickler's storages: a stored record's bytes where they lie in the
 * mapping (nothing read until a tensor is copied out of them). torch.save
 * never compresses one; a re-zipped file's compressed records (16 MiB at
 * most each, checked) are inflated by libtorch's reader and kept until the
 * end, as md_ckpt_read_torch_zip keeps every record. */
static md_status mapped_record(void *ctx, const char *key, const uint8_t **data, size_t *size,
                               md_err *err)
{
    mapped_zip *z = ctx;
    zip_record probe;
    snprintf(probe.key, sizeof probe.key, "%s", key);
    const zip_record *r = bsearch(&probe, z->ix.rec, z->ix.count, sizeof *r, by_key);
    if (r && !r->stored)
        return storage_record(z->tz, key, data, size, err);
    if (!r)
        return md_err_set(err, MD_EUNPROC, "the checkpoint's data.pkl names storage data/%s, "
                          "which the archive does not hold; the file is truncated or corrupt",
                          key);
    const uint8_t *h = z->map + r->local_off;
    uint64_t off;
    if (r->local_off > z->len || z->len - r->local_off < 30 || le(h, 4) != 0x04034b50 ||
        __builtin_add_overflow(r->local_off, 30 + le(h + 26, 2) + le(h + 28, 2), &off) ||
        off > z->len || z->len - off < r->size)
        return md_err_set(err, MD_EUNPROC, "the checkpoint's record data/%s lies outside the "
                          "file; the file is truncated or corrupt", key);
    *data = z->map + off;
    *size = (size_t)r->size;
    return MD_OK;
}

/* The caller's function, then the mapped pages let go: they count in the
 * process's RSS while mapped, and the page cache keeps them anyway. */
static md_status each_then_drop(void *ctx, const char *name, md_ckpt_dtype dtype, int ndim,
                                const int64_t *shape, const void *data, size_t nbytes,
                                md_err *err)
{
    mapped_zip *z = ctx;
    md_status st = z->fn(z->ctx, name, dtype, ndim, shape, data, nbytes, err);
    if (data)
        madvise((void *)z->map, z->len, MADV_DONTNEED);
    return st;
}

md_status md_ckpt_each_torch_zip(const char *path, int with_data, md_ckpt_tensor_fn fn,
                                 void *ctx, md_err *err)
{
    mapped_zip z = {.fn = fn, .ctx = ctx};
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return md_err_set(err, MD_EIO, "cannot open the checkpoint file");
    struct stat sb;
    uint8_t head[16];
    ssize_t n = pread(fd, head, sizeof head, 0);
    md_status st = MD_OK;
    if (md_ckpt_sniff(head, n > 0 ? (size_t)n : 0) != MD_CKPT_ZIP)
        st = md_err_set(err, MD_EUNPROC, "the checkpoint is not a zip archive, so not what "
                        "torch.save writes (nor a TorchScript archive)");
    else if (fstat(fd, &sb) < 0 || sb.st_size <= 0)
        st = md_err_set(err, MD_EIO, "cannot stat the checkpoint file");
    else {
        /* the directory as libtorch will read it first (both end records
         * agree, nothing inflates past the bound), then where each stored
         * record lies, for reading it in place */
        md_zip_dir *dir = NULL;
        st = md_zip_dir_read(fd, &dir, err);
        md_zip_dir_free(dir);
        if (st == MD_OK)
            st = check_records_stored(fd, (uint64_t)sb.st_size, &z.ix, err);
    }
    if (st == MD_OK) {
        z.len = (size_t)sb.st_size;
        void *m = mmap(NULL, z.len, PROT_READ, MAP_PRIVATE, fd, 0);
        if (m == MAP_FAILED)
            st = md_err_set(err, MD_EIO, "cannot map the checkpoint file: %s", strerror(errno));
        else
            z.map = m;
    }
    close(fd);
    if (st == MD_OK && z.ix.count)
        qsort(z.ix.rec, z.ix.count, sizeof *z.ix.rec, by_key);
    if (st == MD_OK)
        st = md_torch_zip_open(path, &z.tz, err);
    const uint8_t *pkl = NULL;
    size_t len = 0;
    if (st == MD_OK && (md_torch_zip_has_record(z.tz, "constants.pkl") ||
                        md_torch_zip_has_record(z.tz, "code/")))
        st = md_err_set(err, MD_EUNPROC, "the file is a TorchScript archive, not a torch.save "
                        "checkpoint");
    else if (st == MD_OK && !md_torch_zip_has_record(z.tz, "data.pkl"))
        st = md_err_set(err, MD_EUNPROC, "the zip archive has no data.pkl, so it is not what "
                        "torch.save writes");
    else if (st == MD_OK)
        st = md_torch_zip_record(z.tz, "data.pkl", &pkl, &len, err);
    if (st == MD_OK)
        st = md_ckpt_unpickle_each(pkl, len, mapped_record, &z, "the checkpoint", with_data,
                                   each_then_drop, &z, err);
    md_torch_zip_close(z.tz);
    if (z.map)
        munmap((void *)z.map, z.len);
    free(z.ix.rec);
    return st;
}
