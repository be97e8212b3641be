/*
 * app.c - the application state's models: finding the loaded model a request
 * or a job needs, loading a stored version on demand: once per (model,
 * version) however many ask at the same time, with a deadline for those who
 * wait, and remembering what a retry would not change (a bad checkpoint, a
 * name the store does not have). Every load of a model happens here
 * (md_app_load_file; an upload's validation load too), as do the start-up
 * loads (md_app_load_defaults) and the store sync with replicas
 * (md_app_sync), both through the same once-only slots.
 *
 * DESIGN
 * A stored version that is not loaded (an older version asked for by number,
 * a default deployed through a replica) is loaded on first use. Loading is a
 * libtorch load, a test forward and SQLite writes: seconds for a big model,
 * and N copies of the model if N requests each did it. So:
 *   - the first caller for (name, version) creates a load slot and loads;
 *     callers arriving meanwhile wait on the slot's condition variable, until
 *     the version's batching.timeout_ms at most (then 504 naming it), and
 *     take the same model (a reference each). The loader puts the model in
 *     the registry before it marks the slot done, and a caller that finds no
 *     slot looks in the registry again under load_mu before it creates one,
 *     so a version is never loaded twice (a slot is freed when its last
 *     caller leaves, which may be before a late caller reads the store).
 *     Start-up loads and the store sync go through the same slots.
 *   - what a retry would answer the same is remembered in memory: a load
 *     that failed because the checkpoint or its config is bad (MD_EUNPROC,
 *     MD_EINVAL; never EIO, ENOMEM, EBUSY or a timeout, which may pass), keyed
 *     by the row's identity (sha256, created_at, config); and a model or
 *     version the store does not have. HTTP threads answer these from memory
 *     (md_app_lookup) without a deferred thread or SQLite.
 *   - memory goes stale only when the store changes, so it is forgotten then:
 *     a local add or delete forgets that name (md_app_forget), and the store
 *     sync forgets everything when the store's generation moved (a replica's
 *     change). An epoch counter, bumped by every forget, keeps a caller that
 *     read the store before a forget from remembering what it read.
 * md_app_resolve and md_app_load_stored block while they load or wait: HTTP
 * handlers call them from a deferred thread (md_req_defer), never from a
 * libmicrohttpd thread; there only md_app_lookup, which never blocks.
 *
 * Test-only knobs: MD_TEST_LOAD_HOLD=N makes a load wait until N callers
 * (the loader included, and waiters that gave up) have asked for that
 * (name, version), so a test can have N requests provably inside one load; MD_TEST_LOAD_HOLD_VERSION=V
 * holds only loads of version V; MD_TEST_LOAD_HOLD_S bounds the hold
 * (default 120 s). A held load logs "load held for the test" once.
 * MD_TEST_USE_HOLD_VERSION=V keeps a request that loaded version V on demand
 * in flight (holding its reference) until another load has finished or was
 * refused, so a test can load a third version while V provably has a
 * request in flight; it logs "request held in flight for the test".
 *
 * Memory (max_loaded_bytes): every load makes room first
 * (md_registry_reserve with the checkpoint's size, in md_app_load_file) and
 * a stored version goes into the registry through md_registry_admit with its
 * real size; the registry unloads the least recently used versions no
 * request holds. No room is MD_EBUSY (503 with Retry-After): not remembered
 * and not a "failed" version. Weights larger than the whole budget are
 * remembered like a bad checkpoint (the budget is fixed while the process
 * runs), but not recorded as a failed version either: another replica may
 * have a larger budget.
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "handlers.h"

#define REMEMBERED_MAX 256 /* answers remembered; the oldest go first */
#define NAME_MAX_LEN 72    /* model names are at most 64 bytes */

typedef struct load_slot {
    char name[NAME_MAX_LEN];
    int version;
    int done;
    md_model *model; /* one reference, held for the waiters; NULL on failure */
    md_err err;
    int refs;  /* the loader and its waiters */
    int asked; /* callers that came for this load, those gone included */
    pthread_cond_t cv;
    struct load_slot *next;
} load_slot;

/* A remembered answer: a failed load of (name, version) whose row had
 * `identity`, or (identity "") a model (version 0) or version the store does
 * not have. */
