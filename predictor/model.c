/*
 * model.c - a loaded model version (predictor.h, "loaded model versions"):
 * its load (config, backend, the test forwards, its workers started), the
 * accessors that read it, its reference count, and its stats and metrics.
 * The queues and workers are batcher.c's; the struct both share is
 * model_impl.h's.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "model_impl.h"

/* "[a, b, c]" of dims[0..n) into buf. */
const char *md_fmt_dims(char *buf, size_t size, const int64_t *dims, int n)
{
    int len = snprintf(buf, size, "[");
    for (int d = 0; d < n && len > 0 && (size_t)len < size; d++)
        len += snprintf(buf + len, size - (size_t)len, "%s%lld", d ? ", " : "",
                        (long long)dims[d]);
    if (len > 0 && (size_t)len < size)
        snprintf(buf + len, size - (size_t)len, "]");
    return buf;
}

/* 1 when two queued items have the same row shape, so one forward can take both. */
static int cfg_int(json_t *o, const char *k, int def)
{
    json_t *v = json_object_get(o, k);
    return json_is_integer(v) ? (int)json_integer_value(v) : def;
}

static md_dtype parse_dtype(const char *t)
{
    if (!t)
        return MD_F32;
    if (!strcmp(t, "float64"))
        return MD_F64;
    if (!strcmp(t, "int64"))
        return MD_I64;
    if (!strcmp(t, "uint8"))
        return MD_U8;
    if (!strcmp(t, "int32"))
        return MD_I32;
    if (!strcmp(t, "bool"))
        return MD_BOOL;
    return MD_F32;
}

/* config.inputs and config.outputs into m->in and m->out (checked already
 * by md_model_config_check). */
static md_status read_io(md_model *m, json_t *config, md_err *err)
{
    json_t *ins = json_object_get(config, "inputs"), *outs = json_object_get(config, "outputs");
    int64_t words = 0;
    m->class_out = -1;
    for (size_t i = 0; i < json_array_size(ins) && i < MD_MAX_IO; i++) {
        json_t *e = json_array_get(ins, i);
        md_io *io = &m->in[m->n_in++];
        snprintf(io->name, sizeof io->name, "%s", json_string_value(json_object_get(e, "name")));
        const char *dt = json_string_value(json_object_get(e, "dtype"));
        io->dtype = parse_dtype(dt);
        snprintf(io->dtype_name, sizeof io->dtype_name, "%s", dt ? dt : "float32");
        io->is_int = io->dtype != MD_F32 && io->dtype != MD_F64;
        json_t *shape = json_object_get(e, "shape");
        for (size_t d = 0; d < json_array_size(shape) && d < MD_MAX_DIMS - 1; d++)
            io->shape[io->ndim++] = json_integer_value(json_array_get(shape, d));
        int64_t w;
        if (md_shape_product(io->shape, io->ndim, &io->values) != 0 ||
            md_mul_i64(io->values, io->is_int ? 2 : 1, &w) || md_add_i64(words, w, &words) ||
            words > MD_MAX_ROW_VALUES)
            return md_err_setc(err, MD_EUNPROC, "invalid_config",
                               "config.inputs hold more than %lld values a row together; give "
                               "the shape of one row",
                               (long long)MD_MAX_ROW_VALUES);
        io->off = words - w;
        json_t *pre = json_object_get(e, "preprocess");
        io->scale = json_is_number(json_object_get(pre, "scale"))
                        ? json_number_value(json_object_get(pre, "scale"))
                        : 1.0;
        json_t *mean = json_object_get(pre, "mean"), *std = json_object_get(pre, "std");
        if (mean) {
            io->n_norm = (int)json_array_size(mean);
            if (io->n_norm > 1 && (io->ndim < 2 || io->shape[0] != io->n_norm))
                return md_err_setc(err, MD_EUNPROC, "invalid_config",
                                   "config.inputs[%zu] (\"%s\"): preprocess.mean has %d channels "
                                   "but its shape does not start with %d channels (C, H, W)",
                                   i, io->name, io->n_norm, io->n_norm);
            io->mean = md_xmalloc(sizeof(float) * (size_t)io->n_norm);
            io->std = md_xmalloc(sizeof(float) * (size_t)io->n_norm);
            for (int k = 0; k < io->n_norm; k++) {
                io->mean[k] = (float)json_number_value(json_array_get(mean, (size_t)k));
                io->std[k] = (float)json_number_value(json_array_get(std, (size_t)k));
            }
            io->norm_inner = io->n_norm > 1 ? io->values / io->n_norm : 0;
        }
    }
    for (size_t j = 0; j < json_array_size(outs) && j < MD_MAX_IO; j++) {
        json_t *e = json_array_get(outs, j);
        md_io *io = &m->out[m->n_out++];
        snprintf(io->name, sizeof io->name, "%s", json_string_value(json_object_get(e, "name")));
        m->out_keys[j] = io->name;
        if (json_is_true(json_object_get(e, "logits")))
            m->class_out = (int)j;
    }
    if (m->n_out == 1)
        m->class_out = 0;
    if (m->n_in) {
        uint32_t h = 2166136261u; /* FNV-1a over what a packed row's layout depends on */
        for (int i = 0; i < m->n_in; i++) {
            const md_io *io = &m->in[i];
            const unsigned char *parts[3] = {(const unsigned char *)io->name,
                                             (const unsigned char *)io->dtype_name,
                                             (const unsigned char *)io->shape};
            size_t lens[3] = {strlen(io->name) + 1, strlen(io->dtype_name) + 1,
                              sizeof(int64_t) * (size_t)io->ndim};
            for (int k = 0; k < 3; k++)
                for (size_t b = 0; b < lens[k]; b++)
                    h = (h ^ parts[k][b]) * 16777619u;
            h = (h ^ (uint32_t)io->ndim) * 16777619u;
        }
        m->layout = (int)(h | 1u);
        m->row_ndim = 1;
        m->row_shape[0] = words;
        m->row_size = words;
    }
    if (m->n_out && !m->n_in && m->row_ndim == 0)
        return md_err_setc(err, MD_EUNPROC, "invalid_config",
                           "config.outputs needs the input's shape, so the deploy's test "
                           "forward can check every output: give config.input.shape (or "
                           "config.inputs)");
    return MD_OK;
}

