/*
 * store.c - the checkpoint store: SQLite index, content-addressed blobs,
 * crash-safe uploads, retention.
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
#include "checkpoint.h"
#include "formats.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <signal.h>
#include <sqlite3.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define ORPHAN_GRACE_S 600

static md_store_hook_fn test_hook;
static void *test_hook_ctx;

void md_store_set_test_hook(md_store_hook_fn fn, void *ctx)
{
    test_hook = fn;
    test_hook_ctx = ctx;
}

static void hook(md_store *s, const char *point)
{
    if (test_hook)
        test_hook(s, point, test_hook_ctx);
}

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
};
#define SCHEMA_VERSION ((int)(sizeof migrations / sizeof migrations[0]))

static void now_iso(char out[32])
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    size_t n = strftime(out, 32, "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(out + n, 32 - n, ".%03ldZ", ts.tv_nsec / 1000000L);
}

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

static md_status db_fail(md_store *s, md_err *err, const char *what)
{
    return md_err_set(err, MD_EIO, "store index %s/index.sqlite: %s: %s", s->dir, what,
                      sqlite3_errmsg(s->db));
}

static md_status exec(md_store *s, const char *sql, md_err *err)
{
    char *msg = NULL;
    if (sqlite3_exec(s->db, sql, NULL, NULL, &msg) != SQLITE_OK) {
        md_err_set(err, MD_EIO, "store index %s/index.sqlite: %s", s->dir, msg ? msg : "error");
        sqlite3_free(msg);
        return MD_EIO;
    }
    return MD_OK;
}

static sqlite3_stmt *prep(md_store *s, const char *sql, md_err *err)
{
    sqlite3_stmt *st = NULL;
    if (sqlite3_prepare_v2(s->db, sql, -1, &st, NULL) != SQLITE_OK) {
        db_fail(s, err, "prepare");
        return NULL;
    }
    return st;
}

static md_status bump_generation(md_store *s, md_err *err)
{
    return exec(s, "UPDATE meta SET value = CAST(value AS INTEGER) + 1 WHERE key = 'generation'",
                err);
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
        if (exec(s, "BEGIN IMMEDIATE", err) != MD_OK)
            return MD_EIO;
        if (exec(s, migrations[v], err) != MD_OK || exec(s, bump, err) != MD_OK) {
            exec(s, "ROLLBACK", NULL);
            return MD_EIO;
        }
        if (exec(s, "COMMIT", err) != MD_OK)
            return MD_EIO;
        md_log(MD_LOG_INFO, "store %s: schema migrated to version %d", s->dir, v + 1);
    }
    return MD_OK;
}

static void blob_path(const md_store *s, const char *sha, char *out, size_t size)
{
    snprintf(out, size, "%s/blobs/%s", s->dir, sha);
}

static int fsync_dir(const char *path)
{
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    int rc = fsync(fd);
    close(fd);
    return rc;
}

/* fsync blobs/, so a rename or unlink there survives a power loss. */
static md_status sync_blobs_dir(md_store *s, md_err *err)
{
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/blobs", s->dir);
    if (fsync_dir(dir) != 0)
        return md_err_set(err, MD_EIO, "store %s: fsync of blobs/ failed: %s; check the disk",
                          s->dir, strerror(errno));
    return MD_OK;
}

/* Temp files of processes that are gone: tmp/upload-<pid>-XXXXXX. */
static void sweep_tmp(md_store *s)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/tmp", s->dir);
    DIR *d = opendir(path);
    if (!d)
        return;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        long pid = 0;
        int owned = sscanf(e->d_name, "upload-%ld-", &pid) == 1 && pid > 0;
        if (owned && pid != (long)getpid() && (kill((pid_t)pid, 0) == 0 || errno == EPERM))
            continue; /* a live replica is still writing it */
        char full[4352];
        snprintf(full, sizeof full, "%s/%s", path, e->d_name);
        if (unlink(full) == 0)
            md_log(MD_LOG_INFO, "store: removed stale temp file %s", full);
    }
    closedir(d);
}

static int sha_referenced(md_store *s, const char *sha)
{
    sqlite3_stmt *st = prep(s,
                            "SELECT 1 FROM versions WHERE sha256 = ?1 OR arch_sha256 = ?1 "
                            "UNION ALL SELECT 1 FROM models WHERE arch_sha256 = ?1 LIMIT 1",
                            NULL);
    if (!st)
        return 1; /* when unsure, keep the file */
    sqlite3_bind_text(st, 1, sha, -1, SQLITE_STATIC);
    int rc = sqlite3_step(st);
    sqlite3_finalize(st);
    return rc != SQLITE_DONE;
}

/* Blobs no row references (a crash between rename and commit), decided and
 * unlinked inside a write transaction (see DESIGN). */
static void sweep_orphans(md_store *s)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/blobs", s->dir);
    DIR *d = opendir(path);
    if (!d)
        return;
    md_err err;
    if (exec(s, "BEGIN IMMEDIATE", &err) != MD_OK) {
        md_log(MD_LOG_WARN, "store: orphan sweep skipped: %s", err.msg);
        closedir(d);
        return;
    }
    hook(s, "sweep_locked");
    struct dirent *e;
    time_t now = time(NULL);
    while ((e = readdir(d))) {
        if (strlen(e->d_name) != 64)
            continue;
        char full[4352];
        snprintf(full, sizeof full, "%s/%s", path, e->d_name);
        struct stat sb;
        if (stat(full, &sb) != 0 || now - sb.st_mtime < ORPHAN_GRACE_S)
            continue;
        if (!sha_referenced(s, e->d_name) && unlink(full) == 0)
            md_log(MD_LOG_INFO, "store: removed unreferenced blob %s", full);
    }
    closedir(d);
    if (sync_blobs_dir(s, &err) != MD_OK)
        md_log(MD_LOG_WARN, "%s", err.msg);
    /* nothing written: ends the transaction. A failed COMMIT would leave the
     * connection inside it, holding the write lock every replica shares. */
    if (exec(s, "COMMIT", &err) != MD_OK) {
        md_log(MD_LOG_WARN, "store: orphan sweep: %s", err.msg);
        exec(s, "ROLLBACK", NULL);
    }
}

/* Rows whose blob is missing are marked failed with the reason. */
static md_status check_blobs(md_store *s, md_err *err)
{
    sqlite3_stmt *st = prep(s, "SELECT model, version, sha256 FROM versions WHERE state != "
                               "'failed' OR state_reason NOT LIKE 'checkpoint file %'", err);
    if (!st)
        return MD_EIO;
    sqlite3_stmt *up = prep(s, "UPDATE versions SET state = 'failed', state_reason = ? WHERE "
                               "model = ? AND version = ?", err);
    if (!up) {
        sqlite3_finalize(st);
        return MD_EIO;
    }
    while (sqlite3_step(st) == SQLITE_ROW) {
        const char *sha = (const char *)sqlite3_column_text(st, 2);
        char path[4096];
        blob_path(s, sha, path, sizeof path);
        if (access(path, R_OK) == 0)
            continue;
        char reason[4200];
        snprintf(reason, sizeof reason, "checkpoint file %s is missing; upload the version again",
                 path);
        sqlite3_bind_text(up, 1, reason, -1, SQLITE_TRANSIENT);
        sqlite3_bind_text(up, 2, (const char *)sqlite3_column_text(st, 0), -1, SQLITE_TRANSIENT);
        sqlite3_bind_int(up, 3, sqlite3_column_int(st, 1));
        int urc = sqlite3_step(up);
        sqlite3_reset(up);
        if (urc != SQLITE_DONE) {
            sqlite3_finalize(up);
            sqlite3_finalize(st);
            return db_fail(s, err, "mark a version with a missing blob failed");
        }
        md_log(MD_LOG_WARN, "model %s version %d: %s", sqlite3_column_text(st, 0),
               sqlite3_column_int(st, 1), reason);
    }
    sqlite3_finalize(up);
    sqlite3_finalize(st);
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
        (st = migrate(s, err)) != MD_OK || (st = check_blobs(s, err)) != MD_OK) {
        md_store_close(s);
        return st;
    }
    sweep_tmp(s);
    sweep_orphans(s);
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

/* ---- blobs ---- */

md_status md_blob_begin(md_store *s, long long max_bytes, md_blob_writer **out, md_err *err)
{
    *out = NULL;
    md_blob_writer *w = md_xcalloc(1, sizeof *w);
    w->store = s;
    w->max_bytes = max_bytes;
    snprintf(w->tmp_path, sizeof w->tmp_path, "%s/tmp/upload-%ld-XXXXXX", s->dir, (long)getpid());
    w->fd = mkostemp(w->tmp_path, O_CLOEXEC);
    if (w->fd < 0) {
        md_err_set(err, MD_EIO, "store %s: cannot create a temp file in tmp/: %s", s->dir,
                   strerror(errno));
        free(w);
        return MD_EIO;
    }
    w->sha = EVP_MD_CTX_new();
    if (!w->sha || EVP_DigestInit_ex(w->sha, EVP_sha256(), NULL) != 1) {
        md_blob_abort(w);
        return md_err_set(err, MD_EINTERNAL, "cannot start SHA-256");
    }
    *out = w;
    return MD_OK;
}

md_status md_blob_write(md_blob_writer *w, const void *data, size_t len, md_err *err)
{
    if ((long long)len > w->max_bytes - w->size)
        return md_err_setc(err, MD_ETOOBIG, "checkpoint_too_large",
                           "checkpoint is larger than the limit of %lld bytes; raise "
                           "max_checkpoint_bytes to accept it",
                           w->max_bytes);
    const char *p = data;
    size_t left = len;
    while (left) {
        ssize_t n = write(w->fd, p, left);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == ENOSPC || errno == EDQUOT)
                return md_err_set(err, MD_ENOSPC,
                                  "store %s: no space left for the checkpoint (%lld bytes "
                                  "written); free space on the store's filesystem, or delete "
                                  "old versions",
                                  w->store->dir, w->size + (long long)(len - left));
            return md_err_set(err, MD_EIO, "store %s: writing the checkpoint failed: %s",
                              w->store->dir, strerror(errno));
        }
        p += n;
        left -= (size_t)n;
    }
    EVP_DigestUpdate(w->sha, data, len);
    w->size += (long long)len;
    return MD_OK;
}

long long md_blob_size(const md_blob_writer *w) { return w->size; }

const char *md_blob_path(const md_blob_writer *w) { return w->tmp_path; }

const char *md_blob_sha256(const md_blob_writer *w) { return w->finished ? w->sha256 : ""; }

void md_store_sha_path(const md_store *s, const char *sha, char *out, size_t size)
{
    blob_path(s, sha, out, size);
}

