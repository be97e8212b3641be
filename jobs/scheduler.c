/*
 * scheduler.c - batch-predict jobs over whole datasets, on the job workers of
 * the model version (predictor/batcher.c: their own pool, at the job_nice CPU
 * priority): the runners, leases and the chunk pipeline. What a job writes
 * (row formats, the NPY header, the per-run output file) is writers.c's.
 *
 * Over 800 lines on purpose: one job's run (run_job) is one sequence of
 * lease, input, pipeline, commit and output steps that all share the
 * runner's state; cutting it would pass that state around for nothing.
 *
 * DESIGN
 * A job streams its input through a reader in chunks of batch_size rows,
 * each chunk one forward, and keeps up to PIPELINE chunks (at most
 * PIPELINE_BYTES of input) queued on the model, so the workers never wait
 * for the reader or for a commit; it refills only when half of them are
 * done, so it wakes (and preempts a worker) once per half pipeline, not once
 * per chunk. Chunks are written strictly in input order
 * to <output>.partial; at most every COMMIT_INTERVAL_S (and at the end, on
 * cancel and on shutdown) the file is fdatasync'ed and then ONE SQLite
 * statement commits rows_done (input rows consumed, good and skipped),
 * output_bytes and the running accuracy counts, so the disk never stalls the
 * pipeline once per forward. Resume after a
 * crash: copy the first output_bytes of the partial file into this run's
 * own new file (see "the output file" in writers.c), reopen the input and
 * skip rows_done rows. Rows written after the last commit are cut off and
 * computed again, so every input row appears exactly once, in order. On
 * success the partial file is renamed to the output path. NPY output keeps
 * a fixed 128-byte header slot, filled in with the final shape at the end.
 *
 * Leases: a runner holds its job with a lease it renews; the pipeline renews
 * as chunks complete, and a keeper thread renews while the runner is inside
 * one long call (model load, input download, skipping committed rows), so a
 * live runner is never taken over. Each run writes a new inode (see "the
 * output file"), so one that lost its lease can never write into the file of
 * the runner that took over. Paths are opened under allowed_paths without
 * following symlinks, again at run time (this replica's settings).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "../config/md_metrics.h"
#include "filerange.h"
#include "jobs.h"
#include "s3_images.h"
#include "writers.h"

/* Chunks in flight: enough queued work to keep the workers busy through an
 * fdatasync + commit (tens of ms on slow disks), bounded by input bytes. */
#define PIPELINE 32
#define PIPELINE_BYTES (16L * 1024 * 1024)
#define COMMIT_INTERVAL_S 0.25

#define POLL_S 1.0 /* idle runners look for claimable jobs this often */

struct md_jobs {
    md_store *store;
    md_fetch_opts fetch;  /* allowed_s3 with the server's own jobs/ area added */
    md_strlist fetch_s3;  /* ... that list (md_job_fetch_opts) */
    md_model_resolver resolve;
    md_default_moved moved;
    void *resolve_ctx;
    pthread_mutex_t mu;
    pthread_cond_t cv;    /* kicks idle runners: a job was created here */
    char owner[160];      /* this process in jobs.owner: "host|pid|nonce" */
    char host[128];
    double lease_s;
    int chunk_delay_ms;   /* for tests only: pause after each committed chunk */
    int64_t image_max_files;     /* images inputs: entries listed at most */
    long long image_max_bytes;   /* images inputs: the largest file read */
    char (*running)[64];  /* id per runner, "" when idle */
    atomic_int *cancel;   /* per runner */
    atomic_int *lost;     /* per runner: another process holds its job now */
    _Atomic double *renewed; /* per runner: monotonic time of the last lease renewal
                              * (written by the runner and its lease keeper) */
    int n_runners;
    pthread_t *threads;
    atomic_int stopping;
    md_job_janitor *janitor; /* job_retention.c */
};

/* ---- one chunk in flight ---- */

typedef struct chunk {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done;
    md_status st;
    md_err err;
    float *out;
    int64_t out_shape[MD_MAX_DIMS];
    int out_ndim;
    int64_t rows;
    int64_t first_index;  /* dataset row index of its first row */
    int64_t end_position; /* reader position after its last row */
    int64_t *labels;
    int64_t *index;       /* dataset row index per row (skips leave gaps) */
    int64_t skipped_end;  /* rows skipped in the input up to its end */
} chunk;

