/*
 * traffic.c - routing unversioned predictions by a model's traffic split
 * (issue 28). The splits live in the store (checkpoint/traffic.c); this is
 * their in-memory copy, replaced by the store sync and by a PATCH, and read
 * once per unversioned request.
 *
 * DESIGN
 * A request without a sticky value takes the next ticket of the model's
 * counter; ticket n lands on slot (37 n) mod 100, and slot s goes to the
 * first version whose cumulative weight passes s. 37 is coprime with 100, so
 * every 100 consecutive tickets cover the 100 slots once: a 90/10 split
 * sends exactly 90 of every 100 requests to the first version, interleaved
 * (not 90 in a row), with no randomness to flake a test or a canary's
 * numbers. A request carrying the split's sticky header goes to slot
 * FNV-1a(value) mod 100: the same value lands on the same version on every
 * replica and after every restart, as long as the split is unchanged.
 * A model without a split costs one atomic read (no split anywhere) or one
 * mutex and a scan of the few models that have one.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "handlers.h"

#define NAME_LEN 72

typedef struct split {
    char name[NAME_LEN];
    int n;
    int version[MD_TRAFFIC_MAX_VERSIONS];
    int cum[MD_TRAFFIC_MAX_VERSIONS]; /* cumulative percentages; cum[n-1] == 100 */
    char sticky[72];                  /* "" = none */
    json_t *traffic;                  /* the split as stored (for the judge's compare) */
    json_t *when;                     /* promote_when, or NULL */
    int shadow_version;               /* 0: no shadow */
    int shadow_percent;               /* 1..100 */
    unsigned long long shadow_ticket;
    unsigned long long ticket;
    long long routed[MD_TRAFFIC_MAX_VERSIONS];
} split;

struct md_traffic {
    pthread_mutex_t mu;
    split *items;
    int count, cap;
    atomic_int any; /* count, read without the mutex by the fast path */
};

md_traffic *md_traffic_new(void)
{
    md_traffic *t = md_xcalloc(1, sizeof *t);
    pthread_mutex_init(&t->mu, NULL);
    return t;
}

static void split_clear(split *s)
{
    json_decref(s->traffic);
    json_decref(s->when);
    s->traffic = s->when = NULL;
}

void md_traffic_free(md_traffic *t)
{
    if (!t)
        return;
    for (int i = 0; i < t->count; i++)
        split_clear(&t->items[i]);
    free(t->items);
    pthread_mutex_destroy(&t->mu);
    free(t);
}

static split *find(md_traffic *t, const char *name)
{
    for (int i = 0; i < t->count; i++)
        if (strcmp(t->items[i].name, name) == 0)
            return &t->items[i];
    return NULL;
}

/* Fill `s` from a checked split object; 0 when it is not one (ignored). */
static int parse(split *s, const char *name, json_t *traffic, const char *sticky)
{
    memset(s, 0, sizeof *s);
    if (strlen(name) >= NAME_LEN)
        return 0;
    snprintf(s->name, sizeof s->name, "%s", name);
    if (!json_is_object(traffic))
        return 0;
    snprintf(s->sticky, sizeof s->sticky, "%s", sticky && strlen(sticky) < 72 ? sticky : "");
    int weight[MD_TRAFFIC_MAX_VERSIONS];
    const char *key;
    json_t *v;
    json_object_foreach(traffic, key, v)
    {
        int version = atoi(key);
        json_int_t w = json_integer_value(v);
        if (version <= 0 || w < 0 || w > 100 || s->n == MD_TRAFFIC_MAX_VERSIONS)
            return 0;
        if (w == 0)
            continue;
        /* sorted by version as they come: every replica, whatever order its
         * JSON holds the keys in, maps the slots to the same versions */
        int at = s->n++;
        while (at > 0 && s->version[at - 1] > version) {
            s->version[at] = s->version[at - 1];
            weight[at] = weight[at - 1];
            at--;
        }
        s->version[at] = version;
        weight[at] = (int)w;
    }
    int sum = 0;
    for (int i = 0; i < s->n; i++) {
        sum += weight[i];
        s->cum[i] = sum;
    }
    return s->n > 0 && sum == 100;
}

/* Drop item i; mu held. */
static void drop_locked(md_traffic *t, int i)
{
    split_clear(&t->items[i]);
    t->items[i] = t->items[--t->count];
    atomic_store(&t->any, t->count);
}

/* Set or drop (traffic NULL or not a split) `name`'s split; mu held. The
 * counters of an unchanged split carry over. */
