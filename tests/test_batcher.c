/*
 * test_batcher.c - unit tests of the dynamic batcher (predictor/batcher.c)
 * and the model registry (predictor/registry.c) over a FAKE backend.
 *
 * The fake replaces libtorch at the module edge through the linker seam:
 * this binary must be linked with
 *     -Wl,--wrap=md_torch_load -Wl,--wrap=md_torch_forward -Wl,--wrap=md_torch_free
 *     -Wl,--wrap=md_torch_replica -Wl,--wrap=md_torch_forward_quiet
 *     -Wl,--wrap=md_torch_resident_bytes
 * (LDFLAGS_test_batcher in the Makefile), so batcher.o's calls reach the
 * __wrap_ functions below. The fake forward records every batch (its rows and
 * the first value of each row), returns out = 2 * input (same shape), and
 * has the real thing's awkward modes, chosen by a row's first value: it
 * blocks on a "gate" (GATE: a stall the test releases, so a test can hold a
 * worker busy while requests pile up), fails (FAIL: a forward that throws),
 * answers a row too many (BADROWS), or answers rows as wide as the batch
 * (WIDE: x @ x.t(), an output width that depends on the batch); and with
 * g_need_width set it fails rows of any other width, as a Linear layer does.
 * Every wait is bounded (WAIT_S) so a failure never hangs; no bound depends
 * on the machine's speed. md_torch_forward_quiet is the same fake forward,
 * recorded as quiet (the real one does not log libtorch's message).
 * md_torch_replica (a worker's prepacked copy) is wrapped too: a fake replica
 * is a model of its own whose forwards are recorded as such, that fails the
 * test if two threads ever forward on it (XNNPACK's operators keep per-call
 * state), that can refuse to be made (g_replica_refuse) and that fails rows
 * starting with XNNFAIL which its base model computes (an input the packed
 * kernels refuse). Models are loaded with prepack off unless g_prepack_max.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../predictor/predictor.h"
#include "../predictor/torch_backend.h"

#define WAIT_S 5.0
#define GATE -7777.0f    /* a row starting with this blocks its forward until the gate opens */
#define FAIL -5555.0f    /* ... makes the forward fail */
#define BADROWS -3333.0f /* ... makes the forward answer one row too many */
#define WIDE -4444.0f    /* ... makes the forward answer x @ x.t(): [rows, rows] */
#define XNNFAIL -6666.0f /* ... makes a replica's forward fail (its base computes it) */

/* ---- the fake backend ---- */

struct md_torch_model {
    int id;
    char path[64];
    int replica;         /* made by md_torch_replica */
    int busy;            /* a replica: forwards running on it now (g_mu) */
};

typedef struct batch_rec {
    int model;
    int replica;         /* computed on a worker's replica */
    int quiet;           /* by md_torch_forward_quiet: a failure would not be logged */
    int64_t rows;
    float first[64]; /* first value of each of the first 64 rows */
    double t;
} batch_rec;

#define MAX_BATCHES 8192

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv;

static int g_loads;             /* successful fake loads */
static int g_load_calls;        /* every call of __wrap_md_torch_load */
static int g_frees;             /* fake models freed */
static long g_seq;              /* event counter: callbacks and frees */
static long g_free_seq[64];     /* by model id: when it was freed (0 = not yet) */
static int g_next_id = 1;
static batch_rec g_batches[MAX_BATCHES];
static int g_nbatches;
static int g_gate_open;
static int g_gate_entered;
static int g_forward_sleep_us;
static int64_t g_need_width;     /* nonzero: the forward fails rows of another width */
static _Thread_local int g_loading; /* set around md_model_load: its test forward is not recorded */
static long long g_prepack_max;  /* prepack_max_bytes of the models load_ex makes (0: off) */
static int g_coalesce_us;        /* batching.coalesce_us of the models load_ex makes (0: off) */
static int g_replica_refuse;     /* md_torch_replica fails */
static int g_replica_calls, g_replicas, g_replica_frees, g_replica_shared;
static long long g_resident = 1000; /* what md_torch_resident_bytes says of the next loads */

md_status __wrap_md_torch_resident_bytes(const md_torch_model *m, size_t *out, md_err *err);
md_status __wrap_md_torch_resident_bytes(const md_torch_model *m, size_t *out, md_err *err)
{
    (void)m;
    (void)err;
    pthread_mutex_lock(&g_mu);
    *out = (size_t)g_resident;
    pthread_mutex_unlock(&g_mu);
    return MD_OK;
}

md_status __wrap_md_torch_load(const char *path, const char *device, md_dtype input_dtype,
                               md_torch_model **out, md_err *err);
md_status __wrap_md_torch_forward(md_torch_model *m, const float *input, const int64_t *shape,
                                  int ndim, float **out, int64_t *out_shape, int *out_ndim,
                                  md_err *err);
md_status __wrap_md_torch_forward_quiet(md_torch_model *m, const float *input,
                                        const int64_t *shape, int ndim, float **out,
                                        int64_t *out_shape, int *out_ndim, md_err *err);
void __wrap_md_torch_free(md_torch_model *m);
md_status __wrap_md_torch_replica(const md_torch_model *base, size_t max_weight_bytes,
                                  md_torch_model **out, size_t *packed_bytes, md_err *err);

md_status __wrap_md_torch_replica(const md_torch_model *base, size_t max_weight_bytes,
                                  md_torch_model **out, size_t *packed_bytes, md_err *err)
{
    *out = NULL;
    *packed_bytes = 1000;
    pthread_mutex_lock(&g_mu);
    g_replica_calls++;
    int refuse = g_replica_refuse;
    pthread_mutex_unlock(&g_mu);
    if (refuse)
        return md_err_setc(err, MD_EUNPROC, "prepack_failed", "fake prepack refused");
    if (max_weight_bytes < 1000) /* too large to pack: nothing made */
        return MD_OK;
    md_torch_model *r = calloc(1, sizeof *r);
    r->id = base->id;
    r->replica = 1;
    snprintf(r->path, sizeof r->path, "%s", base->path);
    pthread_mutex_lock(&g_mu);
    g_replicas++;
    pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
    *out = r;
    return MD_OK;
}

md_status __wrap_md_torch_load(const char *path, const char *device, md_dtype input_dtype,
                               md_torch_model **out, md_err *err)
{
    (void)device;
    (void)input_dtype;
    pthread_mutex_lock(&g_mu);
    g_load_calls++;
    if (strncmp(path, "fail", 4) == 0) {
        pthread_mutex_unlock(&g_mu);
        *out = NULL;
        return md_err_setc(err, MD_EUNPROC, "invalid_model", "fake load of %s failed", path);
    }
    md_torch_model *m = calloc(1, sizeof *m);
    m->id = g_next_id++;
    snprintf(m->path, sizeof m->path, "%s", path);
    g_loads++;
    pthread_mutex_unlock(&g_mu);
    *out = m;
    return MD_OK;
}

static struct timespec deadline_in(double secs)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    long long ns = (long long)ts.tv_nsec + (long long)(secs * 1e9);
    ts.tv_sec += (time_t)(ns / 1000000000LL);
    ts.tv_nsec = (long)(ns % 1000000000LL);
    return ts;
}

