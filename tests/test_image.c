/*
 * test_image.c - unit tests of image input (predictor/image.c) against
 * torchvision 0.14 on PIL 9.4, on the fixtures of
 * tests/fixtures/make_images.py (tests/fixtures/images/manifest.json):
 *   - every case (sizes, PNG and JPEG flavours, mode conversions, resize by
 *     int and [h, w], up and down, crops smaller and larger than the image)
 *     decoded and preprocessed with the options md_image_opts_from_config
 *     reads from the config the case implies, compared value by value with
 *     torchvision's tensor; the largest difference of each case is printed,
 *     and the assertion is exact equality within 1e-6 (the tensors are
 *     v / 255 of uint8 pixels, so anything short of the same pixels differs
 *     by at least 1/255);
 *   - the 200 FashionMNIST PNGs and JPEGs of the ImageFolder fixture against
 *     PIL's decoded pixels, and the layout a job reads (label directories,
 *     label in the file name);
 *   - every file of bad/ refused with the documented status, the code
 *     invalid_image and the file's name in the message; max_pixels before
 *     decoding and after resize;
 *   - what md_image_opts_from_config promises to refuse, each naming the key.
 *
 * Run from the repository root (make does): fixture paths are relative.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../predictor/image.h"
#include "test_util.h"
#include <time.h>

#define IMAGES "tests/fixtures/images/"

/* ---- helpers ---- */

/* The whole file; *len its size. fail()s when it cannot be read. */
static unsigned char *slurp(const char *rel, size_t *len)
{
    char p[512];
    snprintf(p, sizeof p, IMAGES "%s", rel);
    FILE *f = fopen(p, "rb");
    if (!f)
        fail_msg("cannot open %s (run from the repository root; make fixtures)", p);
    assert_int_equal(fseek(f, 0, SEEK_END), 0);
    long n = ftell(f);
    assert_true(n >= 0);
    rewind(f);
    unsigned char *buf = malloc((size_t)n + 1);
    assert_non_null(buf);
    assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    *len = (size_t)n;
    return buf;
}

static json_t *manifest(void)
{
    json_error_t je;
    json_t *m = json_load_file(IMAGES "manifest.json", 0, &je);
    if (!m)
        fail_msg("manifest.json: %s (line %d)", je.text, je.line);
    return m;
}

/* An NPY array as numpy.save writes it: '<f4' or '|u1', C order. */
typedef struct npy {
    int is_float;
    int ndim;
    int64_t shape[4];
    size_t count;
    float *f;         /* is_float */
    unsigned char *u; /* otherwise */
    unsigned char *raw;
} npy;

static void npy_load(const char *rel, npy *a)
{
    size_t len;
    unsigned char *raw = slurp(rel, &len);
    memset(a, 0, sizeof *a);
    a->raw = raw;
    if (len < 10 || memcmp(raw, "\x93NUMPY", 6) != 0)
        fail_msg("%s: not an NPY file", rel);
    size_t hlen, off;
    if (raw[6] == 1) {
        hlen = raw[8] | (size_t)raw[9] << 8;
        off = 10;
    } else {
        hlen = raw[8] | (size_t)raw[9] << 8 | (size_t)raw[10] << 16 | (size_t)raw[11] << 24;
        off = 12;
    }
    assert_true(off + hlen <= len);
    char header[1024];
    assert_true(hlen < sizeof header);
    memcpy(header, raw + off, hlen);
    header[hlen] = '\0';
    if (strstr(header, "'descr': '<f4'"))
        a->is_float = 1;
    else if (!strstr(header, "'descr': '|u1'"))
        fail_msg("%s: dtype not float32 or uint8: %s", rel, header);
    if (!strstr(header, "'fortran_order': False"))
        fail_msg("%s: not C order", rel);
    const char *s = strstr(header, "'shape': (");
    assert_non_null(s);
    s += strlen("'shape': (");
    a->count = 1;
    while (*s && *s != ')') {
        char *end;
        long long d = strtoll(s, &end, 10);
        if (end == s)
            break;
        assert_true(a->ndim < 4);
        a->shape[a->ndim++] = d;
        a->count *= (size_t)d;
        s = end;
        while (*s == ',' || *s == ' ')
            s++;
    }
    size_t bytes = a->count * (a->is_float ? 4 : 1);
    if (off + hlen + bytes != len)
        fail_msg("%s: %zu data bytes, shape wants %zu", rel, len - off - hlen, bytes);
    if (a->is_float) {
        a->f = malloc(bytes ? bytes : 1);
        assert_non_null(a->f);
        memcpy(a->f, raw + off + hlen, bytes); /* little-endian host, as numpy wrote */
    } else {
        a->u = raw + off + hlen;
    }
}

static void npy_free(npy *a)
{
    free(a->f);
    free(a->raw);
}

/* {"input": {"shape": shape}, "preprocess": {"image": {mode, resize, center_crop}}},
 * the null transforms left out. Returns a new reference. */
