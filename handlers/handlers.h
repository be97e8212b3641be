/*
 * handlers.h - the HTTP resources of modeld and the application state they
 * share. Each handlers/<resource>.c translates HTTP into calls to the modules
 * (checkpoint/, predictor/, jobs/) and their md_status into replies through
 * md_reply_error, the one place statuses become HTTP statuses. app.c holds
 * the application's models (loading, resolution, the store sync); deploy.h
 * is private to the deploying files (deploy.c, upload.c, models.c).
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
 *
 * Not opaque, because its only two users each need the fields, and getters
 * would hide nothing from them:
 *   - handlers/, its implementation: every handler reads cfg, store,
 *     registry or jobs; health.c, metrics.c and predict.c read `ready`,
 *     health.c `stop_signal`, metrics.c `http`; app.c alone uses
 *     model_defaults and synced_generation.
 *   - server/main.c, its owner: it fills in cfg, store, registry and
 *     model_defaults before the HTTP server starts, http, synced_generation
 *     and jobs after it started and before it reports ready, and moves
 *     `ready` and `stop_signal` through start and drain; it tears it down.
 * Every other module gets it as a void * ctx (md_http_start's `app`, read
 * back with md_req_app; md_jobs_start's resolver ctx) and cannot see inside.
 * `ready` (an md_ready_state) and `stop_signal` are atomics: HTTP threads
 * read them while main writes (a reason string there was a data race
 * ThreadSanitizer found). The other fields are written once and not changed
 * while requests are served, except synced_generation (the poller thread's
 * own, in md_app_sync). */
typedef struct md_traffic md_traffic;

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
    md_traffic *traffic;         /* the traffic splits (traffic.c) */
} md_app;

/* Handlers: each md_handle_* is an md_handler_fn, called by server/ on a
 * libmicrohttpd thread with the request it owns until it replies or defers
 * (md_req_defer); each answers exactly once. The *_body functions are
 * md_body_fn sinks, called on the same thread for each chunk. None blocks
 * on inference, a load or a download: those run deferred. */

/* The routing table: every route modeld serves. openapi.yaml lists the same
 * set (tests/e2e checks both directions). Constant; read by any thread. */
extern const md_route md_routes[];
extern const size_t md_n_routes;

/* The embedded openapi.yaml (built in from the file at build time): static
 * bytes, never freed, `len` set. Thread-safe. */
const char *md_openapi_text(size_t *len);

/* ?limit= of a list (1 to 1000, default 100) into *limit. On a bad value it
 * answers 400 invalid_limit and returns 0. On the handler thread (it reads
 * the query). */
static inline int md_req_limit(md_req *req, long *limit)
{
    md_err err;
    md_err_clear(&err);
    if (md_req_query_int(req, "limit", 1, 1000, 100, "invalid_limit", limit, &err) == MD_OK)
        return 1;
    md_reply_error(req, &err);
    return 0;
}

/* MD_OK when `name` (may be NULL) is a valid model name (md_model_name_ok);
 * else 400 invalid_name quoting it. Pure; thread-safe. (deploy.c) */
md_status md_check_model_name(const char *name, md_err *err);

/* metrics.c: GET /metrics (Prometheus text) */
void md_handle_metrics(md_req *req);
/* Record the process start (modeld_uptime_seconds). Once, from main, before
 * serving. */
void md_metrics_mark_start(void);
/* health.c */
void md_handle_healthz(md_req *req);
void md_handle_readyz(md_req *req);

/* deploy.c: POST /models, a version registered from a URL (the download is
 * deferred; concurrent registrations of one URL share it). */
void md_handle_models_register(md_req *req);
/* upload.c: POST /models/{name}/versions. md_upload_body streams each chunk
 * into the store's blob writer (or buffers a JSON average body); the handler
 * defers the commit. */
md_status md_upload_body(md_req *req, const char *data, size_t len, md_err *err);
void md_handle_version_upload(md_req *req);
/* models.c: reads answer at once from the store; PATCH and DELETE of a
 * version defer (they may load a version). */
void md_handle_models_list(md_req *req);
void md_handle_model_get(md_req *req);
void md_handle_model_history(md_req *req);
void md_handle_model_patch(md_req *req);
void md_handle_model_delete(md_req *req);
void md_handle_versions_list(md_req *req);
void md_handle_version_get(md_req *req);
void md_handle_version_delete(md_req *req);
void md_handle_version_checkpoint(md_req *req);
/* POST .../versions/{version}/load (deferred: it may load) and .../unload. */
void md_handle_version_load(md_req *req);
void md_handle_version_unload(md_req *req);
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

