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

void md_traffic_free(md_traffic *t)
{
    if (!t)
        return;
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
    if (!json_is_object(traffic) || strlen(name) >= NAME_LEN)
        return 0;
    snprintf(s->name, sizeof s->name, "%s", name);
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

/* Set or drop (traffic NULL or not a split) `name`'s split; mu held. The
 * counters of an unchanged split carry over. */
static void set_locked(md_traffic *t, const char *name, json_t *traffic, const char *sticky)
{
    split s;
    int ok = parse(&s, name, traffic, sticky);
    split *cur = find(t, name);
    if (!ok) {
        if (cur) {
            *cur = t->items[--t->count];
            atomic_store(&t->any, t->count);
        }
        return;
    }
    if (cur) {
        if (cur->n == s.n && !memcmp(cur->version, s.version, sizeof s.version) &&
            !memcmp(cur->cum, s.cum, sizeof s.cum)) {
            memcpy(cur->sticky, s.sticky, sizeof s.sticky);
            return;
        }
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

void md_traffic_set(md_traffic *t, const char *name, json_t *traffic, const char *sticky_header)
{
    pthread_mutex_lock(&t->mu);
    set_locked(t, name, traffic, sticky_header);
    pthread_mutex_unlock(&t->mu);
}

void md_traffic_replace(md_traffic *t, json_t *all)
{
    pthread_mutex_lock(&t->mu);
    /* drop the models that no longer have a split, then set the rest */
    for (int i = t->count - 1; i >= 0; i--)
        if (!json_object_get(all, t->items[i].name))
            t->items[i] = t->items[--t->count];
    atomic_store(&t->any, t->count);
    const char *name;
    json_t *v;
    json_object_foreach(all, name, v)
    {
        set_locked(t, name, json_object_get(v, "traffic"),
                   json_string_value(json_object_get(v, "sticky_header")));
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
    if (s) {
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
