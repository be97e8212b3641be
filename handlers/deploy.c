/*
 * deploy.c - deploying a version, whichever way it comes: what a deployment
 * asks for (its fields, each checked before any byte is stored), the one
 * commit every way ends in (md_deploy_commit: load, add the row, serve), and
 * POST /models, a version registered from a URL. Uploads (multipart, raw, a
 * JSON average) are upload.c's; both share deploy.h.
 *
 * Finishing (fsync, rename, SQLite commit), loads and downloads run on a
 * deferred thread with the connection suspended, so no server thread waits
 * on disk or network.
 */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "deploy.h"

/* ---- what a deployment asks for, whichever way it came ---- */

const char *const md_deploy_fields[] = {"config",       "metadata", "metrics", "version",
                                        "make_default", "deploy",   "sha256",  "retention",
                                        NULL};

md_status md_deploy_mark_given(deploy_req *d, const char *field, md_err *err)
{
    for (unsigned i = 0; md_deploy_fields[i]; i++) {
        if (strcmp(field, md_deploy_fields[i]) != 0)
            continue;
        if (d->given & (1u << i))
            return md_err_setc(err, MD_EINVAL, "duplicate_field",
                               "%s is given twice (as two form fields, or as a form field and a "
                               "query argument); give it once",
                               field);
        d->given |= 1u << i;
        return MD_OK;
    }
    return MD_OK;
}

void md_deploy_req_free(deploy_req *d)
{
    free(d->source);
    json_decref(d->config);
    json_decref(d->metadata);
    json_decref(d->metrics);
    json_decref(d->retention);
    memset(d, 0, sizeof *d);
}

md_status md_check_model_name(const char *name, md_err *err)
{
    if (!name || !md_model_name_ok(name))
        return md_err_setc(err, MD_EINVAL, "invalid_name",
                           "model name \"%.80s\" is invalid; use 1 to 64 of A-Z a-z 0-9 . _ -",
                           name ? name : "");
    return MD_OK;
}

md_status md_deploy_bool(const char *field, const char *text, int *out, md_err *err)
{
    if (strcmp(text, "true") == 0 || strcmp(text, "1") == 0)
        *out = 1;
    else if (strcmp(text, "false") == 0 || strcmp(text, "0") == 0)
        *out = 0;
    else
        return md_err_set(err, MD_EINVAL, "%s=\"%.40s\" is not a boolean; use true or false", field,
                          text);
    return MD_OK;
}

static md_status parse_version_text(const char *text, int *out, md_err *err)
{
    char *end;
    long v = strtol(text, &end, 10);
    if (end == text || *end || v < 1 || v > 1000000000)
        return md_err_setc(err, MD_EINVAL, "invalid_version",
                           "version \"%.40s\" is not a positive integer", text);
    *out = (int)v;
    return MD_OK;
}

md_status md_deploy_check_sha(const char *text, md_err *err)
{
    size_t n = strlen(text);
    int ok = n == 64;
    for (size_t i = 0; ok && i < n; i++)
        ok = strchr("0123456789abcdefABCDEF", text[i]) != NULL;
    if (!ok)
        return md_err_set(err, MD_EINVAL, "sha256 \"%.80s\" is not 64 hex digits", text);
    return MD_OK;
}

/* config/metadata/metrics: a JSON object; metrics values must be numbers
 * (they are ordered and compared). */
static void set_slot(json_t **slot, json_t *v)
{
    /* mark_given refuses a second value, but never leak one either way */
    json_decref(*slot);
    *slot = json_incref(v);
}

