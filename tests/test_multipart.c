/*
 * test_multipart.c - unit tests of the multipart/form-data iterator over a
 * buffered body (server/multipart.c): what curl -F and Python requests send,
 * quoted and unquoted boundaries, preamble and epilogue, a boundary string
 * inside a part's data, empty parts, and the refusals: bare-LF lines, a body
 * cut short (no closing delimiter), bad boundaries, parts without a name, too
 * many parts.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../server/server.h"
#include "test_util.h"

#define CT "multipart/form-data; boundary=XyZ"

/* Every part of `body` into parts (room for `max`); returns the status. */
static md_status parse_all(const char *ct, const char *body, size_t len, md_multipart_part *parts,
                           size_t max, size_t *n, md_err *err)
{
    md_multipart mp;
    md_err_clear(err);
    *n = 0;
    md_status st = md_multipart_begin(&mp, ct, body, len, max, "max_request_images", err);
    if (st != MD_OK)
        return st;
    for (;;) {
        md_multipart_part p;
        int more;
        st = md_multipart_next(&mp, &p, &more, err);
        if (st != MD_OK || !more)
            return st;
        parts[(*n)++] = p;
    }
}

static void assert_bytes(const char *got, size_t got_len, const char *want, size_t want_len)
{
    assert_int_equal(got_len, want_len);
    assert_memory_equal(got, want, want_len);
}
#define assert_str_part(got, got_len, want) assert_bytes(got, got_len, want, strlen(want))

/* What curl -F image=@a.png -F image=@b.jpg -F note=hi sends (binary data
 * with CR, LF, NUL and the boundary string in it, not at a line's start). */
static void test_curl_body(void **state)
{
    (void)state;
    static const char data_a[] = "\x89PNG\r\n\x1a\n\0\0--XyZ\r\n--XyZX\r\n";
    size_t a_len = sizeof data_a - 1;
    char body[1024];
    size_t len = 0;
    len += (size_t)sprintf(body + len,
                           "--XyZ\r\nContent-Disposition: form-data; name=\"image\"; "
                           "filename=\"a.png\"\r\nContent-Type: image/png\r\n\r\n");
    memcpy(body + len, data_a, a_len);
    len += a_len;
    len += (size_t)sprintf(body + len,
                           "\r\n--XyZ\r\ncontent-disposition: form-data; filename=b.jpg; "
                           "name=image\r\nCONTENT-TYPE: image/jpeg; q=1\r\n\r\n\xff\xd8\xff"
                           "\r\n--XyZ\r\nContent-Disposition: form-data; name=\"note\"\r\n\r\nhi"
                           "\r\n--XyZ--\r\n");
    md_multipart_part parts[4];
    size_t n;
    md_err err;
    assert_int_equal(parse_all(CT, body, len, parts, 4, &n, &err), MD_OK);
    assert_int_equal(n, 3);
    assert_str_part(parts[0].name, parts[0].name_len, "image");
    assert_str_part(parts[0].filename, parts[0].filename_len, "a.png");
    assert_str_part(parts[0].content_type, parts[0].content_type_len, "image/png");
    assert_bytes(parts[0].data, parts[0].len, data_a, a_len);
    assert_str_part(parts[1].name, parts[1].name_len, "image");
    assert_str_part(parts[1].filename, parts[1].filename_len, "b.jpg");
    assert_str_part(parts[1].content_type, parts[1].content_type_len, "image/jpeg");
    assert_bytes(parts[1].data, parts[1].len, "\xff\xd8\xff", 3);
    assert_str_part(parts[2].name, parts[2].name_len, "note");
    assert_null(parts[2].filename);
    assert_null(parts[2].content_type);
    assert_str_part(parts[2].data, parts[2].len, "hi");
    /* pointers into the body, never copies */
    assert_true(parts[0].data > body && parts[0].data < body + len);
}

static void test_quoted_boundary(void **state)
{
    (void)state;
    const char *body = "--a:b c?\r\nContent-Disposition: form-data; name=\"x\"\r\n\r\n1"
                       "\r\n--a:b c?--";
    md_multipart_part parts[2];
    size_t n;
    md_err err;
    assert_int_equal(parse_all("Multipart/Form-Data; charset=utf-8; BOUNDARY=\"a:b c?\"", body,
                               strlen(body), parts, 2, &n, &err),
                     MD_OK);
    assert_int_equal(n, 1);
    assert_str_part(parts[0].data, parts[0].len, "1");
    /* the same boundary unquoted, and spaces around the '=' */
    body = "--abc\r\nContent-Disposition: form-data; name=x\r\n\r\n2\r\n--abc--";
    assert_int_equal(parse_all("multipart/form-data ; boundary = abc", body, strlen(body), parts,
                               2, &n, &err),
                     MD_OK);
    assert_int_equal(n, 1);
    assert_str_part(parts[0].data, parts[0].len, "2");
}

