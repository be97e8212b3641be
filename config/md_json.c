/*
 * md_json.c - the validating JSON skipper (md_json.h): one pass, no
 * allocation, an explicit stack of open containers so that depth costs no C
 * stack. See the header for the grammar and why it exists.
 */
#include "md_json.h"

#include <stdint.h>

static inline int blank(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

size_t md_json_blank(const char *s, size_t len, size_t i)
{
    while (i < len && blank(s[i]))
        i++;
    return i;
}

static size_t fail(md_json_scan *sc, size_t at)
{
    sc->bad = at;
    return 0;
}

static int hex4(const char *s, size_t len, size_t i, unsigned *out)
{
    unsigned v = 0;
    if (i + 4 > len)
        return 0;
    for (int k = 0; k < 4; k++) {
        char c = s[i + k];
        v <<= 4;
        if (c >= '0' && c <= '9')
            v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f')
            v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F')
            v |= (unsigned)(c - 'A' + 10);
        else
            return 0;
    }
    *out = v;
    return 1;
}

/* Length of the valid UTF-8 sequence at s[i] (a byte >= 0x80), or 0:
 * no overlong forms, no surrogates, nothing past U+10FFFF. */
static size_t utf8_len(const unsigned char *s, size_t len, size_t i)
{
    unsigned c = s[i];
    size_t n;
    unsigned lo = 0x80, hi = 0xbf;
    if (c >= 0xc2 && c <= 0xdf)
        n = 2;
    else if (c >= 0xe0 && c <= 0xef) {
        n = 3;
        if (c == 0xe0)
            lo = 0xa0;
        else if (c == 0xed)
            hi = 0x9f;
    } else if (c >= 0xf0 && c <= 0xf4) {
        n = 4;
        if (c == 0xf0)
            lo = 0x90;
        else if (c == 0xf4)
            hi = 0x8f;
    } else
        return 0;
    if (i + n > len || s[i + 1] < lo || s[i + 1] > hi)
        return 0;
    for (size_t k = 2; k < n; k++)
        if (s[i + k] < 0x80 || s[i + k] > 0xbf)
            return 0;
    return n;
}

size_t md_json_skip_string(const char *s, size_t len, size_t i, int *escaped, md_json_scan *sc)
{
    const unsigned char *u = (const unsigned char *)s;
    if (escaped)
        *escaped = 0;
    for (i++; i < len;) {
        unsigned c = u[i];
        if (c == '"')
            return i + 1;
        if (c < 0x20)
            return fail(sc, i);
        if (c < 0x80 && c != '\\') {
            i++;
            continue;
        }
        if (c >= 0x80) {
            size_t n = utf8_len(u, len, i);
            if (!n)
                return fail(sc, i);
            i += n;
            continue;
        }
        if (escaped)
            *escaped = 1;
        if (i + 1 >= len)
            return fail(sc, i);
        char e = s[i + 1];
        if (e == '"' || e == '\\' || e == '/' || e == 'b' || e == 'f' || e == 'n' || e == 'r' ||
            e == 't') {
            i += 2;
            continue;
        }
        unsigned cp, lo;
        if (e != 'u' || !hex4(s, len, i + 2, &cp) || cp == 0)
            return fail(sc, i);
        i += 6;
        if (cp >= 0xdc00 && cp <= 0xdfff)
            return fail(sc, i - 6); /* a low surrogate alone */
        if (cp >= 0xd800 && cp <= 0xdbff) {
            if (i + 6 > len || s[i] != '\\' || s[i + 1] != 'u' || !hex4(s, len, i + 2, &lo) ||
                lo < 0xdc00 || lo > 0xdfff)
                return fail(sc, i - 6);
            i += 6;
        }
    }
    return fail(sc, len);
}

static inline int digit(char c) { return (unsigned)(c - '0') < 10u; }

static size_t skip_number(const char *s, size_t len, size_t i, md_json_scan *sc)
{
    size_t start = i;
    if (i < len && s[i] == '-')
        i++;
    if (i >= len || !digit(s[i]))
        return fail(sc, start);
    if (s[i] == '0') {
        i++;
        if (i < len && digit(s[i]))
            return fail(sc, i);
    } else {
        while (i < len && digit(s[i]))
            i++;
    }
    if (i < len && s[i] == '.') {
        i++;
        if (i >= len || !digit(s[i]))
            return fail(sc, i);
        while (i < len && digit(s[i]))
            i++;
    }
    if (i < len && (s[i] == 'e' || s[i] == 'E')) {
        i++;
        if (i < len && (s[i] == '+' || s[i] == '-'))
            i++;
        if (i >= len || !digit(s[i]))
            return fail(sc, i);
        while (i < len && digit(s[i]))
            i++;
    }
    return i;
}

static size_t skip_literal(const char *s, size_t len, size_t i, md_json_scan *sc)
{
    static const char *const words[] = {"true", "false", "null"};
    for (int w = 0; w < 3; w++) {
        size_t n = w == 1 ? 5 : 4;
        if (i + n <= len && s[i] == words[w][0]) {
            for (size_t k = 1; k < n; k++)
                if (s[i + k] != words[w][k])
                    return fail(sc, i + k);
            return i + n;
        }
    }
    return fail(sc, i);
}

/* Past `"key" :` at s[i] (after blanks): the index after the colon, or 0. */
static size_t skip_key(const char *s, size_t len, size_t i, md_json_scan *sc)
{
    i = md_json_blank(s, len, i);
    if (i >= len || s[i] != '"')
        return fail(sc, i);
    if (!(i = md_json_skip_string(s, len, i, NULL, sc)))
        return 0;
    i = md_json_blank(s, len, i);
    if (i >= len || s[i] != ':')
        return fail(sc, i);
    sc->members++;
    return i + 1;
}

size_t md_json_skip(const char *s, size_t len, size_t i, int max_depth, md_json_scan *sc)
{
    char open[MD_JSON_MAX_DEPTH]; /* '{' or '[' for each open container */
    int depth = 0;
    if (max_depth > MD_JSON_MAX_DEPTH)
        max_depth = MD_JSON_MAX_DEPTH;
    for (;;) {
        /* a value starts at s[i] */
        i = md_json_blank(s, len, i);
        if (i >= len)
            return fail(sc, i);
        char c = s[i];
        sc->values++;
        if (c == '{' || c == '[') {
            if (depth >= max_depth)
                return fail(sc, i);
            open[depth++] = c;
            sc->containers++;
            sc->objects += c == '{';
            i = md_json_blank(s, len, i + 1);
            if (i < len && s[i] == (c == '{' ? '}' : ']')) {
                depth--;
                i++;
            } else {
                if (c == '{' && !(i = skip_key(s, len, i, sc)))
                    return 0;
                continue;
            }
        } else if (c == '"') {
            if (!(i = md_json_skip_string(s, len, i, NULL, sc)))
                return 0;
        } else if (c == '-' || digit(c)) {
            if (!(i = skip_number(s, len, i, sc)))
                return 0;
        } else if (!(i = skip_literal(s, len, i, sc))) {
            return 0;
        }
        /* after a value: close containers, or the next element */
        for (;;) {
            if (depth == 0)
                return i;
            i = md_json_blank(s, len, i);
            if (i >= len)
                return fail(sc, i);
            char top = open[depth - 1];
            if (s[i] == ',') {
                i++;
                if (top == '{' && !(i = skip_key(s, len, i, sc)))
                    return 0;
                break;
            }
            if (s[i] != (top == '{' ? '}' : ']'))
                return fail(sc, i);
            depth--;
            i++;
        }
    }
}

int md_json_check(const char *s, size_t len, int max_depth, md_json_scan *sc)
{
    size_t i = md_json_blank(s, len, 0);
    if (i >= len || (s[i] != '{' && s[i] != '[')) {
        fail(sc, i);
        return 0;
    }
    if (!(i = md_json_skip(s, len, i, max_depth, sc)))
        return 0;
    i = md_json_blank(s, len, i);
    if (i != len) {
        fail(sc, i);
        return 0;
    }
    return 1;
}