void md_blob_abort(md_blob_writer *w)
{
    if (!w)
        return;
    if (w->fd >= 0)
        close(w->fd);
    if (w->tmp_path[0])
        unlink(w->tmp_path);
    EVP_MD_CTX_free(w->sha);
    free(w);
}

md_status md_blob_link(const md_blob_writer *w, md_blob_writer **out, md_err *err)
{
    static atomic_ulong seq;
    *out = NULL;
    md_assert(w->finished);
    md_blob_writer *c = md_xcalloc(1, sizeof *c);
    c->store = w->store;
    c->fd = -1;
    c->size = w->size;
    c->max_bytes = w->max_bytes;
    c->finished = 1;
    memcpy(c->sha256, w->sha256, sizeof c->sha256);
    /* upload-<pid>-: swept like any temp file of this process once it is gone */
    snprintf(c->tmp_path, sizeof c->tmp_path, "%s/tmp/upload-%ld-link%lu", w->store->dir,
             (long)getpid(), atomic_fetch_add(&seq, 1));
    if (link(w->tmp_path, c->tmp_path) != 0) {
        md_err_set(err, MD_EIO, "store %s: cannot link the downloaded checkpoint %s: %s",
                   w->store->dir, w->tmp_path, strerror(errno));
        free(c);
        return MD_EIO;
    }
    *out = c;
    return MD_OK;
}

static md_status blob_format_check(const char *path, md_err *err);

md_status md_blob_finish(md_blob_writer *w, const char *expect, char sha256[MD_SHA256_HEX],
                         long long *size, md_err *err)
{
    md_status st = MD_OK;
    unsigned char digest[32];
    unsigned int dlen = 0;
    if (w->size == 0) {
        st = md_err_setc(err, MD_EINVAL, "empty_checkpoint",
                         "the checkpoint is empty; send the bytes of a TorchScript file "
                         "(torch.jit.save)");
        goto fail;
    }
    if (EVP_DigestFinal_ex(w->sha, digest, &dlen) != 1 || dlen != 32) {
        st = md_err_set(err, MD_EINTERNAL, "store %s: computing the checkpoint's SHA-256 failed",
                        w->store->dir);
        goto fail;
    }
    for (unsigned i = 0; i < 32; i++)
        snprintf(w->sha256 + 2 * i, 3, "%02x", digest[i]);
    if (expect && *expect && strcasecmp(expect, w->sha256) != 0) {
        st = md_err_setc(err, MD_EINVAL, "sha256_mismatch",
                         "the checkpoint's sha256 is %s but %s was expected; check the file or the "
                         "sha256 given",
                         w->sha256, expect);
        goto fail;
    }
    if (fsync(w->fd) != 0) {
        st = md_err_set(err, MD_EIO, "store %s: fsync of the checkpoint failed: %s",
                        w->store->dir, strerror(errno));
        goto fail;
    }
    if ((st = blob_format_check(w->tmp_path, err)) != MD_OK)
        goto fail;
    close(w->fd);
    w->fd = -1;
    w->finished = 1;
    memcpy(sha256, w->sha256, MD_SHA256_HEX);
    *size = w->size;
    return MD_OK;
fail:
    md_blob_abort(w);
    return st;
}

/* ---- TorchScript archive check ---- */

static unsigned rd16(const unsigned char *p) { return (unsigned)p[0] | (unsigned)p[1] << 8; }
static unsigned long rd32(const unsigned char *p)
{
    return (unsigned long)p[0] | (unsigned long)p[1] << 8 | (unsigned long)p[2] << 16 |
           (unsigned long)p[3] << 24;
}

md_status md_archive_check(const char *path, md_err *err)
{
    static const char *fix = "send a TorchScript archive (torch.jit.save), a torch.save "
                             "state_dict or a safetensors file";
    FILE *f = fopen(path, "rb");
    if (!f)
        return md_err_set(err, MD_EIO, "cannot read %s: %s", path, strerror(errno));
    md_status st = MD_OK;
    unsigned char head[4];
    unsigned char *tail = NULL, *cd = NULL;
    if (fread(head, 1, 4, f) != 4 || memcmp(head, "PK\3\4", 4) != 0) {
        st = md_err_setc(err, MD_EUNPROC, "invalid_checkpoint",
                         "the checkpoint is not a TorchScript archive (not a zip file); %s", fix);
        goto out;
    }
    /* The end-of-central-directory record is in the last 65557 bytes. */
    fseeko(f, 0, SEEK_END);
    off_t fsize = ftello(f);
    long tail_len = fsize < 65557 ? (long)fsize : 65557;
    tail = md_xmalloc((size_t)tail_len);
    fseeko(f, fsize - tail_len, SEEK_SET);
    if (fread(tail, 1, (size_t)tail_len, f) != (size_t)tail_len) {
        st = md_err_set(err, MD_EIO, "cannot read %s", path);
        goto out;
    }
    long eocd = -1;
    for (long i = tail_len - 22; i >= 0; i--)
        if (rd32(tail + i) == 0x06054b50UL) {
            eocd = i;
            break;
        }
    if (eocd < 0) {
        st = md_err_setc(err, MD_EUNPROC, "invalid_checkpoint",
                         "the checkpoint is not a TorchScript archive (truncated zip: no central "
                         "directory); %s",
                         fix);
        goto out;
    }
    unsigned long cd_size = rd32(tail + eocd + 12), cd_off = rd32(tail + eocd + 16);
    if (cd_size == 0xffffffffUL || cd_off == 0xffffffffUL)
        goto out; /* zip64: a very large archive; the predictor's load is the real check */
    if ((off_t)(cd_off + cd_size) > fsize || cd_size > 64UL * 1024 * 1024) {
        st = md_err_setc(err, MD_EUNPROC, "invalid_checkpoint",
                         "the checkpoint is not a TorchScript archive (corrupt zip); %s", fix);
        goto out;
    }
    cd = md_xmalloc(cd_size ? cd_size : 1);
    fseeko(f, (off_t)cd_off, SEEK_SET);
    if (fread(cd, 1, cd_size, f) != cd_size) {
        st = md_err_set(err, MD_EIO, "cannot read %s", path);
        goto out;
    }
    /* Every entry sits under one top-level folder, and <folder>/data.pkl exists. */
    char top[256] = "";
    int has_data = 0, entries = 0;
    for (unsigned long p = 0; p + 46 <= cd_size;) {
        if (rd32(cd + p) != 0x02014b50UL)
            break;
        unsigned nlen = rd16(cd + p + 28), xlen = rd16(cd + p + 30), clen = rd16(cd + p + 32);
        if (p + 46 + nlen > cd_size)
            break;
        const char *name = (const char *)cd + p + 46;
        const char *slash = memchr(name, '/', nlen);
        if (!slash || (size_t)(slash - name) >= sizeof top) {
            st = md_err_setc(err, MD_EUNPROC, "invalid_checkpoint",
                             "the checkpoint is a zip but not a TorchScript archive (entry "
                             "\"%.*s\" is not inside the archive folder); %s",
                             (int)(nlen > 100 ? 100 : nlen), name, fix);
            goto out;
        }
        size_t tl = (size_t)(slash - name);
        if (!top[0]) {
            memcpy(top, name, tl);
            top[tl] = '\0';
        } else if (strlen(top) != tl || memcmp(top, name, tl) != 0) {
            st = md_err_setc(err, MD_EUNPROC, "invalid_checkpoint",
                             "the checkpoint is a zip but not a TorchScript archive (entries in "
                             "several top-level folders); %s",
                             fix);
            goto out;
        }
        if (nlen - tl - 1 == 8 && memcmp(slash + 1, "data.pkl", 8) == 0)
            has_data = 1;
        entries++;
        p += 46 + nlen + xlen + clen;
    }
    if (!has_data)
        st = md_err_setc(err, MD_EUNPROC, "invalid_checkpoint",
                         "the checkpoint is a zip but not a TorchScript archive (%d entries, no "
                         "data.pkl); %s",
                         entries, fix);
out:
    free(tail);
    free(cd);
    fclose(f);
    return st;
}

/* What a checkpoint blob may hold (issue 12): a safetensors file (its
 * reader checks it in full when it is loaded), a zip (TorchScript or
 * torch.save: md_archive_check), and not the legacy torch.save format. */
static md_status blob_format_check(const char *path, md_err *err)
{
    uint8_t head[16];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    ssize_t n = fd >= 0 ? read(fd, head, sizeof head) : -1;
    if (fd >= 0)
        close(fd);
    md_ckpt_format f = md_ckpt_sniff(head, n > 0 ? (size_t)n : 0);
    if (f == MD_CKPT_SAFETENSORS)
        return MD_OK;
    if (f == MD_CKPT_LEGACY)
        return md_err_setc(err, MD_EUNPROC, "legacy_checkpoint",
                           "the checkpoint is in the legacy (pre-1.6) torch.save format; re-save "
                           "it with torch.save(..., _use_new_zipfile_serialization=True)");
    return md_archive_check(path, err);
}

/* ---- rows ---- */

int md_model_name_ok(const char *name)
{
    size_t n = strlen(name);
    if (n < 1 || n > 64 || strcmp(name, ".") == 0 || strcmp(name, "..") == 0)
        return 0; /* "." and ".." cannot be addressed in a URL path */
    for (size_t i = 0; i < n; i++) {
        char c = name[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '_' || c == '-'))
            return 0;
    }
    return 1;
}

static json_t *json_col(sqlite3_stmt *st, int col)
{
    const char *text = (const char *)sqlite3_column_text(st, col);
    json_t *v = text ? json_loads(text, JSON_DECODE_ANY, NULL) : NULL;
    return v ? v : json_object();
}

#define VERSION_COLS                                                                          \
    "v.model, v.version, v.sha256, v.size, v.format, v.source, v.config, v.metadata, "        \
    "v.metrics, v.state, v.state_reason, v.created_at, (m.default_version = v.version), "   \
    "v.arch_sha256 "

static json_t *version_json(sqlite3_stmt *st)
{
    json_t *v = json_pack("{s:s,s:i,s:s,s:I,s:s,s:s,s:o,s:o,s:o,s:s,s:s,s:b}", "model",
                          sqlite3_column_text(st, 0), "version", sqlite3_column_int(st, 1),
                          "sha256", sqlite3_column_text(st, 2), "size",
                          (json_int_t)sqlite3_column_int64(st, 3), "format",
                          sqlite3_column_text(st, 4), "source", sqlite3_column_text(st, 5),
                          "config", json_col(st, 6), "metadata", json_col(st, 7), "metrics",
                          json_col(st, 8), "state", sqlite3_column_text(st, 9), "created_at",
                          sqlite3_column_text(st, 11), "default", sqlite3_column_int(st, 12));
    if (sqlite3_column_type(st, 10) != SQLITE_NULL)
        json_object_set_new(v, "state_reason", json_string((const char *)sqlite3_column_text(st, 10)));
    if (sqlite3_column_type(st, 13) != SQLITE_NULL)
        json_object_set_new(v, "arch_sha256",
                            json_string((const char *)sqlite3_column_text(st, 13)));
    return v;
}

