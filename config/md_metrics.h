/*
 * md_metrics.h - lock-free counters and histograms, written out in the
 * Prometheus text exposition format (version 0.0.4) for GET /metrics.
 *
 * The lowest layer, like md_err.h: every module keeps its own counters
 * (atomics it bumps on its hot path, never a lock) and writes them with the
 * helpers here when /metrics is scraped. A scrape only reads atomics, so it
 * cannot slow a prediction down.
 *
 * Thread safety: md_hist_observe and the reads are lock-free and may run on
 * any thread; a scrape may see one histogram's buckets a few observations
 * apart from its count (Prometheus tolerates that; each value is monotonic).
 */
#ifndef MD_METRICS_H
#define MD_METRICS_H

#include <stdatomic.h>
#include <stdio.h>

#define MD_HIST_MAX_BUCKETS 16

/* A histogram with fixed upper bounds (in the unit it is observed in,
 * seconds or rows). Zero-initialise, then md_hist_init. */
typedef struct md_hist {
    int n;                                        /* finite bounds */
    double bounds[MD_HIST_MAX_BUCKETS];           /* increasing */
    atomic_llong counts[MD_HIST_MAX_BUCKETS + 1]; /* per bucket, not cumulative; last: +Inf */
    atomic_llong sum_micro;                       /* sum of observations x 1e6 */
} md_hist;

/* Bounds used across modeld: latencies in seconds (100 us .. 10 s) and batch
 * sizes in rows (1 .. 1024). */
extern const double md_latency_bounds[];
extern const int md_latency_nbounds;
extern const double md_rows_bounds[];
extern const int md_rows_nbounds;

/* Set the bounds (n <= MD_HIST_MAX_BUCKETS, copied) and zero the counts. */
void md_hist_init(md_hist *h, const double *bounds, int n);
/* Count one observation of `v`. Lock-free. */
void md_hist_observe(md_hist *h, double v);
/* Observations so far. */
long long md_hist_count(const md_hist *h);
/* The q-quantile (0 <= q <= 1) estimated as Prometheus' histogram_quantile
 * does: linear within the bucket that holds it, the last finite bound for
 * the +Inf bucket. NAN when nothing was observed. */
double md_hist_quantile(const md_hist *h, double q);

/* "# HELP name help\n# TYPE name type\n". */
void md_prom_family(FILE *f, const char *name, const char *type, const char *help);
/* One sample: name{labels} value. `labels` is the inside of the braces,
 * already escaped (md_prom_label), or "" for none. */
void md_prom_sample(FILE *f, const char *name, const char *labels, double value);
/* The histogram's _bucket (cumulative, le="..."), _sum and _count samples
 * under `labels` (already escaped; may be ""). */
void md_prom_hist(FILE *f, const char *name, const char *labels, const md_hist *h);
/* Append `key="value"` (value escaped: backslash, quote, newline) to `out`
 * (size `size`, always NUL-terminated), with a ',' before it unless `out` is
 * empty. */
void md_prom_label(char *out, size_t size, const char *key, const char *value);

#endif