static json_t *config_for(json_t *shape, const char *mode, json_t *resize, json_t *crop)
{
    json_t *img = json_object();
    if (mode)
        json_object_set_new(img, "mode", json_string(mode));
    if (resize && !json_is_null(resize))
        json_object_set(img, "resize", resize);
    if (crop && !json_is_null(crop))
        json_object_set(img, "center_crop", crop);
    return json_pack("{s:{s:O},s:{s:o}}", "input", "shape", shape, "preprocess", "image", img);
}

/* Options from a config given as JSON text; fail()s unless it is accepted. */
static md_image_opts opts_from(const char *text, int64_t max_pixels)
{
    json_t *cfg = json_loads(text, 0, NULL);
    assert_non_null(cfg);
    md_image_opts o;
    md_err err;
    md_err_clear(&err);
    int declared = -1;
    md_status st = md_image_opts_from_config(cfg, max_pixels, &o, &declared, &err);
    json_decref(cfg);
    if (st != MD_OK)
        fail_msg("config %s refused: %s", text, err.msg);
    assert_int_equal(declared, 1);
    return o;
}

/* The config must be refused with MD_EUNPROC; returns the message. */
static const char *config_fails(const char *text, md_err *err)
{
    json_t *cfg = json_loads(text, 0, NULL);
    assert_non_null(cfg);
    md_image_opts o;
    md_err_clear(err);
    int declared = -1;
    md_status st = md_image_opts_from_config(cfg, 0, &o, &declared, err);
    json_decref(cfg);
    if (st != MD_EUNPROC)
        fail_msg("config %s: status %d, want MD_EUNPROC (message: %s)", text, st, err->msg);
    assert_int_equal(err->status, MD_EUNPROC);
    assert_string_equal(md_err_code(err), "invalid_config");
    assert_int_not_equal(declared, 1);
    return err->msg;
}

/* Decode `rel` with `o`; returns the status, the floats in a new *out. */
static md_status run_file(const char *rel, const md_image_opts *o, float **out, md_err *err)
{
    size_t len;
    unsigned char *data = slurp(rel, &len);
    size_t n = md_image_values(o);
    *out = malloc(n * sizeof(float));
    assert_non_null(*out);
    for (size_t i = 0; i < n; i++)
        (*out)[i] = -1.0f; /* every value must be written */
    md_err_clear(err);
    md_status st = md_image_to_tensor(data, len, o, rel, *out, err);
    free(data);
    return st;
}

/* ---- the cases against torchvision ---- */

static void test_cases_match_torchvision(void **state)
{
    (void)state;
    json_t *m = manifest();
    json_t *cases = json_object_get(m, "cases");
    assert_true(json_array_size(cases) >= 20);
    size_t i;
    json_t *c;
    int failed = 0;
    json_array_foreach(cases, i, c)
    {
        const char *name = json_string_value(json_object_get(c, "name"));
        const char *file = json_string_value(json_object_get(c, "file"));
        const char *mode = json_string_value(json_object_get(c, "mode"));
        json_t *shape = json_object_get(c, "shape");
        json_t *cfg = config_for(shape, mode, json_object_get(c, "resize"),
                                 json_object_get(c, "center_crop"));
        md_image_opts o;
        md_err err;
        md_err_clear(&err);
        int declared = 0;
        md_status st = md_image_opts_from_config(cfg, 0, &o, &declared, &err);
        char *cfg_text = json_dumps(cfg, JSON_COMPACT);
        json_decref(cfg);
        if (st != MD_OK || !declared) {
            printf("case %-22s config %s refused: %s\n", name, cfg_text, err.msg);
            free(cfg_text);
            failed++;
            continue;
        }
        free(cfg_text);
        npy want;
        npy_load(json_string_value(json_object_get(c, "expected")), &want);
        assert_true(want.is_float);
        assert_int_equal(want.ndim, 3);
        assert_int_equal(md_image_values(&o), want.count);
        assert_int_equal(o.channels, want.shape[0]);
        assert_int_equal(o.height, want.shape[1]);
        assert_int_equal(o.width, want.shape[2]);
        float *got;
        st = run_file(file, &o, &got, &err);
        if (st != MD_OK) {
            printf("case %-22s %s: status %d (%s): %s\n", name, file, st, md_err_code(&err),
                   err.msg);
            failed++;
        } else {
            double max_diff = 0;
            size_t n_off = 0, first_off = (size_t)-1;
            for (size_t k = 0; k < want.count; k++) {
                double d = fabs((double)got[k] - (double)want.f[k]);
                if (d > max_diff)
                    max_diff = d;
                if (d > 1e-6 && n_off++ == 0)
                    first_off = k;
            }
            printf("case %-22s max |diff| %.9f (%.2f/255), %zu of %zu values off", name,
                   max_diff, max_diff * 255, n_off, want.count);
            if (n_off) {
                size_t hw = (size_t)(want.shape[1] * want.shape[2]);
                size_t ch = first_off / hw, y = first_off % hw / (size_t)want.shape[2],
                       x = first_off % (size_t)want.shape[2];
                printf("; first at [%zu, %zu, %zu]: got %.0f/255, torchvision %.0f/255", ch, y,
                       x, got[first_off] * 255.0, want.f[first_off] * 255.0);
                failed++;
            }
            printf("\n");
        }
        free(got);
        npy_free(&want);
    }
    json_decref(m);
    if (failed)
        fail_msg("%d case(s) differ from torchvision or fail (see above)", failed);
}

