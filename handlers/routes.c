/* routes.c - the routing table: method, path pattern, handler. */
#include "handlers.h"

const md_route md_routes[] = {
    {"GET", "/healthz", md_handle_healthz, NULL},
    {"GET", "/readyz", md_handle_readyz, NULL},
    {"GET", "/openapi.yaml", md_handle_openapi, NULL},
};
const size_t md_n_routes = sizeof md_routes / sizeof md_routes[0];
