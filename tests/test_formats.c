/*
 * test_formats.c - unit tests of the checkpoint readers (checkpoint/pickle.c,
 * torch_zip.c, safetensors.c, named_tensors.c) and of loading named tensors
 * into a TorchScript architecture (predictor/torch_backend.cpp).
 *
 * The good files were written by real PyTorch 1.13 (torch.save) or by a few
 * lines of Python (safetensors) in tests/fixtures/make_ckpt_fixtures.py,
 * which records every tensor's name, dtype, shape and exact values in
 * tests/fixtures/ckpt/expected.json: each good file must read back as exactly
 * that. Forwards through the architecture loaded with the trained weights
 * must equal PyTorch's outputs (mlp_expected.npy, bn_expected.npy). Every bad
 * file must fail with a message naming the problem; the malicious pickles
 * must fail naming their global, and the file they would create must not
 * exist afterwards. Hand-made pickles and safetensors headers cover the
 * limits and corruptions one at a time.
 *
 * Fixtures are read relative to the repository root (make runs tests there).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../checkpoint/formats.h"
#include "../predictor/predictor.h"
#include "../predictor/torch_backend.h"
#include "test_util.h"

#define CKPT "tests/fixtures/ckpt/"
#define FIX "tests/fixtures/"

/* ---- helpers ---- */

static json_t *expected;

static int load_expected(void **state)
{
    (void)state;
    json_error_t jerr;
    expected = json_load_file(CKPT "expected.json", 0, &jerr);
    if (!expected)
        fprintf(stderr, "cannot read " CKPT "expected.json: %s\n", jerr.text);
    md_torch_init(1);
    return expected ? 0 : -1;
}

static int free_expected(void **state)
{
    (void)state;
    json_decref(expected);
    return 0;
}

static uint8_t *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        fail_msg("cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *buf = malloc((size_t)n + 1);
    assert_non_null(buf);
    assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    *len = (size_t)n;
    return buf;
}

static float half_to_float(uint16_t h)
{
    int sign = h >> 15, exp = (h >> 10) & 31, mant = h & 1023;
    float v;
    if (exp == 0)
        v = ldexpf((float)mant, -24);
    else if (exp == 31)
        v = mant ? NAN : INFINITY;
    else
        v = ldexpf((float)(mant | 1024), exp - 25);
    return sign ? -v : v;
}

static double element(const md_tensors *t, size_t i, size_t k)
{
    const void *d = md_tensors_data(t, i);
    switch (md_tensors_dtype(t, i)) {
    case MD_CKPT_F32:
        return ((const float *)d)[k];
    case MD_CKPT_F64:
        return ((const double *)d)[k];
    case MD_CKPT_F16:
        return half_to_float(((const uint16_t *)d)[k]);
    case MD_CKPT_BF16: {
        uint32_t bits = (uint32_t)((const uint16_t *)d)[k] << 16;
        float f;
        memcpy(&f, &bits, 4);
        return f;
    }
    case MD_CKPT_I64:
        return (double)((const int64_t *)d)[k];
    default:
        fail_msg("unexpected dtype %s", md_ckpt_dtype_name(md_tensors_dtype(t, i)));
    }
    return 0;
}

static md_ckpt_dtype dtype_of(const char *torch_name)
{
    static const struct {
        const char *name;
        md_ckpt_dtype dtype;
    } map[] = {{"float32", MD_CKPT_F32}, {"float16", MD_CKPT_F16}, {"bfloat16", MD_CKPT_BF16},
               {"float64", MD_CKPT_F64}, {"int64", MD_CKPT_I64}};
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
        if (strcmp(map[i].name, torch_name) == 0)
            return map[i].dtype;
    fail_msg("unknown dtype %s in expected.json", torch_name);
    return MD_CKPT_F32;
}

/* `t` must hold exactly the tensors (in order, bit-exact values) and scalars
 * expected.json records for `file`. */
static void assert_matches_expected(const md_tensors *t, const char *file)
{
    json_t *e = json_object_get(expected, file);
    if (!e)
        fail_msg("expected.json has no entry for %s", file);
    json_t *tensors = json_object_get(e, "tensors");
    assert_int_equal(md_tensors_count(t), json_object_size(tensors));
    size_t i = 0;
    const char *name;
    json_t *want;
    json_object_foreach(tensors, name, want)
    {
        assert_string_equal(md_tensors_name(t, i), name);
        assert_int_equal(md_tensors_dtype(t, i),
                         dtype_of(json_string_value(json_object_get(want, "dtype"))));
        json_t *shape = json_object_get(want, "shape"), *values = json_object_get(want, "values");
        assert_int_equal(md_tensors_ndim(t, i), json_array_size(shape));
        size_t numel = 1;
        for (int d = 0; d < md_tensors_ndim(t, i); d++) {
            assert_int_equal(md_tensors_shape(t, i)[d],
                             json_integer_value(json_array_get(shape, (size_t)d)));
            numel *= (size_t)md_tensors_shape(t, i)[d];
        }
        assert_int_equal(numel, json_array_size(values));
        assert_int_equal(md_tensors_nbytes(t, i),
                         numel * md_ckpt_dtype_size(md_tensors_dtype(t, i)));
        for (size_t k = 0; k < numel; k++) {
            double w = json_number_value(json_array_get(values, k));
            if (element(t, i, k) != w)
                fail_msg("%s: %s[%zu] is %.9g, PyTorch wrote %.9g", file, name, k,
                         element(t, i, k), w);
        }
        i++;
    }
    json_t *scalars = json_object_get(e, "scalars");
    assert_int_equal(md_tensors_scalar_count(t), json_object_size(scalars));
    i = 0;
    json_object_foreach(scalars, name, want)
    {
        assert_string_equal(md_tensors_scalar_name(t, i), name);
        assert_true(md_tensors_scalar_value(t, i) == json_number_value(want));
        i++;
    }
}

static md_tensors *read_zip_ok(const char *file)
{
    char path[256];
    snprintf(path, sizeof path, CKPT "%s", file);
    md_tensors *t = NULL;
    md_err err;
    md_err_clear(&err);
    if (md_ckpt_read_torch_zip(path, NULL, &t, &err) != MD_OK)
        fail_msg("reading %s failed: %s", file, err.msg);
    return t;
}

static const char *read_zip_fails(const char *file, md_err *err)
{
    char path[256];
    snprintf(path, sizeof path, CKPT "%s", file);
    md_tensors *t = (md_tensors *)(intptr_t)1;
    md_err_clear(err);
    md_status st = md_ckpt_read_torch_zip(path, NULL, &t, err);
    if (st == MD_OK)
        fail_msg("%s was read, it must be refused", file);
    assert_null(t);
    assert_int_equal(err->status, st);
    return err->msg;
}

/* A float32 .npy (format 1.0, C order) into a new buffer of `*n` floats. */
static float *read_npy(const char *path, size_t *n)
{
    size_t len;
    uint8_t *b = slurp(path, &len);
    assert_memory_equal(b, "\x93NUMPY\x01", 7);
    size_t hlen = b[8] | (size_t)b[9] << 8;
    assert_non_null(strstr((char *)b + 10, "'<f4'"));
    *n = (len - 10 - hlen) / 4;
    float *out = malloc(*n * 4);
    memcpy(out, b + 10 + hlen, *n * 4);
    free(b);
    return out;
}

static md_torch_named_tensor *named(const md_tensors *t)
{
    md_torch_named_tensor *v = calloc(md_tensors_count(t) + 1, sizeof *v);
    for (size_t i = 0; i < md_tensors_count(t); i++)
        v[i] = (md_torch_named_tensor){md_tensors_name(t, i), md_tensors_dtype(t, i),
                                       md_tensors_ndim(t, i), md_tensors_shape(t, i),
                                       md_tensors_data(t, i)};
    return v;
}

/* Load `arch` with `t`, run the fixture input `input_npy` of `shape`, and
 * return the largest absolute difference from `expected_npy`. */
static double forward_diff(const char *arch, const md_tensors *t, const char *input_npy,
                           const int64_t *shape, int ndim, const char *expected_npy)
{
    md_torch_named_tensor *v = named(t);
    md_torch_model *m = NULL;
    md_err err;
    md_err_clear(&err);
    if (md_torch_load_state(arch, "cpu", MD_F32, v, md_tensors_count(t), &m, &err) != MD_OK)
        fail_msg("loading the state into %s failed: %s", arch, err.msg);
    free(v);
    size_t nin, nwant;
    float *x = read_npy(input_npy, &nin), *want = read_npy(expected_npy, &nwant);
    float *y = NULL;
    int64_t oshape[8];
    int ondim = 0;
    assert_int_equal(md_torch_forward(m, x, shape, ndim, &y, oshape, &ondim, &err), MD_OK);
    assert_int_equal(ondim, 2);
    assert_int_equal((size_t)(oshape[0] * oshape[1]), nwant);
    double worst = 0;
    for (size_t i = 0; i < nwant; i++)
        worst = fmax(worst, fabs((double)y[i] - (double)want[i]));
    free(x);
    free(want);
    free(y);
    md_torch_free(m);
    return worst;
}