/* The words of `rows` zero rows for a test forward of a version with
 * declared inputs (int64 zeros are zero words too). */
static md_status io_test_forward(md_model *m, const float *zeros, int64_t rows, int quiet,
                                 md_torch_outs *o, md_err *err)
{
    md_torch_in ins[MD_MAX_IO];
    int64_t shapes[MD_MAX_IO][MD_MAX_DIMS + 1];
    int n = m->n_in ? m->n_in : 1;
    for (int i = 0; i < n; i++) {
        const md_io *io = &m->in[i];
        shapes[i][0] = rows;
        if (m->n_in)
            memcpy(shapes[i] + 1, io->shape, sizeof(int64_t) * (size_t)io->ndim);
        else
            memcpy(shapes[i] + 1, m->row_shape, sizeof(int64_t) * (size_t)m->row_ndim);
        ins[i] = (md_torch_in){.base = zeros + (m->n_in ? io->off : 0),
                               .row_words = m->row_size,
                               .is_int = m->n_in ? io->is_int : 0,
                               .dtype = m->n_in ? io->dtype : m->in_dtype,
                               .ndim = 1 + (m->n_in ? io->ndim : m->row_ndim),
                               .shape = shapes[i]};
    }
    const char *keys[MD_MAX_IO] = {"output0"};
    int n_out = m->n_out ? m->n_out : 1;
    for (int j = 0; j < m->n_out; j++)
        keys[j] = m->out_keys[j];
    return md_torch_forward_io(m->torch, ins, n, keys, n_out, quiet, o, err);
}

/* The test forwards of a version with declared inputs or outputs: one zero
 * row, then two. Every declared output must come back with one row per
 * input row, each row's shape the same in both (the batch must not change
 * a row's answer) and as config.outputs declares it; the shapes it has are
 * the version's for good (each forward is checked against them). */
