/*
 * store.c - the checkpoint store: opening it (directories, the index -
 * SQLite in --store or PostgreSQL by index_url, behind index_impl.h - its
 * forward-only migrations, the sweeps at open) and closing it. The rest of
 * the store is split by concern, sharing store_internal.h: versions.c
 * (model and version rows), retention.c,
 * blobs.c (blob files, uploads, garbage collection), archive.c (the
 * TorchScript zip check); the job table's queries are jobs/job_store.c.
 * The migrations of every table are in the backends' ordered lists.
 *
 * DESIGN
 * Crash safety comes from ordering, not from cleanup code:
 *   1. bytes stream into tmp/upload-<pid>-XXXXXX while SHA-256 is computed;
 *   2. the temp file is checked (non-empty, TorchScript archive, hash) and fsynced;
 *   3. under the store mutex it is renamed to blobs/<sha256> (or dropped when
 *      those bytes are already stored) and the blobs directory is fsynced;
 *   4. the version row is inserted in one transaction (synchronous=FULL);
 *      only then is the deploy acknowledged.
 * A crash before 3 leaves a temp file, swept at the next open (only files of
 * processes that are gone, so replicas sharing the store keep theirs). A
 * crash between 3 and 4 leaves a blob no row references, swept at open once
 * it is older than ORPHAN_GRACE_S. Nothing ever leaves a row without its
 * file or a partial file under a final name. Blobs are unlinked only when
 * the last row referencing them is deleted.
 *
 * Replicas sharing the store: the per-process mutex orders this process's
 * threads only, so every decision about a blob's file is taken inside an
 * index write transaction, which holds one write lock across processes
 * (SQLite: BEGIN IMMEDIATE; PostgreSQL: BEGIN and pg_advisory_xact_lock on
 * one constant, so the same holds for replicas on one PostgreSQL): an add
 * checks "are these bytes already in blobs/?", renames its temp file there
 * and inserts its row in one transaction, and
 * garbage collection (after a delete or retention, a failed add, the orphan
 * sweep at open) re-checks "does any row reference it?" and unlinks in
 * another. So no replica can unlink a blob between another's check and its
 * commit: the row is either committed before the collector looks (the blob
 * stays) or the adder looks after the unlink (and puts its own bytes back).
 * Temp files carry their writer's pid and are swept only once it is gone.
 *
 * With blob_url = s3://... (blobs_impl.h, blobs_s3.c) the same ordering
 * holds one level up: step 3 is preceded by a PUT of the finished file to
 * S3 under a key of its own, recorded in blob_keys by the transaction of
 * step 4, so a committed row's bytes are always in S3; blobs/ becomes a
 * cache that is filled on demand (checked by sha256, renamed) and evicted
 * past cache_max_bytes. Collection marks the keys of bytes no row names in
 * its transaction; a collector thread deletes each object, then its
 * blob_keys row; objects no blob_keys row names (a PUT whose transaction
 * failed) are swept after ORPHAN_GRACE_S.
 */
#define _GNU_SOURCE
#include "store_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static md_store_hook_fn test_hook;
static void *test_hook_ctx;

void md_store_set_test_hook(md_store_hook_fn fn, void *ctx)
{
    test_hook = fn;
    test_hook_ctx = ctx;
}

void md_store_test_point(md_store *s, const char *point)
{
    if (test_hook)
        test_hook(s, point, test_hook_ctx);
}

/* ---- schema ----
 *
 * Each backend keeps its forward-only list (index_sqlite.c: the PRAGMA
 * user_version steps every existing store took; index_pg.c: the tables at
 * the current version in one step). Each step runs in a write transaction
 * of its own that re-reads the version first, so replicas starting together
 * on one index migrate it once. */
static md_status migrate(md_store *s, const char *where, md_err *err)
{
    int n = 0;
    const char *const *steps = ix_migrations(s->ix, &n);
    for (;;) {
        int have = 0;
        md_status rc = txn_begin(s, err);
        if (rc != MD_OK)
            return rc;
        rc = ix_schema_get(s->ix, &have, err);
        if (rc == MD_OK && have > n)
            rc = md_err_set(err, MD_EIO,
                            "store %s has schema version %d, newer than this modeld's %d; run a "
                            "newer modeld or use another store directory",
                            where, have, n);
        if (rc != MD_OK || have == n) {
            txn_end(s, rc, TXN_KEEP, NULL);
            return rc;
        }
        if (steps[have])
            rc = exec(s, steps[have], err);
        if (rc == MD_OK)
            rc = ix_schema_set(s->ix, have + 1, err);
        if ((rc = txn_end(s, rc, TXN_KEEP, err)) != MD_OK)
            return rc;
        md_log(MD_LOG_INFO, "store %s: schema migrated to version %d", where, have + 1);
    }
}

