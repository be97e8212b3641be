/*
 * test_store.c - unit tests of checkpoint/checkpoint.h (store.c, versions.c,
 * promotion.c, retention.c, blobs.c, archive.c, download.c) and of the job table
 * (jobs/jobs.h, job_store.c),
 * called directly on a store in a fresh mkdtemp directory per test: blob
 * writers (begin/write/finish, limits, hashes), versions and shared blobs,
 * the schema migrations and the refusal of a newer schema, crash points
 * simulated by stopping between steps (a temp file never finished, a blob
 * renamed without its row, a row whose blob is gone), the TorchScript archive
 * check on the committed fixtures, retention, ordering by metrics, listing,
 * defaults and deletion, and md_model_name_ok.
 *
 * Fixtures are read from tests/fixtures relative to the working directory
 * (make runs the tests from the repository root).
 *
 * Both index backends run this suite: SQLite (index.sqlite in the test's
 * directory) by default, PostgreSQL when MODELD_TEST_INDEX_URL names one
 * (tests/with_pg.sh starts a throwaway cluster and sets it; `make unit-pg`).
 * Under PostgreSQL each test starts from an empty database (the public
 * schema dropped and created again); the few checks of SQLite's own files
 * and PRAGMAs are skipped, the rest use idx_exec/schema_version, which
 * speak to whichever backend is under test.
 */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <jansson.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <signal.h>
#include <sqlite3.h>
#ifdef MD_WITH_PG
#include <libpq-fe.h>
#endif
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "../checkpoint/checkpoint.h"
#include "../checkpoint/blobs_impl.h"
#include "../checkpoint/index_impl.h"
#include "../jobs/jobs.h"

#define FIXTURES "tests/fixtures"

/* ---- helpers ---- */

typedef struct fx {
    char dir[256];
} fx;

/* The index under test: NULL = SQLite in the store directory. */
static const char *index_url;

/* Run `sql` (statements without rows) on the PostgreSQL index; 0 on success. */
static int pg_exec(const char *sql, char *errbuf, size_t size)
{
#ifdef MD_WITH_PG
    PGconn *c = PQconnectdb(index_url);
    int ok = PQstatus(c) == CONNECTION_OK;
    PGresult *r = ok ? PQexec(c, sql) : NULL;
    ok = ok && (PQresultStatus(r) == PGRES_COMMAND_OK || PQresultStatus(r) == PGRES_TUPLES_OK);
    if (!ok)
        snprintf(errbuf, size, "%s", PQerrorMessage(c));
    PQclear(r);
    PQfinish(c);
    return ok ? 0 : -1;
#else
    snprintf(errbuf, size, "built without PostgreSQL (WITH_PG=0)");
    (void)sql;
    return -1;
#endif
}

static int setup(void **state)
{
    if (index_url) {
        char msg[512];
        if (pg_exec("SET client_min_messages = warning; DROP SCHEMA public CASCADE; "
                    "CREATE SCHEMA public;",
                    msg, sizeof msg) != 0)
            fail_msg("cannot empty the PostgreSQL index %s: %s", index_url, msg);
    }
    fx *f = calloc(1, sizeof *f);
    snprintf(f->dir, sizeof f->dir, "/tmp/modeld-test-store-XXXXXX");
    if (!mkdtemp(f->dir)) {
        free(f);
        return -1;
    }
    *state = f;
    return 0;
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    remove(path);
    return 0;
}

static int teardown(void **state)
{
    fx *f = *state;
    nftw(f->dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    free(f);
    return 0;
}

typedef struct bytes {
    unsigned char *data;
    size_t len;
} bytes;

static bytes read_file(const char *path)
{
    bytes b = {NULL, 0};
    FILE *fp = fopen(path, "rb");
    if (!fp)
        fail_msg("cannot open %s: %s (run the test from the repository root)", path,
                 strerror(errno));
    fseek(fp, 0, SEEK_END);
    long n = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    b.data = malloc(n > 0 ? (size_t)n : 1);
    b.len = fread(b.data, 1, (size_t)n, fp);
    fclose(fp);
    assert_int_equal(b.len, (size_t)n);
    return b;
}

static bytes fixture(const char *name)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", FIXTURES, name);
    return read_file(path);
}

static void sha_hex(const void *data, size_t len, char out[MD_SHA256_HEX])
{
    unsigned char d[32];
    unsigned int n = 0;
    EVP_Digest(data, len, d, &n, EVP_sha256(), NULL);
    for (int i = 0; i < 32; i++)
        snprintf(out + 2 * i, 3, "%02x", d[i]);
}

/* Number of entries (not . or ..) in dir/sub. */
static int count_dir(const fx *f, const char *sub)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", f->dir, sub);
    DIR *d = opendir(path);
    if (!d)
        return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0)
            n++;
    closedir(d);
    return n;
}

static int blob_exists(const fx *f, const char *sha)
{
    char path[512];
    snprintf(path, sizeof path, "%s/blobs/%s", f->dir, sha);
    return access(path, F_OK) == 0;
}

static void open_store(const fx *f, md_store **s)
{
    md_err err;
    md_err_clear(&err);
    md_status st = md_store_open_index(f->dir, index_url, s, &err);
    if (st != MD_OK)
        fail_msg("md_store_open(%s): %d %s", f->dir, (int)st, err.msg);
    assert_non_null(*s);
}

/* Stream `b` into a new writer in chunks of `chunk` bytes. */
static md_blob_writer *write_blob(md_store *s, const bytes *b, size_t chunk)
{
    md_err err;
    md_err_clear(&err);
    md_blob_writer *w = NULL;
    assert_int_equal(md_blob_begin(s, 1LL << 30, &w, &err), MD_OK);
    assert_non_null(w);
    for (size_t off = 0; off < b->len; off += chunk) {
        size_t n = b->len - off < chunk ? b->len - off : chunk;
        if (md_blob_write(w, b->data + off, n, &err) != MD_OK)
            fail_msg("md_blob_write: %s", err.msg);
    }
    assert_int_equal(md_blob_size(w), (long long)b->len);
    return w;
}

/* Upload `b` as a new version of `model`; returns the version number. */
static int add(md_store *s, const char *model, const bytes *b, int version, const char *metrics,
               int make_default)
{
    md_err err;
    md_err_clear(&err);
    md_blob_writer *w = write_blob(s, b, 4096);
    char sha[MD_SHA256_HEX];
    long long size = 0;
    if (md_blob_finish(w, NULL, sha, &size, &err) != MD_OK)
        fail_msg("md_blob_finish: %s", err.msg);
    json_t *m = metrics ? json_loads(metrics, 0, NULL) : NULL;
    md_version_spec spec = {.model = model,
                            .version = version,
                            .sha256 = sha,
                            .size = size,
                            .source = "upload",
                            .metrics = m,
                            .make_default = make_default};
    json_t *out = NULL;
    md_status st = md_store_add_version(s, &spec, w, &out, &err);
    json_decref(m);
    if (st != MD_OK)
        fail_msg("md_store_add_version(%s): %d %s", model, (int)st, err.msg);
    assert_non_null(out);
    int v = (int)json_integer_value(json_object_get(out, "version"));
    json_decref(out);
    return v;
}

/* The version numbers of `model`, in `buf`; returns the count. */
static int versions(md_store *s, const char *model, int *buf, int cap)
{
    md_err err;
    json_t *m = NULL;
    if (md_store_get_model(s, model, &m, &err) != MD_OK)
        fail_msg("md_store_get_model(%s): %s", model, err.msg);
    json_t *vs = json_object_get(m, "versions");
    int n = 0;
    size_t i;
    json_t *v;
    json_array_foreach(vs, i, v)
    {
        if (n < cap)
            buf[n] = (int)json_integer_value(json_object_get(v, "version"));
        n++;
    }
    json_decref(m);
    return n;
}

static int default_version(md_store *s, const char *model)
{
    md_err err;
    json_t *m = NULL;
    assert_int_equal(md_store_get_model(s, model, &m, &err), MD_OK);
    json_t *d = json_object_get(m, "default_version");
    int v = json_is_integer(d) ? (int)json_integer_value(d) : 0;
    json_decref(m);
    return v;
}

/* Skip the calling test under PostgreSQL: it checks SQLite's own files. */
#define SQLITE_ONLY()                                                                         \
    do {                                                                                      \
        if (index_url)                                                                        \
            skip();                                                                           \
    } while (0)

static int user_version(const fx *f)
{
    if (index_url) {
#ifdef MD_WITH_PG
        PGconn *c = PQconnectdb(index_url);
        PGresult *r = PQexec(c, "SELECT max(version) FROM modeld_schema");
        assert_int_equal(PQresultStatus(r), PGRES_TUPLES_OK);
        int v = atoi(PQgetvalue(r, 0, 0));
        PQclear(r);
        PQfinish(c);
        return v;
#endif
    }
    char path[512];
    snprintf(path, sizeof path, "%s/index.sqlite", f->dir);
    sqlite3 *db = NULL;
    assert_int_equal(sqlite3_open_v2(path, &db, SQLITE_OPEN_READONLY, NULL), SQLITE_OK);
    sqlite3_stmt *st = NULL;
    assert_int_equal(sqlite3_prepare_v2(db, "PRAGMA user_version", -1, &st, NULL), SQLITE_OK);
    assert_int_equal(sqlite3_step(st), SQLITE_ROW);
    int v = sqlite3_column_int(st, 0);
    sqlite3_finalize(st);
    sqlite3_close(db);
    return v;
}

/* Run `sql` on the index under test (written for both engines). */
static void sql_exec(const fx *f, const char *sql)
{
    if (index_url) {
        char msg[512];
        if (pg_exec(sql, msg, sizeof msg) != 0)
            fail_msg("%s: %s", sql, msg);
        return;
    }
    char path[512];
    snprintf(path, sizeof path, "%s/index.sqlite", f->dir);
    sqlite3 *db = NULL;
    assert_int_equal(sqlite3_open(path, &db), SQLITE_OK);
    char *msg = NULL;
    if (sqlite3_exec(db, sql, NULL, NULL, &msg) != SQLITE_OK)
        fail_msg("%s: %s", sql, msg);
    sqlite3_close(db);
}

static void touch(const fx *f, const char *rel, time_t age_s)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", f->dir, rel);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, "x", 1), 1);
    close(fd);
    if (age_s > 0) {
        struct timeval tv[2];
        gettimeofday(&tv[0], NULL);
        tv[0].tv_sec -= age_s;
        tv[1] = tv[0];
        assert_int_equal(utimes(path, tv), 0);
    }
}

static int exists(const fx *f, const char *rel)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", f->dir, rel);
    return access(path, F_OK) == 0;
}

/* ---- opening and migrations ---- */

static void test_open_creates_layout_and_schema(void **state)
{
    fx *f = *state;
    md_store *s = NULL;
    open_store(f, &s);
    assert_true(index_url || exists(f, "index.sqlite"));
    assert_int_equal(count_dir(f, "blobs"), 0);
    assert_int_equal(count_dir(f, "tmp"), 0);
    /* migrated to the newest schema: at least the first migration */
    int latest = user_version(f);
    assert_true(latest >= 1);
    md_err err;
    json_t *out = NULL;
    assert_int_equal(md_store_list_models(s, NULL, 10, &out, &err), MD_OK);
    assert_int_equal(json_array_size(json_object_get(out, "models")), 0);
    assert_true(json_is_null(json_object_get(out, "next")));
    json_decref(out);
    md_store_close(s);
    md_store_close(NULL); /* accepted */
}

static void test_reopen_is_idempotent(void **state)
{
    fx *f = *state;
    bytes mlp = fixture("mlp.pt");
    md_store *s = NULL;
    open_store(f, &s);
    assert_int_equal(add(s, "m", &mlp, 0, "{\"loss\": 0.5}", 1), 1);
    long long gen = md_store_generation(s);
    int latest = user_version(f);
    assert_true(latest >= 1);
    md_store_close(s);
    for (int i = 0; i < 3; i++) {
        open_store(f, &s);
        assert_int_equal(user_version(f), latest);
        int vs[4];
        assert_int_equal(versions(s, "m", vs, 4), 1);
        assert_int_equal(vs[0], 1);
        assert_int_equal(md_store_generation(s), gen);
        md_store_close(s);
    }
    free(mlp.data);
}

/* Schema version 1, exactly as the first migration creates it. Migrations
 * are forward-only and never edited, so a store written by the first release
 * looks like this for ever. */
static const char *const schema_v1 =
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
    "INSERT INTO meta VALUES ('generation', '5');"
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
    "CREATE INDEX versions_sha256 ON versions(sha256);"
    "PRAGMA user_version = 1;";

/* A store left by an older modeld (schema 1, with a model in it) is migrated
 * forward to the schema of a fresh store and keeps its rows and blobs. */
