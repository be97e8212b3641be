// numparse.cpp - md_parse_double over fast_float; see numparse.h.
//
// Built without fast_float's headers (an image whose distribution lacks
// libfast-float-dev), the same calls fall back to strtod: exact too, only
// slower. md_numparse_backend() says which one a binary has.
#include "numparse.h"

#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <system_error>

// The shortest digits that read back as the same float32, from libstdc++'s
// std::to_chars (GCC 11+, Ryu) in scientific form, written as %g writes them
// with a precision of max(6, digits): "0.1", "100", "16777216", "1e-08",
// "2.2886511e+11" (a plain to_chars would pick "228865114112", shorter in
// characters but with more digits than the value has).
extern "C" int md_format_float(float v, char *buf, size_t size)
{
    char sci[48];
    std::to_chars_result r = std::to_chars(sci, sci + sizeof sci, v, std::chars_format::scientific);
    if (r.ec != std::errc())
        return std::snprintf(buf, size, "%.9g", (double)v);
    *r.ptr = '\0';
    // sci: [-]d[.ddd]e(+|-)XX
    const char *p = sci;
    int neg = *p == '-';
    p += neg;
    char digits[24];
    int n = 0;
    for (; *p && *p != 'e'; p++)
        if (*p >= '0' && *p <= '9' && n < (int)sizeof digits)
            digits[n++] = *p;
    int e = *p == 'e' ? std::atoi(p + 1) : 0;
    while (n > 1 && digits[n - 1] == '0')
        n--;
    int prec = n > 6 ? n : 6;
    char out[64];
    int o = 0;
    if (neg)
        out[o++] = '-';
    if (e < -4 || e >= prec) {
        out[o++] = digits[0];
        if (n > 1) {
            out[o++] = '.';
            std::memcpy(out + o, digits + 1, (size_t)(n - 1));
            o += n - 1;
        }
        int ae = e < 0 ? -e : e;
        out[o++] = 'e';
        out[o++] = e < 0 ? '-' : '+';
        if (ae >= 100)
            out[o++] = (char)('0' + ae / 100);
        out[o++] = (char)('0' + ae / 10 % 10);
        out[o++] = (char)('0' + ae % 10);
    } else if (e < 0) {
        out[o++] = '0';
        out[o++] = '.';
        for (int i = -1; i > e; i--)
            out[o++] = '0';
        std::memcpy(out + o, digits, (size_t)n);
        o += n;
    } else {
        for (int i = 0; i <= e; i++)
            out[o++] = i < n ? digits[i] : '0';
        if (n > e + 1) {
            out[o++] = '.';
            std::memcpy(out + o, digits + e + 1, (size_t)(n - e - 1));
            o += n - e - 1;
        }
    }
    if (size == 0)
        return o;
    size_t w = (size_t)o < size - 1 ? (size_t)o : size - 1;
    std::memcpy(buf, out, w);
    buf[w] = '\0';
    return o;
}

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