static double mono(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static md_status fake_forward_body(md_torch_model *m, const float *input, const int64_t *shape,
                                   int ndim, float **out, int64_t *out_shape, int *out_ndim,
                                   int quiet, md_err *err);

/* A packed copy keeps per-call state: two forwards on one at the same time
 * (from the pool of a version's copies) are counted in g_replica_shared. */
static md_status fake_forward(md_torch_model *m, const float *input, const int64_t *shape,
                              int ndim, float **out, int64_t *out_shape, int *out_ndim, int quiet,
                              md_err *err)
{
    if (m->replica) {
        pthread_mutex_lock(&g_mu);
        if (m->busy++ > 0)
            g_replica_shared++;
        pthread_mutex_unlock(&g_mu);
    }
    md_status st = fake_forward_body(m, input, shape, ndim, out, out_shape, out_ndim, quiet, err);
    if (m->replica) {
        pthread_mutex_lock(&g_mu);
        m->busy--;
        pthread_mutex_unlock(&g_mu);
    }
    return st;
}

static md_status fake_forward_body(md_torch_model *m, const float *input, const int64_t *shape,
                                   int ndim, float **out, int64_t *out_shape, int *out_ndim,
                                   int quiet, md_err *err)
{
    int64_t rows = shape[0], per = 1;
    for (int d = 1; d < ndim; d++)
        per *= shape[d];
    int gate = 0, fail = 0, badrows = 0, wide = 0, xnnfail = 0;
    for (int64_t r = 0; r < rows; r++) {
        xnnfail |= m->replica && input[r * per] == XNNFAIL;
        gate |= input[r * per] == GATE;
        fail |= input[r * per] == FAIL;
        badrows |= input[r * per] == BADROWS;
        wide |= input[r * per] == WIDE;
    }
    if (!g_loading) {
        pthread_mutex_lock(&g_mu);
        if (g_nbatches < MAX_BATCHES) {
            batch_rec *b = &g_batches[g_nbatches++];
            b->model = m->id;
            b->replica = m->replica;
            b->quiet = quiet;
            b->rows = rows;
            b->t = mono();
            for (int64_t r = 0; r < rows && r < 64; r++)
                b->first[r] = input[r * per];
            pthread_cond_broadcast(&g_cv); /* a test may wait for this batch */
        }
        if (gate) {
            g_gate_entered++;
            pthread_cond_broadcast(&g_cv);
            struct timespec dl = deadline_in(WAIT_S);
            while (!g_gate_open)
                if (pthread_cond_timedwait(&g_cv, &g_mu, &dl) == ETIMEDOUT)
                    break;
        }
        pthread_mutex_unlock(&g_mu);
        if (g_forward_sleep_us)
            usleep((useconds_t)g_forward_sleep_us);
    }
    if (fail)
        return md_err_setc(err, MD_EUNPROC, "forward_failed", "fake forward failed");
    if (xnnfail)
        return md_err_setc(err, MD_EUNPROC, "forward_failed", "fake replica refused the input");
    if (g_need_width && per != g_need_width)
        return md_err_setc(err, MD_EUNPROC, "forward_failed",
                           "fake forward: mat1 and mat2 shapes cannot be multiplied (%lldx%lld "
                           "and %lldx8)",
                           (long long)rows, (long long)per, (long long)g_need_width);
    if (wide) { /* x @ x.t() */
        float *o = malloc(sizeof(float) * (size_t)(rows * rows));
        for (int64_t i = 0; i < rows; i++)
            for (int64_t j = 0; j < rows; j++) {
                float acc = 0;
                for (int64_t c = 0; c < per; c++)
                    acc += input[i * per + c] * input[j * per + c];
                o[i * rows + j] = acc;
            }
        out_shape[0] = rows;
        out_shape[1] = rows;
        *out_ndim = 2;
        *out = o;
        return MD_OK;
    }
    int64_t out_rows = rows + badrows;
    float *o = malloc(sizeof(float) * (size_t)(out_rows * per) + 1);
    for (int64_t i = 0; i < rows * per; i++)
        o[i] = 2.0f * input[i];
    for (int64_t i = rows * per; i < out_rows * per; i++)
        o[i] = 0.0f;
    if (ndim <= MD_MAX_DIMS) {
        memcpy(out_shape, shape, sizeof(int64_t) * (size_t)ndim);
        *out_ndim = ndim;
    } else { /* libtorch allows more dims in; flatten the answer to 2-D */
        out_shape[1] = per;
        *out_ndim = 2;
    }
    out_shape[0] = out_rows;
    *out = o;
    return MD_OK;
}

md_status __wrap_md_torch_forward(md_torch_model *m, const float *input, const int64_t *shape,
                                  int ndim, float **out, int64_t *out_shape, int *out_ndim,
                                  md_err *err)
{
    return fake_forward(m, input, shape, ndim, out, out_shape, out_ndim, 0, err);
}

md_status __wrap_md_torch_forward_quiet(md_torch_model *m, const float *input,
                                        const int64_t *shape, int ndim, float **out,
                                        int64_t *out_shape, int *out_ndim, md_err *err)
{
    return fake_forward(m, input, shape, ndim, out, out_shape, out_ndim, 1, err);
}

void __wrap_md_torch_free(md_torch_model *m)
{
    if (!m)
        return;
    pthread_mutex_lock(&g_mu);
    if (m->replica) {
        /* freeing a real replica takes a while (libtorch): a worker that
         * touched its model after this while another worker, the last,
         * freed the model was a use-after-free (review; ASan sees it with
         * this pause, make asan runs this test) */
        pthread_mutex_unlock(&g_mu);
        usleep(20000);
        pthread_mutex_lock(&g_mu);
        g_replica_frees++;
        pthread_cond_broadcast(&g_cv);
        pthread_mutex_unlock(&g_mu);
        free(m);
        return;
    }
    g_frees++;
    if (m->id < 64)
        g_free_seq[m->id] = ++g_seq;
    pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
    free(m);
}

/* ---- waiting ---- */

/* Wait (bounded) until `expr`, evaluated under g_mu, holds; `ok` gets the result. */
#define WAIT_FOR(ok, expr, secs)                                                      \
    do {                                                                              \
        struct timespec dl_ = deadline_in(secs);                                      \
        pthread_mutex_lock(&g_mu);                                                    \
        while (!((ok) = (expr)))                                                      \
            if (pthread_cond_timedwait(&g_cv, &g_mu, &dl_) == ETIMEDOUT) {            \
                (ok) = (expr);                                                        \
                break;                                                                \
            }                                                                         \
        pthread_mutex_unlock(&g_mu);                                                  \
    } while (0)

#define ASSERT_WAIT(expr)                                                             \
    do {                                                                              \
        int ok_;                                                                      \
        WAIT_FOR(ok_, expr, WAIT_S);                                                  \
        if (!ok_)                                                                     \
            fail_msg("timed out after %.0f s waiting for %s", WAIT_S, #expr);         \
    } while (0)

/* Read an int under the lock. */
static int locked_int(const int *p)
{
    pthread_mutex_lock(&g_mu);
    int v = *p;
    pthread_mutex_unlock(&g_mu);
    return v;
}

static long locked_long(const long *p)
{
    pthread_mutex_lock(&g_mu);
    long v = *p;
    pthread_mutex_unlock(&g_mu);
    return v;
}

static void open_gate(void)
{
    pthread_mutex_lock(&g_mu);
    g_gate_open = 1;
    pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
}

/* ---- requests ---- */

typedef struct req {
    int calls;
    md_status st;
    char code[48];
    char msg[MD_ERR_MSG_MAX];
    float out[512];
    size_t count;
    int64_t shape[MD_MAX_DIMS];
    int ndim;
    double t_submit, t_done;
    long seq;
} req;

#define MAX_REQS 2048
static req g_req[MAX_REQS];

static void on_done(void *ctx, md_status st, const md_err *err, const float *out,
                    const int64_t *out_shape, int ndim)
{
    req *r = ctx;
    pthread_mutex_lock(&g_mu);
    r->calls++;
    r->st = st;
    r->t_done = mono();
    r->seq = ++g_seq;
    if (st != MD_OK) {
        snprintf(r->code, sizeof r->code, "%s", err ? md_err_code(err) : "");
        snprintf(r->msg, sizeof r->msg, "%s", err ? err->msg : "");
    } else {
        r->ndim = ndim;
        size_t n = 1;
        for (int d = 0; d < ndim; d++)
            n *= (size_t)(r->shape[d] = out_shape[d]);
        r->count = n;
        memcpy(r->out, out, sizeof(float) * (n < 512 ? n : 512));
    }
    pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
}

/* Submit `rows` rows of `cols` values (row-major) on `m` for g_req[i]. */
static md_status submit_prio(md_model *m, int i, int rows, int cols, const float *vals,
                             md_priority prio, md_err *err)
{
    md_tensor t = {0};
    t.ndim = 2;
    t.shape[0] = rows;
    t.shape[1] = cols;
    t.count = (size_t)rows * (size_t)cols;
    t.data = malloc(sizeof(float) * t.count);
    memcpy(t.data, vals, sizeof(float) * t.count);
    g_req[i].t_submit = mono();
    md_err_clear(err);
    md_status st = md_model_submit(m, &t, prio, on_done, &g_req[i], err);
    assert_null(t.data); /* ownership taken, even on failure */
    return st;
}

static md_status submit(md_model *m, int i, int rows, int cols, const float *vals, md_err *err)
{
    return submit_prio(m, i, rows, cols, vals, MD_PRIO_ONLINE, err);
}

static void submit_ok(md_model *m, int i, int rows, int cols, const float *vals)
{
    md_err err;
    md_status st = submit(m, i, rows, cols, vals, &err);
    if (st != MD_OK)
        fail_msg("submit %d: status %d (%s)", i, (int)st, err.msg);
}

static int reqs_done(int from, int to)
{
    for (int i = from; i < to; i++)
        if (g_req[i].calls == 0)
            return 0;
    return 1;
}

/* ---- models ---- */

static md_model *g_held[16]; /* models this test still holds, released by the teardown */
static md_registry *g_reg;

static void hold(md_model *m)
{
    for (int i = 0; i < 16; i++)
        if (!g_held[i]) {
            g_held[i] = m;
            return;
        }
    fail_msg("too many models held");
}

static void drop(md_model *m)
{
    for (int i = 0; i < 16; i++)
        if (g_held[i] == m)
            g_held[i] = NULL;
    md_model_release(m);
}

/* Load `name` version `version` with `config` (JSON text) and these defaults;
 * *fake_id gets the fake backend's id for the model. */
static int g_job_nice; /* job_nice of the models load_ex makes (0: not lowered) */

static md_model *load_ex(const char *name, int version, const char *config, int workers,
                         int max_batch, int delay_us, int queue_limit, int timeout_ms,
                         int *fake_id)
{
    json_error_t jerr;
    json_t *cfg = config ? json_loads(config, 0, &jerr) : NULL;
    if (config && !cfg)
        fail_msg("bad test config %s: %s", config, jerr.text);
    md_model_defaults def = {.workers = workers,
                             .max_batch_size = max_batch,
                             .max_delay_us = delay_us,
                             .queue_limit = queue_limit,
                             .timeout_ms = timeout_ms,
                             .job_nice = g_job_nice,
                             .prepack_max_bytes = g_prepack_max,
                             .coalesce_us = g_coalesce_us};
    char path[64];
    snprintf(path, sizeof path, "fake-%s-v%d", name, version);
    int calls_before = locked_int(&g_load_calls);
    int id_before = locked_int(&g_next_id);
    md_model *m = NULL;
    md_err err;
    md_err_clear(&err);
    g_loading = 1;
    md_status st = md_model_load(name, version, path, cfg, &def, &m, &err);
    g_loading = 0;
    json_decref(cfg);
    if (locked_int(&g_load_calls) == calls_before)
        fail_msg("the fake backend was not called: link this test with -Wl,--wrap=md_torch_load "
                 "-Wl,--wrap=md_torch_forward -Wl,--wrap=md_torch_free (%s)",
                 err.msg);
    if (st != MD_OK)
        fail_msg("md_model_load: %d (%s)", (int)st, err.msg);
    assert_non_null(m);
    md_model_set_version(m, version);
    /* served from now on, as md_registry_put starts it */
    assert_int_equal(md_model_start(m, &err), MD_OK);
    hold(m);
    if (fake_id)
        *fake_id = id_before;
    return m;
}

static md_model *load(const char *config, int workers, int max_batch, int delay_us,
                      int queue_limit, int timeout_ms)
{
    return load_ex("m", 1, config, workers, max_batch, delay_us, queue_limit, timeout_ms, NULL);
}

static json_int_t stat_int(md_model *m, const char *key)
{
    json_t *s = md_model_stats(m);
    assert_non_null(s);
    json_t *v = json_object_get(s, key);
    if (!json_is_integer(v))
        fail_msg("md_model_stats has no integer \"%s\"", key);
    json_int_t n = json_integer_value(v);
    json_decref(s);
    return n;
}

/* Batches recorded for fake model `id`, from index `from`; their rows into rows[]. */
static int batches_of(int id, int from, int64_t *rows, int cap)
{
    int n = 0;
    pthread_mutex_lock(&g_mu);
    for (int i = from; i < g_nbatches; i++)
        if (g_batches[i].model == id && n < cap)
            rows[n++] = g_batches[i].rows;
    pthread_mutex_unlock(&g_mu);
    return n;
}

static int setup(void **state)
{
    (void)state;
    pthread_mutex_lock(&g_mu);
    memset(g_req, 0, sizeof g_req);
    memset(g_batches, 0, sizeof g_batches);
    g_nbatches = 0;
    g_gate_open = 0;
    g_gate_entered = 0;
    g_forward_sleep_us = 0;
    g_need_width = 0;
    g_prepack_max = 0;
    g_coalesce_us = 0;
    g_replica_refuse = 0;
    g_replica_calls = g_replicas = g_replica_frees = g_replica_shared = 0;
    g_resident = 1000;
    pthread_mutex_unlock(&g_mu);
    memset(g_held, 0, sizeof g_held);
    g_reg = NULL;
    return 0;
}

/* Release what the test holds, let blocked forwards go, and wait until every
 * fake model is freed so no worker outlives its test. */
static int teardown(void **state)
{
    (void)state;
    open_gate();
    for (int i = 0; i < 16; i++)
        if (g_held[i]) {
            md_model_release(g_held[i]);
            g_held[i] = NULL;
        }
    md_registry_free(g_reg);
    g_reg = NULL;
    int ok;
    WAIT_FOR(ok, g_frees == g_loads && g_replica_frees == g_replicas, WAIT_S);
    if (!ok) {
        fprintf(stderr, "teardown: %d of %d fake models and %d of %d replicas freed after "
                "%.0f s\n", locked_int(&g_frees), locked_int(&g_loads),
                locked_int(&g_replica_frees), locked_int(&g_replicas), WAIT_S);
        return -1;
    }
    return 0;
}

static const char *const ROW2 = "{\"input\": {\"shape\": [2]}}";

/* ---- tests ---- */

static void test_fake_backend_linked(void **state)
{
    (void)state;
    /* also: the load's test forward runs on one zero row of the declared shape */
    md_model *m = load(ROW2, 1, 64, 0, 100, 10000);
    assert_int_equal(md_model_version(m), 1);
    assert_string_equal(md_model_name(m), "m");
    int64_t shape[MD_MAX_DIMS];
    assert_int_equal(md_model_input_shape(m, shape), 1);
    assert_int_equal(shape[0], 2);
    /* a load that the backend refuses reports its message */
    md_model *bad = NULL;
    md_err err;
    md_model_defaults def = {1, 64, 0, 100, 10000, 0, 0, 0, 0, 0};
    assert_int_equal(md_model_load("x", 1, "fail-me", NULL, &def, &bad, &err), MD_EUNPROC);
    assert_null(bad);
    assert_non_null(strstr(err.msg, "fake load of fail-me failed"));
}

static void test_single_request_roundtrip(void **state)
{
    (void)state;
    md_model *m = load(ROW2, 1, 64, 0, 100, 10000);
    submit_ok(m, 0, 3, 2, (const float[]){1, 2, 3, 4, 5, 6});
    ASSERT_WAIT(reqs_done(0, 1));
    assert_int_equal(g_req[0].calls, 1);
    assert_int_equal(g_req[0].st, MD_OK);
    assert_int_equal(g_req[0].ndim, 2);
    assert_int_equal(g_req[0].shape[0], 3);
    assert_int_equal(g_req[0].shape[1], 2);
    for (int i = 0; i < 6; i++)
        assert_true(g_req[0].out[i] == 2.0f * (float)(i + 1));
    /* a flat list is one row */
    md_tensor t = {.ndim = 1, .shape = {2}, .count = 2, .data = malloc(2 * sizeof(float))};
    t.data[0] = 7;
    t.data[1] = 8;
    md_err err;
    assert_int_equal(md_model_submit(m, &t, MD_PRIO_ONLINE, on_done, &g_req[1], &err), MD_OK);
    ASSERT_WAIT(reqs_done(1, 2));
    assert_int_equal(g_req[1].shape[0], 1);
    assert_true(g_req[1].out[0] == 14.0f && g_req[1].out[1] == 16.0f);
}

static void test_greedy_take(void **state)
{
    (void)state;
    /* workers=1, no delay: while the first forward runs, 10 requests queue;
     * the worker then takes all 10 in ONE batch */
    md_model *m = load(ROW2, 1, 64, 0, 100, 10000);
    int id = locked_int(&g_next_id) - 1;
    submit_ok(m, 0, 1, 2, (const float[]){GATE, 0});
    ASSERT_WAIT(g_gate_entered == 1);
    for (int i = 1; i <= 10; i++)
        submit_ok(m, i, 1, 2, (const float[]){(float)i, (float)(10 * i)});
    open_gate();
    ASSERT_WAIT(reqs_done(0, 11));
    int64_t rows[16];
    int n = batches_of(id, 0, rows, 16);
    assert_int_equal(n, 2);
    assert_int_equal(rows[0], 1);
    assert_int_equal(rows[1], 10);
    /* FIFO within the batch, and each answer is its own row */
    for (int i = 1; i <= 10; i++) {
        assert_true(g_batches[1].first[i - 1] == (float)i);
        assert_int_equal(g_req[i].calls, 1);
        assert_int_equal(g_req[i].st, MD_OK);
        assert_int_equal(g_req[i].shape[0], 1);
        assert_true(g_req[i].out[0] == 2.0f * (float)i);
        assert_true(g_req[i].out[1] == 20.0f * (float)i);
    }
    assert_int_equal(stat_int(m, "batches"), 2);
    assert_int_equal(stat_int(m, "rows"), 11);
    assert_int_equal(stat_int(m, "requests"), 11);
}

/* Wait until `n` online workers of m wait for requests. */
static void wait_idle(md_model *m, int n);

/* batching.coalesce_us: while a worker computes a small batch and forwards
 * are short, requests of less than half a batch wait for it instead of
 * waking the idle worker (fewer, fuller batches); half a batch queued wakes
 * it, and what is left when the busy worker comes back, it takes. */
static void test_coalesce_small_requests(void **state)
{
    (void)state;
    g_coalesce_us = 1000000; /* the fake's forwards take microseconds */
    md_model *m = load(ROW2, 2, 8, 0, 100, 10000);
    int id = locked_int(&g_next_id) - 1;
    wait_idle(m, 2); /* both workers past their start, waiting */
    submit_ok(m, 0, 1, 2, (const float[]){GATE, 0});
    ASSERT_WAIT(g_gate_entered == 1);
    submit_ok(m, 1, 1, 2, (const float[]){1, 1});
    submit_ok(m, 2, 1, 2, (const float[]){2, 2});
    /* two rows, a quarter of a batch: they wait for the busy worker, however
     * long it computes (a wrongly woken worker would take them at once) */
    usleep(100 * 1000);
    assert_int_equal(stat_int(m, "queued"), 2);
    assert_int_equal(locked_int(&g_req[1].calls), 0);
    /* two more rows make half a batch: the idle worker takes all four */
    submit_ok(m, 3, 2, 2, (const float[]){3, 3, 4, 4});
    ASSERT_WAIT(reqs_done(1, 4));
    assert_int_equal(locked_int(&g_req[0].calls), 0); /* still in its forward */
    int64_t rows[4];
    assert_int_equal(batches_of(id, 0, rows, 4), 2);
    assert_int_equal(rows[0], 1);
    assert_int_equal(rows[1], 4);
    assert_true(g_req[3].out[2] == 8.0f);
    /* one more row, while the first worker is still held: it waits for a
     * worker to come back, and is computed when the gate opens */
    wait_idle(m, 1);
    submit_ok(m, 4, 1, 2, (const float[]){5, 5});
    usleep(100 * 1000);
    assert_int_equal(locked_int(&g_req[4].calls), 0);
    open_gate();
    ASSERT_WAIT(reqs_done(0, 5));
    assert_int_equal(g_req[0].st, MD_OK);
    assert_true(g_req[4].out[0] == 10.0f);
}

/* A worker computing half a batch or more, or a model whose batches were
 * never timed (no input.shape: no test forward), does not make small
 * requests wait: the idle worker takes them. */
static void test_coalesce_not_behind_big_or_untimed_batches(void **state)
{
    (void)state;
    g_coalesce_us = 1000000;
    md_model *m = load_ex("big", 1, ROW2, 2, 8, 0, 100, 10000, NULL);
    wait_idle(m, 2);
    submit_ok(m, 0, 4, 2, (const float[]){GATE, 0, 1, 1, 2, 2, 3, 3});
    ASSERT_WAIT(g_gate_entered == 1);
    submit_ok(m, 1, 1, 2, (const float[]){GATE, 1});
    ASSERT_WAIT(g_gate_entered == 2);
    open_gate();
    ASSERT_WAIT(reqs_done(0, 2));

    pthread_mutex_lock(&g_mu);
    g_gate_open = 0;
    g_gate_entered = 0;
    pthread_mutex_unlock(&g_mu);
    md_model *u = load_ex("untimed", 1, NULL, 2, 8, 0, 100, 10000, NULL);
    wait_idle(u, 2);
    submit_ok(u, 2, 1, 2, (const float[]){GATE, 2});
    ASSERT_WAIT(g_gate_entered == 1);
    submit_ok(u, 3, 1, 2, (const float[]){GATE, 3});
    ASSERT_WAIT(g_gate_entered == 2);
    open_gate();
    ASSERT_WAIT(reqs_done(2, 4));
}

/* coalesce_us 0, or forwards slower than coalesce_us: a free worker takes
 * each request at once, so two one-row requests compute side by side. */
static void test_coalesce_off_or_slow_forwards(void **state)
{
    (void)state;
    for (int slow = 0; slow < 2; slow++) {
        pthread_mutex_lock(&g_mu);
        g_gate_open = 0;
        g_gate_entered = 0;
        pthread_mutex_unlock(&g_mu);
        g_coalesce_us = slow ? 1000 : 0;
        md_model *m = load_ex(slow ? "slow" : "off", 1, ROW2, 2, 8, 0, 100, 10000, NULL);
        int base = slow ? 10 : 0;
        if (slow) {
            /* one forward of 20 ms: its moving average passes 1 ms on any machine */
            g_forward_sleep_us = 20000;
            submit_ok(m, base + 5, 1, 2, (const float[]){5, 5});
            ASSERT_WAIT(reqs_done(base + 5, base + 6));
            g_forward_sleep_us = 0;
        }
        submit_ok(m, base, 1, 2, (const float[]){GATE, 0});
        ASSERT_WAIT(g_gate_entered == 1);
        submit_ok(m, base + 1, 1, 2, (const float[]){GATE, 1});
        ASSERT_WAIT(g_gate_entered == 2);
        /* side by side: the first still in its forward (the fake's gate gives
         * up after WAIT_S, which would let one worker take both in turn) */
        assert_int_equal(locked_int(&g_req[base].calls), 0);
        open_gate();
        ASSERT_WAIT(reqs_done(base, base + 2));
    }
}

static void wait_idle(md_model *m, int n)
{
    double until = mono() + WAIT_S;
    while (stat_int(m, "idle_workers") != n && mono() < until)
        usleep(1000);
    assert_int_equal(stat_int(m, "idle_workers"), n);
}

static void test_delay_from_first_arrival(void **state)
{
    (void)state;
    /* max_delay 1 s: a lone request waits the delay for company. The bounds
     * hold on any machine: at least the delay, and less than twice it (a
     * delay counted twice, or never ending, is what they catch); the second
     * request comes 10 ms after the first, 990 ms inside the window. */
    md_model *m = load(ROW2, 1, 64, 1000000, 100, 10000);
    int id = locked_int(&g_next_id) - 1;
    submit_ok(m, 0, 1, 2, (const float[]){1, 2});
    ASSERT_WAIT(reqs_done(0, 1));
    double dt = g_req[0].t_done - g_req[0].t_submit;
    if (dt < 0.999 || dt > 1.9)
        fail_msg("a lone request took %.1f ms with max_delay_us=1000000 (want 1000..1900)",
                 dt * 1e3);
    /* a request arriving inside the window joins the same batch, and the
     * window is counted from the first arrival */
    submit_ok(m, 1, 1, 2, (const float[]){3, 4});
    usleep(10000);
    submit_ok(m, 2, 1, 2, (const float[]){5, 6});
    ASSERT_WAIT(reqs_done(1, 3));
    int64_t rows[8];
    int n = batches_of(id, 0, rows, 8);
    assert_int_equal(n, 2);
    assert_int_equal(rows[0], 1);
    assert_int_equal(rows[1], 2);
    double d1 = g_req[1].t_done - g_req[1].t_submit;
    if (d1 < 0.999 || d1 > 1.9)
        fail_msg("the first of two requests took %.1f ms (want 1000..1900)", d1 * 1e3);
    assert_true(g_req[2].t_done >= g_req[1].t_done - 1e-3);
    /* a full batch does not wait */
    md_model *m2 = load_ex("full", 1, ROW2, 1, 2, 2000000, 100, 10000, NULL);
    double t0 = mono();
    submit_ok(m2, 3, 2, 2, (const float[]){1, 2, 3, 4});
    ASSERT_WAIT(reqs_done(3, 4));
    if (g_req[3].t_done - t0 > 1.0)
        fail_msg("a full batch waited %.0f ms for the 2 s delay", (g_req[3].t_done - t0) * 1e3);
}

static void test_delay_not_stacked_on_queue_wait(void **state)
{
    (void)state;
    /* max_delay 1 s; the only worker is busy for 1.2 s; a request that waited
     * through it has used up its delay and goes as soon as the worker is
     * free, not a whole delay later (the bound, 0.9 s, tells the two apart on
     * any machine) */
    md_model *m = load(ROW2, 1, 64, 1000000, 100, 10000);
    submit_ok(m, 0, 1, 2, (const float[]){GATE, 0});
    ASSERT_WAIT(g_gate_entered == 1);
    submit_ok(m, 1, 1, 2, (const float[]){1, 2});
    usleep(1200000);
    double t_open = mono();
    open_gate();
    ASSERT_WAIT(reqs_done(0, 2));
    double dt = g_req[1].t_done - t_open;
    if (dt > 0.9)
        fail_msg("the queued request finished %.0f ms after the worker was freed; its 1 s "
                 "delay had already passed while it waited",
                 dt * 1e3);
}

static void test_size_cap(void **state)
{
    (void)state;
    md_model *m = load(ROW2, 1, 4, 0, 100, 10000);
    int id = locked_int(&g_next_id) - 1;
    submit_ok(m, 0, 1, 2, (const float[]){GATE, 0});
    ASSERT_WAIT(g_gate_entered == 1);
    for (int i = 1; i <= 10; i++)
        submit_ok(m, i, 1, 2, (const float[]){(float)i, 0});
    open_gate();
    ASSERT_WAIT(reqs_done(0, 11));
    int64_t rows[16];
    int n = batches_of(id, 1, rows, 16);
    int64_t total = 0;
    for (int i = 0; i < n; i++) {
        if (rows[i] > 4)
            fail_msg("batch %d has %lld rows, max_batch_size is 4", i, (long long)rows[i]);
        total += rows[i];
    }
    assert_int_equal(total, 10);
    /* greedy: full batches while rows remain */
    assert_int_equal(n, 3);
    assert_int_equal(rows[0], 4);
    assert_int_equal(rows[1], 4);
    assert_int_equal(rows[2], 2);
    for (int i = 1; i <= 10; i++) {
        assert_int_equal(g_req[i].st, MD_OK);
        assert_true(g_req[i].out[0] == 2.0f * (float)i);
    }
}

static void check_split(int workers)
{
    md_model *m = load(ROW2, workers, 3, 0, 100, 10000);
    int id = locked_int(&g_next_id) - 1;
    float in[20];
    for (int r = 0; r < 10; r++) {
        in[2 * r] = (float)r;
        in[2 * r + 1] = (float)(-r - 100);
    }
    g_forward_sleep_us = 2000; /* let several workers overlap */
    submit_ok(m, 0, 10, 2, in);
    ASSERT_WAIT(reqs_done(0, 1));
    usleep(20000); /* a second callback would come now */
    assert_int_equal(locked_int(&g_req[0].calls), 1);
    assert_int_equal(g_req[0].st, MD_OK);
    assert_int_equal(g_req[0].ndim, 2);
    assert_int_equal(g_req[0].shape[0], 10);
    assert_int_equal(g_req[0].shape[1], 2);
    for (int i = 0; i < 20; i++)
        if (g_req[0].out[i] != 2.0f * in[i])
            fail_msg("workers=%d: out[%d] = %g, want %g (rows out of order?)", workers, i,
                     (double)g_req[0].out[i], (double)(2.0f * in[i]));
    int64_t rows[16];
    int n = batches_of(id, 0, rows, 16);
    int64_t total = 0;
    for (int i = 0; i < n; i++) {
        assert_true(rows[i] <= 3);
        total += rows[i];
    }
    assert_int_equal(total, 10);
    assert_true(n >= 4);
    if (workers == 1) {
        assert_int_equal(n, 4);
        assert_int_equal(rows[3], 1);
    }
    assert_int_equal(stat_int(m, "requests"), 1);
}

static void test_split_large_request(void **state)
{
    (void)state;
    check_split(1);
}

static void test_split_across_workers(void **state)
{
    (void)state;
    check_split(3);
}

static void test_split_shares_batches(void **state)
{
    (void)state;
    /* pieces of a split request and small requests share batches */
    md_model *m = load(ROW2, 1, 4, 0, 100, 10000);
    int id = locked_int(&g_next_id) - 1;
    submit_ok(m, 0, 1, 2, (const float[]){GATE, 0});
    ASSERT_WAIT(g_gate_entered == 1);
    submit_ok(m, 1, 1, 2, (const float[]){1, 1});
    submit_ok(m, 2, 6, 2, (const float[]){20, 0, 21, 0, 22, 0, 23, 0, 24, 0, 25, 0});
    submit_ok(m, 3, 1, 2, (const float[]){3, 3});
    open_gate();
    ASSERT_WAIT(reqs_done(0, 4));
    int64_t rows[8];
    int n = batches_of(id, 1, rows, 8);
    assert_int_equal(n, 2);
    assert_int_equal(rows[0], 4);
    assert_int_equal(rows[1], 4);
    for (int r = 0; r < 6; r++)
        assert_true(g_req[2].out[2 * r] == 2.0f * (float)(20 + r));
    assert_int_equal(g_req[2].shape[0], 6);
    assert_true(g_req[1].out[0] == 2.0f && g_req[3].out[0] == 6.0f);
}

static void test_timeout(void **state)
{
    (void)state;
    /* timeout 50 ms (not 10: the gate request itself must be taken inside its
     * timeout on a noisy machine); the worker is blocked for ~250 ms */
    md_model *m = load(ROW2, 1, 64, 0, 100, 50);
    int id = locked_int(&g_next_id) - 1;
    submit_ok(m, 0, 1, 2, (const float[]){GATE, 0});
    ASSERT_WAIT(g_gate_entered == 1);
    submit_ok(m, 1, 2, 2, (const float[]){999, 1, 999, 2});
    usleep(250000);
    open_gate();
    ASSERT_WAIT(reqs_done(0, 2));
    usleep(20000);
    assert_int_equal(g_req[0].st, MD_OK);
    assert_int_equal(locked_int(&g_req[1].calls), 1);
    assert_int_equal(g_req[1].st, MD_ETIMEOUT);
    assert_string_equal(g_req[1].code, "timeout");
    assert_non_null(strstr(g_req[1].msg, "50 ms"));
    /* never forwarded */
    pthread_mutex_lock(&g_mu);
    for (int b = 0; b < g_nbatches; b++)
        for (int64_t r = 0; r < g_batches[b].rows && r < 64; r++)
            if (g_batches[b].first[r] == 999.0f) {
                pthread_mutex_unlock(&g_mu);
                fail_msg("the timed-out request was forwarded in batch %d", b);
            }
    pthread_mutex_unlock(&g_mu);
    int64_t rows[8];
    assert_int_equal(batches_of(id, 0, rows, 8), 1);
    assert_int_equal(stat_int(m, "timeouts"), 1);
    /* the model still serves */
    submit_ok(m, 2, 1, 2, (const float[]){1, 2});
    ASSERT_WAIT(reqs_done(2, 3));
    assert_int_equal(g_req[2].st, MD_OK);
}

/* timeout_ms bounds online waits only: a batch job's chunk that waits longer
 * behind busy workers is still computed, never failed as a timeout */
static void test_batch_priority_never_times_out(void **state)
{
    (void)state;
    md_model *m = load(ROW2, 1, 64, 0, 100, 50);
    md_err err;
    /* the job worker is held in a forward; a second chunk waits 5x timeout_ms */
    assert_int_equal(submit_prio(m, 0, 1, 2, (const float[]){GATE, 0}, MD_PRIO_BATCH, &err), MD_OK);
    ASSERT_WAIT(g_gate_entered == 1);
    assert_int_equal(submit_prio(m, 1, 1, 2, (const float[]){3, 4}, MD_PRIO_BATCH, &err), MD_OK);
    usleep(250000);
    open_gate();
    ASSERT_WAIT(reqs_done(0, 2));
    assert_int_equal(g_req[0].st, MD_OK);
    assert_int_equal(g_req[1].st, MD_OK);
    assert_int_equal(stat_int(m, "timeouts"), 0);
}

static void test_queue_full(void **state)
{
    (void)state;
    md_model *m = load(ROW2, 1, 64, 0, 2, 10000);
    submit_ok(m, 0, 1, 2, (const float[]){GATE, 0});
    ASSERT_WAIT(g_gate_entered == 1); /* the gate request is out of the queue */
    submit_ok(m, 1, 1, 2, (const float[]){1, 0});
    submit_ok(m, 2, 1, 2, (const float[]){2, 0});
    md_err err;
    double t0 = mono();
    md_status st = submit(m, 3, 1, 2, (const float[]){3, 0}, &err);
    double dt = mono() - t0;
    assert_int_equal(st, MD_EBUSY);
    assert_int_equal(err.status, MD_EBUSY);
    assert_non_null(strstr(err.msg, "queue_limit"));
    if (dt > 0.5)
        fail_msg("a full queue answered after %.0f ms; it must answer at once", dt * 1e3);
    assert_int_equal(stat_int(m, "rejected"), 1);
    assert_int_equal(stat_int(m, "queued"), 2);
    open_gate();
    ASSERT_WAIT(reqs_done(0, 3));
    usleep(20000);
    assert_int_equal(locked_int(&g_req[3].calls), 0);
    for (int i = 0; i < 3; i++)
        assert_int_equal(g_req[i].st, MD_OK);
    /* room again */
    submit_ok(m, 4, 1, 2, (const float[]){4, 0});
    ASSERT_WAIT(reqs_done(4, 5));
}

static void test_wrong_shape(void **state)
{
    (void)state;
    md_model *m = load("{\"input\": {\"shape\": [4]}}", 1, 64, 0, 100, 10000);
    md_err err;
    assert_int_equal(submit(m, 0, 1, 3, (const float[]){1, 2, 3}, &err), MD_EINVAL);
    assert_string_equal(md_err_code(&err), "wrong_shape");
    assert_non_null(strstr(err.msg, "[4]"));
    assert_non_null(strstr(err.msg, "3 values"));
    assert_int_equal(submit(m, 1, 2, 5, (const float[]){1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, &err),
                     MD_EINVAL);
    /* a flat list of the wrong width */
    md_tensor t = {.ndim = 1, .shape = {3}, .count = 3, .data = calloc(3, sizeof(float))};
    assert_int_equal(md_model_submit(m, &t, MD_PRIO_ONLINE, on_done, &g_req[2], &err), MD_EINVAL);
    assert_null(t.data);
    /* the right width passes */
    submit_ok(m, 3, 2, 4, (const float[]){1, 2, 3, 4, 5, 6, 7, 8});
    ASSERT_WAIT(reqs_done(3, 4));
    usleep(20000);
    for (int i = 0; i < 3; i++)
        assert_int_equal(locked_int(&g_req[i].calls), 0);
    /* a model without a declared shape takes the first request's */
    md_model *m2 = load_ex("noshape", 1, NULL, 1, 64, 0, 100, 10000, NULL);
    submit_ok(m2, 4, 1, 3, (const float[]){1, 2, 3});
    ASSERT_WAIT(reqs_done(4, 5));
    assert_int_equal(submit(m2, 5, 1, 2, (const float[]){1, 2}, &err), MD_EINVAL);
}

static void test_preprocess(void **state)
{
    (void)state;
    /* x -> (x * 0.5 - 1) / 2, then the fake doubles it */
    md_model *m = load("{\"input\": {\"shape\": [2]}, \"preprocess\": {\"scale\": 0.5, "
                       "\"mean\": [1], \"std\": [2]}}",
                       1, 64, 0, 100, 10000);
    submit_ok(m, 0, 2, 2, (const float[]){4, 6, 0, 2});
    ASSERT_WAIT(reqs_done(0, 1));
    assert_int_equal(g_req[0].st, MD_OK);
    const float want[] = {1.0f, 2.0f, -1.0f, 0.0f};
    for (int i = 0; i < 4; i++)
        if (fabsf(g_req[0].out[i] - want[i]) > 1e-6f)
            fail_msg("out[%d] = %g, want %g", i, (double)g_req[0].out[i], (double)want[i]);
    /* per channel (C, H, W): channel c -> (x * 0.5 - mean[c]) / std[c] */
    md_model *m2 = load_ex("chw", 1,
                           "{\"input\": {\"shape\": [2, 1, 2]}, \"preprocess\": {\"scale\": 0.5, "
                           "\"mean\": [1, 2], \"std\": [1, 4]}}",
                           1, 64, 0, 100, 10000, NULL);
    /* two rows, one flat (reshaped) */
    submit_ok(m2, 1, 2, 4, (const float[]){2, 4, 8, 12, 0, 2, 4, 20});
    ASSERT_WAIT(reqs_done(1, 2));
    assert_int_equal(g_req[1].st, MD_OK);
    assert_int_equal(g_req[1].ndim, 4);
    assert_int_equal(g_req[1].shape[0], 2);
    const float want2[] = {0, 2, 1, 2, -2, 0, 0, 4};
    for (int i = 0; i < 8; i++)
        if (fabsf(g_req[1].out[i] - want2[i]) > 1e-6f)
            fail_msg("chw out[%d] = %g, want %g", i, (double)g_req[1].out[i], (double)want2[i]);
    /* scale alone */
    md_model *m3 = load_ex("scale", 1,
                           "{\"input\": {\"shape\": [2]}, \"preprocess\": {\"scale\": 0.25}}", 1,
                           64, 0, 100, 10000, NULL);
    submit_ok(m3, 2, 1, 2, (const float[]){4, 8});
    ASSERT_WAIT(reqs_done(2, 3));
    assert_true(g_req[2].out[0] == 2.0f && g_req[2].out[1] == 4.0f);
}

/* Online requests and job chunks have their own workers: an online request
 * is computed while every job worker is inside a (blocked) forward, and a
 * job chunk while every online worker is. */
static void test_online_and_jobs_have_own_workers(void **state)
{
    (void)state;
    md_model *m = load(ROW2, 1, 64, 0, 100, 10000);
    md_err err;
    assert_int_equal(submit_prio(m, 0, 1, 2, (const float[]){GATE, 0}, MD_PRIO_BATCH, &err), MD_OK);
    ASSERT_WAIT(g_gate_entered == 1);
    assert_int_equal(submit_prio(m, 1, 1, 2, (const float[]){1, 0}, MD_PRIO_ONLINE, &err), MD_OK);
    ASSERT_WAIT(reqs_done(1, 2));
    assert_int_equal(g_req[1].st, MD_OK);
    assert_int_equal(locked_int(&g_req[0].calls), 0); /* the job chunk is still inside */
    open_gate();
    ASSERT_WAIT(reqs_done(0, 1));
    assert_int_equal(g_req[0].st, MD_OK);

    /* the other way round */
    pthread_mutex_lock(&g_mu);
    g_gate_open = 0;
    g_gate_entered = 0;
    pthread_mutex_unlock(&g_mu);
    submit_ok(m, 2, 1, 2, (const float[]){GATE, 0});
    ASSERT_WAIT(g_gate_entered == 1);
    assert_int_equal(submit_prio(m, 3, 1, 2, (const float[]){3, 0}, MD_PRIO_BATCH, &err), MD_OK);
    ASSERT_WAIT(reqs_done(3, 4));
    assert_int_equal(locked_int(&g_req[2].calls), 0);
    open_gate();
    ASSERT_WAIT(reqs_done(2, 3));
}

/* A job chunk is one forward of all its rows, above max_batch_size too, and
 * never merged with another chunk; online requests are still split. */
static void test_job_chunk_is_one_forward(void **state)
{
    (void)state;
    int id;
    md_model *m = load_ex("m", 1, ROW2, 1, 4, 0, 100, 10000, &id);
    enum { R = 10 };
    float vals[2 * R];
    for (int i = 0; i < 2 * R; i++)
        vals[i] = (float)i;
    md_err err;
    /* hold the job worker so the next two chunks queue up together */
    assert_int_equal(submit_prio(m, 0, 1, 2, (const float[]){GATE, 0}, MD_PRIO_BATCH, &err), MD_OK);
    ASSERT_WAIT(g_gate_entered == 1);
    assert_int_equal(submit_prio(m, 1, R, 2, vals, MD_PRIO_BATCH, &err), MD_OK);
    assert_int_equal(submit_prio(m, 2, 3, 2, vals, MD_PRIO_BATCH, &err), MD_OK);
    open_gate();
    ASSERT_WAIT(reqs_done(0, 3));
    int64_t rows[8];
    assert_int_equal(batches_of(id, 0, rows, 8), 3);
    assert_int_equal(rows[0], 1);
    assert_int_equal(rows[1], R); /* over max_batch_size 4, in one forward */
    assert_int_equal(rows[2], 3); /* not merged with the chunk before */
    assert_int_equal(g_req[1].st, MD_OK);
    assert_int_equal(g_req[1].shape[0], R);
    /* an online request of 10 rows is still split at 4 */
    submit_ok(m, 3, R, 2, vals);
    ASSERT_WAIT(reqs_done(3, 4));
    assert_int_equal(batches_of(id, 3, rows, 8), 3);
}

/* Nice of thread `tid` of this process, from /proc (field 19 of stat). */
static int thread_nice(const char *tid)
{
    char path[300], buf[512];
    snprintf(path, sizeof path, "/proc/self/task/%s/stat", tid);
    FILE *f = fopen(path, "r");
    if (!f)
        return -100;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* after the name: state is field 3 */
    int field = 2, nice = -100;
    for (char *tok = strtok(p + 1, " "); tok; tok = strtok(NULL, " "))
        if (++field == 19) {
            nice = atoi(tok);
            break;
        }
    return nice;
}

/* This process's threads named `name` with nice `want_nice`; *others gets
 * the number named so with another nice. Threads name themselves and set
 * their nice as they start, so callers wait for the counts to settle. */
static int threads_named(const char *name, int want_nice, int *others)
{
    *others = 0;
    DIR *d = opendir("/proc/self/task");
    assert_non_null(d);
    int count = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        char path[300], comm[32] = "";
        snprintf(path, sizeof path, "/proc/self/task/%s/comm", e->d_name);
        FILE *f = fopen(path, "r");
        if (!f)
            continue;
        if (fgets(comm, sizeof comm, f))
            comm[strcspn(comm, "\n")] = 0;
        fclose(f);
        if (strcmp(comm, name) != 0)
            continue;
        if (thread_nice(e->d_name) == want_nice)
            count++;
        else
            ++*others;
    }
    closedir(d);
    return count;
}

/* job_nice lowers the job workers' CPU priority, and only theirs */
static void test_job_workers_niced(void **state)
{
    (void)state;
    g_job_nice = 7;
    md_model *m = load_ex("nicejobs", 1, ROW2, 2, 64, 0, 100, 10000, NULL);
    g_job_nice = 0;
    (void)m;
    /* relative to the test's own nice value (`nice make unit` starts at 10) */
    int base = getpriority(PRIO_PROCESS, 0), want = base + 7 > 19 ? 19 : base + 7;
    int other_mj = 0, other_md = 0;
    ASSERT_WAIT(threads_named("mj-nicejobs", want, &other_mj) == 2 && other_mj == 0 &&
                threads_named("md-nicejobs", base, &other_md) == 2 && other_md == 0);
}

static void test_forward_error(void **state)
{
    (void)state;
    md_model *m = load(ROW2, 1, 3, 0, 100, 10000);
    submit_ok(m, 0, 1, 2, (const float[]){FAIL, 0});
    ASSERT_WAIT(reqs_done(0, 1));
    assert_int_equal(g_req[0].st, MD_EUNPROC);
    assert_non_null(strstr(g_req[0].msg, "fake forward failed"));
    /* one failing piece of a split request fails it, once */
    float in[20] = {0};
    for (int r = 0; r < 10; r++)
        in[2 * r] = (float)r;
    in[2 * 7] = FAIL;
    submit_ok(m, 1, 10, 2, in);
    ASSERT_WAIT(reqs_done(1, 2));
    usleep(20000);
    assert_int_equal(locked_int(&g_req[1].calls), 1);
    assert_int_equal(g_req[1].st, MD_EUNPROC);
    /* a model answering the wrong number of rows */
    submit_ok(m, 2, 2, 2, (const float[]){BADROWS, 0, 1, 1});
    ASSERT_WAIT(reqs_done(2, 3));
    assert_int_equal(g_req[2].st, MD_EUNPROC);
    assert_string_equal(g_req[2].code, "bad_model_output");
    /* and it still serves */
    submit_ok(m, 3, 1, 2, (const float[]){1, 2});
    ASSERT_WAIT(reqs_done(3, 4));
    assert_int_equal(g_req[3].st, MD_OK);
}


/* A request that makes the model throw, batched with others: the failed
 * forward is run again in halves down to single requests, so only that
 * request fails and the ones that happened to share its batch are answered. */
static void test_bad_request_fails_alone(void **state)
{
    (void)state;
    md_model *m = load(ROW2, 1, 64, 0, 100, 10000);
    int id = locked_int(&g_next_id) - 1;
    submit_ok(m, 0, 1, 2, (const float[]){GATE, 0});
    ASSERT_WAIT(g_gate_entered == 1);
    for (int i = 1; i <= 5; i++)
        submit_ok(m, i, 1, 2, (const float[]){i == 3 ? FAIL : (float)i, (float)(10 * i)});
    open_gate();
    ASSERT_WAIT(reqs_done(0, 6));
    for (int i = 1; i <= 5; i++) {
        assert_int_equal(g_req[i].calls, 1);
        if (i == 3) {
            assert_int_equal(g_req[i].st, MD_EUNPROC);
            assert_non_null(strstr(g_req[i].msg, "fake forward failed"));
        } else {
            assert_int_equal(g_req[i].st, MD_OK);
            assert_true(g_req[i].out[0] == 2.0f * (float)i);
        }
    }
    /* the gate's batch, the failed 5 = [1 2] + [3 4 5]; [3 4 5] fails again
     * = [3] (fails alone) + [4 5] */
    int64_t rows[16];
    assert_int_equal(batches_of(id, 0, rows, 16), 6);
    const int64_t want[] = {1, 5, 2, 3, 1, 2};
    for (int b = 0; b < 6; b++)
        assert_int_equal(rows[b], want[b]);
    /* the split batches are not counted: gate, [1 2], [3], [4 5] */
    assert_int_equal(stat_int(m, "batches"), 4);
}

/* A model whose output width depends on the batch (x @ x.t()), a request of
 * 5 rows over max_batch_size 4: pieces of 4 and 1 rows answer rows of 4 and
 * of 1 value. The request fails naming the model and the split; before, the
 * output was sized by whichever piece finished first and the other copied
 * its own width into it (a heap overflow under ASan, garbage without). */
static void test_split_output_width_depends_on_batch(void **state)
{
    (void)state;
    md_model *m = load(ROW2, 2, 4, 0, 100, 10000);
    float in[10];
    for (int r = 0; r < 5; r++) {
        in[2 * r] = WIDE;
        in[2 * r + 1] = (float)r;
    }
    submit_ok(m, 0, 5, 2, in);
    ASSERT_WAIT(reqs_done(0, 1));
    assert_int_equal(g_req[0].st, MD_EINTERNAL);
    assert_string_equal(g_req[0].code, "bad_model_output");
    assert_non_null(strstr(g_req[0].msg, "model m returned rows of shape"));
    assert_non_null(strstr(g_req[0].msg, "[4]"));
    assert_non_null(strstr(g_req[0].msg, "[1]"));
    assert_non_null(strstr(g_req[0].msg, "split"));
    /* the same order with one worker: the 4-row piece first, then the 1-row */
    md_model *m1 = load_ex("one", 1, ROW2, 1, 4, 0, 100, 10000, NULL);
    submit_ok(m1, 1, 5, 2, in);
    ASSERT_WAIT(reqs_done(1, 2));
    assert_string_equal(g_req[1].code, "bad_model_output");
    /* a request that is not split answers x @ x.t() */
    submit_ok(m, 2, 2, 2, (const float[]){WIDE, 1, WIDE, 2});
    ASSERT_WAIT(reqs_done(2, 3));
    assert_int_equal(g_req[2].st, MD_OK);
    assert_int_equal(g_req[2].shape[0], 2);
    assert_int_equal(g_req[2].shape[1], 2);
    assert_true(g_req[2].out[1] == WIDE * WIDE + 2.0f);
    assert_int_equal(locked_int(&g_req[0].calls), 1);
}

/* A split request whose first piece stalls in its forward while another
 * worker computes the rest is answered once, after the stall ends, with
 * every row in place; one whose later piece throws fails once. */
static void test_split_with_stalled_and_failing_pieces(void **state)
{
    (void)state;
    md_model *m = load(ROW2, 2, 4, 0, 100, 10000);
    int id = locked_int(&g_next_id) - 1;
    float in[12];
    for (int r = 0; r < 6; r++) {
        in[2 * r] = (float)(10 + r);
        in[2 * r + 1] = 0;
    }
    in[0] = GATE;
    submit_ok(m, 0, 6, 2, in);
    ASSERT_WAIT(g_gate_entered == 1);
    /* the other worker takes the 2-row rest meanwhile */
    int64_t rows[8];
    int ok;
    WAIT_FOR(ok, g_nbatches == 2, WAIT_S);
    assert_true(ok);
    assert_int_equal(batches_of(id, 0, rows, 8), 2);
    assert_int_equal(locked_int(&g_req[0].calls), 0);
    open_gate();
    ASSERT_WAIT(reqs_done(0, 1));
    assert_int_equal(g_req[0].st, MD_OK);
    assert_int_equal(g_req[0].shape[0], 6);
    assert_true(g_req[0].out[0] == 2.0f * GATE);
    for (int r = 1; r < 6; r++)
        assert_true(g_req[0].out[2 * r] == 2.0f * (float)(10 + r));
    /* the second piece throws: the request fails, once, with its message */
    in[0] = 10;
    in[2 * 5] = FAIL;
    submit_ok(m, 1, 6, 2, in);
    ASSERT_WAIT(reqs_done(1, 2));
    assert_int_equal(g_req[1].st, MD_EUNPROC);
    assert_non_null(strstr(g_req[1].msg, "fake forward failed"));
    /* every piece has reported before the answer: nothing left to count */
    submit_ok(m, 2, 1, 2, (const float[]){1, 1});
    ASSERT_WAIT(reqs_done(2, 3));
    assert_int_equal(locked_int(&g_req[1].calls), 1);
}

/* A model deployed without config.input.shape learns its row shape from its
 * first SUCCESSFUL forward: a first request of the wrong width fails in its
 * forward and leaves the model open to the right width (before, it fixed
 * the shape at submit and every right request got 400 until a restart). The
 * same for a job chunk. Once learned, other widths answer 400 as before. */
static void test_configless_shape_learned_from_success_only(void **state)
{
    (void)state;
    pthread_mutex_lock(&g_mu);
    g_need_width = 4;
    pthread_mutex_unlock(&g_mu);
    md_model *m = load_ex("noshape", 1, NULL, 1, 64, 0, 100, 10000, NULL);
    int64_t shape[MD_MAX_DIMS];
    assert_int_equal(md_model_input_shape(m, shape), 0);
    /* online, then a job chunk, of the wrong width: each fails in its forward */
    submit_ok(m, 0, 1, 3, (const float[]){1, 2, 3});
    ASSERT_WAIT(reqs_done(0, 1));
    assert_int_equal(g_req[0].st, MD_EUNPROC);
    assert_non_null(strstr(g_req[0].msg, "cannot be multiplied"));
    md_err err;
    assert_int_equal(submit_prio(m, 1, 2, 3, (const float[]){1, 2, 3, 4, 5, 6}, MD_PRIO_BATCH,
                                 &err),
                     MD_OK);
    ASSERT_WAIT(reqs_done(1, 2));
    assert_int_equal(g_req[1].st, MD_EUNPROC);
    assert_int_equal(md_model_input_shape(m, shape), 0);
    /* the right width still passes, and now fixes the shape */
    submit_ok(m, 2, 1, 4, (const float[]){1, 2, 3, 4});
    ASSERT_WAIT(reqs_done(2, 3));
    assert_int_equal(g_req[2].st, MD_OK);
    assert_true(g_req[2].out[3] == 8.0f);
    assert_int_equal(md_model_input_shape(m, shape), 1);
    assert_int_equal(shape[0], 4);
    assert_int_equal(submit(m, 3, 1, 3, (const float[]){1, 2, 3}, &err), MD_EINVAL);
    assert_string_equal(md_err_code(&err), "wrong_shape");
    assert_non_null(strstr(err.msg, "expects rows of shape [4]"));
    /* a job chunk of the right width after it */
    assert_int_equal(submit_prio(m, 4, 2, 4, (const float[]){1, 2, 3, 4, 5, 6, 7, 8},
                                 MD_PRIO_BATCH, &err),
                     MD_OK);
    ASSERT_WAIT(reqs_done(4, 5));
    assert_int_equal(g_req[4].st, MD_OK);

    /* queued together before anything is learned, rows of two widths go in
     * separate forwards: the wrong one fails, the right one passes */
    md_model *m2 = load_ex("noshape2", 1, NULL, 1, 64, 0, 100, 10000, NULL);
    submit_ok(m2, 5, 1, 4, (const float[]){GATE, 0, 0, 0});
    ASSERT_WAIT(g_gate_entered == 1);
    submit_ok(m2, 6, 1, 3, (const float[]){1, 2, 3});
    submit_ok(m2, 7, 1, 4, (const float[]){5, 6, 7, 8});
    open_gate();
    ASSERT_WAIT(reqs_done(5, 8));
    assert_int_equal(g_req[5].st, MD_OK);
    assert_int_equal(g_req[6].st, MD_EUNPROC);
    assert_int_equal(g_req[7].st, MD_OK);
    assert_true(g_req[7].out[0] == 10.0f);
}

/* Sizes from a config or a request never reach an allocation unchecked: a
 * shape whose product overflows answers 422 naming input.shape and the
 * limit (it aborted the process: "out of memory allocating 0 bytes"), and a
 * tensor whose shape does not hold its values (a job's input.shape, a V2
 * shape) is refused at submit instead of being read past its end. */
static void test_sizes_checked(void **state)
{
    (void)state;
    md_model_defaults def = {1, 4, 0, 100, 10000, 0, 0, 0, 0, 0};
    const char *huge[] = {
        "{\"input\": {\"shape\": [1073741824, 1073741824, 4]}}",
        "{\"input\": {\"shape\": [1073741824, 1073741824, 1073741824, 1073741824]}}",
        "{\"input\": {\"shape\": [8192, 8193]}}",
    };
    for (int i = 0; i < 3; i++) {
        json_t *cfg = json_loads(huge[i], 0, NULL);
        md_model *bad = NULL;
        md_err err;
        md_err_clear(&err);
        g_loading = 1;
        md_status st = md_model_load("big", 1, "fake-big", cfg, &def, &bad, &err);
        g_loading = 0;
        json_decref(cfg);
        assert_int_equal(st, MD_EUNPROC);
        assert_null(bad);
        assert_string_equal(md_err_code(&err), "invalid_config");
        assert_non_null(strstr(err.msg, "config.input.shape"));
        assert_non_null(strstr(err.msg, "67108864"));
    }
    /* a tensor whose shape says more rows than its data holds */
    md_model *m = load_ex("noshape", 1, NULL, 1, 4, 0, 100, 10000, NULL);
    md_err err;
    md_tensor t = {.ndim = 2, .shape = {(int64_t)1 << 62, 4}, .count = 4,
                   .data = calloc(4, sizeof(float))};
    assert_int_equal(md_model_submit(m, &t, MD_PRIO_BATCH, on_done, &g_req[0], &err), MD_EINVAL);
    assert_null(t.data);
    assert_string_equal(md_err_code(&err), "wrong_shape");
    /* ... or whose product overflows */
    md_tensor t2 = {.ndim = 3, .shape = {2, (int64_t)1 << 40, (int64_t)1 << 40}, .count = 0,
                    .data = calloc(4, sizeof(float))};
    assert_int_equal(md_model_submit(m, &t2, MD_PRIO_ONLINE, on_done, &g_req[1], &err), MD_EINVAL);
    assert_int_equal(locked_int(&g_req[0].calls) + locked_int(&g_req[1].calls), 0);
    /* and the model still serves */
    submit_ok(m, 2, 1, 4, (const float[]){1, 2, 3, 4});
    ASSERT_WAIT(reqs_done(2, 3));
    assert_int_equal(g_req[2].st, MD_OK);
}

static void test_registry_swap_drains_old(void **state)
{
    (void)state;
    g_reg = md_registry_new();
    int id1, id2;
    md_model *v1 = load_ex("m", 1, ROW2, 1, 64, 0, 100, 10000, &id1);
    for (int i = 0; i < 16; i++)
        if (g_held[i] == v1)
            g_held[i] = NULL; /* the registry takes the reference */
    md_registry_put(g_reg, v1, 1);
    md_model *cur = md_registry_get(g_reg, "m", 0);
    assert_ptr_equal(cur, v1);
    /* requests on v1, the first holding its only worker */
    submit_ok(cur, 0, 1, 2, (const float[]){GATE, 0});
    ASSERT_WAIT(g_gate_entered == 1);
    for (int i = 1; i <= 3; i++)
        submit_ok(cur, i, 1, 2, (const float[]){(float)i, 0});
    md_model_release(cur);

    md_model *v2 = load_ex("m", 2, ROW2, 1, 64, 0, 100, 10000, &id2);
    for (int i = 0; i < 16; i++)
        if (g_held[i] == v2)
            g_held[i] = NULL;
    md_registry_put(g_reg, v2, 1);
    cur = md_registry_get(g_reg, "m", 0);
    assert_ptr_equal(cur, v2);
    assert_int_equal(md_model_version(cur), 2);
    assert_null(md_registry_get(g_reg, "m", 1)); /* the old default left the registry */
    /* v2 serves while v1 still drains */
    submit_ok(cur, 4, 1, 2, (const float[]){4, 0});
    ASSERT_WAIT(reqs_done(4, 5));
    assert_int_equal(g_req[4].st, MD_OK);
    md_model_release(cur);
    assert_int_equal(locked_long(&g_free_seq[id1]), 0); /* not while its queue has requests */
    open_gate();
    ASSERT_WAIT(reqs_done(0, 4));
    for (int i = 0; i < 4; i++)
        assert_int_equal(g_req[i].st, MD_OK);
    ASSERT_WAIT(g_free_seq[id1] != 0);
    for (int i = 0; i < 4; i++)
        if (g_free_seq[id1] < g_req[i].seq)
            fail_msg("the old model was freed before request %d was answered", i);
    assert_int_equal(locked_long(&g_free_seq[id2]), 0);
    md_registry_free(g_reg);
    g_reg = NULL;
    ASSERT_WAIT(g_free_seq[id2] != 0);
}

static void test_registry_versions(void **state)
{
    (void)state;
    g_reg = md_registry_new();
    int id1, id2, id2b;
    md_model *v1 = load_ex("a", 1, ROW2, 1, 64, 0, 100, 10000, &id1);
    md_model *v2 = load_ex("a", 2, ROW2, 1, 64, 0, 100, 10000, &id2);
    memset(g_held, 0, sizeof g_held);
    md_registry_put(g_reg, v1, 1);
    md_registry_put(g_reg, v2, 0); /* not the default */
    md_model *g = md_registry_get(g_reg, "a", 0);
    assert_ptr_equal(g, v1);
    md_model_release(g);
    g = md_registry_get(g_reg, "a", 2);
    assert_ptr_equal(g, v2);
    md_model_release(g);
    assert_null(md_registry_get(g_reg, "a", 3));
    assert_null(md_registry_get(g_reg, "b", 0));
    json_t *names = md_registry_names(g_reg);
    assert_int_equal(json_array_size(names), 1);
    assert_string_equal(json_string_value(json_array_get(names, 0)), "a");
    json_decref(names);
    json_t *stats = md_registry_stats(g_reg);
    assert_int_equal(json_array_size(stats), 2);
    json_decref(stats);
    /* set_default */
    assert_int_equal(md_registry_set_default(g_reg, "a", 3), 0);
    assert_int_equal(md_registry_set_default(g_reg, "a", 2), 1);
    g = md_registry_get(g_reg, "a", 0);
    assert_ptr_equal(g, v2);
    md_model_release(g);
    g = md_registry_get(g_reg, "a", 1); /* still loaded */
    assert_ptr_equal(g, v1);
    md_model_release(g);
    /* replacing the same version keeps it the default and frees the old one */
    md_model *v2b = load_ex("a", 2, ROW2, 1, 64, 0, 100, 10000, &id2b);
    memset(g_held, 0, sizeof g_held);
    md_registry_put(g_reg, v2b, 0);
    g = md_registry_get(g_reg, "a", 0);
    assert_ptr_equal(g, v2b);
    md_model_release(g);
    ASSERT_WAIT(g_free_seq[id2] != 0);
    assert_int_equal(locked_long(&g_free_seq[id1]), 0);
    /* remove one version, then all */
    md_registry_remove(g_reg, "a", 1);
    ASSERT_WAIT(g_free_seq[id1] != 0);
    assert_null(md_registry_get(g_reg, "a", 1));
    md_registry_remove(g_reg, "a", 0);
    ASSERT_WAIT(g_free_seq[id2b] != 0);
    assert_null(md_registry_get(g_reg, "a", 0));
    names = md_registry_names(g_reg);
    assert_int_equal(json_array_size(names), 0);
    json_decref(names);
}

/* A model in the registry under its budget: loaded as app.c does (make room
 * for the expected bytes, load, admit with the real ones). */
static md_status admit(const char *name, int version, int make_default, int *fake_id,
                       md_err *err)
{
    long long reserved;
    md_status st = md_registry_reserve(g_reg, name, version, 1000, &reserved, err);
    if (st != MD_OK)
        return st;
    md_model *m = load_ex(name, version, ROW2, 1, 64, 0, 100, 10000, fake_id);
    for (int i = 0; i < 16; i++)
        if (g_held[i] == m)
            g_held[i] = NULL; /* the registry takes the reference */
    return md_registry_admit(g_reg, m, make_default, reserved, err);
}

static int is_loaded(const char *name, int version)
{
    md_registry_entry e;
    int loaded = md_registry_info(g_reg, name, version, &e);
    json_decref(e.live);
    return loaded;
}

static void test_registry_budget(void **state)
{
    (void)state;
    g_reg = md_registry_new();
    md_registry_set_budget(g_reg, 2500); /* two versions of 1000 bytes */
    md_err err;
    int id[6];
    assert_int_equal(admit("a", 1, 1, &id[1], &err), MD_OK);
    assert_int_equal(admit("a", 2, 0, &id[2], &err), MD_OK);
    /* the default is the least recently used, but it goes last */
    md_model *g = md_registry_get(g_reg, "a", 2);
    md_model_release(g);
    assert_int_equal(admit("a", 3, 0, &id[3], &err), MD_OK);
    assert_true(is_loaded("a", 1) && !is_loaded("a", 2) && is_loaded("a", 3));
    ASSERT_WAIT(g_free_seq[id[2]] != 0); /* nobody held it: freed */

    /* a version in use is never unloaded: the idle default goes instead,
     * and stays the default (parked) for POST /predict and the store sync */
    md_model *busy3 = md_registry_get(g_reg, "a", 3);
    assert_int_equal(admit("a", 4, 0, &id[4], &err), MD_OK);
    assert_true(!is_loaded("a", 1) && is_loaded("a", 3) && is_loaded("a", 4));
    assert_int_equal(md_registry_default_version(g_reg, "a"), 1);
    assert_null(md_registry_get(g_reg, "a", 0));
    json_t *names = md_registry_names(g_reg);
    assert_int_equal(json_array_size(names), 1);
    json_decref(names);

    /* everything in use: no room, nothing unloaded for nothing */
    md_model *busy4 = md_registry_get(g_reg, "a", 4);
    long long reserved = -1;
    assert_int_equal(md_registry_reserve(g_reg, "a", 5, 1000, &reserved, &err), MD_EBUSY);
    assert_int_equal(reserved, 0);
    assert_non_null(strstr(err.msg, "max_loaded_bytes"));
    assert_true(is_loaded("a", 3) && is_loaded("a", 4));
    /* a load larger than the estimate is refused after the fact, too */
    md_model_release(busy4);
    pthread_mutex_lock(&g_mu);
    g_resident = 1600;
    pthread_mutex_unlock(&g_mu);
    assert_int_equal(admit("a", 5, 0, &id[5], &err), MD_EBUSY); /* 3 in use, 4 went */
    assert_true(is_loaded("a", 3) && !is_loaded("a", 4) && !is_loaded("a", 5));
    ASSERT_WAIT(g_free_seq[id[5]] != 0);
    md_model_release(busy3);

    /* weights larger than the whole budget */
    pthread_mutex_lock(&g_mu);
    g_resident = 3000;
    pthread_mutex_unlock(&g_mu);
    int big;
    assert_int_equal(admit("b", 1, 1, &big, &err), MD_ETOOBIG);
    assert_false(is_loaded("b", 0));

    /* the default loaded again (as a request would) is the default again */
    pthread_mutex_lock(&g_mu);
    g_resident = 1000;
    pthread_mutex_unlock(&g_mu);
    assert_int_equal(admit("a", 1, 1, &id[1], &err), MD_OK);
    g = md_registry_get(g_reg, "a", 0);
    assert_non_null(g);
    assert_int_equal(md_model_version(g), 1);
    md_model_release(g);
    /* a deleted default is no longer the default */
    md_registry_unload(g_reg, "a", 1);
    assert_int_equal(md_registry_default_version(g_reg, "a"), 1);
    md_registry_remove(g_reg, "a", 1);
    assert_int_equal(md_registry_default_version(g_reg, "a"), 0);
}

/* The bytes promised to a load go back in the step that counts the loaded
 * version's real size: were they given back before (or never), the next
 * load would find the budget full of a promise. */
static void test_registry_admit_takes_back_the_promise(void **state)
{
    (void)state;
    g_reg = md_registry_new();
    md_registry_set_budget(g_reg, 2000);
    md_err err;
    int id[3];
    assert_int_equal(admit("a", 1, 1, &id[1], &err), MD_OK);
    md_model *busy = md_registry_get(g_reg, "a", 1);
    long long reserved = 0;
    assert_int_equal(md_registry_reserve(g_reg, "a", 2, 1000, &reserved, &err), MD_OK);
    assert_int_equal(reserved, 1000);
    /* with 1 loaded and 2 promised, a third has no room while 1 is in use */
    long long third = -1;
    assert_int_equal(md_registry_reserve(g_reg, "a", 3, 1000, &third, &err), MD_EBUSY);
    md_model *m = load_ex("a", 2, ROW2, 1, 64, 0, 100, 10000, &id[2]);
    for (int i = 0; i < 16; i++)
        if (g_held[i] == m)
            g_held[i] = NULL;
    assert_int_equal(md_registry_admit(g_reg, m, 0, reserved, &err), MD_OK);
    assert_true(is_loaded("a", 1) && is_loaded("a", 2));
    /* 2000 loaded, nothing promised: version 2 (idle) goes for a third */
    assert_int_equal(md_registry_reserve(g_reg, "a", 3, 1000, &third, &err), MD_OK);
    assert_true(is_loaded("a", 1) && !is_loaded("a", 2));
    md_registry_unreserve(g_reg, third);
    /* a refused admit gives its promise back too */
    pthread_mutex_lock(&g_mu);
    g_resident = 5000;
    pthread_mutex_unlock(&g_mu);
    assert_int_equal(md_registry_reserve(g_reg, "b", 1, 1000, &reserved, &err), MD_OK);
    md_model *big = load_ex("b", 1, ROW2, 1, 64, 0, 100, 10000, &id[0]);
    for (int i = 0; i < 16; i++)
        if (g_held[i] == big)
            g_held[i] = NULL;
    assert_int_equal(md_registry_admit(g_reg, big, 1, reserved, &err), MD_ETOOBIG);
    pthread_mutex_lock(&g_mu);
    g_resident = 1000;
    pthread_mutex_unlock(&g_mu);
    assert_int_equal(md_registry_reserve(g_reg, "a", 3, 1000, &third, &err), MD_OK);
    md_registry_unreserve(g_reg, third);
    md_model_release(busy);
}

typedef struct stress_arg {
    md_model *m;
    int first, n;
    int failures;
} stress_arg;

static void *stress_thread(void *p)
{
    stress_arg *a = p;
    for (int k = 0; k < a->n; k++) {
        int i = a->first + k;
        int rows = 1 + i % 7;
        float in[14];
        for (int r = 0; r < rows; r++) {
            in[2 * r] = (float)(i * 10 + r);
            in[2 * r + 1] = (float)-i;
        }
        md_tensor t = {.ndim = 2, .shape = {rows, 2}, .count = (size_t)rows * 2};
        t.data = malloc(sizeof(float) * t.count);
        memcpy(t.data, in, sizeof(float) * t.count);
        md_err err;
        if (md_model_submit(a->m, &t, i % 3 ? MD_PRIO_ONLINE : MD_PRIO_BATCH, on_done,
                            &g_req[i], &err) != MD_OK)
            a->failures++;
        if (k % 16 == 0)
            usleep(500);
    }
    return NULL;
}

static void test_concurrent_submitters(void **state)
{
    (void)state;
    /* 4 submitters x 200 requests of 1..7 rows, 2 workers, batches of <= 8 */
    md_model *m = load(ROW2, 2, 8, 100, 100000, 30000);
    int id = locked_int(&g_next_id) - 1;
    g_forward_sleep_us = 100;
    stress_arg args[4];
    pthread_t th[4];
    for (int t = 0; t < 4; t++) {
        args[t] = (stress_arg){m, t * 200, 200, 0};
        pthread_create(&th[t], NULL, stress_thread, &args[t]);
    }
    for (int t = 0; t < 4; t++) {
        pthread_join(th[t], NULL);
        assert_int_equal(args[t].failures, 0);
    }
    ASSERT_WAIT(reqs_done(0, 800));
    usleep(20000);
    for (int i = 0; i < 800; i++) {
        int rows = 1 + i % 7;
        req *r = &g_req[i];
        if (r->calls != 1 || r->st != MD_OK || r->shape[0] != rows)
            fail_msg("request %d: %d calls, status %d, %lld rows", i, r->calls, (int)r->st,
                     (long long)r->shape[0]);
        for (int k = 0; k < rows; k++)
            if (r->out[2 * k] != 2.0f * (float)(i * 10 + k) || r->out[2 * k + 1] != -2.0f * (float)i)
                fail_msg("request %d row %d has another request's answer", i, k);
    }
    int64_t rows[MAX_BATCHES];
    int n = batches_of(id, 0, rows, MAX_BATCHES);
    int64_t total = 0;
    for (int i = 0; i < n; i++) {
        assert_true(rows[i] >= 1 && rows[i] <= 8);
        total += rows[i];
    }
    int64_t want = 0;
    for (int i = 0; i < 800; i++)
        want += 1 + i % 7;
    assert_int_equal(total, want);
    assert_int_equal(stat_int(m, "rows"), want);
    assert_int_equal(stat_int(m, "requests"), 800);
}

static void test_release_drains_queue(void **state)
{
    (void)state;
    /* the last release lets queued requests finish before the model is freed */
    int id;
    md_model *m = load_ex("d", 1, ROW2, 1, 64, 0, 100, 10000, &id);
    submit_ok(m, 0, 1, 2, (const float[]){GATE, 0});
    ASSERT_WAIT(g_gate_entered == 1);
    for (int i = 1; i <= 5; i++)
        submit_ok(m, i, 1, 2, (const float[]){(float)i, 0});
    drop(m);
    usleep(20000);
    assert_int_equal(locked_long(&g_free_seq[id]), 0);
    open_gate();
    ASSERT_WAIT(reqs_done(0, 6));
    ASSERT_WAIT(g_free_seq[id] != 0);
    for (int i = 0; i <= 5; i++) {
        assert_int_equal(g_req[i].st, MD_OK);
        assert_true(g_req[i].seq < g_free_seq[id]);
    }
}

static void test_eight_dim_row_shape(void **state)
{
    (void)state;
    /* config.input.shape allows 8 dims, but a batch of such rows has 9, one
     * more than md_tensor holds: a submit must not write past shape[]. Run in
     * a child so a crash is reported, not fatal. */
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        /* crashes show as signals, not through cmocka's handlers */
        signal(SIGSEGV, SIG_DFL);
        signal(SIGBUS, SIG_DFL);
        signal(SIGILL, SIG_DFL);
        signal(SIGFPE, SIG_DFL);
        json_t *cfg = json_loads("{\"input\": {\"shape\": [1, 1, 1, 1, 1, 1, 1, 2]}}", 0, NULL);
        md_model_defaults def = {1, 64, 0, 100, 10000, 0, 0, 0, 0, 0};
        md_model *m = NULL;
        md_err err;
        g_loading = 1;
        md_status st = md_model_load("eight", 1, "fake-eight", cfg, &def, &m, &err);
        g_loading = 0;
        if (st != MD_OK)
            _exit(0); /* refused at load: fine */
        md_tensor t = {.ndim = 2, .shape = {1, 2}, .count = 2, .data = calloc(2, sizeof(float))};
        t.data[0] = 1;
        t.data[1] = 2;
        st = md_model_submit(m, &t, MD_PRIO_ONLINE, on_done, &g_req[0], &err);
        if (st == MD_OK) {
            int ok;
            WAIT_FOR(ok, g_req[0].calls == 1, WAIT_S);
            if (!ok)
                _exit(3);
            if (g_req[0].st == MD_OK && (g_req[0].out[0] != 2.0f || g_req[0].out[1] != 4.0f))
                _exit(4);
        } else if (st != MD_EINVAL) {
            _exit(5);
        }
        _exit(0);
    }
    int status = 0;
    double dl = mono() + 10;
    pid_t w;
    while ((w = waitpid(pid, &status, WNOHANG)) == 0 && mono() < dl)
        usleep(10000);
    if (w == 0) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        fail_msg("an 8-dim row shape: the child hung");
    }
    if (WIFSIGNALED(status))
        fail_msg("an 8-dim row shape (config.input.shape allows 8 dims): submitting a row "
                 "crashed with signal %d (md_tensor.shape holds 8 dims, the batch needs 9)",
                 WTERMSIG(status));
    assert_true(WIFEXITED(status));
    if (WEXITSTATUS(status) != 0)
        fail_msg("an 8-dim row shape: the child exited %d", WEXITSTATUS(status));
}


