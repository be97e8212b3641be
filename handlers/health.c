/* health.c - liveness (/healthz) and readiness (/readyz). */
#include "handlers.h"

void md_handle_healthz(md_req *req)
{
    md_reply_json(req, 200, json_pack("{s:s}", "status", "alive"));
}

void md_handle_readyz(md_req *req)
{
    md_app *app = md_req_app(req);
    int state = atomic_load(&app->ready);
    if (state == MD_READY) {
        md_reply_json(req, 200, json_pack("{s:s}", "status", "ready"));
        return;
    }
    md_err err;
    md_err_setc(&err, MD_EUNAVAIL, state == MD_DRAINING ? "draining" : "starting", "%s",
                app->not_ready_reason[0] ? app->not_ready_reason
                : state == MD_DRAINING   ? "the server is shutting down"
                                         : "the server is starting");
    md_reply_error(req, &err);
}