static void test_old_schema_migrated_forward(void **state)
{
    SQLITE_ONLY(); /* builds a version-1 index.sqlite by hand */
    fx *f = *state;
    /* the newest schema, from a fresh store elsewhere */
    fx fresh;
    if (snprintf(fresh.dir, sizeof fresh.dir, "%s/fresh", f->dir) >= (int)sizeof fresh.dir)
        fail_msg("path too long");
    md_store *s = NULL;
    open_store(&fresh, &s);
    md_store_close(s);
    int latest = user_version(&fresh);

    bytes mlp = fixture("mlp.pt");
    char sm[MD_SHA256_HEX];
    sha_hex(mlp.data, mlp.len, sm);
    char path[512];
    fx old;
    if (snprintf(old.dir, sizeof old.dir, "%s/old", f->dir) >= (int)sizeof old.dir)
        fail_msg("path too long");
    const char *old_dir = old.dir;
    assert_int_equal(mkdir(old_dir, 0755), 0);
    snprintf(path, sizeof path, "%s/blobs", old_dir);
    assert_int_equal(mkdir(path, 0755), 0);
    snprintf(path, sizeof path, "%s/blobs/%s", old_dir, sm);
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    assert_int_equal(fwrite(mlp.data, 1, mlp.len, fp), mlp.len);
    fclose(fp);
    char sql[2048];
    snprintf(sql, sizeof sql,
             "%s"
             "INSERT INTO models VALUES ('m', 1, '{}', '2025-01-01T00:00:00.000Z', "
             "'2025-01-01T00:00:00.000Z');"
             "INSERT INTO versions (model, version, sha256, size, source, metrics, state, "
             "created_at) VALUES ('m', 1, '%s', %zu, 'upload', '{\"loss\": 0.5}', 'stored', "
             "'2025-01-01T00:00:00.000Z');",
             schema_v1, sm, mlp.len);
    sql_exec(&old, sql);
    assert_int_equal(user_version(&old), 1);

    open_store(&old, &s);
    assert_int_equal(user_version(&old), latest);
    assert_true(md_store_generation(s) >= 5);
    md_err err;
    json_t *v = NULL;
    assert_int_equal(md_store_get_version(s, "m", 1, &v, &err), MD_OK);
    assert_string_equal(json_string_value(json_object_get(v, "sha256")), sm);
    assert_string_equal(json_string_value(json_object_get(v, "state")), "stored");
    assert_true(json_is_true(json_object_get(v, "default")));
    json_decref(v);
    /* and it works as a store of the newest schema */
    assert_int_equal(add(s, "m", &mlp, 0, NULL, 1), 2);
    md_store_close(s);
    open_store(&old, &s);
    assert_int_equal(user_version(&old), latest);
    md_store_close(s);
    free(mlp.data);
}

static void test_newer_schema_refused(void **state)
{
    fx *f = *state;
    md_store *s = NULL;
    open_store(f, &s);
    md_store_close(s);
    sql_exec(f, index_url ? "UPDATE modeld_schema SET version = 99" : "PRAGMA user_version = 99");
    md_err err;
    md_err_clear(&err);
    s = (md_store *)0x1;
    assert_int_equal(md_store_open_index(f->dir, index_url, &s, &err), MD_EIO);
    assert_null(s);
    if (!strstr(err.msg, "schema version 99"))
        fail_msg("message does not name the schema version: %s", err.msg);
    assert_non_null(strstr(err.msg, f->dir));
    /* nothing was changed: still 99 */
    assert_int_equal(user_version(f), 99);
}

static void test_open_unwritable_dir_fails(void **state)
{
    (void)state;
    md_err err;
    md_err_clear(&err);
    md_store *s = NULL;
    assert_int_equal(md_store_open("/proc/modeld-no-such/store", &s, &err), MD_EIO);
    assert_null(s);
    assert_true(err.msg[0] != '\0');
}

/* ---- blobs ---- */

static void test_blob_write_finish_add_version(void **state)
{
    fx *f = *state;
    bytes mlp = fixture("mlp.pt");
    char want[MD_SHA256_HEX];
    sha_hex(mlp.data, mlp.len, want);
    md_store *s = NULL;
    open_store(f, &s);
    long long gen0 = md_store_generation(s);
    md_blob_writer *w = write_blob(s, &mlp, 1000);
    assert_int_equal(count_dir(f, "tmp"), 1); /* streaming into tmp/ */
    assert_int_equal(count_dir(f, "blobs"), 0);
    md_err err;
    md_err_clear(&err);
    char sha[MD_SHA256_HEX];
    long long size = 0;
    assert_int_equal(md_blob_finish(w, want, sha, &size, &err), MD_OK);
    assert_string_equal(sha, want);
    assert_int_equal(size, (long long)mlp.len);
    assert_int_equal(count_dir(f, "blobs"), 0); /* not before add_version */

    json_t *config = json_loads("{\"input\": {\"shape\": [4]}}", 0, NULL);
    json_t *metrics = json_loads("{\"loss\": 0.25}", 0, NULL);
    json_t *metadata = json_loads("{\"by\": \"unit\"}", 0, NULL);
    md_version_spec spec = {.model = "mlp",
                            .sha256 = sha,
                            .size = size,
                            .source = "upload",
                            .config = config,
                            .metadata = metadata,
                            .metrics = metrics,
                            .make_default = 0};
    json_t *out = NULL;
    assert_int_equal(md_store_add_version(s, &spec, w, &out, &err), MD_OK);
    assert_int_equal(json_integer_value(json_object_get(out, "version")), 1);
    assert_string_equal(json_string_value(json_object_get(out, "sha256")), want);
    assert_int_equal(json_integer_value(json_object_get(out, "size")), (long long)mlp.len);
    assert_string_equal(json_string_value(json_object_get(out, "model")), "mlp");
    assert_string_equal(json_string_value(json_object_get(out, "source")), "upload");
    assert_string_equal(json_string_value(json_object_get(out, "state")), "stored");
    /* the first version is the default whatever make_default says */
    assert_true(json_is_true(json_object_get(out, "default")));
    assert_true(json_equal(json_object_get(out, "config"), config));
    assert_true(json_equal(json_object_get(out, "metrics"), metrics));
    assert_true(json_equal(json_object_get(out, "metadata"), metadata));
    json_decref(out);
    json_decref(config);
    json_decref(metrics);
    json_decref(metadata);
    assert_true(md_store_generation(s) > gen0);

    /* the file is in place, byte for byte; tmp/ is empty */
    assert_int_equal(count_dir(f, "tmp"), 0);
    char path[4096], got_sha[MD_SHA256_HEX];
    assert_int_equal(md_store_blob_path(s, "mlp", 1, path, sizeof path, got_sha, &err), MD_OK);
    assert_string_equal(got_sha, want);
    bytes stored = read_file(path);
    assert_int_equal(stored.len, mlp.len);
    assert_memory_equal(stored.data, mlp.data, mlp.len);
    free(stored.data);

    json_t *defs = NULL;
    assert_int_equal(md_store_defaults(s, &defs, &err), MD_OK);
    assert_int_equal(json_array_size(defs), 1);
    assert_string_equal(json_string_value(json_object_get(json_array_get(defs, 0), "path")),
                        path);
    json_decref(defs);
    md_store_close(s);
    free(mlp.data);
}

static void test_blob_finish_errors_leave_nothing(void **state)
{
    fx *f = *state;
    bytes mlp = fixture("mlp.pt"), junk = fixture("not_a_model.pt"),
          zip = fixture("zip_not_torchscript.pt");
    md_store *s = NULL;
    open_store(f, &s);
    md_err err;
    char sha[MD_SHA256_HEX];
    long long size = 0;
    md_blob_writer *w = NULL;

    /* empty */
    md_err_clear(&err);
    assert_int_equal(md_blob_begin(s, 1 << 20, &w, &err), MD_OK);
    assert_int_equal(md_blob_finish(w, NULL, sha, &size, &err), MD_EINVAL);
    assert_string_equal(md_err_code(&err), "empty_checkpoint");
    assert_int_equal(count_dir(f, "tmp"), 0);

    /* not an archive, a zip that is not TorchScript */
    const bytes *bad[] = {&junk, &zip};
    for (int i = 0; i < 2; i++) {
        md_err_clear(&err);
        w = write_blob(s, bad[i], 7);
        assert_int_equal(md_blob_finish(w, NULL, sha, &size, &err), MD_EUNPROC);
        assert_string_equal(md_err_code(&err), "invalid_checkpoint");
        assert_int_equal(count_dir(f, "tmp"), 0);
    }

    /* the wrong hash */
    char other[MD_SHA256_HEX];
    sha_hex(junk.data, junk.len, other);
    md_err_clear(&err);
    w = write_blob(s, &mlp, 4096);
    assert_int_equal(md_blob_finish(w, other, sha, &size, &err), MD_EINVAL);
    assert_string_equal(md_err_code(&err), "sha256_mismatch");
    assert_non_null(strstr(err.msg, other));
    assert_int_equal(count_dir(f, "tmp"), 0);

    /* the right hash in upper case is accepted */
    char upper[MD_SHA256_HEX];
    sha_hex(mlp.data, mlp.len, upper);
    for (char *p = upper; *p; p++)
        if (*p >= 'a' && *p <= 'f')
            *p = (char)(*p - 'a' + 'A');
    md_err_clear(&err);
    w = write_blob(s, &mlp, 4096);
    assert_int_equal(md_blob_finish(w, upper, sha, &size, &err), MD_OK);
    md_blob_abort(w); /* a finished writer dropped: its temp file goes */
    assert_int_equal(count_dir(f, "tmp"), 0);

    /* past the limit: MD_ETOOBIG, nothing written past it; abort cleans up */
    md_err_clear(&err);
    assert_int_equal(md_blob_begin(s, 100, &w, &err), MD_OK);
    assert_int_equal(md_blob_write(w, mlp.data, 60, &err), MD_OK);
    assert_int_equal(md_blob_write(w, mlp.data + 60, 40, &err), MD_OK);
    assert_int_equal(md_blob_write(w, mlp.data + 100, 1, &err), MD_ETOOBIG);
    assert_string_equal(md_err_code(&err), "checkpoint_too_large");
    assert_int_equal(md_blob_size(w), 100);
    md_blob_abort(w);
    md_blob_abort(NULL);
    assert_int_equal(count_dir(f, "tmp"), 0);
    assert_int_equal(count_dir(f, "blobs"), 0);

    md_store_close(s);
    free(mlp.data);
    free(junk.data);
    free(zip.data);
}

static void test_shared_blobs(void **state)
{
    fx *f = *state;
    bytes mlp = fixture("mlp.pt"), cnn = fixture("cnn.pt");
    char sm[MD_SHA256_HEX], sc[MD_SHA256_HEX];
    sha_hex(mlp.data, mlp.len, sm);
    sha_hex(cnn.data, cnn.len, sc);
    md_store *s = NULL;
    open_store(f, &s);
    md_err err;
    md_err_clear(&err);
    assert_int_equal(add(s, "a", &mlp, 0, NULL, 1), 1);
    assert_int_equal(add(s, "a", &mlp, 0, NULL, 0), 2);
    assert_int_equal(add(s, "b", &mlp, 0, NULL, 1), 1);
    assert_int_equal(add(s, "b", &cnn, 0, NULL, 1), 2);
    /* the same bytes, once */
    assert_int_equal(count_dir(f, "blobs"), 2);
    assert_true(blob_exists(f, sm));
    assert_true(blob_exists(f, sc));
    assert_int_equal(count_dir(f, "tmp"), 0);

    /* a version added from a blob already stored (no writer) */
    md_version_spec spec = {.model = "c", .sha256 = sc, .size = (long long)cnn.len,
                            .source = "http://x/cnn.pt", .make_default = 1};
    json_t *out = NULL;
    assert_int_equal(md_store_add_version(s, &spec, NULL, &out, &err), MD_OK);
    assert_string_equal(json_string_value(json_object_get(out, "source")), "http://x/cnn.pt");
    assert_int_equal(json_integer_value(json_object_get(out, "size")), (long long)cnn.len);
    json_decref(out);
    /* ... and one naming a blob that is not there */
    char nosuch[MD_SHA256_HEX];
    memset(nosuch, 'e', 64);
    nosuch[64] = '\0';
    spec.sha256 = nosuch;
    spec.model = "d";
    assert_int_equal(md_store_add_version(s, &spec, NULL, NULL, &err), MD_EIO);
    assert_int_equal(md_store_get_model(s, "d", &out, &err), MD_ENOTFOUND);

    /* delete one user of the MLP bytes: the file stays */
    assert_int_equal(md_store_delete_version(s, "a", 2, 0, &err), MD_OK);
    assert_true(blob_exists(f, sm));
    assert_int_equal(md_store_delete_version(s, "a", 1, 0, &err), MD_OK); /* the last: allowed */
    assert_true(blob_exists(f, sm)); /* b version 1 still uses them */
    assert_int_equal(default_version(s, "a"), 0);
    /* the default of b while another exists: refused, then forced */
    assert_int_equal(md_store_delete_version(s, "b", 2, 0, &err), MD_ECONFLICT);
    assert_string_equal(md_err_code(&err), "version_is_default");
    assert_int_equal(md_store_delete_version(s, "b", 2, 1, &err), MD_OK);
    assert_int_equal(default_version(s, "b"), 1);
    assert_true(blob_exists(f, sc)); /* c version 1 */
    assert_int_equal(md_store_delete_version(s, "b", 1, 0, &err), MD_OK);
    assert_false(blob_exists(f, sm)); /* the last user is gone */
    assert_int_equal(md_store_delete_model(s, "c", &err), MD_OK);
    assert_false(blob_exists(f, sc));
    assert_int_equal(count_dir(f, "blobs"), 0);

    assert_int_equal(md_store_delete_version(s, "b", 1, 0, &err), MD_ENOTFOUND);
    assert_string_equal(md_err_code(&err), "version_not_found");
    assert_int_equal(md_store_delete_model(s, "nope", &err), MD_ENOTFOUND);
    assert_string_equal(md_err_code(&err), "model_not_found");
    md_store_close(s);
    free(mlp.data);
    free(cnn.data);
}

