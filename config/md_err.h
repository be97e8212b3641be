/*
 * md_err.h - the one status enum and error detail type shared by every module.
 *
 * Functions return an md_status; detail goes into a caller-owned md_err whose
 * message lives in a fixed buffer, so reporting an error never allocates
 * (SQLite result codes + jansson's json_error_t). md_status_http() is the only
 * place a status becomes an HTTP status.
 *
 * This header lives in config/ because config is the lowest layer every other
 * module already depends on; it is the one exception to "one header per folder".
 */
#ifndef MD_ERR_H
#define MD_ERR_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum md_status {
    MD_OK = 0,        /* success */
    MD_EINVAL,        /* the request or value is malformed (400) */
    MD_ENOTFOUND,     /* the named thing does not exist (404) */
    MD_EMETHOD,       /* the path exists but not with this method (405) */
    MD_ECONFLICT,     /* the request conflicts with current state (409) */
    MD_ETOOBIG,       /* a body, file or count is past its configured limit (413) */
    MD_EMEDIA,        /* unsupported Content-Type (415) */
    MD_EUNPROC,       /* well-formed but semantically unusable, e.g. bad model (422) */
    MD_EAUTH,         /* missing credentials (401) */
    MD_EBUSY,         /* a queue or resource is full; retry later (503) */
    MD_EUNAVAIL,      /* the server is starting or draining (503) */
    MD_ETIMEOUT,      /* a deadline passed before the work was done (504) */
    MD_ENOMEM,        /* an allocation sized by a request failed (503) */
    MD_EIO,           /* a file, database or network operation failed (500) */
    MD_EINTERNAL,     /* a bug or an unexpected library failure (500) */
    MD_ENOSPC,        /* the store's filesystem is full (507) */
    MD_EFORBIDDEN,    /* credentials given, but not ones that open this route (403) */
    MD_STATUS_COUNT
} md_status;

#define MD_ERR_MSG_MAX 512

/* Caller-owned error detail. `code` overrides the default machine-readable
 * code of `status` (e.g. "model_not_found") when non-empty. */
typedef struct md_err {
    md_status status;
    char code[48];
    char msg[MD_ERR_MSG_MAX];
} md_err;

/* Clear `err` to MD_OK. Accepts NULL. */
void md_err_clear(md_err *err);

/* Record `status` with a printf-style message; returns `status` so callers can
 * write `return md_err_set(err, MD_EINVAL, "...")`. Accepts a NULL err. */
