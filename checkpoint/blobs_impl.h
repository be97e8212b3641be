/*
 * blobs_impl.h - PRIVATE: the store's blobs seam. Checkpoint bytes live in
 * one of two places: a directory (blobs_dir.c, the embedded default:
 * --store/blobs/<sha256>, where the local file IS the blob) or S3
 * (blobs_s3.c, chosen by blob_url = s3://BUCKET/PREFIX, where the object is
 * the blob and --store/blobs/<sha256> is this replica's cache of it).
 *
 * Shape (CONVENTIONS.md "Backends behind one seam"): an md_blobs handle
 * whose first field is the backend's `const md_blobs_ops *`; each backend
 * keeps its state in a struct starting with the base and exports one static
 * const table. The static inline bl_* wrappers are the only code that calls
 * through `ops`. The choice is made once, in md_store_open_opts.
 *
 * Keys. A blob the directory holds is named by its sha256 alone (key "").
 * An S3 upload gets a key of its own, blobs/<sha256>/<nonce>, stored on the
 * row that names it (versions.blob_key, models.arch_blob_key,
 * versions.arch_blob_key): two uploads of the same bytes are two objects, so
 * collecting the older one can never delete the newer one's bytes. A key is
 * copied to a new row only from a row that names it inside the same write
 * transaction, so once no row names a key, none ever will again: the
 * collector may delete it after the commit, outside the write lock.
 *
 * Threads: every op may be called from any thread at once (the S3 backend's
 * cache has a mutex of its own); none is called with the store's mutex held
 * unless it says so.
 */
#ifndef MD_BLOBS_IMPL_H
#define MD_BLOBS_IMPL_H

#include <stddef.h>
#include <stdio.h>
#include <time.h>

#include "../config/md_err.h"

typedef struct md_blobs md_blobs;
typedef struct md_blobs_ops md_blobs_ops;

/* Room for a key: blobs/<64 hex>/<32 hex> after a prefix of at most 900
 * bytes (blob_url's prefix is checked against it at open). */
#define MD_BLOB_KEY_MAX 1024

/* Capability bits (md_blobs.caps), set at open. */
enum {
    /* The bytes live elsewhere: --store/blobs is a cache, a missing local
     * file is not a missing blob, and keys name the objects. */
    MD_BLOBS_CAP_REMOTE = 1
};

/* What md_store_open_opts hands a backend's open. */
typedef struct md_blobs_args {
    const char *url;           /* blob_url ("" or NULL: the directory) */
    const char *dir;           /* --store: blobs/ (the blobs or the cache) and tmp/ */
    long long cache_max_bytes; /* S3: bound of the cache; 0 = none */
    int path_style;            /* S3: -1 auto, 0 virtual-hosted, 1 path-style */
} md_blobs_args;

/* Called once per stored object by list: its key (relative to the prefix)
 * and its age in seconds. Non-zero stops the listing. */
typedef int (*md_blobs_list_fn)(void *ctx, const char *key, long long age_s);

struct md_blobs_ops {
    const char *name; /* "directory", "s3": in messages */

    /* required */
    md_status (*open)(const md_blobs_args *args, md_blobs **out, md_err *err);
    void (*close)(md_blobs *b);
    /* Make the finished file `path` (bytes `sha256`) durable in the backend
     * BEFORE the row naming it commits; the key to store on the row goes to
     * `key` (MD_BLOB_KEY_MAX bytes; "" when the sha256 names it). A failure
     * (MD_EUNAVAIL when the backend cannot be reached) leaves in `key` what
     * may still have been stored, for the caller to remove. */
    md_status (*put)(md_blobs *b, const char *sha256, const char *path, char *key,
                     md_err *err);
    /* Make --store/blobs/<sha256> hold those bytes, from `key` when they
     * are not there ("" or NULL: no key is known), checked by sha256 before
     * the file gets its name. MD_ENOTFOUND when there are no such bytes,
     * MD_EUNAVAIL when the backend cannot be reached now. */
    md_status (*fetch)(md_blobs *b, const char *sha256, const char *key, md_err *err);

