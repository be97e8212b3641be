/*
 * test_tensor.c - unit tests of the request codecs in predictor/ (tensor.c, npy.c, v2.c):
 * md_tensor_decode over every JSON dialect (bare rows, {"instances"},
 * {"array", "shape"}), the exactness of its number scanner against
 * (float)strtod, every malformed input class with its md_status and a
 * message naming the row and column, md_npy_decode over hand-built NPY files,
 * md_npy_encode round trips and its 64-byte data alignment, and
 * md_float_format's shortest round-tripping output.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../predictor/numparse.h"
#include "../predictor/predictor.h"
#include "test_util.h"

#define BIG (1u << 24) /* max_values that never limits these tests */

/* ---- helpers ---- */

static md_status decode_ct(const char *body, size_t len, const char *ct, size_t max,
                           md_tensor *t, md_err *err)
{
    md_err_clear(err);
    memset(t, 0xA5, sizeof *t); /* decode must initialise out, even on failure */
    md_status st = md_tensor_decode(body, len, ct, max, t, err);
    if (st != MD_OK) {
        /* on failure nothing is left to free */
        assert_null(t->data);
        assert_int_equal(err->status, st);
    }
    return st;
}

static md_status decode(const char *body, md_tensor *t, md_err *err)
{
    return decode_ct(body, strlen(body), "application/json", BIG, t, err);
}

/* Decode `body` as JSON and expect `status` whose message has every substring given. */
#define EXPECT_FAIL(body, status, ...)                                                        \
    do {                                                                                      \
        md_tensor t_;                                                                         \
        md_err e_;                                                                            \
        md_status st_ = decode((body), &t_, &e_);                                             \
        if (st_ == MD_OK)                                                                     \
            md_tensor_free(&t_);                                                              \
        if (st_ != (status))                                                                  \
            fail_msg("%s: expected status %d, got %d (msg \"%s\")", (body), (int)(status),   \
                     (int)st_, e_.msg);                                                       \
        assert_null(strchr(e_.msg, '\n'));                                                    \
        assert_msg_has(e_.msg, __VA_ARGS__, NULL);                                            \
        md_tensor_free(&t_);                                                                  \
    } while (0)

/* Decode `body` and expect a tensor of the given shape and values. */
static void expect_tensor(const char *body, int ndim, const int64_t *shape, const float *vals,
                          size_t count)
{
    md_tensor t;
    md_err e;
    md_status st = decode(body, &t, &e);
    if (st != MD_OK)
        fail_msg("%s: expected MD_OK, got %d (%s)", body, (int)st, e.msg);
    assert_int_equal(t.ndim, ndim);
    for (int d = 0; d < ndim; d++)
        assert_int_equal(t.shape[d], shape[d]);
    assert_int_equal(t.count, count);
    for (size_t i = 0; i < count; i++)
        if (memcmp(&t.data[i], &vals[i], sizeof(float)) != 0)
            fail_msg("%s: value %zu is %.9g, want %.9g", body, i, (double)t.data[i],
                     (double)vals[i]);
    md_tensor_free(&t);
    assert_null(t.data);
    assert_int_equal(t.count, 0);
}

#define SHAPE(...) ((const int64_t[]){__VA_ARGS__})
#define VALS(...) ((const float[]){__VA_ARGS__})
#define NVALS(...) (sizeof((const float[]){__VA_ARGS__}) / sizeof(float))
#define EXPECT_TENSOR(body, ndim, shape, ...) \
    expect_tensor((body), (ndim), (shape), VALS(__VA_ARGS__), NVALS(__VA_ARGS__))

/* ---- dialects ---- */

static void test_bare_rows(void **state)
{
    (void)state;
    EXPECT_TENSOR("[[1, 2, 3], [4, 5, 6]]", 2, SHAPE(2, 3), 1, 2, 3, 4, 5, 6);
    EXPECT_TENSOR("[[0.5]]", 2, SHAPE(1, 1), 0.5f);
    /* a flat list is a 1-D tensor (the batcher makes it one row) */
    EXPECT_TENSOR("[1.5, -2, 3e2]", 1, SHAPE(3), 1.5f, -2.0f, 300.0f);
}

static void test_instances(void **state)
{
    (void)state;
    EXPECT_TENSOR("{\"instances\": [[1, 2], [3, 4]]}", 2, SHAPE(2, 2), 1, 2, 3, 4);
    EXPECT_TENSOR("{\"instances\":[[7]]}", 2, SHAPE(1, 1), 7);
}

static void test_array_and_shape(void **state)
{
    (void)state;
    EXPECT_TENSOR("{\"array\": [1, 2, 3, 4, 5, 6]}", 1, SHAPE(6), 1, 2, 3, 4, 5, 6);
    EXPECT_TENSOR("{\"array\": [1, 2, 3, 4, 5, 6], \"shape\": [2, 3]}", 2, SHAPE(2, 3), 1, 2, 3,
                  4, 5, 6);
    /* shape first, and a nested array reshaped */
    EXPECT_TENSOR("{\"shape\": [3, 2], \"array\": [[1, 2, 3], [4, 5, 6]]}", 2, SHAPE(3, 2), 1, 2,
                  3, 4, 5, 6);
    EXPECT_TENSOR("{\"array\": [1, 2, 3, 4], \"shape\": [1, 2, 1, 2]}", 4, SHAPE(1, 2, 1, 2), 1,
                  2, 3, 4);
    /* eight dimensions is the limit, and allowed */
    EXPECT_TENSOR("{\"array\": [1, 2], \"shape\": [1, 1, 1, 1, 1, 1, 1, 2]}", 8,
                  SHAPE(1, 1, 1, 1, 1, 1, 1, 2), 1, 2);
}

static void test_nested_3d(void **state)
{
    (void)state;
    EXPECT_TENSOR("[[[1, 2], [3, 4], [5, 6]], [[7, 8], [9, 10], [11, 12]]]", 3, SHAPE(2, 3, 2), 1,
                  2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12);
    EXPECT_TENSOR("{\"instances\": [[[1]], [[2]]]}", 3, SHAPE(2, 1, 1), 1, 2);
    /* eight levels of nesting are allowed */
    EXPECT_TENSOR("[[[[[[[[1, 2]]]]]]]]", 8, SHAPE(1, 1, 1, 1, 1, 1, 1, 2), 1, 2);
}

static void test_whitespace_everywhere(void **state)
{
    (void)state;
    EXPECT_TENSOR(" \t\r\n[ \n[ 1 ,\t2 ] ,\r\n [ 3\n,4\t]\n]\r\n\t ", 2, SHAPE(2, 2), 1, 2, 3, 4);
    EXPECT_TENSOR("\n{ \"instances\" \t:\r\n [ [ 1 , 2 ] ] \n}\n", 2, SHAPE(1, 2), 1, 2);
    EXPECT_TENSOR("{ \"array\" : [ 1 , 2 ] , \"shape\" : [ 2 , 1 ] }  ", 2, SHAPE(2, 1), 1, 2);
}

static void test_content_types(void **state)
{
    (void)state;
    const char *body = "[[1, 2]]";
    const char *ok[] = {NULL, "application/json", "application/json; charset=utf-8",
                        "APPLICATION/JSON", "text/plain", "application/x-www-form-urlencoded"};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        md_tensor t;
        md_err e;
        md_status st = decode_ct(body, strlen(body), ok[i], BIG, &t, &e);
        if (st != MD_OK)
            fail_msg("content type %s: %d (%s)", ok[i] ? ok[i] : "(null)", (int)st, e.msg);
        assert_int_equal(t.count, 2);
        md_tensor_free(&t);
    }
    const char *bad[] = {"text/csv", "application/xml", "image/png", "multipart/form-data"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        md_tensor t;
        md_err e;
        assert_int_equal(decode_ct(body, strlen(body), bad[i], BIG, &t, &e), MD_EMEDIA);
        assert_msg_has(e.msg, bad[i], "application/json", "application/x-npy", NULL);
    }
}

static void test_empty_body(void **state)
{
    (void)state;
    md_tensor t;
    md_err e;
    assert_int_equal(decode_ct("", 0, "application/json", BIG, &t, &e), MD_EINVAL);
    assert_msg_has(e.msg, "no body", NULL);
    assert_int_equal(decode_ct(NULL, 0, NULL, BIG, &t, &e), MD_EINVAL);
    /* whitespace only */
    assert_int_equal(decode_ct("  \n ", 4, NULL, BIG, &t, &e), MD_EINVAL);
    /* the length is honoured: a body cut to 0 bytes is empty */
    assert_int_equal(decode_ct("[[1]]", 0, NULL, BIG, &t, &e), MD_EINVAL);
}

static void test_length_is_honoured(void **state)
{
    (void)state;
    /* the bytes past len are not read */
    const char *body = "[[1, 2]]garbage";
    md_tensor t;
    md_err e;
    assert_int_equal(decode_ct(body, 8, NULL, BIG, &t, &e), MD_OK);
    assert_int_equal(t.count, 2);
    md_tensor_free(&t);
    /* a body cut short is truncated */
    assert_int_equal(decode_ct(body, 7, NULL, BIG, &t, &e), MD_EINVAL);
    assert_msg_has(e.msg, "row 0", "ends", NULL);
}

/* ---- numbers ---- */

/* Decode "[text]" and check the value is bit-identical to (float)strtod(text),
 * or that the decode fails when that is not a finite float. */
static void check_number(const char *text)
{
    char body[1200];
    snprintf(body, sizeof body, "[%s]", text);
    double d = strtod(text, NULL);
    float want = (float)d;
    md_tensor t;
    md_err e;
    md_status st = decode(body, &t, &e);
    if (!isfinite(want)) {
        if (st != MD_EINVAL)
            fail_msg("%s: out of float range, expected MD_EINVAL, got %d", text, (int)st);
        assert_msg_has(e.msg, "row 0", "float32 range", NULL);
        return;
    }
    if (st != MD_OK)
        fail_msg("%s: expected MD_OK, got %d (%s)", text, (int)st, e.msg);
    assert_int_equal(t.count, 1);
    uint32_t a, b;
    memcpy(&a, &t.data[0], 4);
    memcpy(&b, &want, 4);
    if (a != b)
        fail_msg("%s: decoded %.9g (0x%08x), (float)strtod gives %.9g (0x%08x)", text,
                 (double)t.data[0], a, (double)want, b);
    md_tensor_free(&t);
}

