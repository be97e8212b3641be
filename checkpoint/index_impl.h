/*
 * index_impl.h - PRIVATE: the store's index seam. The index (models,
 * versions, settings, jobs, the generation counter) lives in one of two
 * databases, SQLite (index_sqlite.c, the embedded default: --store's
 * index.sqlite) or PostgreSQL 15 (index_pg.c, chosen by index_url). The
 * store's logic (promotion, retention, GC ordering, leases) is written once,
 * above this seam, in SQL both engines accept; each backend only executes it.
 *
 * Shape (CONVENTIONS.md "Backends behind one seam"): an md_index handle whose
 * first field is the backend's `const md_index_ops *`; each backend keeps its
 * state in a struct that starts with the base (struct md_index_pg { md_index
 * base; PGconn *conn; ... }) and exports one static const table. The static
 * inline ix_* wrappers below are the only code that calls through `ops`.
 *
 * SQL conventions above the seam: parameters are `?N` (numbered, 1-based;
 * PostgreSQL's backend rewrites them to `$N`); no JSON1 functions (JSON
 * columns are TEXT, read and changed with jansson in C inside the write
 * transaction); no SQLite-only scalars (MAX(a, b), `IS ?`, bare boolean
 * columns); booleans are integers compared explicitly (`?3 != 0`).
 *
 * Threads: a handle is used by one thread at a time (the store's mutex).
 */
#ifndef MD_INDEX_IMPL_H
#define MD_INDEX_IMPL_H

#include "../config/md_err.h"

typedef struct md_index md_index;
typedef struct md_index_ops md_index_ops;
/* A prepared statement: each backend's statement struct starts with this
 * base, so the wrappers need only the statement. */
typedef struct md_ixstmt {
    md_index *ix;
} md_ixstmt;

/* What ix_step answers. */
enum { MD_IX_DONE = 0, MD_IX_ROW = 1, MD_IX_ERROR = -1 };

/* A column's type in the current row. */
enum { MD_IXT_NULL = 0, MD_IXT_INT, MD_IXT_FLOAT, MD_IXT_TEXT };

/* Capability bits (md_index.caps), set at open. */
enum { MD_IX_CAP_NOTIFY = 1 };

/* What md_store_open hands a backend's open. */
typedef struct md_index_args {
    const char *url; /* the index_url ("" or NULL for SQLite) */
    const char *dir; /* --store: SQLite keeps index.sqlite there */
    /* called while a write transaction waits for another connection's
     * (a replica's) write lock; NULL: none */
    void (*on_wait)(void *ctx);
    void *ctx;
} md_index_args;

struct md_index_ops {
    const char *name; /* "sqlite", "postgresql": in messages */
    /* The forward-only schema: entry i moves schema version i to i+1; NULL
     * entries are no-ops (PostgreSQL creates its tables at the current
     * version in its last entry). Every backend has MD_INDEX_SCHEMA entries. */
    const char *const *migrations;
    int n_migrations;

    /* required */
    md_status (*open)(const md_index_args *args, md_index **out, md_err *err);
    void (*close)(md_index *ix);
    /* A write transaction that serialises writers across processes. */
    md_status (*begin)(md_index *ix, md_err *err);
    md_status (*commit)(md_index *ix, md_err *err);
    void (*rollback)(md_index *ix);
    /* One or more statements without parameters or rows. */
    md_status (*exec)(md_index *ix, const char *sql, md_err *err);
    md_status (*prepare)(md_index *ix, const char *sql, md_ixstmt **out, md_err *err);
    /* Binds copy their value; a bind keeps across a reset, as SQLite's. */
    void (*bind_text)(md_ixstmt *st, int i, const char *v);
    void (*bind_int64)(md_ixstmt *st, int i, long long v);
    void (*bind_double)(md_ixstmt *st, int i, double v);
    void (*bind_null)(md_ixstmt *st, int i);
    int (*step)(md_ixstmt *st); /* MD_IX_ROW, MD_IX_DONE or MD_IX_ERROR */
    void (*reset)(md_ixstmt *st);
    void (*finalize)(md_ixstmt *st);
    int (*column_type)(md_ixstmt *st, int col);           /* 0-based, MD_IXT_* */
    const char *(*column_text)(md_ixstmt *st, int col);   /* NULL for NULL */
    long long (*column_int64)(md_ixstmt *st, int col);    /* 0 for NULL */
    double (*column_double)(md_ixstmt *st, int col);      /* 0 for NULL */
    long long (*changes)(md_index *ix); /* rows changed by the last statement */
    md_status (*schema_get)(md_index *ix, int *version, md_err *err);
    /* inside the migration's write transaction */
    md_status (*schema_set)(md_index *ix, int version, md_err *err);
    /* The last failure (of prepare, step, exec, begin, commit) as a status,
     * its native message on `err` prefixed by `what`: the ONE place a
     * backend maps its native codes. */
    md_status (*map_error)(md_index *ix, const char *what, md_err *err);

    /* optional (NULL: absent) */
    /* A hint, inside a write transaction that bumped the generation: tell
     * listening replicas at commit (PostgreSQL: NOTIFY). */
    md_status (*notify_change)(md_index *ix, md_err *err);
    /* MD_IX_CAP_NOTIFY: wait up to timeout_ms for a change notification;
     * 1 when one came, 0 on timeout, -1 when the connection failed. */
    int (*wait_change)(md_index *ix, int timeout_ms);
};

