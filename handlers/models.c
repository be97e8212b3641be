/*
 * models.c - the model registry over HTTP, apart from deploying (deploy.c,
 * upload.c): list and read models and versions, download a stored
 * checkpoint, roll the default, set retention and promotion (PATCH), delete.
 *
 * Reads and a whole model's DELETE answer on the handler thread (a store
 * call each); PATCH and a version's DELETE may load a stored version, so they
 * run on a deferred thread.
 */
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "deploy.h"

/* ---- reading ---- */

static void reply_result(md_req *req, md_status st, json_t *out, const md_err *err)
{
    if (st == MD_OK)
        md_reply_json(req, 200, out);
    else
        md_reply_error(req, err);
}

void md_handle_models_list(md_req *req)
{
    md_app *app = md_req_app(req);
    md_err err;
    md_err_clear(&err);
    long limit;
    if (!md_req_limit(req, &limit))
        return;
    json_t *out = NULL;
    md_status st = md_store_list_models(app->store, md_req_query(req, "after"), (int)limit, &out, &err);
    reply_result(req, st, out, &err);
}

void md_handle_model_get(md_req *req)
{
    md_app *app = md_req_app(req);
    md_err err;
    json_t *out = NULL;
    const char *name = md_req_param(req, "name");
    md_status st = md_store_get_model(app->store, name, &out, &err);
    if (st == MD_OK) {
        /* the batchers of this model's loaded versions: batch sizes, queue waits */
        json_t *all = md_registry_stats(app->registry), *mine = json_array();
        size_t i;
        json_t *s;
        json_array_foreach(all, i, s)
        {
            if (strcmp(json_string_value(json_object_get(s, "model")), name) == 0)
                json_array_append(mine, s);
        }
        json_decref(all);
        json_object_set_new(out, "loaded", mine);
    }
    reply_result(req, st, out, &err);
}

/* order_by=metrics.KEY where no version has KEY sorts nothing: a typo
 * (metrics.los) would answer 200 in version order. Answer 400 naming the
 * metrics the versions have and the nearest one. No versions: nothing to
 * check. */
static md_status check_metric_known(json_t *versions, const char *key, md_err *err)
{
    enum { MAX_KEYS = 64 };
    const char *keys[MAX_KEYS];
    size_t n = 0;
    size_t i;
    json_t *v;
    if (json_array_size(versions) == 0)
        return MD_OK;
    json_array_foreach(versions, i, v)
    {
        json_t *metrics = json_object_get(v, "metrics");
        if (json_object_get(metrics, key))
            return MD_OK;
        const char *k;
        json_t *val;
        json_object_foreach(metrics, k, val)
        {
            size_t j = 0;
            while (j < n && strcmp(keys[j], k) != 0)
                j++;
            if (j == n && n < MAX_KEYS)
                keys[n++] = k; /* borrowed from `versions`, alive until the reply */
        }
    }
    char have[256] = "";
    size_t used = 0;
    for (size_t j = 0; j < n && used < sizeof have; j++)
        used += (size_t)snprintf(have + used, sizeof have - used, "%s%s", j ? ", " : "", keys[j]);
    const char *near = md_suggest(key, keys, n);
    char hint[96] = "";
    if (near)
        snprintf(hint, sizeof hint, "; did you mean metrics.%.64s?", near);
    return md_err_setc(err, MD_EINVAL, "unknown_metric",
                       "order_by=metrics.%.64s: no version of this model has metric \"%.64s\"; "
                       "%s%s%s",
                       key, key, n ? "their metrics are: " : "the versions have no metrics",
                       have, hint);
}

