/*
 * main.c - flags, signals and the lifecycle of the modeld process.
 *
 * Start: load the configuration (exit 2 on a bad value), bind the port (exit 1
 * if it cannot), then report ready. Stop: on the first SIGTERM or SIGINT,
 * /readyz turns 503 at once so load balancers stop sending; after
 * drain_seconds the listener closes; requests in flight finish; exit 0. What
 * is still in flight drain_seconds + the longest a request may take after the
 * signal (a client trickling a body is never idle, so nothing else ends it)
 * is cut off: a log line says how many, exit 1. A second signal exits at once. Signals are blocked in every thread and taken
 * synchronously here with sigtimedwait, so no handler runs in signal context.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../config/config.h"
#include "../handlers/handlers.h"
#include "../predictor/image.h"
#include "../predictor/torch_backend.h"
#include "server.h"

extern char **environ;

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Wait up to `seconds` for a signal in `set`; returns the signal or 0. */
static int wait_signal(const sigset_t *set, double seconds)
{
    if (seconds < 0)
        seconds = 0;
    struct timespec ts = {.tv_sec = (time_t)seconds,
                          .tv_nsec = (long)((seconds - (double)(time_t)seconds) * 1e9)};
    for (;;) {
        int sig = sigtimedwait(set, NULL, &ts);
        if (sig > 0)
            return sig;
        if (errno == EAGAIN)
            return 0;
        /* EINTR: retry with the same bound; the drain loop re-checks time */
    }
}

/* The longest a request may take, in seconds: the largest of the bounds the
 * settings put on one (connection_timeout_s without a byte from the client,
 * timeout_ms for a prediction, a deploy's download). A body that keeps
 * trickling has no bound of its own: at stop, this is it. */
static int longest_request_s(const md_cfg *cfg)
{
    int s = cfg->connection_timeout_s;
    int predict = (cfg->timeout_ms + 999) / 1000;
    int download = cfg->download_connect_timeout_s + cfg->download_timeout_s;
    if (predict > s)
        s = predict;
    if (download > s)
        s = download;
    return s;
}

/* A stop signal arrived while starting (checked between model loads). */
static int stop_pending(void)
{
    sigset_t pending;
    sigpending(&pending);
    return sigismember(&pending, SIGTERM) || sigismember(&pending, SIGINT);
}

/* Replicas sharing a store: look for the others' changes every store_poll_ms,
 * and at once when the index notifies of one (PostgreSQL LISTEN/NOTIFY).
 * The same thread hands the memory malloc keeps free back to the system once
 * a second (tune_malloc lets every arena keep up to 64 MiB for speed: with a
 * worker thread per arena that is hundreds of MiB a container pays for
 * nothing once the burst is over); a busy server faults those pages in again
 * at most once a second. */
static atomic_int poll_stop;

