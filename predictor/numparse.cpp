// numparse.cpp - md_parse_double over fast_float; see numparse.h.
//
// Built without fast_float's headers (an image whose distribution lacks
// libfast-float-dev), the same calls fall back to strtod: exact too, only
// slower. md_numparse_backend() says which one a binary has.
#include "numparse.h"

#if defined(__has_include)
#if __has_include(<fast_float/fast_float.h>)
#define MD_HAVE_FAST_FLOAT 1
#endif
#endif

#ifdef MD_HAVE_FAST_FLOAT
#include <fast_float/fast_float.h>

#include <system_error>

extern "C" int md_parse_double(const char *first, const char *last, double *out)
{
    double v = 0.0;
    fast_float::from_chars_result r = fast_float::from_chars(first, last, v);
    // fast_float 3.9 answers +-inf with no error past double's range, as
    // strtod does (HUGE_VAL); newer releases say result_out_of_range, and
    // set the value the same way
    if (r.ptr != last || (r.ec != std::errc() && r.ec != std::errc::result_out_of_range))
        return -1;
    *out = v;
    return 0;
}

extern "C" int md_double_from_parts(uint64_t w, int64_t q, int neg, double *out)
{
    // Eisel-Lemire on the significand and exponent; power2 < 0 means the
    // 128-bit product could not decide the rounding, and the digits must
    // be compared (from_chars does that)
    fast_float::adjusted_mantissa am =
        fast_float::compute_float<fast_float::binary_format<double>>(q, w);
    if (am.power2 < 0)
        return -1;
    double v = 0.0;
    fast_float::to_float(neg != 0, am, v);
    *out = v;
    return 0;
}

extern "C" const char *md_numparse_backend(void) { return "fast_float"; }

#else
#include <cstdlib>
#include <cstring>
#include <memory>

extern "C" int md_parse_double(const char *first, const char *last, double *out)
{
    size_t n = (size_t)(last - first);
    char small[128];
    std::unique_ptr<char[]> big;
    char *buf = small;
    if (n >= sizeof small) {
        big.reset(new (std::nothrow) char[n + 1]);
        if (!big)
            return -1;
        buf = big.get();
    }
    std::memcpy(buf, first, n);
    buf[n] = '\0';
    char *end = nullptr;
    double v = std::strtod(buf, &end);
    if (n == 0 || end != buf + n)
        return -1;
    *out = v;
    return 0;
}

extern "C" int md_double_from_parts(uint64_t, int64_t, int, double *) { return -1; }

extern "C" const char *md_numparse_backend(void) { return "strtod"; }
#endif
