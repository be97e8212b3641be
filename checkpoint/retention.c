/*
 * retention.c - a model's retention policy: md_retention_check validates one,
 * md_store_apply_retention (store_internal.h) deletes the versions it does not
 * keep, inside the caller's write transaction.
 */
#define _GNU_SOURCE
#include "store_internal.h"

#include <stdlib.h>
#include <string.h>

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

/* See store_internal.h. */
md_status md_store_apply_retention(md_store *s, const char *name, sha_list *released,
                                   md_err *err)
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
             "SELECT version, sha256, arch_sha256 FROM versions WHERE model = ?1 AND version != ?2 "
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
        md_sha_list_add(released, (const char *)sqlite3_column_text(st, 1));
        /* the architecture a state_dict version was loaded into: collected
         * with it when nothing else uses it, as its weights are */
        if (sqlite3_column_type(st, 2) != SQLITE_NULL)
            md_sha_list_add(released, (const char *)sqlite3_column_text(st, 2));
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
