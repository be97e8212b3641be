/*
 * batcher.c - a loaded model version's request queues and the workers that
 * batch them into forwards, the packed copies' pool they forward on, and
 * the shaping and preprocessing of what is submitted. The version's struct
 * is model_impl.h's; its load, accessors, stats and metrics are model.c's.
 *
 * DESIGN
 * One mutex guards two FIFO queues per version, online requests and batch
 * job chunks, each with its own pool of `workers` threads and condition
 * variable, as redis' bio.c keeps a queue per job type. Job workers run at
 * the job_nice setting, so the kernel schedules online work first and
 * preempts a job forward when an online request arrives: a queue order alone
 * cannot, because a worker inside a 64-row job forward would make the next
 * online request wait for it (measured: 1-row p99 4.5 -> 8.6 ms at 32
 * connections when jobs shared the online workers). With no online traffic
 * the job workers have the cores to themselves.
 * A free worker takes what is queued at once, up to max_batch_size rows:
 * under load batches grow by themselves while the other workers compute.
 * Online rows wake an idle worker only when it is worth it (wake_online):
 * while another computes a small batch and the version's batches take at
 * most coalesce_us on average, fewer than half a batch of rows wait for
 * that worker, which takes them all when it comes back (measured on two
 * cores, 1-row JSON at 32 connections: 4 -> 7.5 rows a forward, ~18% less
 * CPU a request, bench/RESULTS.md); half a batch, a big batch computing,
 * slow forwards or coalesce_us 0 wake the next idle worker at once.
 * Only when max_delay_us > 0 does an online worker wait for more, and then
 * only until max_delay_us after the batch's FIRST request arrived (the clock
 * starts at arrival, not when a worker polls), so a fixed delay never stacks
 * on top of queueing time.
 * A request larger than max_batch_size is taken in pieces, by several
 * workers at once (a worker that leaves rows queued wakes another, as above:
 * a leftover under half a batch waits for it); each
 * piece writes its rows of the shared output
 * and the piece that completes the last row answers. An online request whose
 * deadline passed before any row was taken is answered 504 and never
 * computed (job chunks have no deadline: under online load they wait for
 * spare CPU however long it takes); one whose requester is gone (the alive
 * check, a peek at the client's socket) is dropped the same way. The queue
 * limit counts online requests, answered 503 at submit.
 * A split request answers only when every piece's output rows have one
 * shape: a model whose output width depends on the batch (x @ x.t()) fails
 * it (500 bad_model_output) instead of copying rows of another width.
 * A model deployed without config.input.shape learns its row shape from the
 * first forward that SUCCEEDS (set by that worker under the lock, published
 * through `shape_known`); until then any row shape is queued, batches hold
 * one row shape each, and each forward decides. A request whose forward
 * fails therefore never fixes the shape for the requests after it.
 * Every size computed from a request or a config (row size, gather buffer,
 * output buffer) is overflow-checked and allocated with a status, so a huge
 * shape answers an error instead of aborting the process.
 * A forward of several requests that fails with the model's own error (it
 * raised) is run again in halves, down to single requests (run_pieces), so a
 * request that makes the model throw fails alone instead of taking its batch
 * with it: about 2 log2(n) extra forwards for one bad request among n, 2n - 1
 * at most when every request fails. libtorch's whole message is logged once
 * per failing request: forwards of several requests, on a replica (its own
 * width check would be said first, split_with_sizes, no part of the user's
 * model) and of a piece of a request that failed already are quiet
 * (md_torch_forward_quiet); that request's forward alone on the model logs.
 * Lifetime: the registry and each queued request hold references; the last
 * release sets `stopping`; workers finish the queue, exit, and the last one
 * to exit frees the model, so a release from a worker thread never joins
 * itself.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "model_impl.h"

static struct timespec abs_time(double mono_s)
{
    struct timespec ts;
    ts.tv_sec = (time_t)mono_s;
    ts.tv_nsec = (long)((mono_s - (double)ts.tv_sec) * 1e9);
    return ts;
}

static void finish_item(md_model *m, item *it)
{
    if (atomic_load(&it->failed))
        it->cb(it->ctx, it->err.status, &it->err, NULL, NULL, 0);
    else
        it->cb(it->ctx, MD_OK, NULL, it->out, it->out_shape, it->out_ndim);
    free(it->out);
    md_tensor_free(&it->in);
    free(it);
    md_model_release(m);
}

typedef struct piece {
    item *it;
    int64_t start, rows;
} piece;

static int same_row_shape(const item *a, const item *b)
{
    return a->in.ndim == b->in.ndim &&
           memcmp(a->in.shape + 1, b->in.shape + 1, sizeof(int64_t) * (size_t)(a->in.ndim - 1)) == 0;
}

/* Fail `it` with `e` unless it already failed (the first failure is its answer). */
/* Returns 1 for the request's first failure. */
static int fail_item(item *it, const md_err *e)
{
    if (atomic_exchange(&it->failed, 1) != 0)
        return 0;
    it->err = *e;
    return 1;
}

/* Store this piece's output rows in its request: the first piece sizes the
 * request's output, later ones must have the same row shape (a model whose
 * output width depends on the batch must not write rows of another width
 * into it). Called under m->mu; returns 1 when the caller copies the rows. */
static int claim_output(md_model *m, item *it, int64_t out_row, const int64_t *out_shape,
                        int out_ndim)
{
    md_err e;
    if (atomic_load(&it->failed))
        return 0;
    if (!it->out) {
        size_t count;
        if (md_mul_size((size_t)it->rows, (size_t)out_row, &count)) {
            md_err_setc(&e, MD_ENOMEM, "out_of_memory",
                        "model %s answers %lld values per row: %lld rows of them do not fit in "
                        "memory; send fewer rows",
                        m->name, (long long)out_row, (long long)it->rows);
            fail_item(it, &e);
            return 0;
        }
        it->out = md_mallocarray_checked(count, sizeof(float), "the output of a prediction", &e);
        if (!it->out) {
            fail_item(it, &e);
            return 0;
        }
        it->out_row = out_row;
        it->out_ndim = out_ndim;
        memcpy(it->out_shape, out_shape, sizeof(int64_t) * (size_t)out_ndim);
        it->out_shape[0] = it->rows;
        return 1;
    }
    if (out_ndim != it->out_ndim ||
        memcmp(out_shape + 1, it->out_shape + 1, sizeof(int64_t) * (size_t)(out_ndim - 1)) != 0) {
        char a[128], b[128];
        md_err_setc(&e, MD_EINTERNAL, "bad_model_output",
                    "model %s returned rows of shape %s for one part of a split request and %s "
                    "for another; its output per row must not depend on the batch (requests "
                    "over batching.max_batch_size = %d rows are split), or send at most %d rows",
                    m->name, md_fmt_dims(a, sizeof a, it->out_shape + 1, it->out_ndim - 1),
                    md_fmt_dims(b, sizeof b, out_shape + 1, out_ndim - 1), m->max_batch,
                    m->max_batch);
        fail_item(it, &e);
        return 0;
    }
    return 1;
}