/* ---- the FashionMNIST ImageFolder ---- */

static void check_fashion(const char *kind)
{
    json_t *m = manifest();
    json_t *files = json_object_get(m, kind);
    assert_int_equal(json_array_size(files), 200);
    npy px;
    npy_load(json_string_value(json_object_get(json_object_get(m, "fashion_pixels"), kind)), &px);
    assert_false(px.is_float);
    assert_int_equal(px.shape[0], 200);
    md_image_opts o = opts_from("{\"input\": {\"shape\": [1, 28, 28]}, "
                                "\"preprocess\": {\"image\": {\"mode\": \"L\"}}}",
                                0);
    size_t i;
    json_t *e;
    const char *prev = "";
    double max_diff = 0;
    json_array_foreach(files, i, e)
    {
        const char *file = json_string_value(json_object_get(e, "file"));
        int label = (int)json_integer_value(json_object_get(e, "label"));
        /* the layout a job reads: sorted paths, <kind>/<label>/<label>_<index>.<ext> */
        assert_true(strcmp(prev, file) < 0);
        prev = file;
        char want_prefix[64];
        snprintf(want_prefix, sizeof want_prefix, "%s/%d/%d_", kind, label, label);
        assert_true(strncmp(file, want_prefix, strlen(want_prefix)) == 0);
        float *got;
        md_err err;
        md_status st = run_file(file, &o, &got, &err);
        if (st != MD_OK)
            fail_msg("%s: %s", file, err.msg);
        for (size_t k = 0; k < 28 * 28; k++) {
            float want = (float)px.u[i * 28 * 28 + k] / 255.0f;
            double d = fabs((double)got[k] - (double)want);
            if (d > max_diff)
                max_diff = d;
            if (d > 1e-6)
                fail_msg("%s: value %zu is %.0f/255, PIL decodes %u", file, k, got[k] * 255.0,
                         px.u[i * 28 * 28 + k]);
        }
        free(got);
    }
    printf("%s: 200 files, max |diff| from PIL %.9f\n", kind, max_diff);
    npy_free(&px);
    json_decref(m);
}

static void test_fashion_png(void **state)
{
    (void)state;
    check_fashion("fashion");
}

static void test_fashion_jpeg(void **state)
{
    (void)state;
    check_fashion("fashion_jpeg");
}

/* ---- refused files ---- */

static void test_bad_files(void **state)
{
    (void)state;
    json_t *m = manifest();
    json_t *bad = json_object_get(m, "bad");
    assert_true(json_array_size(bad) >= 9);
    /* RGB: every file passes the mode; 32x32 is what the good ones would be */
    md_image_opts o = opts_from("{\"input\": {\"shape\": [3, 32, 32]}, "
                                "\"preprocess\": {\"image\": {\"mode\": \"RGB\"}}}",
                                0);
    assert_int_equal(o.max_pixels, MD_IMAGE_MAX_PIXELS_DEFAULT);
    size_t i;
    json_t *e;
    int failed = 0;
    json_array_foreach(bad, i, e)
    {
        const char *file = json_string_value(json_object_get(e, "file"));
        const char *status = json_string_value(json_object_get(e, "status"));
        int too_large = strcmp(status, "too_large") == 0;
        float *got;
        md_err err;
        md_status st = run_file(file, &o, &got, &err);
        free(got);
        md_status want = too_large ? MD_ETOOBIG : MD_EUNPROC;
        const char *want_code = too_large ? "image_too_large" : "invalid_image";
        int ok = st == want && err.status == st && strcmp(md_err_code(&err), want_code) == 0 &&
                 strstr(err.msg, file) != NULL;
        printf("bad %-26s status %d code %s: %s%s\n", file, st, md_err_code(&err), err.msg,
               ok ? "" : "   <-- WRONG");
        failed += !ok;
    }
    json_decref(m);
    if (failed)
        fail_msg("%d bad file(s) not refused as documented (see above)", failed);
}

static void expect_too_big(const char *file, const md_image_opts *o, const char *what)
{
    float *got;
    md_err err;
    md_status st = run_file(file, o, &got, &err);
    free(got);
    if (st != MD_ETOOBIG)
        fail_msg("%s with max_pixels %lld: status %d (%s), want MD_ETOOBIG", file,
                 (long long)o->max_pixels, st, err.msg);
    assert_msg_has(err.msg, file, what, "max_image_pixels", NULL);
}

