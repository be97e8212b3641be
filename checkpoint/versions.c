/*
 * versions.c - the store's model and version rows: adding a version (its blob
 * moved into blobs/ and its row inserted in one write transaction, see DESIGN
 * in store.c), listing, reading, the default, retention settings, deleting
 * (blobs released after the commit), load states, and the "did you mean" hint
 * for a missing model. The rows of training checkpoints (architecture,
 * promotion, recorded metrics) are in promotion.c.
 */
#define _GNU_SOURCE
#include "store_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

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

#define VERSION_COLS                                                                          \
    "v.model, v.version, v.sha256, v.size, v.format, v.source, v.config, v.metadata, "        \
    "v.metrics, v.state, v.state_reason, v.created_at, "                                    \
    "CASE WHEN m.default_version = v.version THEN 1 ELSE 0 END, "   \
    "v.arch_sha256 "

static json_t *version_json(md_ixstmt *st)
{
    json_t *v = json_pack("{s:s,s:i,s:s,s:I,s:s,s:s,s:o,s:o,s:o,s:s,s:s,s:b}", "model",
                          ix_column_text(st, 0), "version", (int)ix_column_int64(st, 1),
                          "sha256", ix_column_text(st, 2), "size",
                          (json_int_t)ix_column_int64(st, 3), "format",
                          ix_column_text(st, 4), "source", ix_column_text(st, 5),
                          "config", json_col(st, 6), "metadata", json_col(st, 7), "metrics",
                          json_col(st, 8), "state", ix_column_text(st, 9), "created_at",
                          ix_column_text(st, 11), "default", (int)ix_column_int64(st, 12));
    if (ix_column_type(st, 10) != MD_IXT_NULL)
        json_object_set_new(v, "state_reason", json_string(ix_column_text(st, 10)));
    if (ix_column_type(st, 13) != MD_IXT_NULL)
        json_object_set_new(v, "arch_sha256",
                            json_string(ix_column_text(st, 13)));
    return v;
}

md_status md_get_version_locked(md_store *s, const char *name, int version, json_t **out,
                                md_err *err)
{
    md_ixstmt *st = prep(s,
                            "SELECT " VERSION_COLS
                            "FROM versions v JOIN models m ON m.name = v.model "
                            "WHERE v.model = ? AND v.version = ?",
                            err);
    if (!st)
        return MD_EIO;
    ix_bind_text(st, 1, name);
    ix_bind_int64(st, 2, version);
    md_status rc = MD_OK;
    int step = ix_step(st);
    if (step == MD_IX_ROW)
        *out = version_json(st);
    else if (step == MD_IX_ERROR)
        rc = db_fail(s, err, "read a version"); /* not "not found": the index failed */
    else
        rc = md_err_setc(err, MD_ENOTFOUND, "version_not_found",
                         "model %s has no version %d; GET /models/%s lists its versions", name,
                         version, name);
    ix_finalize(st);
    return rc;
}

md_status md_model_check(md_store *s, const char *name, md_err *err)
{
    md_ixstmt *st = prep(s, "SELECT 1 FROM models WHERE name = ?", err);
    if (!st)
        return MD_EIO;
    ix_bind_text(st, 1, name);
    int step = ix_step(st);
    /* an index that cannot answer is not a model that does not exist: a 404
     * there would be remembered, and a store sync would unload the model */
    md_status rc = step == MD_IX_ROW     ? MD_OK
                   : step == MD_IX_ERROR ? db_fail(s, err, "look up the model")
                                         : md_model_missing(name, err);
    ix_finalize(st);
    return rc;
}

md_status md_model_missing(const char *name, md_err *err)
{
    return md_err_setc(err, MD_ENOTFOUND, "model_not_found",
                       "model %s does not exist; GET /models lists the models", name);
}

/* the names are copied under the mutex in one read, the edit distances are
 * computed after it */