static void test_numbers_fixed(void **state)
{
    (void)state;
    static const char *const cases[] = {
        "0", "-0", "0.0", "-0.0", "1", "-1", "0.1", "0.2", "0.3", "1.5", "123", "-123.456",
        "3.14159265358979323846", "2.718281828459045", "1e0", "1E0", "1e1", "1e+1", "1e-1",
        "1E-1", "1.5e3", "1.5E+3", "-2.5e-3", "0e0", "0e10", "0.0e-10", "123456789",
        "16777216", "16777217", "16777218", "33554433", "9007199254740993",
        "9007199254740992", "18446744073709551615", "18446744073709551616",
        "1234567890123456789", "12345678901234567890", "123456789012345678901234567890",
        "0.12345678901234567890123", "1.00000000000000000000001",
        "0.000000000000000000000000000001", "1e22", "1e23", "1e-22", "1e-23", "4.5e15",
        "123456789012345e7", "123456789012345e-7", "1234567890123456e-7",
        "0.00000000000000000000000000000000000001175494350822287507968736537222245677818665556"
        "77246614899521180346062127", /* FLT_MIN */
        "1.17549435e-38", "1.1754942e-38", "1e-38", "1e-40", "1.4e-45", "1.401298464324817e-45",
        "7e-46", "7.1e-46", "1e-45", "1e-46", "1e-50", "1e-300", "1e-400", "2.2250738585072014e-308",
        "4.9e-324", "3.4028235e38", "3.40282346638528859811704183484516925440e+38",
        "3.4028235677973366e38", "3.4028236e38", "3.40282357e38", "340282356779733661637539395458142568448",
        "1e38", "1e39", "-1e39", "3.5e38", "1e308", "1e309", "-1e400", "1e99999", "1e-99999",
        "0.1e1", "100e-2", "0.000001", "1000000", "5e-324", "8388608.5", "8388609.5",
        "0.30000000000000004", "1.0000001", "1.00000005", "1.000000059604644775390625",
        "1.0000000596046447753906250000000001", "0.99999997", "0.999999970197677612304687",
        "2.2e-7", "6.103515625e-05", "65504", "65519.99", "1e10", "1e15", "1e16", "1e17",
        "12345678.9", "0.1234567890123456", "99999999999999999999", "-99999999999999999999e-20",
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        check_number(cases[i]);
}

static void test_minus_zero(void **state)
{
    (void)state;
    md_tensor t;
    md_err e;
    assert_int_equal(decode("[-0, 0, -0.0, -0e5]", &t, &e), MD_OK);
    assert_true(signbit(t.data[0]));
    assert_false(signbit(t.data[1]));
    assert_true(signbit(t.data[2]));
    assert_true(signbit(t.data[3]));
    assert_true(t.data[0] == 0.0f);
    md_tensor_free(&t);
}

static void test_long_mantissas(void **state)
{
    (void)state;
    char buf[1100];
    /* 20..1000-digit integers and fractions, past the 19-digit fast path and the 128-byte copy */
    for (int len = 20; len <= 1000; len += 7) {
        for (int i = 0; i < len; i++)
            buf[i] = (char)('0' + (i * 7 + len) % 10);
        if (buf[0] == '0')
            buf[0] = '7';
        buf[len] = '\0';
        check_number(buf); /* huge integers past 39 digits are out of float range */
        /* 0.xxxxx */
        memmove(buf + 2, buf, (size_t)len + 1);
        buf[0] = '0';
        buf[1] = '.';
        check_number(buf);
        /* x.xxxxxe-30 */
        buf[0] = buf[2];
        buf[1] = '.';
        buf[2] = '5';
        strcat(buf, "e-30");
        check_number(buf);
    }
    /* a halfway case decided only by a digit far past the 19th */
    check_number("1.000000059604644775390625000000000000000000000000000000001");
    check_number("1.000000059604644775390624999999999999999999999999999999999");
    check_number("16777217.000000000000000000000000000000000001");
    check_number("16777216.999999999999999999999999999999999999");
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ULL;
static uint64_t rnd(void)
{
    /* xorshift64* */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 2685821657736338717ULL;
}

static void test_numbers_random(void **state)
{
    (void)state;
    char text[64];
    for (int i = 0; i < 200000; i++) {
        int n = 0;
        if (rnd() & 1)
            text[n++] = '-';
        int digits = 1 + (int)(rnd() % 25);
        int point = (int)(rnd() % (uint64_t)(digits + 1)); /* digits before the point */
        int lead = (int)(rnd() % 10);                        /* leading zeros after "0." */
        if (point == 0) {
            text[n++] = '0';
            text[n++] = '.';
            for (int k = 0; k < lead % 4; k++)
                text[n++] = '0';
        }
        for (int k = 0; k < digits; k++) {
            if (k == point && point > 0)
                text[n++] = '.';
            char c = (char)('0' + rnd() % 10);
            if (k == 0 && point > 0 && c == '0')
                c = '1';
            text[n++] = c;
        }
        if (text[n - 1] == '.')
            text[n++] = '0';
        if (rnd() % 3 == 0) {
            int ex = (int)(rnd() % 100) - 50;
            n += snprintf(text + n, sizeof text - (size_t)n, "%c%s%d", rnd() & 1 ? 'e' : 'E',
                          ex >= 0 && (rnd() & 1) ? "+" : "", ex);
        }
        text[n] = '\0';
        check_number(text);
    }
    /* every float printed with 9, 8 and 17 significant digits reads back */
    for (int i = 0; i < 100000; i++) {
        uint32_t bits = (uint32_t)rnd();
        float f;
        memcpy(&f, &bits, 4);
        if (!isfinite(f))
            continue;
        snprintf(text, sizeof text, "%.9g", (double)f);
        check_number(text);
        snprintf(text, sizeof text, "%.8e", (double)f);
        check_number(text);
        snprintf(text, sizeof text, "%.17g", (double)f);
        check_number(text);
    }
}

/* md_parse_double (fast_float) equals strtod bit for bit as a double, not
 * only after the cast to float the decoder makes. */
static void check_double(const char *text)
{
    double want = strtod(text, NULL), got = -1.0;
    if (md_parse_double(text, text + strlen(text), &got) != 0)
        fail_msg("%s: md_parse_double refused a JSON number", text);
    if (memcmp(&want, &got, sizeof want) != 0)
        fail_msg("%s: md_parse_double gives %.17g, strtod %.17g", text, got, want);
}

/* Numbers long enough for the decoder's eight-digits-at-a-time step, in the
 * integer part, the fraction, after leading zeros, past 19 digits and at a
 * body's end: each decodes to (float)strtod of its text. */
static void test_decode_eight_digit_steps(void **state)
{
    (void)state;
    static const char *const nums[] = {
        "12345678", "123456789", "1234567890123456", "12345678901234567890",
        "123456789012345678901234567890", "0.12345678", "0.0039215688593685627",
        "0.00000000012345678901234567", "99999999.99999999", "1.0000000000000000001",
        "0.99999999999999999999", "-0.0078431377187371254", "12345678.87654321e-3",
        "0.000000000000000000000000000000000000011754943508222875",
        "340282346638528859811704183484516925440", "1e-45", "0.00000000",
        "00000000",
    };
    for (size_t i = 0; i < sizeof nums / sizeof nums[0]; i++) {
        char body[256];
        /* at the end of the body and followed by more text */
        for (int tail = 0; tail < 2; tail++) {
            snprintf(body, sizeof body, tail ? "[%s, 1.5]" : "[%s]", nums[i]);
            md_tensor t;
            md_err err;
            md_status st = decode_ct(body, strlen(body), NULL, BIG, &t, &err);
            if (strcmp(nums[i], "00000000") == 0) {
                assert_int_equal(st, MD_EINVAL); /* JSON has no leading zeros */
                continue;
            }
            if (st != MD_OK)
                fail_msg("%s: %s", body, err.msg);
            float want = (float)strtod(nums[i], NULL);
            if (memcmp(&t.data[0], &want, 4) != 0)
                fail_msg("%s decoded as %.9g, strtod says %.9g", nums[i], (double)t.data[0],
                         (double)want);
            md_tensor_free(&t);
        }
    }
}

/* Every length of digit run the decoder reads in one step (1..8 digits of
 * an 8-byte load, then the rest) in the integer part, after leading zeros of
 * the fraction and in the fraction, with blanks or a comma or the body's end
 * after the number: each decodes to (float)strtod of its text. */
static void test_decode_digit_runs(void **state)
{
    (void)state;
    static const char digits[] = "9876543210123456789098765432101234567";
    int checked = 0;
    for (int ints = 0; ints <= 24; ints++)
        for (int zeros = 0; zeros <= 11; zeros++)
            for (int frac = 0; frac <= 24; frac++) {
                if (ints == 0 && zeros == 0 && frac == 0)
                    continue;
                if (frac == 0 && zeros > 0)
                    continue;
                char num[96];
                int n = 0;
                if (ints == 0)
                    num[n++] = '0';
                else
                    for (int i = 0; i < ints; i++)
                        num[n++] = digits[i];
                if (zeros + frac > 0) {
                    num[n++] = '.';
                    for (int i = 0; i < zeros; i++)
                        num[n++] = '0';
                    for (int i = 0; i < frac; i++)
                        num[n++] = digits[(i + ints + 3) % 30];
                }
                num[n] = '\0';
                float want = (float)strtod(num, NULL);
                for (int tail = 0; tail < 3; tail++) {
                    char body[160];
                    snprintf(body, sizeof body, tail == 0 ? "[%s]" : tail == 1 ? "[%s,7]" : "[%s  ]",
                             num);
                    md_tensor t;
                    md_err err;
                    md_status st = decode_ct(body, strlen(body), NULL, BIG, &t, &err);
                    if (!isfinite(want)) {
                        assert_int_not_equal(st, MD_OK);
                        continue;
                    }
                    if (st != MD_OK)
                        fail_msg("%s: %s", body, err.msg);
                    if (memcmp(&t.data[0], &want, 4) != 0)
                        fail_msg("%s decoded as %.9g, strtod says %.9g", body,
                                 (double)t.data[0], (double)want);
                    md_tensor_free(&t);
                    checked++;
                }
            }
    assert_true(checked > 3000);
}

static void test_parse_double_matches_strtod(void **state)
{
    (void)state;
    static const char *const cases[] = {
        "0", "-0", "0.0039215688593685627", "2.2250738585072011e-308", "2.2250738585072014e-308",
        "4.9406564584124654e-324", "2.4703282292062327e-324", "2.4703282292062328e-324",
        "1.7976931348623157e308", "1.7976931348623158e308", "1.7976931348623159e308", "1e309",
        "-1e309", "1e-400", "-1e-400", "1e99999999999999999999", "9007199254740993",
        "9007199254740992.9999999999999999999999", "7.2057594037927933e16",
        "0.1", "0.30000000000000004", "123456789012345678901234567890e-30",
        "1.00000000000000011102230246251565404236316680908203125",
        "1.00000000000000011102230246251565404236316680908203124",
        "1.00000000000000011102230246251565404236316680908203126",
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        check_double(cases[i]);
    char text[64];
    for (int i = 0; i < 100000; i++) {
        uint64_t bits = rnd();
        double d;
        memcpy(&d, &bits, 8);
        if (!isfinite(d))
            continue;
        snprintf(text, sizeof text, "%.17g", d);
        check_double(text);
        snprintf(text, sizeof text, "%.16e", d);
        check_double(text);
        /* a float32 as Python prints it: json.dumps(x.tolist()) */
        float f = (float)d;
        if (isfinite(f)) {
            snprintf(text, sizeof text, "%.17g", (double)f);
            check_double(text);
        }
    }
    /* text that is not one whole number is refused */
    double v;
    assert_int_equal(md_parse_double("1x", (const char *)"1x" + 2, &v), -1);
    assert_int_equal(md_parse_double("", (const char *)"", &v), -1);
}

static void test_out_of_float_range(void **state)
{
    (void)state;
    EXPECT_FAIL("[[1, 3.5e38]]", MD_EINVAL, "row 0, column 1", "float32 range");
    EXPECT_FAIL("[[1, 2], [-1e39, 0]]", MD_EINVAL, "row 1, column 0", "float32 range");
    EXPECT_FAIL("[[1e400]]", MD_EINVAL, "row 0, column 0", "float32 range");
    EXPECT_FAIL("[[1e99999999999999]]", MD_EINVAL, "row 0, column 0", "float32 range");
    /* tiny magnitudes underflow to zero or a subnormal, as strtof does: not an error */
    EXPECT_TENSOR("[[1e-50, -1e-400, 1e-99999999]]", 2, SHAPE(1, 3), 0.0f, -0.0f, 0.0f);
    EXPECT_TENSOR("[[1e-45]]", 2, SHAPE(1, 1), 1e-45f);
}

/* ---- malformed JSON ---- */

static void test_ragged_rows(void **state)
{
    (void)state;
    /* a shorter row */
    EXPECT_FAIL("[[1, 2, 3], [4, 5]]", MD_EINVAL, "row 1", "ragged", "2", "3");
    /* a longer row */
    EXPECT_FAIL("[[1, 2], [3, 4], [5, 6, 7]]", MD_EINVAL, "row 2", "ragged");
    /* an array where a number is expected */
    EXPECT_FAIL("[[1, 2], [3, [4]]]", MD_EINVAL, "row 1, column 1", "found an array");
    /* a number where an array is expected */
    EXPECT_FAIL("[[1, 2], 3]", MD_EINVAL, "row 1", "found a number");
    EXPECT_FAIL("[1, [2]]", MD_EINVAL, "row 1", "found an array");
    /* ragged at the third level */
    EXPECT_FAIL("[[[1, 2], [3, 4]], [[5, 6], [7]]]", MD_EINVAL, "row 1, column 1", "ragged");
    EXPECT_FAIL("[[[1, 2], [3, 4]], [[5, 6]]]", MD_EINVAL, "row 1", "ragged");
    EXPECT_FAIL("[[[1]], [2]]", MD_EINVAL, "row 1, column 0", "found a number");
    EXPECT_FAIL("{\"instances\": [[1, 2], [3]]}", MD_EINVAL, "row 1", "ragged");
}

static void test_non_numbers(void **state)
{
    (void)state;
    EXPECT_FAIL("[[1, \"2\"]]", MD_EINVAL, "row 0, column 1", "string");
    EXPECT_FAIL("[[1, 2], [3, \"x\"]]", MD_EINVAL, "row 1, column 1", "string");
    EXPECT_FAIL("[[NaN]]", MD_EINVAL, "row 0, column 0", "NaN");
    EXPECT_FAIL("[[1, 2], [Infinity, 1]]", MD_EINVAL, "row 1, column 0", "Infinity");
    EXPECT_FAIL("[[1, -Infinity]]", MD_EINVAL, "row 0, column 1", "Infinity");
    EXPECT_FAIL("[[1, 2, null]]", MD_EINVAL, "row 0, column 2", "null");
    EXPECT_FAIL("[[true]]", MD_EINVAL, "row 0, column 0", "true/false");
    EXPECT_FAIL("[[0, false]]", MD_EINVAL, "row 0, column 1", "true/false");
    EXPECT_FAIL("[[1], [{\"a\": 1}]]", MD_EINVAL, "row 1, column 0", "object");
    EXPECT_FAIL("[[1, x]]", MD_EINVAL, "row 0, column 1", "expected a number");
    /* the first row goes fast after its first number: the same positions */
    EXPECT_FAIL("[[1, 2 3]]", MD_EINVAL, "row 0, column 1", "expected ',' or ']'");
    EXPECT_FAIL("[[1, 2, 3, [4]]]", MD_EINVAL, "row 0, column 3", "ragged");
    EXPECT_FAIL("[1, 2, 3, x]", MD_EINVAL, "row 3", "expected a number");
    /* JSON number grammar: no '+', no leading '.', no bare '-', digits after '.' and 'e' */
    EXPECT_FAIL("[[+1]]", MD_EINVAL, "row 0, column 0");
    EXPECT_FAIL("[[.5]]", MD_EINVAL, "row 0, column 0");
    EXPECT_FAIL("[[1, -]]", MD_EINVAL, "row 0, column 1");
    EXPECT_FAIL("[[1.]]", MD_EINVAL, "row 0, column 0");
    EXPECT_FAIL("[[1e]]", MD_EINVAL, "row 0, column 0");
    EXPECT_FAIL("[[1e+]]", MD_EINVAL, "row 0, column 0");
    EXPECT_FAIL("[[01]]", MD_EINVAL, "row 0, column 0");
    EXPECT_FAIL("[[1 2]]", MD_EINVAL, "row 0, column 0", "expected ',' or ']'");
    EXPECT_FAIL("[[0x10]]", MD_EINVAL, "row 0, column 0");
}

static void test_trailing_commas(void **state)
{
    (void)state;
    EXPECT_FAIL("[[1, 2,]]", MD_EINVAL, "row 0, column 2");
    EXPECT_FAIL("[[1, 2], [3, 4],]", MD_EINVAL, "row 2");
    EXPECT_FAIL("[1, 2,]", MD_EINVAL, "row 2");
    EXPECT_FAIL("[[1,, 2]]", MD_EINVAL, "row 0, column 1");
    EXPECT_FAIL("[,]", MD_EINVAL, "row 0");
    EXPECT_FAIL("{\"instances\": [[1]],}", MD_EINVAL, "key");
}

static void test_truncated(void **state)
{
    (void)state;
    EXPECT_FAIL("[[1, 2], [3, 4]", MD_EINVAL, "row 1", "ends");
    EXPECT_FAIL("[[1, 2], [3, 4", MD_EINVAL, "row 1, column 1", "ends");
    EXPECT_FAIL("[[1, 2], [3,", MD_EINVAL, "row 1, column 1", "ends");
    EXPECT_FAIL("[[1, 2], [", MD_EINVAL, "row 1", "ends");
    EXPECT_FAIL("[[1, 2],", MD_EINVAL, "row 1", "ends");
    EXPECT_FAIL("[", MD_EINVAL, "row 0", "ends");
    EXPECT_FAIL("[[", MD_EINVAL, "row 0", "ends");
    EXPECT_FAIL("[[1.5", MD_EINVAL, "row 0, column 0", "ends");
    EXPECT_FAIL("{\"instances\": [[1, 2]]", MD_EINVAL, "not valid JSON");
    EXPECT_FAIL("{\"instances\": ", MD_EINVAL, "array of rows");
    EXPECT_FAIL("{\"instances\"", MD_EINVAL, "not valid JSON");
    EXPECT_FAIL("{\"inst", MD_EINVAL, "not valid JSON");
    EXPECT_FAIL("{", MD_EINVAL, "not valid JSON");
    EXPECT_FAIL("{\"array\": [1, 2], \"shape\": [2", MD_EINVAL, "shape");
}

static void test_trailing_garbage(void **state)
{
    (void)state;
    EXPECT_FAIL("[[1, 2]] x", MD_EINVAL, "after the JSON value", "byte 9");
    EXPECT_FAIL("[[1, 2]]]", MD_EINVAL, "after the JSON value", "byte 8");
    EXPECT_FAIL("[[1]][[2]]", MD_EINVAL, "after the JSON value", "byte 5");
    EXPECT_FAIL("{\"instances\": [[1]]} {}", MD_EINVAL, "after the JSON value");
    EXPECT_FAIL("[[1]]\n\n,", MD_EINVAL, "after the JSON value");
}

static void test_trailing_nul_byte(void **state)
{
    (void)state;
    md_tensor t;
    md_err e;
    assert_int_equal(decode_ct("[[1]]\0", 6, NULL, BIG, &t, &e), MD_EINVAL);
    assert_msg_has(e.msg, "after the JSON value", NULL);
}

static void test_empty_arrays(void **state)
{
    (void)state;
    EXPECT_FAIL("[]", MD_EINVAL, "no rows");
    EXPECT_FAIL("  [ ]  ", MD_EINVAL, "no rows");
    EXPECT_FAIL("[[]]", MD_EINVAL, "row 0", "empty array");
    EXPECT_FAIL("[[1], []]", MD_EINVAL, "row 1", "empty array");
    EXPECT_FAIL("{\"instances\": []}", MD_EINVAL, "no rows");
    EXPECT_FAIL("{\"array\": [[]]}", MD_EINVAL, "row 0", "empty array");
}

static void test_not_an_array(void **state)
{
    (void)state;
    EXPECT_FAIL("1", MD_EINVAL, "JSON array of rows");
    EXPECT_FAIL("\"x\"", MD_EINVAL, "JSON array of rows");
    EXPECT_FAIL("null", MD_EINVAL, "JSON array of rows");
    EXPECT_FAIL("{\"instances\": 5}", MD_EINVAL, "JSON array of rows");
    EXPECT_FAIL("{\"instances\": {\"a\": 1}}", MD_EINVAL, "JSON array of rows");
}

static void test_object_keys(void **state)
{
    (void)state;
    EXPECT_FAIL("{\"inputs\": [[1]]}", MD_EINVAL, "unknown key \"inputs\"", "instances", "array");
    EXPECT_FAIL("{\"instances\": [[1]], \"extra\": 1}", MD_EINVAL, "unknown key \"extra\"");
    EXPECT_FAIL("{\"instances\": [[1]], \"array\": [[1]]}", MD_EINVAL, "only one", "instances",
                "array");
    EXPECT_FAIL("{\"array\": [1], \"instances\": [[1]]}", MD_EINVAL, "only one");
    EXPECT_FAIL("{\"instances\": [[1]], \"instances\": [[2]]}", MD_EINVAL, "only one");
    EXPECT_FAIL("{}", MD_EINVAL, "key");
    EXPECT_FAIL("{\"shape\": [1]}", MD_EINVAL, "no \"instances\" or \"array\"");
    EXPECT_FAIL("{instances: [[1]]}", MD_EINVAL, "not valid JSON");
    EXPECT_FAIL("{\"instances\" [[1]]}", MD_EINVAL, "not valid JSON", "':'");
    EXPECT_FAIL("{\"instances\": [[1]] \"shape\": [1, 1]}", MD_EINVAL, "not valid JSON");
}

static void test_shape_errors(void **state)
{
    (void)state;
    EXPECT_FAIL("{\"array\": [1, 2, 3, 4, 5, 6], \"shape\": [4, 2]}", MD_EINVAL, "shape holds 8",
                "has 6");
    EXPECT_FAIL("{\"array\": [1, 2, 3], \"shape\": [2]}", MD_EINVAL, "shape holds 2", "has 3");
    EXPECT_FAIL("{\"array\": [1], \"shape\": [0]}", MD_EINVAL, "positive");
    EXPECT_FAIL("{\"array\": [1], \"shape\": [1, 0]}", MD_EINVAL, "positive");
    EXPECT_FAIL("{\"array\": [1], \"shape\": [-1]}", MD_EINVAL, "positive");
    EXPECT_FAIL("{\"array\": [1], \"shape\": [1.5]}", MD_EINVAL, "integers");
    EXPECT_FAIL("{\"array\": [1], \"shape\": []}", MD_EINVAL, "shape");
    EXPECT_FAIL("{\"array\": [1], \"shape\": 1}", MD_EINVAL, "shape");
    EXPECT_FAIL("{\"array\": [1], \"shape\": [\"1\"]}", MD_EINVAL, "shape");
    EXPECT_FAIL("{\"array\": [1], \"shape\": [1, 1, 1, 1, 1, 1, 1, 1, 1]}", MD_EINVAL, "8");
}

static void test_shape_product_overflow(void **state)
{
    (void)state;
    /* (2^32+1)(2^32-1)(2^32+1)(2^32-1) = (2^64-1)^2 == 1 mod 2^64: a shape whose
     * product wraps around to the data count must still be refused */
    EXPECT_FAIL("{\"array\": [5], \"shape\": [4294967297, 4294967295, 4294967297, 4294967295]}",
                MD_EINVAL, "shape");
    /* 2^62 * 4 == 0 mod 2^64 */
    EXPECT_FAIL("{\"array\": [5], \"shape\": [4611686018427387904, 4]}", MD_EINVAL, "shape");
}

static void test_shape_dim_past_int64(void **state)
{
    (void)state;
    /* dimensions past int64 (casting 1e300 or 2^63 to int64_t is undefined
     * behaviour; -fsanitize=float-cast-overflow reports it) */
    EXPECT_FAIL("{\"array\": [5], \"shape\": [1e300]}", MD_EINVAL, "shape");
    EXPECT_FAIL("{\"array\": [5, 6], \"shape\": [9223372036854775808, 2, 1]}", MD_EINVAL,
                "shape");
}

static void test_too_deep(void **state)
{
    (void)state;
    EXPECT_FAIL("[[[[[[[[[1]]]]]]]]]", MD_EINVAL, "8 dimensions");
    /* a deep attack never recurses past the limit */
    size_t n = 100000;
    char *body = malloc(n + 1);
    memset(body, '[', n);
    body[n] = '\0';
    EXPECT_FAIL(body, MD_EINVAL, "8 dimensions");
    free(body);
}

static void test_max_values(void **state)
{
    (void)state;
    md_tensor t;
    md_err e;
    const char *body = "[[1, 2], [3, 4], [5, 6]]";
    /* exactly at the limit */
    assert_int_equal(decode_ct(body, strlen(body), NULL, 6, &t, &e), MD_OK);
    assert_int_equal(t.count, 6);
    md_tensor_free(&t);
    /* one past it */
    assert_int_equal(decode_ct(body, strlen(body), NULL, 5, &t, &e), MD_ETOOBIG);
    assert_msg_has(e.msg, "more than 5", NULL);
    assert_int_equal(decode_ct(body, strlen(body), NULL, 0, &t, &e), MD_ETOOBIG);
    /* a bad element where the values are exactly at the limit is named as
     * itself, not as one value too many (a row after the first goes through
     * the scanner's fast path: it must check the limit only for a number) */
    static const struct {
        const char *body, *has;
        size_t max;
    } at_limit[] = {
        {"[[1, 2], [NaN]]", "row 1, column 0: NaN and Infinity are not allowed", 2},
        {"[[1, 2], [\"a\"]]", "row 1, column 0: a string is not a number", 2},
        {"[[1, 2], [1e39]]", "row 1, column 0: the number is outside the float32 range", 2},
        {"[[1, 2], [3, 4, ]]", "row 1, column 2: expected a number", 4},
    };
    for (size_t i = 0; i < sizeof at_limit / sizeof at_limit[0]; i++) {
        const char *b = at_limit[i].body;
        assert_int_equal(decode_ct(b, strlen(b), NULL, at_limit[i].max, &t, &e), MD_EINVAL);
        assert_msg_has(e.msg, at_limit[i].has, NULL);
    }
    /* past the first 1024-value chunk */
    size_t n = 3000;
    char *big = malloc(n * 3 + 8);
    size_t k = 0;
    big[k++] = '[';
    for (size_t i = 0; i < n; i++)
        k += (size_t)sprintf(big + k, "%s%d", i ? "," : "", (int)(i % 10));
    big[k++] = ']';
    big[k] = '\0';
    assert_int_equal(decode_ct(big, k, NULL, 3000, &t, &e), MD_OK);
    assert_int_equal(t.count, 3000);
    for (size_t i = 0; i < n; i++)
        assert_true(t.data[i] == (float)(i % 10));
    md_tensor_free(&t);
    assert_int_equal(decode_ct(big, k, NULL, 2999, &t, &e), MD_ETOOBIG);
    assert_int_equal(decode_ct(big, k, NULL, 1500, &t, &e), MD_ETOOBIG);
    /* the same limit through the object dialects */
    const char *obj = "{\"array\": [1, 2, 3], \"shape\": [3]}";
    assert_int_equal(decode_ct(obj, strlen(obj), NULL, 2, &t, &e), MD_ETOOBIG);
    free(big);
}

/* ---- NPY ---- */

/* Build an NPY v1 file: magic, version, header dict padded so the data starts
 * on a 64-byte boundary, then `nbytes` of data. */
static char *npy_build(const char *descr, const char *fortran, const char *shape,
                       const void *data, size_t nbytes, size_t *len)
{
    char dict[256];
    int h = snprintf(dict, sizeof dict, "{'descr': '%s', 'fortran_order': %s, 'shape': %s, }",
                     descr, fortran, shape);
    size_t hl = (size_t)h + 1;
    hl += (64 - (10 + hl) % 64) % 64;
    *len = 10 + hl + nbytes;
    char *b = malloc(*len + 1);
    memcpy(b, "\x93NUMPY\x01\x00", 8);
    b[8] = (char)(hl & 0xff);
    b[9] = (char)(hl >> 8);
    memset(b + 10, ' ', hl);
    memcpy(b + 10, dict, (size_t)h);
    b[10 + hl - 1] = '\n';
    if (nbytes)
        memcpy(b + 10 + hl, data, nbytes);
    return b;
}

static void npy_expect(const char *descr, const char *shape_text, const void *data,
                       size_t nbytes, int ndim, const int64_t *shape, const float *want,
                       size_t count)
{
    size_t len;
    char *b = npy_build(descr, "False", shape_text, data, nbytes, &len);
    md_tensor t;
    md_err e;
    md_err_clear(&e);
    md_status st = md_npy_decode(b, len, BIG, &t, &e);
    if (st != MD_OK)
        fail_msg("npy %s %s: %d (%s)", descr, shape_text, (int)st, e.msg);
    assert_int_equal(t.ndim, ndim);
    for (int d = 0; d < ndim; d++)
        assert_int_equal(t.shape[d], shape[d]);
    assert_int_equal(t.count, count);
    for (size_t i = 0; i < count; i++)
        if (memcmp(&t.data[i], &want[i], 4) != 0)
            fail_msg("npy %s: value %zu is %.9g, want %.9g", descr, i, (double)t.data[i],
                     (double)want[i]);
    md_tensor_free(&t);
    /* the same through md_tensor_decode's content type */
    md_err_clear(&e);
    assert_int_equal(md_tensor_decode(b, len, "application/x-npy", BIG, &t, &e), MD_OK);
    assert_int_equal(t.count, count);
    md_tensor_free(&t);
    free(b);
}

static md_status npy_try(const char *descr, const char *fortran, const char *shape,
                         const void *data, size_t nbytes, size_t cut, size_t max, md_err *e)
{
    size_t len;
    char *b = npy_build(descr, fortran, shape, data, nbytes, &len);
    md_tensor t;
    md_err_clear(e);
    md_status st = md_npy_decode(b, len - cut, max, &t, e);
    if (st == MD_OK)
        md_tensor_free(&t);
    else
        assert_null(t.data);
    free(b);
    return st;
}

static void test_npy_dtypes(void **state)
{
    (void)state;
    const float f4[] = {1.5f, -2.25f, 0.1f, 3.4028235e38f, -0.0f, 1e-45f};
    npy_expect("<f4", "(2, 3)", f4, sizeof f4, 2, SHAPE(2, 3), f4, 6);
    npy_expect("|f4", "(6,)", f4, sizeof f4, 1, SHAPE(6), f4, 6);

    const double f8[] = {0.1, -1e10, 1e-300, 2.5};
    const float f8w[] = {0.1f, -1e10f, 0.0f, 2.5f};
    npy_expect("<f8", "(2, 2)", f8, sizeof f8, 2, SHAPE(2, 2), f8w, 4);

    const int64_t i8[] = {0, -1, 16777217, INT64_MAX, INT64_MIN, 42};
    const float i8w[] = {0.0f, -1.0f, 16777216.0f, (float)INT64_MAX, (float)INT64_MIN, 42.0f};
    npy_expect("<i8", "(3, 2)", i8, sizeof i8, 2, SHAPE(3, 2), i8w, 6);

    const int32_t i4[] = {7, -7, INT32_MAX, INT32_MIN};
    const float i4w[] = {7.0f, -7.0f, (float)INT32_MAX, (float)INT32_MIN};
    npy_expect("<i4", "(1, 2, 2)", i4, sizeof i4, 3, SHAPE(1, 2, 2), i4w, 4);

    const uint8_t u1[] = {0, 1, 127, 128, 255, 3};
    const float u1w[] = {0, 1, 127, 128, 255, 3};
    npy_expect("|u1", "(2, 3)", u1, sizeof u1, 2, SHAPE(2, 3), u1w, 6);

    const uint8_t b1[] = {1, 0, 0, 1};
    const float b1w[] = {1, 0, 0, 1};
    npy_expect("|b1", "(4, 1)", b1, sizeof b1, 2, SHAPE(4, 1), b1w, 4);

    /* a header written without spaces, keys in another order */
    const float one[] = {9.0f};
    size_t len;
    char *b = npy_build("<f4", "False", "(1, 1)", one, 4, &len);
    const char hdr[] = "{'shape':(1,1),'fortran_order':False,'descr':'<f4'}";
    size_t hl = (size_t)(unsigned char)b[8] | (size_t)(unsigned char)b[9] << 8;
    memset(b + 10, ' ', hl - 1);
    memcpy(b + 10, hdr, sizeof hdr - 1);
    md_tensor t;
    md_err e;
    assert_int_equal(md_npy_decode(b, len, BIG, &t, &e), MD_OK);
    assert_int_equal(t.ndim, 2);
    assert_true(t.data[0] == 9.0f);
    md_tensor_free(&t);
    free(b);
}

/* The one NPY dict parser, shared with the dataset readers: what each field
 * gives, and each way a dict is refused. */
static void test_npy_parse_dict(void **state)
{
    (void)state;
    md_npy_dict d;
    assert_int_equal(md_npy_parse_dict("{'descr': '<f8', 'fortran_order': False, "
                                       "'shape': (3, 4, 5), }", &d), MD_NPY_DICT_OK);
    assert_string_equal(d.descr, "<f8");
    assert_int_equal(d.shape_status, MD_NPY_DICT_OK);
    assert_int_equal(d.ndim, 3);
    assert_int_equal(d.shape[0], 3);
    assert_int_equal(d.shape[2], 5);
    /* a scalar: no dims, not an error here (callers refuse it) */
    assert_int_equal(md_npy_parse_dict("{'descr': '<f4', 'fortran_order':\tFalse, 'shape': (), }",
                                       &d), MD_NPY_DICT_OK);
    assert_int_equal(d.shape_status, MD_NPY_DICT_OK);
    assert_int_equal(d.ndim, 0);
    assert_int_equal(md_npy_parse_dict("{'descr': '<f4', 'shape': (2,), }", &d), MD_NPY_DICT_KEYS);
    assert_int_equal(md_npy_parse_dict("{'descr': '<f4', 'fortran_order': True, 'shape': (2,), }",
                                       &d), MD_NPY_DICT_FORTRAN);
    assert_int_equal(md_npy_parse_dict("{'descr': '<f4', 'fortran_order': False, 'shape': 2, }",
                                       &d), MD_NPY_DICT_OK);
    assert_int_equal(d.shape_status, MD_NPY_DICT_NO_SHAPE);
    const char *bad[] = {"(2, -1)", "(2, x)", "(1, 1, 1, 1, 1, 1, 1, 1, 1)", "(2, 3"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char h[128];
        snprintf(h, sizeof h, "{'descr': '<f4', 'fortran_order': False, 'shape': %s", bad[i]);
        assert_int_equal(md_npy_parse_dict(h, &d), MD_NPY_DICT_OK);
        if (d.shape_status != MD_NPY_DICT_SHAPE)
            fail_msg("shape %s: status %d, want MD_NPY_DICT_SHAPE", bad[i], (int)d.shape_status);
    }
}

static void test_npy_refused(void **state)
{
    (void)state;
    const float f4[] = {1, 2, 3, 4};
    md_err e;
    /* Fortran order */
    assert_int_equal(npy_try("<f4", "True", "(2, 2)", f4, 16, 0, BIG, &e), MD_EINVAL);
    assert_msg_has(e.msg, "Fortran", NULL);
    /* big-endian and other dtypes */
    assert_int_equal(npy_try(">f4", "False", "(2, 2)", f4, 16, 0, BIG, &e), MD_EINVAL);
    assert_msg_has(e.msg, ">f4", "not supported", NULL);
    assert_int_equal(npy_try(">i8", "False", "(2,)", f4, 16, 0, BIG, &e), MD_EINVAL);
    assert_int_equal(npy_try("<f2", "False", "(2, 2)", f4, 8, 0, BIG, &e), MD_EINVAL);
    assert_int_equal(npy_try("<c8", "False", "(2,)", f4, 16, 0, BIG, &e), MD_EINVAL);
    assert_int_equal(npy_try("|O", "False", "(2,)", f4, 16, 0, BIG, &e), MD_EINVAL);
    /* truncated data: one byte short, and no data at all */
    assert_int_equal(npy_try("<f4", "False", "(2, 2)", f4, 16, 1, BIG, &e), MD_EINVAL);
    assert_msg_has(e.msg, "truncated", NULL);
    assert_int_equal(npy_try("<f4", "False", "(2, 2)", f4, 16, 16, BIG, &e), MD_EINVAL);
    /* truncated header */
    assert_int_equal(npy_try("<f4", "False", "(2, 2)", f4, 16, 40, BIG, &e), MD_EINVAL);
    assert_msg_has(e.msg, "truncated", NULL);
    /* scalar and zero-size */
    assert_int_equal(npy_try("<f4", "False", "()", f4, 4, 0, BIG, &e), MD_EINVAL);
    assert_msg_has(e.msg, "scalar", NULL);
    assert_int_equal(npy_try("<f4", "False", "(0,)", f4, 0, 0, BIG, &e), MD_EINVAL);
    assert_msg_has(e.msg, "empty", NULL);
    assert_int_equal(npy_try("<f4", "False", "(0, 3)", f4, 0, 0, BIG, &e), MD_EINVAL);
    assert_int_equal(npy_try("<f4", "False", "(3, 0)", f4, 0, 0, BIG, &e), MD_EINVAL);
    /* negative and too many dims */
    assert_int_equal(npy_try("<f4", "False", "(-1,)", f4, 4, 0, BIG, &e), MD_EINVAL);
    assert_int_equal(npy_try("<f4", "False", "(1, 1, 1, 1, 1, 1, 1, 1, 1)", f4, 4, 0, BIG, &e),
                     MD_EINVAL);
    /* eight dims are fine */
    assert_int_equal(npy_try("<f4", "False", "(1, 1, 1, 1, 1, 1, 1, 1)", f4, 4, 0, BIG, &e),
                     MD_OK);
    /* max_values */
    assert_int_equal(npy_try("<f4", "False", "(2, 2)", f4, 16, 0, 4, &e), MD_OK);
    assert_int_equal(npy_try("<f4", "False", "(2, 2)", f4, 16, 0, 3, &e), MD_ETOOBIG);
    /* a shape whose product overflows size_t */
    assert_int_equal(
        npy_try("<f4", "False", "(4294967296, 4294967296, 4)", f4, 16, 0, BIG, &e), MD_ETOOBIG);
    /* NaN and infinities, and float64 values past float32 */
    const float bad4[] = {1, NAN};
    assert_int_equal(npy_try("<f4", "False", "(2,)", bad4, 8, 0, BIG, &e), MD_EINVAL);
    assert_msg_has(e.msg, "value 1", NULL);
    const double bad8[] = {1e300};
    assert_int_equal(npy_try("<f8", "False", "(1,)", bad8, 8, 0, BIG, &e), MD_EINVAL);
    /* header without the keys */
    size_t len;
    char *b = npy_build("<f4", "False", "(1,)", f4, 4, &len);
    memcpy(b + 12, "xxxxx", 5); /* 'descr' -> 'xxxxx' */
    md_tensor t;
    assert_int_equal(md_npy_decode(b, len, BIG, &t, &e), MD_EINVAL);
    free(b);
}

static void test_npy_bad_magic(void **state)
{
    (void)state;
    const float f4[] = {1, 2};
    size_t len;
    char *b = npy_build("<f4", "False", "(2,)", f4, 8, &len);
    md_tensor t;
    md_err e;
    b[1] = 'n';
    assert_int_equal(md_npy_decode(b, len, BIG, &t, &e), MD_EINVAL);
    assert_msg_has(e.msg, "magic", NULL);
    b[1] = 'N';
    b[0] = 'x';
    assert_int_equal(md_npy_decode(b, len, BIG, &t, &e), MD_EINVAL);
    b[0] = (char)0x93;
    /* unknown version */
    b[6] = 9;
    assert_int_equal(md_npy_decode(b, len, BIG, &t, &e), MD_EINVAL);
    assert_msg_has(e.msg, "version", NULL);
    b[6] = 1;
    assert_int_equal(md_npy_decode(b, len, BIG, &t, &e), MD_OK);
    md_tensor_free(&t);
    /* too short to hold the preamble */
    for (size_t n = 0; n < 10; n++)
        assert_int_equal(md_npy_decode(b, n, BIG, &t, &e), MD_EINVAL);
    /* a JSON body sent as NPY */
    assert_int_equal(md_tensor_decode("[[1, 2]]", 8, "application/x-npy", BIG, &t, &e),
                     MD_EINVAL);
    assert_msg_has(e.msg, "NPY", NULL);
    free(b);
}

static void test_npy_every_truncation(void **state)
{
    (void)state;
    /* no prefix of a valid file decodes, and none crashes */
    const float f4[] = {1, 2, 3, 4, 5, 6};
    size_t len;
    char *b = npy_build("<f4", "False", "(2, 3)", f4, sizeof f4, &len);
    for (size_t n = 0; n < len; n++) {
        char *copy = malloc(n ? n : 1); /* exact size so ASan sees any over-read */
        memcpy(copy, b, n);
        md_tensor t;
        md_err e;
        assert_int_not_equal(md_npy_decode(copy, n, BIG, &t, &e), MD_OK);
        free(copy);
    }
    free(b);
}

static void test_npy_roundtrip(void **state)
{
    (void)state;
    static const int64_t shapes[][MD_MAX_DIMS] = {
        {1}, {7}, {2, 3}, {1, 28, 28}, {3, 1, 4, 1}, {2, 1, 1, 1, 1, 1, 1, 2}, {1000}, {33, 31},
    };
    static const int ndims[] = {1, 1, 2, 3, 4, 8, 1, 2};
    for (size_t s = 0; s < sizeof ndims / sizeof ndims[0]; s++) {
        size_t count = 1;
        for (int d = 0; d < ndims[s]; d++)
            count *= (size_t)shapes[s][d];
        float *data = malloc(count * sizeof(float));
        for (size_t i = 0; i < count; i++) {
            uint32_t bits = (uint32_t)rnd();
            memcpy(&data[i], &bits, 4);
            if (!isfinite(data[i]))
                data[i] = (float)i;
        }
        size_t len = 0;
        char *npy = md_npy_encode(data, shapes[s], ndims[s], &len);
        assert_non_null(npy);
        assert_memory_equal(npy, "\x93NUMPY\x01\x00", 8);
        size_t hl = (size_t)(unsigned char)npy[8] | (size_t)(unsigned char)npy[9] << 8;
        size_t off = 10 + hl;
        assert_int_equal(off % 64, 0);
        assert_int_equal(len, off + count * sizeof(float));
        assert_int_equal(npy[off - 1], '\n');
        md_tensor t;
        md_err e;
        md_err_clear(&e);
        md_status st = md_npy_decode(npy, len, BIG, &t, &e);
        if (st != MD_OK)
            fail_msg("round trip of shape %zu: %s", s, e.msg);
        assert_int_equal(t.ndim, ndims[s]);
        for (int d = 0; d < ndims[s]; d++)
            assert_int_equal(t.shape[d], shapes[s][d]);
        assert_int_equal(t.count, count);
        assert_memory_equal(t.data, data, count * sizeof(float));
        md_tensor_free(&t);
        free(npy);
        free(data);
    }
    /* the exact header numpy writes for a (2, 3) float32 array */
    const float six[6] = {0};
    size_t len;
    char *npy = md_npy_encode(six, SHAPE(2, 3), 2, &len);
    assert_int_equal(len, 128 + 24);
    assert_memory_equal(npy + 10, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
                        59);
    free(npy);
    npy = md_npy_encode(six, SHAPE(6), 1, &len);
    assert_non_null(strstr(npy + 10, "'shape': (6,)"));
    free(npy);
}

/* ---- md_float_format ---- */

/* Significant digits of a %g-style string: "834780" and "8.3478e+05" have 5. */
static int sig_digits(const char *s)
{
    char d[64];
    int n = 0;
    for (; *s && *s != 'e' && *s != 'E'; s++)
        if (*s >= '0' && *s <= '9' && n < 63)
            d[n++] = *s;
    int a = 0;
    while (a < n && d[a] == '0')
        a++;
    while (n > a && d[n - 1] == '0')
        n--;
    return n - a;
}

/* The fewest significant digits (1..9) whose "%.Ng" reads back as v; the
 * string in buf. */
static int shortest_ref(float v, char *buf, size_t size)
{
    for (int prec = 1; prec <= 9; prec++) {
        snprintf(buf, size, "%.*g", prec, (double)v);
        float back = strtof(buf, NULL);
        if (memcmp(&back, &v, 4) == 0)
            return sig_digits(buf);
    }
    return -1;
}

static void check_format(float v, const char *want)
{
    char buf[64];
    int n = md_float_format(v, buf, sizeof buf);
    assert_int_equal(n, (int)strlen(buf));
    float back = strtof(buf, NULL);
    if (memcmp(&back, &v, 4) != 0)
        fail_msg("md_float_format(%.9g) = \"%s\" reads back as %.9g", (double)v, buf,
                 (double)back);
    if (want)
        assert_string_equal(buf, want);
}

static void test_float_format_known(void **state)
{
    (void)state;
    check_format(0.1f, "0.1");
    check_format(1.0f, "1");
    check_format(0.0f, "0");
    check_format(-0.0f, "-0");
    check_format(-2.5f, "-2.5");
    check_format(100.0f, "100");
    check_format(0.3f, "0.3");
    check_format(1e-8f, "1e-08");
    check_format(3.4028235e38f, "3.4028235e+38");
    check_format(-3.4028235e38f, "-3.4028235e+38");
    check_format(16777216.0f, "16777216");
    check_format(1.17549435e-38f, "1.1754944e-38");
    check_format(0.33333334f, "0.33333334");
    check_format(1.0000001f, "1.0000001");
    char buf[64];
    md_float_format(-0.0f, buf, sizeof buf);
    assert_true(signbit(strtof(buf, NULL)));
}

static void test_float_format_random(void **state)
{
    (void)state;
    char buf[64], ref[64];
    int checked = 0;
    while (checked < 100000) {
        uint32_t bits = (uint32_t)rnd();
        float v;
        memcpy(&v, &bits, 4);
        if (!isfinite(v))
            continue;
        check_format(v, NULL);
        /* as short as the shortest %.Ng, for normal numbers */
        if (isnormal(v) || v == 0.0f) {
            md_float_format(v, buf, sizeof buf);
            if (sig_digits(buf) > shortest_ref(v, ref, sizeof ref))
                fail_msg("md_float_format(%.9g) = \"%s\", shortest is \"%s\"", (double)v, buf,
                         ref);
        }
        checked++;
    }
    /* short decimals stay short */
    for (int i = -1000; i <= 1000; i++) {
        char want[32];
        snprintf(want, sizeof want, "%g", i / 100.0);
        check_format(strtof(want, NULL), want);
    }
}

static void test_float_format_subnormal_shortest(void **state)
{
    (void)state;
    /* subnormals round-trip and are as short as the shortest %.Ng */
    char buf[64], ref[64];
    for (uint32_t bits = 1; bits < (1u << 23); bits = bits * 3 + 1) {
        float v;
        memcpy(&v, &bits, 4);
        check_format(v, NULL);
        md_float_format(v, buf, sizeof buf);
        if (sig_digits(buf) > shortest_ref(v, ref, sizeof ref))
            fail_msg("md_float_format(%.9g) = \"%s\", shortest is \"%s\"", (double)v, buf, ref);
    }
}

static void test_float_format_small_buffer(void **state)
{
    (void)state;
    /* like snprintf: never writes past size, always terminates */
    char buf[8];
    memset(buf, 'Z', sizeof buf);
    int n = md_float_format(0.33333334f, buf, 4);
    assert_true(n >= 10);
    assert_int_equal(buf[3], '\0');
    assert_int_equal(buf[4], 'Z');
}


/* ---- md_top_k and checked sizes ---- */

/* The former selection, kept as the reference: k passes, each taking the
 * best value not yet taken, the lowest index among equals. */
static void naive_top_k(const float *x, int64_t n, int64_t k, int64_t *idx)
{
    unsigned char used[4096] = {0};
    for (int64_t t = 0; t < k && t < n; t++) {
        int64_t best = -1;
        for (int64_t j = 0; j < n; j++)
            if (!used[j] && (best < 0 || x[j] > x[best]))
                best = j;
        used[best] = 1;
        idx[t] = best;
    }
}

/* md_top_k answers exactly what the O(k^2 n) loop did, ties included,
 * on random inputs drawn from few distinct values (many ties). */
static void test_top_k_matches_reference(void **state)
{
    (void)state;
    srand(12345);
    float x[4096];
    int64_t want[4096], got[4096];
    for (int trial = 0; trial < 2000; trial++) {
        int64_t n = 1 + rand() % (trial < 1500 ? 40 : 3000);
        int distinct = 1 + rand() % 8;
        for (int64_t j = 0; j < n; j++)
            x[j] = (float)(rand() % distinct) * (rand() % 2 ? 0.5f : -0.25f);
        int64_t k = 1 + rand() % (n + 3); /* sometimes more than n */
        naive_top_k(x, n, k, want);
        int64_t m = md_top_k(x, n, k, got);
        assert_int_equal(m, k < n ? k : n);
        for (int64_t t = 0; t < m; t++)
            if (got[t] != want[t])
                fail_msg("trial %d (n %lld, k %lld): place %lld is %lld, want %lld", trial,
                         (long long)n, (long long)k, (long long)t, (long long)got[t],
                         (long long)want[t]);
    }
    /* nothing asked, nothing answered */
    assert_int_equal(md_top_k(x, 10, 0, got), 0);
    assert_int_equal(md_top_k(x, 0, 5, got), 0);
    /* NaN ranks last, whatever its index */
    float nan_first[4] = {NAN, 1.0f, 3.0f, NAN};
    assert_int_equal(md_top_k(nan_first, 4, 4, got), 4);
    assert_int_equal(got[0], 2);
    assert_int_equal(got[1], 1);
    assert_int_equal(got[2], 0);
    assert_int_equal(got[3], 3);
}

/* Counting comparisons is not possible from outside, so bound the work by
 * size instead: k = 1000 over 200,000 classes, which the former loop would
 * take k*k*n = 2e11 steps for, must answer the same as a sort would. */
/* How an output row reads as classes (issue 29): one column is a binary
 * classifier on a threshold, never a one-class argmax. */
static md_classes classes_of(const char *config_json, int64_t width)
{
    json_t *c = json_loads(config_json, 0, NULL);
    assert_non_null(c);
    md_classes r = md_classes_from_config(c, width);
    json_decref(c);
    return r;
}

static void test_classes_rule(void **state)
{
    (void)state;
    float p[3], score[3];
    int64_t idx[3];
    /* several columns: argmax, softmax scores for logits */
    md_classes c = classes_of("{\"output\": \"logits\"}", 3);
    assert_int_equal(c.kind, MD_CLASSES_ARGMAX);
    assert_int_equal(c.classes, 3);
    float y3[3] = {1.0f, 3.0f, 2.0f};
    assert_int_equal(md_classes_top(&c, y3), 1);
    assert_int_equal(md_classes_top_k(&c, y3, 5, p, idx, score), 3);
    assert_int_equal(idx[0], 1);
    assert_int_equal(idx[1], 2);
    assert_true(fabsf(score[0] + score[1] + score[2] - 1.0f) < 1e-6f);
    /* one column of undeclared meaning: no classes */
    c = classes_of("{}", 1);
    assert_int_equal(c.kind, MD_CLASSES_NONE);
    assert_int_equal(c.classes, 0);
    float y1 = 0.9f;
    assert_int_equal(md_classes_top(&c, &y1), -1);
    assert_int_equal(md_classes_top_k(&c, &y1, 1, p, idx, score), 0);
    c = classes_of("{\"output\": \"raw\"}", 1);
    assert_int_equal(c.kind, MD_CLASSES_NONE);
    /* probabilities: class 1 strictly above 0.5, as PyTorch's p > 0.5 */
    c = classes_of("{\"output\": \"probabilities\"}", 1);
    assert_int_equal(c.kind, MD_CLASSES_BINARY);
    assert_int_equal(c.classes, 2);
    float half = 0.5f, above = 0.50001f, low = 0.2f;
    assert_int_equal(md_classes_top(&c, &half), 0);
    assert_int_equal(md_classes_top(&c, &above), 1);
    assert_int_equal(md_classes_top_k(&c, &low, 2, p, idx, score), 2);
    assert_int_equal(idx[0], 0);
    assert_int_equal(idx[1], 1);
    assert_true(fabsf(score[0] - 0.8f) < 1e-6f && fabsf(score[1] - 0.2f) < 1e-6f);
    /* logits: the same test on the logit, 0 by default, logit(t) declared */
    c = classes_of("{\"output\": \"logits\"}", 1);
    float z0 = 0.0f, zp = 1e-30f, zn = -1e-30f;
    assert_int_equal(md_classes_top(&c, &z0), 0);
    assert_int_equal(md_classes_top(&c, &zp), 1);
    assert_int_equal(md_classes_top(&c, &zn), 0);
    c = classes_of("{\"output\": \"logits\", \"threshold\": 0.3}", 1);
    float zl = -0.84f, zh = -0.85f; /* logit(0.3) = -0.8473 */
    assert_int_equal(md_classes_top(&c, &zl), 1);
    assert_int_equal(md_classes_top(&c, &zh), 0);
    md_classes_probs(&c, &z0, p);
    assert_true(fabsf(p[1] - 0.5f) < 1e-7f);
    /* NaN is never past a threshold */
    float nan = NAN;
    assert_int_equal(md_classes_top(&c, &nan), 0);
    /* multi-label: each column on its own */
    c = classes_of("{\"output\": \"probabilities\", \"multi_label\": true}", 3);
    assert_int_equal(c.kind, MD_CLASSES_MULTI);
    float ym[3] = {0.7f, 0.2f, 0.9f};
    assert_int_equal(md_classes_top(&c, ym), -1);
    assert_true(md_classes_present(&c, ym, 0) && !md_classes_present(&c, ym, 1) &&
                md_classes_present(&c, ym, 2));
    assert_int_equal(md_classes_top_k(&c, ym, 3, p, idx, score), 3);
    assert_int_equal(idx[0], 2);
    assert_int_equal(idx[1], 0);
    assert_true(fabsf(score[0] - 0.9f) < 1e-7f);
    /* the config check: a threshold needs probabilities or logits */
    md_err err;
    json_t *bad = json_loads("{\"threshold\": 0.4}", 0, NULL);
    assert_int_equal(md_model_config_check(bad, &err), MD_EUNPROC);
    assert_non_null(strstr(err.msg, "config.threshold"));
    json_decref(bad);
    bad = json_loads("{\"output\": \"logits\", \"threshold\": 0}", 0, NULL);
    assert_int_equal(md_model_config_check(bad, &err), MD_EUNPROC);
    json_decref(bad);
    json_t *good = json_loads("{\"output\": \"logits\", \"threshold\": 0.25, \"multi_label\": true}",
                              0, NULL);
    assert_int_equal(md_model_config_check(good, &err), MD_OK);
    json_decref(good);
}

static void test_top_k_large(void **state)
{
    (void)state;
    enum { N = 200000, K = 1000 };
    float *x = malloc(sizeof(float) * N);
    int64_t *got = malloc(sizeof(int64_t) * K);
    for (int j = 0; j < N; j++)
        x[j] = (float)((j * 7919) % 100003);
    assert_int_equal(md_top_k(x, N, K, got), K);
    /* the values 100002, 100001, ... each appear at most twice below N */
    for (int t = 1; t < K; t++) {
        float a = x[got[t - 1]], b = x[got[t]];
        assert_true(a > b || (a == b && got[t - 1] < got[t]));
    }
    assert_true(x[got[0]] == 100002.0f);
    free(x);
    free(got);
}

static void test_checked_sizes(void **state)
{
    (void)state;
    int64_t p;
    assert_int_equal(md_shape_product((const int64_t[]){3, 224, 224}, 3, &p), 0);
    assert_int_equal(p, 150528);
    assert_int_equal(
        md_shape_product((const int64_t[]){1073741824, 1073741824, 1073741824}, 3, &p), -1);
    assert_int_equal(md_shape_product((const int64_t[]){4, -1}, 2, &p), -1);
    assert_int_equal(md_shape_product(NULL, 0, &p), 0);
    assert_int_equal(p, 1);
    int64_t v;
    assert_int_equal(md_mul_i64(INT64_MAX / 2, 3, &v), 1);
    assert_int_equal(md_mul_i64(-1, 3, &v), 1);
    assert_int_equal(md_add_i64(INT64_MAX, 1, &v), 1);
    size_t z;
    assert_int_equal(md_mul_size(SIZE_MAX / 4 + 1, 4, &z), 1);
    assert_int_equal(md_mul_size(1000, 4, &z), 0);
    assert_int_equal(z, 4000);
    /* a request-sized allocation that overflows fails with a status */
    md_err err;
    md_err_clear(&err);
    assert_null(md_mallocarray_checked(SIZE_MAX / 2, sizeof(float), "the test", &err));
    assert_int_equal(err.status, MD_ENOMEM);
    assert_non_null(strstr(err.msg, "the test"));
    md_err_clear(&err);
    assert_null(md_calloc_checked((size_t)1 << 62, 8, "zeros", &err));
    assert_int_equal(err.status, MD_ENOMEM);
    void *ok = md_calloc_checked(4, 4, "zeros", &err);
    assert_non_null(ok);
    assert_true(((float *)ok)[3] == 0.0f);
    free(ok);
}

/* ---- Open Inference Protocol V2 inputs ---- */

static md_status v2(const char *json, md_tensor *t, md_err *err)
{
    json_error_t jerr;
    json_t *in = json_loads(json, 0, &jerr);
    assert_non_null(in);
    md_status st = md_v2_decode(in, 1 << 20, t, err);
    json_decref(in);
    return st;
}

static void test_v2_decode(void **state)
{
    (void)state;
    md_tensor t;
    md_err err;
    assert_int_equal(v2("{\"name\":\"x\",\"shape\":[2,2],\"datatype\":\"FP32\","
                        "\"data\":[[1,2],[3,4.5]]}", &t, &err), MD_OK);
    assert_int_equal(t.ndim, 2);
    assert_int_equal(t.count, 4);
    assert_true(t.data[3] == 4.5f);
    md_tensor_free(&t);
    assert_int_equal(v2("{\"shape\":[3],\"datatype\":\"BOOL\",\"data\":[true,false,true]}",
                        &t, &err), MD_OK);
    assert_true(t.data[0] == 1.0f && t.data[1] == 0.0f);
    md_tensor_free(&t);
    /* found by fuzz_v2: past float32's range the cast was undefined (inf) */
    assert_int_equal(v2("{\"shape\":[2],\"datatype\":\"FP64\",\"data\":[1e39,0]}", &t, &err),
                     MD_EINVAL);
    assert_non_null(strstr(err.msg, "outside float32's range"));
    /* the shape sizes the buffer: bounded before allocating, overflow caught */
    assert_int_equal(v2("{\"shape\":[4294967296,4294967296,4294967296],\"datatype\":\"FP32\","
                        "\"data\":[1]}", &t, &err), MD_ETOOBIG);
    assert_string_equal(err.code, "too_many_values");
    assert_int_equal(v2("{\"shape\":[3],\"datatype\":\"FP32\",\"data\":[1,2]}", &t, &err),
                     MD_EINVAL);
    assert_int_equal(v2("{\"shape\":[1],\"datatype\":\"FP32\",\"data\":[1,2]}", &t, &err),
                     MD_EINVAL);
    assert_int_equal(v2("{\"shape\":[1],\"datatype\":\"BYTES\",\"data\":[\"a\"]}", &t, &err),
                     MD_EINVAL);
    assert_int_equal(v2("{\"shape\":[1],\"datatype\":\"FP32\",\"data\":[\"a\"]}", &t, &err),
                     MD_EINVAL);
}

/* md_v2_parse on a whole request: *decoded and, when decoded, the tensor. */
static json_t *v2p(const char *body, md_tensor *t, int *decoded)
{
    md_err err;
    return md_v2_parse(body, strlen(body), 1000, 1, t, decoded, &err);
}

static void test_v2_parse(void **state)
{
    (void)state;
    md_tensor t;
    int decoded;
    /* a flat data array, read by the row scanner into the input's shape; the
     * root keeps everything else, with "data": [] */
    json_t *root = v2p("{\"id\":\"7\", \"inputs\" : [ {\"name\":\"x\",\"shape\":[2,3],"
                       "\"datatype\":\"FP32\",\"data\" :[1, 2.5,-0.0039215688593685627,4,5e1,"
                       "-0]}],\"outputs\":[{\"name\":\"y\",\"parameters\":{\"binary_data\":true}}]}",
                       &t, &decoded);
    assert_non_null(root);
    assert_int_equal(decoded, 1);
    assert_int_equal(t.ndim, 2);
    assert_int_equal(t.shape[0], 2);
    assert_int_equal(t.shape[1], 3);
    assert_int_equal(t.count, 6);
    assert_true(t.data[1] == 2.5f && t.data[2] == (float)-0.0039215688593685627 &&
                t.data[4] == 50.0f && t.data[5] == 0.0f && signbit(t.data[5]));
    json_t *in = json_array_get(json_object_get(root, "inputs"), 0);
    assert_int_equal(json_array_size(json_object_get(in, "data")), 0);
    assert_string_equal(json_string_value(json_object_get(root, "id")), "7");
    assert_true(json_is_true(json_object_get(
        json_object_get(json_array_get(json_object_get(root, "outputs"), 0), "parameters"),
        "binary_data")));
    md_tensor_free(&t);
    json_decref(root);
    /* nested data, in the input's shape whatever the nesting */
    root = v2p("{\"inputs\":[{\"shape\":[4],\"datatype\":\"FP32\",\"data\":[[1,2],[3,4]]}]}",
               &t, &decoded);
    assert_int_equal(decoded, 1);
    assert_int_equal(t.ndim, 1);
    assert_int_equal(t.shape[0], 4);
    assert_true(t.data[3] == 4.0f);
    md_tensor_free(&t);
    json_decref(root);
    /* UINT64's largest values, past jansson's integers (which refused the
     * whole body), read as numbers like everywhere else */
    root = v2p("{\"inputs\":[{\"shape\":[2],\"datatype\":\"UINT64\","
               "\"data\":[18446744073709551615,9223372036854775808]}]}", &t, &decoded);
    assert_non_null(root);
    assert_int_equal(decoded, 1);
    assert_true(t.data[0] == 18446744073709551615.0f && t.data[1] == 9223372036854775808.0f);
    md_tensor_free(&t);
    json_decref(root);
    /* everything else is the whole body's, through jansson, as before: the
     * root holds the data for md_v2_decode to read and report on */
    const char *whole[] = {
        /* booleans, ragged rows, a wrong count, a string */
        "{\"inputs\":[{\"shape\":[2],\"datatype\":\"BOOL\",\"data\":[true,false]}]}",
        "{\"inputs\":[{\"shape\":[3],\"datatype\":\"FP32\",\"data\":[[1],[2,3]]}]}",
        "{\"inputs\":[{\"shape\":[3],\"datatype\":\"FP32\",\"data\":[1,2]}]}",
        "{\"inputs\":[{\"shape\":[2],\"datatype\":\"FP32\",\"data\":[1,\"2\"]}]}",
        /* "d\u0061ta" is "data" to jansson, which keeps the last of two keys */
        "{\"inputs\":[{\"shape\":[2],\"datatype\":\"FP32\",\"data\":[1,2],\"d\\u0061ta\":[3,4]}]}",
        "{\"inputs\":[{\"shape\":[2],\"datatype\":\"FP32\",\"data\":[1,2],\"data\":[3,4]}]}",
        /* binary data announced; a value that rounds to FLT_MAX */
        "{\"inputs\":[{\"shape\":[1],\"datatype\":\"FP32\",\"data\":[1],"
        "\"parameters\":{\"binary_data_size\":4}}]}",
        "{\"inputs\":[{\"shape\":[1],\"datatype\":\"FP32\",\"data\":[3.4028235e38]}]}",
    };
    for (size_t i = 0; i < sizeof whole / sizeof *whole; i++) {
        root = v2p(whole[i], &t, &decoded);
        assert_non_null(root);
        assert_int_equal(decoded, 0);
        assert_null(t.data);
        assert_true(json_array_size(json_object_get(
                        json_array_get(json_object_get(root, "inputs"), 0), "data")) > 0);
        json_decref(root);
    }
    /* several inputs: no input's data is built (the handler reads each
     * where it lies, md_v2_parse_spans), none is scanned */
    root = v2p("{\"inputs\":[{\"shape\":[1],\"datatype\":\"FP32\",\"data\":[1]},"
               "{\"name\":\"b\",\"data\":[2, 3]}]}",
               &t, &decoded);
    assert_non_null(root);
    assert_int_equal(decoded, 0);
    assert_null(t.data);
    for (size_t k = 0; k < 2; k++) {
        json_t *d = json_object_get(json_array_get(json_object_get(root, "inputs"), k), "data");
        assert_true(json_is_array(d) && json_array_size(d) == 0);
    }
    assert_string_equal(
        json_string_value(json_object_get(json_array_get(json_object_get(root, "inputs"), 1), "name")),
        "b");
    json_decref(root);
    /* ... and md_v2_parse_spans says where each lies */
    {
        const char *body = "{\"inputs\":[{\"name\":\"a\",\"shape\":[2],\"datatype\":\"INT64\","
                           "\"data\":[9007199254740993, -1]},{\"name\":\"b\",\"shape\":[1,2],"
                           "\"datatype\":\"FP32\",\"data\":[[0.5, 2]]}]}";
        size_t sa[MD_MAX_IO], sb[MD_MAX_IO];
        md_err e;
        md_err_clear(&e);
        json_t *r = md_v2_parse_spans(body, strlen(body), 100, sa, sb, &e);
        assert_non_null(r);
        md_array x;
        json_t *in0 = json_array_get(json_object_get(r, "inputs"), 0);
        assert_int_equal(md_v2_text_array(in0, body + sa[0], sb[0] - sa[0], 100, &x, &e), MD_OK);
        assert_true(x.is_int && x.count == 2 && x.i64[0] == 9007199254740993LL && x.i64[1] == -1);
        free(x.i64);
        json_t *in1 = json_array_get(json_object_get(r, "inputs"), 1);
        assert_int_equal(md_v2_text_array(in1, body + sa[1], sb[1] - sa[1], 100, &x, &e), MD_OK);
        assert_true(!x.is_int && x.count == 2 && x.f32[0] == 0.5f && x.f32[1] == 2.0f);
        free(x.f32);
        json_decref(r);
        /* over the limit together */
        assert_null(md_v2_parse_spans(body, strlen(body), 3, sa, sb, &e));
        assert_int_equal(e.status, MD_ETOOBIG);
    }
    /* jansson keeps the last "data": [3, 4] */
    root = v2p(whole[5], &t, &decoded);
    md_err err;
    assert_int_equal(md_v2_decode(json_array_get(json_object_get(root, "inputs"), 0), 100, &t,
                                  &err), MD_OK);
    assert_true(t.data[0] == 3.0f);
    md_tensor_free(&t);
    json_decref(root);
    /* not JSON at all: NULL, with where it stops being JSON */
    assert_null(md_v2_parse("{\"inputs\":[{\"data\":[1,2]}", 24, 100, 1, &t, &decoded, &err));
    assert_int_equal(decoded, 0);
    assert_int_equal(err.status, MD_EINVAL);
    assert_non_null(strstr(err.msg, "byte 24"));
    /* members modeld ignores are null in the root, never built */
    const char *ign = "{\"x\":[{},{}],\"inputs\":[{\"shape\":[2],\"datatype\":\"FP32\","
                       "\"data\":[1,2],\"y\":\"long string\"}],\"id\":\"a\"}";
    root = md_v2_parse(ign, strlen(ign), 100, 1, &t, &decoded, &err);
    assert_non_null(root);
    assert_int_equal(decoded, 1);
    assert_true(json_is_null(json_object_get(root, "x")));
    json_t *in0 = json_array_get(json_object_get(root, "inputs"), 0);
    assert_true(json_is_null(json_object_get(in0, "y")));
    assert_string_equal(json_string_value(json_object_get(root, "id")), "a");
    md_tensor_free(&t);
    json_decref(root);
    /* what modeld reads is counted before jansson builds it: 413 past the limit */
    size_t n = 3 * MD_V2_MAX_JSON_VALUES;
    char *big = malloc(n + 64);
    int k = sprintf(big, "{\"id\":[");
    for (size_t i = 0; i < MD_V2_MAX_JSON_VALUES; i++)
        k += sprintf(big + k, "%s0", i ? "," : "");
    k += sprintf(big + k, "]}");
    assert_null(md_v2_parse(big, (size_t)k, 100, 1, &t, &decoded, &err));
    assert_int_equal(err.status, MD_ETOOBIG);
    assert_string_equal(err.code, "too_many_json_values");
    free(big);
}

/* md_v2_decode_binary on `n` raw bytes for an input of `dt` and `shape`. */
static md_status v2bin(const char *dt, const char *shape, const void *raw, size_t n,
                       md_tensor *t, md_err *err)
{
    char json[200];
    snprintf(json, sizeof json, "{\"shape\":%s,\"datatype\":\"%s\"}", shape, dt);
    json_error_t jerr;
    json_t *in = json_loads(json, 0, &jerr);
    assert_non_null(in);
    md_status st = md_v2_decode_binary(in, raw, n, 1 << 20, t, err);
    json_decref(in);
    return st;
}

static void test_v2_decode_binary(void **state)
{
    (void)state;
    md_tensor t;
    md_err err;
    /* every FP16 bit pattern against the compiler's own conversion */
    static uint16_t halves[65536];
    for (uint32_t i = 0; i < 65536; i++)
        halves[i] = (uint16_t)i;
    size_t finite = 0;
    for (uint32_t i = 0; i < 65536; i++) {
        _Float16 h;
        memcpy(&h, &halves[i], 2);
        float want = (float)h;
        if (!isfinite(want))
            continue;
        finite++;
        assert_int_equal(v2bin("FP16", "[1]", &halves[i], 2, &t, &err), MD_OK);
        if (memcmp(&t.data[0], &want, 4) != 0)
            fail_msg("FP16 0x%04x: got %.9g, want %.9g", i, (double)t.data[0], (double)want);
        md_tensor_free(&t);
    }
    assert_int_equal(finite, 65536 - 2 * 1024); /* inf and NaN patterns refused */
    uint16_t inf16 = 0x7c00;
    assert_int_equal(v2bin("FP16", "[1]", &inf16, 2, &t, &err), MD_EINVAL);
    assert_non_null(strstr(err.msg, "value 0"));
    /* BF16: the upper half of a float32 */
    float f = -3.140625f;
    uint32_t fb;
    memcpy(&fb, &f, 4);
    uint16_t bf = (uint16_t)(fb >> 16);
    assert_int_equal(v2bin("BF16", "[1]", &bf, 2, &t, &err), MD_OK);
    assert_true(t.data[0] == f);
    md_tensor_free(&t);
    /* integers of every width, signed and not */
    int64_t i64[2] = {-5, 1LL << 40};
    assert_int_equal(v2bin("INT64", "[2]", i64, 16, &t, &err), MD_OK);
    assert_true(t.data[0] == -5.0f && t.data[1] == 1099511627776.0f);
    md_tensor_free(&t);
    uint64_t u64 = 18446744073709551615ULL;
    assert_int_equal(v2bin("UINT64", "[1]", &u64, 8, &t, &err), MD_OK);
    assert_true(t.data[0] == 18446744073709551616.0f);
    md_tensor_free(&t);
    int8_t i8[3] = {-128, 0, 127};
    assert_int_equal(v2bin("INT8", "[1,3]", i8, 3, &t, &err), MD_OK);
    assert_true(t.data[0] == -128.0f && t.data[2] == 127.0f);
    assert_int_equal(t.ndim, 2);
    md_tensor_free(&t);
    int16_t i16 = -32768;
    assert_int_equal(v2bin("INT16", "[1]", &i16, 2, &t, &err), MD_OK);
    assert_true(t.data[0] == -32768.0f);
    md_tensor_free(&t);
    uint16_t u16 = 65535;
    assert_int_equal(v2bin("UINT16", "[1]", &u16, 2, &t, &err), MD_OK);
    assert_true(t.data[0] == 65535.0f);
    md_tensor_free(&t);
    uint32_t u32 = 4000000000u;
    assert_int_equal(v2bin("UINT32", "[1]", &u32, 4, &t, &err), MD_OK);
    assert_true(t.data[0] == 4000000000.0f);
    md_tensor_free(&t);
    uint8_t b[3] = {0, 2, 255};
    assert_int_equal(v2bin("BOOL", "[3]", b, 3, &t, &err), MD_OK);
    assert_true(t.data[0] == 0.0f && t.data[1] == 1.0f && t.data[2] == 1.0f);
    md_tensor_free(&t);
    assert_int_equal(v2bin("UINT8", "[3]", b, 3, &t, &err), MD_OK);
    assert_true(t.data[2] == 255.0f);
    md_tensor_free(&t);
    /* FP64 past float32's range, and NaN, are refused naming the value */
    double d[2] = {1.0, 1e39};
    assert_int_equal(v2bin("FP64", "[2]", d, 16, &t, &err), MD_EINVAL);
    assert_non_null(strstr(err.msg, "value 1"));
    float nan32[1] = {NAN};
    assert_int_equal(v2bin("FP32", "[1]", nan32, 4, &t, &err), MD_EINVAL);
    /* the byte count must be the shape's exactly */
    float four[4] = {1, 2, 3, 4};
    assert_int_equal(v2bin("FP32", "[4]", four, 12, &t, &err), MD_EINVAL);
    assert_non_null(strstr(err.msg, "binary_data_size is 12 bytes"));
    assert_int_equal(v2bin("FP32", "[2]", four, 16, &t, &err), MD_EINVAL);
    assert_int_equal(v2bin("FP16", "[3]", four, 5, &t, &err), MD_EINVAL);
    /* the shape is bounded before anything is allocated */
    assert_int_equal(v2bin("FP32", "[4294967296,4294967296]", four, 16, &t, &err), MD_ETOOBIG);
    assert_int_equal(v2bin("BYTES", "[1]", four, 4, &t, &err), MD_EINVAL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bare_rows),
        cmocka_unit_test(test_instances),
        cmocka_unit_test(test_array_and_shape),
        cmocka_unit_test(test_nested_3d),
        cmocka_unit_test(test_whitespace_everywhere),
        cmocka_unit_test(test_content_types),
        cmocka_unit_test(test_empty_body),
        cmocka_unit_test(test_length_is_honoured),
        cmocka_unit_test(test_numbers_fixed),
        cmocka_unit_test(test_minus_zero),
        cmocka_unit_test(test_long_mantissas),
        cmocka_unit_test(test_numbers_random),
        cmocka_unit_test(test_out_of_float_range),
        cmocka_unit_test(test_ragged_rows),
        cmocka_unit_test(test_non_numbers),
        cmocka_unit_test(test_trailing_commas),
        cmocka_unit_test(test_truncated),
        cmocka_unit_test(test_trailing_garbage),
        cmocka_unit_test(test_trailing_nul_byte),
        cmocka_unit_test(test_empty_arrays),
        cmocka_unit_test(test_not_an_array),
        cmocka_unit_test(test_object_keys),
        cmocka_unit_test(test_shape_errors),
        cmocka_unit_test(test_shape_product_overflow),
        cmocka_unit_test(test_shape_dim_past_int64),
        cmocka_unit_test(test_too_deep),
        cmocka_unit_test(test_max_values),
        cmocka_unit_test(test_npy_dtypes),
        cmocka_unit_test(test_npy_parse_dict),
        cmocka_unit_test(test_npy_refused),
        cmocka_unit_test(test_npy_bad_magic),
        cmocka_unit_test(test_npy_every_truncation),
        cmocka_unit_test(test_npy_roundtrip),
        cmocka_unit_test(test_float_format_known),
        cmocka_unit_test(test_float_format_random),
        cmocka_unit_test(test_parse_double_matches_strtod),
        cmocka_unit_test(test_decode_eight_digit_steps),
        cmocka_unit_test(test_decode_digit_runs),
        cmocka_unit_test(test_float_format_subnormal_shortest),
        cmocka_unit_test(test_float_format_small_buffer),
        cmocka_unit_test(test_top_k_matches_reference),
        cmocka_unit_test(test_top_k_large),
        cmocka_unit_test(test_classes_rule),
        cmocka_unit_test(test_checked_sizes),
        cmocka_unit_test(test_v2_decode),
        cmocka_unit_test(test_v2_parse),
        cmocka_unit_test(test_v2_decode_binary),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
