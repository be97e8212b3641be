/*
 * fuzz_s3_xml.c - libFuzzer harness for the S3 client's XML extractor
 * (checkpoint/s3.c): ListObjectsV2 pages, error answers, one element's text.
 * The input is the answer's bytes, exactly sized (no terminating NUL), so any
 * read past it is caught. Checks beyond "no crash": every listed object has a
 * non-empty key within S3's 1024 bytes, a non-negative size, bounded fields;
 * a truncated page always has a continuation token; extracted text fits its
 * buffer; and two round trips that cannot drift: the input escaped as XML
 * text (the five entities and numeric references) and extracted again is the
 * input, and the input percent-encoded for a key holds only unreserved
 * characters, '%' and '/', and decodes back to the input.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../checkpoint/s3.h"

static int on_object(void *ctx, const md_s3_object *o)
{
    int *n = ctx;
    size_t k = strlen(o->key);
    if (k == 0 || k > MD_S3_KEY_MAX || o->size < 0 || strlen(o->etag) >= sizeof o->etag ||
        strlen(o->last_modified) >= sizeof o->last_modified)
        abort();
    return ++*n >= 50; /* stopping early is a path too */
}

static int hexval(char c)
{
    return c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *xml = (const char *)data;
    int truncated, stopped, n = 0;
    char token[64];
    md_err err;
    if (md_s3_parse_list(xml, size, on_object, &n, &truncated, &stopped, token, sizeof token, &err) ==
        MD_OK) {
        if (strlen(token) >= sizeof token || (truncated && !token[0] && !stopped))
            abort();
    } else if (!err.msg[0]) {
        abort(); /* every failure explains itself */
    }
    char code[16], msg[32];
    md_s3_parse_error(xml, size, code, sizeof code, msg, sizeof msg);
    if (strlen(code) >= sizeof code || strlen(msg) >= sizeof msg)
        abort();
    char text[40];
    int f = md_s3_xml_text(xml, size, "Key", text, sizeof text);
    if (f == 1 && strlen(text) >= sizeof text)
        abort();

    /* round trip 1: the input (up to a NUL, at most 300 bytes) as XML text */
    size_t len = strnlen(xml, size < 300 ? size : 300);
    char wrapped[300 * 10 + 16], back[301];
    size_t w = 0;
    w += (size_t)sprintf(wrapped + w, "<Key>");
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)xml[i];
        if (c == '&')
            w += (size_t)sprintf(wrapped + w, "&amp;");
        else if (c == '<')
            w += (size_t)sprintf(wrapped + w, (i & 1) ? "&lt;" : "&#60;");
        else if (c == '>')
            w += (size_t)sprintf(wrapped + w, "&gt;");
        else if (c == '"')
            w += (size_t)sprintf(wrapped + w, (i & 1) ? "&quot;" : "&#x22;");
        else if (c == '\'')
            w += (size_t)sprintf(wrapped + w, "&apos;");
        else
            wrapped[w++] = (char)c;
    }
    w += (size_t)sprintf(wrapped + w, "</Key>");
    if (md_s3_xml_text(wrapped, w, "Key", back, sizeof back) != 1 || strlen(back) != len ||
        memcmp(back, xml, len) != 0)
        abort();

    /* round trip 2: percent-encoding of a key */
    char enc[300 * 3 + 1], dec[301];
    long e = md_s3_uri_encode(enc, sizeof enc, xml, len, (size & 1) != 0);
    if (e < 0)
        abort();
    size_t d = 0;
    for (long i = 0; i < e; i++) {
        char c = enc[i];
        if (c == '%') {
            int hi = hexval(enc[i + 1]), lo = hexval(enc[i + 2]);
            if (hi < 0 || lo < 0)
                abort();
            dec[d++] = (char)(hi << 4 | lo);
            i += 2;
        } else if ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
                   c == '-' || c == '.' || c == '_' || c == '~' || (c == '/' && (size & 1))) {
            dec[d++] = c;
        } else {
            abort();
        }
    }
    if (d != len || memcmp(dec, xml, len) != 0)
        abort();
    return 0;
}