md_status md_deploy_set_json(deploy_req *d, const char *field, json_t *v, md_err *err)
{
    md_status st;
    if (strcmp(field, "retention") == 0) {
        if ((st = md_retention_check(v, err)) != MD_OK)
            return st;
        set_slot(&d->retention, v);
        return MD_OK;
    }
    if (!json_is_object(v))
        return md_err_setc(err, MD_EINVAL, "invalid_json", "%s must be a JSON object, e.g. %s",
                           field,
                           strcmp(field, "metrics") == 0 ? "{\"epoch\": 4, \"loss\": 0.31}"
                                                         : "{\"key\": \"value\"}");
    if (strcmp(field, "config") == 0) {
        if ((st = md_model_config_check(v, err)) != MD_OK)
            return st;
        set_slot(&d->config, v);
    } else if (strcmp(field, "metrics") == 0) {
        const char *k;
        json_t *x;
        json_object_foreach(v, k, x)
        {
            if (!json_is_number(x))
                return md_err_setc(err, MD_EINVAL, "invalid_json",
                                   "metrics.%s must be a number (metrics are compared and ordered)",
                                   k);
        }
        set_slot(&d->metrics, v);
    } else {
        set_slot(&d->metadata, v);
    }
    return MD_OK;
}

md_status md_deploy_set_text(deploy_req *d, const char *field, const char *text, md_err *err)
{
    if (md_deploy_mark_given(d, field, err) != MD_OK)
        return MD_EINVAL;
    if (strcmp(field, "version") == 0)
        return parse_version_text(text, &d->version, err);
    if (strcmp(field, "make_default") == 0)
        return md_deploy_bool(field, text, &d->make_default, err);
                              if (strcmp(field, "deploy") == 0)
        return md_deploy_bool(field, text, &d->deploy, err);
    if (strcmp(field, "sha256") == 0) {
        if (md_deploy_check_sha(text, err) != MD_OK)
            return MD_EINVAL;
        snprintf(d->sha256, sizeof d->sha256, "%s", text);
        return MD_OK;
    }
    json_error_t jerr;
    json_t *v = json_loads(text, JSON_DECODE_ANY, &jerr);
    if (!v)
        return md_err_setc(err, MD_EINVAL, "invalid_json",
                           "%s is not valid JSON (line %d, column %d: %s)", field, jerr.line,
                           jerr.column, jerr.text);
    md_status st = md_deploy_set_json(d, field, v, err);
    json_decref(v);
    return st;
}

int md_deploy_field_known(const char *f)
{
    for (int i = 0; md_deploy_fields[i]; i++)
        if (strcmp(f, md_deploy_fields[i]) == 0)
            return 1;
    return 0;
}

/* ---- the commit every deployment ends in ---- */

/* The config a version given without one inherits: the config of the
 * model's current default version (a new reference in *config, its
 * number in *from), or nothing (*config NULL, *from 0) for a new model. A
 * checkpoint uploaded on its own is almost always "the same model, retrained":
 * dropping the labels, preprocess and input shape of the version it replaces
 * would silently turn a classifier's answer into raw logits. */
static void inherited_config(md_app *app, const char *name, json_t **config, int *from)
{
    *config = NULL;
    *from = 0;
    int dv = md_app_stored_default(app, name);
    json_t *v = NULL;
    if (dv <= 0 || md_store_get_version(app->store, name, dv, &v, NULL) != MD_OK)
        return;
    json_t *c = json_object_get(v, "config");
    if (json_is_object(c)) {
        *config = json_incref(c);
        *from = dv;
    }
    json_decref(v);
}

static unsigned given_bit(const char *field)
{
    for (unsigned i = 0; md_deploy_fields[i]; i++)
        if (strcmp(field, md_deploy_fields[i]) == 0)
            return 1u << i;
    return 0;
}

/* Before loading an upload at `path`: its format by content, and for a
 * state_dict (torch.save or safetensors) the model's architecture (sha256
 * into `arch_sha`, "" for TorchScript) and, when the upload gave no metrics,
 * the file's top-level numbers (epoch, loss, ...) as its metrics. Reading the
 * file here also refuses a malicious pickle before anything is stored. */
