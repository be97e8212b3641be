/*
 * promotion.c - the store's rows for training checkpoints (issue 12): a
 * model's architecture, its promotion policy and how it decides the default,
 * and metrics recorded on a version after its upload (a job's accuracy).
 * Versions themselves are added and removed in versions.c; the helpers both
 * files use are in store_internal.h.
 */
#define _GNU_SOURCE
#include "store_internal.h"

#include <stdlib.h>
#include <string.h>

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

md_status md_promotion_decide(md_store *s, const md_version_spec *spec, int *make_default,
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
    if ((rc = txn_begin(s, err)) == MD_OK) {
        rc = md_model_exists(s, name)
                 ? md_set_setting(s, name, "$.promote", policy, 1, "set the promotion policy", err)
                 : md_model_missing(name, err);
        rc = txn_end(s, rc, TXN_BUMP, err);
    }
    pthread_mutex_unlock(&s->mu);
    return md_model_hint(s, rc, name, err);
}

md_status md_store_set_architecture(md_store *s, const char *name, md_blob_writer *blob,
                                    md_err *err)
{
    char sha[MD_SHA256_HEX];
    md_assert(blob && blob->finished);
    snprintf(sha, sizeof sha, "%s", blob->sha256);
    sha_list released = {0};
    int moved = 0;
    md_status rc;
    pthread_mutex_lock(&s->mu);
    if ((rc = txn_begin(s, err)) != MD_OK)
        goto unlock;
    if ((rc = md_blob_place(s, blob, "architecture", &moved, err)) != MD_OK)
        goto end;
    char now[32];
    now_iso(now);
    sqlite3_stmt *st = prep(s, "SELECT arch_sha256 FROM models WHERE name = ?", err);
    if (!st) {
        rc = MD_EIO;
        goto end;
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
        goto end;
    }
    sqlite3_bind_text(st, 1, name, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 2, now, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 3, sha, -1, SQLITE_STATIC);
    if (sqlite3_step(st) != SQLITE_DONE)
        rc = db_fail(s, err, "set the architecture");
    sqlite3_finalize(st);
end:
    rc = txn_end(s, rc, TXN_BUMP, err);
    /* committed: the old architecture, unless a version still uses it */
    md_blobs_settle(s, rc, &released, moved ? sha : NULL);
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
        rc = md_model_missing(name, err);
    else if (sqlite3_column_type(st, 0) == SQLITE_NULL)
        rc = md_err_setc(err, MD_ENOTFOUND, "no_architecture",
                         "model %s has no architecture; PUT /models/%s/architecture with the "
                         "network as TorchScript (torch.jit.script(model).save(\"arch.pt\")): "
                         "curl -T arch.pt .../models/%s/architecture",
                         name, name, name);
    else
        snprintf(sha256, MD_SHA256_HEX, "%s", (const char *)sqlite3_column_text(st, 0));
    sqlite3_finalize(st);
out:
    pthread_mutex_unlock(&s->mu);
    return rc == MD_ENOTFOUND && strcmp(md_err_code(err), "model_not_found") == 0
               ? md_model_hint(s, rc, name, err)
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
    md_status rc = md_set_default_locked(s, name, version, "promote a version", err);
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
    if ((rc = txn_begin(s, err)) != MD_OK)
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
    rc = txn_end(s, rc, TXN_BUMP, err);
out:
    pthread_mutex_unlock(&s->mu);
    return rc;
}
