/*
 * index_pg.c - the store's index in PostgreSQL 15 over libpq (index_impl.h),
 * chosen by an index_url of postgresql://... (a libpq URI: sslmode and every
 * other parameter pass through). Every replica of a cluster shares it.
 *
 * Writers: a write transaction is BEGIN and pg_advisory_xact_lock(LOCK_KEY),
 * one constant, so writers on every replica are serialised as SQLite's
 * BEGIN IMMEDIATE serialises the processes of one host, and store.c's
 * reasoning about blobs and rows holds across hosts. The lock goes with
 * the transaction (commit, rollback or a lost connection).
 *
 * Statements: `?N` placeholders are rewritten to `$N` at prepare; binds are
 * kept as text with a type (text, int8, float8; NULL untyped) and the
 * statement runs once, at its first step, by PQexecParams; the rows are read
 * from the result.
 *
 * Nothing hangs: connect_timeout (5 s), TCP keepalives and tcp_user_timeout,
 * statement_timeout and idle_in_transaction_session_timeout are set unless
 * the URL sets them itself. A lost connection (PostgreSQL restarted) fails
 * the call in flight as MD_EUNAVAIL (index_unavailable: 503 with
 * Retry-After) and the transaction with it, so nothing is half-applied; the
 * next call resets the connection (PQreset), and a BEGIN or a read outside a
 * transaction is retried once on the new connection.
 *
 * The URL's password never reaches a log, an error or --print-config: the
 * handle keeps a masked copy for messages.
 */
#define _GNU_SOURCE
#include "index_impl.h"

#include <libpq-fe.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

/* 'modeld' in ASCII: the advisory lock every replica's writers take */
#define LOCK_KEY "120282346121316"
/* a failed reconnect is not retried more often than this, so a request
 * during an outage answers at once */
#define RESET_INTERVAL_S 0.5

#define TEXTOID 25
#define INT8OID 20
#define INT2OID 21
#define INT4OID 23
#define OIDOID 26
#define BOOLOID 16
#define FLOAT4OID 700
#define FLOAT8OID 701
#define NUMERICOID 1700

/* The tables at schema version 7 in one step (entries 1-6 are SQLite's
 * history), then the steps both backends take: proper types, "C" collation
 * on the keys so names sort and page bytewise as in SQLite, JSON as TEXT
 * (read and changed with jansson). */