static md_status io_load_check(md_model *m, const char *name, json_t *config, md_err *err)
{
    float *zeros = md_calloc_checked((size_t)m->row_size, 2 * sizeof(float) * 2,
                                     "the test forward's zero rows", err);
    if (!zeros)
        return MD_ENOMEM;
    md_torch_outs o1, o2;
    md_err ferr;
    memset(&o2, 0, sizeof o2);
    md_status st = io_test_forward(m, zeros, 1, 0, &o1, &ferr);
    if (st == MD_OK) {
        double t0 = now_s();
        st = io_test_forward(m, zeros, 2, 0, &o2, &ferr);
        m->fwd_avg_s = now_s() - t0;
    }
    free(zeros);
    free(o1.data);
    free(o2.data);
    if (st == MD_ENOMEM) {
        *err = ferr;
        return MD_ENOMEM;
    }
    if (st != MD_OK) {
        const char *what = m->n_in ? "config.inputs" : "config.input.shape";
        if (strcmp(md_err_code(&ferr), "bad_model_output") == 0)
            return md_err_setc(err, MD_EUNPROC, "model_mismatch",
                               "the test forward on zeros of %s does not answer what "
                               "config.outputs declares: %s",
                               what, ferr.msg);
        return md_err_setc(err, MD_EUNPROC, "model_test_failed",
                           "the test forward on zeros of %s failed: %s; check the names, "
                           "order (forward's), shapes and dtypes there",
                           what, ferr.msg);
    }
    json_t *outs = json_object_get(config, "outputs");
    int n_out = m->n_out ? m->n_out : 1; /* without config.outputs: the first tensor */
    for (int j = 0; j < n_out; j++) {
        md_io *io = &m->out[j];
        char a[96], b[96];
        int same = o1.ndim[j] == o2.ndim[j] && o1.shape[j][0] == 1 && o2.shape[j][0] == 2;
        for (int d = 1; same && d < o1.ndim[j]; d++)
            same = o1.shape[j][d] == o2.shape[j][d];
        if (!same)
            return md_err_setc(err, MD_EUNPROC, "batch_dependent_output",
                               "model %s answers %s%s%s of shape %s for a batch of 1 row "
                               "and %s for a batch of 2; modeld batches the rows of different "
                               "requests together, so each output needs one row per input row, "
                               "computed from that row alone",
                               name, m->n_out ? "output \"" : "its output",
                               m->n_out ? io->name : "", m->n_out ? "\"" : "",
                               md_fmt_dims(a, sizeof a, o1.shape[j], o1.ndim[j]),
                               md_fmt_dims(b, sizeof b, o2.shape[j], o2.ndim[j]));
        if (!m->n_out) {
            /* labels against the one output, as a version without declared
             * inputs checks them */
            int on = o1.ndim[0];
            md_classes cls = md_classes_from_config(m->classes_cfg, on == 2 ? o1.shape[0][1] : 0);
            if (m->labels && on == 2 && cls.kind == MD_CLASSES_NONE)
                return md_err_setc(err, MD_EUNPROC, "invalid_config",
                                   "config.labels names %zu classes, but %s",
                                   json_array_size(m->labels), md_classes_none_reason());
            if (m->labels && (on != 2 || cls.classes != (int64_t)json_array_size(m->labels)))
                return md_err_setc(err, MD_EUNPROC, "invalid_config",
                                   "config.labels has %zu names but the model outputs %lld "
                                   "values per row%s",
                                   json_array_size(m->labels),
                                   on >= 2 ? (long long)o1.values[0] : 1LL,
                                   cls.kind == MD_CLASSES_BINARY
                                       ? " (a binary classifier: give two names, the class "
                                         "below the threshold first)"
                                       : "");
            break;
        }
        io->ndim = o1.ndim[j] - 1;
        memcpy(io->shape, o1.shape[j] + 1, sizeof(int64_t) * (size_t)io->ndim);
        io->values = o1.values[j];
        io->off = o1.off[j];
        snprintf(io->dtype_name, sizeof io->dtype_name, "%s", o1.dtype[j]);
        json_t *decl = json_array_get(outs, (size_t)j);
        json_t *shape = json_object_get(decl, "shape");
        if (shape) {
            int ok = json_array_size(shape) == (size_t)io->ndim;
            for (int d = 0; ok && d < io->ndim; d++)
                ok = json_integer_value(json_array_get(shape, (size_t)d)) == io->shape[d];
            if (!ok) {
                char *want = json_dumps(shape, JSON_COMPACT);
                md_err_setc(err, MD_EUNPROC, "model_mismatch",
                            "config.outputs[%d] (\"%s\") declares rows of shape %s, but the "
                            "model returns rows of shape %s",
                            j, io->name, want ? want : "?",
                            md_fmt_dims(a, sizeof a, io->shape, io->ndim));
                free(want);
                return MD_EUNPROC;
            }
        }
        const char *dt = json_string_value(json_object_get(decl, "dtype"));
        if (dt && strcmp(dt, io->dtype_name) != 0)
            return md_err_setc(err, MD_EUNPROC, "model_mismatch",
                               "config.outputs[%d] (\"%s\") declares dtype %s, but the model "
                               "returns %s",
                               j, io->name, dt, io->dtype_name);
    }
    m->out_values = m->n_out ? o1.row_values : 0;
    /* labels read one output: its rows must be a vector of classes */
    int co = m->n_out ? m->class_out : -1;
    if (m->labels && m->n_out && co < 0)
        return md_err_setc(err, MD_EUNPROC, "invalid_config",
                           "config.labels names classes but no output is marked: add "
                           "\"logits\": true to the one in config.outputs they name");
    if (m->labels && co >= 0) {
        md_io *io = &m->out[co];
        md_classes cls = md_classes_from_config(m->classes_cfg, io->ndim == 1 ? io->shape[0] : 0);
        if (io->ndim != 1 || cls.kind == MD_CLASSES_NONE ||
            cls.classes != (int64_t)json_array_size(m->labels))
            return md_err_setc(err, MD_EUNPROC, "invalid_config",
                               "config.labels has %zu names but output \"%s\" has %lld values "
                               "per row%s",
                               json_array_size(m->labels), io->name, (long long)io->values,
                               cls.kind == MD_CLASSES_NONE && io->ndim == 1
                                   ? "; declare \"output\": \"logits\" or \"probabilities\""
                                   : "");
    }
    return MD_OK;
}

int md_model_n_inputs(const md_model *m) { return m->n_in; }
int md_model_n_outputs(const md_model *m) { return m->n_out; }
int64_t md_model_output_values(const md_model *m) { return m->out_values; }
int md_model_classes_output(const md_model *m) { return m->class_out; }