static const int64_t mlp_in[] = {5, 4};
static const int64_t cnn_in[] = {3, 1, 8, 8};

/* ---- torch.save files PyTorch wrote ---- */

static void test_torch_save_files_read_exactly(void **state)
{
    (void)state;
    static const char *const files[] = {"mlp_sd.pt",     "mlp_sd_plain.pt", "mlp_epoch3.pt",
                                        "mlp_adam.pt",   "mlp_sd_module.pt", "mlp_sd_f16.pt",
                                        "mlp_sd_f64.pt", "mlp_sd_views.pt", "bn_sd.pt",
                                        "good_strided.pt", "deflated.pt"};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        md_tensors *t = read_zip_ok(files[i]);
        assert_matches_expected(t, files[i]);
        md_tensors_free(t);
    }
}

static void test_checkpoint_dict_scalars_and_optimizer_skipped(void **state)
{
    (void)state;
    md_tensors *t = read_zip_ok("mlp_epoch3.pt");
    /* the SGD momentum buffers (same shapes as the weights) are not tensors of
     * the result, and the numbers are */
    assert_int_equal(md_tensors_count(t), 4);
    assert_int_equal(md_tensors_find(t, "fc2.bias"), 3);
    assert_int_equal(md_tensors_find(t, "momentum_buffer"), -1);
    assert_int_equal(md_tensors_scalar_count(t), 2);
    assert_string_equal(md_tensors_scalar_name(t, 0), "epoch");
    assert_true(md_tensors_scalar_value(t, 0) == 3.0);
    assert_true(md_tensors_scalar_value(t, 1) == 0.25);
    md_tensors_free(t);
}

static void test_bn_int64_buffer(void **state)
{
    (void)state;
    md_tensors *t = read_zip_ok("bn_sd.pt");
    long i = md_tensors_find(t, "bn.num_batches_tracked");
    assert_true(i >= 0);
    assert_int_equal(md_tensors_dtype(t, (size_t)i), MD_CKPT_I64);
    assert_int_equal(md_tensors_ndim(t, (size_t)i), 0);
    assert_int_equal(*(const int64_t *)md_tensors_data(t, (size_t)i), 3);
    md_tensors_free(t);
}

static void test_malicious_pickles_refused_nothing_runs(void **state)
{
    (void)state;
    json_t *mal = json_object_get(expected, "_malicious");
    const char *creates = json_string_value(json_object_get(mal, "creates"));
    assert_non_null(creates);
    unlink(creates);
    static const struct {
        const char *file, *global;
    } cases[] = {
        {"evil_os_system.pt", "global os.system is not allowed in a checkpoint"},
        {"evil_posix_system.pt", "global posix.system is not allowed in a checkpoint"},
        {"evil_eval.pt", "global builtins.eval is not allowed in a checkpoint"},
        {"evil_inside_sd.pt", "global os.system is not allowed in a checkpoint"},
    };
    assert_int_equal(json_array_size(json_object_get(mal, "files")), 4);
    for (size_t i = 0; i < 4; i++) {
        md_err err;
        const char *msg = read_zip_fails(cases[i].file, &err);
        assert_int_equal(err.status, MD_EUNPROC);
        assert_msg_has(msg, cases[i].global, "state_dict", NULL);
        assert_int_equal(access(creates, F_OK), -1);
    }
}

static void test_whole_model_pickle_refused(void **state)
{
    (void)state;
    md_err err;
    const char *msg = read_zip_fails("whole_model.pt", &err);
    assert_int_equal(err.status, MD_EUNPROC);
    assert_msg_has(msg, "__main__.MLP", "model.state_dict()", NULL);
}

#define PKL(s) s, sizeof(s) - 1
/* {'w': tensor of data/0, 4 floats, size (4,), stride (1,)} */
#define TENSOR_W                                                                          \
    "X\x01\x00\x00\x00w" "ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storage" \
    "ctorch\nFloatStorage\nX\x01\x00\x00\x00" "0X\x03\x00\x00\x00" "cpuK\x04tQK\x00K\x04" \
    "\x85K\x01\x85\x89}t" "R"

static void test_legacy_format_refused(void **state)
{
    (void)state;
    md_err err;
    const char *msg = read_zip_fails("legacy.pt", &err);
    assert_int_equal(err.status, MD_EUNPROC);
    assert_msg_has(msg, "legacy", "_use_new_zipfile_serialization=True", NULL);
    /* the unpickler itself recognises it too (a data.pkl-like stream) */
    size_t len;
    uint8_t *b = slurp(CKPT "legacy.pt", &len);
    md_tensors *t;
    assert_int_equal(md_ckpt_unpickle(b, len, NULL, NULL, "legacy.pt", NULL, &t, &err), MD_EUNPROC);
    assert_msg_has(err.msg, "legacy.pt", "_use_new_zipfile_serialization=True", NULL);
    free(b);
    /* a storage with no record source at all */
    assert_int_equal(md_ckpt_unpickle((const uint8_t *)"\x80\x02}(" TENSOR_W "u.",
                                      sizeof("\x80\x02}(" TENSOR_W "u.") - 1, NULL, NULL, "x.pt",
                                      NULL, &t, &err), MD_EUNPROC);
    assert_msg_has(err.msg, "data/0", "no storage records", NULL);
}