static const char *const migrations[MD_INDEX_SCHEMA] = {
    NULL, NULL, NULL, NULL, NULL, NULL,
    "CREATE TABLE meta (key TEXT COLLATE \"C\" PRIMARY KEY, value TEXT NOT NULL);"
    "INSERT INTO meta VALUES ('generation', '0');"
    "CREATE TABLE models ("
    "  name TEXT COLLATE \"C\" PRIMARY KEY,"
    "  default_version BIGINT,"
    "  settings TEXT NOT NULL DEFAULT '{}',"
    "  created_at TEXT NOT NULL,"
    "  updated_at TEXT NOT NULL,"
    "  last_version BIGINT NOT NULL DEFAULT 0,"
    "  arch_sha256 TEXT);"
    "CREATE TABLE versions ("
    "  model TEXT COLLATE \"C\" NOT NULL REFERENCES models(name) ON DELETE CASCADE,"
    "  version BIGINT NOT NULL CHECK (version > 0),"
    "  sha256 TEXT NOT NULL,"
    "  size BIGINT NOT NULL,"
    "  format TEXT NOT NULL DEFAULT 'torchscript',"
    "  source TEXT NOT NULL,"
    "  config TEXT NOT NULL DEFAULT '{}',"
    "  metadata TEXT NOT NULL DEFAULT '{}',"
    "  metrics TEXT NOT NULL DEFAULT '{}',"
    "  state TEXT NOT NULL CHECK (state IN ('stored','loading','ready','failed')),"
    "  state_reason TEXT,"
    "  created_at TEXT NOT NULL,"
    "  arch_sha256 TEXT,"
    "  PRIMARY KEY (model, version));"
    "CREATE INDEX versions_sha256 ON versions(sha256);"
    "CREATE INDEX versions_arch_sha256 ON versions(arch_sha256);"
    "CREATE TABLE jobs ("
    "  id TEXT COLLATE \"C\" PRIMARY KEY,"
    "  model TEXT COLLATE \"C\" NOT NULL,"
    "  version BIGINT,"
    "  spec TEXT NOT NULL,"
    "  status TEXT NOT NULL CHECK (status IN "
    "    ('queued','running','succeeded','failed','cancelled')),"
    "  rows_done BIGINT NOT NULL DEFAULT 0,"
    "  rows_total BIGINT,"
    "  rows_skipped BIGINT NOT NULL DEFAULT 0,"
    "  output_path TEXT NOT NULL,"
    "  output_bytes BIGINT NOT NULL DEFAULT 0,"
    "  correct BIGINT NOT NULL DEFAULT 0,"
    "  labeled BIGINT NOT NULL DEFAULT 0,"
    "  confusion TEXT,"
    "  rows_per_s DOUBLE PRECISION,"
    "  partial BIGINT NOT NULL DEFAULT 0,"
    "  error TEXT,"
    "  created_at TEXT COLLATE \"C\" NOT NULL,"
    "  started_at TEXT,"
    "  finished_at TEXT,"
    "  updated_at TEXT NOT NULL,"
    "  owner TEXT,"
    "  lease_until DOUBLE PRECISION,"
    "  cancel_requested BIGINT NOT NULL DEFAULT 0,"
    "  files_skipped BIGINT,"
    "  accuracy_note TEXT);"
    "CREATE INDEX jobs_status ON jobs(status, created_at);",
    /* 8: blobs in S3 (issue 25): as index_sqlite.c's 8 */
    "CREATE TABLE blob_keys ("
    "  key TEXT COLLATE \"C\" PRIMARY KEY,"
    "  sha256 TEXT NOT NULL,"
    "  state TEXT NOT NULL DEFAULT 'live' CHECK (state IN ('live','deleting')),"
    "  created_at TEXT NOT NULL);"
    "CREATE INDEX blob_keys_sha256 ON blob_keys(sha256, state);",
    /* 9: one job over every replica (issue 26): as index_sqlite.c's 9 */
    "CREATE TABLE job_chunks ("
    "  job_id TEXT COLLATE \"C\" NOT NULL,"
    "  seq BIGINT NOT NULL,"
    "  start_row BIGINT NOT NULL,"
    "  end_row BIGINT NOT NULL,"
    "  start_byte BIGINT NOT NULL,"
    "  end_byte BIGINT NOT NULL,"
    "  status TEXT NOT NULL DEFAULT 'pending' CHECK (status IN ('pending','running','done')),"
    "  owner TEXT,"
    "  attempt BIGINT NOT NULL DEFAULT 0,"
    "  lease_until DOUBLE PRECISION,"
    "  rows_done BIGINT NOT NULL DEFAULT 0,"
    "  rows_skipped BIGINT NOT NULL DEFAULT 0,"
    "  correct BIGINT NOT NULL DEFAULT 0,"
    "  labeled BIGINT NOT NULL DEFAULT 0,"
    "  confusion TEXT,"
    "  output_key TEXT,"
    "  output_bytes BIGINT NOT NULL DEFAULT 0,"
    "  taken_over BIGINT NOT NULL DEFAULT 0,"
    "  PRIMARY KEY (job_id, seq));"
    "CREATE INDEX job_chunks_claim ON job_chunks(status, job_id, seq);"
    "ALTER TABLE jobs ADD COLUMN chunks_total BIGINT;"
    "ALTER TABLE jobs ADD COLUMN chunk_plan TEXT;",
    /* 10: removing ended jobs: as index_sqlite.c's 10 */
    "ALTER TABLE jobs ADD COLUMN removing_until DOUBLE PRECISION;"
    "CREATE TABLE jobs_removed ("
    "  id TEXT COLLATE \"C\" PRIMARY KEY,"
    "  removed_at TEXT COLLATE \"C\" NOT NULL);"
    "CREATE INDEX jobs_removed_at ON jobs_removed(removed_at);",
};

