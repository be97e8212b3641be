/*
 * test_readers.c - unit tests of the streaming dataset readers in
 * jobs/readers.c: every format (CSV, JSONL, NPY, IDX plain and gzip) on
 * the committed fixtures with exact values, labels, widths and totals; every
 * malformed-row class with its 0-based row number in the message and the
 * next row still read after it; the end of data; every open error; resume by
 * skipping; a 20 MB CSV read through; a CSV read from a FIFO whose writer
 * waits until the first row has been returned (a reader that slurped the
 * file could not return it); a row past the 64 MiB record limit skipped; and
 * the real FashionMNIST test set when it is installed; and a folder of PNG
 * files (input format images): order, hidden names, symlinks and non-images
 * skipped, folder and regex labels, resume by number.
 *
 * Fixtures are read from tests/fixtures/datasets relative to the working
 * directory (make runs the tests from the repository root) and are written
 * by tests/fixtures/make_datasets.py, whose formulas the helpers below repeat.
 * Temporary files go under /tmp and are removed by the teardown.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <zlib.h>

#include "../jobs/gzstream.h"
#include "../jobs/jobs.h"
#include "test_util.h"

#define DATASETS "tests/fixtures/datasets/"
#define FASHION "/usr/share/datasets/fashion-mnist/"

/* ---- helpers ---- */

/* Open with `features` given as JSON text (or NULL). */
static md_status open_reader(const char *path, const char *format, const char *features,
                             const char *label, md_reader **r, md_err *err)
{
    json_t *feat = NULL;
    if (features) {
        feat = json_loads(features, JSON_DECODE_ANY, NULL);
        assert_non_null(feat);
    }
    md_reader_opts opts = {.path = path, .format = format, .features = feat, .label = label};
    md_err_clear(err);
    *r = (md_reader *)(intptr_t)1; /* must be reset on failure */
    md_status st = md_reader_open(&opts, r, err);
    json_decref(feat);
    if (st != MD_OK) {
        assert_null(*r);
        assert_int_equal(err->status, st);
    } else {
        assert_non_null(*r);
    }
    return st;
}

/* Open, expecting MD_EINVAL "invalid_dataset"; returns the message. */
static const char *open_fails(const char *path, const char *format, const char *features,
                              const char *label, md_err *err)
{
    md_reader *r;
    assert_int_equal(open_reader(path, format, features, label, &r, err), MD_EINVAL);
    assert_string_equal(md_err_code(err), "invalid_dataset");
    return err->msg;
}

static md_reader *open_ok(const char *path, const char *format, const char *features,
                          const char *label)
{
    md_reader *r;
    md_err err;
    md_status st = open_reader(path, format, features, label, &r, &err);
    if (st != MD_OK)
        fail_msg("opening %s failed: %s", path, err.msg);
    return r;
}

/* The next row must be MD_OK with exactly `want` (width values) and `label`
 * (-1: the reader gives no label). */
static void expect_row(md_reader *r, const float *want, int64_t label)
{
    int64_t width = md_reader_row_width(r);
    float row[64];
    assert_true(width <= 64);
    int64_t got_label = -7;
    md_err err;
    md_err_clear(&err);
    int64_t before = md_reader_position(r);
    md_status st = md_reader_next(r, row, &got_label, &err);
    if (st != MD_OK)
        fail_msg("row %lld: status %d: %s", (long long)before, st, err.msg);
    for (int64_t j = 0; j < width; j++)
        if (row[j] != want[j])
            fail_msg("row %lld value %lld: got %.9g, want %.9g",
                     (long long)md_reader_position(r) - 1, (long long)j, row[j], want[j]);
    assert_int_equal(got_label, label);
}

/* The next row must fail with `st` and a message holding each string. */
static void expect_bad_row(md_reader *r, md_status want, ...)
{
    float row[64];
    int64_t label;
    md_err err;
    md_err_clear(&err);
    int64_t before = md_reader_position(r);
    md_status st = md_reader_next(r, row, &label, &err);
    if (st != want)
        fail_msg("row %lld: status %d, want %d (%s)", (long long)before, st, want, err.msg);
    assert_int_equal(err.status, want);
    if (want == MD_EINVAL) {
        assert_string_equal(md_err_code(&err), "invalid_dataset");
        /* a bad row is consumed */
        assert_int_equal(md_reader_position(r), before + 1);
    }
    va_list ap;
    va_start(ap, want);
    for (const char *s = va_arg(ap, const char *); s; s = va_arg(ap, const char *))
        if (!strstr(err.msg, s)) {
            va_end(ap);
            fail_msg("message \"%s\" lacks \"%s\"", err.msg, s);
        }
    va_end(ap);
}

/* The end: MD_ENOTFOUND, twice, and the position stays. */
static void expect_end(md_reader *r, int64_t rows)
{
    float row[64];
    int64_t label;
    md_err err;
    for (int i = 0; i < 2; i++) {
        md_err_clear(&err);
        assert_int_equal(md_reader_next(r, row, &label, &err), MD_ENOTFOUND);
        assert_int_equal(md_reader_position(r), rows);
    }
}

/* make_datasets.py's SMALL table and labels */
static void small_row(int i, float *out)
{
    for (int j = 0; j < 4; j++)
        out[j] = (float)((4 * i + j) * 0.25 - 2.0);
}

static int64_t small_label(int i)
{
    return (i * 7) % 10;
}

/* ---- CSV ---- */

static void test_csv_small(void **state)
{
    (void)state;
    md_reader *r = open_ok(DATASETS "small.csv", "csv", NULL, "label");
    assert_int_equal(md_reader_row_width(r), 4);
    assert_int_equal(md_reader_total_rows(r), -1);
    assert_int_equal(md_reader_has_labels(r), 1);
    assert_int_equal(md_reader_position(r), 0);
    for (int i = 0; i < 6; i++) {
        float want[4];
        small_row(i, want);
        expect_row(r, want, small_label(i));
        assert_int_equal(md_reader_position(r), i + 1);
    }
    expect_end(r, 6);
    md_reader_close(r);
}

/* Without `label` the label column is one more feature ("1.0" reads as 1). */
static void test_csv_without_label(void **state)
{
    (void)state;
    md_reader *r = open_ok(DATASETS "small.csv", "csv", NULL, NULL);
    assert_int_equal(md_reader_row_width(r), 5);
    assert_int_equal(md_reader_has_labels(r), 0);
    for (int i = 0; i < 6; i++) {
        float want[5];
        small_row(i, want);
        want[4] = (float)small_label(i);
        expect_row(r, want, -1);
    }
    expect_end(r, 6);
    md_reader_close(r);
}

/* `features` picks and orders the columns. */
static void test_csv_features(void **state)
{
    (void)state;
    md_reader *r = open_ok(DATASETS "small.csv", "csv", "[\"x3\", \"x1\"]", "label");
    assert_int_equal(md_reader_row_width(r), 2);
    for (int i = 0; i < 6; i++) {
        float all[4];
        small_row(i, all);
        float want[2] = {all[2], all[0]};
        expect_row(r, want, small_label(i));
    }
    expect_end(r, 6);
    md_reader_close(r);
}

/* Quoted commas, doubled quotes, a newline inside quotes, a blank line, a
 * quoted number, spaces around a number; text columns left out by features. */
static void test_csv_quoted(void **state)
{
    (void)state;
    md_reader *r = open_ok(DATASETS "quoted.csv", "csv", "[\"x1\", \"x2\"]", "label");
    expect_row(r, (float[]){1.5f, -2}, 3);
    expect_row(r, (float[]){0.25f, 4}, 1);
    expect_row(r, (float[]){-0.5f, 8.75f}, 0);
    expect_row(r, (float[]){100, 7}, 2);
    expect_end(r, 4);
    md_reader_close(r);

    /* with every column a feature, the text fields come back unquoted in
     * the messages: proof of the splitting */
    r = open_ok(DATASETS "quoted.csv", "csv", NULL, "label");
    assert_int_equal(md_reader_row_width(r), 4);
    expect_bad_row(r, MD_EINVAL, "quoted.csv row 0: column \"name\" is not a number: \"a,b\"", NULL);
    expect_bad_row(r, MD_EINVAL, "quoted.csv row 1: column \"name\" is not a number: \"say \"hi\"\"",
                   NULL);
    expect_bad_row(r, MD_EINVAL, "quoted.csv row 2: column \"name\" is not a number: \"two\\x0alines\"",
                   NULL);
    expect_bad_row(r, MD_EINVAL, "quoted.csv row 3: column \"name\" is not a number: \"plain\"", NULL);
    expect_end(r, 4);
    md_reader_close(r);
}

/* Bad rows name their row; each is consumed and the next good row follows. */
/* Chunked jobs (issue 26): the byte offset where each next record starts,
 * a quoted newline inside a record and a blank line between records
 * included, and the fixed-row layout of NPY and plain IDX (none for gzip). */
static void test_chunk_offsets_and_layout(void **state)
{
    (void)state;
    md_reader *r = open_ok(DATASETS "quoted.csv", "csv", "[\"x1\", \"x2\"]", "label");
    assert_int_equal(md_reader_byte_offset(r), 20); /* after the header */
    const int64_t after[] = {37, 61, 88, 108};      /* row 2 holds a newline in quotes */
    for (int i = 0; i < 4; i++) {
        float row[2];
        int64_t label;
        md_err err;
        assert_int_equal(md_reader_next(r, row, &label, &err), MD_OK);
        assert_int_equal(md_reader_byte_offset(r), after[i]);
    }
    int64_t off, rb, loff;
    assert_int_equal(md_reader_layout(r, &off, &rb, &loff), 0);
    md_reader_close(r);

    r = open_ok(DATASETS "small_u8.npy", "npy", NULL, NULL);
    assert_int_equal(md_reader_byte_offset(r), -1);
    assert_int_equal(md_reader_layout(r, &off, &rb, &loff), 1);
    assert_int_equal(off, 128);
    assert_int_equal(rb, 4);
    assert_int_equal(loff, -1);
    md_reader_close(r);

    r = open_ok(DATASETS "images.idx3", "idx", NULL, DATASETS "labels.idx1");
    assert_int_equal(md_reader_layout(r, &off, &rb, &loff), 1);
    assert_int_equal(off, 16); /* the magic and three sizes */
    assert_int_equal(rb, md_reader_row_width(r));
    assert_int_equal(loff, 8);
    md_reader_close(r);

    r = open_ok(DATASETS "images.idx3.gz", "idx", NULL, DATASETS "labels.idx1.gz");
    assert_int_equal(md_reader_layout(r, &off, &rb, &loff), 0); /* gzip: no random access */
    md_reader_close(r);
}

