/*
 * test_npz.c - unit tests of md_npz_decode (predictor/npz.c) over NPZ bodies
 * numpy wrote (tests/fixtures/npz/, by tests/fixtures/make_npz.py): savez and
 * savez_compressed with every dtype it reads, big-endian members, 0-d and
 * empty arrays, an unseekable writer's data descriptors; and the bodies it
 * must refuse, each with its status, code and a message naming the member:
 * truncated (at every length), a bad CRC, lying sizes, zip bombs, duplicate
 * and non-.npy members, too many members, dtypes and orders it does not read.
 * The checked allocator is wrapped (-Wl,--wrap) to see that a body lying
 * about its sizes is refused before anything of that size is allocated.
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

#include "../predictor/predictor.h"
#include "test_util.h"

#define NPZ "tests/fixtures/npz/"
#define BIG ((size_t)1 << 22) /* max_values that limits none of the small files */

/* ---- the checked allocator, watched ---- */

static size_t largest_alloc; /* the largest request-sized allocation asked for */

void *__real_md_malloc_checked(size_t size, const char *what, md_err *err);
void *__real_md_mallocarray_checked(size_t n, size_t size, const char *what, md_err *err);

void *__wrap_md_malloc_checked(size_t size, const char *what, md_err *err)
{
    if (size > largest_alloc)
        largest_alloc = size;
    return __real_md_malloc_checked(size, what, err);
}

void *__wrap_md_mallocarray_checked(size_t n, size_t size, const char *what, md_err *err)
{
    size_t total;
    if (!__builtin_mul_overflow(n, size, &total) && total > largest_alloc)
        largest_alloc = total;
    return __real_md_mallocarray_checked(n, size, what, err);
}

/* ---- helpers ---- */