typedef struct md_index_pg {
    md_index base;
    PGconn *conn;
    char *url;
    /* LISTEN modeld_change: a connection of its own, used only by
     * pg_wait_change (the store's poll thread) */
    PGconn *listen;
    double listen_try;
    char masked[1024]; /* the URL without its password, for messages */
    void (*on_wait)(void *ctx);
    void *ctx;
    int in_txn;
    long long changes;
    double last_reset;
    /* the last failure, for pg_fail */
    char sqlstate[6];
    int lost; /* the connection failed */
    char msg[400];
} md_index_pg;

typedef struct pg_stmt {
    md_ixstmt base;
    char *sql;
    int nparams;
    char **vals;
    Oid *types;
    PGresult *res;
    int ran;
    int row;
} pg_stmt;

#define IX(p) ((md_index_pg *)(p))
#define ST(p) ((pg_stmt *)(p))

static double mono_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void set_msg(md_index_pg *ix, const char *msg)
{
    snprintf(ix->msg, sizeof ix->msg, "%s", msg && msg[0] ? msg : "unknown error");
    for (char *p = ix->msg; *p; p++)
        if (*p == '\n' || *p == '\r' || *p == '\t')
            *p = ' ';
    size_t n = strlen(ix->msg);
    while (n && ix->msg[n - 1] == ' ')
        ix->msg[--n] = '\0';
}

/* Remember why `res` (NULL: the connection) failed. */
static void note_failure(md_index_pg *ix, const PGresult *res)
{
    const char *state = res ? PQresultErrorField(res, PG_DIAG_SQLSTATE) : NULL;
    snprintf(ix->sqlstate, sizeof ix->sqlstate, "%s", state ? state : "");
    ix->lost = PQstatus(ix->conn) != CONNECTION_OK || !state ||
               strncmp(ix->sqlstate, "08", 2) == 0 || strncmp(ix->sqlstate, "57P0", 4) == 0;
    set_msg(ix, res && PQresultErrorMessage(res)[0] ? PQresultErrorMessage(res)
                                                    : PQerrorMessage(ix->conn));
}

/* The one mapping of libpq's failures (SQLSTATE, a lost connection) to the
 * store's statuses. */
static md_status pg_fail(md_index *base, const char *what, md_err *err)
{
    md_index_pg *ix = IX(base);
    const char *s = ix->sqlstate;
    md_status st = MD_EIO;
    const char *code = "index_error";
    if (strcmp(s, "23505") == 0) {
        st = MD_ECONFLICT;
        code = "conflict";
    } else if (ix->lost || strncmp(s, "08", 2) == 0 || strncmp(s, "57P0", 4) == 0 ||
               strcmp(s, "40001") == 0 || strcmp(s, "40P01") == 0 || strcmp(s, "55P03") == 0 ||
               strcmp(s, "57014") == 0 || strncmp(s, "53", 2) == 0) {
        /* unreachable, restarting, a serialization failure or deadlock, a
         * timeout, out of resources: the same request may succeed later */
        st = strcmp(s, "53100") == 0 ? MD_ENOSPC : MD_EUNAVAIL;
        code = st == MD_ENOSPC ? "insufficient_storage" : "index_unavailable";
    }
    return md_err_setc(err, st, code, "store index %s: %s: %s%s%s", ix->masked, what, ix->msg,
                       s[0] ? " SQLSTATE " : "", s);
}

/* Outside a transaction, a broken connection is reset before use. 0: usable. */
static int ensure_conn(md_index_pg *ix)
{
    if (PQstatus(ix->conn) == CONNECTION_OK)
        return 0;
    if (ix->in_txn) {
        /* the transaction died with the connection: its caller rolls back */
        ix->lost = 1;
        snprintf(ix->sqlstate, sizeof ix->sqlstate, "08006");
        set_msg(ix, "the connection was lost during the transaction");
        return -1;
    }
    double now = mono_now();
    if (ix->last_reset && now - ix->last_reset < RESET_INTERVAL_S) {
        ix->lost = 1;
        snprintf(ix->sqlstate, sizeof ix->sqlstate, "08001");
        set_msg(ix, PQerrorMessage(ix->conn));
        return -1;
    }
    ix->last_reset = now;
    PQreset(ix->conn);
    if (PQstatus(ix->conn) != CONNECTION_OK) {
        note_failure(ix, NULL);
        ix->lost = 1;
        return -1;
    }
    md_log(MD_LOG_INFO, "store index %s: reconnected", ix->masked);
    ix->last_reset = 0;
    return 0;
}

