/*
 * numparse.h - decimal text to double, exactly rounded, at memory speed.
 *
 * A thin C header over fast_float (Debian libfast-float-dev, the
 * Eisel-Lemire algorithm with an exact fallback), as CONVENTIONS.md allows
 * for a measured C++ library. The request decoder (tensor.c) validates JSON's
 * number grammar itself and calls this only for the digits its own exact fast
 * path cannot take (more than 15 significant digits, or |exponent| > 22):
 * what json.dumps(x.tolist()) writes for float32 values. strtod did that
 * before at about 37 us a 784-value row; the differential fuzz target
 * tests/fuzz_number.c checks that the results are bit for bit strtod's.
 *
 * Thread safety: reentrant; no locale, no global state.
 */
#ifndef MD_NUMPARSE_H
#define MD_NUMPARSE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Parse the number in [first, last): JSON's grammar (an optional '-', digits,
 * an optional fraction and exponent), already checked by the caller. Stores
 * the correctly rounded double in *out (+-HUGE_VAL past its range, as strtod)
 * and returns 0; -1 when the text is not one whole number. */
int md_parse_double(const char *first, const char *last, double *out);

/* The double nearest to (neg ? -1 : 1) * w * 10^q, for a decimal significand
 * `w` of at most 19 digits that is exact (no digit of the text was dropped):
 * the decoder has already accumulated it, so the digits are not read twice.
 * Returns 0, or -1 in the rare case that needs the digits themselves (call
 * md_parse_double then). */
int md_double_from_parts(uint64_t w, int64_t q, int neg, double *out);

/* Write the shortest decimal that reads back as `v` (a float32) into buf
 * (`size` bytes, NUL-terminated) and return its length: std::to_chars, so
 * "0.1", "1e-08", "-0", "inf", "nan". Reentrant. */
int md_format_float(float v, char *buf, size_t size);

/* "fast_float", or "strtod" in a build made without its headers. */
const char *md_numparse_backend(void);

#ifdef __cplusplus
}
#endif
#endif
