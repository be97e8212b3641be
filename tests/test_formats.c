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
#include "../predictor/torch_backend.h"

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

static void assert_msg_has(const char *msg, ...)
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
    if (md_ckpt_read_torch_zip(path, &t, &err) != MD_OK)
        fail_msg("reading %s failed: %s", file, err.msg);
    return t;
}

static const char *read_zip_fails(const char *file, md_err *err)
{
    char path[256];
    snprintf(path, sizeof path, CKPT "%s", file);
    md_tensors *t = (md_tensors *)(intptr_t)1;
    md_err_clear(err);
    md_status st = md_ckpt_read_torch_zip(path, &t, err);
    if (st == MD_OK)
        fail_msg("%s was read, it must be refused", file);
    assert_null(t);
    assert_int_equal(err->status, st);
    return err->msg;
}





/* ---- torch.save files PyTorch wrote ---- */

static void test_torch_save_files_read_exactly(void **state)
{
    (void)state;
    static const char *const files[] = {"mlp_sd.pt",     "mlp_sd_plain.pt", "mlp_epoch3.pt",
                                        "mlp_adam.pt",   "mlp_sd_module.pt", "mlp_sd_f16.pt",
                                        "mlp_sd_f64.pt", "mlp_sd_views.pt", "bn_sd.pt",
                                        "good_strided.pt"};
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
    assert_int_equal(md_ckpt_unpickle(b, len, NULL, NULL, "legacy.pt", &t, &err), MD_EUNPROC);
    assert_msg_has(err.msg, "legacy.pt", "_use_new_zipfile_serialization=True", NULL);
    free(b);
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
    md_status st = md_ckpt_unpickle((const uint8_t *)pkl, len, one_record, NULL, "test.pt", t,
                                    err);
    if (st != MD_OK)
        assert_null(*t);
    return st;
}

#define PKL(s) s, sizeof(s) - 1
/* {'w': tensor of data/0, 4 floats, size (4,), stride (1,)} */
#define TENSOR_W                                                                          \
    "X\x01\x00\x00\x00w" "ctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storage" \
    "ctorch\nFloatStorage\nX\x01\x00\x00\x00" "0X\x03\x00\x00\x00" "cpuK\x04tQK\x00K\x04" \
    "\x85K\x01\x85\x89}t" "R"

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
        cmocka_unit_test(test_safetensors_files_read_exactly),
        cmocka_unit_test(test_safetensors_round_trip),
        cmocka_unit_test(test_torch_save_to_safetensors),
        cmocka_unit_test(test_safetensors_bad_headers),
        cmocka_unit_test(test_named_tensors),
        cmocka_unit_test(test_sniff),
        cmocka_unit_test(test_zip_records),
    };
    return cmocka_run_group_tests(tests, load_expected, free_expected);
}