static void test_bad_torch_save_files(void **state)
{
    (void)state;
    static const struct {
        const char *file, *a, *b;
    } cases[] = {
        {"oob_numel.pt", "storage data/0 claims 1000 elements", "holds 16 bytes"},
        {"oob_offset.pt", "offset 2", "past the end of storage data/0, which holds 4"},
        {"oob_stride.pt", "past the end of storage data/0", "holds 4 elements"},
        {"oob_missing_record.pt", "data/7", "does not hold"},
        {"bad_storage_type.pt", "torch.QInt8Storage", "not supported"},
        {"truncated.pt", "zip", NULL},
        {"zip_bomb.pt", "compressed record that would inflate past 16 MiB", "torch.save"},
        {"mlp_arch.pt", "TorchScript archive", NULL},
        {"../not_a_model.pt", "not a zip archive", NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        md_err err;
        const char *msg = read_zip_fails(cases[i].file, &err);
        assert_int_equal(err.status, MD_EUNPROC);
        assert_msg_has(msg, cases[i].a, cases[i].b, NULL);
    }
}

/* ---- hand-made pickles: one corruption or limit at a time ---- */

static const uint8_t four_floats[16] = {0, 0, 0x80, 0x3f, 0, 0, 0, 0x40,
                                        0, 0, 0x40, 0x40, 0, 0, 0x80, 0x40};

static md_status one_record(void *ctx, const char *key, const uint8_t **data, size_t *size,
                            md_err *err)
{
    (void)ctx;
    if (strcmp(key, "0") != 0)
        return md_err_set(err, MD_EUNPROC, "no record data/%s", key);
    *data = four_floats;
    *size = sizeof four_floats;
    return MD_OK;
}

static md_status unpickle(const char *pkl, size_t len, md_tensors **t, md_err *err)
{
    md_err_clear(err);
    md_status st = md_ckpt_unpickle((const uint8_t *)pkl, len, one_record, NULL, "test.pt", NULL,
                                    t, err);
    if (st != MD_OK)
        assert_null(*t);
    return st;
}

static void test_handmade_pickles(void **state)
{
    (void)state;
    md_tensors *t;
    md_err err;
    /* the reference: a good one, with protocol-4 opcodes too */
    assert_int_equal(unpickle(PKL("\x80\x02}(" TENSOR_W "u."), &t, &err), MD_OK);
    assert_int_equal(md_tensors_count(t), 1);
    assert_true(((const float *)md_tensors_data(t, 0))[3] == 4.0f);
    md_tensors_free(t);
    assert_int_equal(unpickle(PKL("\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00}\x94(" TENSOR_W
                                  "u."), &t, &err), MD_OK);
    md_tensors_free(t);

    static const struct {
        const char *pkl;
        size_t len;
        md_status st;
        const char *want;
    } cases[] = {
        {PKL("\x80\x02}(" TENSOR_W "u"), MD_EUNPROC, "truncated"},
        {PKL("\x80\x02h\x05."), MD_EUNPROC, "memo slot 5 is read before"},
        {PKL("\x80\x02}r\xff\xff\xff\x7f."), MD_EUNPROC, "memo index 2147483647"},
        {PKL("\x80\x02."), MD_EUNPROC, "empty stack"},
        {PKL("\x80\x02u."), MD_EUNPROC, "never opened"},
        {PKL("\x80\x02]}s."), MD_EUNPROC, "fewer than 3"},
        {PKL("\x80\x02]K\x01K\x02s."), MD_EUNPROC, "SETITEM on a list"},
        {PKL("\x80\x02}K\x01" "a."), MD_EUNPROC, "APPEND to a dict"},
        {PKL("\x80\x02]]b."), MD_EUNPROC, "BUILD sets the state of a list"},
        {PKL("\x80\x02K\x01)R."), MD_EUNPROC, "REDUCE calls a int"},
        {PKL("\x80\x02X\x02\x00\x00\x00osX\x06\x00\x00\x00system\x93."), MD_EUNPROC,
         "global os.system"},
        {PKL("\x80\x02" "cos\nsystem"), MD_EUNPROC, "unterminated"},
        {PKL("\x80\x02X\xff\xff\xff\x7f"), MD_EUNPROC, "MD_PICKLE_MAX_STRING"},
        {PKL("\x80\x02\x01."), MD_EUNPROC, "opcode 0x01"},
        {PKL("\x80\x01}."), MD_EUNPROC, "protocol 1"},
        {PKL("\x80\x02]."), MD_EUNPROC, "holds a list, not a state_dict"},
        {PKL("\x80\x02}."), MD_EUNPROC, "empty dict"},
        {PKL("\x80\x02}X\x01\x00\x00\x00wK\x01s."), MD_EUNPROC, "entry \"w\" is a int"},
        {PKL("\x80\x02}(X\x05\x00\x00\x00model}(" TENSOR_W "uu."), MD_OK, NULL},
        {PKL("\x80\x02" "ccollections\nOrderedDict\nK\x01\x85R."), MD_EUNPROC,
         "called with arguments"},
        {PKL("\x80\x02" "ctorch\nFloatStorage\n)R."), MD_EUNPROC, "never calls a storage"},
        {PKL("\x80\x02" "ctorch._utils\n_rebuild_tensor_v2\n)R."), MD_EUNPROC,
         "takes 6 or 7 arguments"},
        {PKL("\x80\x02(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x03\x00\x00\x00../"
             "X\x03\x00\x00\x00" "cpuK\x04tQ."),
         MD_EUNPROC, "not a record name"},
        {PKL("\x80\x02(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x00" "0"
             "X\x03\x00\x00\x00" "cpu\x8a\x08\xff\xff\xff\xff\xff\xff\xff\x7ftQ."),
         MD_EUNPROC, "claims 9223372036854775807 elements"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        md_status st = unpickle(cases[i].pkl, cases[i].len, &t, &err);
        if (st != cases[i].st)
            fail_msg("case %zu: status %d (%s), want %d", i, st, err.msg, cases[i].st);
        if (st == MD_OK)
            md_tensors_free(t);
        else
            assert_msg_has(err.msg, "test.pt", cases[i].want, NULL);
    }
}

static void test_pickle_limits(void **state)
{
    (void)state;
    md_tensors *t;
    md_err err;
    /* MARKs nested past MD_PICKLE_MAX_MARKS */
    size_t n = MD_PICKLE_MAX_MARKS + 3;
    char *p = malloc(n + 3);
    memcpy(p, "\x80\x02", 2);
    memset(p + 2, '(', n);
    assert_int_equal(unpickle(p, n + 2, &t, &err), MD_EUNPROC);
    assert_msg_has(err.msg, "MD_PICKLE_MAX_MARKS", NULL);
    free(p);
    /* a stack past MD_PICKLE_MAX_STACK (N N N ...) */
    n = MD_PICKLE_MAX_STACK + 10;
    p = malloc(n + 3);
    memcpy(p, "\x80\x02", 2);
    memset(p + 2, 'N', n);
    assert_int_equal(unpickle(p, n + 2, &t, &err), MD_EUNPROC);
    assert_msg_has(err.msg, "MD_PICKLE_MAX_STACK", NULL);
    free(p);
    /* a list appended to itself (a cycle) is harmless: it is not a dict */
    assert_int_equal(unpickle(PKL("\x80\x02]q\x00h\x00" "a."), &t, &err), MD_EUNPROC);
    assert_msg_has(err.msg, "holds a list", NULL);
    /* a dict holding itself as a value: refused, not recursed into */
    assert_int_equal(unpickle(PKL("\x80\x02}q\x00X\x01\x00\x00\x00xh\x00s."), &t, &err),
                     MD_EUNPROC);
    assert_msg_has(err.msg, "entry \"x\" is a dict", NULL);
}

/* {'w': a view of data/0's 4 floats with `size` and `stride` (pickled tuples) */
#define TENSOR_VIEW(size, stride)                                                         \
    "X\x01\x00\x00\x00w" "ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storage" \
    "ctorch\nFloatStorage\nX\x01\x00\x00\x00" "0X\x03\x00\x00\x00" "cpuK\x04tQK\x00"     \
    size stride "\x89}t" "R"
#define LONG1_2_33 "\x8a\x05\x00\x00\x00\x00\x02"
#define LONG1_2_62 "\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x40"

/* issue 24: what a view copies out to is checked, in checked arithmetic,
 * against the read's budget before anything is allocated */
static void test_pickle_views_within_budget(void **state)
{
    (void)state;
    md_tensors *t;
    md_err err;
    /* torch.zeros(1).expand(2**33): one stored element, 32 GiB copied out,
     * past the build's limit (16 GiB): refused before any allocation */
    assert_int_equal(unpickle(PKL("\x80\x02}(" TENSOR_VIEW(LONG1_2_33 "\x85", "K\x00\x85")
                                  "u."), &t, &err), MD_ETOOBIG);
    assert_string_equal(err.code, "checkpoint_too_large");
    assert_msg_has(err.msg, "34359738368 bytes", "MD_CKPT_MAX_TOTAL_BYTES", NULL);
    /* a caller's budget, named in the message; a small expand within it is fine */
    md_ckpt_budget budget = {16, "the test's limit"};
    md_err_clear(&err);
    /* the same view of one stored element under two names (memo slot 1) */
    static const char shared[] = "\x80\x02}(" TENSOR_VIEW("K\x04\x85", "K\x00\x85")
                                 "q\x01X\x01\x00\x00\x00vh\x01u.";
    assert_int_equal(md_ckpt_unpickle((const uint8_t *)shared, sizeof shared - 1, one_record,
                                      NULL, "test.pt", &budget, &t, &err), MD_ETOOBIG);
    assert_null(t);
    assert_msg_has(err.msg, "test.pt", "32 bytes", "the test's limit", "(16 bytes)", NULL);
    budget.max_bytes = 32;
    assert_int_equal(md_ckpt_unpickle((const uint8_t *)shared, sizeof shared - 1, one_record,
                                      NULL, "test.pt", &budget, &t, &err), MD_OK);
    assert_int_equal(md_tensors_count(t), 2);
    const float *w = md_tensors_data(t, 0);
    assert_true(w[0] == 1.0f && w[3] == 1.0f); /* stride 0: element 0 four times */
    md_tensors_free(t);
    /* shape (0, 2**62, 2**62): no elements, and no overflow on the way
     * (the contiguity check once multiplied the sizes in signed 64 bits) */
    assert_int_equal(unpickle(PKL("\x80\x02}(" TENSOR_VIEW("K\x00" LONG1_2_62 LONG1_2_62
                                                           "\x87", "K\x01K\x01K\x01\x87")
                                  "u."), &t, &err), MD_OK);
    assert_int_equal(md_tensors_nbytes(t, 0), 0);
    assert_int_equal(md_tensors_shape(t, 0)[2], 1LL << 62);
    md_tensors_free(t);
    /* (2**62, 2**62) of one stored element: the element count overflows */
    assert_int_equal(unpickle(PKL("\x80\x02}(" TENSOR_VIEW(LONG1_2_62 LONG1_2_62 "\x86",
                                                           "K\x00K\x00\x86") "u."), &t, &err),
                     MD_ETOOBIG);
    assert_msg_has(err.msg, "more elements than fit", NULL);
}

/* issue 24: top-level numbers and metadata are hashed, and a repeated key
 * still means what it did (a dict's later value wins; a repeated tensor name
 * is refused; a repeated safetensors key is refused by the JSON parser) */
static void test_many_entries_and_duplicates(void **state)
{
    (void)state;
    md_tensors *t = md_tensors_new();
    char key[32], value[32];
    for (int i = 0; i < 100000; i++) {
        snprintf(key, sizeof key, "key%d", i);
        snprintf(value, sizeof value, "%d", i);
        md_tensors_set_meta(t, key, value);
        md_tensors_set_scalar(t, key, i);
    }
    md_tensors_set_meta(t, "key5", "again");
    md_tensors_set_scalar(t, "key7", -1);
    assert_int_equal(md_tensors_meta_count(t), 100000);
    assert_int_equal(md_tensors_scalar_count(t), 100000);
    assert_string_equal(md_tensors_meta_get(t, "key5"), "again");
    assert_string_equal(md_tensors_meta_get(t, "key99999"), "99999");
    assert_null(md_tensors_meta_get(t, "key100000"));
    assert_string_equal(md_tensors_meta_key(t, 5), "key5"); /* replaced in place */
    assert_true(md_tensors_scalar_value(t, 7) == -1);
    assert_string_equal(md_tensors_scalar_name(t, 99999), "key99999");
    md_tensors_free(t);

    md_err err;
    /* a checkpoint dict whose number "epoch" is set twice: the later wins */
    assert_int_equal(unpickle(PKL("\x80\x02}(X\x05\x00\x00\x00model}(" TENSOR_W "u"
                                  "X\x05\x00\x00\x00" "epochK\x01X\x05\x00\x00\x00" "epochK\x02u."),
                              &t, &err), MD_OK);
    assert_int_equal(md_tensors_scalar_count(t), 1);
    assert_true(md_tensors_scalar_value(t, 0) == 2);
    md_tensors_free(t);
    /* a state_dict naming one tensor twice */
    assert_int_equal(unpickle(PKL("\x80\x02}(" TENSOR_W TENSOR_W "u."), &t, &err), MD_EUNPROC);
    assert_msg_has(err.msg, "\"w\" appears twice", NULL);
    /* a safetensors __metadata__ key twice */
    static const char st[] = "{\"__metadata__\":{\"a\":\"1\",\"a\":\"2\"},"
                             "\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}";
    uint8_t buf[sizeof st + 8];
    uint64_t n = sizeof st - 1;
    for (int i = 0; i < 8; i++)
        buf[i] = (uint8_t)(n >> (8 * i));
    memcpy(buf + 8, st, n);
    buf[8 + n] = 7;
    assert_int_equal(md_safetensors_read(buf, 8 + n + 1, &t, &err), MD_EUNPROC);
    assert_msg_has(err.msg, "duplicate", NULL);
}

/* ---- zip directories as libtorch reads them (zipdir.c) ---- */

typedef struct zip_entry {
    const char *name;
    int method;
    const char *data;
    size_t len;
    uint64_t usize; /* declared; the data's length when 0 */
} zip_entry;

typedef struct zip_buf {
    uint8_t b[8192];
    size_t n;
} zip_buf;

static void zput(zip_buf *z, uint64_t v, int bytes)
{
    for (int i = 0; i < bytes; i++)
        z->b[z->n++] = (uint8_t)(v >> (8 * i));
}

static void zput_bytes(zip_buf *z, const void *p, size_t n)
{
    memcpy(z->b + z->n, p, n);
    z->n += n;
}

/* Local records for `e`, their offsets into `off`. */
static void zip_locals(zip_buf *z, const zip_entry *e, size_t n, uint64_t *off)
{
    for (size_t i = 0; i < n; i++) {
        off[i] = z->n;
        zput(z, 0x04034b50, 4);
        zput(z, 45, 2), zput(z, 0, 2), zput(z, (uint64_t)e[i].method, 2), zput(z, 0, 4);
        zput(z, 0, 4), zput(z, e[i].len, 4), zput(z, 0, 4);
        zput(z, strlen(e[i].name), 2), zput(z, 0, 2);
        zput_bytes(z, e[i].name, strlen(e[i].name));
        zput_bytes(z, e[i].data, e[i].len);
    }
}

/* A central directory for `e` at `off`; a usize past 32 bits goes into a
 * zip64 extra field unless `no_extra`. Returns its offset. */
static uint64_t zip_central(zip_buf *z, const zip_entry *e, size_t n, const uint64_t *off,
                            int no_extra)
{
    uint64_t at = z->n;
    for (size_t i = 0; i < n; i++) {
        uint64_t usize = e[i].usize ? e[i].usize : e[i].len;
        int big = usize >= 0xFFFFFFFF;
        zput(z, 0x02014b50, 4);
        zput(z, 45, 2), zput(z, 45, 2), zput(z, 0, 2), zput(z, (uint64_t)e[i].method, 2);
        zput(z, 0, 4), zput(z, 0, 4), zput(z, e[i].len, 4), zput(z, big ? 0xFFFFFFFF : usize, 4);
        zput(z, strlen(e[i].name), 2), zput(z, big && !no_extra ? 12 : 0, 2), zput(z, 0, 2);
        zput(z, 0, 2), zput(z, 0, 2), zput(z, 0, 4), zput(z, off[i], 4);
        zput_bytes(z, e[i].name, strlen(e[i].name));
        if (big && !no_extra)
            zput(z, 1, 2), zput(z, 8, 2), zput(z, usize, 8);
    }
    return at;
}

static void zip_eocd(zip_buf *z, uint64_t entries, uint64_t cd_size, uint64_t cd_off)
{
    zput(z, 0x06054b50, 4), zput(z, 0, 4), zput(z, entries, 2), zput(z, entries, 2);
    zput(z, cd_size, 4), zput(z, cd_off, 4), zput(z, 0, 2);
}

/* A zip64 end record (a bad signature when `broken`) and its locator. */
static void zip64_tail(zip_buf *z, uint64_t entries, uint64_t cd_size, uint64_t cd_off,
                       int broken)
{
    uint64_t at = z->n;
    zput(z, broken ? 0x06064b51 : 0x06064b50, 4), zput(z, 44, 8), zput(z, 45, 2), zput(z, 45, 2);
    zput(z, 0, 4), zput(z, 0, 4), zput(z, entries, 8), zput(z, entries, 8);
    zput(z, cd_size, 8), zput(z, cd_off, 8);
    zput(z, 0x07064b50, 4), zput(z, 0, 4), zput(z, at, 8), zput(z, 1, 4);
}

/* md_zip_dir_read over the bytes of `z`: its status, and `err`. */
static md_status zip_read(const zip_buf *z, md_zip_dir **dir, md_err *err)
{
    char path[64];
    write_temp_n(path, (const char *)z->b, z->n);
    int fd = open(path, O_RDONLY);
    assert_true(fd >= 0);
    md_err_clear(err);
    md_status st = md_zip_dir_read(fd, dir, err);
    close(fd);
    unlink(path);
    if (st != MD_OK)
        assert_null(*dir);
    return st;
}

static void test_zip_directory_as_libtorch_reads_it(void **state)
{
    (void)state;
    static const zip_entry good[] = {{"a/data.pkl", 0, "xy", 2, 0}, {"a/version", 0, "3\n", 2, 0}};
    uint64_t off[4];
    md_zip_dir *dir;
    md_err err;
    size_t len;
    /* a plain zip: every entry, in order */
    zip_buf z = {.n = 0};
    zip_locals(&z, good, 2, off);
    uint64_t cd = zip_central(&z, good, 2, off, 0);
    zip_eocd(&z, 2, z.n - cd, cd);
    assert_int_equal(zip_read(&z, &dir, &err), MD_OK);
    assert_int_equal(md_zip_dir_count(dir), 2);
    assert_memory_equal(md_zip_dir_name(dir, 1, &len), "a/version", 9);
    assert_int_equal(len, 9);
    md_zip_dir_free(dir);
    md_zip_dir_free(NULL);
    /* zip64, the classic record saturated as zip64 writers leave it: read */
    z.n = 0;
    zip_locals(&z, good, 2, off);
    cd = zip_central(&z, good, 2, off, 0);
    uint64_t cd_size = z.n - cd;
    zip64_tail(&z, 2, cd_size, cd, 0);
    zip_eocd(&z, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF);
    assert_int_equal(zip_read(&z, &dir, &err), MD_OK);
    assert_int_equal(md_zip_dir_count(dir), 2);
    md_zip_dir_free(dir);
    /* two directories: the classic record names a harmless one, the zip64
     * one (libtorch's choice) a deflated record of 4.7 GB */
    static const zip_entry bomb[] = {{"a/data.pkl", 0, "xy", 2, 0},
                                     {"a/version", 8, "\x03\x00", 2, 4697620480ULL}};
    z.n = 0;
    zip_locals(&z, good, 2, off);
    zip_locals(&z, bomb + 1, 1, off + 2);
    cd = zip_central(&z, good, 2, off, 0);
    cd_size = z.n - cd;
    uint64_t off64[2] = {off[0], off[2]};
    uint64_t cd64 = zip_central(&z, bomb, 2, off64, 0);
    zip64_tail(&z, 2, z.n - cd64, cd64, 0);
    zip_eocd(&z, 2, cd_size, cd);
    assert_int_equal(zip_read(&z, &dir, &err), MD_EUNPROC);
    assert_string_equal(err.code, "zip_directories_disagree");
    assert_msg_has(err.msg, "zip64", "classic", "torch.save", NULL);
    /* the same zip64 directory alone: its deflated record is the bomb */
    z.n = 0;
    zip_locals(&z, bomb, 2, off);
    cd = zip_central(&z, bomb, 2, off, 0);
    cd_size = z.n - cd;
    zip64_tail(&z, 2, cd_size, cd, 0);
    zip_eocd(&z, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF);
    assert_int_equal(zip_read(&z, &dir, &err), MD_EUNPROC);
    assert_string_equal(err.code, "compressed_record_too_large");
    assert_msg_has(err.msg, "a/version", "4697620480", "16 MiB", NULL);
    /* ... and with its size field saturated but no zip64 extra field */
    z.n = 0;
    zip_locals(&z, bomb, 2, off);
    cd = zip_central(&z, bomb, 2, off, 1);
    zip_eocd(&z, 2, z.n - cd, cd);
    assert_int_equal(zip_read(&z, &dir, &err), MD_EUNPROC);
    assert_msg_has(err.msg, "zip64 sizes are missing", NULL);
    /* a locator whose zip64 record is not one */
    z.n = 0;
    zip_locals(&z, good, 2, off);
    cd = zip_central(&z, good, 2, off, 0);
    cd_size = z.n - cd;
    zip64_tail(&z, 2, cd_size, cd, 1);
    zip_eocd(&z, 2, cd_size, cd);
    assert_int_equal(zip_read(&z, &dir, &err), MD_EUNPROC);
    assert_msg_has(err.msg, "no valid zip64", NULL);
    /* many names for one stored region: libtorch would hold each copy */
    static char blob[1000];
    zip_entry same[3] = {{"a/data/0", 0, blob, sizeof blob, 0}, {"a/data/1", 0, blob, 0, 0},
                         {"a/data/2", 0, blob, 0, 0}};
    z.n = 0;
    zip_locals(&z, same, 1, off);
    off[1] = off[2] = off[0];
    same[1].len = same[2].len = sizeof blob;
    cd = zip_central(&z, same, 3, off, 0);
    zip_eocd(&z, 3, z.n - cd, cd);
    assert_int_equal(zip_read(&z, &dir, &err), MD_EUNPROC);
    assert_msg_has(err.msg, "share its bytes", NULL);
    /* a stored record whose two sizes differ */
    static const zip_entry lying[] = {{"a/data.pkl", 0, "xy", 2, 1000}};
    z.n = 0;
    zip_locals(&z, lying, 1, off);
    cd = zip_central(&z, lying, 1, off, 0);
    zip_eocd(&z, 1, z.n - cd, cd);
    assert_int_equal(zip_read(&z, &dir, &err), MD_EUNPROC);
    assert_msg_has(err.msg, "two sizes differ", NULL);
    /* no end record at all */
    z.n = 0;
    zip_locals(&z, good, 2, off);
    assert_int_equal(zip_read(&z, &dir, &err), MD_EUNPROC);
    assert_msg_has(err.msg, "no end-of-central-directory", NULL);
}

/* ---- safetensors ---- */

static md_tensors *read_st_ok(const char *file)
{
    char path[256];
    snprintf(path, sizeof path, CKPT "%s", file);
    md_tensors *t = NULL;
    md_err err;
    if (md_safetensors_read_file(path, &t, &err) != MD_OK)
        fail_msg("reading %s failed: %s", file, err.msg);
    return t;
}

static void test_safetensors_files_read_exactly(void **state)
{
    (void)state;
    static const char *const files[] = {"mlp.safetensors", "mlp_bf16.safetensors",
                                        "bn.safetensors"};
    for (size_t i = 0; i < 3; i++) {
        md_tensors *t = read_st_ok(files[i]);
        assert_matches_expected(t, files[i]);
        md_tensors_free(t);
    }
    md_tensors *t = read_st_ok("mlp.safetensors");
    assert_int_equal(md_tensors_meta_count(t), 2);
    assert_string_equal(md_tensors_meta_get(t, "format"), "pt");
    assert_string_equal(md_tensors_meta_get(t, "epoch"), "3");
    assert_null(md_tensors_meta_get(t, "absent"));
    md_tensors_free(t);
}

/* Writing what was read gives back the bytes Python wrote, and reading that
 * gives back the same tensors bit for bit. */
static void test_safetensors_round_trip(void **state)
{
    (void)state;
    static const char *const files[] = {"mlp.safetensors", "mlp_bf16.safetensors",
                                        "bn.safetensors"};
    for (size_t f = 0; f < 3; f++) {
        char path[256];
        snprintf(path, sizeof path, CKPT "%s", files[f]);
        size_t len;
        uint8_t *orig = slurp(path, &len);
        md_tensors *t = read_st_ok(files[f]);
        uint8_t *buf;
        size_t blen;
        md_err err;
        assert_int_equal(md_safetensors_write(t, &buf, &blen, &err), MD_OK);
        assert_int_equal(blen, len);
        assert_memory_equal(buf, orig, len);
        md_tensors *back;
        assert_int_equal(md_safetensors_read(buf, blen, &back, &err), MD_OK);
        assert_int_equal(md_tensors_count(back), md_tensors_count(t));
        for (size_t i = 0; i < md_tensors_count(t); i++) {
            assert_string_equal(md_tensors_name(back, i), md_tensors_name(t, i));
            assert_int_equal(md_tensors_nbytes(back, i), md_tensors_nbytes(t, i));
            assert_memory_equal(md_tensors_data(back, i), md_tensors_data(t, i),
                                md_tensors_nbytes(t, i));
        }
        /* and through a file descriptor */
        char tmp[] = "/tmp/modeld_test_formats_XXXXXX";
        int fd = mkstemp(tmp);
        assert_true(fd >= 0);
        assert_int_equal(md_safetensors_write_fd(t, fd, &err), MD_OK);
        close(fd);
        size_t flen;
        uint8_t *fbytes = slurp(tmp, &flen);
        unlink(tmp);
        assert_int_equal(flen, len);
        assert_memory_equal(fbytes, orig, len);
        free(fbytes);
        md_tensors_free(back);
        free(buf);
        md_tensors_free(t);
        free(orig);
    }
}

/* A torch.save state_dict exported as safetensors reads back bit-identical. */
static void test_torch_save_to_safetensors(void **state)
{
    (void)state;
    md_tensors *t = read_zip_ok("bn_sd.pt");
    md_tensors_set_meta(t, "source", "bn_sd.pt");
    uint8_t *buf;
    size_t len;
    md_err err;
    assert_int_equal(md_safetensors_write(t, &buf, &len, &err), MD_OK);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = hlen << 8 | buf[i];
    assert_int_equal(hlen % 8, 0);
    md_tensors *back;
    assert_int_equal(md_safetensors_read(buf, len, &back, &err), MD_OK);
    assert_matches_expected(back, "bn_sd.pt");
    assert_string_equal(md_tensors_meta_get(back, "source"), "bn_sd.pt");
    md_tensors_free(back);
    free(buf);
    md_tensors_free(t);
}

/* A safetensors file from a header text and `data_len` zero data bytes. */
static md_status st_from_header(const char *header, size_t data_len, md_tensors **t, md_err *err)
{
    size_t h = strlen(header), len = 8 + h + data_len;
    uint8_t *b = calloc(1, len);
    for (int i = 0; i < 8; i++)
        b[i] = (uint8_t)((uint64_t)h >> (8 * i));
    memcpy(b + 8, header, h);
    md_err_clear(err);
    md_status st = md_safetensors_read(b, len, t, err);
    free(b);
    if (st != MD_OK)
        assert_null(*t);
    return st;
}

static void test_safetensors_bad_headers(void **state)
{
    (void)state;
    md_tensors *t;
    md_err err;
    static const struct {
        const char *header;
        size_t data;
        const char *want;
    } cases[] = {
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, NULL},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 4,
         "ends at byte 8 of the data, which holds 4"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8,
         "has 8 bytes of data; its shape and dtype F32 need 12"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12, "overlapping"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}", 12, "holes"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 8, "trailing bytes"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
         "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8, "unique"},
        {"{\"a\":{\"dtype\":\"F8_E4M3\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1,
         "dtype \"F8_E4M3\""},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4, "invalid shape"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2305843009213693952,2],\"data_offsets\":[0,0]}}",
         0, "overflows"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,0]}}", 4,
         "invalid data_offsets"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}", 4,
         "9 dimensions"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4, "data_offsets"},
        {"{\"__metadata__\":{\"k\":1},\"a\":{\"dtype\":\"F32\",\"shape\":[1],"
         "\"data_offsets\":[0,4]}}", 4, "__metadata__ entry \"k\" is not a string"},
        {"{\"__metadata__\":{}}", 0, "no tensors"},
        {"{\"a\":", 0, "not valid JSON"},
        {"[1]", 0, "not a JSON object"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        md_status st = st_from_header(cases[i].header, cases[i].data, &t, &err);
        if (!cases[i].want) {
            assert_int_equal(st, MD_OK);
            md_tensors_free(t);
            continue;
        }
        if (st != MD_EUNPROC)
            fail_msg("case %zu: status %d, want MD_EUNPROC", i, st);
        assert_msg_has(err.msg, "safetensors", cases[i].want, NULL);
    }
    /* the length itself: past the file, past the limit, shorter than 8 */
    uint8_t b[16] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, '{', '}'};
    assert_int_equal(md_safetensors_read(b, 10, &t, &err), MD_EUNPROC);
    assert_msg_has(err.msg, "MD_SAFETENSORS_MAX_HEADER", NULL);
    memset(b, 0, 8);
    b[0] = 100;
    assert_int_equal(md_safetensors_read(b, 10, &t, &err), MD_EUNPROC);
    assert_msg_has(err.msg, "claims 100 bytes", "truncated", NULL);
    assert_int_equal(md_safetensors_read(b, 5, &t, &err), MD_EUNPROC);
    assert_msg_has(err.msg, "shorter than its 8-byte header length", NULL);
    /* the committed truncated file */
    assert_int_equal(md_safetensors_read_file(CKPT "truncated.safetensors", &t, &err),
                     MD_EUNPROC);
    assert_msg_has(err.msg, "truncated or corrupt", NULL);
}

