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

#ifdef __cplusplus
}
#endif
#endif