/* max_pixels bounds the image as its header declares it, and what a resize makes */
static void test_max_pixels(void **state)
{
    (void)state;
    float *got;
    md_err err;
    /* 300x200 = 60000 pixels: the bound is inclusive */
    md_image_opts o = opts_from("{\"input\": {\"shape\": [3, 56, 56]}, \"preprocess\": "
                                "{\"image\": {\"resize\": 64, \"center_crop\": 56}}}",
                                60000);
    assert_int_equal(o.max_pixels, 60000);
    assert_int_equal(run_file("cases/rgb_300x200.png", &o, &got, &err), MD_OK);
    free(got);
    assert_int_equal(run_file("cases/rgb_300x200.jpg", &o, &got, &err), MD_OK);
    free(got);
    o.max_pixels = 59999;
    expect_too_big("cases/rgb_300x200.png", &o, "300x200");
    expect_too_big("cases/rgb_300x200.jpg", &o, "300x200");
    /* a 64x48 image (3072 pixels) resized to 100x100: past 5000 after resize */
    o = opts_from("{\"input\": {\"shape\": [3, 100, 100]}, \"preprocess\": "
                  "{\"image\": {\"resize\": [100, 100]}}}",
                  5000);
    expect_too_big("cases/rgb_64x48.png", &o, "after resize");
    /* 1 x 65536 resized to [16, 16]: PIL's horizontal pass first makes a
     * 16 x 65536 image, 2^20 pixels, although input and output are small */
    o = opts_from("{\"input\": {\"shape\": [1, 16, 16]}, \"preprocess\": "
                  "{\"image\": {\"resize\": [16, 16]}}}",
                  1 << 20);
    assert_int_equal(run_file("cases/tall_1x65536.png", &o, &got, &err), MD_OK);
    free(got);
    o.max_pixels = (1 << 20) - 1;
    expect_too_big("cases/tall_1x65536.png", &o, "16x65536");
    /* the bomb's 10^10 pixels against a limit one short of it */
    o.max_pixels = 100000LL * 100000 - 1;
    expect_too_big("bad/bomb_100000.png", &o, "100000x100000");
    o.max_pixels = MD_IMAGE_MAX_PIXELS_DEFAULT;
    expect_too_big("bad/bomb_8000.png", &o, "8000x8000");
    expect_too_big("bad/bomb_65000.jpg", &o, "65000x65000");
    /* with the limit raised past the 8000x8000 bomb, its four bytes of
     * pixel data are a truncated image, not a crash or a 64 MB answer */
    o.max_pixels = 8000LL * 8000;
    assert_int_equal(run_file("bad/bomb_8000.png", &o, &got, &err), MD_EUNPROC);
    free(got);
    assert_string_equal(md_err_code(&err), "invalid_image");
    assert_msg_has(err.msg, "bad/bomb_8000.png", NULL);
}

/* Without a resize, an image must already be the input's size; a resize
 * whose result is not H x W (no crop) is refused naming the image. */
static void test_size_mismatch(void **state)
{
    (void)state;
    float *got;
    md_err err;
    md_image_opts o = opts_from("{\"input\": {\"shape\": [1, 28, 28]}, "
                                "\"preprocess\": {\"image\": {\"mode\": \"L\"}}}",
                                0);
    assert_int_equal(run_file("cases/rgb_40x30.png", &o, &got, &err), MD_EUNPROC);
    free(got);
    assert_string_equal(md_err_code(&err), "invalid_image");
    assert_msg_has(err.msg, "cases/rgb_40x30.png", "40x30", "28x28", NULL);
    /* Resize(30) of 64x48 is 40x30: the config is fine (the smaller edge is
     * 30), this image is not */
    o = opts_from("{\"input\": {\"shape\": [3, 30, 30]}, "
                  "\"preprocess\": {\"image\": {\"resize\": 30}}}",
                  0);
    assert_int_equal(run_file("cases/rgb_64x48.png", &o, &got, &err), MD_EUNPROC);
    free(got);
    assert_string_equal(md_err_code(&err), "invalid_image");
    assert_msg_has(err.msg, "cases/rgb_64x48.png", "40x30", "after resize", NULL);
    /* a square image passes the same config */
    assert_int_equal(run_file("cases/rgb_224x224.png", &o, &got, &err), MD_OK);
    free(got);
}

/* The same bytes through "L" and "RGB": RGB replicates L exactly. */
static void test_l_to_rgb_replicates(void **state)
{
    (void)state;
    md_image_opts l = opts_from("{\"input\": {\"shape\": [1, 40, 50]}, "
                                "\"preprocess\": {\"image\": {\"mode\": \"L\"}}}",
                                0);
    md_image_opts rgb = opts_from("{\"input\": {\"shape\": [3, 40, 50]}, "
                                  "\"preprocess\": {\"image\": {\"mode\": \"RGB\"}}}",
                                  0);
    float *a, *b;
    md_err err;
    assert_int_equal(run_file("cases/gray_50x40.png", &l, &a, &err), MD_OK);
    assert_int_equal(run_file("cases/gray_50x40.png", &rgb, &b, &err), MD_OK);
    for (int c = 0; c < 3; c++)
        assert_memory_equal(a, b + c * 40 * 50, 40 * 50 * sizeof(float));
    free(a);
    free(b);
}

