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
    if (state == MD_DRAINING)
        md_err_setc(&err, MD_EUNAVAIL, "draining", "the server is shutting down (signal %d)",
                    atomic_load(&app->stop_signal));
    else
        md_err_setc(&err, MD_EUNAVAIL, "starting", "%s",
                    state == MD_LOADING ? "the server is loading its deployed models"
                                        : "the server is starting");
    md_reply_error(req, &err);
}
