/*
 * job_retention.c - removing ended jobs, and what the server wrote for them.
 *
 * DESIGN
 * A job's record and outputs are kept until it is removed: by its operator
 * (DELETE /jobs/ID?purge=true) or, with job_retention_s set, by the janitor
 * thread once the job ended that long ago. Removing a job removes, in this
 * order:
 *   1. the server's own S3 objects of it (cluster mode, no output.path:
 *      s3://BUCKET/PREFIX/jobs/<id>/, its output and any part left there);
 *      a user's s3:// output.path is never removed, only the parts a
 *      failed sweep may have left beside it (<output>.chunks/<id>/);
 *   2. its row and chunk rows, recording its id in jobs_removed, in one
 *      transaction that NOTIFYs every replica;
 *   3. this replica's files of it: <store>/jobs/<id>.* (its output's copy,
 *      parts, an S3 image folder's copy). A local output.path is never in
 *      there and never removed.
 * A failure at 1 keeps the row (the next sweep tries again), so no object
 * is ever left without a row naming it; a crash between 2 and 3 leaves
 * files that step 3's sweep finds. Every replica's janitor removes its own
 * copies of the jobs recorded in jobs_removed (another replica may have
 * removed them): when it hears the NOTIFY (md_jobs_wake), and at each
 * sweep. Ids in jobs_removed are forgotten after REMOVED_KEEP_S.
 *
 * Two replicas sweeping at once both delete the same objects (deleting an
 * absent object is fine) and one of them the row; the other's delete
 * answers job_not_found, which the sweep ignores.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "../config/md_metrics.h"
#include "jobs.h"

#define SWEEP_MAX_S 60                  /* the longest between two sweeps */
#define SWEEP_BATCH 100                 /* jobs listed per query */
#define REMOVED_KEEP_S (30L * 24 * 3600) /* how long a removal is remembered */
#define LOCAL_IDS_MAX 1000000           /* ids of one local scan */
#define LOCAL_GAP_S 2.0                 /* the least time between two local scans */

static atomic_llong jobs_removed_total;

void md_job_remove_tree(int parent, const char *name, int depth)
{
    int fd = openat(parent, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd >= 0 && depth < MD_IMAGES_MAX_DEPTH + 2) {
        DIR *d = fdopendir(fd);
        if (d) {
            struct dirent *e;
            while ((e = readdir(d)) != NULL) {
                if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
                    continue;
                if (unlinkat(dirfd(d), e->d_name, 0) != 0 && (errno == EISDIR || errno == EPERM))
                    md_job_remove_tree(dirfd(d), e->d_name, depth + 1);
            }
            closedir(d);
            fd = -1;
        }
    }
    if (fd >= 0)
        close(fd);
    unlinkat(parent, name, AT_REMOVEDIR);
}

/* The job id an entry of <store>/jobs belongs to (what precedes its first
 * '.'), into id; 0 when the name is not one of a job's. Ids are the
 * server's: j<digits><hex>. */
static int entry_job_id(const char *name, char id[64])
{
    const char *dot = strchr(name, '.');
    size_t n = dot ? (size_t)(dot - name) : 0;
    if (n < 2 || n > 63 || name[0] != 'j')
        return 0;
    for (size_t i = 1; i < n; i++)
        if (!((name[i] >= '0' && name[i] <= '9') || (name[i] >= 'a' && name[i] <= 'f')))
            return 0;
    memcpy(id, name, n);
    id[n] = '\0';
    return 1;
}

/* Remove every entry <store>/jobs/<id>.* of this replica (files and
 * folders); the number removed. */
static int remove_local(md_store *store, const char *id)
{
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/jobs", md_store_dir(store));
    DIR *d = opendir(dir);
    if (!d)
        return 0;
    int removed = 0;
    struct dirent *e;
    char eid[64];
    while ((e = readdir(d)) != NULL) {
        if (!entry_job_id(e->d_name, eid) || strcmp(eid, id) != 0)
            continue;
        if (unlinkat(dirfd(d), e->d_name, 0) != 0) {
            if (errno != EISDIR && errno != EPERM)
                continue;
            md_job_remove_tree(dirfd(d), e->d_name, 0);
        }
        removed++;
    }
    closedir(d);
    return removed;
}