static md_status weights_prepare(md_app *app, deploy_req *d, const char *path,
                                 const char **format, char arch_sha[MD_SHA256_HEX], md_err *err)
{
    arch_sha[0] = '\0';
    md_status st = md_weights_format(path, format, err);
    if (st != MD_OK || strcmp(*format, MD_FORMAT_TORCHSCRIPT) == 0)
        return st;
    md_err aerr;
    if (d->arch_sha[0])
        snprintf(arch_sha, MD_SHA256_HEX, "%s", d->arch_sha);
    else if (md_store_architecture(app->store, d->name, arch_sha, &aerr) != MD_OK) {
        if (aerr.status != MD_ENOTFOUND)
            return *err = aerr, aerr.status;
        return md_err_setc(err, MD_EUNPROC, "no_architecture",
                           "the checkpoint is a %s state_dict (weights only, as torch.save() or "
                           "safetensors writes them) and model %s has no architecture to load "
                           "it into; first PUT /models/%s/architecture with the network as "
                           "TorchScript (torch.jit.script(model).save(\"arch.pt\"); its weights "
                           "do not matter): curl -T arch.pt .../models/%s/architecture; or "
                           "upload a TorchScript archive",
                           strcmp(*format, MD_FORMAT_SAFETENSORS) == 0 ? "safetensors" : "torch.save",
                           d->name, d->name, d->name);
    }
    /* the architecture bounds what reading the file may allocate */
    char arch_path[4096];
    int64_t arch_numel = 0;
    if ((st = md_app_blob(app, arch_sha, arch_path, sizeof arch_path, err)) != MD_OK)
        return st;
    st = md_weights_arch_numel(arch_path, &arch_numel, err);
    md_app_blob_done(app, arch_sha);
    if (st != MD_OK)
        return st;
    md_tensors *t = NULL;
    if ((st = md_weights_read(path, *format, arch_numel, &t, err)) != MD_OK)
        return st;
    if (!d->metrics && md_tensors_scalar_count(t) > 0) {
        d->metrics = json_object();
        for (size_t i = 0; i < md_tensors_scalar_count(t); i++) {
            double x = md_tensors_scalar_value(t, i);
            if (!isfinite(x))
                continue; /* NaN and inf are no JSON numbers: not a metric */
            /* the range first: casting NaN or 1e300 to an integer is undefined */
            json_object_set_new(d->metrics, md_tensors_scalar_name(t, i),
                                fabs(x) < 1e15 && x == trunc(x) ? json_integer((json_int_t)x)
                                                                : json_real(x));
        }
    }
    md_tensors_free(t);
    return MD_OK;
}