/* A config-less model learns its row shape from a successful forward on
 * rows of `shape[1..ndim)`; the first one wins. */
static void learn_row_shape(md_model *m, const int64_t *shape, int ndim, int64_t row_size)
{
    if (atomic_load_explicit(&m->shape_known, memory_order_acquire))
        return;
    pthread_mutex_lock(&m->mu);
    if (!atomic_load_explicit(&m->shape_known, memory_order_relaxed)) {
        m->row_ndim = ndim - 1;
        memcpy(m->row_shape, shape + 1, sizeof(int64_t) * (size_t)(ndim - 1));
        m->row_size = row_size;
        m->norm_inner = m->n_norm > 1 ? m->row_size / m->n_norm : 0;
        atomic_store_explicit(&m->shape_known, 1, memory_order_release);
    }
    pthread_mutex_unlock(&m->mu);
}

/*
 * One forward over `pieces` (n of them, `rows` rows, one row shape), then each
 * piece's rows delivered to its request. When a forward of several requests
 * fails with the model's own error (it raised, or rejected the batch), the
 * batch is run again in halves, recursively, so a request that makes the
 * model throw fails only itself, not the others that happened to share its
 * batch (the cost is paid only on failure). `batch`/`batch_cap` are the
 * worker's gather buffer.
 */
static md_torch_model *pool_take(md_model *m);
static void pool_give(md_model *m, md_torch_model *r);

/* One forward: on a packed copy from the version's pool (pool_take) when
 * the version is packed, else on the model itself, which any number of
 * workers may run at once. Should a packed copy fail where the model itself
 * succeeds (an input XNNPACK refuses), packing stops for the version for
 * good, and that is said once. The packed copy's own failure is never
 * logged: the model's forward after it has the reason worth logging (the
 * copy's is the width check it was given, split_with_sizes, which is no part
 * of the user's model). `quiet`: the model's failure is not logged either
 * (run_pieces says when). */
static md_status forward_on(md_model *m, int quiet, const float *input, const int64_t *shape,
                            int ndim, float **out, int64_t *out_shape, int *out_ndim,
                            md_err *err);

/* ---- forward slots: at most one forward per core and queue at once ----
 *
 * Workers beyond the cores (16 on 2 cores, or many versions' workers) would
 * otherwise all forward at once, time-sliced: no faster, and each holds its
 * batch's activations and its BLAS buffer meanwhile, in its own malloc
 * arena, which keeps them afterwards (bench/memory.py: a 192 MB model at 16
 * workers on 2 cores held 240-289 MB, 226-237 MB with the slots). Online
 * and job forwards have slots of their own, so a job never takes one an
 * online request waits for. Admission is in arrival order (a ticket), so no
 * worker starves. Process-wide: the cores are. */
typedef struct fwd_slots {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    unsigned long next, done; /* tickets handed out, forwards finished */
} fwd_slots;
static fwd_slots slots[2] = {
    {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0},
    {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0},
};

static md_status forward(md_model *m, int qi, int quiet, const float *input,
                         const int64_t *shape, int ndim, float **out, int64_t *out_shape,
                         int *out_ndim, md_err *err)
{
    fwd_slots *f = &slots[qi];
    unsigned long cap = (unsigned long)md_batcher_cores();
    pthread_mutex_lock(&f->mu);
    unsigned long ticket = f->next++;
    while (ticket >= f->done + cap) /* the earlier tickets hold every slot */
        pthread_cond_wait(&f->cv, &f->mu);
    pthread_mutex_unlock(&f->mu);
    md_status st = forward_on(m, quiet, input, shape, ndim, out, out_shape, out_ndim, err);
    pthread_mutex_lock(&f->mu);
    int waiting = f->next - f->done > cap;
    f->done++;
    if (waiting)
        pthread_cond_broadcast(&f->cv); /* the next ticket, whichever thread holds it */
    pthread_mutex_unlock(&f->mu);
    return st;
}

/* One forward on `t` (the version's module or a packed copy of it). A
 * version with declared inputs or outputs goes through md_torch_forward_io:
 * its rows are the inputs' words side by side (md_model_pack), and its
 * answer the outputs' floats side by side, each output's rows checked
 * against the shape the load's test forward found, so a split request or a
 * batch never mixes rows of different layouts. */
