/*
 * models.c - the model registry over HTTP: deploy by upload (multipart or raw
 * bytes) or by URL, list, read, roll the default, retention, delete, and
 * download a stored checkpoint.
 *
 * Uploads stream: each body chunk goes straight into the store's blob writer
 * (hashing as it goes), never into memory. Everything that can be checked
 * before bytes are committed is checked first (name, content type, size,
 * config, metrics), so a bad request stores nothing. Finishing (fsync,
 * rename, SQLite commit) and downloads run on a deferred thread with the
 * connection suspended, so no server thread waits on disk or network.
 */
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../checkpoint/checkpoint.h"
#include "../predictor/predictor.h"
#include "handlers.h"

#define FIELD_MAX (1024 * 1024)

/* ---- what a deployment asks for, whichever way it came ---- */

typedef struct deploy_req {
    char name[72];
    int version;      /* 0 = next */
    int make_default; /* default 1 */
    int deploy;       /* default 1 */
    char sha256[MD_SHA256_HEX];
    char *source;     /* owned; NULL for uploads */
    json_t *config, *metadata, *metrics, *retention; /* owned; NULL = not given */
    char arch_sha[MD_SHA256_HEX]; /* a state_dict's architecture when not the model's (an
                                   * average of versions loads into theirs) */
    unsigned given;   /* bit i: field_names[i] was given (a second one is refused) */
} deploy_req;

/* The fields of a deployment, in the order of the `given` bits. A field given
 * twice (two form fields of one name, or a form field and a query argument)
 * is refused with 400 naming it: last-wins would silently drop what the
 * client sent first. */
static const char *const field_names[] = {"config", "metadata", "metrics", "version",
                                          "make_default", "deploy", "sha256", "retention", NULL};

