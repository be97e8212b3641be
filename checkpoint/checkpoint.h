/*
 * checkpoint.h - the checkpoint store: a directory holding index.sqlite and
 * content-addressed checkpoint files (blobs/<sha256>).
 *
 * Files arrive through an md_blob_writer, which streams into tmp/ while
 * hashing, then fsyncs and renames to blobs/<sha256>: a final name only ever
 * holds complete bytes, and identical bytes are stored once. Rows are added
 * after their blob is in place, in one transaction, so a committed row always
 * has its file. A blob is unlinked only when no row references it. At open,
 * stale temp files and blobs no row references are swept, and rows whose blob
 * is missing are marked failed. With blob_url (md_store_open_opts) the
 * bytes live in S3 and blobs/ is this replica's cache of them: see
 * md_store_blob_fetch.
 *
 * Thread safety: every md_store_* function is safe to call from any thread
 * (one mutex serialises use of the SQLite connection). An md_blob_writer is
 * used by one thread at a time; md_blob_begin and md_blob_link may be called
 * from any thread. Everything else here keeps no shared state and may be
 * called from any thread: the checks (md_model_name_ok, md_retention_check,
 * md_promote_check, md_metric_name_check, md_archive_check, md_source_check,
 * md_addr_is_internal), md_path_open_* and md_fsync_dir, and the downloads
 * (md_fetch_*: libcurl's global init runs once, under pthread_once). The
 * downloads and md_store_* may block on disk or network: never call them
 * from a libmicrohttpd thread for a request that could wait long (defer).
 *
 * JSON results are new references the caller decrefs.
 *
 * Implemented by store.c (open, schema), versions.c (rows), promotion.c
 * (architecture, promotion, recorded metrics), retention.c, blobs.c (files,
 * GC), archive.c, download.c; the job table, in the same index, is
 * jobs/jobs.h's.
 */
#ifndef MD_CHECKPOINT_H
#define MD_CHECKPOINT_H

#include <jansson.h>
#include <stddef.h>
#include <stdio.h>

#include "../config/config.h"
#include "../config/md_err.h"
#include "../config/md_metrics.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct md_store md_store;
typedef struct md_blob_writer md_blob_writer;

#define MD_SHA256_HEX 65 /* 64 hex digits and a NUL */

/* Test-only: `fn(store, point, ctx)` is called at named points inside the
 * store's write transactions ("add_blob_decided": an add has decided its
 * blob's file and not committed; "gc_locked": garbage collection holds the
 * write lock; "sweep_locked": the orphan sweep at open does;
 * "set_default_checked": md_store_set_default checked the version and has not
 * moved the default yet), where a "did you mean" hint is about to be
 * computed ("hint": neither the mutex nor a transaction is held there), and
 * each time a connection waits for another's write lock ("busy"), so a unit test can
 * drive two handles (two replicas) through an exact interleaving. Global;
 * set it before the threads it affects start. NULL removes it. */
typedef void (*md_store_hook_fn)(md_store *store, const char *point, void *ctx);
void md_store_set_test_hook(md_store_hook_fn fn, void *ctx);

/* Open (creating if needed) the store in `dir`: migrate the schema forward,
 * sweep temp files, check every blob. The index is dir/index.sqlite. */
md_status md_store_open(const char *dir, md_store **out, md_err *err);
/* As md_store_open, with the index at `index_url`: NULL or "" for
 * dir/index.sqlite, "postgresql://..." (a libpq URI) for PostgreSQL 15;
 * blobs and temp files stay in `dir`. An unknown scheme is MD_EINVAL
 * index_url_invalid, a backend this build lacks index_backend_not_built; a
 * database that cannot be reached is MD_EUNAVAIL index_unavailable. */
md_status md_store_open_index(const char *dir, const char *index_url, md_store **out,
                              md_err *err);
