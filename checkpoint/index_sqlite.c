/*
 * index_sqlite.c - the store's index in SQLite (index_impl.h), the embedded
 * default: --store/index.sqlite in WAL mode with synchronous=FULL. A write
 * transaction is BEGIN IMMEDIATE, which takes the database's write lock
 * across every process sharing the file (replicas on one host); a waiting
 * writer retries for up to BUSY_WAIT_MS, telling the store (args.on_wait).
 * The schema moves forward by PRAGMA user_version, entry i of `migrations`
 * taking version i to i+1; existing stores keep migrating as before.
 */
#define _GNU_SOURCE
#include "index_impl.h"

#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Forward-only migrations: entry i moves user_version i to i+1. */
static const char *const migrations[] = {
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
    "INSERT INTO meta VALUES ('generation', '0');"
    "CREATE TABLE models ("
    "  name TEXT PRIMARY KEY,"
    "  default_version INTEGER,"
    "  settings TEXT NOT NULL DEFAULT '{}',"
    "  created_at TEXT NOT NULL,"
    "  updated_at TEXT NOT NULL);"
    "CREATE TABLE versions ("
    "  model TEXT NOT NULL REFERENCES models(name) ON DELETE CASCADE,"
    "  version INTEGER NOT NULL CHECK (version > 0),"
    "  sha256 TEXT NOT NULL,"
    "  size INTEGER NOT NULL,"
    "  format TEXT NOT NULL DEFAULT 'torchscript',"
    "  source TEXT NOT NULL,"
    "  config TEXT NOT NULL DEFAULT '{}',"
    "  metadata TEXT NOT NULL DEFAULT '{}',"
    "  metrics TEXT NOT NULL DEFAULT '{}',"
    "  state TEXT NOT NULL CHECK (state IN ('stored','loading','ready','failed')),"
    "  state_reason TEXT,"
    "  created_at TEXT NOT NULL,"
    "  PRIMARY KEY (model, version));"
    "CREATE INDEX versions_sha256 ON versions(sha256);",
    /* 2: batch-predict jobs and their committed progress */
    "CREATE TABLE jobs ("
    "  id TEXT PRIMARY KEY,"
    "  model TEXT NOT NULL,"
    "  version INTEGER,"
    "  spec TEXT NOT NULL,"
    "  status TEXT NOT NULL CHECK (status IN "
    "    ('queued','running','succeeded','failed','cancelled')),"
    "  rows_done INTEGER NOT NULL DEFAULT 0,"
    "  rows_total INTEGER,"
    "  rows_skipped INTEGER NOT NULL DEFAULT 0,"
    "  output_path TEXT NOT NULL,"
    "  output_bytes INTEGER NOT NULL DEFAULT 0,"
    "  correct INTEGER NOT NULL DEFAULT 0,"
    "  labeled INTEGER NOT NULL DEFAULT 0,"
    "  confusion TEXT,"
    "  rows_per_s REAL,"
    "  partial INTEGER NOT NULL DEFAULT 0,"
    "  error TEXT,"
    "  created_at TEXT NOT NULL,"
    "  started_at TEXT,"
    "  finished_at TEXT,"
    "  updated_at TEXT NOT NULL);"
    "CREATE INDEX jobs_status ON jobs(status, created_at);",
    /* 3: version numbers are never reused, even after deletes */
    "ALTER TABLE models ADD COLUMN last_version INTEGER NOT NULL DEFAULT 0;"
    "UPDATE models SET last_version = "
    "  (SELECT COALESCE(MAX(version), 0) FROM versions WHERE versions.model = models.name);",
    /* 4: jobs are claimed with a lease, so replicas sharing a store run each
     * job once and take over the jobs of one that died */
    "ALTER TABLE jobs ADD COLUMN owner TEXT;"
    "ALTER TABLE jobs ADD COLUMN lease_until REAL;"
    "ALTER TABLE jobs ADD COLUMN cancel_requested INTEGER NOT NULL DEFAULT 0;",
    /* 5: training checkpoints (issue 12): a model's architecture (a TorchScript
     * blob) and, per version, the architecture its state_dict was loaded into */
    "ALTER TABLE models ADD COLUMN arch_sha256 TEXT;"
    "ALTER TABLE versions ADD COLUMN arch_sha256 TEXT;",
    /* 6: jobs over image folders (issue 15): the directory's files that are
     * not rows (symlinks, neither PNG nor JPEG); NULL for other inputs */
    "ALTER TABLE jobs ADD COLUMN files_skipped INTEGER;",
    /* 7: why a job over a labelled dataset counts no accuracy (issue 29: a
     * one-column output of undeclared meaning); NULL when it counts one */
    "ALTER TABLE jobs ADD COLUMN accuracy_note TEXT;",
    /* 8: blobs in S3 (issue 25, blobs_impl.h): every uploaded object's key,
     * 'live' while rows may name its sha256, 'deleting' once garbage
     * collection marked it (the object goes, then the row) */
    "CREATE TABLE blob_keys ("
    "  key TEXT PRIMARY KEY,"
    "  sha256 TEXT NOT NULL,"
    "  state TEXT NOT NULL DEFAULT 'live' CHECK (state IN ('live','deleting')),"
    "  created_at TEXT NOT NULL);"
    "CREATE INDEX blob_keys_sha256 ON blob_keys(sha256, state);",
    /* 9: one job over every replica (issue 26): the chunks a job is planned
     * into (rows, and input bytes for CSV and JSON Lines), each claimed by a
     * runner of any replica with a lease on the database's clock, finished
     * once under owner and attempt; the job's chunk count and plan. SQLite
     * (one host) makes the tables and never plans chunks. */
    "CREATE TABLE job_chunks ("
    "  job_id TEXT NOT NULL,"
    "  seq INTEGER NOT NULL,"
    "  start_row INTEGER NOT NULL,"
    "  end_row INTEGER NOT NULL,"
    "  start_byte INTEGER NOT NULL,"
    "  end_byte INTEGER NOT NULL,"
    "  status TEXT NOT NULL DEFAULT 'pending' CHECK (status IN ('pending','running','done')),"
    "  owner TEXT,"
    "  attempt INTEGER NOT NULL DEFAULT 0,"
    "  lease_until REAL,"
    "  rows_done INTEGER NOT NULL DEFAULT 0,"
    "  rows_skipped INTEGER NOT NULL DEFAULT 0,"
    "  correct INTEGER NOT NULL DEFAULT 0,"
    "  labeled INTEGER NOT NULL DEFAULT 0,"
    "  confusion TEXT,"
    "  output_key TEXT,"
    "  output_bytes INTEGER NOT NULL DEFAULT 0,"
    "  taken_over INTEGER NOT NULL DEFAULT 0,"
    "  PRIMARY KEY (job_id, seq));"
    "CREATE INDEX job_chunks_claim ON job_chunks(status, job_id, seq);"
    "ALTER TABLE jobs ADD COLUMN chunks_total INTEGER;"
    "ALTER TABLE jobs ADD COLUMN chunk_plan TEXT;",
    /* 10: removing ended jobs (job_retention_s, DELETE ?purge=true; see
     * jobs/job_retention.c): the replica removing a job holds it until
     * removing_until (seconds on the index's clock), so one replica removes
     * it; jobs_removed names the jobs whose rows are gone, so every replica
     * removes its own copies of their outputs from its store (kept 30 days) */
    "ALTER TABLE jobs ADD COLUMN removing_until REAL;"
    "CREATE TABLE jobs_removed ("
    "  id TEXT PRIMARY KEY,"
    "  removed_at TEXT NOT NULL);"
    "CREATE INDEX jobs_removed_at ON jobs_removed(removed_at);",
};