/* A good file cut at every length: never read past the end (ASan, exact-size
 * buffers), refused as invalid_image naming the file, or, only where PIL
 * also reads the cut file, the whole file's tensor. PIL refuses a JPEG cut
 * anywhere (even its EOI: "image file is truncated"); it reads a PNG that
 * lost its IEND, its last IDAT's CRC, the zlib checksum and a few deflate
 * bytes after the last row (up to 20-22 bytes of these fixtures), so there
 * either answer is right. */
static void test_every_truncation(void **state)
{
    (void)state;
    const char *files[] = {"cases/gray2_interlaced_37x21.png", "cases/fashion_0.png",
                           "cases/fashion_0.jpg", "cases/progressive_64x48.jpg"};
    /* the crop makes every size acceptable, so only the bytes decide */
    md_image_opts o = opts_from("{\"input\": {\"shape\": [1, 20, 20]}, "
                                "\"preprocess\": {\"image\": {\"center_crop\": 20}}}",
                                0);
    for (size_t f = 0; f < sizeof files / sizeof *files; f++) {
        size_t len;
        unsigned char *data = slurp(files[f], &len);
        int is_png = md_image_sniff(data, len) == MD_IMAGE_PNG;
        float whole[400], out[400];
        md_err err;
        md_err_clear(&err);
        assert_int_equal(md_image_to_tensor(data, len, &o, files[f], whole, &err), MD_OK);
        size_t n_ok = 0;
        for (size_t cut = 0; cut < len; cut++) {
            unsigned char *copy = malloc(cut ? cut : 1);
            assert_non_null(copy);
            memcpy(copy, data, cut);
            md_err_clear(&err);
            md_status st = md_image_to_tensor(copy, cut, &o, files[f], out, &err);
            free(copy);
            if (st == MD_OK) {
                if (!is_png || cut + 24 < len)
                    fail_msg("%s cut to %zu of %zu bytes: accepted (PIL refuses it)", files[f],
                             cut, len);
                assert_memory_equal(out, whole, sizeof whole);
                n_ok++;
                continue;
            }
            if (st != MD_EUNPROC)
                fail_msg("%s cut to %zu of %zu bytes: status %d (%s)", files[f], cut, len, st,
                         err.msg);
            assert_string_equal(md_err_code(&err), "invalid_image");
            assert_msg_has(err.msg, files[f], NULL);
        }
        printf("%s: %zu cuts refused, %zu read as the whole file\n", files[f], len - n_ok, n_ok);
        free(data);
    }
}

/* ---- sniffing and sizes ---- */

static void test_sniff(void **state)
{
    (void)state;
    assert_int_equal(md_image_sniff("\x89PNG\r\n\x1a\n", 8), MD_IMAGE_PNG);
    assert_int_equal(md_image_sniff("\x89PNG\r\n\x1a", 7), MD_IMAGE_NONE);
    assert_int_equal(md_image_sniff("\xff\xd8\xff\xe0", 4), MD_IMAGE_JPEG);
    assert_int_equal(md_image_sniff("\xff\xd8", 2), MD_IMAGE_NONE);
    assert_int_equal(md_image_sniff("GIF89a", 6), MD_IMAGE_NONE);
    assert_int_equal(md_image_sniff("", 0), MD_IMAGE_NONE);
    size_t len;
    unsigned char *d = slurp("cases/fashion_0.png", &len);
    assert_int_equal(md_image_sniff(d, len), MD_IMAGE_PNG);
    free(d);
    d = slurp("cases/fashion_0.jpg", &len);
    assert_int_equal(md_image_sniff(d, len), MD_IMAGE_JPEG);
    free(d);
}

static void test_values(void **state)
{
    (void)state;
    md_image_opts o = opts_from("{\"input\": {\"shape\": [3, 224, 200]}, \"preprocess\": "
                                "{\"image\": {\"mode\": \"RGB\", \"resize\": 256, "
                                "\"center_crop\": [224, 200]}}}",
                                0);
    assert_int_equal(md_image_values(&o), 3 * 224 * 200);
    assert_int_equal(o.channels, 3);
    assert_int_equal(o.height, 224);
    assert_int_equal(o.width, 200);
    assert_int_equal(o.resize, 1);
    assert_int_equal(o.resize_h, 256);
    assert_int_equal(o.crop, 1);
    assert_int_equal(o.crop_h, 224);
    assert_int_equal(o.crop_w, 200);
    /* [H, W] is one channel */
    o = opts_from("{\"input\": {\"shape\": [28, 28]}, \"preprocess\": {\"image\": {}}}", 123);
    assert_int_equal(o.channels, 1);
    assert_int_equal(md_image_values(&o), 28 * 28);
    assert_int_equal(o.max_pixels, 123);
    assert_int_equal(o.resize, 0);
    assert_int_equal(o.crop, 0);
    /* [h, w] resize, and torchvision's [n] taken as n */
    o = opts_from("{\"input\": {\"shape\": [1, 20, 30]}, "
                  "\"preprocess\": {\"image\": {\"resize\": [20, 30]}}}",
                  0);
    assert_int_equal(o.resize, 2);
    assert_int_equal(o.resize_h, 20);
    assert_int_equal(o.resize_w, 30);
    o = opts_from("{\"input\": {\"shape\": [1, 20, 20]}, "
                  "\"preprocess\": {\"image\": {\"resize\": [20], \"center_crop\": [20]}}}",
                  0);
    assert_int_equal(o.resize, 1);
    assert_int_equal(o.crop_h, 20);
    assert_int_equal(o.crop_w, 20);
}