/* Where a store keeps its index and its blobs. */
typedef struct md_store_opts {
    const char *index_url;     /* as md_store_open_index's */
    const char *blob_url;      /* NULL or "": dir/blobs holds the blobs; "s3://BUCKET/PREFIX":
                                * S3 does (credentials and endpoint from AWS_*, s3.h), and
                                * dir/blobs is this replica's cache of them */
    long long cache_max_bytes; /* S3: the cache's bound (least recently used files go);
                                * 0 = none */
    int s3_path_style;         /* S3: -1 auto (path-style for a custom endpoint), 0, 1 */
} md_store_opts;

/* As md_store_open_index, with the blobs where `opts` says (NULL: the
 * defaults). A blob_url that is not s3:// is MD_EINVAL blob_url_invalid; bad
 * AWS_* settings are MD_EINVAL naming the variable. Opening talks to no S3
 * server: S3 unreachable at start fails nothing, and marks no version
 * failed. */
md_status md_store_open_opts(const char *dir, const md_store_opts *opts, md_store **out,
                             md_err *err);
/* Close the store. Accepts NULL. */
void md_store_close(md_store *store);

/* The current index generation: bumped by every change, so replicas sharing
 * the store can notice changes made by another process. -1 when the index
 * cannot be read now (PostgreSQL unreachable or restarting): keep what is
 * served and ask again later. */
long long md_store_generation(md_store *store);
/* Wait up to timeout_ms for another replica's change (PostgreSQL LISTEN/
 * NOTIFY): 1 when one may have come (look: md_store_generation), 0 on
 * timeout, -1 when the listener is down (poll meanwhile; it reconnects),
 * -2 at once when the index cannot notify (SQLite: poll). Holds no lock the
 * other md_store_* calls take; one caller at a time. */
int md_store_wait_change(md_store *store, int timeout_ms);
/* The store directory (borrowed, valid until md_store_close). */
const char *md_store_dir(const md_store *store);
/* With S3 blobs (blob_url): "s3://BUCKET/PREFIX" (the prefix "" or ending in
 * '/') into `url`, where the server keeps objects of its own beside the
 * blobs (jobs/<id>/... : cluster job outputs), and 1. 0 with the blobs in a
 * directory (single host: everything stays under --store). The blobs'
 * orphan sweep looks under PREFIX/blobs/ only, so it never touches them.
 * Thread-safe (reads what open set). */
int md_store_data_url(md_store *store, char *url, size_t size);
/* Write the store's metric families (models, versions, bytes; Prometheus
 * text) to `f`. Takes the store's lock for one query. */
void md_store_write_metrics(md_store *store, FILE *f);

/* ---- blobs ---- */

/* Start a new upload into the store's tmp/ directory; at most `max_bytes`. */
md_status md_blob_begin(md_store *store, long long max_bytes, md_blob_writer **out, md_err *err);
/* Append bytes (hashing as they go). MD_ETOOBIG past the limit. */
md_status md_blob_write(md_blob_writer *w, const void *data, size_t len, md_err *err);
/* Bytes written so far. */
long long md_blob_size(const md_blob_writer *w);
/* The sha256 (hex) of a finished writer; "" before md_blob_finish. */
const char *md_blob_sha256(const md_blob_writer *w);
/* The temp file being written (valid until the writer is consumed). */
const char *md_blob_path(const md_blob_writer *w);
/* The final path of the blob with this sha256 (in S3 mode, its place in
 * the cache, which may not hold it now: see md_store_blob_fetch). */
void md_store_sha_path(const md_store *store, const char *sha256, char *out, size_t size);
/* The local path of the blob `sha256` into `path`, always, and whether the
 * file is there: with blobs in S3 it is downloaded into the cache first
 * (checked by sha256 before it gets its name). MD_OK: the file is readable
 * and pinned (never evicted) until md_store_blob_release; MD_ENOTFOUND: no
 * such bytes are stored; MD_EUNAVAIL: S3 (or the index) cannot be reached
 * now, retry later; MD_EIO: the object's bytes are not those. Every MD_OK
 * and MD_ENOTFOUND pairs with one md_store_blob_release; the other
 * statuses pin nothing. Blocks on the network: never on a libmicrohttpd
 * thread. Thread-safe. */
