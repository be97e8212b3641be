/*
 * inprocess.c - the in-process ceiling for bench/run.sh: load a TorchScript
 * model through md_torch_* (the same C API modeld's workers use) and run
 * forward on random input from T threads for S seconds per batch size,
 * with no HTTP, JSON or batching in the way. Prints one JSON line per batch
 * size on stdout:
 *
 *   {"bench":"inprocess","batch":64,"threads":2,"seconds":5.00,"forwards":...,
 *    "rows":...,"rows_per_s":...,"forwards_per_s":...,"p50_ms":...,"p99_ms":...}
 *
 * Each thread runs single-threaded forwards (intra-op 1, OpenBLAS 1), the
 * way modeld runs one worker per core, on its own prepacked copy of the
 * model (md_torch_replica, as each modeld worker makes one; --prepack-max-bytes
 * as modeld's setting, 0 = forward on the loaded module as PyTorch would), so rows_per_s is what the machine can
 * do when the model is the only work. Input values are uniform in [0,1):
 * already scaled, as modeld's preprocess.scale would leave them.
 *
 * --images DIR: the in-process side of the image-folder job: read every PNG
 * and JPEG under DIR (recursively, in byte order of their paths, as a job
 * over input.format images reads them) into memory, then from T threads
 * decode them with md_image_to_tensor (preprocess.image {"mode": "L"}, the
 * job's work per file) and forward batches of 64. Prints one line:
 *
 *   {"bench":"inprocess_images","images":...,"threads":2,"seconds":...,
 *    "rows_per_s":...,"decode_us_per_image":...,"forward_us_per_image":...}
 *
 * decode_us_per_image is the CPU time of md_image_to_tensor per image on one
 * thread (file reads are not in it); rows_per_s counts decode and forward.
 *
 * Build (after make): cc $(CFLAGS) -o build/bench/inprocess bench/inprocess.c
 *   build/predictor/torch_backend.o build/predictor/image.o build/config/md_err.o $(LIBS)
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../config/md_err.h"
#include "../predictor/image.h"
#include "../predictor/torch_backend.h"

#define MAX_BATCHES 8
#define MAX_THREADS 256

typedef struct worker {
    pthread_t tid;
    md_torch_model *model;
    int64_t batch, features;
    double seconds, warmup_s;
    uint64_t seed;
    /* results */
    int64_t forwards;
    double *lat_ms; /* one per timed forward */
    size_t lat_n, lat_cap;
    int failed;
    md_err err;
} worker;

static size_t g_prepack_max = 268435456; /* --prepack-max-bytes, modeld's default */
static int g_prepacked = -1;             /* whether thread 0 got a replica (for the report) */

/* The model a thread forwards on: its own replica when one can be made. */
static md_torch_model *thread_model(md_torch_model *base, md_torch_model **mine)
{
    *mine = NULL;
    size_t bytes = 0;
    md_err err;
    md_err_clear(&err);
    if (g_prepack_max > 0 && md_torch_replica(base, g_prepack_max, mine, &bytes, &err) != MD_OK)
        fprintf(stderr, "inprocess: not prepacked: %s\n", err.msg);
    if (g_prepacked < 0)
        g_prepacked = *mine != NULL;
    return *mine ? *mine : base;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* xorshift64*: per-thread, so no shared state between workers. */
static uint64_t rng_next(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return x * 0x2545F4914F6CDD1DULL;
}

static int run_forward(worker *w, const float *in, double *ms)
{
    int64_t shape[2] = {w->batch, w->features};
    float *out = NULL;
    int64_t out_shape[8];
    int out_ndim = 0;
    double t0 = now_s();
    md_status st = md_torch_forward(w->model, in, shape, 2, &out, out_shape, &out_ndim, &w->err);
    double t1 = now_s();
    free(out);
    if (st != MD_OK)
        return -1;
    if (ms)
        *ms = (t1 - t0) * 1e3;
    return 0;
}

static void *worker_main(void *arg)
{
    worker *w = arg;
    md_torch_model *mine;
    w->model = thread_model(w->model, &mine);
    size_t n = (size_t)(w->batch * w->features);
    float *in = malloc(n * sizeof(float));
    if (!in) {
        md_err_set(&w->err, MD_ENOMEM, "out of memory for the input");
        w->failed = 1;
        return NULL;
    }
    for (size_t i = 0; i < n; i++)
        in[i] = (float)(rng_next(&w->seed) >> 40) / (float)(1u << 24);

    /* warm-up: TorchScript's profiling executor optimizes after the first runs */
    double end = now_s() + w->warmup_s;
    for (int i = 0; i < 3 || now_s() < end; i++)
        if (run_forward(w, in, NULL) != 0) {
            w->failed = 1;
            free(in);
            return NULL;
        }

    end = now_s() + w->seconds;
    while (now_s() < end) {
        double ms;
        if (run_forward(w, in, &ms) != 0) {
            w->failed = 1;
            break;
        }
        if (w->lat_n == w->lat_cap) {
            size_t cap = w->lat_cap ? w->lat_cap * 2 : 4096;
            double *p = realloc(w->lat_ms, cap * sizeof(double));
            if (!p) {
                md_err_set(&w->err, MD_ENOMEM, "out of memory for latencies");
                w->failed = 1;
                break;
            }
            w->lat_ms = p;
            w->lat_cap = cap;
        }
        w->lat_ms[w->lat_n++] = ms;
        w->forwards++;
    }
    free(in);
    md_torch_free(mine);
    return NULL;
}

/* ---- --images DIR ---- */

typedef struct img {
    char *path;
    unsigned char *data;
    size_t len;
} img;

typedef struct img_list {
    img *v;
    size_t n, cap;
} img_list;

static int list_images(const char *dir, img_list *l)
{
    DIR *d = opendir(dir);
    if (!d)
        return -1;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        char *p;
        if (asprintf(&p, "%s/%s", dir, e->d_name) < 0)
            return -1;
        if (e->d_type == DT_DIR) {
            list_images(p, l);
            free(p);
        } else if (e->d_type == DT_REG) {
            if (l->n == l->cap) {
                l->cap = l->cap ? l->cap * 2 : 1024;
                l->v = realloc(l->v, l->cap * sizeof *l->v);
                if (!l->v)
                    return -1;
            }
            l->v[l->n++] = (img){.path = p};
        } else {
            free(p);
        }
    }
    closedir(d);
    return 0;
}

