/*
 * job_retention.c - removing ended jobs, and what the server wrote for them.
 *
 * DESIGN
 * A job's record and outputs are kept until it is removed: by its operator
 * (DELETE /jobs/ID?purge=true) or, with job_retention_s set, by the janitor
 * thread once the job ended that long ago. Removing a job is, in order:
 *   1. the claim (md_store_job_removal_claim), one transaction: the job
 *      has ended, no other replica is removing it (removing_until, a lease
 *      on the index's clock, so N replicas sweeping remove each job once);
 *      its chunk rows are deleted, so a runner still on one of its chunks
 *      (a job failed or cancelled elsewhere) finishes nothing and deletes
 *      the part it put, and the keys the finished chunks named are read;
 *   2. the server's own S3 objects of it (cluster mode, no output.path:
 *      s3://BUCKET/PREFIX/jobs/<id>/, its output and any part there; when
 *      S3 refuses the listing, the output and the named parts by key). A
 *      user's s3:// output.path is never removed, only the parts a failed
 *      sweep may have left beside it (<output>.chunks/<id>/);
 *   3. its row, recording its id in jobs_removed, in one transaction that
 *      NOTIFYs every replica;
 *   4. this replica's files of it: <store>/jobs/<id>.* (its output's copy,
 *      parts, an S3 image folder's copy). A local output.path is never in
 *      there (POST /jobs refuses one in the store) and never removed.
 * A failure at 2 or 3 gives the claim back and keeps the row (the next
 * sweep, or purge, tries again), so no object is left without a row naming
 * it; a crash between 3 and 4 leaves files that the start's full look
 * finds. Every replica's janitor removes its own copies of jobs any replica
 * removed: it reads jobs_removed from a watermark on the index's clock
 * (removed_at is stamped by the database, not the remover; with a margin
 * for removals committed out of order) when it hears the NOTIFY
 * (md_jobs_wake) and at each sweep, and at start checks every job id its
 * store holds files of. The janitor also deletes the S3 parts an ended
 * chunked job still has (its coordinator stopped between recording the
 * job and deleting them). Ids are forgotten after REMOVED_KEEP_S: a replica
 * down for longer keeps its copies of jobs removed meanwhile until they
 * are deleted by hand.
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
#define LOCAL_GAP_S 2.0                 /* the least time between two looks at removals */
#define SKEW_S 300                      /* removed_at read again this far back */
#define CLAIM_S 300.0                   /* a removal's hold on its job */
#define PRUNE_EVERY_S 3600.0

static atomic_llong jobs_removed_total, retention_sweeps;

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
 * folders) whose id is a key of `ids`, in one pass; the number removed. */
static int remove_local(md_store *store, json_t *ids)
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
        if (!entry_job_id(e->d_name, eid) || !json_object_get(ids, eid))
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

static int remove_local_one(md_store *store, const char *id)
{
    json_t *ids = json_pack("{s:b}", id, 1);
    int n = ids ? remove_local(store, ids) : 0;
    json_decref(ids);
    return n;
}

/* Delete the objects of `keys` (an array of keys) in the bucket of `url`
 * (s3://BUCKET/...), and `url` itself when `also_url`; the first failure. */
static md_status delete_keys(const char *url, int also_url, json_t *keys,
                             const md_fetch_opts *fetch, md_err *err)
{
    const char *b = url + 5, *slash = strchr(b, '/');
    if (strncmp(url, "s3://", 5) != 0 || !slash)
        return MD_OK;
    md_status st = MD_OK, one;
    md_err derr;
    if (also_url && (one = md_s3_data_delete(url, fetch, &derr)) != MD_OK && one != MD_ENOTFOUND) {
        *err = derr;
        st = one;
    }
    size_t i;
    json_t *k;
    json_array_foreach(keys, i, k)
    {
        char obj[1400];
        snprintf(obj, sizeof obj, "s3://%.*s/%s", (int)(slash - b), b, json_string_value(k));
        if ((one = md_s3_data_delete(obj, fetch, &derr)) != MD_OK && one != MD_ENOTFOUND &&
            st == MD_OK) {
            *err = derr;
            st = one;
        }
    }
    return st;
}

