/*
 * http.c - libmicrohttpd glue: one access handler for every route.
 *
 * Over 800 lines, to be split: the request lifecycle (the access handler,
 * suspend, resume, defer) must stay one file with struct md_req; the bearer
 * tokens (md_auth checks) and the request id, trace context and access log
 * only read a request and can move out behind a private header for it.
 *
 * DESIGN
 * libmicrohttpd calls the access handler several times per request: first
 * with the headers (we create an md_req, route it, check Content-Length),
 * then once per body chunk (buffered under max_body_bytes or passed to the
 * route's streaming sink), then with no data (we run the handler). An error
 * found before the body is read (404, 405, 413 by Content-Length) is queued
 * at once, so the body is never read; libmicrohttpd then closes the
 * connection after the reply. A handler either replies or suspends; the
 * thread that later replies to a suspended request resumes it, and the next
 * call of the access handler queues the stored reply.
 *
 * Timeouts: the daemon's timeout is keepalive_timeout_s (idle connections);
 * once a request starts, its connection gets connection_timeout_s, so a
 * client that stops sending its body is dropped (one that keeps trickling is
 * never idle: at stop, main.c cuts it off); when the request completes, the
 * keep-alive timeout is restored. Suspended connections do not time out in
 * libmicrohttpd; the predictor enforces its own deadline on them.
 */
#define _GNU_SOURCE
#include "router.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <microhttpd.h>
#include <openssl/crypto.h>
#include <openssl/sha.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define MAX_REPLY_HEADERS 8

struct md_http {
    struct MHD_Daemon *daemon;
    const md_cfg *cfg;
    const md_route *routes;
    size_t n_routes;
    void *app;
    int listen_fd;
    int port;
    FILE *access_log;       /* NULL when off */
    int access_log_owned;
    /* the access log's writer thread and its queue (see "access log") */
    struct log_queue {
        pthread_mutex_t mu;
        pthread_cond_t cv;
        char *buf; /* lines waiting, ACCESS_LOG_QUEUE_BYTES at most */
        size_t len, cap;
        int stop, started;
        pthread_t thread;
        atomic_llong dropped;
    } alog;
    atomic_long in_flight;
    atomic_int quiesced;
    atomic_int gate_closed;   /* md_http_close_gate: new requests answered 503 at once */
    atomic_ulong next_id;
    unsigned long id_seed;
    /* GET /metrics: one latency histogram per (route, status class); the
     * route index n_routes is "no route" (404/405). Its counts are the
     * request counters. Updated lock-free when a request completes. */
    md_hist *route_hist;
    /* bearer tokens, as SHA-256 digests (compared in constant time) */
    struct token_set {
        unsigned char (*digest)[SHA256_DIGEST_LENGTH];
        int count;
    } admin, predict, metrics;
};

#define N_CLASSES 5 /* 1xx .. 5xx */

static md_hist *route_hist(md_http *h, size_t route, int status)
{
    int c = status / 100 - 1;
    if (c < 0 || c >= N_CLASSES)
        c = N_CLASSES - 1;
    return &h->route_hist[route * N_CLASSES + (size_t)c];
}

typedef enum { REPLY_NONE, REPLY_BUFFER, REPLY_FD, REPLY_STREAM } reply_kind;

struct md_req {
    md_http *http;
    struct MHD_Connection *conn;
    char method[16];
    char *path;               /* owned copy of the URL path */
    char id[72];
    char traceparent[MD_TRACEPARENT_LEN + 1]; /* the client's when valid, else made here */
    struct timespec start;
    md_route_match match;
    md_body body;
    size_t bytes_in;
    int v2;                   /* Open Inference Protocol error shape */
    int handled;              /* the handler has run */
    int suspended;
    int rejected;             /* an error reply is set; discard the rest of the body */
    int queued;               /* the reply was handed to libmicrohttpd */
    size_t discarded;
    md_err early_err;         /* error found while reading the body */
    void *state;
    void (*state_free)(void *);
    struct MHD_PostProcessor *form;
    md_form_fn form_fn;
    md_err *form_err;
    void (*deferred)(md_req *);
    struct defer_group *defer_group; /* md_req_defer's bound it counts in */
    int in_deferred;          /* its deferred function is running (the connection is suspended) */
    struct md_req *offload_next; /* the decode pool's queue (md_req_offload) */
    /* the reply */
    reply_kind reply;
    int status;
    char content_type[64];
    char *data;
    size_t len;
    int fd;
    void (*stream_done)(void *); /* REPLY_STREAM: run once the reply is over */
    void *stream_ctx;
    int n_headers;
    char *header_names[MAX_REPLY_HEADERS];
    char *header_values[MAX_REPLY_HEADERS];
    size_t bytes_out;
};

/* ---- request ids ---- */

static int id_char_ok(char c) { return c > 0x20 && c < 0x7f && c != '"' && c != '\\'; }

static void set_request_id(md_http *h, md_req *r, const char *client)
{
    if (client) {
        size_t n = strlen(client);
        int ok = n > 0 && n < sizeof r->id;
        for (size_t i = 0; ok && i < n; i++)
            ok = id_char_ok(client[i]);
        if (ok) {
            memcpy(r->id, client, n + 1);
            return;
        }
    }
    unsigned long seq = atomic_fetch_add(&h->next_id, 1);
    snprintf(r->id, sizeof r->id, "%08lx%08lx", h->id_seed & 0xffffffffUL, seq & 0xffffffffUL);
}

/* Largest body buffer allocated from a Content-Length before its bytes come:
 * a 64-row JSON body of full-precision floats is ~0.6 MB; larger bodies grow
 * as their bytes arrive, so a client that only sends headers holds at most
 * this much a connection. */
#define BODY_PRESIZE_MAX ((size_t)1 << 20)

/* ---- trace context ---- */

/* Random ids for traces: a xoshiro256** generator per thread, seeded from
 * getrandom once, so a request costs no system call (getrandom per request
 * was ~1% of a one-row prediction's CPU). Trace ids need to be unique and
 * unpredictable enough for sampling, not secret. */
static _Thread_local uint64_t rng_s[4];
static _Thread_local int rng_seeded;