/* ---- two replicas sharing one store (issue 10 item 10) ----
 *
 * Two md_store handles on one directory stand for two processes: each has its
 * own SQLite connection, so only SQLite's write lock orders them. The test
 * hook stops replica B inside md_store_add_version right after it decided its
 * blob's file ("add_blob_decided") and runs replica A's operation on another
 * thread; B goes on once A's operation either finished or is waiting for the
 * write lock ("busy"). With the decision inside B's write transaction, A
 * waits, B commits, and A's garbage collection then sees B's row. Had B
 * decided outside it, A would finish first and unlink the file under B's row.
 */

typedef struct race {
    md_store *b;          /* the replica whose add is held */
    int armed;            /* hold B at its next `point` */
    const char *point;    /* default "add_blob_decided" */
    void *(*other)(void *); /* replica A's operation, run on its own thread */
    void *other_arg;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int other_done, other_waiting;
    pthread_t thread;
    int started;
    int timed_out; /* the other operation neither finished nor waited in time */
} race;

static void race_hook(md_store *store, const char *point, void *ctx)
{
    race *r = ctx;
    if (strcmp(point, "busy") == 0 && store != r->b) {
        pthread_mutex_lock(&r->mu);
        r->other_waiting = 1;
        pthread_cond_broadcast(&r->cv);
        pthread_mutex_unlock(&r->mu);
        return;
    }
    if (strcmp(point, r->point) != 0 || store != r->b || !r->armed)
        return;
    r->armed = 0;
    assert_int_equal(pthread_create(&r->thread, NULL, r->other, r), 0);
    r->started = 1;
    /* bounded: a regression (the other operation blocked on something this
     * thread holds, not the write lock) fails the test instead of hanging
     * `make test`; race_finish reports it once B has let go */
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 30;
    pthread_mutex_lock(&r->mu);
    while (!r->other_done && !r->other_waiting)
        if (pthread_cond_timedwait(&r->cv, &r->mu, &until) == ETIMEDOUT) {
            r->timed_out = 1;
            break;
        }
    pthread_mutex_unlock(&r->mu);
}