md_status md_store_blob_fetch(md_store *store, const char *sha256, char *path, size_t size,
                              md_err *err);
/* The caller of a successful md_store_blob_fetch is done reading the file
 * (one release per fetch). Accepts NULL. Thread-safe. */
void md_store_blob_release(md_store *store, const char *sha256);
/* Finish writing: check it is non-empty, a TorchScript archive, and (when
 * `expect_sha256` is non-NULL and non-empty) has that hash; fsync. Fills
 * `sha256` and `size`. On failure the writer and its temp file are gone; on
 * success the writer must be handed to md_store_add_version (which renames
 * the file to blobs/<sha256>) or dropped with md_blob_abort. */
md_status md_blob_finish(md_blob_writer *w, const char *expect_sha256, char sha256[MD_SHA256_HEX],
                         long long *size, md_err *err);
/* A second finished writer over the same bytes: a hard link to the finished
 * writer `w`'s temp file under a new temp name, with its sha256 and size, so
 * several requests sharing one download each own (and commit or drop) their
 * copy without copying bytes. `w` stays valid and owned by its caller.
 * MD_EIO when the link fails. Thread-safe for a `w` no other thread consumes. */
md_status md_blob_link(const md_blob_writer *w, md_blob_writer **out, md_err *err);
/* Drop an unfinished upload and its temp file. Accepts NULL. */
void md_blob_abort(md_blob_writer *w);
/* A new temp file in the store's tmp/ directory, already unlinked: *fd is
 * the caller's (read-write), and the file's space goes back when it is
 * closed. MD_EIO naming the store when it cannot be made. Thread-safe. */
md_status md_store_tmpfile(md_store *store, int *fd, md_err *err);

/* Check that `path` holds a PyTorch archive, TorchScript or torch.save (a
 * zip whose entries sit under one top-level folder with data.pkl). Exposed
 * for tests. */
md_status md_archive_check(const char *path, md_err *err);

/* ---- downloads (download.c) ---- */

typedef struct md_fetch_opts {
    long long max_bytes;
    int connect_timeout_s;
    int timeout_s;
    int max_redirects;
    const md_strlist *allowed_paths; /* file:// only under these */
    const md_strlist *allowed_urls;  /* when non-empty, each http(s) URL and redirect must
                                      * match one: scheme, host, port, path under its path */
    int allow_private;               /* 1: may connect to loopback, private, link-local... */
    const md_strlist *allowed_s3;    /* s3://BUCKET/KEY sources must be under one of these
                                      * BUCKET[/PREFIX]; empty = s3:// sources refused */
    /* Optional: called during a transfer (about once a second and on every
     * read); returning 0 stops it with MD_ECONFLICT. Called on the
     * downloading thread. */
    int (*keep_going)(void *ctx);
    void *keep_going_ctx;
} md_fetch_opts;

/* The download settings `cfg` gives (size limit, timeouts, redirects, the
 * allow lists, private addresses), keep_going unset: the one place a
 * configuration becomes fetch options. The lists are borrowed from `cfg`.
 * Thread-safe. */
md_fetch_opts md_fetch_opts_from_cfg(const md_cfg *cfg);

/* Check a source URL against the scheme and the allow lists without fetching:
 * MD_EINVAL for a malformed, unsupported or forbidden URL, naming the setting
 * that would allow it. A file:// source is opened (under allowed_paths, no
 * symlink followed) and closed. Where an http(s) URL resolves to is checked
 * only when it is fetched. Thread-safe. */
md_status md_source_check(const char *url, const md_fetch_opts *opts, md_err *err);

/* ---- datasets in S3: job inputs and outputs (s3_data.c) ----
 * Read and written with the AWS_* credentials of the S3 blob store
 * (s3.h), only under the buckets and prefixes allowed_s3 lists. */

