/*
 * registry.c - model name -> loaded versions, reference-counted, under a
 * budget of resident bytes (max_loaded_bytes).
 *
 * A lookup retains the model under the registry mutex, so a concurrent swap
 * can drop the registry's reference at any time: the old version finishes
 * the requests already queued (each holds a reference) and then stops. No
 * request fails during a swap.
 *
 * DESIGN (the budget)
 * Each entry knows its version's resident bytes (md_model_resident_bytes)
 * and its last use (the monotonic time of its last lookup, or its put),
 * written under the mutex every lookup already takes, so tracking use costs
 * one clock read. Loads happen outside the registry (handlers/app.c), in two
 * steps that both make room by unloading:
 *   - before a load, md_registry_reserve promises the expected bytes (the
 *     checkpoint's size) to the load, so concurrent loads cannot all count
 *     on the same free bytes;
 *   - after it, md_registry_admit puts the model in with its real size and
 *     unloads again until the loaded bytes and the promises fit.
 * Unloading takes the least recently used entry that nobody else holds:
 * a request, a job chunk or a waiting loader each hold a reference, and new
 * references to a loaded version are only handed out under this mutex, so
 * an entry whose model has exactly one reference (the registry's), seen
 * under the mutex, has no request in flight and cannot get one before it is
 * gone. Versions that are not the default go first, defaults last. When
 * even that cannot make room, the load is refused (MD_EBUSY, 503 with
 * Retry-After) rather than run past the budget.
 * Unloading only removes the entry and drops the registry's reference; the
 * model drains its queue and is freed by its last holder (md_model_release).
 * A default unloaded this way stays the name's default: it is "parked" (its
 * name and version kept), so POST /predict still finds the name and the
 * store sync does not load it back; the next request for it loads it on
 * demand.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "predictor.h"

#define NAME_LEN 72 /* model names are at most 64 bytes */

typedef struct entry {
    md_model *model;
    int is_default;
    long long last_used_ns; /* CLOCK_MONOTONIC of the last lookup or the put */
} entry;

/* A default unloaded to free memory (budget or operator): still the default. */
typedef struct parked {
    char name[NAME_LEN];
    int version;
} parked;

struct md_registry {
    pthread_mutex_t mu;
    entry *items;
    int count, cap;
    parked *parked;
    int n_parked, parked_cap;
    long long max_bytes; /* 0: no budget; set before the registry is shared */
    long long reserved;  /* bytes promised to loads under way */
    /* GET /metrics */
    atomic_llong loads;
    atomic_llong unloads[MD_UNLOAD_REASONS];
    md_hist load_hist;
};

static const char *const reason_names[MD_UNLOAD_REASONS] = {"budget", "operator", "deleted",
                                                            "replaced"};

/* Loads take from milliseconds (a small MLP) to minutes (a large model read
 * from a slow volume). */
static const double load_bounds[] = {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                                     2.5,  5,     10,   30,  60,   120};

static long long mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

md_registry *md_registry_new(void)
{
    md_registry *r = md_xcalloc(1, sizeof *r);
    pthread_mutex_init(&r->mu, NULL);
    md_hist_init(&r->load_hist, load_bounds, (int)(sizeof load_bounds / sizeof load_bounds[0]));
    return r;
}

void md_registry_set_budget(md_registry *r, long long max_bytes)
{
    r->max_bytes = max_bytes > 0 ? max_bytes : 0;
}

long long md_registry_budget(const md_registry *r) { return r->max_bytes; }

