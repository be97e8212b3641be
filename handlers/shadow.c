/*
 * shadow.c - shadow versions (issue 28): a share of a model's unversioned
 * predictions is also computed by its shadow version, after the primary
 * answer is on its way, and the two outputs are compared. The client only
 * ever sees the primary's answer.
 *
 * DESIGN
 * predict.c copies the request's tensor before the primary forward takes it
 * (md_shadow_copy), and once the primary answered, hands the copy and the
 * primary's output to md_shadow_run. That submits the copy to the shadow
 * version as a batch job chunk (MD_PRIO_BATCH: its job workers, below every
 * online request), unless the shadow is not loaded here (it is never loaded
 * on the request path) or MD_SHADOW_MAX_INFLIGHT copies are already waiting
 * for it: then the copy is dropped and counted, never queued. When the
 * shadow answers, the rows are compared: top-1 agreement (the argmax of
 * each row's outputs), the largest absolute difference, and both
 * latencies. A shadow that fails counts an error and nothing else.
 * The pairs (model, primary, shadow) live for the process (at most
 * MD_SHADOW_MAX_PAIRS; a callback may hold one at any time) behind one
 * mutex for the rare new pair; their counters are atomic or under the
 * pair's own lock.
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "handlers.h"

#define MD_SHADOW_MAX_INFLIGHT 64 /* copies waiting for one shadow version */
#define MD_SHADOW_MAX_PAIRS 256

typedef struct pair {
    char name[72];
    int primary, shadow;
    atomic_llong compared, rows, agree, errors, dropped, mismatched;
    atomic_int inflight;
    pthread_mutex_t mu;
    double max_abs_diff;
    md_hist primary_latency, shadow_latency;
} pair;

static pthread_mutex_t pairs_mu = PTHREAD_MUTEX_INITIALIZER; /* adding a pair */
static pair *pairs[MD_SHADOW_MAX_PAIRS];
static atomic_int n_pairs; /* published after pairs[n] is set: read without the lock */

static pair *scan(const char *name, int primary, int shadow)
{
    int n = atomic_load_explicit(&n_pairs, memory_order_acquire);
    for (int i = 0; i < n; i++)
        if (pairs[i]->primary == primary && pairs[i]->shadow == shadow &&
            strcmp(pairs[i]->name, name) == 0)
            return pairs[i];
    return NULL;
}

static pair *find_pair(const char *name, int primary, int shadow, int create)
{
    pair *p = scan(name, primary, shadow); /* every request after the first: no lock */
    if (p || !create)
        return p;
    pthread_mutex_lock(&pairs_mu);
    p = scan(name, primary, shadow);
    int n = atomic_load(&n_pairs);
    if (!p && n < MD_SHADOW_MAX_PAIRS && strlen(name) < sizeof p->name) {
        p = md_xcalloc(1, sizeof *p);
        snprintf(p->name, sizeof p->name, "%s", name);
        p->primary = primary;
        p->shadow = shadow;
        pthread_mutex_init(&p->mu, NULL);
        md_hist_init(&p->primary_latency, md_latency_bounds, md_latency_nbounds);
        md_hist_init(&p->shadow_latency, md_latency_bounds, md_latency_nbounds);
        pairs[n] = p;
        atomic_store_explicit(&n_pairs, n + 1, memory_order_release);
    }
    pthread_mutex_unlock(&pairs_mu);
    return p;
}

int md_shadow_room(const char *name, int primary, int shadow)
{
    pair *p = find_pair(name, primary, shadow, 1);
    if (!p)
        return 0;
    if (atomic_load(&p->inflight) < MD_SHADOW_MAX_INFLIGHT)
        return 1;
    atomic_fetch_add(&p->dropped, 1); /* not even copied */
    return 0;
}

int md_shadow_copy(const md_tensor *in, md_tensor *out)
{
    memset(out, 0, sizeof *out);
    if (!in->data || in->count == 0 || in->count > SIZE_MAX / sizeof(float))
        return 0;
    out->data = malloc(in->count * sizeof(float));
    if (!out->data)
        return 0;
    memcpy(out->data, in->data, in->count * sizeof(float));
    out->ndim = in->ndim;
    memcpy(out->shape, in->shape, sizeof out->shape);
    out->count = in->count;
    out->prescaled = in->prescaled;
    out->packed = in->packed;
    return 1;
}

typedef struct run {
    pair *p;
    md_model *model;
    float *primary; /* the primary's output */
    int64_t shape[MD_MAX_DIMS];
    int ndim;
    size_t count;
    double t0;
} run;

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int64_t argmax(const float *y, int64_t n)
{
    int64_t best = 0;
    for (int64_t j = 1; j < n; j++)
        if (y[j] > y[best])
            best = j;
    return best;
}