/* Check the s3:// job path `url` (`what` names its field, "input.path")
 * without talking to S3: an object (folder 0: s3://BUCKET/KEY) or a folder
 * of images (folder 1: s3://BUCKET/PREFIX/ or s3://BUCKET/). MD_EINVAL
 * invalid_path for a malformed URL or key; MD_EFORBIDDEN source_not_allowed
 * outside allowed_s3 (403, as for deploys). bucket gets room for 64 bytes,
 * key for 1025. Thread-safe; in download.c, next to the deploy check. */
md_status md_s3_data_check(const char *url, const md_fetch_opts *o, const char *what, int folder,
                           char *bucket, char *key, md_err *err);

/* An S3 object read as a stream: md_s3_stream_open HEADs the object (size,
 * ETag), then a thread reads it in pieces of a few MiB with Range GETs
 * guarded by If-Match (an object replaced meanwhile fails the read, it is
 * never mixed), retrying a piece that failed, and writes each piece to a
 * pipe. *fd is the pipe's read end, the caller's to close; readers open it
 * as /proc/self/fd/N like any file read front to back. Memory: one piece.
 * The read end reaches EOF at the object's end or when the reading failed:
 * md_s3_stream_status tells them apart. Thread-safe per handle. */
typedef struct md_s3_stream md_s3_stream;
md_status md_s3_stream_open(const char *url, const md_fetch_opts *o, const char *what, int *fd,
                            md_s3_stream **out, md_err *err);
/* As md_s3_stream_open, the bytes [0, head_bytes) then [from, to) of the
 * object (to < 0: its end): a chunk of a dataset behind its header. */
md_status md_s3_stream_open_range(const char *url, const md_fetch_opts *o, const char *what,
                                  long long head_bytes, long long from, long long to, int *fd,
                                  md_s3_stream **out, md_err *err);
/* As md_s3_stream_open_range, pinned to the ETag a job's plan recorded
 * (NULL or "": the HEAD's, as md_s3_stream_open_range): an object whose
 * HEAD names another ETag is refused before any byte is read, and every
 * piece is read with "If-Match: etag", so a chunk never mixes two versions
 * of the input. Both are MD_ECONFLICT with the code input_changed and a
 * message "<what> s3://... changed since the job was planned (ETag ...);
 * run the job again". */
md_status md_s3_stream_open_pinned(const char *url, const md_fetch_opts *o, const char *what,
                                   const char *etag, long long head_bytes, long long from,
                                   long long to, int *fd, md_s3_stream **out, md_err *err);
/* The object's ETag from the HEAD (with its quotes); borrowed, valid until
 * md_s3_stream_close. */
const char *md_s3_stream_etag(const md_s3_stream *s);
/* MD_OK while the stream is whole so far (or complete); else the failure
 * (MD_EUNAVAIL s3_unavailable, MD_ECONFLICT when the object changed,
 * MD_EIO), with its message into `err`. */
md_status md_s3_stream_status(md_s3_stream *s, md_err *err);
/* The object's size in bytes (from the HEAD). */
long long md_s3_stream_size(const md_s3_stream *s);
/* Stop and join the thread. Close every descriptor of the read end first
 * (the thread's blocked write then fails with EPIPE). Accepts NULL. */
void md_s3_stream_close(md_s3_stream *s);

/* Copy the objects under the folder `url` (s3://BUCKET/PREFIX/, listed page
 * by page, in key order) into the directory `dirfd` as files at the same
 * relative paths (subdirectories made as needed), so a directory walk sees
 * the folder as it is in S3. Keys with an empty, "." or ".." segment, and
 * "folder" markers ending in '/', are skipped. More than max_files objects
 * is MD_ETOOBIG (job_max_files); an object larger than max_file_bytes is not
 * downloaded but made a sparse file of its size, so the reader rejects it
 * as it would rejected that file on disk. keep_going (may be NULL) is asked
 * between objects; 0 stops with MD_ECONFLICT. *files gets the objects
 * copied. Blocks. Thread-safe. */
md_status md_s3_fetch_folder(const char *url, const md_fetch_opts *o, int dirfd, int64_t max_files,
                             long long max_file_bytes, int (*keep_going)(void *ctx), void *ctx,
                             int64_t *files, md_err *err);

