/* openapi.c - serves the HTTP contract, openapi.yaml, embedded at build time. */
#include <stdlib.h>
#include <string.h>

#include "handlers.h"

/* defined by openapi_blob.S, which .incbin's openapi.yaml */
extern const char md_openapi_start[];
extern const char md_openapi_end[];

const char *md_openapi_text(size_t *len)
{
    *len = (size_t)(md_openapi_end - md_openapi_start);
    return md_openapi_start;
}

void md_handle_openapi(md_req *req)
{
    size_t len;
    const char *text = md_openapi_text(&len);
    char *copy = md_xmalloc(len);
    memcpy(copy, text, len);
    md_reply_bytes(req, 200, "application/yaml", copy, len);
}