static md_status get_version_locked(md_store *s, const char *name, int version, json_t **out,
                                    md_err *err)
{
    sqlite3_stmt *st = prep(s,
                            "SELECT " VERSION_COLS
                            "FROM versions v JOIN models m ON m.name = v.model "
                            "WHERE v.model = ? AND v.version = ?",
                            err);
    if (!st)
        return MD_EIO;
    sqlite3_bind_text(st, 1, name, -1, SQLITE_STATIC);
    sqlite3_bind_int(st, 2, version);
    md_status rc = MD_OK;
    if (sqlite3_step(st) == SQLITE_ROW)
        *out = version_json(st);
    else
        rc = md_err_setc(err, MD_ENOTFOUND, "version_not_found",
                         "model %s has no version %d; GET /models/%s lists its versions", name,
                         version, name);
    sqlite3_finalize(st);
    return rc;
}

static int model_exists(md_store *s, const char *name)
{
    sqlite3_stmt *st = prep(s, "SELECT 1 FROM models WHERE name = ?", NULL);
    if (!st)
        return 0;
    sqlite3_bind_text(st, 1, name, -1, SQLITE_STATIC);
    int found = sqlite3_step(st) == SQLITE_ROW;
    sqlite3_finalize(st);
    return found;
}

/* model_not_found, without the "did you mean" hint: cheap, so it may be
 * decided under the mutex and inside a write transaction. The public
 * function adds the hint (with_hint) once it holds neither. */
static md_status model_missing(const char *name, md_err *err)
{
    return md_err_setc(err, MD_ENOTFOUND, "model_not_found",
                       "model %s does not exist; GET /models lists the models", name);
}

/* When `rc` is model_not_found, add the nearest stored name when `name`
 * looks like a typo of one ("did you mean fashion?"). Call with neither the
 * mutex nor a transaction held: the names are copied under the mutex in one
 * read, the edit distances are computed after it. Returns rc. */
static md_status with_hint(md_store *s, md_status rc, const char *name, md_err *err)
{
    enum { MAX_NAMES = 4096, NAME_BYTES = 65 }; /* more names: none past them suggested */
    if (rc != MD_ENOTFOUND || !err || strcmp(md_err_code(err), "model_not_found") != 0)
        return rc;
    char(*buf)[NAME_BYTES] = malloc(sizeof *buf * MAX_NAMES);
    const char **names = malloc(sizeof *names * MAX_NAMES);
    size_t n = 0;
    if (buf && names) {
        pthread_mutex_lock(&s->mu);
        sqlite3_stmt *st = prep(s, "SELECT name FROM models ORDER BY name LIMIT 4096", NULL);
        while (st && n < MAX_NAMES && sqlite3_step(st) == SQLITE_ROW) {
            const char *v = (const char *)sqlite3_column_text(st, 0);
            if (v) {
                snprintf(buf[n], NAME_BYTES, "%s", v);
                names[n] = buf[n];
                n++;
            }
        }
        sqlite3_finalize(st);
        pthread_mutex_unlock(&s->mu);
    }
    hook(s, "hint");
    const char *near = n ? md_suggest(name, names, n) : NULL;
    if (near)
        md_err_setc(err, MD_ENOTFOUND, "model_not_found",
                    "model %s does not exist; did you mean %.64s? GET /models lists the models",
                    name, near);
    free(buf);
    free(names);
    return rc;
}

/* Unlink the blob if no row references it any more. Caller holds the mutex
 * and a write transaction, so no replica adds a row for it meanwhile. */
static void release_blob(md_store *s, const char *sha)
{
    if (sha_referenced(s, sha))
        return;
    char path[4096];
    blob_path(s, sha, path, sizeof path);
    if (unlink(path) == 0)
        md_log(MD_LOG_DEBUG, "store: removed blob %s", path);
}

/* Collect the sha256 of rows about to be deleted so their blobs can be
 * released after the commit. */
typedef struct sha_list {
    char (*items)[MD_SHA256_HEX];
    int count;
} sha_list;

static void sha_list_add(sha_list *l, const char *sha)
{
    l->items = realloc(l->items, sizeof *l->items * (size_t)(l->count + 1));
    md_assert(l->items != NULL);
    snprintf(l->items[l->count++], MD_SHA256_HEX, "%s", sha);
}

/* Garbage-collect the blobs of rows just deleted (committed), in a write
 * transaction of its own: a replica's add of the same bytes either committed
 * its row before (the blob stays) or checks for the file after (and puts it
 * back). Caller holds the mutex, not a transaction. A failure only leaves an
 * unreferenced blob, which the sweep at open removes. */
static void release_all(md_store *s, sha_list *l)
{
    md_err err;
    if (l->count && exec(s, "BEGIN IMMEDIATE", &err) == MD_OK) {
        hook(s, "gc_locked");
        for (int i = 0; i < l->count; i++)
            release_blob(s, l->items[i]);
        if (sync_blobs_dir(s, &err) != MD_OK)
            md_log(MD_LOG_WARN, "%s", err.msg);
        /* never left inside the transaction (it holds the shared write lock) */
        if (exec(s, "COMMIT", &err) != MD_OK) {
            md_log(MD_LOG_WARN, "store: blob collection: %s", err.msg);
            exec(s, "ROLLBACK", NULL);
        }
    } else if (l->count) {
        md_log(MD_LOG_WARN, "store: unreferenced blobs kept for the next sweep: %s", err.msg);
    }
    free(l->items);
    l->items = NULL;
    l->count = 0;
}

md_status md_retention_check(json_t *r, md_err *err)
{
    if (json_is_null(r))
        return MD_OK;
    if (!json_is_object(r))
        return md_err_set(err, MD_EINVAL, "retention must be an object such as {\"keep_last\": 5}");
    const char *key;
    json_t *v;
    json_object_foreach(r, key, v)
    {
        if (strcmp(key, "keep_last") == 0 || strcmp(key, "keep_best") == 0) {
            if (!json_is_integer(v) || json_integer_value(v) < 1)
                return md_err_set(err, MD_EINVAL, "retention.%s must be an integer >= 1", key);
        } else if (strcmp(key, "metric") == 0) {
            const char *m = json_string_value(v);
            if (!m || strncmp(m, "metrics.", 8) != 0 || !md_model_name_ok(m + 8))
                return md_err_set(err, MD_EINVAL,
                                  "retention.metric must name a metric as \"metrics.KEY\", e.g. "
                                  "\"metrics.loss\"");
        } else if (strcmp(key, "order") == 0) {
            const char *o = json_string_value(v);
            if (!o || (strcmp(o, "asc") != 0 && strcmp(o, "desc") != 0))
                return md_err_set(err, MD_EINVAL,
                                  "retention.order must be \"asc\" (lower is better, e.g. loss) "
                                  "or \"desc\"");
        } else {
            return md_err_set(err, MD_EINVAL,
                              "retention has an unknown key \"%s\"; allowed: keep_last, keep_best, "
                              "metric, order",
                              key);
        }
    }
    if (json_object_get(r, "keep_best") && !json_object_get(r, "metric"))
        return md_err_set(err, MD_EINVAL,
                          "retention.keep_best needs a metric, e.g. \"metric\": \"metrics.loss\"");
    return MD_OK;
}

/* Apply the model's retention policy inside the open transaction: keep the
 * default, the newest keep_last and the best keep_best; delete the rest. */
static md_status apply_retention(md_store *s, const char *name, sha_list *released, md_err *err)
{
    sqlite3_stmt *st = prep(s, "SELECT settings, default_version FROM models WHERE name = ?", err);
    if (!st)
        return MD_EIO;
    sqlite3_bind_text(st, 1, name, -1, SQLITE_STATIC);
    json_t *settings = NULL;
    int def = 0;
    if (sqlite3_step(st) == SQLITE_ROW) {
        settings = json_col(st, 0);
        def = sqlite3_column_int(st, 1);
    }
    sqlite3_finalize(st);
    json_t *r = settings ? json_object_get(settings, "retention") : NULL;
    if (!json_is_object(r)) {
        json_decref(settings);
        return MD_OK;
    }
    json_int_t keep_last = json_integer_value(json_object_get(r, "keep_last"));
    json_int_t keep_best = json_integer_value(json_object_get(r, "keep_best"));
    const char *metric = json_string_value(json_object_get(r, "metric"));
    const char *order = json_string_value(json_object_get(r, "order"));
    int asc = !order || strcmp(order, "asc") == 0;
    char path[80] = "$.";
    if (metric)
        snprintf(path, sizeof path, "$.%s", metric + 8);

    /* keep = newest keep_last UNION best keep_best UNION default */
    char sql[1024];
    snprintf(sql, sizeof sql,
             "SELECT version, sha256 FROM versions WHERE model = ?1 AND version != ?2 "
             "AND state != 'loading' "
             "AND (?3 = 0 OR version NOT IN (SELECT version FROM versions WHERE model = ?1 "
             "     ORDER BY version DESC LIMIT ?3)) "
             "AND (?4 = 0 OR version NOT IN (SELECT version FROM versions WHERE model = ?1 "
             "     AND json_extract(metrics, ?5) IS NOT NULL "
             "     ORDER BY json_extract(metrics, ?5) %s, version DESC LIMIT ?4)) "
             "AND (?3 != 0 OR ?4 != 0)",
             asc ? "ASC" : "DESC");
    st = prep(s, sql, err);
    if (!st) {
        json_decref(settings);
        return MD_EIO;
    }
    sqlite3_bind_text(st, 1, name, -1, SQLITE_STATIC);
    sqlite3_bind_int(st, 2, def);
    sqlite3_bind_int64(st, 3, keep_last);
    sqlite3_bind_int64(st, 4, keep_best);
    sqlite3_bind_text(st, 5, path, -1, SQLITE_STATIC);
    int victims[4096], n = 0;
    while (sqlite3_step(st) == SQLITE_ROW && n < 4096) {
        victims[n++] = sqlite3_column_int(st, 0);
        sha_list_add(released, (const char *)sqlite3_column_text(st, 1));
    }
    sqlite3_finalize(st);
    json_decref(settings);
    st = prep(s, "DELETE FROM versions WHERE model = ? AND version = ?", err);
    if (!st)
        return MD_EIO;
    for (int i = 0; i < n; i++) {
        sqlite3_bind_text(st, 1, name, -1, SQLITE_STATIC);
        sqlite3_bind_int(st, 2, victims[i]);
        if (sqlite3_step(st) != SQLITE_DONE) {
            sqlite3_finalize(st);
            return db_fail(s, err, "retention delete");
        }
        sqlite3_reset(st);
        md_log(MD_LOG_INFO, "model %s: retention removed version %d", name, victims[i]);
    }
    sqlite3_finalize(st);
    return MD_OK;
}

