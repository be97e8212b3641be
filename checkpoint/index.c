/*
 * index.c - the index seam's one choice (index_impl.h): which backend an
 * index_url names, and the check that a backend's table is complete.
 */
#define _GNU_SOURCE
#include "index_impl.h"

#include <stdio.h>
#include <string.h>
#include <strings.h>

const char *md_index_ops_missing(const md_index_ops *ops)
{
    if (!ops)
        return "ops";
#define REQ(slot)                                                                             \
    if (!ops->slot)                                                                           \
        return #slot;
    REQ(name) REQ(migrations) REQ(open) REQ(close) REQ(begin) REQ(commit) REQ(rollback)
    REQ(exec) REQ(prepare) REQ(bind_text) REQ(bind_int64) REQ(bind_double) REQ(bind_null)
    REQ(step) REQ(reset) REQ(finalize) REQ(column_type) REQ(column_text) REQ(column_int64)
    REQ(column_double) REQ(changes) REQ(schema_get) REQ(schema_set) REQ(map_error)
#undef REQ
    if (ops->n_migrations != MD_INDEX_SCHEMA)
        return "n_migrations";
    return NULL;
}

md_status md_index_open(const md_index_args *args, md_index **out, md_err *err)
{
    *out = NULL;
    const char *url = args->url ? args->url : "";
    const md_index_ops *ops = NULL;
    if (!url[0] || strcasecmp(url, "sqlite:") == 0) {
        ops = &md_index_sqlite_ops;
    } else if (strncasecmp(url, "postgresql://", 13) == 0 ||
               strncasecmp(url, "postgres://", 11) == 0) {
#ifdef MD_WITH_PG
        ops = &md_index_pg_ops;
#else
        return md_err_setc(err, MD_EINVAL, "index_backend_not_built",
                           "index_url names PostgreSQL, but this modeld was built without it "
                           "(make WITH_PG=1 with libpq-dev installed)");
#endif
    } else {
        char masked[512];
        md_url_mask(url, masked, sizeof masked);
        return md_err_setc(err, MD_EINVAL, "index_url_invalid",
                           "index_url %s has an unknown scheme; use postgresql://USER@HOST/DB "
                           "(a libpq URI) or leave it empty for SQLite in --store",
                           masked);
    }
    const char *missing = md_index_ops_missing(ops);
    if (missing)
        return md_err_set(err, MD_EINTERNAL, "index backend %s lacks %s", ops->name, missing);
    md_status st = ops->open(args, out, err);
    if (st == MD_OK)
        md_assert((*out)->ops == ops);
    return st;
}
