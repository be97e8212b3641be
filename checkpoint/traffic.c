/*
 * traffic.c - a model's traffic split (issue 28): which versions answer its
 * unversioned predictions, by weight, and the header that keeps a client on
 * one version. Stored in the model row's settings ("traffic": {"3": 90,
 * "4": 10}, "sticky_header": "X-User-Id"), changed in one write transaction
 * that bumps the generation, so every replica sharing the index follows it
 * (handlers/traffic.c routes by it).
 */
#define _GNU_SOURCE
#include "store_internal.h"

#include <stdlib.h>
#include <string.h>

/* A version number as a traffic key: "1".."2147483647", no sign, no zeros first. */
static int version_key(const char *k, int *out)
{
    size_t n = strlen(k);
    if (n < 1 || n > 10 || k[0] < '1' || k[0] > '9')
        return 0;
    long long v = 0;
    for (size_t i = 0; i < n; i++) {
        if (k[i] < '0' || k[i] > '9')
            return 0;
        v = v * 10 + (k[i] - '0');
    }
    if (v > 2147483647LL)
        return 0;
    *out = (int)v;
    return 1;
}

/* An HTTP header name (RFC 9110 token), 1 to 64 bytes. */
static int header_name_ok(const char *h)
{
    size_t n = strlen(h);
    if (n < 1 || n > 64)
        return 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)h[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              strchr("!#$%&'*+-.^_`|~", c)))
            return 0;
    }
    return 1;
}

md_status md_traffic_check(json_t *traffic, json_t *sticky_header, md_err *err)
{
    if (sticky_header && !json_is_null(sticky_header) &&
        (!json_is_string(sticky_header) || !header_name_ok(json_string_value(sticky_header))))
        return md_err_setc(err, MD_EINVAL, "invalid_traffic",
                           "sticky_header must be an HTTP header name (letters, digits, - and "
                           "_, at most 64), e.g. \"X-User-Id\", or null");
    if (!traffic || json_is_null(traffic))
        return MD_OK;
    if (!json_is_object(traffic) || json_object_size(traffic) == 0)
        return md_err_setc(err, MD_EINVAL, "invalid_traffic",
                           "traffic must map versions to integer percentages summing to 100, "
                           "e.g. {\"3\": 90, \"4\": 10}, or be null to send every request to "
                           "the default");
    if (json_object_size(traffic) > MD_TRAFFIC_MAX_VERSIONS)
        return md_err_setc(err, MD_EINVAL, "invalid_traffic",
                           "traffic names %zu versions; at most %d may share a model's traffic",
                           json_object_size(traffic), MD_TRAFFIC_MAX_VERSIONS);
    long long sum = 0;
    const char *key;
    json_t *v;
    json_object_foreach(traffic, key, v)
    {
        int version;
        if (!version_key(key, &version))
            return md_err_setc(err, MD_EINVAL, "invalid_traffic",
                               "traffic key \"%.20s\" is not a version number; keys are versions "
                               "such as \"3\"",
                               key);
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > 100)
            return md_err_setc(err, MD_EINVAL, "invalid_traffic",
                               "traffic[\"%s\"] must be an integer percentage from 0 to 100", key);
        sum += json_integer_value(v);
    }
    if (sum != 100)
        return md_err_setc(err, MD_EINVAL, "invalid_traffic",
                           "the traffic percentages sum to %lld; they must sum to 100", sum);
    return MD_OK;
}

static md_status versions_usable(md_store *s, const char *name, json_t *traffic, md_err *err);

int md_settings_route_to(json_t *settings, int version)
{
    json_t *shadow = json_object_get(settings, "shadow");
    return md_traffic_names_version(json_object_get(settings, "traffic"), version) ||
           (json_is_object(shadow) && json_integer_value(json_object_get(shadow, "version")) ==
                                          version);
}