static md_status json_text(json_t *v, char **out)
{
    *out = v ? json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY) : md_xstrdup("{}");
    md_assert(*out != NULL);
    return MD_OK;
}

/* ---- training checkpoints (issue 12): architecture, promotion, recorded metrics ----
 *
 * A model's architecture is a blob like any checkpoint (models.arch_sha256);
 * each state_dict version records the architecture it was loaded into
 * (versions.arch_sha256), so replacing the architecture leaves existing
 * versions loading as they were. A blob is referenced by either column, so
 * garbage collection and the orphan sweep keep it while any row names it.
 * The promotion policy lives in models.settings next to retention.
 */

md_status md_promote_check(json_t *p, md_err *err)
{
    if (json_is_null(p))
        return MD_OK;
    static const char *example = "{\"metric\": \"val_accuracy\", \"order\": \"desc\"}";
    if (!json_is_object(p))
        return md_err_setc(err, MD_EINVAL, "invalid_promote",
                           "promote must be an object such as %s, or null to clear it", example);
    const char *k;
    json_t *v;
    json_object_foreach(p, k, v)
    {
        if (strcmp(k, "metric") != 0 && strcmp(k, "order") != 0)
            return md_err_setc(err, MD_EINVAL, "invalid_promote",
                               "promote.%.40s is unknown; promote takes metric and order, e.g. %s",
                               k, example);
    }
    json_t *m = json_object_get(p, "metric"), *o = json_object_get(p, "order");
    if (!json_is_string(m) || !json_string_length(m) || json_string_length(m) > 128)
        return md_err_setc(err, MD_EINVAL, "invalid_promote",
                           "promote.metric must name a metric (1 to 128 bytes), e.g. %s", example);
    if (o && (!json_is_string(o) || (strcmp(json_string_value(o), "asc") != 0 &&
                                     strcmp(json_string_value(o), "desc") != 0)))
        return md_err_setc(err, MD_EINVAL, "invalid_promote",
                           "promote.order must be \"desc\" (higher is better, the default) or "
                           "\"asc\" (lower is better)");
    return MD_OK;
}

/* Within add_version's transaction: whether the new version (spec) becomes
 * the default under the model's promotion policy, and why (`reason`, "" when
 * the model has none: then spec->make_default decides). */
static md_status promotion_decide(md_store *s, const md_version_spec *spec, int *make_default,
                                  char *reason, size_t size, md_err *err)
{
    sqlite3_stmt *st = prep(s, "SELECT settings, default_version FROM models WHERE name = ?", err);
    if (!st)
        return MD_EIO;
    sqlite3_bind_text(st, 1, spec->model, -1, SQLITE_STATIC);
    json_t *settings = NULL;
    int dv = 0;
    if (sqlite3_step(st) == SQLITE_ROW) {
        settings = json_col(st, 0);
        dv = sqlite3_column_type(st, 1) == SQLITE_NULL ? 0 : sqlite3_column_int(st, 1);
    }
    sqlite3_finalize(st);
    json_t *p = json_object_get(settings, "promote");
    if (!json_is_object(p)) {
        json_decref(settings);
        return MD_OK;
    }
    const char *metric = json_string_value(json_object_get(p, "metric"));
    const char *order = json_string_value(json_object_get(p, "order"));
    int desc = !order || strcmp(order, "desc") == 0;
    json_t *mine = json_object_get(spec->metrics, metric);
    json_t *cur_metrics = NULL;
    if (dv > 0 && (st = prep(s, "SELECT metrics FROM versions WHERE model = ? AND version = ?",
                             err)) != NULL) {
        sqlite3_bind_text(st, 1, spec->model, -1, SQLITE_STATIC);
        sqlite3_bind_int(st, 2, dv);
        if (sqlite3_step(st) == SQLITE_ROW)
            cur_metrics = json_col(st, 0);
        sqlite3_finalize(st);
    }
    json_t *theirs = json_object_get(cur_metrics, metric);
    if (dv <= 0) {
        *make_default = 1;
        snprintf(reason, size, "the model had no default version");
    } else if (!json_is_number(mine)) {
        *make_default = 0;
        snprintf(reason, size,
                 json_is_number(theirs)
                     ? "the upload has no metrics.%.128s and default version %d has it"
                     : "the upload has no metrics.%.128s (neither has default version %d)",
                 metric, dv);
    } else if (!json_is_number(theirs)) {
        *make_default = 1;
        snprintf(reason, size, "default version %d had no metrics.%.128s", dv, metric);
    } else {
        double a = json_number_value(mine), b = json_number_value(theirs);
        int better = desc ? a > b : a < b;
        *make_default = better;
        snprintf(reason, size, "metrics.%.128s %.15g %s %.15g of default version %d (%s is better)",
                 metric, a, better ? (desc ? ">" : "<") : "does not beat", b, dv,
                 desc ? "higher" : "lower");
    }
    json_decref(cur_metrics);
    json_decref(settings);
    return MD_OK;
}

md_status md_store_set_promote(md_store *s, const char *name, json_t *policy, md_err *err)
{
    md_status rc = md_promote_check(policy, err);
    if (rc != MD_OK)
        return rc;
    pthread_mutex_lock(&s->mu);
    if ((rc = exec(s, "BEGIN IMMEDIATE", err)) != MD_OK)
        goto out;
    if (!model_exists(s, name)) {
        rc = model_missing(name, err);
        exec(s, "ROLLBACK", NULL);
        goto out;
    }
    char *text = json_dumps(policy, JSON_COMPACT | JSON_ENCODE_ANY);
    sqlite3_stmt *st = prep(s,
                            json_is_null(policy)
                                ? "UPDATE models SET settings = json_remove(settings, "
                                  "'$.promote') WHERE name = ?2 AND ?1 IS NOT NULL"
                                : "UPDATE models SET settings = json_set(settings, '$.promote', "
                                  "json(?1)) WHERE name = ?2",
                            err);
    if (st) {
        sqlite3_bind_text(st, 1, text, -1, SQLITE_TRANSIENT);
        sqlite3_bind_text(st, 2, name, -1, SQLITE_STATIC);
        if (sqlite3_step(st) != SQLITE_DONE)
            rc = db_fail(s, err, "set the promotion policy");
        sqlite3_finalize(st);
    } else {
        rc = MD_EIO;
    }
    free(text);
    if (rc == MD_OK)
        rc = bump_generation(s, err);
    if (rc == MD_OK)
        rc = exec(s, "COMMIT", err);
    if (rc != MD_OK)
        exec(s, "ROLLBACK", NULL);
out:
    pthread_mutex_unlock(&s->mu);
    return with_hint(s, rc, name, err);
}

md_status md_store_set_architecture(md_store *s, const char *name, md_blob_writer *blob,
                                    md_err *err)
{
    char path[4096];
    char sha[MD_SHA256_HEX];
    md_assert(blob && blob->finished);
    snprintf(sha, sizeof sha, "%s", blob->sha256);
    blob_path(s, sha, path, sizeof path);
    sha_list released = {0};
    int moved = 0;
    md_status rc;
    pthread_mutex_lock(&s->mu);
    if ((rc = exec(s, "BEGIN IMMEDIATE", err)) != MD_OK)
        goto unlock;
    struct stat sb;
    if (stat(path, &sb) == 0) {
        unlink(blob->tmp_path); /* the same bytes are already stored */
    } else if (rename(blob->tmp_path, path) != 0) {
        rc = md_err_set(err, MD_EIO, "store %s: cannot move the architecture into blobs/: %s",
                        s->dir, strerror(errno));
        goto rollback;
    } else {
        moved = 1;
    }
    blob->tmp_path[0] = '\0';
    if ((rc = sync_blobs_dir(s, err)) != MD_OK)
        goto rollback;
    char now[32];
    now_iso(now);
    sqlite3_stmt *st = prep(s, "SELECT arch_sha256 FROM models WHERE name = ?", err);
    if (!st) {
        rc = MD_EIO;
        goto rollback;
    }
    sqlite3_bind_text(st, 1, name, -1, SQLITE_STATIC);
    if (sqlite3_step(st) == SQLITE_ROW && sqlite3_column_type(st, 0) != SQLITE_NULL &&
        strcmp((const char *)sqlite3_column_text(st, 0), sha) != 0)
        sha_list_add(&released, (const char *)sqlite3_column_text(st, 0));
    sqlite3_finalize(st);
    st = prep(s,
              "INSERT INTO models (name, created_at, updated_at, arch_sha256) VALUES (?1, ?2, ?2, "
              "?3) ON CONFLICT(name) DO UPDATE SET updated_at = ?2, arch_sha256 = ?3",
              err);
    if (!st) {
        rc = MD_EIO;
        goto rollback;
    }
    sqlite3_bind_text(st, 1, name, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 2, now, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 3, sha, -1, SQLITE_STATIC);
    int ok = sqlite3_step(st) == SQLITE_DONE;
    sqlite3_finalize(st);
    if (!ok) {
        rc = db_fail(s, err, "set the architecture");
        goto rollback;
    }
    if ((rc = bump_generation(s, err)) != MD_OK || (rc = exec(s, "COMMIT", err)) != MD_OK)
        goto rollback;
    release_all(s, &released); /* the old architecture, unless a version still uses it */
    goto unlock;
rollback:
    exec(s, "ROLLBACK", NULL);
    free(released.items);
    released.items = NULL;
    released.count = 0;
    if (moved) {
        sha_list_add(&released, sha);
        release_all(s, &released);
    }
unlock:
    pthread_mutex_unlock(&s->mu);
    md_blob_abort(blob);
    return rc;
}