static void race_other_finished(race *r)
{
    pthread_mutex_lock(&r->mu);
    r->other_done = 1;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

typedef struct delete_args {
    md_store *a;
    md_status st;
    md_err err;
} delete_args;

static void *delete_v1_on_a(void *p)
{
    race *r = p;
    delete_args *d = r->other_arg;
    d->st = md_store_delete_version(d->a, "m1", 1, 1, &d->err);
    race_other_finished(r);
    return NULL;
}

typedef struct open_args {
    const char *dir;
    md_store *opened;
    md_status st;
    md_err err;
} open_args;

static void *open_replica(void *p)
{
    race *r = p;
    open_args *o = r->other_arg;
    o->st = md_store_open_index(o->dir, index_url, &o->opened, &o->err);
    race_other_finished(r);
    return NULL;
}

static void race_init(race *r, md_store *b, void *(*other)(void *), void *arg)
{
    memset(r, 0, sizeof *r);
    r->b = b;
    r->armed = 1;
    r->point = "add_blob_decided";
    r->other = other;
    r->other_arg = arg;
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    md_store_set_test_hook(race_hook, r);
}

static void race_finish(race *r)
{
    assert_true(r->started);
    pthread_join(r->thread, NULL);
    if (r->timed_out)
        fail_msg("replica A's operation neither finished nor waited for the write lock within "
                 "30 s while B was held");
    md_store_set_test_hook(NULL, NULL);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
}

/* A deletes the last row of bytes X (its GC wants to unlink blobs/X) while
 * B adds a row for the same bytes X. */
static void test_replica_gc_waits_for_add_of_same_bytes(void **state)
{
    fx *f = *state;
    bytes mlp = fixture("mlp.pt");
    char sm[MD_SHA256_HEX];
    sha_hex(mlp.data, mlp.len, sm);
    md_store *a = NULL, *b = NULL;
    open_store(f, &a);
    open_store(f, &b);
    assert_int_equal(add(a, "m1", &mlp, 0, NULL, 1), 1);
    assert_true(blob_exists(f, sm));

    delete_args d = {.a = a};
    race r;
    race_init(&r, b, delete_v1_on_a, &d);
    assert_int_equal(add(b, "m2", &mlp, 0, NULL, 1), 1); /* held in the hook */
    race_finish(&r);
    assert_int_equal(d.st, MD_OK);

    /* what a user sees: B's version has its file, from either handle */
    char path[4096], sha[MD_SHA256_HEX];
    md_err err;
    assert_int_equal(md_store_blob_path(a, "m2", 1, path, sizeof path, sha, &err), MD_OK);
    assert_string_equal(sha, sm);
    assert_true(access(path, R_OK) == 0);
    assert_true(blob_exists(f, sm));
    json_t *gone = NULL;
    assert_int_equal(md_store_get_version(a, "m1", 1, &gone, &err), MD_ENOTFOUND);
    /* and once B's row goes too, the file goes */
    assert_int_equal(md_store_delete_version(b, "m2", 1, 1, &err), MD_OK);
    assert_false(blob_exists(f, sm));
    md_store_close(a);
    md_store_close(b);
    free(mlp.data);
}

/* A replica starting (its orphan sweep) while B adds a row for bytes that sit
 * in blobs/ unreferenced and older than the sweep's grace period. */
static void test_replica_sweep_waits_for_add_of_orphan_bytes(void **state)
{
    fx *f = *state;
    bytes mlp = fixture("mlp.pt");
    char sm[MD_SHA256_HEX];
    sha_hex(mlp.data, mlp.len, sm);
    md_store *b = NULL;
    open_store(f, &b);
    /* an orphan: the same bytes in blobs/, no row, an hour old */
    char rel[128], path[512];
    snprintf(rel, sizeof rel, "blobs/%s", sm);
    snprintf(path, sizeof path, "%s/%s", f->dir, rel);
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    assert_int_equal(fwrite(mlp.data, 1, mlp.len, fp), mlp.len);
    fclose(fp);
    struct timeval tv[2];
    gettimeofday(&tv[0], NULL);
    tv[0].tv_sec -= 3600;
    tv[1] = tv[0];
    assert_int_equal(utimes(path, tv), 0);

    open_args o = {.dir = f->dir};
    race r;
    race_init(&r, b, open_replica, &o);
    assert_int_equal(add(b, "m", &mlp, 0, NULL, 1), 1); /* reuses the orphan; held */
    race_finish(&r);
    assert_int_equal(o.st, MD_OK);

    md_err err;
    char got[4096], sha[MD_SHA256_HEX];
    assert_int_equal(md_store_blob_path(o.opened, "m", 1, got, sizeof got, sha, &err), MD_OK);
    assert_true(access(got, R_OK) == 0);
    md_store_close(o.opened);
    md_store_close(b);
    free(mlp.data);
}

/* md_store_set_default checks the version and moves the default in one
 * write transaction: a replica deleting that version meanwhile waits, and
 * then finds it is the default. Had the check and the move been two
 * autocommits, the delete would land between them and the default would
 * name a version that no longer exists. */
static void *delete_v2_on_a(void *p)
{
    race *r = p;
    delete_args *d = r->other_arg;
    d->st = md_store_delete_version(d->a, "m", 2, 0, &d->err);
    race_other_finished(r);
    return NULL;
}

static void test_replica_delete_waits_for_set_default(void **state)
{
    fx *f = *state;
    bytes mlp = fixture("mlp.pt");
    md_store *a = NULL, *b = NULL;
    open_store(f, &a);
    open_store(f, &b);
    assert_int_equal(add(a, "m", &mlp, 0, NULL, 1), 1);
    assert_int_equal(add(a, "m", &mlp, 0, NULL, 0), 2);
    delete_args d = {.a = a};
    race r;
    race_init(&r, b, delete_v2_on_a, &d);
    r.point = "set_default_checked";
    md_err err;
    assert_int_equal(md_store_set_default(b, "m", 2, &err), MD_OK); /* held in the hook */
    race_finish(&r);
    assert_int_equal(d.st, MD_ECONFLICT);
    assert_string_equal(md_err_code(&d.err), "version_is_default");
    int dv = default_version(a, "m");
    assert_int_equal(dv, 2);
    json_t *v = NULL;
    assert_int_equal(md_store_get_version(a, "m", dv, &v, &err), MD_OK);
    json_decref(v);
    md_store_close(a);
    md_store_close(b);
    free(mlp.data);
}

static void test_version_conflict_keeps_nothing(void **state)
{
    fx *f = *state;
    bytes mlp = fixture("mlp.pt"), cnn = fixture("cnn.pt");
    char sc[MD_SHA256_HEX];
    sha_hex(cnn.data, cnn.len, sc);
    md_store *s = NULL;
    open_store(f, &s);
    assert_int_equal(add(s, "m", &mlp, 7, NULL, 1), 7);
    long long gen = md_store_generation(s);
    md_err err;
    md_err_clear(&err);
    md_blob_writer *w = write_blob(s, &cnn, 4096);
    char sha[MD_SHA256_HEX];
    long long size;
    assert_int_equal(md_blob_finish(w, NULL, sha, &size, &err), MD_OK);
    md_version_spec spec = {.model = "m", .version = 7, .sha256 = sha, .size = size,
                            .source = "upload", .make_default = 1};
    json_t *out = (json_t *)0x1;
    assert_int_equal(md_store_add_version(s, &spec, w, &out, &err), MD_ECONFLICT);
    assert_null(out);
    assert_string_equal(md_err_code(&err), "version_exists");
    assert_false(blob_exists(f, sc));
    assert_int_equal(count_dir(f, "tmp"), 0);
    assert_int_equal(count_dir(f, "blobs"), 1);
    assert_int_equal(md_store_generation(s), gen);
    assert_int_equal(default_version(s, "m"), 7);
    /* the next number follows the highest */
    assert_int_equal(add(s, "m", &cnn, 0, NULL, 1), 8);
    md_store_close(s);
    free(mlp.data);
    free(cnn.data);
}

/* ---- a failing index (SQLite's testvfs, for either backend) ----
 *
 * A pass-through ops table over the real one that fails the Nth call of
 * begin, commit, exec or step with MD_EUNAVAIL (as a lost PostgreSQL
 * connection does): every error path of an add is taken in turn. */
static const md_index_ops *real_ops;
static int fault_at, fault_calls, fault_hit;

static int fault_now(void) { return ++fault_calls == fault_at ? (fault_hit = 1) : 0; }
static md_status f_map_error(md_index *ix, const char *what, md_err *err)
{
    if (fault_hit) {
        fault_hit = 0;
        return md_err_setc(err, MD_EUNAVAIL, "index_unavailable", "injected failure: %s", what);
    }
    return real_ops->map_error(ix, what, err);
}
static md_status f_begin(md_index *ix, md_err *err)
{
    return fault_now() ? f_map_error(ix, "begin", err) : real_ops->begin(ix, err);
}
static md_status f_commit(md_index *ix, md_err *err)
{
    if (fault_now()) {
        real_ops->rollback(ix); /* a commit that failed committed nothing */
        return f_map_error(ix, "commit", err);
    }
    return real_ops->commit(ix, err);
}
static md_status f_exec(md_index *ix, const char *sql, md_err *err)
{
    return fault_now() ? f_map_error(ix, "exec", err) : real_ops->exec(ix, sql, err);
}
static int f_step(md_ixstmt *st) { return fault_now() ? MD_IX_ERROR : real_ops->step(st); }

static void fault_install(md_store *s, md_index_ops *ops, int at)
{
    md_index *ix = md_store_index_for_test(s);
    real_ops = ix->ops;
    *ops = *real_ops;
    ops->begin = f_begin;
    ops->commit = f_commit;
    ops->exec = f_exec;
    ops->step = f_step;
    ops->map_error = f_map_error;
    assert_null(md_index_ops_missing(ops));
    fault_at = at;
    fault_calls = 0;
    fault_hit = 0;
    ix->ops = ops;
}

static void fault_remove(md_store *s)
{
    md_store_index_for_test(s)->ops = real_ops;
    fault_at = 0;
}

/* An add failing at each of its index calls in turn leaves the store as it
 * was (no row, no new blob, the default and generation unmoved) or, when
 * the failure came after its commit (the blob collection), the new row
 * whole with its blob; the next add gets the next number either way. */
static void test_add_version_fails_at_every_index_call(void **state)
{
    fx *f = *state;
    bytes mlp = fixture("mlp.pt"), cnn = fixture("cnn.pt");
    char sc[MD_SHA256_HEX];
    sha_hex(cnn.data, cnn.len, sc);
    md_store *s = NULL;
    open_store(f, &s);
    assert_int_equal(add(s, "m", &mlp, 0, NULL, 1), 1);
    md_index_ops ops;
    int failed = 0;
    for (int at = 1; at < 200; at++) {
        long long gen = md_store_generation(s);
        md_err err;
        md_err_clear(&err);
        md_blob_writer *w = write_blob(s, &cnn, 4096);
        char sha[MD_SHA256_HEX];
        long long size;
        assert_int_equal(md_blob_finish(w, NULL, sha, &size, &err), MD_OK);
        md_version_spec spec = {.model = "m", .sha256 = sha, .size = size, .source = "upload",
                                .make_default = 1};
        json_t *out = NULL;
        fault_install(s, &ops, at);
        md_status rc = md_store_add_version(s, &spec, w, &out, &err);
        int reached = fault_calls >= at;
        fault_remove(s);
        json_t *m = NULL;
        assert_int_equal(md_store_get_model(s, "m", &m, &err), MD_OK);
        size_t nv = json_array_size(json_object_get(m, "versions"));
        if (rc != MD_OK) {
            failed++;
            assert_null(out);
            assert_int_equal(err.status, MD_EUNAVAIL);
            assert_int_equal(nv, 1); /* nothing half-applied */
            assert_int_equal(md_store_generation(s), gen);
            assert_int_equal(default_version(s, "m"), 1);
            assert_false(blob_exists(f, sc));
        } else {
            assert_non_null(out);
            json_decref(out);
            assert_int_equal(nv, 2);
            assert_true(blob_exists(f, sc));
            /* back to one version for the next round */
            assert_int_equal(md_store_set_default(s, "m", 1, &err), MD_OK);
            int v = (int)json_integer_value(
                json_object_get(json_array_get(json_object_get(m, "versions"), 1), "version"));
            assert_int_equal(md_store_delete_version(s, "m", v, 0, &err), MD_OK);
            assert_false(blob_exists(f, sc));
        }
        assert_int_equal(count_dir(f, "tmp"), 0);
        json_decref(m);
        if (!reached)
            break; /* the add made fewer calls than `at`: every one has failed once */
    }
    assert_true(failed >= 5);
    /* the next add still gets a number one past the last ever given */
    int next = add(s, "m", &cnn, 0, NULL, 1);
    assert_true(next >= 2);
    md_store_close(s);
    free(mlp.data);
    free(cnn.data);
}

/* A read the index fails (PostgreSQL restarting) is never "not found" nor
 * an empty or shorter list: a 404 there would be remembered by the server,
 * and its store sync would unload a model the store still has. */
static void test_failed_reads_are_not_not_found(void **state)
{
    fx *f = *state;
    bytes mlp = fixture("mlp.pt");
    md_store *s = NULL;
    open_store(f, &s);
    assert_int_equal(add(s, "m", &mlp, 0, NULL, 1), 1);
    md_err err;
    json_t *spec = json_pack("{s:s}", "input", "x");
    assert_int_equal(md_store_job_create(s, "j1", "m", 0, spec, "/o1", &err), MD_OK);
    json_decref(spec);
    md_index_ops ops;
    for (int read = 0; read < 8; read++) {
        int failed = 0;
        for (int at = 1; at < 20; at++) {
            json_t *out = NULL;
            char sha[MD_SHA256_HEX];
            md_err_clear(&err);
            fault_install(s, &ops, at);
            md_status rc;
            switch (read) {
            case 0: rc = md_store_get_model(s, "m", &out, &err); break;
            case 1: rc = md_store_get_version(s, "m", 1, &out, &err); break;
            case 2: rc = md_store_list_versions(s, "m", NULL, 1, &out, &err); break;
            case 3: rc = md_store_defaults(s, &out, &err); break;
            case 4: rc = md_store_list_models(s, NULL, 10, &out, &err); break;
            case 5: rc = md_store_architecture(s, "m", sha, &err); break;
            case 6: rc = md_store_traffic_all(s, &out, &err); break;
            default: rc = md_store_job_get(s, "j1", &out, &err); break;
            }
            int reached = fault_calls >= at;
            fault_remove(s);
            if (rc != MD_OK) {
                failed++;
                /* 5: no architecture is a real "not found" once the read worked */
                if (!(read == 5 && strcmp(md_err_code(&err), "no_architecture") == 0)) {
                    assert_int_equal(rc, MD_EUNAVAIL);
                    assert_string_equal(md_err_code(&err), "index_unavailable");
                }
                assert_null(out);
            } else if (read == 3 || read == 4) {
                json_t *list = read == 3 ? out : json_object_get(out, "models");
                assert_int_equal(json_array_size(list), 1);
            }
            json_decref(out);
            if (!reached)
                break;
        }
        assert_true(failed >= 1);
    }
    md_store_close(s);
    free(mlp.data);
}

/* ---- crash points ---- */

/* (a) bytes written to tmp/ but never finished: swept at the next open when
 * they belong to this process or to one that is gone, kept for a live one. */
static void test_crash_unfinished_temp_file(void **state)
{
    fx *f = *state;
    bytes mlp = fixture("mlp.pt");
    md_store *s = NULL;
    open_store(f, &s);
    md_blob_writer *w = write_blob(s, &mlp, 1024);
    assert_int_equal(count_dir(f, "tmp"), 1);

    /* a dead process's upload: find a pid that is not running */
    long dead = 999999;
    while (kill((pid_t)dead, 0) == 0 || errno != ESRCH)
        dead--;
    char name[128];
    snprintf(name, sizeof name, "tmp/upload-%ld-AbCdEf", dead);
    touch(f, name, 0);
    /* a live process's (pid 1 is always there): another replica writing */
    touch(f, "tmp/upload-1-XyZzY1", 0);
    /* something that is no upload at all */
    touch(f, "tmp/stray", 0);
    assert_int_equal(count_dir(f, "tmp"), 4);

    /* "crash": close without finishing or aborting, then reopen */
    md_store_close(s);
    open_store(f, &s);
    assert_false(exists(f, name));
    assert_false(exists(f, "tmp/stray"));
    assert_true(exists(f, "tmp/upload-1-XyZzY1"));
    assert_int_equal(count_dir(f, "tmp"), 1); /* our own upload-<pid>- file went too */
    assert_int_equal(count_dir(f, "blobs"), 0);
    json_t *out = NULL;
    md_err err;
    assert_int_equal(md_store_list_models(s, NULL, 10, &out, &err), MD_OK);
    assert_int_equal(json_array_size(json_object_get(out, "models")), 0);
    json_decref(out);
    md_blob_abort(w); /* frees the orphaned writer; its file is already gone */
    md_store_close(s);
    free(mlp.data);
}

/* (b) a blob renamed into blobs/ but its row never committed: swept once
 * older than the grace period; a fresh one (an upload in progress in another
 * replica) and an old one that a row references are kept. */
static void test_crash_blob_without_row(void **state)
{
    fx *f = *state;
    bytes mlp = fixture("mlp.pt");
    char sm[MD_SHA256_HEX];
    sha_hex(mlp.data, mlp.len, sm);
    md_store *s = NULL;
    open_store(f, &s);
    assert_int_equal(add(s, "m", &mlp, 0, NULL, 1), 1);
    md_store_close(s);

    char old[80], fresh[80], used[80];
    snprintf(old, sizeof old, "blobs/%064d", 1);
    snprintf(fresh, sizeof fresh, "blobs/%064d", 2);
    snprintf(used, sizeof used, "blobs/%s", sm);
    touch(f, old, 700);
    touch(f, fresh, 0);
    /* the referenced blob, made old too (its bytes kept: only the times change) */
    char path[512];
    snprintf(path, sizeof path, "%s/%s", f->dir, used);
    struct timeval tv[2];
    gettimeofday(&tv[0], NULL);
    tv[0].tv_sec -= 7000;
    tv[1] = tv[0];
    assert_int_equal(utimes(path, tv), 0);

    open_store(f, &s);
    assert_false(exists(f, old));
    assert_true(exists(f, fresh));
    assert_true(exists(f, used));
    md_err err;
    json_t *v = NULL;
    assert_int_equal(md_store_get_version(s, "m", 1, &v, &err), MD_OK);
    assert_string_equal(json_string_value(json_object_get(v, "state")), "stored");
    json_decref(v);
    md_store_close(s);
    free(mlp.data);
}

/* (c) a row whose blob is gone: marked failed with a reason naming it missing. */
static void test_crash_row_without_blob(void **state)
{
    fx *f = *state;
    bytes mlp = fixture("mlp.pt"), cnn = fixture("cnn.pt");
    char sc[MD_SHA256_HEX];
    sha_hex(cnn.data, cnn.len, sc);
    md_store *s = NULL;
    open_store(f, &s);
    assert_int_equal(add(s, "m", &mlp, 0, NULL, 1), 1);
    assert_int_equal(add(s, "m", &cnn, 0, NULL, 0), 2);
    md_store_close(s);
    char rel[80], path[512];
    snprintf(rel, sizeof rel, "blobs/%s", sc);
    snprintf(path, sizeof path, "%s/%s", f->dir, rel);
    assert_int_equal(unlink(path), 0);

    open_store(f, &s);
    md_err err;
    json_t *v = NULL;
    assert_int_equal(md_store_get_version(s, "m", 2, &v, &err), MD_OK);
    assert_string_equal(json_string_value(json_object_get(v, "state")), "failed");
    const char *reason = json_string_value(json_object_get(v, "state_reason"));
    assert_non_null(reason);
    if (!strstr(reason, "missing"))
        fail_msg("state_reason does not say missing: %s", reason);
    json_decref(v);
    assert_int_equal(md_store_get_version(s, "m", 1, &v, &err), MD_OK);
    assert_string_equal(json_string_value(json_object_get(v, "state")), "stored");
    json_decref(v);
    /* a failed version cannot become the default */
    md_err_clear(&err);
    assert_int_equal(md_store_set_default(s, "m", 2, &err), MD_ECONFLICT);
    assert_int_equal(default_version(s, "m"), 1);
    md_store_close(s);

    /* reopening again keeps it failed (and its reason) */
    open_store(f, &s);
    assert_int_equal(md_store_get_version(s, "m", 2, &v, &err), MD_OK);
    assert_string_equal(json_string_value(json_object_get(v, "state")), "failed");
    assert_non_null(strstr(json_string_value(json_object_get(v, "state_reason")), "missing"));
    json_decref(v);
    md_store_close(s);
    free(mlp.data);
    free(cnn.data);
}

/* ---- the archive check ---- */

static void test_archive_check_fixtures(void **state)
{
    fx *f = *state;
    md_err err;
    md_err_clear(&err);
    assert_int_equal(md_archive_check(FIXTURES "/mlp.pt", &err), MD_OK);
    assert_int_equal(md_archive_check(FIXTURES "/cnn.pt", &err), MD_OK);
    const char *bad[] = {FIXTURES "/not_a_model.pt", FIXTURES "/zip_not_torchscript.pt"};
    for (int i = 0; i < 2; i++) {
        md_err_clear(&err);
        assert_int_equal(md_archive_check(bad[i], &err), MD_EUNPROC);
        assert_string_equal(md_err_code(&err), "invalid_checkpoint");
        assert_non_null(strstr(err.msg, "torch.jit.save"));
    }
    /* a truncated archive (the central directory cut off) */
    bytes mlp = fixture("mlp.pt");
    char path[512];
    snprintf(path, sizeof path, "%s/half.pt", f->dir);
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    assert_int_equal(fwrite(mlp.data, 1, mlp.len / 2, fp), mlp.len / 2);
    fclose(fp);
    md_err_clear(&err);
    assert_int_equal(md_archive_check(path, &err), MD_EUNPROC);
    /* a file that is not there */
    md_err_clear(&err);
    assert_int_equal(md_archive_check("/nonexistent/model.pt", &err), MD_EIO);
    free(mlp.data);
}

/* ---- retention ---- */

/* Traffic splits (issue 28): checked, stored in one transaction that bumps
 * the generation, refused for a missing or failed version, shown by
 * get_model and traffic_all, and a version with a share is neither deleted
 * nor collected by retention; null clears the split and its header. */
static void test_traffic_split(void **state)
{
    fx *f = *state;
    bytes mlp = fixture("mlp.pt");
    md_store *s = NULL;
    open_store(f, &s);
    md_err err;
    md_err_clear(&err);
    for (int i = 0; i < 3; i++)
        add(s, "t", &mlp, 0, NULL, 1); /* versions 1..3, 3 the default */
    const char *bad[] = {"{\"1\": 50, \"2\": 40}", "{\"x\": 100}", "{\"0\": 100}",
                         "{\"1\": 100.0}", "{}", "[1]", "{\"1\": 101, \"2\": -1}"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        json_t *t = json_loads(bad[i], JSON_DECODE_ANY, NULL);
        assert_int_equal(md_traffic_check(t, NULL, &err), MD_EINVAL);
        assert_string_equal(md_err_code(&err), "invalid_traffic");
        json_decref(t);
    }
    json_t *hdr = json_string("X User");
    assert_int_equal(md_traffic_check(NULL, hdr, &err), MD_EINVAL);
    json_decref(hdr);

    long long gen = md_store_generation(s);
    json_t *t = json_loads("{\"1\": 90, \"2\": 10}", 0, NULL);
    json_t *missing = json_loads("{\"1\": 90, \"7\": 10}", 0, NULL);
    assert_int_equal(md_store_set_traffic(s, "t", missing, NULL, NULL, NULL, &err), MD_ENOTFOUND);
    assert_string_equal(md_err_code(&err), "version_not_found");
    assert_int_equal(md_store_set_traffic(s, "nope", t, NULL, NULL, NULL, &err), MD_ENOTFOUND);
    assert_string_equal(md_err_code(&err), "model_not_found");
    assert_int_equal(md_store_generation(s), gen); /* nothing changed */
    assert_int_equal(md_store_set_state(s, "t", 2, "failed", "broken", &err), MD_OK);
    assert_int_equal(md_store_set_traffic(s, "t", t, NULL, NULL, NULL, &err), MD_ECONFLICT);
    assert_string_equal(md_err_code(&err), "version_failed");
    assert_int_equal(md_store_set_state(s, "t", 2, "ready", NULL, &err), MD_OK);
    gen = md_store_generation(s);
    hdr = json_string("X-User-Id");
    assert_int_equal(md_store_set_traffic(s, "t", t, hdr, NULL, NULL, &err), MD_OK);
    assert_true(md_store_generation(s) > gen); /* replicas see it */

    json_t *m = NULL;
    assert_int_equal(md_store_get_model(s, "t", &m, &err), MD_OK);
    assert_true(json_equal(json_object_get(m, "traffic"), t));
    assert_string_equal(json_string_value(json_object_get(m, "sticky_header")), "X-User-Id");
    json_decref(m);
    json_t *all = NULL;
    assert_int_equal(md_store_traffic_all(s, &all, &err), MD_OK);
    assert_int_equal(json_object_size(all), 1);
    assert_true(json_equal(json_object_get(json_object_get(all, "t"), "traffic"), t));
    json_decref(all);

    /* a version with a share stays: not deleted, not collected */
    assert_int_equal(md_store_delete_version(s, "t", 2, 1, &err), MD_ECONFLICT);
    assert_string_equal(md_err_code(&err), "version_in_traffic");
    json_t *pol = json_loads("{\"keep_last\": 1}", 0, NULL);
    assert_int_equal(md_store_set_retention(s, "t", pol, &err), MD_OK);
    json_decref(pol);
    int vs[8];
    assert_int_equal(versions(s, "t", vs, 8), 3); /* 1 and 2 have shares, 3 the default */

    /* null clears the split and its header */
    json_t *null = json_null();
    assert_int_equal(md_store_set_traffic(s, "t", null, NULL, NULL, NULL, &err), MD_OK);
    assert_int_equal(md_store_get_model(s, "t", &m, &err), MD_OK);
    assert_true(json_is_null(json_object_get(m, "traffic")));
    assert_true(json_is_null(json_object_get(m, "sticky_header")));
    json_decref(m);
    assert_int_equal(md_store_traffic_all(s, &all, &err), MD_OK);
    assert_int_equal(json_object_size(all), 0);
    json_decref(all);
    assert_int_equal(md_store_delete_version(s, "t", 2, 0, &err), MD_OK);

    /* a verdict applies only to the split it judged: one replica acts */
    json_t *split = json_loads("{\"1\": 50, \"3\": 50}", 0, NULL);
    json_t *note = json_pack("{s:s,s:s}", "by", "api", "reason", "canary");
    assert_int_equal(md_store_set_traffic(s, "t", split, NULL, NULL, note, &err), MD_OK);
    json_t *judge = json_pack("{s:s,s:s}", "by", "promote_when", "reason", "met");
    assert_int_equal(md_store_apply_verdict(s, "t", t /* not the split */, 1, null, judge, &err),
                     MD_ECONFLICT);
    assert_string_equal(md_err_code(&err), "traffic_changed");
    assert_int_equal(default_version(s, "t"), 3);
    assert_int_equal(md_store_apply_verdict(s, "t", split, 1, null, judge, &err), MD_OK);
    assert_int_equal(default_version(s, "t"), 1);
    assert_int_equal(md_store_apply_verdict(s, "t", split, 1, null, judge, &err), MD_ECONFLICT);
    json_t *h = NULL;
    assert_int_equal(md_store_history(s, "t", &h, &err), MD_OK);
    /* the three deploys moved the default (each one recorded), then the
     * changes made with a note: the split, then the verdict */
    assert_int_equal(json_array_size(h), 5);
    assert_string_equal(json_string_value(json_object_get(json_array_get(h, 0), "by")),
                        "deploy");
    assert_string_equal(json_string_value(json_object_get(json_array_get(h, 0), "reason")),
                        "deployed as the default");
    assert_string_equal(json_string_value(json_object_get(json_array_get(h, 3), "reason")),
                        "canary");
    json_t *last = json_array_get(h, 4);
    assert_string_equal(json_string_value(json_object_get(last, "by")), "promote_when");
    assert_int_equal(json_integer_value(json_object_get(json_object_get(last, "change"),
                                                        "default_version")),
                     1);
    json_decref(h);
    json_decref(judge);
    json_decref(note);
    json_decref(split);
    json_decref(null);
    json_decref(hdr);
    json_decref(t);
    json_decref(missing);
    md_store_close(s);
    free(mlp.data);
}

static void test_retention_keep_last(void **state)
{
    fx *f = *state;
    bytes mlp = fixture("mlp.pt"), cnn = fixture("cnn.pt");
    char sm[MD_SHA256_HEX], sc[MD_SHA256_HEX];
    sha_hex(mlp.data, mlp.len, sm);
    sha_hex(cnn.data, cnn.len, sc);
    md_store *s = NULL;
    open_store(f, &s);
    md_err err;
    md_err_clear(&err);
    assert_int_equal(add(s, "r", &mlp, 0, NULL, 1), 1); /* the default */
    json_t *pol = json_loads("{\"keep_last\": 2}", 0, NULL);
    assert_int_equal(md_store_set_retention(s, "r", pol, &err), MD_OK);
    json_decref(pol);
    for (int i = 0; i < 4; i++) /* 2..5: cnn, cnn, cnn, mlp */
        add(s, "r", i == 3 ? &mlp : &cnn, 0, NULL, 0);
    int vs[8];
    assert_int_equal(versions(s, "r", vs, 8), 3);
    assert_int_equal(vs[0], 1);
    assert_int_equal(vs[1], 4);
    assert_int_equal(vs[2], 5);
    assert_int_equal(default_version(s, "r"), 1);
    assert_true(blob_exists(f, sm));
    assert_true(blob_exists(f, sc));

    /* a tighter policy applies at once; the default is never removed */
    pol = json_loads("{\"keep_last\": 1}", 0, NULL);
    assert_int_equal(md_store_set_retention(s, "r", pol, &err), MD_OK);
    json_decref(pol);
    assert_int_equal(versions(s, "r", vs, 8), 2);
    assert_int_equal(vs[0], 1);
    assert_int_equal(vs[1], 5);
    assert_false(blob_exists(f, sc)); /* version 4 was the last cnn user */

    /* retention is reported by get_model, and null clears it */
    json_t *m = NULL;
    assert_int_equal(md_store_get_model(s, "r", &m, &err), MD_OK);
    assert_int_equal(json_integer_value(json_object_get(json_object_get(m, "retention"),
                                                        "keep_last")),
                     1);
    json_decref(m);
    assert_int_equal(md_store_set_retention(s, "r", json_null(), &err), MD_OK);
    for (int i = 0; i < 3; i++)
        add(s, "r", &cnn, 0, NULL, 0);
    assert_int_equal(versions(s, "r", vs, 8), 5);

    /* on a model that is not there */
    pol = json_loads("{\"keep_last\": 1}", 0, NULL);
    assert_int_equal(md_store_set_retention(s, "nope", pol, &err), MD_ENOTFOUND);
    json_decref(pol);
    md_store_close(s);
    free(mlp.data);
    free(cnn.data);
}

static void test_retention_keep_best(void **state)
{
    fx *f = *state;
    bytes mlp = fixture("mlp.pt");
    md_store *s = NULL;
    open_store(f, &s);
    md_err err;
    md_err_clear(&err);
    assert_int_equal(add(s, "b", &mlp, 0, "{\"loss\": 0.5}", 1), 1);
    assert_int_equal(add(s, "b", &mlp, 0, "{\"loss\": 0.3}", 0), 2);
    assert_int_equal(add(s, "b", &mlp, 0, "{\"loss\": 0.9}", 0), 3);
    assert_int_equal(add(s, "b", &mlp, 0, "{\"loss\": 0.1}", 0), 4);
    assert_int_equal(add(s, "b", &mlp, 0, "{\"acc\": 0.99}", 0), 5); /* no loss */
    json_t *pol =
        json_loads("{\"keep_best\": 2, \"metric\": \"metrics.loss\", \"order\": \"asc\"}", 0, NULL);
    assert_int_equal(md_store_set_retention(s, "b", pol, &err), MD_OK);
    json_decref(pol);
    int vs[8];
    /* the two lowest losses (4, 2) and the default (1) */
    assert_int_equal(versions(s, "b", vs, 8), 3);
    assert_int_equal(vs[0], 1);
    assert_int_equal(vs[1], 2);
    assert_int_equal(vs[2], 4);
    md_store_close(s);
    free(mlp.data);
}

/* A version that the model's own policy prunes in the transaction that adds
 * it: add_version answers MD_OK, so it must describe the version it added
 * (the HTTP layer answers 201 with it and a Location built from it). */
static void test_add_version_pruned_by_keep_best(void **state)
{
    fx *f = *state;
    bytes mlp = fixture("mlp.pt");
    md_store *s = NULL;
    open_store(f, &s);
    md_err err;
    md_err_clear(&err);
    assert_int_equal(add(s, "p", &mlp, 0, "{\"loss\": 0.5}", 1), 1);
    assert_int_equal(add(s, "p", &mlp, 0, "{\"loss\": 0.3}", 0), 2);
    json_t *pol = json_loads("{\"keep_best\": 1, \"metric\": \"metrics.loss\"}", 0, NULL);
    assert_int_equal(md_store_set_retention(s, "p", pol, &err), MD_OK);
    json_decref(pol);
    md_blob_writer *w = write_blob(s, &mlp, 4096);
    char sha[MD_SHA256_HEX];
    long long size;
    assert_int_equal(md_blob_finish(w, NULL, sha, &size, &err), MD_OK);
    json_t *metrics = json_loads("{\"loss\": 0.9}", 0, NULL);
    md_version_spec spec = {.model = "p", .sha256 = sha, .size = size, .source = "upload",
                            .metrics = metrics, .make_default = 0};
    json_t *out = NULL;
    md_status st = md_store_add_version(s, &spec, w, &out, &err);
    json_decref(metrics);
    int no_json = st == MD_OK && !out;
    json_int_t got = out ? json_integer_value(json_object_get(out, "version")) : 0;
    json_decref(out);
    int vs[8];
    int n = versions(s, "p", vs, 8);
    int tmp_left = count_dir(f, "tmp"), blobs = count_dir(f, "blobs");
    md_store_close(s);
    free(mlp.data);
    /* checked after the cleanup, so a failure leaks nothing under ASan */
    if (no_json)
        fail_msg("md_store_add_version returned MD_OK but no version JSON for a version its "
                 "retention policy pruned at once");
    if (st == MD_OK)
        assert_int_equal(got, 3);
    assert_int_equal(n, 2); /* 1 (default) and 2 (best) */
    assert_int_equal(vs[0], 1);
    assert_int_equal(vs[1], 2);
    assert_int_equal(tmp_left, 0);
    assert_int_equal(blobs, 1);
}

static void test_retention_check(void **state)
{
    (void)state;
    md_err err;
    const char *ok[] = {"null", "{}", "{\"keep_last\": 3}",
                        "{\"keep_best\": 1, \"metric\": \"metrics.loss\"}",
                        "{\"keep_best\": 1, \"metric\": \"metrics.acc\", \"order\": \"desc\"}",
                        "{\"keep_last\": 1, \"keep_best\": 1, \"metric\": \"metrics.f1\"}"};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        json_t *r = json_loads(ok[i], JSON_DECODE_ANY, NULL);
        md_err_clear(&err);
        if (md_retention_check(r, &err) != MD_OK)
            fail_msg("%s refused: %s", ok[i], err.msg);
        json_decref(r);
    }
    const char *bad[] = {"[]", "3", "{\"keep_last\": 0}", "{\"keep_last\": \"2\"}",
                         "{\"keep_best\": 2}", "{\"keep_best\": 2, \"metric\": \"loss\"}",
                         "{\"keep_best\": 2, \"metric\": \"metrics.a b\"}",
                         "{\"keep_last\": 1, \"order\": \"up\"}", "{\"keep\": 1}"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        json_t *r = json_loads(bad[i], JSON_DECODE_ANY, NULL);
        assert_non_null(r);
        md_err_clear(&err);
        if (md_retention_check(r, &err) != MD_EINVAL)
            fail_msg("%s accepted", bad[i]);
        assert_true(err.msg[0] != '\0');
        json_decref(r);
    }
}