static md_status forward_t(md_model *m, md_torch_model *t, int quiet, const float *input,
                           const int64_t *shape, int ndim, float **out, int64_t *out_shape,
                           int *out_ndim, md_err *err)
{
    if (!m->n_in && !m->n_out)
        return (quiet ? md_torch_forward_quiet : md_torch_forward)(t, input, shape, ndim, out,
                                                                   out_shape, out_ndim, err);
    md_torch_in ins[MD_MAX_IO];
    int64_t shapes[MD_MAX_IO][MD_MAX_DIMS + 1];
    int64_t rows = shape[0], row_words = 1;
    for (int d = 1; d < ndim; d++)
        row_words *= shape[d];
    int n_in = m->n_in ? m->n_in : 1;
    for (int i = 0; i < n_in; i++) {
        const md_io *io = &m->in[i];
        if (m->n_in) {
            shapes[i][0] = rows;
            memcpy(shapes[i] + 1, io->shape, sizeof(int64_t) * (size_t)io->ndim);
            ins[i] = (md_torch_in){input + io->off, row_words, io->is_int, io->dtype,
                                   1 + io->ndim, shapes[i]};
        } else {
            ins[i] = (md_torch_in){input, row_words, 0, m->in_dtype, ndim, shape};
        }
    }
    md_torch_outs o;
    static const char *const first[1] = {"output0"};
    md_status st = m->n_out ? md_torch_forward_io(t, ins, n_in, m->out_keys, m->n_out, quiet,
                                                  &o, err)
                            : md_torch_forward_io(t, ins, n_in, first, 1, quiet, &o, err);
    if (st != MD_OK)
        return st;
    if (!m->n_out) { /* the first tensor forward returns, in its own shape */
        *out = o.data;
        memcpy(out_shape, o.shape[0], sizeof(int64_t) * (size_t)o.ndim[0]);
        *out_ndim = o.ndim[0];
        return MD_OK;
    }
    for (int j = 0; j < m->n_out; j++) {
        const md_io *io = &m->out[j];
        int same = o.ndim[j] == io->ndim + 1;
        for (int d = 0; same && d < io->ndim; d++)
            same = o.shape[j][d + 1] == io->shape[d];
        if (!same) {
            char a[96], b[96];
            md_err_setc(err, MD_EUNPROC, "bad_model_output",
                        "model %s returned rows of shape %s for output \"%s\", where its test "
                        "forward at load returned %s; each output's rows must keep one shape",
                        m->name, md_fmt_dims(a, sizeof a, o.shape[j] + 1, o.ndim[j] - 1),
                        io->name, md_fmt_dims(b, sizeof b, io->shape, io->ndim));
            free(o.data);
            return MD_EUNPROC;
        }
    }
    *out = o.data;
    out_shape[0] = rows;
    out_shape[1] = o.row_values;
    *out_ndim = 2;
    return MD_OK;
}

static md_status forward_on(md_model *m, int quiet, const float *input, const int64_t *shape,
                            int ndim, float **out, int64_t *out_shape, int *out_ndim,
                            md_err *err)
{
    md_torch_model *r = pool_take(m);
    if (!r)
        return forward_t(m, m->torch, quiet, input, shape, ndim, out, out_shape, out_ndim, err);
    md_status st = forward_t(m, r, 1, input, shape, ndim, out, out_shape, out_ndim, err);
    if (st != MD_EUNPROC) {
        pool_give(m, r);
        return st;
    }
    md_err rerr = *err;
    st = forward_t(m, m->torch, quiet, input, shape, ndim, out, out_shape, out_ndim, err);
    if (st == MD_OK) {
        if (atomic_exchange(&m->fallback_logged, 1) == 0)
            md_log(MD_LOG_WARN, "model %s version %d: the prepacked forward failed where the "
                   "model's own succeeded (%s); forwarding without prepacking",
                   m->name, md_model_version(m), rerr.msg);
        pthread_mutex_lock(&m->pool_mu);
        m->pool_max = 0; /* copies in a forward now go as they come back */
        /* the idle copies go now (under the lock: a rare path, and a few
         * at most), so resident bytes stop counting them */
        m->pool_made -= 1 + m->pool_nfree;
        atomic_store(&m->prepacked, m->pool_made);
        for (int i = 0; i < m->pool_nfree; i++)
            md_torch_free(m->pool_free[i]);
        m->pool_nfree = 0;
        pthread_cond_broadcast(&m->pool_cv);
        pthread_mutex_unlock(&m->pool_mu);
        md_torch_free(r);
    } else {
        pool_give(m, r);
    }
    return st;
}

/*
 * The error an online request gets when the forward failed on its rows: for
 * a model with no declared input shape (nor one learned yet, which would
 * have checked the rows at submit), what modeld read the body as comes
 * first, then how to declare the shape, then the model's reason (`ferr`).
 * Without a declared shape every inner array is a row, so one input sent as
 * a nested array (a 28x28 image from x.tolist()) reaches the model as 28 rows
 * of 28 values and fails there with a matrix product's shapes, which do not
 * say that. Returns `ferr`, or `buf` holding the longer answer.
 */
static const md_err *explain_rows(const md_model *m, const item *it, const md_err *ferr,
                                  md_err *buf)
{
    if (!it->unshaped || ferr->status != MD_EUNPROC ||
        strcmp(md_err_code(ferr), "bad_model_output") == 0)
        return ferr;
    const md_tensor *in = &it->in; /* as sent: without a known shape nothing reshaped it */
    long long rows = (long long)in->shape[0];
    char read[128], dims[96], hint[192] = "";
    if (in->ndim == 2)
        snprintf(read, sizeof read, "%lld row%s of %lld value%s", rows, rows == 1 ? "" : "s",
                 (long long)in->shape[1], in->shape[1] == 1 ? "" : "s");
    else
        snprintf(read, sizeof read, "%lld row%s of shape %s", rows, rows == 1 ? "" : "s",
                 md_fmt_dims(dims, sizeof dims, in->shape + 1, in->ndim - 1));
    if (rows > 1 && in->ndim < MD_MAX_DIMS) {
        /* the whole array as one input; a 2-D one as one channel (C, H, W
         * with C = 1, as ToTensor gives a grayscale image), which one_row
         * then takes as sent */
        int64_t one[MD_MAX_DIMS];
        int nd = 0;
        if (in->ndim == 2)
            one[nd++] = 1;
        memcpy(one + nd, in->shape, sizeof(int64_t) * (size_t)in->ndim);
        nd += in->ndim;
        snprintf(hint, sizeof hint,
                 " If the body is one input, not %lld rows, declare its shape when deploying: "
                 "-F 'config={\"input\": {\"shape\": %s}}'.",
                 rows, md_fmt_dims(dims, sizeof dims, one, nd));
    }
    md_err_setc(buf, ferr->status, md_err_code(ferr),
                "modeld read the body as %s, as model %s version %d declares no input.shape.%s "
                "On %s, %s",
                read, m->name, md_model_version(m), hint, rows == 1 ? "that row" : "those rows",
                ferr->msg);
    return buf;
}