typedef struct remembered {
    char name[NAME_MAX_LEN];
    int version;
    char identity[160];
    md_err err;
} remembered;

static pthread_mutex_t load_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t arrival_cv = PTHREAD_COND_INITIALIZER;
static load_slot *loading;
static remembered memory[REMEMBERED_MAX];
static int n_memory, next_memory;
static unsigned long epoch; /* bumped by every forget (load_mu) */
static unsigned long settled; /* loads finished, kept or not (load_mu; MD_TEST_USE_HOLD_VERSION) */

/* ---- remembered answers (load_mu held) ---- */

static int name_fits(const char *name) { return name && strlen(name) < NAME_MAX_LEN; }

/* What identifies one row of (name, version): recreating the row or changing
 * its bytes or config changes it. `out` is "" when `v` lacks them. */
static void row_identity(json_t *v, char *out, size_t size)
{
    const char *sha = json_string_value(json_object_get(v, "sha256"));
    const char *created = json_string_value(json_object_get(v, "created_at"));
    char *config = json_dumps(json_object_get(v, "config"),
                              JSON_COMPACT | JSON_SORT_KEYS | JSON_ENCODE_ANY);
    uint64_t h = 1469598103934665603ULL; /* FNV-1a of the config */
    for (const char *p = config ? config : ""; *p; p++)
        h = (h ^ (unsigned char)*p) * 1099511628211ULL;
    free(config);
    snprintf(out, size, "%s/%s/%016llx", sha ? sha : "", created ? created : "",
             (unsigned long long)h);
}

/* The remembered answer for name/version. With `identity` (a row the store
 * has just shown): only a failed load of that very row. Without: any entry
 * for (name, version), or the model itself not found. */
static remembered *recall(const char *name, int version, const char *identity)
{
    for (int i = 0; i < n_memory; i++) {
        remembered *r = &memory[i];
        if (strcmp(r->name, name) != 0)
            continue;
        if (identity) {
            if (r->version == version && strcmp(r->identity, identity) == 0)
                return r;
            continue;
        }
        if (r->version == version || (r->version == 0 && r->err.status == MD_ENOTFOUND))
            return r; /* no such model: no version either */
    }
    return NULL;
}

/* Remember `err` for name/version, unless something was forgotten since
 * `seen_epoch` (what the caller read may be stale already). */
static void remember(const char *name, int version, const char *identity, const md_err *err,
                     unsigned long seen_epoch)
{
    if (seen_epoch != epoch || !name_fits(name))
        return;
    remembered *r = NULL;
    for (int i = 0; i < n_memory && !r; i++)
        if (memory[i].version == version && strcmp(memory[i].name, name) == 0)
            r = &memory[i];
    if (!r) {
        r = &memory[next_memory];
        next_memory = (next_memory + 1) % REMEMBERED_MAX;
        if (n_memory < REMEMBERED_MAX)
            n_memory++;
    }
    snprintf(r->name, sizeof r->name, "%s", name);
    r->version = version;
    snprintf(r->identity, sizeof r->identity, "%s", identity ? identity : "");
    r->err = *err;
}

/* A version larger than the whole max_loaded_bytes (registry.c). */
static int over_budget(const md_err *err)
{
    return err->status == MD_ETOOBIG && strcmp(md_err_code(err), "model_over_budget") == 0;
}

/* Failures a retry would answer the same: the checkpoint or its config is
 * bad, or its weights alone exceed max_loaded_bytes (fixed while the process
 * runs). I/O errors, memory, a full queue or budget, a timeout may pass. */
static int deterministic(const md_err *err)
{
    return err->status == MD_EUNPROC || err->status == MD_EINVAL || over_budget(err);
}

void md_app_forget(md_app *app, const char *name, int version)
{
    (void)app;
    pthread_mutex_lock(&load_mu);
    epoch++;
    int kept = 0;
    for (int i = 0; i < n_memory; i++) {
        remembered *r = &memory[i];
        int drop = !name || (strcmp(r->name, name) == 0 &&
                             (version == 0 || r->version == version || r->version == 0));
        if (!drop)
            memory[kept++] = *r;
    }
    n_memory = kept;
    next_memory = kept % REMEMBERED_MAX;
    pthread_mutex_unlock(&load_mu);
}