static uint64_t rotl64(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t rng_next(md_http *h)
{
    if (!rng_seeded) {
        if (getrandom(rng_s, sizeof rng_s, GRND_NONBLOCK) != (ssize_t)sizeof rng_s) {
            /* no entropy yet (early boot): unique, if guessable, ids still
             * let a request be followed */
            uint64_t x = (uint64_t)h->id_seed ^ ((uint64_t)atomic_fetch_add(&h->next_id, 1) << 32);
            for (int i = 0; i < 4; i++) { /* splitmix64 */
                uint64_t z = (x += 0x9e3779b97f4a7c15ull);
                z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
                z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
                rng_s[i] = z ^ (z >> 31);
            }
        }
        if (!(rng_s[0] | rng_s[1] | rng_s[2] | rng_s[3]))
            rng_s[0] = 1; /* the one state xoshiro cannot leave */
        rng_seeded = 1;
    }
    uint64_t *s = rng_s;
    uint64_t r = rotl64(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl64(s[3], 45);
    return r;
}

/* Take the client's traceparent when it is valid (so one trace id follows a
 * request through nginx and into this log); otherwise start a trace with a
 * random trace id and span id. An invalid header is replaced, as the W3C
 * spec asks, rather than rejected: tracing never fails a request. */
static void set_traceparent(md_http *h, md_req *r, const char *client)
{
    if (md_traceparent_valid(client)) {
        memcpy(r->traceparent, client, MD_TRACEPARENT_LEN + 1);
        return;
    }
    uint64_t ids[3] = {rng_next(h), rng_next(h), rng_next(h)};
    /* md_traceparent_format keeps the ids non-zero */
    md_traceparent_format(r->traceparent, (const unsigned char *)ids,
                          (const unsigned char *)(ids + 2), 0);
}

/* ---- access log ----
 * A line is queued, and a thread of its own writes it: a write() to the
 * log may block for long (the kernel throttles a process that dirtied many
 * pages, as when a deploy writes a 200 MB blob, up to 200 ms a call), and
 * each HTTP thread serves many connections, /healthz among them. Past
 * ACCESS_LOG_QUEUE_BYTES waiting, lines are dropped and counted
 * (modeld_access_log_dropped_total) rather than hold a request. */
#define ACCESS_LOG_QUEUE_BYTES (4u << 20)

static void *access_log_main(void *arg)
{
    md_http *h = arg;
    struct log_queue *q = &h->alog;
    pthread_mutex_lock(&q->mu);
    for (;;) {
        while (!q->stop && q->len == 0)
            pthread_cond_wait(&q->cv, &q->mu);
        if (q->len == 0)
            break; /* stopping, and all written */
        char *out = q->buf;
        size_t n = q->len;
        q->buf = NULL;
        q->len = q->cap = 0;
        pthread_mutex_unlock(&q->mu);
        fwrite(out, 1, n, h->access_log);
        fflush(h->access_log);
        free(out);
        pthread_mutex_lock(&q->mu);
    }
    pthread_mutex_unlock(&q->mu);
    return NULL;
}

/* Queue `n` bytes (whole lines) for the writer; dropped when it is behind. */
static void access_log_queue(md_http *h, const char *text, size_t n)
{
    struct log_queue *q = &h->alog;
    pthread_mutex_lock(&q->mu);
    if (q->len + n > ACCESS_LOG_QUEUE_BYTES) {
        atomic_fetch_add(&q->dropped, 1);
    } else {
        if (q->len + n > q->cap) {
            size_t cap = q->cap ? q->cap : 16384;
            while (cap < q->len + n)
                cap *= 2;
            char *nb = realloc(q->buf, cap);
            if (!nb) {
                atomic_fetch_add(&q->dropped, 1);
                pthread_mutex_unlock(&q->mu);
                return;
            }
            q->buf = nb;
            q->cap = cap;
        }
        memcpy(q->buf + q->len, text, n);
        q->len += n;
        pthread_cond_signal(&q->cv);
    }
    pthread_mutex_unlock(&q->mu);
}

/* Start the writer (the log is open); 0 when it cannot start. */
static int access_log_start(md_http *h)
{
    struct log_queue *q = &h->alog;
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->cv, NULL);
    q->started = pthread_create(&q->thread, NULL, access_log_main, h) == 0;
    return q->started;
}

/* Write what is queued, stop the writer, close an owned log. */
static void access_log_stop(md_http *h)
{
    struct log_queue *q = &h->alog;
    if (q->started) {
        pthread_mutex_lock(&q->mu);
        q->stop = 1;
        pthread_cond_signal(&q->cv);
        pthread_mutex_unlock(&q->mu);
        pthread_join(q->thread, NULL);
        q->started = 0;
        free(q->buf);
        pthread_mutex_destroy(&q->mu);
        pthread_cond_destroy(&q->cv);
    }
    if (h->access_log_owned)
        fclose(h->access_log);
}

static void access_log_line(md_req *r)
{
    FILE *f = r->http->access_log;
    if (!f)
        return;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    double ms = (double)(now.tv_sec - r->start.tv_sec) * 1e3 +
                (double)(now.tv_nsec - r->start.tv_nsec) / 1e6;
    struct timespec wall;
    clock_gettime(CLOCK_REALTIME, &wall);
    struct tm tm;
    gmtime_r(&wall.tv_sec, &tm);
    char ts[40];
    size_t n = strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(ts + n, sizeof ts - n, ".%03ldZ", wall.tv_nsec / 1000000L);
    /* the method and path are the client's bytes: jansson refuses a string
     * that is not UTF-8 (json_pack would fail and the line be lost), so they
     * are escaped (\xNN) as error messages are; 4 bytes out per byte in at
     * most. The path is bounded by libmicrohttpd's connection memory. */
    char method[4 * sizeof r->method];
    md_text_escape(method, sizeof method, r->method);
    size_t path_size = 4 * strlen(r->path) + 1;
    char *path = md_xmalloc(path_size);
    md_text_escape(path, path_size, r->path);
    json_t *line = json_pack("{s:s,s:s,s:s,s:i,s:I,s:I,s:f,s:s,s:s}", "time", ts, "method",
                             method, "path", path, "status", r->status, "bytes_in",
                             (json_int_t)r->bytes_in, "bytes_out", (json_int_t)r->bytes_out,
                             "duration_ms", ms, "request_id", r->id, "traceparent",
                             r->traceparent);
    free(path);
    if (!line)
        return;
    char *text = json_dumps(line, JSON_COMPACT | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(6));
    json_decref(line);
    if (text) {
        /* whole lines, so concurrent requests never interleave */
        size_t len = strlen(text);
        text[len] = '\n';
        access_log_queue(r->http, text, len + 1);
        free(text);
    }
}

/* ---- replies ---- */

static void reply_reset_headers(md_req *r)
{
    for (int i = 0; i < r->n_headers; i++) {
        free(r->header_names[i]);
        free(r->header_values[i]);
    }
    r->n_headers = 0;
}

void md_reply_header(md_req *r, const char *name, const char *value)
{
    md_assert(r->n_headers < MAX_REPLY_HEADERS);
    r->header_names[r->n_headers] = md_xstrdup(name);
    r->header_values[r->n_headers] = md_xstrdup(value);
    r->n_headers++;
}

void md_reply_bytes(md_req *r, int http_status, const char *content_type, char *data, size_t len)
{
    md_assert(r->reply == REPLY_NONE);
    r->reply = REPLY_BUFFER;
    r->status = http_status;
    snprintf(r->content_type, sizeof r->content_type, "%s", content_type);
    r->data = data;
    r->len = len;
}

void md_reply_fd(md_req *r, int http_status, const char *content_type, int fd, size_t size)
{
    md_assert(r->reply == REPLY_NONE);
    r->reply = REPLY_FD;
    r->status = http_status;
    snprintf(r->content_type, sizeof r->content_type, "%s", content_type);
    r->fd = fd;
    r->len = size;
}

void md_reply_stream(md_req *r, int http_status, const char *content_type, int fd, size_t size,
                     void (*done)(void *ctx), void *ctx)
{
    md_assert(r->reply == REPLY_NONE);
    r->reply = REPLY_STREAM;
    r->status = http_status;
    snprintf(r->content_type, sizeof r->content_type, "%s", content_type);
    r->fd = fd;
    r->len = size;
    r->stream_done = done;
    r->stream_ctx = ctx;
}

/* ---- a streamed body ----
 * DESIGN
 * The body comes from a pipe another thread fills (an S3 object read in
 * pieces), so a read may have to wait for the network. libmicrohttpd's
 * threads serve many connections each and must never block, so the pipe is
 * non-blocking: stream_read hands over what is there; when it is empty the
 * connection is suspended (allowed from a content reader callback) and
 * returns 0, and the body's watcher thread poll()s the pipe and resumes the
 * connection once bytes or the end arrive. The watcher waits for the next
 * suspension on a condition variable, so it never resumes a connection
 * that is not suspended. EOF before `size` bytes ends the reply with an
 * error: the client sees a cut body (the Content-Length says so), never a
 * short one taken for whole. The request stays in flight until its body is
 * sent or cut, so the drain (main.c) never stops libmicrohttpd while one is
 * suspended; the pipe's writer (s3_data.c) ends within its S3 timeouts. */
typedef struct stream_body {
    int fd;
    uint64_t size;
    struct MHD_Connection *conn;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int waiting; /* the connection is suspended until fd is readable */
    int stop;
    pthread_t watcher;
    void (*done)(void *);
    void *ctx;
} stream_body;

static void *stream_watch(void *arg)
{
    stream_body *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->waiting && !s->stop)
            pthread_cond_wait(&s->cv, &s->mu);
        if (s->stop)
            break;
        pthread_mutex_unlock(&s->mu);
        struct pollfd p = {.fd = s->fd, .events = POLLIN};
        int n = poll(&p, 1, 1000); /* readable, at its end (POLLHUP), or look again */
        pthread_mutex_lock(&s->mu);
        if (n != 0 && s->waiting && !s->stop) {
            s->waiting = 0;
            MHD_resume_connection(s->conn);
        }
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    stream_body *s = cls;
    ssize_t n = read(s->fd, buf, max);
    if (n > 0)
        return n;
    if (n == 0) /* the end: whole only at its size */
        return pos >= s->size ? MHD_CONTENT_READER_END_OF_STREAM
                              : MHD_CONTENT_READER_END_WITH_ERROR;
    if (errno != EAGAIN && errno != EINTR)
        return MHD_CONTENT_READER_END_WITH_ERROR;
    pthread_mutex_lock(&s->mu);
    if (!s->waiting) {
        s->waiting = 1;
        MHD_suspend_connection(s->conn);
        pthread_cond_signal(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
    return 0;
}

/* The response is done with (sent, cut, or the client left): the
 * connection is not suspended then, so the watcher is idle. */
static void stream_free(void *cls)
{
    stream_body *s = cls;
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->watcher, NULL);
    close(s->fd);
    if (s->done)
        s->done(s->ctx);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
}

static struct MHD_Response *stream_response(md_req *r)
{
    stream_body *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    int fl = fcntl(r->fd, F_GETFL);
    if (fl < 0 || fcntl(r->fd, F_SETFL, fl | O_NONBLOCK) != 0) {
        free(s);
        return NULL;
    }
    s->fd = r->fd;
    s->size = (uint64_t)r->len;
    s->conn = r->conn;
    s->done = r->stream_done;
    s->ctx = r->stream_ctx;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    if (pthread_create(&s->watcher, NULL, stream_watch, s) != 0) {
        pthread_mutex_destroy(&s->mu);
        pthread_cond_destroy(&s->cv);
        free(s);
        return NULL;
    }
    struct MHD_Response *resp =
        MHD_create_response_from_callback(s->size, 64 * 1024, stream_read, s, stream_free);
    if (!resp) {
        s->done = NULL; /* still the request's to clean up */
        s->fd = -1;
        pthread_mutex_lock(&s->mu);
        s->stop = 1;
        pthread_cond_signal(&s->cv);
        pthread_mutex_unlock(&s->mu);
        pthread_join(s->watcher, NULL);
        pthread_mutex_destroy(&s->mu);
        pthread_cond_destroy(&s->cv);
        free(s);
        return NULL;
    }
    /* the response owns the pipe and the stream now */
    r->fd = -1;
    r->stream_done = NULL;
    return resp;
}

void md_reply_json(md_req *r, int http_status, json_t *body)
{
    char *text = body ? json_dumps(body, JSON_COMPACT | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(15)) : NULL;
    json_decref(body);
    if (!text) {
        /* only an allocation failure gets here */
        text = md_xstrdup("{\"error\":{\"code\":\"internal_error\",\"message\":\"could not encode "
                          "the response\"}}");
        http_status = 500;
    }
    size_t len = strlen(text);
    /* a trailing newline keeps curl output readable */
    char *nl = realloc(text, len + 2);
    if (nl) {
        text = nl;
        text[len++] = '\n';
        text[len] = '\0';
    }
    md_reply_bytes(r, http_status, "application/json", text, len);
}

void md_reply_error(md_req *r, const md_err *err)
{
    /* both may pass: a full queue, an index that is unreachable or
     * restarting (index_unavailable), a server starting or draining */
    if ((err->status == MD_EBUSY || err->status == MD_EUNAVAIL) &&
        r->n_headers < MAX_REPLY_HEADERS)
        md_reply_header(r, "Retry-After", "1");
    md_reply_json(r, md_status_http(err->status), md_error_body(err, r->v2));
}

/* Build and queue the stored reply. */
static enum MHD_Result queue_reply(md_req *r)
{
    struct MHD_Response *resp;
    if (r->reply == REPLY_FD) {
        resp = MHD_create_response_from_fd((uint64_t)r->len, r->fd);
        r->fd = -1; /* the response owns it now */
    } else if (r->reply == REPLY_STREAM) {
        resp = stream_response(r);
    } else {
        resp = MHD_create_response_from_buffer(r->len, r->data, MHD_RESPMEM_MUST_FREE);
        if (resp)
            r->data = NULL;
    }
    if (!resp)
        return MHD_NO;
    r->bytes_out = r->len;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, r->content_type);
    MHD_add_response_header(resp, "X-Request-Id", r->id);
    MHD_add_response_header(resp, "traceparent", r->traceparent);
    for (int i = 0; i < r->n_headers; i++)
        MHD_add_response_header(resp, r->header_names[i], r->header_values[i]);
    if (atomic_load(&r->http->quiesced))
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CONNECTION, "close");
    r->queued = 1;
    enum MHD_Result ret = MHD_queue_response(r->conn, (unsigned)r->status, resp);
    MHD_destroy_response(resp);
    return ret;
}