md_status md_deploy_commit(md_req *req, deploy_req *d, const char *sha, long long size,
                           md_blob_writer *blob)
{
    md_app *app = md_req_app(req);
    md_err err;
    md_err_clear(&err);
    char path[4096];
    const char *pinned = NULL; /* a stored blob this call holds in the cache */
    if (blob)
        snprintf(path, sizeof path, "%s", md_blob_path(blob));
    else if (md_app_blob(app, sha, path, sizeof path, &err) != MD_OK) {
        md_reply_error(req, &err);
        return err.status;
    } else {
        pinned = sha;
    }
    int config_from = 0;
    if (!d->config)
        inherited_config(app, d->name, &d->config, &config_from);
    md_model *model = NULL;
    const char *format = NULL;
    char arch_sha[MD_SHA256_HEX] = "";
    if (weights_prepare(app, d, path, &format, arch_sha, &err) != MD_OK) {
        md_app_blob_done(app, pinned);
        md_blob_abort(blob);
        md_reply_error(req, &err);
        return err.status;
    }
    long long reserved = 0; /* under max_loaded_bytes, until admitted or released */
    md_status loaded = md_app_load_file(app, d->name, d->version, path, format, arch_sha,
                                        d->config, &model, &reserved, &err);
    md_app_blob_done(app, pinned);
    pinned = NULL;
    if (loaded != MD_OK) {
        md_blob_abort(blob);
        if (config_from) {
            md_err inner = err;
            md_err_setc(&err, inner.status, md_err_code(&inner),
                        "%.400s (with the config inherited from version %d; give a config to "
                        "replace it)",
                        inner.msg, config_from);
        }
        md_reply_error(req, &err);
        return err.status;
    }
    long long budget = md_registry_budget(app->registry);
    if (budget > 0 && md_model_weight_bytes(model) > budget) {
        /* it could never be served here: say so now, not on every request */
        md_err_setc(&err, MD_ETOOBIG, "model_over_budget",
                    "the model's weights hold %lld bytes, more than max_loaded_bytes (%lld) "
                    "allows for all loaded versions together; raise max_loaded_bytes",
                    md_model_weight_bytes(model), budget);
        md_registry_unreserve(app->registry, reserved);
        md_model_release(model);
        md_blob_abort(blob);
        md_reply_error(req, &err);
        return err.status;
    }
    md_version_spec spec = {
        .model = d->name,
        .version = d->version,
        .sha256 = sha,
        .size = size,
        .source = d->source ? d->source : "upload",
        .config = d->config,
        .metadata = d->metadata,
        .metrics = d->metrics,
        .make_default = d->deploy && d->make_default,
        .state = d->deploy ? "ready" : "stored",
        .format = format,
        .arch_sha256 = arch_sha[0] ? arch_sha : NULL,
        /* make_default given says what the client wants; else the policy */
        .promote = d->deploy && !(d->given & given_bit("make_default")),
    };
    json_t *version = NULL;
    md_status st = md_store_add_version(app->store, &spec, blob, &version, &err);
    if (st == MD_OK && d->retention)
        st = md_store_set_retention(app->store, d->name, d->retention, &err);
    /* a new row (maybe a number deleted and reused) and retention's deletes:
     * what app.c remembered about this name is stale */
    md_app_forget(app, d->name, 0);
    if (st != MD_OK) {
        md_registry_unreserve(app->registry, reserved);
        md_model_release(model);
        json_decref(version);
        md_reply_error(req, &err);
        return st;
    }
    int number = (int)json_integer_value(json_object_get(version, "version"));
    /* only a new default stays loaded: any other version was validated (the
     * load and test forwards above) and loads again on its first request,
     * so versions kept for rollback or comparison cost no memory */
    if (d->deploy && json_is_true(json_object_get(version, "default")) &&
        !json_is_true(json_object_get(version, "removed_by_retention"))) {
        md_model_set_version(model, number);
        md_err aerr;
        if (md_registry_admit(app->registry, model, 1, reserved, &aerr) != MD_OK)
            md_log(MD_LOG_WARN, "model %s version %d is the default but not kept loaded (its "
                   "next request loads it): %s", d->name, number, aerr.msg);
    } else {
        md_registry_unreserve(app->registry, reserved);
        md_model_release(model);
    }
    md_app_add_residency(app, version);
    if (config_from)
        json_object_set_new(version, "config_from", json_integer(config_from));
    char loc[160];
    snprintf(loc, sizeof loc, "/models/%s/versions/%d", d->name, number);
    md_reply_header(req, "Location", loc);
    md_reply_json(req, 201, version);
    return MD_OK;
}

/* ---- POST /models: register from a URL ---- */

/*
 * Concurrent registrations of one source share one download, and only the
 * download: the bytes, their sha256 and size (or the download's error, which
 * is a property of the URL). Each request then checks its own sha256, loads
 * with its own config and commits or fails on its own, through its own hard
 * link to the downloaded temp file (md_blob_link), so one client's wrong
 * sha256 or bad config never answers another's request. The first request
 * downloads; later ones wait on the fetch's condition variable (on their
 * deferred thread). The downloaded file goes when the last request has taken
 * its link.
 */
typedef struct fetch {
    char *source;
    int done;
    md_status status;      /* of the download */
    md_err err;
    md_blob_writer *blob;  /* the finished download; owned by the fetch */
    int refs;
    pthread_cond_t cv;
    struct fetch *next;
} fetch;