static void io_info(const md_io *io, md_io_info *out)
{
    out->name = io->name;
    out->dtype = io->dtype_name;
    out->is_int = io->is_int;
    out->ndim = io->ndim;
    out->shape = io->shape;
    out->values = io->values;
    out->off = io->off;
}

void md_model_input(const md_model *m, int i, md_io_info *out) { io_info(&m->in[i], out); }
void md_model_output(const md_model *m, int j, md_io_info *out) { io_info(&m->out[j], out); }
static pthread_once_t trim_once = PTHREAD_ONCE_INIT;
static void trim_first(void) { malloc_trim(0); }

void md_model_destroy(md_model *m)
{
    /* the last worker is gone: every packed copy is back in the pool */
    for (int i = 0; i < m->pool_nfree; i++)
        md_torch_free(m->pool_free[i]);
    free(m->pool_free);
    pthread_mutex_destroy(&m->pool_mu);
    pthread_cond_destroy(&m->pool_cv);
    md_torch_free(m->torch);
    json_decref(m->labels);
    json_decref(m->classes_cfg);
    free(m->mean);
    free(m->std);
    for (int i = 0; i < m->n_in; i++) {
        free(m->in[i].mean);
        free(m->in[i].std);
    }
    pthread_mutex_destroy(&m->mu);
    pthread_cond_destroy(&m->cv[0]);
    pthread_cond_destroy(&m->cv[1]);
    free(m);
    /* give the freed weights' pages back to the system: glibc keeps freed
     * heap memory (tensors under its mmap threshold, which grows as big
     * blocks are freed) for reuse, so without this an unloaded version's
     * memory stays in the RSS (measured: tests/e2e/test_memory.py). The
     * first call once (glibc's set-up of its arena races with a second
     * first call; the server makes it in main, a unit test may not) */
    pthread_once(&trim_once, trim_first);
    malloc_trim(0);
}

md_status md_model_load(const char *name, int version, const char *path, json_t *config,
                        const md_model_defaults *def, md_model **out, md_err *err)
{
    return md_model_load_weights(name, version, path, NULL, NULL, config, def, out, err);
}