static md_status mark_given(deploy_req *d, const char *field, md_err *err)
{
    for (unsigned i = 0; field_names[i]; i++) {
        if (strcmp(field, field_names[i]) != 0)
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

static void deploy_req_free(deploy_req *d)
{
    free(d->source);
    json_decref(d->config);
    json_decref(d->metadata);
    json_decref(d->metrics);
    json_decref(d->retention);
    memset(d, 0, sizeof *d);
}

static md_status check_name(const char *name, md_err *err)
{
    if (!name || !md_model_name_ok(name))
        return md_err_setc(err, MD_EINVAL, "invalid_name",
                           "model name \"%.80s\" is invalid; use 1 to 64 of A-Z a-z 0-9 . _ -",
                           name ? name : "");
    return MD_OK;
}

static md_status parse_bool(const char *field, const char *text, int *out, md_err *err)
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

static md_status check_sha(const char *text, md_err *err)
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

static md_status set_json_field(deploy_req *d, const char *field, json_t *v, md_err *err)
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

/* A text field (multipart field or query argument). */
static md_status set_text_field(deploy_req *d, const char *field, const char *text, md_err *err)
{
    if (mark_given(d, field, err) != MD_OK)
        return MD_EINVAL;
    if (strcmp(field, "version") == 0)
        return parse_version_text(text, &d->version, err);
    if (strcmp(field, "make_default") == 0)
        return parse_bool(field, text, &d->make_default, err);
    if (strcmp(field, "deploy") == 0)
        return parse_bool(field, text, &d->deploy, err);
    if (strcmp(field, "sha256") == 0) {
        if (check_sha(text, err) != MD_OK)
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
    md_status st = set_json_field(d, field, v, err);
    json_decref(v);
    return st;
}

static int text_field_known(const char *f)
{
    for (int i = 0; field_names[i]; i++)
        if (strcmp(f, field_names[i]) == 0)
            return 1;
    return 0;
}

/* Load version `v` whose file is at `path`: a TorchScript archive alone, or
 * a state_dict into the architecture the version recorded (arch_sha256), so
 * a replaced architecture never changes what an existing version serves. */
static md_status load_stored_weights(md_app *app, json_t *v, const char *path, md_model **m,
                                     md_err *err)
{
    const char *name = json_string_value(json_object_get(v, "model"));
    int version = (int)json_integer_value(json_object_get(v, "version"));
    const char *format = json_string_value(json_object_get(v, "format"));
    json_t *config = json_object_get(v, "config");
    if (!format || strcmp(format, MD_FORMAT_TORCHSCRIPT) == 0)
        return md_model_load(name, version, path, config, &app->model_defaults, m, err);
    const char *arch = json_string_value(json_object_get(v, "arch_sha256"));
    if (!arch)
        return md_err_setc(err, MD_EUNPROC, "no_architecture",
                           "model %s version %d is a %s state_dict with no recorded architecture",
                           name, version, format);
    char arch_path[4096];
    md_store_sha_path(app->store, arch, arch_path, sizeof arch_path);
    if (access(arch_path, R_OK) != 0)
        return md_err_setc(err, MD_EIO, "checkpoint_missing",
                           "model %s version %d: its architecture file is missing from the store "
                           "(sha256 %.64s)",
                           name, version, arch);
    return md_model_load_weights(name, version, arch_path, path, format, config,
                                 &app->model_defaults, m, err);
}

md_model *md_app_load_version(md_app *app, json_t *v, md_err *err)
{
    const char *name = json_string_value(json_object_get(v, "model"));
    int version = (int)json_integer_value(json_object_get(v, "version"));
    char path[4096];
    md_store_sha_path(app->store, json_string_value(json_object_get(v, "sha256")), path,
                      sizeof path);
    md_model *m = NULL;
    md_status st;
    /* a blob missing now (a replica's delete racing this load, a volume not
     * mounted yet) is an I/O error, which may pass, not a bad checkpoint,
     * which would be remembered (app.c) */
    if (access(path, R_OK) != 0)
        st = md_err_setc(err, MD_EIO, "checkpoint_missing",
                         "model %s version %d: its checkpoint file is missing from the store "
                         "(sha256 %.64s); retry, or upload the version again",
                         name, version, json_string_value(json_object_get(v, "sha256")));
    else
        st = load_stored_weights(app, v, path, &m, err);
    md_store_set_state(app->store, name, version, st == MD_OK ? "ready" : "failed",
                       st == MD_OK ? NULL : err->msg, NULL);
    if (st != MD_OK)
        md_log(MD_LOG_WARN, "model %s version %d failed to load: %s", name, version, err->msg);
    return m;
}

void md_app_load_defaults(md_app *app, int (*stop)(void))
{
    md_err err;
    json_t *defaults = NULL;
    unsigned long seen = md_app_epoch(); /* before the rows are read */
    if (md_store_defaults(app->store, &defaults, &err) != MD_OK) {
        md_log(MD_LOG_ERROR, "cannot list the deployed models: %s", err.msg);
        return;
    }
    size_t i;
    json_t *v;
    json_array_foreach(defaults, i, v)
    {
        const char *state = json_string_value(json_object_get(v, "state"));
        if (stop && stop()) {
            md_log(MD_LOG_INFO, "stop requested: loading the remaining models skipped");
            break;
        }
        if (strcmp(state, "failed") == 0)
            continue;
        /* through the load slots: a request may already be loading it */
        md_model *m = md_app_load_row(app, v, seen, "at start", &err);
        if (m) {
            md_registry_set_default(app->registry, md_model_name(m), md_model_version(m));
            md_log(MD_LOG_INFO, "model %s version %d loaded", md_model_name(m),
                   md_model_version(m));
            md_model_release(m);
        }
    }
    json_decref(defaults);
}

/* The store's default version of `name` now, 0 when none (or no model). */
static int stored_default(md_app *app, const char *name)
{
    json_t *info = NULL;
    md_err err;
    if (md_store_get_model(app->store, name, &info, &err) != MD_OK)
        return 0;
    json_t *dv = json_object_get(info, "default_version");
    int v = json_is_integer(dv) ? (int)json_integer_value(dv) : 0;
    json_decref(info);
    return v;
}

void md_app_sync(md_app *app)
{
    /* read the generation first: a change made while this pass runs moves
     * it again, so the next pass corrects whatever this one raced with */
    long long gen = md_store_generation(app->store);
    if (gen == app->synced_generation)
        return;
    /* the store changed, maybe through a replica: what app.c remembered
     * (failed loads, names not found) may be stale now */
    md_app_forget(app, NULL, 0);
    int again = 0; /* a load was still running elsewhere: look again next pass */
    md_err err;
    md_err_clear(&err);
    json_t *defaults = NULL;
    unsigned long seen = md_app_epoch(); /* after the forget, before the rows are read */
    if (md_store_defaults(app->store, &defaults, &err) != MD_OK) {
        md_log(MD_LOG_WARN, "store sync: %s", err.msg);
        return;
    }
    size_t i;
    json_t *v;
    json_array_foreach(defaults, i, v)
    {
        const char *name = json_string_value(json_object_get(v, "model"));
        int version = (int)json_integer_value(json_object_get(v, "version"));
        const char *state = json_string_value(json_object_get(v, "state"));
        md_model *cur = md_registry_get(app->registry, name, 0);
        int cur_v = cur ? md_model_version(cur) : 0;
        md_model_release(cur);
        if (cur_v == version || (state && strcmp(state, "failed") == 0))
            continue;
        if (md_registry_set_default(app->registry, name, version) == 0) {
            /* through the load slots: a request may be loading it already */
            md_model *m = md_app_load_row(app, v, seen, "for the store sync", &err);
            if (!m) {
                md_log(MD_LOG_WARN, "store sync: model %s version %d: %s", name, version, err.msg);
                again |= err.status == MD_ETIMEOUT;
                continue;
            }
            /* a local deploy or rollback may have moved the default meanwhile */
            if (stored_default(app, name) == version)
                md_registry_set_default(app->registry, name, version);
            md_model_release(m);
        } else if (stored_default(app, name) != version) {
            continue; /* changed meanwhile: the next pass sees it */
        }
        md_log(MD_LOG_INFO, "store sync: model %s now serves version %d (changed through another "
               "process sharing the store)", name, version);
    }
    json_decref(defaults);
    /* loaded versions (and models) the store no longer has */
    json_t *loaded = md_registry_stats(app->registry);
    json_array_foreach(loaded, i, v)
    {
        const char *name = json_string_value(json_object_get(v, "model"));
        int version = (int)json_integer_value(json_object_get(v, "version"));
        json_t *row = NULL;
        md_status st = md_store_get_version(app->store, name, version, &row, &err);
        json_decref(row);
        if (st == MD_ENOTFOUND) {
            md_registry_remove(app->registry, name, version);
            md_log(MD_LOG_INFO, "store sync: model %s version %d unloaded (deleted through another "
                   "process sharing the store)", name, version);
        }
    }
    json_decref(loaded);
    if (!again)
        app->synced_generation = gen;
}

/* The config a version given without one inherits: the config of the
 * model's current default version (a new new reference in *config, its
 * number in *from), or nothing (*config NULL, *from 0) for a new model. A
 * checkpoint uploaded on its own is almost always "the same model, retrained":
 * dropping the labels, preprocess and input shape of the version it replaces
 * would silently turn a classifier's answer into raw logits. */
static void inherited_config(md_app *app, const char *name, json_t **config, int *from)
{
    *config = NULL;
    *from = 0;
    int dv = stored_default(app, name);
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
    for (unsigned i = 0; field_names[i]; i++)
        if (strcmp(field, field_names[i]) == 0)
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
                           "do not matter), or upload a TorchScript archive",
                           strcmp(*format, MD_FORMAT_SAFETENSORS) == 0 ? "safetensors" : "torch.save",
                           d->name, d->name);
    }
    md_tensors *t = NULL;
    if ((st = md_weights_read(path, *format, &t, err)) != MD_OK)
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

/* Load the checkpoint (the real validation), add the version row, put the
 * model in the registry when deploying, and answer 201. Takes ownership of
 * `blob`. A checkpoint that does not load stores nothing (422). A version
 * given without config inherits the current default's (inherited_config) and
 * the answer says so with "config_from". Returns the status answered, so a
 * caller never mistakes a failed commit for a stored version. */
static md_status commit_and_reply(md_req *req, deploy_req *d, const char *sha, long long size,
                                  md_blob_writer *blob)
{
    md_app *app = md_req_app(req);
    md_err err;
    md_err_clear(&err);
    char path[4096];
    if (blob)
        snprintf(path, sizeof path, "%s", md_blob_path(blob));
    else
        md_store_sha_path(app->store, sha, path, sizeof path);
    int config_from = 0;
    if (!d->config)
        inherited_config(app, d->name, &d->config, &config_from);
    md_model *model = NULL;
    const char *format = NULL;
    char arch_sha[MD_SHA256_HEX] = "";
    if (weights_prepare(app, d, path, &format, arch_sha, &err) != MD_OK) {
        md_blob_abort(blob);
        md_reply_error(req, &err);
        return err.status;
    }
    md_status lst;
    if (arch_sha[0]) {
        char arch_path[4096];
        md_store_sha_path(app->store, arch_sha, arch_path, sizeof arch_path);
        lst = md_model_load_weights(d->name, d->version, arch_path, path, format, d->config,
                                    &app->model_defaults, &model, &err);
    } else {
        lst = md_model_load(d->name, d->version, path, d->config, &app->model_defaults, &model,
                            &err);
    }
    if (lst != MD_OK) {
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
        md_model_release(model);
        json_decref(version);
        md_reply_error(req, &err);
        return st;
    }
    int number = (int)json_integer_value(json_object_get(version, "version"));
    if (d->deploy && !json_is_true(json_object_get(version, "removed_by_retention"))) {
        md_model_set_version(model, number);
        md_registry_put(app->registry, model, json_is_true(json_object_get(version, "default")));
    } else {
        md_model_release(model);
    }
    if (config_from)
        json_object_set_new(version, "config_from", json_integer(config_from));
    char loc[160];
    snprintf(loc, sizeof loc, "/models/%s/versions/%d", d->name, number);
    md_reply_header(req, "Location", loc);
    md_reply_json(req, 201, version);
    return MD_OK;
}

/* ---- POST /models/{name}/versions: upload ---- */

typedef struct upload {
    deploy_req d;
    md_blob_writer *blob;
    int multipart;
    int json;         /* a JSON body: {"average": ...} (issue 12), buffered in `text` */
    int saw_file;
    char field[32];   /* the text field being accumulated */
    md_body text;     /* its bytes so far */
    md_err err;
} upload;

static void upload_free(void *p)
{
    upload *u = p;
    if (!u)
        return;
    md_blob_abort(u->blob); /* an unfinished upload leaves no temp file */
    md_body_free(&u->text);
    deploy_req_free(&u->d);
    free(u);
}

/* End the text field being accumulated, if any. */
static md_status flush_text_field(upload *u, md_err *err)
{
    if (!u->field[0])
        return MD_OK;
    md_status st = set_text_field(&u->d, u->field, u->text.data ? u->text.data : "", err);
    u->field[0] = '\0';
    u->text.len = 0;
    if (u->text.data)
        u->text.data[0] = '\0';
    return st;
}

static md_status on_form_field(md_req *req, const char *field, const char *filename,
                               const char *data, size_t len, md_err *err)
{
    upload *u = md_req_state(req);
    if (strcmp(field, "checkpoint") == 0 || strcmp(field, "file") == 0) {
        (void)filename;
        if (flush_text_field(u, err) != MD_OK)
            return err->status;
        u->saw_file = 1;
        return md_blob_write(u->blob, data, len, err);
    }
    if (!text_field_known(field))
        return md_err_setc(err, MD_EINVAL, "unknown_field",
                           "unknown form field \"%.40s\"; allowed: checkpoint, config, metadata, "
                           "metrics, version, make_default, deploy, sha256, retention",
                           field);
    if (strcmp(u->field, field) != 0) {
        if (flush_text_field(u, err) != MD_OK)
            return err->status;
        snprintf(u->field, sizeof u->field, "%s", field);
    }
    if (md_body_append(&u->text, data, len, err) != MD_OK)
        return md_err_set(err, MD_ETOOBIG, "form field %s is larger than %d bytes", field,
                          FIELD_MAX);
    return MD_OK;
}

static upload *upload_start(md_req *req, md_err *err)
{
    md_app *app = md_req_app(req);
    const char *name = md_req_param(req, "name");
    if (check_name(name, err) != MD_OK)
        return NULL;
    const char *ct = md_req_header(req, "Content-Type");
    int multipart = ct && strncasecmp(ct, "multipart/form-data", 19) == 0;
    int json = ct && strncasecmp(ct, "application/json", 16) == 0;
    if (!multipart && !json && !(ct && strncasecmp(ct, "application/octet-stream", 24) == 0)) {
        md_err_setc(err, MD_EMEDIA, "unsupported_media_type",
                    "Content-Type %s is not accepted here; send the checkpoint as multipart "
                    "(curl -F checkpoint=@model.pt) or raw bytes with Content-Type: "
                    "application/octet-stream, or a JSON {\"average\": ...} body",
                    ct ? ct : "(none)");
        return NULL;
    }
    if (json) {
        upload *u = md_xcalloc(1, sizeof *u);
        snprintf(u->d.name, sizeof u->d.name, "%s", name);
        u->d.make_default = u->d.deploy = 1;
        u->json = 1;
        u->text.limit = FIELD_MAX;
        md_req_set_state(req, u, upload_free);
        return u;
    }
    const char *cl = md_req_header(req, "Content-Length");
    if (cl && strtoll(cl, NULL, 10) > app->cfg->max_checkpoint_bytes) {
        md_err_setc(err, MD_ETOOBIG, "checkpoint_too_large",
                    "the upload of %s bytes is larger than max_checkpoint_bytes (%lld); raise the "
                    "setting to accept it",
                    cl, app->cfg->max_checkpoint_bytes);
        return NULL;
    }
    upload *u = md_xcalloc(1, sizeof *u);
    snprintf(u->d.name, sizeof u->d.name, "%s", name);
    u->d.make_default = u->d.deploy = 1;
    u->multipart = multipart;
    u->text.limit = FIELD_MAX;
    if (md_blob_begin(app->store, app->cfg->max_checkpoint_bytes, &u->blob, err) != MD_OK) {
        upload_free(u);
        return NULL;
    }
    md_req_set_state(req, u, upload_free);
    return u;
}

md_status md_upload_body(md_req *req, const char *data, size_t len, md_err *err)
{
    upload *u = md_req_state(req);
    if (!u && !(u = upload_start(req, err)))
        return err->status;
    if (!data)
        return MD_OK; /* headers only: checked by upload_start */
    if (u->json)
        return md_body_append(&u->text, data, len, err);
    if (u->multipart)
        return md_req_form_feed(req, on_form_field, data, len, err);
    return md_blob_write(u->blob, data, len, err);
}

static void upload_commit(md_req *req)
{
    upload *u = md_req_state(req);
    md_err err;
    md_err_clear(&err);
    char sha[MD_SHA256_HEX];
    long long size = 0;
    md_blob_writer *blob = u->blob;
    u->blob = NULL; /* finish and add_version own it from here */
    if (md_blob_finish(blob, u->d.sha256, sha, &size, &err) != MD_OK) {
        md_reply_error(req, &err);
        return;
    }
    commit_and_reply(req, &u->d, sha, size, blob);
}

/* ---- POST /models/{name}/versions {"average": ...}: weight averaging ---- */

#define AVERAGE_MAX_SOURCES 64

static md_status average_parse(upload *u, json_t *body, json_t **versions, json_t **weights,
                               md_err *err)
{
    static const char *example = "{\"average\": {\"versions\": [3, 4, 5], \"weights\": [0.2, "
                                 "0.3, 0.5]}, \"metrics\": {}, \"make_default\": false}";
    const char *key;
    json_t *v;
    md_status st;
    json_object_foreach(body, key, v)
    {
        if (strcmp(key, "average") == 0)
            continue;
        if (strcmp(key, "make_default") == 0 || strcmp(key, "deploy") == 0) {
            if (!json_is_boolean(v))
                return md_err_set(err, MD_EINVAL, "%s must be true or false", key);
            if (mark_given(&u->d, key, err) != MD_OK)
                return MD_EINVAL;
            *(strcmp(key, "deploy") == 0 ? &u->d.deploy : &u->d.make_default) = json_is_true(v);
        } else if (strcmp(key, "config") == 0 || strcmp(key, "metadata") == 0 ||
                   strcmp(key, "metrics") == 0) {
            if (mark_given(&u->d, key, err) != MD_OK ||
                (st = set_json_field(&u->d, key, v, err)) != MD_OK)
                return MD_EINVAL;
        } else {
            return md_err_setc(err, MD_EINVAL, "unknown_field",
                               "unknown key \"%.40s\"; a JSON body to /models/NAME/versions "
                               "averages versions: %s (also config, metadata, deploy)",
                               key, example);
        }
    }
    json_t *a = json_object_get(body, "average");
    if (!json_is_object(a))
        return md_err_setc(err, MD_EINVAL, "invalid_average", "the body needs \"average\": %s",
                           example);
    json_object_foreach(a, key, v)
    {
        if (strcmp(key, "versions") != 0 && strcmp(key, "weights") != 0)
            return md_err_setc(err, MD_EINVAL, "invalid_average",
                               "average.%.40s is unknown; average takes versions and weights",
                               key);
    }
    *versions = json_object_get(a, "versions");
    *weights = json_object_get(a, "weights");
    size_t n = json_array_size(*versions);
    if (!json_is_array(*versions) || n < 1 || n > AVERAGE_MAX_SOURCES)
        return md_err_setc(err, MD_EINVAL, "invalid_average",
                           "average.versions must list 1 to %d version numbers, e.g. [3, 4, 5]",
                           AVERAGE_MAX_SOURCES);
    size_t i;
    json_array_foreach(*versions, i, v)
    {
        if (!json_is_integer(v) || json_integer_value(v) < 1 || json_integer_value(v) > 1000000000)
            return md_err_setc(err, MD_EINVAL, "invalid_average",
                               "average.versions[%zu] is not a version number", i);
        /* a version twice is a weight in disguise, and costs a second read:
         * say it with weights */
        for (size_t j = 0; j < i; j++)
            if (json_integer_value(json_array_get(*versions, j)) == json_integer_value(v))
                return md_err_setc(err, MD_EINVAL, "invalid_average",
                                   "average.versions lists version %lld twice (at %zu and %zu); "
                                   "list each version once and give it a larger weight",
                                   (long long)json_integer_value(v), j, i);
    }
    if (*weights) {
        double sum = 0;
        if (!json_is_array(*weights) || json_array_size(*weights) != n)
            return md_err_setc(err, MD_EINVAL, "invalid_average",
                               "average.weights must have one number per version (%zu)", n);
        json_array_foreach(*weights, i, v)
        {
            if (!json_is_number(v) || !isfinite(json_number_value(v)) ||
                json_number_value(v) < 0)
                return md_err_setc(err, MD_EINVAL, "invalid_average",
                                   "average.weights[%zu] must be a finite number >= 0", i);
            sum += json_number_value(v);
        }
        /* each weight is divided by the sum: an infinite sum would make every
         * weight 0 and the average an all-zero model */
        if (!isfinite(sum))
            return md_err_setc(err, MD_EINVAL, "invalid_average",
                               "average.weights sum to more than a double holds; scale them down "
                               "(only their ratios matter)");
        if (!(sum > 0))
            return md_err_setc(err, MD_EINVAL, "invalid_average",
                               "average.weights sum to 0; give at least one positive weight");
    }
    return MD_OK;
}

/* The weights of stored version `version` as its model uses them, the
 * architecture they load into (`arch_sha`, "" for a TorchScript version) and
 * the version's own blob (`sha`). */
static md_status version_weights(md_app *app, const char *name, int version, md_tensors **out,
                                 char arch_sha[MD_SHA256_HEX], char sha[MD_SHA256_HEX],
                                 md_err *err)
{
    json_t *v = NULL;
    md_status st = md_store_get_version(app->store, name, version, &v, err);
    if (st != MD_OK)
        return st;
    const char *format = json_string_value(json_object_get(v, "format"));
    const char *arch = json_string_value(json_object_get(v, "arch_sha256"));
    char path[4096], arch_path[4096];
    md_store_sha_path(app->store, json_string_value(json_object_get(v, "sha256")), path,
                      sizeof path);
    if (arch)
        md_store_sha_path(app->store, arch, arch_path, sizeof arch_path);
    snprintf(arch_sha, MD_SHA256_HEX, "%s", arch ? arch : "");
    snprintf(sha, MD_SHA256_HEX, "%s", json_string_value(json_object_get(v, "sha256")));
    st = md_weights_effective(path, format ? format : MD_FORMAT_TORCHSCRIPT,
                              arch ? arch_path : NULL, out, err);
    if (st != MD_OK) {
        md_err inner = *err;
        /* out of memory (503) and too large (413) are not the version's fault */
        md_status keep = st == MD_EIO || st == MD_ENOMEM || st == MD_ETOOBIG ? st : MD_EUNPROC;
        md_err_setc(err, keep, md_err_code(&inner),
                    "model %s version %d: %.400s", name, version, inner.msg);
        st = err->status;
    }
    json_decref(v);
    return st;
}

static void average_commit(md_req *req)
{
    upload *u = md_req_state(req);
    md_app *app = md_req_app(req);
    md_err err;
    md_err_clear(&err);
    json_error_t jerr;
    json_t *body = json_loadb(u->text.data ? u->text.data : "", u->text.len, 0, &jerr);
    json_t *versions = NULL, *weights = NULL;
    md_status st = MD_OK;
    if (!json_is_object(body))
        st = md_err_setc(&err, MD_EINVAL, "invalid_json",
                         "the body is not a JSON object (line %d: %s)", jerr.line,
                         body ? "not an object" : jerr.text);
    else
        st = average_parse(u, body, &versions, &weights, &err);
    size_t n = json_array_size(versions);
    double w[AVERAGE_MAX_SOURCES];
    char arch[MD_SHA256_HEX] = "", first_ts[MD_SHA256_HEX] = "";
    double sum = 0;
    /* the sources' stored sizes against max_average_bytes, before reading any */
    long long total = 0;
    for (size_t i = 0; st == MD_OK && i < n; i++) {
        int version = (int)json_integer_value(json_array_get(versions, i));
        json_t *row = NULL;
        if ((st = md_store_get_version(app->store, u->d.name, version, &row, &err)) ==
            MD_ENOTFOUND)
            st = err.status = MD_EUNPROC; /* in a body: the request is wrong, the route is fine */
        long long size = (long long)json_integer_value(json_object_get(row, "size"));
        json_decref(row);
        if (st == MD_OK && __builtin_add_overflow(total, size, &total))
            total = LLONG_MAX;
    }
    if (st == MD_OK && total > app->cfg->max_average_bytes)
        st = md_err_setc(&err, MD_ETOOBIG, "average_too_large",
                         "averaging these %zu versions reads %lld bytes of checkpoints, more than "
                         "max_average_bytes (%lld); average fewer versions or raise the setting",
                         n, total, app->cfg->max_average_bytes);
    for (size_t i = 0; st == MD_OK && i < n; i++) {
        w[i] = weights ? json_number_value(json_array_get(weights, i)) : 1.0;
        sum += w[i];
    }
    for (size_t i = 0; st == MD_OK && i < n; i++)
        w[i] /= sum;
    /* one source at a time: read, add with its weight, free */
    md_weights_avg *acc = md_weights_avg_new();
    for (size_t i = 0; st == MD_OK && i < n; i++) {
        int version = (int)json_integer_value(json_array_get(versions, i));
        char label[32];
        snprintf(label, sizeof label, "version %d", version);
        char a[MD_SHA256_HEX], sha[MD_SHA256_HEX];
        md_tensors *src = NULL;
        st = version_weights(app, u->d.name, version, &src, a, sha, &err);
        if (st == MD_ENOTFOUND) /* deleted since the size check */
            st = err.status = MD_EUNPROC;
        if (st == MD_OK && a[0])
            snprintf(arch, sizeof arch, "%s", a); /* the last state_dict source's */
        else if (st == MD_OK && !first_ts[0])
            snprintf(first_ts, sizeof first_ts, "%s", sha);
        if (st == MD_OK &&
            (st = md_weights_avg_add(acc, src, w[i], label, &err)) == MD_EINVAL)
            err.status = st = MD_EUNPROC; /* the sources do not fit together: 422 */
        md_tensors_free(src);
    }
    /* only TorchScript sources: the first one's archive is the architecture
     * the averaged weights load into (its own weights do not matter), not
     * the model's current architecture, which may be another network or none */
    if (!arch[0])
        snprintf(arch, sizeof arch, "%s", first_ts);
    md_tensors *avg = NULL;
    if (st == MD_OK)
        st = md_weights_avg_finish(acc, &avg, &err);
    md_weights_avg_free(acc);
    uint8_t *buf = NULL;
    size_t len = 0;
    if (st == MD_OK)
        st = md_safetensors_write(avg, &buf, &len, &err);
    md_tensors_free(avg);
    md_blob_writer *blob = NULL;
    char sha[MD_SHA256_HEX];
    long long size = 0;
    if (st == MD_OK)
        st = md_blob_begin(app->store, app->cfg->max_checkpoint_bytes, &blob, &err);
    if (st == MD_OK && (st = md_blob_write(blob, buf, len, &err)) != MD_OK) {
        md_blob_abort(blob);
        blob = NULL;
    }
    free(buf);
    if (st == MD_OK && (st = md_blob_finish(blob, NULL, sha, &size, &err)) != MD_OK)
        blob = NULL; /* md_blob_finish dropped it */
    if (st != MD_OK) {
        json_decref(body);
        md_reply_error(req, &err);
        return;
    }
    /* the metadata records where the weights came from */
    if (!u->d.metadata)
        u->d.metadata = json_object();
    json_t *wl = json_array();
    for (size_t i = 0; i < n; i++)
        json_array_append_new(wl, json_real(w[i]));
    json_object_set_new(u->d.metadata, "average",
                        json_pack("{s:O,s:o}", "versions", versions, "weights", wl));
    json_decref(body);
    snprintf(u->d.arch_sha, sizeof u->d.arch_sha, "%s", arch);
    u->d.source = md_xstrdup("average");
    commit_and_reply(req, &u->d, sha, size, blob);
}

void md_handle_version_upload(md_req *req)
{
    md_err err;
    md_err_clear(&err);
    upload *u = md_req_state(req);
    if (!u) {
        /* no body at all */
        if (check_name(md_req_param(req, "name"), &err) == MD_OK)
            md_err_setc(&err, MD_EINVAL, "empty_checkpoint",
                        "the request has no checkpoint; send curl -F checkpoint=@model.pt or "
                        "--data-binary @model.pt with Content-Type: application/octet-stream");
        md_reply_error(req, &err);
        return;
    }
    if (u->json) {
        md_req_defer(req, average_commit);
        return;
    }
    if (flush_text_field(u, &err) != MD_OK) {
        md_reply_error(req, &err);
        return;
    }
    if (u->multipart && !u->saw_file) {
        md_err_setc(&err, MD_EINVAL, "missing_checkpoint",
                    "the form has no checkpoint field; add -F checkpoint=@model.pt");
        md_reply_error(req, &err);
        return;
    }
    /* query arguments work for both forms (raw uploads have no other place) */
    for (int i = 0; field_names[i]; i++) {
        const char *v = md_req_query(req, field_names[i]);
        if (v && set_text_field(&u->d, field_names[i], v, &err) != MD_OK) {
            md_reply_error(req, &err);
            return;
        }
    }
    md_req_defer(req, upload_commit);
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
    if (commit_and_reply(req, d, sha, size, mine) != MD_OK)
        md_log(MD_LOG_INFO, "register %s from %s: not stored (answered with the reason)", d->name,
               d->source);
}

static void deploy_req_free_cb(void *p)
{
    deploy_req_free(p);
    free(p);
}

/* Parse a JSON request body into an object; replies and returns NULL on error. */
static json_t *body_object(md_req *req, const char *example)
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
    json_t *body = body_object(req, "{\"name\": \"mnist\", \"source\": \"https://host/model.pt\"}");
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
            if ((st = check_name(json_string_value(v), &err)) != MD_OK)
                break;
            snprintf(d->name, sizeof d->name, "%s", json_string_value(v));
        } else if (strcmp(key, "source") == 0) {
            if (!json_is_string(v)) {
                st = md_err_setc(&err, MD_EINVAL, "invalid_source",
                                 "source must be a URL string (https://, http:// or file:///)");
                break;
            }
            d->source = md_xstrdup(json_string_value(v));
        } else if (strcmp(key, "sha256") == 0) {
            if (!json_is_string(v) || check_sha(json_string_value(v), &err) != MD_OK) {
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
            if ((st = set_json_field(d, key, v, &err)) != MD_OK)
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
                         "source is required: the URL of the checkpoint (https://, http:// or "
                         "file:///); to upload bytes use POST /models/NAME/versions");
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
    if (md_req_query_int(req, "limit", 1, 1000, 100, "invalid_limit", &limit, &err) != MD_OK) {
        md_reply_error(req, &err);
        return;
    }
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
    if (st == MD_OK)
        out = json_pack("{s:o}", "versions", out);
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
    reply_result(req, st, out, &err);
}

void md_handle_version_checkpoint(md_req *req)
{
    md_app *app = md_req_app(req);
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
    char path[4096], sha[MD_SHA256_HEX];
    md_status st = md_store_blob_path(app->store, md_req_param(req, "name"), version, path,
                                      sizeof path, sha, &err);
    if (st != MD_OK) {
        md_reply_error(req, &err);
        return;
    }
    char etag[MD_SHA256_HEX + 2];
    snprintf(etag, sizeof etag, "\"%s\"", sha);
    md_reply_header(req, "ETag", etag);
    const char *inm = md_req_header(req, "If-None-Match");
    if (inm && (strcmp(inm, etag) == 0 || strcmp(inm, sha) == 0)) {
        md_reply_bytes(req, 304, "application/octet-stream", NULL, 0);
        return;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC);
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
    snprintf(disp, sizeof disp, "attachment; filename=\"%s-v%d.pt\"", md_req_param(req, "name"),
             version);
    md_reply_header(req, "Content-Disposition", disp);
    md_reply_fd(req, 200, "application/octet-stream", fd, (size_t)sb.st_size);
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
    json_t *body = body_object(req, "{\"default_version\": 2}");
    if (!body)
        return;
    md_status st = MD_OK;
    const char *key;
    json_t *v;
    json_object_foreach(body, key, v)
    {
        if (strcmp(key, "default_version") != 0 && strcmp(key, "retention") != 0 &&
            strcmp(key, "promote") != 0) {
            st = md_err_setc(&err, MD_EINVAL, "unknown_field",
                             "unknown key \"%.40s\"; allowed: default_version, retention, promote",
                             key);
            break;
        }
    }
    json_t *dv = json_object_get(body, "default_version");
    json_t *ret = json_object_get(body, "retention");
    json_t *promote = json_object_get(body, "promote");
    if (st == MD_OK && dv && (!json_is_integer(dv) || json_integer_value(dv) < 1))
        st = md_err_setc(&err, MD_EINVAL, "invalid_version",
                         "default_version must be a positive integer");
    if (st == MD_OK && ret)
        st = md_retention_check(ret, &err);
    if (st == MD_OK && promote)
        st = md_promote_check(promote, &err);
    if (st == MD_OK && !dv && !ret && !promote)
        st = md_err_setc(&err, MD_EINVAL, "empty_patch",
                         "nothing to change; give default_version, retention and/or promote");
    if (st == MD_OK && dv)
        st = md_store_set_default(app->store, name, (int)json_integer_value(dv), &err);
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
    if (st == MD_OK && ret) {
        st = md_store_set_retention(app->store, name, ret, &err);
        md_app_forget(app, name, 0); /* retention may have deleted versions */
    }
    json_decref(body);
    json_t *out = NULL;
    if (st == MD_OK)
        st = md_store_get_model(app->store, name, &out, &err);
    reply_result(req, st, out, &err);
}

void md_handle_model_patch(md_req *req) { md_req_defer(req, model_patch_deferred); }

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
    if (f && parse_bool("force", f, &a.force, &err) != MD_OK) {
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
        md_registry_remove(app->registry, name, 0);
    }
    reply_result(req, st, st == MD_OK ? json_pack("{s:{s:s}}", "deleted", "model", name) : NULL,
                 &err);
}