/* Step 1 of the DESIGN: the job's S3 objects the server owns. */
static md_status remove_objects(md_store *store, const md_fetch_opts *fetch, const char *id,
                                json_t *spec, md_err *err)
{
    char out_url[1200], prefix[1400];
    if (!md_job_output_url(store, id, spec, out_url, sizeof out_url))
        return MD_OK; /* a local output only */
    long long gone = 0;
    if (!json_string_value(json_object_get(json_object_get(spec, "output"), "path"))) {
        /* the server's own folder of this job: output.EXT and its parts */
        char root[1200];
        if (!md_store_data_url(store, root, sizeof root))
            return MD_OK;
        snprintf(prefix, sizeof prefix, "%sjobs/%s/", root, id);
        return md_s3_data_delete_prefix(prefix, fetch, &gone, err);
    }
    /* a user's output.path: only parts a failed sweep may have left */
    snprintf(prefix, sizeof prefix, "%s.chunks/%s/", out_url, id);
    md_err derr;
    if (md_s3_data_delete_prefix(prefix, fetch, &gone, &derr) != MD_OK)
        md_log(MD_LOG_WARN, "job %s: deleting parts left under %s: %s", id, prefix, derr.msg);
    return MD_OK;
}

md_status md_job_remove(md_store *store, const md_fetch_opts *fetch, const char *id,
                        const char *why, md_err *err)
{
    json_t *job = NULL;
    md_status st = md_store_job_get(store, id, &job, err);
    if (st != MD_OK)
        return st;
    const char *status = json_string_value(json_object_get(job, "status"));
    if (!status || (strcmp(status, "succeeded") && strcmp(status, "failed") &&
                    strcmp(status, "cancelled"))) {
        st = md_err_setc(err, MD_ECONFLICT, "job_not_finished",
                         "job %s is %s: only an ended job is removed; cancel it with "
                         "DELETE /jobs/%s, then purge it once it reads cancelled",
                         id, status ? status : "?", id);
        json_decref(job);
        return st;
    }
    st = remove_objects(store, fetch, id, json_object_get(job, "spec"), err);
    json_decref(job);
    if (st == MD_OK)
        st = md_store_job_delete(store, id, err);
    if (st != MD_OK)
        return st;
    int files = remove_local(store, id);
    atomic_fetch_add(&jobs_removed_total, 1);
    md_log(MD_LOG_INFO, "job %s removed (%s); %d file(s) of it in this store", id, why, files);
    return MD_OK;
}

void md_jobs_write_removed_metrics(FILE *f)
{
    md_prom_family(f, "modeld_jobs_removed_total", "counter",
                   "Ended jobs this replica removed, with the outputs the server wrote for "
                   "them (job_retention_s, DELETE /jobs/ID?purge=true).");
    md_prom_sample(f, "modeld_jobs_removed_total", "", (double)atomic_load(&jobs_removed_total));
}

/* ---- the janitor thread ---- */

struct md_job_janitor {
    md_store *store;
    const md_fetch_opts *fetch;
    int retention_s;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv; /* CLOCK_MONOTONIC */
    int stop, woken;
    char mark[64]; /* md_store_jobs_removed_mark at the last local scan */
};

