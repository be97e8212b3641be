/*
 * multipart.c - multipart/form-data (RFC 7578 over RFC 2046) read from a body
 * that is already buffered whole: the prediction routes' images
 * (curl -F image=@a.png -F image=@b.jpg).
 *
 * libmicrohttpd's PostProcessor parses uploads as they stream in, on the
 * connection's thread, copying each field through a callback; the
 * prediction routes have the whole body before the handler runs (and may
 * decode it on another thread), so this is an iterator over that buffer
 * instead: no allocation at all, each part a (pointer, length) into the body,
 * linear in the body's length (one memmem per delimiter candidate, each
 * search starting past the last). No libmicrohttpd here, so it is unit-tested
 * (tests/test_multipart.c) and fuzzed (tests/fuzz_multipart.c) alone.
 *
 * Strictness, chosen for clients that build bodies with a library (curl -F,
 * requests, browsers), all of which write CRLF and a closing delimiter:
 * a bare LF line ending is refused with a message that says so (accepting
 * it would make "\n--BOUNDARY" inside an image's bytes a delimiter), and so
 * is a body with no closing "--BOUNDARY--" (its last part may be cut short).
 */
#define _GNU_SOURCE /* memmem */
#include <string.h>
#include <strings.h>

#include "server.h"

#define HELP "; let curl -F or an HTTP library build the body"

int md_multipart_eq(const char *s, size_t n, const char *lit)
{
    return s && strlen(lit) == n && strncasecmp(s, lit, n) == 0;
}

static int is_ws(char c) { return c == ' ' || c == '\t'; }

/* RFC 2046's bchars (a space too, but not as the last character). */
static int is_bchar(unsigned char c)
{
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
           (c && strchr("'()+_,-./:=? ", c) != NULL);
}

/* One ";name=value" parameter of a header value from *s (before end).
 * Returns 1 with name/value set (value NULL when there is no '='), 0 when
 * there are no more, -1 for an unterminated quoted string. `*quoted_escapes`
 * is set when a quoted value holds a backslash. */
static int next_param(const char **s, const char *end, const char **name, size_t *name_len,
                      const char **val, size_t *val_len, int *quoted_escapes)
{
    const char *p = *s;
    while (p < end && (*p == ';' || is_ws(*p)))
        p++;
    if (p >= end)
        return 0;
    const char *n = p;
    while (p < end && *p != '=' && *p != ';')
        p++;
    const char *ne = p;
    while (ne > n && is_ws(ne[-1]))
        ne--;
    *name = n;
    *name_len = (size_t)(ne - n);
    *val = NULL;
    *val_len = 0;
    *quoted_escapes = 0;
    if (p < end && *p == '=') {
        p++;
        while (p < end && is_ws(*p))
            p++;
        if (p < end && *p == '"') {
            const char *v = ++p;
            while (p < end && *p != '"') {
                if (*p == '\\') {
                    *quoted_escapes = 1;
                    if (++p >= end)
                        break;
                }
                p++;
            }
            if (p >= end)
                return -1;
            *val = v;
            *val_len = (size_t)(p - v);
            p++; /* the closing quote; anything up to the next ';' is ignored */
            while (p < end && *p != ';')
                p++;
        } else {
            const char *v = p;
            while (p < end && *p != ';')
                p++;
            const char *ve = p;
            while (ve > v && is_ws(ve[-1]))
                ve--;
            *val = v;
            *val_len = (size_t)(ve - v);
        }
    }
    *s = p;
    return 1;
}

/* The first ';'-delimited token of a header value, without the white space
 * around it: returns its start, sets *tok_end past its last character and
 * *rest at the ';' (or the end) where the parameters begin. */
static const char *first_token(const char *s, const char *end, const char **tok_end,
                               const char **rest)
{
    while (s < end && is_ws(*s))
        s++;
    const char *p = s;
    while (p < end && *p != ';')
        p++;
    const char *te = p;
    while (te > s && is_ws(te[-1]))
        te--;
    *tok_end = te;
    *rest = p;
    return s;
}