void md_registry_free(md_registry *r)
{
    if (!r)
        return;
    for (int i = 0; i < r->count; i++)
        md_model_release(r->items[i].model);
    free(r->items);
    free(r->parked);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

static int same(const md_model *m, const char *name) { return strcmp(md_model_name(m), name) == 0; }

/* ---- parked defaults (mu held) ---- */

static void unpark(md_registry *r, const char *name, int version)
{
    for (int i = 0; i < r->n_parked; i++)
        if (strcmp(r->parked[i].name, name) == 0 &&
            (version == 0 || r->parked[i].version == version))
            r->parked[i--] = r->parked[--r->n_parked];
}

static void park(md_registry *r, const md_model *m)
{
    unpark(r, md_model_name(m), 0);
    if (r->n_parked == r->parked_cap) {
        r->parked_cap = r->parked_cap ? r->parked_cap * 2 : 8;
        r->parked = realloc(r->parked, sizeof(parked) * (size_t)r->parked_cap);
        md_assert(r->parked != NULL);
    }
    parked *p = &r->parked[r->n_parked++];
    snprintf(p->name, sizeof p->name, "%s", md_model_name(m));
    p->version = md_model_version(m);
}

/* ---- entries (mu held) ---- */

/* Take entry i out; its model goes to drop[*n] (released by the caller,
 * outside the lock). A default unloaded to free memory is parked. */
static void take_out(md_registry *r, int i, md_unload_reason why, md_model **drop, int *n)
{
    entry e = r->items[i];
    r->items[i] = r->items[--r->count];
    if (e.is_default && (why == MD_UNLOAD_BUDGET || why == MD_UNLOAD_OPERATOR))
        park(r, e.model);
    atomic_fetch_add(&r->unloads[why], 1);
    drop[(*n)++] = e.model;
}

static long long loaded_bytes(md_registry *r)
{
    long long total = 0;
    for (int i = 0; i < r->count; i++)
        total += md_model_resident_bytes(r->items[i].model);
    return total;
}

/* Unload until the loaded bytes, the promises and `need` fit the budget:
 * the least recently used entry held by nobody else (never `keep`),
 * defaults last. Returns 1 when they fit, 0 when nothing more can go; the
 * unloaded models are in drop[0..*n) (room for r->count). */
static int make_room(md_registry *r, long long need, const md_model *keep, md_model **drop,
                     int *n)
{
    if (r->max_bytes <= 0)
        return 1;
    long long total = r->reserved, movable = 0;
    for (int i = 0; i < r->count; i++) {
        long long b = md_model_resident_bytes(r->items[i].model);
        total += b;
        if (r->items[i].model != keep && md_model_refs(r->items[i].model) == 1)
            movable += b;
    }
    if (total - movable + need > r->max_bytes)
        return 0; /* hopeless: unload nothing for nothing */
    while (total + need > r->max_bytes) {
        int victim = -1;
        for (int i = 0; i < r->count; i++) {
            const entry *e = &r->items[i];
            if (e->model == keep || md_model_refs(e->model) != 1)
                continue; /* in flight (or being loaded): never unloaded */
            if (victim < 0)
                victim = i;
            else if (e->is_default != r->items[victim].is_default) {
                if (!e->is_default)
                    victim = i;
            } else if (e->last_used_ns < r->items[victim].last_used_ns)
                victim = i;
        }
        if (victim < 0)
            return 0;
        total -= md_model_resident_bytes(r->items[victim].model);
        take_out(r, victim, MD_UNLOAD_BUDGET, drop, n);
    }
    return 1;
}

/* Release what make_room or take_out unloaded (mu not held). */
static void release_dropped(md_model **drop, int n, const char *why)
{
    for (int i = 0; i < n; i++) {
        if (why)
            md_log(MD_LOG_INFO, "model %s version %d unloaded (%lld bytes) %s",
                   md_model_name(drop[i]), md_model_version(drop[i]),
                   md_model_resident_bytes(drop[i]), why);
        md_model_release(drop[i]);
    }
    free(drop);
}

static md_model **drop_list(md_registry *r)
{
    return md_xmalloc(sizeof(md_model *) * (size_t)(r->count + 2));
}

/* ---- lookups ---- */

md_model *md_registry_get(md_registry *r, const char *name, int version)
{
    md_model *found = NULL;
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < r->count; i++) {
        entry *e = &r->items[i];
        if (same(e->model, name) &&
            (version ? md_model_version(e->model) == version : e->is_default)) {
            found = e->model;
            md_model_retain(found);
            e->last_used_ns = mono_ns();
            break;
        }
    }
    pthread_mutex_unlock(&r->mu);
    return found;
}

int md_registry_info(md_registry *r, const char *name, int version, md_registry_entry *out)
{
    memset(out, 0, sizeof *out);
    long long last = 0;
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < r->count; i++) {
        entry *e = &r->items[i];
        if (same(e->model, name) &&
            (version ? md_model_version(e->model) == version : e->is_default)) {
            out->loaded = 1;
            out->is_default = e->is_default;
            out->version = md_model_version(e->model);
            out->resident_bytes = md_model_resident_bytes(e->model);
            out->live = md_model_live(e->model);
            last = e->last_used_ns;
            break;
        }
    }
    pthread_mutex_unlock(&r->mu);
    if (out->loaded) {
        /* the monotonic clock orders uses; the wall clock only says when */
        struct timespec now;
        clock_gettime(CLOCK_REALTIME, &now);
        out->last_used = (double)now.tv_sec + (double)now.tv_nsec / 1e9 -
                         (double)(mono_ns() - last) / 1e9;
    }
    return out->loaded;
}