/* ---- request accessors ---- */

void *md_req_app(md_req *r) { return r->http->app; }
const char *md_req_method(md_req *r) { return r->method; }
const char *md_req_path(md_req *r) { return r->path; }
const char *md_req_id(md_req *r) { return r->id; }

double md_req_elapsed_s(md_req *r)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)(now.tv_sec - r->start.tv_sec) +
           (double)(now.tv_nsec - r->start.tv_nsec) / 1e9;
}

const char *md_req_param(md_req *r, const char *name)
{
    size_t n = strlen(name);
    for (int i = 0; i < r->match.n_params; i++)
        if (r->match.params[i].name_len == n && memcmp(r->match.params[i].name, name, n) == 0)
            return r->match.params[i].value;
    return NULL;
}

const char *md_req_query(md_req *r, const char *key)
{
    return MHD_lookup_connection_value(r->conn, MHD_GET_ARGUMENT_KIND, key);
}

const char *md_req_header(md_req *r, const char *name)
{
    return MHD_lookup_connection_value(r->conn, MHD_HEADER_KIND, name);
}

md_status md_req_query_int(md_req *r, const char *key, long min, long max, long def,
                           const char *code, long *out, md_err *err)
{
    const char *v = md_req_query(r, key);
    *out = def;
    if (!v)
        return MD_OK;
    char *end;
    errno = 0;
    long n = strtol(v, &end, 10);
    if (end == v || *end || errno || n < min || n > max)
        return md_err_setc(err, MD_EINVAL, code, "%s=%.20s: give an integer in %ld..%ld", key, v,
                           min, max);
    *out = n;
    return MD_OK;
}