/* ---- the config ---- */

static void test_config_not_declared(void **state)
{
    (void)state;
    const char *texts[] = {"{\"input\": {\"shape\": [4]}}",
                           "{\"input\": {\"shape\": [1, 28, 28]}, \"preprocess\": {\"scale\": 1}}"};
    for (size_t i = 0; i < 2; i++) {
        json_t *cfg = json_loads(texts[i], 0, NULL);
        md_image_opts o;
        md_err err;
        md_err_clear(&err);
        int declared = -1;
        assert_int_equal(md_image_opts_from_config(cfg, 0, &o, &declared, &err), MD_OK);
        assert_int_equal(declared, 0);
        json_decref(cfg);
    }
}

static void test_config_errors(void **state)
{
    (void)state;
    md_err err;
#define SHAPE3 "{\"input\": {\"shape\": [3, 24, 24]}, \"preprocess\": {\"image\": "
#define SHAPE1 "{\"input\": {\"shape\": [1, 24, 24]}, \"preprocess\": {\"image\": "
    assert_msg_has(config_fails(SHAPE3 "{\"mode\": \"RGB\", \"sizes\": 3}}}", &err), "sizes",
                   "mode", "resize", "center_crop", NULL);
    assert_msg_has(config_fails(SHAPE1 "{\"mode\": \"RGB\"}}}", &err), "mode", "RGB", NULL);
    assert_msg_has(config_fails(SHAPE3 "{\"mode\": \"L\"}}}", &err), "mode", NULL);
    assert_msg_has(config_fails(SHAPE3 "{\"mode\": \"CMYK\"}}}", &err), "mode", "RGB", NULL);
    assert_msg_has(config_fails(SHAPE3 "{\"mode\": 3}}}", &err), "mode", NULL);
    assert_msg_has(config_fails(SHAPE3 "{\"resize\": 0, \"center_crop\": 24}}}", &err), "resize",
                   NULL);
    assert_msg_has(config_fails(SHAPE3 "{\"resize\": -5, \"center_crop\": 24}}}", &err),
                   "resize", NULL);
    assert_msg_has(config_fails(SHAPE3 "{\"resize\": [24, 0]}}}", &err), "resize", NULL);
    assert_msg_has(config_fails(SHAPE3 "{\"resize\": [24, 24, 3]}}}", &err), "resize", NULL);
    assert_msg_has(config_fails(SHAPE3 "{\"resize\": \"24\"}}}", &err), "resize", NULL);
    assert_msg_has(config_fails(SHAPE3 "{\"resize\": 24.5}}}", &err), "resize", NULL);
    assert_msg_has(config_fails(SHAPE3 "{\"resize\": 4000000000, \"center_crop\": 24}}}", &err),
                   "resize", NULL);
    assert_msg_has(config_fails(SHAPE3 "{\"center_crop\": 0}}}", &err), "center_crop", NULL);
    assert_msg_has(config_fails(SHAPE3 "{\"center_crop\": [24, 24, 1]}}}", &err), "center_crop",
                   NULL);
    /* the last step must end at the input's 24x24 */
    assert_msg_has(config_fails(SHAPE3 "{\"center_crop\": 20}}}", &err), "center_crop", "20x20",
                   "24x24", NULL);
    assert_msg_has(config_fails(SHAPE3 "{\"resize\": 32, \"center_crop\": [24, 20]}}}", &err),
                   "center_crop", NULL);
    assert_msg_has(config_fails(SHAPE3 "{\"resize\": [24, 30]}}}", &err), "resize", "24x24",
                   NULL);
    assert_msg_has(config_fails(SHAPE3 "{\"resize\": 32}}}", &err), "resize", "center_crop",
                   NULL);
    /* the shape an image can fill */
    assert_msg_has(config_fails("{\"input\": {\"shape\": [2, 24, 24]}, "
                                "\"preprocess\": {\"image\": {}}}",
                                &err),
                   "input.shape", NULL);
    assert_msg_has(config_fails("{\"input\": {\"shape\": [784]}, "
                                "\"preprocess\": {\"image\": {}}}",
                                &err),
                   "input.shape", NULL);
    assert_msg_has(config_fails("{\"preprocess\": {\"image\": {}}}", &err), "input.shape", NULL);
    assert_msg_has(config_fails("{\"input\": {\"shape\": [1, 0, 24]}, "
                                "\"preprocess\": {\"image\": {}}}",
                                &err),
                   "input.shape", NULL);
    assert_msg_has(config_fails("{\"input\": {\"shape\": [1, 24, 24]}, "
                                "\"preprocess\": {\"image\": \"RGB\"}}",
                                &err),
                   "preprocess.image", NULL);
#undef SHAPE1
#undef SHAPE3
}