static void test_csv_bad_rows(void **state)
{
    (void)state;
    md_reader *r = open_ok(DATASETS "bad.csv", "csv", NULL, "label");
    expect_row(r, (float[]){1, 2, 3, 4}, 0);
    expect_row(r, (float[]){5, 6, 7, 8}, 1);
    expect_bad_row(r, MD_EINVAL, "bad.csv row 2: column \"x2\" is not a number: \"abc\"", NULL);
    expect_row(r, (float[]){13, 14, 15, 16}, 3);
    expect_bad_row(r, MD_EINVAL, "bad.csv row 4: has 4 fields, the header has 5", NULL);
    expect_bad_row(r, MD_EINVAL, "bad.csv row 5: the label column \"label\" is not an integer: \"2.5\"",
                   NULL);
    expect_row(r, (float[]){25, 26, 27, 28}, 6);
    expect_end(r, 7);
    md_reader_close(r);
}

/* Malformed text built here, one case per file. */
static void test_csv_malformed(void **state)
{
    (void)state;
    char path[64];
    md_reader *r;

    write_temp(path, "a,b\n1,\n");
    r = open_ok(path, "csv", NULL, NULL);
    expect_bad_row(r, MD_EINVAL, "row 0: column \"b\" is empty", NULL);
    expect_end(r, 1);
    md_reader_close(r);

    write_temp(path, "a,b\n1,nan\n2,1e999\n3,-inf\n4,1e30x\n5,0x10\n");
    r = open_ok(path, "csv", NULL, NULL);
    expect_bad_row(r, MD_EINVAL, "row 0: column \"b\" is not a finite float32 number: \"nan\"", NULL);
    expect_bad_row(r, MD_EINVAL, "row 1: column \"b\" is not a finite float32 number: \"1e999\"", NULL);
    expect_bad_row(r, MD_EINVAL, "row 2: column \"b\" is not a finite float32 number", NULL);
    expect_bad_row(r, MD_EINVAL, "row 3: column \"b\" is not a number: \"1e30x\"", NULL);
    expect_row(r, (float[]){5, 16}, -1); /* strtod reads hex */
    expect_end(r, 5);
    md_reader_close(r);

    /* text after a closing quote; a quote never closed (at the end) */
    write_temp(path, "a,b\n\"1\"x,2\n3,4\n5,\"6\n");
    r = open_ok(path, "csv", NULL, NULL);
    expect_bad_row(r, MD_EINVAL, "row 0: a quoted field has text after its closing quote", NULL);
    expect_row(r, (float[]){3, 4}, -1);
    expect_bad_row(r, MD_EINVAL, "row 2: a quoted field is not closed before the end of the file",
                   NULL);
    expect_end(r, 3);
    md_reader_close(r);

    /* labels: empty, not integral, too big; integral forms accepted */
    write_temp(path, "x,y\n1,\n2,1.5\n3,1e30\n4, -3 \n5,2e1\n6,abc\n");
    r = open_ok(path, "csv", NULL, "y");
    expect_bad_row(r, MD_EINVAL, "row 0: the label column \"y\" is empty", NULL);
    expect_bad_row(r, MD_EINVAL, "row 1: the label column \"y\" is not an integer: \"1.5\"", NULL);
    expect_bad_row(r, MD_EINVAL, "row 2: the label column \"y\" is not an integer: \"1e30\"", NULL);
    expect_row(r, (float[]){4}, -3);
    expect_row(r, (float[]){5}, 20);
    expect_bad_row(r, MD_EINVAL, "row 5: the label column \"y\" is not an integer: \"abc\"", NULL);
    expect_end(r, 6);
    md_reader_close(r);

    /* too many fields; a long bad value is cut in the message */
    write_temp(path, "a\n1,2\n1.50000000000000000000000000000000000000000000000000000000000\n"
                     "abcdefghijklmnopqrstuvwxyzabcdefghijklmnopqrstuvwxyz\n");
    r = open_ok(path, "csv", NULL, NULL);
    expect_bad_row(r, MD_EINVAL, "row 0: has 2 fields, the header has 1", NULL);
    expect_row(r, (float[]){1.5f}, -1);
    expect_bad_row(r, MD_EINVAL, "row 2: column \"a\" is not a number: "
                   "\"abcdefghijklmnopqrstuvwxyzabcdefghijklmn...\"", NULL);
    md_reader_close(r);
}

/* Line ends and blank lines: LF, CRLF, none at the end, blank lines in the
 * middle and the end (not rows), a byte-order mark and spaces in the header. */
static void test_csv_layout(void **state)
{
    (void)state;
    char path[64];
    md_reader *r;

    write_temp(path, "\xEF\xBB\xBF a , b \r\n\r\n1,2\n\n   \n3,4\r\n5,6\r\n\r\n\n");
    r = open_ok(path, "csv", "[\"b\", \"a\"]", NULL);
    expect_row(r, (float[]){2, 1}, -1);
    expect_row(r, (float[]){4, 3}, -1);
    expect_row(r, (float[]){6, 5}, -1);
    expect_end(r, 3);
    md_reader_close(r);

    write_temp(path, "a,b\n1,2\n3,4");
    r = open_ok(path, "csv", NULL, "b");
    expect_row(r, (float[]){1}, 2);
    expect_row(r, (float[]){3}, 4);
    expect_end(r, 2);
    md_reader_close(r);

    /* a header alone: the width is known, there are no rows */
    write_temp(path, "a,b,c\n");
    r = open_ok(path, "csv", NULL, NULL);
    assert_int_equal(md_reader_row_width(r), 3);
    expect_end(r, 0);
    md_reader_close(r);

    /* a quoted header name with a comma */
    write_temp(path, "\"a,1\",b\n1,2\n");
    md_err err;
    assert_msg_has(open_fails(path, "csv", "[\"a\"]", NULL, &err),
                   "the feature column \"a\" is not in the header (columns: a,1, b)", NULL);
    r = open_ok(path, "csv", "[\"a,1\"]", NULL);
    expect_row(r, (float[]){1}, -1);
    md_reader_close(r);
}

static void test_csv_open_errors(void **state)
{
    (void)state;
    char path[64];
    md_err err;
    const char *small = DATASETS "small.csv";

    assert_msg_has(open_fails(small, "csv", "[\"x1\", \"x9\"]", "label", &err),
                   "small.csv: the feature column \"x9\" is not in the header "
                   "(columns: x1, x2, x3, x4, label)", NULL);
    assert_msg_has(open_fails(small, "csv", NULL, "y", &err),
                   "small.csv: the label column \"y\" is not in the header", "x1, x2", NULL);
    assert_msg_has(open_fails(small, "csv", "\"x1\"", NULL, &err),
                   "features must be an array of column names", NULL);
    assert_msg_has(open_fails(small, "csv", "[]", NULL, &err), "features is empty", NULL);
    assert_msg_has(open_fails(small, "csv", "[\"x1\", 2]", NULL, &err),
                   "features[1] is not a string", NULL);

    write_temp(path, "");
    assert_msg_has(open_fails(path, "csv", NULL, NULL, &err), "is empty; a csv needs a header", NULL);
    write_temp(path, "\n\r\n");
    assert_msg_has(open_fails(path, "csv", NULL, NULL, &err), "is empty; a csv needs a header", NULL);
    write_temp(path, "label\n1\n");
    assert_msg_has(open_fails(path, "csv", NULL, "label", &err),
                   "has no feature columns: its only column is the label \"label\"", NULL);
    write_temp(path, "\"a\"b,c\n1,2\n");
    assert_msg_has(open_fails(path, "csv", NULL, NULL, &err),
                   "header: a quoted column name has text after its closing quote", NULL);
}

/* ---- JSONL ---- */

static void test_jsonl_arrays(void **state)
{
    (void)state;
    md_reader *r = open_ok(DATASETS "small.jsonl", "jsonl", NULL, NULL);
    assert_int_equal(md_reader_row_width(r), 4);
    assert_int_equal(md_reader_total_rows(r), -1);
    assert_int_equal(md_reader_has_labels(r), 0);
    assert_int_equal(md_reader_position(r), 0); /* row 0 was read at open, not consumed */
    for (int i = 0; i < 6; i++) {
        float want[4];
        small_row(i, want);
        expect_row(r, want, -1);
        assert_int_equal(md_reader_position(r), i + 1); /* the blank line is no row */
    }
    expect_end(r, 6);
    md_reader_close(r);
}

static void test_jsonl_objects(void **state)
{
    (void)state;
    /* "label" is taken by default when row 0 has it, and can be named */
    for (int named = 0; named < 2; named++) {
        md_reader *r = open_ok(DATASETS "objects.jsonl", "jsonl", named ? "\"features\"" : NULL,
                               named ? "label" : NULL);
        assert_int_equal(md_reader_row_width(r), 4);
        assert_int_equal(md_reader_has_labels(r), 1);
        for (int i = 0; i < 6; i++) {
            float want[4];
            small_row(i, want);
            expect_row(r, want, small_label(i));
        }
        expect_end(r, 6);
        md_reader_close(r);
    }

    /* other field names; nested values; objects without a label field */
    char path[64];
    write_temp(path, "{\"x\": [[1, 2], [3]], \"y\": 4}\n{\"y\": -1, \"x\": [5, [6, [7]]]}\n");
    md_reader *r = open_ok(path, "jsonl", "\"x\"", "y");
    assert_int_equal(md_reader_row_width(r), 3);
    expect_row(r, (float[]){1, 2, 3}, 4);
    expect_row(r, (float[]){5, 6, 7}, -1);
    expect_end(r, 2);
    md_reader_close(r);

    write_temp(path, "{\"features\": [1, 2]}\n[3, 4]\n");
    r = open_ok(path, "jsonl", NULL, NULL);
    assert_int_equal(md_reader_has_labels(r), 0);
    expect_row(r, (float[]){1, 2}, -1);
    expect_row(r, (float[]){3, 4}, -1);
    expect_end(r, 2);
    md_reader_close(r);
}