static void iso_at(time_t t, char out[32])
{
    struct tm tm;
    gmtime_r(&t, &tm);
    size_t n = strftime(out, 32, "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(out + n, 32 - n, ".000Z");
}

/* Remove this replica's files of jobs recorded as removed (by any replica). */
static void sweep_local(md_store *store)
{
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/jobs", md_store_dir(store));
    DIR *d = opendir(dir);
    if (!d)
        return;
    json_t *seen = json_object(); /* the distinct ids, as a set */
    struct dirent *e;
    char id[64];
    while (seen && (e = readdir(d)) != NULL && json_object_size(seen) < LOCAL_IDS_MAX)
        if (entry_job_id(e->d_name, id))
            json_object_set_new(seen, id, json_true());
    closedir(d);
    json_t *list = json_array();
    const char *key;
    json_t *v;
    json_object_foreach(seen, key, v) json_array_append_new(list, json_string(key));
    json_decref(seen);
    json_t *removed = NULL;
    md_err err;
    if (json_array_size(list) &&
        md_store_jobs_removed_among(store, list, &removed, &err) == MD_OK) {
        size_t i;
        json_array_foreach(removed, i, v)
        {
            int files = remove_local(store, json_string_value(v));
            if (files)
                md_log(MD_LOG_INFO, "job %s was removed: %d file(s) of it taken from this store",
                       json_string_value(v), files);
        }
        json_decref(removed);
    }
    json_decref(list);
}

/* Remove the jobs that ended more than retention_s ago. */
static void sweep_expired(struct md_job_janitor *w)
{
    char before[32];
    iso_at(time(NULL) - w->retention_s, before);
    for (int round = 0; round < 100; round++) {
        json_t *ids = NULL;
        md_err err;
        if (md_store_jobs_ended_before(w->store, before, SWEEP_BATCH, &ids, &err) != MD_OK) {
            md_log(MD_LOG_WARN, "job retention: cannot list ended jobs: %s", err.msg);
            return;
        }
        size_t n = json_array_size(ids), failed = 0, i;
        json_t *v;
        json_array_foreach(ids, i, v)
        {
            pthread_mutex_lock(&w->mu);
            int stop = w->stop;
            pthread_mutex_unlock(&w->mu);
            if (stop)
                break;
            md_status st = md_job_remove(w->store, w->fetch, json_string_value(v),
                                         "job_retention_s", &err);
            if (st != MD_OK && st != MD_ENOTFOUND && st != MD_ECONFLICT) {
                md_log(MD_LOG_WARN, "job retention: cannot remove job %s: %s",
                       json_string_value(v), err.msg);
                failed++;
            }
        }
        json_decref(ids);
        if (n < SWEEP_BATCH || failed) /* all done, or try again at the next sweep */
            return;
    }
}

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void *janitor_main(void *arg)
{
    struct md_job_janitor *w = arg;
    int interval = SWEEP_MAX_S;
    if (w->retention_s > 0 && w->retention_s / 4 < interval)
        interval = w->retention_s / 4 > 1 ? w->retention_s / 4 : 1;
    double next = 0; /* sweep at once: a restart finds what expired meanwhile */
    double last_local = -LOCAL_GAP_S;
    for (;;) {
        pthread_mutex_lock(&w->mu);
        for (;;) {
            /* a wake (any NOTIFY: chunk plans and finishes too) looks at
             * this store's files at most once per LOCAL_GAP_S */
            double due = next;
            if (w->woken && last_local + LOCAL_GAP_S < due)
                due = last_local + LOCAL_GAP_S;
            if (w->stop || mono_s() >= due)
                break;
            struct timespec ts = {.tv_sec = (time_t)due,
                                  .tv_nsec = (long)((due - (double)(time_t)due) * 1e9)};
            pthread_cond_timedwait(&w->cv, &w->mu, &ts);
        }
        int stop = w->stop;
        w->woken = 0;
        pthread_mutex_unlock(&w->mu);
        if (stop)
            break;
        int swept = mono_s() >= next;
        if (swept) {
            if (w->retention_s > 0)
                sweep_expired(w);
            char before[32];
            md_err err;
            iso_at(time(NULL) - REMOVED_KEEP_S, before);
            if (md_store_jobs_removed_prune(w->store, before, &err) != MD_OK)
                md_log(MD_LOG_DEBUG, "job retention: cannot prune removals: %s", err.msg);
            next = mono_s() + interval;
        }
        /* woken: only when a job was removed since the last look */
        char mark[64] = "";
        md_err err;
        int periodic = swept, changed = 1;
        if (md_store_jobs_removed_mark(w->store, mark, &err) == MD_OK) {
            changed = strcmp(mark, w->mark) != 0;
            snprintf(w->mark, sizeof w->mark, "%s", mark);
        }
        if (periodic || changed)
            sweep_local(w->store);
        last_local = mono_s();
    }
    return NULL;
}

md_job_janitor *md_job_janitor_start(md_store *store, const md_fetch_opts *fetch,
                                     int retention_s)
{
    md_job_janitor *w = md_xcalloc(1, sizeof *w);
    w->store = store;
    w->fetch = fetch;
    w->retention_s = retention_s > 0 ? retention_s : 0;
    pthread_mutex_init(&w->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&w->cv, &ca);
    pthread_condattr_destroy(&ca);
    if (pthread_create(&w->thread, NULL, janitor_main, w) != 0) {
        md_log(MD_LOG_ERROR, "job retention: cannot start its thread; no job is removed but "
                             "by DELETE /jobs/ID?purge=true");
        pthread_mutex_destroy(&w->mu);
        pthread_cond_destroy(&w->cv);
        free(w);
        return NULL;
    }
    return w;
}

void md_job_janitor_wake(md_job_janitor *w)
{
    if (!w)
        return;
    pthread_mutex_lock(&w->mu);
    w->woken = 1;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

void md_job_janitor_stop(md_job_janitor *w)
{
    if (!w)
        return;
    pthread_mutex_lock(&w->mu);
    w->stop = 1;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->thread, NULL);
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    free(w);
}