/* ---- prepacked replicas ---- */

/* Poll a stat (its counters are not signalled) until it reads `want`, bounded. */
static void wait_stat(md_model *m, const char *key, json_int_t want)
{
    double until = mono() + WAIT_S;
    json_int_t v;
    while ((v = stat_int(m, key)) != want && mono() < until)
        usleep(1000);
    if (v != want)
        fail_msg("stat %s is %lld after %.0f s, not %lld", key, (long long)v, WAIT_S,
                 (long long)want);
}

static int batches_where(int replica)
{
    int n = 0;
    for (int i = 0; i < g_nbatches; i++)
        n += g_batches[i].replica == replica;
    return n;
}

/* Each online worker makes its replica before its first request and every
 * forward runs on one; two threads never share one; job workers make theirs
 * at their first chunk; all are freed with the model. */
/* A version only loaded (a deploy's validation of a version that does not
 * become the default) starts no worker and makes no packed copy; released,
 * it is freed at once. Its first request starts them. */
static void test_loaded_version_starts_workers_when_used(void **state)
{
    (void)state;
    g_prepack_max = 1 << 20;
    setenv("MD_TEST_CORES", "2", 1);
    md_model_defaults def = {.workers = 2, .max_batch_size = 64, .max_delay_us = 0,
                             .queue_limit = 1000, .timeout_ms = 10000,
                             .prepack_max_bytes = g_prepack_max};
    assert_int_equal(md_models_wait_stopped(WAIT_S), 0); /* the tests before have stopped */
    json_t *cfg = json_loads(ROW2, 0, NULL);
    md_model *m = NULL;
    md_err err;
    md_err_clear(&err);
    int id = locked_int(&g_next_id);
    g_loading = 1;
    assert_int_equal(md_model_load("v", 1, "fake-v", cfg, &def, &m, &err), MD_OK);
    g_loading = 0;
    /* no thread of it is alive, and none made a copy */
    assert_int_equal(md_models_wait_stopped(0), 0);
    pthread_mutex_lock(&g_mu);
    int made = g_replica_calls;
    pthread_mutex_unlock(&g_mu);
    assert_int_equal(made, 0);
    md_model_release(m);
    ASSERT_WAIT(g_free_seq[id] != 0);

    /* the same, asked to predict: its workers start then */
    g_loading = 1;
    assert_int_equal(md_model_load("v", 2, "fake-v2", cfg, &def, &m, &err), MD_OK);
    g_loading = 0;
    json_decref(cfg);
    md_model_set_version(m, 2);
    hold(m);
    submit_ok(m, 0, 1, 2, (const float[]){3, 1});
    ASSERT_WAIT(reqs_done(0, 1));
    assert_int_equal(g_req[0].st, MD_OK);
    assert_true(g_req[0].out[0] == 6.0f);
    assert_true(md_models_wait_stopped(0) > 0);
    drop(m);
    unsetenv("MD_TEST_CORES");
}