md_status md_store_architecture(md_store *s, const char *name, char sha256[MD_SHA256_HEX],
                                md_err *err)
{
    sha256[0] = '\0';
    pthread_mutex_lock(&s->mu);
    md_status rc = MD_OK;
    sqlite3_stmt *st = prep(s, "SELECT arch_sha256 FROM models WHERE name = ?", err);
    if (!st) {
        rc = MD_EIO;
        goto out;
    }
    sqlite3_bind_text(st, 1, name, -1, SQLITE_STATIC);
    int step = sqlite3_step(st);
    if (step != SQLITE_ROW)
        rc = model_missing(name, err);
    else if (sqlite3_column_type(st, 0) == SQLITE_NULL)
        rc = md_err_setc(err, MD_ENOTFOUND, "no_architecture",
                         "model %s has no architecture; PUT /models/%s/architecture with the "
                         "network as TorchScript (torch.jit.script(model).save(\"arch.pt\"))",
                         name, name);
    else
        snprintf(sha256, MD_SHA256_HEX, "%s", (const char *)sqlite3_column_text(st, 0));
    sqlite3_finalize(st);
out:
    pthread_mutex_unlock(&s->mu);
    return rc == MD_ENOTFOUND && strcmp(md_err_code(err), "model_not_found") == 0
               ? with_hint(s, rc, name, err)
               : rc;
}

md_status md_store_record_metric(md_store *s, const char *name, int version, const char *metric,
                                 double value, md_err *err)
{
    pthread_mutex_lock(&s->mu);
    md_status rc = exec(s, "BEGIN IMMEDIATE", err);
    if (rc != MD_OK)
        goto out;
    char path[300];
    json_t *key = json_string(metric);
    char *quoted = json_dumps(key, JSON_ENCODE_ANY);
    json_decref(key);
    snprintf(path, sizeof path, "$.%s", quoted ? quoted : "\"\"");
    free(quoted);
    sqlite3_stmt *st = prep(s,
                            "UPDATE versions SET metrics = json_set(metrics, ?1, ?2) WHERE model = "
                            "?3 AND version = ?4",
                            err);
    if (!st) {
        rc = MD_EIO;
    } else {
        sqlite3_bind_text(st, 1, path, -1, SQLITE_TRANSIENT);
        sqlite3_bind_double(st, 2, value);
        sqlite3_bind_text(st, 3, name, -1, SQLITE_STATIC);
        sqlite3_bind_int(st, 4, version);
        if (sqlite3_step(st) != SQLITE_DONE)
            rc = db_fail(s, err, "record a metric");
        else if (sqlite3_changes(s->db) == 0)
            rc = md_err_setc(err, MD_ENOTFOUND, "version_not_found",
                             "model %s has no version %d", name, version);
        sqlite3_finalize(st);
    }
    if (rc == MD_OK)
        rc = bump_generation(s, err);
    if (rc == MD_OK)
        rc = exec(s, "COMMIT", err);
    if (rc != MD_OK)
        exec(s, "ROLLBACK", NULL);
out:
    pthread_mutex_unlock(&s->mu);
    return rc;
}

md_status md_store_add_version(md_store *s, const md_version_spec *spec, md_blob_writer *blob,
                               json_t **out, md_err *err)
{
    if (out)
        *out = NULL;
    char path[4096];
    char sha[MD_SHA256_HEX];
    snprintf(sha, sizeof sha, "%s", blob ? blob->sha256 : spec->sha256);
    blob_path(s, sha, path, sizeof path);
    md_status rc = MD_OK;
    sha_list released = {0};
    char *config = NULL, *metadata = NULL, *metrics = NULL;
    int moved = 0; /* this add put the file in blobs/ (undone on failure) */
    json_text(spec->config, &config);
    json_text(spec->metadata, &metadata);
    json_text(spec->metrics, &metrics);

    pthread_mutex_lock(&s->mu);
    /* One write transaction: the blob's file (see DESIGN), model row, version
     * row, default, retention, generation. */
    if ((rc = exec(s, "BEGIN IMMEDIATE", err)) != MD_OK)
        goto unlock;
    if (blob) {
        md_assert(blob->finished);
        struct stat sb;
        if (stat(path, &sb) == 0) {
            unlink(blob->tmp_path); /* the same bytes are already stored */
        } else if (rename(blob->tmp_path, path) != 0) {
            rc = md_err_set(err, MD_EIO, "store %s: cannot move the checkpoint into blobs/: %s",
                            s->dir, strerror(errno));
            goto rollback;
        } else {
            moved = 1;
        }
        blob->tmp_path[0] = '\0';
        if ((rc = sync_blobs_dir(s, err)) != MD_OK)
            goto rollback;
    } else if (access(path, R_OK) != 0) {
        rc = md_err_set(err, MD_EIO, "store %s: checkpoint %s is no longer stored; retry", s->dir,
                        sha);
        goto rollback;
    }
    hook(s, "add_blob_decided");
    char now[32];
    now_iso(now);
    sqlite3_stmt *st = prep(s,
                            "INSERT INTO models (name, created_at, updated_at) VALUES (?1, ?2, ?2) "
                            "ON CONFLICT(name) DO UPDATE SET updated_at = ?2",
                            err);
    if (!st) {
        rc = MD_EIO;
        goto rollback;
    }
    sqlite3_bind_text(st, 1, spec->model, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 2, now, -1, SQLITE_STATIC);
    int ok = sqlite3_step(st) == SQLITE_DONE;
    sqlite3_finalize(st);
    if (!ok) {
        rc = db_fail(s, err, "insert model");
        goto rollback;
    }
    int version = spec->version;
    if (version == 0) {
        st = prep(s,
                  "SELECT MAX(last_version, (SELECT COALESCE(MAX(version), 0) FROM versions "
                  "WHERE model = ?1)) + 1 FROM models WHERE name = ?1",
                  err);
        if (!st) {
            rc = MD_EIO;
            goto rollback;
        }
        sqlite3_bind_text(st, 1, spec->model, -1, SQLITE_STATIC);
        version = sqlite3_step(st) == SQLITE_ROW ? sqlite3_column_int(st, 0) : 1;
        sqlite3_finalize(st);
    }
    st = prep(s,
              "INSERT INTO versions (model, version, sha256, size, source, config, metadata, "
              "metrics, state, created_at, format, arch_sha256) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
              err);
    if (!st) {
        rc = MD_EIO;
        goto rollback;
    }
    sqlite3_bind_text(st, 1, spec->model, -1, SQLITE_STATIC);
    sqlite3_bind_int(st, 2, version);
    sqlite3_bind_text(st, 3, sha, -1, SQLITE_STATIC);
    sqlite3_bind_int64(st, 4, blob ? blob->size : spec->size);
    sqlite3_bind_text(st, 5, spec->source ? spec->source : "upload", -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 6, config, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 7, metadata, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 8, metrics, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 9, spec->state ? spec->state : "stored", -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 10, now, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 11, spec->format ? spec->format : "torchscript", -1, SQLITE_STATIC);
    if (spec->arch_sha256 && spec->arch_sha256[0])
        sqlite3_bind_text(st, 12, spec->arch_sha256, -1, SQLITE_STATIC);
    else
        sqlite3_bind_null(st, 12);
    int step = sqlite3_step(st);
    sqlite3_finalize(st);
    if (step == SQLITE_CONSTRAINT) {
        rc = md_err_setc(err, MD_ECONFLICT, "version_exists",
                         "model %s already has version %d; choose another number or omit it",
                         spec->model, version);
        goto rollback;
    }
    if (step != SQLITE_DONE) {
        rc = db_fail(s, err, "insert version");
        goto rollback;
    }
    st = prep(s, "UPDATE models SET last_version = MAX(last_version, ?2) WHERE name = ?1", err);
    if (!st) {
        rc = MD_EIO;
        goto rollback;
    }
    sqlite3_bind_text(st, 1, spec->model, -1, SQLITE_STATIC);
    sqlite3_bind_int(st, 2, version);
    ok = sqlite3_step(st) == SQLITE_DONE;
    sqlite3_finalize(st);
    if (!ok) {
        rc = db_fail(s, err, "record the version number");
        goto rollback;
    }
    /* The first version of a model is its default whatever make_default says;
     * a promotion policy (issue 12) may decide instead. */
    char promotion[320] = "";
    int make_default = spec->make_default;
    if (spec->promote && (rc = promotion_decide(s, spec, &make_default, promotion,
                                                sizeof promotion, err)) != MD_OK)
        goto rollback;
    st = prep(s,
              "UPDATE models SET default_version = ?2 WHERE name = ?1 AND (?3 OR default_version "
              "IS NULL)",
              err);
    if (!st) {
        rc = MD_EIO;
        goto rollback;
    }
    sqlite3_bind_text(st, 1, spec->model, -1, SQLITE_STATIC);
    sqlite3_bind_int(st, 2, version);
    sqlite3_bind_int(st, 3, make_default);
    ok = sqlite3_step(st) == SQLITE_DONE;
    sqlite3_finalize(st);
    if (!ok) {
        rc = db_fail(s, err, "set default");
        goto rollback;
    }
    /* the answer describes the new row even if retention removes it at once */
    json_t *added = NULL;
    get_version_locked(s, spec->model, version, &added, NULL);
    if (added && promotion[0])
        json_object_set_new(added, "promotion",
                            json_pack("{s:b,s:s}", "promoted",
                                      json_is_true(json_object_get(added, "default")), "reason",
                                      promotion));
    if ((rc = apply_retention(s, spec->model, &released, err)) != MD_OK ||
        (rc = bump_generation(s, err)) != MD_OK) {
        json_decref(added);
        goto rollback;
    }
    if ((rc = exec(s, "COMMIT", err)) != MD_OK) {
        json_decref(added);
        goto rollback;
    }
    release_all(s, &released);
    json_t *still = NULL;
    if (get_version_locked(s, spec->model, version, &still, NULL) != MD_OK && added)
        json_object_set_new(added, "removed_by_retention", json_true());
    json_decref(still);
    if (out)
        *out = added;
    else
        json_decref(added);
    goto unlock;
rollback:
    exec(s, "ROLLBACK", NULL);
    free(released.items);
    released.items = NULL;
    released.count = 0;
    if (moved) {
        /* the upload's bytes, unless another row (maybe a replica's) uses them */
        sha_list_add(&released, sha);
        release_all(s, &released);
    }
unlock:
    pthread_mutex_unlock(&s->mu);
    md_blob_abort(blob);
    free(config);
    free(metadata);
    free(metrics);
    return rc;
}