/* ---- named tensors, sniffing ---- */

static void test_named_tensors(void **state)
{
    (void)state;
    md_tensors *t = md_tensors_new();
    md_err err;
    float f[6] = {1, 2, 3, 4, 5, 6};
    int64_t shape[2] = {2, 3};
    assert_int_equal(md_tensors_add(t, "a", MD_CKPT_F32, 2, shape, f, sizeof f, &err), MD_OK);
    assert_int_equal(md_tensors_add(t, "a", MD_CKPT_F32, 2, shape, f, sizeof f, &err),
                     MD_ECONFLICT);
    assert_msg_has(err.msg, "\"a\" appears twice", NULL);
    assert_int_equal(md_tensors_add(t, "b", MD_CKPT_F32, 2, shape, f, 20, &err), MD_EINVAL);
    assert_msg_has(err.msg, "20 bytes", "need 24", NULL);
    int64_t huge[2] = {INT64_MAX, 4};
    assert_int_equal(md_tensors_add(t, "c", MD_CKPT_F32, 2, huge, f, 24, &err), MD_EINVAL);
    /* many names: the hash keeps finding them */
    for (int i = 0; i < 1000; i++) {
        char name[32];
        snprintf(name, sizeof name, "layer%d.weight", i);
        assert_int_equal(md_tensors_add(t, name, MD_CKPT_F32, 1, shape, f, 8, &err), MD_OK);
    }
    assert_int_equal(md_tensors_find(t, "layer737.weight"), 738);
    assert_int_equal(md_tensors_find(t, "a"), 0);
    assert_int_equal(md_tensors_find(t, "layer1000.weight"), -1);
    md_tensors_free(t);
    md_tensors_free(NULL);
    assert_string_equal(md_ckpt_strip_module("module.fc1.weight"), "fc1.weight");
    assert_string_equal(md_ckpt_strip_module("fc1.weight"), "fc1.weight");
    assert_string_equal(md_ckpt_strip_module("modules.x"), "modules.x");
}