md_status md_shadow_check(json_t *shadow, md_err *err)
{
    if (!shadow || json_is_null(shadow))
        return MD_OK;
    const char *example = "e.g. {\"version\": 4, \"percent\": 100}";
    json_t *v = json_object_get(shadow, "version"), *p = json_object_get(shadow, "percent");
    if (!json_is_object(shadow) || !json_is_integer(v) || json_integer_value(v) < 1 ||
        json_integer_value(v) > 2147483647 ||
        (p && (!json_is_integer(p) || json_integer_value(p) < 1 || json_integer_value(p) > 100)))
        return md_err_setc(err, MD_EINVAL, "invalid_shadow",
                           "shadow must be {\"version\": N, \"percent\": 1..100} (percent "
                           "defaults to 100), %s, or null",
                           example);
    const char *key;
    json_t *x;
    json_object_foreach(shadow, key, x)
    {
        if (strcmp(key, "version") != 0 && strcmp(key, "percent") != 0)
            return md_err_setc(err, MD_EINVAL, "invalid_shadow",
                               "shadow has an unknown key \"%.40s\"; allowed: version, percent",
                               key);
    }
    return MD_OK;
}

md_status md_store_set_shadow(md_store *s, const char *name, json_t *shadow, json_t *note,
                              md_err *err)
{
    md_status rc = md_shadow_check(shadow, err);
    if (rc != MD_OK)
        return rc;
    json_t *pct = json_object_get(shadow, "percent");
    json_t *value = json_is_object(shadow)
                        ? json_pack("{s:O,s:I}", "version", json_object_get(shadow, "version"),
                                    "percent", pct ? json_integer_value(pct) : (json_int_t)100)
                        : json_null();
    pthread_mutex_lock(&s->mu);
    if ((rc = txn_begin(s, err)) != MD_OK)
        goto unlock;
    if ((rc = md_model_check(s, name, err)) != MD_OK)
        goto end;
    if (json_is_object(value)) {
        json_t *one = json_object();
        char k[16];
        snprintf(k, sizeof k, "%lld", (long long)json_integer_value(json_object_get(value,
                                                                                  "version")));
        json_object_set_new(one, k, json_integer(100));
        rc = versions_usable(s, name, one, err);
        json_decref(one);
        if (rc != MD_OK)
            goto end;
    }
    rc = md_set_setting(s, name, "shadow", value, 1, "set the shadow", err);
    if (rc == MD_OK && note) {
        json_t *change = json_pack("{s:O}", "shadow", value);
        rc = md_history_add_locked(s, name, note, change, err);
        json_decref(change);
    }
end:
    rc = txn_end(s, rc, TXN_BUMP, err);
unlock:
    pthread_mutex_unlock(&s->mu);
    json_decref(value);
    return md_model_hint(s, rc, name, err);
}

int md_traffic_names_version(json_t *traffic, int version)
{
    const char *key;
    json_t *v;
    json_object_foreach(traffic, key, v)
    {
        int k;
        if (version_key(key, &k) && k == version && json_integer_value(v) > 0)
            return 1;
    }
    return 0;
}

md_status md_promote_when_check(json_t *p, md_err *err)
{
    if (!p || json_is_null(p))
        return MD_OK;
    const char *example = "e.g. {\"min_requests\": 1000, \"max_error_rate\": 0.001}";
    if (!json_is_object(p))
        return md_err_setc(err, MD_EINVAL, "invalid_promote_when",
                           "promote_when must be an object, %s, or null", example);
    const char *key;
    json_t *v;
    json_object_foreach(p, key, v)
    {
        if (strcmp(key, "min_requests") == 0) {
            if (!json_is_integer(v) || json_integer_value(v) < 1 ||
                json_integer_value(v) > 1000000000)
                return md_err_setc(err, MD_EINVAL, "invalid_promote_when",
                                   "promote_when.min_requests must be an integer from 1 to 1e9");
        } else if (strcmp(key, "max_error_rate") == 0 || strcmp(key, "min_agreement") == 0) {
            if (!json_is_number(v) || json_number_value(v) < 0 || json_number_value(v) > 1)
                return md_err_setc(err, MD_EINVAL, "invalid_promote_when",
                                   "promote_when.%s must be a number from 0 to 1", key);
        } else {
            return md_err_setc(err, MD_EINVAL, "invalid_promote_when",
                               "promote_when has an unknown key \"%.40s\"; allowed: "
                               "min_requests, max_error_rate, min_agreement (%s)",
                               key, example);
        }
    }
    if (!json_object_get(p, "min_requests") || !json_object_get(p, "max_error_rate"))
        return md_err_setc(err, MD_EINVAL, "invalid_promote_when",
                           "promote_when needs both min_requests and max_error_rate, %s",
                           example);
    return MD_OK;
}