/* ---- blobs ---- */

md_status md_app_blob(md_app *app, const char *sha, char *path, size_t size, md_err *err)
{
    md_err mine;
    md_status st = md_store_blob_fetch(app->store, sha, path, size, &mine);
    if (st == MD_OK || st == MD_ENOTFOUND)
        return MD_OK; /* missing: the caller's check of the file says what is */
    *err = mine;
    return st;
}

void md_app_blob_done(md_app *app, const char *sha) { md_store_blob_release(app->store, sha); }

/* ---- loading: every model modeld serves is loaded here ---- */

md_status md_app_load_file(md_app *app, const char *name, int version, const char *path,
                           const char *format, const char *arch_sha, json_t *config,
                           md_model **out, long long *reserved_out, md_err *err)
{
    *out = NULL;
    *reserved_out = 0;
    /* make room first (see registry.c): the checkpoint's size is close to
     * what its weights will hold */
    struct stat sb;
    long long expected = stat(path, &sb) == 0 ? (long long)sb.st_size : 0, reserved = 0;
    md_status st = md_registry_reserve(app->registry, name, version, expected, &reserved, err);
    if (st != MD_OK)
        return st; /* the caller logs or answers it */
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    if (!arch_sha || !arch_sha[0]) {
        st = md_model_load(name, version, path, config, &app->model_defaults, out, err);
    } else {
        char arch_path[4096];
        st = md_app_blob(app, arch_sha, arch_path, sizeof arch_path, err);
        if (st == MD_OK) {
            st = md_model_load_weights(name, version, arch_path, path, format, config,
                                       &app->model_defaults, out, err);
            md_app_blob_done(app, arch_sha);
        }
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (st != MD_OK)
        md_registry_unreserve(app->registry, reserved);
    else
        *reserved_out = reserved; /* held until md_registry_admit counts the real size */
    if (st == MD_OK)
        md_registry_note_load(app->registry, (double)(t1.tv_sec - t0.tv_sec) +
                                                 (double)(t1.tv_nsec - t0.tv_nsec) / 1e9);
    return st;
}

/* Load version `v` whose file is at `path`: a TorchScript archive alone, or
 * a state_dict into the architecture the version recorded (arch_sha256), so
 * a replaced architecture never changes what an existing version serves. */
static md_status load_stored_weights(md_app *app, json_t *v, const char *path, md_model **m,
                                     long long *reserved, md_err *err)
{
    const char *name = json_string_value(json_object_get(v, "model"));
    int version = (int)json_integer_value(json_object_get(v, "version"));
    const char *format = json_string_value(json_object_get(v, "format"));
    json_t *config = json_object_get(v, "config");
    if (!format || strcmp(format, MD_FORMAT_TORCHSCRIPT) == 0)
        return md_app_load_file(app, name, version, path, format, NULL, config, m, reserved, err);
    const char *arch = json_string_value(json_object_get(v, "arch_sha256"));
    if (!arch)
        return md_err_setc(err, MD_EUNPROC, "no_architecture",
                           "model %s version %d is a %s state_dict with no recorded architecture",
                           name, version, format);
    char arch_path[4096];
    md_status st = md_app_blob(app, arch, arch_path, sizeof arch_path, err);
    if (st != MD_OK)
        return st;
    if (access(arch_path, R_OK) != 0)
        st = md_err_setc(err, MD_EIO, "checkpoint_missing",
                         "model %s version %d: its architecture file is missing from the store "
                         "(sha256 %.64s)",
                         name, version, arch);
    else
        st = md_app_load_file(app, name, version, path, format, arch, config, m, reserved, err);
    md_app_blob_done(app, arch);
    return st;
}

/* Load the stored version described by `v` (its row from the store) and
 * record its state (ready, or failed with libtorch's reason). Returns the
 * model with one reference, or NULL with `err` set. Blocks on libtorch and
 * SQLite; called only by load_once, so every load of a stored version goes
 * through its once-only slots. */
static md_model *load_version(md_app *app, json_t *v, long long *reserved, md_err *err)
{
    *reserved = 0;
    const char *name = json_string_value(json_object_get(v, "model"));
    int version = (int)json_integer_value(json_object_get(v, "version"));
    const char *sha = json_string_value(json_object_get(v, "sha256"));
    char path[4096];
    md_model *m = NULL;
    /* blobs in S3: fetched into the cache first; S3 unreachable now is
     * MD_EUNAVAIL, which passes: it never marks the version failed */
    md_status st = md_app_blob(app, sha, path, sizeof path, err);
    int pinned = st == MD_OK;
    if (st == MD_EUNAVAIL) {
        md_log(MD_LOG_WARN, "model %s version %d cannot be loaded now: %s", name, version,
               err->msg);
        return NULL;
    }
    /* a blob missing now (a replica's delete racing this load, a volume not
     * mounted yet) is an I/O error, which may pass, not a bad checkpoint,
     * which would be remembered (see DESIGN) */
    if (st != MD_OK)
        ; /* the object's bytes are not the version's: failed, with that reason */
    else if (access(path, R_OK) != 0)
        st = md_err_setc(err, MD_EIO, "checkpoint_missing",
                         "model %s version %d: its checkpoint file is missing from the store "
                         "(sha256 %.64s); retry, or upload the version again",
                         name, version, json_string_value(json_object_get(v, "sha256")));
    else
        st = load_stored_weights(app, v, path, &m, reserved, err);
    if (pinned)
        md_app_blob_done(app, sha);
    /* no room under max_loaded_bytes says nothing about the version */
    if (st != MD_EBUSY && st != MD_EUNAVAIL && !over_budget(err))
        md_store_set_state(app->store, name, version, st == MD_OK ? "ready" : "failed",
                           st == MD_OK ? NULL : err->msg, NULL);
    if (st != MD_OK)
        md_log(MD_LOG_WARN, "model %s version %d failed to load: %s", name, version, err->msg);
    return m;
}

/* ---- loading once ---- */

/* Loader, load_mu held: with MD_TEST_LOAD_HOLD, wait until enough callers
 * asked for this load (see the DESIGN note). */
static void hold_for_test(load_slot *s)
{
    static long hold = -1, hold_version, hold_s;
    if (hold < 0) {
        const char *h = getenv("MD_TEST_LOAD_HOLD");
        const char *hv = getenv("MD_TEST_LOAD_HOLD_VERSION");
        const char *hs = getenv("MD_TEST_LOAD_HOLD_S");
        hold_version = hv ? strtol(hv, NULL, 10) : 0;
        hold_s = hs ? strtol(hs, NULL, 10) : 120;
        hold = h ? strtol(h, NULL, 10) : 0;
    }
    if (s->asked >= hold || (hold_version && s->version != hold_version))
        return;
    md_log(MD_LOG_INFO, "model %s version %d: load held for the test until %ld callers asked",
           s->name, s->version, hold);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += hold_s;
    while (s->asked < hold)
        if (pthread_cond_timedwait(&arrival_cv, &load_mu, &until) == ETIMEDOUT)
            break;
}

/* With MD_TEST_USE_HOLD_VERSION=V, a request that loaded version V on
 * demand keeps it (a reference: in flight) until another load of any version
 * finished or was refused (see the DESIGN note). */
static void hold_use_for_test(const md_model *m)
{
    static long hold_version = -1, hold_s;
    pthread_mutex_lock(&load_mu);
    if (hold_version < 0) {
        const char *hv = getenv("MD_TEST_USE_HOLD_VERSION");
        const char *hs = getenv("MD_TEST_LOAD_HOLD_S");
        hold_version = hv ? strtol(hv, NULL, 10) : 0;
        hold_s = hs ? strtol(hs, NULL, 10) : 120;
    }
    if (hold_version && md_model_version(m) == hold_version) {
        unsigned long start = settled;
        md_log(MD_LOG_INFO, "model %s version %d: request held in flight for the test until "
               "another load settles", md_model_name(m), md_model_version(m));
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += hold_s;
        while (settled == start)
            if (pthread_cond_timedwait(&arrival_cv, &load_mu, &until) == ETIMEDOUT)
                break;
    }
    pthread_mutex_unlock(&load_mu);
}

/* How long a caller waits for another's load of `v`: its batching.timeout_ms,
 * else the server's. */
static int wait_ms(md_app *app, json_t *v)
{
    json_t *t = json_object_get(json_object_get(json_object_get(v, "config"), "batching"),
                                "timeout_ms");
    if (json_is_integer(t) && json_integer_value(t) > 0 && json_integer_value(t) <= 3600000)
        return (int)json_integer_value(t);
    return app->model_defaults.timeout_ms > 0 ? app->model_defaults.timeout_ms : 30000;
}

/* Free `s` once its last caller leaves (load_mu held). */
static void slot_leave(load_slot *s)
{
    if (--s->refs > 0)
        return;
    for (load_slot **p = &loading; *p; p = &(*p)->next)
        if (*p == s) {
            *p = s->next;
            break;
        }
    md_model_release(s->model);
    pthread_cond_destroy(&s->cv);
    free(s);
}

/* Load the stored version `v` (its JSON from the store, read after
 * `seen_epoch`) once; see DESIGN. `why` goes in the log line ("on demand",
 * "at start", ...). Returns a new reference, or NULL with `err` set. The
 * model is also in the registry (not as the default). Blocks while another
 * caller loads it, until that version's timeout (MD_ETIMEOUT). */
static md_model *load_once(md_app *app, json_t *v, unsigned long seen_epoch, const char *why,
                           md_err *err)
{
    const char *name = json_string_value(json_object_get(v, "model"));
    int version = (int)json_integer_value(json_object_get(v, "version"));
    char identity[160];
    row_identity(v, identity, sizeof identity);
    if (!name_fits(name)) {
        md_err_set(err, MD_EINTERNAL, "a stored model name is longer than 64 bytes");
        return NULL;
    }
    pthread_mutex_lock(&load_mu);
    remembered *r = recall(name, version, identity);
    if (r) {
        *err = r->err; /* answered from memory: no load, no log line */
        pthread_mutex_unlock(&load_mu);
        return NULL;
    }
    load_slot *s = loading;
    while (s && (s->version != version || strcmp(s->name, name) != 0))
        s = s->next;
    if (s) {
        s->refs++;
        s->asked++;
        pthread_cond_broadcast(&arrival_cv);
        int ms = wait_ms(app, v);
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += ms / 1000;
        until.tv_nsec += (long)(ms % 1000) * 1000000L;
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec++;
            until.tv_nsec -= 1000000000L;
        }
        while (!s->done)
            if (pthread_cond_timedwait(&s->cv, &load_mu, &until) == ETIMEDOUT && !s->done) {
                slot_leave(s);
                pthread_mutex_unlock(&load_mu);
                md_err_setc(err, MD_ETIMEOUT, "model_loading",
                            "model %s version %d is still loading after %d ms (its "
                            "batching.timeout_ms); retry shortly",
                            name, version, ms);
                return NULL;
            }
    } else {
        /* the slot of a load that just finished may be gone: its model is
         * in the registry then (put there before the slot was marked done) */
        md_model *m = md_registry_get(app->registry, name, version);
        if (m) {
            pthread_mutex_unlock(&load_mu);
            return m;
        }
        s = md_xcalloc(1, sizeof *s);
        snprintf(s->name, sizeof s->name, "%s", name);
        s->version = version;
        s->refs = 1;
        s->asked = 1;
        pthread_cond_init(&s->cv, NULL);
        s->next = loading;
        loading = s;
        hold_for_test(s);
        pthread_mutex_unlock(&load_mu);

        md_log(MD_LOG_INFO, "model %s version %d: loading %s", name, version, why);
        md_err lerr;
        md_err_clear(&lerr);
        long long reserved = 0;
        m = load_version(app, v, &reserved, &lerr);
        /* The registry gets it only while the row is still the one loaded: a
         * delete (or a delete and a new upload of the same number) during
         * the load must not find the old model back in the registry. When
         * anything was forgotten since the row was read, the row is read
         * again; deletes forget before they remove, and the put below holds
         * load_mu with the epoch the row was checked at, so a delete either
         * sees the model in the registry and removes it, or is seen here. */
        unsigned long checked = seen_epoch;
        int keep = m != NULL;
        pthread_mutex_lock(&load_mu);
        while (keep && epoch != checked) {
            checked = epoch;
            pthread_mutex_unlock(&load_mu);
            json_t *now = NULL;
            md_err gerr;
            char now_id[160] = "";
            if (md_store_get_version(app->store, name, version, &now, &gerr) == MD_OK)
                row_identity(now, now_id, sizeof now_id);
            json_decref(now);
            pthread_mutex_lock(&load_mu);
            if (strcmp(now_id, identity) != 0) {
                md_log(MD_LOG_INFO, "model %s version %d changed while it loaded; not kept",
                       name, version);
                keep = 0;
            }
        }
        if (keep) {
            /* the registry's reference; with the real size the budget may
             * unload others, or refuse this one when the rest is in use */
            md_model_retain(m);
            if (md_registry_admit(app->registry, m, 0, reserved, &lerr) != MD_OK) {
                md_log(MD_LOG_WARN, "model %s version %d not kept loaded: %s", name, version,
                       lerr.msg);
                md_model_release(m);
                m = NULL;
            }
        }
        else
            md_registry_unreserve(app->registry, reserved);
        settled++;
        pthread_cond_broadcast(&arrival_cv);
        s->done = 1;
        s->model = m;
        s->err = lerr;
        if (!m && deterministic(&lerr))
            remember(name, version, identity, &lerr, seen_epoch);
        pthread_cond_broadcast(&s->cv);
    }
    md_model *m = s->model;
    if (m)
        md_model_retain(m);
    else
        *err = s->err;
    slot_leave(s);
    pthread_mutex_unlock(&load_mu);
    return m;
}