/* Step 2 of the DESIGN: the job's S3 objects the server owns. */
static md_status remove_objects(md_store *store, const md_fetch_opts *fetch, const char *id,
                                json_t *spec, json_t *part_keys, md_err *err)
{
    char out_url[1200], prefix[1400];
    if (!md_job_output_url(store, id, spec, out_url, sizeof out_url))
        return MD_OK; /* a local output only */
    int own = !json_string_value(json_object_get(json_object_get(spec, "output"), "path"));
    if (own) { /* the server's own folder of this job: output.EXT and its parts */
        char root[1200];
        if (!md_store_data_url(store, root, sizeof root))
            return MD_OK;
        snprintf(prefix, sizeof prefix, "%sjobs/%s/", root, id);
    } else { /* a user's output.path: only parts a failed sweep may have left */
        snprintf(prefix, sizeof prefix, "%s.chunks/%s/", out_url, id);
    }
    long long gone = 0;
    md_err derr;
    md_status st = md_s3_data_delete_prefix(prefix, fetch, &gone, &derr);
    if (st == MD_ENOTFOUND) /* no such bucket: nothing of it is there */
        return MD_OK;
    if (st == MD_EFORBIDDEN) {
        /* listing refused (no s3:ListBucket): the keys the job named */
        md_log(MD_LOG_WARN, "job %s: S3 refused to list %s (%s); deleting its output and the "
               "parts its chunks named by key (parts of attempts that never finished may "
               "remain: allow s3:ListBucket there)", id, prefix, derr.msg);
        st = delete_keys(out_url, own, part_keys, fetch, &derr);
    }
    if (st == MD_OK || !own) {
        if (st != MD_OK)
            md_log(MD_LOG_WARN, "job %s: deleting parts left under %s: %s", id, prefix, derr.msg);
        return MD_OK;
    }
    *err = derr;
    return st;
}

md_status md_job_remove(md_store *store, const md_fetch_opts *fetch, const char *id,
                        const char *why, md_err *err)
{
    json_t *job = NULL, *part_keys = NULL;
    md_status st = md_store_job_get(store, id, &job, err);
    if (st == MD_OK)
        st = md_store_job_removal_claim(store, id, CLAIM_S, &part_keys, err);
    if (st != MD_OK) {
        json_decref(job);
        return st;
    }
    int objects_gone = 0;
    st = remove_objects(store, fetch, id, json_object_get(job, "spec"), part_keys, err);
    json_decref(part_keys);
    if (st == MD_OK) {
        objects_gone = 1;
        st = md_store_job_delete(store, id, err);
    }
    if (st != MD_OK) {
        md_err rerr;
        md_store_job_removal_release(store, id, &rerr); /* else its hold runs out */
        if (objects_gone) {
            char msg[320];
            snprintf(msg, sizeof msg, "%.300s", err->msg);
            snprintf(err->msg, sizeof err->msg, "job %.63s: the output the server wrote is "
                     "deleted, its record is not (%s); remove it again", id, msg);
        }
        json_decref(job);
        return st;
    }
    json_decref(job);
    int files = remove_local_one(store, id);
    atomic_fetch_add(&jobs_removed_total, 1);
    md_log(MD_LOG_INFO, "job %s removed (%s); %d file(s) of it in this store", id, why, files);
    return MD_OK;
}