static void test_sniff(void **state)
{
    (void)state;
    static const struct {
        const char *file;
        md_ckpt_format want;
    } cases[] = {
        {CKPT "mlp_sd.pt", MD_CKPT_ZIP},        {CKPT "mlp_arch.pt", MD_CKPT_ZIP},
        {CKPT "legacy.pt", MD_CKPT_LEGACY},     {CKPT "mlp.safetensors", MD_CKPT_SAFETENSORS},
        {CKPT "bn.safetensors", MD_CKPT_SAFETENSORS}, {FIX "not_a_model.pt", MD_CKPT_UNKNOWN},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        size_t len;
        uint8_t *b = slurp(cases[i].file, &len);
        assert_int_equal(md_ckpt_sniff(b, len < 16 ? len : 16), cases[i].want);
        free(b);
    }
}

/* ---- into an architecture ---- */

static void test_forward_equals_pytorch(void **state)
{
    (void)state;
    /* the architecture's own (random) weights are far from the trained ones,
     * so the comparisons below can fail */
    md_torch_state *arch;
    md_err err;
    assert_int_equal(md_torch_state_read(CKPT "mlp_arch.pt", &arch, &err), MD_OK);
    md_tensors *own = md_tensors_new();
    for (size_t i = 0; i < md_torch_state_count(arch); i++) {
        md_torch_named_tensor nt;
        md_torch_state_get(arch, i, &nt, NULL);
        size_t n = md_ckpt_dtype_size(nt.dtype);
        for (int d = 0; d < nt.ndim; d++)
            n *= (size_t)nt.shape[d];
        assert_int_equal(md_tensors_add(own, nt.name, nt.dtype, nt.ndim, nt.shape, nt.data, n,
                                        &err), MD_OK);
    }
    md_torch_state_free(arch);
    assert_true(forward_diff(CKPT "mlp_arch.pt", own, FIX "mlp_input.npy", mlp_in, 2,
                             FIX "mlp_expected.npy") > 1e-2);
    md_tensors_free(own);

    static const char *const same[] = {"mlp_sd.pt", "mlp_sd_plain.pt", "mlp_epoch3.pt",
                                       "mlp_adam.pt", "mlp_sd_module.pt", "mlp_sd_f64.pt",
                                       "mlp_sd_views.pt"};
    for (size_t i = 0; i < sizeof same / sizeof same[0]; i++) {
        md_tensors *t = read_zip_ok(same[i]);
        double d = forward_diff(CKPT "mlp_arch.pt", t, FIX "mlp_input.npy", mlp_in, 2,
                                FIX "mlp_expected.npy");
        if (d > 1e-6)
            fail_msg("%s: forward differs from PyTorch's by %g", same[i], d);
        md_tensors_free(t);
    }
    md_tensors *t = read_st_ok("mlp.safetensors");
    assert_true(forward_diff(CKPT "mlp_arch.pt", t, FIX "mlp_input.npy", mlp_in, 2,
                             FIX "mlp_expected.npy") <= 1e-6);
    md_tensors_free(t);
    t = read_zip_ok("mlp_sd_f16.pt");
    assert_true(forward_diff(CKPT "mlp_arch.pt", t, FIX "mlp_input.npy", mlp_in, 2,
                             CKPT "mlp_f16_expected.npy") <= 1e-6);
    md_tensors_free(t);
    static const char *const bn[] = {"bn_sd.pt", "bn.safetensors"};
    for (size_t i = 0; i < 2; i++) {
        t = i ? read_st_ok(bn[i]) : read_zip_ok(bn[i]);
        double d = forward_diff(CKPT "bn_arch.pt", t, FIX "cnn_input.npy", cnn_in, 4,
                                CKPT "bn_expected.npy");
        if (d > 1e-5)
            fail_msg("%s: forward differs from PyTorch's by %g", bn[i], d);
        md_tensors_free(t);
    }
}