typedef struct md_index_sqlite {
    md_index base;
    sqlite3 *db;
    char path[4096];
    void (*on_wait)(void *ctx);
    void *ctx;
} md_index_sqlite;

typedef struct sqlite_stmt {
    md_ixstmt base;
    sqlite3_stmt *st;
} sqlite_stmt;

#define IX(p) ((md_index_sqlite *)(p))
#define ST(p) (((sqlite_stmt *)(p))->st)

/* Another connection (a replica, or another handle) holds the write lock:
 * wait up to BUSY_WAIT_MS for it, telling the store that we wait. */
#define BUSY_WAIT_MS 5000
static int on_busy(void *p, int tries)
{
    md_index_sqlite *ix = p;
    if (ix->on_wait)
        ix->on_wait(ix->ctx);
    if (tries >= BUSY_WAIT_MS)
        return 0;
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
    return 1;
}

/* The one mapping of SQLite's result codes to the store's statuses. */
static md_status sq_fail(md_index *base, const char *what, md_err *err)
{
    md_index_sqlite *ix = IX(base);
    int code = sqlite3_extended_errcode(ix->db);
    md_status st = MD_EIO;
    if (code == SQLITE_CONSTRAINT_UNIQUE || code == SQLITE_CONSTRAINT_PRIMARYKEY)
        st = MD_ECONFLICT;
    else if (code == SQLITE_FULL)
        st = MD_ENOSPC;
    return md_err_set(err, st, "store index %s: %s: %s", ix->path, what, sqlite3_errmsg(ix->db));
}