static unsigned long current_epoch(void)
{
    pthread_mutex_lock(&load_mu);
    unsigned long e = epoch;
    pthread_mutex_unlock(&load_mu);
    return e;
}

/* A store lookup's "not found" (model or version), remembered. */
static void remember_missing(const char *name, int version, const md_err *err,
                             unsigned long seen_epoch)
{
    if (err->status != MD_ENOTFOUND)
        return;
    pthread_mutex_lock(&load_mu);
    remember(name, strcmp(md_err_code(err), "version_not_found") == 0 ? version : 0, NULL, err,
             seen_epoch);
    pthread_mutex_unlock(&load_mu);
}

md_model *md_app_load_stored(md_app *app, const char *name, int version, int make_default,
                             md_err *err)
{
    unsigned long seen = current_epoch();
    json_t *v = NULL;
    if (md_store_get_version(app->store, name, version, &v, err) != MD_OK) {
        remember_missing(name, version, err, seen);
        return NULL;
    }
    md_model *m = load_once(app, v, seen, "on demand", err);
    json_decref(v);
    if (m && make_default)
        md_registry_set_default(app->registry, name, version);
    return m;
}

md_model *md_app_lookup(md_app *app, const char *name, int version, md_err *err)
{
    md_err_clear(err);
    md_model *m = md_registry_get(app->registry, name, version);
    if (m || !name_fits(name))
        return m; /* a name too long to remember: not stored either; resolve says so */
    pthread_mutex_lock(&load_mu);
    remembered *r = recall(name, version, NULL);
    if (r)
        *err = r->err;
    pthread_mutex_unlock(&load_mu);
    return NULL;
}

