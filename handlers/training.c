/*
 * training.c - what a training run needs besides uploads (issue 12): a
 * model's architecture (PUT/GET /models/{name}/architecture) and any
 * version's weights (md_version_weights), exported as safetensors
 * (GET /models/{name}/versions/{v}/checkpoint?format=safetensors) or
 * averaged (upload.c).
 *
 * The architecture streams into a blob writer like a checkpoint upload
 * (hashing as it goes, never whole in memory), is validated by loading it
 * (its parameter table is the answer), and only then is recorded. Loading and
 * the commit run on a deferred thread.
 */
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "../checkpoint/checkpoint.h"
#include "../predictor/predictor.h"
#include "handlers.h"

typedef struct arch_upload {
    md_blob_writer *blob;
    int multipart;
    int saw_file;
} arch_upload;

static void arch_upload_free(void *p)
{
    arch_upload *u = p;
    if (!u)
        return;
    md_blob_abort(u->blob);
    free(u);
}

static md_status arch_field(md_req *req, const char *field, const char *filename,
                            const char *data, size_t len, md_err *err)
{
    (void)filename;
    arch_upload *u = md_req_state(req);
    if (strcmp(field, "architecture") != 0)
        return md_err_setc(err, MD_EINVAL, "unknown_field",
                           "unknown form field \"%.40s\"; send the TorchScript file as -F "
                           "architecture=@arch.pt",
                           field);
    u->saw_file = 1;
    return md_blob_write(u->blob, data, len, err);
}

md_status md_architecture_body(md_req *req, const char *data, size_t len, md_err *err)
{
    md_app *app = md_req_app(req);
    arch_upload *u = md_req_state(req);
    if (!u) {
        if (md_check_model_name(md_req_param(req, "name"), err) != MD_OK)
            return err->status;
        /* No Content-Type is raw bytes: what curl -T arch.pt sends */
        const char *ct = md_req_header(req, "Content-Type");
        int multipart = ct && strncasecmp(ct, "multipart/form-data", 19) == 0;
        if (ct && !multipart && strncasecmp(ct, "application/octet-stream", 24) != 0)
            return md_err_setc(err, MD_EMEDIA, "unsupported_media_type",
                               "Content-Type %.80s is not accepted here; send the architecture "
                               "as raw bytes (curl -T arch.pt, or Content-Type: "
                               "application/octet-stream) or multipart (curl -F "
                               "architecture=@arch.pt)",
                               ct);
        u = md_xcalloc(1, sizeof *u);
        u->multipart = multipart;
        if (md_blob_begin(app->store, app->cfg->max_checkpoint_bytes, &u->blob, err) != MD_OK) {
            free(u);
            return err->status;
        }
        md_req_set_state(req, u, arch_upload_free);
    }
    if (!data)
        return MD_OK;
    if (u->multipart)
        return md_req_form_feed(req, arch_field, data, len, err);
    return md_blob_write(u->blob, data, len, err);
}

/* The answer of PUT and GET: the sha256 and the parameter table. */
static md_status arch_answer(const char *name, const char *sha, const char *path, json_t **out,
                             md_err *err)
{
    json_t *table = NULL;
    md_status st = md_weights_table(path, sha, &table, err);
    if (st != MD_OK)
        return st;
    json_object_set_new(table, "model", json_string(name));
    json_object_set_new(table, "sha256", json_string(sha));
    *out = table;
    return MD_OK;
}

static void arch_commit(md_req *req)
{
    md_app *app = md_req_app(req);
    arch_upload *u = md_req_state(req);
    const char *name = md_req_param(req, "name");
    md_err err;
    md_err_clear(&err);
    md_blob_writer *blob = u->blob;
    u->blob = NULL;
    char sha[MD_SHA256_HEX];
    long long size;
    if (md_blob_finish(blob, NULL, sha, &size, &err) != MD_OK) {
        md_reply_error(req, &err);
        return;
    }
    const char *format = NULL;
    json_t *out = NULL;
    md_status st = md_weights_format(md_blob_path(blob), &format, &err);
    if (st == MD_OK && strcmp(format, MD_FORMAT_TORCHSCRIPT) != 0)
        st = md_err_setc(&err, MD_EUNPROC, "not_torchscript",
                         "the architecture must be a TorchScript archive "
                         "(torch.jit.script(model).save(\"arch.pt\")), not a %s file; upload "
                         "weights to POST /models/%s/versions",
                         format, name);
    if (st == MD_OK)
        st = arch_answer(name, sha, md_blob_path(blob), &out, &err);
    if (st != MD_OK) {
        md_blob_abort(blob);
        md_reply_error(req, &err);
        return;
    }
    if ((st = md_store_set_architecture(app->store, name, blob, &err)) != MD_OK) {
        json_decref(out);
        md_reply_error(req, &err);
        return;
    }
    md_app_forget(app, name, 0);
    md_reply_json(req, 200, out);
}