static void test_prepack_copies_are_a_pool(void **state)
{
    (void)state;
    g_prepack_max = 1 << 20;
    setenv("MD_TEST_CORES", "2", 1);
    md_model *m = load(ROW2, 2, 64, 0, 1000, 10000);
    ASSERT_WAIT(g_replicas == 2); /* one per online worker as they start: cores allow 2 */
    wait_stat(m, "prepacked_workers", 2);
    /* hold both online workers in a forward at once: each on its own copy */
    submit_ok(m, 0, 1, 2, (const float[]){GATE, 0});
    ASSERT_WAIT(g_gate_entered == 1);
    submit_ok(m, 1, 1, 2, (const float[]){GATE, 1});
    ASSERT_WAIT(g_gate_entered == 2);
    open_gate();
    for (int i = 2; i < 200; i++)
        submit_ok(m, i, 1, 2, (const float[]){(float)i, 1});
    ASSERT_WAIT(reqs_done(0, 200));
    for (int i = 2; i < 200; i++) {
        assert_int_equal(g_req[i].st, MD_OK);
        assert_true(g_req[i].out[0] == 2.0f * (float)i);
    }
    /* a job worker takes a free copy from the pool: no third copy */
    md_err err;
    assert_int_equal(submit_prio(m, 200, 1, 2, (const float[]){7, 0}, MD_PRIO_BATCH, &err), MD_OK);
    ASSERT_WAIT(reqs_done(200, 201));
    assert_int_equal(g_req[200].st, MD_OK);
    pthread_mutex_lock(&g_mu);
    int on_base = batches_where(0), shared = g_replica_shared, made = g_replicas;
    pthread_mutex_unlock(&g_mu);
    assert_int_equal(on_base, 0);
    assert_int_equal(shared, 0);
    assert_int_equal(made, 2);
    assert_int_equal(stat_int(m, "prepacked_workers"), 2);
    drop(m);
    ASSERT_WAIT(g_replica_frees == 2);
    unsetenv("MD_TEST_CORES");
}