/* app.c: the models the application serves. Every model is loaded through
 * md_app_load_file; stored versions through app.c's once-only slots. */

/* The loaded version of `name` (0 = the default), retained (the caller
 * releases it), from memory only: never loads, waits or reads SQLite, so an
 * HTTP thread may call it. On NULL, err->status says whether the answer is
 * known: model_not_found, version_not_found or a failed load's error
 * remembered (see app.c), or MD_OK when it is not: then call md_app_resolve
 * on a deferred thread. Thread-safe. */
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
 * default. Returns a new reference or NULL with `err`. May block (deferred
 * threads only); thread-safe. */
md_model *md_app_load_stored(md_app *app, const char *name, int version, int make_default,
                             md_err *err);
/* Load the checkpoint at `path` (borrowed) as version `version` of `name`
 * with `config` (borrowed, may be NULL): a TorchScript archive alone when
 * `arch_sha` is NULL or "", else a state_dict of `format` into the
 * architecture blob `arch_sha`. Does not touch the registry or the store's
 * rows. *out gets a new reference, and *reserved the bytes promised to it
 * under max_loaded_bytes, which the caller gives back through
 * md_registry_admit (or md_registry_unreserve when it does not admit it);
 * 0 on failure. The one call into md_model_load*: the
 * once-only slots use it for stored versions, md_deploy_commit to validate
 * an upload before it is stored. Blocks on libtorch (deferred threads only);
 * thread-safe. */
md_status md_app_load_file(md_app *app, const char *name, int version, const char *path,
                           const char *format, const char *arch_sha, json_t *config,
                           md_model **out, long long *reserved, md_err *err);
/* The local file of the stored blob `sha` into `path` (handlers' one way
 * to a blob: with blobs in S3 it is downloaded into the cache first). MD_OK
 * when the file is there or no such bytes are stored (the caller's own check
 * of the file names what is missing); MD_EUNAVAIL when S3 or the index
 * cannot be reached now (503), MD_EIO when the object's bytes are wrong.
 * Pair every MD_OK (also the one for missing bytes) with one
 * md_app_blob_done once the file is open or read; other statuses pin
 * nothing.
 * Blocks on the network: deferred threads only. Thread-safe. */
md_status md_app_blob(md_app *app, const char *sha, char *path, size_t size, md_err *err);
void md_app_blob_done(md_app *app, const char *sha);
/* Add what the registry says of the stored version `v` (a version row as
 * the store answers it; changed in place): "loaded", "resident_bytes" (0
 * when not loaded) and "last_used" (ISO time of its last use, null when not
 * loaded). Never blocks; thread-safe. */
void md_app_add_residency(md_app *app, json_t *v);
/* The store's default version of `name` now, 0 when none (or no model).
 * Reads SQLite: deferred threads only. Thread-safe. */
int md_app_stored_default(md_app *app, const char *name);
/* Forget what is remembered about `name` (failed loads, "not found"):
 * version 0 every version of it, NULL every name. Call after changing the
 * store (an add, a delete, retention) or noticing a replica did; never
 * blocks. Thread-safe. */
void md_app_forget(md_app *app, const char *name, int version);
/* At start: load every model's default version into the registry, asking
 * `stop` (may be NULL) between models whether to give up (a stop signal).
 * Returns -1 when the index could not be read (the splits or the defaults),
 * else 0.
 * Called by main once, while HTTP threads already serve (through the same
 * slots, so a request for a model being loaded waits for this load). A
 * default that cannot load now (S3 unreachable: MD_EUNAVAIL, or a timeout)
 * sets synced_generation to -1, so the store sync retries it; call it
 * before the poller thread starts. */
int md_app_load_defaults(md_app *app, int (*stop)(void));
/* Converge on changes another process made to a shared store (a deploy, a
 * rollback, a delete): when the store's generation moved, load or switch to
 * every model's stored default and unload versions the store no longer has.
 * Called from one thread only (main's store poller): it alone writes
 * app->synced_generation. */
void md_app_sync(md_app *app);

/* traffic.c: the traffic splits of unversioned predictions (issue 28).
 * Every function is thread-safe. */