static void test_preamble_epilogue_padding(void **state)
{
    (void)state;
    /* a preamble mentioning --XyZ mid-line, padding after delimiters, an epilogue */
    const char *body = "this is the preamble --XyZ\r\n--XyZ  \t\r\n"
                       "Content-Disposition: form-data; name=\"a\"\r\n\r\n"
                       "\r\n--XyZ \r\nContent-Disposition: form-data; name=\"b\"\r\n\r\nB"
                       "\r\n--XyZ--\r\nepilogue\r\n--XyZ\r\nContent-Disposition: form-data; "
                       "name=\"c\"\r\n\r\nC\r\n--XyZ--";
    md_multipart_part parts[4];
    size_t n;
    md_err err;
    assert_int_equal(parse_all(CT, body, strlen(body), parts, 4, &n, &err), MD_OK);
    assert_int_equal(n, 2);
    assert_int_equal(parts[0].len, 0); /* an empty part */
    assert_str_part(parts[1].name, parts[1].name_len, "b");
    assert_str_part(parts[1].data, parts[1].len, "B");
}

static void test_no_parts(void **state)
{
    (void)state;
    md_multipart_part parts[1];
    size_t n;
    md_err err;
    assert_int_equal(parse_all(CT, "--XyZ--\r\n", 9, parts, 1, &n, &err), MD_OK);
    assert_int_equal(n, 0);
}

static void expect_invalid(const char *ct, const char *body, md_status want, const char *needle)
{
    md_multipart_part parts[8];
    size_t n;
    md_err err;
    assert_int_equal(parse_all(ct, body, body ? strlen(body) : 0, parts, 8, &n, &err), want);
    assert_msg_has(err.msg, needle, NULL);
    assert_null(strchr(err.msg, '\n'));
}

static void test_missing_final_boundary(void **state)
{
    (void)state;
    expect_invalid(CT, "--XyZ\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nAAAA",
                   MD_EINVAL, "ends inside part 1, without the closing --XyZ--: the upload was "
                              "cut short");
    /* cut inside the closing delimiter itself */
    expect_invalid(CT, "--XyZ\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nA\r\n--XyZ",
                   MD_EINVAL, "cut short");
    expect_invalid(CT, "--XyZ\r\nContent-Disposition: form-data; name=\"a\"\r\n", MD_EINVAL,
                   "ends inside part 1's headers");
    expect_invalid(CT, "--XyZ", MD_EINVAL, "cut short");
    /* a second part cut off after a first complete one */
    expect_invalid(CT,
                   "--XyZ\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nA\r\n--XyZ\r\n"
                   "Content-Disposition: form-data; name=\"b\"\r\n\r\nBB",
                   MD_EINVAL, "part 2");
}

static void test_lf_only_refused(void **state)
{
    (void)state;
    expect_invalid(CT, "--XyZ\nContent-Disposition: form-data; name=\"a\"\n\nA\n--XyZ--\n",
                   MD_EINVAL, "bare LF");
    expect_invalid(CT, "preamble\n--XyZ\nContent-Disposition: form-data; name=\"a\"\n\nA\n--XyZ--",
                   MD_EINVAL, "bare LF");
    /* CRLF delimiter line, LF header lines */
    expect_invalid(CT, "--XyZ\r\nContent-Disposition: form-data; name=\"a\"\n\nA\r\n--XyZ--",
                   MD_EINVAL, "bare LF");
}

static void test_boundary_inside_data(void **state)
{
    (void)state;
    /* "\r\n--XyZ" followed by other characters is data, as is --XyZ mid-line */
    const char *body = "--XyZ\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\n"
                       "x--XyZ\r\n\r\n--XyZa\r\n--XyZ-\r\n--XyZ\r\n"
                       "Content-Disposition: form-data; name=\"b\"\r\n\r\nb\r\n--XyZ--";
    md_multipart_part parts[4];
    size_t n;
    md_err err;
    assert_int_equal(parse_all(CT, body, strlen(body), parts, 4, &n, &err), MD_OK);
    assert_int_equal(n, 2);
    assert_str_part(parts[0].data, parts[0].len, "x--XyZ\r\n\r\n--XyZa\r\n--XyZ-");
    assert_str_part(parts[1].data, parts[1].len, "b");
}

