/*
 * fuzz_multipart.c - libFuzzer harness for the multipart/form-data iterator
 * over a buffered body (server/multipart.c), as the prediction routes run it
 * on image uploads. The input's first line is the Content-Type header's
 * value, the rest the body (copied into a buffer of its exact size, so any
 * read past it is caught). Checks beyond "no crash": every part lies inside
 * the body, in order and without overlap; its name, filename and content type
 * lie inside its headers, before its data; no part's data holds a valid
 * delimiter (CRLF--BOUNDARY then optional spaces and CRLF, or "--"); the
 * part count never passes the limit; every failure explains itself.
 */
#define _GNU_SOURCE /* memmem */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../server/server.h"

#define MAX_PARTS 16

static int inside(const char *p, size_t n, const char *lo, const char *hi)
{
    return p >= lo && n <= (size_t)(hi - p);
}

/* Whether data[0..len) holds a delimiter the iterator should have stopped at. */
static int holds_delimiter(const char *data, size_t len, const char *delim, size_t dlen)
{
    const char *end = data + len, *p = data;
    while (p < end) {
        const char *q = memmem(p, (size_t)(end - p), delim, dlen);
        if (!q)
            return 0;
        const char *a = q + dlen;
        if (end - a >= 2 && a[0] == '-' && a[1] == '-')
            return 1;
        while (a < end && (*a == ' ' || *a == '\t'))
            a++;
        if (end - a >= 2 && a[0] == '\r' && a[1] == '\n')
            return 1;
        p = q + 1;
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *nl = memchr(data, '\n', size);
    size_t ct_len = nl ? (size_t)(nl - (const char *)data) : size;
    char *ct = malloc(ct_len + 1);
    memcpy(ct, data, ct_len);
    ct[ct_len] = '\0';
    size_t len = nl ? size - ct_len - 1 : 0;
    char *body = malloc(len ? len : 1);
    if (len)
        memcpy(body, nl + 1, len);
    md_multipart mp;
    md_err err;
    md_err_clear(&err);
    md_status st = md_multipart_begin(&mp, ct, len ? body : NULL, len, MAX_PARTS, "max_parts",
                                      &err);
    const char *prev_end = body;
    size_t n = 0;
    while (st == MD_OK) {
        md_multipart_part p;
        int more;
        st = md_multipart_next(&mp, &p, &more, &err);
        if (st != MD_OK || !more)
            break;
        if (++n > MAX_PARTS)
            abort();
        if (!p.name || !inside(p.data, p.len, prev_end, body + len))
            abort();
        if (!inside(p.name, p.name_len, prev_end, p.data) ||
            (p.filename && !inside(p.filename, p.filename_len, prev_end, p.data)) ||
            (p.content_type && !inside(p.content_type, p.content_type_len, prev_end, p.data)))
            abort();
        if (holds_delimiter(p.data, p.len, mp.delim, mp.delim_len))
            abort();
        prev_end = p.data + p.len;
    }
    if (st != MD_OK && (err.status != st || err.msg[0] == '\0' || strchr(err.msg, '\n')))
        abort();
    free(body);
    free(ct);
    return 0;
}