md_status md_model_load_weights(const char *name, int version, const char *path,
                                const char *weights_path, const char *weights_format,
                                json_t *config, const md_model_defaults *def, md_model **out,
                                md_err *err)
{
    *out = NULL;
    md_status st = md_model_config_check(config, err);
    if (st != MD_OK)
        return st;
    double load_t0 = now_s();
    md_model *m = md_xcalloc(1, sizeof *m);
    m->fwd_avg_s = INFINITY; /* no coalescing before a forward was timed */
    snprintf(m->name, sizeof m->name, "%s", name);
    m->version = version;
    md_hist_init(&m->rows_hist, md_rows_bounds, md_rows_nbounds);
    md_hist_init(&m->wait_hist, md_latency_bounds, md_latency_nbounds);
    md_hist_init(&m->forward_hist, md_latency_bounds, md_latency_nbounds);
    md_hist_init(&m->live_latency, md_latency_bounds, md_latency_nbounds);
    pthread_mutex_init(&m->mu, NULL);
    pthread_mutex_init(&m->pool_mu, NULL);
    pthread_cond_init(&m->pool_cv, NULL);
    pthread_cond_init(&m->cv[0], NULL);
    pthread_cond_init(&m->cv[1], NULL);
    atomic_store(&m->refs, 1);
    json_t *input = json_object_get(config, "input");
    json_t *shape = json_object_get(input, "shape");
    for (size_t i = 0; i < json_array_size(shape) && i < MD_MAX_DIMS - 1; i++)
        m->row_shape[m->row_ndim++] = json_integer_value(json_array_get(shape, i));
    /* md_model_config_check bounded the product; checked again because the
     * zero row of the test forward is allocated from it */
    if (md_shape_product(m->row_shape, m->row_ndim, &m->row_size) != 0 ||
        m->row_size > MD_MAX_ROW_VALUES) {
        md_model_destroy(m);
        return md_err_setc(err, MD_EUNPROC, "invalid_config",
                           "config.input.shape holds more than %lld values per row; give the "
                           "shape of one row",
                           (long long)MD_MAX_ROW_VALUES);
    }
    atomic_store(&m->shape_known, m->row_ndim > 0);
    if ((st = read_io(m, config, err)) != MD_OK) {
        md_model_destroy(m);
        return st;
    }
    atomic_store(&m->shape_known, m->row_ndim > 0);
    json_t *pre = json_object_get(config, "preprocess");
    m->scale = json_is_number(json_object_get(pre, "scale"))
                   ? json_number_value(json_object_get(pre, "scale"))
                   : 1.0;
    json_t *mean = json_object_get(pre, "mean"), *std = json_object_get(pre, "std");
    if (mean) {
        m->n_norm = (int)json_array_size(mean);
        if (m->n_norm > 1 && (m->row_ndim < 2 || m->row_shape[0] != m->n_norm)) {
            md_model_destroy(m);
            return md_err_setc(err, MD_EUNPROC, "invalid_config",
                               "config.preprocess.mean has %d channels but input.shape does not "
                               "start with %d channels (C, H, W)",
                               m->n_norm, m->n_norm);
        }
        m->mean = md_xmalloc(sizeof(float) * (size_t)m->n_norm);
        m->std = md_xmalloc(sizeof(float) * (size_t)m->n_norm);
        for (int i = 0; i < m->n_norm; i++) {
            m->mean[i] = (float)json_number_value(json_array_get(mean, (size_t)i));
            m->std[i] = (float)json_number_value(json_array_get(std, (size_t)i));
        }
        m->norm_inner = m->n_norm > 1 ? m->row_size / m->n_norm : 0;
    }
    if ((st = md_image_opts_from_config(config,
                                        def->max_image_pixels > 0 ? def->max_image_pixels
                                                                  : MD_IMAGE_MAX_PIXELS_DEFAULT,
                                        &m->image, &m->has_image, err)) != MD_OK) {
        md_model_destroy(m);
        return st;
    }
    if (def->max_jpeg_scans > 0)
        m->image.max_scans = def->max_jpeg_scans;
    const char *output = json_string_value(json_object_get(config, "output"));
    m->logits = output && strcmp(output, "logits") == 0;
    /* a private copy: the config belongs to the request that deployed it, and
     * jansson's reference counts are not safe to share across threads (TSan:
     * the request freed the config while a worker released its labels) */
    m->labels = json_deep_copy(json_object_get(config, "labels"));
    m->classes_cfg = json_object();
    for (const char **k = (const char *[]){"output", "threshold", "multi_label", NULL}; *k; k++)
        if (json_object_get(config, *k))
            json_object_set_new(m->classes_cfg, *k, json_deep_copy(json_object_get(config, *k)));
    /* an output marked "logits": true reads as logits unless config.output says otherwise */
    for (int j = 0; j < m->n_out; j++)
        if (json_is_true(json_object_get(json_array_get(json_object_get(config, "outputs"),
                                                        (size_t)j),
                                         "logits")) &&
            !output) {
            json_object_set_new(m->classes_cfg, "output", json_string("logits"));
            m->logits = 1;
        }
    json_t *b = json_object_get(config, "batching");
    m->max_batch = cfg_int(b, "max_batch_size", def->max_batch_size);
    m->max_delay_us = cfg_int(b, "max_delay_us", def->max_delay_us);
    m->coalesce_us = cfg_int(b, "coalesce_us", def->coalesce_us);
    m->queue_limit = cfg_int(b, "queue_limit", def->queue_limit);
    m->timeout_ms = cfg_int(b, "timeout_ms", def->timeout_ms);
    m->workers = cfg_int(config, "workers", def->workers);
    /* the packed copies' pool (see "one copy of the weights"): no more
     * copies than forwards can run at once; prepack_max lowers it once the
     * first copy's size is known */
    m->pool_max = md_batcher_cores() < 2 * m->workers ? md_batcher_cores() : 2 * m->workers;
    m->pool_free = md_xmalloc(sizeof(md_torch_model *) * (size_t)m->pool_max);
    m->job_nice = def->job_nice;
    json_t *pp = json_object_get(config, "prepack");
    m->prepack_max = pp && json_is_false(pp) ? 0
                     : def->prepack_max_bytes > 0 ? (size_t)def->prepack_max_bytes
                                                  : 0;
    const char *device = json_string_value(json_object_get(config, "device"));

    md_dtype in_dtype = parse_dtype(json_string_value(json_object_get(input, "dtype")));
    m->in_dtype = in_dtype;
    if (weights_path)
        st = md_weights_load(path, weights_path, weights_format, device ? device : "cpu",
                             in_dtype, &m->torch, err);
    else
        st = md_torch_load(path, device ? device : "cpu", in_dtype, &m->torch, err);
    if (st != MD_OK) {
        md_model_destroy(m);
        return st;
    }
    size_t resident = 0;
    md_err rerr;
    if (md_torch_resident_bytes(m->torch, &resident, &rerr) != MD_OK) {
        /* the checkpoint's size is close: its bytes are mostly the weights */
        struct stat sb;
        resident = stat(weights_path ? weights_path : path, &sb) == 0 ? (size_t)sb.st_size : 0;
        md_log(MD_LOG_WARN, "model %s: %s; counting its checkpoint's %zu bytes as resident", name,
               rerr.msg, resident);
    }
    atomic_store(&m->resident_bytes, (long long)resident);
    if (m->n_in || m->n_out) {
        if ((st = io_load_check(m, name, config, err)) != MD_OK) {
            md_model_destroy(m);
            return st;
        }
    } else if (m->row_ndim > 0) {
        /* the test forwards: one zero row, then two, of the declared shape.
         * Requests of different clients share forwards, so a row's answer
         * must not depend on the batch: an output whose rows change shape
         * with the batch (x @ x.t()) would hand one client values computed
         * from another's input. */
        float *zeros = md_calloc_checked((size_t)m->row_size, 2 * sizeof(float),
                                         "the test forward's zero rows", err);
        if (!zeros) {
            md_model_destroy(m);
            return MD_ENOMEM;
        }
        int64_t s[MD_MAX_DIMS + 1] = {1};
        memcpy(s + 1, m->row_shape, sizeof(int64_t) * (size_t)m->row_ndim);
        float *o = NULL;
        int64_t os[MD_MAX_DIMS], os2[MD_MAX_DIMS];
        int on = 0, on2 = 0;
        md_err ferr;
        st = md_torch_forward(m->torch, zeros, s, m->row_ndim + 1, &o, os, &on, &ferr);
        free(o);
        o = NULL;
        if (st == MD_OK) {
            s[0] = 2;
            double t0 = now_s();
            st = md_torch_forward(m->torch, zeros, s, m->row_ndim + 1, &o, os2, &on2, &ferr);
            /* the first estimate of the batch time wake_online goes by (on
             * the unpacked module: on the high side, so a slow model spreads
             * its first requests over the workers; a config-less model has
             * no test forward and coalesces nothing until its first batch) */
            m->fwd_avg_s = now_s() - t0;
            free(o);
        }
        free(zeros);
        if (st == MD_OK) {
            int same = on == on2 && on >= 1 && os[0] == 1 && os2[0] == 2;
            for (int d = 1; same && d < on; d++)
                same = os[d] == os2[d];
            if (!same) {
                char a[96], b[96];
                md_fmt_dims(a, sizeof a, os, on);
                md_fmt_dims(b, sizeof b, os2, on2);
                md_err_setc(err, MD_EUNPROC, "batch_dependent_output",
                            "model %s answers a batch of 1 row with shape %s and a batch of 2 "
                            "with %s; modeld batches the rows of different requests together, "
                            "so the output must have one row per input row, each computed from "
                            "that row alone",
                            name, a, b);
                md_model_destroy(m);
                return MD_EUNPROC;
            }
        }
        if (st == MD_ENOMEM) { /* short of memory now: not the model's fault */
            *err = ferr;
            md_model_destroy(m);
            return MD_ENOMEM;
        }
        if (st != MD_OK) {
            md_err_setc(err, MD_EUNPROC, "model_test_failed",
                        "the test forward on the declared input shape failed: %s; check "
                        "config.input.shape",
                        ferr.msg);
            md_model_destroy(m);
            return MD_EUNPROC;
        }
        md_classes cls = md_classes_from_config(m->classes_cfg, on == 2 ? os[1] : 0);
        if (m->labels && on == 2 && cls.kind == MD_CLASSES_NONE) {
            md_err_setc(err, MD_EUNPROC, "invalid_config",
                        "config.labels names %zu classes, but %s",
                        json_array_size(m->labels), md_classes_none_reason());
            md_model_destroy(m);
            return MD_EUNPROC;
        }
        if (m->labels && (on != 2 || cls.classes != (int64_t)json_array_size(m->labels))) {
            if (cls.kind == MD_CLASSES_BINARY)
                md_err_setc(err, MD_EUNPROC, "invalid_config",
                            "config.labels has %zu names but the model's one output column is "
                            "a binary classifier: give two, the class below the threshold "
                            "first, e.g. [\"benign\", \"malignant\"]",
                            json_array_size(m->labels));
            else
                md_err_setc(err, MD_EUNPROC, "invalid_config",
                            "config.labels has %zu names but the model outputs %lld values per "
                            "row",
                            json_array_size(m->labels), on >= 2 ? (long long)os[1] : 1LL);
            md_model_destroy(m);
            return MD_EUNPROC;
        }
    }
    m->load_s = now_s() - load_t0;
    /* no workers yet: they start when the version is admitted to serve
     * (md_registry_put) or its first request comes, so a version that is
     * only validated (a deploy that does not become the default) never
     * starts threads nor makes packed copies */
    *out = m;
    return MD_OK;
}