static void run_pieces(md_model *m, int qi, piece *pieces, int n, int64_t rows, float **batch_p,
                       size_t *batch_cap_p)
{
    float *batch = *batch_p;
    size_t batch_cap = *batch_cap_p;
    /* one piece: forward on its rows in place; else gather. Every piece
     * has the first one's row shape (the take loop stops at another). */
    const item *first = pieces[0].it;
    int64_t row_size = first->row_size;
    md_err ferr;
    md_err_clear(&ferr);
    md_status st = MD_OK;
    const float *input = NULL;
    if (n == 1) {
        input = first->in.data + pieces[0].start * row_size;
    } else {
        size_t need;
        if (md_mul_size((size_t)rows, (size_t)row_size, &need))
            st = md_err_setc(&ferr, MD_ENOMEM, "out_of_memory",
                             "a batch of %lld rows of %lld values is too large",
                             (long long)rows, (long long)row_size);
        if (st == MD_OK && need > batch_cap) {
            free(batch);
            batch_cap = 0;
            batch = md_mallocarray_checked(need, sizeof(float), "a batch", &ferr);
            if (batch)
                batch_cap = need;
            else
                st = MD_ENOMEM;
        }
        if (st == MD_OK) {
            size_t off = 0;
            for (int i = 0; i < n; i++) {
                size_t len = (size_t)pieces[i].rows * (size_t)row_size;
                memcpy(batch + off, pieces[i].it->in.data + pieces[i].start * row_size,
                       len * sizeof(float));
                off += len;
            }
            input = batch;
        }
    }
    int64_t shape[MD_MAX_DIMS + 1];
    int ndim = first->in.ndim;
    shape[0] = rows;
    memcpy(shape + 1, first->in.shape + 1, sizeof(int64_t) * (size_t)(ndim - 1));
    float *out = NULL;
    int64_t out_shape[MD_MAX_DIMS];
    int out_ndim = 0;
    if (st == MD_OK) {
        /* libtorch's whole message is logged once per failing request: by
         * the forward of that request alone. A forward of several is run
         * again in halves when it fails (below), and a piece of a request
         * that has failed already changes nothing in its answer. */
        int quiet = n > 1 || atomic_load(&first->failed);
        double t0 = now_s();
        st = forward(m, qi, quiet, input, shape, ndim, &out, out_shape, &out_ndim, &ferr);
        md_hist_observe(&m->forward_hist, now_s() - t0);
    }
    if (st == MD_OK && (out_ndim < 1 || out_shape[0] != rows)) {
        st = md_err_setc(&ferr, MD_EUNPROC, "bad_model_output",
                         "model %s returned %lld rows for a batch of %lld; its output must "
                         "keep the batch dimension",
                         m->name, out_ndim < 1 ? 0LL : (long long)out_shape[0],
                         (long long)rows);
    }
    int64_t out_row = 1;
    if (st == MD_OK && md_shape_product(out_shape + 1, out_ndim - 1, &out_row) != 0)
        st = md_err_setc(&ferr, MD_EUNPROC, "bad_model_output",
                         "model %s returned an output whose size overflows", m->name);
    if (st == MD_OK)
        learn_row_shape(m, shape, ndim, row_size);
    *batch_p = batch;
    *batch_cap_p = batch_cap;
    if (n > 1 && (st == MD_ENOMEM ||
                  (st == MD_EUNPROC && strcmp(md_err_code(&ferr), "bad_model_output") != 0))) {
        /* isolate by halves: a half that fails again is split again, down to
         * single requests, so one bad request costs about 2 log2(n) extra
         * forwards (2n - 1 at most, when all fail), and the others are
         * answered (the failed batch is not counted). A batch too large to
         * gather is split the same way. */
        md_log(MD_LOG_DEBUG, "model %s: a forward of %d requests failed (%s); splitting it",
               m->name, n, ferr.msg);
        free(out);
        int half = n / 2;
        int64_t first_rows = 0;
        for (int i = 0; i < half; i++)
            first_rows += pieces[i].rows;
        run_pieces(m, qi, pieces, half, first_rows, batch_p, batch_cap_p);
        run_pieces(m, qi, pieces + half, n - half, rows - first_rows, batch_p, batch_cap_p);
        return;
    }
    atomic_fetch_add(&m->n_batches, 1);
    atomic_fetch_add(&m->n_rows, rows);
    int bucket = 0;
    while (bucket < 7 && (1LL << bucket) < rows)
        bucket++;
    atomic_fetch_add(&m->batch_hist[bucket], 1);
    md_hist_observe(&m->rows_hist, (double)rows);

    int64_t off = 0;
    for (int i = 0; i < n; i++) {
        item *it = pieces[i].it;
        if (st != MD_OK) {
            md_err why;
            if (fail_item(it, explain_rows(m, it, &ferr, &why)))
                atomic_fetch_add(&m->n_failed, 1);
        } else {
            pthread_mutex_lock(&m->mu);
            int copy = claim_output(m, it, out_row, out_shape, out_ndim);
            pthread_mutex_unlock(&m->mu);
            /* the rows this piece owns: no other piece writes them */
            if (copy)
                memcpy(it->out + pieces[i].start * out_row, out + off * out_row,
                       (size_t)(pieces[i].rows * out_row) * sizeof(float));
        }
        off += pieces[i].rows;
        /* read rows first: once done is added, another worker may finish and free it */
        int64_t total = it->rows;
        if (atomic_fetch_add(&it->done, pieces[i].rows) + pieces[i].rows == total)
            finish_item(m, it);
    }
    free(out);
}


/* Worker threads alive in the process, all models together: main() waits for
 * none to be left before it returns, since exit() runs libtorch's static
 * destructors and a worker still inside libtorch (freeing its model, or
 * making its replica right after a load) would crash the exit (seen: SIGSEGV
 * after "stopped" when SIGTERM came within 30 ms of a deploy). */
static pthread_mutex_t live_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t live_cv = PTHREAD_COND_INITIALIZER;
static int live_threads;

void md_batcher_live_add(int n)
{
    pthread_mutex_lock(&live_mu);
    live_threads += n;
    if (live_threads == 0)
        pthread_cond_broadcast(&live_cv);
    pthread_mutex_unlock(&live_mu);
}

int md_models_wait_stopped(double timeout_s)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    long long ns = (long long)ts.tv_nsec + (long long)(timeout_s * 1e9);
    ts.tv_sec += (time_t)(ns / 1000000000LL);
    ts.tv_nsec = (long)(ns % 1000000000LL);
    pthread_mutex_lock(&live_mu);
    while (live_threads > 0 && pthread_cond_timedwait(&live_cv, &live_mu, &ts) == 0)
        ;
    int left = live_threads;
    pthread_mutex_unlock(&live_mu);
    return left;
}

