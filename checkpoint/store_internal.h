/*
 * store_internal.h - PRIVATE to the store's implementation. Include it only
 * from the checkpoint/ files (store.c, versions.c, promotion.c, retention.c,
 * blobs.c, download.c) and jobs/job_store.c, whose job table lives in the same index;
 * every other file goes through checkpoint.h or jobs/jobs.h, where md_store
 * and md_blob_writer stay opaque.
 *
 * It holds the two struct bodies and the small helpers all those files use
 * on the index (index_impl.h: SQLite or PostgreSQL behind one seam; the SQL
 * here and in those files is written once, for both). Locking: s->mu
 * serialises this process's use of s->ix;
 * the public md_store_* functions take it, the helpers here expect it held
 * (or the store not yet shared, during md_store_open) unless they say
 * otherwise. The crash-safety and replica DESIGN is in store.c.
 */
#ifndef MD_STORE_INTERNAL_H
#define MD_STORE_INTERNAL_H

#include <jansson.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <stdio.h>
#include <time.h>

#include "blobs_impl.h"
#include "checkpoint.h"
#include "index_impl.h"

struct md_store {
    char *dir;
    md_index *ix;
    md_blobs *blobs; /* blobs_impl.h: the directory or S3 (then blobs/ is a cache) */
    pthread_mutex_t mu;
    pthread_mutex_t listen_mu; /* md_store_wait_change: one waiter at a time */
    /* S3 only: the collector thread (blobs.c), woken by gc_cv */
    pthread_t gc_thread;
    int gc_started, gc_stop, gc_kick;
    pthread_mutex_t gc_mu;
    pthread_cond_t gc_cv;
};

struct md_blob_writer {
    md_store *store;
    int fd;
    char tmp_path[4096];
    long long size;
    long long max_bytes;
    EVP_MD_CTX *sha;
    int finished;
    char sha256[MD_SHA256_HEX];
    /* S3: the object md_blob_upload put (""= none); deleted by md_blob_abort
     * unless md_blob_committed saw its row commit */
    char key[MD_BLOB_KEY_MAX];
};

/* The test hook set by md_store_set_test_hook, called at `point` (store.c). */
void md_store_test_point(md_store *s, const char *point);
static inline void hook(md_store *s, const char *point) { md_store_test_point(s, point); }

/* config/md_err.h's md_now_iso, under the name the store's code uses. */
static inline void now_iso(char out[32]) { md_now_iso(out); }

/* The index's last failure as a status (index_impl.h: each backend maps its
 * own codes), `what` naming the step. */
static inline md_status db_fail(md_store *s, md_err *err, const char *what)
{
    return ix_fail(s->ix, what, err);
}

static inline md_status exec(md_store *s, const char *sql, md_err *err)
{
    return ix_exec(s->ix, sql, err);
}

/* ---- one write transaction ----
 *
 * Every change to the index is one write transaction holding the write lock
 * every replica shares (SQLite: BEGIN IMMEDIATE; PostgreSQL: BEGIN and a
 * transaction-scoped advisory lock; see DESIGN in store.c). The frame is
 * always:
 *
 *     if ((rc = txn_begin(s, err)) != MD_OK)
 *         return rc;                     (nothing to roll back)
 *     rc = ...the work, stopping at its first failure...;
 *     rc = txn_end(s, rc, TXN_BUMP, err);
 *
 * txn_end is the one place a transaction ends and a failure of its own is
 * mapped: MD_OK commits, any other status (or a failed generation bump or
 * COMMIT) rolls back, so the connection is never left inside a transaction.
 * `err` keeps the detail of the first failure. Caller holds s->mu.
 */
enum {
    TXN_KEEP = 0, /* commit as is (the blob sweeps, migrations) */
    TXN_BUMP = 1  /* bump meta.generation first: replicas reload what they serve */
};

static inline md_status txn_begin(md_store *s, md_err *err) { return ix_begin(s->ix, err); }

