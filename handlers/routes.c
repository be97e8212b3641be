/* routes.c - the routing table: method, path pattern, handler. */
#include "handlers.h"

const md_route md_routes[] = {
    {"GET", "/healthz", md_handle_healthz, NULL},
    {"GET", "/readyz", md_handle_readyz, NULL},
    {"GET", "/openapi.yaml", md_handle_openapi, NULL},
    {"GET", "/models", md_handle_models_list, NULL},
    {"POST", "/models", md_handle_models_register, NULL},
    {"GET", "/models/{name}", md_handle_model_get, NULL},
    {"PATCH", "/models/{name}", md_handle_model_patch, NULL},
    {"DELETE", "/models/{name}", md_handle_model_delete, NULL},
    {"GET", "/models/{name}/versions", md_handle_versions_list, NULL},
    {"POST", "/models/{name}/versions", md_handle_version_upload, md_upload_body},
    {"GET", "/models/{name}/versions/{version}", md_handle_version_get, NULL},
    {"DELETE", "/models/{name}/versions/{version}", md_handle_version_delete, NULL},
    {"GET", "/models/{name}/versions/{version}/checkpoint", md_handle_version_checkpoint, NULL},
    {"POST", "/predict", md_handle_predict_default, NULL},
    {"POST", "/models/{name}/predict", md_handle_predict_model, NULL},
    {"POST", "/models/{name}/versions/{version}/predict", md_handle_predict_version, NULL},
    {"GET", "/v2", md_handle_v2_server, NULL},
    {"GET", "/v2/", md_handle_v2_server, NULL},
    {"GET", "/v2/health/live", md_handle_v2_live, NULL},
    {"GET", "/v2/health/ready", md_handle_v2_ready, NULL},
    {"GET", "/v2/models/{name}", md_handle_v2_model, NULL},
    {"GET", "/v2/models/{name}/ready", md_handle_v2_model_ready, NULL},
    {"POST", "/v2/models/{name}/infer", md_handle_v2_infer, NULL},
    {"GET", "/v2/models/{name}/versions/{version}", md_handle_v2_model_version, NULL},
    {"GET", "/v2/models/{name}/versions/{version}/ready", md_handle_v2_model_version_ready, NULL},
    {"POST", "/v2/models/{name}/versions/{version}/infer", md_handle_v2_infer_version, NULL},
};
const size_t md_n_routes = sizeof md_routes / sizeof md_routes[0];