md_status md_history_add_locked(md_store *s, const char *name, json_t *note, json_t *change,
                                md_err *err)
{
    md_ixstmt *st = prep(s, "SELECT settings FROM models WHERE name = ?1", err);
    if (!st)
        return MD_EIO;
    ix_bind_text(st, 1, name);
    int step = ix_step(st);
    json_t *settings = step == MD_IX_ROW ? json_col(st, 0) : NULL;
    ix_finalize(st);
    if (step == MD_IX_ERROR)
        return db_fail(s, err, "read the history");
    json_t *h = json_object_get(settings, "history");
    json_t *list = json_is_array(h) ? json_copy(h) : json_array();
    json_decref(settings);
    char now[32];
    now_iso(now);
    json_t *e = json_deep_copy(note);
    if (!json_is_object(e)) {
        json_decref(e);
        e = json_object();
    }
    json_object_set_new(e, "at", json_string(now));
    json_object_set(e, "change", change);
    json_array_append_new(list, e);
    while (json_array_size(list) > MD_HISTORY_MAX)
        json_array_remove(list, 0);
    md_status rc = md_set_setting(s, name, "history", list, 0, "record the history", err);
    json_decref(list);
    return rc;
}

/* The split without its 0 shares (a version with none is not part of it:
 * it may be deleted, and nothing is routed to it). New reference; JSON null
 * and NULL stay as they are. */
static json_t *shares_only(json_t *traffic)
{
    if (!json_is_object(traffic))
        return json_incref(traffic);
    json_t *out = json_object();
    const char *key;
    json_t *v;
    json_object_foreach(traffic, key, v)
    {
        if (json_integer_value(v) > 0)
            json_object_set(out, key, v);
    }
    return out;
}

/* Check that each version given a share exists and has not failed (mu held). */
static md_status versions_usable(md_store *s, const char *name, json_t *traffic, md_err *err)
{
    const char *key;
    json_t *v;
    json_object_foreach(traffic, key, v)
    {
        int version = atoi(key);
        if (json_integer_value(v) <= 0)
            continue;
        json_t *row = NULL;
        md_status rc = md_get_version_locked(s, name, version, &row, err);
        if (rc != MD_OK)
            return rc;
        const char *state = json_string_value(json_object_get(row, "state"));
        if (state && strcmp(state, "failed") == 0 && json_integer_value(v) > 0) {
            rc = md_err_setc(err, MD_ECONFLICT, "version_failed",
                             "model %s version %d failed (%s) and cannot take traffic", name,
                             version, json_string_value(json_object_get(row, "state_reason")));
            json_decref(row);
            return rc;
        }
        json_decref(row);
    }
    return MD_OK;
}

/* Set traffic (and, when it is cleared, the keys that go with it), mu held
 * inside the transaction. */