static md_status load_into(const char *arch, const md_tensors *t, md_err *err)
{
    md_torch_named_tensor *v = named(t);
    md_torch_model *m = (md_torch_model *)(intptr_t)1;
    md_err_clear(err);
    md_status st = md_torch_load_state(arch, "cpu", MD_F32, v, md_tensors_count(t), &m, err);
    free(v);
    if (st == MD_OK)
        md_torch_free(m);
    else
        assert_null(m);
    return st;
}

static void test_strict_mismatches_reported_together(void **state)
{
    (void)state;
    md_tensors *sd = read_zip_ok("mlp_sd.pt");
    md_err err;
    /* drop fc2.bias, rename fc1.bias, give fc2.weight a wrong shape */
    md_tensors *t = md_tensors_new();
    for (size_t i = 0; i < md_tensors_count(sd); i++) {
        const char *n = md_tensors_name(sd, i);
        if (strcmp(n, "fc2.bias") == 0)
            continue;
        int64_t shape[2] = {md_tensors_shape(sd, i)[0], md_tensors_shape(sd, i)[1]};
        int ndim = md_tensors_ndim(sd, i);
        if (strcmp(n, "fc2.weight") == 0) {
            shape[0] = 4;
            shape[1] = 6;
        }
        assert_int_equal(md_tensors_add(t, strcmp(n, "fc1.bias") == 0 ? "fc1.bais" : n,
                                        md_tensors_dtype(sd, i), ndim, shape,
                                        md_tensors_data(sd, i), md_tensors_nbytes(sd, i), &err),
                         MD_OK);
    }
    assert_int_equal(load_into(CKPT "mlp_arch.pt", t, &err), MD_EUNPROC);
    assert_string_equal(md_err_code(&err), "state_dict_mismatch");
    assert_msg_has(err.msg, "2 missing keys (fc1.bias, fc2.bias)", "1 unexpected key (fc1.bais)",
                   "1 mismatched tensor (fc2.weight: checkpoint [4,6], architecture [3,8])",
                   NULL);
    md_tensors_free(t);
    /* an MLP state_dict into the BatchNorm net: many of each, counted */
    assert_int_equal(load_into(CKPT "bn_arch.pt", sd, &err), MD_EUNPROC);
    assert_msg_has(err.msg, "9 missing keys (conv.weight, conv.bias, bn.weight, bn.bias, ...)",
                   "4 unexpected keys (fc1.weight", NULL);
    /* an integer tensor where a float parameter is */
    t = md_tensors_new();
    for (size_t i = 0; i < md_tensors_count(sd); i++) {
        const char *n = md_tensors_name(sd, i);
        if (strcmp(n, "fc2.bias") == 0) {
            int64_t ints[3] = {1, 2, 3}, shape[1] = {3};
            assert_int_equal(md_tensors_add(t, n, MD_CKPT_I64, 1, shape, ints, sizeof ints, &err),
                             MD_OK);
        } else {
            assert_int_equal(md_tensors_add(t, n, md_tensors_dtype(sd, i), md_tensors_ndim(sd, i),
                                            md_tensors_shape(sd, i), md_tensors_data(sd, i),
                                            md_tensors_nbytes(sd, i), &err), MD_OK);
        }
    }
    assert_int_equal(load_into(CKPT "mlp_arch.pt", t, &err), MD_EUNPROC);
    assert_msg_has(err.msg, "fc2.bias: checkpoint I64, architecture Float", NULL);
    md_tensors_free(t);
    /* module.-prefixed keys that still miss one: stripped, the one reported */
    md_tensors *mod = read_zip_ok("mlp_sd_module.pt");
    t = md_tensors_new();
    for (size_t i = 0; i + 1 < md_tensors_count(mod); i++)
        assert_int_equal(md_tensors_add(t, md_tensors_name(mod, i), md_tensors_dtype(mod, i),
                                        md_tensors_ndim(mod, i), md_tensors_shape(mod, i),
                                        md_tensors_data(mod, i), md_tensors_nbytes(mod, i), &err),
                         MD_OK);
    assert_int_equal(load_into(CKPT "mlp_arch.pt", t, &err), MD_EUNPROC);
    assert_msg_has(err.msg, "1 missing key (fc2.bias)", NULL);
    assert_null(strstr(err.msg, "unexpected"));
    md_tensors_free(t);
    md_tensors_free(mod);
    /* a missing architecture file */
    assert_int_equal(load_into(CKPT "no_such_arch.pt", sd, &err), MD_EUNPROC);
    md_tensors_free(sd);
}