/* ---- progressive JPEG scans ---- */

/* progressive_64x48.jpg (10 scans) with its last scan repeated `extra` times
 * before EOI: libjpeg only warns about the repeats and decodes each one,
 * a pass over the whole image per scan, which is what a scan bomb does. */
static unsigned char *with_repeated_last_scan(size_t extra, size_t *len_out)
{
    size_t len;
    unsigned char *d = slurp("cases/progressive_64x48.jpg", &len);
    size_t i = 2, last_sos = 0, eoi = 0;
    while (i + 1 < len) {
        assert_int_equal(d[i], 0xFF);
        unsigned char m = d[i + 1];
        if (m == 0xD9) {
            eoi = i;
            break;
        }
        assert_true(i + 3 < len);
        size_t seg = 2 + ((size_t)d[i + 2] << 8 | d[i + 3]);
        if (m != 0xDA) {
            i += seg;
            continue;
        }
        last_sos = i;
        i += seg; /* then the entropy-coded data, up to the next marker */
        while (i + 1 < len && !(d[i] == 0xFF && d[i + 1] != 0 && (d[i + 1] < 0xD0 || d[i + 1] > 0xD7)))
            i++;
    }
    assert_true(last_sos > 0 && eoi > last_sos);
    size_t scan = eoi - last_sos, n = len + extra * scan;
    unsigned char *out = malloc(n);
    assert_non_null(out);
    memcpy(out, d, eoi);
    for (size_t k = 0; k < extra; k++)
        memcpy(out + eoi + k * scan, d + last_sos, scan);
    memcpy(out + eoi + extra * scan, d + eoi, len - eoi);
    free(d);
    *len_out = n;
    return out;
}

static void test_jpeg_scan_limit(void **state)
{
    (void)state;
    md_image_opts o = opts_from("{\"input\": {\"shape\": [1, 20, 20]}, "
                                "\"preprocess\": {\"image\": {\"center_crop\": 20}}}",
                                0);
    assert_int_equal(o.max_scans, MD_IMAGE_MAX_JPEG_SCANS_DEFAULT);
    float out[400];
    md_err err;
    size_t len;
    /* the file itself: 10 scans, read under a limit of 10, refused under 9 */
    unsigned char *d = with_repeated_last_scan(0, &len);
    o.max_scans = 10;
    md_err_clear(&err);
    assert_int_equal(md_image_to_tensor(d, len, &o, "p.jpg", out, &err), MD_OK);
    o.max_scans = 9;
    md_err_clear(&err);
    assert_int_equal(md_image_to_tensor(d, len, &o, "p.jpg", out, &err), MD_EUNPROC);
    assert_string_equal(md_err_code(&err), "invalid_image");
    assert_msg_has(err.msg, "p.jpg", "more than 9 scans", "max_jpeg_scans", NULL);
    free(d);
    /* 10 + 600 scans: refused under the default limit of 500, and read when
     * the limit allows them (so the limit is what refuses it, not the bytes) */
    d = with_repeated_last_scan(600, &len);
    o.max_scans = 0; /* the default */
    md_err_clear(&err);
    assert_int_equal(md_image_to_tensor(d, len, &o, "bomb.jpg", out, &err), MD_EUNPROC);
    assert_string_equal(md_err_code(&err), "invalid_image");
    assert_msg_has(err.msg, "bomb.jpg", "more than 500 scans", NULL);
    o.max_scans = 1000;
    md_err_clear(&err);
    assert_int_equal(md_image_to_tensor(d, len, &o, "bomb.jpg", out, &err), MD_OK);
    free(d);
}

/* ---- the large-decode gate ---- */

/* A w x h 8-bit grayscale PNG of one gray value, in memory (a few KB). */
static unsigned char *gray_png(uint32_t w, uint32_t h, size_t *len)
{
    char *buf = NULL;
    FILE *f = open_memstream(&buf, len);
    assert_non_null(f);
    fwrite("\x89PNG\r\n\x1a\n", 1, 8, f);
    unsigned char ihdr[13] = {w >> 24, w >> 16, w >> 8, w, h >> 24, h >> 16, h >> 8, h, 8, 0, 0, 0, 0};
    png_chunk(f, "IHDR", ihdr, 13);
    size_t rawlen = (size_t)(w + 1) * h;
    unsigned char *raw = malloc(rawlen);
    assert_non_null(raw);
    memset(raw, 77, rawlen);
    for (uint32_t y = 0; y < h; y++)
        raw[(size_t)y * (w + 1)] = 0; /* filter none */
    uLongf zlen = compressBound((uLong)rawlen);
    unsigned char *z = malloc(zlen);
    assert_non_null(z);
    assert_int_equal(compress(z, &zlen, raw, (uLong)rawlen), Z_OK);
    png_chunk(f, "IDAT", z, (uint32_t)zlen);
    png_chunk(f, "IEND", (const unsigned char *)"", 0);
    fclose(f);
    free(raw);
    free(z);
    return (unsigned char *)buf;
}

