/*
 * versions.c - the store's model and version rows: adding a version (its blob
 * moved into blobs/ and its row inserted in one write transaction, see DESIGN
 * in store.c), listing, reading, the default, deleting (blobs released after
 * the commit), load states, and the "did you mean" hint for a missing model.
 */
#define _GNU_SOURCE
#include "store_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static md_status bump_generation(md_store *s, md_err *err)
{
    return exec(s, "UPDATE meta SET value = CAST(value AS INTEGER) + 1 WHERE key = 'generation'",
                err);
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

md_status md_metric_name_check(const char *name, const char *what, const char *code,
                               md_err *err)
{
    size_t len = name ? strlen(name) : 0;
    int ok = len >= 1 && len <= MD_METRIC_NAME_MAX;
    for (size_t i = 0; ok && i < len; i++) {
        unsigned char c = (unsigned char)name[i];
        ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
             c == '_' || c == '.' || c == '-';
    }
    if (ok)
        return MD_OK;
    return md_err_setc(err, MD_EINVAL, code,
                       "%s must be a metric name of 1 to %d characters from A-Z a-z 0-9 _ . - "
                       "(e.g. \"test_accuracy\")",
                       what, MD_METRIC_NAME_MAX);
}

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
    if (!json_is_string(m))
        return md_err_setc(err, MD_EINVAL, "invalid_promote",
                           "promote.metric must name a metric, e.g. %s", example);
    md_status rc = md_metric_name_check(json_string_value(m), "promote.metric", "invalid_promote",
                                        err);
    if (rc != MD_OK)
        return rc;
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
        snprintf(reason, size, "metrics.%.128s %.17g %s %.17g of default version %d (%s is better)",
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
    if ((rc = md_blobs_sync_dir(s, err)) != MD_OK)
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
        md_sha_list_add(&released, (const char *)sqlite3_column_text(st, 0));
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
    md_blobs_release_all(s, &released); /* the old architecture, unless a version still uses it */
    goto unlock;
rollback:
    exec(s, "ROLLBACK", NULL);
    free(released.items);
    released.items = NULL;
    released.count = 0;
    if (moved) {
        md_sha_list_add(&released, sha);
        md_blobs_release_all(s, &released);
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

/* Within record_metric's transaction: a metric recorded after the upload
 * (a job's test accuracy) is what the promotion policy was waiting for, so
 * the policy applies to it as to an upload: when `metric` is the policy's and
 * `value` beats the default version's (or the default lacks it), `version`
 * becomes the default. Sets *promoted to 1 then, else 0. */
static md_status promote_recorded(md_store *s, const char *name, int version, const char *metric,
                                  double value, int *promoted, md_err *err)
{
    *promoted = 0;
    sqlite3_stmt *st = prep(s,
                            "SELECT json_extract(m.settings, '$.promote.metric'), "
                            "json_extract(m.settings, '$.promote.order'), m.default_version, "
                            "json_extract(d.metrics, ?3) FROM models m LEFT JOIN versions d ON "
                            "d.model = m.name AND d.version = m.default_version WHERE m.name = ?1 "
                            "AND EXISTS (SELECT 1 FROM versions v WHERE v.model = ?1 AND "
                            "v.version = ?2 AND v.state = 'ready')",
                            err);
    if (!st)
        return MD_EIO;
    char path[MD_METRIC_NAME_MAX + 8]; /* the name was checked by the caller */
    snprintf(path, sizeof path, "$.\"%s\"", metric);
    sqlite3_bind_text(st, 1, name, -1, SQLITE_STATIC);
    sqlite3_bind_int(st, 2, version);
    sqlite3_bind_text(st, 3, path, -1, SQLITE_TRANSIENT);
    int apply = 0;
    if (sqlite3_step(st) == SQLITE_ROW && sqlite3_column_type(st, 0) == SQLITE_TEXT &&
        strcmp((const char *)sqlite3_column_text(st, 0), metric) == 0) {
        const char *order = (const char *)sqlite3_column_text(st, 1);
        int desc = !order || strcmp(order, "desc") == 0;
        int dv = sqlite3_column_type(st, 2) == SQLITE_NULL ? 0 : sqlite3_column_int(st, 2);
        int kind = sqlite3_column_type(st, 3);
        if (dv != version) {
            if (dv <= 0 || (kind != SQLITE_INTEGER && kind != SQLITE_FLOAT))
                apply = 1;
            else {
                double theirs = sqlite3_column_double(st, 3);
                apply = desc ? value > theirs : value < theirs;
            }
        }
    }
    sqlite3_finalize(st);
    if (!apply)
        return MD_OK;
    st = prep(s, "UPDATE models SET default_version = ?, updated_at = ? WHERE name = ?", err);
    if (!st)
        return MD_EIO;
    char now[32];
    now_iso(now);
    sqlite3_bind_int(st, 1, version);
    sqlite3_bind_text(st, 2, now, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 3, name, -1, SQLITE_STATIC);
    md_status rc = sqlite3_step(st) == SQLITE_DONE ? MD_OK : db_fail(s, err, "promote a version");
    sqlite3_finalize(st);
    if (rc == MD_OK)
        *promoted = 1;
    return rc;
}

md_status md_store_record_metric(md_store *s, const char *name, int version, const char *metric,
                                 double value, int *promoted, md_err *err)
{
    if (promoted)
        *promoted = 0;
    /* SQLite does not unescape a quoted JSON path label: a name with a quote
     * or a backslash would set another key or none, so such names are
     * refused and the rest need no quoting */
    md_status rc = md_metric_name_check(metric, "record_metric", "invalid_metric", err);
    if (rc != MD_OK)
        return rc;
    pthread_mutex_lock(&s->mu);
    if ((rc = exec(s, "BEGIN IMMEDIATE", err)) != MD_OK)
        goto out;
    char path[MD_METRIC_NAME_MAX + 8];
    snprintf(path, sizeof path, "$.\"%s\"", metric);
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
    if (rc == MD_OK && promoted)
        rc = promote_recorded(s, name, version, metric, value, promoted, err);
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
        if ((rc = md_blobs_sync_dir(s, err)) != MD_OK)
            goto rollback;
    } else if (access(path, R_OK) != 0) {
        rc = md_err_set(err, MD_EIO, "store %s: checkpoint %s is no longer stored; retry", s->dir,
                        sha);
        goto rollback;
    }
    hook(s, "add_blob_decided");
    /* The architecture the upload was loaded with was read before this
     * transaction; a PUT of another architecture in between released and
     * unlinked it (no row named it yet). Checked here, under s->mu and the
     * write transaction, so no release can come between this check and the
     * row that keeps the blob alive. */
    if (spec->arch_sha256 && spec->arch_sha256[0]) {
        char arch_path[4096];
        struct stat ab;
        blob_path(s, spec->arch_sha256, arch_path, sizeof arch_path);
        if (stat(arch_path, &ab) != 0) {
            rc = md_err_setc(err, MD_ECONFLICT, "architecture_replaced",
                             "model %s: the architecture was replaced during the upload; retry",
                             spec->model);
            goto rollback;
        }
    }
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
    if ((rc = md_store_apply_retention(s, spec->model, &released, err)) != MD_OK ||
        (rc = bump_generation(s, err)) != MD_OK) {
        json_decref(added);
        goto rollback;
    }
    if ((rc = exec(s, "COMMIT", err)) != MD_OK) {
        json_decref(added);
        goto rollback;
    }
    md_blobs_release_all(s, &released);
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
        md_sha_list_add(&released, sha);
        md_blobs_release_all(s, &released);
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
        rc = md_store_apply_retention(s, name, &released, err);
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
    md_blobs_release_all(s, &released);
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
    md_sha_list_add(&released, json_string_value(json_object_get(v, "sha256")));
    /* and the architecture it was loaded into, unless the model or another
     * version still uses it (release_blob checks), rather than at next open */
    const char *arch = json_string_value(json_object_get(v, "arch_sha256"));
    if (arch && arch[0])
        md_sha_list_add(&released, arch);
    if ((rc = bump_generation(s, err)) != MD_OK || (rc = exec(s, "COMMIT", err)) != MD_OK)
        goto rollback;
    md_blobs_release_all(s, &released);
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
            md_sha_list_add(&released, (const char *)sqlite3_column_text(st, 0));
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
    md_blobs_release_all(s, &released);
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

void md_store_write_metrics(md_store *s, FILE *f)
{
    long long models = 0, versions = 0, bytes = 0;
    pthread_mutex_lock(&s->mu);
    md_err err;
    sqlite3_stmt *st = prep(s,
                            "SELECT (SELECT count(*) FROM models), count(*), "
                            "coalesce(sum(size), 0) FROM versions",
                            &err);
    if (st && sqlite3_step(st) == SQLITE_ROW) {
        models = sqlite3_column_int64(st, 0);
        versions = sqlite3_column_int64(st, 1);
        bytes = sqlite3_column_int64(st, 2);
    }
    sqlite3_finalize(st);
    pthread_mutex_unlock(&s->mu);
    md_prom_family(f, "modeld_store_models", "gauge", "Models in the store.");
    md_prom_sample(f, "modeld_store_models", "", (double)models);
    md_prom_family(f, "modeld_store_versions", "gauge", "Versions in the store.");
    md_prom_sample(f, "modeld_store_versions", "", (double)versions);
    md_prom_family(f, "modeld_store_version_bytes", "gauge",
                   "Bytes of the versions' checkpoints (a blob shared by versions counts for "
                   "each).");
    md_prom_sample(f, "modeld_store_version_bytes", "", (double)bytes);
}