static void test_jsonl_bad_rows(void **state)
{
    (void)state;
    md_reader *r = open_ok(DATASETS "bad.jsonl", "jsonl", NULL, NULL);
    assert_int_equal(md_reader_has_labels(r), 1);
    expect_row(r, (float[]){1, 2, 3, 4}, 0);
    expect_bad_row(r, MD_EINVAL, "bad.jsonl row 1: invalid JSON", NULL);
    expect_bad_row(r, MD_EINVAL, "bad.jsonl row 2: has 3 values, the first row has 4", NULL);
    expect_bad_row(r, MD_EINVAL, "bad.jsonl row 3: value 1 is not a number", NULL);
    expect_bad_row(r, MD_EINVAL, "bad.jsonl row 4: the label field \"label\" is not an integer", NULL);
    expect_bad_row(r, MD_EINVAL, "bad.jsonl row 5: has no field \"features\"", NULL);
    expect_bad_row(r, MD_EINVAL, "bad.jsonl row 6: is a number, not an array or an object", NULL);
    expect_row(r, (float[]){5, 6, 7, 8}, 7);
    expect_end(r, 8);
    md_reader_close(r);

    char path[64];
    write_temp(path, "[1, 2]\n[1e39, 2]\n{\"features\": [1, 2]}\n[true, 2]\n[[], [1, 2]]\n"
                     "{\"features\": 3}\n[1, 2, 3]\n");
    r = open_ok(path, "jsonl", NULL, NULL);
    expect_row(r, (float[]){1, 2}, -1);
    expect_bad_row(r, MD_EINVAL, "row 1: value 0 is not a finite float32 number", NULL);
    expect_row(r, (float[]){1, 2}, -1);
    expect_bad_row(r, MD_EINVAL, "row 3: value 0 is not a number", NULL);
    expect_row(r, (float[]){1, 2}, -1);
    expect_bad_row(r, MD_EINVAL, "row 5: field \"features\" is a number, not an array of numbers",
                   NULL);
    expect_bad_row(r, MD_EINVAL, "row 6: has 3 values, the first row has 2", NULL);
    expect_end(r, 7);
    md_reader_close(r);

    /* labels asked for: a row without the field, or an array row */
    write_temp(path, "{\"features\": [1], \"label\": 1}\n{\"features\": [2]}\n[3]\n"
                     "{\"features\": [4], \"label\": \"cat\"}\n{\"features\": [5], \"label\": 5.0}\n");
    r = open_ok(path, "jsonl", NULL, "label");
    expect_row(r, (float[]){1}, 1);
    expect_bad_row(r, MD_EINVAL, "row 1: has no field \"label\" (the label)", NULL);
    expect_bad_row(r, MD_EINVAL, "row 2: is an array, so it has no label field \"label\"", NULL);
    expect_bad_row(r, MD_EINVAL, "row 3: the label field \"label\" is not an integer", NULL);
    expect_row(r, (float[]){5}, 5);
    expect_end(r, 5);
    md_reader_close(r);
}

static void test_jsonl_open_errors(void **state)
{
    (void)state;
    char path[64];
    md_err err;

    write_temp(path, "");
    assert_msg_has(open_fails(path, "jsonl", NULL, NULL, &err), "has no rows", NULL);
    write_temp(path, "\n  \n\r\n");
    assert_msg_has(open_fails(path, "jsonl", NULL, NULL, &err), "has no rows", NULL);
    write_temp(path, "\n[1, \n[1, 2]\n");
    assert_msg_has(open_fails(path, "jsonl", NULL, NULL, &err), "row 0: invalid JSON", NULL);
    write_temp(path, "[]\n");
    assert_msg_has(open_fails(path, "jsonl", NULL, NULL, &err), "row 0: has no values", NULL);
    assert_msg_has(open_fails(DATASETS "small.jsonl", "jsonl", "[\"a\"]", NULL, &err),
                   "features must be a string", NULL);
    assert_msg_has(open_fails(DATASETS "small.jsonl", "jsonl", NULL, "label", &err),
                   "small.jsonl row 0: is an array, so it has no label field \"label\"", NULL);
    assert_msg_has(open_fails(DATASETS "objects.jsonl", "jsonl", "\"values\"", NULL, &err),
                   "objects.jsonl row 0: has no field \"values\"", NULL);
}

/* ---- NPY ---- */

static void test_npy_dtypes(void **state)
{
    (void)state;
    static const char *files[] = {"small_f32.npy", "small_f64.npy", "small_u8.npy",
                                  "small_i64.npy", "small_i32.npy"};
    for (int f = 0; f < 5; f++) {
        char path[128];
        snprintf(path, sizeof path, DATASETS "%s", files[f]);
        md_reader *r = open_ok(path, "npy", NULL, NULL);
        assert_int_equal(md_reader_row_width(r), 4);
        assert_int_equal(md_reader_total_rows(r), 6);
        assert_int_equal(md_reader_has_labels(r), 0);
        for (int i = 0; i < 6; i++) {
            float want[4];
            for (int j = 0; j < 4; j++) {
                int k = 4 * i + j;
                switch (f) {
                case 0:
                case 1: want[j] = (float)(k * 0.25 - 2.0); break;
                case 2: want[j] = (float)(10 * k + 5); break;
                case 3: want[j] = (float)((k - 12) * 1000); break;
                default: want[j] = (float)(k - 7); break;
                }
            }
            expect_row(r, want, -1);
        }
        expect_end(r, 6);
        md_reader_close(r);
    }
}

static void test_npy_3d(void **state)
{
    (void)state;
    md_reader *r = open_ok(DATASETS "images_3d.npy", "npy", NULL, NULL);
    assert_int_equal(md_reader_row_width(r), 6);
    assert_int_equal(md_reader_total_rows(r), 5);
    for (int i = 0; i < 5; i++) {
        float want[6];
        for (int k = 0; k < 6; k++)
            want[k] = (float)((6 * i + k) * 0.5);
        expect_row(r, want, -1);
    }
    expect_end(r, 5);
    md_reader_close(r);
}

static void test_npy_errors(void **state)
{
    (void)state;
    md_err err;
    assert_msg_has(open_fails(DATASETS "fortran.npy", "npy", NULL, NULL, &err),
                   "fortran.npy: the array is in Fortran order", "ascontiguousarray", NULL);
    assert_msg_has(open_fails(DATASETS "big_endian.npy", "npy", NULL, NULL, &err),
                   "big_endian.npy: NPY dtype '>f4' is not supported", NULL);
    assert_msg_has(open_fails(DATASETS "truncated.npy", "npy", NULL, NULL, &err),
                   "truncated.npy is truncated: the header says 6 rows of 16 bytes", NULL);
    assert_msg_has(open_fails(DATASETS "small.csv", "npy", NULL, NULL, &err),
                   "small.csv is not an NPY file", NULL);
    assert_msg_has(open_fails(DATASETS "small_f32.npy", "npy", NULL, "label", &err),
                   "npy files carry no labels", NULL);
    assert_msg_has(open_fails(DATASETS "small_f32.npy", "npy", "[\"a\"]", NULL, &err),
                   "features applies to csv and jsonl only", NULL);

    /* a NaN row is bad; the rows around it read */
    md_reader *r = open_ok(DATASETS "nan_f32.npy", "npy", NULL, NULL);
    expect_row(r, (float[]){0, 1, 2, 3}, -1);
    expect_bad_row(r, MD_EINVAL, "nan_f32.npy row 1: value 2 is NaN or infinite", NULL);
    expect_row(r, (float[]){8, 9, 10, 11}, -1);
    expect_end(r, 3);
    md_reader_close(r);

    /* a version 2 header and a 1-D array (width 1) */
    static const char hdr[] = "{'descr': '<i4', 'fortran_order': False, 'shape': (3,), }";
    char file[256];
    size_t hlen = 128 - 12;
    memcpy(file, "\x93NUMPY\x02\x00", 8);
    file[8] = (char)hlen, file[9] = file[10] = file[11] = 0;
    memset(file + 12, ' ', hlen);
    memcpy(file + 12, hdr, sizeof hdr - 1);
    file[12 + hlen - 1] = '\n';
    int32_t vals[3] = {-5, 0, 70000};
    memcpy(file + 128, vals, sizeof vals);
    char path[64];
    write_temp_n(path, file, 128 + sizeof vals);
    r = open_ok(path, "npy", NULL, NULL);
    assert_int_equal(md_reader_row_width(r), 1);
    assert_int_equal(md_reader_total_rows(r), 3);
    expect_row(r, (float[]){-5}, -1);
    expect_row(r, (float[]){0}, -1);
    expect_row(r, (float[]){70000}, -1);
    expect_end(r, 3);
    md_reader_close(r);
}

/* Write a version 1 NPY file of `rows` x `width` values of `descr`. */
static void write_npy(char *path, const char *descr, int rows, int width, const void *data,
                      size_t esize)
{
    char hdr[128];
    int n = snprintf(hdr, sizeof hdr, "{'descr': '%s', 'fortran_order': False, 'shape': (%d, %d), }",
                     descr, rows, width);
    size_t hlen = 128 - 10, total = 128 + (size_t)rows * (size_t)width * esize;
    char *file = malloc(total);
    assert_non_null(file);
    memcpy(file, "\x93NUMPY\x01\x00", 8);
    file[8] = (char)hlen, file[9] = 0;
    memset(file + 10, ' ', hlen);
    memcpy(file + 10, hdr, (size_t)n);
    file[10 + hlen - 1] = '\n';
    memcpy(file + 128, data, total - 128);
    write_temp_n(path, file, total);
    free(file);
}

/* Rows wider than a vector register, of an odd width, in every dtype: the
 * conversion loops' bodies and tails both run; a bad value anywhere in a
 * wide row is found and named. */
static void test_npy_wide_rows(void **state)
{
    (void)state;
    enum { W = 37, R = 3 };
    float want[R][W];
    uint8_t u1[R][W];
    int32_t i4[R][W];
    int64_t i8[R][W];
    float f4[R][W];
    double f8[R][W];
    for (int i = 0; i < R; i++)
        for (int j = 0; j < W; j++) {
            int v = (i * W + j) % 251;
            want[i][j] = (float)v;
            u1[i][j] = (uint8_t)v;
            i4[i][j] = v;
            i8[i][j] = v;
            f4[i][j] = (float)v;
            f8[i][j] = v;
        }
    static const char *const descr[] = {"|u1", "<i4", "<i8", "<f4", "<f8"};
    const void *data[] = {u1, i4, i8, f4, f8};
    const size_t esize[] = {1, 4, 8, 4, 8};
    for (int k = 0; k < 5; k++) {
        char path[64];
        write_npy(path, descr[k], R, W, data[k], esize[k]);
        md_reader *r = open_ok(path, "npy", NULL, NULL);
        assert_int_equal(md_reader_row_width(r), W);
        for (int i = 0; i < R; i++)
            expect_row(r, want[i], -1);
        expect_end(r, R);
        md_reader_close(r);
    }
    /* +inf late in a float32 row; 1e300 (finite, but not as float32) in a float64 row */
    char path[64];
    f4[1][W - 2] = INFINITY;
    write_npy(path, "<f4", R, W, f4, 4);
    md_reader *r = open_ok(path, "npy", NULL, NULL);
    expect_row(r, want[0], -1);
    expect_bad_row(r, MD_EINVAL, "row 1: value 35 is NaN or infinite", NULL);
    expect_row(r, want[2], -1);
    md_reader_close(r);
    f8[2][W - 1] = 1e300;
    write_npy(path, "<f8", R, W, f8, 8);
    r = open_ok(path, "npy", NULL, NULL);
    expect_row(r, want[0], -1);
    expect_row(r, want[1], -1);
    expect_bad_row(r, MD_EINVAL, "row 2: value 36 is not a finite float32 number", NULL);
    expect_end(r, R);
    md_reader_close(r);
}

