/* md_err.c - status codes, their HTTP mapping, checked allocation. */
#include "md_err.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const struct {
    int http;
    const char *code;
} status_table[MD_STATUS_COUNT] = {
    [MD_OK] = {200, "ok"},
    [MD_EINVAL] = {400, "invalid_request"},
    [MD_ENOTFOUND] = {404, "not_found"},
    [MD_EMETHOD] = {405, "method_not_allowed"},
    [MD_ECONFLICT] = {409, "conflict"},
    [MD_ETOOBIG] = {413, "payload_too_large"},
    [MD_EMEDIA] = {415, "unsupported_media_type"},
    [MD_EUNPROC] = {422, "unprocessable"},
    [MD_EAUTH] = {401, "unauthorized"},
    [MD_EBUSY] = {503, "overloaded"},
    [MD_EUNAVAIL] = {503, "unavailable"},
    [MD_ETIMEOUT] = {504, "timeout"},
    [MD_ENOMEM] = {503, "out_of_memory"},
    [MD_EIO] = {500, "io_error"},
    [MD_EINTERNAL] = {500, "internal_error"},
    [MD_ENOSPC] = {507, "insufficient_storage"},
    [MD_EFORBIDDEN] = {403, "forbidden"},
};

void md_err_clear(md_err *err)
{
    if (!err)
        return;
    err->status = MD_OK;
    err->code[0] = '\0';
    err->msg[0] = '\0';
}

/* The length of the well-formed UTF-8 sequence at `c` (1..4), or 0 when the
 * bytes there are not one (a stray continuation byte, an overlong form, a
 * surrogate, past U+10FFFF, or a sequence cut short). */
static size_t utf8_len(const unsigned char *c)
{
    if (c[0] < 0x80)
        return 1;
    size_t n = c[0] >= 0xc2 && c[0] <= 0xdf ? 2 : c[0] >= 0xe0 && c[0] <= 0xef ? 3
             : c[0] >= 0xf0 && c[0] <= 0xf4 ? 4 : 0;
    for (size_t i = 1; i < n; i++)
        if ((c[i] & 0xc0) != 0x80)
            return 0; /* also stops at the terminating NUL */
    if ((c[0] == 0xe0 && c[1] < 0xa0) || (c[0] == 0xed && c[1] >= 0xa0) ||
        (c[0] == 0xf0 && c[1] < 0x90) || (c[0] == 0xf4 && c[1] >= 0x90))
        return 0;
    return n;
}

size_t md_text_escape(char *out, size_t size, const char *in)
{
    size_t o = 0;
    for (const unsigned char *c = (const unsigned char *)in; *c && o + 1 < size;) {
        size_t n = utf8_len(c);
        if (n == 0 || *c < 0x20 || *c == 0x7f) {
            if (o + 5 > size)
                break;
            o += (size_t)snprintf(out + o, size - o, "\\x%02x", *c);
            c++;
        } else {
            if (o + n + 1 > size)
                break;
            memcpy(out + o, c, n);
            o += n;
            c += n;
        }
    }
    out[o] = '\0';
    return o;
}

static md_status err_vset(md_err *err, md_status status, const char *code, const char *fmt,
                          va_list ap)
{
    if (!err)
        return status;
    err->status = status;
    snprintf(err->code, sizeof err->code, "%s", code ? code : "");
    char raw[MD_ERR_MSG_MAX];
    vsnprintf(raw, sizeof raw, fmt, ap);
    /* a message quotes what the client sent: keep it one line of printable,
     * valid UTF-8 text, so it can neither break a log line nor forge another,
     * nor make the JSON error body unencodable (jansson refuses invalid
     * UTF-8: a 400 would become a 500), and still shows the bytes */
    md_text_escape(err->msg, sizeof err->msg, raw);
    return status;
}

md_status md_err_set(md_err *err, md_status status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    err_vset(err, status, NULL, fmt, ap);
    va_end(ap);
    return status;
}

md_status md_err_setc(md_err *err, md_status status, const char *code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    err_vset(err, status, code, fmt, ap);
    va_end(ap);
    return status;
}

int md_status_http(md_status status)
{
    if ((unsigned)status >= MD_STATUS_COUNT)
        return 500;
    return status_table[status].http;
}

const char *md_status_code(md_status status)
{
    if ((unsigned)status >= MD_STATUS_COUNT)
        return "internal_error";
    return status_table[status].code;
}