md_status md_model_start(md_model *m, md_err *err)
{
    if (atomic_load_explicit(&m->running, memory_order_acquire))
        return MD_OK; /* every request asks: no lock once started */
    pthread_mutex_lock(&m->mu);
    if (m->started) {
        int failed = m->start_failed;
        pthread_mutex_unlock(&m->mu);
        return failed ? md_err_set(err, MD_EBUSY, "cannot start the worker threads of model %s "
                                                  "version %d; lower its workers",
                                   m->name, md_model_version(m))
                      : MD_OK;
    }
    /* `workers` online workers, then as many job workers */
    int total = 2 * m->workers;
    m->live_workers = total;
    md_batcher_live_add(total);
    for (int i = 0; i < total; i++) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&t, &attr, i < m->workers ? md_batcher_online_main : md_batcher_job_main, m);
        pthread_attr_destroy(&attr);
        if (rc != 0) {
            md_batcher_live_add(-(total - i));
            m->live_workers -= total - i;
            if (i == 0) { /* none started: the next request tries again */
                pthread_mutex_unlock(&m->mu);
            } else {
                /* the started ones wait, with nothing queued, for the last
                 * release (which stops them; the last one frees m) */
                m->started = 1;
                m->start_failed = 1;
                pthread_mutex_unlock(&m->mu);
            }
            return md_err_set(err, MD_EBUSY, "cannot start %d worker threads for model %s (%s); "
                              "lower its workers", total, m->name, strerror(rc));
        }
    }
    m->started = 1;
    atomic_store_explicit(&m->running, 1, memory_order_release);
    pthread_mutex_unlock(&m->mu);
    return MD_OK;
}