int md_req_version_param(md_req *r, int *version)
{
    const char *v = md_req_param(r, "version");
    char *end;
    errno = 0;
    long n = v ? strtol(v, &end, 10) : 0;
    if (!v || end == v || *end || errno || n < 1 || n > 1000000000) {
        md_err err;
        md_err_setc(&err, MD_EINVAL, "invalid_version", "version \"%.40s\" is not a positive integer",
                    v ? v : "");
        md_reply_error(r, &err);
        return 0;
    }
    *version = (int)n;
    return 1;
}

const char *md_req_body(md_req *r, size_t *len)
{
    if (len)
        *len = r->body.len;
    return r->body.len ? r->body.data : NULL;
}

void md_req_set_state(md_req *r, void *state, void (*free_fn)(void *))
{
    r->state = state;
    r->state_free = free_fn;
}

void *md_req_state(md_req *r) { return r->state; }

/* Set when a deferred function hands its request on (md_req_suspend from a
 * deferred thread): the request may be answered and freed by the next owner
 * at once, so defer_main must not read it afterwards. */
static _Thread_local int handed_off;

void md_req_suspend(md_req *r)
{
    if (r->in_deferred) {
        handed_off = 1; /* still suspended; the new owner replies and resumes */
        return;
    }
    r->suspended = 1;
    MHD_suspend_connection(r->conn);
}

void md_req_resume(md_req *r) { MHD_resume_connection(r->conn); }