/* ---- listing, ordering, defaults ---- */

static void test_list_versions_ordered_by_metrics(void **state)
{
    fx *f = *state;
    bytes mlp = fixture("mlp.pt");
    md_store *s = NULL;
    open_store(f, &s);
    add(s, "m", &mlp, 0, "{\"loss\": 0.5, \"acc\": 0.7}", 1);
    add(s, "m", &mlp, 0, "{\"loss\": 0.2, \"acc\": 0.9}", 1);
    add(s, "m", &mlp, 0, "{\"loss\": 0.9, \"acc\": 0.1}", 1);
    add(s, "m", &mlp, 0, NULL, 1); /* no metrics: last either way */
    add(s, "m", &mlp, 0, "{\"loss\": 0.35}", 1);
    struct {
        const char *by;
        int asc;
        int want[5];
    } cases[] = {
        {"metrics.loss", 1, {2, 5, 1, 3, 4}},
        {"metrics.loss", 0, {3, 1, 5, 2, 4}},
        {"metrics.acc", 0, {2, 1, 3, 5, 4}},
        {"version", 1, {1, 2, 3, 4, 5}},
        {"version", 0, {5, 4, 3, 2, 1}},
        {NULL, 1, {1, 2, 3, 4, 5}},
        {"created_at", 1, {1, 2, 3, 4, 5}},
    };
    md_err err;
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        json_t *out = NULL;
        md_err_clear(&err);
        if (md_store_list_versions(s, "m", cases[c].by, cases[c].asc, &out, &err) != MD_OK)
            fail_msg("order_by %s: %s", cases[c].by, err.msg);
        assert_int_equal(json_array_size(out), 5);
        for (int i = 0; i < 5; i++) {
            int got = (int)json_integer_value(json_object_get(json_array_get(out, i), "version"));
            if (got != cases[c].want[i])
                fail_msg("order_by %s %s: position %d is version %d, expected %d", cases[c].by,
                         cases[c].asc ? "asc" : "desc", i, got, cases[c].want[i]);
        }
        json_decref(out);
    }
    const char *bad[] = {"size", "metrics.", "metrics.a b", "metrics.x')--", "Version"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        json_t *out = NULL;
        md_err_clear(&err);
        assert_int_equal(md_store_list_versions(s, "m", bad[i], 1, &out, &err), MD_EINVAL);
        assert_null(out);
    }
    json_t *out = NULL;
    assert_int_equal(md_store_list_versions(s, "nope", NULL, 1, &out, &err), MD_ENOTFOUND);
    assert_string_equal(md_err_code(&err), "model_not_found");
    md_store_close(s);
    free(mlp.data);
}