static int by_path(const void *a, const void *b)
{
    return strcmp(((const img *)a)->path, ((const img *)b)->path);
}

typedef struct img_worker {
    pthread_t tid;
    md_torch_model *model;
    const img *v;
    size_t from, to;
    const md_image_opts *o;
    double decode_s, forward_s;
    int failed;
    md_err err;
} img_worker;

static double cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void *img_worker_main(void *arg)
{
    img_worker *w = arg;
    size_t values = md_image_values(w->o);
    float *in = malloc(64 * values * sizeof(float));
    if (!in) {
        w->failed = 1;
        return NULL;
    }
    for (size_t i = w->from; i < w->to && !w->failed;) {
        int64_t rows = 0;
        double t0 = cpu_s();
        for (; i < w->to && rows < 64; i++) {
            if (md_image_to_tensor(w->v[i].data, w->v[i].len, w->o, w->v[i].path,
                                   in + (size_t)rows * values, &w->err) != MD_OK) {
                w->failed = 1;
                break;
            }
            rows++;
        }
        double t1 = now_s();
        w->decode_s += cpu_s() - t0;
        int64_t shape[4] = {rows, w->o->channels, w->o->height, w->o->width};
        float *out = NULL;
        int64_t out_shape[8];
        int out_ndim = 0;
        if (rows > 0 && md_torch_forward(w->model, in, shape, 4, &out, out_shape, &out_ndim,
                                         &w->err) != MD_OK)
            w->failed = 1;
        free(out);
        w->forward_s += now_s() - t1;
    }
    free(in);
    return NULL;
}