/* ---- one copy of the weights: the packed copies' pool ----
 *
 * A version holds its weights once, in `torch`, which every worker may
 * forward on at the same time. XNNPACK's prepacked linear (md_torch_replica)
 * is 2-3x faster at 1-16 rows, but a packed operator keeps per-call state,
 * so a packed copy serves one forward at a time, and each is another copy
 * of the linear weights. So the copies are a pool of the version's, not one
 * per worker: as many as forwards can run at once (the cores, or fewer
 * workers), and only when all of them fit in prepack_max_bytes together;
 * otherwise none (packing is all or nothing per version, so every answer of
 * a version comes from the same kernels, whatever the load). A forward
 * takes a free copy, makes one while the pool is short, or waits for one
 * to come back: with a copy per core that wait is the wait for a core.
 * Online workers each add a copy as they start, so a version's first
 * requests find them made. With 16 workers on 2 cores a version keeps 2
 * packed copies, not 32. */

/* The most gather buffer a worker keeps between batches (worker_loop). */
#define MAX_KEPT_GATHER_BYTES (256 << 10)

int md_batcher_cores(void)
{
    /* test-only: the unit tests' pools must not depend on the machine */
    const char *t = getenv("MD_TEST_CORES");
    if (t && atoi(t) > 0)
        return atoi(t);
    static atomic_int cached; /* asked on every forward: one syscall, once */
    int c = atomic_load_explicit(&cached, memory_order_relaxed);
    if (c > 0)
        return c;
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) {
        c = CPU_COUNT(&set);
    } else {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        c = n > 0 ? (int)n : 1;
    }
    atomic_store_explicit(&cached, c, memory_order_relaxed);
    return c;
}

/* Make one packed copy, counted in pool_made; NULL when there is none to
 * make (the version is stopping, nothing to pack, the copies would not fit
 * prepack_max_bytes, or packing failed: then pool_max is 0 for good).
 * pool_mu not held; the caller counts itself in pool_making. */
static md_torch_model *make_replica(md_model *m)
{
    /* released before its workers got here (a SIGTERM right after a
     * deploy): no freeze, so the exit is not kept waiting */
    pthread_mutex_lock(&m->mu);
    int stopping = m->stopping;
    pthread_mutex_unlock(&m->mu);
    if (stopping)
        return NULL;
    md_torch_model *r = NULL;
    size_t bytes = 0;
    md_err err;
    md_err_clear(&err);
    double t0 = now_s();
    pthread_mutex_lock(&m->pool_mu);
    int copies = m->pool_max;
    pthread_mutex_unlock(&m->pool_mu);
    size_t each = copies > 0 ? m->prepack_max / (size_t)copies : 0;
    if (md_torch_replica(m->torch, each, &r, &bytes, &err) != MD_OK) {
        if (atomic_exchange(&m->prepack_logged, 1) == 0)
            md_log(MD_LOG_WARN, "model %s version %d: forwarding without prepacking: %s",
                   m->name, md_model_version(m), err.msg);
        r = NULL;
    } else if (r) {
        md_log(MD_LOG_DEBUG, "model %s version %d: packed %zu bytes of linear weights in %.1f ms",
               m->name, md_model_version(m), bytes, (now_s() - t0) * 1e3);
    } else if (bytes > each && atomic_exchange(&m->prepack_logged, 1) == 0) {
        md_log(MD_LOG_INFO, "model %s version %d: not prepacked: its linear weights are %zu "
               "bytes, and %d packed copies (one per forward at once) would be more than "
               "prepack_max_bytes (%zu)", m->name, md_model_version(m), bytes, copies,
               m->prepack_max);
    }
    pthread_mutex_lock(&m->pool_mu);
    if (r) {
        atomic_store(&m->packed_bytes, (long long)bytes);
        m->pool_made++;
        atomic_store(&m->prepacked, m->pool_made);
    } else if (!stopping) {
        m->pool_max = 0; /* the same answer next time: forward on torch */
    }
    pthread_cond_broadcast(&m->pool_cv);
    pthread_mutex_unlock(&m->pool_mu);
    return r;
}

/* A packed copy for one forward, given back with pool_give: a free one, one
 * made now while the pool is short, or the next one given back. NULL to
 * forward on m->torch (no packing for this version). */
static md_torch_model *pool_take(md_model *m)
{
    if (m->prepack_max == 0)
        return NULL;
    md_torch_model *r = NULL, *drop = NULL;
    pthread_mutex_lock(&m->pool_mu);
    for (;;) {
        if (m->pool_max == 0) { /* packing stopped: free the copies as they come */
            if (m->pool_nfree > 0) {
                drop = m->pool_free[--m->pool_nfree];
                m->pool_made--;
                atomic_store(&m->prepacked, m->pool_made);
            }
            break;
        }
        if (m->pool_nfree > 0) {
            r = m->pool_free[--m->pool_nfree];
            break;
        }
        if (m->pool_made + m->pool_making < m->pool_max) {
            m->pool_making++;
            pthread_mutex_unlock(&m->pool_mu);
            r = make_replica(m);
            pthread_mutex_lock(&m->pool_mu);
            m->pool_making--;
            pthread_cond_broadcast(&m->pool_cv); /* pool_fill_one waits for making == 0 */
            break;
        }
        pthread_cond_wait(&m->pool_cv, &m->pool_mu);
    }
    pthread_mutex_unlock(&m->pool_mu);
    md_torch_free(drop);
    return r;
}

static void pool_give(md_model *m, md_torch_model *r)
{
    md_assert(r != NULL);
    pthread_mutex_lock(&m->pool_mu);
    if (m->pool_max == 0) { /* packing stopped (forward's fallback) */
        m->pool_made--;
        atomic_store(&m->prepacked, m->pool_made);
        pthread_mutex_unlock(&m->pool_mu);
        md_torch_free(r);
        return;
    }
    m->pool_free[m->pool_nfree++] = r;
    /* two kinds of waiters share the cv (pool_take for a copy, pool_fill_one
     * for making == 0): a signal could wake the wrong one */
    pthread_cond_broadcast(&m->pool_cv);
    pthread_mutex_unlock(&m->pool_mu);
}