static void set_locked(md_traffic *t, const char *name, json_t *traffic, const char *sticky,
                       json_t *when, json_t *shadow)
{
    split s;
    int ok = parse(&s, name, traffic, sticky);
    if (!ok) /* no split: the entry may still hold a shadow */
        s.n = 0;
    int sv = (int)json_integer_value(json_object_get(shadow, "version"));
    int sp = (int)json_integer_value(json_object_get(shadow, "percent"));
    if (sv > 0 && sp >= 1 && sp <= 100) {
        s.shadow_version = sv;
        s.shadow_percent = sp;
    }
    split *cur = find(t, name);
    if (s.n == 0 && !s.shadow_version) {
        if (cur)
            drop_locked(t, (int)(cur - t->items));
        return;
    }
    s.traffic = s.n ? json_deep_copy(traffic) : NULL;
    s.when = json_is_object(when) ? json_deep_copy(when) : NULL;
    if (cur) {
        if (cur->n == s.n && !memcmp(cur->version, s.version, sizeof s.version) &&
            !memcmp(cur->cum, s.cum, sizeof s.cum)) {
            memcpy(cur->sticky, s.sticky, sizeof s.sticky);
            split_clear(cur);
            cur->traffic = s.traffic;
            cur->when = s.when;
            if (cur->shadow_version != s.shadow_version ||
                cur->shadow_percent != s.shadow_percent)
                cur->shadow_ticket = 0;
            cur->shadow_version = s.shadow_version;
            cur->shadow_percent = s.shadow_percent;
            return;
        }
        split_clear(cur);
        *cur = s;
        return;
    }
    if (t->count == t->cap) {
        t->cap = t->cap ? t->cap * 2 : 8;
        t->items = realloc(t->items, (size_t)t->cap * sizeof *t->items);
        md_assert(t->items != NULL);
    }
    t->items[t->count++] = s;
    atomic_store(&t->any, t->count);
}

void md_traffic_set(md_traffic *t, const char *name, json_t *traffic, const char *sticky_header,
                    json_t *promote_when, json_t *shadow)
{
    pthread_mutex_lock(&t->mu);
    set_locked(t, name, traffic, sticky_header, promote_when, shadow);
    pthread_mutex_unlock(&t->mu);
}

void md_traffic_replace(md_traffic *t, json_t *all)
{
    pthread_mutex_lock(&t->mu);
    /* drop the models that no longer have a split, then set the rest */
    for (int i = t->count - 1; i >= 0; i--)
        if (!json_object_get(all, t->items[i].name))
            drop_locked(t, i);
    const char *name;
    json_t *v;
    json_object_foreach(all, name, v)
    {
        set_locked(t, name, json_object_get(v, "traffic"),
                   json_string_value(json_object_get(v, "sticky_header")),
                   json_object_get(v, "promote_when"), json_object_get(v, "shadow"));
    }
    pthread_mutex_unlock(&t->mu);
}

static unsigned long long fnv1a(const char *s)
{
    unsigned long long h = 1469598103934665603ULL;
    for (; *s; s++) {
        h ^= (unsigned char)*s;
        h *= 1099511628211ULL;
    }
    return h;
}

int md_traffic_pick(md_traffic *t, const char *name, md_req *req)
{
    if (!t || atomic_load(&t->any) == 0)
        return 0;
    int version = 0;
    pthread_mutex_lock(&t->mu);
    split *s = find(t, name);
    if (s && s->n > 0) {
        const char *value = s->sticky[0] ? md_req_header(req, s->sticky) : NULL;
        int slot = value && value[0] ? (int)(fnv1a(value) % 100)
                                     : (int)((s->ticket++ % 100) * 37 % 100);
        int i = 0;
        while (i < s->n - 1 && slot >= s->cum[i])
            i++;
        version = s->version[i];
        s->routed[i]++;
    }
    pthread_mutex_unlock(&t->mu);
    return version;
}

int md_traffic_shadow(md_traffic *t, const char *name, int primary)
{
    if (!t || atomic_load(&t->any) == 0)
        return 0;
    int version = 0;
    pthread_mutex_lock(&t->mu);
    split *s = find(t, name);
    if (s && s->shadow_version && s->shadow_version != primary &&
        (int)((s->shadow_ticket++ % 100) * 37 % 100) < s->shadow_percent)
        version = s->shadow_version;
    pthread_mutex_unlock(&t->mu);
    return version;
}