int md_req_client_gone(md_req *r)
{
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(r->conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci)
        return 0;
    char c;
    ssize_t n = recv(ci->connect_fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    /* 0: orderly close; an error other than "no data yet": reset */
    return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

static enum MHD_Result on_form_field(void *cls, enum MHD_ValueKind kind, const char *key,
                                     const char *filename, const char *content_type,
                                     const char *transfer_encoding, const char *data,
                                     uint64_t off, size_t size)
{
    (void)kind, (void)content_type, (void)transfer_encoding, (void)off;
    md_req *r = cls;
    if (r->form_err->status != MD_OK)
        return MHD_NO;
    return r->form_fn(r, key, filename, data, size, r->form_err) == MD_OK ? MHD_YES : MHD_NO;
}

md_status md_req_form_feed(md_req *r, md_form_fn field_fn, const char *data, size_t len,
                           md_err *err)
{
    if (!r->form) {
        const char *ct = md_req_header(r, MHD_HTTP_HEADER_CONTENT_TYPE);
        if (!ct || strncasecmp(ct, "multipart/form-data", 19) != 0)
            return md_err_set(err, MD_EMEDIA, "expected a multipart/form-data body");
        r->form = MHD_create_post_processor(r->conn, 64 * 1024, on_form_field, r);
        if (!r->form)
            return md_err_set(err, MD_EINVAL,
                              "the multipart/form-data body has no boundary; let curl -F build it");
    }
    r->form_fn = field_fn;
    r->form_err = err;
    md_err_clear(err);
    if (MHD_post_process(r->form, data, len) != MHD_YES && err->status == MD_OK)
        md_err_set(err, MD_EINVAL, "the multipart/form-data body is malformed");
    r->form_err = NULL;
    return err->status;
}

/* Deferred threads running now, in two groups with a bound each (503 with
 * Retry-After past it), so a burst cannot start a thread a request: admin
 * work (the routes that need an admin token: deploys, PATCH, DELETE) and the
 * rest (large-image predictions, loads on demand, exports). With one shared
 * bound, 70 clients sending large images made every deploy answer 503
 * (issue 24): the operator could not act while the traffic lasted.
 * Test-only: MD_TEST_MAX_DEFERRED=N and MD_TEST_MAX_ADMIN_DEFERRED=N lower
 * the bounds, so a test can fill one. */
#define MAX_DEFERRED 64
#define MAX_ADMIN_DEFERRED 16

typedef struct defer_group {
    const char *test_env; /* the test-only variable that lowers `max` */
    int max;
    const char *what;     /* for the 503: what fills the group */
    atomic_int limit;     /* 0: not read yet */
    atomic_int running;
} defer_group;

static defer_group work_group = {.test_env = "MD_TEST_MAX_DEFERRED", .max = MAX_DEFERRED,
                                 .what = "predictions and reads needing a thread of their "
                                         "own (large images, loads on demand, exports)"};
static defer_group admin_group = {.test_env = "MD_TEST_MAX_ADMIN_DEFERRED",
                                  .max = MAX_ADMIN_DEFERRED,
                                  .what = "deploys and model changes"};

static int group_limit(defer_group *g)
{
    int n = atomic_load(&g->limit);
    if (n == 0) {
        const char *t = getenv(g->test_env);
        long v = t ? strtol(t, NULL, 10) : 0;
        n = v >= 1 && v <= g->max ? (int)v : g->max;
        atomic_store(&g->limit, n);
    }
    return n;
}

/* Run r->deferred on this thread, the connection suspended; then reply if
 * it did not and resume, unless it handed the request on. `group` (NULL on
 * the decode pool) is given its thread back before r may be freed by
 * another thread. */
static void run_deferred(md_req *r, defer_group *group)
{
    handed_off = 0;
    r->in_deferred = 1;
    r->deferred(r);
    if (handed_off) {
        if (group)
            atomic_fetch_sub(&group->running, 1);
        return; /* r belongs to whoever took it (it may be freed already) */
    }
    r->in_deferred = 0;
    if (group)
        atomic_fetch_sub(&group->running, 1);
    if (r->reply == REPLY_NONE) {
        md_err err;
        md_err_set(&err, MD_EINTERNAL, "the handler for %s %s produced no response", r->method,
                   r->path);
        md_reply_error(r, &err);
    }
    md_req_resume(r);
}

static void *defer_main(void *arg)
{
    md_req *r = arg;
    pthread_setname_np(pthread_self(), "md-deferred");
    run_deferred(r, r->defer_group);
    return NULL;
}

/* ---- the decode pool (md_req_offload) ----
 * As many threads as HTTP threads (pool_size, set at start), started on the
 * first use, taking requests in arrival order from one queue of at most
 * POOL_QUEUE_PER_THREAD a thread: past that the handler decodes inline, as
 * before the pool, so a flood of large bodies meets libmicrohttpd's own
 * back-pressure (its threads stop reading) instead of a queue without end.
 * A thread that cannot start is not tried again (a pids limit would fail
 * every try, under the lock). */
#define POOL_QUEUE_PER_THREAD 4
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_cv = PTHREAD_COND_INITIALIZER;
static md_req *pool_head, *pool_tail;
static int pool_threads, pool_queued, pool_start_failed; /* under pool_mu */
static atomic_int pool_size;
static atomic_llong pool_taken;

static void *pool_main(void *arg)
{
    (void)arg;
    pthread_setname_np(pthread_self(), "md:decode");
    for (;;) {
        pthread_mutex_lock(&pool_mu);
        while (!pool_head)
            pthread_cond_wait(&pool_cv, &pool_mu);
        md_req *r = pool_head;
        pool_head = r->offload_next;
        if (!pool_head)
            pool_tail = NULL;
        pool_queued--;
        pthread_mutex_unlock(&pool_mu);
        run_deferred(r, NULL);
    }
    return NULL;
}

int md_req_offload(md_req *r, void (*fn)(md_req *req))
{
    pthread_mutex_lock(&pool_mu);
    int want = atomic_load(&pool_size);
    while (pool_threads < want && !pool_start_failed) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&t, &attr, pool_main, NULL) != 0)
            pool_start_failed = 1;
        else
            pool_threads++;
        pthread_attr_destroy(&attr);
    }
    if (pool_threads == 0 || pool_queued >= POOL_QUEUE_PER_THREAD * pool_threads) {
        pthread_mutex_unlock(&pool_mu);
        return 0; /* the caller does the work itself */
    }
    r->deferred = fn;
    r->offload_next = NULL;
    md_req_suspend(r);
    if (pool_tail)
        pool_tail->offload_next = r;
    else
        pool_head = r;
    pool_tail = r;
    pool_queued++;
    atomic_fetch_add(&pool_taken, 1);
    pthread_cond_signal(&pool_cv);
    pthread_mutex_unlock(&pool_mu);
    return 1;
}

void md_req_defer(md_req *r, void (*fn)(md_req *req))
{
    defer_group *g = r->match.route && r->match.route->auth == MD_AUTH_ADMIN ? &admin_group
                                                                             : &work_group;
    int limit = group_limit(g);
    if (atomic_fetch_add(&g->running, 1) >= limit) {
        atomic_fetch_sub(&g->running, 1);
        md_err err;
        md_err_setc(&err, MD_EBUSY, "too_busy",
                    "%d %s are in progress, the most at once; retry %s %s shortly", limit,
                    g->what, r->method, r->path);
        md_reply_error(r, &err); /* MD_EBUSY: 503 with Retry-After */
        return;
    }
    r->defer_group = g;
    r->deferred = fn;
    md_req_suspend(r);
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &attr, defer_main, r) != 0) {
        md_err err;
        atomic_fetch_sub(&g->running, 1);
        md_err_set(&err, MD_EBUSY, "cannot start a thread for %s %s; retry later", r->method,
                   r->path);
        md_reply_error(r, &err);
        md_req_resume(r);
    }
    pthread_attr_destroy(&attr);
}

/* ---- libmicrohttpd callbacks ---- */

static void req_free(md_req *r)
{
    if (r->form)
        MHD_destroy_post_processor(r->form);
    if (r->state_free)
        r->state_free(r->state);
    md_body_free(&r->body);
    reply_reset_headers(r);
    free(r->data);
    if (r->fd >= 0)
        close(r->fd);
    if (r->stream_done) /* a stream reply never handed to libmicrohttpd */
        r->stream_done(r->stream_ctx);
    free(r->path);
    free(r);
}