static void sq_close(md_index *base)
{
    md_index_sqlite *ix = IX(base);
    sqlite3_close(ix->db);
    free(ix);
}

static md_status sq_exec(md_index *base, const char *sql, md_err *err)
{
    if (sqlite3_exec(IX(base)->db, sql, NULL, NULL, NULL) != SQLITE_OK)
        return sq_fail(base, "exec", err);
    return MD_OK;
}

static md_status sq_begin(md_index *base, md_err *err)
{
    if (sqlite3_exec(IX(base)->db, "BEGIN IMMEDIATE", NULL, NULL, NULL) != SQLITE_OK)
        return sq_fail(base, "begin", err);
    return MD_OK;
}

static md_status sq_commit(md_index *base, md_err *err)
{
    if (sqlite3_exec(IX(base)->db, "COMMIT", NULL, NULL, NULL) != SQLITE_OK)
        return sq_fail(base, "commit", err);
    return MD_OK;
}

static void sq_rollback(md_index *base)
{
    sqlite3_exec(IX(base)->db, "ROLLBACK", NULL, NULL, NULL);
}

static md_status sq_prepare(md_index *base, const char *sql, md_ixstmt **out, md_err *err)
{
    sqlite3_stmt *st = NULL;
    *out = NULL;
    if (sqlite3_prepare_v2(IX(base)->db, sql, -1, &st, NULL) != SQLITE_OK)
        return sq_fail(base, "prepare", err);
    sqlite_stmt *s = md_xcalloc(1, sizeof *s);
    s->base.ix = base;
    s->st = st;
    *out = &s->base;
    return MD_OK;
}

static void sq_bind_text(md_ixstmt *st, int i, const char *v)
{
    sqlite3_bind_text(ST(st), i, v, -1, SQLITE_TRANSIENT);
}
static void sq_bind_int64(md_ixstmt *st, int i, long long v) { sqlite3_bind_int64(ST(st), i, v); }
static void sq_bind_double(md_ixstmt *st, int i, double v) { sqlite3_bind_double(ST(st), i, v); }
static void sq_bind_null(md_ixstmt *st, int i) { sqlite3_bind_null(ST(st), i); }

static int sq_step(md_ixstmt *st)
{
    int r = sqlite3_step(ST(st));
    return r == SQLITE_ROW ? MD_IX_ROW : r == SQLITE_DONE ? MD_IX_DONE : MD_IX_ERROR;
}

static void sq_reset(md_ixstmt *st) { sqlite3_reset(ST(st)); }