md_status md_job_drop_parts(md_store *store, const md_fetch_opts *fetch, const char *id,
                            json_t *spec, md_err *err)
{
    char out_url[1200], prefix[1400];
    if (!md_job_output_url(store, id, spec, out_url, sizeof out_url))
        return md_store_job_parts_dropped(store, id, err); /* no object, no part */
    json_t *chunks = NULL, *c;
    md_err derr;
    size_t i;
    md_status st = md_store_chunks_list(store, id, &chunks, err);
    if (st != MD_OK)
        return st;
    json_t *keys = json_array();
    json_array_foreach(chunks, i, c)
    {
        const char *key = json_string_value(json_object_get(c, "output_key"));
        if (key)
            json_array_append_new(keys, json_string(key));
    }
    json_decref(chunks);
    /* the named parts first: all that goes without the right to list */
    md_status named = delete_keys(out_url, 0, keys, fetch, &derr);
    json_decref(keys);
    snprintf(prefix, sizeof prefix, "%s.chunks/%s/", out_url, id);
    long long gone = 0;
    st = md_s3_data_delete_prefix(prefix, fetch, &gone, &derr);
    if (st == MD_EFORBIDDEN || st == MD_ENOTFOUND) {
        /* no listing (or no bucket): the named parts are what can go */
        if (st == MD_EFORBIDDEN)
            md_log(MD_LOG_WARN, "job %s: S3 refused to list %s (%s); its chunks' named parts "
                   "are deleted, parts of attempts that never finished may remain", id, prefix,
                   derr.msg);
        st = named;
    }
    if (st != MD_OK) {
        md_log(MD_LOG_WARN, "job %s: deleting its chunks' parts under %s: %s", id, prefix,
               derr.msg);
        *err = derr;
        return st;
    }
    return md_store_job_parts_dropped(store, id, err);
}

void md_jobs_write_removed_metrics(FILE *f)
{
    md_prom_family(f, "modeld_jobs_removed_total", "counter",
                   "Ended jobs this replica removed, with the outputs the server wrote for "
                   "them (job_retention_s, DELETE /jobs/ID?purge=true).");
    md_prom_sample(f, "modeld_jobs_removed_total", "", (double)atomic_load(&jobs_removed_total));
    md_prom_family(f, "modeld_job_retention_sweeps_total", "counter",
                   "Looks this replica took for jobs past job_retention_s.");
    md_prom_sample(f, "modeld_job_retention_sweeps_total", "",
                   (double)atomic_load(&retention_sweeps));
}

/* ---- the janitor thread ---- */

struct md_job_janitor {
    md_store *store;
    const md_fetch_opts *fetch;
    int retention_s;
    double lease_s;
    double sweep_every_s;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv; /* CLOCK_MONOTONIC */
    int stop, woken;
    /* removals seen: all ids with files here checked once (at start), then
     * jobs_removed read from `since`, `seen` the ids handled since then */
    int checked_all;
    char since[32];
    json_t *seen; /* id -> removed_at */
};