void md_traffic_write_metrics(md_traffic *t, FILE *f)
{
    md_prom_family(f, "modeld_traffic_routed_total", "counter",
                   "Unversioned predictions a model's traffic split sent to each version "
                   "(since the split was last changed on this replica).");
    pthread_mutex_lock(&t->mu);
    for (int i = 0; i < t->count; i++)
        for (int j = 0; j < t->items[i].n; j++) {
            char labels[128];
            snprintf(labels, sizeof labels, "model=\"%s\",version=\"%d\"", t->items[i].name,
                     t->items[i].version[j]);
            md_prom_sample(f, "modeld_traffic_routed_total", labels,
                           (double)t->items[i].routed[j]);
        }
    pthread_mutex_unlock(&t->mu);
}

/* ---- promote_when: the judge ----
 *
 * Once a second (main's store poller), each split with promote_when is
 * judged on this server's live numbers of its canaries (the versions with a
 * share that are not the default, md_model_live since they loaded here):
 *   - rollback: a canary that failed more requests than max_error_rate
 *     allows over min_requests (errors > floor(max_error_rate x
 *     min_requests)) loses its share to the default at once; waiting for
 *     min_requests would only serve more errors;
 *   - promotion: a canary that answered min_requests with an error rate
 *     within max_error_rate becomes the default, and the split ends.
 * The outcome is written in one transaction that first checks the split is
 * still the one judged (md_store_apply_verdict), so when several replicas
 * judge at once exactly one acts; the others follow it at their sync. */

/* The splits with promote_when: [{"model", "traffic", "promote_when"}]. */
static json_t *judgeable(md_traffic *t)
{
    json_t *out = json_array();
    pthread_mutex_lock(&t->mu);
    for (int i = 0; i < t->count; i++)
        if (t->items[i].when && (t->items[i].traffic || t->items[i].shadow_version))
            json_array_append_new(
                out, json_pack("{s:s,s:O,s:O,s:o}", "model", t->items[i].name, "traffic",
                               t->items[i].traffic ? t->items[i].traffic : json_null(),
                               "promote_when", t->items[i].when, "shadow",
                               t->items[i].shadow_version
                                   ? json_pack("{s:i,s:i}", "version", t->items[i].shadow_version,
                                               "percent", t->items[i].shadow_percent)
                                   : json_null()));
    pthread_mutex_unlock(&t->mu);
    return out;
}

/* The split without `version`, its share given to `def`; JSON null when
 * only the default would be left. New reference. */
static json_t *without(json_t *traffic, int version, int def)
{
    json_t *out = json_object();
    char vk[16], dk[16];
    snprintf(vk, sizeof vk, "%d", version);
    snprintf(dk, sizeof dk, "%d", def);
    json_int_t freed = json_integer_value(json_object_get(traffic, vk));
    const char *key;
    json_t *w;
    json_object_foreach(traffic, key, w)
    {
        if (strcmp(key, vk) != 0 && json_integer_value(w) > 0)
            json_object_set(out, key, w);
    }
    json_object_set_new(out, dk,
                        json_integer(json_integer_value(json_object_get(out, dk)) + freed));
    if (json_object_size(out) == 1) {
        json_decref(out);
        return json_null();
    }
    return out;
}

/* Judge the shadow of one model; 1 when it acted. */
static int judge_shadow(md_app *app, json_t *item)
{
    const char *name = json_string_value(json_object_get(item, "model"));
    json_t *shadow = json_object_get(item, "shadow");
    json_t *when = json_object_get(item, "promote_when");
    int sv = (int)json_integer_value(json_object_get(shadow, "version"));
    json_t *ma = json_object_get(when, "min_agreement");
    long long min_requests = json_integer_value(json_object_get(when, "min_requests"));
    double max_rate = json_number_value(json_object_get(when, "max_error_rate"));
    int def = md_registry_default_version(app->registry, name);
    long long compared, errors;
    double agreement;
    if (sv <= 0 || def <= 0 || sv == def || min_requests <= 0 ||
        !md_shadow_numbers(name, def, sv, &compared, &errors, &agreement))
        return 0;
    long long n = compared + errors;
    long long allowed = (long long)(max_rate * (double)min_requests + 1e-9);
    double rate = n ? (double)errors / (double)n : 0;
    int drop = errors > allowed;
    int promote = !drop && n >= min_requests && rate <= max_rate &&
                  (!ma || agreement >= json_number_value(ma));
    if (!drop && !promote)
        return 0;
    char why[400];
    if (drop)
        snprintf(why, sizeof why,
                 "promote_when: shadow version %d failed %lld of %lld requests, more than "
                 "max_error_rate %g allows over min_requests %lld (%lld): the shadow ended",
                 sv, errors, n, max_rate, min_requests, allowed);
    else
        snprintf(why, sizeof why,
                 "promote_when: shadow version %d answered %lld requests with an error rate of "
                 "%.6f and a top-1 agreement of %.6f with version %d: it became the default",
                 sv, n, rate, agreement, def);
    json_t *note = json_pack("{s:s,s:s}", "by", "promote_when", "reason", why);
    json_t *null = json_null();
    md_err err;
    md_err_clear(&err);
    md_status st = md_store_apply_verdict_on(app->store, name, "shadow", shadow,
                                             promote ? sv : 0, null, note, &err);
    if (st == MD_OK) {
        md_log(MD_LOG_INFO, "model %s: %s", name, why);
        if (promote)
            md_registry_set_default(app->registry, name, sv);
        md_err lerr;
        if (md_app_load_traffic(app, &lerr) != MD_OK)
            md_traffic_set(app->traffic, name, NULL, NULL, NULL, NULL);
    } else if (st != MD_ECONFLICT) {
        md_log(MD_LOG_WARN, "model %s: promote_when could not act (%s); it tries again", name,
               err.msg);
    }
    json_decref(null);
    json_decref(note);
    return st == MD_OK;
}