/* An online worker as it starts: one more packed copy in the pool while it
 * is short, so a version's first concurrent requests find them made. */
static void pool_fill_one(md_model *m)
{
    if (m->prepack_max == 0)
        return;
    pthread_mutex_lock(&m->pool_mu);
    while (m->pool_making > 0) /* the first copy decides whether packing pays */
        pthread_cond_wait(&m->pool_cv, &m->pool_mu);
    int room = m->pool_made < m->pool_max;
    if (room)
        m->pool_making++;
    pthread_mutex_unlock(&m->pool_mu);
    if (!room)
        return;
    md_torch_model *r = make_replica(m);
    pthread_mutex_lock(&m->pool_mu);
    m->pool_making--;
    pthread_cond_broadcast(&m->pool_cv);
    pthread_mutex_unlock(&m->pool_mu);
    if (r)
        pool_give(m, r);
}

/* Rows were queued online (under mu): wake an idle worker if one should
 * take them. Not when a worker is already computing a small batch (or is on
 * its way), fewer than half a batch wait, and batches take at most
 * coalesce_us on average: those rows wait for that worker, which takes them
 * all when it comes back, so small requests make fewer, fuller batches and
 * fewer wake-ups, and wait at most about one short batch. */
static void wake_online(md_model *m)
{
    if (m->max_delay_us > 0) {
        pthread_cond_broadcast(&m->cv[0]); /* the worker waiting for more re-checks */
        return;
    }
    if (m->coalesce_us > 0 && m->busy + m->wakes > 0 && m->q[0].rows * 2 < m->max_batch &&
        m->busy_rows * 2 < m->max_batch && m->fwd_avg_s * 1e6 <= m->coalesce_us)
        return;
    if (m->wakes < m->idle) {
        m->wakes++;
        pthread_cond_signal(&m->cv[0]);
    }
}

/* The loop of one worker of pool `qi` (0: online, 1: batch jobs). Online
 * workers make their replica before the first request; job workers when
 * their first chunk comes (many versions never run a job). */
static void worker_loop(md_model *m, int qi)
{
    size_t cap_pieces = 64;
    piece *pieces = md_xmalloc(sizeof(piece) * cap_pieces);
    float *batch = NULL;
    size_t batch_cap = 0;
    queue *q = &m->q[qi];
    if (qi == 0)
        pool_fill_one(m);
    double fwd_s = -1; /* this worker's last online batch: < 0 none */
    int64_t fwd_rows = 0;
    for (;;) {
        pthread_mutex_lock(&m->mu);
        if (fwd_s >= 0) {
            m->busy--;
            m->busy_rows -= fwd_rows;
            m->fwd_avg_s = isfinite(m->fwd_avg_s) ? 0.875 * m->fwd_avg_s + 0.125 * fwd_s : fwd_s;
            fwd_s = -1;
        }
        if (qi == 0)
            m->idle++;
        while (!q->head && !m->stopping) {
            pthread_cond_wait(&m->cv[qi], &m->mu);
            if (qi == 0 && m->wakes > 0)
                m->wakes--; /* any return consumes one: a count never outlives its waiters */
        }
        if (qi == 0)
            m->idle--;
        if (!q->head) {
            pthread_mutex_unlock(&m->mu);
            free(pieces);
            free(batch);
            pthread_mutex_lock(&m->mu);
            int last = --m->live_workers == 0;
            pthread_mutex_unlock(&m->mu);
            if (last)
                md_model_destroy(m);
            md_batcher_live_add(-1);
            return;
        }
        if (m->max_delay_us > 0 && qi == 0) {
            /* wait for more rows, until max_delay after the first arrival */
            double until = q->head->enqueued + m->max_delay_us / 1e6;
            while (q->rows < m->max_batch && !m->stopping && now_s() < until) {
                struct timespec ts = abs_time(until);
                pthread_cond_timedwait(&m->cv[0], &m->mu, &ts);
            }
        }
        /* Online: take up to max_batch rows. Jobs: one whole chunk, the
         * job's batch_size rows, whatever max_batch_size says (that setting
         * bounds online batching; a job names its own forward size). */
        int n = 0;
        int64_t rows = 0;
        int64_t cap = qi == 0 ? m->max_batch : INT64_MAX;
        item *expired = NULL;
        double now = now_s();
        {
            while (q->head && rows < cap && (qi == 0 || n == 0)) {
                item *it = q->head;
                /* only a request that waited a while is worth a syscall: the
                 * fast path (taken within ALIVE_AFTER_S) never pays it */
                int gone = it->taken == 0 && it->alive && now - it->enqueued > ALIVE_AFTER_S &&
                           !it->alive(it->ctx);
                if (it->taken == 0 && (gone || now > it->deadline)) {
                    if (gone)
                        md_err_setc(&it->err, MD_EUNAVAIL, "client_closed",
                                    "the client closed the connection while queued");
                    q->head = it->next;
                    q->count--;
                    q->rows -= it->rows;
                    it->next = expired;
                    expired = it;
                    continue;
                }
                /* one forward takes one row shape: a config-less model that
                 * has not learned its shape yet may have several queued */
                if (n > 0 && !same_row_shape(pieces[0].it, it))
                    break;
                int64_t k = it->rows - it->taken;
                if (k > cap - rows)
                    k = cap - rows;
                if (n == (int)cap_pieces) {
                    cap_pieces *= 2;
                    pieces = realloc(pieces, sizeof(piece) * cap_pieces);
                    md_assert(pieces != NULL);
                }
                pieces[n++] = (piece){it, it->taken, k};
                if (it->taken == 0) {
                    atomic_fetch_add(&m->wait_us_total, (long long)((now - it->enqueued) * 1e6));
                    if (qi == 0)
                        md_hist_observe(&m->wait_hist, now - it->enqueued);
                }
                it->taken += k;
                rows += k;
                q->rows -= k;
                if (it->taken == it->rows) {
                    q->head = it->next;
                    q->count--;
                }
            }
            atomic_store(&m->depth[qi], q->count);
            if (!q->head)
                q->tail = NULL;
            else if (qi == 1) /* rows left (a split request, a backlog) */
                pthread_cond_signal(&m->cv[1]);
            if (qi == 0 && n > 0) {
                m->busy++;
                m->busy_rows += fwd_rows = rows;
            }
            if (qi == 0 && q->head)
                wake_online(m);
        }
        pthread_mutex_unlock(&m->mu);

        while (expired) {
            item *it = expired;
            expired = it->next;
            atomic_store(&it->failed, 1);
            if (it->err.status == MD_EUNAVAIL) { /* client_closed */
                atomic_fetch_add(&m->n_dropped, 1);
                finish_item(m, it);
                continue;
            }
            atomic_fetch_add(&m->n_timeouts, 1);
            md_err_setc(&it->err, MD_ETIMEOUT, "timeout",
                        "the prediction waited past its timeout of %d ms in the queue of model "
                        "%s; retry, add workers, or raise batching.timeout_ms",
                        m->timeout_ms, m->name);
            atomic_store(&it->failed, 1);
            finish_item(m, it);
        }
        if (n == 0)
            continue;
        double t0 = qi == 0 ? now_s() : 0;
        run_pieces(m, qi, pieces, n, rows, &batch, &batch_cap);
        if (qi == 0)
            fwd_s = now_s() - t0;
        /* a large gather buffer is not kept between batches: 16 workers of
         * a 4096-wide model held 1 MiB each for nothing while idle (one
         * allocation a batch costs nothing beside a forward of that size) */
        if (batch_cap * sizeof(float) > MAX_KEPT_GATHER_BYTES) {
            free(batch);
            batch = NULL;
            batch_cap = 0;
        }
    }
}