/* Run `sql` without parameters; a lost connection is retried once when
 * `retry` (nothing of it can have applied). Returns the result (caller
 * clears) or NULL with the failure noted. */
static PGresult *run(md_index_pg *ix, const char *sql, int nparams, const Oid *types,
                     const char *const *vals, int retry)
{
    for (int attempt = 0;; attempt++) {
        if (ensure_conn(ix) != 0)
            return NULL;
        PGresult *res = nparams >= 0 ? PQexecParams(ix->conn, sql, nparams, types, vals, NULL,
                                                    NULL, 0)
                                     : PQexec(ix->conn, sql);
        ExecStatusType t = res ? PQresultStatus(res) : PGRES_FATAL_ERROR;
        if (t == PGRES_COMMAND_OK || t == PGRES_TUPLES_OK) {
            const char *n = PQcmdTuples(res);
            ix->changes = n && n[0] ? atoll(n) : 0;
            return res;
        }
        note_failure(ix, res);
        PQclear(res);
        if (!(ix->lost && retry && !ix->in_txn && attempt == 0))
            return NULL;
        ix->last_reset = 0; /* the first reset after a failure is at once */
    }
}

static void pg_close(md_index *base)
{
    md_index_pg *ix = IX(base);
    if (ix->conn)
        PQfinish(ix->conn);
    if (ix->listen)
        PQfinish(ix->listen);
    free(ix->url);
    free(ix);
}

static md_status pg_exec(md_index *base, const char *sql, md_err *err);

/* Inside the write transaction, after the generation bump: every
 * listening replica hears of the change when it commits (not before, and
 * not at all when it rolls back). */
static md_status pg_notify_change(md_index *base, md_err *err)
{
    return pg_exec(base, "NOTIFY modeld_change", err);
}

static PGconn *connect_url(const char *url);

/* MD_IX_CAP_NOTIFY: wait for a NOTIFY modeld_change. A (re)connected
 * listener answers 1 at once: what changed while it was not listening is
 * unknown, so the caller looks. */
static int pg_wait_change(md_index *base, int timeout_ms)
{
    md_index_pg *ix = IX(base);
    if (!ix->listen || PQstatus(ix->listen) != CONNECTION_OK) {
        if (ix->listen) {
            PQfinish(ix->listen);
            ix->listen = NULL;
        }
        double now = mono_now();
        if (ix->listen_try && now - ix->listen_try < 1.0)
            return -1; /* at most one try a second while PostgreSQL is away */
        ix->listen_try = now;
        PGconn *c = connect_url(ix->url);
        PGresult *r = c && PQstatus(c) == CONNECTION_OK ? PQexec(c, "LISTEN modeld_change") : NULL;
        int ok = r && PQresultStatus(r) == PGRES_COMMAND_OK;
        PQclear(r);
        if (!ok) {
            if (c)
                PQfinish(c);
            return -1;
        }
        ix->listen = c;
        return 1;
    }
    struct pollfd p = {.fd = PQsocket(ix->listen), .events = POLLIN};
    int n = poll(&p, 1, timeout_ms);
    if (n > 0 && !PQconsumeInput(ix->listen))
        return -1; /* reconnected at the next call */
    int got = 0;
    PGnotify *note;
    while ((note = PQnotifies(ix->listen)) != NULL) {
        got = 1;
        PQfreemem(note);
    }
    return got;
}