void md_handle_versions_list(md_req *req)
{
    md_app *app = md_req_app(req);
    md_err err;
    md_err_clear(&err);
    const char *order = md_req_query(req, "order");
    if (order && strcmp(order, "asc") != 0 && strcmp(order, "desc") != 0) {
        md_err_setc(&err, MD_EINVAL, "invalid_order", "order=%.20s: use asc or desc", order);
        md_reply_error(req, &err);
        return;
    }
    json_t *out = NULL;
    const char *order_by = md_req_query(req, "order_by");
    md_status st = md_store_list_versions(app->store, md_req_param(req, "name"), order_by,
                                          !order || strcmp(order, "asc") == 0, &out, &err);
    if (st == MD_OK && order_by && strncmp(order_by, "metrics.", 8) == 0)
        st = check_metric_known(out, order_by + 8, &err);
    if (st == MD_OK) {
        size_t i;
        json_t *v;
        json_array_foreach(out, i, v)
            md_app_add_residency(app, v);
        out = json_pack("{s:o}", "versions", out);
    }
    else
        json_decref(out), out = NULL;
    reply_result(req, st, out, &err);
}

void md_handle_version_get(md_req *req)
{
    md_app *app = md_req_app(req);
    md_err err;
    int version;
    if (!md_req_version_param(req, &version))
        return;
    json_t *out = NULL;
    md_status st = md_store_get_version(app->store, md_req_param(req, "name"), version, &out, &err);
    if (st == MD_OK)
        md_app_add_residency(app, out);
    reply_result(req, st, out, &err);
}

/* ---- loading and unloading for the operator ---- */

/* On a deferred thread: the load may take seconds (or wait on another's). */
static void version_load_deferred(md_req *req)
{
    md_app *app = md_req_app(req);
    md_err err;
    md_err_clear(&err);
    int version = *(const int *)md_req_state(req);
    const char *name = md_req_param(req, "name");
    /* the stored default loads as the default (it may have been unloaded) */
    int make_default = md_app_stored_default(app, name) == version;
    md_model *m = md_app_load_stored(app, name, version, make_default, &err);
    if (!m) {
        md_reply_error(req, &err);
        return;
    }
    md_model_release(m); /* the registry holds it */
    json_t *out = NULL;
    md_status st = md_store_get_version(app->store, name, version, &out, &err);
    if (st == MD_OK)
        md_app_add_residency(app, out);
    reply_result(req, st, out, &err);
}

void md_handle_version_load(md_req *req)
{
    int version;
    if (!md_req_version_param(req, &version))
        return;
    int *state = md_xmalloc(sizeof *state);
    *state = version;
    md_req_set_state(req, state, free);
    md_req_defer(req, version_load_deferred);
}

/* Unloading never blocks: the registry lets go of its reference, requests
 * in flight finish on theirs, and the last one frees the weights. A default
 * stays the default and its next request loads it again. */
void md_handle_version_unload(md_req *req)
{
    md_app *app = md_req_app(req);
    md_err err;
    int version;
    if (!md_req_version_param(req, &version))
        return;
    const char *name = md_req_param(req, "name");
    json_t *out = NULL;
    md_status st = md_store_get_version(app->store, name, version, &out, &err);
    if (st == MD_OK) {
        md_registry_unload(app->registry, name, version); /* logs when it was loaded */
        md_app_add_residency(app, out);
    }
    reply_result(req, st, out, &err);
}

/* The stored file: deferred, since with blobs in S3 it may be downloaded
 * into the cache first. */
