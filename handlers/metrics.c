/*
 * metrics.c - GET /metrics: the Prometheus text exposition format (0.0.4).
 *
 * Each module writes its own families from its own counters: the HTTP layer
 * (requests and latency by route pattern and status class, connections),
 * the loaded versions (predictions, rows, batch sizes, queue depth and wait,
 * forward time, load time, errors by kind), the store (versions, bytes) and
 * the jobs (by state, rows done); this file adds the process (RSS, uptime,
 * readiness, build info). The prediction path is never locked for a scrape:
 * its counters are atomics; only the store's two queries take the store's
 * lock, which predictions do not use.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../jobs/jobs.h"
#include "../predictor/predictor.h"
#include "handlers.h"


static double mono_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static double started_at;

/* Called once at start-up, before serving. */
void md_metrics_mark_start(void) { started_at = mono_now(); }

static double rss_bytes(void)
{
    long pages = 0, resident = 0;
    FILE *f = fopen("/proc/self/statm", "r");
    if (!f)
        return 0;
    if (fscanf(f, "%ld %ld", &pages, &resident) != 2)
        resident = 0;
    fclose(f);
    return (double)resident * (double)sysconf(_SC_PAGESIZE);
}

static void process_metrics(md_app *app, FILE *f)
{
    char l[256] = "";
    md_prom_label(l, sizeof l, "version", MODELD_VERSION);
    md_prom_label(l, sizeof l, "libtorch", md_torch_version());
    md_prom_label(l, sizeof l, "cuda", md_torch_built_with_cuda() ? "1" : "0");
    md_prom_family(f, "modeld_build_info", "gauge",
                   "Always 1; the labels say the modeld and libtorch versions and whether the "
                   "build has CUDA.");
    md_prom_sample(f, "modeld_build_info", l, 1);
    md_prom_family(f, "modeld_ready", "gauge",
                   "1 when /readyz answers 200 (the deployed defaults are loaded).");
    md_prom_sample(f, "modeld_ready", "", atomic_load(&app->ready) == MD_READY ? 1 : 0);
    md_prom_family(f, "modeld_uptime_seconds", "gauge", "Seconds since the server started.");
    md_prom_sample(f, "modeld_uptime_seconds", "", started_at ? mono_now() - started_at : 0);
    md_prom_family(f, "modeld_resident_memory_bytes", "gauge",
                   "Resident set size of the process.");
    md_prom_sample(f, "modeld_resident_memory_bytes", "", rss_bytes());
}

void md_handle_metrics(md_req *req)
{
    md_app *app = md_req_app(req);
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (!f) {
        md_err err;
        md_err_set(&err, MD_ENOMEM, "out of memory for the metrics");
        md_reply_error(req, &err);
        return;
    }
    process_metrics(app, f);
    if (app->http)
        md_http_write_metrics(app->http, f);
    md_registry_write_metrics(app->registry, f);
    md_traffic_write_metrics(app->traffic, f);
    md_shadow_write_metrics(f);
    md_store_write_metrics(app->store, f);
    md_jobs_write_metrics(app->store, f);
    md_jobs_write_output_metrics(f);
    if (fclose(f) != 0 || !buf) {
        free(buf);
        md_err err;
        md_err_set(&err, MD_ENOMEM, "out of memory for the metrics");
        md_reply_error(req, &err);
        return;
    }
    md_reply_bytes(req, 200, "text/plain; version=0.0.4; charset=utf-8", buf, len);
}