/* The architecture's table is PyTorch's state_dict order, names, shapes and
 * dtypes; a TorchScript file's weights read out equal its state_dict. */
static void test_architecture_table(void **state)
{
    (void)state;
    md_torch_state *s;
    md_err err;
    assert_int_equal(md_torch_state_read(CKPT "bn_arch.pt", &s, &err), MD_OK);
    md_tensors *sd = read_zip_ok("bn_sd.pt");
    assert_int_equal(md_torch_state_count(s), md_tensors_count(sd));
    int buffers = 0;
    for (size_t i = 0; i < md_torch_state_count(s); i++) {
        md_torch_named_tensor nt;
        int is_buffer = -1;
        md_torch_state_get(s, i, &nt, &is_buffer);
        assert_string_equal(nt.name, md_tensors_name(sd, i));
        assert_int_equal(nt.dtype, md_tensors_dtype(sd, i));
        assert_int_equal(nt.ndim, md_tensors_ndim(sd, i));
        for (int d = 0; d < nt.ndim; d++)
            assert_int_equal(nt.shape[d], md_tensors_shape(sd, i)[d]);
        assert_int_equal(is_buffer, strstr(nt.name, "running_") ||
                                        strstr(nt.name, "num_batches") ? 1 : 0);
        buffers += is_buffer;
    }
    assert_int_equal(buffers, 3);
    md_torch_state_free(s);
    md_tensors_free(sd);
    /* mlp.pt (TorchScript, trained) holds exactly the trained state_dict */
    assert_int_equal(md_torch_state_read(FIX "mlp.pt", &s, &err), MD_OK);
    sd = read_zip_ok("mlp_sd.pt");
    assert_int_equal(md_torch_state_count(s), 4);
    for (size_t i = 0; i < 4; i++) {
        md_torch_named_tensor nt;
        md_torch_state_get(s, i, &nt, NULL);
        assert_memory_equal(nt.data, md_tensors_data(sd, i), md_tensors_nbytes(sd, i));
    }
    md_torch_state_free(s);
    md_tensors_free(sd);
    md_torch_state_free(NULL);
    assert_int_equal(md_torch_state_read(CKPT "mlp_sd.pt", &s, &err), MD_EUNPROC);
    assert_null(s);
}

static void test_zip_records(void **state)
{
    (void)state;
    md_torch_zip *z;
    md_err err;
    assert_int_equal(md_torch_zip_open(CKPT "good_strided.pt", &z, &err), MD_OK);
    assert_true(md_torch_zip_has_record(z, "data.pkl"));
    assert_false(md_torch_zip_has_record(z, "constants.pkl"));
    const uint8_t *d;
    size_t n;
    assert_int_equal(md_torch_zip_record(z, "data/0", &d, &n, &err), MD_OK);
    assert_int_equal(n, 16);
    assert_memory_equal(d, four_floats, 16);
    assert_int_equal(md_torch_zip_record(z, "data/9", &d, &n, &err), MD_ENOTFOUND);
    assert_msg_has(err.msg, "data/9", NULL);
    md_torch_zip_close(z);
    md_torch_zip_close(NULL);
    assert_int_equal(md_torch_zip_open(FIX "not_a_model.pt", &z, &err), MD_EUNPROC);
    assert_null(z);
}

/* ---- tensor by tensor (the streaming export, issue 24) ---- */

/* What the *_each readers hand over, gathered into a list; without data,
 * the names and sizes alone. */
typedef struct gathered {
    md_tensors *t;
    char names[64][64];
    size_t nbytes[64], count;
} gathered;

static md_status gather(void *ctx, const char *name, md_ckpt_dtype dtype, int ndim,
                        const int64_t *shape, const void *data, size_t nbytes, md_err *err)
{
    gathered *g = ctx;
    if (g->count < 64) {
        snprintf(g->names[g->count], sizeof g->names[0], "%s", name);
        g->nbytes[g->count] = nbytes;
    }
    g->count++;
    return data ? md_tensors_add(g->t, name, dtype, ndim, shape, data, nbytes, err) : MD_OK;
}

static void assert_same_tensors(const md_tensors *a, const md_tensors *b, const char *file)
{
    if (md_tensors_count(a) != md_tensors_count(b))
        fail_msg("%s: %zu tensors against %zu", file, md_tensors_count(a), md_tensors_count(b));
    for (size_t i = 0; i < md_tensors_count(a); i++) {
        assert_string_equal(md_tensors_name(a, i), md_tensors_name(b, i));
        assert_int_equal(md_tensors_dtype(a, i), md_tensors_dtype(b, i));
        assert_int_equal(md_tensors_ndim(a, i), md_tensors_ndim(b, i));
        assert_memory_equal(md_tensors_shape(a, i), md_tensors_shape(b, i),
                            sizeof(int64_t) * (size_t)md_tensors_ndim(a, i));
        assert_int_equal(md_tensors_nbytes(a, i), md_tensors_nbytes(b, i));
        assert_memory_equal(md_tensors_data(a, i), md_tensors_data(b, i),
                            md_tensors_nbytes(a, i));
    }
}

/* Each reader one tensor at a time yields what the whole-file reader reads,
 * in the same order (views, strides, a compressed record, f16, buffers);
 * asked for names only, the same names and sizes without data; a damaged
 * file fails as the whole-file reader fails. */