static enum MHD_Result reply_now_error(md_req *r, const md_err *err)
{
    md_reply_error(r, err);
    r->rejected = 1;
    return queue_reply(r);
}

static md_req *req_new(md_http *h, struct MHD_Connection *conn, const char *url, const char *method)
{
    md_req *r = md_xcalloc(1, sizeof *r);
    r->http = h;
    r->conn = conn;
    r->fd = -1;
    snprintf(r->method, sizeof r->method, "%s", method);
    r->path = md_xstrdup(url);
    clock_gettime(CLOCK_MONOTONIC, &r->start);
    set_request_id(h, r, MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "X-Request-Id"));
    set_traceparent(h, r, MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "traceparent"));
    r->body.limit = (size_t)h->cfg->max_body_bytes;
    /* KServe V1 errors have the same shape */
    r->v2 = strncmp(url, "/v2/", 4) == 0 || strcmp(url, "/v2") == 0 ||
            strncmp(url, "/v1/", 4) == 0;
    atomic_fetch_add(&h->in_flight, 1);
    return r;
}

/* Every query parameter must be one the route takes (md_route_check_query). */
typedef struct query_check {
    const md_route *route;
    md_err *err;
    md_status st;
} query_check;

static enum MHD_Result check_query_arg(void *cls, enum MHD_ValueKind kind, const char *key,
                                       const char *value)
{
    (void)kind;
    (void)value;
    query_check *qc = cls;
    qc->st = md_route_check_query(qc->route, key ? key : "", qc->err);
    return qc->st == MD_OK ? MHD_YES : MHD_NO;
}

/* ---- bearer tokens ---- */

static void token_set_init(struct token_set *t, const md_strlist *l)
{
    t->count = l->count;
    t->digest = t->count ? md_xcalloc((size_t)t->count, sizeof *t->digest) : NULL;
    for (int i = 0; i < t->count; i++)
        SHA256((const unsigned char *)l->items[i], strlen(l->items[i]), t->digest[i]);
}

/* 1 when `d` is one of the set's tokens. Every token is compared, each in
 * constant time, and digests have one length: the time says nothing of how
 * much of a guess was right. */
static int token_in(const struct token_set *t, const unsigned char *d)
{
    int found = 0;
    for (int i = 0; i < t->count; i++)
        found |= CRYPTO_memcmp(t->digest[i], d, SHA256_DIGEST_LENGTH) == 0;
    return found;
}

/* The route's guard: MD_OK, or an error (401 without a token, 403 with one
 * that does not open the route) with its WWW-Authenticate header set. The
 * token itself never reaches a message or the log. */
static md_status check_auth(md_http *h, md_req *r, struct MHD_Connection *conn, md_err *err)
{
    md_auth need = r->match.route->auth;
    const struct token_set *sets[2] = {NULL, NULL};
    const char *which;
    switch (need) {
    case MD_AUTH_OPEN:
        return MD_OK;
    case MD_AUTH_ADMIN:
        sets[0] = &h->admin;
        which = "an admin token (admin_token)";
        break;
    case MD_AUTH_METRICS:
        sets[0] = &h->metrics;
        sets[1] = &h->admin;
        which = "a metrics or admin token";
        break;
    default: /* MD_AUTH_PREDICT, MD_AUTH_READ */
        sets[0] = &h->predict;
        sets[1] = &h->admin;
        which = "a predict or admin token";
        break;
    }
    if (sets[0]->count == 0)
        return MD_OK; /* that kind of token is not configured: open */
    const char *a = MHD_lookup_connection_value(conn, MHD_HEADER_KIND,
                                                MHD_HTTP_HEADER_AUTHORIZATION);
    if (!a || strncasecmp(a, "Bearer ", 7) != 0 || !a[7]) {
        md_reply_header(r, "WWW-Authenticate", "Bearer realm=\"modeld\"");
        return md_err_setc(err, MD_EAUTH, "unauthorized",
                           "%s %s needs %s: send the header Authorization: Bearer TOKEN",
                           r->method, r->match.route->pattern, which);
    }
    const char *tok = a + 7;
    while (*tok == ' ')
        tok++;
    unsigned char d[SHA256_DIGEST_LENGTH];
    SHA256((const unsigned char *)tok, strlen(tok), d);
    if (token_in(sets[0], d) || (sets[1] && token_in(sets[1], d)))
        return MD_OK;
    md_reply_header(r, "WWW-Authenticate", "Bearer realm=\"modeld\", error=\"invalid_token\"");
    return md_err_setc(err, MD_EFORBIDDEN, "forbidden",
                       "the bearer token does not open %s %s; it needs %s", r->method,
                       r->match.route->pattern, which);
}