static md_status pg_exec(md_index *base, const char *sql, md_err *err)
{
    PGresult *res = run(IX(base), sql, -1, NULL, NULL, 0);
    if (!res)
        return pg_fail(base, "exec", err);
    PQclear(res);
    return MD_OK;
}

static md_status pg_begin(md_index *base, md_err *err)
{
    md_index_pg *ix = IX(base);
    PGresult *res = run(ix, "BEGIN", -1, NULL, NULL, 1);
    if (!res)
        return pg_fail(base, "begin", err);
    PQclear(res);
    ix->in_txn = 1;
    res = run(ix, "SELECT pg_try_advisory_xact_lock(" LOCK_KEY ")", -1, NULL, NULL, 0);
    int got = res && PQntuples(res) == 1 && strcmp(PQgetvalue(res, 0, 0), "t") == 0;
    if (res && !got) {
        /* a replica holds it: wait (bounded by statement_timeout) */
        PQclear(res);
        if (ix->on_wait)
            ix->on_wait(ix->ctx);
        res = run(ix, "SELECT pg_advisory_xact_lock(" LOCK_KEY ")", -1, NULL, NULL, 0);
    }
    if (!res) {
        md_status st = pg_fail(base, "take the write lock", err);
        PGresult *rb = PQexec(ix->conn, "ROLLBACK");
        PQclear(rb);
        ix->in_txn = 0;
        return st;
    }
    PQclear(res);
    return MD_OK;
}

static md_status pg_commit(md_index *base, md_err *err)
{
    md_index_pg *ix = IX(base);
    PGresult *res = run(ix, "COMMIT", -1, NULL, NULL, 0);
    ix->in_txn = 0;
    if (!res)
        return pg_fail(base, "commit", err);
    /* a COMMIT of a failed transaction answers ROLLBACK, not an error */
    int rolled_back = strcmp(PQcmdStatus(res), "ROLLBACK") == 0;
    PQclear(res);
    if (rolled_back) {
        snprintf(IX(base)->sqlstate, sizeof IX(base)->sqlstate, "40000");
        set_msg(ix, "the transaction was rolled back");
        return pg_fail(base, "commit", err);
    }
    return MD_OK;
}

static void pg_rollback(md_index *base)
{
    md_index_pg *ix = IX(base);
    ix->in_txn = 0;
    if (PQstatus(ix->conn) == CONNECTION_OK)
        PQclear(PQexec(ix->conn, "ROLLBACK"));
}

/* ?N -> $N; a bare ? takes the number after the largest so far, as in
 * SQLite. Quoted text is copied as is. */
static md_status pg_prepare(md_index *base, const char *sql, md_ixstmt **out, md_err *err)
{
    *out = NULL;
    size_t len = strlen(sql);
    char *q = malloc(len * 2 + 16);
    if (!q)
        return md_err_set(err, MD_ENOMEM, "store index: out of memory preparing a statement");
    size_t o = 0;
    int maxp = 0, quote = 0;
    for (size_t i = 0; i < len; i++) {
        char c = sql[i];
        if (c == '\'')
            quote = !quote;
        if (c != '?' || quote) {
            q[o++] = c;
            continue;
        }
        int n = 0;
        size_t j = i + 1;
        while (j < len && sql[j] >= '0' && sql[j] <= '9' && n < 10000)
            n = n * 10 + (sql[j++] - '0');
        if (j == i + 1)
            n = maxp + 1;
        if (n > maxp)
            maxp = n;
        o += (size_t)snprintf(q + o, len * 2 + 16 - o, "$%d", n);
        i = j - 1;
    }
    q[o] = '\0';
    pg_stmt *st = md_xcalloc(1, sizeof *st);
    st->base.ix = base;
    st->sql = q;
    st->nparams = maxp;
    st->vals = md_xcalloc((size_t)maxp + 1, sizeof *st->vals);
    st->types = md_xcalloc((size_t)maxp + 1, sizeof *st->types);
    *out = &st->base;
    return MD_OK;
}

static void bind_str(pg_stmt *st, int i, char *v, Oid type)
{
    if (i < 1 || i > st->nparams) {
        free(v);
        return;
    }
    free(st->vals[i - 1]);
    st->vals[i - 1] = v;
    st->types[i - 1] = type;
}