/* 8 workers on 2 cores keep 2 packed copies, not 16: a third forward at the
 * same time waits for a copy (never shares one, never runs unpacked: every
 * answer of a version comes from the same kernels); and the copies one per
 * core would need must fit prepack_max_bytes together, or there are none
 * (1000 bytes each here). */
static void test_prepack_pool_is_bounded_by_cores_and_bytes(void **state)
{
    (void)state;
    g_prepack_max = 2000;
    setenv("MD_TEST_CORES", "2", 1);
    md_model *m = load(ROW2, 8, 1, 0, 1000, 10000);
    wait_stat(m, "prepacked_workers", 2);
    for (int i = 0; i < 2; i++) {
        submit_ok(m, i, 1, 2, (const float[]){GATE, (float)i});
        ASSERT_WAIT(g_gate_entered == i + 1);
    }
    submit_ok(m, 2, 1, 2, (const float[]){2, 2}); /* waits for a copy */
    open_gate();
    ASSERT_WAIT(reqs_done(0, 3));
    pthread_mutex_lock(&g_mu);
    int on_base = batches_where(0), on_copy = batches_where(1), shared = g_replica_shared;
    int made = g_replicas;
    pthread_mutex_unlock(&g_mu);
    assert_int_equal(made, 2);
    assert_int_equal(on_copy, 3);
    assert_int_equal(on_base, 0);
    assert_int_equal(shared, 0);
    assert_int_equal(g_req[2].st, MD_OK);
    assert_true(g_req[2].out[0] == 4.0f);
    drop(m);
    ASSERT_WAIT(g_replica_frees == 2);
    /* 16 cores: 16 copies of 1000 bytes do not fit 2500: none, all unpacked */
    setenv("MD_TEST_CORES", "16", 1);
    g_prepack_max = 2500;
    md_model *m2 = load_ex("m2", 1, ROW2, 8, 1, 0, 1000, 10000, NULL);
    for (int i = 3; i < 6; i++)
        submit_ok(m2, i, 1, 2, (const float[]){(float)i, 1});
    ASSERT_WAIT(reqs_done(3, 6));
    assert_int_equal(locked_int(&g_replicas), 2);
    assert_int_equal(stat_int(m2, "prepacked_workers"), 0);
    pthread_mutex_lock(&g_mu);
    int on_base2 = batches_where(0);
    pthread_mutex_unlock(&g_mu);
    assert_int_equal(on_base2, 3);
    unsetenv("MD_TEST_CORES");
}