static void *poll_main(void *arg)
{
    md_app *app = arg;
    pthread_setname_np(pthread_self(), "md-storepoll");
    int sync = app->cfg->store_poll_ms > 0;
    double interval = sync && app->cfg->store_poll_ms < 1000 ? app->cfg->store_poll_ms / 1000.0
                                                              : 1.0;
    double next = now_s(), next_sync = next, next_trim = next;
    /* with an index that notifies (PostgreSQL), a change is looked at as
     * soon as it commits; the poll stays as the fallback for a missed one */
    int notify = sync;
    while (!atomic_load(&poll_stop)) {
        next += interval;
        int notified = 0;
        while (!atomic_load(&poll_stop) && now_s() < next) {
            if (notify) {
                int r = md_store_wait_change(app->store, 20);
                if (r == 1) {
                    notified = 1;
                    break;
                }
                if (r == 0)
                    continue; /* waited its 20 ms */
                notify = r != -2; /* -2: the index cannot notify; -1: down for now */
            }
            struct timespec ts = {0, 20 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
        if (atomic_load(&poll_stop))
            break;
        if (notified) {
            md_app_sync(app);
            if (app->jobs)
                md_jobs_wake(app->jobs); /* the change may be chunks to take */
            next = now_s(); /* the next slice starts now */
        } else if (sync && now_s() >= next_sync) {
            next_sync += app->cfg->store_poll_ms / 1000.0;
            md_app_sync(app);
        }
        if (now_s() >= next_trim) {
            next_trim = now_s() + 1.0;
            md_app_judge_canaries(app);
            malloc_trim(0);
        }
    }
    return NULL;
}

/* Request bodies, tensors and answers of a batch request are 200 KB to a few
 * MB: past glibc's default mmap threshold (128 KB, adjusted only after the
 * first free) each one is an mmap, a page fault on every page and an munmap,
 * and the worker threads' arenas hand their tops back with madvise after
 * every request, to fault them in again on the next. perf put 10% of a
 * 64-row NPY request's CPU there. Keep blocks under 32 MiB in the heap and
 * trim an arena only past 64 MiB free at its top (a ceiling on what idle
 * arenas hold, not a cost: the pages stay mapped only while reused). */
static void tune_malloc(void)
{
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, 64 << 20);
    /* Four arenas per core, not glibc's 8: every worker thread of every
     * version would otherwise get an arena of its own, each holding what its
     * last batch freed. One per core held least (16 workers of a 192 MB
     * model: 246 MB against 277 MB, bench/memory.py) but cost 5-15% more
     * CPU a 1-row request in contention (bench/online_ab.sh); four per core
     * kept the old speed. Small blocks come from each thread's tcache. */
    cpu_set_t set;
    int cores = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 0;
    mallopt(M_ARENA_MAX, 4 * (cores >= 1 ? cores : 1));
    /* glibc sets its allocator up on first use, and malloc_trim's set-up
     * races with another thread's malloc_trim (it marks the arena ready
     * before filling it in). Its first use here, before any thread: under
     * ASan, which takes over malloc and mallopt, malloc_trim from a worker
     * unloading a version and from the store poller would otherwise be the
     * first (a SEGV in mtrim, seen in make asan). */
    malloc_trim(0);
}

int main(int argc, char **argv)
{
    tune_malloc();
    md_cfg cfg;
    md_cfg_action action;
    md_err err;
    md_err_clear(&err);
    if (md_cfg_load(&cfg, argc, argv, environ, &action, &err) != MD_OK) {
        fprintf(stderr, "modeld: %s\n", err.msg);
        md_cfg_free(&cfg);
        return 2;
    }
    if (action == MD_CFG_HELP) {
        md_cfg_print_help(stdout);
        md_cfg_free(&cfg);
        return 0;
    }
    if (action == MD_CFG_VERSION) {
        printf("modeld %s (libtorch %s%s)\n", MODELD_VERSION, md_torch_version(),
               md_torch_built_with_cuda() ? ", CUDA" : "");
        md_cfg_free(&cfg);
        return 0;
    }
    if (action == MD_CFG_PRINT_CONFIG) {
        char *json = md_cfg_to_json(&cfg);
        printf("%s\n", json);
        free(json);
        md_cfg_free(&cfg);
        return 0;
    }
    md_log_set_level(cfg.log_level);
    if (cfg.open_admin && cfg.admin_token.count == 0)
        md_log(MD_LOG_WARN, "open_admin: deploys, PATCH, DELETE and every other admin route "
                            "need no token; set admin_token to guard them");

    /* Block the stop signals before any thread starts, so every thread
     * inherits the mask and only sigtimedwait below receives them. */
    sigset_t stop_signals;
    sigemptyset(&stop_signals);
    sigaddset(&stop_signals, SIGTERM);
    sigaddset(&stop_signals, SIGINT);
    pthread_sigmask(SIG_BLOCK, &stop_signals, NULL);
    signal(SIGPIPE, SIG_IGN);

    static md_app app;
    app.cfg = &cfg;
    atomic_store(&app.ready, MD_STARTING);

    /* Open the store before binding: a replica that cannot read its store
     * must not take traffic. */
    md_store_opts store_opts = {
        .index_url = cfg.index_url,
        .blob_url = cfg.blob_url,
        .cache_max_bytes = cfg.cache_max_bytes,
        .s3_path_style = strcmp(cfg.s3_path_style, "true") == 0    ? 1
                         : strcmp(cfg.s3_path_style, "false") == 0 ? 0
                                                                   : -1,
    };
    if (md_store_open_opts(cfg.store, &store_opts, &app.store, &err) != MD_OK) {
        fprintf(stderr, "modeld: %s\n", err.msg);
        md_cfg_free(&cfg);
        return 1;
    }

    md_torch_init(cfg.intra_op_threads);
    app.registry = md_registry_new();
    app.traffic = md_traffic_new();
    md_registry_set_budget(app.registry, cfg.max_loaded_bytes);
    md_image_set_large_decodes(cfg.max_large_decodes > 0 ? cfg.max_large_decodes
                                                         : md_cfg_cores());
    app.model_defaults = (md_model_defaults){
        .workers = cfg.workers > 0 ? cfg.workers : md_cfg_cores(),
        .max_batch_size = cfg.max_batch_size,
        .max_delay_us = cfg.max_delay_us,
        .coalesce_us = cfg.coalesce_us,
        .queue_limit = cfg.queue_limit,
        .timeout_ms = cfg.timeout_ms,
        .job_nice = cfg.job_nice,
        .max_image_pixels = cfg.max_image_pixels,
        .max_jpeg_scans = cfg.max_jpeg_scans,
        .prepack_max_bytes = cfg.prepack_max_bytes,
    };

    /* Jobs start before the HTTP threads exist, so app.jobs is set (or NULL
     * for good, answered 503) before any handler can read it. */
    md_fetch_opts job_fetch = md_fetch_opts_from_cfg(&cfg);
    if (md_jobs_start(app.store, cfg.max_jobs, cfg.job_lease_s, cfg.test_job_chunk_delay_ms,
                      cfg.job_max_files, cfg.job_max_image_bytes, &job_fetch, md_app_resolve, md_app_default_moved, &app, &app.jobs, &err) !=
        MD_OK)
        md_log(MD_LOG_ERROR, "batch jobs are unavailable: %s", err.msg);
    md_jobs_set_retention(app.jobs, cfg.job_retention_s);
    md_http *http = NULL;
    md_metrics_mark_start();
    if (md_http_start(&cfg, md_routes, md_n_routes, &app, &http, &err) != MD_OK) {
        fprintf(stderr, "modeld: %s\n", err.msg);
        md_jobs_stop(app.jobs);
        md_store_close(app.store);
        md_cfg_free(&cfg);
        return 1;
    }
    app.http = http;
    /* Serve /healthz and /readyz (503: starting) while the models load. */
    atomic_store(&app.ready, MD_LOADING);
    app.synced_generation = md_store_generation(app.store);
    if (md_app_load_defaults(&app, stop_pending) != 0)
        app.synced_generation = -1; /* the index did not answer: the poller syncs when it does */
    pthread_t poller;
    int polling = pthread_create(&poller, NULL, poll_main, &app) == 0;
    atomic_store(&app.ready, MD_READY);
    md_log(MD_LOG_INFO, "modeld %s listening on %s:%d (libtorch %s)", MODELD_VERSION, cfg.host,
           md_http_port(http), md_torch_version());

    int sig = wait_signal(&stop_signals, 1e9);
    while (sig == 0)
        sig = wait_signal(&stop_signals, 1e9);

    atomic_store(&app.stop_signal, sig);
    atomic_store(&app.ready, MD_DRAINING);
    double signalled = now_s();
    int longest = longest_request_s(&cfg);
    double cut_at = signalled + cfg.drain_seconds + longest;
    md_log(MD_LOG_INFO,
           "signal %d: not ready; closing the listener in %d s; requests still in flight "
           "after %d s are cut off",
           sig, cfg.drain_seconds, cfg.drain_seconds + longest);

    /* Drain: keep serving for drain_seconds while load balancers notice. */
    double until = signalled + cfg.drain_seconds;
    while (now_s() < until) {
        if (wait_signal(&stop_signals, until - now_s()) > 0) {
            md_log(MD_LOG_WARN, "second signal: exiting at once");
            _exit(1);
        }
    }
    md_http_quiesce(http);
    md_log(MD_LOG_INFO, "listener closed; waiting for %ld request(s) in flight",
           md_http_in_flight(http));
    /* Twice: a keep-alive connection may start a request just after the count
     * reads zero. With the gate closed, such a request is answered at once
     * (never suspended), so the second zero is final (md_http_close_gate). */
    for (int pass = 0; pass < 2; pass++) {
        while (md_http_in_flight(http) > 0) {
            double left = cut_at - now_s();
            if (left <= 0) {
                /* _exit, not md_http_stop: libmicrohttpd aborts when stopped
                 * with a connection suspended, and a deferred thread may still
                 * use the store and the models; what is committed is durable
                 * (SQLite, blobs renamed after fsync), jobs resume elsewhere */
                md_log(MD_LOG_WARN,
                       "cutting off %ld request(s) still in flight %.0f s after signal %d "
                       "(drain_seconds %d + %d s, the longest a request may take: "
                       "connection_timeout_s, timeout_ms, download timeouts); exiting 1",
                       md_http_in_flight(http), now_s() - signalled, sig, cfg.drain_seconds,
                       longest);
                fflush(NULL);
                _exit(1);
            }
            if (wait_signal(&stop_signals, left < 0.02 ? left : 0.02) > 0) {
                md_log(MD_LOG_WARN, "second signal: exiting at once");
                _exit(1);
            }
        }
        if (pass == 0) {
            md_http_close_gate(http);
            /* for tests only: hold the window between the gate and the
             * final count, so a test can start a request in it */
            const char *pause = getenv("MD_TEST_STOP_PAUSE_MS");
            if (pause && atoi(pause) > 0) {
                md_log(MD_LOG_INFO, "requests drained; gate closed (test pause %d ms)",
                       atoi(pause));
                usleep((useconds_t)atoi(pause) * 1000);
            }
        }
    }
    md_http_stop(http);
    atomic_store(&poll_stop, 1);
    if (polling)
        pthread_join(poller, NULL);
    md_jobs_stop(app.jobs);
    md_registry_free(app.registry);
    md_traffic_free(app.traffic);
    /* the workers finish what is queued and exit; a forward may still run */
    int left = md_models_wait_stopped(10.0);
    if (left > 0)
        md_log(MD_LOG_WARN, "%d model worker thread(s) still running after 10 s; exiting anyway",
               left);
    md_store_close(app.store);
    md_log(MD_LOG_INFO, "stopped");
    md_cfg_free(&cfg);
    return 0;
}