/* ---- IDX ---- */

static void expect_idx_rows(md_reader *r, int labels)
{
    static const int64_t want_labels[5] = {9, 0, 3, 255, 7};
    assert_int_equal(md_reader_row_width(r), 6);
    assert_int_equal(md_reader_total_rows(r), 5);
    assert_int_equal(md_reader_has_labels(r), labels);
    for (int i = 0; i < 5; i++) {
        float want[6];
        for (int k = 0; k < 6; k++)
            want[k] = (float)((i * 50 + k * 7) % 256);
        expect_row(r, want, labels ? want_labels[i] : -1);
    }
    expect_end(r, 5);
}

static void test_idx(void **state)
{
    (void)state;
    md_reader *r = open_ok(DATASETS "images.idx3", "idx", NULL, DATASETS "labels.idx1");
    expect_idx_rows(r, 1);
    md_reader_close(r);
    r = open_ok(DATASETS "images.idx3.gz", "idx", NULL, DATASETS "labels.idx1.gz");
    expect_idx_rows(r, 1);
    md_reader_close(r);
    r = open_ok(DATASETS "images.idx3.gz", "idx", NULL, DATASETS "labels.idx1"); /* mixed */
    expect_idx_rows(r, 1);
    md_reader_close(r);
    r = open_ok(DATASETS "images.idx3", "idx", NULL, NULL);
    expect_idx_rows(r, 0);
    md_reader_close(r);

    /* an idx1 file as the data: width 1 */
    r = open_ok(DATASETS "labels.idx1.gz", "idx", NULL, NULL);
    assert_int_equal(md_reader_row_width(r), 1);
    assert_int_equal(md_reader_total_rows(r), 5);
    expect_row(r, (float[]){9}, -1);
    md_reader_close(r);
}

static void test_idx_errors(void **state)
{
    (void)state;
    md_err err;
    assert_msg_has(open_fails(DATASETS "images.idx3", "idx", NULL,
                              DATASETS "labels_wrong_count.idx1", &err),
                   "labels_wrong_count.idx1 has 4 labels but images.idx3 has 5 rows", NULL);
    assert_msg_has(open_fails(DATASETS "images.idx3", "idx", NULL, DATASETS "images.idx3.gz", &err),
                   "images.idx3.gz is not an IDX labels file", NULL);
    assert_msg_has(open_fails(DATASETS "images.idx3", "idx", NULL, DATASETS "nothing.idx1", &err),
                   "cannot open dataset " DATASETS "nothing.idx1: No such file or directory", NULL);
    assert_msg_has(open_fails(DATASETS "small.csv", "idx", NULL, NULL, &err),
                   "small.csv is not an IDX file", NULL);
    assert_msg_has(open_fails(DATASETS "images.idx3", "idx", "[\"a\"]", NULL, &err),
                   "features applies to csv and jsonl only", NULL);

    /* a file that ends inside row 3 */
    md_reader *r = open_ok(DATASETS "images_truncated.idx3", "idx", NULL, NULL);
    assert_int_equal(md_reader_total_rows(r), 5);
    for (int i = 0; i < 3; i++) {
        float want[6];
        for (int k = 0; k < 6; k++)
            want[k] = (float)((i * 50 + k * 7) % 256);
        expect_row(r, want, -1);
    }
    expect_bad_row(r, MD_EIO, "images_truncated.idx3 row 3: the file ends early (truncated)", NULL);
    md_reader_close(r);

    /* a gzip file cut short */
    FILE *f = fopen(DATASETS "images.idx3.gz", "rb");
    assert_non_null(f);
    char gz[256];
    size_t n = fread(gz, 1, sizeof gz, f);
    fclose(f);
    char path[64];
    write_temp_n(path, gz, n - 12);
    r = open_ok(path, "idx", NULL, NULL);
    float row[6];
    int64_t label;
    md_status st = MD_OK;
    for (int i = 0; i < 6 && st == MD_OK; i++)
        st = md_reader_next(r, row, &label, &err);
    assert_int_equal(st, MD_EIO);
    assert_msg_has(err.msg, "modeld_test_", " row ", ": unexpected end of file", NULL);
    md_reader_close(r);
}

/* ---- gzstream.c: gzip files read as zlib's gzread reads them ---- */

/* One gzip member of data[0, n) at `level`; `fancy`: a header with FEXTRA,
 * FNAME, FCOMMENT and FHCRC (Python's gzip writes FNAME; other tools the
 * rest). Appended to *buf (grown), *len updated. */
static void gz_member(unsigned char **buf, size_t *len, const unsigned char *data, size_t n,
                      int level, int fancy)
{
    z_stream z;
    memset(&z, 0, sizeof z);
    assert_int_equal(deflateInit2(&z, level, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY), Z_OK);
    gz_header h;
    memset(&h, 0, sizeof h);
    unsigned char extra[] = "AB\x02\x00xy";
    if (fancy) {
        h.extra = extra, h.extra_len = 6;
        h.name = (Bytef *)"images.idx3", h.comment = (Bytef *)"a comment";
        h.hcrc = 1;
        assert_int_equal(deflateSetHeader(&z, &h), Z_OK);
    }
    size_t cap = deflateBound(&z, (uLong)n) + 64;
    *buf = realloc(*buf, *len + cap);
    assert_non_null(*buf);
    z.next_in = (Bytef *)data, z.avail_in = (uInt)n;
    z.next_out = *buf + *len, z.avail_out = (uInt)cap;
    assert_int_equal(deflate(&z, Z_FINISH), Z_STREAM_END);
    *len += cap - z.avail_out;
    deflateEnd(&z);
}

/* Everything md_gz reads from `path`, `step` bytes a call; *failed: the read
 * ended on an error (its message in msg). Returns the bytes (caller frees). */
static unsigned char *gz_slurp(const char *path, size_t step, size_t *n, int *failed, char *msg,
                               size_t msg_size)
{
    md_gz *g = md_gz_open(path);
    assert_non_null(g);
    size_t cap = 1 << 16, len = 0;
    unsigned char *out = malloc(cap);
    for (;;) {
        if (len + step > cap) {
            cap = (len + step) * 2;
            out = realloc(out, cap);
            assert_non_null(out);
        }
        size_t got = md_gz_read(g, out + len, step);
        len += got;
        if (got < step)
            break;
    }
    const char *e = md_gz_error(g, NULL);
    *failed = e != NULL;
    snprintf(msg, msg_size, "%s", e ? e : "");
    /* the end stays the end */
    unsigned char b;
    assert_int_equal(md_gz_read(g, &b, 1), 0);
    md_gz_close(g);
    *n = len;
    return out;
}

/* The same file through zlib's gzread: the reference the reader replaced. */
static unsigned char *zlib_slurp(const char *path, size_t *n, int *failed)
{
    gzFile z = gzopen(path, "rb");
    assert_non_null(z);
    size_t cap = 1 << 16, len = 0;
    unsigned char *out = malloc(cap);
    int r;
    for (;;) {
        if (len + 4096 > cap)
            out = realloc(out, cap *= 2);
        r = gzread(z, out + len, 4096);
        if (r <= 0)
            break;
        len += (size_t)r;
    }
    int zerr = Z_OK;
    gzerror(z, &zerr);
    *failed = r < 0 || (zerr != Z_OK && zerr != Z_STREAM_END);
    gzclose(z);
    *n = len;
    return out;
}

/* zlib reads `path` as `want` (n bytes), or, `want` NULL, fails on it. */
static void zlib_agrees(const char *path, const unsigned char *want, size_t n)
{
    size_t zn;
    int zfailed;
    unsigned char *z = zlib_slurp(path, &zn, &zfailed);
    if (!want) {
        assert_true(zfailed);
    } else {
        assert_false(zfailed);
        assert_int_equal(zn, n);
        assert_memory_equal(z, want, n);
    }
    free(z);
}

/* `file` read by md_gz at several call sizes: `want` (n bytes) exactly, then
 * the end with no error; zlib reads the same. */
static void expect_gz_reads(const unsigned char *file, size_t flen, const unsigned char *want,
                            size_t n)
{
    char path[64], msg[128];
    write_temp_n(path, (const char *)file, flen);
    static const size_t steps[] = {1, 7, 784, 65536, 3 << 20};
    for (size_t i = 0; i < sizeof steps / sizeof steps[0]; i++) {
        size_t got;
        int failed;
        unsigned char *out = gz_slurp(path, steps[i], &got, &failed, msg, sizeof msg);
        if (failed)
            fail_msg("step %zu: %s", steps[i], msg);
        assert_int_equal(got, n);
        assert_memory_equal(out, want, n);
        free(out);
    }
    zlib_agrees(path, want, n);
}

/* `file` ends on an error whose message holds `has`; zlib fails on it too.
 * `good` (a file cut short): what md_gz gave before the error is a prefix of
 * it; NULL for damaged data, which inflates to garbage until a check fails
 * (zlib's too: that is what the CRC-32 at a member's end is for). */
static void expect_gz_fails(const unsigned char *file, size_t flen, const unsigned char *good,
                            size_t n, const char *has)
{
    char path[64], msg[128];
    write_temp_n(path, (const char *)file, flen);
    size_t got;
    int failed;
    unsigned char *out = gz_slurp(path, 784, &got, &failed, msg, sizeof msg);
    if (!failed)
        fail_msg("%zu bytes of %zu read with no error", got, n);
    if (has && !strstr(msg, has))
        fail_msg("message \"%s\" lacks \"%s\"", msg, has);
    assert_true(got <= n);
    if (good)
        assert_memory_equal(out, good, got);
    free(out);
    zlib_agrees(path, NULL, 0);
}

