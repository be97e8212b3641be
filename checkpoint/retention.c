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

json_t *md_metric_get(json_t *metrics, const char *dotted)
{
    char key[128];
    json_t *v = metrics;
    const char *p = dotted;
    while (v && p && *p) {
        const char *dot = strchr(p, '.');
        size_t n = dot ? (size_t)(dot - p) : strlen(p);
        if (n >= sizeof key)
            return NULL;
        memcpy(key, p, n);
        key[n] = '\0';
        v = json_is_object(v) ? json_object_get(v, key) : NULL;
        p = dot ? dot + 1 : NULL;
    }
    return v && !json_is_null(v) ? v : NULL;
}

/* 0: a number (or boolean), 1: text (strings, and objects and arrays as
 * their JSON text, as json_extract answers them) */
static int metric_rank(json_t *v) { return json_is_number(v) || json_is_boolean(v) ? 0 : 1; }

static double metric_num(json_t *v)
{
    return json_is_boolean(v) ? (json_is_true(v) ? 1.0 : 0.0) : json_number_value(v);
}

int md_metric_cmp(json_t *a, json_t *b)
{
    int ra = metric_rank(a), rb = metric_rank(b);
    if (ra != rb)
        return ra < rb ? -1 : 1;
    if (ra == 0) {
        if (json_is_integer(a) && json_is_integer(b)) {
            json_int_t x = json_integer_value(a), y = json_integer_value(b);
            return x < y ? -1 : x > y;
        }
        double x = metric_num(a), y = metric_num(b);
        return x < y ? -1 : x > y;
    }
    char *ta = json_is_string(a) ? NULL : json_dumps(a, JSON_COMPACT | JSON_ENCODE_ANY);
    char *tb = json_is_string(b) ? NULL : json_dumps(b, JSON_COMPACT | JSON_ENCODE_ANY);
    int c = strcmp(ta ? ta : json_string_value(a), tb ? tb : json_string_value(b));
    free(ta);
    free(tb);
    return c < 0 ? -1 : c > 0;
}

/* One version row as retention weighs it. */
typedef struct ret_row {
    int version;
    int loading;
    char sha[MD_SHA256_HEX];
    char arch[MD_SHA256_HEX];
    json_t *metric; /* borrowed from metrics; NULL: absent */
    json_t *metrics;
    int keep;
} ret_row;

static int ret_asc; /* the direction of the best: guarded by ret_mu */
static pthread_mutex_t ret_mu = PTHREAD_MUTEX_INITIALIZER;

/* best first: ORDER BY metric ASC|DESC, version DESC */
static int by_best(const void *pa, const void *pb)
{
    const ret_row *a = *(ret_row *const *)pa, *b = *(ret_row *const *)pb;
    int c = md_metric_cmp(a->metric, b->metric);
    if (!ret_asc)
        c = -c;
    return c ? c : (a->version > b->version ? -1 : a->version < b->version);
}

/* See store_internal.h. Read every version of the model, decide in C what
 * is kept (the default, the newest keep_last, the best keep_best by the
 * metric; never a version still loading), delete the rest: all inside the
 * caller's write transaction, so the decision and the deletes are one. */