/* The index tells the store's test hook that a write waits for a replica. */
static void on_wait(void *ctx) { hook(ctx, "busy"); }

static int mkdir_p(const char *path)
{
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s", path);
    for (char *p = tmp + 1; *p; p++) {
        if (*p == '/') {
            *p = '\0';
            if (mkdir(tmp, 0755) != 0 && errno != EEXIST)
                return -1;
            *p = '/';
        }
    }
    return mkdir(tmp, 0755) == 0 || errno == EEXIST ? 0 : -1;
}

md_status md_store_open(const char *dir, md_store **out, md_err *err)
{
    return md_store_open_index(dir, NULL, out, err);
}

md_status md_store_open_index(const char *dir, const char *index_url, md_store **out,
                              md_err *err)
{
    md_store_opts o = {.index_url = index_url, .s3_path_style = -1};
    return md_store_open_opts(dir, &o, out, err);
}

md_status md_store_open_opts(const char *dir, const md_store_opts *opts, md_store **out,
                             md_err *err)
{
    static const md_store_opts none = {.s3_path_style = -1};
    if (!opts)
        opts = &none;
    const char *index_url = opts->index_url;
    *out = NULL;
    char path[4096];
    const char *subs[] = {"", "/blobs", "/tmp"};
    for (int i = 0; i < 3; i++) {
        snprintf(path, sizeof path, "%s%s", dir, subs[i]);
        if (mkdir_p(path) != 0)
            return md_err_set(err, MD_EIO, "store %s: cannot create directory %s: %s; check the "
                                           "store setting and permissions",
                              dir, path, strerror(errno));
    }
    md_store *s = md_xcalloc(1, sizeof *s);
    s->dir = md_xstrdup(dir);
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->listen_mu, NULL);
    pthread_mutex_init(&s->gc_mu, NULL);
    pthread_cond_init(&s->gc_cv, NULL);
    /* the one choice of each backend: nothing after it branches on it */
    md_blobs_args bargs = {.url = opts->blob_url, .dir = dir,
                           .cache_max_bytes = opts->cache_max_bytes,
                           .path_style = opts->s3_path_style};
    md_index_args args = {.url = index_url, .dir = dir, .on_wait = on_wait, .ctx = s};
    md_status st;
    char where[4200];
    if (index_url && index_url[0]) {
        char masked[1024];
        md_url_mask(index_url, masked, sizeof masked);
        snprintf(where, sizeof where, "%s (index %s)", dir, masked);
    } else {
        snprintf(where, sizeof where, "%s", dir);
    }
    if ((st = md_blobs_open(&bargs, &s->blobs, err)) != MD_OK ||
        (st = md_index_open(&args, &s->ix, err)) != MD_OK ||
        (st = migrate(s, where, err)) != MD_OK || (st = md_blobs_check(s, err)) != MD_OK) {
        md_store_close(s);
        return st;
    }
    md_blobs_sweep_tmp(s);
    md_blobs_sweep_orphans(s);
    md_blobs_start_gc(s);
    if (opts->blob_url && opts->blob_url[0])
        md_log(MD_LOG_INFO, "store %s: blobs in %s, this directory their cache (%lld bytes at "
               "most; 0 = no bound)", dir, opts->blob_url, opts->cache_max_bytes);
    *out = s;
    return MD_OK;
}

void md_store_close(md_store *s)
{
    if (!s)
        return;
    md_blobs_stop_gc(s);
    ix_close(s->ix);
    bl_close(s->blobs);
    pthread_mutex_destroy(&s->mu);
    pthread_mutex_destroy(&s->listen_mu);
    pthread_mutex_destroy(&s->gc_mu);
    pthread_cond_destroy(&s->gc_cv);
    free(s->dir);
    free(s);
}

long long md_store_generation(md_store *s)
{
    pthread_mutex_lock(&s->mu);
    long long g = -1; /* the index cannot be read now (PostgreSQL restarting) */
    md_ixstmt *st = prep(s, "SELECT CAST(value AS BIGINT) FROM meta WHERE key = 'generation'",
                         NULL);
    if (ix_step(st) == MD_IX_ROW)
        g = ix_column_int64(st, 0);
    ix_finalize(st);
    pthread_mutex_unlock(&s->mu);
    return g;
}

int md_store_wait_change(md_store *s, int timeout_ms)
{
    /* not s->mu: the index waits on a connection of its own */
    pthread_mutex_lock(&s->listen_mu);
    int r = ix_wait_change(s->ix, timeout_ms);
    pthread_mutex_unlock(&s->listen_mu);
    return r;
}

md_index *md_store_index_for_test(md_store *s) { return s->ix; }

const char *md_store_dir(const md_store *s) { return s->dir; }

int md_store_data_url(md_store *s, char *url, size_t size)
{
    if (size)
        url[0] = '\0';
    return bl_data_url(s->blobs, url, size);
}