static void test_gzstream(void **state)
{
    (void)state;
    /* 600 KB that compress to several deflate blocks and more than the
     * stream's 128 KiB input and output buffers */
    size_t n = 600 * 1000;
    unsigned char *data = malloc(n);
    uint32_t x = 12345;
    for (size_t i = 0; i < n; i++) {
        x = x * 1103515245u + 12345u;
        data[i] = (unsigned char)(i % 784 < 300 ? 0 : (x >> 16) % 40);
    }
    unsigned char *f = NULL;
    size_t flen = 0;

    for (int level = 0; level <= 9; level += 3) { /* 0: stored blocks */
        flen = 0;
        gz_member(&f, &flen, data, n, level, level == 6);
        assert_true(flen > 128 * 1024 || level == 9 || level == 6 || level == 3);
        expect_gz_reads(f, flen, data, n);
    }

    /* members one after another (an empty one among them), then trailing
     * bytes that start no member: ignored, as gzread ignores them */
    flen = 0;
    gz_member(&f, &flen, data, 1000, 6, 0);
    gz_member(&f, &flen, data + 1000, 0, 6, 1);
    gz_member(&f, &flen, data + 1000, 199000, 1, 0);
    gz_member(&f, &flen, data + 200000, n - 200000, 9, 1);
    expect_gz_reads(f, flen, data, n);
    expect_gz_fails(f, flen - 5, data, n, "unexpected end of file"); /* the last member cut */
    f = realloc(f, flen + 16);
    memcpy(f + flen, "\0\0\0\0junk\n", 10);
    expect_gz_reads(f, flen + 10, data, n);
    f[flen] = 0x1f; /* a lone magic byte is no member either */
    expect_gz_reads(f, flen + 1, data, n);

    /* a second member whose header (every field, FHCRC too) or trailer is
     * cut by the stream's 128 KiB reads: the first member is stored
     * (level 0), so its size follows its length, and is sized to end k bytes
     * before the boundary, for every k up to past the header's length */
    for (size_t k = 0; k <= 40; k++) {
        size_t want_end = 128 * 1024 - k, first = want_end - 40;
        for (int tries = 0; tries < 4; tries++) {
            flen = 0;
            gz_member(&f, &flen, data, first, 0, 0);
            if (flen == want_end)
                break;
            first += want_end - flen; /* stored: one more input byte, one more output byte */
        }
        assert_int_equal(flen, want_end);
        gz_member(&f, &flen, data + first, 5000, 6, 1);
        expect_gz_reads(f, flen, data, first + 5000);
    }
    for (size_t k = 1; k <= 12; k++) { /* the first member's trailer cut */
        size_t first = 128 * 1024 - 40;
        for (int tries = 0; tries < 4; tries++) {
            flen = 0;
            gz_member(&f, &flen, data, first, 0, 1);
            if (flen == 128 * 1024 + 8 - k)
                break;
            first += 128 * 1024 + 8 - k - flen;
        }
        assert_int_equal(flen, 128 * 1024 + 8 - k);
        gz_member(&f, &flen, data + first, 5000, 6, 1);
        expect_gz_reads(f, flen, data, first + 5000);
    }

    /* cut short: inside the header, inside the data, inside the trailer */
    flen = 0;
    gz_member(&f, &flen, data, n, 6, 0);
    expect_gz_fails(f, 2, data, n, "unexpected end of file");
    expect_gz_fails(f, 9, data, n, "unexpected end of file");
    expect_gz_fails(f, flen / 2, data, n, "unexpected end of file");
    expect_gz_fails(f, flen - 3, data, n, "unexpected end of file");
    /* a wrong CRC-32, a wrong length, a damaged block, a bad method */
    f[flen - 8] ^= 1;
    expect_gz_fails(f, flen, NULL, n, "incorrect data check");
    f[flen - 8] ^= 1;
    f[flen - 2] ^= 1;
    expect_gz_fails(f, flen, NULL, n, NULL);
    f[flen - 2] ^= 1;
    f[flen / 3] ^= 0x55;
    expect_gz_fails(f, flen, NULL, n, NULL);
    f[flen / 3] ^= 0x55;
    f[2] = 7;
    expect_gz_fails(f, flen, NULL, n, "compression method");
    f[2] = 8;
    expect_gz_reads(f, flen, data, n); /* and back to good */

    /* not gzip: the bytes as they are, whatever their size */
    expect_gz_reads(data, n, data, n);
    expect_gz_reads((const unsigned char *)"\x1f", 1, (const unsigned char *)"\x1f", 1);
    expect_gz_reads(data, 0, data, 0);

    /* what cannot be opened or read */
    errno = 0;
    assert_null(md_gz_open(DATASETS "no such file"));
    assert_int_equal(errno, ENOENT);
    md_gz *g = md_gz_open(DATASETS);
    assert_non_null(g);
    unsigned char b;
    assert_int_equal(md_gz_read(g, &b, 1), 0);
    int e = 0;
    assert_non_null(strstr(md_gz_error(g, &e), "read failed: Is a directory"));
    assert_int_equal(e, EISDIR);
    md_gz_close(g);
    md_gz_close(NULL);
    free(f);
    free(data);
}

/* The reader names the row where a gzip file goes wrong, and why. */
static void test_idx_gzip_errors(void **state)
{
    (void)state;
    FILE *in = fopen(DATASETS "images.idx3.gz", "rb");
    assert_non_null(in);
    unsigned char gz[512];
    size_t n = fread(gz, 1, sizeof gz, in);
    fclose(in);
    assert_true(n > 20 && n < sizeof gz);
    char path[64];
    md_err err;
    /* the CRC-32 is checked at the member's end, after the last row's bytes */
    gz[n - 8] ^= 0xff;
    write_temp_n(path, (const char *)gz, n);
    md_reader *r = open_ok(path, "idx", NULL, NULL);
    float row[6];
    int64_t label;
    md_status st = MD_OK;
    int rows = 0;
    while ((st = md_reader_next(r, row, &label, &err)) == MD_OK)
        rows++;
    assert_int_equal(st, MD_EIO);
    assert_int_equal(rows, 5);
    assert_msg_has(err.msg, "modeld_test_", ", after its last row (5): incorrect data check (CRC-32 "
                   "or length); the file is damaged", NULL);
    md_reader_close(r);

    /* the labels file is checked the same way */
    in = fopen(DATASETS "labels.idx1.gz", "rb");
    assert_non_null(in);
    n = fread(gz, 1, sizeof gz, in);
    fclose(in);
    assert_true(n > 20 && n < sizeof gz);
    gz[n - 8] ^= 0xff;
    write_temp_n(path, (const char *)gz, n);
    r = open_ok(DATASETS "images.idx3", "idx", NULL, path);
    rows = 0;
    while ((st = md_reader_next(r, row, &label, &err)) == MD_OK)
        rows++;
    assert_int_equal(st, MD_EIO);
    assert_int_equal(rows, 5);
    md_reader_close(r);
}

/* Write a version 1 NPY header of `shape` (a Python tuple) with no data. */
static void write_npy_header(char *path, const char *shape)
{
    char file[128];
    memset(file, ' ', sizeof file);
    memcpy(file, "\x93NUMPY\x01\x00", 8);
    file[8] = (char)(sizeof file - 10), file[9] = 0;
    int n = snprintf(file + 10, sizeof file - 10,
                     "{'descr': '<f4', 'fortran_order': False, 'shape': %s, }", shape);
    file[10 + n] = ' ';
    file[sizeof file - 1] = '\n';
    write_temp_n(path, file, sizeof file);
}

/* A row wider than MD_MAX_ROW_VALUES (2^26) is refused at open, naming the
 * limit, before any buffer is sized from the header (the former bound was a
 * 1 GiB row: a 2^27-value f4 row was accepted and sized a 512 MiB buffer,
 * and the job then allocated chunks of batch x width floats from it). */
static void test_row_width_limit(void **state)
{
    (void)state;
    md_err err;
    char path[64];
    write_npy_header(path, "(2, 16384, 8192)");
    assert_msg_has(open_fails(path, "npy", NULL, NULL, &err),
                   "a row holds more than 67108864 values", NULL);
    write_npy_header(path, "(1, 4294967296, 4294967296, 4294967296)");
    assert_msg_has(open_fails(path, "npy", NULL, NULL, &err),
                   "a row holds more than 67108864 values", NULL);
    /* the limit itself passes the width check (then the missing data is named) */
    write_npy_header(path, "(2, 8192, 8192)");
    assert_msg_has(open_fails(path, "npy", NULL, NULL, &err), "is truncated", NULL);
    /* IDX: dims of 2^32 - 1 */
    const unsigned char idx[] = {0, 0, 8, 3, 0, 0, 0, 1, 0xff, 0xff, 0xff, 0xff,
                                 0xff, 0xff, 0xff, 0xff};
    write_temp_n(path, (const char *)idx, sizeof idx);
    assert_msg_has(open_fails(path, "idx", NULL, NULL, &err),
                   "a row holds more than 67108864 values", NULL);
}

/* The real FashionMNIST test set: 10000 rows of 784, 1000 of each class. */
static void test_fashion_mnist(void **state)
{
    (void)state;
    if (access(FASHION "t10k-images-idx3-ubyte.gz", R_OK) != 0) {
        print_message("FashionMNIST not installed under " FASHION "; skipped\n");
        skip();
    }
    md_reader *r = open_ok(FASHION "t10k-images-idx3-ubyte.gz", "idx", NULL,
                           FASHION "t10k-labels-idx1-ubyte.gz");
    assert_int_equal(md_reader_row_width(r), 784);
    assert_int_equal(md_reader_total_rows(r), 10000);
    assert_int_equal(md_reader_has_labels(r), 1);
    float row[784];
    int64_t label, counts[10] = {0}, first = -1;
    md_err err;
    double max = 0;
    md_status st;
    while ((st = md_reader_next(r, row, &label, &err)) == MD_OK) {
        if (first < 0)
            first = label;
        assert_in_range(label, 0, 9);
        counts[label]++;
        for (int k = 0; k < 784; k++)
            if (row[k] > max)
                max = row[k];
    }
    assert_int_equal(st, MD_ENOTFOUND);
    assert_int_equal(md_reader_position(r), 10000);
    assert_int_equal(first, 9);
    for (int c = 0; c < 10; c++)
        assert_int_equal(counts[c], 1000);
    assert_true(max == 255.0); /* unscaled bytes */
    md_reader_close(r);
}

