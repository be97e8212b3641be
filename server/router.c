/*
 * router.c - the pure parts of the HTTP layer: path pattern matching,
 * the bounded body accumulator and the JSON error body. No libmicrohttpd
 * here, so each piece is unit-tested alone.
 */
#include "router.h"

#include <stdlib.h>
#include <string.h>

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* Percent-decode one path segment into out; 0 on success, -1 if malformed,
 * too long or decoding to '/' or NUL (a parameter never spans segments). */
static int decode_segment(const char *s, size_t n, char *out, size_t size)
{
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (c == '%') {
            if (i + 2 >= n)
                return -1;
            int hi = hexval(s[i + 1]), lo = hexval(s[i + 2]);
            if (hi < 0 || lo < 0)
                return -1;
            c = (char)(hi * 16 + lo);
            if (c == '\0' || c == '/')
                return -1;
            i += 2;
        }
        if (o + 1 >= size)
            return -1;
        out[o++] = c;
    }
    out[o] = '\0';
    return 0;
}

/* Match `path` against `pattern`; fills params on success. */
static int pattern_match(const char *pattern, const char *path, md_route_match *m)
{
    m->n_params = 0;
    const char *p = pattern, *s = path;
    while (*p && *s) {
        if (*p != '/' || *s != '/')
            return 0;
        p++, s++;
        const char *pend = strchr(p, '/');
        const char *send = strchr(s, '/');
        size_t plen = pend ? (size_t)(pend - p) : strlen(p);
        size_t slen = send ? (size_t)(send - s) : strlen(s);
        const char *close = plen >= 2 && p[0] == '{' ? memchr(p, '}', plen) : NULL;
        if (close) {
            /* "{name}" or "{name}:verb" (KServe V1's "/v1/models/{name}:predict"):
             * the parameter is the segment less the literal after '}' */
            size_t suffix = plen - (size_t)(close + 1 - p);
            if (slen <= suffix || memcmp(s + slen - suffix, close + 1, suffix) != 0 ||
                m->n_params >= MD_ROUTE_MAX_PARAMS)
                return 0;
            int k = m->n_params;
            if (decode_segment(s, slen - suffix, m->params[k].value, sizeof m->params[k].value) !=
                0)
                return 0;
            m->params[k].name = p + 1;
            m->params[k].name_len = (size_t)(close - p) - 1;
            m->n_params++;
        } else if (plen != slen || memcmp(p, s, plen) != 0) {
            return 0;
        }
        p += plen;
        s += slen;
    }
    return *p == '\0' && *s == '\0';
}

md_status md_route_find(const md_route *routes, size_t n_routes, const char *method,
                        const char *path, md_route_match *match, char *allow, size_t allow_size)
{
    int path_matched = 0;
    size_t used = 0;
    if (allow_size)
        allow[0] = '\0';
    /* HEAD is answered by GET routes, as HTTP requires. */
    const char *want = strcmp(method, "HEAD") == 0 ? "GET" : method;
    for (size_t i = 0; i < n_routes; i++) {
        md_route_match m;
        if (!pattern_match(routes[i].pattern, path, &m))
            continue;
        if (strcmp(routes[i].method, want) == 0) {
            *match = m;
            match->route = &routes[i];
            return MD_OK;
        }
        /* list each method once */
        size_t mlen = strlen(routes[i].method);
        const char *found = strstr(allow, routes[i].method);
        int dup = found && (found[mlen] == '\0' || found[mlen] == ',');
        if (!dup && used + mlen + 3 < allow_size) {
            if (used) {
                memcpy(allow + used, ", ", 2);
                used += 2;
            }
            memcpy(allow + used, routes[i].method, mlen);
            used += mlen;
            allow[used] = '\0';
        }
        path_matched = 1;
    }
    return path_matched ? MD_EMETHOD : MD_ENOTFOUND;
}