void md_app_default_moved(void *ctx, const char *name, int version)
{
    md_err err;
    md_err_clear(&err);
    md_model *m = md_app_load_stored(ctx, name, version, 1, &err);
    if (!m)
        md_log(MD_LOG_WARN, "model %s version %d is the stored default but could not be served "
               "(the store sync retries): %s", name, version, err.msg);
    md_model_release(m);
}

md_model *md_app_resolve(void *ctx, const char *name, int version, md_err *err)
{
    md_app *app = ctx;
    md_model *m = md_app_lookup(app, name, version, err);
    if (m || err->status != MD_OK)
        return m;
    unsigned long seen = current_epoch();
    json_t *info = NULL;
    if (md_store_get_model(app->store, name, &info, err) != MD_OK) {
        remember_missing(name, 0, err, seen); /* model_not_found */
        return NULL;
    }
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
    m = md_app_load_stored(app, name, version, make_default, err);
    if (m)
        hold_use_for_test(m);
    return m;
}

void md_app_add_residency(md_app *app, json_t *v)
{
    const char *name = json_string_value(json_object_get(v, "model"));
    int version = (int)json_integer_value(json_object_get(v, "version"));
    md_registry_entry e;
    if (!name || version <= 0 || !md_registry_info(app->registry, name, version, &e)) {
        json_object_set_new(v, "loaded", json_false());
        json_object_set_new(v, "resident_bytes", json_integer(0));
        json_object_set_new(v, "last_used", json_null());
        return;
    }
    time_t secs = (time_t)e.last_used;
    long ms = (long)((e.last_used - (double)secs) * 1000.0);
    struct tm tm;
    gmtime_r(&secs, &tm);
    char when[40];
    size_t n = strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(when + n, sizeof when - n, ".%03ldZ", ms < 0 ? 0 : ms > 999 ? 999 : ms);
    json_object_set_new(v, "loaded", json_true());
    json_object_set_new(v, "resident_bytes", json_integer(e.resident_bytes));
    json_object_set_new(v, "last_used", json_string(when));
    json_object_set_new(v, "live", e.live);
}