static void shadow_done(void *ctx, md_status st, const md_err *err, const float *out,
                        const int64_t *shape, int ndim)
{
    (void)st;
    (void)err;
    run *r = ctx;
    pair *p = r->p;
    if (!out) {
        atomic_fetch_add(&p->errors, 1);
    } else {
        md_hist_observe(&p->shadow_latency, mono_s() - r->t0);
        int same = ndim == r->ndim && ndim >= 1;
        for (int d = 0; same && d < ndim; d++)
            same = shape[d] == r->shape[d];
        if (!same) {
            atomic_fetch_add(&p->mismatched, 1);
        } else {
            int64_t rows = r->shape[0];
            int64_t width = rows > 0 ? (int64_t)(r->count / (size_t)rows) : 0;
            long long agree = 0;
            double diff = 0;
            for (int64_t i = 0; i < rows; i++) {
                const float *a = r->primary + i * width, *b = out + i * width;
                if (width > 0 && argmax(a, width) == argmax(b, width))
                    agree++;
                for (int64_t j = 0; j < width; j++) {
                    double d = fabs((double)a[j] - (double)b[j]);
                    if (d > diff || isnan(d))
                        diff = isnan(d) ? INFINITY : d;
                }
            }
            atomic_fetch_add(&p->compared, 1);
            atomic_fetch_add(&p->rows, rows);
            atomic_fetch_add(&p->agree, agree);
            pthread_mutex_lock(&p->mu);
            if (diff > p->max_abs_diff)
                p->max_abs_diff = diff;
            pthread_mutex_unlock(&p->mu);
        }
    }
    atomic_fetch_sub(&p->inflight, 1);
    md_model_release(r->model);
    free(r->primary);
    free(r);
}

/* Drop a copy: counted, never queued. */
static void drop(pair *p, md_model *m, md_tensor *in)
{
    if (p)
        atomic_fetch_add(&p->dropped, 1);
    md_model_release(m);
    md_tensor_free(in);
}

void md_shadow_run(md_app *app, const char *name, int primary, int shadow, md_tensor *in,
                   const float *out, const int64_t *shape, int ndim, double primary_s)
{
    pair *p = find_pair(name, primary, shadow, 1);
    if (p && atomic_load(&p->inflight) >= MD_SHADOW_MAX_INFLIGHT) {
        drop(p, NULL, in); /* before the registry's lock: a drop costs next to nothing */
        return;
    }
    /* never loaded on the request path: a shadow unloaded here is skipped */
    md_model *m = p ? md_registry_get(app->registry, name, shadow) : NULL;
    size_t count = 1;
    int ok = m && ndim >= 1 && ndim <= MD_MAX_DIMS;
    for (int d = 0; ok && d < ndim; d++) {
        ok = shape[d] >= 0 && (shape[d] == 0 || count <= SIZE_MAX / sizeof(float) /
                                                               (size_t)shape[d]);
        count *= ok ? (size_t)shape[d] : 1;
    }
    if (!ok) {
        drop(p, m, in);
        return;
    }
    if (atomic_fetch_add(&p->inflight, 1) >= MD_SHADOW_MAX_INFLIGHT) {
        atomic_fetch_sub(&p->inflight, 1);
        drop(p, m, in);
        return;
    }
    run *r = calloc(1, sizeof *r);
    float *copy = r ? malloc(count ? count * sizeof(float) : 1) : NULL;
    if (!copy) {
        free(r);
        atomic_fetch_sub(&p->inflight, 1);
        drop(p, m, in);
        return;
    }
    memcpy(copy, out, count * sizeof(float));
    r->p = p;
    r->model = m;
    r->primary = copy;
    memcpy(r->shape, shape, (size_t)ndim * sizeof *shape);
    r->ndim = ndim;
    r->count = count;
    r->t0 = mono_s();
    md_hist_observe(&p->primary_latency, primary_s);
    md_err err;
    md_err_clear(&err);
    /* a job chunk: the shadow's job workers, below every online request;
     * submit takes `in` even when it fails */
    if (md_model_submit(m, in, MD_PRIO_BATCH, shadow_done, r, &err) != MD_OK) {
        atomic_fetch_add(&p->errors, 1);
        atomic_fetch_sub(&p->inflight, 1);
        md_model_release(m);
        free(r->primary);
        free(r);
    }
}