static md_status set_split_locked(md_store *s, const char *name, json_t *traffic, json_t *sticky,
                                  json_t *promote_when, md_err *err)
{
    md_status rc = MD_OK;
    json_t *null = json_null();
    if (traffic && json_is_null(traffic)) /* no split: what went with it goes too */
        sticky = promote_when = null;
    if (traffic)
        rc = md_set_setting(s, name, "traffic", traffic, 1, "set the traffic split", err);
    if (rc == MD_OK && sticky)
        rc = md_set_setting(s, name, "sticky_header", sticky, 1, "set the sticky header", err);
    if (rc == MD_OK && promote_when)
        rc = md_set_setting(s, name, "promote_when", promote_when, 1, "set promote_when", err);
    json_decref(null);
    return rc;
}

md_status md_store_set_traffic(md_store *s, const char *name, json_t *traffic,
                               json_t *sticky_header, json_t *promote_when, json_t *note,
                               md_err *err)
{
    md_status rc = md_traffic_check(traffic, sticky_header, err);
    if (rc == MD_OK)
        rc = md_promote_when_check(promote_when, err);
    if (rc != MD_OK)
        return rc;
    traffic = shares_only(traffic); /* our reference from here */
    pthread_mutex_lock(&s->mu);
    if ((rc = txn_begin(s, err)) != MD_OK)
        goto unlock;
    /* inside the transaction: a replica cannot delete or fail a version
     * between this check and the commit */
    if ((rc = md_model_check(s, name, err)) != MD_OK)
        goto end;
    if (json_is_object(traffic) && (rc = versions_usable(s, name, traffic, err)) != MD_OK)
        goto end;
    rc = set_split_locked(s, name, traffic, sticky_header, promote_when, err);
    if (rc == MD_OK && note) {
        json_t *change = json_object();
        if (traffic)
            json_object_set(change, "traffic", traffic);
        if (sticky_header)
            json_object_set(change, "sticky_header", sticky_header);
        if (promote_when)
            json_object_set(change, "promote_when", promote_when);
        rc = md_history_add_locked(s, name, note, change, err);
        json_decref(change);
    }
end:
    rc = txn_end(s, rc, TXN_BUMP, err);
unlock:
    pthread_mutex_unlock(&s->mu);
    json_decref(traffic);
    return md_model_hint(s, rc, name, err);
}

md_status md_store_check_traffic(md_store *s, const char *name, json_t *traffic, md_err *err)
{
    md_status rc = md_traffic_check(traffic, NULL, err);
    if (rc != MD_OK || !json_is_object(traffic))
        return rc;
    pthread_mutex_lock(&s->mu);
    rc = md_model_check(s, name, err);
    if (rc == MD_OK)
        rc = versions_usable(s, name, traffic, err);
    pthread_mutex_unlock(&s->mu);
    return md_model_hint(s, rc, name, err);
}

md_status md_store_traffic_all(md_store *s, json_t **out, md_err *err)
{
    *out = NULL;
    pthread_mutex_lock(&s->mu);
    md_status rc = MD_OK;
    md_ixstmt *st = prep(s, "SELECT name, settings FROM models ORDER BY name", err);
    if (!st) {
        rc = MD_EIO;
        goto out;
    }
    json_t *all = json_object();
    int step;
    while ((step = ix_step(st)) == MD_IX_ROW) {
        json_t *settings = json_col(st, 1);
        json_t *t = json_object_get(settings, "traffic");
        json_t *sh = json_object_get(settings, "shadow");
        if (json_is_object(t) || json_is_object(sh)) {
            json_t *h = json_object_get(settings, "sticky_header");
            json_t *p = json_object_get(settings, "promote_when");
            json_object_set_new(all, ix_column_text(st, 0),
                                json_pack("{s:O,s:O,s:O,s:O}", "traffic",
                                          json_is_object(t) ? t : json_null(), "sticky_header",
                                          json_is_string(h) ? h : json_null(), "promote_when",
                                          json_is_object(p) ? p : json_null(), "shadow",
                                          json_is_object(sh) ? sh : json_null()));
        }
        json_decref(settings);
    }
    if (step == MD_IX_ERROR) {
        rc = db_fail(s, err, "read the traffic splits");
        json_decref(all);
    } else {
        *out = all;
    }
    ix_finalize(st);
out:
    pthread_mutex_unlock(&s->mu);
    return rc;
}