md_status md_err_set(md_err *err, md_status status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* As md_err_set, with an explicit machine-readable code ("model_not_found"). */
md_status md_err_setc(md_err *err, md_status status, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Copy the text `in` into `out` (`size` bytes, at least 1) as one line of
 * printable, valid UTF-8: control characters and bytes that are not UTF-8 are
 * written as \xNN, as C writes them. Stops before a character that would not
 * fit; always terminates `out`. Returns the bytes written (without the NUL).
 * For what a client sent that reaches a log line or a JSON string (jansson
 * refuses invalid UTF-8). Thread-safe. */
size_t md_text_escape(char *out, size_t size, const char *in);

/* `url` with the password of its userinfo (scheme://user:PASSWORD@host) and
 * of a password= query parameter replaced by "***", into out (size bytes,
 * always terminated): for logs, errors and --print-config. NULL: "". */
void md_url_mask(const char *url, char *out, size_t size);

/* The HTTP status for `status`: the single mapping the handlers use. */
int md_status_http(md_status status);

/* The default machine-readable code for `status` ("invalid_request", ...). */
const char *md_status_code(md_status status);

/* The code to report for `err`: its own code when set, else md_status_code(). */
const char *md_err_code(const md_err *err);

/* Checked allocation for sizes chosen by a request: returns NULL (never aborts)
 * and sets MD_ENOMEM on `err` naming `what`. */
void *md_malloc_checked(size_t size, const char *what, md_err *err);

/* As md_malloc_checked for `n` elements of `size` bytes: the product is
 * overflow-checked first (an overflow is MD_ENOMEM too, naming `what`). */
void *md_mallocarray_checked(size_t n, size_t size, const char *what, md_err *err);
/* As md_mallocarray_checked, zero-filled. */
void *md_calloc_checked(size_t n, size_t size, const char *what, md_err *err);

/*
 * Checked arithmetic: every size computed from input (a shape's product,
 * rows x width, a header's count) goes through these, as SQLite funnels its
 * arithmetic through sqlite3MulInt64. Each stores the result in *out and
 * returns 0, or returns 1 when it overflows (or, for md_mul_i64, when an
 * operand is negative: sizes never are), leaving *out unspecified.
 * Thread-safe: pure functions.
 */
static inline int md_mul_i64(int64_t a, int64_t b, int64_t *out)
{
    return a < 0 || b < 0 || __builtin_mul_overflow(a, b, out);
}
static inline int md_add_i64(int64_t a, int64_t b, int64_t *out)
{
    return a < 0 || b < 0 || __builtin_add_overflow(a, b, out);
}
static inline int md_mul_size(size_t a, size_t b, size_t *out)
{
    return __builtin_mul_overflow(a, b, out);
}
static inline int md_add_size(size_t a, size_t b, size_t *out)
{
    return __builtin_add_overflow(a, b, out);
}

/* Small fixed-size internal allocations only (never sized by a request, a
 * config or a file header): abort with a message on OOM. */
void *md_xmalloc(size_t size);
void *md_xcalloc(size_t n, size_t size);
char *md_xstrdup(const char *s);

/* Invariant check: logs the expression, file and line, then aborts. Never for input. */
#define md_assert(expr) \
    ((expr) ? (void)0 : md_assert_fail(#expr, __FILE__, __LINE__))
void md_assert_fail(const char *expr, const char *file, int line) __attribute__((noreturn));

#ifdef __cplusplus
}
#endif
#endif

/* ---- diagnostics log (stderr), shared by every module ---- */
#ifndef MD_LOG_H
#define MD_LOG_H
#ifdef __cplusplus
extern "C" {
#endif
typedef enum md_log_level { MD_LOG_DEBUG, MD_LOG_INFO, MD_LOG_WARN, MD_LOG_ERROR } md_log_level;

/* Set the least severe level written; "debug", "info", "warn" or "error". */
void md_log_set_level(const char *name);

/* Write one line "TIME LEVEL message" to stderr. Thread-safe. */
void md_log(md_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* The wall-clock time now as UTC ISO 8601 with milliseconds,
 * "2024-01-31T12:00:00.000Z", the form every timestamp in the store and the
 * API takes. Thread-safe. */
void md_now_iso(char out[32]);

/* Lower the calling thread's priority `steps` nice levels below the
 * process's own (under `nice -n 10 modeld` too), capped at 19: batch work
 * that yields the CPU to online work. steps <= 0 changes nothing. A refusal
 * by the kernel is logged as a warning naming `who` ("model fashion: the job
 * workers"). */
void md_thread_nice(int steps, const char *who);
#ifdef __cplusplus
}
#endif
#endif

/* ---- "did you mean": the nearest known word to a typo ---- */
#ifndef MD_SUGGEST_H
#define MD_SUGGEST_H
#include <stddef.h>
#ifdef __cplusplus
extern "C" {
#endif
/* The candidate nearest to `word` by edit distance (case-insensitive) when it
 * is close enough to be a typo of it (1 edit when the longer of the two has up
 * to 4 characters, 2 up to 8, 3 beyond; a swap of neighbours is one; a
 * difference of case alone is nearest), else NULL; an exact match is not a
 * suggestion.
 * Borrowed from `candidates` (NULL entries are skipped). Thread-safe. */
const char *md_suggest(const char *word, const char *const *candidates, size_t n);
#ifdef __cplusplus
}
#endif
#endif