/* The boundary of a multipart/form-data Content-Type into out (NUL-terminated). */
static md_status parse_boundary(const char *ct, char *out, size_t *out_len, md_err *err)
{
    const char *end = ct + strlen(ct), *p, *te;
    const char *t = first_token(ct, end, &te, &p);
    if (!md_multipart_eq(t, (size_t)(te - t), "multipart/form-data"))
        return md_err_setc(err, MD_EMEDIA, "unsupported_media_type",
                           "Content-Type %.60s is not multipart/form-data", ct);
    const char *name, *val;
    size_t name_len, val_len;
    int esc, r;
    while ((r = next_param(&p, end, &name, &name_len, &val, &val_len, &esc)) == 1) {
        if (!md_multipart_eq(name, name_len, "boundary") || !val)
            continue;
        if (val_len == 0 || val_len > MD_MULTIPART_BOUNDARY_MAX)
            return md_err_setc(err, MD_EINVAL, "invalid_multipart",
                               "the multipart/form-data boundary has %zu characters; it must "
                               "have 1 to %d" HELP,
                               val_len, MD_MULTIPART_BOUNDARY_MAX);
        for (size_t i = 0; i < val_len; i++)
            if (esc || !is_bchar((unsigned char)val[i]) || (i == val_len - 1 && val[i] == ' '))
                return md_err_setc(err, MD_EINVAL, "invalid_multipart",
                                   "the multipart/form-data boundary \"%.*s\" holds a character "
                                   "RFC 2046 does not allow (letters, digits and '()+_,-./:=? "
                                   "only)" HELP,
                                   (int)val_len, val);
        memcpy(out, val, val_len);
        out[val_len] = '\0';
        *out_len = val_len;
        return MD_OK;
    }
    if (r < 0)
        return md_err_setc(err, MD_EINVAL, "invalid_multipart",
                           "the Content-Type %.80s has a quoted parameter that never ends" HELP,
                           ct);
    return md_err_setc(err, MD_EINVAL, "invalid_multipart",
                       "the multipart/form-data Content-Type has no boundary parameter" HELP);
}

enum { D_DATA = 0, D_PART = 1, D_CLOSE = 2, D_BARE_LF = -1, D_END = -2 };

/* What follows "--BOUNDARY" at `a`: another part (after optional spaces and
 * CRLF; *next is where its headers begin), the close delimiter ("--"), a
 * bare LF, the end of the body, or anything else (so it was data). */
static int delim_kind(const char *a, const char *end, const char **next)
{
    if (end - a >= 2 && a[0] == '-' && a[1] == '-')
        return D_CLOSE;
    while (a < end && is_ws(*a))
        a++;
    if (a >= end || (a + 1 == end && *a == '\r'))
        return D_END;
    if (*a == '\n')
        return D_BARE_LF;
    if (end - a >= 2 && a[0] == '\r' && a[1] == '\n') {
        *next = a + 2;
        return D_PART;
    }
    return D_DATA;
}

static md_status bare_lf(md_err *err)
{
    return md_err_setc(err, MD_EINVAL, "invalid_multipart",
                       "the multipart/form-data body's lines end with a bare LF; RFC 2046 "
                       "needs CRLF" HELP);
}

md_status md_multipart_begin(md_multipart *mp, const char *content_type, const char *body,
                             size_t len, size_t max_parts, const char *limit_setting,
                             md_err *err)
{
    memset(mp, 0, sizeof *mp);
    mp->max_parts = max_parts;
    mp->limit_setting = limit_setting ? limit_setting : "max_parts";
    if (!content_type)
        return md_err_setc(err, MD_EMEDIA, "unsupported_media_type",
                           "the request has no Content-Type; a form needs multipart/form-data");
    char b[MD_MULTIPART_BOUNDARY_MAX + 1];
    size_t blen = 0;
    md_status st = parse_boundary(content_type, b, &blen, err);
    if (st != MD_OK)
        return st;
    memcpy(mp->delim, "\r\n--", 4);
    memcpy(mp->delim + 4, b, blen);
    mp->delim_len = blen + 4;
    const char *end = body ? body + len : body;
    mp->end = end;
    /* the first delimiter: "--BOUNDARY" at the very start, or after CRLF */
    const char *dash = mp->delim + 2, *next = NULL;
    size_t dash_len = mp->delim_len - 2;
    int kind = D_DATA;
    if (body && len >= dash_len && memcmp(body, dash, dash_len) == 0)
        kind = delim_kind(body + dash_len, end, &next);
    const char *from = body;
    while (kind == D_DATA && from && from < end) {
        const char *q = memmem(from, (size_t)(end - from), mp->delim, mp->delim_len);
        if (!q)
            break;
        kind = delim_kind(q + mp->delim_len, end, &next);
        from = q + 1;
    }
    if (kind == D_BARE_LF)
        return bare_lf(err);
    if (kind == D_END)
        return md_err_setc(err, MD_EINVAL, "invalid_multipart",
                           "the multipart/form-data body ends at its first --%s line: the "
                           "upload was cut short" HELP,
                           b);
    if (kind == D_DATA) {
        /* "\n--BOUNDARY" with no CR before it: a body written with LF */
        const char *q = body ? memmem(body, len, dash, dash_len) : NULL;
        if (q && q > body && q[-1] == '\n')
            return bare_lf(err);
        return md_err_setc(err, MD_EINVAL, "invalid_multipart",
                           "the multipart/form-data body holds no line --%s (the Content-Type's "
                           "boundary)" HELP,
                           b);
    }
    if (kind == D_CLOSE) {
        mp->done = 1;
        mp->p = end;
    } else {
        mp->p = next;
    }
    return MD_OK;
}