static enum MHD_Result on_access(void *cls, struct MHD_Connection *conn, const char *url,
                                 const char *method, const char *version, const char *upload_data,
                                 size_t *upload_data_size, void **req_cls)
{
    (void)version;
    md_http *h = cls;
    md_req *r = *req_cls;
    md_err err;
    md_err_clear(&err);

    if (!r) {
        r = req_new(h, conn, url, method); /* counted in flight before the gate is read */
        *req_cls = r;
        MHD_set_connection_option(conn, MHD_CONNECTION_OPTION_TIMEOUT,
                                  (unsigned)h->cfg->connection_timeout_s);
        if (atomic_load(&h->gate_closed)) {
            md_reply_header(r, "Retry-After", "1");
            md_err_setc(&err, MD_EUNAVAIL, "draining",
                        "the server is shutting down; retry, another replica will answer");
            return reply_now_error(r, &err);
        }
        char allow[128];
        md_status st = md_route_find(h->routes, h->n_routes, method, url, &r->match, allow,
                                     sizeof allow);
        if (st == MD_ENOTFOUND) {
            md_err_setc(&err, MD_ENOTFOUND, "route_not_found",
                        "no route for %s %s; see GET /openapi.yaml for the API", method, url);
            return reply_now_error(r, &err);
        }
        if (st == MD_EMETHOD) {
            md_reply_header(r, MHD_HTTP_HEADER_ALLOW, allow);
            md_err_setc(&err, MD_EMETHOD, "method_not_allowed",
                        "%s is not allowed on %s; allowed: %s", method, url, allow);
            return reply_now_error(r, &err);
        }
        /* the guard first: without a token, nothing about the request is checked */
        if (check_auth(h, r, conn, &err) != MD_OK)
            return reply_now_error(r, &err);
        query_check qc = {r->match.route, &err, MD_OK};
        MHD_get_connection_values(conn, MHD_GET_ARGUMENT_KIND, check_query_arg, &qc);
        if (qc.st != MD_OK)
            return reply_now_error(r, &err);
        const char *cl = MHD_lookup_connection_value(conn, MHD_HEADER_KIND,
                                                     MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (cl && !r->match.route->on_body) {
            char *end;
            errno = 0;
            unsigned long long n = strtoull(cl, &end, 10);
            if (errno == 0 && end != cl && n > (unsigned long long)h->cfg->max_body_bytes) {
                md_err_setc(&err, MD_ETOOBIG, "body_too_large",
                            "request body of %llu bytes is larger than the limit of %lld bytes; "
                            "send less or raise max_body_bytes",
                            n, h->cfg->max_body_bytes);
                return reply_now_error(r, &err);
            }
            /* the declared size in one allocation (doubling from 4 KiB copied a
             * 200 KB body 1.3 times more); bounded, as the bytes may never come.
             * Failing here is no error: md_body_append grows it as before. */
            if (errno == 0 && end != cl && n > 0 && !r->body.data) {
                size_t want = n + 1 <= BODY_PRESIZE_MAX ? (size_t)n + 1 : BODY_PRESIZE_MAX;
                if ((r->body.data = malloc(want)) != NULL)
                    r->body.cap = want;
            }
        }
        /* streaming routes check their headers now, before any byte is read */
        if (r->match.route->on_body && r->match.route->on_body(r, NULL, 0, &err) != MD_OK)
            return reply_now_error(r, &err);
        return MHD_YES;
    }

    if (*upload_data_size) {
        size_t n = *upload_data_size;
        *upload_data_size = 0;
        r->bytes_in += n;
        if (r->rejected) {
            /* libmicrohttpd can only answer once the body is in: discard it,
             * but drop a client that sends more than another full limit */
            r->discarded += n;
            return r->discarded > (size_t)h->cfg->max_body_bytes ? MHD_NO : MHD_YES;
        }
        md_status st = r->match.route->on_body
                           ? r->match.route->on_body(r, upload_data, n, &err)
                           : md_body_append(&r->body, upload_data, n, &err);
        if (st != MD_OK) {
            /* answered when the body ends (libmicrohttpd cannot reply mid-upload) */
            md_reply_error(r, &err);
            r->rejected = 1;
        }
        return MHD_YES;
    }

    if (r->rejected)
        return r->reply != REPLY_NONE && !r->queued ? queue_reply(r) : MHD_YES;
    if (!r->handled) {
        r->handled = 1;
        r->match.route->handler(r);
        if (r->suspended)
            return MHD_YES; /* another thread replies and resumes; do not touch the reply */
    }
    if (r->reply == REPLY_NONE) {
        /* resumed without a reply: a handler bug, answered rather than hung */
        md_err_set(&err, MD_EINTERNAL, "the handler for %s %s produced no response", r->method,
                   r->path);
        md_reply_error(r, &err);
    }
    r->suspended = 0;
    return queue_reply(r);
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **req_cls,
                         enum MHD_RequestTerminationCode toe)
{
    md_http *h = cls;
    md_req *r = *req_cls;
    if (!r)
        return;
    *req_cls = NULL;
    if (toe != MHD_REQUEST_TERMINATED_COMPLETED_OK) {
        if (r->status == 0)
            r->status = 499; /* the client went away before a reply (nginx's convention) */
        r->bytes_out = 0;    /* the reply, if any, was not delivered */
    }
    access_log_line(r);
    {
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        double s = (double)(now.tv_sec - r->start.tv_sec) +
                   (double)(now.tv_nsec - r->start.tv_nsec) / 1e9;
        size_t route = r->match.route ? (size_t)(r->match.route - h->routes) : h->n_routes;
        md_hist_observe(route_hist(h, route, r->status ? r->status : 500), s);
    }
    MHD_set_connection_option(conn, MHD_CONNECTION_OPTION_TIMEOUT,
                              (unsigned)h->cfg->keepalive_timeout_s);
    req_free(r);
    atomic_fetch_sub(&h->in_flight, 1);
}

static void on_mhd_log(void *cls, const char *fmt, va_list ap)
{
    (void)cls;
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t n = strlen(msg);
    while (n && (msg[n - 1] == '\n' || msg[n - 1] == '\r'))
        msg[--n] = '\0';
    md_log(MD_LOG_DEBUG, "libmicrohttpd: %s", msg);
}

/* ---- lifecycle ---- */

static int bind_listener(const md_cfg *cfg, md_err *err)
{
    char port[16];
    snprintf(port, sizeof port, "%d", cfg->port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    struct addrinfo *res = NULL;
    int rc = getaddrinfo(cfg->host, port, &hints, &res);
    if (rc != 0) {
        md_err_set(err, MD_EIO, "cannot listen on %s:%d: %s; check the host setting", cfg->host,
                   cfg->port, gai_strerror(rc));
        return -1;
    }
    int fd = -1, saved = 0;
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) {
            saved = errno;
            continue;
        }
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, 1024) == 0)
            break;
        saved = errno;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0)
        md_err_set(err, MD_EIO, "cannot listen on %s:%d: %s", cfg->host, cfg->port,
                   strerror(saved));
    return fd;
}

/* Free the server's own memory (the daemon, listener and log are gone). */
static void http_free(md_http *h)
{
    free(h->route_hist);
    free(h->admin.digest);
    free(h->predict.digest);
    free(h->metrics.digest);
    free(h);
}