static void pg_bind_text(md_ixstmt *st, int i, const char *v)
{
    bind_str(ST(st), i, md_xstrdup(v), TEXTOID);
}

static void pg_bind_int64(md_ixstmt *st, int i, long long v)
{
    char buf[32];
    snprintf(buf, sizeof buf, "%lld", v);
    bind_str(ST(st), i, md_xstrdup(buf), INT8OID);
}

static void pg_bind_double(md_ixstmt *st, int i, double v)
{
    char buf[40];
    snprintf(buf, sizeof buf, "%.17g", v);
    bind_str(ST(st), i, md_xstrdup(buf), FLOAT8OID);
}

static void pg_bind_null(md_ixstmt *st, int i) { bind_str(ST(st), i, NULL, 0); }

/* Whether `sql` only reads (so a lost connection may be retried). */
static int read_only(const char *sql)
{
    while (*sql == ' ' || *sql == '\n')
        sql++;
    return strncasecmp(sql, "SELECT", 6) == 0;
}

static int pg_step(md_ixstmt *b)
{
    pg_stmt *st = ST(b);
    md_index_pg *ix = IX(b->ix);
    if (!st->ran) {
        st->ran = 1;
        st->row = -1;
        st->res = run(ix, st->sql, st->nparams, st->types, (const char *const *)st->vals,
                      read_only(st->sql));
        if (!st->res)
            return MD_IX_ERROR;
    }
    if (!st->res)
        return MD_IX_ERROR;
    if (st->row < PQntuples(st->res))
        st->row++;
    return st->row < PQntuples(st->res) ? MD_IX_ROW : MD_IX_DONE;
}

static void pg_reset(md_ixstmt *b)
{
    pg_stmt *st = ST(b);
    PQclear(st->res);
    st->res = NULL;
    st->ran = 0;
    st->row = -1;
}

static void pg_finalize(md_ixstmt *b)
{
    pg_stmt *st = ST(b);
    PQclear(st->res);
    for (int i = 0; i < st->nparams; i++)
        free(st->vals[i]);
    free(st->vals);
    free(st->types);
    free(st->sql);
    free(st);
}

static int has_row(pg_stmt *st, int c)
{
    return st->res && st->row >= 0 && st->row < PQntuples(st->res) && c >= 0 &&
           c < PQnfields(st->res);
}

static int pg_column_type(md_ixstmt *b, int c)
{
    pg_stmt *st = ST(b);
    if (!has_row(st, c) || PQgetisnull(st->res, st->row, c))
        return MD_IXT_NULL;
    switch (PQftype(st->res, c)) {
    case INT8OID:
    case INT4OID:
    case INT2OID:
    case OIDOID:
    case BOOLOID:
        return MD_IXT_INT;
    case FLOAT4OID:
    case FLOAT8OID:
        return MD_IXT_FLOAT;
    case NUMERICOID:
        return strpbrk(PQgetvalue(st->res, st->row, c), ".eEN") ? MD_IXT_FLOAT : MD_IXT_INT;
    default:
        return MD_IXT_TEXT;
    }
}

static const char *pg_column_text(md_ixstmt *b, int c)
{
    pg_stmt *st = ST(b);
    if (!has_row(st, c) || PQgetisnull(st->res, st->row, c))
        return NULL;
    return PQgetvalue(st->res, st->row, c);
}

static long long pg_column_int64(md_ixstmt *b, int c)
{
    const char *v = pg_column_text(b, c);
    if (!v)
        return 0;
    if (v[0] == 't' && !v[1])
        return 1; /* a boolean */
    return strtoll(v, NULL, 10);
}

static double pg_column_double(md_ixstmt *b, int c)
{
    const char *v = pg_column_text(b, c);
    return v ? strtod(v, NULL) : 0;
}

static long long pg_changes(md_index *base) { return IX(base)->changes; }