md_status md_store_apply_retention(md_store *s, const char *name, sha_list *released,
                                   md_err *err)
{
    md_ixstmt *st = prep(s, "SELECT settings, default_version FROM models WHERE name = ?1", err);
    if (!st)
        return MD_EIO;
    ix_bind_text(st, 1, name);
    json_t *settings = NULL;
    int def = 0;
    int step = ix_step(st);
    if (step == MD_IX_ROW) {
        settings = json_col(st, 0);
        def = (int)ix_column_int64(st, 1);
    }
    md_status rc = step == MD_IX_ERROR ? db_fail(s, err, "read the retention policy") : MD_OK;
    ix_finalize(st);
    json_t *r = settings ? json_object_get(settings, "retention") : NULL;
    if (rc != MD_OK || !json_is_object(r)) {
        json_decref(settings);
        return rc;
    }
    json_int_t keep_last = json_integer_value(json_object_get(r, "keep_last"));
    json_int_t keep_best = json_integer_value(json_object_get(r, "keep_best"));
    const char *metric = json_string_value(json_object_get(r, "metric"));
    const char *order = json_string_value(json_object_get(r, "order"));
    int asc = !order || strcmp(order, "asc") == 0;
    if (keep_last <= 0 && keep_best <= 0) {
        json_decref(settings);
        return MD_OK;
    }

    st = prep(s,
              "SELECT version, sha256, arch_sha256, state, metrics FROM versions "
              "WHERE model = ?1 ORDER BY version DESC",
              err);
    if (!st) {
        json_decref(settings);
        return MD_EIO;
    }
    ix_bind_text(st, 1, name);
    ret_row *rows = NULL;
    size_t n = 0, cap = 0;
    while ((step = ix_step(st)) == MD_IX_ROW) {
        if (n == cap) {
            cap = cap ? cap * 2 : 16;
            rows = realloc(rows, cap * sizeof *rows);
            md_assert(rows != NULL);
        }
        ret_row *row = &rows[n++];
        memset(row, 0, sizeof *row);
        row->version = (int)ix_column_int64(st, 0);
        const char *sha = ix_column_text(st, 1);
        snprintf(row->sha, sizeof row->sha, "%s", sha ? sha : "");
        if (ix_column_text(st, 2))
            snprintf(row->arch, sizeof row->arch, "%s", ix_column_text(st, 2));
        const char *state = ix_column_text(st, 3);
        row->loading = state && strcmp(state, "loading") == 0;
        row->metrics = json_col(st, 4);
        row->metric = metric ? md_metric_get(row->metrics, metric + 8) : NULL;
    }
    if (step != MD_IX_DONE)
        rc = db_fail(s, err, "read the versions for retention");
    ix_finalize(st);

    /* rows are newest first: the first keep_last are kept, and every
     * version with a share of the traffic split */
    for (size_t i = 0; i < n; i++)
        rows[i].keep = rows[i].version == def || rows[i].loading ||
                       md_settings_route_to(settings, rows[i].version) ||
                       (keep_last > 0 && (json_int_t)i < keep_last);
    json_decref(settings);
    if (keep_best > 0 && metric && n) {
        ret_row **best = md_xcalloc(n, sizeof *best);
        size_t nb = 0;
        for (size_t i = 0; i < n; i++)
            if (rows[i].metric)
                best[nb++] = &rows[i];
        pthread_mutex_lock(&ret_mu);
        ret_asc = asc;
        qsort(best, nb, sizeof *best, by_best);
        pthread_mutex_unlock(&ret_mu);
        for (size_t i = 0; i < nb && (json_int_t)i < keep_best; i++)
            best[i]->keep = 1;
        free(best);
    }

    if (rc == MD_OK && (st = prep(s, "DELETE FROM versions WHERE model = ?1 AND version = ?2",
                                  err)) == NULL)
        rc = MD_EIO;
    for (size_t i = 0; rc == MD_OK && i < n; i++) {
        if (rows[i].keep)
            continue;
        ix_reset(st);
        ix_bind_text(st, 1, name);
        ix_bind_int64(st, 2, rows[i].version);
        if (ix_step(st) != MD_IX_DONE) {
            rc = db_fail(s, err, "retention delete");
            break;
        }
        md_sha_list_add(released, rows[i].sha);
        /* the architecture a state_dict version was loaded into: collected
         * with it when nothing else uses it, as its weights are */
        if (rows[i].arch[0])
            md_sha_list_add(released, rows[i].arch);
        md_log(MD_LOG_INFO, "model %s: retention removed version %d", name, rows[i].version);
    }
    ix_finalize(st);
    for (size_t i = 0; i < n; i++)
        json_decref(rows[i].metrics);
    free(rows);
    return rc;
}
