/*
 * server.h - the HTTP layer: libmicrohttpd glue, routing table, request bodies,
 * replies, suspend/resume, request ids and the access log.
 *
 * A handler receives an md_req and either replies at once (md_reply_*) or
 * suspends the connection (md_req_suspend) and hands the request to another
 * thread, which replies and then calls md_req_resume. No server thread ever
 * waits on inference. Every JSON error goes through md_reply_error, which
 * maps the md_status to the HTTP status (md_status_http) and builds
 * {"error": {"code", "message"}} (or the Open Inference Protocol's
 * {"error": "message"} on /v2 routes).
 */
#ifndef MD_SERVER_H
#define MD_SERVER_H

#include <jansson.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>

#include "../config/config.h"
#include "../config/md_err.h"
#include "../config/md_metrics.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct md_req md_req;
typedef struct md_http md_http;

#define MD_ROUTE_MAX_PARAMS 4

/* Called once the whole body is in (or at once for bodyless routes). */
typedef void (*md_handler_fn)(md_req *req);

/* Optional streaming body sink: receives each chunk instead of buffering it.
 * It is first called with data == NULL once the headers are in, so it can
 * refuse the request before any byte is read (answered at once). Returns
 * MD_OK to go on; any other status stops the upload: the rest of the body is
 * discarded and `err` is answered when it ends (libmicrohttpd cannot reply
 * mid-upload). The handler runs only if every chunk was accepted. */
typedef md_status (*md_body_fn)(md_req *req, const char *data, size_t len, md_err *err);

/* One row of the routing table. `pattern` is a path with {param} segments,
 * e.g. "/models/{name}/versions/{version}". */
/* Which bearer tokens a route needs (when that kind of token is configured):
 * the zero value is the strictest, so a route that forgets to say needs an
 * admin token. */
typedef enum md_auth {
    MD_AUTH_ADMIN = 0, /* changes state: admin_token */
    MD_AUTH_PREDICT,   /* predictions: predict_token or admin_token */
    MD_AUTH_READ,      /* reads: predict_token or admin_token */
    MD_AUTH_METRICS,   /* GET /metrics: metrics_token or admin_token */
    MD_AUTH_OPEN,      /* health, readiness, the API description: always open */
} md_auth;

typedef struct md_route {
    const char *method;
    const char *pattern;
    md_handler_fn handler;
    md_body_fn on_body; /* NULL: body buffered up to max_body_bytes */
    const char *query;  /* the query parameters it takes, space-separated; NULL: none */
    md_auth auth;       /* the tokens it needs */
} md_route;

/* ---- routing (pure functions, unit-tested) ----
 * md_route_find and its md_route_match are the HTTP layer's own
 * (server/router.h); handlers read parameters with md_req_param. */

/*
 * Check one query parameter name against what `route` takes: MD_OK, or
 * MD_EINVAL with code "unknown_query_parameter" naming the parameter, the
 * route, the parameters it takes and the nearest one ("did you mean"). A
 * parameter silently ignored would answer something other than what the
 * client asked for (`?version=7` on /models/NAME/predict). Thread-safe.
 */
md_status md_route_check_query(const md_route *route, const char *key, md_err *err);

/* ---- request body accumulator (unit-tested) ----
 * A value type, on purpose: handlers embed one in their per-request state
 * (handlers/models.c) and read data/len directly; md_body_free releases the
 * buffer. Used by one thread at a time. */

typedef struct md_body {
    char *data;       /* owned; NUL-terminated for convenience */
    size_t len;
    size_t cap;
    size_t limit;     /* most bytes accepted */
} md_body;

/* Append `n` bytes; MD_ETOOBIG (with a message naming the limit and the
 * setting) once the total would pass `limit`, MD_ENOMEM if allocation fails.
 * Nothing past the limit is ever buffered. */
md_status md_body_append(md_body *body, const char *data, size_t n, md_err *err);
void md_body_free(md_body *body);

/* ---- multipart/form-data over a buffered body (multipart.c, unit-tested) ----
 *
 * For routes whose body is buffered whole before the handler runs (the
 * prediction routes: curl -F image=@a.png -F image=@b.jpg). An iterator over
 * the body (RFC 7578 over RFC 2046): it allocates nothing, and each part is
 * pointers into the body. The boundary comes from the Content-Type
 * (quoted or not, 1 to 70 characters of RFC 2046's set); the preamble and the
 * epilogue are ignored; a delimiter is "--BOUNDARY" at the start of the body
 * or after CRLF, followed by optional spaces or tabs and CRLF ("--" after
 * it: the close delimiter); "--BOUNDARY" followed by anything else is data.
 * Refused (MD_EINVAL, the message saying what is wrong and that curl -F or
 * an HTTP library builds a correct body): lines ending in a bare LF, a body
 * with no closing "--BOUNDARY--" (cut short), a part with no
 * Content-Disposition name, headers that never end. Pure functions of their
 * arguments; an iterator is used by one thread at a time. */

/* One part; every pointer is into the body (borrowed, valid while it is).
 * Quoted values are given without their quotes, not unescaped. */