md_status md_store_apply_verdict(md_store *s, const char *name, json_t *expect, int new_default,
                                 json_t *new_traffic, json_t *note, md_err *err)
{
    return md_store_apply_verdict_on(s, name, "traffic", expect, new_default, new_traffic, note,
                                     err);
}

md_status md_store_apply_verdict_on(md_store *s, const char *name, const char *key,
                                    json_t *expect, int new_default, json_t *new_value,
                                    json_t *note, md_err *err)
{
    int shadow = strcmp(key, "shadow") == 0;
    pthread_mutex_lock(&s->mu);
    md_status rc;
    if ((rc = txn_begin(s, err)) != MD_OK)
        goto unlock;
    md_ixstmt *st = prep(s, "SELECT settings FROM models WHERE name = ?1", err);
    if (!st) {
        rc = MD_EIO;
        goto end;
    }
    ix_bind_text(st, 1, name);
    int step = ix_step(st);
    json_t *settings = step == MD_IX_ROW ? json_col(st, 0) : NULL;
    ix_finalize(st);
    if (step == MD_IX_ERROR) {
        rc = db_fail(s, err, "read the traffic split");
        goto end;
    }
    /* inside the write transaction: exactly one replica acts on a split */
    int same = settings && json_equal(json_object_get(settings, key), expect);
    int split_left = settings && json_is_object(json_object_get(settings, "traffic"));
    json_decref(settings);
    if (!same) {
        rc = md_err_setc(err, MD_ECONFLICT, "traffic_changed",
                         "the %s of model %s changed meanwhile", shadow ? "shadow" : "split",
                         name);
        goto end;
    }
    if (new_default > 0)
        rc = md_set_default_locked(s, name, new_default, "promote the canary", err);
    if (rc == MD_OK && !shadow)
        rc = set_split_locked(s, name, new_value, NULL, NULL, err);
    if (rc == MD_OK && shadow) {
        rc = md_set_setting(s, name, "shadow", new_value, 1, "end the shadow", err);
        if (rc == MD_OK && json_is_null(new_value) && !split_left) { /* nothing left to judge */
            json_t *null = json_null();
            rc = md_set_setting(s, name, "promote_when", null, 1, "clear promote_when", err);
            json_decref(null);
        }
    }
    if (rc == MD_OK) {
        json_t *change = json_pack("{s:O}", key, new_value);
        if (new_default > 0)
            json_object_set_new(change, "default_version", json_integer(new_default));
        rc = md_history_add_locked(s, name, note, change, err);
        json_decref(change);
    }
end:
    rc = txn_end(s, rc, TXN_BUMP, err);
unlock:
    pthread_mutex_unlock(&s->mu);
    return rc;
}

md_status md_store_history(md_store *s, const char *name, json_t **out, md_err *err)
{
    *out = NULL;
    pthread_mutex_lock(&s->mu);
    md_status rc = md_model_check(s, name, err);
    md_ixstmt *st = rc == MD_OK ? prep(s, "SELECT settings FROM models WHERE name = ?1", err)
                                : NULL;
    if (rc == MD_OK && !st)
        rc = MD_EIO;
    if (st) {
        ix_bind_text(st, 1, name);
        int step = ix_step(st);
        json_t *settings = step == MD_IX_ROW ? json_col(st, 0) : NULL;
        if (step == MD_IX_ERROR)
            rc = db_fail(s, err, "read the history");
        else if (step == MD_IX_DONE) /* deleted since the check */
            rc = md_model_missing(name, err);
        ix_finalize(st);
        json_t *h = json_object_get(settings, "history");
        if (rc == MD_OK)
            *out = json_is_array(h) ? json_incref(h) : json_array();
        json_decref(settings);
    }
    pthread_mutex_unlock(&s->mu);
    return md_model_hint(s, rc, name, err);
}