md_status md_store_list_models(md_store *s, const char *after, int limit, json_t **out,
                               md_err *err)
{
    pthread_mutex_lock(&s->mu);
    md_status rc = MD_OK;
    sqlite3_stmt *st = prep(s,
                            "SELECT m.name, m.default_version, m.created_at, m.updated_at, "
                            "(SELECT COUNT(*) FROM versions v WHERE v.model = m.name), "
                            "(SELECT state FROM versions v WHERE v.model = m.name AND v.version = "
                            "m.default_version) "
                            "FROM models m WHERE m.name > ? ORDER BY m.name LIMIT ?",
                            err);
    if (!st) {
        rc = MD_EIO;
        goto out;
    }
    sqlite3_bind_text(st, 1, after ? after : "", -1, SQLITE_STATIC);
    sqlite3_bind_int(st, 2, limit + 1);
    json_t *models = json_array();
    json_t *next = json_null();
    int n = 0;
    while (sqlite3_step(st) == SQLITE_ROW) {
        if (n++ == limit) {
            json_decref(next);
            json_t *last = json_array_get(models, json_array_size(models) - 1);
            next = json_incref(json_object_get(last, "name"));
            break;
        }
        json_t *m = json_pack("{s:s,s:o,s:s,s:s,s:i}", "name", sqlite3_column_text(st, 0),
                              "default_version",
                              sqlite3_column_type(st, 1) == SQLITE_NULL
                                  ? json_null()
                                  : json_integer(sqlite3_column_int(st, 1)),
                              "created_at", sqlite3_column_text(st, 2), "updated_at",
                              sqlite3_column_text(st, 3), "versions", sqlite3_column_int(st, 4));
        if (sqlite3_column_type(st, 5) != SQLITE_NULL)
            json_object_set_new(m, "state", json_string((const char *)sqlite3_column_text(st, 5)));
        json_array_append_new(models, m);
    }
    sqlite3_finalize(st);
    *out = json_pack("{s:o,s:o}", "models", models, "next", next);
out:
    pthread_mutex_unlock(&s->mu);
    return rc;
}

static md_status list_versions_locked(md_store *s, const char *name, const char *order_by,
                                      int asc, json_t **out, md_err *err)
{
    char path[80] = "";
    const char *order_expr;
    if (!order_by || strcmp(order_by, "version") == 0)
        order_expr = "v.version";
    else if (strcmp(order_by, "created_at") == 0)
        order_expr = "v.created_at";
    else if (strncmp(order_by, "metrics.", 8) == 0 && md_model_name_ok(order_by + 8)) {
        snprintf(path, sizeof path, "$.%s", order_by + 8);
        order_expr = "json_extract(v.metrics, ?2)";
    } else
        return md_err_setc(err, MD_EINVAL, "invalid_order_by",
                           "order_by=%s is not supported; use version, created_at or "
                           "metrics.KEY (e.g. metrics.loss)",
                           order_by);
    char sql[600];
    snprintf(sql, sizeof sql,
             "SELECT " VERSION_COLS "FROM versions v JOIN models m ON m.name = v.model "
             "WHERE v.model = ?1 ORDER BY %s IS NULL, %s %s, v.version %s",
             order_expr, order_expr, asc ? "ASC" : "DESC", asc ? "ASC" : "DESC");
    sqlite3_stmt *st = prep(s, sql, err);
    if (!st)
        return MD_EIO;
    sqlite3_bind_text(st, 1, name, -1, SQLITE_STATIC);
    if (path[0])
        sqlite3_bind_text(st, 2, path, -1, SQLITE_STATIC);
    json_t *a = json_array();
    while (sqlite3_step(st) == SQLITE_ROW)
        json_array_append_new(a, version_json(st));
    sqlite3_finalize(st);
    *out = a;
    return MD_OK;
}

md_status md_store_get_model(md_store *s, const char *name, json_t **out, md_err *err)
{
    pthread_mutex_lock(&s->mu);
    md_status rc = MD_OK;
    sqlite3_stmt *st = prep(s,
                            "SELECT name, default_version, settings, created_at, updated_at, "
                            "arch_sha256 FROM models WHERE name = ?",
                            err);
    if (!st) {
        rc = MD_EIO;
        goto out;
    }
    sqlite3_bind_text(st, 1, name, -1, SQLITE_STATIC);
    if (sqlite3_step(st) != SQLITE_ROW) {
        sqlite3_finalize(st);
        rc = model_missing(name, err);
        goto out;
    }
    json_t *settings = json_col(st, 2);
    json_t *m = json_pack("{s:s,s:o,s:O,s:s,s:s}", "name", sqlite3_column_text(st, 0),
                          "default_version",
                          sqlite3_column_type(st, 1) == SQLITE_NULL
                              ? json_null()
                              : json_integer(sqlite3_column_int(st, 1)),
                          "retention",
                          json_object_get(settings, "retention") ? json_object_get(settings,
                                                                                   "retention")
                                                                 : json_null(),
                          "created_at", sqlite3_column_text(st, 3), "updated_at",
                          sqlite3_column_text(st, 4));
    json_object_set_new(m, "architecture",
                        sqlite3_column_type(st, 5) == SQLITE_NULL
                            ? json_null()
                            : json_pack("{s:s}", "sha256", sqlite3_column_text(st, 5)));
    json_object_set(m, "promote",
                    json_object_get(settings, "promote") ? json_object_get(settings, "promote")
                                                         : json_null());
    json_decref(settings);
    sqlite3_finalize(st);
    json_t *versions = NULL;
    if ((rc = list_versions_locked(s, name, "version", 1, &versions, err)) != MD_OK) {
        json_decref(m);
        goto out;
    }
    json_object_set_new(m, "versions", versions);
    *out = m;
out:
    pthread_mutex_unlock(&s->mu);
    return with_hint(s, rc, name, err);
}

md_status md_store_get_version(md_store *s, const char *name, int version, json_t **out,
                               md_err *err)
{
    pthread_mutex_lock(&s->mu);
    md_status rc = model_exists(s, name) ? get_version_locked(s, name, version, out, err)
                                         : model_missing(name, err);
    pthread_mutex_unlock(&s->mu);
    return with_hint(s, rc, name, err);
}

md_status md_store_list_versions(md_store *s, const char *name, const char *order_by, int asc,
                                 json_t **out, md_err *err)
{
    pthread_mutex_lock(&s->mu);
    md_status rc = model_exists(s, name) ? list_versions_locked(s, name, order_by, asc, out, err)
                                         : model_missing(name, err);
    pthread_mutex_unlock(&s->mu);
    return with_hint(s, rc, name, err);
}

md_status md_store_set_default(md_store *s, const char *name, int version, md_err *err)
{
    pthread_mutex_lock(&s->mu);
    md_status rc = MD_OK;
    json_t *v = NULL;
    /* one transaction: the check of the version's state, the move and the
     * generation bump commit together or not at all (a replica cannot delete
     * or fail the version in between, nor see a move without its bump) */
    if ((rc = exec(s, "BEGIN IMMEDIATE", err)) != MD_OK)
        goto unlock;
    if (!model_exists(s, name)) {
        rc = model_missing(name, err);
        goto out;
    }
    if ((rc = get_version_locked(s, name, version, &v, err)) != MD_OK)
        goto out;
    const char *state = json_string_value(json_object_get(v, "state"));
    if (strcmp(state, "failed") == 0) {
        rc = md_err_setc(err, MD_ECONFLICT, "version_failed",
                         "model %s version %d failed (%s) and cannot be the default", name, version,
                         json_string_value(json_object_get(v, "state_reason")));
        goto out;
    }
    hook(s, "set_default_checked");
    sqlite3_stmt *st = prep(s, "UPDATE models SET default_version = ?, updated_at = ? WHERE name = ?",
                            err);
    if (!st) {
        rc = MD_EIO;
        goto out;
    }
    char now[32];
    now_iso(now);
    sqlite3_bind_int(st, 1, version);
    sqlite3_bind_text(st, 2, now, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 3, name, -1, SQLITE_STATIC);
    if (sqlite3_step(st) != SQLITE_DONE)
        rc = db_fail(s, err, "set default");
    sqlite3_finalize(st);
    if (rc == MD_OK)
        rc = bump_generation(s, err);
    if (rc == MD_OK)
        rc = exec(s, "COMMIT", err);
out:
    if (rc != MD_OK)
        exec(s, "ROLLBACK", NULL);
unlock:
    json_decref(v);
    pthread_mutex_unlock(&s->mu);
    return with_hint(s, rc, name, err); /* after the ROLLBACK: see with_hint */
}

md_status md_store_set_retention(md_store *s, const char *name, json_t *retention, md_err *err)
{
    md_status rc = md_retention_check(retention, err);
    if (rc != MD_OK)
        return rc;
    sha_list released = {0};
    pthread_mutex_lock(&s->mu);
    if ((rc = exec(s, "BEGIN IMMEDIATE", err)) != MD_OK)
        goto out;
    /* inside the transaction: a replica cannot delete the model in between */
    if (!model_exists(s, name)) {
        rc = model_missing(name, err);
        exec(s, "ROLLBACK", NULL);
        goto out;
    }
    char *text = json_dumps(retention, JSON_COMPACT | JSON_ENCODE_ANY);
    sqlite3_stmt *st = prep(s,
                            "UPDATE models SET settings = json_set(settings, '$.retention', "
                            "json(?)) WHERE name = ?",
                            err);
    if (st) {
        sqlite3_bind_text(st, 1, text, -1, SQLITE_TRANSIENT);
        sqlite3_bind_text(st, 2, name, -1, SQLITE_STATIC);
        if (sqlite3_step(st) != SQLITE_DONE)
            rc = db_fail(s, err, "set retention");
        sqlite3_finalize(st);
    } else {
        rc = MD_EIO;
    }
    free(text);
    if (rc == MD_OK)
        rc = apply_retention(s, name, &released, err);
    if (rc == MD_OK)
        rc = bump_generation(s, err);
    if (rc == MD_OK)
        rc = exec(s, "COMMIT", err);
    if (rc != MD_OK) {
        exec(s, "ROLLBACK", NULL);
        free(released.items);
        released.items = NULL;
        released.count = 0;
    }
    release_all(s, &released);
out:
    pthread_mutex_unlock(&s->mu);
    return with_hint(s, rc, name, err);
}