static void chunk_cb(void *ctx, md_status st, const md_err *err, const float *out,
                     const int64_t *shape, int ndim)
{
    chunk *c = ctx;
    pthread_mutex_lock(&c->mu);
    c->st = st;
    if (err)
        c->err = *err;
    if (out) {
        size_t n = 1;
        for (int d = 0; d < ndim; d++)
            n *= (size_t)shape[d];
        c->out = malloc(n * sizeof(float) + 1);
        if (c->out)
            memcpy(c->out, out, n * sizeof(float));
        else
            c->st = md_err_set(&c->err, MD_ENOMEM, "out of memory for a job chunk");
        memcpy(c->out_shape, shape, sizeof(int64_t) * (size_t)ndim);
        c->out_ndim = ndim;
    }
    c->done = 1;
    pthread_cond_signal(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

static void chunk_wait(chunk *c)
{
    pthread_mutex_lock(&c->mu);
    while (!c->done)
        pthread_cond_wait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
}

static double mono(void);
static md_status jupdate(md_jobs *J, int slot, const char *id, json_t *f, md_err *err);

/* Wait for a chunk, renewing the job's lease meanwhile: job workers run at a
 * low priority and may wait for CPU far longer than a lease lasts. */
static void chunk_wait_renewing(md_jobs *J, int slot, const char *id, chunk *c)
{
    pthread_mutex_lock(&c->mu);
    while (!c->done) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        double t = (double)ts.tv_sec + (double)ts.tv_nsec / 1e9 + J->lease_s / 4;
        ts.tv_sec = (time_t)t;
        ts.tv_nsec = (long)((t - (double)ts.tv_sec) * 1e9);
        if (pthread_cond_timedwait(&c->cv, &c->mu, &ts) == ETIMEDOUT && !c->done &&
            !atomic_load(&J->lost[slot])) {
            pthread_mutex_unlock(&c->mu);
            jupdate(J, slot, id, NULL, NULL);
            pthread_mutex_lock(&c->mu);
        }
    }
    pthread_mutex_unlock(&c->mu);
}

static void chunk_reset(chunk *c)
{
    free(c->out);
    free(c->labels);
    free(c->index);
    c->out = NULL;
    c->labels = c->index = NULL;
    c->done = 0;
    c->rows = 0;
    md_err_clear(&c->err);
    c->st = MD_OK;
}

/* ---- helpers ---- */

static double mono(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Update the job while this process holds it, renewing the lease; notes a
 * cancel request from another replica, and a lost lease. */
static md_status jupdate(md_jobs *J, int slot, const char *id, json_t *f, md_err *err)
{
    md_err local;
    md_err_clear(&local);
    int cancel = 0;
    md_status st = md_store_job_update_owned(J->store, id, J->owner, J->lease_s, f, &cancel,
                                             err ? err : &local);
    if (st == MD_OK) {
        J->renewed[slot] = mono();
        if (cancel)
            atomic_store(&J->cancel[slot], 1);
    } else if (st == MD_ECONFLICT && !atomic_exchange(&J->lost[slot], 1)) {
        md_log(MD_LOG_WARN, "job %s: another process holds it now; this one stops without "
               "writing more", id);
    }
    return st;
}

/* `in` for one log line: control characters and non-ASCII bytes as \xNN
 * (md_err already writes a message's control characters so), so text from a
 * dataset or a URL can forge neither lines nor terminal escapes in the log.
 * `out` holds 4 * strlen(in) + 1 or is cut. */
static const char *log_escape(const char *in, char *out, size_t size)
{
    size_t n = 0;
    for (const unsigned char *p = (const unsigned char *)in; *p && n + 5 < size; p++) {
        if (*p < 0x20 || *p >= 0x7f)
            n += (size_t)snprintf(out + n, size - n, "\\x%02x", *p);
        else
            out[n++] = (char)*p;
    }
    out[n] = '\0';
    return out;
}

/* 1 when the job is failed by this process (it still held it). */
static int fail_job(md_jobs *J, int slot, const char *id, const md_err *err)
{
    if (atomic_load(&J->lost[slot]))
        return 0;
    char now[32];
    md_now_iso(now);
    json_t *f = json_pack("{s:s,s:s,s:s}", "status", "failed", "error", err->msg, "finished_at",
                          now);
    md_status st = jupdate(J, slot, id, f, NULL);
    json_decref(f);
    char shown[4 * MD_ERR_MSG_MAX + 1];
    md_log(MD_LOG_WARN, "job %s failed: %s", id, log_escape(err->msg, shown, sizeof shown));
    return st == MD_OK;
}

/* ---- the lease while nothing is written: downloads, model loads ---- */

/* A thread that renews the job's lease every lease/4 while the runner is
 * busy in one long call (an input download, a model load), so a replica
 * does not take the job over from a live runner. */
typedef struct keeper {
    md_jobs *J;
    int slot;
    const char *id;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int stop, started;
} keeper;

static void *keeper_main(void *arg)
{
    keeper *k = arg;
    pthread_mutex_lock(&k->mu);
    while (!k->stop) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        double t = (double)ts.tv_sec + (double)ts.tv_nsec / 1e9 + k->J->lease_s / 4;
        ts.tv_sec = (time_t)t;
        ts.tv_nsec = (long)((t - (double)ts.tv_sec) * 1e9);
        if (pthread_cond_timedwait(&k->cv, &k->mu, &ts) == ETIMEDOUT && !k->stop &&
            !atomic_load(&k->J->lost[k->slot])) {
            pthread_mutex_unlock(&k->mu);
            jupdate(k->J, k->slot, k->id, NULL, NULL);
            pthread_mutex_lock(&k->mu);
        }
    }
    pthread_mutex_unlock(&k->mu);
    return NULL;
}

static void keeper_start(keeper *k, md_jobs *J, int slot, const char *id)
{
    memset(k, 0, sizeof *k);
    k->J = J;
    k->slot = slot;
    k->id = id;
    pthread_mutex_init(&k->mu, NULL);
    pthread_cond_init(&k->cv, NULL);
    k->started = pthread_create(&k->thread, NULL, keeper_main, k) == 0;
    if (!k->started)
        md_log(MD_LOG_WARN, "job %s: cannot start its lease keeper; a long download may let "
               "another replica take the job over", id);
}

static void keeper_stop(keeper *k)
{
    if (!k->J)
        return;
    pthread_mutex_lock(&k->mu);
    k->stop = 1;
    pthread_cond_signal(&k->cv);
    pthread_mutex_unlock(&k->mu);
    if (k->started)
        pthread_join(k->thread, NULL);
    pthread_mutex_destroy(&k->mu);
    pthread_cond_destroy(&k->cv);
    k->J = NULL;
}

typedef struct slot_ref {
    md_jobs *J;
    int slot;
} slot_ref;

/* md_fetch_opts.keep_going: a download stops when the job is lost,
 * cancelled here, or the server stops. */
static int download_keep_going(void *ctx)
{
    slot_ref *r = ctx;
    return !atomic_load(&r->J->lost[r->slot]) && !atomic_load(&r->J->cancel[r->slot]) &&
           !atomic_load(&r->J->stopping);
}

/* ---- dataset errors ---- */

/* The reader names the file by its path's last component; given
 * /proc/self/fd/N it says "N": put the dataset's own name back. */
static void reader_err_name(md_err *err, int fd, const char *path)
{
    char fdname[16];
    int n = snprintf(fdname, sizeof fdname, "%d", fd);
    if (fd < 0 || strncmp(err->msg, fdname, (size_t)n) != 0 ||
        (err->msg[n] != ' ' && err->msg[n] != ':'))
        return;
    const char *slash = strrchr(path, '/');
    char msg[MD_ERR_MSG_MAX];
    snprintf(msg, sizeof msg, "%.200s%s", slash ? slash + 1 : path, err->msg + n);
    snprintf(err->msg, sizeof err->msg, "%s", msg);
}

/* A malformed row of a downloaded dataset: say where and what kind of
 * problem, never its bytes, which may be an internal service's answer. */
static void reader_err_from_url(md_err *err, const char *format)
{
    if (err->status != MD_EINVAL)
        return; /* read failures and truncation quote no data */
    /* the reason, as one of the reader's fixed phrases; never its inserts */
    static const char *const reasons[][2] = {
        {"is not a finite float32", "a value is not a finite float32 number"},
        {"NaN or infinite", "a value is NaN or infinite"},
        {"is not a number", "a value is not a number"},
        {"is not an integer", "the label is not an integer"},
        {"is empty", "a value is empty"},
        {"fields, the header has", "it has another number of fields than the header"},
        {"values, the first row has", "it has another number of values than the first row"},
        {"invalid JSON", "it is not valid JSON"},
        {"has no field", "a field asked for is missing"},
        {"quoted field", "a quoted field has text after its closing quote"},
        {"is longer than", "the row is too long"},
    };
    const char *reason = "it is malformed";
    for (size_t i = 0; i < sizeof reasons / sizeof reasons[0]; i++)
        if (strstr(err->msg, reasons[i][0])) {
            reason = reasons[i][1];
            break;
        }
    const char *row = strstr(err->msg, " row ");
    long long n = -1;
    if (row && sscanf(row, " row %lld", &n) == 1 && n >= 0)
        snprintf(err->msg, sizeof err->msg,
                 "input.url data row %lld (0-based, format %s): %s; its contents are not shown "
                 "for downloaded data: check that row of the file",
                 n, format, reason);
    else if (strstr(err->msg, " header"))
        snprintf(err->msg, sizeof err->msg,
                 "input.url data: the %s header is malformed or lacks the features or label "
                 "asked for; its contents are not shown for downloaded data",
                 format);
    else
        snprintf(err->msg, sizeof err->msg,
                 "input.url data is not a valid %s dataset with the features and label asked "
                 "for; its contents are not shown for downloaded data",
                 format);
}

/* For tests only (test_job_chunk_delay_ms): pause after a committed chunk,
 * so a test can kill, stop or cancel in the middle of a job however fast the
 * machine is. Ends early on stop and on a cancel made here. The runner is
 * alive meanwhile, so it keeps the job it runs (its lease renewed every
 * quarter lease, as its pipeline does): only a stopped or dead process's
 * job is taken over, however long the pause. (A chunk's own lease is not
 * renewed here: chunk runners are paced far below a lease, and renew it
 * after each pause.) */
static void test_pause(md_jobs *J, int slot)
{
    double end = mono() + (double)J->chunk_delay_ms / 1000.0, renewed = mono();
    pthread_mutex_lock(&J->mu);
    while (!atomic_load(&J->stopping) && !atomic_load(&J->cancel[slot])) {
        double left = end - mono();
        if (left <= 0)
            break;
        double step = left < J->lease_s / 4 ? left : J->lease_s / 4;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        double t = (double)ts.tv_sec + (double)ts.tv_nsec / 1e9 + step;
        ts.tv_sec = (time_t)t;
        ts.tv_nsec = (long)((t - (double)ts.tv_sec) * 1e9);
        pthread_cond_timedwait(&J->cv, &J->mu, &ts);
        /* by the time gone, not by timeouts: wakes for other runners (a
         * NOTIFY, a chunk given back) may come more often than that */
        if (mono() - renewed >= J->lease_s / 4 && mono() < end) {
            renewed = mono();
            char id[64];
            snprintf(id, sizeof id, "%s", J->running[slot]);
            pthread_mutex_unlock(&J->mu);
            if (id[0] && !atomic_load(&J->lost[slot]))
                jupdate(J, slot, id, NULL, NULL);
            pthread_mutex_lock(&J->mu);
        }
    }
    pthread_mutex_unlock(&J->mu);
}

/* ---- datasets in S3 ---- */

static int is_s3(const char *path) { return path && strncmp(path, "s3://", 5) == 0; }

/* What a run reads from S3: streams of an object (and of its IDX labels),
 * or a folder of images copied into <store>/jobs/<id>.images. */
typedef struct s3_input {
    md_s3_stream *data, *labels;
    int images_copied;
} s3_input;

/* A folder of images in S3 (input.path s3://BUCKET/PREFIX/): copied afresh
 * into <store>/jobs/<id>.images, which the reader then walks as any
 * directory, so the listing, its order and the label rules are the
 * directory walk's own. *in_fd is that directory. */
static md_status s3_images_open(md_jobs *J, const char *id, const char *url, slot_ref *sref,
                                s3_input *in, int *in_fd, md_err *err)
{
    char dir[4200], name[128];
    snprintf(dir, sizeof dir, "%s/jobs", md_store_dir(J->store));
    snprintf(name, sizeof name, "%s.images", id);
    int jobs_fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (jobs_fd < 0)
        return md_err_set(err, MD_EIO, "cannot open %s: %s", dir, strerror(errno));
    md_job_remove_tree(jobs_fd, name, 0); /* a copy an earlier run left half made */
    in->images_copied = 1;
    md_status st = MD_OK;
    if (mkdirat(jobs_fd, name, 0700) != 0)
        st = md_err_set(err, MD_EIO, "cannot make %s/%s: %s", dir, name, strerror(errno));
    int fd = st == MD_OK ? openat(jobs_fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
                         : -1;
    if (st == MD_OK && fd < 0)
        st = md_err_set(err, MD_EIO, "cannot open %s/%s: %s", dir, name, strerror(errno));
    int64_t files = 0;
    if (st == MD_OK)
        st = md_s3_fetch_folder(url, &J->fetch, fd, J->image_max_files, J->image_max_bytes,
                                download_keep_going, sref, &files, err);
    close(jobs_fd);
    if (st != MD_OK) {
        if (fd >= 0)
            close(fd);
        return st;
    }
    md_log(MD_LOG_INFO, "job %s: %lld objects of %s copied for the reader", id, (long long)files,
           url);
    *in_fd = fd;
    return MD_OK;
}

/* 1 (with `err` set) when an S3 stream of this run failed: its reader saw
 * an early EOF or a truncated file, not the object's end. */
static int s3_input_failed(s3_input *in, md_err *err)
{
    return (in->data && md_s3_stream_status(in->data, err) != MD_OK) ||
           (in->labels && md_s3_stream_status(in->labels, err) != MD_OK);
}

/* After the reader and the input descriptors are closed. */
static void s3_input_close(md_jobs *J, const char *id, s3_input *in)
{
    md_s3_stream_close(in->data);
    md_s3_stream_close(in->labels);
    if (in->images_copied) {
        char dir[4200], name[128];
        snprintf(dir, sizeof dir, "%s/jobs", md_store_dir(J->store));
        snprintf(name, sizeof name, "%s.images", id);
        int jobs_fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (jobs_fd >= 0) {
            md_job_remove_tree(jobs_fd, name, 0);
            close(jobs_fd);
        }
    }
    memset(in, 0, sizeof *in);
}

/* ---- one job over every replica: chunks (issue 26) ----
 *
 * DESIGN
 * With the PostgreSQL index, a job whose input and output are in S3 (so
 * every replica reads and writes the same bytes) runs in chunks; with no
 * output.path its output is the blob store's jobs/<id>/output.<ext>
 * (job_output.c), so such a job with an s3:// input is chunked too. The runner
 * that claims the job (its coordinator, under the job's own lease) plans it
 * once: chunks of whole batches, by rows for NPY and plain IDX (offsets from
 * the header), by the byte offsets one pass of the real reader finds for CSV
 * and JSON Lines (so a quoted newline never splits a row), by index for an
 * s3:// image folder (the listing, with each key's ETag, is in the plan and
 * a chunk downloads only its own images: s3_images.h), one chunk for a
 * gzip stream; the plan is recorded with the chunks in one transaction.
 * The plan pins the input: it records the object's ETag (and the IDX
 * labels'), and every chunk opens its streams with that ETag (refused at
 * the HEAD when it differs, If-Match on every Range GET). A replaced input
 * fails the job (input_changed) instead of mixing two versions in one
 * output; plans recorded before the pinning read unpinned.
 * Every runner of every replica then claims chunks (job_store.c: SKIP
 * LOCKED, leases on the database clock), reads its rows with Range GETs of
 * the header and the chunk's bytes, computes them, uploads its output as
 * <output>.chunks/<seq>-<attempt>, and finishes the chunk fenced by owner
 * and attempt, adding its counts to the job's in that transaction. A runner
 * that loses its lease (killed, paused past it) finishes nothing: the chunk
 * is claimed again, attempt + 1, and only that attempt's object is named
 * by the chunk's row. The coordinator also runs chunks; once all are done
 * it assembles the parts in order (CSV header once, the NPY header with the
 * final shape) into the store's copy, puts it in S3 and records accuracy
 * (and record_metric) once. A coordinator that dies is replaced through the
 * job's lease like any job runner, and goes on from the recorded chunks.
 * Cancel: runners see the flag when they renew and give their chunks back;
 * the coordinator then writes the longest contiguous prefix of done chunks
 * as the partial output.
 */

#define CHUNK_DEPTH 4          /* batches of one chunk in flight */
#define CHUNKS_TARGET 32       /* a plan aims at this many chunks at most */
#define CHUNK_MIN_BATCHES 16   /* ... when neither bound below is known */
#define CHUNK_MIN_BYTES (32LL << 20) /* a default chunk: this much input, or */
#define CHUNK_MIN_SECONDS 2.0        /* ... this much compute (chunk_min_rows) */
#define PLAN_PEEK_BYTES (1LL << 20)  /* what planning reads of an NPY or IDX input */

static atomic_llong chunks_claimed, chunks_finished, chunks_taken_over, chunks_refused,
    chunk_rows;

void md_jobs_write_chunk_metrics(FILE *f)
{
    md_prom_family(f, "modeld_job_chunks_claimed_total", "counter",
                   "Job chunks this replica claimed (issue 26: one job over every replica).");
    md_prom_sample(f, "modeld_job_chunks_claimed_total", "", (double)atomic_load(&chunks_claimed));
    md_prom_family(f, "modeld_job_chunks_finished_total", "counter",
                   "Job chunks this replica finished (its finish accepted).");
    md_prom_sample(f, "modeld_job_chunks_finished_total", "",
                   (double)atomic_load(&chunks_finished));
    md_prom_family(f, "modeld_job_chunks_taken_over_total", "counter",
                   "Job chunks this replica claimed after their holder's lease ran out.");
    md_prom_sample(f, "modeld_job_chunks_taken_over_total", "",
                   (double)atomic_load(&chunks_taken_over));
    md_prom_family(f, "modeld_job_chunks_refused_total", "counter",
                   "Job chunks this replica worked on but may not finish: another took them "
                   "over after the lease ran out (its renewal or finish was refused).");
    md_prom_sample(f, "modeld_job_chunks_refused_total", "", (double)atomic_load(&chunks_refused));
    md_prom_family(f, "modeld_job_chunk_rows_total", "counter",
                   "Input rows of finished job chunks this replica computed.");
    md_prom_sample(f, "modeld_job_chunk_rows_total", "", (double)atomic_load(&chunk_rows));
}

/* An input in S3 or a local file every replica sees, and an output in S3:
 * output.path, or in cluster mode the server's own object (job_output.c)
 * when there is none. */
static int chunkable(md_jobs *J, const char *id, json_t *spec)
{
    json_t *input = json_object_get(spec, "input");
    const char *path = json_string_value(json_object_get(input, "path"));
    const char *fmt = json_string_value(json_object_get(input, "format"));
    char out[1200];
    /* an input in S3 or a local file (not a URL: no ranges); an output in S3 */
    if (!path || !fmt || json_object_get(input, "url") ||
        !md_job_output_url(J->store, id, spec, out, sizeof out))
        return 0;
    if (!strcmp(fmt, "images"))
        return is_s3(path); /* an s3:// folder: split by index (s3_images.h) */
    return !strcmp(fmt, "npy") || !strcmp(fmt, "csv") || !strcmp(fmt, "jsonl") ||
           !strcmp(fmt, "idx");
}

/* The reader of a chunk's rows (or of the whole input, to plan): streams of
 * the header and [from, to) of the data (and of the labels file). */
typedef struct chunk_input {
    md_s3_stream *data, *labels;     /* an input in S3 */
    md_filerange *fdata, *flabels;   /* a local one (the same path on every replica) */
    int fd, label_fd;
    md_reader *r;
    /* images: the listing (planning: a new reference, for the plan) and
     * the directory under <store>/jobs holding this chunk's images */
    json_t *listing;
    int64_t files_skipped;
    char images_dir[160];
    md_jobs *J;
} chunk_input;

static void chunk_input_close(chunk_input *in)
{
    md_reader_close(in->r);
    json_decref(in->listing);
    if (in->images_dir[0]) {
        char dir[4200];
        snprintf(dir, sizeof dir, "%s/jobs", md_store_dir(in->J->store));
        int jobs_fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (jobs_fd >= 0) {
            md_job_remove_tree(jobs_fd, in->images_dir, 0);
            close(jobs_fd);
        }
    }
    if (in->fd >= 0)
        close(in->fd);
    if (in->label_fd >= 0)
        close(in->label_fd);
    md_s3_stream_close(in->data);
    md_s3_stream_close(in->labels);
    md_filerange_close(in->fdata);
    md_filerange_close(in->flabels);
    memset(in, 0, sizeof *in);
    in->fd = in->label_fd = -1;
}

/* 1 (its failure in `err`) when a stream of `in` failed: the reader then saw
 * a short file, which says nothing of the data. */
static int chunk_streams_failed(chunk_input *in, md_err *err)
{
    return (in->data && md_s3_stream_status(in->data, err) != MD_OK) ||
           (in->labels && md_s3_stream_status(in->labels, err) != MD_OK) ||
           (in->fdata && md_filerange_status(in->fdata, err) != MD_OK) ||
           (in->flabels && md_filerange_status(in->flabels, err) != MD_OK);
}

/* [0, head) and [from, to) of `path`: in S3, or a local file under
 * allowed_paths, which in cluster mode every replica must see at the same
 * path (a replica that does not fails the job naming the path). */
static md_status range_open(md_jobs *J, const char *path, const char *what, const char *etag,
                            long long head, long long from, long long to, int *fd,
                            md_s3_stream **s3, md_filerange **local, md_err *err)
{
    if (is_s3(path))
        return md_s3_stream_open_pinned(path, &J->fetch, what, etag, head, from, to, fd, s3,
                                        err);
    int src = -1;
    md_err oerr;
    md_status st = md_path_open_file(J->fetch.allowed_paths, what, path, "input_not_found", &src,
                                     &oerr);
    if (st != MD_OK) /* not this replica's to do: given back for one that sees it */
        return md_err_setc(err, MD_EUNAVAIL, "input_not_on_replica",
                           "%s %.200s cannot be read on this replica (%s: %s): in cluster mode a "
                           "local input must be at the same path, under allowed_paths, on every "
                           "replica (a shared volume), or in S3", what, path, J->host, oerr.msg);
    if ((st = md_filerange_open(src, head, from, to, fd, local, err)) != MD_OK)
        return st;
    if (etag && strcmp(etag, md_filerange_tag(*local)) != 0) /* size:mtime, as an ETag */
        return md_err_setc(err, MD_ECONFLICT, "input_changed",
                           "%s %.200s changed since the job was planned (size:mtime %s, now %s); "
                           "run the job again", what, path, etag, md_filerange_tag(*local));
    return MD_OK;
}

static int not_stopping(void *ctx) { return !atomic_load(&((md_jobs *)ctx)->stopping); }

/* A chunk downloading its images holds its lease meanwhile (a chunk of
 * thousands of images may take longer than one lease): renewed every
 * quarter lease; 0 (stop) once lost, cancelled or the server stops. */
typedef struct chunk_hold {
    md_jobs *J;
    const md_job_chunk *c;
    double renewed;
} chunk_hold;

static int chunk_keep_going(void *ctx)
{
    chunk_hold *h = ctx;
    if (atomic_load(&h->J->stopping))
        return 0;
    if (mono() - h->renewed > h->J->lease_s / 4) {
        int cancel = 0;
        md_err rerr;
        if (md_store_chunk_renew(h->J->store, h->c, h->J->owner, h->J->lease_s, &cancel, &rerr) !=
                MD_OK ||
            cancel)
            return 0;
        h->renewed = mono();
    }
    return 1;
}

/* An s3:// image folder (s3_images.h). plan NULL: list it (in->listing,
 * in->files_skipped) and open the reader over the listing, which reads no
 * image. Else download chunk c's images into a directory of its own and
 * open the reader over the plan's listing there, at the chunk's first row:
 * md_reader_position is then the row's number in the whole folder. */
static md_status chunk_images_open(md_jobs *J, json_t *input, json_t *plan, const md_job_chunk *c,
                                   md_model *m, chunk_input *in, md_err *err)
{
    const char *url = json_string_value(json_object_get(input, "path"));
    const md_image_opts *image = m ? md_model_image(m) : NULL;
    if (!image)
        return md_err_setc(err, MD_EUNPROC, "no_image_preprocess",
                           "this model version declares no preprocess.image, so it cannot read "
                           "images: deploy a version whose config has preprocess.image, e.g. "
                           "{\"mode\": \"RGB\"}");
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/jobs", md_store_dir(J->store));
    json_t *listing = NULL;
    md_status st = MD_OK;
    if (!plan) {
        st = md_job_s3_images_list(url, &J->fetch, J->image_max_files, J->image_max_bytes,
                                   not_stopping, J, &in->listing, &in->files_skipped, err);
        listing = in->listing;
    } else {
        listing = json_object_get(plan, "images");
        if (!json_is_object(listing))
            return md_err_set(err, MD_EINTERNAL, "job %s: its plan has no image listing",
                              c->job_id);
        int jobs_fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (jobs_fd < 0)
            return md_err_set(err, MD_EIO, "cannot open %s: %s", dir, strerror(errno));
        snprintf(in->images_dir, sizeof in->images_dir, "%s.c%lld-%lld.%ld.images", c->job_id,
                 (long long)c->seq, (long long)c->attempt, (long)getpid());
        md_job_remove_tree(jobs_fd, in->images_dir, 0);
        int fd = -1;
        if (mkdirat(jobs_fd, in->images_dir, 0700) != 0 ||
            (fd = openat(jobs_fd, in->images_dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW |
                         O_CLOEXEC)) < 0)
            st = md_err_set(err, MD_EIO, "cannot make %s/%s: %s", dir, in->images_dir,
                            strerror(errno));
        close(jobs_fd);
        chunk_hold hold = {J, c, mono()};
        if (st == MD_OK)
            st = md_job_s3_images_fetch(url, &J->fetch, listing, c->start_row, c->end_row, fd,
                                        chunk_keep_going, &hold, err);
        if (fd >= 0)
            close(fd);
        snprintf(dir + strlen(dir), sizeof dir - strlen(dir), "/%s", in->images_dir);
    }
    if (st != MD_OK)
        return st;
    md_reader_opts ro = {
        .path = dir, /* planning: any directory; the listing is what is read */
        .format = "images",
        .features = json_object_get(input, "features"),
        .image = image,
        .label_from = json_object_get(input, "label_from"),
        .class_names = md_model_labels(m),
        .max_files = J->image_max_files,
        .max_file_bytes = J->image_max_bytes,
        .image_list = json_object_get(listing, "paths"),
    };
    st = md_reader_open(&ro, &in->r, err);
    if (st == MD_OK && c)
        st = md_reader_skip_to(in->r, c->start_row, err);
    return st;
}

/* plan NULL: the whole input. */
static md_status chunk_input_open(md_jobs *J, json_t *input, json_t *plan, const md_job_chunk *c,
                                  md_model *m, chunk_input *in, md_err *err)
{
    memset(in, 0, sizeof *in);
    in->fd = in->label_fd = -1;
    in->J = J;
    const char *path = json_string_value(json_object_get(input, "path"));
    const char *label = json_string_value(json_object_get(input, "label"));
    const char *fmt = json_string_value(json_object_get(input, "format"));
    if (fmt && !strcmp(fmt, "images"))
        return chunk_images_open(J, input, plan, c, m, in, err);
    /* the ETags the plan recorded: every read of a chunk is of that object */
    const char *etag = json_string_value(json_object_get(plan, "etag"));
    const char *label_etag = json_string_value(json_object_get(plan, "label_etag"));
    long long head = 0, from = 0, to = -1, lhead = 0, lfrom = 0, lto = -1;
    if (plan && c) {
        long long data_off = json_integer_value(json_object_get(plan, "data_off"));
        long long row_bytes = json_integer_value(json_object_get(plan, "row_bytes"));
        if (json_is_true(json_object_get(plan, "fixed"))) {
            head = data_off;
            from = data_off + c->start_row * row_bytes;
            to = data_off + c->end_row * row_bytes;
            lhead = 8;
            lfrom = 8 + c->start_row;
            lto = 8 + c->end_row;
        } else if (c->start_byte >= 0) {
            head = json_integer_value(json_object_get(plan, "head_bytes"));
            from = c->start_byte;
            to = c->end_byte;
        }
    } else if (fmt && (!strcmp(fmt, "npy") || !strcmp(fmt, "idx"))) {
        /* planning rows of a fixed size: their header tells all (a gzip
         * IDX's too: one chunk, its rows from the header) */
        to = lto = PLAN_PEEK_BYTES;
    }
    md_status st = range_open(J, path, "input.path", etag, head, from, to, &in->fd, &in->data,
                              &in->fdata, err);
    if (st == MD_OK && label && !strcmp(fmt, "idx"))
        st = range_open(J, label, "input.label", label_etag, lhead, lfrom, lto, &in->label_fd,
                        &in->labels, &in->flabels, err);
    if (st != MD_OK)
        return st;
    char input_path[64], label_path[64];
    snprintf(input_path, sizeof input_path, "/proc/self/fd/%d", in->fd);
    snprintf(label_path, sizeof label_path, "/proc/self/fd/%d", in->label_fd);
    md_reader_opts ro = {
        .path = input_path,
        .format = fmt,
        .features = json_object_get(input, "features"),
        .label = label ? (!strcmp(fmt, "idx") ? label_path : label) : NULL,
        .class_names = m ? md_model_labels(m) : NULL,
        .max_files = J->image_max_files,
        .max_file_bytes = J->image_max_bytes,
    };
    st = md_reader_open(&ro, &in->r, err);
    if (st != MD_OK) /* a stream that failed cut the file short: its own failure, not the data's */
        st = chunk_streams_failed(in, err) ? err->status : st;
    return st;
}

/* The fewest rows a default chunk holds: enough that its fixed cost (a
 * claim, a few index round trips, a HEAD and Range GET of its input, the
 * PUT of its part, its GET and DELETE at assembly: some 10-20 round trips,
 * 0.1-0.3 s against a real S3) stays near a tenth of what the chunk does,
 * which is the lesser of
 *   - CHUNK_MIN_BYTES of input (moving them takes a few tenths of a second
 *     at S3's per-stream rate, whatever the model), and
 *   - CHUNK_MIN_SECONDS of the model's compute, from the time of one batch
 *     of zeros timed here (the fastest of three: the first ones warm up);
 * so a cheap model over narrow rows gets few, large chunks and a costly
 * one many. Whole batches, one at least. A plan that must not depend on
 * the machine's speed (a test) gives chunk_rows. */
static int64_t chunk_min_rows(md_jobs *J, md_model *m, int batch, int64_t width,
                              json_t *row_shape, int64_t bytes_per_row)
{
    int64_t by_bytes = bytes_per_row > 0 ? CHUNK_MIN_BYTES / bytes_per_row : INT64_MAX;
    int64_t by_time = INT64_MAX;
    size_t vals;
    if (m && width > 0 && !__builtin_mul_overflow((size_t)batch, (size_t)width, &vals) &&
        vals <= (1u << 26)) {
        double took = -1, best = -1;
        /* the fastest of three: TorchScript's executor profiles a graph's
         * first runs and optimises it after them */
        for (int run = 0; run < 3 && !atomic_load(&J->stopping); run++) {
            float *zeros = calloc(vals, sizeof(float)); /* the submit takes it */
            if (!zeros) {
                took = -1;
                break;
            }
            chunk c;
            memset(&c, 0, sizeof c);
            pthread_mutex_init(&c.mu, NULL);
            pthread_cond_init(&c.cv, NULL);
            md_tensor t = {.ndim = 2, .shape = {batch, width}, .data = zeros, .count = vals};
            if (json_array_size(row_shape) > 0 && json_array_size(row_shape) < MD_MAX_DIMS) {
                t.ndim = 1 + (int)json_array_size(row_shape);
                for (size_t i = 0; i < json_array_size(row_shape); i++)
                    t.shape[i + 1] = json_integer_value(json_array_get(row_shape, i));
            }
            md_err err;
            double t0 = mono();
            if (md_model_submit(m, &t, MD_PRIO_BATCH, chunk_cb, &c, &err) == MD_OK) {
                chunk_wait(&c);
                took = c.st == MD_OK ? mono() - t0 : -1;
            } else {
                took = -1;
            }
            chunk_reset(&c);
            pthread_mutex_destroy(&c.mu);
            pthread_cond_destroy(&c.cv);
            if (took < 0)
                break;
            if (best < 0 || took < best)
                best = took;
        }
        if (took > 0 && best > 0)
            by_time = (int64_t)(CHUNK_MIN_SECONDS / best + 1) * batch;
    }
    int64_t rows = by_bytes < by_time ? by_bytes : by_time;
    if (rows == INT64_MAX)
        rows = (int64_t)batch * CHUNK_MIN_BATCHES;
    rows = (rows + batch - 1) / batch * batch;
    return rows < batch ? batch : rows;
}

/* Plan the job: chunks of whole batches; one pass of the reader for the
 * text formats. */
static md_status chunk_plan(md_jobs *J, slot_ref *sref, const char *id, json_t *input, int batch,
                            int64_t chunk_rows_asked, md_model *m, md_err *err)
{
    chunk_input in;
    md_status st = chunk_input_open(J, input, NULL, NULL, m, &in, err);
    if (st != MD_OK) {
        chunk_input_close(&in);
        return st;
    }
    json_t *plan = json_object(), *chunks = json_array();
    int64_t data_off = 0, row_bytes = 0, label_off = -1, total = md_reader_total_rows(in.r);
    int fixed = md_reader_layout(in.r, &data_off, &row_bytes, &label_off);
    int text = md_reader_byte_offset(in.r) >= 0;
    int by_index = in.listing != NULL; /* an image listing splits by index */
    /* text: the byte offset before every batch-th row, found by the reader */
    int64_t *marks = NULL;
    size_t nmarks = 0, cap_marks = 0;
    if (text) {
        const char *fmt = json_string_value(json_object_get(input, "format"));
        /* JSON Lines reads row 0 at open: it starts at byte 0 */
        int64_t head = !strcmp(fmt, "csv") ? md_reader_byte_offset(in.r) : 0;
        json_object_set_new(plan, "head_bytes", json_integer(head));
        float *row = md_xmalloc(sizeof(float) * (size_t)(md_reader_row_width(in.r) > 0
                                                             ? md_reader_row_width(in.r)
                                                             : 1));
        int64_t start_of_next = head;
        for (int64_t n = 0;; n++) {
            if (n % batch == 0) {
                if (nmarks == cap_marks) {
                    cap_marks = cap_marks ? cap_marks * 2 : 1024;
                    int64_t *grown = realloc(marks, cap_marks * sizeof *marks);
                    if (!grown) {
                        st = md_err_set(err, MD_ENOMEM, "out of memory for a job's plan");
                        break;
                    }
                    marks = grown;
                }
                marks[nmarks++] = start_of_next;
            }
            int64_t label;
            md_status rs = md_reader_next(in.r, row, &label, err);
            if (rs == MD_ENOTFOUND)
                break;
            if (rs != MD_OK && rs != MD_EINVAL) {
                st = rs;
                break;
            }
            start_of_next = md_reader_byte_offset(in.r);
            if (n % 4096 == 0 && !download_keep_going(sref)) {
                st = md_err_set(err, MD_ECONFLICT, "the job stopped while it was planned");
                break;
            }
        }
        free(row);
        total = md_reader_position(in.r);
        if (st == MD_OK && chunk_streams_failed(&in, err))
            st = err->status;
        json_object_set_new(plan, "end_byte", json_integer(start_of_next));
    }
    if (st == MD_OK) {
        /* by default at most CHUNKS_TARGET chunks, and none smaller than
         * what is worth its fixed cost (chunk_min_rows) */
        int64_t per = chunk_rows_asked;
        if (per <= 0) {
            int64_t bytes_per_row = fixed ? row_bytes : 0;
            if (text && total > 0) {
                int64_t span = json_integer_value(json_object_get(plan, "end_byte")) -
                               json_integer_value(json_object_get(plan, "head_bytes"));
                bytes_per_row = span > 0 ? (span + total - 1) / total : 1;
            }
            per = chunk_min_rows(J, m, batch, md_reader_row_width(in.r),
                                 json_object_get(input, "shape"), bytes_per_row);
            if (per < (total + CHUNKS_TARGET - 1) / CHUNKS_TARGET)
                per = (total + CHUNKS_TARGET - 1) / CHUNKS_TARGET;
        }
        per = (per + batch - 1) / batch * batch; /* whole batches */
        if (per < batch)
            per = batch;
        if (!fixed && !text && !by_index)
            per = total > 0 ? total : 1; /* gzip: one chunk */
        int64_t end_byte = json_integer_value(json_object_get(plan, "end_byte"));
        for (int64_t a = 0; a < total || (a == 0 && total == 0); a += per) {
            int64_t b = a + per < total ? a + per : total;
            int64_t sb = -1, eb = -1;
            if (text) {
                sb = marks[a / batch];
                eb = (size_t)(b / batch) < nmarks && b < total ? marks[b / batch] : end_byte;
            }
            json_array_append_new(chunks, json_pack("[I,I,I,I]", (json_int_t)a, (json_int_t)b,
                                                    (json_int_t)sb, (json_int_t)eb));
            if (total == 0)
                break;
        }
        json_object_set_new(plan, "fixed", json_boolean(fixed));
        json_object_set_new(plan, "data_off", json_integer(data_off));
        json_object_set_new(plan, "row_bytes", json_integer(row_bytes));
        json_object_set_new(plan, "rows_total", json_integer(total));
        json_object_set_new(plan, "has_labels", json_boolean(md_reader_has_labels(in.r)));
        json_object_set_new(plan, "chunk_rows", json_integer(per));
        /* one chunk: its part is the whole output, and the output a copy of it */
        json_object_set_new(plan, "whole_part", json_boolean(json_array_size(chunks) == 1));
        /* the input pinned: every chunk reads these versions or fails */
        if (in.data)
            json_object_set_new(plan, "etag", json_string(md_s3_stream_etag(in.data)));
        if (in.labels)
            json_object_set_new(plan, "label_etag", json_string(md_s3_stream_etag(in.labels)));
        if (in.fdata)
            json_object_set_new(plan, "etag", json_string(md_filerange_tag(in.fdata)));
        if (in.flabels)
            json_object_set_new(plan, "label_etag", json_string(md_filerange_tag(in.flabels)));
        if (by_index) {
            json_object_set(plan, "images", in.listing);
            json_object_set_new(plan, "files_skipped", json_integer(in.files_skipped));
        }
        int planned = 0;
        st = md_store_chunks_plan(J->store, id, J->owner, chunks, plan, &planned, err);
        if (st == MD_OK)
            md_log(MD_LOG_INFO, "job %s: planned %zu chunks of %lld rows (%lld rows)", id,
                   json_array_size(chunks), (long long)per, (long long)total);
    }
    free(marks);
    json_decref(plan);
    json_decref(chunks);
    chunk_input_close(&in);
    return st;
}

/* <output key>.chunks/<job id>/<seq>-<attempt>: beside the output, so
 * under the same allowed_s3 entry, and the job's own (two jobs naming one
 * output never share a part; the later one's output is refused). */
static void chunk_object_url(const char *out_url, const md_job_chunk *c, char *url, size_t size)
{
    snprintf(url, size, "%s.chunks/%s/%06lld-%lld", out_url, c->job_id, (long long)c->seq,
             (long long)c->attempt);
}

/* Where a coordinator keeps its own chunks' parts until the assembly:
 * <store>/jobs/<job id>.part-<seq>-<attempt> (the part object's name). */
static void local_part_path(md_jobs *J, const char *job_id, const char *part_key, char *path,
                            size_t size)
{
    const char *base = strrchr(part_key, '/');
    snprintf(path, size, "%s/jobs/%s.part-%s", md_store_dir(J->store), job_id,
             base ? base + 1 : part_key);
}

/* Remove every part a coordinator kept of job `id` (local_part_path). */
static void drop_local_parts(md_jobs *J, const char *id)
{
    char dir[4200], prefix[96];
    snprintf(dir, sizeof dir, "%s/jobs", md_store_dir(J->store));
    snprintf(prefix, sizeof prefix, "%s.part-", id);
    DIR *d = opendir(dir);
    if (!d)
        return;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (strncmp(e->d_name, prefix, strlen(prefix)) == 0)
            unlinkat(dirfd(d), e->d_name, 0);
    closedir(d);
}

/* Sleep `ms` (a back-off), ended early only when the server stops: the
 * wakes of idle runners (a NOTIFY, a chunk given back) do not end it. */
static void test_pause_ms(md_jobs *J, long ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    long long ns = (long long)ts.tv_nsec + ms * 1000000LL;
    ts.tv_sec += (time_t)(ns / 1000000000LL);
    ts.tv_nsec = (long)(ns % 1000000000LL);
    pthread_mutex_lock(&J->mu);
    while (!atomic_load(&J->stopping) &&
           pthread_cond_timedwait(&J->cv, &J->mu, &ts) != ETIMEDOUT) {
    }
    pthread_mutex_unlock(&J->mu);
}

/* For tests only (MD_TEST_CHUNK_FINISH_HOLD=DIR): a computed chunk past its
 * last renewal waits while DIR/SEQ exists, its lease kept meanwhile (a
 * slow part upload's, without the cancel it would learn of). */
static void test_chunk_hold(md_jobs *J, const md_job_chunk *c, const char *dir)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/%lld", dir, (long long)c->seq);
    if (access(path, F_OK) != 0)
        return;
    md_log(MD_LOG_INFO, "job %s chunk %lld: test hold before putting its part", c->job_id,
           (long long)c->seq);
    double renewed = mono();
    while (!atomic_load(&J->stopping) && access(path, F_OK) == 0) {
        if (mono() - renewed > J->lease_s / 4) {
            int cancel = 0;
            md_err rerr;
            md_store_chunk_renew(J->store, c, J->owner, J->lease_s, &cancel, &rerr);
            renewed = mono();
        }
        test_pause_ms(J, 20);
    }
}

static size_t chunk_output_head(json_t *spec, int has_labels, char head[MD_JOB_NPY_HEADER + 1]);

/* Run one claimed chunk to its fenced finish. MD_OK: finished; other
 * statuses: given back (or lost), with the reason in `err`. A failure of
 * the data itself (a bad row, the model) fails the job. */
static md_status run_chunk(md_jobs *J, int slot, const md_job_chunk *c, md_err *err)
{
    json_t *job = NULL, *plan = NULL;
    md_model *m = NULL;
    chunk_input in = {.fd = -1, .label_fd = -1};
    int fd = -1, lost = 0, data_failed = 0;
    char tmp[4400] = "", obj_url[2200] = "";
    char *text = NULL;
    size_t text_cap = 0;
    int64_t *conf = NULL, classes = 0;
    md_job_chunk_counts n = {0};
    chunk ring[CHUNK_DEPTH];
    memset(ring, 0, sizeof ring);
    for (int i = 0; i < CHUNK_DEPTH; i++) {
        pthread_mutex_init(&ring[i].mu, NULL);
        pthread_cond_init(&ring[i].cv, NULL);
    }
    int head = 0, inflight = 0, eof = 0;
    double t_start = mono();
    atomic_fetch_add(&chunks_claimed, 1);
    if (c->taken_over)
        atomic_fetch_add(&chunks_taken_over, 1);
    md_status st = md_store_job_get(J->store, c->job_id, &job, err);
    if (st == MD_OK)
        st = md_store_chunk_plan_get(J->store, c->job_id, &plan, err);
    if (st == MD_OK && !plan)
        st = md_err_set(err, MD_EINTERNAL, "job %s has chunks but no plan", c->job_id);
    if (st != MD_OK)
        goto out;
    json_t *spec = json_object_get(job, "spec");
    json_t *input = json_object_get(spec, "input"), *output = json_object_get(spec, "output");
    char out_url[1200]; /* output.path, or the server's own object (job_output.c) */
    md_job_output_url(J->store, c->job_id, spec, out_url, sizeof out_url);
    const char *model_name = json_string_value(json_object_get(job, "model"));
    int version = (int)json_integer_value(json_object_get(job, "version"));
    int batch = (int)json_integer_value(json_object_get(spec, "batch_size"));
    int skip_bad = json_is_string(json_object_get(spec, "on_error")) &&
                   !strcmp(json_string_value(json_object_get(spec, "on_error")), "skip");
    m = J->resolve(J->resolve_ctx, model_name, version, err);
    if (!m) {
        st = err->status ? err->status : MD_EUNAVAIL;
        goto out;
    }
    if (batch <= 0)
        batch = md_model_max_batch(m);
    if ((st = chunk_input_open(J, input, plan, c, m, &in, err)) != MD_OK) {
        /* the data (missing, malformed, changed since the plan), not S3 being away */
        data_failed = st == MD_EINVAL || st == MD_ENOTFOUND || st == MD_ECONFLICT;
        goto out;
    }
    int64_t width = md_reader_row_width(in.r);
    int has_labels = md_reader_has_labels(in.r);
    int64_t rows_wanted = c->end_row - c->start_row;
    md_job_outfmt o = {0};
    const char *ofmt = json_string_value(json_object_get(output, "format"));
    o.kind = !ofmt || !strcmp(ofmt, "jsonl") ? 0 : !strcmp(ofmt, "csv") ? 1 : 2;
    json_t *include = json_object_get(output, "include");
    o.inc_index = md_job_include_has(include, "index", 1);
    o.inc_pred = md_job_include_has(include, "prediction", 1);
    o.inc_label = md_job_include_has(include, "label", has_labels);
    o.inc_scores = md_job_include_has(include, "scores", 0);
    o.top_k = (int)json_integer_value(json_object_get(spec, "top_k"));
    json_t *row_shape = json_object_get(input, "shape");
    /* images: the reader stands at the chunk's first row of the whole
     * listing, so its position is the row's number; others start at 0 */
    int images = in.images_dir[0] != '\0';
    int64_t index_base = images ? 0 : c->start_row;
    o.inc_path = images && md_job_include_has(include, "path", 1);

    snprintf(tmp, sizeof tmp, "%s/jobs/%s.c%lld-%lld.%ld.part", md_store_dir(J->store), c->job_id,
             (long long)c->seq, (long long)c->attempt, (long)getpid());
    fd = open(tmp, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) {
        st = md_err_set(err, MD_EIO, "cannot create %s: %s", tmp, strerror(errno));
        goto out;
    }
    /* the job's only chunk: its part is the whole output file, header first
     * (an NPY one rewritten with the final shape at the end) */
    int whole = json_is_true(json_object_get(plan, "whole_part"));
    int64_t out_width = 0;
    if (whole) {
        char head[MD_JOB_NPY_HEADER + 1];
        size_t hl = chunk_output_head(spec, json_is_true(json_object_get(plan, "has_labels")),
                                      head);
        if (hl && md_job_write_all(fd, head, hl) != 0) {
            st = md_err_set(err, MD_EIO, "writing %s failed: %s", tmp, strerror(errno));
            goto out;
        }
    }
    double renewed = mono();
    int64_t read_rows = 0; /* rows consumed of this chunk, good and bad */
    for (;;) {
        while (!eof && inflight < CHUNK_DEPTH && read_rows < rows_wanted) {
            chunk *b = &ring[(head + inflight) % CHUNK_DEPTH];
            chunk_reset(b);
            size_t vals;
            if (__builtin_mul_overflow((size_t)batch, (size_t)width, &vals) || vals > (1u << 30)) {
                st = md_err_setc(err, MD_ETOOBIG, "invalid_job", "a batch of %d rows of %lld "
                                 "values is too large; lower batch_size", batch, (long long)width);
                data_failed = 1;
                goto out;
            }
            float *buf = md_malloc_checked(vals * sizeof(float), "a job batch", err);
            if (!buf) {
                st = MD_ENOMEM;
                goto out;
            }
            b->labels = md_xmalloc(sizeof(int64_t) * (size_t)batch);
            b->index = md_xmalloc(sizeof(int64_t) * (size_t)batch);
            while (b->rows < batch && read_rows < rows_wanted) {
                int64_t pos = md_reader_position(in.r);
                st = md_reader_next(in.r, buf + b->rows * width, &b->labels[b->rows], err);
                if (st == MD_ENOTFOUND) {
                    eof = 1;
                    st = MD_OK;
                    break;
                }
                read_rows++;
                if (st == MD_EINVAL && skip_bad) {
                    n.skipped++;
                    st = MD_OK;
                    continue;
                }
                if (st != MD_OK) {
                    free(buf);
                    if (chunk_streams_failed(&in, err))
                        /* S3 away: the chunk is given back; the input
                         * changed since the plan: no attempt can do it */
                        data_failed = (st = err->status) == MD_ECONFLICT;
                    else /* the bytes came whole and do not hold the planned rows */
                        data_failed = st != MD_ENOMEM;
                    goto out;
                }
                /* the dataset's row number: the chunk's first plus the row within it */
                b->index[b->rows++] = index_base + pos;
            }
            if (b->rows == 0) {
                free(buf);
                break;
            }
            md_tensor t = {.ndim = 2, .shape = {b->rows, width}, .data = buf,
                           .count = (size_t)(b->rows * width)};
            if (json_array_size(row_shape) > 0) {
                t.ndim = 1 + (int)json_array_size(row_shape);
                for (size_t i = 0; i < json_array_size(row_shape); i++)
                    t.shape[i + 1] = json_integer_value(json_array_get(row_shape, i));
            }
            if ((st = md_model_submit(m, &t, MD_PRIO_BATCH, chunk_cb, b, err)) != MD_OK)
                goto out;
            inflight++;
        }
        if (inflight == 0)
            break;
        chunk *b = &ring[head];
        chunk_wait(b);
        head = (head + 1) % CHUNK_DEPTH;
        inflight--;
        if (b->st != MD_OK) {
            *err = b->err;
            st = b->st;
            data_failed = 1;
            goto out;
        }
        int64_t ow = 1;
        for (int d = 1; d < b->out_ndim; d++)
            ow *= b->out_shape[d];
        out_width = ow;
        md_classes cls = md_model_classes(m, ow);
        int scored = has_labels && (cls.kind == MD_CLASSES_ARGMAX || cls.kind == MD_CLASSES_BINARY);
        if (scored && !conf && cls.classes > 1 && cls.classes <= 1000) {
            classes = cls.classes;
            conf = md_xcalloc((size_t)(classes * classes), sizeof(int64_t));
        }
        size_t len = 0;
        if (o.kind == 2) {
            len = (size_t)(b->rows * ow) * sizeof(float);
            if (md_job_write_all(fd, (const char *)b->out, len) != 0) {
                st = md_err_set(err, MD_EIO, "writing %s failed: %s", tmp, strerror(errno));
                goto out;
            }
        }
        for (int64_t i = 0; i < b->rows; i++) {
            const float *y = b->out + i * ow;
            if (scored) {
                int64_t top = md_classes_top(&cls, y);
                n.labeled++;
                n.correct += top == b->labels[i];
                if (conf && b->labels[i] >= 0 && b->labels[i] < classes && top >= 0 &&
                    top < classes)
                    conf[b->labels[i] * classes + top]++;
            }
            if (o.kind != 2)
                md_job_format_row(&text, &len, &text_cap, &o, m, b->index[i],
                                  md_reader_row_name(in.r, b->index[i]), y, &cls, has_labels,
                                  b->labels[i], NULL);
        }
        if (o.kind != 2 && md_job_write_all(fd, text, len) != 0) {
            st = md_err_set(err, MD_EIO, "writing %s failed: %s", tmp, strerror(errno));
            goto out;
        }
        n.output_bytes += (long long)len;
        n.rows += b->rows;
        if (J->chunk_delay_ms > 0)
            test_pause(J, slot); /* a test acts in the middle of a chunk */
        if (atomic_load(&J->stopping)) {
            st = md_err_set(err, MD_EUNAVAIL, "the server is stopping");
            goto out;
        }
        if (mono() - renewed > J->lease_s / 4 || J->chunk_delay_ms > 0) {
            int cancel = 0;
            if ((st = md_store_chunk_renew(J->store, c, J->owner, J->lease_s, &cancel, err)) !=
                MD_OK) {
                lost = st == MD_ECONFLICT;
                goto out;
            }
            renewed = mono();
            if (cancel) {
                st = md_err_set(err, MD_ECONFLICT, "job %s was cancelled or has ended", c->job_id);
                goto out;
            }
        }
    }
    /* every row of the chunk, and the data behind them whole */
    if (chunk_streams_failed(&in, err)) { /* (images: no stream, each file whole) */
        data_failed = (st = err->status) == MD_ECONFLICT; /* changed since the plan */
        goto out;
    }
    if (whole && o.kind == 2) { /* the rows written (skipped ones write none) */
        int64_t shape[2] = {n.rows, out_width};
        char h[MD_JOB_NPY_HEADER];
        md_job_npy_header(h, n.rows, shape, n.rows > 0 ? 2 : 1);
        if (pwrite(fd, h, MD_JOB_NPY_HEADER, 0) != MD_JOB_NPY_HEADER) {
            st = md_err_set(err, MD_EIO, "writing %s failed: %s", tmp, strerror(errno));
            goto out;
        }
    }
    /* rows_done counts good and bad rows, as the single runner's does */
    n.rows += n.skipped;
    if (n.rows != rows_wanted) {
        st = md_err_set(err, MD_EIO, "chunk %lld of job %s holds %lld rows, its plan %lld: the "
                        "input changed since the job was planned", (long long)c->seq, c->job_id,
                        (long long)n.rows, (long long)rows_wanted);
        data_failed = 1;
        goto out;
    }
    char *conf_text = NULL;
    if (conf) {
        json_t *cm = json_array();
        for (int64_t a = 0; a < classes; a++) {
            json_t *line = json_array();
            for (int64_t b2 = 0; b2 < classes; b2++)
                json_array_append_new(line, json_integer(conf[a * classes + b2]));
            json_array_append_new(cm, line);
        }
        conf_text = json_dumps(cm, JSON_COMPACT);
        json_decref(cm);
    }
    n.confusion = conf_text;
    /* fence early: a runner that lost the chunk uploads nothing */
    int cancel_now = 0;
    if ((st = md_store_chunk_renew(J->store, c, J->owner, J->lease_s, &cancel_now, err)) != MD_OK ||
        cancel_now) {
        lost = st == MD_ECONFLICT;
        if (cancel_now)
            st = md_err_set(err, MD_ECONFLICT, "job %s was cancelled or has ended", c->job_id);
        free(conf_text);
        goto out;
    }
    if (getenv("MD_TEST_CHUNK_FINISH_HOLD"))
        test_chunk_hold(J, c, getenv("MD_TEST_CHUNK_FINISH_HOLD"));
    /* no fsync: the part is durable once S3 has it, and only then named */
    chunk_object_url(out_url, c, obj_url, sizeof obj_url);
    double t_put = mono();
    st = md_s3_data_put_new(obj_url, &J->fetch, tmp, err); /* its name is this attempt's */
    double t_finish = mono();
    int all_done = 0;
    if (st == MD_OK) {
        const char *key = obj_url + 5 + strcspn(obj_url + 5, "/") + 1;
        st = md_store_chunk_finish(J->store, c, J->owner, &n, key, &all_done, err);
        if (st == MD_ECONFLICT) {
            lost = 1;
            md_err derr;
            md_s3_data_delete(obj_url, &J->fetch, &derr); /* nobody names it */
        }
    }
    free(conf_text);
    if (st == MD_OK && !strcmp(J->running[slot], c->job_id)) {
        /* the coordinator's own chunk: its part kept on disk too, so the
         * assembly (here) reads it back from this disk, not from S3 */
        char keep[4400];
        local_part_path(J, c->job_id, obj_url, keep, sizeof keep);
        if (rename(tmp, keep) == 0)
            tmp[0] = '\0';
    }
    if (st == MD_OK) {
        md_log(MD_LOG_DEBUG, "job %s chunk %lld: %lld rows; %.3f s reading and computing, "
               "%.3f s putting its part, %.3f s finishing", c->job_id, (long long)c->seq,
               (long long)n.rows, t_put - t_start, t_finish - t_put, mono() - t_finish);
        atomic_fetch_add(&chunks_finished, 1);
        atomic_fetch_add(&chunk_rows, n.rows - n.skipped);
        pthread_mutex_lock(&J->mu);
        pthread_cond_broadcast(&J->cv); /* a coordinator waiting here may assemble */
        pthread_mutex_unlock(&J->mu);
    }
out:
    while (inflight > 0) {
        chunk_wait(&ring[head]);
        head = (head + 1) % CHUNK_DEPTH;
        inflight--;
    }
    for (int i = 0; i < CHUNK_DEPTH; i++) {
        chunk_reset(&ring[i]);
        pthread_mutex_destroy(&ring[i].mu);
        pthread_cond_destroy(&ring[i].cv);
    }
    if (fd >= 0)
        close(fd);
    if (tmp[0])
        unlink(tmp);
    chunk_input_close(&in);
    if (st != MD_OK && !lost && !strcmp(err->code, "input_changed"))
        data_failed = 1; /* the input was replaced since the plan: never mixed, the job fails */
    if (st != MD_OK && !lost && !strcmp(err->code, "input_not_on_replica") &&
        !strcmp(J->running[slot], c->job_id))
        data_failed = 1; /* the replica that planned it cannot read it now: nobody will */
    if (st != MD_OK && lost) {
        atomic_fetch_add(&chunks_refused, 1);
        md_log(MD_LOG_WARN, "job %s chunk %lld (attempt %lld): %s", c->job_id, (long long)c->seq,
               (long long)c->attempt, err->msg);
    } else if (st != MD_OK && data_failed) {
        /* the data or the model: the job fails, whoever coordinates it */
        char now[32];
        md_now_iso(now);
        json_t *f = json_pack("{s:s,s:s,s:s}", "status", "failed", "error", err->msg,
                              "finished_at", now);
        md_err uerr;
        md_store_job_update(J->store, c->job_id, f, &uerr);
        json_decref(f);
        md_store_chunk_release(J->store, c, J->owner, &uerr);
        md_log(MD_LOG_WARN, "job %s failed in chunk %lld: %s", c->job_id, (long long)c->seq,
               err->msg);
    } else if (st != MD_OK) {
        md_err rerr;
        /* another may try at once; or another took it over while this one
         * was stopped (an S3 read timed out on resuming): refused, like a
         * renewal that learns it */
        md_status rst = md_store_chunk_release(J->store, c, J->owner, &rerr);
        if (rst == MD_ECONFLICT) {
            atomic_fetch_add(&chunks_refused, 1);
            md_log(MD_LOG_WARN, "job %s chunk %lld (attempt %lld): %s; %s", c->job_id,
                   (long long)c->seq, (long long)c->attempt, err->msg, rerr.msg);
        } else if (rst != MD_OK)
            md_log(MD_LOG_WARN, "job %s chunk %lld: %s; not given back (%s): it is taken over "
                   "once its lease runs out", c->job_id, (long long)c->seq, err->msg, rerr.msg);
        else
            md_log(MD_LOG_WARN, "job %s chunk %lld given back: %s", c->job_id, (long long)c->seq,
                   err->msg);
        if (!atomic_load(&J->stopping))
            test_pause_ms(J, 200); /* S3 or the index away: not a busy loop */
    }
    free(text);
    free(conf);
    md_model_release(m);
    json_decref(plan);
    json_decref(job);
    return st;
}

/* The start of a chunked job's output file (an NPY header for 0 rows,
 * rewritten with the final shape at the end; a CSV header line; nothing for
 * JSON Lines) in `head` (MD_JOB_NPY_HEADER + 1 bytes); its length. */
static size_t chunk_output_head(json_t *spec, int has_labels, char head[MD_JOB_NPY_HEADER + 1])
{
    json_t *output = json_object_get(spec, "output");
    const char *ofmt = json_string_value(json_object_get(output, "format"));
    const char *ifmt = json_string_value(json_object_get(json_object_get(spec, "input"), "format"));
    head[0] = '\0';
    if (ofmt && !strcmp(ofmt, "npy")) {
        int64_t s1[1] = {0};
        md_job_npy_header(head, 0, s1, 1);
        return MD_JOB_NPY_HEADER;
    }
    if (!ofmt || strcmp(ofmt, "csv") != 0)
        return 0;
    json_t *include = json_object_get(output, "include");
    int images = ifmt && !strcmp(ifmt, "images");
    const char *names[] = {"index", "path", "prediction", "label", "scores"};
    int on[] = {md_job_include_has(include, "index", 1),
                images && md_job_include_has(include, "path", 1),
                md_job_include_has(include, "prediction", 1),
                md_job_include_has(include, "label", has_labels),
                md_job_include_has(include, "scores", 0)};
    int first = 1;
    for (int i = 0; i < 5; i++)
        if (on[i]) {
            strcat(head, first ? "" : ",");
            strcat(head, names[i]);
            first = 0;
        }
    strcat(head, "\n");
    return strlen(head);
}

/* Append what is left of `in` to `out`. */
static md_status append_fd(int in, int out, md_err *err)
{
    char buf[65536];
    for (;;) {
        ssize_t r = read(in, buf, sizeof buf);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return md_err_set(err, MD_EIO, "reading a chunk's output failed: %s",
                              strerror(errno));
        if (r == 0)
            return MD_OK;
        if (md_job_write_all(out, buf, (size_t)r) != 0)
            return md_err_set(err, MD_EIO, "writing the job output failed: %s", strerror(errno));
    }
}

/* Append the object `url` to fd (the assembly of a chunked job's output). */
static md_status append_object(md_jobs *J, const char *url, int fd, md_err *err)
{
    int in = -1;
    md_s3_stream *s = NULL;
    md_status st = md_s3_stream_open(url, &J->fetch, "output.path", &in, &s, err);
    if (st != MD_OK)
        return st;
    st = append_fd(in, fd, err);
    if (st == MD_OK)
        st = md_s3_stream_status(s, err);
    close(in);
    md_s3_stream_close(s);
    return st;
}

/* The parts of an ended job: this replica's kept on its disk, and in S3
 * those its chunks named and every other under <output>.chunks/<job id>/
 * (attempts that never finished: their runner lost the chunk, or the index
 * was away at its finish), then recorded gone (md_job_drop_parts). What
 * fails here is left to the janitor of any replica. */
static void sweep_job_parts(md_jobs *J, const char *id, json_t *spec)
{
    drop_local_parts(J, id);
    md_err derr;
    md_job_drop_parts(J->store, &J->fetch, id, spec, &derr);
}

/* The store's copy of a job's output, written at `tmp` on `fd` (closed
 * here), made durable and named `out_path`; removed when `st` (what came
 * before) or this fails. */
static md_status store_copy_commit(int fd, const char *tmp, const char *out_path, md_status st,
                                   md_err *err)
{
    if (st == MD_OK && fsync(fd) != 0)
        st = md_err_set(err, MD_EIO, "fsync of %s failed: %s", tmp, strerror(errno));
    close(fd);
    if (st == MD_OK && rename(tmp, out_path) != 0)
        st = md_err_set(err, MD_EIO, "cannot rename %s: %s", tmp, strerror(errno));
    if (st != MD_OK)
        unlink(tmp);
    return st;
}

/* The output of a job of one chunk whose part is the whole file (its
 * header in it, whole_part in the plan): the store's copy is the part (kept
 * on this disk, else downloaded) and the output in S3 a copy of the part
 * made inside S3 (CopyObject), so its bytes cross the network once, as a
 * single-host job's do. `fd` is the store's copy being made, at `tmp`. */
static md_status assemble_whole(md_jobs *J, const char *id, json_t *spec, const char *out_path,
                                const char *out_url, json_t *chunks, int fd, const char *tmp,
                                size_t head_len, int64_t *rows_out, json_t **confusion,
                                md_err *err)
{
    json_t *c = json_array_get(chunks, 0);
    const char *key = json_string_value(json_object_get(c, "output_key"));
    if (!key) {
        close(fd);
        unlink(tmp);
        return md_err_set(err, MD_EINTERNAL, "chunk 0 of job %s names no part", id);
    }
    char url[2200], kept[4400];
    snprintf(url, sizeof url, "s3://%.*s/%s", (int)strcspn(out_url + 5, "/"), out_url + 5, key);
    local_part_path(J, id, key, kept, sizeof kept);
    struct stat ks;
    int kfd = open(kept, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    long long size = (long long)head_len + json_integer_value(json_object_get(c, "output_bytes"));
    md_status st;
    if (kfd >= 0 && fstat(kfd, &ks) == 0 && S_ISREG(ks.st_mode) && (long long)ks.st_size == size)
        st = append_fd(kfd, fd, err);
    else
        st = append_object(J, url, fd, err);
    if (kfd >= 0)
        close(kfd);
    st = store_copy_commit(fd, tmp, out_path, st, err);
    if (st == MD_OK) /* under md_job_output_put's rule for what may be replaced */
        st = md_job_output_copy(J->store, &J->fetch, id, spec, url, err);
    if (st != MD_OK)
        return st;
    *rows_out = json_integer_value(json_object_get(c, "rows"));
    json_t *cm = json_object_get(c, "confusion");
    *confusion = json_is_array(cm) ? json_deep_copy(cm) : NULL;
    return MD_OK;
}

/* The job's output from its done chunks, in order, up to the first one not
 * done (a cancelled job: the longest contiguous prefix): the store's copy
 * at out_path, then the object in S3. Counts come from those chunks. */
static md_status chunk_assemble(md_jobs *J, const char *id, json_t *spec, const char *out_path,
                                int cancelled, int64_t *rows_out, md_job_chunk_counts *prefix,
                                json_t **confusion, md_err *err)
{
    json_t *output = json_object_get(spec, "output");
    char out_url[1200]; /* output.path, or the server's own object (job_output.c) */
    md_job_output_url(J->store, id, spec, out_url, sizeof out_url);
    const char *ofmt = json_string_value(json_object_get(output, "format"));
    int kind = !ofmt || !strcmp(ofmt, "jsonl") ? 0 : !strcmp(ofmt, "csv") ? 1 : 2;
    json_t *chunks = NULL;
    md_status st = md_store_chunks_list(J->store, id, &chunks, err);
    if (st != MD_OK)
        return st;
    /* what the output holds: the done chunks from the first (all of them,
     * unless the job was cancelled), counted for a cancelled job's record */
    memset(prefix, 0, sizeof *prefix);
    size_t ci;
    json_t *cj;
    json_array_foreach(chunks, ci, cj)
    {
        if (strcmp(json_string_value(json_object_get(cj, "status")), "done") != 0)
            break;
        prefix->rows += json_integer_value(json_object_get(cj, "rows"));
        prefix->skipped += json_integer_value(json_object_get(cj, "skipped"));
        prefix->correct += json_integer_value(json_object_get(cj, "correct"));
        prefix->labeled += json_integer_value(json_object_get(cj, "labeled"));
        prefix->output_bytes += json_integer_value(json_object_get(cj, "output_bytes"));
    }
    char tmp[4300];
    snprintf(tmp, sizeof tmp, "%s.%ld.assembling", out_path, (long)getpid());
    int fd = open(tmp, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        json_decref(chunks);
        return md_err_set(err, MD_EIO, "cannot create %s: %s", tmp, strerror(errno));
    }
    /* has_labels as the chunks saw it: from the plan */
    json_t *plan = NULL;
    if ((st = md_store_chunk_plan_get(J->store, id, &plan, err)) != MD_OK) {
        close(fd);
        unlink(tmp);
        json_decref(chunks);
        return st;
    }
    int has_labels = json_is_true(json_object_get(plan, "has_labels"));
    /* one chunk whose part is the whole file: the output is a copy of it */
    int whole = json_is_true(json_object_get(plan, "whole_part")) && json_array_size(chunks) == 1 &&
                !strcmp(json_string_value(json_object_get(json_array_get(chunks, 0), "status")),
                        "done");
    json_decref(plan);
    char head[MD_JOB_NPY_HEADER + 1] = "";
    size_t head_len = chunk_output_head(spec, has_labels, head);
    if (whole) {
        st = assemble_whole(J, id, spec, out_path, out_url, chunks, fd, tmp, head_len, rows_out,
                            confusion, err);
        json_decref(chunks);
        return st;
    }
    if (head_len && md_job_write_all(fd, head, head_len) != 0)
        st = md_err_set(err, MD_EIO, "writing %s failed: %s", tmp, strerror(errno));
    int64_t rows = 0, skipped = 0;
    long long payload = 0;
    json_t *conf = NULL;
    size_t i;
    json_t *c;
    json_array_foreach(chunks, i, c)
    {
        if (st != MD_OK)
            break;
        if (strcmp(json_string_value(json_object_get(c, "status")), "done") != 0) {
            if (!cancelled)
                st = md_err_set(err, MD_EINTERNAL, "chunk %zu of job %s is not done", i, id);
            break;
        }
        char url[2200], kept[4400];
        const char *key = json_string_value(json_object_get(c, "output_key"));
        snprintf(url, sizeof url, "s3://%.*s/%s", (int)strcspn(out_url + 5, "/"), out_url + 5,
                 key ? key : "");
        /* a part this process made and kept (its attempt's, whole), else S3's */
        local_part_path(J, id, key ? key : "", kept, sizeof kept);
        struct stat ks;
        int kfd = key ? open(kept, O_RDONLY | O_NOFOLLOW | O_CLOEXEC) : -1;
        if (kfd >= 0 && fstat(kfd, &ks) == 0 && S_ISREG(ks.st_mode) &&
            ks.st_size == (off_t)json_integer_value(json_object_get(c, "output_bytes")))
            st = append_fd(kfd, fd, err);
        else
            st = append_object(J, url, fd, err);
        if (kfd >= 0)
            close(kfd);
        rows += json_integer_value(json_object_get(c, "rows"));
        skipped += json_integer_value(json_object_get(c, "skipped"));
        payload += json_integer_value(json_object_get(c, "output_bytes"));
        json_t *cm = json_object_get(c, "confusion");
        if (json_is_array(cm)) {
            if (!conf)
                conf = json_deep_copy(cm);
            else
                for (size_t a = 0; a < json_array_size(cm); a++)
                    for (size_t b = 0; b < json_array_size(json_array_get(cm, a)); b++) {
                        json_t *cell = json_array_get(json_array_get(conf, a), b);
                        if (cell)
                            json_integer_set(cell, json_integer_value(cell) +
                                                       json_integer_value(json_array_get(
                                                           json_array_get(cm, a), b)));
                    }
        }
    }
    if (st == MD_OK && kind == 2) {
        /* rows written: skipped rows wrote nothing; the width from the bytes */
        int64_t out_rows = rows - skipped, width = 0;
        if (out_rows > 0 && payload % (4 * out_rows) == 0)
            width = payload / 4 / out_rows;
        int64_t shape[2] = {out_rows, width};
        char h[MD_JOB_NPY_HEADER];
        md_job_npy_header(h, out_rows, shape, out_rows > 0 ? 2 : 1);
        if (pwrite(fd, h, MD_JOB_NPY_HEADER, 0) != MD_JOB_NPY_HEADER)
            st = md_err_set(err, MD_EIO, "writing %s failed: %s", tmp, strerror(errno));
    }
    st = store_copy_commit(fd, tmp, out_path, st, err);
    if (st == MD_OK) /* a user's output.path never over an object; the server's own key
                      * over an earlier holder's upload of this very job */
        st = md_job_output_put(J->store, &J->fetch, id, spec, out_path, err);
    *rows_out = rows;
    if (st == MD_OK)
        *confusion = conf;
    else
        json_decref(conf);
    json_decref(chunks);
    return st;
}

/* The coordinator of a chunked job (see DESIGN above), holding the job's
 * lease: plan, run chunks with the other runners, assemble once. Returns 0
 * (having changed nothing) when the model version declares named inputs or
 * outputs, whose rows and columns only the single runner lays out: the job
 * then runs on this process alone, as in single-host mode. */
static int run_chunked_job(md_jobs *J, int slot, const char *id, json_t *job)
{
    md_err err;
    md_err_clear(&err);
    slot_ref sref = {J, slot};
    keeper kp = {0};
    md_model *m = NULL;
    json_t *spec = json_object_get(job, "spec");
    const char *model_name = json_string_value(json_object_get(job, "model"));
    /* the store's copy of the output in this replica's own store: the job's
     * output_path names the store of the replica that took the request,
     * which another host does not see (GET /jobs/ID/output looks here too) */
    const char *named = json_string_value(json_object_get(job, "output_path"));
    const char *leaf = named ? strrchr(named, '/') : NULL;
    char out_path[4200];
    snprintf(out_path, sizeof out_path, "%s/jobs/%s", md_store_dir(J->store),
             leaf ? leaf + 1 : id);
    int version = (int)json_integer_value(json_object_get(spec, "version"));
    char now[32];
    json_t *f;
    keeper_start(&kp, J, slot, id);
    m = J->resolve(J->resolve_ctx, model_name, version, &err);
    if (!m)
        goto failed;
    if ((md_model_n_inputs(m) || md_model_n_outputs(m)) &&
        json_is_null(json_object_get(job, "chunks_total"))) {
        keeper_stop(&kp);
        md_model_release(m);
        return 0;
    }
    md_now_iso(now);
    f = json_pack("{s:s}", "status", "running");
    if (json_is_null(json_object_get(job, "started_at")))
        json_object_set_new(f, "started_at", json_string(now));
    jupdate(J, slot, id, f, NULL);
    json_decref(f);
    if (atomic_load(&J->lost[slot]))
        goto out;
    int batch = (int)json_integer_value(json_object_get(spec, "batch_size"));
    if (!version || batch <= 0) {
        if (batch <= 0) {
            batch = md_model_max_batch(m);
            json_object_set_new(spec, "batch_size", json_integer(batch));
        }
        f = json_pack("{s:i,s:O}", "version", md_model_version(m), "spec", spec);
        jupdate(J, slot, id, f, NULL);
        json_decref(f);
    }
    if (json_is_null(json_object_get(job, "chunks_total"))) {
        char s3_out[1200];
        md_job_output_url(J->store, id, spec, s3_out, sizeof s3_out);
        if (md_s3_data_put(s3_out, &J->fetch, NULL, &err) != MD_OK)
            goto failed; /* an output that exists already: before any work */
        md_status st = chunk_plan(J, &sref, id, json_object_get(spec, "input"), batch,
                                  json_integer_value(json_object_get(spec, "chunk_rows")), m, &err);
        if (st != MD_OK) {
            if (atomic_load(&J->lost[slot]) || atomic_load(&J->stopping))
                goto out;
            goto failed;
        }
    }
    keeper_stop(&kp);
    json_t *plan = NULL;
    if (md_store_chunk_plan_get(J->store, id, &plan, &err) != MD_OK || !plan)
        goto failed;
    f = json_pack("{s:I}", "rows_total",
                  (json_int_t)json_integer_value(json_object_get(plan, "rows_total")));
    if (json_is_integer(json_object_get(plan, "files_skipped"))) /* images, as the single runner */
        json_object_set(f, "files_skipped", json_object_get(plan, "files_skipped"));
    json_decref(plan);
    jupdate(J, slot, id, f, NULL);
    json_decref(f);
    int cancelled = 0;
    for (;;) {
        if (atomic_load(&J->lost[slot]) || atomic_load(&J->stopping))
            goto out;
        if (jupdate(J, slot, id, NULL, NULL) != MD_OK && atomic_load(&J->lost[slot]))
            goto out;
        json_t *now_job = NULL;
        if (md_store_job_get(J->store, id, &now_job, &err) != MD_OK) {
            if (err.status != MD_EUNAVAIL && err.status != MD_EIO)
                goto failed;
            /* the index is away (PostgreSQL restarting): the chunks' leases
             * are on its clock, so nothing runs out meanwhile; try again */
            md_log(MD_LOG_WARN, "job %s: %s; retrying", id, err.msg);
            test_pause_ms(J, 200);
            continue;
        }
        const char *status = json_string_value(json_object_get(now_job, "status"));
        json_t *ch = json_object_get(now_job, "chunks");
        int failed_now = status && !strcmp(status, "failed");
        long long total = json_integer_value(json_object_get(ch, "total"));
        long long done = json_integer_value(json_object_get(ch, "done"));
        json_decref(now_job);
        if (failed_now) { /* a chunk's data failed the job: its runner recorded why */
            sweep_job_parts(J, id, spec);
            goto out;
        }
        if (atomic_load(&J->cancel[slot])) {
            cancelled = 1;
            break;
        }
        if (done == total)
            break;
        md_job_chunk c;
        int found = 0;
        if (md_store_chunk_claim(J->store, J->owner, J->lease_s, id, &c, &found, &err) == MD_OK &&
            found) {
            md_err cerr;
            md_err_clear(&cerr);
            keeper_start(&kp, J, slot, id); /* the job's lease, while the chunk runs */
            run_chunk(J, slot, &c, &cerr);
            keeper_stop(&kp);
            continue;
        }
        /* every chunk is held by a runner: wait for one to finish (or its
         * lease to run out), renewing this job's lease */
        pthread_mutex_lock(&J->mu);
        if (!atomic_load(&J->stopping)) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            long long ns = (long long)ts.tv_nsec + 200000000LL;
            ts.tv_sec += (time_t)(ns / 1000000000LL);
            ts.tv_nsec = (long)(ns % 1000000000LL);
            pthread_cond_timedwait(&J->cv, &J->mu, &ts);
        }
        pthread_mutex_unlock(&J->mu);
    }
    /* the last chunk is done (or the job cancelled): assemble once */
    int64_t rows = 0;
    json_t *confusion = NULL;
    if (jupdate(J, slot, id, NULL, NULL) != MD_OK)
        goto out;
    keeper_start(&kp, J, slot, id); /* the job's lease, while its parts are read and put */
    double t_asm = mono();
    md_job_chunk_counts prefix;
    md_status ast =
        chunk_assemble(J, id, spec, out_path, cancelled, &rows, &prefix, &confusion, &err);
    md_log(MD_LOG_DEBUG, "job %s: assembled in %.3f s", id, mono() - t_asm);
    if (ast == MD_OK && getenv("MD_TEST_PAUSE_AFTER_OUTPUT_MS")) {
        /* for tests only: the window between the output's upload and its
         * record, held open so that a test can stop this process in it */
        md_log(MD_LOG_INFO, "job %s: output put; test pause before recording it", id);
        test_pause_ms(J, atol(getenv("MD_TEST_PAUSE_AFTER_OUTPUT_MS")));
    }
    keeper_stop(&kp);
    if (ast != MD_OK || atomic_load(&J->lost[slot]))
        goto failed;
    json_t *final = NULL;
    if (md_store_job_get(J->store, id, &final, &err) != MD_OK)
        goto failed;
    int64_t correct = json_integer_value(json_object_get(final, "correct"));
    int64_t labeled = json_integer_value(json_object_get(final, "labeled"));
    json_decref(final);
    const char *record = json_string_value(json_object_get(spec, "record_metric"));
    int promoted = 0;
    if (!cancelled && record && labeled > 0 &&
        md_store_record_metric(J->store, model_name, md_model_version(m), record,
                               (double)correct / (double)labeled, &promoted, &err) != MD_OK)
        md_log(MD_LOG_WARN, "job %s: recording metrics.%s failed: %s", id, record, err.msg);
    else if (promoted && J->moved)
        J->moved(J->resolve_ctx, model_name, md_model_version(m));
    md_now_iso(now);
    f = json_pack("{s:s,s:s}", "status", cancelled ? "cancelled" : "succeeded", "finished_at", now);
    if (cancelled) {
        /* the rows of the output, not those of every chunk done: a chunk
         * done after one that was not is not in a partial output */
        json_object_set_new(f, "partial", json_true());
        json_object_set_new(f, "rows_done", json_integer(prefix.rows));
        json_object_set_new(f, "rows_skipped", json_integer(prefix.skipped));
        json_object_set_new(f, "correct", json_integer(prefix.correct));
        json_object_set_new(f, "labeled", json_integer(prefix.labeled));
        json_object_set_new(f, "output_bytes", json_integer(prefix.output_bytes));
    } else
        json_object_set_new(f, "rows_total", json_integer(rows));
    if (confusion)
        json_object_set_new(f, "confusion", confusion);
    md_status rec = jupdate(J, slot, id, f, NULL);
    json_decref(f);
    if (rec != MD_OK) /* not recorded: the parts stay for whoever holds the job now */
        goto out;
    md_log(MD_LOG_INFO, "job %s %s: %lld rows assembled from its chunks", id,
           cancelled ? "cancelled" : "succeeded", (long long)rows);
    /* the parts only now: a coordinator that stops between its upload and
     * the record leaves them to the one that takes the job over, which
     * assembles the same bytes again and finds the output already there,
     * byte for byte (s3_data.c) */
    if (getenv("MD_TEST_PAUSE_AFTER_RECORD_MS")) { /* for tests only: a stop here */
        md_log(MD_LOG_INFO, "job %s: recorded; test pause before deleting its parts", id);
        test_pause_ms(J, atol(getenv("MD_TEST_PAUSE_AFTER_RECORD_MS")));
    }
    sweep_job_parts(J, id, spec);
    goto out;
failed:
    keeper_stop(&kp);
    if (err.status == MD_EUNAVAIL && !atomic_load(&J->lost[slot]) &&
        !atomic_load(&J->stopping)) {
        /* the index or S3 away: nothing is wrong with the job; it is
         * claimed again (here or elsewhere) once its lease is given back */
        md_log(MD_LOG_WARN, "job %s: %s; trying again", id, err.msg);
        md_err rerr;
        md_store_job_release(J->store, id, J->owner, &rerr);
        test_pause_ms(J, 1000);
        goto out;
    }
    /* only the holder that failed it sweeps: one that lost the job (paused
     * past its lease) leaves the parts to the job's new coordinator */
    if (fail_job(J, slot, id, &err))
        sweep_job_parts(J, id, spec);
out:
    keeper_stop(&kp);
    md_model_release(m);
    return 1;
}

/* ---- running one job ---- */

static void run_job(md_jobs *J, int slot, const char *id)
{
    md_err err;
    md_err_clear(&err);
    json_t *job = NULL;
    if (md_store_job_get(J->store, id, &job, &err) != MD_OK)
        return;
    const char *status = json_string_value(json_object_get(job, "status"));
    if (strcmp(status, "queued") != 0 && strcmp(status, "running") != 0) {
        json_decref(job);
        return;
    }
    if (md_store_jobs_chunked(J->store) && chunkable(J, id, json_object_get(job, "spec")) &&
        run_chunked_job(J, slot, id, job)) { /* one job over every replica */
        json_decref(job);
        return;
    }
    json_t *spec = json_object_get(job, "spec");
    json_t *input = json_object_get(spec, "input"), *output = json_object_get(spec, "output");
    /* where the output goes besides the store's copy: output.path in S3, or
     * in cluster mode with no output.path the server's own object, so any
     * replica can serve it (job_output.c); "" when it stays a local file */
    char s3_out[1200];
    md_job_output_url(J->store, id, spec, s3_out, sizeof s3_out);
    const char *model_name = json_string_value(json_object_get(job, "model"));
    int version = (int)json_integer_value(json_object_get(spec, "version"));
    int skip_bad = json_is_string(json_object_get(spec, "on_error")) &&
                   strcmp(json_string_value(json_object_get(spec, "on_error")), "skip") == 0;
    int64_t rows_done = json_integer_value(json_object_get(job, "rows_done"));
    long long out_bytes = json_integer_value(json_object_get(job, "output_bytes"));
    int64_t correct = json_integer_value(json_object_get(job, "correct"));
    int64_t labeled = json_integer_value(json_object_get(job, "labeled"));
    int64_t skipped = json_integer_value(json_object_get(job, "rows_skipped"));
    char accuracy_note[400] = ""; /* why a labelled job counts no accuracy */
    char out_path[4096], partial[4200], input_path[4200];
    const char *stored = json_string_value(json_object_get(job, "output_path"));
    const char *opath = json_string_value(json_object_get(output, "path"));
    if (opath && !is_s3(opath)) { /* a user's file, under allowed_paths */
        snprintf(out_path, sizeof out_path, "%s", stored);
    } else {
        /* the store's file (writers.c): in this replica's own store, while
         * output_path names that of the replica that took the request */
        const char *leaf = stored ? strrchr(stored, '/') : NULL;
        snprintf(out_path, sizeof out_path, "%s/jobs/%s", md_store_dir(J->store),
                 leaf ? leaf + 1 : id);
    }
    snprintf(partial, sizeof partial, "%s.partial", out_path);
    md_model *m = NULL;
    md_reader *r = NULL;
    int fd = -1, in_fd = -1, label_fd = -1;
    s3_input s3in = {0};
    const char *in_format = json_string_value(json_object_get(input, "format"));
    const char *url = json_string_value(json_object_get(input, "url"));
    md_job_outfile of = {.dirfd = -1};
    keeper kp = {0};
    slot_ref sref = {J, slot};
    int64_t written_skipped = skipped; /* rows_skipped as of the last row written */
    chunk ring[PIPELINE];
    memset(ring, 0, sizeof ring);
    for (int i = 0; i < PIPELINE; i++) {
        pthread_mutex_init(&ring[i].mu, NULL);
        pthread_cond_init(&ring[i].cv, NULL);
    }
    json_t *confusion = json_incref(json_object_get(job, "confusion"));
    int64_t *conf = NULL;
    int64_t classes = 0;
    int eof = 0, head = 0, inflight = 0;
    char *text = NULL;
    size_t text_cap = 0;

    char now[32];
    md_now_iso(now);
    json_t *f = json_pack("{s:s}", "status", "running");
    if (json_is_null(json_object_get(job, "started_at")))
        json_object_set_new(f, "started_at", json_string(now));
    jupdate(J, slot, id, f, NULL);
    json_decref(f);
    if (atomic_load(&J->lost[slot]))
        goto out;

    /* the model, then the input: either may take longer than a lease (a
     * checkpoint to load, a dataset to download), so a keeper renews it */
    keeper_start(&kp, J, slot, id);
    m = J->resolve(J->resolve_ctx, model_name, version, &err);
    if (!m) {
        keeper_stop(&kp);
        goto failed;
    }
    if (!version) {
        f = json_pack("{s:i}", "version", md_model_version(m));
        jupdate(J, slot, id, f, NULL);
        json_decref(f);
    }
    /* the input: a URL is downloaded once into the store; a path is opened
     * here under this replica's allowed_paths without following symlinks,
     * and the reader reads that very file through /proc/self/fd */
    char label_path[64];
    md_reader_opts ro = {
        .path = input_path,
        .format = in_format,
        .features = json_object_get(input, "features"),
        .label = json_string_value(json_object_get(input, "label")),
        .label_from = json_object_get(input, "label_from"),
        .class_names = md_model_labels(m),
        .max_files = J->image_max_files,
        .max_file_bytes = J->image_max_bytes,
    };
    int images = in_format && !strcmp(in_format, "images");
    /* a version with named inputs: the reader lays each row out as they are
     * packed (md_model_pack_rows), from input.columns */
    md_io_info named[MD_MAX_IO];
    int n_named = md_model_n_inputs(m);
    for (int i = 0; i < n_named; i++)
        md_model_input(m, i, &named[i]);
    if (n_named) {
        if (!in_format ||
            (strcmp(in_format, "csv") && strcmp(in_format, "jsonl") && strcmp(in_format, "npz"))) {
            keeper_stop(&kp);
            md_err_setc(&err, MD_EUNPROC, "invalid_job",
                        "model %s version %d takes named inputs, which a job reads from csv or "
                        "jsonl columns (input.columns) or an npz file's arrays, not from %s",
                        model_name, md_model_version(m), in_format ? in_format : "this input");
            goto failed;
        }
        ro.inputs = named;
        ro.n_inputs = n_named;
        ro.columns = json_object_get(input, "columns");
    } else if (json_object_get(input, "columns")) {
        keeper_stop(&kp);
        md_err_setc(&err, MD_EUNPROC, "invalid_job",
                    "input.columns maps a model's named inputs, and model %s version %d "
                    "declares none (config.inputs): use input.features",
                    model_name, md_model_version(m));
        goto failed;
    }
    if (md_model_n_outputs(m) > 1 && output &&
        json_string_value(json_object_get(output, "format")) &&
        !strcmp(json_string_value(json_object_get(output, "format")), "npy")) {
        keeper_stop(&kp);
        md_err_setc(&err, MD_EUNPROC, "invalid_job",
                    "model %s version %d answers %d outputs, and an NPY file holds one array: "
                    "write jsonl or csv (a field per output)",
                    model_name, md_model_version(m), md_model_n_outputs(m));
        goto failed;
    }
    if (images) {
        /* a folder of images: the directory opened as a file is (under
         * allowed_paths, no symlink followed); the reader walks it from
         * that descriptor without following any symlink either */
        ro.image = md_model_image(m);
        const char *path = json_string_value(json_object_get(input, "path"));
        if (!ro.image) {
            keeper_stop(&kp);
            md_err_setc(&err, MD_EUNPROC, "no_image_preprocess",
                        "model %s version %d declares no preprocess.image, so it cannot read "
                        "images: deploy a version whose config has preprocess.image, e.g. "
                        "{\"mode\": \"RGB\"}",
                        model_name, md_model_version(m));
            goto failed;
        }
        if (is_s3(path)) {
            md_status fst = s3_images_open(J, id, path, &sref, &s3in, &in_fd, &err);
            if (fst != MD_OK) {
                keeper_stop(&kp);
                if (atomic_load(&J->lost[slot]) || atomic_load(&J->stopping) ||
                    atomic_load(&J->cancel[slot]))
                    goto stopped_early;
                goto failed;
            }
        } else if (md_path_open_directory(J->fetch.allowed_paths, "input.path", path,
                                          "input_not_found", &in_fd, &err) != MD_OK) {
            keeper_stop(&kp);
            goto failed;
        }
        snprintf(input_path, sizeof input_path, "/proc/self/fd/%d", in_fd);
    } else if (url) {
        snprintf(input_path, sizeof input_path, "%s/jobs/%s.input", md_store_dir(J->store), id);
        md_fetch_opts fo = J->fetch;
        fo.keep_going = download_keep_going;
        fo.keep_going_ctx = &sref;
        if (access(input_path, R_OK) != 0 && md_fetch_file(url, &fo, input_path, &err) != MD_OK) {
            keeper_stop(&kp);
            if (atomic_load(&J->lost[slot]) || atomic_load(&J->stopping) ||
                atomic_load(&J->cancel[slot]))
                goto stopped_early;
            goto failed;
        }
    } else {
        const char *path = json_string_value(json_object_get(input, "path"));
        if (is_s3(path) ? md_s3_stream_open(path, &J->fetch, "input.path", &in_fd, &s3in.data,
                                            &err) != MD_OK
                        : md_path_open_file(J->fetch.allowed_paths, "input.path", path,
                                            "input_not_found", &in_fd, &err) != MD_OK) {
            keeper_stop(&kp);
            goto failed;
        }
        snprintf(input_path, sizeof input_path, "/proc/self/fd/%d", in_fd);
        if (ro.label && !strcmp(in_format, "idx")) {
            if (is_s3(ro.label) ? md_s3_stream_open(ro.label, &J->fetch, "input.label", &label_fd,
                                                    &s3in.labels, &err) != MD_OK
                                : md_path_open_file(J->fetch.allowed_paths, "input.label", ro.label,
                                                    "input_not_found", &label_fd, &err) != MD_OK) {
                keeper_stop(&kp);
                goto failed;
            }
            snprintf(label_path, sizeof label_path, "/proc/self/fd/%d", label_fd);
            ro.label = label_path;
        }
    }
    if (md_reader_open(&ro, &r, &err) != MD_OK)
        goto reader_failed;
    int64_t width = md_reader_row_width(r);
    int has_labels = md_reader_has_labels(r);
    int64_t total = md_reader_total_rows(r);
    if (total >= 0) {
        f = json_pack("{s:I}", "rows_total", (json_int_t)total);
        if (md_reader_files_skipped(r) >= 0)
            json_object_set_new(f, "files_skipped", json_integer(md_reader_files_skipped(r)));
        jupdate(J, slot, id, f, NULL);
        json_decref(f);
    }
    /* resumed where the committed output is not: a job staged in the store
     * that another replica ran before (it stopped or lost the job) starts
     * over here, rather than failing for a file on another host */
    struct stat psb;
    int restarted = 0;
    if ((rows_done > 0 || out_bytes > 0) && (is_s3(s3_out) || !opath) &&
        (stat(partial, &psb) != 0 || psb.st_size < out_bytes)) {
        md_log(MD_LOG_INFO, "job %s: its %lld committed rows are written on the replica that "
               "ran it before; starting it over here", id, (long long)rows_done);
        rows_done = correct = labeled = skipped = written_skipped = 0;
        out_bytes = 0;
        json_decref(confusion);
        confusion = NULL;
        f = json_pack("{s:i,s:i,s:i,s:i,s:i,s:n}", "rows_done", 0, "output_bytes", 0, "correct",
                      0, "labeled", 0, "rows_skipped", 0, "confusion");
        md_status rst = jupdate(J, slot, id, f, &err);
        json_decref(f);
        if (rst != MD_OK) /* lost, or the index away: the job stays for its next holder */
            goto out;
        unlink(out_path); /* this store's copy of an earlier finish, if any */
        restarted = 1;
    }
    /* resume: skip what is committed (images by number, reading nothing) */
    if (md_reader_skip_to(r, rows_done, &err) != MD_OK)
        goto reader_failed;
    md_job_outfmt o = {0};
    const char *ofmt = json_string_value(json_object_get(output, "format"));
    o.kind = !ofmt || !strcmp(ofmt, "jsonl") ? 0 : !strcmp(ofmt, "csv") ? 1 : 2;
    json_t *include = json_object_get(output, "include");
    o.inc_index = md_job_include_has(include, "index", 1);
    o.inc_path = images && md_job_include_has(include, "path", 1);
    o.inc_pred = md_job_include_has(include, "prediction", 1);
    o.inc_label = md_job_include_has(include, "label", has_labels);
    o.inc_scores = md_job_include_has(include, "scores", 0);
    o.top_k = (int)json_integer_value(json_object_get(spec, "top_k"));
    if (md_model_n_outputs(m) && md_model_classes_output(m) < 0)
        o.inc_pred = o.inc_scores = 0; /* no output is the classes one */
    /* input.shape: the per-row shape the flat rows are given to the model in */
    json_t *row_shape = json_object_get(input, "shape");
    int64_t shape_prod = 1;
    int shape_overflow = 0;
    for (size_t i = 0; i < json_array_size(row_shape) && !shape_overflow; i++)
        shape_overflow = md_mul_i64(shape_prod, json_integer_value(json_array_get(row_shape, i)),
                                    &shape_prod);
    if (json_array_size(row_shape) > 0 &&
        (json_array_size(row_shape) >= MD_MAX_DIMS || shape_overflow || shape_prod != width)) {
        if (shape_overflow || json_array_size(row_shape) >= MD_MAX_DIMS)
            md_err_setc(&err, MD_EINVAL, "invalid_job",
                        "input.shape has too many dimensions or values (at most %d dimensions); "
                        "the dataset rows have %lld values",
                        MD_MAX_DIMS - 1, (long long)width);
        else
            md_err_setc(&err, MD_EINVAL, "invalid_job",
                        "input.shape holds %lld values per row but the dataset rows have %lld",
                        (long long)shape_prod, (long long)width);
        goto failed;
    }

    /* the output is touched only under a fresh lease */
    if (jupdate(J, slot, id, NULL, NULL) == MD_ECONFLICT)
        goto out;
    if (is_s3(s3_out) && rows_done == 0 && out_bytes == 0 && !restarted &&
        md_s3_data_put(s3_out, &J->fetch, NULL, &err) != MD_OK)
        goto failed; /* an output that exists already: before any work (a job
                      * started over may find its earlier run's: compared at
                      * the end) */
    if (md_job_out_open_dir(J->fetch.allowed_paths, J->store, output, out_path, &of, &err) !=
        MD_OK)
        goto failed;
    int fresh = rows_done == 0 && out_bytes == 0;
    /* the keeper renews the lease through the copy of a resumed job's
     * committed output (gigabytes on a slow disk outlast a lease) */
    fd = md_job_out_open_partial(&of, fresh, out_bytes, in_fd, &J->lost[slot], &err);
    keeper_stop(&kp); /* from here the pipeline renews the lease as it goes */
    if (fd < 0)
        goto failed;
    if (fresh) {
        char head[16384] = "";
        if (o.kind == 2) {
            int64_t s1[1] = {0};
            md_job_npy_header(head, 0, s1, 1);
            out_bytes = MD_JOB_NPY_HEADER;
        } else if (o.kind == 1) {
            int first = 1;
            if (o.inc_index)
                strcat(head, "index"), first = 0;
            if (o.inc_path)
                strcat(head, first ? "path" : ",path"), first = 0;
            /* a column per output value: NAME_0, NAME_1, ... (NAME for one
             * value a row); names are letters, digits, _ . -: nothing to quote */
            for (int j = 0; j < md_model_n_outputs(m); j++) {
                md_io_info oi;
                md_model_output(m, j, &oi);
                for (int64_t v = 0; v < oi.values; v++) {
                    char col[96];
                    if (oi.ndim == 0)
                        snprintf(col, sizeof col, "%s%s", first ? "" : ",", oi.name);
                    else
                        snprintf(col, sizeof col, "%s%s_%lld", first ? "" : ",", oi.name,
                                 (long long)v);
                    if (strlen(head) + strlen(col) + 64 >= sizeof head) {
                        md_err_setc(&err, MD_EUNPROC, "invalid_job",
                                    "the outputs of model %s version %d have too many values "
                                    "for csv columns; write jsonl",
                                    model_name, md_model_version(m));
                        goto failed;
                    }
                    strcat(head, col);
                    first = 0;
                }
            }

            if (o.inc_pred)
                strcat(head, first ? "prediction" : ",prediction"), first = 0;
            if (o.inc_label)
                strcat(head, first ? "label" : ",label"), first = 0;
            if (o.inc_scores)
                strcat(head, first ? "scores" : ",scores");
            strcat(head, "\n");
            out_bytes = (long long)strlen(head);
        }
        if (out_bytes > 0 && md_job_write_all(fd, head, (size_t)out_bytes) != 0) {
            md_err_set(&err, MD_EIO, "writing %s failed: %s", partial, strerror(errno));
            goto failed;
        }
    }

    /* no batch_size given: the model version's max_batch_size, recorded */
    int batch = (int)json_integer_value(json_object_get(spec, "batch_size"));
    if (batch <= 0) {
        batch = md_model_max_batch(m);
        json_object_set_new(spec, "batch_size", json_integer(batch));
        f = json_pack("{s:O}", "spec", spec);
        jupdate(J, slot, id, f, NULL);
        json_decref(f);
    }
    long chunk_bytes = (long)batch * (long)width * (long)sizeof(float);
    int depth = chunk_bytes > 0 ? (int)(PIPELINE_BYTES / chunk_bytes) : PIPELINE;
    depth = depth < 2 ? 2 : depth > PIPELINE ? PIPELINE : depth;
    double t0 = mono(), last_commit = t0;
    int64_t rows_this_run = 0;
    int64_t index_next = md_reader_position(r);
    int64_t written_end = index_next; /* reader position after the last row written */
    /* Refill only once the pipeline has drained to `low` chunks, and sleep
     * until it has: the runner then wakes once per depth - low chunks, not
     * once per chunk. Each wake-up on a 2-core machine preempts a worker
     * mid-forward (a reschedule IPI); per chunk, that cost ~9% of the
     * workers' time and the runner's futex calls another few percent. The
     * workers still have `low` chunks queued when the runner refills. */
    int low = depth / 2;
    for (;;) {
        /* fill the pipeline */
        int refill = inflight <= low;
        while (refill && !eof && inflight < depth &&
               !atomic_load(&J->cancel[slot]) &&
               !atomic_load(&J->stopping) && !atomic_load(&J->lost[slot])) {
            chunk *c = &ring[(head + inflight) % PIPELINE];
            chunk_reset(c);
            size_t chunk_values, chunk_size;
            if (__builtin_mul_overflow((size_t)batch, (size_t)width, &chunk_values) ||
                __builtin_mul_overflow(chunk_values, sizeof(float), &chunk_size)) {
                md_err_setc(&err, MD_ETOOBIG, "invalid_job",
                            "a chunk of batch_size %d rows of %lld values is too large; lower "
                            "batch_size",
                            batch, (long long)width);
                goto failed;
            }
            float *buf = md_malloc_checked(chunk_size, "a job chunk", &err);
            if (!buf)
                goto failed;
            c->labels = md_xmalloc(sizeof(int64_t) * (size_t)batch);
            c->index = md_xmalloc(sizeof(int64_t) * (size_t)batch);
            while (c->rows < batch) {
                int64_t pos = md_reader_position(r);
                md_status st = md_reader_next(r, buf + c->rows * width, &c->labels[c->rows], &err);
                if (st == MD_ENOTFOUND) {
                    eof = 1;
                    break;
                }
                if (st == MD_EINVAL && skip_bad) {
                    skipped++;
                    continue;
                }
                if (st != MD_OK) {
                    free(buf);
                    goto reader_failed;
                }
                c->index[c->rows++] = pos;
            }
            c->skipped_end = skipped;
            index_next = md_reader_position(r);
            c->end_position = index_next;
            if (c->rows == 0) {
                free(buf);
                c->done = 1;
                c->st = MD_OK;
                inflight++;
                break;
            }
            /* decoded images are ToTensor's values already: no preprocess.scale */
            md_tensor t = {.ndim = 2, .shape = {c->rows, width}, .data = buf,
                           .count = (size_t)(c->rows * width), .prescaled = images};
            if (json_array_size(row_shape) > 0) {
                t.ndim = 1 + (int)json_array_size(row_shape);
                for (size_t i = 0; i < json_array_size(row_shape); i++)
                    t.shape[i + 1] = json_integer_value(json_array_get(row_shape, i));
            }
            if (n_named && md_model_pack_rows(m, buf, c->rows, &t, &err) != MD_OK)
                goto failed;
            if (md_model_submit(m, &t, MD_PRIO_BATCH, chunk_cb, c, &err) != MD_OK)
                goto failed;
            inflight++;
        }
        if (inflight == 0 && eof)
            break;
        /* write the oldest chunk (none left when stopping early), then commit */
        chunk *c = inflight > 0 ? &ring[head] : NULL;
        if (c) {
            /* chunks finish about in order: sleep until the pipeline is at
             * `low`, then take the ones before without sleeping again */
            if (inflight > low + 1 && !eof)
                chunk_wait_renewing(J, slot, id, &ring[(head + inflight - low - 1) % PIPELINE]);
            chunk_wait_renewing(J, slot, id, c);
            head = (head + 1) % PIPELINE;
            inflight--;
            if (c->st != MD_OK) {
                err = c->err;
                goto failed;
            }
            /* write only under a fresh lease: past half of it, renew first,
             * so a process that lost the job never writes into its output */
            if (!atomic_load(&J->lost[slot]) && mono() - J->renewed[slot] > J->lease_s / 2)
                jupdate(J, slot, id, NULL, NULL);
        }
        if (atomic_load(&J->lost[slot])) {
            if (inflight == 0)
                goto out;
            continue;
        }
        size_t len = 0;
        if (c && c->rows > 0) {
            int64_t ow = 1;
            for (int d = 1; d < c->out_ndim; d++)
                ow *= c->out_shape[d];
            /* declared outputs: classes from the one marked (or the only one) */
            int n_out = md_model_n_outputs(m), co = n_out ? md_model_classes_output(m) : -1;
            md_io_info coi = {0};
            if (co >= 0)
                md_model_output(m, co, &coi);
            md_classes cls = md_model_classes(m, !n_out ? ow : co >= 0 && coi.ndim == 1
                                                                  ? coi.values
                                                                  : 0);
            if (n_out && co < 0)
                cls.kind = MD_CLASSES_NONE;
            /* a row's class and its accuracy by the version's rule (one
             * column: a binary classifier); no rule, no number, and why */
            int scored = has_labels && (cls.kind == MD_CLASSES_ARGMAX ||
                                        cls.kind == MD_CLASSES_BINARY);
            if (has_labels && !scored && !accuracy_note[0])
                snprintf(accuracy_note, sizeof accuracy_note, "no accuracy: %s",
                         cls.kind == MD_CLASSES_MULTI
                             ? "the output is multi-label (config multi_label): each row has "
                               "a set of classes, not the one class a label column gives"
                             : md_classes_none_reason());
            if (scored && !conf && cls.classes > 1 && cls.classes <= 1000) {
                classes = cls.classes;
                conf = md_xcalloc((size_t)(classes * classes), sizeof(int64_t));
                if (json_is_array(confusion) && (int64_t)json_array_size(confusion) == classes)
                    for (int64_t a = 0; a < classes; a++)
                        for (int64_t b2 = 0; b2 < classes; b2++)
                            conf[a * classes + b2] = json_integer_value(
                                json_array_get(json_array_get(confusion, (size_t)a), (size_t)b2));
            }
            if (o.kind == 2) {
                len = (size_t)(c->rows * ow) * sizeof(float);
                if (md_job_write_all(fd, (const char *)c->out, len) != 0) {
                    md_err_set(&err, MD_EIO, "writing %s failed: %s", partial, strerror(errno));
                    goto failed;
                }
            }
            for (int64_t i = 0; i < c->rows; i++) {
                const float *row = c->out + i * ow;
                const float *y = !n_out ? row : co >= 0 ? row + coi.off : NULL;
                if (scored && y) {
                    int64_t top = md_classes_top(&cls, y);
                    labeled++;
                    correct += top == c->labels[i];
                    /* classes was fixed by this run's first chunk: a model
                     * whose width changes with the batch (no test forward)
                     * could give a class past it */
                    if (conf && c->labels[i] >= 0 && c->labels[i] < classes && top >= 0 &&
                        top < classes)
                        conf[c->labels[i] * classes + top]++;
                }
                if (o.kind != 2)
                    md_job_format_row(&text, &len, &text_cap, &o, m, c->index[i],
                                      md_reader_row_name(r, c->index[i]), y, &cls, has_labels,
                                      c->labels[i], n_out ? row : NULL);
            }
            if (o.kind != 2 && md_job_write_all(fd, text, len) != 0) {
                md_err_set(&err, MD_EIO, "writing %s failed: %s", partial, strerror(errno));
                goto failed;
            }
            out_bytes += (long long)len;
            rows_this_run += c->rows;
        }
        if (c) {
            written_end = c->end_position;
            written_skipped = c->skipped_end;
        }
        /* Commit a chunk of work at most every COMMIT_INTERVAL_S: one
         * fdatasync and one SQLite commit per forward would stall the
         * pipeline on the disk. Rows written since the last commit are cut
         * off and redone on resume. */
        double el = mono() - t0;
        int last = (eof && inflight == 0) || atomic_load(&J->cancel[slot]) ||
                   atomic_load(&J->stopping);
        if (!last && J->chunk_delay_ms == 0 && mono() - last_commit < COMMIT_INTERVAL_S)
            continue;
        last_commit = mono();
        if (fdatasync(fd) != 0) {
            md_err_set(&err, MD_EIO, "fdatasync of %s failed: %s", partial, strerror(errno));
            goto failed;
        }
        f = json_pack("{s:I,s:I,s:I,s:I,s:I,s:f}", "rows_done", (json_int_t)written_end,
                      "output_bytes", (json_int_t)out_bytes, "correct", (json_int_t)correct,
                      "labeled", (json_int_t)labeled, "rows_skipped", (json_int_t)written_skipped,
                      "rows_per_s", el > 0 ? (double)rows_this_run / el : 0.0);
        if (accuracy_note[0])
            json_object_set_new(f, "accuracy_note", json_string(accuracy_note));
        if (conf) {
            json_t *cm = json_array();
            for (int64_t a = 0; a < classes; a++) {
                json_t *row = json_array();
                for (int64_t b2 = 0; b2 < classes; b2++)
                    json_array_append_new(row, json_integer(conf[a * classes + b2]));
                json_array_append_new(cm, row);
            }
            json_object_set_new(f, "confusion", cm);
        }
        md_status ust = jupdate(J, slot, id, f, &err);
        json_decref(f);
        if (ust != MD_OK)
            goto failed;
        if (atomic_load(&J->cancel[slot]) && inflight == 0) {
            /* keep what is written, as a valid file marked partial */
            keeper_start(&kp, J, slot, id); /* the lease while it is synced and put */
            if (md_job_out_finish(&of, &fd, o.kind == 2, out_bytes, written_end - written_skipped,
                           partial, &err) != MD_OK)
                goto failed;
            if (atomic_load(&J->lost[slot]))
                goto out;
            if (is_s3(s3_out) &&
                md_job_output_put(J->store, &J->fetch, id, spec, out_path, &err) != MD_OK)
                goto failed;
            keeper_stop(&kp);
            if (atomic_load(&J->lost[slot]))
                goto out;
            md_now_iso(now);
            f = json_pack("{s:s,s:b,s:s}", "status", "cancelled", "partial", 1, "finished_at", now);
            jupdate(J, slot, id, f, NULL);
            json_decref(f);
            md_log(MD_LOG_INFO, "job %s cancelled after %lld rows", id, (long long)written_end);
            goto out;
        }
        if (atomic_load(&J->stopping) && inflight == 0 && !eof) {
            /* give it back: a replica sharing the store may go on at once */
            md_store_job_release(J->store, id, J->owner, NULL);
            md_log(MD_LOG_INFO, "job %s paused for shutdown at row %lld; it resumes at the next "
                   "start (or on another replica now)", id, (long long)written_end);
            goto out;
        }
        if (J->chunk_delay_ms > 0)
            test_pause(J, slot); /* after the last chunk too: "committed, not finished" */
        if (eof && inflight == 0)
            break;
    }
    /* an S3 input's EOF is the object's end only if its stream says so */
    if (s3_input_failed(&s3in, &err))
        goto failed;
    /* the job's lease while the file is synced and put (gigabytes to S3
     * may take many leases): nobody starts it over meanwhile */
    keeper_start(&kp, J, slot, id);
    if (md_job_out_finish(&of, &fd, o.kind == 2, out_bytes, written_end - written_skipped, partial,
                   &err) != MD_OK)
        goto failed;
    if (atomic_load(&J->lost[slot]))
        goto out; /* another holds it now: its upload, not this one */
    if (is_s3(s3_out) && md_job_output_put(J->store, &J->fetch, id, spec, out_path, &err) != MD_OK)
        goto failed;
    if (is_s3(s3_out) && getenv("MD_TEST_OUTPUT_HOLD")) {
        /* for tests only: the window between the output's upload and its
         * record, held open while the file exists */
        md_log(MD_LOG_INFO, "job %s: output put; test hold before recording it", id);
        while (!atomic_load(&J->stopping) && access(getenv("MD_TEST_OUTPUT_HOLD"), F_OK) == 0)
            test_pause_ms(J, 20);
    }
    keeper_stop(&kp);
    if (atomic_load(&J->lost[slot]))
        goto out; /* another holds it now (the keeper's renewal was refused) */
    /* record_metric (issue 12): the accuracy on the version that ran, before
     * the job reads as succeeded, so a client that saw it succeed finds it */
    const char *record = json_string_value(json_object_get(spec, "record_metric"));
    int promoted = 0;
    if (record && labeled == 0 && accuracy_note[0])
        md_log(MD_LOG_WARN, "job %s: metrics.%s not recorded on model %s version %d: %s", id,
               record, model_name, md_model_version(m), accuracy_note);
    if (record && labeled > 0 &&
        md_store_record_metric(J->store, model_name, md_model_version(m), record,
                               (double)correct / (double)labeled, &promoted, &err) != MD_OK)
        md_log(MD_LOG_WARN, "job %s: recording metrics.%s on model %s version %d failed: %s", id,
               record, model_name, md_model_version(m), err.msg);
    else if (promoted) {
        md_log(MD_LOG_INFO, "job %s: model %s version %d is the default now: its metrics.%s "
               "beats the default's (promotion policy)", id, model_name, md_model_version(m),
               record);
        if (J->moved)
            J->moved(J->resolve_ctx, model_name, md_model_version(m));
    }
    md_now_iso(now);
    f = json_pack("{s:s,s:s,s:I}", "status", "succeeded", "finished_at", now, "rows_total",
                  (json_int_t)md_reader_position(r));
    jupdate(J, slot, id, f, NULL);
    json_decref(f);
    md_log(MD_LOG_INFO, "job %s succeeded: %lld rows, %.3f s computing (%.0f rows/s)", id,
           (long long)md_reader_position(r), mono() - t0,
           (double)rows_this_run / (mono() - t0 > 0 ? mono() - t0 : 1));
    goto out;
stopped_early:
    keeper_stop(&kp);
    /* stopped before any output: a lost job is the new owner's; a stop gives
     * it back; a cancel ends it with nothing written */
    if (atomic_load(&J->lost[slot]))
        goto out;
    if (atomic_load(&J->stopping)) {
        md_store_job_release(J->store, id, J->owner, NULL);
        goto out;
    }
    md_now_iso(now);
    f = json_pack("{s:s,s:s}", "status", "cancelled", "finished_at", now);
    jupdate(J, slot, id, f, NULL);
    json_decref(f);
    goto out;
reader_failed:
    keeper_stop(&kp);
    if (s3_input_failed(&s3in, &err))
        goto failed; /* the stream's own failure, not the truncation it caused */
    if (url)
        reader_err_from_url(&err, in_format);
    reader_err_name(&err, in_fd, json_string_value(json_object_get(input, "path")));
    reader_err_name(&err, label_fd, json_string_value(json_object_get(input, "label")));
failed:
    keeper_stop(&kp);
    fail_job(J, slot, id, &err);
out:
    keeper_stop(&kp);
    /* never free a chunk a worker may still answer */
    while (inflight > 0) {
        chunk_wait(&ring[head]);
        head = (head + 1) % PIPELINE;
        inflight--;
    }
    for (int i = 0; i < PIPELINE; i++) {
        chunk_reset(&ring[i]);
        pthread_mutex_destroy(&ring[i].mu);
        pthread_cond_destroy(&ring[i].cv);
    }
    if (fd >= 0)
        close(fd);
    if (in_fd >= 0)
        close(in_fd);
    if (label_fd >= 0)
        close(label_fd);
    if (of.dirfd >= 0)
        close(of.dirfd);
    free(text);
    free(conf);
    json_decref(confusion);
    md_reader_close(r);
    s3_input_close(J, id, &s3in);
    md_model_release(m);
    json_decref(job);
}

/* jobs.owner names a process as "host|pid|nonce". A holder on this host
 * whose pid is gone, or that is this pid with another nonce (a container
 * restarted as pid 1), is dead: its jobs are taken over at once instead of
 * after its lease. Holders on other hosts are trusted until their lease ends. */
static int owner_dead(const char *owner, void *ctx)
{
    md_jobs *J = ctx;
    const char *bar = strchr(owner, '|');
    if (!bar || (size_t)(bar - owner) != strlen(J->host) ||
        strncmp(owner, J->host, (size_t)(bar - owner)) != 0)
        return 0;
    long pid = strtol(bar + 1, NULL, 10);
    if (pid <= 0)
        return 0;
    if (pid == (long)getpid())
        return strcmp(owner, J->owner) != 0;
    return kill((pid_t)pid, 0) != 0 && errno == ESRCH;
}

static void *runner_main(void *arg)
{
    md_jobs *J = ((void **)arg)[0];
    int slot = (int)(intptr_t)((void **)arg)[1];
    free(arg);
    char tname[16];
    snprintf(tname, sizeof tname, "md-job%d", slot);
    pthread_setname_np(pthread_self(), tname);
    while (!atomic_load(&J->stopping)) {
        /* the oldest job nobody (alive) holds: made here, through another
         * replica, or left by a process that stopped or died */
        char id[64];
        md_err err;
        md_err_clear(&err);
        if (md_store_job_claim_next(J->store, J->owner, J->lease_s, owner_dead, J, id, &err) !=
            MD_OK) {
            md_log(MD_LOG_WARN, "jobs: %s", err.msg);
            id[0] = '\0';
        }
        if (id[0]) {
            pthread_mutex_lock(&J->mu);
            snprintf(J->running[slot], 64, "%s", id);
            atomic_store(&J->cancel[slot], 0);
            atomic_store(&J->lost[slot], 0);
            J->renewed[slot] = mono();
            pthread_mutex_unlock(&J->mu);
            run_job(J, slot, id);
            pthread_mutex_lock(&J->mu);
            J->running[slot][0] = '\0';
            pthread_mutex_unlock(&J->mu);
            continue;
        }
        /* no job to run here: a chunk of one another replica coordinates */
        md_job_chunk c;
        int found = 0;
        md_err_clear(&err);
        if (md_store_jobs_chunked(J->store) &&
            md_store_chunk_claim(J->store, J->owner, J->lease_s, NULL, &c, &found, &err) != MD_OK)
            md_log(MD_LOG_WARN, "jobs: %s", err.msg);
        if (found) {
            atomic_store(&J->cancel[slot], 0);
            md_err cerr;
            md_err_clear(&cerr);
            run_chunk(J, slot, &c, &cerr);
            continue;
        }
        pthread_mutex_lock(&J->mu);
        if (!atomic_load(&J->stopping)) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_sec += (time_t)POLL_S;
            pthread_cond_timedwait(&J->cv, &J->mu, &ts);
        }
        pthread_mutex_unlock(&J->mu);
    }
    return NULL;
}