/* A folder of objects (s3://BUCKET/PREFIX/, checked with md_s3_data_check
 * as an images input.path) listed once and read object by object: what a
 * chunked image job plans and each chunk fetches (jobs/s3_images.c). One
 * handle per thread; md_s3_folder_close accepts NULL. */
typedef struct md_s3_folder md_s3_folder;
md_status md_s3_folder_open(const char *url, const md_fetch_opts *o, md_s3_folder **out,
                            md_err *err);
/* Called per object in key order with its key relative to the folder
 * (borrowed for the call), size and ETag; non-zero stops the listing. */
typedef int (*md_s3_folder_fn)(void *ctx, const char *rel, int64_t size, const char *etag);
/* List the folder page by page; folder markers and keys with an empty, "."
 * or ".." segment are left out, as md_s3_fetch_folder leaves them. */
md_status md_s3_folder_list(md_s3_folder *f, md_s3_folder_fn fn, void *ctx, md_err *err);
/* The first `len` bytes (at most MD_S3_RANGE_MAX) of the object `rel` into
 * buf, *got of them, read with If-Match `etag`: MD_ECONFLICT input_changed
 * when it was replaced. */
md_status md_s3_folder_read(md_s3_folder *f, const char *rel, const char *etag, size_t len,
                            char *buf, size_t *got, md_err *err);
/* Download the object `rel` into a new file at the same relative path under
 * dirfd (folders made as needed, no symlink followed, an existing file is
 * an error). An answer whose ETag is not `etag` (NULL: any), or an object
 * gone, is MD_ECONFLICT input_changed. Blocks. */
md_status md_s3_folder_get(md_s3_folder *f, const char *rel, const char *etag, int dirfd,
                           md_err *err);
void md_s3_folder_close(md_s3_folder *f);

/* Upload the file at `path` as the object `url` (s3://BUCKET/KEY, checked
 * with md_s3_data_check): refused with MD_ECONFLICT output_exists when the
 * object is there already (modeld never replaces an output), else one PUT,
 * or a multipart upload past 16 MiB. path NULL: only that check, so a job
 * learns a taken name before it computes. Blocks. Thread-safe. */
md_status md_s3_data_put(const char *url, const md_fetch_opts *o, const char *path, md_err *err);

/* Delete the object `url` (checked as above); absent is MD_OK. Blocks. */
md_status md_s3_data_delete(const char *url, const md_fetch_opts *o, md_err *err);

/* Make the object `dst_url` a copy of `src_url` (same bucket) inside S3:
 * refused with output_exists when dst is there, unless `replace`. Blocks. */
md_status md_s3_data_copy(const char *src_url, const char *dst_url, const md_fetch_opts *o,
                          int replace, md_err *err);

/* As md_s3_data_put with `path`, without the check that the name is free
 * (one HEAD less): for an object whose name nobody else may take, such as
 * a job chunk's part, named by its chunk and attempt. Blocks. */
md_status md_s3_data_put_new(const char *url, const md_fetch_opts *o, const char *path,
                             md_err *err);

/* Delete every object under the folder `url` (s3://BUCKET/PREFIX/, checked
 * as a folder): a listing, then one DELETE each; *deleted (may be NULL)
 * gets their count. Blocks. */
md_status md_s3_data_delete_prefix(const char *url, const md_fetch_opts *o, long long *deleted,
                                   md_err *err);

/* Download `url` (http, https or file) into a new blob writer: connect and
 * total timeouts, size limit, at most max_redirects redirects, each checked
 * like the URL itself; every connection refused when it goes to an internal
 * address (loopback, RFC 1918, link-local, unique-local, ...) unless
 * allow_private. Messages quote `url`, never a redirect target or fetched
 * bytes. On success `*out` is an unfinished writer for md_blob_finish.
 * Thread-safe. */
md_status md_fetch_blob(md_store *store, const char *url, const md_fetch_opts *opts,
                        md_blob_writer **out, md_err *err);