md_status md_store_delete_version(md_store *s, const char *name, int version, int force,
                                  md_err *err)
{
    pthread_mutex_lock(&s->mu);
    md_status rc = MD_OK;
    json_t *v = NULL;
    sha_list released = {0};
    /* read whether it is the default inside the write transaction: a
     * replica's set_default cannot move it between the read and the delete */
    if ((rc = exec(s, "BEGIN IMMEDIATE", err)) != MD_OK)
        goto out;
    if (!model_exists(s, name)) {
        rc = model_missing(name, err);
        goto rollback;
    }
    if ((rc = get_version_locked(s, name, version, &v, err)) != MD_OK)
        goto rollback;
    int is_default = json_is_true(json_object_get(v, "default"));
    sqlite3_stmt *st;
    if (is_default) {
        st = prep(s, "SELECT MAX(version) FROM versions WHERE model = ? AND version != ? AND "
                     "state != 'failed'", err);
        if (!st) {
            rc = MD_EIO;
            goto rollback;
        }
        sqlite3_bind_text(st, 1, name, -1, SQLITE_STATIC);
        sqlite3_bind_int(st, 2, version);
        /* an error must not read as "no other version": that would set the
         * default to NULL without force */
        if (sqlite3_step(st) != SQLITE_ROW) {
            rc = db_fail(s, err, "find the next default");
            sqlite3_finalize(st);
            goto rollback;
        }
        int other = 0;
        if (sqlite3_column_type(st, 0) != SQLITE_NULL)
            other = sqlite3_column_int(st, 0);
        sqlite3_finalize(st);
        if (other && !force) {
            rc = md_err_setc(err, MD_ECONFLICT, "version_is_default",
                             "version %d is the default of model %s; make another version the "
                             "default first (PATCH /models/%s {\"default_version\": N}) or add "
                             "?force=true",
                             version, name, name);
            goto rollback;
        }
        st = prep(s, "UPDATE models SET default_version = ? WHERE name = ?", err);
        if (other)
            sqlite3_bind_int(st, 1, other);
        else
            sqlite3_bind_null(st, 1);
        sqlite3_bind_text(st, 2, name, -1, SQLITE_STATIC);
        int moved_ok = sqlite3_step(st) == SQLITE_DONE;
        sqlite3_finalize(st);
        if (!moved_ok) {
            rc = db_fail(s, err, "move the default");
            goto rollback;
        }
    }
    st = prep(s, "DELETE FROM versions WHERE model = ? AND version = ?", err);
    sqlite3_bind_text(st, 1, name, -1, SQLITE_STATIC);
    sqlite3_bind_int(st, 2, version);
    int ok = sqlite3_step(st) == SQLITE_DONE;
    sqlite3_finalize(st);
    if (!ok) {
        rc = db_fail(s, err, "delete version");
        goto rollback;
    }
    sha_list_add(&released, json_string_value(json_object_get(v, "sha256")));
    if ((rc = bump_generation(s, err)) != MD_OK || (rc = exec(s, "COMMIT", err)) != MD_OK)
        goto rollback;
    release_all(s, &released);
    goto out;
rollback:
    exec(s, "ROLLBACK", NULL);
    free(released.items);
out:
    json_decref(v);
    pthread_mutex_unlock(&s->mu);
    return with_hint(s, rc, name, err); /* after the ROLLBACK: see with_hint */
}

md_status md_store_delete_model(md_store *s, const char *name, md_err *err)
{
    pthread_mutex_lock(&s->mu);
    md_status rc = MD_OK;
    sha_list released = {0};
    if ((rc = exec(s, "BEGIN IMMEDIATE", err)) != MD_OK)
        goto out;
    /* inside the transaction: a replica cannot delete it in between */
    if (!model_exists(s, name)) {
        rc = model_missing(name, err);
        exec(s, "ROLLBACK", NULL);
        goto out;
    }
    sqlite3_stmt *st = prep(s,
                            "SELECT sha256 FROM versions WHERE model = ?1 UNION SELECT "
                            "arch_sha256 FROM versions WHERE model = ?1 AND arch_sha256 IS NOT "
                            "NULL UNION SELECT arch_sha256 FROM models WHERE name = ?1 AND "
                            "arch_sha256 IS NOT NULL",
                            err);
    int step = SQLITE_ERROR;
    if (st) {
        sqlite3_bind_text(st, 1, name, -1, SQLITE_STATIC);
        while ((step = sqlite3_step(st)) == SQLITE_ROW)
            sha_list_add(&released, (const char *)sqlite3_column_text(st, 0));
        sqlite3_finalize(st);
    }
    if (step != SQLITE_DONE) {
        /* the blobs to collect are unknown: delete nothing */
        rc = st ? db_fail(s, err, "list the model's versions") : MD_EIO;
        exec(s, "ROLLBACK", NULL);
        free(released.items);
        goto out;
    }
    st = prep(s, "DELETE FROM models WHERE name = ?", err);
    sqlite3_bind_text(st, 1, name, -1, SQLITE_STATIC);
    int ok = sqlite3_step(st) == SQLITE_DONE;
    sqlite3_finalize(st);
    if (!ok || bump_generation(s, err) != MD_OK || exec(s, "COMMIT", err) != MD_OK) {
        rc = ok ? MD_EIO : db_fail(s, err, "delete model");
        exec(s, "ROLLBACK", NULL);
        free(released.items);
        goto out;
    }
    release_all(s, &released);
out:
    pthread_mutex_unlock(&s->mu);
    return with_hint(s, rc, name, err);
}

md_status md_store_set_state(md_store *s, const char *name, int version, const char *state,
                             const char *reason, md_err *err)
{
    pthread_mutex_lock(&s->mu);
    md_status rc = MD_OK;
    sqlite3_stmt *st = prep(s,
                            "UPDATE versions SET state = ?, state_reason = ? WHERE model = ? AND "
                            "version = ?",
                            err);
    if (!st) {
        rc = MD_EIO;
        goto out;
    }
    sqlite3_bind_text(st, 1, state, -1, SQLITE_STATIC);
    if (reason)
        sqlite3_bind_text(st, 2, reason, -1, SQLITE_STATIC);
    else
        sqlite3_bind_null(st, 2);
    sqlite3_bind_text(st, 3, name, -1, SQLITE_STATIC);
    sqlite3_bind_int(st, 4, version);
    if (sqlite3_step(st) != SQLITE_DONE)
        rc = db_fail(s, err, "set state");
    else if (sqlite3_changes(s->db) == 0)
        rc = md_err_setc(err, MD_ENOTFOUND, "version_not_found", "model %s has no version %d",
                         name, version);
    sqlite3_finalize(st);
out:
    pthread_mutex_unlock(&s->mu);
    return rc;
}

md_status md_store_blob_path(md_store *s, const char *name, int version, char *path,
                             size_t path_size, char sha256[MD_SHA256_HEX], md_err *err)
{
    json_t *v = NULL;
    md_status rc = md_store_get_version(s, name, version, &v, err);
    if (rc != MD_OK)
        return rc;
    snprintf(sha256, MD_SHA256_HEX, "%s", json_string_value(json_object_get(v, "sha256")));
    blob_path(s, sha256, path, path_size);
    json_decref(v);
    return MD_OK;
}

md_status md_store_defaults(md_store *s, json_t **out, md_err *err)
{
    pthread_mutex_lock(&s->mu);
    md_status rc = MD_OK;
    sqlite3_stmt *st = prep(s,
                            "SELECT " VERSION_COLS "FROM versions v JOIN models m ON m.name = "
                            "v.model AND m.default_version = v.version ORDER BY v.model",
                            err);
    if (!st) {
        rc = MD_EIO;
        goto out;
    }
    json_t *a = json_array();
    while (sqlite3_step(st) == SQLITE_ROW) {
        json_t *v = version_json(st);
        char path[4096];
        blob_path(s, json_string_value(json_object_get(v, "sha256")), path, sizeof path);
        json_object_set_new(v, "path", json_string(path));
        json_array_append_new(a, v);
    }
    sqlite3_finalize(st);
    *out = a;
out:
    pthread_mutex_unlock(&s->mu);
    return rc;
}

/* ---- jobs ---- */

#define JOB_COLS                                                                              \
    "id, model, version, spec, status, rows_done, rows_total, rows_skipped, output_path, "   \
    "output_bytes, correct, labeled, confusion, rows_per_s, partial, error, created_at, "    \
    "started_at, finished_at, updated_at, owner "

static json_t *col_or_null(sqlite3_stmt *st, int i)
{
    switch (sqlite3_column_type(st, i)) {
    case SQLITE_NULL:
        return json_null();
    case SQLITE_INTEGER:
        return json_integer(sqlite3_column_int64(st, i));
    case SQLITE_FLOAT:
        return json_real(sqlite3_column_double(st, i));
    default:
        return json_string((const char *)sqlite3_column_text(st, i));
    }
}

static json_t *job_json(sqlite3_stmt *st)
{
    static const char *names[] = {"id", "model", "version", "spec", "status", "rows_done",
                                  "rows_total", "rows_skipped", "output_path", "output_bytes",
                                  "correct", "labeled", "confusion", "rows_per_s", "partial",
                                  "error", "created_at", "started_at", "finished_at",
                                  "updated_at", "owner"};
    json_t *j = json_object();
    for (int i = 0; i < 21; i++) {
        if (i == 3 || i == 12) {
            json_object_set_new(j, names[i], sqlite3_column_type(st, i) == SQLITE_NULL
                                                 ? json_null()
                                                 : json_col(st, i));
        } else if (i == 14) {
            json_object_set_new(j, names[i], json_boolean(sqlite3_column_int(st, i)));
        } else {
            json_object_set_new(j, names[i], col_or_null(st, i));
        }
    }
    return j;
}

md_status md_store_job_create(md_store *s, const char *id, const char *model, int version,
                              json_t *spec, const char *output_path, md_err *err)
{
    char *text = json_dumps(spec, JSON_COMPACT);
    char now[32];
    now_iso(now);
    pthread_mutex_lock(&s->mu);
    md_status rc = MD_OK;
    sqlite3_stmt *st = prep(s,
                            "INSERT INTO jobs (id, model, version, spec, status, output_path, "
                            "created_at, updated_at) VALUES (?,?,?,?, 'queued', ?, ?, ?)",
                            err);
    if (!st) {
        rc = MD_EIO;
        goto out;
    }
    sqlite3_bind_text(st, 1, id, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 2, model, -1, SQLITE_STATIC);
    if (version)
        sqlite3_bind_int(st, 3, version);
    else
        sqlite3_bind_null(st, 3);
    sqlite3_bind_text(st, 4, text, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 5, output_path, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 6, now, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 7, now, -1, SQLITE_STATIC);
    if (sqlite3_step(st) != SQLITE_DONE)
        rc = db_fail(s, err, "insert job");
    sqlite3_finalize(st);
out:
    pthread_mutex_unlock(&s->mu);
    free(text);
    return rc;
}

md_status md_store_job_get(md_store *s, const char *id, json_t **out, md_err *err)
{
    pthread_mutex_lock(&s->mu);
    md_status rc = MD_OK;
    sqlite3_stmt *st = prep(s, "SELECT " JOB_COLS "FROM jobs WHERE id = ?", err);
    if (!st) {
        rc = MD_EIO;
        goto out;
    }
    sqlite3_bind_text(st, 1, id, -1, SQLITE_STATIC);
    if (sqlite3_step(st) == SQLITE_ROW)
        *out = job_json(st);
    else
        rc = md_err_setc(err, MD_ENOTFOUND, "job_not_found",
                         "job %s does not exist; GET /jobs lists the jobs", id);
    sqlite3_finalize(st);
out:
    pthread_mutex_unlock(&s->mu);
    return rc;
}