static pthread_mutex_t fetch_mu = PTHREAD_MUTEX_INITIALIZER;
static fetch *fetches;

static void fetch_release(fetch *f)
{
    /* fetch_mu held */
    if (--f->refs > 0)
        return;
    for (fetch **p = &fetches; *p; p = &(*p)->next)
        if (*p == f) {
            *p = f->next;
            break;
        }
    md_blob_abort(f->blob);
    pthread_cond_destroy(&f->cv);
    free(f->source);
    free(f);
}

static void register_commit(md_req *req)
{
    deploy_req *d = md_req_state(req);
    md_app *app = md_req_app(req);
    md_err err;
    md_err_clear(&err);

    pthread_mutex_lock(&fetch_mu);
    fetch *f = fetches;
    while (f && (f->done || strcmp(f->source, d->source) != 0))
        f = f->next;
    if (f) {
        /* another request is downloading this source: wait for its bytes */
        f->refs++;
        md_log(MD_LOG_INFO, "register %s: sharing the download of %s already in progress",
               d->name, d->source);
        while (!f->done)
            pthread_cond_wait(&f->cv, &fetch_mu);
    } else {
        f = md_xcalloc(1, sizeof *f);
        f->source = md_xstrdup(d->source);
        f->refs = 1;
        pthread_cond_init(&f->cv, NULL);
        f->next = fetches;
        fetches = f;
        pthread_mutex_unlock(&fetch_mu);

        md_fetch_opts opts = md_fetch_opts_from_cfg(app->cfg);
        md_blob_writer *blob = NULL;
        char sha[MD_SHA256_HEX];
        long long size;
        md_err ferr;
        md_err_clear(&ferr);
        /* no expected hash here: each request checks its own below */
        md_status st = md_fetch_blob(app->store, d->source, &opts, &blob, &ferr);
        if (st == MD_OK && (st = md_blob_finish(blob, NULL, sha, &size, &ferr)) != MD_OK)
            blob = NULL; /* md_blob_finish dropped it */

        pthread_mutex_lock(&fetch_mu);
        f->done = 1;
        f->status = st;
        f->err = ferr;
        f->blob = st == MD_OK ? blob : NULL;
        pthread_cond_broadcast(&f->cv);
    }
    /* fetch_mu held, f->done: take this request's own copy of the bytes */
    md_status st = f->status;
    md_blob_writer *mine = NULL;
    if (st == MD_OK)
        st = md_blob_link(f->blob, &mine, &err);
    else
        err = f->err;
    fetch_release(f);
    pthread_mutex_unlock(&fetch_mu);
    if (st != MD_OK) {
        md_reply_error(req, &err);
        return;
    }
    char sha[MD_SHA256_HEX];
    snprintf(sha, sizeof sha, "%s", md_blob_sha256(mine));
    long long size = md_blob_size(mine);
    if (d->sha256[0] && strcasecmp(d->sha256, sha) != 0) {
        md_blob_abort(mine);
        md_err_setc(&err, MD_EINVAL, "sha256_mismatch",
                    "the checkpoint's sha256 is %s but %s was expected; check the URL or the "
                    "sha256 given",
                    sha, d->sha256);
        md_reply_error(req, &err);
        return;
    }
    if (md_deploy_commit(req, d, sha, size, mine) != MD_OK)
        md_log(MD_LOG_INFO, "register %s from %s: not stored (answered with the reason)", d->name,
               d->source);
}

static void deploy_req_free_cb(void *p)
{
    md_deploy_req_free(p);
    free(p);
}

json_t *md_req_json_object(md_req *req, const char *example)
{
    md_err err;
    size_t len;
    const char *body = md_req_body(req, &len);
    if (!body) {
        md_err_setc(&err, MD_EINVAL, "empty_body", "the request needs a JSON body such as %s",
                    example);
        md_reply_error(req, &err);
        return NULL;
    }
    json_error_t jerr;
    json_t *v = json_loadb(body, len, 0, &jerr);
    if (!v || !json_is_object(v)) {
        if (v)
            md_err_setc(&err, MD_EINVAL, "invalid_json", "the body must be a JSON object such as %s",
                        example);
        else
            md_err_setc(&err, MD_EINVAL, "invalid_json",
                        "the body is not valid JSON (line %d, column %d: %s)", jerr.line,
                        jerr.column, jerr.text);
        json_decref(v);
        md_reply_error(req, &err);
        return NULL;
    }
    return v;
}