static void test_list_models_pagination(void **state)
{
    fx *f = *state;
    bytes mlp = fixture("mlp.pt");
    md_store *s = NULL;
    open_store(f, &s);
    add(s, "gamma", &mlp, 0, NULL, 1);
    add(s, "alpha", &mlp, 0, NULL, 1);
    add(s, "beta", &mlp, 0, NULL, 1);
    add(s, "beta", &mlp, 0, NULL, 0);
    md_err err;
    json_t *out = NULL;
    assert_int_equal(md_store_list_models(s, NULL, 2, &out, &err), MD_OK);
    json_t *ms = json_object_get(out, "models");
    assert_int_equal(json_array_size(ms), 2);
    assert_string_equal(json_string_value(json_object_get(json_array_get(ms, 0), "name")),
                        "alpha");
    assert_string_equal(json_string_value(json_object_get(json_array_get(ms, 1), "name")), "beta");
    assert_int_equal(json_integer_value(json_object_get(json_array_get(ms, 1), "versions")), 2);
    assert_int_equal(
        json_integer_value(json_object_get(json_array_get(ms, 1), "default_version")), 1);
    assert_string_equal(json_string_value(json_object_get(out, "next")), "beta");
    json_decref(out);
    assert_int_equal(md_store_list_models(s, "beta", 2, &out, &err), MD_OK);
    ms = json_object_get(out, "models");
    assert_int_equal(json_array_size(ms), 1);
    assert_string_equal(json_string_value(json_object_get(json_array_get(ms, 0), "name")),
                        "gamma");
    assert_true(json_is_null(json_object_get(out, "next")));
    json_decref(out);
    /* exactly a page: no next */
    assert_int_equal(md_store_list_models(s, NULL, 3, &out, &err), MD_OK);
    assert_int_equal(json_array_size(json_object_get(out, "models")), 3);
    assert_true(json_is_null(json_object_get(out, "next")));
    json_decref(out);
    md_store_close(s);
    free(mlp.data);
}

static void test_defaults_and_generation(void **state)
{
    fx *f = *state;
    bytes mlp = fixture("mlp.pt"), cnn = fixture("cnn.pt");
    md_store *s = NULL;
    open_store(f, &s);
    md_err err;
    long long g0 = md_store_generation(s);
    add(s, "m", &mlp, 0, NULL, 1);
    add(s, "m", &cnn, 0, NULL, 0);
    add(s, "n", &cnn, 0, NULL, 0);
    long long g1 = md_store_generation(s);
    assert_true(g1 >= g0 + 3);
    assert_int_equal(default_version(s, "m"), 1);
    assert_int_equal(md_store_set_default(s, "m", 2, &err), MD_OK);
    assert_true(md_store_generation(s) > g1);
    assert_int_equal(default_version(s, "m"), 2);
    assert_int_equal(md_store_set_default(s, "m", 9, &err), MD_ENOTFOUND);
    assert_string_equal(md_err_code(&err), "version_not_found");
    assert_int_equal(md_store_set_default(s, "x", 1, &err), MD_ENOTFOUND);
    assert_string_equal(md_err_code(&err), "model_not_found");

    json_t *defs = NULL;
    assert_int_equal(md_store_defaults(s, &defs, &err), MD_OK);
    assert_int_equal(json_array_size(defs), 2);
    json_t *d0 = json_array_get(defs, 0);
    assert_string_equal(json_string_value(json_object_get(d0, "model")), "m");
    assert_int_equal(json_integer_value(json_object_get(d0, "version")), 2);
    assert_non_null(json_string_value(json_object_get(d0, "path")));
    json_decref(defs);

    assert_int_equal(md_store_set_state(s, "m", 2, "ready", NULL, &err), MD_OK);
    json_t *v = NULL;
    assert_int_equal(md_store_get_version(s, "m", 2, &v, &err), MD_OK);
    assert_string_equal(json_string_value(json_object_get(v, "state")), "ready");
    json_decref(v);
    assert_int_equal(md_store_set_state(s, "m", 3, "ready", NULL, &err), MD_ENOTFOUND);
    assert_int_equal(md_store_get_version(s, "m", 3, &v, &err), MD_ENOTFOUND);
    assert_string_equal(md_err_code(&err), "version_not_found");
    assert_int_equal(md_store_get_version(s, "zz", 1, &v, &err), MD_ENOTFOUND);
    assert_string_equal(md_err_code(&err), "model_not_found");
    char path[4096], sha[MD_SHA256_HEX];
    assert_int_equal(md_store_blob_path(s, "m", 7, path, sizeof path, sha, &err), MD_ENOTFOUND);
    md_store_close(s);
    free(mlp.data);
    free(cnn.data);
}

/* ---- names ---- */

/* owner_dead callback for the lease tests: "dead" names a dead holder */
static int dead_if_named_dead(const char *owner, void *ctx)
{
    (void)ctx;
    return strcmp(owner, "dead") == 0;
}

static void claim(md_store *s, const char *owner, double lease_s, const char *want)
{
    char id[64];
    md_err err;
    md_err_clear(&err);
    assert_int_equal(md_store_job_claim_next(s, owner, lease_s, dead_if_named_dead, NULL, id, &err),
                     MD_OK);
    if (strcmp(id, want) != 0)
        fail_msg("%s claimed \"%s\", expected \"%s\"", owner, id, want);
}

/* Leases: a job is claimed by one owner at a time, oldest first; a live lease
 * is respected, an expired or dead holder's job is taken over; only the
 * holder may update; a released job is claimable at once; cancel requests
 * reach the holder. */
static void test_job_leases(void **state)
{
    fx *f = *state;
    md_store *s = NULL;
    open_store(f, &s);
    md_err err;
    json_t *spec = json_pack("{s:s}", "model", "m");
    assert_int_equal(md_store_job_create(s, "j1", "m", 0, spec, "/o1", &err), MD_OK);
    assert_int_equal(md_store_job_create(s, "j2", "m", 0, spec, "/o2", &err), MD_OK);
    json_decref(spec);

    claim(s, "A", 1.0, "j1");
    claim(s, "B", 1.0, "j2"); /* j1 is A's */
    claim(s, "C", 30, "");    /* both leases live */
    int cancel = -1;
    assert_int_equal(md_store_job_update_owned(s, "j1", "A", 1.0, NULL, &cancel, &err), MD_OK);
    assert_int_equal(cancel, 0);
    assert_int_equal(md_store_job_update_owned(s, "j1", "B", 30, NULL, NULL, &err), MD_ECONFLICT);
    assert_string_equal(md_err_code(&err), "job_lease_lost");

    /* A renews j1; B goes silent: after its lease C takes j2, and B may no
     * longer write */
    usleep(600000);
    assert_int_equal(md_store_job_update_owned(s, "j1", "A", 1.0, NULL, NULL, &err), MD_OK);
    usleep(600000);
    claim(s, "C", 30, "j2");
    json_t *f1 = json_pack("{s:i}", "rows_done", 7);
    assert_int_equal(md_store_job_update_owned(s, "j2", "B", 30, f1, NULL, &err), MD_ECONFLICT);
    assert_int_equal(md_store_job_update_owned(s, "j2", "C", 30, f1, NULL, &err), MD_OK);
    json_decref(f1);
    json_t *job = NULL;
    assert_int_equal(md_store_job_get(s, "j2", &job, &err), MD_OK);
    assert_int_equal(json_integer_value(json_object_get(job, "rows_done")), 7);
    assert_string_equal(json_string_value(json_object_get(job, "owner")), "C");
    json_decref(job);

    /* released: claimable at once, lease or not */
    assert_int_equal(md_store_job_release(s, "j2", "C", &err), MD_OK);
    claim(s, "D", 30, "j2");
    /* a dead holder's job is taken over before its lease ends */
    sql_exec(f, "UPDATE jobs SET owner = 'dead', lease_until = 1e12 WHERE id = 'j2'");
    claim(s, "E", 30, "j2");

    /* cancel: a held job is flagged for its holder; an unheld queued one ends now */
    int now = -1;
    assert_int_equal(md_store_job_request_cancel(s, "j2", &now, &err), MD_OK);
    assert_int_equal(now, 0);
    assert_int_equal(md_store_job_update_owned(s, "j2", "E", 30, NULL, &cancel, &err), MD_OK);
    assert_int_equal(cancel, 1);
    spec = json_pack("{s:s}", "model", "m");
    assert_int_equal(md_store_job_create(s, "j3", "m", 0, spec, "/o3", &err), MD_OK);
    json_decref(spec);
    assert_int_equal(md_store_job_request_cancel(s, "j3", &now, &err), MD_OK);
    assert_int_equal(now, 1);
    assert_int_equal(md_store_job_get(s, "j3", &job, &err), MD_OK);
    assert_string_equal(json_string_value(json_object_get(job, "status")), "cancelled");
    json_decref(job);
    claim(s, "F", 30, ""); /* finished jobs are never claimed */
    md_store_close(s);
}


/* ---- download.c: where a URL or a path may lead ---- */

static int internal4(const char *ip)
{
    struct sockaddr_in a = {.sin_family = AF_INET};
    assert_int_equal(inet_pton(AF_INET, ip, &a.sin_addr), 1);
    return md_addr_is_internal((struct sockaddr *)&a);
}

static int internal6(const char *ip)
{
    struct sockaddr_in6 a = {.sin6_family = AF_INET6};
    assert_int_equal(inet_pton(AF_INET6, ip, &a.sin6_addr), 1);
    return md_addr_is_internal((struct sockaddr *)&a);
}

static void test_addr_is_internal(void **state)
{
    (void)state;
    const char *in4[] = {"127.0.0.1", "127.255.1.2", "10.1.2.3", "172.16.0.1", "172.31.255.255",
                         "192.168.1.1", "169.254.169.254", "0.0.0.0", "100.64.0.1",
                         "100.127.255.255", "198.18.0.1", "224.0.0.1", "255.255.255.255"};
    for (size_t i = 0; i < sizeof in4 / sizeof in4[0]; i++)
        if (!internal4(in4[i]))
            fail_msg("%s must count as internal", in4[i]);
    const char *out4[] = {"8.8.8.8", "172.32.0.1", "172.15.255.255", "100.128.0.1",
                          "169.253.1.1", "192.169.0.1", "1.1.1.1", "198.20.0.1"};
    for (size_t i = 0; i < sizeof out4 / sizeof out4[0]; i++)
        if (internal4(out4[i]))
            fail_msg("%s is a public address", out4[i]);
    const char *in6[] = {"::1", "::", "fc00::1", "fd12:3456::1", "fe80::1", "::ffff:127.0.0.1",
                         "::ffff:10.0.0.1", "::ffff:169.254.169.254", "64:ff9b::7f00:1",
                         "2002:7f00:1::", "ff02::1", "64:ff9b:1::a00:1", "::ffff:0:7f00:1",
                         "2001:0:4136:e378:8000:63bf:3fff:fdd2"};
    for (size_t i = 0; i < sizeof in6 / sizeof in6[0]; i++)
        if (!internal6(in6[i]))
            fail_msg("%s must count as internal", in6[i]);
    const char *out6[] = {"2001:4860:4860::8888", "::ffff:8.8.8.8", "2606:4700::1111"};
    for (size_t i = 0; i < sizeof out6 / sizeof out6[0]; i++)
        if (internal6(out6[i]))
            fail_msg("%s is a public address", out6[i]);
    /* an internal address written in the URL is refused before any fetch */
    const char *urls[] = {"http://127.0.0.1:8080/x", "http://[::1]/x", "https://10.0.0.5/x",
                          "http://169.254.169.254/latest/meta-data/", "http://[::ffff:7f00:1]/x"};
    for (size_t i = 0; i < sizeof urls / sizeof urls[0]; i++) {
        md_fetch_opts o = {0};
        md_err err;
        md_err_clear(&err);
        if (md_source_check(urls[i], &o, &err) != MD_EINVAL)
            fail_msg("%s should be refused", urls[i]);
        assert_string_equal(err.code, "source_not_allowed");
        assert_non_null(strstr(err.msg, "allow_private_urls"));
        o.allow_private = 1;
        assert_int_equal(md_source_check(urls[i], &o, &err), MD_OK);
    }
}