md_status md_route_check_query(const md_route *route, const char *key, md_err *err)
{
    const char *known = route->query ? route->query : "";
    size_t klen = strlen(key);
    const char *words[16];
    char buf[256];
    size_t n = 0;
    snprintf(buf, sizeof buf, "%s", known);
    for (char *save = NULL, *w = strtok_r(buf, " ", &save); w && n < 16;
         w = strtok_r(NULL, " ", &save)) {
        if (strlen(w) == klen && memcmp(w, key, klen) == 0)
            return MD_OK;
        words[n++] = w;
    }
    char takes[160];
    if (n == 0) {
        snprintf(takes, sizeof takes, "it takes no query parameters");
    } else {
        size_t used = (size_t)snprintf(takes, sizeof takes, "it takes: ");
        for (size_t i = 0; i < n && used < sizeof takes; i++)
            used += (size_t)snprintf(takes + used, sizeof takes - used, "%s%s", i ? ", " : "",
                                     words[i]);
    }
    const char *near = md_suggest(key, words, n);
    char hint[96] = "";
    if (near)
        snprintf(hint, sizeof hint, "; did you mean %s?", near);
    else if (strcmp(key, "version") == 0 && strstr(route->pattern, "{name}") &&
             !strstr(route->pattern, "{version}"))
        snprintf(hint, sizeof hint, "; a version is chosen by the path: .../versions/VERSION/...");
    return md_err_setc(err, MD_EINVAL, "unknown_query_parameter",
                       "unknown query parameter \"%.64s\" for %s %s; %s%s", key, route->method,
                       route->pattern, takes, hint);
}

md_status md_body_append(md_body *body, const char *data, size_t n, md_err *err)
{
    if (n > body->limit || body->len > body->limit - n)
        return md_err_setc(err, MD_ETOOBIG, "body_too_large",
                           "request body is larger than the limit of %zu bytes; send less or raise "
                           "max_body_bytes",
                           body->limit);
    if (body->len + n + 1 > body->cap) {
        size_t cap = body->cap ? body->cap : 4096;
        while (cap < body->len + n + 1)
            cap *= 2;
        if (cap > body->limit + 1)
            cap = body->limit + 1;
        char *p = realloc(body->data, cap);
        if (!p)
            return md_err_set(err, MD_ENOMEM,
                              "could not allocate %zu bytes for the request body; retry later", cap);
        body->data = p;
        body->cap = cap;
    }
    memcpy(body->data + body->len, data, n);
    body->len += n;
    body->data[body->len] = '\0';
    return MD_OK;
}

void md_body_free(md_body *body)
{
    if (!body)
        return;
    free(body->data);
    body->data = NULL;
    body->len = body->cap = 0;
}

json_t *md_error_body(const md_err *err, int v2)
{
    const char *msg = err->msg[0] ? err->msg : md_status_code(err->status);
    if (v2)
        return json_pack("{s:s}", "error", msg);
    return json_pack("{s:{s:s,s:s}}", "error", "code", md_err_code(err), "message", msg);
}

/* ---- W3C trace context ---- */

static int lower_hex(const char *s, size_t n, int *all_zero)
{
    *all_zero = 1;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f')))
            return 0;
        if (c != '0')
            *all_zero = 0;
    }
    return 1;
}

int md_traceparent_valid(const char *value)
{
    /* fixed layout: 2 hex '-' 32 hex '-' 16 hex '-' 2 hex */
    if (!value || strlen(value) != MD_TRACEPARENT_LEN)
        return 0;
    if (value[2] != '-' || value[35] != '-' || value[52] != '-')
        return 0;
    int zero;
    if (!lower_hex(value, 2, &zero) || memcmp(value, "ff", 2) == 0)
        return 0; /* version ff is forbidden by the spec */
    if (!lower_hex(value + 3, 32, &zero) || zero)
        return 0;
    if (!lower_hex(value + 36, 16, &zero) || zero)
        return 0;
    return lower_hex(value + 53, 2, &zero);
}

static char *hex_bytes(char *out, const unsigned char *b, size_t n, int force_nonzero)
{
    static const char digits[] = "0123456789abcdef";
    int zero = 1;
    for (size_t i = 0; i < n; i++)
        zero &= b[i] == 0;
    for (size_t i = 0; i < n; i++) {
        unsigned v = b[i];
        if (zero && force_nonzero && i == n - 1)
            v = 1;
        *out++ = digits[v >> 4];
        *out++ = digits[v & 15];
    }
    return out;
}

void md_traceparent_format(char *out, const unsigned char trace_id[16],
                           const unsigned char parent_id[8], unsigned flags)
{
    char *p = out;
    *p++ = '0', *p++ = '0', *p++ = '-';
    p = hex_bytes(p, trace_id, 16, 1);
    *p++ = '-';
    p = hex_bytes(p, parent_id, 8, 1);
    *p++ = '-';
    unsigned char f = (unsigned char)(flags & 0xff);
    p = hex_bytes(p, &f, 1, 0);
    *p = '\0';
}