/* ---- across formats ---- */

static void test_open_errors(void **state)
{
    (void)state;
    md_err err;
    md_reader *r;
    static const char *formats[] = {"csv", "jsonl", "npy", "idx"};
    for (int f = 0; f < 4; f++) {
        assert_msg_has(open_fails(DATASETS "missing.data", formats[f], NULL, NULL, &err),
                       "cannot open dataset " DATASETS "missing.data: No such file or directory",
                       NULL);
        assert_msg_has(open_fails("/tmp", formats[f], NULL, NULL, &err), "is a directory", NULL);
    }
    assert_msg_has(open_fails(DATASETS "small.csv", "parquet", NULL, NULL, &err),
                   "unknown dataset format \"parquet\"; use csv, jsonl, npy, npz, idx or images",
                   NULL);
    assert_msg_has(open_fails(DATASETS "small.csv", NULL, NULL, NULL, &err),
                   "no format given for dataset small.csv", NULL);
    assert_msg_has(open_fails(NULL, "csv", NULL, NULL, &err), "no dataset path given", NULL);
    assert_msg_has(open_fails("", "csv", NULL, NULL, &err), "no dataset path given", NULL);
    md_err_clear(&err);
    r = (md_reader *)(intptr_t)1;
    assert_int_equal(md_reader_open(NULL, &r, &err), MD_EINVAL);
    assert_null(r);
    md_reader_close(NULL);
}

/* Resume: a fresh reader skipped N rows with md_reader_next continues at
 * the same row, whatever the format. */
static void test_resume_by_skipping(void **state)
{
    (void)state;
    static const struct {
        const char *path, *format, *label;
    } cases[] = {
        {DATASETS "small.csv", "csv", "label"},
        {DATASETS "small.jsonl", "jsonl", NULL},
        {DATASETS "objects.jsonl", "jsonl", "label"},
        {DATASETS "small_f32.npy", "npy", NULL},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        for (int skip_rows = 0; skip_rows <= 6; skip_rows++) {
            md_reader *r = open_ok(cases[c].path, cases[c].format, NULL, cases[c].label);
            float row[4];
            int64_t label;
            md_err err;
            while (md_reader_position(r) < skip_rows)
                assert_int_equal(md_reader_next(r, row, &label, &err), MD_OK);
            for (int i = skip_rows; i < 6; i++) {
                float want[4];
                small_row(i, want);
                expect_row(r, want, cases[c].label ? small_label(i) : -1);
            }
            expect_end(r, 6);
            md_reader_close(r);
        }
    }
    /* the bad rows count too */
    md_reader *r = open_ok(DATASETS "bad.csv", "csv", NULL, "label");
    float row[4];
    int64_t label;
    md_err err;
    while (md_reader_position(r) < 6)
        md_reader_next(r, row, &label, &err);
    expect_row(r, (float[]){25, 26, 27, 28}, 6);
    md_reader_close(r);
}

/* ---- streaming ---- */

#define BIG_COLS 16

/* Value j of generated row i: a multiple of 1/4, exact in float32. */
static double big_value(long i, int j)
{
    return (double)((i * 31 + j * 7) % 1000) * 0.25 - 100.0;
}

/* Write rows [from, to) of the generated CSV to `f`; returns the bytes. */
static long write_big_rows(FILE *f, long from, long to)
{
    long bytes = 0;
    for (long i = from; i < to; i++) {
        for (int j = 0; j < BIG_COLS; j++)
            bytes += fprintf(f, "%g,", big_value(i, j));
        bytes += fprintf(f, "%ld\r\n", i % 10);
    }
    return bytes;
}

static void write_big_header(FILE *f)
{
    for (int j = 0; j < BIG_COLS; j++)
        fprintf(f, "c%d,", j);
    fprintf(f, "label\n");
}

/* Read every row of a generated CSV, checking each against the formula. */
static long read_big(md_reader *r, void (*after_first)(void *), void *arg)
{
    float row[BIG_COLS];
    int64_t label;
    md_err err;
    md_status st;
    long n = 0;
    while ((st = md_reader_next(r, row, &label, &err)) == MD_OK) {
        if (n == 0 && after_first)
            after_first(arg);
        for (int j = 0; j < BIG_COLS; j++)
            if (row[j] != (float)big_value(n, j))
                fail_msg("row %ld value %d: got %g, want %g", n, j, row[j], big_value(n, j));
        assert_int_equal(label, n % 10);
        n++;
    }
    if (st != MD_ENOTFOUND)
        fail_msg("row %ld: status %d: %s", n, st, err.msg);
    return n;
}

/* A ~20 MB CSV read through, row by row. */
static void test_csv_large(void **state)
{
    (void)state;
    char path[64];
    temp_path(path);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    write_big_header(f);
    long rows = 0, bytes = 0;
    while (bytes < 20L * 1000 * 1000) {
        bytes += write_big_rows(f, rows, rows + 1000);
        rows += 1000;
    }
    assert_int_equal(fclose(f), 0);

    md_reader *r = open_ok(path, "csv", NULL, "label");
    assert_int_equal(md_reader_row_width(r), BIG_COLS);
    assert_int_equal(read_big(r, NULL, NULL), rows);
    assert_int_equal(md_reader_position(r), rows);
    md_reader_close(r);
}

/* Quoted fields with doubled quotes, commas and newlines, CRLF, and rows of
 * varied length, so that records, quotes and line ends straddle the read
 * buffer's refills at many offsets; the same rows as JSONL objects. */
static void test_chunk_boundaries(void **state)
{
    (void)state;
    char csv[64], jsonl[64];
    temp_path(csv);
    temp_path(jsonl);
    FILE *c = fopen(csv, "w"), *j = fopen(jsonl, "w");
    assert_non_null(c);
    assert_non_null(j);
    fputs("id,text,value,label\r\n", c);
    const long rows = 40000;
    for (long i = 0; i < rows; i++) {
        int pad = (int)(i % 97);
        fprintf(c, "%ld,\"q\"\"%*s,\r\n\"\"x\",\"%g\",%ld\r\n", i, pad, "", big_value(i, 0), i % 10);
        fprintf(j, "{\"text\": \"q\\\"%*s,\\n\", \"features\": [%g, %ld], \"label\": %ld}\n", pad, "",
                big_value(i, 0), i, i % 10);
    }
    assert_int_equal(fclose(c), 0);
    assert_int_equal(fclose(j), 0);

    md_reader *r = open_ok(csv, "csv", "[\"value\", \"id\"]", "label");
    md_reader *q = open_ok(jsonl, "jsonl", NULL, NULL);
    assert_int_equal(md_reader_row_width(q), 2);
    for (long i = 0; i < rows; i++) {
        float want[2] = {(float)big_value(i, 0), (float)i};
        expect_row(r, want, i % 10);
        expect_row(q, want, i % 10);
    }
    expect_end(r, rows);
    expect_end(q, rows);
    md_reader_close(r);
    md_reader_close(q);
}

/* The writer of a FIFO writes 4 MB, then waits (up to 20 s) until the reader
 * has returned row 0 before it writes the rest and closes. A reader that
 * streams returns row 0 at once; one that read the whole file first would
 * see the end only after the writer gave up waiting. */
typedef struct fifo_writer {
    const char *path;
    long rows;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int first_row_returned;
    int streamed;
} fifo_writer;

static void *fifo_write(void *arg)
{
    fifo_writer *w = arg;
    FILE *f = fopen(w->path, "w");
    if (!f)
        return NULL;
    write_big_header(f);
    long bytes = 0, rows = 0;
    while (bytes < 4L * 1000 * 1000) {
        bytes += write_big_rows(f, rows, rows + 100);
        rows += 100;
    }
    fflush(f);
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += 20;
    pthread_mutex_lock(&w->mu);
    while (!w->first_row_returned &&
           pthread_cond_timedwait(&w->cv, &w->mu, &deadline) != ETIMEDOUT) {
    }
    w->streamed = w->first_row_returned;
    pthread_mutex_unlock(&w->mu);
    write_big_rows(f, rows, 2 * rows);
    w->rows = 2 * rows;
    fclose(f);
    return NULL;
}

static void first_row_returned(void *arg)
{
    fifo_writer *w = arg;
    pthread_mutex_lock(&w->mu);
    w->first_row_returned = 1;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

static void test_csv_streams_from_fifo(void **state)
{
    (void)state;
    char path[64];
    temp_path(path);
    assert_int_equal(unlink(path), 0);
    assert_int_equal(mkfifo(path, 0600), 0);

    fifo_writer w = {.path = path};
    pthread_mutex_init(&w.mu, NULL);
    pthread_cond_init(&w.cv, NULL);
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, fifo_write, &w), 0);
    md_reader *r = open_ok(path, "csv", NULL, "label");
    long n = read_big(r, first_row_returned, &w);
    md_reader_close(r);
    pthread_join(t, NULL);
    assert_true(w.streamed);
    assert_int_equal(n, w.rows);
    pthread_cond_destroy(&w.cv);
    pthread_mutex_destroy(&w.mu);
}

/* Write `head`, then 65 MiB of '7', then `tail` to a new temp file. */
static void write_huge_row(char *path, const char *head, const char *tail)
{
    temp_path(path);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(head, f);
    static char chunk[1 << 20];
    memset(chunk, '7', sizeof chunk);
    for (int i = 0; i < 65; i++)
        assert_int_equal(fwrite(chunk, 1, sizeof chunk, f), sizeof chunk);
    fputs(tail, f);
    assert_int_equal(fclose(f), 0);
}

/* A row past the 64 MiB record limit is one bad row, not kept in memory;
 * the next row reads. */
static void test_row_too_long(void **state)
{
    (void)state;
    char path[64];
    write_huge_row(path, "a,b\n1,2\n", ",1\n3,4\n");
    md_reader *r = open_ok(path, "csv", NULL, NULL);
    expect_row(r, (float[]){1, 2}, -1);
    expect_bad_row(r, MD_EINVAL, "row 1: the row is longer than 64 MiB", NULL);
    expect_row(r, (float[]){3, 4}, -1);
    expect_end(r, 3);
    md_reader_close(r);
    remove_temps(NULL);

    write_huge_row(path, "[1, 2]\n[", "]\n[3, 4]");
    r = open_ok(path, "jsonl", NULL, NULL);
    expect_row(r, (float[]){1, 2}, -1);
    expect_bad_row(r, MD_EINVAL, "row 1: the row is longer than 64 MiB", NULL);
    expect_row(r, (float[]){3, 4}, -1);
    expect_end(r, 3);
    md_reader_close(r);
}