static void test_allowed_urls_compare_parsed_urls(void **state)
{
    (void)state;
    char *items[] = {"https://a.example", "https://b.example:8443/models/", "http://c.example/d",
                     NULL};
    md_strlist allowed = {.items = items, .count = 3};
    md_fetch_opts o = {.allowed_urls = &allowed};
    const char *ok[] = {"https://a.example/x.pt", "https://A.EXAMPLE/x.pt",
                        "https://a.example:443/x.pt", "https://b.example:8443/models/m.pt",
                        "http://c.example/d", "http://c.example/d/e.csv",
                        "https://b.example:8443/models/x/../m.pt"};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        md_err err;
        md_err_clear(&err);
        if (md_source_check(ok[i], &o, &err) != MD_OK)
            fail_msg("%s should be allowed: %s", ok[i], err.msg);
    }
    const char *refused[] = {
        "https://a.example.evil/x.pt",            /* the string-prefix trick */
        "https://a.example@evil.example/x.pt",    /* userinfo: the host is evil.example */
        "http://a.example/x.pt",                  /* another scheme */
        "https://a.example:8443/x.pt",            /* another port */
        "https://b.example:8443/modelsX/m.pt",    /* not on a segment boundary */
        "https://b.example:8443/models/../etc/x", /* dot segments out of the path */
        "https://b.example:8443/models/%2e%2e/x", /* encoded ones */
        "http://c.example/de.csv",
        "https://b.example/models/m.pt",          /* default port 443, not 8443 */
    };
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        md_err err;
        md_err_clear(&err);
        if (md_source_check(refused[i], &o, &err) != MD_EINVAL)
            fail_msg("%s should be refused", refused[i]);
        assert_string_equal(err.code, "source_not_allowed");
        assert_non_null(strstr(err.msg, "allowed_urls"));
    }
}

