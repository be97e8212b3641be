/*
 * app.c - finding the loaded model a request or a job needs, loading a stored
 * version on demand: once per (model, version) however many ask at the same
 * time, and never again after it failed, until its bytes change.
 *
 * DESIGN
 * A stored version that is not loaded (an older version asked for by number,
 * a default deployed through a replica) is loaded on first use. Loading is a
 * libtorch load, a test forward and SQLite writes: seconds for a big model,
 * and N copies of the model if N requests each did it. So:
 *   - the first caller for (name, version) creates a load slot and loads;
 *     callers arriving meanwhile wait on the slot's condition variable and
 *     take the same model (a reference each). The loader puts the model in
 *     the registry before it signals, so later callers hit the registry.
 *   - a load that fails is remembered in memory by (name, version, sha256),
 *     with its error: later callers get that answer at once, without a load
 *     or a log line. The store row says "failed" too (md_app_load_version).
 *     New bytes (another sha256) are a new version and load again.
 * Callers block while they wait; HTTP handlers call from a deferred thread
 * (md_req_defer), never from a libmicrohttpd thread.
 *
 * Test-only knob: MD_TEST_LOAD_HOLD=N makes an on-demand load wait
 * (at most 30 s) until N callers have asked for an on-demand load, so a test
 * can have N concurrent requests provably inside the loader at once.
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "handlers.h"

#define FAILED_MAX 256 /* failed loads remembered; the oldest go first */

typedef struct load_slot {
    char name[72];
    int version;
    int done;
    md_model *model; /* one reference, held for the waiters; NULL on failure */
    md_err err;
    int refs;
    pthread_cond_t cv;
    struct load_slot *next;
} load_slot;

typedef struct failed_load {
    char name[72];
    int version;
    char sha256[MD_SHA256_HEX];
    md_err err;
} failed_load;

static pthread_mutex_t load_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t arrival_cv = PTHREAD_COND_INITIALIZER;
static load_slot *loading;
static failed_load failed[FAILED_MAX];
static int n_failed, next_failed;
static long arrivals; /* on-demand load requests so far (the test knob counts them) */

static failed_load *find_failed(const char *name, int version, const char *sha)
{
    for (int i = 0; i < n_failed; i++)
        if (failed[i].version == version && strcmp(failed[i].name, name) == 0 &&
            strcmp(failed[i].sha256, sha) == 0)
            return &failed[i];
    return NULL;
}

static void remember_failure(const char *name, int version, const char *sha, const md_err *err)
{
    failed_load *f = find_failed(name, version, sha);
    if (!f) {
        f = &failed[next_failed];
        next_failed = (next_failed + 1) % FAILED_MAX;
        if (n_failed < FAILED_MAX)
            n_failed++;
    }
    snprintf(f->name, sizeof f->name, "%s", name);
    f->version = version;
    snprintf(f->sha256, sizeof f->sha256, "%s", sha);
    f->err = *err;
}

/* load_mu held. */
static void hold_for_test(void)
{
    static long hold = -1;
    if (hold < 0) {
        const char *h = getenv("MD_TEST_LOAD_HOLD");
        hold = h ? strtol(h, NULL, 10) : 0;
    }
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 30;
    while (arrivals < hold)
        if (pthread_cond_timedwait(&arrival_cv, &load_mu, &until) == ETIMEDOUT)
            break;
}

/* Load the stored version `v` (its JSON from the store) once; see DESIGN.
 * Returns a new reference, or NULL with `err` set. The model is also in the
 * registry (not as the default). Blocks while another caller loads it. */
static md_model *load_once(md_app *app, json_t *v, md_err *err)
{
    const char *name = json_string_value(json_object_get(v, "model"));
    int version = (int)json_integer_value(json_object_get(v, "version"));
    const char *sha = json_string_value(json_object_get(v, "sha256"));
    pthread_mutex_lock(&load_mu);
    arrivals++;
    pthread_cond_broadcast(&arrival_cv);
    failed_load *fl = find_failed(name, version, sha ? sha : "");
    if (fl) {
        *err = fl->err; /* answered from memory: no load, no log line */
        pthread_mutex_unlock(&load_mu);
        return NULL;
    }
    load_slot *s = loading;
    while (s && (s->version != version || strcmp(s->name, name) != 0))
        s = s->next;
    if (s) {
        s->refs++;
        while (!s->done)
            pthread_cond_wait(&s->cv, &load_mu);
    } else {
        s = md_xcalloc(1, sizeof *s);
        snprintf(s->name, sizeof s->name, "%s", name);
        s->version = version;
        s->refs = 1;
        pthread_cond_init(&s->cv, NULL);
        s->next = loading;
        loading = s;
        hold_for_test();
        pthread_mutex_unlock(&load_mu);

        md_log(MD_LOG_INFO, "model %s version %d: loading on demand", name, version);
        md_err lerr;
        md_err_clear(&lerr);
        md_model *m = md_app_load_version(app, v, &lerr);
        if (m) {
            md_model_retain(m); /* the registry's reference */
            md_registry_put(app->registry, m, 0);
        }
        pthread_mutex_lock(&load_mu);
        s->done = 1;
        s->model = m;
        s->err = lerr;
        if (!m)
            remember_failure(name, version, sha ? sha : "", &lerr);
        pthread_cond_broadcast(&s->cv);
    }
    md_model *m = s->model;
    if (m)
        md_model_retain(m);
    else
        *err = s->err;
    if (--s->refs == 0) {
        for (load_slot **p = &loading; *p; p = &(*p)->next)
            if (*p == s) {
                *p = s->next;
                break;
            }
        md_model_release(s->model);
        pthread_cond_destroy(&s->cv);
        free(s);
    }
    pthread_mutex_unlock(&load_mu);
    return m;
}

md_model *md_app_load_stored(md_app *app, const char *name, int version, int make_default,
                             md_err *err)
{
    json_t *v = NULL;
    if (md_store_get_version(app->store, name, version, &v, err) != MD_OK)
        return NULL;
    md_model *m = load_once(app, v, err);
    json_decref(v);
    if (m && make_default)
        md_registry_set_default(app->registry, name, version);
    return m;
}

md_model *md_app_resolve(void *ctx, const char *name, int version, md_err *err)
{
    md_app *app = ctx;
    md_model *m = md_registry_get(app->registry, name, version);
    if (m)
        return m;
    json_t *info = NULL;
    if (md_store_get_model(app->store, name, &info, err) != MD_OK)
        return NULL; /* model_not_found */
    int make_default = 0;
    if (!version) {
        /* a default deployed through a replica sharing the store since this
         * one started: load it here too */
        json_t *dv = json_object_get(info, "default_version");
        if (json_is_integer(dv) && json_integer_value(dv) > 0) {
            version = (int)json_integer_value(dv);
            make_default = 1;
        }
    }
    json_decref(info);
    if (!version) {
        md_err_setc(err, MD_ECONFLICT, "model_not_ready",
                    "model %s has no loaded default version; GET /models/%s shows the versions "
                    "and their states",
                    name, name);
        return NULL;
    }
    return md_app_load_stored(app, name, version, make_default, err);
}

int md_app_resolve_ready(md_app *app, const char *name, int version)
{
    md_model *m = md_registry_get(app->registry, name, version);
    md_model_release(m);
    return m != NULL;
}
