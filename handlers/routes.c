/* routes.c - the routing table: method, path pattern, handler, body sink, the
 * query parameters each route takes (any other one answers 400), and the
 * tokens it needs. A route that names no md_auth needs an admin token (the
 * zero value): only health, readiness and the API description are open. */
#include "handlers.h"

const md_route md_routes[] = {
    {"GET", "/healthz", md_handle_healthz, NULL, NULL, MD_AUTH_OPEN},
    {"GET", "/readyz", md_handle_readyz, NULL, NULL, MD_AUTH_OPEN},
    {"GET", "/openapi.yaml", md_handle_openapi, NULL, NULL, MD_AUTH_OPEN},
    {"GET", "/metrics", md_handle_metrics, NULL, NULL, MD_AUTH_METRICS},
    {"GET", "/models", md_handle_models_list, NULL, "limit after", MD_AUTH_READ},
    {"POST", "/models", md_handle_models_register, NULL, NULL, MD_AUTH_ADMIN},
    {"GET", "/models/{name}", md_handle_model_get, NULL, NULL, MD_AUTH_READ},
    {"PATCH", "/models/{name}", md_handle_model_patch, NULL, NULL, MD_AUTH_ADMIN},
    {"DELETE", "/models/{name}", md_handle_model_delete, NULL, NULL, MD_AUTH_ADMIN},
    {"GET", "/models/{name}/versions", md_handle_versions_list, NULL,
     "order_by order", MD_AUTH_READ},
    {"POST", "/models/{name}/versions", md_handle_version_upload, md_upload_body,
     "config metadata metrics version make_default deploy sha256 retention", MD_AUTH_ADMIN},
    {"GET", "/models/{name}/versions/{version}", md_handle_version_get, NULL, NULL, MD_AUTH_READ},
    {"DELETE", "/models/{name}/versions/{version}", md_handle_version_delete, NULL,
     "force", MD_AUTH_ADMIN},
    {"GET", "/models/{name}/versions/{version}/checkpoint", md_handle_version_checkpoint, NULL,
     "format", MD_AUTH_READ},
    {"PUT", "/models/{name}/architecture", md_handle_architecture_put, md_architecture_body,
     NULL, MD_AUTH_ADMIN},
    {"GET", "/models/{name}/architecture", md_handle_architecture_get, NULL, NULL, MD_AUTH_READ},
    {"POST", "/jobs", md_handle_jobs_create, NULL, NULL, MD_AUTH_ADMIN},
    {"GET", "/jobs", md_handle_jobs_list, NULL, "status model limit before", MD_AUTH_READ},
    {"GET", "/jobs/{id}", md_handle_job_get, NULL, NULL, MD_AUTH_READ},
    {"DELETE", "/jobs/{id}", md_handle_job_cancel, NULL, NULL, MD_AUTH_ADMIN},
    {"GET", "/jobs/{id}/output", md_handle_job_output, NULL, NULL, MD_AUTH_READ},
    {"POST", "/predict", md_handle_predict_default, NULL, "top_k", MD_AUTH_PREDICT},
    {"POST", "/models/{name}/predict", md_handle_predict_model, NULL, "top_k", MD_AUTH_PREDICT},
    {"POST", "/models/{name}/versions/{version}/predict", md_handle_predict_version, NULL,
     "top_k", MD_AUTH_PREDICT},
    /* PUT: what curl -T img.png sends; the same handler and guard as POST */
    {"PUT", "/predict", md_handle_predict_default, NULL, "top_k", MD_AUTH_PREDICT},
    {"PUT", "/models/{name}/predict", md_handle_predict_model, NULL, "top_k", MD_AUTH_PREDICT},
    {"PUT", "/models/{name}/versions/{version}/predict", md_handle_predict_version, NULL,
     "top_k", MD_AUTH_PREDICT},
    /* TorchServe's inference URL (curl -T kitten.jpg .../predictions/NAME), answering
     * modeld's own JSON: the default version of NAME */
    {"POST", "/predictions/{name}", md_handle_predict_model, NULL, "top_k", MD_AUTH_PREDICT},
    {"PUT", "/predictions/{name}", md_handle_predict_model, NULL, "top_k", MD_AUTH_PREDICT},
    {"GET", "/v2", md_handle_v2_server, NULL, NULL, MD_AUTH_OPEN},
    {"GET", "/v2/", md_handle_v2_server, NULL, NULL, MD_AUTH_OPEN},
    {"GET", "/v2/health/live", md_handle_v2_live, NULL, NULL, MD_AUTH_OPEN},
    {"GET", "/v2/health/ready", md_handle_v2_ready, NULL, NULL, MD_AUTH_OPEN},
    {"GET", "/v2/models/{name}", md_handle_v2_model, NULL, NULL, MD_AUTH_READ},
    {"GET", "/v2/models/{name}/ready", md_handle_v2_model_ready, NULL, NULL, MD_AUTH_READ},
    {"POST", "/v2/models/{name}/infer", md_handle_v2_infer, NULL, NULL, MD_AUTH_PREDICT},
    {"GET", "/v2/models/{name}/versions/{version}", md_handle_v2_model_version, NULL,
     NULL, MD_AUTH_READ},
    {"GET", "/v2/models/{name}/versions/{version}/ready", md_handle_v2_model_version_ready, NULL,
     NULL, MD_AUTH_READ},
    {"POST", "/v2/models/{name}/versions/{version}/infer", md_handle_v2_infer_version, NULL,
     NULL, MD_AUTH_PREDICT},
    {"POST", "/v1/models/{name}:predict", md_handle_v1_predict, NULL, NULL, MD_AUTH_PREDICT},
    {"GET", "/v1/models/{name}", md_handle_v1_model, NULL, NULL, MD_AUTH_READ},
};
const size_t md_n_routes = sizeof md_routes / sizeof md_routes[0];