static void test_bad_boundaries(void **state)
{
    (void)state;
    const char *body = "--XyZ--";
    expect_invalid("application/json", body, MD_EMEDIA, "not multipart/form-data");
    expect_invalid("multipart/mixed; boundary=XyZ", body, MD_EMEDIA, "not multipart/form-data");
    expect_invalid(NULL, body, MD_EMEDIA, "no Content-Type");
    expect_invalid("multipart/form-data", body, MD_EINVAL, "no boundary parameter");
    expect_invalid("multipart/form-data; charset=utf-8", body, MD_EINVAL, "no boundary");
    expect_invalid("multipart/form-data; boundary=", body, MD_EINVAL, "1 to 70");
    expect_invalid("multipart/form-data; boundary=\"\"", body, MD_EINVAL, "1 to 70");
    char ct[200];
    snprintf(ct, sizeof ct, "multipart/form-data; boundary=%071d", 0);
    expect_invalid(ct, body, MD_EINVAL, "has 71 characters");
    snprintf(ct, sizeof ct, "multipart/form-data; boundary=%070d", 0);
    char ok_body[200];
    snprintf(ok_body, sizeof ok_body, "--%070d--", 0);
    expect_invalid(ct, "--other--", MD_EINVAL, "holds no line --000");
    md_multipart mp;
    md_err err;
    assert_int_equal(md_multipart_begin(&mp, ct, ok_body, strlen(ok_body), 1, "x", &err), MD_OK);
    expect_invalid("multipart/form-data; boundary=\"a\\\"b\"", body, MD_EINVAL,
                   "RFC 2046 does not allow");
    expect_invalid("multipart/form-data; boundary=a{b", body, MD_EINVAL, "does not allow");
    expect_invalid("multipart/form-data; boundary=\"ab \"", body, MD_EINVAL, "does not allow");
    expect_invalid("multipart/form-data; boundary=\"abc", body, MD_EINVAL, "never ends");
    expect_invalid(CT, "", MD_EINVAL, "holds no line --XyZ");
    expect_invalid(CT, NULL, MD_EINVAL, "holds no line --XyZ");
    expect_invalid(CT, "--XyZa\r\n", MD_EINVAL, "holds no line --XyZ");
}

static void test_part_headers(void **state)
{
    (void)state;
    expect_invalid(CT, "--XyZ\r\nContent-Type: image/png\r\n\r\nA\r\n--XyZ--", MD_EINVAL,
                   "part 1 has no Content-Disposition");
    expect_invalid(CT, "--XyZ\r\nContent-Disposition: form-data; filename=\"a\"\r\n\r\nA\r\n"
                       "--XyZ--",
                   MD_EINVAL, "part 1 has no Content-Disposition: form-data; name=");
    expect_invalid(CT, "--XyZ\r\nContent-Disposition: attachment; name=\"a\"\r\n\r\nA\r\n"
                       "--XyZ--",
                   MD_EINVAL, "not form-data");
    expect_invalid(CT, "--XyZ\r\nContent-Disposition: form-data; name=\"a\r\n\r\nA\r\n--XyZ--",
                   MD_EINVAL, "never ends");
    expect_invalid(CT, "--XyZ\r\nno colon here\r\n\r\nA\r\n--XyZ--", MD_EINVAL,
                   "without ':' (\"no colon here\")");
    /* an escaped quote inside a quoted filename; a folded line and other headers ignored */
    const char *body = "--XyZ\r\nContent-Disposition: form-data; name=\"a\"; "
                       "filename=\"x\\\"y.png\"\r\n\tfolded\r\nX-Other: 1\r\n\r\nA\r\n--XyZ--";
    md_multipart_part parts[2];
    size_t n;
    md_err err;
    assert_int_equal(parse_all(CT, body, strlen(body), parts, 2, &n, &err), MD_OK);
    assert_int_equal(n, 1);
    assert_str_part(parts[0].filename, parts[0].filename_len, "x\\\"y.png");
}

static void test_too_many_parts(void **state)
{
    (void)state;
    char body[4096];
    size_t len = 0;
    for (int i = 0; i < 5; i++)
        len += (size_t)sprintf(body + len,
                               "--XyZ\r\nContent-Disposition: form-data; name=\"p%d\"\r\n\r\n%d\r\n",
                               i, i);
    len += (size_t)sprintf(body + len, "--XyZ--\r\n");
    md_multipart_part parts[8];
    size_t n;
    md_err err;
    assert_int_equal(parse_all(CT, body, len, parts, 5, &n, &err), MD_OK);
    assert_int_equal(n, 5);
    assert_int_equal(parse_all(CT, body, len, parts, 4, &n, &err), MD_ETOOBIG);
    assert_int_equal(n, 4);
    assert_msg_has(err.msg, "more than 4 parts", "max_request_images", NULL);
    assert_int_equal(parse_all(CT, body, len, parts, 0, &n, &err), MD_ETOOBIG);
}

static void test_eq(void **state)
{
    (void)state;
    assert_true(md_multipart_eq("Image/PNG", 9, "image/png"));
    assert_false(md_multipart_eq("image/pngx", 10, "image/png"));
    assert_false(md_multipart_eq("image/pn", 8, "image/png"));
    assert_false(md_multipart_eq(NULL, 0, ""));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_curl_body),
        cmocka_unit_test(test_quoted_boundary),
        cmocka_unit_test(test_preamble_epilogue_padding),
        cmocka_unit_test(test_no_parts),
        cmocka_unit_test(test_missing_final_boundary),
        cmocka_unit_test(test_lf_only_refused),
        cmocka_unit_test(test_boundary_inside_data),
        cmocka_unit_test(test_bad_boundaries),
        cmocka_unit_test(test_part_headers),
        cmocka_unit_test(test_too_many_parts),
        cmocka_unit_test(test_eq),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