static inline md_status txn_end(md_store *s, md_status rc, int flags, md_err *err)
{
    if (rc == MD_OK && (flags & TXN_BUMP))
        rc = exec(s,
                  "UPDATE meta SET value = CAST(CAST(value AS BIGINT) + 1 AS TEXT) "
                  "WHERE key = 'generation'",
                  err);
    if (rc == MD_OK && (flags & TXN_BUMP))
        rc = ix_notify_change(s->ix, err); /* heard by replicas at the commit */
    if (rc == MD_OK)
        rc = ix_commit(s->ix, err);
    if (rc != MD_OK)
        ix_rollback(s->ix);
    return rc;
}

static inline md_ixstmt *prep(md_store *s, const char *sql, md_err *err)
{
    return ix_prepare(s->ix, sql, err);
}

/* A TEXT column holding JSON, parsed (an empty object when NULL or bad). */
static inline json_t *json_col(md_ixstmt *st, int col)
{
    const char *text = ix_column_text(st, col);
    json_t *v = text ? json_loads(text, JSON_DECODE_ANY, NULL) : NULL;
    return v ? v : json_object();
}

static inline void blob_path(const md_store *s, const char *sha, char *out, size_t size)
{
    snprintf(out, size, "%s/blobs/%s", s->dir, sha);
}

/* ---- blob files and their garbage collection (blobs.c) ---- */

/* fsync blobs/, so a rename or unlink there survives a power loss. */
md_status md_blobs_sync_dir(md_store *s, md_err *err);
/* At open: remove temp files of processes that are gone. */
void md_blobs_sweep_tmp(md_store *s);
/* At open: remove blobs no row references, older than the grace period,
 * inside a write transaction of its own. Caller holds no transaction. */
void md_blobs_sweep_orphans(md_store *s);
/* Within a write transaction: move the finished upload `blob` into
 * blobs/<sha256> (or drop its temp file when the same bytes are already
 * stored) and fsync blobs/. Sets *moved when this call put the file there,
 * so that md_blobs_settle can take it back if the transaction rolls back.
 * `what` names the file in an error ("checkpoint", "architecture"). */
md_status md_blob_place(md_store *s, md_blob_writer *blob, const char *what, int *moved,
                        md_err *err);
/* At open: mark rows whose blob is missing failed, with the reason. Only
 * where the directory holds the blobs: a cache miss (S3) is no missing blob,
 * and S3 unreachable at start never fails a version. */
md_status md_blobs_check(md_store *s, md_err *err);

/* Before the write transaction, with neither the mutex nor a transaction
 * held: put the finished upload `blob` in the blobs backend (S3: under a new
 * key kept on the writer; the directory: nothing to do, md_blob_place
 * renames it). MD_EUNAVAIL when S3 cannot be reached: nothing is stored. */
md_status md_blob_upload(md_store *s, md_blob_writer *blob, md_err *err);
/* The writer's temp file was filled behind its back (download.c: an S3
 * GET into blob->fd): hash and count what it holds now, as md_blob_write
 * would have, MD_ETOOBIG past its limit. */
md_status md_blob_adopt(md_blob_writer *blob, md_err *err);
/* After txn_end returned rc: when it committed, the row names the object
 * md_blob_upload put, so md_blob_abort keeps it; otherwise md_blob_abort
 * deletes it. Accepts NULL. */
void md_blob_committed(md_blob_writer *blob, md_status rc);
/* Within a write transaction: 1 when the bytes `sha` are stored (the
 * directory: blobs/<sha> exists; S3: a live object holds them), else 0. */
int md_blob_stored_locked(md_store *s, const char *sha);
/* At open (S3 only): start the collector thread, which deletes the objects
 * garbage collection marked, then their blob_keys rows, and sweeps objects
 * no row names once older than the grace period. md_blobs_stop_gc joins it
 * (does nothing when it never started). */
void md_blobs_start_gc(md_store *s);
void md_blobs_stop_gc(md_store *s);

/* Collect the sha256 of rows about to be deleted so their blobs can be
 * released after the commit. */
typedef struct sha_list {
    char (*items)[MD_SHA256_HEX];
    int count;
} sha_list;

/* Append a sha256 to `l` (aborts on OOM: a small internal list). */
void md_sha_list_add(sha_list *l, const char *sha);
/* Garbage-collect the blobs of the rows just deleted and committed, in a
 * write transaction of its own; empties `l`. Caller holds the mutex, not a
 * transaction. */