int md_model_max_batch(const md_model *m)
{
    return m->max_batch;
}

/* Online workers: "md-<model>" in top, perf and gdb (15 characters at most). */
void *md_batcher_online_main(void *arg)
{
    md_model *m = arg;
    char tname[16];
    snprintf(tname, sizeof tname, "md-%.12s", m->name);
    pthread_setname_np(pthread_self(), tname);
    worker_loop(m, 0);
    return NULL;
}

/* Job workers ("mj-<model>") run job_nice steps below the server's own
 * priority (default 19, capped at nice 19: a
 * scheduler weight of 15 against 1024 for online workers and HTTP threads):
 * the kernel gives the CPU to online work first and preempts a job forward
 * in progress when an online request arrives, which no queue order can do.
 * Measured under a saturating 1-row load during a 60k-row job: nice 0 added
 * ~4 ms to the p99, nice 10 ~2 ms, nice 19 under 1 ms (the job then runs on
 * what the online load leaves). */
void *md_batcher_job_main(void *arg)
{
    md_model *m = arg;
    char tname[16];
    snprintf(tname, sizeof tname, "mj-%.12s", m->name);
    pthread_setname_np(pthread_self(), tname);
    /* job_nice is relative to the server's own nice value: under `nice -n
     * 10 modeld` an absolute 7 would raise the jobs above online work */
    char who[112];
    snprintf(who, sizeof who, "model %s: the job workers", m->name);
    md_thread_nice(m->job_nice, who);
    md_torch_set_thread_background(1);
    worker_loop(m, 1);
    return NULL;
}

static int same_dims(const int64_t *a, int na, const int64_t *b, int nb)
{
    return na == nb && memcmp(a, b, sizeof(int64_t) * (size_t)na) == 0;
}

/* How many leading dims of the row shape are 1s, leaving at least one. */
static int leading_ones(const md_model *m)
{
    int lead = 0;
    while (lead < m->row_ndim - 1 && m->row_shape[lead] == 1)
        lead++;
    return lead;
}

/* Whether an online request's `in` is ONE row with no batch dimension: its
 * shape is the row shape ([1, 28, 28] for input.shape [1, 28, 28]) or the
 * row shape without its leading 1s ([28, 28]: what x.tolist() gives for one
 * FashionMNIST image, and x.squeeze() for any one sample). Read as rows,
 * the first is the same one row, and the second was refused (28 rows of 28
 * values where rows of 784 are expected): nothing that reads as valid rows
 * changes meaning, since past the stripped 1s the first dim is not 1 and
 * the dims after it hold fewer values than one row. */
static int one_row(const md_model *m, const md_tensor *in)
{
    int lead = leading_ones(m);
    return same_dims(in->shape, in->ndim, m->row_shape, m->row_ndim) ||
           (lead > 0 &&
            same_dims(in->shape, in->ndim, m->row_shape + lead, m->row_ndim - lead));
}

/* Shape `in` to [rows, row shape...]: one row as a client sends it
 * (one_row; `online` only: a job's chunk always has its rows dimension, and
 * a chunk that happened to match would be answered with one row for many)
 * is a batch of one; flat rows of the right width are reshaped. Only for a
 * model whose shape is known (read after an acquire of shape_known). */
static md_status shape_input(md_model *m, md_tensor *in, int online, md_err *err)
{
    if (online && one_row(m, in)) {
        in->shape[0] = 1;
        memcpy(in->shape + 1, m->row_shape, sizeof(int64_t) * (size_t)m->row_ndim);
        in->ndim = m->row_ndim + 1;
        return MD_OK;
    }
    int64_t rows = in->shape[0];
    int64_t per = rows > 0 ? (int64_t)in->count / rows : 0;
    if (in->ndim >= 2 && per == m->row_size) {
        in->ndim = m->row_ndim + 1;
        memcpy(in->shape + 1, m->row_shape, sizeof(int64_t) * (size_t)m->row_ndim);
        return MD_OK;
    }
    char want[128], bare[160] = "";
    md_fmt_dims(want, sizeof want, m->row_shape, m->row_ndim);
    int lead = leading_ones(m);
    if (online && lead > 0) {
        char dims[128];
        snprintf(bare, sizeof bare, "; one row alone may also be sent as an array of shape %s",
                 md_fmt_dims(dims, sizeof dims, m->row_shape + lead, m->row_ndim - lead));
    }
    return md_err_setc(err, MD_EINVAL, "wrong_shape",
                       "each row has %lld values but model %s version %d expects rows of shape "
                       "%s (%lld values)%s",
                       in->ndim >= 2 ? (long long)per : (long long)in->count, m->name, md_model_version(m),
                       want, (long long)m->row_size, bare);
}