static md_status pg_schema_get(md_index *base, int *version, md_err *err)
{
    md_index_pg *ix = IX(base);
    *version = 0;
    PGresult *res = run(ix, "SELECT to_regclass('modeld_schema') IS NOT NULL", -1, NULL, NULL,
                        1);
    if (!res)
        return pg_fail(base, "read the schema version", err);
    int exists = PQntuples(res) == 1 && strcmp(PQgetvalue(res, 0, 0), "t") == 0;
    PQclear(res);
    if (!exists)
        return MD_OK;
    res = run(ix, "SELECT max(version) FROM modeld_schema", -1, NULL, NULL, 1);
    if (!res)
        return pg_fail(base, "read the schema version", err);
    if (PQntuples(res) == 1 && !PQgetisnull(res, 0, 0))
        *version = atoi(PQgetvalue(res, 0, 0));
    PQclear(res);
    return MD_OK;
}

static md_status pg_schema_set(md_index *base, int version, md_err *err)
{
    char sql[200];
    snprintf(sql, sizeof sql,
             "CREATE TABLE IF NOT EXISTS modeld_schema (version INTEGER NOT NULL);"
             "DELETE FROM modeld_schema; INSERT INTO modeld_schema VALUES (%d)",
             version);
    return pg_exec(base, sql, err);
}

/* A connection to `url` with the defaults that keep every call bounded. */
static PGconn *connect_url(const char *url)
{
    /* our defaults first: the URL (dbname, expanded) overrides any of them */
    const char *keys[] = {"connect_timeout",
                          "keepalives",
                          "keepalives_idle",
                          "keepalives_interval",
                          "keepalives_count",
                          "tcp_user_timeout",
                          "application_name",
                          "options",
                          "dbname",
                          NULL};
    const char *vals[] = {"5",
                          "1",
                          "10",
                          "5",
                          "3",
                          "10000",
                          "modeld",
                          "-c statement_timeout=30000 -c idle_in_transaction_session_timeout=60000 "
                          "-c client_min_messages=warning",
                          url,
                          NULL};
    return PQconnectdbParams(keys, vals, 1);
}

static md_status pg_open(const md_index_args *args, md_index **out, md_err *err)
{
    *out = NULL;
    md_index_pg *ix = md_xcalloc(1, sizeof *ix);
    ix->base.ops = &md_index_pg_ops;
    ix->base.caps = MD_IX_CAP_NOTIFY;
    ix->on_wait = args->on_wait;
    ix->ctx = args->ctx;
    md_url_mask(args->url, ix->masked, sizeof ix->masked);
    ix->url = md_xstrdup(args->url);
    ix->conn = connect_url(args->url);
    if (!ix->conn || PQstatus(ix->conn) != CONNECTION_OK) {
        set_msg(ix, ix->conn ? PQerrorMessage(ix->conn) : "out of memory");
        md_err_setc(err, MD_EUNAVAIL, "index_unavailable",
                    "store index %s: cannot connect: %s; check index_url and that PostgreSQL "
                    "is running",
                    ix->masked, ix->msg);
        pg_close(&ix->base);
        return MD_EUNAVAIL;
    }
    *out = &ix->base;
    return MD_OK;
}

const md_index_ops md_index_pg_ops = {
    .name = "postgresql",
    .migrations = migrations,
    .n_migrations = MD_INDEX_SCHEMA,
    .open = pg_open,
    .close = pg_close,
    .begin = pg_begin,
    .commit = pg_commit,
    .rollback = pg_rollback,
    .exec = pg_exec,
    .prepare = pg_prepare,
    .bind_text = pg_bind_text,
    .bind_int64 = pg_bind_int64,
    .bind_double = pg_bind_double,
    .bind_null = pg_bind_null,
    .step = pg_step,
    .reset = pg_reset,
    .finalize = pg_finalize,
    .column_type = pg_column_type,
    .column_text = pg_column_text,
    .column_int64 = pg_column_int64,
    .column_double = pg_column_double,
    .changes = pg_changes,
    .schema_get = pg_schema_get,
    .schema_set = pg_schema_set,
    .map_error = pg_fail,
    .notify_change = pg_notify_change,
    .wait_change = pg_wait_change,
};