static void test_path_open_follows_no_symlink(void **state)
{
    (void)state;
    char base[] = "/tmp/md_path_XXXXXX";
    assert_non_null(mkdtemp(base));
    char allowed_dir[256], outside[256], p[512], q[512];
    snprintf(allowed_dir, sizeof allowed_dir, "%s/allowed", base);
    snprintf(outside, sizeof outside, "%s/outside", base);
    assert_int_equal(mkdir(allowed_dir, 0755), 0);
    assert_int_equal(mkdir(outside, 0755), 0);
    snprintf(p, sizeof p, "%s/secret", outside);
    FILE *f = fopen(p, "w");
    assert_non_null(f);
    fputs("secret\n", f);
    fclose(f);
    snprintf(p, sizeof p, "%s/sub", allowed_dir);
    assert_int_equal(mkdir(p, 0755), 0);
    snprintf(p, sizeof p, "%s/sub/data.csv", allowed_dir);
    f = fopen(p, "w");
    assert_non_null(f);
    fclose(f);
    snprintf(p, sizeof p, "%s/link", allowed_dir);
    snprintf(q, sizeof q, "%s/secret", outside);
    assert_int_equal(symlink(q, p), 0);
    snprintf(p, sizeof p, "%s/dirlink", allowed_dir);
    assert_int_equal(symlink(outside, p), 0);
    char *items[] = {allowed_dir, NULL};
    md_strlist allowed = {.items = items, .count = 1};
    md_err err;
    int fd;
    /* a real file below: opened */
    snprintf(p, sizeof p, "%s/sub/data.csv", allowed_dir);
    assert_int_equal(md_path_open_file(&allowed, "input.path", p, "input_not_found", &fd, &err), MD_OK);
    close(fd);
    /* a symlink as the file, as a directory, a "..", a path outside */
    const char *bad[] = {"/link", "/dirlink/secret", "/sub/../../outside/secret"};
    for (size_t i = 0; i < 3; i++) {
        snprintf(p, sizeof p, "%s%s", allowed_dir, bad[i]);
        md_err_clear(&err);
        fd = -1;
        if (md_path_open_file(&allowed, "input.path", p, "input_not_found", &fd, &err) == MD_OK)
            fail_msg("%s was opened through a symlink or ..", p);
        assert_int_equal(fd, -1);
        assert_non_null(strstr(err.msg, "input.path"));
    }
    md_err_clear(&err);
    assert_int_equal(md_path_open_file(&allowed, "input.path", q, "input_not_found", &fd, &err),
                     MD_EINVAL);
    assert_string_equal(err.code, "path_not_allowed");
    /* the output's directory through a symlink: refused too */
    int dirfd;
    const char *leaf;
    snprintf(p, sizeof p, "%s/dirlink/out.jsonl", allowed_dir);
    assert_int_equal(md_path_open_dir(&allowed, "output.path", p, "invalid_path", &dirfd, &leaf, &err),
                     MD_EINVAL);
    assert_string_equal(err.code, "path_not_allowed");
    snprintf(p, sizeof p, "%s/sub/out.jsonl", allowed_dir);
    assert_int_equal(md_path_open_dir(&allowed, "output.path", p, "invalid_path", &dirfd, &leaf, &err),
                     MD_OK);
    assert_string_equal(leaf, "out.jsonl");
    close(dirfd);
    nftw(base, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

/* "did you mean": the edit distances over every stored name are computed
 * with neither the store mutex nor a write transaction held (BEGIN
 * IMMEDIATE holds the write lock every replica shares). */
typedef struct hint_probe {
    const fx *f;
    md_store *s;
    int calls, write_lock_free, mutex_free;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int generation_read;
} hint_probe;

static void *read_generation(void *p)
{
    hint_probe *h = p;
    md_store_generation(h->s); /* takes the store mutex */
    pthread_mutex_lock(&h->mu);
    h->generation_read = 1;
    pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
    return NULL;
}

static void hint_hook(md_store *store, const char *point, void *ctx)
{
    hint_probe *h = ctx;
    if (strcmp(point, "hint") != 0 || store != h->s)
        return;
    h->calls++;
    /* another connection (a replica) can take the write lock at once */
    if (index_url) {
        char msg[512];
        if (pg_exec("BEGIN; SELECT 1/CASE WHEN pg_try_advisory_xact_lock(120282346121316) "
                    "THEN 1 ELSE 0 END; ROLLBACK",
                    msg, sizeof msg) == 0)
            h->write_lock_free++;
    }
    char path[512];
    snprintf(path, sizeof path, "%s/index.sqlite", h->f->dir);
    sqlite3 *db = NULL;
    if (!index_url && sqlite3_open(path, &db) == SQLITE_OK) {
        sqlite3_busy_timeout(db, 0);
        if (sqlite3_exec(db, "BEGIN IMMEDIATE", NULL, NULL, NULL) == SQLITE_OK) {
            h->write_lock_free++;
            sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL);
        }
    }
    sqlite3_close(db);
    /* another thread can take the store mutex (bounded wait: a held mutex
     * fails the check instead of hanging; the reader finishes after) */
    pthread_t t;
    h->generation_read = 0;
    assert_int_equal(pthread_create(&t, NULL, read_generation, h), 0);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 10;
    pthread_mutex_lock(&h->mu);
    while (!h->generation_read)
        if (pthread_cond_timedwait(&h->cv, &h->mu, &until) == ETIMEDOUT)
            break;
    h->mutex_free += h->generation_read;
    pthread_mutex_unlock(&h->mu);
    if (h->generation_read)
        pthread_join(t, NULL);
    else
        pthread_detach(t);
}

static void test_typo_hint_computed_outside_locks(void **state)
{
    fx *f = *state;
    bytes mlp = fixture("mlp.pt");
    md_store *s = NULL;
    open_store(f, &s);
    assert_int_equal(add(s, "fashion", &mlp, 0, NULL, 1), 1);
    hint_probe h = {.f = f, .s = s};
    pthread_mutex_init(&h.mu, NULL);
    pthread_cond_init(&h.cv, NULL);
    md_store_set_test_hook(hint_hook, &h);
    md_err err;
    json_t *out = NULL;
    assert_int_equal(md_store_set_default(s, "fashon", 1, &err), MD_ENOTFOUND);
    assert_non_null(strstr(err.msg, "did you mean fashion?"));
    assert_int_equal(md_store_delete_version(s, "fashon", 1, 0, &err), MD_ENOTFOUND);
    assert_non_null(strstr(err.msg, "did you mean fashion?"));
    assert_int_equal(md_store_set_retention(s, "fashon", json_null(), &err), MD_ENOTFOUND);
    assert_non_null(strstr(err.msg, "did you mean fashion?"));
    assert_int_equal(md_store_delete_model(s, "fashon", &err), MD_ENOTFOUND);
    assert_non_null(strstr(err.msg, "did you mean fashion?"));
    assert_int_equal(md_store_get_model(s, "fashon", &out, &err), MD_ENOTFOUND);
    assert_non_null(strstr(err.msg, "did you mean fashion?"));
    /* far from every name: no hint */
    assert_int_equal(md_store_get_model(s, "zzzzzzzzzz", &out, &err), MD_ENOTFOUND);
    assert_null(strstr(err.msg, "did you mean"));
    md_store_set_test_hook(NULL, NULL);
    assert_int_equal(h.calls, 6);
    assert_int_equal(h.write_lock_free, 6);
    assert_int_equal(h.mutex_free, 6);
    /* and the store is usable after (no transaction left open) */
    assert_int_equal(md_store_set_default(s, "fashion", 1, &err), MD_OK);
    pthread_mutex_destroy(&h.mu);
    pthread_cond_destroy(&h.cv);
    md_store_close(s);
    free(mlp.data);
}

/* A version names the architecture it was loaded with; when a PUT of another
 * architecture released that blob between the load and the row (issue 12),
 * the add refuses (409) instead of recording a sha with no file behind it. */
static void test_add_version_refuses_released_architecture(void **state)
{
    fx *f = *state;
    md_store *s = NULL;
    open_store(f, &s);
    md_err err;
    md_err_clear(&err);
    bytes mlp = fixture("mlp.pt"), cnn = fixture("cnn.pt"), sd = fixture("mlp_state_dict.pt");
    char mlp_sha[MD_SHA256_HEX], cnn_sha[MD_SHA256_HEX], sd_sha[MD_SHA256_HEX];
    sha_hex(mlp.data, mlp.len, mlp_sha);
    sha_hex(cnn.data, cnn.len, cnn_sha);
    sha_hex(sd.data, sd.len, sd_sha);
    char got[MD_SHA256_HEX];
    long long size = 0;

    /* the upload reads architecture A (mlp.pt) ... */
    md_blob_writer *w = write_blob(s, &mlp, 4096);
    assert_int_equal(md_blob_finish(w, mlp_sha, got, &size, &err), MD_OK);
    assert_int_equal(md_store_set_architecture(s, "m", w, &err), MD_OK);
    char arch[MD_SHA256_HEX];
    assert_int_equal(md_store_architecture(s, "m", arch, &err), MD_OK);
    assert_string_equal(arch, mlp_sha);
    /* ... then a PUT replaces it with B: A is released, its file unlinked */
    w = write_blob(s, &cnn, 4096);
    assert_int_equal(md_blob_finish(w, cnn_sha, got, &size, &err), MD_OK);
    assert_int_equal(md_store_set_architecture(s, "m", w, &err), MD_OK);
    char rel[128];
    snprintf(rel, sizeof rel, "blobs/%s", mlp_sha);
    assert_false(exists(f, rel));

    /* the version loaded into A is refused, and nothing is kept */
    md_version_spec spec = {.model = "m", .sha256 = sd_sha, .size = (long long)sd.len,
                            .format = "torch_save", .arch_sha256 = mlp_sha};
    w = write_blob(s, &sd, 4096);
    assert_int_equal(md_blob_finish(w, sd_sha, got, &size, &err), MD_OK);
    json_t *out = NULL;
    md_err_clear(&err);
    assert_int_equal(md_store_add_version(s, &spec, w, &out, &err), MD_ECONFLICT);
    assert_null(out);
    assert_string_equal(md_err_code(&err), "architecture_replaced");
    assert_non_null(strstr(err.msg, "retry"));
    json_t *list = NULL;
    assert_int_equal(md_store_list_versions(s, "m", NULL, 1, &list, &err), MD_OK);
    assert_int_equal(json_array_size(list), 0);
    json_decref(list);
    snprintf(rel, sizeof rel, "blobs/%s", sd_sha);
    assert_false(exists(f, rel));
    assert_int_equal(count_dir(f, "tmp"), 0);

    /* the retry, loaded into B, is stored */
    spec.arch_sha256 = cnn_sha;
    w = write_blob(s, &sd, 4096);
    assert_int_equal(md_blob_finish(w, sd_sha, got, &size, &err), MD_OK);
    assert_int_equal(md_store_add_version(s, &spec, w, &out, &err), MD_OK);
    assert_string_equal(json_string_value(json_object_get(out, "arch_sha256")), cnn_sha);
    json_decref(out);
    md_store_close(s);
    free(mlp.data);
    free(cnn.data);
    free(sd.data);
}

/* record_metric builds a JSON path from the name; SQLite does not unescape
 * a quoted label, so a name with a quote or backslash set another key or
 * none. Such names are refused; the allowed ones land under their own key. */
static void test_record_metric_names(void **state)
{
    fx *f = *state;
    md_store *s = NULL;
    open_store(f, &s);
    md_err err;
    md_err_clear(&err);
    bytes mlp = fixture("mlp.pt");
    char sha[MD_SHA256_HEX];
    long long size = 0;
    md_blob_writer *w = write_blob(s, &mlp, 4096);
    assert_int_equal(md_blob_finish(w, NULL, sha, &size, &err), MD_OK);
    md_version_spec spec = {.model = "m", .sha256 = sha, .size = size};
    assert_int_equal(md_store_add_version(s, &spec, w, NULL, &err), MD_OK);
    const char *bad[] = {"a\"b", "a\\b", "a b", "", "$.x", "0123456789012345678901234567890123456789012345678901234567890123X"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        md_err_clear(&err);
        if (md_store_record_metric(s, "m", 1, bad[i], 0.5, NULL, &err) != MD_EINVAL)
            fail_msg("metric name \"%s\" was accepted", bad[i]);
        assert_non_null(strstr(err.msg, "A-Z a-z 0-9 _ . -"));
    }
    assert_int_equal(md_store_record_metric(s, "m", 1, "top-1.acc_v2", 0.75, NULL, &err), MD_OK);
    assert_int_equal(md_store_record_metric(s, "m", 2, "acc", 0.75, NULL, &err), MD_ENOTFOUND);
    json_t *v = NULL;
    assert_int_equal(md_store_get_version(s, "m", 1, &v, &err), MD_OK);
    json_t *metrics = json_object_get(v, "metrics");
    assert_int_equal(json_object_size(metrics), 1);
    assert_true(json_number_value(json_object_get(metrics, "top-1.acc_v2")) == 0.75);
    json_decref(v);
    md_store_close(s);
    free(mlp.data);
}

/* A change committed through one handle (a replica) wakes another's
 * md_store_wait_change (PostgreSQL LISTEN/NOTIFY); SQLite answers -2 (poll). */
static void test_wait_change_notifies(void **state)
{
    fx *f = *state;
    md_store *a = NULL, *b = NULL;
    open_store(f, &a);
    open_store(f, &b);
    if (!index_url) {
        assert_int_equal(md_store_wait_change(b, 10), -2);
    } else {
        /* the first call subscribes and answers 1 (something may have been missed) */
        assert_int_equal(md_store_wait_change(b, 10), 1);
        /* nothing committed: a rolled-back change notifies nobody either */
        md_err err;
        assert_int_equal(md_store_set_default(a, "nosuch", 1, &err), MD_ENOTFOUND);
        assert_int_equal(md_store_wait_change(b, 50), 0);
        bytes mlp = fixture("mlp.pt");
        assert_int_equal(add(a, "m", &mlp, 0, NULL, 1), 1);
        int got = 0;
        for (int i = 0; i < 500 && !got; i++) /* a deadline of 500 x 20 ms, not an order */
            got = md_store_wait_change(b, 20) == 1;
        assert_true(got);
        free(mlp.data);
    }
    md_store_close(a);
    md_store_close(b);
}

/* Every backend's table has every required slot (as md_index_open checks),
 * and the same number of schema steps. */
static void test_index_ops_complete(void **state)
{
    (void)state;
    assert_null(md_index_ops_missing(&md_index_sqlite_ops));
#ifdef MD_WITH_PG
    assert_null(md_index_ops_missing(&md_index_pg_ops));
    assert_int_equal(md_index_pg_ops.n_migrations, md_index_sqlite_ops.n_migrations);
#endif
    md_index_ops broken = md_index_sqlite_ops;
    broken.step = NULL;
    assert_string_equal(md_index_ops_missing(&broken), "step");
    assert_string_equal(md_index_ops_missing(NULL), "ops");
}

/* Every blobs backend's table has every required slot (md_blobs_open
 * asserts it). */
static void test_blobs_ops_complete(void **state)
{
    (void)state;
    assert_null(md_blobs_ops_missing(&md_blobs_dir_ops));
    assert_null(md_blobs_ops_missing(&md_blobs_s3_ops));
    md_blobs_ops broken = md_blobs_s3_ops;
    broken.fetch = NULL;
    assert_string_equal(md_blobs_ops_missing(&broken), "fetch");
}

/* blob_url: an unknown scheme and a bad bucket are refused at open; an S3
 * store opens without talking to S3 (nothing listens on the endpoint), and
 * a blob no row names is not found without a request. */
static void test_blob_url_schemes(void **state)
{
    fx *f = *state;
    md_err err;
    md_err_clear(&err);
    md_store *s = (md_store *)0x1;
    md_store_opts o = {.blob_url = "gs://bucket/p", .s3_path_style = -1};
    assert_int_equal(md_store_open_opts(f->dir, &o, &s, &err), MD_EINVAL);
    assert_null(s);
    assert_string_equal(md_err_code(&err), "blob_url_invalid");
    setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:1", 1);
    setenv("AWS_ACCESS_KEY_ID", "AKIDUNIT", 1);
    setenv("AWS_SECRET_ACCESS_KEY", "unit-secret", 1);
    o.blob_url = "s3://No_Such..Bucket/p";
    assert_int_equal(md_store_open_opts(f->dir, &o, &s, &err), MD_EINVAL);
    assert_null(s);
    o.blob_url = "s3://modeld-unit/p";
    assert_int_equal(md_store_open_opts(f->dir, &o, &s, &err), MD_OK);
    char path[4096];
    const char *sha = "0000000000000000000000000000000000000000000000000000000000000000";
    assert_int_equal(md_store_blob_fetch(s, sha, path, sizeof path, &err), MD_ENOTFOUND);
    assert_non_null(strstr(path, sha));
    assert_null(strstr(err.msg, "unit-secret"));
    md_store_close(s);
    unsetenv("AWS_ENDPOINT_URL_S3");
    unsetenv("AWS_ACCESS_KEY_ID");
    unsetenv("AWS_SECRET_ACCESS_KEY");
}

/* The index_url's scheme chooses the backend; an unknown one and one not
 * reachable are different errors, and neither message shows a password. */
static void test_index_url_schemes(void **state)
{
    fx *f = *state;
    md_err err;
    md_err_clear(&err);
    md_store *s = (md_store *)0x1;
    assert_int_equal(md_store_open_index(f->dir, "mysql://u:hunter2@h/db", &s, &err), MD_EINVAL);
    assert_null(s);
    assert_string_equal(md_err_code(&err), "index_url_invalid");
    assert_null(strstr(err.msg, "hunter2"));
#ifdef MD_WITH_PG
    /* nothing listens on port 1: unavailable (503), not a crash or a hang */
    md_err_clear(&err);
    assert_int_equal(md_store_open_index(
                         f->dir, "postgresql://u:hunter2@127.0.0.1:1/db?connect_timeout=2", &s,
                         &err),
                     MD_EUNAVAIL);
    assert_null(s);
    assert_string_equal(md_err_code(&err), "index_unavailable");
    assert_null(strstr(err.msg, "hunter2"));
#else
    md_err_clear(&err);
    assert_int_equal(md_store_open_index(f->dir, "postgresql://u@h/db", &s, &err), MD_EINVAL);
    assert_string_equal(md_err_code(&err), "index_backend_not_built");
#endif
    char m[256];
    md_url_mask("postgresql://u:pw@h:5/db?sslmode=require&password=x", m, sizeof m);
    assert_string_equal(m, "postgresql://u:***@h:5/db?sslmode=require&password=***");
    md_url_mask("postgresql://u@h/db", m, sizeof m);
    assert_string_equal(m, "postgresql://u@h/db");
}

static void test_model_name_ok(void **state)
{
    (void)state;
    char n64[65], n65[66];
    memset(n64, 'a', 64);
    n64[64] = '\0';
    memset(n65, 'a', 65);
    n65[65] = '\0';
    const char *good[] = {"a", "A", "0", "mnist", "fashion-mnist_v2.1", "-x", "_", "a.b", n64};
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++)
        if (!md_model_name_ok(good[i]))
            fail_msg("\"%s\" refused", good[i]);
    const char *bad[] = {"", n65, "a b", "a/b", "a\\b", "caf\xc3\xa9", "a:b", "a?b", "a%20b",
                         "a\tb", "name\n", "a+b", "a@b", "a#b", "a*b"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        if (md_model_name_ok(bad[i]))
            fail_msg("\"%s\" accepted", bad[i]);
}

int main(void)
{
    md_log_set_level("error");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_open_creates_layout_and_schema, setup, teardown),
        cmocka_unit_test_setup_teardown(test_reopen_is_idempotent, setup, teardown),
        cmocka_unit_test_setup_teardown(test_old_schema_migrated_forward, setup, teardown),
        cmocka_unit_test_setup_teardown(test_newer_schema_refused, setup, teardown),
        cmocka_unit_test(test_open_unwritable_dir_fails),
        cmocka_unit_test_setup_teardown(test_blob_write_finish_add_version, setup, teardown),
        cmocka_unit_test_setup_teardown(test_blob_finish_errors_leave_nothing, setup, teardown),
        cmocka_unit_test_setup_teardown(test_shared_blobs, setup, teardown),
        cmocka_unit_test_setup_teardown(test_version_conflict_keeps_nothing, setup, teardown),
        cmocka_unit_test_setup_teardown(test_failed_reads_are_not_not_found, setup, teardown),
        cmocka_unit_test_setup_teardown(test_add_version_fails_at_every_index_call, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_replica_gc_waits_for_add_of_same_bytes, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_replica_sweep_waits_for_add_of_orphan_bytes, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_replica_delete_waits_for_set_default, setup, teardown),
        cmocka_unit_test_setup_teardown(test_crash_unfinished_temp_file, setup, teardown),
        cmocka_unit_test_setup_teardown(test_crash_blob_without_row, setup, teardown),
        cmocka_unit_test_setup_teardown(test_crash_row_without_blob, setup, teardown),
        cmocka_unit_test_setup_teardown(test_archive_check_fixtures, setup, teardown),
        cmocka_unit_test_setup_teardown(test_retention_keep_last, setup, teardown),
        cmocka_unit_test_setup_teardown(test_traffic_split, setup, teardown),
        cmocka_unit_test_setup_teardown(test_retention_keep_best, setup, teardown),
        cmocka_unit_test_setup_teardown(test_add_version_pruned_by_keep_best, setup, teardown),
        cmocka_unit_test(test_retention_check),
        cmocka_unit_test_setup_teardown(test_list_versions_ordered_by_metrics, setup, teardown),
        cmocka_unit_test_setup_teardown(test_list_models_pagination, setup, teardown),
        cmocka_unit_test_setup_teardown(test_defaults_and_generation, setup, teardown),
        cmocka_unit_test_setup_teardown(test_job_leases, setup, teardown),
        cmocka_unit_test_setup_teardown(test_add_version_refuses_released_architecture, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_record_metric_names, setup, teardown),
        cmocka_unit_test(test_model_name_ok),
        cmocka_unit_test(test_index_ops_complete),
        cmocka_unit_test(test_blobs_ops_complete),
        cmocka_unit_test_setup_teardown(test_blob_url_schemes, setup, teardown),
        cmocka_unit_test_setup_teardown(test_wait_change_notifies, setup, teardown),
        cmocka_unit_test_setup_teardown(test_index_url_schemes, setup, teardown),
        cmocka_unit_test(test_addr_is_internal),
        cmocka_unit_test(test_allowed_urls_compare_parsed_urls),
        cmocka_unit_test(test_path_open_follows_no_symlink),
        cmocka_unit_test_setup_teardown(test_typo_hint_computed_outside_locks, setup, teardown),
    };
    index_url = getenv("MODELD_TEST_INDEX_URL");
    if (index_url && !index_url[0])
        index_url = NULL;
    if (index_url) {
        char masked[512];
        md_url_mask(index_url, masked, sizeof masked);
        fprintf(stderr, "test_store: the index is PostgreSQL at %s\n", masked);
    }
    return cmocka_run_group_tests(tests, NULL, NULL);
}