/* ---- start-up and the store sync ---- */

md_status md_app_load_traffic(md_app *app, md_err *err)
{
    json_t *all = NULL;
    md_status st = md_store_traffic_all(app->store, &all, err);
    if (st != MD_OK)
        return st;
    md_traffic_replace(app->traffic, all);
    json_decref(all);
    return MD_OK;
}

int md_app_load_defaults(md_app *app, int (*stop)(void))
{
    md_err err;
    json_t *defaults = NULL;
    int failed = 0;
    if (md_app_load_traffic(app, &err) != MD_OK) {
        md_log(MD_LOG_ERROR, "cannot read the traffic splits: %s", err.msg);
        failed = 1;
    }
    unsigned long seen = current_epoch(); /* before the rows are read */
    if (md_store_defaults(app->store, &defaults, &err) != MD_OK) {
        md_log(MD_LOG_ERROR, "cannot list the deployed models: %s", err.msg);
        return -1;
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
        md_model *m = load_once(app, v, seen, "at start", &err);
        if (m) {
            md_registry_set_default(app->registry, md_model_name(m), md_model_version(m));
            md_log(MD_LOG_INFO, "model %s version %d loaded", md_model_name(m),
                   md_model_version(m));
            md_model_release(m);
        } else if (err.status == MD_EUNAVAIL || err.status == MD_ETIMEOUT) {
            /* S3 unreachable now: not failed; the store sync's first pass
             * (the poller is not running yet) tries again until it loads */
            app->synced_generation = -1;
        }
    }
    json_decref(defaults);
    return failed ? -1 : 0;
}

