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
    md_ixstmt *st = prep(s, "SELECT settings, default_version FROM models WHERE name = ?", err);
    if (!st)
        return MD_EIO;
    ix_bind_text(st, 1, spec->model);
    json_t *settings = NULL;
    int dv = 0;
    int step = ix_step(st);
    if (step == MD_IX_ROW) {
        settings = json_col(st, 0);
        dv = ix_column_type(st, 1) == MD_IXT_NULL ? 0 : (int)ix_column_int64(st, 1);
    }
    ix_finalize(st);
    if (step == MD_IX_ERROR) /* not "no policy": the index failed */
        return db_fail(s, err, "read the promotion policy");
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
        ix_bind_text(st, 1, spec->model);
        ix_bind_int64(st, 2, dv);
        step = ix_step(st);
        if (step == MD_IX_ROW)
            cur_metrics = json_col(st, 0);
        ix_finalize(st);
        if (step == MD_IX_ERROR) {
            json_decref(settings);
            return db_fail(s, err, "read the default's metrics");
        }
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
        rc = md_model_check(s, name, err);
        if (rc == MD_OK)
            rc = md_set_setting(s, name, "promote", policy, 1, "set the promotion policy", err);
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
    md_status rc = md_blob_upload(s, blob, err); /* S3: before the row, outside the mutex */
    pthread_mutex_lock(&s->mu);
    if (rc != MD_OK || (rc = txn_begin(s, err)) != MD_OK)
        goto unlock;
    if ((rc = md_blob_place(s, blob, "architecture", &moved, err)) != MD_OK)
        goto end;
    char now[32];
    now_iso(now);
    md_ixstmt *st = prep(s, "SELECT arch_sha256 FROM models WHERE name = ?", err);
    if (!st) {
        rc = MD_EIO;
        goto end;
    }
    ix_bind_text(st, 1, name);
    int step = ix_step(st);
    if (step == MD_IX_ROW && ix_column_type(st, 0) != MD_IXT_NULL &&
        strcmp(ix_column_text(st, 0), sha) != 0)
        md_sha_list_add(&released, ix_column_text(st, 0));
    ix_finalize(st);
    if (step == MD_IX_ERROR) {
        rc = db_fail(s, err, "read the architecture");
        goto end;
    }
    st = prep(s,
              "INSERT INTO models (name, created_at, updated_at, arch_sha256) VALUES (?1, ?2, ?2, "
              "?3) ON CONFLICT(name) DO UPDATE SET updated_at = ?2, arch_sha256 = ?3",
              err);
    if (!st) {
        rc = MD_EIO;
        goto end;
    }
    ix_bind_text(st, 1, name);
    ix_bind_text(st, 2, now);
    ix_bind_text(st, 3, sha);
    if (ix_step(st) != MD_IX_DONE)
        rc = db_fail(s, err, "set the architecture");
    ix_finalize(st);