typedef struct md_multipart_part {
    const char *name;          /* Content-Disposition's name= */
    size_t name_len;
    const char *filename;      /* its filename=, NULL when the part has none */
    size_t filename_len;
    const char *content_type;  /* the part's Content-Type (without parameters), NULL: none */
    size_t content_type_len;
    const char *data;          /* the part's bytes (may be empty) */
    size_t len;
} md_multipart_part;

#define MD_MULTIPART_BOUNDARY_MAX 70

typedef struct md_multipart {
    const char *p, *end;       /* the next part's headers .. the end of the body */
    char delim[MD_MULTIPART_BOUNDARY_MAX + 5]; /* "\r\n--BOUNDARY" */
    size_t delim_len;
    size_t parts, max_parts;   /* parts returned so far, the most allowed */
    const char *limit_setting; /* the setting that raises max_parts (static) */
    int done;                  /* the close delimiter was read */
} md_multipart;

/*
 * Start iterating the multipart/form-data `body` (`len` bytes) sent with
 * `content_type` (the header's whole value). At most `max_parts` parts (the
 * next one is MD_ETOOBIG naming the limit and `limit_setting`, the setting
 * that raises it). MD_EMEDIA when the type is not multipart/form-data;
 * MD_EINVAL for a missing or invalid boundary and a body in which no
 * delimiter line is found.
 */
md_status md_multipart_begin(md_multipart *mp, const char *content_type, const char *body,
                             size_t len, size_t max_parts, const char *limit_setting,
                             md_err *err);

/* The next part into *part with *more = 1, or *more = 0 after the last.
 * On an error the iterator stays at it (every later call fails too). */
md_status md_multipart_next(md_multipart *mp, md_multipart_part *part, int *more, md_err *err);

/* Whether the `n` bytes at `s` equal the NUL-terminated `lit`, ignoring
 * ASCII case (for part names, filenames' extensions and content types). */
int md_multipart_eq(const char *s, size_t n, const char *lit);

/* ---- error bodies (unit-tested) ---- */

/* The JSON body for `err`: {"error": {"code", "message"}}, or for Open
 * Inference Protocol routes (v2 != 0) {"error": "message"}. New reference.
 * Pure; any thread. */
json_t *md_error_body(const md_err *err, int v2);

/* ---- the server ---- */

/* Readiness, read by /readyz and set by main. */
typedef enum md_ready_state { MD_STARTING = 0, MD_LOADING, MD_READY, MD_DRAINING } md_ready_state;

/*
 * Bind host:port from `cfg` and start serving `routes` (borrowed; must
 * outlive the server) with libmicrohttpd's epoll thread pool. `app` is handed
 * to handlers through md_req_app. On failure returns MD_EIO naming host and
 * port. Not thread-safe.
 */
md_status md_http_start(const md_cfg *cfg, const md_route *routes, size_t n_routes, void *app,
                        md_http **out, md_err *err);

/* Stop accepting new connections (close the listener); connections already
 * open are served, each response after this carries "Connection: close".
 * From main's thread (the one that started the server). */
void md_http_quiesce(md_http *http);

/* Requests begun and not yet completed. Thread-safe. */
long md_http_in_flight(const md_http *http);
/* Write the HTTP metric families (Prometheus text) to `f`: requests and
 * latency by route pattern, method and status class, open connections.
 * Reads atomics only; any thread. */
void md_http_write_metrics(md_http *http, FILE *f);

/*
 * Close the gate before stopping: every request that begins after this is
 * answered 503 "draining" with Connection: close at once, never deferred or
 * suspended. A keep-alive connection may start a request after the in-flight
 * count was seen at zero; with the gate closed such a request cannot suspend,
 * so once the count is zero again nothing can be left suspended when
 * md_http_stop runs. Thread-safe.
 */
void md_http_close_gate(md_http *http);

/* The port actually bound (useful with port 0). Fixed at start; any thread. */
int md_http_port(const md_http *http);

/* Stop every thread and close every connection. Accepts NULL. From main's
 * thread, after the drain: no request may be suspended or deferred then. */
void md_http_stop(md_http *http);

/* ---- the request, for handlers ----
 *
 * Threads: a request belongs to one thread at a time: the libmicrohttpd
 * thread running its handler, then (md_req_defer, md_req_offload) the
 * deferred or decode-pool thread running `fn`, or (md_req_suspend) the one
 * thread that will reply and resume it. Calls that read or change the
 * request are made from the thread it belongs to, unless they say
 * otherwise; calls that need the connection (query arguments, headers) only
 * from the handler itself.
 */

/* The `app` given to md_http_start. Any thread. */
void *md_req_app(md_req *req);
/* The method, the path (no query string) and the request id: borrowed,
 * fixed before the handler runs, valid until the request completes; any
 * thread holding the request. */
const char *md_req_method(md_req *req);
const char *md_req_path(md_req *req);
const char *md_req_id(md_req *req);
/* Seconds since the request's first byte was read (CLOCK_MONOTONIC); any
 * thread holding the request. */
double md_req_elapsed_s(md_req *req);
/* The route parameter `name` (decoded), or NULL. Borrowed, valid for the
 * request; fixed at routing, so readable from a deferred or worker thread. */
