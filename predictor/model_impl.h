/*
 * model_impl.h - PRIVATE to predictor/: the struct of a loaded model version
 * and its queued requests, shared by batcher.c (the queues, the workers and
 * the packed copies' pool) and model.c (the load, the accessors, the stats
 * and metrics). Nothing outside predictor/ includes it.
 *
 * Thread safety: as batcher.c's DESIGN says, per field.
 */
#ifndef MD_MODEL_IMPL_H
#define MD_MODEL_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <time.h>

#include "predictor.h"
#include "torch_backend.h"

#define ALIVE_AFTER_S 0.002 /* check that the client is still there past this wait */

typedef struct item {
    md_tensor in;              /* [rows, row shape...], preprocessed */
    int64_t rows;
    int64_t row_size;          /* floats per input row: in.count / rows */
    int64_t taken;             /* rows handed to workers (queue lock) */
    atomic_llong done;         /* rows computed */
    float *out;                /* allocated by the first finished piece (queue lock) */
    int64_t out_row;           /* floats per output row */
    int out_ndim;
    int64_t out_shape[MD_MAX_DIMS];
    atomic_int failed;
    md_err err;
    int unshaped;              /* an online request queued before the row shape was known:
                                * its rows are as its body had them (explain_rows) */
    double enqueued, deadline; /* monotonic seconds */
    md_predict_cb cb;
    md_alive_fn alive;
    void *ctx;
    struct item *next;
} item;

typedef struct queue {
    item *head, *tail;
    int64_t rows;
    int count;
} queue;

/* A declared input or output (config.inputs, config.outputs). */
typedef struct md_io {
    char name[MD_IO_NAME_MAX];
    md_dtype dtype;            /* inputs: declared (what forward gets) */
    char dtype_name[12];       /* inputs: declared; outputs: what the test forward returned */
    int is_int;                /* inputs: carried as int64 words (every non-float dtype) */
    int ndim;                  /* per row */
    int64_t shape[MD_MAX_DIMS];
    int64_t values;            /* per row */
    int64_t off;               /* inputs: words into a packed row; outputs: floats into one */
    /* inputs: their preprocess (float inputs only) */
    double scale;
    int n_norm;
    float *mean, *std;
    int64_t norm_inner;
} md_io;