/* ---- images: a folder of PNG files (jobs/images.c) ---- */

static char img_dir[64];

static int remove_img_dir(void **state)
{
    (void)state;
    char cmd[128];
    if (img_dir[0]) {
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", img_dir);
        if (system(cmd) != 0)
            fprintf(stderr, "cannot remove %s\n", img_dir);
    }
    img_dir[0] = '\0';
    return 0;
}

/* A 4x4 8-bit grayscale PNG, every pixel `v`, at img_dir/rel. */
static void write_png(const char *rel, unsigned char v)
{
    char path[256];
    snprintf(path, sizeof path, "%s/%s", img_dir, rel);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    fwrite("\x89PNG\r\n\x1a\n", 1, 8, f);
    unsigned char ihdr[13] = {0, 0, 0, 4, 0, 0, 0, 4, 8, 0, 0, 0, 0};
    png_chunk(f, "IHDR", ihdr, 13);
    unsigned char raw[4 * 5];
    for (int y = 0; y < 4; y++) {
        raw[y * 5] = 0; /* filter none */
        memset(raw + y * 5 + 1, v, 4);
    }
    unsigned char z[128];
    uLongf zlen = sizeof z;
    assert_int_equal(compress(z, &zlen, raw, sizeof raw), Z_OK);
    png_chunk(f, "IDAT", z, (uint32_t)zlen);
    png_chunk(f, "IEND", (const unsigned char *)"", 0);
    fclose(f);
}

static void make_img_tree(void)
{
    strcpy(img_dir, "/tmp/modeld_test_images_XXXXXX");
    assert_non_null(mkdtemp(img_dir));
    char p[256];
    const char *dirs[] = {"a", "a/sub", "b", "c", ".hidden"};
    for (size_t i = 0; i < sizeof dirs / sizeof dirs[0]; i++) {
        snprintf(p, sizeof p, "%s/%s", img_dir, dirs[i]);
        assert_int_equal(mkdir(p, 0755), 0);
    }
    write_png("b/1.png", 40);
    write_png("a/2.png", 20);
    write_png("a/1.png", 10);
    write_png("a/sub/3.png", 30);
    write_png("top.png", 50);
    write_png(".hidden/x.png", 60);
    write_png("a/.x.png", 70);
    snprintf(p, sizeof p, "%s/c/notes.png", img_dir); /* named .png, not a PNG */
    FILE *f = fopen(p, "w");
    assert_non_null(f);
    fputs("GIF89a, not really\n", f);
    fclose(f);
    char target[256];
    snprintf(target, sizeof target, "%s/a/1.png", img_dir);
    snprintf(p, sizeof p, "%s/b/link.png", img_dir);
    assert_int_equal(symlink(target, p), 0);
}

/* A chunk of a job whose plan listed the folder (image_list, issue 26):
 * its directory holds only the chunk's files, yet the rows, their names and
 * their labels are the whole listing's, as the walk of the whole folder
 * gives them. */
static void test_images_listing(void **state)
{
    (void)state;
    strcpy(img_dir, "/tmp/modeld_test_images_XXXXXX");
    assert_non_null(mkdtemp(img_dir));
    char p[256];
    snprintf(p, sizeof p, "%s/b", img_dir);
    assert_int_equal(mkdir(p, 0755), 0);
    write_png("b/1.png", 40); /* this chunk's one file: row 3 */
    md_image_opts io = {.channels = 1, .height = 4, .width = 4, .max_pixels = 1000};
    json_t *names = json_pack("[sss]", "b", "zz", "a");
    json_t *list = json_pack("[sssss]", "a/1.png", "a/2.png", "a/sub/3.png", "b/1.png", "top.png");
    md_reader_opts o = {.path = img_dir, .format = "images", .image = &io, .class_names = names,
                        .image_list = list};
    md_reader *r = NULL;
    md_err err;
    md_err_clear(&err);
    assert_int_equal(md_reader_open(&o, &r, &err), MD_OK);
    assert_int_equal(md_reader_total_rows(r), 5);
    assert_true(md_reader_has_labels(r));
    assert_string_equal(md_reader_row_name(r, 2), "a/sub/3.png");
    assert_int_equal(md_reader_skip_to(r, 3, &err), MD_OK);
    float row[16];
    int64_t label = -7;
    assert_int_equal(md_reader_next(r, row, &label, &err), MD_OK);
    assert_int_equal(label, 0); /* "b" is the version's label 0, as in the whole folder */
    assert_true(fabsf(row[5] - 40 / 255.0f) < 1e-6f);
    assert_int_equal(md_reader_position(r), 4);
    md_reader_close(r);
    /* a listed file that is not here is a bad row naming it, never another file */
    assert_int_equal(md_reader_open(&o, &r, &err), MD_OK);
    assert_int_equal(md_reader_next(r, row, &label, &err), MD_EINVAL);
    assert_msg_has(err.msg, "row 0", "a/1.png", "cannot be opened", NULL);
    md_reader_close(r);
    /* the listing is bounded as the walk is */
    o.max_files = 4;
    assert_int_equal(md_reader_open(&o, &r, &err), MD_ETOOBIG);
    assert_msg_has(err.msg, "job_max_files", NULL);
    json_decref(list);
    json_decref(names);
}

static void test_images_folder(void **state)
{
    (void)state;
    make_img_tree();
    md_image_opts io = {.channels = 1, .height = 4, .width = 4, .max_pixels = 1000};
    json_t *names = json_pack("[sss]", "b", "zz", "a");
    md_reader_opts o = {.path = img_dir, .format = "images", .image = &io, .class_names = names};
    md_reader *r = NULL;
    md_err err;
    md_err_clear(&err);
    assert_int_equal(md_reader_open(&o, &r, &err), MD_OK);
    assert_int_equal(md_reader_row_width(r), 16);
    assert_int_equal(md_reader_total_rows(r), 5);
    assert_int_equal(md_reader_files_skipped(r), 2); /* notes.png, link.png */
    assert_true(md_reader_has_labels(r));             /* folder: there are subfolders */
    /* byte order of the relative paths; hidden names ignored */
    const char *order[] = {"a/1.png", "a/2.png", "a/sub/3.png", "b/1.png", "top.png"};
    for (int i = 0; i < 5; i++)
        assert_string_equal(md_reader_row_name(r, i), order[i]);
    assert_null(md_reader_row_name(r, 5));
    /* every class is one of the version's labels: their indices */
    int64_t want_label[] = {2, 2, 2, 0};
    float want_value[] = {10, 20, 30, 40};
    float row[16];
    for (int i = 0; i < 4; i++) {
        int64_t label = -7;
        assert_int_equal(md_reader_next(r, row, &label, &err), MD_OK);
        assert_int_equal(label, want_label[i]);
        assert_true(fabsf(row[5] - want_value[i] / 255.0f) < 1e-6f);
    }
    int64_t label;
    assert_int_equal(md_reader_next(r, row, &label, &err), MD_EINVAL); /* no class folder */
    assert_msg_has(err.msg, "row 4", "top.png", "class folder", NULL);
    assert_int_equal(md_reader_next(r, row, &label, &err), MD_ENOTFOUND);
    /* resume by number */
    assert_int_equal(md_reader_skip_to(r, 3, &err), MD_OK);
    assert_int_equal(md_reader_position(r), 3);
    assert_int_equal(md_reader_next(r, row, &label, &err), MD_OK);
    assert_int_equal(label, 0);
    md_reader_close(r);

    /* a regex on the file name; labels not all in the version's: sorted order */
    json_t *lf = json_pack("{s:s}", "regex", "^([0-9])\\.png$");
    o.label_from = lf;
    assert_int_equal(md_reader_open(&o, &r, &err), MD_OK);
    int64_t want_rx[] = {0, 1, 2, 0};
    for (int i = 0; i < 4; i++) {
        assert_int_equal(md_reader_next(r, row, &label, &err), MD_OK);
        assert_int_equal(label, want_rx[i]);
    }
    assert_int_equal(md_reader_next(r, row, &label, &err), MD_EINVAL);
    assert_msg_has(err.msg, "top.png", "does not match", NULL);
    md_reader_close(r);
    json_decref(lf);

    /* a bad regex, no preprocess.image, a file for a directory */
    lf = json_pack("{s:s}", "regex", "([");
    o.label_from = lf;
    assert_int_equal(md_reader_open(&o, &r, &err), MD_EINVAL);
    assert_msg_has(err.msg, "regex", NULL);
    json_decref(lf);
    o.label_from = NULL;
    o.image = NULL;
    assert_int_equal(md_reader_open(&o, &r, &err), MD_EINVAL);
    assert_msg_has(err.msg, "preprocess.image", NULL);
    o.image = &io;
    o.max_files = 3;
    assert_int_equal(md_reader_open(&o, &r, &err), MD_ETOOBIG);
    assert_msg_has(err.msg, "job_max_files", NULL);
    /* 13 entries are looked at (5 at the top, 4 in a, 1 in a/sub, 2 in b, 1
     * in c), the hidden .hidden and a/.x.png among them: a folder of
     * dot-files is bounded too (11 without them, which 12 would let by) */
    o.max_files = 12;
    assert_int_equal(md_reader_open(&o, &r, &err), MD_ETOOBIG);
    assert_msg_has(err.msg, "more than 12 files", NULL);
    o.max_files = 13;
    assert_int_equal(md_reader_open(&o, &r, &err), MD_OK);
    assert_int_equal(md_reader_total_rows(r), 5);
    md_reader_close(r);
    char file[256];
    snprintf(file, sizeof file, "%s/top.png", img_dir);
    o.path = file;
    o.max_files = 0;
    assert_int_equal(md_reader_open(&o, &r, &err), MD_EINVAL);
    json_decref(names);
}

/* ---- named inputs (issue 27): rows laid out as md_model_pack packs them ---- */

static const int64_t s_3[1] = {3};

/* "numeric": 3 floats at word 0; "ids": one int64 at word 3 */
static const md_io_info named_in[2] = {
    {.name = "numeric", .dtype = "float32", .ndim = 1, .shape = s_3, .values = 3, .off = 0},
    {.name = "ids", .dtype = "int64", .is_int = 1, .ndim = 0, .shape = NULL, .values = 1,
     .off = 3},
};