md_status md_model_hint(md_store *s, md_status rc, const char *name, md_err *err)
{
    enum { MAX_NAMES = 4096, NAME_BYTES = 65 }; /* more names: none past them suggested */
    if (rc != MD_ENOTFOUND || !err || strcmp(md_err_code(err), "model_not_found") != 0)
        return rc;
    char(*buf)[NAME_BYTES] = malloc(sizeof *buf * MAX_NAMES);
    const char **names = malloc(sizeof *names * MAX_NAMES);
    size_t n = 0;
    if (buf && names) {
        pthread_mutex_lock(&s->mu);
        md_ixstmt *st = prep(s, "SELECT name FROM models ORDER BY name LIMIT 4096", NULL);
        while (st && n < MAX_NAMES && ix_step(st) == MD_IX_ROW) {
            const char *v = ix_column_text(st, 0);
            if (v) {
                snprintf(buf[n], NAME_BYTES, "%s", v);
                names[n] = buf[n];
                n++;
            }
        }
        ix_finalize(st);
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

static md_status json_text(json_t *v, char **out)
{
    *out = v ? json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY) : md_xstrdup("{}");
    md_assert(*out != NULL);
    return MD_OK;
}

md_status md_set_default_locked(md_store *s, const char *name, int version, const char *what,
                                md_err *err)
{
    md_ixstmt *st =
        prep(s, "UPDATE models SET default_version = ?, updated_at = ? WHERE name = ?", err);
    if (!st)
        return MD_EIO;
    char now[32];
    now_iso(now);
    ix_bind_int64(st, 1, version);
    ix_bind_text(st, 2, now);
    ix_bind_text(st, 3, name);
    md_status rc = ix_step(st) == MD_IX_DONE ? MD_OK : db_fail(s, err, what);
    ix_finalize(st);
    return rc;
}

md_status md_settings_read(md_store *s, const char *name, json_t **settings, const char *what,
                           md_err *err)
{
    *settings = NULL;
    md_ixstmt *st = prep(s, "SELECT settings FROM models WHERE name = ?1", err);
    if (!st)
        return MD_EIO;
    ix_bind_text(st, 1, name);
    int step = ix_step(st);
    if (step == MD_IX_ROW)
        *settings = json_col(st, 0);
    md_status rc = step == MD_IX_ERROR ? db_fail(s, err, what) : MD_OK;
    ix_finalize(st);
    return rc;
}

md_status md_set_setting(md_store *s, const char *name, const char *key, json_t *value,
                         int remove_null, const char *what, md_err *err)
{
    /* read, change in C, write back: inside the caller's write transaction,
     * so no replica changes the row in between */
    json_t *settings;
    md_status rc = md_settings_read(s, name, &settings, what, err);
    if (rc != MD_OK || !settings)
        return rc; /* no such model: nothing to change, as an UPDATE of no row */
    if (!json_is_object(settings)) {
        json_decref(settings);
        settings = json_object();
    }
    if (remove_null && json_is_null(value))
        json_object_del(settings, key);
    else
        json_object_set(settings, key, value);
    char *text = json_dumps(settings, JSON_COMPACT);
    md_assert(text != NULL);
    json_decref(settings);
    md_ixstmt *st = prep(s, "UPDATE models SET settings = ?1 WHERE name = ?2", err);
    if (!st) {
        free(text);
        return MD_EIO;
    }
    ix_bind_text(st, 1, text);
    ix_bind_text(st, 2, name);
    rc = ix_step(st) == MD_IX_DONE ? MD_OK : db_fail(s, err, what);
    ix_finalize(st);
    free(text);
    return rc;
}

md_status md_store_add_version(md_store *s, const md_version_spec *spec, md_blob_writer *blob,
                               json_t **out, md_err *err)
{
    if (out)
        *out = NULL;
    char sha[MD_SHA256_HEX];
    snprintf(sha, sizeof sha, "%s", blob ? blob->sha256 : spec->sha256);
    md_status rc = MD_OK;
    sha_list released = {0};
    json_t *added = NULL;
    int version = spec->version;
    char *config = NULL, *metadata = NULL, *metrics = NULL;
    int moved = 0; /* this add put the file in blobs/ (undone on failure) */
    json_text(spec->config, &config);
    json_text(spec->metadata, &metadata);
    json_text(spec->metrics, &metrics);

    /* blobs in S3: the object first, outside the mutex (the network), so it
     * exists before the row naming it commits */
    if (blob && (rc = md_blob_upload(s, blob, err)) != MD_OK) {
        pthread_mutex_lock(&s->mu); /* the one exit below unlocks */
        goto unlock;
    }
    pthread_mutex_lock(&s->mu);
    /* One write transaction: the blob's file (see DESIGN), model row, version
     * row, default, retention, generation. */
    if ((rc = txn_begin(s, err)) != MD_OK)
        goto unlock;
    if (blob) {
        if ((rc = md_blob_place(s, blob, "checkpoint", &moved, err)) != MD_OK)
            goto end;
    } else if (!md_blob_stored_locked(s, sha)) {
        rc = md_err_set(err, MD_EIO, "store %s: checkpoint %s is no longer stored; retry", s->dir,
                        sha);
        goto end;
    }
    hook(s, "add_blob_decided");
    /* The architecture the upload was loaded with was read before this
     * transaction; a PUT of another architecture in between released and
     * unlinked it (no row named it yet). Checked here, under s->mu and the
     * write transaction, so no release can come between this check and the
     * row that keeps the blob alive. */
    if (spec->arch_sha256 && spec->arch_sha256[0]) {
        if (!md_blob_stored_locked(s, spec->arch_sha256)) {
            rc = md_err_setc(err, MD_ECONFLICT, "architecture_replaced",
                             "model %s: the architecture was replaced during the upload; retry",
                             spec->model);
            goto end;
        }
    }
    char now[32];
    now_iso(now);
    /* The version number is allocated by the database in this one statement:
     * an upsert on the model row that moves last_version and returns the
     * number (never MAX()+1 read apart from its write). 0 asks for the next
     * number; an explicit one moves last_version up to it, and a duplicate
     * fails the versions row's primary key below (409). */
    md_ixstmt *st = prep(s,
                         "INSERT INTO models (name, created_at, updated_at, last_version) "
                         "VALUES (?1, ?2, ?2, CASE WHEN ?3 = 0 THEN 1 ELSE ?3 END) "
                         "ON CONFLICT(name) DO UPDATE SET updated_at = ?2, last_version = "
                         "CASE WHEN ?3 = 0 THEN models.last_version + 1 "
                         "WHEN ?3 > models.last_version THEN ?3 ELSE models.last_version END "
                         "RETURNING CASE WHEN ?3 = 0 THEN last_version ELSE ?3 END",
                         err);
    if (!st) {
        rc = MD_EIO;
        goto end;
    }
    ix_bind_text(st, 1, spec->model);
    ix_bind_text(st, 2, now);
    ix_bind_int64(st, 3, version);
    int step = ix_step(st);
    if (step == MD_IX_ROW) {
        version = (int)ix_column_int64(st, 0);
        step = ix_step(st);
    }
    if (step != MD_IX_DONE || version <= 0) {
        rc = db_fail(s, err, "allocate the version number");
        ix_finalize(st);
        goto end;
    }
    ix_finalize(st);
    st = prep(s,
              "INSERT INTO versions (model, version, sha256, size, source, config, metadata, "
              "metrics, state, created_at, format, arch_sha256) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
              err);
    if (!st) {
        rc = MD_EIO;
        goto end;
    }
    ix_bind_text(st, 1, spec->model);
    ix_bind_int64(st, 2, version);
    ix_bind_text(st, 3, sha);
    ix_bind_int64(st, 4, blob ? blob->size : spec->size);
    ix_bind_text(st, 5, spec->source ? spec->source : "upload");
    ix_bind_text(st, 6, config);
    ix_bind_text(st, 7, metadata);
    ix_bind_text(st, 8, metrics);
    ix_bind_text(st, 9, spec->state ? spec->state : "stored");
    ix_bind_text(st, 10, now);
    ix_bind_text(st, 11, spec->format ? spec->format : "torchscript");
    if (spec->arch_sha256 && spec->arch_sha256[0])
        ix_bind_text(st, 12, spec->arch_sha256);
    else
        ix_bind_null(st, 12);
    step = ix_step(st);
    if (step != MD_IX_DONE) {
        rc = db_fail(s, err, "insert version");
        if (rc == MD_ECONFLICT)
            rc = md_err_setc(err, MD_ECONFLICT, "version_exists",
                             "model %s already has version %d; choose another number or omit it",
                             spec->model, version);
    }
    ix_finalize(st);
    if (rc != MD_OK)
        goto end;
    /* The first version of a model is its default whatever make_default says;
     * a promotion policy (issue 12) may decide instead. */
    char promotion[320] = "";
    int make_default = spec->make_default;
    if (spec->promote && (rc = md_promotion_decide(s, spec, &make_default, promotion,
                                                sizeof promotion, err)) != MD_OK)
        goto end;
    st = prep(s,
              "UPDATE models SET default_version = ?2 WHERE name = ?1 AND (?3 != 0 OR "
              "default_version IS NULL)",
              err);
    if (!st) {
        rc = MD_EIO;
        goto end;
    }
    ix_bind_text(st, 1, spec->model);
    ix_bind_int64(st, 2, version);
    ix_bind_int64(st, 3, make_default);
    int ok = ix_step(st) == MD_IX_DONE;
    if (!ok)
        rc = db_fail(s, err, "set default");
    int default_moved = ok && ix_changes(s->ix) > 0;
    ix_finalize(st);
    if (!ok) {
        goto end;
    }
    if (default_moved) { /* the deploy moved the default: in the history with the rest */
        json_t *note = json_pack("{s:s,s:s}", "by", "deploy", "reason",
                                 promotion[0] ? promotion
                                 : make_default ? "deployed as the default"
                                                : "the model's first version");
        json_t *change = json_pack("{s:i}", "default_version", version);
        rc = md_history_add_locked(s, spec->model, note, change, err);
        json_decref(change);
        json_decref(note);
        if (rc != MD_OK)
            goto end;
    }
    /* the answer describes the new row even if retention removes it at once */
    if ((rc = md_get_version_locked(s, spec->model, version, &added, err)) != MD_OK)
        goto end;
    if (added && promotion[0])
        json_object_set_new(added, "promotion",
                            json_pack("{s:b,s:s}", "promoted",
                                      json_is_true(json_object_get(added, "default")), "reason",
                                      promotion));
    rc = md_store_apply_retention(s, spec->model, &released, err);
end:
    rc = txn_end(s, rc, TXN_BUMP, err);
    /* failed: the upload's bytes go, unless another row (maybe a replica's)
     * uses them */
    md_blobs_settle(s, rc, &released, moved ? sha : NULL);
    md_blob_committed(blob, rc); /* else md_blob_abort deletes the unused object */
    if (rc == MD_OK) {
        json_t *still = NULL;
        if (md_get_version_locked(s, spec->model, version, &still, NULL) == MD_ENOTFOUND && added)
            json_object_set_new(added, "removed_by_retention", json_true());
        json_decref(still);
        if (out) {
            *out = added;
            added = NULL;
        }
    }
    json_decref(added);
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
    md_ixstmt *st = prep(s,
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
    ix_bind_text(st, 1, after ? after : "");
    ix_bind_int64(st, 2, limit + 1);
    json_t *models = json_array();
    json_t *next = json_null();
    int n = 0, step;
    while ((step = ix_step(st)) == MD_IX_ROW) {
        if (n++ == limit) {
            json_decref(next);
            json_t *last = json_array_get(models, json_array_size(models) - 1);
            next = json_incref(json_object_get(last, "name"));
            break;
        }
        json_t *m = json_pack("{s:s,s:o,s:s,s:s,s:i}", "name", ix_column_text(st, 0),
                              "default_version",
                              ix_column_type(st, 1) == MD_IXT_NULL
                                  ? json_null()
                                  : json_integer((int)ix_column_int64(st, 1)),
                              "created_at", ix_column_text(st, 2), "updated_at",
                              ix_column_text(st, 3), "versions", (int)ix_column_int64(st, 4));
        if (ix_column_type(st, 5) != MD_IXT_NULL)
            json_object_set_new(m, "state", json_string(ix_column_text(st, 5)));
        json_array_append_new(models, m);
    }
    if (step == MD_IX_ERROR) { /* not an empty or shorter list: the index failed */
        rc = db_fail(s, err, "list models");
        ix_finalize(st);
        json_decref(models);
        json_decref(next);
        goto out;
    }
    ix_finalize(st);
    *out = json_pack("{s:o,s:o}", "models", models, "next", next);
out:
    pthread_mutex_unlock(&s->mu);
    return rc;
}

/* Sort context of list_versions_locked: the metric path and direction. */
static const char *sort_metric;
static int sort_asc;
static pthread_mutex_t sort_mu = PTHREAD_MUTEX_INITIALIZER;

/* ORDER BY metric IS NULL, metric ASC|DESC, version ASC|DESC, in C. */
static int by_metric(const void *pa, const void *pb)
{
    json_t *a = *(json_t *const *)pa, *b = *(json_t *const *)pb;
    json_t *ma = md_metric_get(json_object_get(a, "metrics"), sort_metric);
    json_t *mb = md_metric_get(json_object_get(b, "metrics"), sort_metric);
    if (!ma != !mb)
        return ma ? -1 : 1; /* the versions without it last, either way */
    int c = ma ? md_metric_cmp(ma, mb) : 0;
    if (c == 0) {
        json_int_t va = json_integer_value(json_object_get(a, "version"));
        json_int_t vb = json_integer_value(json_object_get(b, "version"));
        c = va < vb ? -1 : va > vb;
    }
    return sort_asc ? c : -c;
}

static md_status list_versions_locked(md_store *s, const char *name, const char *order_by,
                                      int asc, json_t **out, md_err *err)
{
    const char *order_expr, *metric = NULL;
    if (!order_by || strcmp(order_by, "version") == 0)
        order_expr = "v.version";
    else if (strcmp(order_by, "created_at") == 0)
        order_expr = "v.created_at";
    else if (strncmp(order_by, "metrics.", 8) == 0 && md_model_name_ok(order_by + 8)) {
        metric = order_by + 8; /* sorted in C: the metrics are JSON text */
        order_expr = "v.version";
    } else
        return md_err_setc(err, MD_EINVAL, "invalid_order_by",
                           "order_by=%s is not supported; use version, created_at or "
                           "metrics.KEY (e.g. metrics.loss)",
                           order_by);
    char sql[600];
    snprintf(sql, sizeof sql,
             "SELECT " VERSION_COLS "FROM versions v JOIN models m ON m.name = v.model "
             "WHERE v.model = ?1 ORDER BY %s %s, v.version %s",
             order_expr, asc ? "ASC" : "DESC", asc ? "ASC" : "DESC");
    md_ixstmt *st = prep(s, sql, err);
    if (!st)
        return MD_EIO;
    ix_bind_text(st, 1, name);
    json_t *a = json_array();
    int step;
    while ((step = ix_step(st)) == MD_IX_ROW)
        json_array_append_new(a, version_json(st));
    md_status rc = step == MD_IX_DONE ? MD_OK : db_fail(s, err, "list versions");
    ix_finalize(st);
    if (rc != MD_OK) {
        json_decref(a);
        return rc;
    }
    size_t n = json_array_size(a);
    if (metric && n > 1) {
        json_t **items = md_xcalloc(n, sizeof *items);
        for (size_t i = 0; i < n; i++)
            items[i] = json_incref(json_array_get(a, i));
        pthread_mutex_lock(&sort_mu);
        sort_metric = metric;
        sort_asc = asc;
        qsort(items, n, sizeof *items, by_metric);
        pthread_mutex_unlock(&sort_mu);
        json_array_clear(a);
        for (size_t i = 0; i < n; i++)
            json_array_append_new(a, items[i]);
        free(items);
    }
    *out = a;
    return MD_OK;
}

md_status md_store_get_model(md_store *s, const char *name, json_t **out, md_err *err)
{
    pthread_mutex_lock(&s->mu);
    md_status rc = MD_OK;
    md_ixstmt *st = prep(s,
                            "SELECT name, default_version, settings, created_at, updated_at, "
                            "arch_sha256 FROM models WHERE name = ?",
                            err);
    if (!st) {
        rc = MD_EIO;
        goto out;
    }
    ix_bind_text(st, 1, name);
    int step = ix_step(st);
    if (step != MD_IX_ROW) {
        rc = step == MD_IX_ERROR ? db_fail(s, err, "read the model") : md_model_missing(name, err);
        ix_finalize(st);
        goto out;
    }
    json_t *settings = json_col(st, 2);
    json_t *m = json_pack("{s:s,s:o,s:O,s:s,s:s}", "name", ix_column_text(st, 0),
                          "default_version",
                          ix_column_type(st, 1) == MD_IXT_NULL
                              ? json_null()
                              : json_integer((int)ix_column_int64(st, 1)),
                          "retention",
                          json_object_get(settings, "retention") ? json_object_get(settings,
                                                                                   "retention")
                                                                 : json_null(),
                          "created_at", ix_column_text(st, 3), "updated_at",
                          ix_column_text(st, 4));
    json_object_set_new(m, "architecture",
                        ix_column_type(st, 5) == MD_IXT_NULL
                            ? json_null()
                            : json_pack("{s:s}", "sha256", ix_column_text(st, 5)));
    json_object_set(m, "promote",
                    json_object_get(settings, "promote") ? json_object_get(settings, "promote")
                                                         : json_null());
    json_object_set(m, "traffic",
                    json_object_get(settings, "traffic") ? json_object_get(settings, "traffic")
                                                         : json_null());
    json_object_set(m, "sticky_header",
                    json_is_string(json_object_get(settings, "sticky_header"))
                        ? json_object_get(settings, "sticky_header")
                        : json_null());
    json_object_set(m, "promote_when",
                    json_is_object(json_object_get(settings, "promote_when"))
                        ? json_object_get(settings, "promote_when")
                        : json_null());
    json_object_set(m, "shadow",
                    json_is_object(json_object_get(settings, "shadow"))
                        ? json_object_get(settings, "shadow")
                        : json_null());
    json_decref(settings);
    ix_finalize(st);
    json_t *versions = NULL;
    if ((rc = list_versions_locked(s, name, "version", 1, &versions, err)) != MD_OK) {
        json_decref(m);
        goto out;
    }
    json_object_set_new(m, "versions", versions);
    *out = m;
out:
    pthread_mutex_unlock(&s->mu);
    return md_model_hint(s, rc, name, err);
}

md_status md_store_get_version(md_store *s, const char *name, int version, json_t **out,
                               md_err *err)
{
    pthread_mutex_lock(&s->mu);
    md_status rc = md_model_check(s, name, err);
    if (rc == MD_OK)
        rc = md_get_version_locked(s, name, version, out, err);
    pthread_mutex_unlock(&s->mu);
    return md_model_hint(s, rc, name, err);
}

md_status md_store_list_versions(md_store *s, const char *name, const char *order_by, int asc,
                                 json_t **out, md_err *err)
{
    pthread_mutex_lock(&s->mu);
    md_status rc = md_model_check(s, name, err);
    if (rc == MD_OK)
        rc = list_versions_locked(s, name, order_by, asc, out, err);
    pthread_mutex_unlock(&s->mu);
    return md_model_hint(s, rc, name, err);
}

md_status md_store_set_default(md_store *s, const char *name, int version, md_err *err)
{
    return md_store_set_default_noted(s, name, version, NULL, err);
}

md_status md_store_set_default_noted(md_store *s, const char *name, int version, json_t *note,
                                     md_err *err)
{
    pthread_mutex_lock(&s->mu);
    md_status rc = MD_OK;
    json_t *v = NULL;
    /* one transaction: the check of the version's state, the move and the
     * generation bump commit together or not at all (a replica cannot delete
     * or fail the version in between, nor see a move without its bump) */
    if ((rc = txn_begin(s, err)) != MD_OK)
        goto unlock;
    if ((rc = md_model_check(s, name, err)) != MD_OK)
        goto end;
    if ((rc = md_get_version_locked(s, name, version, &v, err)) != MD_OK)
        goto end;
    const char *state = json_string_value(json_object_get(v, "state"));
    if (strcmp(state, "failed") == 0) {
        rc = md_err_setc(err, MD_ECONFLICT, "version_failed",
                         "model %s version %d failed (%s) and cannot be the default", name, version,
                         json_string_value(json_object_get(v, "state_reason")));
        goto end;
    }
    hook(s, "set_default_checked");
    rc = md_set_default_locked(s, name, version, "set default", err);
    if (rc == MD_OK && note) {
        json_t *change = json_pack("{s:i}", "default_version", version);
        rc = md_history_add_locked(s, name, note, change, err);
        json_decref(change);
    }
end:
    rc = txn_end(s, rc, TXN_BUMP, err);
unlock:
    json_decref(v);
    pthread_mutex_unlock(&s->mu);
    return md_model_hint(s, rc, name, err); /* after the ROLLBACK: see with_hint */
}

md_status md_store_set_retention(md_store *s, const char *name, json_t *retention, md_err *err)
{
    md_status rc = md_retention_check(retention, err);
    if (rc != MD_OK)
        return rc;
    sha_list released = {0};
    pthread_mutex_lock(&s->mu);
    if ((rc = txn_begin(s, err)) == MD_OK) {
        /* inside the transaction: a replica cannot delete the model in between */
        rc = md_model_check(s, name, err);
        if (rc == MD_OK)
            rc = md_set_setting(s, name, "retention", retention, 0, "set retention", err);
        if (rc == MD_OK)
            rc = md_store_apply_retention(s, name, &released, err);
        rc = txn_end(s, rc, TXN_BUMP, err);
        md_blobs_settle(s, rc, &released, NULL);
    }
    pthread_mutex_unlock(&s->mu);
    return md_model_hint(s, rc, name, err);
}

/* A version with a share of the traffic split is not deleted: the split
 * would send requests to nothing (inside the caller's transaction). */
static md_status refuse_if_in_traffic(md_store *s, const char *name, int version, md_err *err)
{
    json_t *settings;
    md_status rc = md_settings_read(s, name, &settings, "read the traffic split", err);
    if (rc == MD_OK && md_settings_route_to(settings, version))
        rc = md_err_setc(err, MD_ECONFLICT, "version_in_traffic",
                         "version %d of model %s takes part of its traffic (a share of the "
                         "split or the shadow); change them first (PATCH /models/%s "
                         "{\"traffic\": null} or {\"shadow\": null})",
                         version, name, name);
    json_decref(settings);
    return rc;
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
    if ((rc = txn_begin(s, err)) != MD_OK)
        goto out;
    if ((rc = md_model_check(s, name, err)) != MD_OK)
        goto end;
    if ((rc = md_get_version_locked(s, name, version, &v, err)) != MD_OK)
        goto end;
    if ((rc = refuse_if_in_traffic(s, name, version, err)) != MD_OK)
        goto end;
    int is_default = json_is_true(json_object_get(v, "default"));
    md_ixstmt *st;
    if (is_default) {
        st = prep(s, "SELECT MAX(version) FROM versions WHERE model = ? AND version != ? AND "
                     "state != 'failed'", err);
        if (!st) {
            rc = MD_EIO;
            goto end;
        }
        ix_bind_text(st, 1, name);
        ix_bind_int64(st, 2, version);
        /* an error must not read as "no other version": that would set the
         * default to NULL without force */
        if (ix_step(st) != MD_IX_ROW) {
            rc = db_fail(s, err, "find the next default");
            ix_finalize(st);
            goto end;
        }
        int other = 0;
        if (ix_column_type(st, 0) != MD_IXT_NULL)
            other = (int)ix_column_int64(st, 0);
        ix_finalize(st);
        if (other && !force) {
            rc = md_err_setc(err, MD_ECONFLICT, "version_is_default",
                             "version %d is the default of model %s; make another version the "
                             "default first (PATCH /models/%s {\"default_version\": N}) or add "
                             "?force=true",
                             version, name, name);
            goto end;
        }
        st = prep(s, "UPDATE models SET default_version = ? WHERE name = ?", err);
        if (other)
            ix_bind_int64(st, 1, other);
        else
            ix_bind_null(st, 1);
        ix_bind_text(st, 2, name);
        int moved_ok = ix_step(st) == MD_IX_DONE;
        ix_finalize(st);
        if (!moved_ok) {
            rc = db_fail(s, err, "move the default");
            goto end;
        }
    }
    st = prep(s, "DELETE FROM versions WHERE model = ? AND version = ?", err);
    ix_bind_text(st, 1, name);
    ix_bind_int64(st, 2, version);
    int ok = ix_step(st) == MD_IX_DONE;
    ix_finalize(st);
    if (!ok) {
        rc = db_fail(s, err, "delete version");
        goto end;
    }
    md_sha_list_add(&released, json_string_value(json_object_get(v, "sha256")));
    /* and the architecture it was loaded into, unless the model or another
     * version still uses it (release_blob checks), rather than at next open */
    const char *arch = json_string_value(json_object_get(v, "arch_sha256"));
    if (arch && arch[0])
        md_sha_list_add(&released, arch);
end:
    rc = txn_end(s, rc, TXN_BUMP, err);
    md_blobs_settle(s, rc, &released, NULL);
out:
    json_decref(v);
    pthread_mutex_unlock(&s->mu);
    return md_model_hint(s, rc, name, err); /* after the ROLLBACK: see with_hint */
}

md_status md_store_delete_model(md_store *s, const char *name, md_err *err)
{
    pthread_mutex_lock(&s->mu);
    md_status rc = MD_OK;
    sha_list released = {0};
    if ((rc = txn_begin(s, err)) != MD_OK)
        goto out;
    /* inside the transaction: a replica cannot delete it in between */
    if ((rc = md_model_check(s, name, err)) != MD_OK)
        goto end;
    md_ixstmt *st = prep(s,
                            "SELECT sha256 FROM versions WHERE model = ?1 UNION SELECT "
                            "arch_sha256 FROM versions WHERE model = ?1 AND arch_sha256 IS NOT "
                            "NULL UNION SELECT arch_sha256 FROM models WHERE name = ?1 AND "
                            "arch_sha256 IS NOT NULL",
                            err);
    int step = MD_IX_ERROR;
    if (st) {
        ix_bind_text(st, 1, name);
        while ((step = ix_step(st)) == MD_IX_ROW)
            md_sha_list_add(&released, ix_column_text(st, 0));
        ix_finalize(st);
    }
    if (step != MD_IX_DONE) {
        /* the blobs to collect are unknown: delete nothing */
        rc = st ? db_fail(s, err, "list the model's versions") : MD_EIO;
        goto end;
    }
    st = prep(s, "DELETE FROM models WHERE name = ?", err);
    ix_bind_text(st, 1, name);
    int ok = ix_step(st) == MD_IX_DONE;
    ix_finalize(st);
    if (!ok)
        rc = db_fail(s, err, "delete model");
end:
    rc = txn_end(s, rc, TXN_BUMP, err);
    md_blobs_settle(s, rc, &released, NULL);
out:
    pthread_mutex_unlock(&s->mu);
    return md_model_hint(s, rc, name, err);
}

md_status md_store_set_state(md_store *s, const char *name, int version, const char *state,
                             const char *reason, md_err *err)
{
    pthread_mutex_lock(&s->mu);
    md_status rc = MD_OK;
    md_ixstmt *st = prep(s,
                            "UPDATE versions SET state = ?, state_reason = ? WHERE model = ? AND "
                            "version = ?",
                            err);
    if (!st) {
        rc = MD_EIO;
        goto out;
    }
    ix_bind_text(st, 1, state);
    if (reason)
        ix_bind_text(st, 2, reason);
    else
        ix_bind_null(st, 2);
    ix_bind_text(st, 3, name);
    ix_bind_int64(st, 4, version);
    if (ix_step(st) != MD_IX_DONE)
        rc = db_fail(s, err, "set state");
    else if (ix_changes(s->ix) == 0)
        rc = md_err_setc(err, MD_ENOTFOUND, "version_not_found", "model %s has no version %d",
                         name, version);
    ix_finalize(st);
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
    md_ixstmt *st = prep(s,
                            "SELECT " VERSION_COLS "FROM versions v JOIN models m ON m.name = "
                            "v.model AND m.default_version = v.version ORDER BY v.model",
                            err);
    if (!st) {
        rc = MD_EIO;
        goto out;
    }
    json_t *a = json_array();
    int step;
    while ((step = ix_step(st)) == MD_IX_ROW) {
        json_t *v = version_json(st);
        char path[4096];
        blob_path(s, json_string_value(json_object_get(v, "sha256")), path, sizeof path);
        json_object_set_new(v, "path", json_string(path));
        json_array_append_new(a, v);
    }
    if (step == MD_IX_ERROR) {
        rc = db_fail(s, err, "list the defaults");
        json_decref(a);
        a = NULL;
    }
    ix_finalize(st);
    *out = a;
out:
    pthread_mutex_unlock(&s->mu);
    return rc;
}

void md_store_write_metrics(md_store *s, FILE *f)
{
    long long models = 0, versions = 0, bytes = 0;
    pthread_mutex_lock(&s->mu);
    md_err err;
    md_ixstmt *st = prep(s,
                            "SELECT (SELECT count(*) FROM models), count(*), "
                            "coalesce(sum(size), 0) FROM versions",
                            &err);
    int up = st && ix_step(st) == MD_IX_ROW;
    if (up) {
        models = ix_column_int64(st, 0);
        versions = ix_column_int64(st, 1);
        bytes = ix_column_int64(st, 2);
    }
    ix_finalize(st);
    pthread_mutex_unlock(&s->mu);
    md_prom_family(f, "modeld_index_up", "gauge",
                   "1 when the index (SQLite or PostgreSQL) answered this scrape's query; 0 "
                   "when it did not, and the gauges read from it are left out.");
    md_prom_sample(f, "modeld_index_up", "", up);
    /* unknown is not zero: a scrape without them, not a drop to 0 */
    if (up) {
        md_prom_family(f, "modeld_store_models", "gauge", "Models in the store.");
        md_prom_sample(f, "modeld_store_models", "", (double)models);
        md_prom_family(f, "modeld_store_versions", "gauge", "Versions in the store.");
        md_prom_sample(f, "modeld_store_versions", "", (double)versions);
        md_prom_family(f, "modeld_store_version_bytes", "gauge",
                       "Bytes of the versions' checkpoints (a blob shared by versions counts "
                       "for each).");
        md_prom_sample(f, "modeld_store_version_bytes", "", (double)bytes);
    }
    bl_write_metrics(s->blobs, f); /* S3: the cache's */
}
