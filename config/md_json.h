/*
 * md_json.h - a validating JSON skipper: walks one value where it lies,
 * builds nothing, and counts what jansson would build from it.
 *
 * jansson spends ~60-200 bytes of heap on every value and member (an empty
 * object is ~200), so a body of "[{},{},...]" grows ~80x in memory when it is
 * parsed, whether or not anything reads it. Readers of request bodies and
 * uploaded headers skip what they ignore with md_json_skip, and count what
 * they hand to jansson, so that memory is bounded before it is spent.
 *
 * The grammar is jansson's (RFC 8259, as json_loadb reads it without flags):
 * strings are valid UTF-8 without control characters or \u0000, surrogate
 * escapes come in pairs, numbers are -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?,
 * nesting is bounded. Unlike jansson it does not refuse an integer or a real
 * out of range (it never converts one). tests/fuzz_v2.c checks it against
 * jansson. Thread-safe: no state outside the caller's md_json_scan.
 */
#ifndef MD_JSON_H
#define MD_JSON_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MD_JSON_MAX_DEPTH 2048 /* jansson's JSON_PARSER_MAX_DEPTH */

typedef struct md_json_scan {
    size_t values;     /* every value skipped: objects, arrays, strings, numbers, literals */
    size_t containers; /* objects and arrays among them */
    size_t objects;    /* objects among those */
    size_t members;    /* object members (keys) */
    size_t bad;        /* after a failure: the offset of the byte that is not JSON */
} md_json_scan;

/* Index of the first byte at or after s[i] that is not JSON whitespace. */
size_t md_json_blank(const char *s, size_t len, size_t i);

/* Past the JSON string starting at s[i] == '"', validated: the index after
 * its closing quote, or 0 (sc->bad set) when it is not a valid string.
 * *escaped (may be NULL): it holds a backslash escape. */
size_t md_json_skip_string(const char *s, size_t len, size_t i, int *escaped, md_json_scan *sc);

/* Past the JSON value starting at s[i] (after blanks), validated and nested
 * at most `max_depth` (<= MD_JSON_MAX_DEPTH) deep: the index after it, or 0
 * with sc->bad set. Adds what it skipped to sc's counts. */
size_t md_json_skip(const char *s, size_t len, size_t i, int max_depth, md_json_scan *sc);

/* Whether s[0..len) is one JSON object or array and nothing but blanks
 * around it, as json_loadb(s, len, 0) reads it (ranges aside); counts into sc. */
int md_json_check(const char *s, size_t len, int max_depth, md_json_scan *sc);

#ifdef __cplusplus
}
#endif

#endif