const char *md_err_code(const md_err *err)
{
    return err->code[0] ? err->code : md_status_code(err->status);
}

void *md_malloc_checked(size_t size, const char *what, md_err *err)
{
    void *p = malloc(size ? size : 1);
    if (!p)
        md_err_set(err, MD_ENOMEM, "could not allocate %zu bytes for %s; retry later or send less",
                   size, what);
    return p;
}

void *md_mallocarray_checked(size_t n, size_t size, const char *what, md_err *err)
{
    size_t total;
    if (md_mul_size(n, size, &total)) {
        md_err_set(err, MD_ENOMEM,
                   "cannot allocate %zu x %zu bytes for %s: the size overflows; send less", n,
                   size, what);
        return NULL;
    }
    return md_malloc_checked(total, what, err);
}

void *md_calloc_checked(size_t n, size_t size, const char *what, md_err *err)
{
    size_t total;
    if (md_mul_size(n, size, &total)) {
        md_err_set(err, MD_ENOMEM,
                   "cannot allocate %zu x %zu bytes for %s: the size overflows; send less", n,
                   size, what);
        return NULL;
    }
    void *p = calloc(total ? total : 1, 1);
    if (!p)
        md_err_set(err, MD_ENOMEM, "could not allocate %zu bytes for %s; retry later or send less",
                   total, what);
    return p;
}

static void oom(size_t size)
{
    fprintf(stderr, "modeld: out of memory allocating %zu bytes\n", size);
    abort();
}

void *md_xmalloc(size_t size)
{
    void *p = malloc(size ? size : 1);
    if (!p)
        oom(size);
    return p;
}

void *md_xcalloc(size_t n, size_t size)
{
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p)
        oom(n * size);
    return p;
}

char *md_xstrdup(const char *s)
{
    size_t n = strlen(s) + 1;
    char *p = md_xmalloc(n);
    memcpy(p, s, n);
    return p;
}

void md_assert_fail(const char *expr, const char *file, int line)
{
    fprintf(stderr, "modeld: assertion failed: %s (%s:%d)\n", expr, file, line);
    abort();
}

/* ---- diagnostics log ---- */
#include <time.h>

static md_log_level log_min = MD_LOG_INFO;

void md_log_set_level(const char *name)
{
    static const char *names[] = {"debug", "info", "warn", "error"};
    for (int i = 0; i < 4; i++)
        if (strcmp(name, names[i]) == 0)
            log_min = (md_log_level)i;
}

void md_log(md_log_level level, const char *fmt, ...)
{
    static const char *names[] = {"debug", "info", "warn", "error"};
    if (level < log_min)
        return;
    char line[8192]; /* libtorch's whole error message fits */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    int n = (int)strftime(line, sizeof line, "%Y-%m-%dT%H:%M:%S", &tm);
    n += snprintf(line + n, sizeof line - (size_t)n, ".%03ldZ %s ", ts.tv_nsec / 1000000L,
                  names[level]);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    va_end(ap);
    /* one fputs of a whole line: stdio locks the stream, so lines never interleave */
    size_t len = strlen(line);
    if (len + 1 < sizeof line) {
        line[len] = '\n';
        line[len + 1] = '\0';
    }
    fputs(line, stderr);
}

/* ---- did you mean ---- */
#include <ctype.h>
#include <stdint.h>

#define SUGGEST_MAX 64 /* longer words are not typos worth a suggestion */

/* Edit distance of a and b (each at most SUGGEST_MAX bytes), case-insensitive:
 * insertions, deletions, substitutions and swaps of two neighbours ("mpl"
 * for "mlp") each count one (optimal string alignment). */
static size_t edit_distance(const char *a, size_t la, const char *b, size_t lb)
{
    size_t rows[3][SUGGEST_MAX + 1];
    size_t *prev2 = rows[0], *prev = rows[1], *cur = rows[2];
    for (size_t j = 0; j <= lb; j++)
        prev[j] = j;
    for (size_t i = 1; i <= la; i++) {
        cur[0] = i;
        int ai = tolower((unsigned char)a[i - 1]);
        for (size_t j = 1; j <= lb; j++) {
            int bj = tolower((unsigned char)b[j - 1]);
            size_t best = prev[j - 1] + (ai == bj ? 0 : 1);
            if (prev[j] + 1 < best)
                best = prev[j] + 1;
            if (cur[j - 1] + 1 < best)
                best = cur[j - 1] + 1;
            if (i > 1 && j > 1 && ai == tolower((unsigned char)b[j - 2]) &&
                tolower((unsigned char)a[i - 2]) == bj && prev2[j - 2] + 1 < best)
                best = prev2[j - 2] + 1;
            cur[j] = best;
        }
        size_t *t = prev2;
        prev2 = prev;
        prev = cur;
        cur = t;
    }
    return prev[lb];
}

