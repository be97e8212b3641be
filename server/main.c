/*
 * main.c - flags, signals and the lifecycle of the modeld process.
 *
 * Start: load the configuration (exit 2 on a bad value), bind the port (exit 1
 * if it cannot), then report ready. Stop: on the first SIGTERM or SIGINT,
 * /readyz turns 503 at once so load balancers stop sending; after
 * drain_seconds the listener closes; requests in flight finish; exit 0. A
 * second signal exits at once. Signals are blocked in every thread and taken
 * synchronously here with sigtimedwait, so no handler runs in signal context.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <pthread.h>
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

/* A stop signal arrived while starting (checked between model loads). */
static int stop_pending(void)
{
    sigset_t pending;
    sigpending(&pending);
    return sigismember(&pending, SIGTERM) || sigismember(&pending, SIGINT);
}

/* Replicas sharing a store: look for the others' changes every store_poll_ms. */
static atomic_int poll_stop;

static void *poll_main(void *arg)
{
    md_app *app = arg;
    pthread_setname_np(pthread_self(), "md-storepoll");
    double next = now_s();
    while (!atomic_load(&poll_stop)) {
        next += app->cfg->store_poll_ms / 1000.0;
        while (!atomic_load(&poll_stop) && now_s() < next) {
            struct timespec ts = {0, 20 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
        if (!atomic_load(&poll_stop))
            md_app_sync(app);
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
    if (md_store_open(cfg.store, &app.store, &err) != MD_OK) {
        fprintf(stderr, "modeld: %s\n", err.msg);
        md_cfg_free(&cfg);
        return 1;
    }

    md_torch_init(cfg.intra_op_threads);
    app.registry = md_registry_new();
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
    md_app_load_defaults(&app, stop_pending);
    pthread_t poller;
    int polling = cfg.store_poll_ms > 0 && pthread_create(&poller, NULL, poll_main, &app) == 0;
    atomic_store(&app.ready, MD_READY);
    md_log(MD_LOG_INFO, "modeld %s listening on %s:%d (libtorch %s)", MODELD_VERSION, cfg.host,
           md_http_port(http), md_torch_version());

    int sig = wait_signal(&stop_signals, 1e9);
    while (sig == 0)
        sig = wait_signal(&stop_signals, 1e9);

    atomic_store(&app.stop_signal, sig);
    atomic_store(&app.ready, MD_DRAINING);
    md_log(MD_LOG_INFO, "signal %d: not ready; closing the listener in %d s", sig,
           cfg.drain_seconds);

    /* Drain: keep serving for drain_seconds while load balancers notice. */
    double until = now_s() + cfg.drain_seconds;
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
            if (wait_signal(&stop_signals, 0.02) > 0) {
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