md_status md_http_start(const md_cfg *cfg, const md_route *routes, size_t n_routes, void *app,
                        md_http **out, md_err *err)
{
    *out = NULL;
    int fd = bind_listener(cfg, err);
    if (fd < 0)
        return MD_EIO;
    md_http *h = md_xcalloc(1, sizeof *h);
    h->cfg = cfg;
    h->routes = routes;
    h->n_routes = n_routes;
    h->app = app;
    h->listen_fd = fd;
    token_set_init(&h->admin, &cfg->admin_token);
    token_set_init(&h->predict, &cfg->predict_token);
    token_set_init(&h->metrics, &cfg->metrics_token);
    h->route_hist = md_xcalloc((n_routes + 1) * N_CLASSES, sizeof *h->route_hist);
    for (size_t i = 0; i < (n_routes + 1) * N_CLASSES; i++)
        md_hist_init(&h->route_hist[i], md_latency_bounds, md_latency_nbounds);
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (getsockname(fd, (struct sockaddr *)&ss, &sl) == 0)
        h->port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                                 : ((struct sockaddr_in *)&ss)->sin_port);
    if (getrandom(&h->id_seed, sizeof h->id_seed, 0) != (ssize_t)sizeof h->id_seed)
        h->id_seed = (unsigned long)time(NULL) ^ (unsigned long)getpid();

    if (strcmp(cfg->access_log, "off") == 0) {
        h->access_log = NULL;
    } else if (strcmp(cfg->access_log, "stderr") == 0) {
        h->access_log = stderr;
    } else {
        h->access_log = fopen(cfg->access_log, "a");
        if (!h->access_log) {
            md_err_set(err, MD_EIO, "access_log %s: cannot open for appending: %s",
                       cfg->access_log, strerror(errno));
            close(fd);
            free(h);
            return MD_EIO;
        }
        h->access_log_owned = 1;
    }
    if (h->access_log && !access_log_start(h)) {
        md_err_set(err, MD_EIO, "cannot start the access log's writer thread");
        access_log_stop(h);
        close(fd);
        http_free(h);
        return MD_EIO;
    }

    unsigned threads = (unsigned)(cfg->threads > 0 ? cfg->threads : md_cfg_cores());
    atomic_store(&pool_size, (int)threads); /* the decode pool: one thread per HTTP thread */
    /* poll(), not epoll: with a thread pool on epoll, MHD_quiesce_daemon
     * (SIGTERM's drain) and a worker's event loop can both take the listener
     * out of the worker's epoll set, and libmicrohttpd (0.9.75 and later)
     * aborts the process in whichever loses (MHD_PANIC on ENOENT,
     * daemon.c:5531 and :4976). Seen once: a server killed by SIGABRT in its
     * drain, in-flight requests lost. With poll() the quiesce is a flag and
     * a wake-up; each worker polls its own connections (a load balancer's
     * pool of them, not thousands). */
    h->daemon = MHD_start_daemon(
        MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL | MHD_ALLOW_SUSPEND_RESUME |
            MHD_USE_ERROR_LOG,
        0, NULL, NULL, on_access, h, MHD_OPTION_LISTEN_SOCKET, fd, MHD_OPTION_THREAD_POOL_SIZE,
        threads, MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)cfg->keepalive_timeout_s,
        MHD_OPTION_NOTIFY_COMPLETED, on_completed, h, MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log,
        NULL, MHD_OPTION_CONNECTION_LIMIT, 10000u, MHD_OPTION_END);
    if (!h->daemon) {
        md_err_set(err, MD_EIO, "cannot start the HTTP server on %s:%d", cfg->host, cfg->port);
        access_log_stop(h);
        close(fd);
        http_free(h);
        return MD_EIO;
    }
    h->listen_fd = -1; /* libmicrohttpd owns the listener now */
    *out = h;
    return MD_OK;
}

void md_http_quiesce(md_http *h)
{
    if (!h || atomic_exchange(&h->quiesced, 1))
        return;
    MHD_socket fd = MHD_quiesce_daemon(h->daemon);
    if (fd == MHD_INVALID_SOCKET)
        return;
    /* New connections are refused from now on (a listener shut down resets
     * them), but the descriptor stays open until libmicrohttpd has stopped:
     * a worker may still hold it in a poll() it entered before the quiesce,
     * and a number closed now could be reused under it (the library's own
     * rule for the socket MHD_quiesce_daemon returns). */
    shutdown(fd, SHUT_RDWR);
    h->listen_fd = fd;
}

long md_http_in_flight(const md_http *h) { return atomic_load(&h->in_flight); }

void md_http_close_gate(md_http *h)
{
    if (h)
        atomic_store(&h->gate_closed, 1);
}

int md_http_port(const md_http *h) { return h->port; }

void md_http_stop(md_http *h)
{
    if (!h)
        return;
    MHD_stop_daemon(h->daemon);
    if (h->listen_fd >= 0)
        close(h->listen_fd);
    access_log_stop(h); /* after the daemon: no request completes any more */
    http_free(h);
}

void md_http_write_metrics(md_http *h, FILE *f)
{
    md_prom_family(f, "modeld_access_log_dropped_total", "counter",
                   "Access log lines dropped because its writer was 4 MiB behind (the disk "
                   "stalled); requests never wait for the log.");
    md_prom_sample(f, "modeld_access_log_dropped_total", "",
                   (double)atomic_load(&h->alog.dropped));
    static const char *const cls[N_CLASSES] = {"1xx", "2xx", "3xx", "4xx", "5xx"};
    char l[400];
    for (int pass = 0; pass < 2; pass++) {
        const char *name = pass ? "modeld_http_request_duration_seconds"
                                : "modeld_http_requests_total";
        if (pass)
            md_prom_family(f, name, "histogram",
                           "Time from a request's headers to its last byte sent, by route "
                           "pattern, method and status class.");
        else
            md_prom_family(f, name, "counter",
                           "HTTP requests completed, by route pattern (route=\"none\": no "
                           "route matched), method and status class.");
        for (size_t r = 0; r <= h->n_routes; r++) {
            for (int c = 0; c < N_CLASSES; c++) {
                const md_hist *hist = &h->route_hist[r * N_CLASSES + (size_t)c];
                long long n = md_hist_count(hist);
                if (n == 0)
                    continue; /* series appear once they have a request */
                l[0] = '\0';
                md_prom_label(l, sizeof l, "route", r < h->n_routes ? h->routes[r].pattern
                                                                    : "none");
                md_prom_label(l, sizeof l, "method", r < h->n_routes ? h->routes[r].method
                                                                     : "any");
                md_prom_label(l, sizeof l, "code", cls[c]);
                if (pass)
                    md_prom_hist(f, name, l, hist);
                else
                    md_prom_sample(f, name, l, (double)n);
            }
        }
    }
    const union MHD_DaemonInfo *info =
        MHD_get_daemon_info(h->daemon, MHD_DAEMON_INFO_CURRENT_CONNECTIONS);
    md_prom_family(f, "modeld_http_connections", "gauge", "Open client connections.");
    md_prom_sample(f, "modeld_http_connections", "", info ? (double)info->num_connections : 0);
    md_prom_family(f, "modeld_http_decoded_off_thread_total", "counter",
                   "Requests whose large body was decoded on the decode pool instead of the "
                   "HTTP thread that received it.");
    md_prom_sample(f, "modeld_http_decoded_off_thread_total", "",
                   (double)atomic_load(&pool_taken));
    md_prom_family(f, "modeld_http_requests_in_flight", "gauge",
                   "Requests received and not yet completed.");
    md_prom_sample(f, "modeld_http_requests_in_flight", "", (double)atomic_load(&h->in_flight));
}