/* Download `url` to the file `dest` (written under a temp name of this
 * call's own, fsynced, renamed, the directory fsynced), with the same checks
 * and limits as md_fetch_blob. Thread-safe; concurrent calls for one dest
 * leave one whole file. */
md_status md_fetch_file(const char *url, const md_fetch_opts *opts, const char *dest, md_err *err);

/* 1 when a download must not connect to `addr` by default: loopback,
 * private, link-local, carrier-grade NAT, multicast, reserved, and the
 * IPv6 forms (::1, fc00::/7, fe80::/10, IPv4-mapped, NAT64, 6to4 of those).
 * `addr` is a struct sockaddr. Thread-safe. Exposed for tests. */
struct sockaddr;
int md_addr_is_internal(const struct sockaddr *addr);

/* Open the directory holding the absolute `path` under one of `allowed`:
 * the allowed directory is resolved once, then each component below it is
 * opened with openat(O_NOFOLLOW), so no symlink is followed and no other
 * file is reached than the one checked. On success `*dirfd` is a new
 * descriptor the caller closes and `*leaf` points into `path` at the last
 * component. MD_EINVAL with code path_not_allowed (outside, a symlink,
 * paths disabled), invalid_path (relative, "..") or `notfound_code` (a
 * missing directory); `what` names the field in messages. Thread-safe. */
md_status md_path_open_dir(const md_strlist *allowed, const char *what, const char *path,
                           const char *notfound_code, int *dirfd, const char **leaf, md_err *err);

/* md_path_open_dir, then the regular file itself read-only with O_NOFOLLOW;
 * `*fd` is a new descriptor the caller closes. Thread-safe. */
md_status md_path_open_file(const md_strlist *allowed, const char *what, const char *path,
                            const char *notfound_code, int *fd, md_err *err);

/* md_path_open_dir, then the directory `path` itself (O_DIRECTORY,
 * O_NOFOLLOW): `*fd` is a new descriptor the caller closes; invalid_path
 * when it is not a directory. Thread-safe. */
md_status md_path_open_directory(const md_strlist *allowed, const char *what, const char *path,
                                 const char *notfound_code, int *fd, md_err *err);

/* fsync a directory, so the renames in it are durable; MD_EIO naming `what`. */
md_status md_fsync_dir(int dirfd, const char *what, md_err *err);
/* ---- models and versions ---- */

/* Whether `name` is a valid model name: [A-Za-z0-9._-]{1,64}. */
int md_model_name_ok(const char *name);

typedef struct md_version_spec {
    const char *model;
    int version;             /* 0: next number */
    const char *sha256;      /* a blob already in the store */
    long long size;
    const char *source;      /* "upload" or the URL */
    json_t *config;          /* borrowed; NULL = {} */
    json_t *metadata;        /* borrowed; NULL = {} */
    json_t *metrics;         /* borrowed; NULL = {} */
    int make_default;
    const char *state;       /* "stored" (default) or "ready" */
    const char *format;      /* "torchscript" (NULL), "torch_save" or "safetensors" */
    const char *arch_sha256; /* the architecture a state_dict loads into; NULL for TorchScript */
    int promote;             /* 1: the model's promotion policy, when it has one, decides the
                              * default instead of make_default; the answer then carries
                              * "promotion": {"promoted", "reason"} */
} md_version_spec;

/* Move the finished upload `blob` (takes ownership, even on failure; NULL
 * when spec->sha256 names a blob already stored) to blobs/<sha256>, then add
 * the version row (creating the model row if needed) in one transaction and
 * apply the model's retention policy. MD_ECONFLICT when the number is taken.
 * Returns the new version's JSON in `*out` (out may be NULL). */
md_status md_store_add_version(md_store *store, const md_version_spec *spec, md_blob_writer *blob,
                               json_t **out, md_err *err);

/* GET /models: models ordered by name after `after` (NULL = from the start),
 * at most `limit`. `*out` = {"models": [...], "next": name|null}. */
