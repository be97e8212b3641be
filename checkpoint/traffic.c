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

md_status md_store_set_traffic(md_store *s, const char *name, json_t *traffic,
                               json_t *sticky_header, md_err *err)
{
    md_status rc = md_traffic_check(traffic, sticky_header, err);
    if (rc != MD_OK)
        return rc;
    pthread_mutex_lock(&s->mu);
    if ((rc = txn_begin(s, err)) != MD_OK)
        goto unlock;
    /* inside the transaction: a replica cannot delete or fail a version
     * between this check and the commit */
    if ((rc = md_model_check(s, name, err)) != MD_OK)
        goto end;
    const char *key;
    json_t *v;
    if (traffic && !json_is_null(traffic))
        json_object_foreach(traffic, key, v)
        {
            int version = atoi(key);
            json_t *row = NULL;
            if ((rc = md_get_version_locked(s, name, version, &row, err)) != MD_OK)
                goto end;
            const char *state = json_string_value(json_object_get(row, "state"));
            if (state && strcmp(state, "failed") == 0 && json_integer_value(v) > 0) {
                rc = md_err_setc(err, MD_ECONFLICT, "version_failed",
                                 "model %s version %d failed (%s) and cannot take traffic", name,
                                 version, json_string_value(json_object_get(row, "state_reason")));
                json_decref(row);
                goto end;
            }
            json_decref(row);
        }
    if (traffic)
        rc = md_set_setting(s, name, "traffic", traffic, 1, "set the traffic split", err);
    if (rc == MD_OK && traffic && json_is_null(traffic) && !sticky_header)
        sticky_header = json_null(); /* no split: its sticky header goes with it */
    if (rc == MD_OK && sticky_header)
        rc = md_set_setting(s, name, "sticky_header", sticky_header, 1, "set the sticky header",
                            err);
end:
    rc = txn_end(s, rc, TXN_BUMP, err);
unlock:
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
        if (json_is_object(t)) {
            json_t *h = json_object_get(settings, "sticky_header");
            json_object_set_new(all, ix_column_text(st, 0),
                                json_pack("{s:O,s:O}", "traffic", t, "sticky_header",
                                          json_is_string(h) ? h : json_null()));
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
