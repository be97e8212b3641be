/*
 * store.c - the checkpoint store: opening it (directories, the SQLite
 * index, its schema and forward-only migrations, the sweeps at open) and
 * closing it. The rest of the store is split by concern, sharing
 * store_internal.h: versions.c (model and version rows), retention.c,
 * blobs.c (blob files, uploads, garbage collection), archive.c (the
 * TorchScript zip check); the job table's queries are jobs/job_store.c.
 * The migrations of every table stay here, in one ordered list.
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
 * SQLite write transaction (BEGIN IMMEDIATE holds the database's write lock
 * across processes): an add checks "are these bytes already in blobs/?",
 * renames its temp file there and inserts its row in one transaction, and
 * garbage collection (after a delete or retention, a failed add, the orphan
 * sweep at open) re-checks "does any row reference it?" and unlinks in
 * another. So no replica can unlink a blob between another's check and its
 * commit: the row is either committed before the collector looks (the blob
 * stays) or the adder looks after the unlink (and puts its own bytes back).
 * Temp files carry their writer's pid and are swept only once it is gone.
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

/* ---- schema ---- */

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
};
#define SCHEMA_VERSION ((int)(sizeof migrations / sizeof migrations[0]))

/* Another connection (a replica, or another handle) holds the write lock:
 * wait up to BUSY_WAIT_MS for it, telling the test hook that we wait. */
#define BUSY_WAIT_MS 5000
static int on_busy(void *p, int tries)
{
    hook(p, "busy");
    if (tries >= BUSY_WAIT_MS)
        return 0;
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
    return 1;
}

static md_status migrate(md_store *s, md_err *err)
{
    sqlite3_stmt *st = prep(s, "PRAGMA user_version", err);
    if (!st)
        return MD_EIO;
    int have = sqlite3_step(st) == SQLITE_ROW ? sqlite3_column_int(st, 0) : 0;
    sqlite3_finalize(st);
    if (have > SCHEMA_VERSION)
        return md_err_set(err, MD_EIO,
                          "store %s has schema version %d, newer than this modeld's %d; run a "
                          "newer modeld or use another store directory",
                          s->dir, have, SCHEMA_VERSION);
    for (int v = have; v < SCHEMA_VERSION; v++) {
        char bump[64];
        snprintf(bump, sizeof bump, "PRAGMA user_version = %d", v + 1);
        if (txn_begin(s, err) != MD_OK)
            return MD_EIO;
        md_status rc = exec(s, migrations[v], err);
        if (rc == MD_OK)
            rc = exec(s, bump, err);
        if (txn_end(s, rc, TXN_KEEP, err) != MD_OK)
            return MD_EIO;
        md_log(MD_LOG_INFO, "store %s: schema migrated to version %d", s->dir, v + 1);
    }
    return MD_OK;
}

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
    snprintf(path, sizeof path, "%s/index.sqlite", dir);
    if (sqlite3_open_v2(path, &s->db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE |
                                          SQLITE_OPEN_FULLMUTEX, NULL) != SQLITE_OK) {
        md_err_set(err, MD_EIO, "store %s: cannot open %s: %s", dir, path,
                   s->db ? sqlite3_errmsg(s->db) : "out of memory");
        md_store_close(s);
        return MD_EIO;
    }
    sqlite3_busy_handler(s->db, on_busy, s);
    md_status st;
    if ((st = exec(s, "PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL; "
                      "PRAGMA foreign_keys = ON;",
                   err)) != MD_OK ||
        (st = migrate(s, err)) != MD_OK || (st = md_blobs_check(s, err)) != MD_OK) {
        md_store_close(s);
        return st;
    }
    md_blobs_sweep_tmp(s);
    md_blobs_sweep_orphans(s);
    *out = s;
    return MD_OK;
}

void md_store_close(md_store *s)
{
    if (!s)
        return;
    sqlite3_close(s->db);
    pthread_mutex_destroy(&s->mu);
    free(s->dir);
    free(s);
}

long long md_store_generation(md_store *s)
{
    pthread_mutex_lock(&s->mu);
    long long g = 0;
    sqlite3_stmt *st = prep(s, "SELECT CAST(value AS INTEGER) FROM meta WHERE key='generation'",
                            NULL);
    if (st && sqlite3_step(st) == SQLITE_ROW)
        g = sqlite3_column_int64(st, 0);
    sqlite3_finalize(st);
    pthread_mutex_unlock(&s->mu);
    return g;
}

const char *md_store_dir(const md_store *s) { return s->dir; }