static int run_images(md_torch_model *model, const char *dir, long threads)
{
    img_list l = {0};
    if (list_images(dir, &l) != 0 || l.n == 0) {
        fprintf(stderr, "inprocess: no images under %s\n", dir);
        return 1;
    }
    qsort(l.v, l.n, sizeof *l.v, by_path);
    for (size_t i = 0; i < l.n; i++) {
        FILE *f = fopen(l.v[i].path, "rb");
        if (!f || fseek(f, 0, SEEK_END) != 0) {
            fprintf(stderr, "inprocess: cannot read %s\n", l.v[i].path);
            return 1;
        }
        l.v[i].len = (size_t)ftell(f);
        rewind(f);
        l.v[i].data = malloc(l.v[i].len ? l.v[i].len : 1);
        if (!l.v[i].data || fread(l.v[i].data, 1, l.v[i].len, f) != l.v[i].len) {
            fprintf(stderr, "inprocess: cannot read %s\n", l.v[i].path);
            return 1;
        }
        fclose(f);
    }
    md_image_opts o = {.channels = 1, .height = 28, .width = 28,
                       .max_pixels = MD_IMAGE_MAX_PIXELS_DEFAULT};
    img_worker ws[MAX_THREADS];
    memset(ws, 0, sizeof ws);
    /* each thread's replica is made before the clock starts, as modeld's
     * workers make theirs at load */
    md_torch_model *mine[MAX_THREADS] = {0}, *use[MAX_THREADS];
    for (long t = 0; t < threads; t++)
        use[t] = thread_model(model, &mine[t]);
    /* warm-up forwards: the profiling executor optimizes after the first runs */
    img_worker warm = {.model = use[0], .v = l.v, .from = 0, .to = l.n < 256 ? l.n : 256, .o = &o};
    img_worker_main(&warm);
    double t0 = now_s();
    int rc = 0;
    for (long t = 0; t < threads; t++) {
        ws[t] = (img_worker){.model = use[t], .v = l.v, .o = &o,
                             .from = l.n * (size_t)t / (size_t)threads,
                             .to = l.n * (size_t)(t + 1) / (size_t)threads};
        if (pthread_create(&ws[t].tid, NULL, img_worker_main, &ws[t]) != 0)
            return 1;
    }
    double decode = 0, forward = 0;
    for (long t = 0; t < threads; t++) {
        pthread_join(ws[t].tid, NULL);
        if (ws[t].failed) {
            fprintf(stderr, "inprocess: images: %s\n", ws[t].err.msg);
            rc = 1;
        }
        decode += ws[t].decode_s;
        forward += ws[t].forward_s;
    }
    double wall = now_s() - t0;
    if (rc == 0)
        printf("{\"bench\":\"inprocess_images\",\"images\":%zu,\"threads\":%ld,"
               "\"seconds\":%.3f,\"rows_per_s\":%.1f,\"decode_us_per_image\":%.2f,"
               "\"forward_us_per_image\":%.2f,\"prepacked\":%s}\n",
               l.n, threads, wall, (double)l.n / wall, decode / (double)l.n * 1e6,
               forward / (double)l.n * 1e6, g_prepacked > 0 ? "true" : "false");
    for (size_t i = 0; i < l.n; i++) {
        free(l.v[i].path);
        free(l.v[i].data);
    }
    free(l.v);
    for (long t = 0; t < threads; t++)
        md_torch_free(mine[t]);
    return rc;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double percentile(const double *sorted, size_t n, double p)
{
    if (n == 0)
        return 0.0;
    size_t i = (size_t)(p / 100.0 * (double)(n - 1) + 0.5);
    return sorted[i < n ? i : n - 1];
}

static void usage(FILE *f)
{
    fprintf(f, "usage: inprocess [--model PATH] [--batch B[,B...]] [--seconds S] [--threads T]\n"
               "                 [--warmup S] [--features F] [--device D]\n"
               "  --model     TorchScript file (default examples/fashion_mnist/model.pt)\n"
               "  --batch     rows per forward, comma-separated (default 64,1)\n"
               "  --seconds   timed seconds per batch size (default 5)\n"
               "  --threads   concurrent forward threads (default: online cores)\n"
               "  --warmup    untimed seconds per thread first (default 0.5)\n"
               "  --features  values per row (default 784)\n"
               "  --device    cpu, cuda, cuda:N or auto, as a model's config says (default cpu)\n"
               "  --images    a folder of PNG/JPEG files: decode (mode L, 28x28) and forward them\n"
               "  --prepack-max-bytes  each thread packs linear weights up to this size, as\n"
               "              modeld's workers do (default 268435456; 0 = plain module)\n"
               "              in batches of 64 instead (the image-folder job's work)\n");
}

static int parse_batches(const char *s, int64_t *out, int *n)
{
    char *copy = strdup(s), *save = NULL;
    if (!copy)
        return -1;
    *n = 0;
    for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        char *end;
        errno = 0;
        long long v = strtoll(tok, &end, 10);
        if (errno || *end || v < 1 || v > 1 << 20 || *n == MAX_BATCHES) {
            free(copy);
            return -1;
        }
        out[(*n)++] = v;
    }
    free(copy);
    return *n > 0 ? 0 : -1;
}