int md_registry_default_version(md_registry *r, const char *name)
{
    int v = 0;
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < r->count && !v; i++)
        if (r->items[i].is_default && same(r->items[i].model, name))
            v = md_model_version(r->items[i].model);
    for (int i = 0; i < r->n_parked && !v; i++)
        if (strcmp(r->parked[i].name, name) == 0)
            v = r->parked[i].version;
    pthread_mutex_unlock(&r->mu);
    return v;
}

/* ---- changes ---- */

static void md_registry_put_reserved(md_registry *r, md_model *m, int make_default,
                                     long long reserved);

void md_registry_put(md_registry *r, md_model *m, int make_default)
{
    md_registry_put_reserved(r, m, make_default, 0);
}

/* md_registry_put that also gives back `reserved` (promised to the load of
 * `m`) in the same critical section that adds m's real size. */
static void md_registry_put_reserved(md_registry *r, md_model *m, int make_default,
                                     long long reserved)
{
    /* it serves from now on: its workers start (and pack) before the first
     * request comes; a failure is the first request's error too */
    md_err serr;
    if (md_model_start(m, &serr) != MD_OK)
        md_log(MD_LOG_WARN, "%s", serr.msg);
    md_model *drop[2] = {NULL, NULL};
    pthread_mutex_lock(&r->mu);
    int slot = -1;
    for (int i = 0; i < r->count; i++) {
        entry *e = &r->items[i];
        if (!same(e->model, md_model_name(m)))
            continue;
        if (md_model_version(e->model) == md_model_version(m)) {
            slot = i;
            drop[0] = e->model;
        } else if (make_default && e->is_default) {
            /* the old default leaves the registry: it drains and stops */
            drop[1] = e->model;
            r->items[i] = r->items[--r->count];
            i--;
        }
    }
    if (slot < 0) {
        /* the slot may have moved when an old default was removed */
        for (int i = 0; i < r->count; i++)
            if (r->items[i].model == drop[0])
                slot = i;
    }
    if (slot < 0) {
        if (r->count == r->cap) {
            r->cap = r->cap ? r->cap * 2 : 8;
            r->items = realloc(r->items, sizeof(entry) * (size_t)r->cap);
            md_assert(r->items != NULL);
        }
        slot = r->count++;
        r->items[slot].is_default = 0;
    }
    if (reserved > 0)
        r->reserved -= reserved;
    int was_default = drop[0] && r->items[slot].model == drop[0] && r->items[slot].is_default;
    r->items[slot].model = m;
    r->items[slot].is_default = make_default || was_default;
    r->items[slot].last_used_ns = mono_ns();
    if (r->items[slot].is_default)
        unpark(r, md_model_name(m), 0);
    for (int i = 0; i < 2; i++)
        if (drop[i])
            atomic_fetch_add(&r->unloads[MD_UNLOAD_REPLACED], 1);
    pthread_mutex_unlock(&r->mu);
    md_model_release(drop[0]);
    md_model_release(drop[1]);
}

md_status md_registry_reserve(md_registry *r, const char *name, int version, long long bytes,
                              long long *reserved, md_err *err)
{
    *reserved = 0;
    if (r->max_bytes <= 0)
        return MD_OK;
    /* the estimate may overshoot (an archive also holds code): never ask
     * for more than the whole budget; md_registry_admit judges the real size */
    long long need = bytes < 0 ? 0 : bytes > r->max_bytes ? r->max_bytes : bytes;
    pthread_mutex_lock(&r->mu);
    md_model **drop = drop_list(r);
    int n = 0;
    int fits = make_room(r, need, NULL, drop, &n);
    long long loaded = loaded_bytes(r), promised = r->reserved;
    if (fits) {
        r->reserved += need;
        *reserved = need;
    }
    pthread_mutex_unlock(&r->mu);
    release_dropped(drop, n, "to make room under max_loaded_bytes");
    if (fits)
        return MD_OK;
    return md_err_setc(err, MD_EBUSY, "loaded_bytes_full",
                       "model %s version %d needs about %lld bytes, but max_loaded_bytes "
                       "(%lld) is taken by versions with requests in flight (%lld bytes "
                       "loaded, %lld promised to loads under way); retry shortly, or raise "
                       "max_loaded_bytes",
                       name, version, need, r->max_bytes, loaded, promised);
}