static void preprocess(md_model *m, md_tensor *in)
{
    float scale = (float)m->scale;
    size_t n = in->count;
    float *x = in->data;
    if (scale != 1.0f && !in->prescaled)
        for (size_t i = 0; i < n; i++)
            x[i] *= scale;
    if (m->n_norm == 1) {
        float mean = m->mean[0], inv = 1.0f / m->std[0];
        for (size_t i = 0; i < n; i++)
            x[i] = (x[i] - mean) * inv;
    } else if (m->n_norm > 1) {
        for (size_t i = 0; i < n; i++) {
            int c = (int)((i % (size_t)m->row_size) / (size_t)m->norm_inner);
            x[i] = (x[i] - m->mean[c]) / m->std[c];
        }
    }
}

md_status md_model_submit(md_model *m, md_tensor *in, md_priority prio, md_predict_cb cb,
                          void *ctx, md_err *err)
{
    return md_model_submit_alive(m, in, prio, cb, NULL, ctx, err);
}

md_status md_model_submit_alive(md_model *m, md_tensor *in, md_priority prio, md_predict_cb cb,
                                md_alive_fn alive, void *ctx, md_err *err)
{
    md_status st;
    if ((st = md_model_start(m, err)) != MD_OK) {
        md_tensor_free(in);
        return st;
    }
    if (!m->n_in && in->packed) {
        md_tensor_free(in);
        return md_err_setc(err, MD_EINVAL, "invalid_input",
                           "model %s version %d takes one unnamed input (config.input), not "
                           "named inputs: send its rows as a JSON array",
                           m->name, md_model_version(m));
    }
    if (m->n_in && (in->packed != m->layout || in->ndim != 2 || in->shape[1] != m->row_size)) {
        /* rows of floats for a version whose inputs are named */
        char names[256];
        int len = 0;
        for (int i = 0; i < m->n_in && len >= 0 && (size_t)len < sizeof names; i++)
            len += snprintf(names + len, sizeof names - (size_t)len, "%s\"%s\"", i ? ", " : "",
                            m->in[i].name);
        md_tensor_free(in);
        return md_err_setc(err, MD_EINVAL, "invalid_input",
                           "model %s version %d takes named inputs (%s): send rows as objects "
                           "[{\"%s\": ...}], columns {\"inputs\": {\"%s\": [...]}}, an NPZ "
                           "body or a V2 request naming each input",
                           m->name, md_model_version(m), names, m->in[0].name, m->in[0].name);
    }
    if (in->ndim == 1) {
        /* a flat list is one row */
        in->shape[1] = in->shape[0];
        in->shape[0] = 1;
        in->ndim = 2;
    }
    /* No config.input.shape and no successful forward yet: any row shape is
     * queued as it is, and its forward decides (see DESIGN). */
    int shape_known = atomic_load_explicit(&m->shape_known, memory_order_acquire);
    if (shape_known && (st = shape_input(m, in, prio == MD_PRIO_ONLINE, err)) != MD_OK) {
        md_tensor_free(in);
        return st;
    }
    /* the shape must hold exactly the values given: a job's input.shape or a
     * V2 shape that does not would make the workers read past the data */
    int64_t rows = in->shape[0], row_size = 0, values = 0;
    if (in->ndim < 2 || in->ndim > MD_MAX_DIMS || rows < 1 ||
        md_shape_product(in->shape + 1, in->ndim - 1, &row_size) != 0 ||
        md_mul_i64(rows, row_size, &values) || (uint64_t)values != (uint64_t)in->count) {
        char dims[160];
        md_status bad = md_err_setc(err, MD_EINVAL, "wrong_shape",
                                    "the input's shape %s does not hold its %zu values; send "
                                    "rows with a shape that matches the data",
                                    md_fmt_dims(dims, sizeof dims, in->shape,
                                             in->ndim < MD_MAX_DIMS ? in->ndim : MD_MAX_DIMS),
                                    in->count);
        md_tensor_free(in);
        return bad;
    }
    if (row_size > MD_MAX_ROW_VALUES) {
        md_tensor_free(in);
        return md_err_setc(err, MD_ETOOBIG, "too_many_values",
                           "each row has %lld values, more than the limit of %lld per row",
                           (long long)row_size, (long long)MD_MAX_ROW_VALUES);
    }
    if (m->n_in) /* each input's own, by this version's config */
        md_inputs_preprocess(m, in->data, rows);
    else
        preprocess(m, in);
    item *it = md_xcalloc(1, sizeof *it);
    it->in = *in;
    memset(in, 0, sizeof *in);
    it->rows = rows;
    it->row_size = row_size;
    it->unshaped = !shape_known && prio == MD_PRIO_ONLINE;
    it->cb = cb;
    it->alive = alive;
    it->ctx = ctx;
    it->enqueued = now_s();
    /* timeout_ms is an online latency bound; a batch job's chunk waits behind
     * online traffic for as long as it takes (failing a job because online
     * load was high would lose its work) */
    it->deadline = prio == MD_PRIO_BATCH ? INFINITY : it->enqueued + m->timeout_ms / 1e3;
    pthread_mutex_lock(&m->mu);
    queue *q = &m->q[prio == MD_PRIO_BATCH ? 1 : 0];
    if (prio == MD_PRIO_ONLINE && q->count >= m->queue_limit) {
        pthread_mutex_unlock(&m->mu);
        atomic_fetch_add(&m->n_rejected, 1);
        md_tensor_free(&it->in);
        free(it);
        return md_err_setc(err, MD_EBUSY, "overloaded",
                           "model %s has %d requests queued (queue_limit); retry after a moment",
                           m->name, m->queue_limit);
    }
    md_model_retain(m);
    if (q->tail)
        q->tail->next = it;
    else
        q->head = it;
    q->tail = it;
    q->count++;
    atomic_store(&m->depth[prio == MD_PRIO_BATCH ? 1 : 0], q->count);
    q->rows += it->rows;
    atomic_fetch_add(&m->n_requests, 1);
    if (prio == MD_PRIO_BATCH)
        pthread_cond_signal(&m->cv[1]);
    else
        wake_online(m);
    pthread_mutex_unlock(&m->mu);
    return MD_OK;
}