int main(int argc, char **argv)
{
    const char *model_path = "examples/fashion_mnist/model.pt";
    int64_t batches[MAX_BATCHES] = {64, 1};
    int nbatches = 2;
    double seconds = 5.0, warmup = 0.5;
    long threads = sysconf(_SC_NPROCESSORS_ONLN);
    long features = 784;
    const char *device = "cpu";
    const char *images_dir = NULL;

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage(stdout);
            return 0;
        }
        if (!v) {
            usage(stderr);
            return 2;
        }
        i++;
        if (strcmp(a, "--model") == 0)
            model_path = v;
        else if (strcmp(a, "--batch") == 0) {
            if (parse_batches(v, batches, &nbatches) != 0) {
                fprintf(stderr, "inprocess: bad --batch %s\n", v);
                return 2;
            }
        } else if (strcmp(a, "--seconds") == 0)
            seconds = atof(v);
        else if (strcmp(a, "--warmup") == 0)
            warmup = atof(v);
        else if (strcmp(a, "--threads") == 0)
            threads = atol(v);
        else if (strcmp(a, "--features") == 0)
            features = atol(v);
        else if (strcmp(a, "--device") == 0)
            device = v;
        else if (strcmp(a, "--images") == 0)
            images_dir = v;
        else if (strcmp(a, "--prepack-max-bytes") == 0 && v)
            g_prepack_max = (size_t)strtoull(v, NULL, 10);
        else {
            usage(stderr);
            return 2;
        }
    }
    if (seconds <= 0 || warmup < 0 || threads < 1 || threads > MAX_THREADS || features < 1) {
        fprintf(stderr, "inprocess: --seconds > 0, --warmup >= 0, 1 <= --threads <= %d, "
                        "--features >= 1\n",
                MAX_THREADS);
        return 2;
    }

    md_torch_init(1);
    md_err err;
    md_err_clear(&err);
    md_torch_model *model = NULL;
    if (md_torch_load(model_path, device, MD_F32, &model, &err) != MD_OK) {
        fprintf(stderr, "inprocess: %s: %s\n", model_path, err.msg);
        return 1;
    }

    if (images_dir) {
        int irc = run_images(model, images_dir, threads);
        md_torch_free(model);
        return irc;
    }
    int rc = 0;
    for (int b = 0; b < nbatches && rc == 0; b++) {
        worker *ws = calloc((size_t)threads, sizeof(worker));
        if (!ws) {
            fprintf(stderr, "inprocess: out of memory\n");
            rc = 1;
            break;
        }
        int started = 0;
        for (long t = 0; t < threads; t++) {
            worker *w = &ws[t];
            w->model = model;
            w->batch = batches[b];
            w->features = features;
            w->seconds = seconds;
            w->warmup_s = warmup;
            w->seed = 0x9E3779B97F4A7C15ULL * (uint64_t)(t + 1) + (uint64_t)b;
            md_err_clear(&w->err);
            if (pthread_create(&w->tid, NULL, worker_main, w) != 0) {
                fprintf(stderr, "inprocess: cannot start thread %ld\n", t);
                rc = 1;
                break;
            }
            started++;
        }
        size_t total_n = 0;
        int64_t forwards = 0;
        for (int t = 0; t < started; t++) {
            pthread_join(ws[t].tid, NULL);
            if (ws[t].failed) {
                fprintf(stderr, "inprocess: batch %lld thread %d: %s\n", (long long)batches[b], t,
                        ws[t].err.msg);
                rc = 1;
            }
            total_n += ws[t].lat_n;
            forwards += ws[t].forwards;
        }
        if (rc == 0) {
            double *all = malloc((total_n ? total_n : 1) * sizeof(double));
            if (!all) {
                fprintf(stderr, "inprocess: out of memory\n");
                rc = 1;
            } else {
                size_t k = 0;
                for (int t = 0; t < started; t++) {
                    memcpy(all + k, ws[t].lat_ms, ws[t].lat_n * sizeof(double));
                    k += ws[t].lat_n;
                }
                qsort(all, total_n, sizeof(double), cmp_double);
                int64_t rows = forwards * batches[b];
                printf("{\"bench\":\"inprocess\",\"batch\":%lld,\"threads\":%ld,"
                       "\"seconds\":%.2f,\"forwards\":%lld,\"rows\":%lld,\"rows_per_s\":%.1f,"
                       "\"forwards_per_s\":%.1f,\"p50_ms\":%.3f,\"p99_ms\":%.3f,"
                       "\"prepacked\":%s}\n",
                       (long long)batches[b], threads, seconds, (long long)forwards,
                       (long long)rows, (double)rows / seconds, (double)forwards / seconds,
                       percentile(all, total_n, 50), percentile(all, total_n, 99),
                       g_prepacked > 0 ? "true" : "false");
                fflush(stdout);
                free(all);
            }
        }
        for (int t = 0; t < started; t++)
            free(ws[t].lat_ms);
        free(ws);
    }
    md_torch_free(model);
    return rc;
}
