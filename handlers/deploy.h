/*
 * deploy.h - PRIVATE to handlers/: what a deployment asks for, whichever way
 * it came (a multipart or raw upload, a JSON average of versions, a URL), the
 * checks of its fields, and md_deploy_commit, where every way ends. Included
 * by deploy.c (its implementation, and POST /models), upload.c
 * (POST /models/{name}/versions) and models.c (PATCH and DELETE parse with
 * md_deploy_bool and md_req_json_object); nothing else.
 *
 * A deploy_req belongs to one request, used by one thread at a time (the
 * handler thread that parses, then the deferred thread that commits);
 * nothing here is shared between threads.
 */
#ifndef MD_HANDLERS_DEPLOY_H
#define MD_HANDLERS_DEPLOY_H

#include "handlers.h"

/* The largest text field (config, metadata, metrics, ...) a deployment may
 * carry. */
#define MD_DEPLOY_FIELD_MAX (1024 * 1024)

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
    unsigned given;   /* bit i: md_deploy_fields[i] was given (a second one is refused) */
} deploy_req;

/* The fields of a deployment, in the order of the `given` bits, NULL ended.
 * A field given twice (two form fields of one name, or a form field and a
 * query argument) is refused with 400 naming it: last-wins would silently
 * drop what the client sent first. */
extern const char *const md_deploy_fields[];

/* Free what `d` owns (not `d` itself) and zero it. */
void md_deploy_req_free(deploy_req *d);
/* Record that `field` was given; given before: 400 duplicate_field. */
md_status md_deploy_mark_given(deploy_req *d, const char *field, md_err *err);
/* Whether `field` is one of md_deploy_fields. */
int md_deploy_field_known(const char *field);
/* `text` as a boolean (true, false, 1, 0) into *out; else 400 naming `field`. */
md_status md_deploy_bool(const char *field, const char *text, int *out, md_err *err);
/* MD_OK when `text` is 64 hex digits; else 400. */
md_status md_deploy_check_sha(const char *text, md_err *err);
/* config, metadata, metrics or retention given as JSON `v` (borrowed):
 * checked (config by md_model_config_check, metrics all numbers, retention by
 * md_retention_check), then kept in `d` (a new reference). */
md_status md_deploy_set_json(deploy_req *d, const char *field, json_t *v, md_err *err);
/* A text field (a multipart field or a query argument): marked given, parsed
 * (version, booleans, sha256, or JSON for the rest) and kept in `d`. */
md_status md_deploy_set_text(deploy_req *d, const char *field, const char *text, md_err *err);

/* Load the checkpoint (the real validation, through md_app_load_file), add
 * the version row, put the model in the registry when deploying, and answer
 * 201. Takes ownership of `blob` (NULL: the bytes are stored already, as
 * `sha`). A checkpoint that does not load stores nothing (422). A version
 * given without config inherits the current default's and the answer says
 * so with "config_from". Returns the status answered, so a caller never
 * mistakes a failed commit for a stored version. Blocks on libtorch and
 * SQLite: call it on a deferred thread. */
md_status md_deploy_commit(md_req *req, deploy_req *d, const char *sha, long long size,
                           md_blob_writer *blob);

/* The request's body as a JSON object (a new reference). On an empty,
 * invalid or non-object body answers 400 (citing `example`) and returns
 * NULL. */
json_t *md_req_json_object(md_req *req, const char *example);

#endif