md_status md_store_job_list(md_store *s, const char *status, const char *model,
                            const char *before, int limit, json_t **out, md_err *err)
{
    pthread_mutex_lock(&s->mu);
    md_status rc = MD_OK;
    sqlite3_stmt *st = prep(s,
                            "SELECT " JOB_COLS "FROM jobs WHERE (?1 IS NULL OR status = ?1) AND "
                            "(?2 IS NULL OR model = ?2) AND (?3 IS NULL OR id < ?3) "
                            "ORDER BY id DESC LIMIT ?4",
                            err);
    if (!st) {
        rc = MD_EIO;
        goto out;
    }
    if (status)
        sqlite3_bind_text(st, 1, status, -1, SQLITE_STATIC);
    if (model)
        sqlite3_bind_text(st, 2, model, -1, SQLITE_STATIC);
    if (before)
        sqlite3_bind_text(st, 3, before, -1, SQLITE_STATIC);
    sqlite3_bind_int(st, 4, limit + 1);
    json_t *jobs = json_array();
    json_t *next = json_null();
    int n = 0;
    while (sqlite3_step(st) == SQLITE_ROW) {
        if (n++ == limit) {
            next = json_incref(json_object_get(json_array_get(jobs, (size_t)limit - 1), "id"));
            break;
        }
        json_array_append_new(jobs, job_json(st));
    }
    sqlite3_finalize(st);
    *out = json_pack("{s:o,s:o}", "jobs", jobs, "next", next);
out:
    pthread_mutex_unlock(&s->mu);
    return rc;
}

static double wall_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* UPDATE the columns named by `fields`; with `owner`, only while that owner
 * holds the job, extending its lease to now + lease_s (0 rows: ECONFLICT). */
static md_status job_update(md_store *s, const char *id, const char *owner, double lease_s,
                            json_t *fields, int *cancel_requested, md_err *err)
{
    static const char *allowed[] = {"status", "rows_done", "rows_total", "rows_skipped",
                                    "output_bytes", "correct", "labeled", "confusion",
                                    "rows_per_s", "partial", "error", "started_at",
                                    "finished_at", "version", "spec", NULL};
    char sql[1200];
    size_t n = (size_t)snprintf(sql, sizeof sql, "UPDATE jobs SET updated_at = ?1");
    const char *key;
    json_t *v;
    int idx = 2;
    json_object_foreach(fields, key, v)
    {
        int ok = 0;
        for (int i = 0; allowed[i]; i++)
            ok |= strcmp(key, allowed[i]) == 0;
        md_assert(ok);
        n += (size_t)snprintf(sql + n, sizeof sql - n, ", %s = ?%d", key, idx++);
    }
    int id_idx = idx++;
    if (owner) {
        n += (size_t)snprintf(sql + n, sizeof sql - n, ", lease_until = ?%d WHERE id = ?%d AND "
                              "owner = ?%d RETURNING cancel_requested", idx, id_idx, idx + 1);
    } else {
        snprintf(sql + n, sizeof sql - n, " WHERE id = ?%d", id_idx);
    }
    char now[32];
    now_iso(now);
    pthread_mutex_lock(&s->mu);
    md_status rc = MD_OK;
    sqlite3_stmt *st = prep(s, sql, err);
    if (!st) {
        rc = MD_EIO;
        goto out;
    }
    sqlite3_bind_text(st, 1, now, -1, SQLITE_TRANSIENT);
    idx = 2;
    json_object_foreach(fields, key, v)
    {
        if (json_is_integer(v))
            sqlite3_bind_int64(st, idx, json_integer_value(v));
        else if (json_is_real(v))
            sqlite3_bind_double(st, idx, json_real_value(v));
        else if (json_is_string(v))
            sqlite3_bind_text(st, idx, json_string_value(v), -1, SQLITE_TRANSIENT);
        else if (json_is_boolean(v))
            sqlite3_bind_int(st, idx, json_is_true(v));
        else if (json_is_null(v))
            sqlite3_bind_null(st, idx);
        else {
            char *t = json_dumps(v, JSON_COMPACT);
            sqlite3_bind_text(st, idx, t, -1, SQLITE_TRANSIENT);
            free(t);
        }
        idx++;
    }
    sqlite3_bind_text(st, id_idx, id, -1, SQLITE_TRANSIENT);
    if (owner) {
        sqlite3_bind_double(st, id_idx + 1, wall_now() + lease_s);
        sqlite3_bind_text(st, id_idx + 2, owner, -1, SQLITE_TRANSIENT);
        int r = sqlite3_step(st);
        if (r == SQLITE_ROW) {
            if (cancel_requested)
                *cancel_requested = sqlite3_column_int(st, 0);
            r = sqlite3_step(st);
        } else if (r == SQLITE_DONE) {
            rc = md_err_setc(err, MD_ECONFLICT, "job_lease_lost",
                             "job %s is no longer held by this process (%s)", id, owner);
        }
        if (rc == MD_OK && r != SQLITE_DONE)
            rc = db_fail(s, err, "update job");
    } else if (sqlite3_step(st) != SQLITE_DONE) {
        rc = db_fail(s, err, "update job");
    }
    sqlite3_finalize(st);
out:
    pthread_mutex_unlock(&s->mu);
    return rc;
}

md_status md_store_job_update(md_store *s, const char *id, json_t *fields, md_err *err)
{
    return job_update(s, id, NULL, 0, fields, NULL, err);
}

md_status md_store_job_update_owned(md_store *s, const char *id, const char *owner,
                                    double lease_s, json_t *fields, int *cancel_requested,
                                    md_err *err)
{
    json_t *empty = fields ? NULL : json_object();
    md_status rc = job_update(s, id, owner, lease_s, fields ? fields : empty, cancel_requested,
                              err);
    json_decref(empty);
    return rc;
}

md_status md_store_job_claim_next(md_store *s, const char *owner, double lease_s,
                                  int (*owner_dead)(const char *owner, void *ctx), void *ctx,
                                  char id[64], md_err *err)
{
    id[0] = '\0';
    pthread_mutex_lock(&s->mu);
    md_status rc = MD_OK;
    double now = wall_now();
    sqlite3_stmt *sel = prep(s,
                             "SELECT id, owner, lease_until FROM jobs WHERE status IN "
                             "('queued','running') AND (owner IS NULL OR owner != ?1) "
                             "ORDER BY created_at, id",
                             err);
    sqlite3_stmt *upd = prep(s,
                             "UPDATE jobs SET owner = ?1, lease_until = ?2 WHERE id = ?3 AND "
                             "status IN ('queued','running') AND owner IS ?4",
                             err);
    if (!sel || !upd) {
        rc = MD_EIO;
        goto out;
    }
    sqlite3_bind_text(sel, 1, owner, -1, SQLITE_STATIC);
    int r;
    while ((r = sqlite3_step(sel)) == SQLITE_ROW) {
        const char *cand = (const char *)sqlite3_column_text(sel, 0);
        const char *held = (const char *)sqlite3_column_text(sel, 1);
        double until = sqlite3_column_double(sel, 2);
        if (held && until >= now && !(owner_dead && owner_dead(held, ctx)))
            continue; /* a live lease */
        sqlite3_reset(upd);
        sqlite3_bind_text(upd, 1, owner, -1, SQLITE_STATIC);
        sqlite3_bind_double(upd, 2, now + lease_s);
        sqlite3_bind_text(upd, 3, cand, -1, SQLITE_TRANSIENT);
        if (held)
            sqlite3_bind_text(upd, 4, held, -1, SQLITE_TRANSIENT);
        else
            sqlite3_bind_null(upd, 4);
        if (sqlite3_step(upd) != SQLITE_DONE) {
            rc = db_fail(s, err, "claim job");
            break;
        }
        if (sqlite3_changes(s->db) == 1) { /* another process may have taken it first */
            snprintf(id, 64, "%s", cand);
            break;
        }
    }
    if (rc == MD_OK && r != SQLITE_ROW && r != SQLITE_DONE)
        rc = db_fail(s, err, "list claimable jobs");
out:
    sqlite3_finalize(sel);
    sqlite3_finalize(upd);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

/* Run `sql` with text parameters ?1 and ?2, the lock held; *changes (may be
 * NULL) gets the number of rows it changed. */
static md_status exec2(md_store *s, const char *sql, const char *p1, const char *p2,
                       const char *what, int *changes, md_err *err)
{
    sqlite3_stmt *st = prep(s, sql, err);
    if (!st)
        return MD_EIO;
    sqlite3_bind_text(st, 1, p1, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 2, p2, -1, SQLITE_STATIC);
    md_status rc = MD_OK;
    if (sqlite3_step(st) != SQLITE_DONE)
        rc = db_fail(s, err, what);
    else if (changes)
        *changes = sqlite3_changes(s->db);
    sqlite3_finalize(st);
    return rc;
}

md_status md_store_job_release(md_store *s, const char *id, const char *owner, md_err *err)
{
    pthread_mutex_lock(&s->mu);
    md_status rc = exec2(s,
                         "UPDATE jobs SET owner = NULL, lease_until = NULL WHERE id = ?1 AND "
                         "owner = ?2",
                         id, owner, "release job", NULL, err);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

md_status md_store_job_request_cancel(md_store *s, const char *id, int *cancelled_now,
                                      md_err *err)
{
    char now[32];
    now_iso(now);
    int changed = 0;
    pthread_mutex_lock(&s->mu);
    /* a queued job nobody holds is cancelled at once; any other is flagged
     * for its holder (or whoever claims it next) */
    md_status rc = exec2(s,
                         "UPDATE jobs SET status = 'cancelled', finished_at = ?2, "
                         "updated_at = ?2 WHERE id = ?1 AND status = 'queued' AND owner IS NULL",
                         id, now, "cancel job", &changed, err);
    if (rc == MD_OK && changed != 1)
        rc = exec2(s,
                   "UPDATE jobs SET cancel_requested = 1, updated_at = ?2 WHERE id = ?1 AND "
                   "status IN ('queued','running')",
                   id, now, "cancel job", NULL, err);
    pthread_mutex_unlock(&s->mu);
    *cancelled_now = rc == MD_OK && changed == 1;
    return rc;
}

const char *md_store_dir(const md_store *s) { return s->dir; }