const char *md_req_param(md_req *req, const char *name);
/* The query argument `key`, or NULL. Borrowed. Call only from a handler thread. */
const char *md_req_query(md_req *req, const char *key);
/* The request header `name`, or NULL. Borrowed. Call only from a handler thread. */
const char *md_req_header(md_req *req, const char *name);
/* The integer query argument `key` in min..max into *out (`def` when absent).
 * MD_EINVAL with code `code` naming the argument and the range otherwise.
 * Call only from a handler thread (it reads the connection). */
md_status md_req_query_int(md_req *req, const char *key, long min, long max, long def,
                           const char *code, long *out, md_err *err);
/* The route parameter {version} as a positive integer; on failure it replies
 * 400 invalid_version and returns 0. From the thread the request belongs to. */
int md_req_version_param(md_req *req, int *version);
/* The buffered body (NUL-terminated) and its length; NULL when empty or
 * streamed. Borrowed, unchanged once the handler runs, valid until the
 * request completes. */
const char *md_req_body(md_req *req, size_t *len);
/* Per-request state; `state` is owned by the request from here and
 * `free_fn(state)` runs when the request completes (on a libmicrohttpd
 * thread). Set and read from the thread the request belongs to. */
void md_req_set_state(md_req *req, void *state, void (*free_fn)(void *));
void *md_req_state(md_req *req);

/* ---- replies: exactly one per request ----
 * From the thread the request belongs to (see above): the handler, the
 * deferred `fn`, or the one thread that replies to a suspended request
 * before calling md_req_resume. */

/* Add a header to the reply being built (copied). */
void md_reply_header(md_req *req, const char *name, const char *value);
/* Reply with a JSON body; steals `body`. */
void md_reply_json(md_req *req, int http_status, json_t *body);
/* Reply with an error: status from md_status_http(err->status). */
void md_reply_error(md_req *req, const md_err *err);
/* Reply with bytes; takes ownership of malloc'd `data`. */
void md_reply_bytes(md_req *req, int http_status, const char *content_type, char *data,
                    size_t len);
/* Reply with `size` bytes of open file `fd` from offset 0; takes ownership of fd. */
void md_reply_fd(md_req *req, int http_status, const char *content_type, int fd, size_t size);
/* Reply with `size` bytes read from `fd`, the read end of a pipe another
 * thread fills (an S3 object: md_s3_stream_open). No server thread ever
 * blocks on it: while the pipe is empty the connection is suspended and a
 * watcher thread resumes it when bytes arrive (http.c, "a streamed body").
 * A pipe that ends before `size` bytes cuts the reply off (the client sees
 * a body shorter than its Content-Length, never a short one as whole).
 * Takes ownership of fd; done(ctx) (may be NULL) runs once, after fd is
 * closed, when the reply is over or was never sent: close the writer there. */
void md_reply_stream(md_req *req, int http_status, const char *content_type, int fd, size_t size,
                     void (*done)(void *ctx), void *ctx);

/* Multipart form bodies, for streaming routes: feed each chunk given to the
 * route's md_body_fn; `field_fn` receives every piece of every field in
 * order (`filename` non-NULL for file fields). MD_EMEDIA when the request is
 * not multipart/form-data. The parser is freed with the request. From the
 * route's md_body_fn only (a libmicrohttpd thread), as each chunk comes. */
typedef md_status (*md_form_fn)(md_req *req, const char *field, const char *filename,
                                const char *data, size_t len, md_err *err);
md_status md_req_form_feed(md_req *req, md_form_fn field_fn, const char *data, size_t len,
                           md_err *err);

/* Run `fn(req)` on a background thread with the connection suspended; `fn`
 * replies (the connection is resumed when it returns) or hands the request
 * on with md_req_suspend (its new owner replies and resumes). For work that may
 * block (downloads, fsync, loading a model). Call from the handler only. */
void md_req_defer(md_req *req, void (*fn)(md_req *req));

/* Run `fn(req)` on the decode pool (as many threads as HTTP threads,
 * started on first use), with the connection suspended; `fn` replies or
 * hands the request on (md_req_suspend), as with md_req_defer. For CPU work
 * on a large body (parsing a 64-row JSON body takes ~0.6 ms): libmicrohttpd
 * keeps each connection on one of its threads, so such parses done there
 * queue behind each other on one core when the connections happen to share
 * a thread. Returns 1 when queued; 0 when the pool has no thread or its
 * queue is full (4 a thread), and the caller does the work itself, nothing
 * suspended. Never for work that blocks. Call from the handler only. */
int md_req_offload(md_req *req, void (*fn)(md_req *req));

/* Suspend the connection: the handler returns without replying; another
 * thread later replies and calls md_req_resume. Call from the handler only. */
void md_req_suspend(md_req *req);
/* Whether the client of a suspended request has closed its connection
 * (a peek at the socket; nothing is consumed). Thread-safe while suspended. */
int md_req_client_gone(md_req *req);

/* Resume a suspended request after its reply is set. Thread-safe. */
void md_req_resume(md_req *req);

#ifdef __cplusplus
}
#endif
#endif