md_status md_store_list_models(md_store *store, const char *after, int limit, json_t **out,
                               md_err *err);
/* One model with its versions. MD_ENOTFOUND naming the model. */
md_status md_store_get_model(md_store *store, const char *name, json_t **out, md_err *err);
/* One version. */
md_status md_store_get_version(md_store *store, const char *name, int version, json_t **out,
                               md_err *err);
/* Versions ordered by "version", "created_at" or "metrics.KEY"; asc != 0 ascending. */
md_status md_store_list_versions(md_store *store, const char *name, const char *order_by, int asc,
                                 json_t **out, md_err *err);
/* Move the default version. */
md_status md_store_set_default(md_store *store, const char *name, int version, md_err *err);
/* Set the model's retention policy: {"keep_last": N?, "keep_best": N?, "metric": "metrics.K"?,
 * "order": "asc"|"desc"?} or null to clear; applied at once. */
md_status md_store_set_retention(md_store *store, const char *name, json_t *retention,
                                 md_err *err);
/* Validate a retention policy object without storing it. */
md_status md_retention_check(json_t *retention, md_err *err);
/* ---- traffic splits (traffic.c, issue 28) ---- */

#define MD_TRAFFIC_MAX_VERSIONS 16 /* versions one model's traffic may name */

/* Validate a traffic split {"3": 90, "4": 10} (versions to integer
 * percentages summing to 100; null clears) and a sticky header name (an HTTP
 * header name, or null), either may be NULL (not given), without storing. */
md_status md_traffic_check(json_t *traffic, json_t *sticky_header, md_err *err);
/* Set the model's traffic split (its 0 shares dropped), sticky header and/or
 * promote_when policy (each NULL: unchanged; JSON null: cleared; clearing
 * the split clears the other two) in one transaction that checks every named version exists and
 * has not failed, and records the change in the history with `note` (NULL:
 * no record). GET /models/NAME shows them as "traffic", "sticky_header" and
 * "promote_when". */
md_status md_store_set_traffic(md_store *store, const char *name, json_t *traffic,
                               json_t *sticky_header, json_t *promote_when, json_t *note,
                               md_err *err);
/* Read only: whether md_store_set_traffic would take `traffic` now (its
 * shape, the model, each version with a share exists and has not failed),
 * so a request changing several things can check before it writes. */
md_status md_store_check_traffic(md_store *store, const char *name, json_t *traffic,
                                 md_err *err);
/* Every model with a split: {"NAME": {"traffic": {...}, "sticky_header": "H"|null,
 * "promote_when": {...}|null}}. */
md_status md_store_traffic_all(md_store *store, json_t **out, md_err *err);

/* Validate a shadow {"version": N, "percent": 1..100 (default 100)} (null
 * clears; NULL: not given) without storing it. */
md_status md_shadow_check(json_t *shadow, md_err *err);
/* Set (or with JSON null clear) the model's shadow version, checking it
 * exists and has not failed, and record it in the history with `note`
 * (NULL: no record), in one transaction. GET /models/NAME shows "shadow". */
md_status md_store_set_shadow(md_store *store, const char *name, json_t *shadow, json_t *note,
                              md_err *err);
/* Validate a promote_when policy {"min_requests": N >= 1, "max_error_rate": 0..1}
 * (null clears; NULL: not given) without storing it. */
md_status md_promote_when_check(json_t *policy, md_err *err);

#define MD_HISTORY_MAX 100 /* changes of a model's default and traffic kept */

/* As md_store_set_default, recording the change in the model's history with
 * `note` ({"by": "api", "reason"?: "...", "request_id"?: "..."}; NULL: no
 * record) in the same transaction. */
md_status md_store_set_default_noted(md_store *store, const char *name, int version,
                                     json_t *note, md_err *err);
/* A judged canary's outcome, applied only if the model's split is still
 * `expect` (json_equal; another replica may have acted first: then
 * MD_ECONFLICT code traffic_changed and nothing changes): `new_default` > 0
 * becomes the default, the split becomes `new_traffic` (JSON null: none, the
 * sticky header and promote_when with it), and `note` goes to the history,
 * in one transaction. */