/* Content-Disposition: form-data; name="..."; filename="..." */
static md_status parse_disposition(const char *v, const char *end, size_t n,
                                   md_multipart_part *part, md_err *err)
{
    const char *p, *te;
    v = first_token(v, end, &te, &p);
    if (!md_multipart_eq(v, (size_t)(te - v), "form-data"))
        return md_err_setc(err, MD_EINVAL, "invalid_multipart",
                           "part %zu's Content-Disposition is \"%.*s\", not form-data" HELP, n,
                           (int)(te - v > 40 ? 40 : te - v), v);
    const char *name, *val;
    size_t name_len, val_len;
    int esc, r;
    while ((r = next_param(&p, end, &name, &name_len, &val, &val_len, &esc)) == 1) {
        if (!val)
            continue;
        if (md_multipart_eq(name, name_len, "name")) {
            part->name = val;
            part->name_len = val_len;
        } else if (md_multipart_eq(name, name_len, "filename")) {
            part->filename = val;
            part->filename_len = val_len;
        }
    }
    if (r < 0)
        return md_err_setc(err, MD_EINVAL, "invalid_multipart",
                           "part %zu's Content-Disposition has a quoted value that never "
                           "ends" HELP,
                           n);
    return MD_OK;
}

md_status md_multipart_next(md_multipart *mp, md_multipart_part *part, int *more, md_err *err)
{
    memset(part, 0, sizeof *part);
    *more = 0;
    if (mp->done)
        return MD_OK;
    if (mp->parts >= mp->max_parts)
        return md_err_setc(err, MD_ETOOBIG, "too_many_parts",
                           "the multipart/form-data body has more than %zu parts, the most one "
                           "request may send; send fewer or raise %s",
                           mp->max_parts, mp->limit_setting);
    size_t n = ++mp->parts;
    const char *p = mp->p, *end = mp->end;
    int has_disposition = 0;
    md_status st;
    /* the part's headers, up to an empty line */
    for (;;) {
        if (end - p >= 2 && p[0] == '\r' && p[1] == '\n') {
            p += 2;
            break;
        }
        const char *eol = p < end ? memmem(p, (size_t)(end - p), "\r\n", 2) : NULL;
        if (!eol) {
            if (p < end && memchr(p, '\n', (size_t)(end - p)))
                return bare_lf(err);
            return md_err_setc(err, MD_EINVAL, "invalid_multipart",
                               "the multipart/form-data body ends inside part %zu's headers: the "
                               "upload was cut short" HELP,
                               n);
        }
        if (memchr(p, '\n', (size_t)(eol - p)))
            return bare_lf(err);
        if (is_ws(*p)) { /* an obsolete folded continuation: nothing we read */
            p = eol + 2;
            continue;
        }
        const char *colon = memchr(p, ':', (size_t)(eol - p));
        if (!colon)
            return md_err_setc(err, MD_EINVAL, "invalid_multipart",
                               "part %zu has a header line without ':' (\"%.*s\")" HELP, n,
                               (int)(eol - p > 40 ? 40 : eol - p), p);
        const char *hn = p, *hne = colon, *v = colon + 1, *ve = eol;
        while (hne > hn && is_ws(hne[-1]))
            hne--;
        while (v < ve && is_ws(*v))
            v++;
        while (ve > v && is_ws(ve[-1]))
            ve--;
        if (md_multipart_eq(hn, (size_t)(hne - hn), "content-disposition")) {
            has_disposition = 1;
            if ((st = parse_disposition(v, ve, n, part, err)) != MD_OK)
                return st;
        } else if (md_multipart_eq(hn, (size_t)(hne - hn), "content-type")) {
            const char *te, *rest;
            const char *t = first_token(v, ve, &te, &rest);
            part->content_type = t;
            part->content_type_len = (size_t)(te - t);
        }
        p = eol + 2;
    }
    if (!has_disposition || !part->name)
        return md_err_setc(err, MD_EINVAL, "invalid_multipart",
                           "part %zu has no Content-Disposition: form-data; name=\"...\" "
                           "header" HELP,
                           n);
    /* its data, up to the next delimiter */
    const char *from = p, *next = NULL;
    for (;;) {
        const char *q = from < end ? memmem(from, (size_t)(end - from), mp->delim, mp->delim_len)
                                   : NULL;
        int kind = q ? delim_kind(q + mp->delim_len, end, &next) : D_END;
        if (kind == D_DATA) {
            from = q + 1;
            continue;
        }
        if (kind == D_BARE_LF)
            return bare_lf(err);
        if (kind == D_END)
            return md_err_setc(err, MD_EINVAL, "invalid_multipart",
                               "the multipart/form-data body ends inside part %zu, without the "
                               "closing --%.*s--: the upload was cut short" HELP,
                               n, (int)(mp->delim_len - 4), mp->delim + 4);
        part->data = p;
        part->len = (size_t)(q - p);
        if (kind == D_CLOSE) {
            mp->done = 1;
            mp->p = end;
        } else {
            mp->p = next;
        }
        *more = 1;
        return MD_OK;
    }
}