void md_jobs_enqueue(md_jobs *J, const char *id)
{
    (void)id; /* the row is in the store; a runner here claims it now */
    pthread_mutex_lock(&J->mu);
    pthread_cond_signal(&J->cv);
    pthread_mutex_unlock(&J->mu);
}

void md_jobs_wake(md_jobs *J)
{
    pthread_mutex_lock(&J->mu);
    pthread_cond_broadcast(&J->cv);
    pthread_mutex_unlock(&J->mu);
    md_job_janitor_wake(J->janitor);
}

void md_jobs_set_retention(md_jobs *J, int retention_s)
{
    if (J && !J->janitor)
        J->janitor = md_job_janitor_start(J->store, &J->fetch, retention_s, J->lease_s);
}

md_status md_jobs_purge(md_jobs *J, const char *id, md_err *err)
{
    return md_job_remove(J->store, &J->fetch, id, "DELETE ?purge=true", err);
}

md_status md_jobs_cancel(md_jobs *J, const char *id, md_err *err)
{
    json_t *job = NULL;
    md_status st = md_store_job_get(J->store, id, &job, err);
    if (st != MD_OK)
        return st;
    const char *status = json_string_value(json_object_get(job, "status"));
    if (strcmp(status, "queued") != 0 && strcmp(status, "running") != 0) {
        st = md_err_setc(err, MD_ECONFLICT, "job_finished", "job %s is already %s", id, status);
        json_decref(job);
        return st;
    }
    json_decref(job);
    int chunked = md_store_jobs_chunked(J->store);
    /* a job over every replica: the store first. Its chunks' runners learn
     * it there at their next renewal, wherever they run, and a chunk
     * finishes only while it is not set; a coordinator here must not
     * assemble the done chunks before it is, or a chunk finishing in
     * between would be missing from its output and not from a successor's */
    int now = 0;
    if (chunked && (st = md_store_job_request_cancel(J->store, id, &now, err)) != MD_OK)
        return st;
    pthread_mutex_lock(&J->mu);
    int running = 0;
    for (int i = 0; i < J->n_runners; i++)
        if (strcmp(J->running[i], id) == 0) {
            atomic_store(&J->cancel[i], 1);
            running = 1;
        }
    if (running)
        pthread_cond_broadcast(&J->cv); /* a runner pausing for tests stops pausing */
    pthread_mutex_unlock(&J->mu);
    if (running || chunked)
        return MD_OK;
    /* queued, or running on another replica: through the store */
    return md_store_job_request_cancel(J->store, id, &now, err);
}

