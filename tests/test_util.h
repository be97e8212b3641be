/*
 * test_util.h - cmocka helpers shared by the unit test programs
 * (tests/test_<module>.c). Include it after <cmocka.h>; everything here is
 * static inline, so a program that does not use a helper pays nothing.
 */
#ifndef MD_TEST_UTIL_H
#define MD_TEST_UTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <string.h>

/* Assert that `msg` contains every one of the NULL-terminated substrings
 * after it, failing with the message and the first one it lacks. */
static inline void assert_msg_has(const char *msg, ...)
{
    va_list ap;
    va_start(ap, msg);
    for (const char *want = va_arg(ap, const char *); want; want = va_arg(ap, const char *)) {
        if (!strstr(msg, want)) {
            va_end(ap);
            fail_msg("message \"%s\" lacks \"%s\"", msg, want);
        }
    }
    va_end(ap);
}

#endif