/* Judge one split; 1 when it acted. */
static int judge_one(md_app *app, json_t *item)
{
    if (!json_is_object(json_object_get(item, "traffic")))
        return judge_shadow(app, item);
    const char *name = json_string_value(json_object_get(item, "model"));
    json_t *traffic = json_object_get(item, "traffic");
    json_t *when = json_object_get(item, "promote_when");
    long long min_requests = json_integer_value(json_object_get(when, "min_requests"));
    double max_rate = json_number_value(json_object_get(when, "max_error_rate"));
    int def = md_registry_default_version(app->registry, name);
    if (def <= 0 || min_requests <= 0)
        return 0;
    long long allowed = (long long)(max_rate * (double)min_requests + 1e-9);
    const char *key;
    json_t *w;
    json_object_foreach(traffic, key, w)
    {
        int v = atoi(key);
        if (v == def || json_integer_value(w) <= 0)
            continue;
        md_registry_entry e;
        if (!md_registry_info(app->registry, name, v, &e)) {
            json_decref(e.live);
            continue; /* not loaded here: no numbers of it here */
        }
        long long n = json_integer_value(json_object_get(e.live, "requests"));
        long long errors = json_integer_value(json_object_get(e.live, "errors"));
        json_decref(e.live);
        double rate = n ? (double)errors / (double)n : 0;
        int rollback = errors > allowed;
        int promote = !rollback && n >= min_requests && rate <= max_rate;
        if (!rollback && !promote)
            continue;
        char why[400];
        if (rollback)
            snprintf(why, sizeof why,
                     "promote_when: version %d failed %lld of %lld requests, more than "
                     "max_error_rate %g allows over min_requests %lld (%lld): its share went to "
                     "version %d",
                     v, errors, n, max_rate, min_requests, allowed, def);
        else
            snprintf(why, sizeof why,
                     "promote_when: version %d answered %lld requests with an error rate of "
                     "%.6f, within max_error_rate %g: it became the default",
                     v, n, rate, max_rate);
        json_t *note = json_pack("{s:s,s:s}", "by", "promote_when", "reason", why);
        json_t *next = rollback ? without(traffic, v, def) : json_null();
        md_err err;
        md_err_clear(&err);
        md_status st = md_store_apply_verdict(app->store, name, traffic, rollback ? 0 : v, next,
                                              note, &err);
        if (st == MD_OK) {
            md_log(MD_LOG_INFO, "model %s: %s", name, why);
            /* this replica follows at once (the shadow, unchanged, with it) */
            md_err lerr;
            if (md_app_load_traffic(app, &lerr) != MD_OK)
                md_traffic_set(app->traffic, name, NULL, NULL, NULL, NULL); /* sync redoes it */
            if (promote)
                md_registry_set_default(app->registry, name, v);
        } else if (st != MD_ECONFLICT) {
            md_log(MD_LOG_WARN, "model %s: promote_when could not act (%s); it tries again",
                   name, err.msg);
        }
        json_decref(next);
        json_decref(note);
        return st == MD_OK;
    }
    return 0;
}

void md_app_judge_canaries(md_app *app)
{
    if (!app->traffic || atomic_load(&app->traffic->any) == 0)
        return;
    json_t *items = judgeable(app->traffic);
    size_t i;
    json_t *item;
    json_array_foreach(items, i, item)
    {
        judge_one(app, item);
    }
    json_decref(items);
}