void md_handle_models_register(md_req *req)
{
    md_app *app = md_req_app(req);
    md_err err;
    md_err_clear(&err);
    json_t *body = md_req_json_object(req, "{\"name\": \"mnist\", \"source\": \"https://host/model.pt\"}");
    if (!body)
        return;
    deploy_req *d = md_xcalloc(1, sizeof *d);
    d->make_default = d->deploy = 1;
    md_status st = MD_OK;
    const char *key;
    json_t *v;
    json_object_foreach(body, key, v)
    {
        if (strcmp(key, "name") == 0) {
            if ((st = md_check_model_name(json_string_value(v), &err)) != MD_OK)
                break;
            snprintf(d->name, sizeof d->name, "%s", json_string_value(v));
        } else if (strcmp(key, "source") == 0) {
            if (!json_is_string(v)) {
                st = md_err_setc(&err, MD_EINVAL, "invalid_source",
                                 "source must be a URL string (https://, http://, file:/// or "
                                 "s3://)");
                break;
            }
            d->source = md_xstrdup(json_string_value(v));
        } else if (strcmp(key, "sha256") == 0) {
            if (!json_is_string(v) || md_deploy_check_sha(json_string_value(v), &err) != MD_OK) {
                st = md_err_set(&err, MD_EINVAL, "sha256 must be a string of 64 hex digits");
                break;
            }
            snprintf(d->sha256, sizeof d->sha256, "%s", json_string_value(v));
        } else if (strcmp(key, "version") == 0) {
            if (!json_is_integer(v) || json_integer_value(v) < 1 ||
                json_integer_value(v) > 1000000000) {
                st = md_err_setc(&err, MD_EINVAL, "invalid_version",
                                 "version must be a positive integer");
                break;
            }
            d->version = (int)json_integer_value(v);
        } else if (strcmp(key, "make_default") == 0 || strcmp(key, "deploy") == 0) {
            if (!json_is_boolean(v)) {
                st = md_err_set(&err, MD_EINVAL, "%s must be true or false", key);
                break;
            }
            *(strcmp(key, "deploy") == 0 ? &d->deploy : &d->make_default) = json_is_true(v);
        } else if (strcmp(key, "config") == 0 || strcmp(key, "metadata") == 0 ||
                   strcmp(key, "metrics") == 0 || strcmp(key, "retention") == 0) {
            if ((st = md_deploy_set_json(d, key, v, &err)) != MD_OK)
                break;
        } else {
            st = md_err_setc(&err, MD_EINVAL, "unknown_field",
                             "unknown key \"%.40s\"; allowed: name, source, sha256, version, "
                             "make_default, deploy, config, metadata, metrics, retention",
                             key);
            break;
        }
    }
    json_decref(body);
    if (st == MD_OK && !d->name[0])
        st = md_err_setc(&err, MD_EINVAL, "invalid_name", "name is required");
    if (st == MD_OK && !d->source)
        st = md_err_setc(&err, MD_EINVAL, "invalid_source",
                         "source is required: the URL of the checkpoint (https://, http://, "
                         "file:/// or s3://); to upload bytes use POST /models/NAME/versions");
    md_fetch_opts opts = md_fetch_opts_from_cfg(app->cfg);
    if (st == MD_OK)
        st = md_source_check(d->source, &opts, &err);
    if (st != MD_OK) {
        deploy_req_free_cb(d);
        md_reply_error(req, &err);
        return;
    }
    md_req_set_state(req, d, deploy_req_free_cb);
    md_req_defer(req, register_commit);
}