void md_registry_unreserve(md_registry *r, long long reserved)
{
    if (reserved <= 0)
        return;
    pthread_mutex_lock(&r->mu);
    r->reserved -= reserved;
    pthread_mutex_unlock(&r->mu);
}

md_status md_registry_admit(md_registry *r, md_model *m, int make_default, long long reserved,
                            md_err *err)
{
    long long bytes = md_model_weight_bytes(m);
    if (r->max_bytes > 0 && bytes > r->max_bytes) {
        md_registry_unreserve(r, reserved);
        md_err_setc(err, MD_ETOOBIG, "model_over_budget",
                    "model %s version %d holds %lld bytes of weights, more than "
                    "max_loaded_bytes (%lld) allows for all loaded versions together; raise "
                    "max_loaded_bytes",
                    md_model_name(m), md_model_version(m), bytes, r->max_bytes);
        md_model_release(m);
        return MD_ETOOBIG;
    }
    if (r->max_bytes <= 0) {
        md_registry_put(r, m, make_default);
        return MD_OK;
    }
    /* the promise becomes the real size in one step under the lock: given
     * back before the put, another load could count on the same bytes */
    md_registry_put_reserved(r, m, make_default, reserved);
    pthread_mutex_lock(&r->mu);
    md_model **drop = drop_list(r);
    int n = 0;
    int fits = make_room(r, 0, m, drop, &n);
    long long loaded = loaded_bytes(r), promised = r->reserved;
    int found = 0;
    if (!fits) {
        /* over the budget with everything else in use: this one goes back
         * out, and its callers get the error. Not counted as an unload: it
         * never served. (A delete or an unload between the put and here
         * took it out already, and dropped the registry's reference.) */
        for (int i = 0; i < r->count; i++)
            if (r->items[i].model == m) {
                if (r->items[i].is_default)
                    park(r, m);
                r->items[i] = r->items[--r->count];
                found = 1;
                break;
            }
    }
    pthread_mutex_unlock(&r->mu);
    release_dropped(drop, n, "to make room under max_loaded_bytes");
    if (fits)
        return MD_OK;
    md_err_setc(err, MD_EBUSY, "loaded_bytes_full",
                "model %s version %d holds %lld bytes, but max_loaded_bytes (%lld) is taken by "
                "versions with requests in flight (%lld bytes loaded, %lld promised to loads "
                "under way); retry shortly, or raise max_loaded_bytes",
                md_model_name(m), md_model_version(m), bytes, r->max_bytes, loaded - bytes,
                promised);
    if (found)
        md_model_release(m); /* the registry's reference */
    return MD_EBUSY;
}

int md_registry_set_default(md_registry *r, const char *name, int version)
{
    int found = 0;
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < r->count; i++)
        if (same(r->items[i].model, name) && md_model_version(r->items[i].model) == version)
            found = 1;
    if (found) {
        for (int i = 0; i < r->count; i++)
            if (same(r->items[i].model, name))
                r->items[i].is_default = md_model_version(r->items[i].model) == version;
        unpark(r, name, 0);
    }
    pthread_mutex_unlock(&r->mu);
    return found;
}

/* Take out `name`'s versions (`version` 0: all), as `why`. */
static int take_out_versions(md_registry *r, const char *name, int version, md_unload_reason why,
                             const char *log_why)
{
    pthread_mutex_lock(&r->mu);
    md_model **drop = drop_list(r);
    int n = 0;
    for (int i = 0; i < r->count; i++) {
        if (same(r->items[i].model, name) &&
            (version == 0 || md_model_version(r->items[i].model) == version)) {
            take_out(r, i, why, drop, &n);
            i--;
        }
    }
    if (why == MD_UNLOAD_DELETED)
        unpark(r, name, version);
    pthread_mutex_unlock(&r->mu);
    release_dropped(drop, n, log_why);
    return n;
}

void md_registry_remove(md_registry *r, const char *name, int version)
{
    take_out_versions(r, name, version, MD_UNLOAD_DELETED, NULL);
}

int md_registry_unload(md_registry *r, const char *name, int version)
{
    return take_out_versions(r, name, version, MD_UNLOAD_OPERATOR, "by the operator") > 0;
}

void md_registry_note_load(md_registry *r, double seconds)
{
    atomic_fetch_add(&r->loads, 1);
    md_hist_observe(&r->load_hist, seconds);
}

