/*
 * registry.c - model name -> loaded versions, reference-counted.
 *
 * A lookup retains the model under the registry mutex, so a concurrent swap
 * can drop the registry's reference at any time: the old version finishes
 * the requests already queued (each holds a reference) and then stops. No
 * request fails during a swap.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "predictor.h"

typedef struct entry {
    md_model *model;
    int is_default;
} entry;

struct md_registry {
    pthread_mutex_t mu;
    entry *items;
    int count, cap;
};

md_registry *md_registry_new(void)
{
    md_registry *r = md_xcalloc(1, sizeof *r);
    pthread_mutex_init(&r->mu, NULL);
    return r;
}

void md_registry_free(md_registry *r)
{
    if (!r)
        return;
    for (int i = 0; i < r->count; i++)
        md_model_release(r->items[i].model);
    free(r->items);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

static int same(const md_model *m, const char *name) { return strcmp(md_model_name(m), name) == 0; }

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
            break;
        }
    }
    pthread_mutex_unlock(&r->mu);
    return found;
}

void md_registry_put(md_registry *r, md_model *m, int make_default)
{
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
    int was_default = drop[0] && r->items[slot].model == drop[0] && r->items[slot].is_default;
    r->items[slot].model = m;
    r->items[slot].is_default = make_default || was_default;
    pthread_mutex_unlock(&r->mu);
    md_model_release(drop[0]);
    md_model_release(drop[1]);
}

int md_registry_set_default(md_registry *r, const char *name, int version)
{
    int found = 0;
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < r->count; i++)
        if (same(r->items[i].model, name) && md_model_version(r->items[i].model) == version)
            found = 1;
    if (found)
        for (int i = 0; i < r->count; i++)
            if (same(r->items[i].model, name))
                r->items[i].is_default = md_model_version(r->items[i].model) == version;
    pthread_mutex_unlock(&r->mu);
    return found;
}

void md_registry_remove(md_registry *r, const char *name, int version)
{
    md_model *drop[64];
    int n = 0;
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < r->count && n < 64; i++) {
        if (same(r->items[i].model, name) &&
            (version == 0 || md_model_version(r->items[i].model) == version)) {
            drop[n++] = r->items[i].model;
            r->items[i] = r->items[--r->count];
            i--;
        }
    }
    pthread_mutex_unlock(&r->mu);
    for (int i = 0; i < n; i++)
        md_model_release(drop[i]);
}

json_t *md_registry_names(md_registry *r)
{
    json_t *a = json_array();
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < r->count; i++)
        if (r->items[i].is_default)
            json_array_append_new(a, json_string(md_model_name(r->items[i].model)));
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
    for (int i = 0; i < n; i++)
        md_model_release(ms[i]);
    free(ms);
    free(def);
}
