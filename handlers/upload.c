/*
 * upload.c - POST /models/{name}/versions: a version uploaded as multipart
 * (curl -F checkpoint=@model.pt, with text fields) or raw bytes, or made by
 * averaging stored versions (a JSON {"average": ...} body, issue 12). Each
 * ends in md_deploy_commit (deploy.c).
 *
 * Uploads stream: each body chunk goes straight into the store's blob writer
 * (hashing as it goes), never into memory. Everything that can be checked
 * before bytes are committed is checked first (name, content type, size,
 * config, metrics), so a bad request stores nothing. Finishing and the
 * averaging run on a deferred thread with the connection suspended.
 */
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "deploy.h"

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
    md_deploy_req_free(&u->d);
    free(u);
}

/* End the text field being accumulated, if any. */
static md_status flush_text_field(upload *u, md_err *err)
{
    if (!u->field[0])
        return MD_OK;
    md_status st = md_deploy_set_text(&u->d, u->field, u->text.data ? u->text.data : "", err);
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
    if (!md_deploy_field_known(field))
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
                          MD_DEPLOY_FIELD_MAX);
    return MD_OK;
}

static upload *upload_start(md_req *req, md_err *err)
{
    md_app *app = md_req_app(req);
    const char *name = md_req_param(req, "name");
    if (md_check_model_name(name, err) != MD_OK)
        return NULL;
    /* No Content-Type is raw bytes (curl -X POST -T model.pt, a client that
     * sends a file as it is); a wrong one is refused rather than guessed at */
    const char *ct = md_req_header(req, "Content-Type");
    int multipart = ct && strncasecmp(ct, "multipart/form-data", 19) == 0;
    int json = ct && strncasecmp(ct, "application/json", 16) == 0;
    if (ct && !multipart && !json && strncasecmp(ct, "application/octet-stream", 24) != 0) {
        md_err_setc(err, MD_EMEDIA, "unsupported_media_type",
                    "Content-Type %.80s is not accepted here; send the checkpoint as multipart "
                    "(curl -F checkpoint=@model.pt) or raw bytes (no Content-Type, or "
                    "application/octet-stream), or a JSON {\"average\": ...} body",
                    ct);
        return NULL;
    }
    if (json) {
        upload *u = md_xcalloc(1, sizeof *u);
        snprintf(u->d.name, sizeof u->d.name, "%s", name);
        u->d.make_default = u->d.deploy = 1;
        u->json = 1;
        u->text.limit = MD_DEPLOY_FIELD_MAX;
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
    u->text.limit = MD_DEPLOY_FIELD_MAX;
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
    md_deploy_commit(req, &u->d, sha, size, blob);
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
            if (md_deploy_mark_given(&u->d, key, err) != MD_OK)
                return MD_EINVAL;
            *(strcmp(key, "deploy") == 0 ? &u->d.deploy : &u->d.make_default) = json_is_true(v);
        } else if (strcmp(key, "config") == 0 || strcmp(key, "metadata") == 0 ||
                   strcmp(key, "metrics") == 0) {
            if (md_deploy_mark_given(&u->d, key, err) != MD_OK ||
                (st = md_deploy_set_json(&u->d, key, v, err)) != MD_OK)
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

/* The weights of stored version `version` (md_version_weights), their
 * architecture (`arch_sha`, "" for TorchScript) and the version's own blob
 * (`sha`); a failure to read them is the version's (422), unless it is an
 * I/O error, memory (503) or a size limit (413). */
static md_status version_weights(md_app *app, const char *name, int version, md_tensors **out,
                                 char arch_sha[MD_SHA256_HEX], char sha[MD_SHA256_HEX],
                                 md_err *err)
{
    json_t *v = NULL;
    md_status st = md_store_get_version(app->store, name, version, &v, err);
    if (st != MD_OK)
        return st;
    const char *arch = json_string_value(json_object_get(v, "arch_sha256"));
    snprintf(arch_sha, MD_SHA256_HEX, "%s", arch ? arch : "");
    snprintf(sha, MD_SHA256_HEX, "%s", json_string_value(json_object_get(v, "sha256")));
    st = md_version_weights(app, v, out, err);
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
    md_deploy_commit(req, &u->d, sha, size, blob);
}

void md_handle_version_upload(md_req *req)
{
    md_err err;
    md_err_clear(&err);
    upload *u = md_req_state(req);
    if (!u) {
        /* no body at all */
        if (md_check_model_name(md_req_param(req, "name"), &err) == MD_OK)
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
    for (int i = 0; md_deploy_fields[i]; i++) {
        const char *v = md_req_query(req, md_deploy_fields[i]);
        if (v && md_deploy_set_text(&u->d, md_deploy_fields[i], v, &err) != MD_OK) {
            md_reply_error(req, &err);
            return;
        }
    }
    md_req_defer(req, upload_commit);
}