static md_status open_named(const char *path, const char *format, const char *columns,
                            const char *label, const md_io_info *in, int n, md_reader **r,
                            md_err *err)
{
    json_t *cols = columns ? json_loads(columns, 0, NULL) : NULL;
    md_reader_opts o = {.path = path, .format = format, .label = label, .inputs = in,
                        .n_inputs = n, .columns = cols};
    md_status st = md_reader_open(&o, r, err);
    json_decref(cols);
    return st;
}

/* The next row's words: numeric (3 floats) and ids (int64, exact). */
static void expect_named(md_reader *r, float a, float b, float c, int64_t id, int64_t label)
{
    float row[8];
    int64_t got_label = -7, got_id;
    md_err err;
    md_err_clear(&err);
    assert_int_equal(md_reader_row_width(r), 5);
    md_status st = md_reader_next(r, row, &got_label, &err);
    if (st != MD_OK)
        fail_msg("status %d: %s", st, err.msg);
    assert_true(row[0] == a && row[1] == b && row[2] == c);
    memcpy(&got_id, row + 3, sizeof got_id);
    assert_true(got_id == id);
    assert_int_equal(got_label, label);
}

static void test_named_csv_jsonl(void **state)
{
    (void)state;
    char path[64];
    md_reader *r;
    md_err err;
    write_temp(path, "age,bmi,bp,city,y\n1.5,2,3,9007199254740993,1\n-1,0,0.25,-4,0\n");
    assert_int_equal(open_named(path, "csv",
                                "{\"numeric\": [\"age\", \"bmi\", \"bp\"], \"ids\": \"city\"}", "y",
                                named_in, 2, &r, &err),
                     MD_OK);
    expect_named(r, 1.5f, 2, 3, 9007199254740993LL, 1);
    expect_named(r, -1, 0, 0.25f, -4, 0);
    md_reader_close(r);
    /* an integer input takes integers: 2.5 is a bad row (skippable), not 2 */
    write_temp(path, "age,bmi,bp,city\n1,2,3,2.5\n1,2,3,7\n");
    assert_int_equal(open_named(path, "csv",
                                "{\"numeric\": [\"age\", \"bmi\", \"bp\"], \"ids\": \"city\"}", NULL,
                                named_in, 2, &r, &err),
                     MD_OK);
    float row[8];
    int64_t label;
    assert_int_equal(md_reader_next(r, row, &label, &err), MD_EINVAL);
    assert_msg_has(err.msg, "row 0", "column \"city\" (input \"ids\")", "not an integer", NULL);
    expect_named(r, 1, 2, 3, 7, -1);
    md_reader_close(r);
    /* columns: unknown input, missing column, wrong count */
    assert_int_equal(open_named(path, "csv", "{\"nope\": \"age\"}", NULL, named_in, 2, &r, &err),
                     MD_EINVAL);
    assert_msg_has(err.msg, "\"nope\", which is not one of the model's inputs", NULL);
    assert_int_equal(open_named(path, "csv", "{\"numeric\": [\"age\", \"x\", \"bp\"], \"ids\": \"city\"}",
                                NULL, named_in, 2, &r, &err),
                     MD_EINVAL);
    assert_msg_has(err.msg, "the column \"x\" (input.columns) is not in the header", NULL);
    assert_int_equal(open_named(path, "csv", "{\"numeric\": [\"age\"], \"ids\": \"city\"}", NULL,
                                named_in, 2, &r, &err),
                     MD_EINVAL);
    assert_msg_has(err.msg, "names 1 columns, and input \"numeric\" takes 3 values a row", NULL);
    /* jsonl: each input from the field of its name */
    write_temp(path, "{\"numeric\": [1, 2, 3], \"ids\": 9007199254740993, \"label\": 1}\n"
                     "{\"numeric\": [[0.5], [0], [1]], \"ids\": -1, \"label\": 0}\n"
                     "{\"numeric\": [1, 2], \"ids\": 1, \"label\": 0}\n");
    assert_int_equal(open_named(path, "jsonl", NULL, NULL, named_in, 2, &r, &err), MD_OK);
    assert_true(md_reader_has_labels(r));
    expect_named(r, 1, 2, 3, 9007199254740993LL, 1);
    expect_named(r, 0.5f, 0, 1, -1, 0);
    assert_int_equal(md_reader_next(r, row, &label, &err), MD_EINVAL);
    assert_msg_has(err.msg, "input \"numeric\" has 2 values, and takes 3 a row", NULL);
    md_reader_close(r);
}

#define NPZ_DIR "tests/fixtures/npz/"

static void test_npz_dataset(void **state)
{
    (void)state;
    md_reader *r;
    md_err err;
    static const int64_t s_31[1] = {3};
    const md_io_info in[2] = {
        {.name = "x", .dtype = "float32", .ndim = 1, .shape = s_31, .values = 3, .off = 0},
        {.name = "ids", .dtype = "int64", .is_int = 1, .ndim = 0, .values = 1, .off = 3},
    };
    const char *files[2] = {NPZ_DIR "dataset.npz", NPZ_DIR "dataset_stored.npz"};
    for (int f = 0; f < 2; f++) {
        assert_int_equal(open_named(files[f], "npz", NULL, "y", in, 2, &r, &err), MD_OK);
        assert_int_equal(md_reader_total_rows(r), 4);
        expect_named(r, 0, 0.25f, 0.5f, 9007199254740993LL, 0);
        expect_named(r, 0.75f, 1, 1.25f, -1, 1);
        expect_named(r, 1.5f, 1.75f, 2, 2, 0);
        expect_named(r, 2.25f, 2.5f, 2.75f, 300, 1);
        float row[8];
        int64_t label;
        assert_int_equal(md_reader_next(r, row, &label, &err), MD_ENOTFOUND);
        md_reader_close(r);
    }
    /* a value its dtype does not hold is a bad row, and the next one reads */
    const md_io_info u8[2] = {in[0], {.name = "ids", .dtype = "uint8", .is_int = 1, .ndim = 0,
                                      .values = 1, .off = 3}};
    assert_int_equal(open_named(files[0], "npz", NULL, NULL, u8, 2, &r, &err), MD_OK);
    float row[8];
    int64_t label;
    assert_int_equal(md_reader_next(r, row, &label, &err), MD_EINVAL);
    assert_msg_has(err.msg, "row 0", "does not fit input \"ids\"'s dtype uint8", NULL);
    assert_int_equal(md_reader_next(r, row, &label, &err), MD_EINVAL); /* -1 */
    assert_int_equal(md_reader_next(r, row, &label, &err), MD_OK);     /* 2 */
    md_reader_close(r);
    /* a float array for an integer input, a missing array, rows that differ, damage */
    const md_io_info xint[1] = {{.name = "x", .dtype = "int64", .is_int = 1, .ndim = 1,
                                 .shape = s_31, .values = 3, .off = 0}};
    assert_int_equal(open_named(files[0], "npz", NULL, NULL, xint, 1, &r, &err), MD_EINVAL);
    assert_msg_has(err.msg, "array \"x\" is floating point", "declared int64", NULL);
    const md_io_info nope[1] = {{.name = "nope", .dtype = "float32", .ndim = 0, .values = 1}};
    assert_int_equal(open_named(files[0], "npz", NULL, NULL, nope, 1, &r, &err), MD_EINVAL);
    assert_msg_has(err.msg, "no array \"nope\"", "ids", NULL);
    assert_int_equal(open_named(NPZ_DIR "two.npz", "npz", NULL, NULL, in, 2, &r, &err), MD_EINVAL);
    assert_msg_has(err.msg, "has 3 rows, and array \"x\" 2", NULL);
    assert_int_equal(open_named(NPZ_DIR "bomb_lying.npz", "npz", NULL, NULL, in, 2, &r, &err),
                     MD_EINVAL);
    assert_int_equal(open_named(NPZ_DIR "not_zip.npz", "npz", NULL, NULL, in, 2, &r, &err),
                     MD_EINVAL);
    /* a model without named inputs reads npy, not npz */
    assert_int_equal(open_named(files[0], "npz", NULL, NULL, NULL, 0, &r, &err), MD_EINVAL);
    assert_msg_has(err.msg, "declares no config.inputs", NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_csv_small, remove_temps),
        cmocka_unit_test_teardown(test_chunk_offsets_and_layout, remove_temps),
        cmocka_unit_test_teardown(test_named_csv_jsonl, remove_temps),
        cmocka_unit_test(test_npz_dataset),
        cmocka_unit_test_teardown(test_csv_without_label, remove_temps),
        cmocka_unit_test_teardown(test_csv_features, remove_temps),
        cmocka_unit_test_teardown(test_csv_quoted, remove_temps),
        cmocka_unit_test_teardown(test_csv_bad_rows, remove_temps),
        cmocka_unit_test_teardown(test_csv_malformed, remove_temps),
        cmocka_unit_test_teardown(test_csv_layout, remove_temps),
        cmocka_unit_test_teardown(test_csv_open_errors, remove_temps),
        cmocka_unit_test_teardown(test_jsonl_arrays, remove_temps),
        cmocka_unit_test_teardown(test_jsonl_objects, remove_temps),
        cmocka_unit_test_teardown(test_jsonl_bad_rows, remove_temps),
        cmocka_unit_test_teardown(test_jsonl_open_errors, remove_temps),
        cmocka_unit_test_teardown(test_npy_dtypes, remove_temps),
        cmocka_unit_test_teardown(test_npy_3d, remove_temps),
        cmocka_unit_test_teardown(test_npy_errors, remove_temps),
        cmocka_unit_test_teardown(test_npy_wide_rows, remove_temps),
        cmocka_unit_test_teardown(test_idx, remove_temps),
        cmocka_unit_test_teardown(test_idx_errors, remove_temps),
        cmocka_unit_test_teardown(test_gzstream, remove_temps),
        cmocka_unit_test_teardown(test_idx_gzip_errors, remove_temps),
        cmocka_unit_test_teardown(test_fashion_mnist, remove_temps),
        cmocka_unit_test_teardown(test_open_errors, remove_temps),
        cmocka_unit_test_teardown(test_resume_by_skipping, remove_temps),
        cmocka_unit_test_teardown(test_chunk_boundaries, remove_temps),
        cmocka_unit_test_teardown(test_csv_large, remove_temps),
        cmocka_unit_test_teardown(test_csv_streams_from_fifo, remove_temps),
        cmocka_unit_test_teardown(test_row_too_long, remove_temps),
        cmocka_unit_test_teardown(test_row_width_limit, remove_temps),
        cmocka_unit_test_teardown(test_images_folder, remove_img_dir),
        cmocka_unit_test_teardown(test_images_listing, remove_img_dir),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
