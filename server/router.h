/*
 * router.h - PRIVATE to the HTTP layer: matching a request's method and path
 * against the routing table (router.c). Included by server/http.c and the
 * router's tests (tests/test_router.c, tests/fuzz_router.c) only; handlers
 * see a route's parameters through md_req_param (server.h), so the match's
 * layout stays out of the public header.
 */
#ifndef MD_ROUTER_H
#define MD_ROUTER_H

#include "server.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct md_route_match {
    const md_route *route;
    int n_params;
    struct {
        const char *name; /* borrowed from the pattern; not NUL-terminated at name_len */
        size_t name_len;
        char value[256];  /* percent-decoded segment */
    } params[MD_ROUTE_MAX_PARAMS];
} md_route_match;

/*
 * Find the route for `method` and `path` (no query string). Returns MD_OK and
 * fills `match`; MD_ENOTFOUND when no pattern matches the path; MD_EMETHOD
 * when patterns match with other methods, listing them in `allow` (e.g.
 * "GET, DELETE"). Thread-safe (reads only).
 */
md_status md_route_find(const md_route *routes, size_t n_routes, const char *method,
                        const char *path, md_route_match *match, char *allow, size_t allow_size);

/* W3C trace context (https://www.w3.org/TR/trace-context/): a traceparent
 * header value is "VV-TTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTT-PPPPPPPPPPPPPPPP-FF",
 * 55 characters: version, trace id, parent (span) id, flags, lowercase hex. */
#define MD_TRACEPARENT_LEN 55

/*
 * Whether `value` is a valid traceparent: exactly MD_TRACEPARENT_LEN chars,
 * lowercase hex fields joined by '-', version not "ff", trace id and parent
 * id not all zeros. NULL is invalid. Pure; thread-safe.
 */
int md_traceparent_valid(const char *value);

/*
 * Format a version-00 traceparent from 16 trace-id bytes and 8 parent-id
 * bytes into `out` (MD_TRACEPARENT_LEN + 1 bytes, NUL-terminated). An
 * all-zero id is made valid by setting its last byte to 1 (a random source
 * that returned zeros must not produce a header receivers drop).
 */
void md_traceparent_format(char *out, const unsigned char trace_id[16],
                           const unsigned char parent_id[8], unsigned flags);

#ifdef __cplusplus
}
#endif
#endif
