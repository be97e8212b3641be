/*
 * fuzz_router.c - libFuzzer harness for request routing: path matching and
 * percent-decoding of path parameters (md_route_find) and the query
 * parameter check (md_route_check_query), over a table with every pattern
 * shape of handlers/routes.c. The input is "METHOD\npath\nquery-key".
 * Checks beyond "no crash": a matched route's parameters are NUL-terminated,
 * hold no '/' and fit their buffers; a failure explains itself.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../server/router.h"

static void h(md_req *r) { (void)r; }

static const md_route routes[] = {
    {"GET", "/healthz", h, NULL, NULL},
    {"GET", "/models", h, NULL, "limit after"},
    {"POST", "/models", h, NULL, NULL},
    {"GET", "/models/{name}", h, NULL, NULL},
    {"PATCH", "/models/{name}", h, NULL, NULL},
    {"GET", "/models/{name}/versions", h, NULL, "order_by order"},
    {"DELETE", "/models/{name}/versions/{version}", h, NULL, "force"},
    {"GET", "/models/{name}/versions/{version}/checkpoint", h, NULL, NULL},
    {"POST", "/models/{name}/versions/{version}/predict", h, NULL, "top_k"},
    {"GET", "/jobs/{id}/output", h, NULL, NULL},
    {"GET", "/v2", h, NULL, NULL},
    {"GET", "/v2/", h, NULL, NULL},
    {"POST", "/v2/models/{name}/versions/{version}/infer", h, NULL, NULL},
};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *buf = malloc(size + 1);
    memcpy(buf, data, size);
    buf[size] = '\0';
    char *method = buf, *path = strchr(buf, '\n'), *key = NULL;
    if (path) {
        *path++ = '\0';
        key = strchr(path, '\n');
        if (key)
            *key++ = '\0';
    } else {
        path = buf + size;
    }
    md_route_match m;
    char allow[64];
    md_status st = md_route_find(routes, sizeof routes / sizeof routes[0], method, path, &m, allow,
                                 sizeof allow);
    if (st == MD_OK) {
        if (m.n_params < 0 || m.n_params > MD_ROUTE_MAX_PARAMS)
            abort();
        for (int i = 0; i < m.n_params; i++) {
            size_t n = strnlen(m.params[i].value, sizeof m.params[i].value);
            if (n == sizeof m.params[i].value || memchr(m.params[i].value, '/', n))
                abort();
        }
        if (key) {
            md_err err;
            md_err_clear(&err);
            if (md_route_check_query(m.route, key, &err) != MD_OK && err.msg[0] == '\0')
                abort();
        }
    } else if (st == MD_EMETHOD && strnlen(allow, sizeof allow) == sizeof allow) {
        abort();
    }
    free(buf);
    return 0;
}