struct md_model {
    char name[72];
    atomic_int version;        /* set again after the load (md_model_set_version) */
    md_torch_model *torch;
    /* config. The row shape is declared (config.input.shape, set at load) or
     * learned by the first successful forward (written once, under mu, by a
     * worker). Readers outside mu read it only after an acquire load of
     * shape_known returned 1; it never changes after that. */
    atomic_int shape_known;
    int row_ndim;
    int64_t row_shape[MD_MAX_DIMS];
    int64_t row_size;          /* floats per input row */
    double scale;
    int n_norm;
    float *mean, *std;
    int64_t norm_inner;        /* floats per channel within a row */
    int logits;
    /* declared inputs and outputs (0: one unnamed input, as config.input
     * says, and the first tensor forward returns). With inputs, a request's
     * row is the inputs' values side by side in 4-byte words (an int64 takes
     * two: md_model_pack), row_shape is [words] and the row is preprocessed
     * there; with outputs, an output row is the outputs' floats side by side,
     * their shapes fixed by the test forward at load. */
    int n_in, n_out;
    int class_out;             /* the output labels read: -1 none (n_out 0: the only one) */
    int layout;                /* n_in: a hash of the inputs (names, dtypes, shapes), never 0:
                                * md_model_pack's tensors carry it (md_tensor.packed) */
    md_dtype in_dtype;         /* config.input.dtype (n_in 0) */
    md_io in[MD_MAX_IO], out[MD_MAX_IO];
    const char *out_keys[MD_MAX_IO]; /* out[j].name, for md_torch_forward_io */
    int64_t out_values;        /* floats per packed output row */
    json_t *labels;
    json_t *classes_cfg;       /* config's output, threshold, multi_label (md_model_classes) */
    int max_batch, max_delay_us, queue_limit, timeout_ms, workers, job_nice;
    int coalesce_us;           /* see wake_online */
    size_t prepack_max;        /* all packed copies together; 0: workers forward on torch */
    atomic_int prepack_logged; /* make_replica's refusal or size bound is logged once */
    atomic_int fallback_logged; /* forward's fallback to torch is logged once */
    atomic_int prepacked;      /* packed copies alive (stats: a copy of pool_made) */
    /* The packed copies, shared by every worker (see "one copy of the
     * weights"): a forward takes a free one or forwards on `torch` */
    pthread_mutex_t pool_mu;
    pthread_cond_t pool_cv;    /* a copy was made (pool_making went down) */
    md_torch_model **pool_free; /* pool_nfree of them, each unused */
    int pool_nfree;
    int pool_made;             /* copies alive, free or in a forward */
    int pool_making;           /* copies being made now */
    int pool_max;              /* the most copies: cores, workers, prepack_max / one copy */
    atomic_llong packed_bytes; /* one copy's packed weights (0 before the first) */
    md_image_opts image; /* preprocess.image, when has_image */
    int has_image;
    /* queues */
    pthread_mutex_t mu;
    pthread_cond_t cv[2];      /* per queue: its pool of workers waits on it */
    queue q[2];
    int stopping;
    int started;               /* md_model_start ran (its workers are live_workers) */
    int start_failed;          /* ... and could not start them all: requests are refused */
    atomic_int running;        /* started, all of them: md_model_start's lock-free answer */
    int live_workers;
    /* online pool, under mu (see wake_online) */
    int busy;                  /* workers that took rows and have not come back */
    int idle;                  /* workers waiting for rows */
    int wakes;                 /* signals sent that no waiter has consumed yet */
    int64_t busy_rows;         /* rows the busy workers are computing */
    double fwd_avg_s;          /* a worker's time per batch (forward and answers), moving
                                * average; INFINITY until one is measured */
    atomic_int refs;
    /* stats */
    atomic_llong n_batches, n_rows, n_requests, n_timeouts, n_rejected, n_dropped;
    atomic_llong wait_us_total;
    atomic_llong batch_hist[8]; /* batch rows <=1, 2, 4, 8, 16, 32, 64, more */
    /* GET /metrics (md_models_write_metrics): read without the lock */
    atomic_llong n_failed;     /* requests answered with a failed forward */
    atomic_int depth[2];       /* requests queued, per pool (a copy of q[i].count) */
    md_hist rows_hist;         /* rows per forward */
    md_hist wait_hist;         /* online queue wait, seconds */
    md_hist forward_hist;      /* forward time, seconds */
    double load_s;             /* how long the load and test forward took */
    atomic_llong resident_bytes; /* md_model_resident_bytes: set at load */
    /* live numbers of the online answers (md_model_note_answer) */
    atomic_llong live_ok, live_errors;
    md_hist live_latency;        /* seconds from the request's first byte to its answer */
};

static inline double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* model.c: "[a, b, c]" of dims[0..n) into buf, which it returns. */
const char *md_fmt_dims(char *buf, size_t size, const int64_t *dims, int n);

/* inputs.c: each declared input's preprocess over `rows` packed rows, in place. */
void md_inputs_preprocess(const md_model *m, float *words, int64_t rows);

/* model.c: free a version whose last worker is gone (or that never started
 * one): its packed copies, its module, its config. */
void md_model_destroy(md_model *m);

/* batcher.c: the workers md_model_load starts, `workers` of each (arg: the
 * md_model); worker threads alive in the process (md_models_wait_stopped);
 * the cores a version's forwards can run on at once (the packed copies'
 * pool; MD_TEST_CORES overrides it for the unit tests). */
void *md_batcher_online_main(void *arg);
void *md_batcher_job_main(void *arg);
void md_batcher_live_add(int n);
int md_batcher_cores(void);

#endif