static char *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        fail_msg("cannot open %s (run make fixtures?)", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc(n > 0 ? (size_t)n : 1);
    assert_non_null(b);
    assert_int_equal(fread(b, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    *len = (size_t)n;
    return b;
}

/* Decode `len` bytes; on failure out must be empty and err set. */
static md_status decode_buf(const char *b, size_t len, size_t max, md_arrays *a, md_err *err)
{
    md_err_clear(err);
    memset(a, 0xA5, sizeof *a); /* decode must initialise out, even on failure */
    md_status st = md_npz_decode(b, len, max, a, err);
    if (st != MD_OK) {
        assert_int_equal(a->n, 0);
        assert_int_equal(err->status, st);
        assert_true(err->msg[0] != '\0');
    }
    return st;
}

static md_status decode_file(const char *name, size_t max, md_arrays *a, md_err *err)
{
    char path[256];
    snprintf(path, sizeof path, NPZ "%s", name);
    size_t len;
    char *b = slurp(path, &len);
    largest_alloc = 0;
    md_status st = decode_buf(b, len, max, a, err);
    free(b);
    return st;
}

static md_array *get(md_arrays *a, const char *name, int ndim, int is_int, size_t count)
{
    md_array *x = md_arrays_find(a, name);
    if (!x)
        fail_msg("no array \"%s\"", name);
    assert_int_equal(x->ndim, ndim);
    assert_int_equal(x->is_int, is_int);
    assert_int_equal(x->count, count);
    if (count) {
        assert_true(is_int ? x->i64 != NULL : x->f32 != NULL);
        assert_true(is_int ? x->f32 == NULL : x->i64 == NULL);
    }
    return x;
}

static void assert_f32s(const md_array *x, const float *want, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (memcmp(&x->f32[i], &want[i], sizeof(float)) != 0)
            fail_msg("%s[%zu] is %.9g, want %.9g", x->name, i, (double)x->f32[i],
                     (double)want[i]);
}

static void assert_i64s(const md_array *x, const int64_t *want, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (x->i64[i] != want[i])
            fail_msg("%s[%zu] is %lld, want %lld", x->name, i, (long long)x->i64[i],
                     (long long)want[i]);
}

/* ---- what numpy writes ---- */

static void check_every_dtype(const char *file)
{
    md_arrays a;
    md_err err;
    md_status st = decode_file(file, BIG, &a, &err);
    if (st != MD_OK)
        fail_msg("%s: %s", file, err.msg);
    assert_int_equal(a.n, 16);

    md_array *x = get(&a, "f16", 1, 0, 4);
    assert_int_equal(x->shape[0], 4);
    assert_f32s(x, (float[]){1.5f, -2.0f, 65504.0f, 0.0f}, 4);
    x = get(&a, "f32", 2, 0, 6);
    assert_int_equal(x->shape[0], 2);
    assert_int_equal(x->shape[1], 3);
    assert_f32s(x, (float[]){0.25f, -1.0f, 3.5f, 1e-3f, 2.0f, -0.0f}, 6);
    x = get(&a, "f64", 1, 0, 3);
    assert_f32s(x, (float[]){(float)0.1, -FLT_MAX, 0.0f}, 3);

    assert_i64s(get(&a, "b", 1, 1, 3), (int64_t[]){1, 0, 1}, 3);
    assert_i64s(get(&a, "u8", 1, 1, 3), (int64_t[]){0, 255, 7}, 3);
    assert_i64s(get(&a, "i8", 1, 1, 3), (int64_t[]){-128, 127, 0}, 3);
    assert_i64s(get(&a, "i16", 1, 1, 2), (int64_t[]){-32768, 32767}, 2);
    assert_i64s(get(&a, "u16", 1, 1, 2), (int64_t[]){0, 65535}, 2);
    assert_i64s(get(&a, "i32", 1, 1, 2), (int64_t[]){INT32_MIN, INT32_MAX}, 2);
    assert_i64s(get(&a, "u32", 1, 1, 2), (int64_t[]){0, 4294967295LL}, 2);
    /* exact: neither goes through a double */
    assert_i64s(get(&a, "i64", 1, 1, 3),
                (int64_t[]){INT64_MIN, 9007199254740993LL, INT64_MAX}, 3);
    assert_i64s(get(&a, "u64", 1, 1, 2), (int64_t[]){0, INT64_MAX}, 2);

    /* 0-d arrays: no dims, one value */
    assert_i64s(get(&a, "scalar", 0, 1, 1), (int64_t[]){7}, 1);
    assert_f32s(get(&a, "fscalar", 0, 0, 1), (float[]){2.5f}, 1);

    /* big-endian members are converted */
    assert_f32s(get(&a, "be_f32", 1, 0, 2), (float[]){1.0f, -0.5f}, 2);
    assert_i64s(get(&a, "be_i64", 1, 1, 2), (int64_t[]){-2, 9007199254740993LL}, 2);
    md_arrays_free(&a);
    assert_int_equal(a.n, 0);
}

static void test_savez_every_dtype(void **state)
{
    (void)state;
    check_every_dtype("all_stored.npz");
}

static void test_savez_compressed_every_dtype(void **state)
{
    (void)state;
    check_every_dtype("all_deflated.npz");
}

/* numpy writing to a pipe: sizes and CRCs in data descriptors after the
 * data; and the same arrays with a zip64 directory (sizes and offsets in
 * zip64 extra fields), as zipfile writes past 4 GiB */
static void test_unseekable_stream_and_zip64(void **state)
{
    (void)state;
    const char *files[] = {"stream.npz", "stream_stored.npz", "two.npz", "zip64.npz"};
    for (size_t f = 0; f < 4; f++) {
        md_arrays a;
        md_err err;
        if (decode_file(files[f], BIG, &a, &err) != MD_OK)
            fail_msg("%s: %s", files[f], err.msg);
        md_array *x = get(&a, "x", 2, 0, 6);
        assert_int_equal(x->shape[0], 2);
        assert_int_equal(x->shape[1], 3);
        assert_f32s(x, (float[]){0, 1, 2, 3, 4, 5}, 6);
        if (f != 1) {
            assert_int_equal(a.n, 2);
            assert_i64s(get(&a, "ids", 1, 1, 3), (int64_t[]){3, 1, 4}, 3);
        } else {
            assert_int_equal(a.n, 1);
        }
        md_arrays_free(&a);
    }
}

static void test_empty_array(void **state)
{
    (void)state;
    md_arrays a;
    md_err err;
    assert_int_equal(decode_file("empty_array.npz", BIG, &a, &err), MD_OK);
    md_array *x = get(&a, "e", 2, 0, 0);
    assert_int_equal(x->shape[0], 0);
    assert_int_equal(x->shape[1], 3);
    md_arrays_free(&a);
}

static void test_members_and_names_at_their_limits(void **state)
{
    (void)state;
    md_arrays a;
    md_err err;
    assert_int_equal(decode_file("max_members.npz", BIG, &a, &err), MD_OK);
    assert_int_equal(a.n, MD_MAX_IO);
    assert_i64s(get(&a, "in15", 1, 1, 2), (int64_t[]){0, 1}, 2);
    md_arrays_free(&a);

    assert_int_equal(decode_file("too_many.npz", BIG, &a, &err), MD_ETOOBIG);
    assert_string_equal(err.code, "too_many_inputs");
    assert_msg_has(err.msg, "17 arrays", "limit is 16", NULL);

    assert_int_equal(decode_file("name_63.npz", BIG, &a, &err), MD_OK);
    assert_int_equal(strlen(a.a[0].name), 63);
    md_arrays_free(&a);
    assert_int_equal(decode_file("long_name.npz", BIG, &a, &err), MD_EINVAL);
    assert_string_equal(err.code, "bad_npz");
    assert_msg_has(err.msg, "nnnnnnnn", "longer than 63 bytes", NULL);
}

/* The values limit counts every member's values together. */
static void test_max_values(void **state)
{
    (void)state;
    md_arrays a;
    md_err err;
    /* two.npz: 6 + 3 values */
    assert_int_equal(decode_file("two.npz", 9, &a, &err), MD_OK);
    md_arrays_free(&a);
    assert_int_equal(decode_file("two.npz", 8, &a, &err), MD_ETOOBIG);
    assert_string_equal(err.code, "too_many_values");
    assert_msg_has(err.msg, "\"ids.npy\"", "3 values", NULL);
    assert_int_equal(decode_file("two.npz", 5, &a, &err), MD_ETOOBIG);
    assert_msg_has(err.msg, "\"x.npy\"", NULL);
}

/* ---- memory: sizes are checked before they are allocated ---- */

static void test_lying_sizes(void **state)
{
    (void)state;
    md_arrays a;
    md_err err;
    /* ~200 bytes declaring 4 GiB: past the values limit ... */
    assert_int_equal(decode_file("lying_huge.npz", BIG, &a, &err), MD_ETOOBIG);
    assert_msg_has(err.msg, "\"x.npy\"", "4294967280 bytes", NULL);
    assert_true(largest_alloc < 65536);
    /* ... and, with a limit that allows it, more than deflate can make of
     * its bytes: refused before a byte of it is allocated */
    assert_int_equal(decode_file("lying_huge.npz", SIZE_MAX / 64, &a, &err), MD_EINVAL);
    assert_string_equal(err.code, "bad_npz");
    assert_msg_has(err.msg, "\"x.npy\"", "cannot hold", NULL);
    assert_int_equal(largest_alloc, 0);
    /* a size deflate could make but does not: inflates short */
    assert_int_equal(decode_file("lying_short.npz", BIG, &a, &err), MD_EINVAL);
    assert_msg_has(err.msg, "\"x.npy\"", "inflates to", "not the", NULL);
    assert_true(largest_alloc < 65536);
}

static void test_zip_bomb(void **state)
{
    (void)state;
    md_arrays a;
    md_err err;
    /* 16 MiB of uint8 zeros in 16 KiB: past a limit of 1M values before
     * inflating */
    assert_int_equal(decode_file("bomb.npz", 1 << 20, &a, &err), MD_ETOOBIG);
    assert_string_equal(err.code, "too_many_values");
    assert_msg_has(err.msg, "\"z.npy\"", NULL);
    assert_int_equal(largest_alloc, 0);
    /* within the limit it is an array like any other */
    assert_int_equal(decode_file("bomb.npz", 1 << 24, &a, &err), MD_OK);
    md_array *x = get(&a, "z", 1, 1, 1 << 24);
    /* the allocator is watched: this one's int64 values were seen */
    assert_true(largest_alloc >= ((size_t)1 << 24) * sizeof(int64_t));
    int64_t any = 0;
    for (size_t i = 0; i < x->count; i++)
        any |= x->i64[i];
    assert_int_equal(any, 0);
    md_arrays_free(&a);
    /* the same bomb saying it is 4 KiB: inflating stops at 4 KiB */
    assert_int_equal(decode_file("bomb_lying.npz", BIG, &a, &err), MD_EINVAL);
    assert_msg_has(err.msg, "\"z.npy\"", "past its declared size of 4096", NULL);
    assert_true(largest_alloc <= 65536);
}

/* ---- refused ---- */

static void test_refused(void **state)
{
    (void)state;
    static const struct {
        const char *file;
        md_status st;
        const char *code, *has1, *has2;
    } cases[] = {
        {"truncated.npz", MD_EINVAL, "bad_npz", "end-of-central-directory", "numpy.savez"},
        {"truncated_tail.npz", MD_EINVAL, "bad_npz", "end-of-central-directory", NULL},
        {"trailing.npz", MD_EINVAL, "bad_npz", "bytes after the end", NULL},
        {"bad_crc.npz", MD_EINVAL, "bad_npz", "\"x.npy\"", "CRC"},
        {"dup.npz", MD_EINVAL, "bad_npz", "two arrays named \"a.npy\"", NULL},
        {"not_npy.npz", MD_EINVAL, "bad_npz", "\"readme.txt\"", "not an array"},
        {"not_npy_data.npz", MD_EINVAL, "bad_npz", "\"a.npy\"", "not an NPY file"},
        {"fortran.npz", MD_EINVAL, "bad_npz", "\"f.npy\"", "Fortran order"},
        {"u64_big.npz", MD_EINVAL, "invalid_input", "value 1 of NPZ member \"u.npy\"",
         "9223372036854775808"},
        {"nan.npz", MD_EINVAL, "invalid_input", "value 2 of NPZ member \"v.npy\"", "NaN"},
        {"inf16.npz", MD_EINVAL, "invalid_input", "value 1 of NPZ member \"h.npy\"",
         "infinite"},
        {"f64_range.npz", MD_EINVAL, "invalid_input", "value 1 of NPZ member \"d.npy\"",
         "outside float32's range"},
        {"object.npz", MD_EINVAL, "bad_npz", "\"o.npy\"", "dtype |O"},
        {"complex.npz", MD_EINVAL, "bad_npz", "\"c.npy\"", "dtype <c8"},
        {"zip64_disagree.npz", MD_EINVAL, "bad_npz", "two end-of-central-directory", NULL},
        {"local_mismatch.npz", MD_EINVAL, "bad_npz", "\"x.npy\"", "local header"},
        {"bzip2.npz", MD_EINVAL, "bad_npz", "\"a.npy\"", "method 12"},
        {"empty.npz", MD_EINVAL, "bad_npz", "holds no arrays", NULL},
        {"not_zip.npz", MD_EINVAL, "bad_npz", "not a zip archive", NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        md_arrays a;
        md_err err;
        md_status st = decode_file(cases[i].file, BIG, &a, &err);
        if (st != cases[i].st || strcmp(err.code, cases[i].code) != 0)
            fail_msg("%s: status %d code %s (%s), want %d %s", cases[i].file, st, err.code,
                     err.msg, cases[i].st, cases[i].code);
        assert_msg_has(err.msg, cases[i].has1, cases[i].has2, NULL);
    }
    md_arrays a;
    md_err err;
    assert_int_equal(decode_buf(NULL, 0, BIG, &a, &err), MD_EINVAL);
    assert_int_equal(decode_buf("PK", 2, BIG, &a, &err), MD_EINVAL);
}

/* Every prefix of a good body is refused cleanly: only the whole one
 * decodes (single-byte changes are tests/fuzz_npz.c's). */
static void test_every_prefix(void **state)
{
    (void)state;
    const char *files[] = {"two.npz", "all_deflated.npz", "stream.npz"};
    for (size_t f = 0; f < 3; f++) {
        char path[256];
        snprintf(path, sizeof path, NPZ "%s", files[f]);
        size_t len;
        char *b = slurp(path, &len);
        for (size_t n = 0; n < len; n++) {
            md_arrays a;
            md_err err;
            char *copy = malloc(n ? n : 1); /* exactly n bytes: ASan sees a read past them */
            memcpy(copy, b, n);
            md_status st = decode_buf(copy, n, BIG, &a, &err);
            free(copy);
            if (st == MD_OK)
                fail_msg("%s: the first %zu of %zu bytes decoded", files[f], n, len);
        }
        free(b);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_savez_every_dtype),
        cmocka_unit_test(test_savez_compressed_every_dtype),
        cmocka_unit_test(test_unseekable_stream_and_zip64),
        cmocka_unit_test(test_empty_array),
        cmocka_unit_test(test_members_and_names_at_their_limits),
        cmocka_unit_test(test_max_values),
        cmocka_unit_test(test_lying_sizes),
        cmocka_unit_test(test_zip_bomb),
        cmocka_unit_test(test_refused),
        cmocka_unit_test(test_every_prefix),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