const char *md_suggest(const char *word, const char *const *candidates, size_t n)
{
    size_t lw = strlen(word);
    if (lw == 0 || lw > SUGGEST_MAX)
        return NULL;
    const char *best = NULL;
    size_t best_d = SIZE_MAX;
    for (size_t i = 0; i < n; i++) {
        const char *c = candidates[i];
        size_t lc = c ? strlen(c) : 0;
        if (!c || lc > SUGGEST_MAX)
            continue;
        size_t longer = lc > lw ? lc : lw;
        size_t limit = longer <= 4 ? 1 : longer <= 8 ? 2 : 3;
        if ((lc > lw ? lc - lw : lw - lc) > limit)
            continue;
        if (strcmp(word, c) == 0)
            return NULL; /* the word itself is known: nothing to suggest */
        size_t d = edit_distance(word, lw, c, lc); /* 0: it differs only in case */
        if (d <= limit && d < best_d) {
            best_d = d;
            best = c;
        }
    }
    return best;
}

/* MD_TEST_CLOCK_SKEW_S (a test knob): this process's wall clock read that
 * many seconds ahead (or behind), as a host's clock off by that much. */
static long clock_skew_s(void)
{
    static _Atomic int read;
    static _Atomic long skew;
    if (!atomic_load(&read)) {
        const char *e = getenv("MD_TEST_CLOCK_SKEW_S");
        atomic_store(&skew, e ? strtol(e, NULL, 10) : 0);
        atomic_store(&read, 1);
    }
    return atomic_load(&skew);
}

void md_now_iso(char out[32])
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += clock_skew_s();
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    size_t n = strftime(out, 32, "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(out + n, 32 - n, ".%03ldZ", ts.tv_nsec / 1000000L);
}

#include <errno.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

void md_thread_nice(int steps, const char *who)
{
    if (steps <= 0)
        return;
    errno = 0;
    int base = getpriority(PRIO_PROCESS, 0);
    if (errno)
        base = 0;
    int target = base + steps > 19 ? 19 : base + steps;
    if (target > base && setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), target) != 0)
        md_log(MD_LOG_WARN, "%s: cannot lower the priority to nice %d: %s", who, target,
               strerror(errno));
}

/* strncasecmp for ASCII, without <strings.h>'s feature macros. */
static int strncasecmp_ascii(const char *a, const char *b, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        int x = (unsigned char)a[i], y = (unsigned char)b[i];
        if (x >= 'A' && x <= 'Z')
            x += 32;
        if (y >= 'A' && y <= 'Z')
            y += 32;
        if (x != y || !x)
            return x - y;
    }
    return 0;
}

void md_url_mask(const char *url, char *out, size_t size)
{
    if (!size)
        return;
    if (!url) {
        out[0] = '\0';
        return;
    }
    /* scheme://user:PASSWORD@host... */
    const char *sch = strstr(url, "://");
    const char *at = sch ? strchr(sch + 3, '@') : NULL;
    const char *slash = sch ? strchr(sch + 3, '/') : NULL;
    const char *colon = sch ? strchr(sch + 3, ':') : NULL;
    char tmp[2048];
    if (at && (!slash || at < slash) && colon && colon < at)
        snprintf(tmp, sizeof tmp, "%.*s:***%s", (int)(colon - url), url, at);
    else
        snprintf(tmp, sizeof tmp, "%s", url);
    /* ...?password=SECRET&... (any case) */
    char *q = strchr(tmp, '?');
    for (char *p = q; p && *p; p++) {
        if ((*p != '?' && *p != '&') || strncasecmp_ascii(p + 1, "password=", 9) != 0)
            continue;
        char *v = p + 10, *end = strchr(v, '&');
        char rest[2048];
        snprintf(rest, sizeof rest, "%s", end ? end : "");
        snprintf(v, sizeof tmp - (size_t)(v - tmp), "***%s", rest);
        p = v + 2;
    }
    snprintf(out, size, "%s", tmp);
}