void md_handle_architecture_put(md_req *req)
{
    md_err err;
    md_err_clear(&err);
    arch_upload *u = md_req_state(req);
    if (!u || md_blob_size(u->blob) == 0 || (u->multipart && !u->saw_file)) {
        md_err_setc(&err, MD_EINVAL, "empty_checkpoint",
                    "the request has no architecture; send curl -T arch.pt or -F "
                    "architecture=@arch.pt");
        md_reply_error(req, &err);
        return;
    }
    md_req_defer(req, arch_commit);
}

static void arch_get_deferred(md_req *req)
{
    md_app *app = md_req_app(req);
    const char *name = md_req_param(req, "name");
    md_err err;
    md_err_clear(&err);
    char sha[MD_SHA256_HEX], path[4096];
    json_t *out = NULL;
    md_status st = md_store_architecture(app->store, name, sha, &err);
    if (st == MD_OK && (st = md_app_blob(app, sha, path, sizeof path, &err)) == MD_OK) {
        st = arch_answer(name, sha, path, &out, &err);
        md_app_blob_done(app, sha);
    }
    if (st == MD_OK)
        md_reply_json(req, 200, out);
    else
        md_reply_error(req, &err);
}

void md_handle_architecture_get(md_req *req) { md_req_defer(req, arch_get_deferred); }

/* ---- a version's weights: export, and averaging (upload.c) ---- */

md_status md_version_weights(md_app *app, json_t *v, md_tensors **out, md_err *err)
{
    const char *format = json_string_value(json_object_get(v, "format"));
    const char *arch = json_string_value(json_object_get(v, "arch_sha256"));
    const char *sha = json_string_value(json_object_get(v, "sha256"));
    char path[4096], arch_path[4096];
    md_status st = md_app_blob(app, sha, path, sizeof path, err);
    if (st != MD_OK)
        return st;
    if (arch && (st = md_app_blob(app, arch, arch_path, sizeof arch_path, err)) != MD_OK) {
        md_app_blob_done(app, sha);
        return st;
    }
    st = md_weights_effective(path, format ? format : MD_FORMAT_TORCHSCRIPT,
                              arch ? arch_path : NULL, arch, out, err);
    md_app_blob_done(app, sha);
    md_app_blob_done(app, arch);
    return st;
}

/* Written to an unlinked temp file in the store, tensor by tensor
 * (md_weights_export), and sent from it as a checkpoint download is: the
 * request holds about one tensor in memory, never the model (issue 24). */
static void export_deferred(md_req *req)
{
    md_app *app = md_req_app(req);
    const char *name = md_req_param(req, "name");
    int version = *(int *)md_req_state(req);
    md_err err;
    md_err_clear(&err);
    json_t *v = NULL;
    int fd = -1;
    uint64_t size = 0;
    md_status st = md_store_get_version(app->store, name, version, &v, &err);
    if (st == MD_OK)
        st = md_store_tmpfile(app->store, &fd, &err);
    if (st == MD_OK) {
        char text[64], path[4096], arch_path[4096];
        const char *format = json_string_value(json_object_get(v, "format"));
        const char *arch = json_string_value(json_object_get(v, "arch_sha256"));
        const char *sha = json_string_value(json_object_get(v, "sha256"));
        st = md_app_blob(app, sha, path, sizeof path, &err);
        if (st == MD_OK && arch &&
            (st = md_app_blob(app, arch, arch_path, sizeof arch_path, &err)) != MD_OK)
            md_app_blob_done(app, sha);
        if (st == MD_OK) {
            md_tensors *meta = md_tensors_new();
            snprintf(text, sizeof text, "%d", version);
            md_tensors_set_meta(meta, "model", name);
            md_tensors_set_meta(meta, "version", text);
            md_tensors_set_meta(meta, "sha256", sha);
            st = md_weights_export(path, format ? format : MD_FORMAT_TORCHSCRIPT,
                                   arch ? arch_path : NULL, arch, meta, fd, &size, &err);
            md_tensors_free(meta);
            md_app_blob_done(app, sha);
            md_app_blob_done(app, arch);
        }
    }
    json_decref(v);
    if (st != MD_OK) {
        if (fd >= 0)
            close(fd);
        md_reply_error(req, &err);
        return;
    }
    char disp[160];
    snprintf(disp, sizeof disp, "attachment; filename=\"%s-v%d.safetensors\"", name, version);
    md_reply_header(req, "Content-Disposition", disp);
    md_reply_fd(req, 200, "application/octet-stream", fd, (size_t)size);
}

void md_version_export_safetensors(md_req *req, int version)
{
    int *state = md_xmalloc(sizeof *state);
    *state = version;
    md_req_set_state(req, state, free);
    md_req_defer(req, export_deferred);
}