static const unsigned char *g_big;
static size_t g_big_len;
static md_image_opts g_big_opts;
static int g_gate_fail;

/* Inside a slot: stay a while, so a gate letting two in would show them
 * both in (the peak); with one slot the others can only wait, whatever the
 * machine's speed. */
static void hold_slot(void)
{
    struct timespec ts = {0, 5 * 1000 * 1000};
    nanosleep(&ts, NULL);
}

static void *decode_big(void *arg)
{
    (void)arg;
    float out[16];
    for (int k = 0; k < 4; k++) {
        md_err err;
        md_err_clear(&err);
        if (md_image_to_tensor(g_big, g_big_len, &g_big_opts, "big.png", out, &err) != MD_OK ||
            out[0] != 77.0f / 255.0f)
            __atomic_add_fetch(&g_gate_fail, 1, __ATOMIC_SEQ_CST);
    }
    return NULL;
}

static void test_large_decode_gate(void **state)
{
    (void)state;
    size_t len;
    unsigned char *big = gray_png(1100, 1000, &len); /* 1.1 Mpx: past the gate */
    g_big = big;
    g_big_len = len;
    g_big_opts = opts_from("{\"input\": {\"shape\": [1, 4, 4]}, "
                           "\"preprocess\": {\"image\": {\"center_crop\": 4}}}",
                           0);
    md_image_set_gate_hook(hold_slot);
    for (int slots = 1; slots <= 2; slots++) {
        md_image_set_large_decodes(slots);
        g_gate_fail = 0;
        pthread_t t[4];
        for (int i = 0; i < 4; i++)
            assert_int_equal(pthread_create(&t[i], NULL, decode_big, NULL), 0);
        for (int i = 0; i < 4; i++)
            pthread_join(t[i], NULL);
        int busy, peak;
        md_image_large_decodes(&busy, &peak);
        printf("max_large_decodes %d: peak %d, now %d\n", slots, peak, busy);
        assert_int_equal(g_gate_fail, 0);
        assert_int_equal(busy, 0); /* every slot given back */
        assert_true(peak >= 1 && peak <= slots);
    }
    /* failures give their slot back too: a truncated big image, refused */
    md_image_set_large_decodes(1);
    float out[16];
    md_err err;
    for (int k = 0; k < 3; k++) {
        md_err_clear(&err);
        assert_int_equal(md_image_to_tensor(big, len - 20, &g_big_opts, "cut.png", out, &err),
                         MD_EUNPROC);
    }
    int busy, peak;
    md_image_large_decodes(&busy, &peak);
    assert_int_equal(busy, 0);
    /* a resize replaces the decoded pixels: the slot is still given back
     * (review: it was lost, and the next large decode waited for ever) */
    md_image_opts rs = opts_from("{\"input\": {\"shape\": [1, 4, 4]}, "
                                 "\"preprocess\": {\"image\": {\"resize\": 4}}}",
                                 0);
    for (int k = 0; k < 3; k++) {
        md_err_clear(&err);
        assert_int_equal(md_image_to_tensor(big, len, &rs, "big.png", out, &err), MD_OK);
        md_image_large_decodes(&busy, &peak);
        assert_int_equal(busy, 0);
    }
    /* inline_max: refused from the header, before a slot or a pixel */
    md_image_set_large_decodes(1);
    md_image_opts inl = g_big_opts;
    inl.inline_max = 1 << 16;
    md_err_clear(&err);
    assert_int_equal(md_image_to_tensor(big, len, &inl, "big.png", out, &err), MD_EBUSY);
    assert_string_equal(md_err_code(&err), "image_not_inline");
    md_image_large_decodes(&busy, &peak);
    assert_int_equal(busy, 0);
    assert_int_equal(peak, 0);
    /* small images never take a slot */
    md_image_set_large_decodes(1);
    size_t slen;
    unsigned char *small = gray_png(8, 8, &slen);
    md_err_clear(&err);
    assert_int_equal(md_image_to_tensor(small, slen, &g_big_opts, "small.png", out, &err), MD_OK);
    md_image_large_decodes(&busy, &peak);
    assert_int_equal(peak, 0);
    md_image_set_gate_hook(NULL);
    md_image_set_large_decodes(2);
    free(small);
    free(big);
}

int main(void)
{
    /* the per-case lines interleave with cmocka's own (stderr) in order */
    setvbuf(stdout, NULL, _IOLBF, 0);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cases_match_torchvision),
        cmocka_unit_test(test_fashion_png),
        cmocka_unit_test(test_fashion_jpeg),
        cmocka_unit_test(test_bad_files),
        cmocka_unit_test(test_max_pixels),
        cmocka_unit_test(test_size_mismatch),
        cmocka_unit_test(test_l_to_rgb_replicates),
        cmocka_unit_test(test_every_truncation),
        cmocka_unit_test(test_sniff),
        cmocka_unit_test(test_values),
        cmocka_unit_test(test_config_not_declared),
        cmocka_unit_test(test_config_errors),
        cmocka_unit_test(test_jpeg_scan_limit),
        cmocka_unit_test(test_large_decode_gate),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