json_t *md_registry_names(md_registry *r)
{
    json_t *a = json_array();
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < r->count; i++)
        if (r->items[i].is_default)
            json_array_append_new(a, json_string(md_model_name(r->items[i].model)));
    for (int i = 0; i < r->n_parked; i++)
        json_array_append_new(a, json_string(r->parked[i].name));
    pthread_mutex_unlock(&r->mu);
    return a;
}

json_t *md_registry_stats(md_registry *r)
{
    json_t *a = json_array();
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < r->count; i++) {
        json_t *s = md_model_stats(r->items[i].model);
        json_object_set_new(s, "default", json_boolean(r->items[i].is_default));
        json_array_append_new(a, s);
    }
    pthread_mutex_unlock(&r->mu);
    return a;
}

/* The budget's families: loads, unloads by reason, bytes loaded. */
static void write_budget_metrics(md_registry *r, md_model *const *ms, int n, FILE *f)
{
    long long total = 0;
    char l[200];
    md_prom_family(f, "modeld_model_resident_bytes", "gauge",
                   "Bytes a loaded version's parameters and buffers hold.");
    for (int i = 0; i < n; i++) {
        char v[16];
        l[0] = '\0';
        md_prom_label(l, sizeof l, "model", md_model_name(ms[i]));
        snprintf(v, sizeof v, "%d", md_model_version(ms[i]));
        md_prom_label(l, sizeof l, "version", v);
        md_prom_sample(f, "modeld_model_resident_bytes", l,
                       (double)md_model_resident_bytes(ms[i]));
        total += md_model_resident_bytes(ms[i]);
    }
    md_prom_family(f, "modeld_loaded_bytes", "gauge",
                   "Bytes the loaded versions hold together: what max_loaded_bytes bounds.");
    md_prom_sample(f, "modeld_loaded_bytes", "", (double)total);
    md_prom_family(f, "modeld_max_loaded_bytes", "gauge",
                   "The max_loaded_bytes setting (0: no budget).");
    md_prom_sample(f, "modeld_max_loaded_bytes", "", (double)r->max_bytes);
    md_prom_family(f, "modeld_model_threads", "gauge",
                   "Worker threads alive: those of the loaded versions, and those of unloaded "
                   "versions until they have drained (the last one frees the weights).");
    md_prom_sample(f, "modeld_model_threads", "", (double)md_models_wait_stopped(0));
    md_prom_family(f, "modeld_model_loads_total", "counter",
                   "Versions loaded into memory (libtorch load and test forwards), the "
                   "validation of each deploy included.");
    md_prom_sample(f, "modeld_model_loads_total", "", (double)atomic_load(&r->loads));
    md_prom_family(f, "modeld_model_load_duration_seconds", "histogram",
                   "Time of each load counted by modeld_model_loads_total.");
    md_prom_hist(f, "modeld_model_load_duration_seconds", "", &r->load_hist);
    md_prom_family(f, "modeld_model_unloads_total", "counter",
                   "Versions unloaded, by reason: budget (room under max_loaded_bytes), "
                   "operator (POST .../unload), deleted, replaced (another version became the "
                   "default).");
    for (int i = 0; i < MD_UNLOAD_REASONS; i++) {
        l[0] = '\0';
        md_prom_label(l, sizeof l, "reason", reason_names[i]);
        md_prom_sample(f, "modeld_model_unloads_total", l, (double)atomic_load(&r->unloads[i]));
    }
}

void md_registry_write_metrics(md_registry *r, FILE *f)
{
    /* retain under the lock, write without it: a scrape never holds the
     * registry (or any batcher) lock while it formats */
    pthread_mutex_lock(&r->mu);
    int n = r->count;
    md_model **ms = malloc(sizeof(md_model *) * (size_t)(n ? n : 1));
    int *def = malloc(sizeof(int) * (size_t)(n ? n : 1));
    if (!ms || !def) {
        pthread_mutex_unlock(&r->mu);
        free(ms);
        free(def);
        return;
    }
    for (int i = 0; i < n; i++) {
        ms[i] = r->items[i].model;
        def[i] = r->items[i].is_default;
        md_model_retain(ms[i]);
    }
    pthread_mutex_unlock(&r->mu);
    md_models_write_metrics(ms, def, n, f);
    write_budget_metrics(r, ms, n, f);
    for (int i = 0; i < n; i++)
        md_model_release(ms[i]);
    free(ms);
    free(def);
}