int md_app_stored_default(md_app *app, const char *name)
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
    if (gen == app->synced_generation || gen < 0) /* < 0: the index is unreachable now */
        return;
    /* the store changed, maybe through a replica: what app.c remembered
     * (failed loads, names not found) may be stale now */
    md_app_forget(app, NULL, 0);
    int again = 0; /* a load was still running elsewhere: look again next pass */
    md_err err;
    md_err_clear(&err);
    json_t *defaults = NULL;
    /* the splits first: a version a split names is loaded on demand */
    if (md_app_load_traffic(app, &err) != MD_OK) {
        md_log(MD_LOG_WARN, "store sync: %s", err.msg);
        return;
    }
    unsigned long seen = current_epoch(); /* after the forget, before the rows are read */
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
        /* a default unloaded for memory is still the default: not loaded back */
        int cur_v = md_registry_default_version(app->registry, name);
        if (cur_v == version || (state && strcmp(state, "failed") == 0))
            continue;
        if (md_registry_set_default(app->registry, name, version) == 0) {
            /* through the load slots: a request may be loading it already */
            md_model *m = load_once(app, v, seen, "for the store sync", &err);
            if (!m) {
                md_log(MD_LOG_WARN, "store sync: model %s version %d: %s", name, version, err.msg);
                /* still loading elsewhere, or S3 unreachable now: the old
                 * version keeps serving, and the next pass tries again */
                again |= err.status == MD_ETIMEOUT || err.status == MD_EUNAVAIL;
                continue;
            }
            /* a local deploy or rollback may have moved the default meanwhile */
            if (md_app_stored_default(app, name) == version)
                md_registry_set_default(app->registry, name, version);
            md_model_release(m);
        } else if (md_app_stored_default(app, name) != version) {
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