static void test_tensor_by_tensor_readers(void **state)
{
    (void)state;
    static const char *const files[] = {"mlp_sd.pt",      "mlp_sd_views.pt", "good_strided.pt",
                                        "deflated.pt",    "mlp_epoch3.pt",   "bn_sd.pt",
                                        "mlp_sd_f16.pt",  "mlp_sd_module.pt", "mlp.safetensors",
                                        "bn.safetensors", "mlp_bf16.safetensors"};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        char path[256];
        snprintf(path, sizeof path, CKPT "%s", files[i]);
        int st_file = strstr(files[i], ".safetensors") != NULL;
        md_tensors *whole = NULL;
        md_err err;
        md_err_clear(&err);
        assert_int_equal(st_file ? md_safetensors_read_file(path, &whole, &err)
                                 : md_ckpt_read_torch_zip(path, NULL, &whole, &err),
                         MD_OK);
        for (int with_data = 0; with_data < 2; with_data++) {
            gathered g = {.t = md_tensors_new()};
            md_status st = st_file ? md_safetensors_each_file(path, with_data, gather, &g, &err)
                                   : md_ckpt_each_torch_zip(path, with_data, gather, &g, &err);
            if (st != MD_OK)
                fail_msg("%s: %s", files[i], err.msg);
            assert_int_equal(g.count, md_tensors_count(whole));
            if (with_data) {
                assert_same_tensors(g.t, whole, files[i]);
            } else {
                for (size_t k = 0; k < g.count; k++) {
                    assert_string_equal(g.names[k], md_tensors_name(whole, k));
                    assert_int_equal(g.nbytes[k], md_tensors_nbytes(whole, k));
                }
            }
            md_tensors_free(g.t);
        }
        md_tensors_free(whole);
    }
    static const struct {
        const char *file, *a, *b;
    } bad[] = {
        {"oob_numel.pt", "storage data/0 claims 1000 elements", "holds 16 bytes"},
        {"oob_missing_record.pt", "data/7", "does not hold"},
        {"truncated.pt", "zip", NULL},
        {"truncated.safetensors", "truncated or corrupt", NULL},
        {"mlp_arch.pt", "TorchScript", NULL},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char path[256];
        snprintf(path, sizeof path, CKPT "%s", bad[i].file);
        gathered g = {.t = md_tensors_new()};
        md_err err;
        md_err_clear(&err);
        md_status st = strstr(bad[i].file, ".safetensors")
                           ? md_safetensors_each_file(path, 1, gather, &g, &err)
                           : md_ckpt_each_torch_zip(path, 1, gather, &g, &err);
        assert_int_equal(st, MD_EUNPROC);
        assert_msg_has(err.msg, bad[i].a, bad[i].b, NULL);
        md_tensors_free(g.t);
    }
}

/* The header written alone, then the data, is md_safetensors_write's file. */
static void test_safetensors_header_alone(void **state)
{
    (void)state;
    md_tensors *t = read_zip_ok("bn_sd.pt");
    md_tensors_set_meta(t, "model", "m");
    uint8_t *whole, *head;
    size_t whole_len, head_len;
    md_err err;
    assert_int_equal(md_safetensors_write(t, &whole, &whole_len, &err), MD_OK);
    md_ckpt_tensor_info info[16];
    size_t n = md_tensors_count(t), data = 0;
    assert_true(n <= 16);
    for (size_t i = 0; i < n; i++) {
        info[i] = (md_ckpt_tensor_info){md_tensors_name(t, i), md_tensors_dtype(t, i),
                                        md_tensors_ndim(t, i), md_tensors_shape(t, i)};
        data += md_tensors_nbytes(t, i);
    }
    assert_int_equal(md_safetensors_header(info, n, t, &head, &head_len, &err), MD_OK);
    assert_int_equal(head_len + data, whole_len);
    assert_memory_equal(head, whole, head_len);
    free(head);
    free(whole);
    md_tensors_free(t);
}

/* The table read onto the meta device is md_torch_state_read's, without data. */
static void test_architecture_shapes_only(void **state)
{
    (void)state;
    md_torch_state *full, *shapes;
    md_err err;
    assert_int_equal(md_torch_state_read(CKPT "bn_arch.pt", &full, &err), MD_OK);
    assert_int_equal(md_torch_state_read_shapes(CKPT "bn_arch.pt", &shapes, &err), MD_OK);
    assert_int_equal(md_torch_state_count(shapes), md_torch_state_count(full));
    for (size_t i = 0; i < md_torch_state_count(full); i++) {
        md_torch_named_tensor a, b;
        int ba = -1, bb = -1;
        md_torch_state_get(full, i, &a, &ba);
        md_torch_state_get(shapes, i, &b, &bb);
        assert_string_equal(a.name, b.name);
        assert_int_equal(a.dtype, b.dtype);
        assert_int_equal(a.ndim, b.ndim);
        assert_memory_equal(a.shape, b.shape, sizeof(int64_t) * (size_t)a.ndim);
        assert_int_equal(ba, bb);
        assert_non_null(a.data);
        assert_null(b.data);
    }
    md_torch_state_free(full);
    md_torch_state_free(shapes);
    assert_int_equal(md_torch_state_read_shapes(CKPT "mlp_sd.pt", &shapes, &err), MD_EUNPROC);
    assert_null(shapes);
}

/* The streamed export is, byte for byte, the safetensors file of
 * md_weights_effective: names "module."-stripped, f16/bf16/f64 converted, a
 * TorchScript version's own weights; a mismatch is the same 422. */
static void test_export_equals_effective_weights(void **state)
{
    (void)state;
    static const struct {
        const char *path, *format;
    } cases[] = {
        {CKPT "mlp_sd.pt", "torch_save"},        {CKPT "mlp_sd_module.pt", "torch_save"},
        {CKPT "mlp_sd_f16.pt", "torch_save"},    {CKPT "mlp_sd_f64.pt", "torch_save"},
        {CKPT "mlp_sd_views.pt", "torch_save"},  {CKPT "mlp.safetensors", "safetensors"},
        {CKPT "mlp_bf16.safetensors", "safetensors"}, {FIX "mlp.pt", "torchscript"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        for (int cached = 0; cached < 2; cached++) {
            const char *sha = cached ? "mlp_arch" : NULL;
            md_err err;
            md_err_clear(&err);
            md_tensors *eff = NULL;
            if (md_weights_effective(cases[i].path, cases[i].format, CKPT "mlp_arch.pt", sha,
                                     &eff, &err) != MD_OK)
                fail_msg("%s: %s", cases[i].path, err.msg);
            md_tensors_set_meta(eff, "model", "m");
            uint8_t *want;
            size_t want_len;
            assert_int_equal(md_safetensors_write(eff, &want, &want_len, &err), MD_OK);
            FILE *f = tmpfile();
            assert_non_null(f);
            uint64_t size = 0;
            if (md_weights_export(cases[i].path, cases[i].format, CKPT "mlp_arch.pt", sha, eff,
                                  fileno(f), &size, &err) != MD_OK)
                fail_msg("%s: %s", cases[i].path, err.msg);
            assert_int_equal(size, want_len);
            uint8_t *got = malloc(want_len);
            assert_int_equal(pread(fileno(f), got, want_len, 0), (ssize_t)want_len);
            assert_memory_equal(got, want, want_len);
            free(got);
            free(want);
            fclose(f);
            md_tensors_free(eff);
        }
    }
    /* another architecture's weights: the same refusal, nothing else */
    md_err a, b;
    md_tensors *eff = NULL;
    FILE *f = tmpfile();
    uint64_t size;
    assert_int_equal(md_weights_effective(CKPT "bn_sd.pt", "torch_save", CKPT "mlp_arch.pt",
                                          NULL, &eff, &a), MD_EUNPROC);
    assert_int_equal(md_weights_export(CKPT "bn_sd.pt", "torch_save", CKPT "mlp_arch.pt", NULL,
                                       NULL, fileno(f), &size, &b), MD_EUNPROC);
    assert_string_equal(md_err_code(&a), "state_dict_mismatch");
    assert_string_equal(a.msg, b.msg);
    fclose(f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_torch_save_files_read_exactly),
        cmocka_unit_test(test_checkpoint_dict_scalars_and_optimizer_skipped),
        cmocka_unit_test(test_bn_int64_buffer),
        cmocka_unit_test(test_malicious_pickles_refused_nothing_runs),
        cmocka_unit_test(test_whole_model_pickle_refused),
        cmocka_unit_test(test_legacy_format_refused),
        cmocka_unit_test(test_bad_torch_save_files),
        cmocka_unit_test(test_handmade_pickles),
        cmocka_unit_test(test_pickle_limits),
        cmocka_unit_test(test_pickle_views_within_budget),
        cmocka_unit_test(test_many_entries_and_duplicates),
        cmocka_unit_test_teardown(test_zip_directory_as_libtorch_reads_it, remove_temps),
        cmocka_unit_test(test_safetensors_files_read_exactly),
        cmocka_unit_test(test_safetensors_round_trip),
        cmocka_unit_test(test_torch_save_to_safetensors),
        cmocka_unit_test(test_safetensors_bad_headers),
        cmocka_unit_test(test_named_tensors),
        cmocka_unit_test(test_sniff),
        cmocka_unit_test(test_forward_equals_pytorch),
        cmocka_unit_test(test_strict_mismatches_reported_together),
        cmocka_unit_test(test_architecture_table),
        cmocka_unit_test(test_zip_records),
        cmocka_unit_test(test_tensor_by_tensor_readers),
        cmocka_unit_test(test_safetensors_header_alone),
        cmocka_unit_test(test_architecture_shapes_only),
        cmocka_unit_test(test_export_equals_effective_weights),
    };
    return cmocka_run_group_tests(tests, load_expected, free_expected);
}