static void iso_at(time_t t, char out[32])
{
    struct tm tm;
    gmtime_r(&t, &tm);
    size_t n = strftime(out, 32, "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(out + n, 32 - n, ".000Z");
}

static int stopping(struct md_job_janitor *w)
{
    pthread_mutex_lock(&w->mu);
    int stop = w->stop;
    pthread_mutex_unlock(&w->mu);
    return stop;
}

/* Every job id this store holds files of, checked against jobs_removed:
 * once, at start (a crash between a removal's row and its files, or
 * removals made while this replica was down). 0 when the index failed. */
static int check_all_local(struct md_job_janitor *w)
{
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/jobs", md_store_dir(w->store));
    DIR *d = opendir(dir);
    if (!d)
        return 1;
    json_t *have = json_object(); /* the distinct ids, as a set */
    struct dirent *e;
    char id[64];
    while (have && (e = readdir(d)) != NULL && json_object_size(have) < LOCAL_IDS_MAX)
        if (entry_job_id(e->d_name, id))
            json_object_set_new(have, id, json_true());
    closedir(d);
    json_t *list = json_array();
    const char *key;
    json_t *v;
    json_object_foreach(have, key, v) json_array_append_new(list, json_string(key));
    json_decref(have);
    json_t *removed = NULL;
    md_err err;
    int ok = 1;
    if (json_array_size(list) &&
        md_store_jobs_removed_among(w->store, list, &removed, &err) != MD_OK) {
        md_log(MD_LOG_WARN, "job retention: cannot check this store's job files: %s", err.msg);
        ok = 0;
    }
    json_decref(list);
    json_t *ids = json_object();
    size_t i;
    json_array_foreach(removed, i, v) json_object_set(ids, json_string_value(v), json_true());
    json_decref(removed);
    int files = json_object_size(ids) ? remove_local(w->store, ids) : 0;
    if (files)
        md_log(MD_LOG_INFO, "%d file(s) of %zu removed job(s) taken from this store", files,
               json_object_size(ids));
    json_decref(ids);
    return ok;
}

/* The removals recorded since the last look (any replica's): this store's
 * files of them go. */
static void sweep_removed(struct md_job_janitor *w)
{
    if (!w->checked_all) {
        /* the watermark starts on the index's clock (removals are stamped
         * with it), read before the full look so nothing falls between */
        char t0[32];
        struct tm tm = {0};
        md_err err;
        if (md_store_db_now_iso(w->store, t0, &err) != MD_OK) {
            md_log(MD_LOG_DEBUG, "job retention: cannot read the index's clock: %s", err.msg);
            return;
        }
        if (!strptime(t0, "%Y-%m-%dT%H:%M:%S", &tm)) {
            md_log(MD_LOG_WARN, "job retention: the index's clock reads '%s'", t0);
            return;
        }
        if (!check_all_local(w))
            return;
        w->checked_all = 1;
        iso_at(timegm(&tm) - SKEW_S, w->since);
        return;
    }
    json_t *rows = NULL;
    md_err err;
    if (md_store_jobs_removed_since(w->store, w->since, 10000, &rows, &err) != MD_OK) {
        md_log(MD_LOG_DEBUG, "job retention: cannot read removals: %s", err.msg);
        return; /* `since` stays: read again at the next look */
    }
    json_t *fresh = json_object();
    size_t i;
    json_t *row;
    const char *newest = NULL;
    json_array_foreach(rows, i, row)
    {
        const char *id = json_string_value(json_array_get(row, 0));
        newest = json_string_value(json_array_get(row, 1));
        if (id && !json_object_get(w->seen, id))
            json_object_set_new(fresh, id, json_string(newest));
    }
    if (json_object_size(fresh)) {
        int files = remove_local(w->store, fresh);
        char some[200] = ""; /* the first few ids, for the log */
        size_t n = 0, listed = 0;
        const char *key;
        json_t *at;
        json_object_foreach(fresh, key, at)
        {
            if (n + strlen(key) + 2 >= sizeof some)
                break;
            n += (size_t)snprintf(some + n, sizeof some - n, "%s%s", n ? ", " : "", key);
            listed++;
        }
        if (files)
            md_log(MD_LOG_INFO, "%d file(s) of %zu job(s) removed elsewhere taken from this "
                   "store (%s%s)", files, json_object_size(fresh), some,
                   listed < json_object_size(fresh) ? ", ..." : "");
        json_object_update(w->seen, fresh);
    }
    json_decref(fresh);
    /* move `since` to the newest removal less the skew margin (never back;
     * to the newest itself when the page was full), and forget what lies
     * before it */
    if (newest && strlen(newest) >= 19) {
        struct tm tm = {0};
        char next[32];
        if (json_array_size(rows) == 10000)
            snprintf(next, sizeof next, "%s", newest);
        else if (strptime(newest, "%Y-%m-%dT%H:%M:%S", &tm))
            iso_at(timegm(&tm) - SKEW_S, next);
        else
            next[0] = '\0';
        if (strcmp(next, w->since) > 0)
            snprintf(w->since, sizeof w->since, "%s", next);
        const char *key;
        void *tmp;
        json_t *at;
        json_object_foreach_safe(w->seen, tmp, key, at)
        {
            if (strcmp(json_string_value(at), w->since) < 0)
                json_object_del(w->seen, key);
        }
    }
    json_decref(rows);
}

/* Remove the jobs that ended more than retention_s ago. */
static void sweep_expired(struct md_job_janitor *w)
{
    char before[32];
    iso_at(time(NULL) - w->retention_s, before);
    atomic_fetch_add(&retention_sweeps, 1);
    for (int round = 0; round < 100 && !stopping(w); round++) {
        json_t *ids = NULL;
        md_err err;
        if (md_store_jobs_ended_before(w->store, before, SWEEP_BATCH, &ids, &err) != MD_OK) {
            md_log(MD_LOG_WARN, "job retention: cannot list ended jobs: %s", err.msg);
            return;
        }
        size_t n = json_array_size(ids), removed = 0, i;
        json_t *v;
        json_array_foreach(ids, i, v)
        {
            if (stopping(w))
                break;
            md_status st = md_job_remove(w->store, w->fetch, json_string_value(v),
                                         "job_retention_s", &err);
            if (st == MD_OK)
                removed++;
            else if (strcmp(err.code, "job_not_found") && strcmp(err.code, "job_not_finished") &&
                     strcmp(err.code, "job_removing"))
                md_log(MD_LOG_WARN, "job retention: cannot remove job %s: %s",
                       json_string_value(v), err.msg);
            /* else another replica took it first */
        }
        json_decref(ids);
        if (n < SWEEP_BATCH || removed == 0) /* all done, or try again at the next sweep */
            return;
    }
}

/* The parts of ended chunked jobs left in S3: their coordinator stopped
 * between recording the job and deleting them (md_job_drop_parts). Each
 * replica looks, a few leases after the job ended; deleting is idempotent. */
static void sweep_parts_left(struct md_job_janitor *w)
{
    char before[32];
    iso_at(time(NULL) - (time_t)(4 * w->lease_s), before);
    json_t *rows = NULL;
    md_err err;
    if (md_store_jobs_parts_left(w->store, before, SWEEP_BATCH, &rows, &err) != MD_OK) {
        md_log(MD_LOG_DEBUG, "job retention: cannot list jobs with parts left: %s", err.msg);
        return;
    }
    size_t i;
    json_t *row;
    json_array_foreach(rows, i, row)
    {
        if (stopping(w))
            break;
        const char *id = json_string_value(json_array_get(row, 0));
        if (md_job_drop_parts(w->store, w->fetch, id, json_array_get(row, 1), &err) == MD_OK)
            md_log(MD_LOG_INFO, "job %s: the parts its coordinator left are deleted", id);
    }
    json_decref(rows);
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
    double next = 0; /* sweep at once: a restart finds what expired meanwhile */
    double last_look = -LOCAL_GAP_S, last_prune = -PRUNE_EVERY_S;
    for (;;) {
        pthread_mutex_lock(&w->mu);
        for (;;) {
            /* a wake (any NOTIFY: chunk plans and finishes too) reads the
             * removals at most once per LOCAL_GAP_S */
            double due = next;
            if (w->woken && last_look + LOCAL_GAP_S < due)
                due = last_look + LOCAL_GAP_S;
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
        if (mono_s() >= next) {
            sweep_parts_left(w);
            if (w->retention_s > 0)
                sweep_expired(w);
            if (mono_s() - last_prune >= PRUNE_EVERY_S) {
                char before[32];
                md_err err;
                iso_at(time(NULL) - REMOVED_KEEP_S, before);
                if (md_store_jobs_removed_prune(w->store, before, &err) == MD_OK)
                    last_prune = mono_s();
                else
                    md_log(MD_LOG_DEBUG, "job retention: cannot prune removals: %s", err.msg);
            }
            next = mono_s() + w->sweep_every_s;
        }
        sweep_removed(w);
        last_look = mono_s();
    }
    return NULL;
}

md_job_janitor *md_job_janitor_start(md_store *store, const md_fetch_opts *fetch,
                                     int retention_s, double lease_s)
{
    md_job_janitor *w = md_xcalloc(1, sizeof *w);
    w->store = store;
    w->fetch = fetch;
    w->lease_s = lease_s > 0 ? lease_s : 30;
    w->retention_s = retention_s > 0 ? retention_s : 0;
    w->sweep_every_s = SWEEP_MAX_S;
    if (w->retention_s > 0 && w->retention_s / 4 < SWEEP_MAX_S)
        w->sweep_every_s = w->retention_s / 4 > 1 ? w->retention_s / 4 : 1;
    /* for tests only: how often to sweep, so that a test can tell a sweep
     * from a wake, or see sweeps keep what is not expired */
    const char *every = getenv("MD_TEST_JOB_SWEEP_S");
    if (every && atof(every) > 0)
        w->sweep_every_s = atof(every);
    w->seen = json_object();
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
        json_decref(w->seen);
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
    json_decref(w->seen);
    free(w);
}