void md_blobs_release_all(md_store *s, sha_list *l);
/* After txn_end returned rc: committed (MD_OK), collect the blobs of the rows
 * it deleted (`released`); rolled back, those rows stay, so collect only
 * `moved_sha` (NULL: none), the blob md_blob_place moved in, unless another
 * row (maybe a replica's) uses the same bytes. Empties `released`. Caller
 * holds the mutex, not a transaction. */
void md_blobs_settle(md_store *s, md_status rc, sha_list *released, const char *moved_sha);

/* ---- model and version rows (versions.c), shared with promotion.c ----
 * All expect s->mu held; those that write expect a write transaction. */

/* The settings JSON of model `name` into *settings (new reference; NULL when
 * there is no such row), or the index's failure (db_fail naming `what`). */
md_status md_settings_read(md_store *s, const char *name, json_t **settings, const char *what,
                           md_err *err);
/* Append to the model's history (settings.history, the newest
 * MD_HISTORY_MAX kept) an entry of `note` ({"by", "reason"?, "request_id"?},
 * borrowed) with "at" (now) and "change" (borrowed): inside the write
 * transaction of the change it records (traffic.c). */
md_status md_history_add_locked(md_store *s, const char *name, json_t *note, json_t *change,
                                md_err *err);
/* 1 when the traffic split object `traffic` (settings.traffic, may be NULL)
 * gives `version` a share above 0 (traffic.c). */
int md_traffic_names_version(json_t *traffic, int version);
/* 1 when a model's `settings` route requests to `version`: a share of its
 * split, or its shadow (traffic.c). */
int md_settings_route_to(json_t *settings, int version);
/* MD_OK when model `name` has a row; model_not_found (md_model_missing)
 * when it has none; the index's failure (db_fail) when it could not tell. */
md_status md_model_check(md_store *s, const char *name, md_err *err);
/* Sets model_not_found on err, without the "did you mean" hint: cheap, so it
 * may be decided under the mutex and inside a write transaction. The public
 * function adds the hint (md_model_hint) once it holds neither. Returns
 * MD_ENOTFOUND. */
md_status md_model_missing(const char *name, md_err *err);
/* When `rc` is model_not_found, add the nearest stored name when `name`
 * looks like a typo of one ("did you mean fashion?"). Call with neither the
 * mutex nor a transaction held (it takes the mutex itself). Returns rc. */
md_status md_model_hint(md_store *s, md_status rc, const char *name, md_err *err);
/* The version row as JSON in *out (a new reference), or version_not_found. */
md_status md_get_version_locked(md_store *s, const char *name, int version, json_t **out,
                                md_err *err);
/* `version` becomes the default of `name`; `what` names the change in an
 * error. */
md_status md_set_default_locked(md_store *s, const char *name, int version, const char *what,
                                md_err *err);
/* The key `key` ("retention") of the model's settings becomes `value`
 * (borrowed); with remove_null, a JSON null removes the key instead. Read,
 * changed with jansson and written back inside the caller's write
 * transaction. `what` names the change in an error. */
md_status md_set_setting(md_store *s, const char *name, const char *path, json_t *value,
                         int remove_null, const char *what, md_err *err);

/* ---- promotion (promotion.c) ---- */

/* Within md_store_add_version's transaction: whether the new version (spec)
 * becomes the default under the model's promotion policy, and why
 * (`reason`, "" when the model has none: then spec->make_default decides). */
md_status md_promotion_decide(md_store *s, const md_version_spec *spec, int *make_default,
                              char *reason, size_t size, md_err *err);

/* ---- retention (retention.c) ---- */

/* The value at `dotted` ("loss", "eval.loss": nested keys) in the metrics
 * object, NULL when absent or JSON null (borrowed). */
json_t *md_metric_get(json_t *metrics, const char *dotted);
/* Orders two metric values as SQLite orders json_extract's results: numbers
 * (true/false as 1/0) before text, numbers by value, text bytewise. */
int md_metric_cmp(json_t *a, json_t *b);

/* Apply the model's retention policy inside the open transaction: keep the
 * default, the newest keep_last and the best keep_best; delete the rest,
 * adding their sha256 to `released` for md_blobs_release_all after commit. */
md_status md_store_apply_retention(md_store *s, const char *name, sha_list *released,
                                   md_err *err);

#endif