    /* optional (NULL: absent) */
    /* Delete the object `key`, which no row names any more (a hint: a
     * failure leaves an orphan the sweep collects). */
    md_status (*remove)(md_blobs *b, const char *key, md_err *err);
    /* Every stored object's key and age, for the orphan sweep. */
    md_status (*list)(md_blobs *b, md_blobs_list_fn fn, void *ctx, md_err *err);
    /* A cached file is in use (pin != 0) or no longer (pin == 0): a pinned
     * file is never evicted; pins count. */
    void (*pin)(md_blobs *b, const char *sha256, int pin);
    /* A file was placed in the cache (an upload committed): bring it back
     * under its bound (a hint). */
    void (*trim)(md_blobs *b);
    /* The backend's metric families (Prometheus text) to `f`. */
    void (*write_metrics)(md_blobs *b, FILE *f);
    /* "s3://BUCKET/PREFIX" (the prefix normalised: "" or ending in '/')
     * into `url` (size bytes): where the server keeps objects of its own
     * beside the blobs (job outputs under PREFIX/jobs/, which list and the
     * orphan sweep never see: they look under PREFIX/blobs/ only). Returns
     * 1, or 0 when the backend keeps nothing remote (absent: the same). */
    int (*data_url)(md_blobs *b, char *url, size_t size);
};

/* The base every backend's state starts with. */
struct md_blobs {
    const md_blobs_ops *ops;
    unsigned caps; /* MD_BLOBS_CAP_* */
};

extern const md_blobs_ops md_blobs_dir_ops;
extern const md_blobs_ops md_blobs_s3_ops;

/* NULL when every required slot of `ops` is set, else the first missing
 * slot's name (checked at open and by the unit tests). */
const char *md_blobs_ops_missing(const md_blobs_ops *ops);

/* Chooses the backend from `args->url`'s scheme (none: the directory;
 * "s3://": S3) and opens it. An unknown scheme is MD_EINVAL
 * (blob_url_invalid). */
md_status md_blobs_open(const md_blobs_args *args, md_blobs **out, md_err *err);

/* ---- the only callers of ops ---- */

static inline void bl_close(md_blobs *b)
{
    if (b)
        b->ops->close(b);
}
static inline int bl_data_url(md_blobs *b, char *url, size_t size)
{
    return b->ops->data_url ? b->ops->data_url(b, url, size) : 0;
}
static inline int bl_remote(const md_blobs *b) { return (b->caps & MD_BLOBS_CAP_REMOTE) != 0; }
static inline md_status bl_put(md_blobs *b, const char *sha, const char *path, char *key,
                               md_err *err)
{
    return b->ops->put(b, sha, path, key, err);
}
static inline md_status bl_fetch(md_blobs *b, const char *sha, const char *key, md_err *err)
{
    return b->ops->fetch(b, sha, key, err);
}
static inline md_status bl_remove(md_blobs *b, const char *key, md_err *err)
{
    return b->ops->remove && key && key[0] ? b->ops->remove(b, key, err) : MD_OK;
}
static inline md_status bl_list(md_blobs *b, md_blobs_list_fn fn, void *ctx, md_err *err)
{
    return b->ops->list ? b->ops->list(b, fn, ctx, err) : MD_OK;
}
static inline void bl_trim(md_blobs *b)
{
    if (b->ops->trim)
        b->ops->trim(b);
}
static inline void bl_write_metrics(md_blobs *b, FILE *f)
{
    if (b->ops->write_metrics)
        b->ops->write_metrics(b, f);
}
static inline void bl_pin(md_blobs *b, const char *sha, int pin)
{
    if (b->ops->pin)
        b->ops->pin(b, sha, pin);
}

#endif