/* 8 workers on 2 cores forward 2 at a time: once every worker has taken a
 * request (none queued, none idle), exactly 2 are inside a forward and the
 * other 6 wait for a slot; a job's forward has slots of its own, so it runs
 * while the online ones are all taken; every request is answered. */
static void test_forwards_at_once_are_bounded_by_cores(void **state)
{
    (void)state;
    g_prepack_max = 0;
    setenv("MD_TEST_CORES", "2", 1);
    md_model *m = load(ROW2, 8, 1, 0, 1000, 10000);
    for (int i = 0; i < 8; i++)
        submit_ok(m, i, 1, 2, (const float[]){GATE, (float)i});
    ASSERT_WAIT(g_gate_entered == 2);
    wait_stat(m, "queued", 0);
    wait_stat(m, "idle_workers", 0);
    /* every online worker holds a request; only the slots' two forward */
    assert_int_equal(locked_int(&g_gate_entered), 2);
    md_err err;
    assert_int_equal(submit_prio(m, 8, 1, 2, (const float[]){GATE, 8}, MD_PRIO_BATCH, &err),
                     MD_OK);
    ASSERT_WAIT(g_gate_entered == 3);
    open_gate();
    ASSERT_WAIT(reqs_done(0, 9));
    for (int i = 0; i < 9; i++)
        assert_int_equal(g_req[i].st, MD_OK);
    drop(m);
    unsetenv("MD_TEST_CORES");
}