void md_model_retain(md_model *m) { atomic_fetch_add(&m->refs, 1); }

void md_model_release(md_model *m)
{
    if (!m || atomic_fetch_sub(&m->refs, 1) != 1)
        return;
    pthread_mutex_lock(&m->mu);
    m->stopping = 1;
    /* no worker runs (never started, or none could be): nobody else frees it */
    int unattended = m->live_workers == 0;
    pthread_cond_broadcast(&m->cv[0]);
    pthread_cond_broadcast(&m->cv[1]);
    pthread_mutex_unlock(&m->mu);
    if (unattended)
        md_model_destroy(m);
}

const char *md_model_name(const md_model *m) { return m->name; }
int md_model_version(const md_model *m) { return atomic_load(&((md_model *)m)->version); }
void md_model_set_version(md_model *m, int version) { atomic_store(&m->version, version); }
json_t *md_model_labels(const md_model *m) { return m->labels; }
long long md_model_weight_bytes(const md_model *m)
{
    return atomic_load(&((md_model *)m)->resident_bytes);
}

void md_model_note_answer(md_model *m, int ok, double seconds)
{
    if (ok) {
        atomic_fetch_add(&m->live_ok, 1);
        md_hist_observe(&m->live_latency, seconds);
    } else {
        atomic_fetch_add(&m->live_errors, 1);
    }
}

json_t *md_model_live(const md_model *m)
{
    md_model *mm = (md_model *)m;
    long long ok = atomic_load(&mm->live_ok), errors = atomic_load(&mm->live_errors);
    double p50 = md_hist_quantile(&mm->live_latency, 0.5);
    double p99 = md_hist_quantile(&mm->live_latency, 0.99);
    return json_pack("{s:I,s:I,s:f,s:o,s:o}", "requests", (json_int_t)(ok + errors), "errors",
                     (json_int_t)errors, "error_rate",
                     ok + errors ? (double)errors / (double)(ok + errors) : 0.0, "p50_ms",
                     isnan(p50) ? json_null() : json_real(p50 * 1e3), "p99_ms",
                     isnan(p99) ? json_null() : json_real(p99 * 1e3));
}

long long md_model_resident_bytes(const md_model *m)
{
    md_model *mm = (md_model *)m;
    /* its module, and the packed copies it holds now (made after the load,
     * at most one per core: they count once made) */
    return atomic_load(&mm->resident_bytes) +
           (long long)atomic_load(&mm->prepacked) * atomic_load(&mm->packed_bytes);
}
int md_model_refs(const md_model *m) { return atomic_load(&((md_model *)m)->refs); }
int md_model_output_logits(const md_model *m) { return m->logits; }
md_classes md_model_classes(const md_model *m, int64_t width)
{
    return md_classes_from_config(m->classes_cfg, width);
}

const md_image_opts *md_model_image(const md_model *m)
{
    return m->has_image ? &m->image : NULL;
}

int md_model_input_shape(const md_model *m, int64_t *shape)
{
    if (!atomic_load_explicit(&((md_model *)m)->shape_known, memory_order_acquire))
        return 0;
    memcpy(shape, m->row_shape, sizeof(int64_t) * (size_t)m->row_ndim);
    return m->row_ndim;
}

json_t *md_model_stats(const md_model *m)
{
    json_t *hist = json_array();
    for (int i = 0; i < 8; i++)
        json_array_append_new(hist, json_integer(atomic_load(&m->batch_hist[i])));
    md_model *mm = (md_model *)m;
    pthread_mutex_lock(&mm->mu);
    int queued = m->q[0].count + m->q[1].count, job_chunks = m->q[1].count, idle = m->idle;
    pthread_mutex_unlock(&mm->mu);
    return json_pack("{s:s,s:i,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:i,s:i,s:o,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i}",
                     "model", m->name,
                     "version", md_model_version(m), "batches", (json_int_t)atomic_load(&m->n_batches),
                     "rows", (json_int_t)atomic_load(&m->n_rows), "requests",
                     (json_int_t)atomic_load(&m->n_requests), "timeouts",
                     (json_int_t)atomic_load(&m->n_timeouts), "client_closed",
                     (json_int_t)atomic_load(&m->n_dropped), "rejected",
                     (json_int_t)atomic_load(&m->n_rejected), "queue_wait_us_total",
                     (json_int_t)atomic_load(&m->wait_us_total), "queued", queued,
                     "queued_job_chunks", job_chunks, "batch_size_histogram", hist, "workers",
                     m->workers, "job_workers", m->workers, "job_nice", m->job_nice,
                     "max_batch_size", m->max_batch, "max_delay_us", m->max_delay_us,
                     "coalesce_us", m->coalesce_us, "idle_workers", idle,
                     "prepacked_workers", atomic_load(&m->prepacked));
}

