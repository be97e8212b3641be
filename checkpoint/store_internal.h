/*
 * store_internal.h - PRIVATE to the store's implementation. Include it only
 * from the checkpoint/ files (store.c, versions.c, retention.c, blobs.c) and
 * jobs/job_store.c, whose job table lives in the same SQLite index; every
 * other file goes through checkpoint.h or jobs/jobs.h, where md_store and
 * md_blob_writer stay opaque.
 *
 * It holds the two struct bodies and the small helpers all those files use
 * on the connection. Locking: s->mu serialises this process's use of s->db;
 * the public md_store_* functions take it, the helpers here expect it held
 * (or the store not yet shared, during md_store_open) unless they say
 * otherwise. The crash-safety and replica DESIGN is in store.c.
 */
#ifndef MD_STORE_INTERNAL_H
#define MD_STORE_INTERNAL_H

#include <jansson.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <sqlite3.h>
#include <stdio.h>
#include <time.h>

#include "checkpoint.h"

struct md_store {
    char *dir;
    sqlite3 *db;
    pthread_mutex_t mu;
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
};

/* The test hook set by md_store_set_test_hook, called at `point` (store.c). */
void md_store_test_point(md_store *s, const char *point);
static inline void hook(md_store *s, const char *point) { md_store_test_point(s, point); }

/* config/md_err.h's md_now_iso, under the name the store's code uses. */
static inline void now_iso(char out[32]) { md_now_iso(out); }

static inline md_status db_fail(md_store *s, md_err *err, const char *what)
{
    return md_err_set(err, MD_EIO, "store index %s/index.sqlite: %s: %s", s->dir, what,
                      sqlite3_errmsg(s->db));
}

static inline md_status exec(md_store *s, const char *sql, md_err *err)
{
    char *msg = NULL;
    if (sqlite3_exec(s->db, sql, NULL, NULL, &msg) != SQLITE_OK) {
        md_err_set(err, MD_EIO, "store index %s/index.sqlite: %s", s->dir, msg ? msg : "error");
        sqlite3_free(msg);
        return MD_EIO;
    }
    return MD_OK;
}

static inline sqlite3_stmt *prep(md_store *s, const char *sql, md_err *err)
{
    sqlite3_stmt *st = NULL;
    if (sqlite3_prepare_v2(s->db, sql, -1, &st, NULL) != SQLITE_OK) {
        db_fail(s, err, "prepare");
        return NULL;
    }
    return st;
}

static inline json_t *json_col(sqlite3_stmt *st, int col)
{
    const char *text = (const char *)sqlite3_column_text(st, col);
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
/* At open: mark rows whose blob is missing failed, with the reason. */
md_status md_blobs_check(md_store *s, md_err *err);

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

/* ---- retention (retention.c) ---- */

/* Apply the model's retention policy inside the open transaction: keep the
 * default, the newest keep_last and the best keep_best; delete the rest,
 * adding their sha256 to `released` for md_blobs_release_all after commit. */
md_status md_store_apply_retention(md_store *s, const char *name, sha_list *released,
                                   md_err *err);

#endif