static json_t *pair_json(pair *p)
{
    long long rows = atomic_load(&p->rows), agree = atomic_load(&p->agree);
    pthread_mutex_lock(&p->mu);
    double diff = p->max_abs_diff;
    pthread_mutex_unlock(&p->mu);
    double q[4] = {md_hist_quantile(&p->primary_latency, 0.5),
                   md_hist_quantile(&p->primary_latency, 0.99),
                   md_hist_quantile(&p->shadow_latency, 0.5),
                   md_hist_quantile(&p->shadow_latency, 0.99)};
    json_t *ms[4];
    for (int i = 0; i < 4; i++)
        ms[i] = isnan(q[i]) ? json_null() : json_real(q[i] * 1e3);
    long long compared = atomic_load(&p->compared);
    return json_pack("{s:i,s:i,s:I,s:I,s:o,s:o,s:I,s:I,s:I,s:o,s:o,s:o,s:o}", "primary",
                     p->primary, "shadow", p->shadow, "compared", (json_int_t)compared, "rows",
                     (json_int_t)rows, "agreement",
                     rows ? json_real((double)agree / (double)rows) : json_null(),
                     "max_abs_diff", compared ? json_real(isinf(diff) ? 1e308 : diff)
                                              : json_null(),
                     "errors", (json_int_t)atomic_load(&p->errors), "dropped",
                     (json_int_t)atomic_load(&p->dropped), "shape_mismatches",
                     (json_int_t)atomic_load(&p->mismatched), "primary_p50_ms", ms[0],
                     "primary_p99_ms", ms[1], "shadow_p50_ms", ms[2], "shadow_p99_ms", ms[3]);
}

json_t *md_shadow_json(const char *name)
{
    json_t *a = json_array();
    int n = atomic_load_explicit(&n_pairs, memory_order_acquire);
    for (int i = 0; i < n; i++) /* pairs are only appended, never freed */
        if (strcmp(pairs[i]->name, name) == 0)
            json_array_append_new(a, pair_json(pairs[i]));
    return a;
}

void md_shadow_write_metrics(FILE *f)
{
    int n = atomic_load_explicit(&n_pairs, memory_order_acquire);
    static const char *const names[] = {"modeld_shadow_compared_total",
                                        "modeld_shadow_rows_agreeing_total",
                                        "modeld_shadow_rows_total", "modeld_shadow_errors_total",
                                        "modeld_shadow_dropped_total"};
    static const char *const help[] = {
        "Requests a shadow version computed and compared with the primary's answer.",
        "Rows whose top-1 class the shadow and the primary agree on.",
        "Rows compared.",
        "Requests the shadow version failed (the primary's answer is not affected).",
        "Requests not sent to the shadow: it was not loaded here or too many waited for it."};
    for (int k = 0; k < 5; k++) {
        md_prom_family(f, names[k], "counter", help[k]);
        for (int i = 0; i < n; i++) {
            pair *p = pairs[i];
            atomic_llong *c[] = {&p->compared, &p->agree, &p->rows, &p->errors, &p->dropped};
            char labels[160];
            snprintf(labels, sizeof labels, "model=\"%s\",primary=\"%d\",shadow=\"%d\"", p->name,
                     p->primary, p->shadow);
            md_prom_sample(f, names[k], labels, (double)atomic_load(c[k]));
        }
    }
    md_prom_family(f, "modeld_shadow_max_abs_diff", "gauge",
                   "The largest absolute difference between a shadow's and the primary's "
                   "outputs so far.");
    for (int i = 0; i < n; i++) {
        pair *p = pairs[i];
        pthread_mutex_lock(&p->mu);
        double d = p->max_abs_diff;
        pthread_mutex_unlock(&p->mu);
        char labels[160];
        snprintf(labels, sizeof labels, "model=\"%s\",primary=\"%d\",shadow=\"%d\"", p->name,
                 p->primary, p->shadow);
        md_prom_sample(f, "modeld_shadow_max_abs_diff", labels, d);
    }
}

int md_shadow_numbers(const char *name, int primary, int shadow, long long *compared,
                      long long *errors, double *agreement)
{
    pair *p = find_pair(name, primary, shadow, 0);
    if (!p)
        return 0;
    long long rows = atomic_load(&p->rows), agree = atomic_load(&p->agree);
    /* a shadow answer of another shape agrees on nothing */
    *compared = atomic_load(&p->compared) + atomic_load(&p->mismatched);
    *errors = atomic_load(&p->errors);
    *agreement = rows && !atomic_load(&p->mismatched) ? (double)agree / (double)rows : 0;
    return 1;
}
