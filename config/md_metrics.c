/* md_metrics.c - see md_metrics.h. */
#include "md_metrics.h"

#include <math.h>
#include <string.h>

const double md_latency_bounds[] = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
                                    0.025,  0.05,    0.1,    0.25,  0.5,    1,     2.5,
                                    5,      10};
const int md_latency_nbounds = (int)(sizeof md_latency_bounds / sizeof md_latency_bounds[0]);
const double md_rows_bounds[] = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024};
const int md_rows_nbounds = (int)(sizeof md_rows_bounds / sizeof md_rows_bounds[0]);

void md_hist_init(md_hist *h, const double *bounds, int n)
{
    if (n > MD_HIST_MAX_BUCKETS)
        n = MD_HIST_MAX_BUCKETS;
    h->n = n;
    memcpy(h->bounds, bounds, sizeof(double) * (size_t)n);
    for (int i = 0; i <= MD_HIST_MAX_BUCKETS; i++)
        atomic_init(&h->counts[i], 0);
    atomic_init(&h->sum_micro, 0);
}

void md_hist_observe(md_hist *h, double v)
{
    if (!(v >= 0))
        v = 0; /* NaN or a clock step back */
    int i = 0;
    while (i < h->n && v > h->bounds[i])
        i++;
    atomic_fetch_add_explicit(&h->counts[i], 1, memory_order_relaxed);
    double micro = v * 1e6;
    atomic_fetch_add_explicit(&h->sum_micro, micro < 9e15 ? (long long)micro : 0,
                              memory_order_relaxed);
}

long long md_hist_count(const md_hist *h)
{
    long long n = 0;
    for (int i = 0; i <= h->n; i++)
        n += atomic_load_explicit(&((md_hist *)h)->counts[i], memory_order_relaxed);
    return n;
}

double md_hist_quantile(const md_hist *h, double q)
{
    long long c[MD_HIST_MAX_BUCKETS + 1], total = 0;
    for (int i = 0; i <= h->n; i++) {
        c[i] = atomic_load_explicit(&((md_hist *)h)->counts[i], memory_order_relaxed);
        total += c[i];
    }
    if (total == 0)
        return NAN;
    double rank = q * (double)total;
    long long cum = 0;
    for (int i = 0; i <= h->n; i++) {
        if (c[i] == 0 || (double)(cum + c[i]) < rank) {
            cum += c[i];
            continue;
        }
        if (i == h->n)
            return h->n ? h->bounds[h->n - 1] : NAN;
        double lo = i ? h->bounds[i - 1] : 0, hi = h->bounds[i];
        return lo + (hi - lo) * ((rank - (double)cum) / (double)c[i]);
    }
    return h->n ? h->bounds[h->n - 1] : NAN;
}

void md_prom_family(FILE *f, const char *name, const char *type, const char *help)
{
    fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void value(FILE *f, double v)
{
    if (isinf(v))
        fputs(v > 0 ? "+Inf" : "-Inf", f);
    else if (v == floor(v) && fabs(v) < 1e15)
        fprintf(f, "%.0f", v);
    else
        fprintf(f, "%.17g", v);
}

void md_prom_sample(FILE *f, const char *name, const char *labels, double v)
{
    if (labels && labels[0])
        fprintf(f, "%s{%s} ", name, labels);
    else
        fprintf(f, "%s ", name);
    value(f, v);
    fputc('\n', f);
}

void md_prom_hist(FILE *f, const char *name, const char *labels, const md_hist *h)
{
    long long cum = 0;
    const char *sep = labels && labels[0] ? "," : "";
    for (int i = 0; i <= h->n; i++) {
        cum += atomic_load_explicit(&((md_hist *)h)->counts[i], memory_order_relaxed);
        fprintf(f, "%s_bucket{%s%sle=\"", name, labels ? labels : "", sep);
        if (i < h->n)
            fprintf(f, "%.6g", h->bounds[i]); /* the bounds have few digits */
        else
            fputs("+Inf", f);
        fprintf(f, "\"} %lld\n", cum);
    }
    char n[160];
    snprintf(n, sizeof n, "%s_sum", name);
    md_prom_sample(f, n, labels,
                   (double)atomic_load_explicit(&((md_hist *)h)->sum_micro,
                                                memory_order_relaxed) / 1e6);
    snprintf(n, sizeof n, "%s_count", name);
    md_prom_sample(f, n, labels, (double)cum);
}

void md_prom_label(char *out, size_t size, const char *key, const char *v)
{
    size_t n = strlen(out);
    if (size == 0 || n + 1 >= size)
        return;
    int w = snprintf(out + n, size - n, "%s%s=\"", n ? "," : "", key);
    if (w < 0 || (size_t)w >= size - n) {
        out[n] = '\0';
        return;
    }
    n += (size_t)w;
    for (; *v && n + 3 < size; v++) {
        if (*v == '\\' || *v == '"') {
            out[n++] = '\\';
            out[n++] = *v;
        } else if (*v == '\n') {
            out[n++] = '\\';
            out[n++] = 'n';
        } else {
            out[n++] = *v;
        }
    }
    if (n + 1 < size)
        out[n++] = '"';
    out[n] = '\0';
}