md_status md_store_apply_verdict(md_store *store, const char *name, json_t *expect,
                                 int new_default, json_t *new_traffic, json_t *note,
                                 md_err *err);
/* As md_store_apply_verdict for setting `key`: "traffic" (the split) or
 * "shadow" (`new_value` then the new shadow, JSON null to end it; with no
 * split left, promote_when ends too). */
md_status md_store_apply_verdict_on(md_store *store, const char *name, const char *key,
                                    json_t *expect, int new_default, json_t *new_value,
                                    json_t *note, md_err *err);
/* The model's history, oldest first: [{"at", "by", "change", "reason"?,
 * "request_id"?}]. */
md_status md_store_history(md_store *store, const char *name, json_t **out, md_err *err);

/* Delete a version; MD_ECONFLICT if it is the default while others exist,
 * unless `force` (then the newest other version becomes default). */
md_status md_store_delete_version(md_store *store, const char *name, int version, int force,
                                  md_err *err);
/* Delete a model and all its versions. */
md_status md_store_delete_model(md_store *store, const char *name, md_err *err);
/* Record a version's state ("stored", "loading", "ready", "failed") and reason. */
md_status md_store_set_state(md_store *store, const char *name, int version, const char *state,
                             const char *reason, md_err *err);
/* The path of a version's checkpoint file and its sha256. */
md_status md_store_blob_path(md_store *store, const char *name, int version, char *path,
                             size_t path_size, char sha256[MD_SHA256_HEX], md_err *err);
/* Every model's default version: [{"model", "version", "config", "path"}]. */
md_status md_store_defaults(md_store *store, json_t **out, md_err *err);

/* ---- training checkpoints (issue 12) ---- */

/* Make the finished upload `blob` (takes ownership, even on failure) the
 * architecture of model `name` (created when new): moved to blobs/<sha256>
 * and recorded in one transaction. Versions keep the architecture they were
 * loaded with; the previous architecture's blob goes when nothing uses it.
 * GET /models/NAME shows it as "architecture": {"sha256"}. */
md_status md_store_set_architecture(md_store *store, const char *name, md_blob_writer *blob,
                                    md_err *err);
/* The sha256 of the model's architecture into `sha256`. MD_ENOTFOUND with
 * code model_not_found, or no_architecture saying how to PUT one. */
md_status md_store_architecture(md_store *store, const char *name, char sha256[MD_SHA256_HEX],
                                md_err *err);
/* Validate a promotion policy {"metric": K, "order": "desc"|"asc"} (null
 * clears) without storing it. */
md_status md_promote_check(json_t *policy, md_err *err);
/* Set (or with JSON null clear) the model's promotion policy: a version added
 * with spec.promote becomes the default only when it beats the current
 * default on metrics.K (a version without K never replaces one with it).
 * GET /models/NAME shows it as "promote". */
md_status md_store_set_promote(md_store *store, const char *name, json_t *policy, md_err *err);
/* A metric name a request may name (record_metric, promote.metric): 1 to
 * MD_METRIC_NAME_MAX bytes of [A-Za-z0-9_.-], so it is one JSON path label
 * SQLite reads as written. MD_EINVAL (code `code`) naming `what` and the rule
 * otherwise. Thread-safe. */
#define MD_METRIC_NAME_MAX 64
md_status md_metric_name_check(const char *name, const char *what, const char *code,
                               md_err *err);
/* Set metrics.`metric` of a version to `value` (a job's accuracy). MD_EINVAL
 * when md_metric_name_check refuses the name. With `promoted` non-NULL, the
 * model's promotion policy applies too: when `metric` is the policy's and the
 * (ready) version beats the default on it, or the default lacks it, the
 * version becomes the default and *promoted is 1. */
md_status md_store_record_metric(md_store *store, const char *name, int version,
                                 const char *metric, double value, int *promoted, md_err *err);

#ifdef __cplusplus
}
#endif
#endif