md_status md_jobs_start(md_store *store, int max_jobs, double lease_s, int test_chunk_delay_ms,
                        int64_t image_max_files, long long image_max_bytes,
                        const md_fetch_opts *fetch, md_model_resolver resolve,
                        md_default_moved moved, void *ctx,
                        md_jobs **out, md_err *err)
{
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/jobs", md_store_dir(store));
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        return md_err_set(err, MD_EIO, "cannot create %s: %s", dir, strerror(errno));
    md_jobs *J = md_xcalloc(1, sizeof *J);
    J->store = store;
    if (md_job_fetch_opts(store, fetch, &J->fetch, &J->fetch_s3, err) != MD_OK) {
        free(J);
        return err->status;
    }
    J->resolve = resolve;
    J->moved = moved;
    J->resolve_ctx = ctx;
    J->lease_s = lease_s > 0 ? lease_s : 30;
    J->chunk_delay_ms = test_chunk_delay_ms > 0 ? test_chunk_delay_ms : 0;
    J->image_max_files = image_max_files;
    J->image_max_bytes = image_max_bytes;
    if (gethostname(J->host, sizeof J->host - 1) != 0 || !J->host[0])
        snprintf(J->host, sizeof J->host, "localhost");
    for (char *p = J->host; *p; p++)
        if (*p == '|')
            *p = '_';
    unsigned nonce = 0;
    if (getrandom(&nonce, sizeof nonce, 0) != sizeof nonce)
        nonce = (unsigned)time(NULL) ^ (unsigned)getpid();
    snprintf(J->owner, sizeof J->owner, "%s|%ld|%08x", J->host, (long)getpid(), nonce);
    pthread_mutex_init(&J->mu, NULL);
    pthread_cond_init(&J->cv, NULL);
    J->n_runners = max_jobs;
    J->running = md_xcalloc((size_t)max_jobs, 64);
    J->cancel = md_xcalloc((size_t)max_jobs, sizeof(atomic_int));
    J->lost = md_xcalloc((size_t)max_jobs, sizeof(atomic_int));
    J->renewed = md_xcalloc((size_t)max_jobs, sizeof(_Atomic double));
    J->threads = md_xcalloc((size_t)max_jobs, sizeof(pthread_t));
    /* the runners claim what a previous process left, oldest first */
    for (int i = 0; i < max_jobs; i++) {
        void **arg = md_xmalloc(2 * sizeof(void *));
        arg[0] = J;
        arg[1] = (void *)(intptr_t)i;
        if (pthread_create(&J->threads[i], NULL, runner_main, arg) != 0) {
            free(arg);
            J->n_runners = i;
            break;
        }
    }
    *out = J;
    return MD_OK;
}

void md_jobs_stop(md_jobs *J)
{
    if (!J)
        return;
    pthread_mutex_lock(&J->mu);
    atomic_store(&J->stopping, 1);
    pthread_cond_broadcast(&J->cv);
    pthread_mutex_unlock(&J->mu);
    md_job_janitor_stop(J->janitor); /* while the runners wind down */
    J->janitor = NULL;
    for (int i = 0; i < J->n_runners; i++)
        pthread_join(J->threads[i], NULL);
    free(J->running);
    free(J->cancel);
    free(J->lost);
    free((void *)J->renewed);
    free(J->threads);
    md_job_fetch_free(&J->fetch_s3);
    pthread_mutex_destroy(&J->mu);
    pthread_cond_destroy(&J->cv);
}
