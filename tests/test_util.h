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
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

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

/* ---- temp files ----
 * Every temp path a test makes (temp_path, write_temp, or remember_temp for
 * one it made itself) is removed by remove_temps, a cmocka teardown, even
 * when the test fails half-way; the test's own unlink or rmdir covers the
 * passing path. At most 16 a test: past them a path is left behind. */
typedef struct md_test_temps {
    char paths[16][64];
    int n;
} md_test_temps;

static inline md_test_temps *md_test_temps_get(void)
{
    static md_test_temps temps; /* one program, one thread */
    return &temps;
}

static inline void remember_temp(const char *path)
{
    md_test_temps *t = md_test_temps_get();
    if (t->n < 16)
        snprintf(t->paths[t->n++], sizeof t->paths[0], "%s", path);
}

static inline int remove_temps(void **state)
{
    (void)state;
    md_test_temps *t = md_test_temps_get();
    for (int i = 0; i < t->n; i++)
        remove(t->paths[i]);
    t->n = 0;
    return 0;
}

/* A new empty temp file under /tmp, remembered; its path goes into `path`
 * (>= 64 bytes). */
static inline void temp_path(char *path)
{
    strcpy(path, "/tmp/modeld_test_XXXXXX");
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    remember_temp(path);
}

/* Write `len` bytes of `data` to a new temp file; its path goes into `path`. */
static inline void write_temp_n(char *path, const char *data, size_t len)
{
    temp_path(path);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(data, 1, len, f), len);
    assert_int_equal(fclose(f), 0);
}

/* Write the string `text` to a new temp file; its path goes into `path`. */
static inline void write_temp(char *path, const char *text)
{
    write_temp_n(path, text, strlen(text));
}

/* One PNG chunk (length, type, body, CRC) written to f: the tests build
 * small PNG files byte by byte with it (test_readers, test_image). */
static inline void png_chunk(FILE *f, const char *type, const unsigned char *body, uint32_t len)
{
    unsigned char be[4] = {len >> 24, len >> 16, len >> 8, len};
    fwrite(be, 1, 4, f);
    fwrite(type, 1, 4, f);
    fwrite(body, 1, len, f);
    uLong crc = crc32(crc32(0, (const Bytef *)type, 4), body, len);
    unsigned char c[4] = {crc >> 24, crc >> 16, crc >> 8, crc};
    fwrite(c, 1, 4, f);
}

#endif