/* The labels of one model version: model="...",version="N". */
static void model_labels(const md_model *m, char *out, size_t size)
{
    char v[16];
    out[0] = '\0';
    md_prom_label(out, size, "model", m->name);
    snprintf(v, sizeof v, "%d", md_model_version(m));
    md_prom_label(out, size, "version", v);
}

void md_models_write_metrics(md_model *const *ms, const int *is_default, int n, FILE *f)
{
    char l[200], l2[240];
    md_prom_family(f, "modeld_model_loaded", "gauge",
                   "Loaded model versions (1 each); default=1 for the version /predict uses.");
    for (int i = 0; i < n; i++) {
        model_labels(ms[i], l, sizeof l);
        snprintf(l2, sizeof l2, "%s,default=\"%d\"", l, is_default[i] ? 1 : 0);
        md_prom_sample(f, "modeld_model_loaded", l2, 1);
    }
    md_prom_family(f, "modeld_model_load_seconds", "gauge",
                   "Seconds the version's load and test forwards took.");
    for (int i = 0; i < n; i++) {
        model_labels(ms[i], l, sizeof l);
        md_prom_sample(f, "modeld_model_load_seconds", l, ms[i]->load_s);
    }
    md_prom_family(f, "modeld_predictions_total", "counter",
                   "Prediction requests queued (online requests and job chunks).");
    for (int i = 0; i < n; i++) {
        model_labels(ms[i], l, sizeof l);
        md_prom_sample(f, "modeld_predictions_total", l,
                       (double)atomic_load(&ms[i]->n_requests));
    }
    md_prom_family(f, "modeld_rows_total", "counter", "Rows through successful forwards.");
    for (int i = 0; i < n; i++) {
        model_labels(ms[i], l, sizeof l);
        md_prom_sample(f, "modeld_rows_total", l, (double)atomic_load(&ms[i]->n_rows));
    }
    md_prom_family(f, "modeld_prediction_errors_total", "counter",
                   "Requests not answered with a prediction, by kind: rejected (503, queue "
                   "full), timeout (504), client_closed, forward_failed.");
    for (int i = 0; i < n; i++) {
        const struct {
            const char *kind;
            long long v;
        } k[] = {{"rejected", atomic_load(&ms[i]->n_rejected)},
                 {"timeout", atomic_load(&ms[i]->n_timeouts)},
                 {"client_closed", atomic_load(&ms[i]->n_dropped)},
                 {"forward_failed", atomic_load(&ms[i]->n_failed)}};
        model_labels(ms[i], l, sizeof l);
        for (size_t j = 0; j < sizeof k / sizeof k[0]; j++) {
            snprintf(l2, sizeof l2, "%s,kind=\"%s\"", l, k[j].kind);
            md_prom_sample(f, "modeld_prediction_errors_total", l2, (double)k[j].v);
        }
    }
    md_prom_family(f, "modeld_queue_depth", "gauge",
                   "Requests waiting for a worker, by pool (online, job).");
    for (int i = 0; i < n; i++) {
        model_labels(ms[i], l, sizeof l);
        snprintf(l2, sizeof l2, "%s,pool=\"online\"", l);
        md_prom_sample(f, "modeld_queue_depth", l2, atomic_load(&ms[i]->depth[0]));
        snprintf(l2, sizeof l2, "%s,pool=\"job\"", l);
        md_prom_sample(f, "modeld_queue_depth", l2, atomic_load(&ms[i]->depth[1]));
    }
    md_prom_family(f, "modeld_batch_rows", "histogram", "Rows per forward (batch size).");
    for (int i = 0; i < n; i++) {
        model_labels(ms[i], l, sizeof l);
        md_prom_hist(f, "modeld_batch_rows", l, &ms[i]->rows_hist);
    }
    md_prom_family(f, "modeld_queue_wait_seconds", "histogram",
                   "Time online requests waited in the queue before a worker took them.");
    for (int i = 0; i < n; i++) {
        model_labels(ms[i], l, sizeof l);
        md_prom_hist(f, "modeld_queue_wait_seconds", l, &ms[i]->wait_hist);
    }
    md_prom_family(f, "modeld_forward_seconds", "histogram", "Time of each forward.");
    for (int i = 0; i < n; i++) {
        model_labels(ms[i], l, sizeof l);
        md_prom_hist(f, "modeld_forward_seconds", l, &ms[i]->forward_hist);
    }
}