static void checkpoint_deferred(md_req *req)
{
    md_app *app = md_req_app(req);
    md_err err;
    int version;
    if (!md_req_version_param(req, &version))
        return;
    json_t *v = NULL;
    md_status st = md_store_get_version(app->store, md_req_param(req, "name"), version, &v, &err);
    if (st != MD_OK) {
        md_reply_error(req, &err);
        return;
    }
    char path[4096], sha[MD_SHA256_HEX];
    snprintf(sha, sizeof sha, "%s", json_string_value(json_object_get(v, "sha256")));
    if ((st = md_app_blob(app, sha, path, sizeof path, &err)) != MD_OK) {
        json_decref(v);
        md_reply_error(req, &err);
        return;
    }
    /* The name says what opens the file: safetensors' loader for a
     * safetensors version, torch.load / torch.jit.load for the zips */
    const char *stored = json_string_value(json_object_get(v, "format"));
    const char *ext = stored && strcmp(stored, MD_FORMAT_SAFETENSORS) == 0 ? "safetensors" : "pt";
    json_decref(v);
    char etag[MD_SHA256_HEX + 2];
    snprintf(etag, sizeof etag, "\"%s\"", sha);
    md_reply_header(req, "ETag", etag);
    const char *inm = md_req_header(req, "If-None-Match");
    if (inm && (strcmp(inm, etag) == 0 || strcmp(inm, sha) == 0)) {
        md_app_blob_done(app, sha);
        md_reply_bytes(req, 304, "application/octet-stream", NULL, 0);
        return;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    md_app_blob_done(app, sha); /* open: an eviction now leaves the bytes readable */
    struct stat sb;
    if (fd < 0 || fstat(fd, &sb) != 0) {
        if (fd >= 0)
            close(fd);
        md_err_setc(&err, MD_EIO, "checkpoint_missing",
                    "the checkpoint file of model %s version %d is missing from the store",
                    md_req_param(req, "name"), version);
        md_reply_error(req, &err);
        return;
    }
    char disp[160];
    snprintf(disp, sizeof disp, "attachment; filename=\"%s-v%d.%s\"", md_req_param(req, "name"),
             version, ext);
    md_reply_header(req, "Content-Disposition", disp);
    md_reply_fd(req, 200, "application/octet-stream", fd, (size_t)sb.st_size);
}

void md_handle_version_checkpoint(md_req *req)
{
    md_err err;
    int version;
    if (!md_req_version_param(req, &version))
        return;
    const char *format = md_req_query(req, "format");
    if (format && strcmp(format, "safetensors") == 0) {
        md_version_export_safetensors(req, version);
        return;
    }
    if (format && strcmp(format, "original") != 0) {
        md_err_setc(&err, MD_EINVAL, "invalid_format",
                    "format=%.40s: use safetensors (the weights) or original (the stored file)",
                    format);
        md_reply_error(req, &err);
        return;
    }
    md_req_defer(req, checkpoint_deferred);
}

/* ---- changing and deleting ---- */

/* PATCH and DELETE may load a stored version (seconds of libtorch and
 * SQLite): they run on a deferred thread, never a libmicrohttpd one. */
static void model_patch_deferred(md_req *req)
{
    md_app *app = md_req_app(req);
    md_err err;
    md_err_clear(&err);
    const char *name = md_req_param(req, "name");
    json_t *body = md_req_json_object(req, "{\"default_version\": 2}");
    if (!body)
        return;
    md_status st = MD_OK;
    const char *key;
    json_t *v;
    json_object_foreach(body, key, v)
    {
        if (strcmp(key, "default_version") != 0 && strcmp(key, "retention") != 0 &&
            strcmp(key, "promote") != 0 && strcmp(key, "traffic") != 0 &&
            strcmp(key, "sticky_header") != 0 && strcmp(key, "promote_when") != 0 &&
            strcmp(key, "reason") != 0 && strcmp(key, "shadow") != 0) {
            st = md_err_setc(&err, MD_EINVAL, "unknown_field",
                             "unknown key \"%.40s\"; allowed: default_version, retention, "
                             "promote, traffic, sticky_header, promote_when, shadow, reason",
                             key);
            break;
        }
    }
    json_t *dv = json_object_get(body, "default_version");
    json_t *ret = json_object_get(body, "retention");
    json_t *promote = json_object_get(body, "promote");
    json_t *traffic = json_object_get(body, "traffic");
    json_t *sticky = json_object_get(body, "sticky_header");
    json_t *when = json_object_get(body, "promote_when");
    json_t *reason = json_object_get(body, "reason");
    json_t *shadow = json_object_get(body, "shadow");
    if (st == MD_OK && shadow)
        st = md_shadow_check(shadow, &err);
    if (st == MD_OK && (traffic || sticky))
        st = md_traffic_check(traffic, sticky, &err);
    if (st == MD_OK && when)
        st = md_promote_when_check(when, &err);
    if (st == MD_OK && reason &&
        (!json_is_string(reason) || json_string_length(reason) > 500))
        st = md_err_setc(&err, MD_EINVAL, "invalid_reason",
                         "reason must be a string of at most 500 bytes: why the change, for "
                         "GET /models/%s/history",
                         name);
    /* who and why, for the history of the default and the traffic */
    json_t *note = json_pack("{s:s,s:s}", "by", "api", "request_id", md_req_id(req));
    if (json_is_string(reason))
        json_object_set(note, "reason", reason);
    if (st == MD_OK && dv && (!json_is_integer(dv) || json_integer_value(dv) < 1))
        st = md_err_setc(&err, MD_EINVAL, "invalid_version",
                         "default_version must be a positive integer");
    if (st == MD_OK && ret)
        st = md_retention_check(ret, &err);
    if (st == MD_OK && promote)
        st = md_promote_check(promote, &err);
    if (st == MD_OK && !dv && !ret && !promote && !traffic && !sticky && !when && !shadow)
        st = md_err_setc(&err, MD_EINVAL, "empty_patch",
                         "nothing to change; give default_version, retention, promote, traffic, "
                         "sticky_header, promote_when and/or shadow");
    if (st == MD_OK && json_is_object(shadow)) {
        /* the shadow version must load too, before anything changes */
        md_model *m = md_app_load_stored(
            app, name, (int)json_integer_value(json_object_get(shadow, "version")), 0, &err);
        if (!m)
            st = err.status;
        md_model_release(m);
    }
    if (st == MD_OK && json_is_object(traffic))
        st = md_store_check_traffic(app->store, name, traffic, &err);
    if (st == MD_OK && json_is_object(traffic)) {
        /* every version given a share must load (here, once, before any
         * request is sent to it), or the split is refused as it stands;
         * before anything else of the PATCH changes */
        const char *vkey;
        json_t *w;
        json_object_foreach(traffic, vkey, w)
        {
            if (json_integer_value(w) <= 0)
                continue;
            md_model *m = md_app_load_stored(app, name, atoi(vkey), 0, &err);
            if (!m) {
                st = err.status;
                break;
            }
            md_model_release(m);
        }
    }
    if (st == MD_OK && dv)
        st = md_store_set_default_noted(app->store, name, (int)json_integer_value(dv), note,
                                        &err);
    if (st == MD_OK && dv &&
        !md_registry_set_default(app->registry, name, (int)json_integer_value(dv))) {
        /* not loaded yet: load it (once, however many ask), then swap it in */
        md_model *m = md_app_load_stored(app, name, (int)json_integer_value(dv), 1, &err);
        if (m)
            md_model_release(m); /* the registry holds it */
        else
            st = err.status;
    }
    if (st == MD_OK && promote)
        st = md_store_set_promote(app->store, name, promote, &err);
    if (st == MD_OK && (traffic || sticky || when))
        st = md_store_set_traffic(app->store, name, traffic, sticky, when, note, &err);
    if (st == MD_OK && shadow)
        st = md_store_set_shadow(app->store, name, shadow, note, &err);
    /* retention last: it keeps the versions the split (new or old) gives a share */
    if (st == MD_OK && ret) {
        st = md_store_set_retention(app->store, name, ret, &err);
        md_app_forget(app, name, 0); /* retention may have deleted versions */
    }
    json_decref(note);
    json_decref(body);
    json_t *out = NULL;
    if (st == MD_OK)
        st = md_store_get_model(app->store, name, &out, &err);
    if (st == MD_OK && (traffic || sticky || when || shadow)) /* here now; others at sync */
        md_traffic_set(app->traffic, name, json_object_get(out, "traffic"),
                       json_string_value(json_object_get(out, "sticky_header")),
                       json_object_get(out, "promote_when"), json_object_get(out, "shadow"));
    reply_result(req, st, out, &err);
}

void md_handle_model_patch(md_req *req) { md_req_defer(req, model_patch_deferred); }

static void history_deferred(md_req *req)
{
    md_app *app = md_req_app(req);
    md_err err;
    md_err_clear(&err);
    json_t *h = NULL;
    md_status st = md_store_history(app->store, md_req_param(req, "name"), &h, &err);
    reply_result(req, st, st == MD_OK ? json_pack("{s:s,s:o}", "model",
                                                  md_req_param(req, "name"), "history", h)
                                      : NULL,
                 &err);
}

void md_handle_model_history(md_req *req) { md_req_defer(req, history_deferred); }

static void shadow_deferred(md_req *req)
{
    md_app *app = md_req_app(req);
    md_err err;
    md_err_clear(&err);
    const char *name = md_req_param(req, "name");
    json_t *info = NULL;
    md_status st = md_store_get_model(app->store, name, &info, &err);
    json_t *out = NULL;
    if (st == MD_OK)
        out = json_pack("{s:s,s:O,s:o}", "model", name, "shadow",
                        json_object_get(info, "shadow"), "pairs", md_shadow_json(name));
    json_decref(info);
    reply_result(req, st, out, &err);
}

void md_handle_model_shadow(md_req *req) { md_req_defer(req, shadow_deferred); }

typedef struct delete_args {
    int version, force;
} delete_args;

static void version_delete_deferred(md_req *req)
{
    md_app *app = md_req_app(req);
    md_err err;
    md_err_clear(&err);
    const delete_args *a = md_req_state(req);
    int version = a->version, force = a->force;
    const char *name = md_req_param(req, "name");
    md_status st = md_store_delete_version(app->store, name, version, force, &err);
    if (st == MD_OK) {
        /* forget first: a load of this version still running then keeps its
         * model out of the registry (app.c load_once) */
        md_app_forget(app, name, version); /* the number may be uploaded again */
        md_registry_remove(app->registry, name, version);
        /* a forced delete of the default moved it: follow in the registry */
        json_t *info = NULL;
        if (md_store_get_model(app->store, name, &info, NULL) == MD_OK) {
            json_t *dv = json_object_get(info, "default_version");
            if (json_is_integer(dv) &&
                !md_registry_set_default(app->registry, name, (int)json_integer_value(dv))) {
                md_err lerr;
                md_model_release(
                    md_app_load_stored(app, name, (int)json_integer_value(dv), 1, &lerr));
            }
            json_decref(info);
        }
    }
    reply_result(req, st,
                 st == MD_OK ? json_pack("{s:{s:s,s:i}}", "deleted", "model", name, "version",
                                         version)
                             : NULL,
                 &err);
}

void md_handle_version_delete(md_req *req)
{
    md_err err;
    md_err_clear(&err);
    delete_args a = {0, 0};
    if (!md_req_version_param(req, &a.version))
        return;
    /* query arguments are read here, on the handler thread */
    const char *f = md_req_query(req, "force");
    if (f && md_deploy_bool("force", f, &a.force, &err) != MD_OK) {
        md_reply_error(req, &err);
        return;
    }
    delete_args *state = md_xmalloc(sizeof *state);
    *state = a;
    md_req_set_state(req, state, free);
    md_req_defer(req, version_delete_deferred);
}

void md_handle_model_delete(md_req *req)
{
    md_app *app = md_req_app(req);
    md_err err;
    const char *name = md_req_param(req, "name");
    md_status st = md_store_delete_model(app->store, name, &err);
    if (st == MD_OK) {
        md_app_forget(app, name, 0); /* first: see the version delete */
        md_traffic_set(app->traffic, name, NULL, NULL, NULL, NULL);
        md_registry_remove(app->registry, name, 0);
    }
    reply_result(req, st, st == MD_OK ? json_pack("{s:{s:s}}", "deleted", "model", name) : NULL,
                 &err);
}