/* The base every backend's state starts with. */
struct md_index {
    const md_index_ops *ops;
    unsigned caps; /* MD_IX_CAP_* */
};

/* The schema version both backends reach (store.c checks the tables agree). */
#define MD_INDEX_SCHEMA 10

/* The backends' tables (index_sqlite.c, index_pg.c). */
extern const md_index_ops md_index_sqlite_ops;
#ifdef MD_WITH_PG
extern const md_index_ops md_index_pg_ops;
#endif

/* NULL when every required slot of `ops` is set, else the first missing
 * slot's name (checked at open and by the unit tests). */
const char *md_index_ops_missing(const md_index_ops *ops);

/* Chooses the backend from `url`'s scheme (none or "sqlite:": SQLite;
 * "postgresql://" or "postgres://": PostgreSQL) and opens it. An unknown
 * scheme is MD_EINVAL (index_url_invalid); a known backend this build lacks
 * is MD_EINVAL (index_backend_not_built). */
md_status md_index_open(const md_index_args *args, md_index **out, md_err *err);


/* The index under a store (store.c), for the unit tests' fault-injecting
 * pass-through backend only: nothing else may reach past the store. */
struct md_store;
md_index *md_store_index_for_test(struct md_store *s);

/* ---- the only callers of ops ---- */

static inline void ix_close(md_index *ix)
{
    if (ix)
        ix->ops->close(ix);
}
static inline md_status ix_begin(md_index *ix, md_err *err) { return ix->ops->begin(ix, err); }
static inline md_status ix_commit(md_index *ix, md_err *err) { return ix->ops->commit(ix, err); }
static inline void ix_rollback(md_index *ix) { ix->ops->rollback(ix); }
static inline md_status ix_exec(md_index *ix, const char *sql, md_err *err)
{
    return ix->ops->exec(ix, sql, err);
}
static inline md_ixstmt *ix_prepare(md_index *ix, const char *sql, md_err *err)
{
    md_ixstmt *st = NULL;
    return ix->ops->prepare(ix, sql, &st, err) == MD_OK ? st : NULL;
}
/* The statement wrappers accept a NULL statement (a failed prepare whose
 * failure the caller reports at the step): binds do nothing, a step answers
 * MD_IX_ERROR, columns read as NULL. */
static inline void ix_bind_text(md_ixstmt *st, int i, const char *v)
{
    if (!st)
        return;
    if (v)
        st->ix->ops->bind_text(st, i, v);
    else
        st->ix->ops->bind_null(st, i);
}
static inline void ix_bind_int64(md_ixstmt *st, int i, long long v)
{
    if (st)
        st->ix->ops->bind_int64(st, i, v);
}
static inline void ix_bind_double(md_ixstmt *st, int i, double v)
{
    if (st)
        st->ix->ops->bind_double(st, i, v);
}
static inline void ix_bind_null(md_ixstmt *st, int i)
{
    if (st)
        st->ix->ops->bind_null(st, i);
}
static inline int ix_step(md_ixstmt *st) { return st ? st->ix->ops->step(st) : MD_IX_ERROR; }
static inline void ix_reset(md_ixstmt *st)
{
    if (st)
        st->ix->ops->reset(st);
}
static inline void ix_finalize(md_ixstmt *st)
{
    if (st)
        st->ix->ops->finalize(st);
}
static inline int ix_column_type(md_ixstmt *st, int c)
{
    return st ? st->ix->ops->column_type(st, c) : MD_IXT_NULL;
}
static inline const char *ix_column_text(md_ixstmt *st, int c)
{
    return st ? st->ix->ops->column_text(st, c) : NULL;
}
static inline long long ix_column_int64(md_ixstmt *st, int c)
{
    return st ? st->ix->ops->column_int64(st, c) : 0;
}
static inline double ix_column_double(md_ixstmt *st, int c)
{
    return st ? st->ix->ops->column_double(st, c) : 0;
}
static inline long long ix_changes(md_index *ix) { return ix->ops->changes(ix); }
static inline md_status ix_schema_get(md_index *ix, int *v, md_err *err)
{
    return ix->ops->schema_get(ix, v, err);
}
static inline md_status ix_schema_set(md_index *ix, int v, md_err *err)
{
    return ix->ops->schema_set(ix, v, err);
}
static inline md_status ix_fail(md_index *ix, const char *what, md_err *err)
{
    return ix->ops->map_error(ix, what, err);
}
static inline const char *const *ix_migrations(md_index *ix, int *n)
{
    *n = ix->ops->n_migrations;
    return ix->ops->migrations;
}
/* Does nothing where the backend has no notifications. */
static inline md_status ix_notify_change(md_index *ix, md_err *err)
{
    return ix->ops->notify_change ? ix->ops->notify_change(ix, err) : MD_OK;
}
/* -2 when the backend cannot notify (the caller polls instead). */
static inline int ix_wait_change(md_index *ix, int timeout_ms)
{
    if (!(ix->caps & MD_IX_CAP_NOTIFY) || !ix->ops->wait_change)
        return -2;
    return ix->ops->wait_change(ix, timeout_ms);
}

#endif