static void sq_finalize(md_ixstmt *st)
{
    sqlite3_finalize(ST(st));
    free(st);
}

static int sq_column_type(md_ixstmt *st, int c)
{
    switch (sqlite3_column_type(ST(st), c)) {
    case SQLITE_NULL:
        return MD_IXT_NULL;
    case SQLITE_INTEGER:
        return MD_IXT_INT;
    case SQLITE_FLOAT:
        return MD_IXT_FLOAT;
    default:
        return MD_IXT_TEXT;
    }
}

static const char *sq_column_text(md_ixstmt *st, int c)
{
    return (const char *)sqlite3_column_text(ST(st), c);
}
static long long sq_column_int64(md_ixstmt *st, int c) { return sqlite3_column_int64(ST(st), c); }
static double sq_column_double(md_ixstmt *st, int c) { return sqlite3_column_double(ST(st), c); }
static long long sq_changes(md_index *base) { return sqlite3_changes(IX(base)->db); }

static md_status sq_schema_get(md_index *base, int *version, md_err *err)
{
    sqlite3_stmt *st = NULL;
    *version = 0;
    if (sqlite3_prepare_v2(IX(base)->db, "PRAGMA user_version", -1, &st, NULL) != SQLITE_OK)
        return sq_fail(base, "read the schema version", err);
    md_status rc = MD_OK;
    if (sqlite3_step(st) == SQLITE_ROW)
        *version = sqlite3_column_int(st, 0);
    else
        rc = sq_fail(base, "read the schema version", err);
    sqlite3_finalize(st);
    return rc;
}

static md_status sq_schema_set(md_index *base, int version, md_err *err)
{
    char sql[64];
    snprintf(sql, sizeof sql, "PRAGMA user_version = %d", version);
    return sq_exec(base, sql, err);
}

static md_status sq_open(const md_index_args *args, md_index **out, md_err *err)
{
    *out = NULL;
    md_index_sqlite *ix = md_xcalloc(1, sizeof *ix);
    ix->base.ops = &md_index_sqlite_ops;
    ix->on_wait = args->on_wait;
    ix->ctx = args->ctx;
    snprintf(ix->path, sizeof ix->path, "%s/index.sqlite", args->dir);
    if (sqlite3_open_v2(ix->path, &ix->db,
                        SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX,
                        NULL) != SQLITE_OK) {
        md_err_set(err, MD_EIO, "store %s: cannot open %s: %s", args->dir, ix->path,
                   ix->db ? sqlite3_errmsg(ix->db) : "out of memory");
        sq_close(&ix->base);
        return MD_EIO;
    }
    sqlite3_busy_handler(ix->db, on_busy, ix);
    md_status st = sq_exec(&ix->base,
                           "PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL; "
                           "PRAGMA foreign_keys = ON;",
                           err);
    if (st != MD_OK) {
        sq_close(&ix->base);
        return st;
    }
    *out = &ix->base;
    return MD_OK;
}

const md_index_ops md_index_sqlite_ops = {
    .name = "sqlite",
    .migrations = migrations,
    .n_migrations = (int)(sizeof migrations / sizeof migrations[0]),
    .open = sq_open,
    .close = sq_close,
    .begin = sq_begin,
    .commit = sq_commit,
    .rollback = sq_rollback,
    .exec = sq_exec,
    .prepare = sq_prepare,
    .bind_text = sq_bind_text,
    .bind_int64 = sq_bind_int64,
    .bind_double = sq_bind_double,
    .bind_null = sq_bind_null,
    .step = sq_step,
    .reset = sq_reset,
    .finalize = sq_finalize,
    .column_type = sq_column_type,
    .column_text = sq_column_text,
    .column_int64 = sq_column_int64,
    .column_double = sq_column_double,
    .changes = sq_changes,
    .schema_get = sq_schema_get,
    .schema_set = sq_schema_set,
    .map_error = sq_fail,
    .notify_change = NULL,
    .wait_change = NULL,
};