/* config "prepack": false, prepack_max_bytes 0, or weights over the bound:
 * no replica is used, the module itself computes */
static void test_prepack_off(void **state)
{
    (void)state;
    g_prepack_max = 1 << 20;
    md_model *m = load("{\"input\": {\"shape\": [2]}, \"prepack\": false}", 1, 64, 0, 100, 10000);
    submit_ok(m, 0, 1, 2, (const float[]){3, 1});
    ASSERT_WAIT(reqs_done(0, 1));
    g_prepack_max = 999; /* the fake's weights are 1000 bytes */
    md_model *m2 = load_ex("m2", 1, ROW2, 1, 64, 0, 100, 10000, NULL);
    submit_ok(m2, 1, 1, 2, (const float[]){4, 1});
    ASSERT_WAIT(reqs_done(1, 2));
    g_prepack_max = 0;
    md_model *m3 = load_ex("m3", 1, ROW2, 1, 64, 0, 100, 10000, NULL);
    submit_ok(m3, 2, 1, 2, (const float[]){5, 1});
    ASSERT_WAIT(reqs_done(2, 3));
    for (int i = 0; i < 3; i++) {
        assert_int_equal(g_req[i].st, MD_OK);
        assert_true(g_req[i].out[0] == 2.0f * (float)(i + 3));
    }
    pthread_mutex_lock(&g_mu);
    int on_replica = batches_where(1), made = g_replicas, calls = g_replica_calls;
    pthread_mutex_unlock(&g_mu);
    assert_int_equal(on_replica, 0);
    assert_int_equal(made, 0);
    assert_int_equal(calls, 1); /* m2 asked, and was told its weights are too large */
    assert_int_equal(stat_int(m, "prepacked_workers"), 0);
    assert_int_equal(stat_int(m2, "prepacked_workers"), 0);
}

/* A replica that cannot be made: the worker forwards on the module. */
static void test_prepack_refused_forwards_on_the_module(void **state)
{
    (void)state;
    g_prepack_max = 1 << 20;
    g_replica_refuse = 1;
    md_model *m = load(ROW2, 1, 64, 0, 100, 10000);
    submit_ok(m, 0, 1, 2, (const float[]){6, 1});
    ASSERT_WAIT(reqs_done(0, 1));
    assert_int_equal(g_req[0].st, MD_OK);
    assert_true(g_req[0].out[0] == 12.0f);
    assert_int_equal(locked_int(&g_replica_calls), 1);
    assert_int_equal(stat_int(m, "prepacked_workers"), 0);
}

/* A replica's forward that fails where the module succeeds: the request is
 * answered by the module, and that worker drops its replica for good. A
 * request the module fails too still fails, with the module's reason. */