end:
    rc = txn_end(s, rc, TXN_BUMP, err);
    /* committed: the old architecture, unless a version still uses it */
    md_blobs_settle(s, rc, &released, moved ? sha : NULL);
    md_blob_committed(blob, rc);
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
    md_ixstmt *st = prep(s, "SELECT arch_sha256 FROM models WHERE name = ?", err);
    if (!st) {
        rc = MD_EIO;
        goto out;
    }
    ix_bind_text(st, 1, name);
    int step = ix_step(st);
    if (step == MD_IX_ERROR)
        rc = db_fail(s, err, "read the architecture");
    else if (step != MD_IX_ROW)
        rc = md_model_missing(name, err);
    else if (ix_column_type(st, 0) == MD_IXT_NULL)
        rc = md_err_setc(err, MD_ENOTFOUND, "no_architecture",
                         "model %s has no architecture; PUT /models/%s/architecture with the "
                         "network as TorchScript (torch.jit.script(model).save(\"arch.pt\")): "
                         "curl -T arch.pt .../models/%s/architecture",
                         name, name, name);
    else
        snprintf(sha256, MD_SHA256_HEX, "%s", ix_column_text(st, 0));
    ix_finalize(st);
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
    md_ixstmt *st = prep(s,
                         "SELECT m.settings, m.default_version, d.metrics FROM models m "
                         "LEFT JOIN versions d ON d.model = m.name AND d.version = "
                         "m.default_version WHERE m.name = ?1 AND EXISTS (SELECT 1 FROM "
                         "versions v WHERE v.model = ?1 AND v.version = ?2 AND v.state = "
                         "'ready')",
                         err);
    if (!st)
        return MD_EIO;
    ix_bind_text(st, 1, name);
    ix_bind_int64(st, 2, version);
    int apply = 0;
    int step = ix_step(st);
    if (step == MD_IX_ROW) {
        json_t *settings = json_col(st, 0);
        json_t *p = json_object_get(settings, "promote");
        const char *pm = json_string_value(json_object_get(p, "metric"));
        if (pm && strcmp(pm, metric) == 0) {
            const char *order = json_string_value(json_object_get(p, "order"));
            int desc = !order || strcmp(order, "desc") == 0;
            int dv = ix_column_type(st, 1) == MD_IXT_NULL ? 0 : (int)ix_column_int64(st, 1);
            json_t *dm = ix_column_type(st, 2) == MD_IXT_NULL ? NULL : json_col(st, 2);
            json_t *theirs = json_object_get(dm, metric);
            if (dv != version) {
                if (dv <= 0 || !json_is_number(theirs))
                    apply = 1;
                else {
                    double d = json_number_value(theirs);
                    apply = desc ? value > d : value < d;
                }
            }
            json_decref(dm);
        }
        json_decref(settings);
    }
    md_status rc = step == MD_IX_ERROR ? db_fail(s, err, "read the promotion policy") : MD_OK;
    ix_finalize(st);
    if (rc != MD_OK)
        return rc;
    if (!apply)
        return MD_OK;
    rc = md_set_default_locked(s, name, version, "promote a version", err);
    if (rc == MD_OK)
        *promoted = 1;
    return rc;
}

md_status md_store_record_metric(md_store *s, const char *name, int version, const char *metric,
                                 double value, int *promoted, md_err *err)
{
    if (promoted)
        *promoted = 0;
    /* metric names stay within A-Z a-z 0-9 _ . - (they once became JSON
     * paths in SQL; the API keeps refusing the rest) */
    md_status rc = md_metric_name_check(metric, "record_metric", "invalid_metric", err);
    if (rc != MD_OK)
        return rc;
    pthread_mutex_lock(&s->mu);
    if ((rc = txn_begin(s, err)) != MD_OK)
        goto out;
    /* read, set with jansson, write back: inside the write transaction */
    md_ixstmt *st = prep(s, "SELECT metrics FROM versions WHERE model = ?1 AND version = ?2", err);
    json_t *metrics = NULL;
    if (!st) {
        rc = MD_EIO;
    } else {
        ix_bind_text(st, 1, name);
        ix_bind_int64(st, 2, version);
        int step = ix_step(st);
        if (step == MD_IX_ROW)
            metrics = json_col(st, 0);
        else if (step == MD_IX_DONE)
            rc = md_err_setc(err, MD_ENOTFOUND, "version_not_found",
                             "model %s has no version %d", name, version);
        else
            rc = db_fail(s, err, "record a metric");
        ix_finalize(st);
    }
    if (rc == MD_OK) {
        if (!json_is_object(metrics)) {
            json_decref(metrics);
            metrics = json_object();
        }
        json_object_set_new(metrics, metric, json_real(value));
        char *text = json_dumps(metrics, JSON_COMPACT);
        md_assert(text != NULL);
        st = prep(s, "UPDATE versions SET metrics = ?1 WHERE model = ?2 AND version = ?3", err);
        ix_bind_text(st, 1, text);
        ix_bind_text(st, 2, name);
        ix_bind_int64(st, 3, version);
        if (ix_step(st) != MD_IX_DONE)
            rc = db_fail(s, err, "record a metric");
        ix_finalize(st);
        free(text);
    }
    json_decref(metrics);
    if (rc == MD_OK && promoted)
        rc = promote_recorded(s, name, version, metric, value, promoted, err);
    rc = txn_end(s, rc, TXN_BUMP, err);
out:
    pthread_mutex_unlock(&s->mu);
    return rc;
}
