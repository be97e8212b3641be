/*
 * handlers.h - the HTTP resources of modeld and the application state they
 * share. Each handlers/<resource>.c translates HTTP into calls to the modules
 * (checkpoint/, predictor/) and their md_status into replies through
 * md_reply_error, the one place statuses become HTTP statuses.
 */
#ifndef MD_HANDLERS_H
#define MD_HANDLERS_H

#include <stdatomic.h>

#include "../checkpoint/checkpoint.h"
#include "../config/config.h"
#include "../jobs/jobs.h"
#include "../predictor/predictor.h"
#include "../server/server.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Everything a handler can reach. Created by main; outlives the HTTP server.
 * `ready` is an md_ready_state, changed by main and read by /readyz; both it
 * and `stop_signal` are atomics, since HTTP threads read them while main
 * writes (a reason string there was a data race ThreadSanitizer found).
 * Not opaque: its only users are handlers/ (which is its implementation) and
 * server/main.c (its owner, which fills it in at start and tears it down);
 * every one of them reads the fields. Other modules get it as a void * ctx
 * (md_req_app, md_model_resolver). */
typedef struct md_app {
    const md_cfg *cfg;
    md_store *store;
    md_registry *registry;
    md_jobs *jobs;
    md_http *http;               /* set once it started (GET /metrics reads it) */
    md_model_defaults model_defaults;
    atomic_int ready;
    atomic_int stop_signal;      /* the signal that began the drain (0: none yet) */
    long long synced_generation; /* the store generation md_app_sync last matched */
} md_app;

/* The routing table: every route modeld serves. openapi.yaml lists the same
 * set (tests/e2e checks both directions). */
extern const md_route md_routes[];
extern const size_t md_n_routes;

/* The embedded openapi.yaml (built in from the file at build time). */
const char *md_openapi_text(size_t *len);

/* metrics.c: GET /metrics (Prometheus text) */
void md_handle_metrics(md_req *req);
/* Record the process start (modeld_uptime_seconds). Once, before serving. */
void md_metrics_mark_start(void);
/* health.c */
void md_handle_healthz(md_req *req);
void md_handle_readyz(md_req *req);
/* models.c */
/* Load the stored version described by `v` (its JSON from the store), and
 * record its state (ready, or failed with libtorch's reason). Returns the
 * model with one reference, or NULL with `err` set. Reads the store and
 * blocks on the load: called only by app.c's loader (load_once), so every
 * load goes through app.c's once-only slots, off the HTTP threads. */
md_model *md_app_load_version(md_app *app, json_t *v, md_err *err);
/* At start: load every model's default version into the registry, asking
 * `stop` (may be NULL) between models whether to give up (a stop signal). */
void md_app_load_defaults(md_app *app, int (*stop)(void));
/* Converge on changes another process made to a shared store (a deploy, a
 * rollback, a delete): when the store's generation moved, load or switch to
 * every model's stored default and unload versions the store no longer has.
 * Called from one thread (main's store poller). */
void md_app_sync(md_app *app);
md_status md_upload_body(md_req *req, const char *data, size_t len, md_err *err);
void md_handle_version_upload(md_req *req);
void md_handle_models_register(md_req *req);
void md_handle_models_list(md_req *req);
void md_handle_model_get(md_req *req);
void md_handle_model_patch(md_req *req);
void md_handle_model_delete(md_req *req);
void md_handle_versions_list(md_req *req);
void md_handle_version_get(md_req *req);
void md_handle_version_delete(md_req *req);
void md_handle_version_checkpoint(md_req *req);
/* predict.c */
void md_handle_predict_default(md_req *req);
void md_handle_predict_model(md_req *req);
void md_handle_predict_version(md_req *req);
void md_handle_v2_infer(md_req *req);
void md_handle_v2_infer_version(md_req *req);
/* KServe V1: POST /v1/models/{name}:predict, GET /v1/models/{name} */
void md_handle_v1_predict(md_req *req);
void md_handle_v1_model(md_req *req);
void md_handle_v2_model(md_req *req);
void md_handle_v2_model_version(md_req *req);
void md_handle_v2_model_ready(md_req *req);
void md_handle_v2_model_version_ready(md_req *req);
void md_handle_v2_live(md_req *req);
void md_handle_v2_ready(md_req *req);
void md_handle_v2_server(md_req *req);
/* app.c */
/* The loaded version of `name` (0 = the default), retained, from memory
 * only: never loads, waits or reads SQLite, so an HTTP thread may call it.
 * On NULL, err->status says whether the answer is known: model_not_found,
 * version_not_found or a failed load's error remembered (see app.c), or
 * MD_OK when it is not: then call md_app_resolve on a deferred thread.
 * Thread-safe. */
md_model *md_app_lookup(md_app *app, const char *name, int version, md_err *err);
/* md_model_resolver over the registry: the loaded version (0 = the default),
 * retained; a stored version not loaded yet is loaded on demand, once however
 * many callers ask at the same time; callers that wait on another's load give
 * up at the version's batching.timeout_ms (MD_ETIMEOUT). Errors:
 * model_not_found, version_not_found, model_not_ready (no loaded default),
 * model_loading (timeout) and the load's own. May block: call it from a job
 * thread or a deferred handler thread, never a libmicrohttpd thread (there,
 * md_app_lookup). Thread-safe. */
md_model *md_app_resolve(void *ctx, const char *name, int version, md_err *err);
/* md_default_moved for the job runners: `version` of `name` became the
 * default in the store (a job's recorded metric under the promotion policy),
 * so make it the registry's default too, loading it if need be. May block;
 * thread-safe. */
void md_app_default_moved(void *ctx, const char *name, int version);
/* Load stored `version` of `name` as md_app_resolve does (once, deadline,
 * failures remembered) and, with make_default, make it the registry's
 * default. Returns a new reference or NULL with `err`. May block; thread-safe. */
md_model *md_app_load_stored(md_app *app, const char *name, int version, int make_default,
                             md_err *err);
/* What md_app_forget has changed so far; read it BEFORE reading rows from
 * the store, and pass it to md_app_load_row. Thread-safe. */
unsigned long md_app_epoch(void);
/* Load the stored row `v` (borrowed; its JSON from the store, read after
 * `seen_epoch` was taken) through the same once-only slots; `why` words the
 * log line ("at start"). The model is in the registry, not as the default,
 * unless something was forgotten since `seen_epoch` (then the caller alone
 * gets it). New reference or NULL with `err`. May block; thread-safe. */
md_model *md_app_load_row(md_app *app, json_t *v, unsigned long seen_epoch, const char *why,
                          md_err *err);
/* Forget what is remembered about `name` (failed loads, "not found"):
 * version 0 every version of it, NULL every name. Call after changing the
 * store (an add, a delete, retention) or noticing a replica did. Thread-safe. */
void md_app_forget(md_app *app, const char *name, int version);
/* jobs.c */
void md_handle_jobs_create(md_req *req);
void md_handle_jobs_list(md_req *req);
void md_handle_job_get(md_req *req);
void md_handle_job_cancel(md_req *req);
void md_handle_job_output(md_req *req);
/* training.c (issue 12) */
md_status md_architecture_body(md_req *req, const char *data, size_t len, md_err *err);
void md_handle_architecture_put(md_req *req);
void md_handle_architecture_get(md_req *req);
/* Answer version `version` of the route's model as safetensors (deferred). */
void md_version_export_safetensors(md_req *req, int version);
/* openapi.c */
void md_handle_openapi(md_req *req);

#ifdef __cplusplus
}
#endif
#endif