static void test_prepack_forward_falls_back(void **state)
{
    (void)state;
    g_prepack_max = 1 << 20;
    md_model *m = load(ROW2, 1, 64, 0, 100, 10000);
    wait_stat(m, "prepacked_workers", 1);
    submit_ok(m, 0, 1, 2, (const float[]){FAIL, 1});
    ASSERT_WAIT(reqs_done(0, 1));
    assert_int_equal(g_req[0].st, MD_EUNPROC);
    assert_string_equal(g_req[0].msg, "fake forward failed");
    assert_int_equal(stat_int(m, "prepacked_workers"), 1); /* the module failed too: kept */
    submit_ok(m, 1, 1, 2, (const float[]){XNNFAIL, 1});
    ASSERT_WAIT(reqs_done(1, 2));
    assert_int_equal(g_req[1].st, MD_OK);
    assert_true(g_req[1].out[0] == 2.0f * XNNFAIL);
    assert_int_equal(stat_int(m, "prepacked_workers"), 0);
    ASSERT_WAIT(g_replica_frees == 1);
    int before = locked_int(&g_nbatches);
    submit_ok(m, 2, 1, 2, (const float[]){8, 1});
    ASSERT_WAIT(reqs_done(2, 3));
    pthread_mutex_lock(&g_mu);
    int last_on_replica = g_batches[g_nbatches - 1].replica, n = g_nbatches;
    pthread_mutex_unlock(&g_mu);
    assert_int_equal(n, before + 1);
    assert_int_equal(last_on_replica, 0);
    assert_true(g_req[2].out[0] == 16.0f);
}

/* Submit `vals` as a tensor of shape dims[0..ndim) on `m` for g_req[i]. */
static md_status submit_shaped(md_model *m, int i, const int64_t *dims, int ndim,
                               const float *vals, md_priority prio, md_err *err)
{
    md_tensor t = {0};
    t.ndim = ndim;
    t.count = 1;
    for (int d = 0; d < ndim; d++)
        t.count *= (size_t)(t.shape[d] = dims[d]);
    t.data = malloc(sizeof(float) * t.count);
    memcpy(t.data, vals, sizeof(float) * t.count);
    md_err_clear(err);
    return md_model_submit(m, &t, prio, on_done, &g_req[i], err);
}

/* One row may come without its batch dimension: in the declared row shape
 * ([1, 2, 3]) or in it without its leading 1s ([2, 3]: x.tolist() of one
 * 28x28 image for input.shape [1, 28, 28]); online, either is a batch of
 * one. A job's chunk always has its rows: 2 rows of 3 values stay 2 rows
 * (refused, 3 values a row), never one row answered for two. */
static void test_one_row_without_batch_dim(void **state)
{
    (void)state;
    md_model *m = load("{\"input\": {\"shape\": [1, 2, 3]}}", 1, 64, 0, 100, 10000);
    const float v[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    md_err err;
    assert_int_equal(submit_shaped(m, 0, (const int64_t[]){2, 3}, 2, v, MD_PRIO_ONLINE, &err),
                     MD_OK);
    assert_int_equal(
        submit_shaped(m, 1, (const int64_t[]){1, 2, 3}, 3, v, MD_PRIO_ONLINE, &err), MD_OK);
    assert_int_equal(
        submit_shaped(m, 2, (const int64_t[]){2, 2, 3}, 3, v, MD_PRIO_ONLINE, &err), MD_OK);
    ASSERT_WAIT(reqs_done(0, 3));
    for (int i = 0; i < 2; i++) {
        assert_int_equal(g_req[i].st, MD_OK);
        assert_int_equal(g_req[i].ndim, 4);
        assert_int_equal(g_req[i].shape[0], 1);
        assert_int_equal(g_req[i].count, 6);
        assert_true(g_req[i].out[5] == 12.0f);
    }
    assert_int_equal(g_req[2].st, MD_OK);
    assert_int_equal(g_req[2].shape[0], 2); /* [2, 2, 3] is two rows, as before */
    assert_true(g_req[2].out[11] == 24.0f);
    /* neither a row nor rows: the error says how one row may be sent */
    assert_int_equal(submit_shaped(m, 3, (const int64_t[]){3, 2}, 2, v, MD_PRIO_ONLINE, &err),
                     MD_EINVAL);
    assert_string_equal(md_err_code(&err), "wrong_shape");
    assert_non_null(strstr(err.msg, "expects rows of shape [1, 2, 3] (6 values)"));
    assert_non_null(strstr(err.msg, "one row alone may also be sent as an array of shape [2, 3]"));
    /* a job's chunk of 2 rows of 3 values: not taken as one row */
    assert_int_equal(submit_shaped(m, 4, (const int64_t[]){2, 3}, 2, v, MD_PRIO_BATCH, &err),
                     MD_EINVAL);
    assert_string_equal(md_err_code(&err), "wrong_shape");
    assert_non_null(strstr(err.msg, "each row has 3 values"));
    usleep(20000);
    for (int i = 3; i < 5; i++)
        assert_int_equal(locked_int(&g_req[i].calls), 0);
}

/* How many recorded forwards of fake model `id` had a row starting with
 * FAIL, and of those how many were not quiet (would log libtorch's message);
 * a loud one must be on the model itself, not a replica. */
static int fail_forwards(int id, int *loud)
{
    int n = 0, loud_on_replica = 0;
    *loud = 0;
    pthread_mutex_lock(&g_mu);
    for (int i = 0; i < g_nbatches; i++) {
        const batch_rec *b = &g_batches[i];
        int fail = 0;
        for (int64_t r = 0; r < b->rows && r < 64; r++)
            fail |= b->first[r] == FAIL;
        if (b->model != id || !fail)
            continue;
        n++;
        if (!b->quiet) {
            ++*loud;
            loud_on_replica += b->replica;
        }
    }
    pthread_mutex_unlock(&g_mu);
    assert_int_equal(loud_on_replica, 0); /* after the unlock: a failure jumps out */
    return n;
}

/* A failing request logs libtorch's message once (one request, one log
 * line): the forward of that request alone on the model logs it; the
 * replica's forward before it (its own width check, split_with_sizes, said
 * first before), forwards of several requests (run again in halves) and a
 * later piece of a request that failed already are quiet. */
static void test_failure_logged_once(void **state)
{
    (void)state;
    g_prepack_max = 1 << 20;
    md_model *m = load(ROW2, 1, 64, 0, 100, 10000);
    int id = locked_int(&g_next_id) - 1;
    wait_stat(m, "prepacked_workers", 1);
    /* alone: the replica fails, then the model */
    submit_ok(m, 0, 1, 2, (const float[]){FAIL, 0});
    ASSERT_WAIT(reqs_done(0, 1));
    assert_int_equal(g_req[0].st, MD_EUNPROC);
    int loud;
    assert_int_equal(fail_forwards(id, &loud), 2);
    assert_int_equal(loud, 1);
    /* batched with others: the batch of 5, [3 4 5], and [3] on each of the
     * replica and the model */
    submit_ok(m, 1, 1, 2, (const float[]){GATE, 0});
    ASSERT_WAIT(g_gate_entered == 1);
    for (int i = 2; i <= 6; i++)
        submit_ok(m, i, 1, 2, (const float[]){i == 4 ? FAIL : (float)i, 0});
    open_gate();
    ASSERT_WAIT(reqs_done(1, 7));
    assert_int_equal(g_req[4].st, MD_EUNPROC);
    assert_true(fail_forwards(id, &loud) > 3);
    assert_int_equal(loud, 2);
    /* a request split in pieces of 3 rows, two of them failing: one logs */
    g_prepack_max = 0;
    md_model *m2 = load_ex("split", 1, ROW2, 1, 3, 0, 100, 10000, NULL);
    int id2 = locked_int(&g_next_id) - 1;
    float in[24] = {0};
    for (int r = 0; r < 12; r++)
        in[2 * r] = r == 4 || r == 10 ? FAIL : (float)r;
    submit_ok(m2, 7, 12, 2, in);
    ASSERT_WAIT(reqs_done(7, 8));
    assert_int_equal(g_req[7].st, MD_EUNPROC);
    assert_int_equal(fail_forwards(id2, &loud), 2);
    assert_int_equal(loud, 1);
}

/* A model with no declared input shape whose forward fails on an online
 * request: the answer says first what modeld read the body as and, for a
 * body of several rows, how to declare it as one input; the model's reason
 * follows, and the status and code stay the forward's. A job's chunk, and a
 * request after the shape was learned, get the model's reason only. */
static void test_configless_failure_says_what_was_read(void **state)
{
    (void)state;
    pthread_mutex_lock(&g_mu);
    g_need_width = 4;
    pthread_mutex_unlock(&g_mu);
    md_model *m = load_ex("noshape", 1, NULL, 1, 64, 0, 100, 10000, NULL);
    const float v[6] = {1, 2, 3, 4, 5, 6};
    submit_ok(m, 0, 2, 3, v);
    ASSERT_WAIT(reqs_done(0, 1));
    assert_int_equal(g_req[0].st, MD_EUNPROC);
    assert_string_equal(g_req[0].code, "forward_failed"); /* the forward's own code */
    const char *msg = g_req[0].msg;
    assert_ptr_equal(strstr(msg, "modeld read the body as 2 rows of 3 values, as model noshape "
                                 "version 1 declares no input.shape."),
                     msg);
    assert_non_null(strstr(msg, "If the body is one input, not 2 rows, declare its shape when "
                                "deploying: -F 'config={\"input\": {\"shape\": [1, 2, 3]}}'."));
    assert_non_null(strstr(msg, "On those rows, fake forward: mat1 and mat2 shapes cannot be "
                                "multiplied (2x3 and 4x8)"));
    /* one row: what was read, no hint */
    submit_ok(m, 1, 1, 3, v);
    ASSERT_WAIT(reqs_done(1, 2));
    assert_ptr_equal(strstr(g_req[1].msg, "modeld read the body as 1 row of 3 values"),
                     g_req[1].msg);
    assert_null(strstr(g_req[1].msg, "If the body is one input"));
    assert_non_null(strstr(g_req[1].msg, "On that row, fake forward: mat1"));
    /* rows of [2, 3]: the whole [2, 2, 3] is the shape to declare */
    const float w[12] = {0};
    md_err err;
    assert_int_equal(
        submit_shaped(m, 2, (const int64_t[]){2, 2, 3}, 3, w, MD_PRIO_ONLINE, &err), MD_OK);
    ASSERT_WAIT(reqs_done(2, 3));
    assert_non_null(strstr(g_req[2].msg, "2 rows of shape [2, 3]"));
    assert_non_null(strstr(g_req[2].msg, "{\"shape\": [2, 2, 3]}"));
    /* a job's chunk */
    assert_int_equal(submit_prio(m, 3, 2, 3, v, MD_PRIO_BATCH, &err), MD_OK);
    ASSERT_WAIT(reqs_done(3, 4));
    assert_int_equal(g_req[3].st, MD_EUNPROC);
    assert_ptr_equal(strstr(g_req[3].msg, "fake forward: mat1"), g_req[3].msg);
    /* once a forward succeeded the shape is known and rows are checked at
     * submit: a later failure is not about how the body was read */
    submit_ok(m, 4, 1, 4, (const float[]){1, 2, 3, 4});
    ASSERT_WAIT(reqs_done(4, 5));
    assert_int_equal(g_req[4].st, MD_OK);
    submit_ok(m, 5, 2, 4, (const float[]){FAIL, 0, 0, 0, 1, 2, 3, 4});
    ASSERT_WAIT(reqs_done(5, 6));
    assert_string_equal(g_req[5].msg, "fake forward failed");
}

int main(void)
{
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&g_cv, &ca);
    pthread_condattr_destroy(&ca);
    /* without the linker seam every test would fail the same way: say so once */
    md_model *probe = NULL;
    md_err perr;
    md_model_defaults pdef = {1, 1, 0, 1, 1000, 0, 0, 0, 0, 0};
    md_model_load("probe", 1, "fail-probe", NULL, &pdef, &probe, &perr);
    if (g_load_calls == 0) {
        fprintf(stderr, "test_batcher: the fake backend is not linked in; link with "
                        "-Wl,--wrap=md_torch_load -Wl,--wrap=md_torch_forward "
                        "-Wl,--wrap=md_torch_free\n");
        md_model_release(probe);
        return 1;
    }
#define T(f) cmocka_unit_test_setup_teardown(f, setup, teardown)
    const struct CMUnitTest tests[] = {
        T(test_fake_backend_linked),
        T(test_single_request_roundtrip),
        T(test_greedy_take),
        T(test_coalesce_small_requests),
        T(test_coalesce_off_or_slow_forwards),
        T(test_coalesce_not_behind_big_or_untimed_batches),
        T(test_delay_from_first_arrival),
        T(test_delay_not_stacked_on_queue_wait),
        T(test_size_cap),
        T(test_split_large_request),
        T(test_split_across_workers),
        T(test_split_shares_batches),
        T(test_timeout),
        T(test_batch_priority_never_times_out),
        T(test_queue_full),
        T(test_wrong_shape),
        T(test_preprocess),
        T(test_online_and_jobs_have_own_workers),
        T(test_job_workers_niced),
        T(test_job_chunk_is_one_forward),
        T(test_forward_error),
        T(test_bad_request_fails_alone),
        T(test_split_output_width_depends_on_batch),
        T(test_split_with_stalled_and_failing_pieces),
        T(test_configless_shape_learned_from_success_only),
        T(test_sizes_checked),
        T(test_registry_swap_drains_old),
        T(test_registry_versions),
        T(test_registry_budget),
        T(test_registry_admit_takes_back_the_promise),
        T(test_concurrent_submitters),
        T(test_release_drains_queue),
        T(test_eight_dim_row_shape),
        T(test_loaded_version_starts_workers_when_used),
        T(test_forwards_at_once_are_bounded_by_cores),
        T(test_prepack_copies_are_a_pool),
        T(test_prepack_pool_is_bounded_by_cores_and_bytes),
        T(test_prepack_off),
        T(test_prepack_refused_forwards_on_the_module),
        T(test_prepack_forward_falls_back),
        T(test_one_row_without_batch_dim),
        T(test_failure_logged_once),
        T(test_configless_failure_says_what_was_read),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