md_traffic *md_traffic_new(void);
void md_traffic_free(md_traffic *t);
/* Set `name`'s split ({"3": 90, "4": 10}, checked by md_traffic_check),
 * sticky header (NULL: none), promote_when (NULL or null: none) and shadow
 * ({"version", "percent"}; NULL or null: none); traffic NULL or null drops
 * the split. Copies what it keeps. */
void md_traffic_set(md_traffic *t, const char *name, json_t *traffic, const char *sticky_header,
                    json_t *promote_when, json_t *shadow);
/* The version to send a copy of an unversioned request answered by
 * `primary` to (the model's shadow, for its share of the requests), or 0. */
int md_traffic_shadow(md_traffic *t, const char *name, int primary);
/* Replace every split with md_store_traffic_all's object. */
void md_traffic_replace(md_traffic *t, json_t *all);
/* The version the split of `name` sends an unversioned request to (reading
 * the split's sticky header from `req`), or 0 when it has no split (the
 * default answers). Never blocks on I/O. */
int md_traffic_pick(md_traffic *t, const char *name, md_req *req);
/* shadow.c: shadow versions (issue 28). Thread-safe. */
/* Whether a copy for version `shadow` would be taken now (fewer than the
 * most copies wait for it); when not, it counts the request dropped. */
int md_shadow_room(const char *name, int primary, int shadow);
/* A copy of `in`'s values and shape into `out`; 0 when it cannot be made. */
int md_shadow_copy(const md_tensor *in, md_tensor *out);
/* Send `in` (taken) to version `shadow` of `name` at job priority, unless
 * it is not loaded here or too many copies wait for it (then dropped), and
 * compare its answer with the primary's `out` (copied) when it comes. */
void md_shadow_run(md_app *app, const char *name, int primary, int shadow, md_tensor *in,
                   const float *out, const int64_t *shape, int ndim, double primary_s);
/* The comparisons of `name`'s pairs: [{"primary", "shadow", "compared",
 * "rows", "agreement", "max_abs_diff", "errors", "dropped", ...}]. */
json_t *md_shadow_json(const char *name);
/* The numbers promote_when judges a shadow by: requests compared (answers
 * of another shape included), its errors, and top-1 agreement (0 when an
 * answer had another shape). 0 when the pair has none here. */
int md_shadow_numbers(const char *name, int primary, int shadow, long long *compared,
                      long long *errors, double *agreement);
/* modeld_shadow_* per model, primary and shadow version. */
void md_shadow_write_metrics(FILE *f);
void md_handle_model_shadow(md_req *req);
/* Judge every split with promote_when on this server's live numbers and
 * promote or roll back its canaries (traffic.c). From main's store poller,
 * once a second: it writes the store. */
void md_app_judge_canaries(md_app *app);
/* modeld_traffic_routed_total, per model and version. */
void md_traffic_write_metrics(md_traffic *t, FILE *f);
/* Read every split from the store into app->traffic; a store that cannot
 * answer leaves the splits as they were (and returns its status). Deferred
 * threads only. */
md_status md_app_load_traffic(md_app *app, md_err *err);

/* jobs.c */
void md_handle_jobs_create(md_req *req);
void md_handle_jobs_list(md_req *req);
void md_handle_job_get(md_req *req);
void md_handle_job_cancel(md_req *req);
void md_handle_job_output(md_req *req);
/* modeld_job_output_streams (Prometheus text) to `f`. Thread-safe. */
void md_jobs_write_output_metrics(FILE *f);
/* training.c (issue 12) */
md_status md_architecture_body(md_req *req, const char *data, size_t len, md_err *err);
void md_handle_architecture_put(md_req *req);
void md_handle_architecture_get(md_req *req);
/* Answer version `version` of the route's model as safetensors: defers the
 * request (the read and the encoding run on a deferred thread). On the
 * handler thread. */
void md_version_export_safetensors(md_req *req, int version);
/* The weights of the stored version `v` (its row, borrowed) as its model
 * uses them: a state_dict's own, or those a TorchScript archive holds, read
 * with its recorded architecture. *out is the caller's (md_tensors_free).
 * Reads the blob files: deferred threads only. Thread-safe. */
md_status md_version_weights(md_app *app, json_t *v, md_tensors **out, md_err *err);
/* openapi.c */
void md_handle_openapi(md_req *req);

#ifdef __cplusplus
}
#endif
#endif
