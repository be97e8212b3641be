/*
 * image.c - PNG and JPEG input, preprocessed as torchvision 0.14 does for PIL
 * images (image.h).
 *
 * libpng and libjpeg-turbo decode (PIL 9.4 uses the same libraries with the
 * same settings: no gamma, islow DCT, fancy upsampling). What is written
 * here follows PIL and torchvision step by step:
 *   - Image.convert("L") of RGB(A): L = (R*19595 + G*38470 + B*7471 + 0x8000)
 *     >> 16; convert("RGB") of L replicates it; alpha is dropped, palettes
 *     and 1/2/4-bit gray are expanded (as libpng does);
 *   - Resize: PIL's Image.resize(BILINEAR), a separable convolution with the
 *     filter's support widened by the downscale factor (antialiasing), its
 *     coefficients in 22-bit fixed point, the horizontal pass first, each
 *     pass rounded and clipped to 8 bits; an int size is the smaller edge,
 *     the other int(size * long / short), and an image already that size is
 *     not resampled;
 *   - CenterCrop: zero padding when the crop is larger, the offset rounded
 *     half to even (Python's round);
 *   - ToTensor: v / 255 as float32, channels first.
 * So the tensors are bit for bit torchvision's (tests/test_image.c checks it
 * on the fixtures of tests/fixtures/make_images.py).
 */
#include "image.h"

#include <jpeglib.h>
#include <jerror.h>
#include <math.h>
#include <png.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The largest edge any step may make (PIL's own limit is int32). */
#define MAX_EDGE (1 << 20)

/* libpng's chunk limits (decode_png): ancillary chunks kept at most, and the
 * least bound on one chunk's bytes (the file's own size above it). */
#define PNG_KEPT_CHUNKS 16
#define PNG_CHUNK_MIN_LIMIT ((size_t)64 * 1024)

md_image_kind md_image_sniff(const void *data, size_t len)
{
    const unsigned char *p = data;
    if (len >= 8 && memcmp(p, "\x89PNG\r\n\x1a\n", 8) == 0)
        return MD_IMAGE_PNG;
    if (len >= 3 && p[0] == 0xFF && p[1] == 0xD8 && p[2] == 0xFF)
        return MD_IMAGE_JPEG;
    return MD_IMAGE_NONE;
}

size_t md_image_values(const md_image_opts *o)
{
    return (size_t)o->channels * (size_t)o->height * (size_t)o->width;
}

/* ---- the config ---- */

static md_status cfg_bad(md_err *err, const char *key, const char *what)
{
    return md_err_setc(err, MD_EUNPROC, "invalid_config", "config.preprocess.image.%s: %s", key,
                       what);
}

/* An int > 0 or [h, w] of ints > 0 into h, w (int: h = w = n, *is_int = 1). */
static int size_pair(json_t *v, int64_t *h, int64_t *w, int *is_int)
{
    *is_int = 0;
    if (json_is_integer(v)) {
        *h = *w = json_integer_value(v);
        *is_int = 1;
    } else if (json_is_array(v) && json_array_size(v) == 2 &&
               json_is_integer(json_array_get(v, 0)) && json_is_integer(json_array_get(v, 1))) {
        *h = json_integer_value(json_array_get(v, 0));
        *w = json_integer_value(json_array_get(v, 1));
    } else if (json_is_array(v) && json_array_size(v) == 1 &&
               json_is_integer(json_array_get(v, 0))) {
        *h = *w = json_integer_value(json_array_get(v, 0)); /* torchvision takes [n] as n */
        *is_int = 1;
    } else {
        return -1;
    }
    return *h >= 1 && *w >= 1 && *h <= MAX_EDGE && *w <= MAX_EDGE ? 0 : -1;
}

md_status md_image_opts_from_config(json_t *config, int64_t max_pixels, md_image_opts *out,
                                    int *declared, md_err *err)
{
    memset(out, 0, sizeof *out);
    *declared = 0;
    json_t *img = json_object_get(json_object_get(config, "preprocess"), "image");
    if (!img)
        return MD_OK;
    if (!json_is_object(img))
        return md_err_setc(err, MD_EUNPROC, "invalid_config",
                           "config.preprocess.image: give an object such as {\"mode\": \"RGB\", "
                           "\"resize\": 256, \"center_crop\": 224}");
    json_t *shape = json_object_get(json_object_get(config, "input"), "shape");
    size_t nd = json_array_size(shape);
    int64_t dims[3] = {0, 0, 0};
    for (size_t i = 0; i < nd && i < 3; i++)
        dims[i] = json_integer_value(json_array_get(shape, i));
    if (nd == 2) {
        out->channels = 1;
        out->height = dims[0];
        out->width = dims[1];
    } else if (nd == 3 && (dims[0] == 1 || dims[0] == 3)) {
        out->channels = (int)dims[0];
        out->height = dims[1];
        out->width = dims[2];
    } else {
        return md_err_setc(err, MD_EUNPROC, "invalid_config",
                           "config.preprocess.image needs input.shape [C, H, W] with C 1 or 3 "
                           "(or [H, W] for one channel), e.g. [3, 224, 224]");
    }
    if (out->height < 1 || out->width < 1 || out->height > MAX_EDGE || out->width > MAX_EDGE)
        return md_err_setc(err, MD_EUNPROC, "invalid_config",
                           "config.input.shape: H and W must be 1..%d for images", MAX_EDGE);
    const char *key;
    json_t *v;
    json_object_foreach(img, key, v)
    {
        if (strcmp(key, "mode") == 0) {
            const char *m = json_string_value(v);
            int c = m && strcmp(m, "L") == 0 ? 1 : m && strcmp(m, "RGB") == 0 ? 3 : 0;
            if (!c)
                return cfg_bad(err, "mode", "allowed: \"L\" (one channel) or \"RGB\"");
            if (c != out->channels)
                return md_err_setc(err, MD_EUNPROC, "invalid_config",
                                   "config.preprocess.image.mode \"%s\" makes %d channel%s but "
                                   "input.shape has %d; make them agree",
                                   m, c, c == 1 ? "" : "s", out->channels);
        } else if (strcmp(key, "resize") == 0) {
            int is_int;
            if (size_pair(v, &out->resize_h, &out->resize_w, &is_int) != 0)
                return cfg_bad(err, "resize",
                               "give N (the smaller edge becomes N, as torchvision's Resize(N)) "
                               "or [H, W], each 1..1048576");
            out->resize = is_int ? 1 : 2;
        } else if (strcmp(key, "center_crop") == 0) {
            int is_int;
            if (size_pair(v, &out->crop_h, &out->crop_w, &is_int) != 0)
                return cfg_bad(err, "center_crop", "give N or [H, W], each 1..1048576");
            out->crop = 1;
        } else {
            return md_err_setc(err, MD_EUNPROC, "invalid_config",
                               "config has an unknown key \"preprocess.image.%s\"; allowed: mode, "
                               "resize, center_crop",
                               key);
        }
    }
    /* the last step must end at input.shape's H x W */
    if (out->crop) {
        if (out->crop_h != out->height || out->crop_w != out->width)
            return md_err_setc(err, MD_EUNPROC, "invalid_config",
                               "config.preprocess.image.center_crop is %lldx%lld but input.shape "
                               "takes %lldx%lld images; make them equal",
                               (long long)out->crop_h, (long long)out->crop_w,
                               (long long)out->height, (long long)out->width);
    } else if (out->resize == 2) {
        if (out->resize_h != out->height || out->resize_w != out->width)
            return md_err_setc(err, MD_EUNPROC, "invalid_config",
                               "config.preprocess.image.resize is [%lld, %lld] but input.shape "
                               "takes %lldx%lld images; make them equal or add center_crop",
                               (long long)out->resize_h, (long long)out->resize_w,
                               (long long)out->height, (long long)out->width);
    } else if (out->resize == 1) {
        if (out->resize_h != (out->height < out->width ? out->height : out->width))
            return md_err_setc(err, MD_EUNPROC, "invalid_config",
                               "config.preprocess.image.resize %lld sets the smaller edge, which "
                               "cannot end at input.shape's %lldx%lld; add center_crop [%lld, "
                               "%lld] (as torchvision's Resize + CenterCrop)",
                               (long long)out->resize_h, (long long)out->height,
                               (long long)out->width, (long long)out->height,
                               (long long)out->width);
    }
    out->max_pixels = max_pixels > 0 ? max_pixels : MD_IMAGE_MAX_PIXELS_DEFAULT;
    out->max_scans = MD_IMAGE_MAX_JPEG_SCANS_DEFAULT;
    *declared = 1;
    return MD_OK;
}

/* ---- decoding ---- */

/* A decoded image: 8-bit pixels, `ch` (1 or 3) interleaved, rows of w*ch. */
typedef struct pix {
    unsigned char *p;
    int64_t w, h;
    int ch;
    int gated;          /* took a large-decode slot (gate_enter); md_image_to_tensor
                         * moves it to a local before a resize replaces the pix */
    int64_t inline_max; /* md_image_opts.inline_max, for pix_alloc */
} pix;

/* ---- the large-decode gate ----
 * A decoded image holds up to ~12 bytes a pixel on its way (decoded,
 * converted, two resize passes), 40 Mpx at most: ~0.5 GB. Requests decode on
 * deferred threads (64) and job runners, so without a bound a burst of large
 * images could hold tens of GB at once. Images past MD_IMAGE_GATE_PIXELS decode at
 * most g_slots at a time (setting max_large_decodes); the others wait for a
 * slot, holding only their compressed bytes. Small images never wait, so the
 * HTTP threads (which decode only small ones) never block here. */
static pthread_mutex_t g_gate_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_gate_cv = PTHREAD_COND_INITIALIZER;
static int g_slots = 2, g_busy, g_peak;
static void (*g_gate_hook)(void);

void md_image_set_large_decodes(int slots)
{
    pthread_mutex_lock(&g_gate_mu);
    g_slots = slots > 0 ? slots : 1;
    g_peak = g_busy;
    pthread_cond_broadcast(&g_gate_cv);
    pthread_mutex_unlock(&g_gate_mu);
}

void md_image_large_decodes(int *busy, int *peak)
{
    pthread_mutex_lock(&g_gate_mu);
    *busy = g_busy;
    *peak = g_peak;
    pthread_mutex_unlock(&g_gate_mu);
}

void md_image_set_gate_hook(void (*hook)(void)) { g_gate_hook = hook; }

static void gate_enter(pix *px, int64_t pixels)
{
    if (pixels <= MD_IMAGE_GATE_PIXELS)
        return;
    pthread_mutex_lock(&g_gate_mu);
    while (g_busy >= g_slots)
        pthread_cond_wait(&g_gate_cv, &g_gate_mu);
    g_busy++;
    if (g_busy > g_peak)
        g_peak = g_busy;
    pthread_mutex_unlock(&g_gate_mu);
    px->gated = 1;
    if (g_gate_hook)
        g_gate_hook();
}

static void gate_leave(int held)
{
    if (!held)
        return;
    pthread_mutex_lock(&g_gate_mu);
    g_busy--;
    pthread_cond_signal(&g_gate_cv);
    pthread_mutex_unlock(&g_gate_mu);
}

static md_status too_large(md_err *err, const char *name, int64_t w, int64_t h, int64_t max,
                           const char *what)
{
    if (w > MAX_EDGE || h > MAX_EDGE)
        return md_err_setc(err, MD_ETOOBIG, "image_too_large",
                           "%s is %lldx%lld pixels%s, an edge longer than the %d pixels modeld "
                           "takes; send a smaller image",
                           name, (long long)w, (long long)h, what, MAX_EDGE);
    return md_err_setc(err, MD_ETOOBIG, "image_too_large",
                       "%s is %lldx%lld pixels%s, more than max_image_pixels (%lld); send a "
                       "smaller image or raise the setting",
                       name, (long long)w, (long long)h, what, (long long)max);
}

static md_status invalid(md_err *err, const char *name, const char *fmt, const char *detail)
{
    char what[300];
    snprintf(what, sizeof what, fmt, detail ? detail : "");
    return md_err_setc(err, MD_EUNPROC, "invalid_image", "%s: %s", name, what);
}

/* w x h x ch bytes, checked against max_pixels and for overflow first. */
static md_status pix_alloc(pix *px, int64_t w, int64_t h, int ch, int64_t max_pixels,
                           const char *name, const char *what, md_err *err)
{
    px->p = NULL;
    if (w < 1 || h < 1)
        return invalid(err, name, "the image has no pixels (width or height 0)%s", NULL);
    if (w > MAX_EDGE || h > MAX_EDGE || w * h > max_pixels)
        return too_large(err, name, w, h, max_pixels, what);
    if (px->inline_max > 0 && w * h > px->inline_max)
        return md_err_setc(err, MD_EBUSY, "image_not_inline",
                           "%s is %lldx%lld pixels, more than is decoded inline", name,
                           (long long)w, (long long)h);
    px->w = w;
    px->h = h;
    px->ch = ch;
    gate_enter(px, w * h); /* left by md_image_to_tensor, whatever happens next */
    px->p = md_mallocarray_checked((size_t)(w * h), (size_t)ch, "the image's pixels", err);
    return px->p ? MD_OK : MD_ENOMEM;
}

/* -- PNG -- */

typedef struct png_src {
    const unsigned char *data;
    size_t len, off;
    char msg[200];
} png_src;

static void png_read_mem(png_structp png, png_bytep out, size_t n)
{
    png_src *s = png_get_io_ptr(png);
    if (n > s->len - s->off)
        png_error(png, "the file ends early (truncated)");
    memcpy(out, s->data + s->off, n);
    s->off += n;
}

static void png_on_error(png_structp png, png_const_charp msg)
{
    png_src *s = png_get_error_ptr(png);
    snprintf(s->msg, sizeof s->msg, "%s", msg);
    png_longjmp(png, 1);
}

static void png_on_warning(png_structp png, png_const_charp msg)
{
    (void)png;
    (void)msg; /* PIL does not stop on libpng's warnings either */
}

static md_status decode_png(const unsigned char *data, size_t len, int64_t max_pixels,
                            const char *name, pix *out, md_err *err)
{
    png_src src = {.data = data, .len = len};
    png_structp png =
        png_create_read_struct(PNG_LIBPNG_VER_STRING, &src, png_on_error, png_on_warning);
    if (!png)
        return md_err_set(err, MD_ENOMEM, "out of memory for a PNG decoder");
    png_infop info = png_create_info_struct(png);
    if (!info) {
        png_destroy_read_struct(&png, NULL, NULL);
        return md_err_set(err, MD_ENOMEM, "out of memory for a PNG decoder");
    }
    /* everything setjmp may come back to lives in these volatile slots */
    pix *volatile px = out;
    png_bytep *volatile rows = NULL;
    md_status st = MD_OK;
    px->p = NULL;
    if (setjmp(png_jmpbuf(png))) {
        free(rows);
        free(px->p);
        px->p = NULL;
        png_destroy_read_struct(&png, &info, NULL);
        return invalid(err, name, "not a readable PNG (corrupt or truncated): %s; send the whole, unmodified file", src.msg[0] ? src.msg : "corrupt");
    }
    png_set_read_fn(png, &src, png_read_mem);
    /* the header's size is checked below, before any row is allocated */
    png_set_user_limits(png, 0x7fffffff, 0x7fffffff);
    /* Only IHDR, PLTE, tRNS (there is alpha to drop), IDAT and IEND make the
     * pixels PIL answers (convert ignores gAMA, iCCP, sBIT...). libpng would
     * otherwise inflate every zTXt/iTXt (8 MB each) and iCCP, and keep up to
     * 1000 text chunks: a 4 MB file of zTXt chunks held 4.4 GB (issue 24).
     * Every other chunk, known or not, is read past (CRC checked), never
     * inflated or kept; the limits below stand should one slip through: no
     * chunk may hold or inflate to more than the file itself (at least
     * 64 KiB), and at most PNG_KEPT_CHUNKS are kept. */
    png_set_keep_unknown_chunks(png, PNG_HANDLE_CHUNK_NEVER, NULL, -1);
    png_set_chunk_cache_max(png, PNG_KEPT_CHUNKS);
    png_set_chunk_malloc_max(png, len > PNG_CHUNK_MIN_LIMIT ? len : PNG_CHUNK_MIN_LIMIT);
    png_read_info(png, info);
    png_uint_32 w = png_get_image_width(png, info), h = png_get_image_height(png, info);
    int depth = png_get_bit_depth(png, info), ctype = png_get_color_type(png, info);
    if (w < 1 || h < 1 || (int64_t)w > MAX_EDGE || (int64_t)h > MAX_EDGE ||
        (int64_t)w * (int64_t)h > max_pixels) {
        png_destroy_read_struct(&png, &info, NULL);
        if (w < 1 || h < 1)
            return invalid(err, name, "the image has no pixels (width or height 0)%s", NULL);
        return too_large(err, name, w, h, max_pixels, "");
    }
    /* 16-bit gray+alpha PIL reads as RGBA of the high bytes, as the strip
     * below does; 16-bit gray alone it reads as 32-bit integers */
    if (depth == 16 && ctype == PNG_COLOR_TYPE_GRAY) {
        png_destroy_read_struct(&png, &info, NULL);
        return invalid(err, name,
                       "16-bit grayscale PNGs are not supported (PIL reads them as 32-bit "
                       "integers, not 8-bit pixels); save it as 8-bit%s",
                       NULL);
    }
    int color = ctype & PNG_COLOR_MASK_COLOR || ctype == PNG_COLOR_TYPE_PALETTE;
    if (ctype == PNG_COLOR_TYPE_PALETTE)
        png_set_palette_to_rgb(png);
    if (!(ctype & PNG_COLOR_MASK_COLOR) && depth < 8)
        png_set_expand_gray_1_2_4_to_8(png);
    if (depth == 16)
        png_set_strip_16(png); /* PIL keeps the high byte of 16-bit RGB(A) */
    /* PIL's convert("RGB"/"L") drops alpha, and a palette's tRNS too (which
     * png_set_palette_to_rgb would otherwise expand into an alpha channel) */
    if ((ctype & PNG_COLOR_MASK_ALPHA) || png_get_valid(png, info, PNG_INFO_tRNS))
        png_set_strip_alpha(png);
    png_set_interlace_handling(png);
    png_read_update_info(png, info);
    size_t rowbytes = png_get_rowbytes(png, info);
    int ch = color ? 3 : 1;
    if (rowbytes != (size_t)w * (size_t)ch) {
        png_destroy_read_struct(&png, &info, NULL);
        return invalid(err, name, "unsupported PNG layout%s", NULL);
    }
    if ((st = pix_alloc(px, w, h, ch, max_pixels, name, "", err)) != MD_OK) {
        png_destroy_read_struct(&png, &info, NULL);
        return st;
    }
    rows = md_mallocarray_checked(h, sizeof(png_bytep), "the image's rows", err);
    if (!rows) {
        free(px->p);
        px->p = NULL;
        png_destroy_read_struct(&png, &info, NULL);
        return MD_ENOMEM;
    }
    for (png_uint_32 y = 0; y < h; y++)
        rows[y] = px->p + (size_t)y * rowbytes;
    png_read_image(png, rows);
    png_read_end(png, NULL);
    free(rows);
    png_destroy_read_struct(&png, &info, NULL);
    return MD_OK;
}

/* -- JPEG -- */

typedef struct jpeg_err {
    struct jpeg_error_mgr mgr;
    jmp_buf jmp;
    char msg[JMSG_LENGTH_MAX];
    int truncated;
    int max_scans, too_many_scans;
    struct jpeg_progress_mgr progress;
} jpeg_err;

/* Each scan of a progressive JPEG costs a pass over the whole image's
 * coefficients, and libjpeg takes any number of them (redundant ones only
 * warn), so a few kilobytes of scans can keep a decoder busy for minutes.
 * libjpeg-turbo's own advice (djpeg -maxscans, TurboJPEG's scan limit) is a
 * bound; encoders write about 10 (PIL and libjpeg's default script). */
static void jpeg_on_progress(j_common_ptr c)
{
    j_decompress_ptr d = (j_decompress_ptr)(void *)c;
    jpeg_err *e = (jpeg_err *)c->err;
    if (c->is_decompressor && d->input_scan_number > e->max_scans) {
        snprintf(e->msg, sizeof e->msg,
                 "a progressive JPEG of more than %d scans (max_jpeg_scans), which no "
                 "encoder writes (about 10); re-encode it",
                 e->max_scans);
        e->too_many_scans = 1;
        longjmp(e->jmp, 1);
    }
}

static void jpeg_on_error(j_common_ptr c)
{
    jpeg_err *e = (jpeg_err *)c->err;
    (*c->err->format_message)(c, e->msg);
    longjmp(e->jmp, 1);
}

static void jpeg_on_message(j_common_ptr c, int level)
{
    jpeg_err *e = (jpeg_err *)c->err;
    /* a file that ends early is padded by libjpeg with a warning; PIL
     * refuses it ("image file is truncated"), and so do we. Other warnings
     * (extraneous bytes) PIL ignores. */
    if (level < 0 && c->err->msg_code == JWRN_JPEG_EOF)
        e->truncated = 1;
}

static void jpeg_no_output(j_common_ptr c) { (void)c; }

static md_status decode_jpeg(const unsigned char *data, size_t len, int64_t max_pixels,
                             int max_scans, const char *name, pix *out, md_err *err)
{
    struct jpeg_decompress_struct cinfo;
    jpeg_err je;
    memset(&je, 0, sizeof je);
    je.max_scans = max_scans > 0 ? max_scans : MD_IMAGE_MAX_JPEG_SCANS_DEFAULT;
    cinfo.err = jpeg_std_error(&je.mgr);
    je.mgr.error_exit = jpeg_on_error;
    je.mgr.emit_message = jpeg_on_message;
    je.mgr.output_message = jpeg_no_output;
    pix *volatile px = out;
    px->p = NULL;
    if (setjmp(je.jmp)) {
        jpeg_destroy_decompress(&cinfo);
        free(px->p);
        px->p = NULL;
        if (je.too_many_scans)
            return invalid(err, name, "%s", je.msg);
        return invalid(err, name, "not a readable JPEG (corrupt or truncated): %s; send the whole, unmodified file", je.msg);
    }
    jpeg_create_decompress(&cinfo);
    je.progress.progress_monitor = jpeg_on_progress;
    cinfo.progress = &je.progress;
    jpeg_mem_src(&cinfo, data, (unsigned long)len);
    /* No jpeg_save_markers: COM and APPn segments (EXIF, ICC, XMP) are
     * skipped as they are read, never kept, however many a file holds (the
     * PNG text-chunk amplification of issue 24 has no JPEG twin); what a
     * JPEG may cost is its pixels (max_image_pixels) times its scans
     * (max_jpeg_scans). */
    jpeg_read_header(&cinfo, TRUE);
    int64_t w = cinfo.image_width, h = cinfo.image_height;
    if (w < 1 || h < 1 || w > MAX_EDGE || h > MAX_EDGE || w * h > max_pixels) {
        jpeg_destroy_decompress(&cinfo);
        if (w < 1 || h < 1)
            return invalid(err, name, "the image has no pixels (width or height 0)%s", NULL);
        return too_large(err, name, w, h, max_pixels, "");
    }
    int ch;
    if (cinfo.jpeg_color_space == JCS_GRAYSCALE) {
        cinfo.out_color_space = JCS_GRAYSCALE;
        ch = 1;
    } else if (cinfo.jpeg_color_space == JCS_YCbCr || cinfo.jpeg_color_space == JCS_RGB) {
        cinfo.out_color_space = JCS_RGB;
        ch = 3;
    } else {
        jpeg_destroy_decompress(&cinfo);
        return invalid(err, name,
                       "CMYK and YCCK JPEGs are not supported; convert it to RGB (e.g. "
                       "Image.open(f).convert(\"RGB\").save(...))%s",
                       NULL);
    }
    md_status st = pix_alloc(px, w, h, ch, max_pixels, name, "", err);
    if (st != MD_OK) {
        jpeg_destroy_decompress(&cinfo);
        return st;
    }
    jpeg_start_decompress(&cinfo);
    if (cinfo.output_components != ch || (int64_t)cinfo.output_width != w ||
        (int64_t)cinfo.output_height != h) {
        jpeg_destroy_decompress(&cinfo);
        free(px->p);
        px->p = NULL;
        return invalid(err, name, "unsupported JPEG layout%s", NULL);
    }
    while (cinfo.output_scanline < cinfo.output_height) {
        JSAMPROW row = px->p + (size_t)cinfo.output_scanline * (size_t)w * (size_t)ch;
        jpeg_read_scanlines(&cinfo, &row, 1);
    }
    jpeg_finish_decompress(&cinfo);
    jpeg_destroy_decompress(&cinfo);
    if (je.truncated) {
        free(px->p);
        px->p = NULL;
        return invalid(err, name, "the JPEG file ends early (truncated)%s", NULL);
    }
    return MD_OK;
}

/* ---- mode conversion ---- */

/* To `ch` channels, as PIL's convert("L") / convert("RGB"). */
static md_status convert(pix *px, int ch, md_err *err)
{
    if (px->ch == ch)
        return MD_OK;
    size_t n = (size_t)(px->w * px->h);
    unsigned char *q = md_mallocarray_checked(n, (size_t)ch, "the converted image", err);
    if (!q)
        return MD_ENOMEM;
    const unsigned char *p = px->p;
    if (ch == 1) {
        for (size_t i = 0; i < n; i++, p += 3)
            q[i] = (unsigned char)((p[0] * 19595u + p[1] * 38470u + p[2] * 7471u + 0x8000u) >> 16);
    } else {
        for (size_t i = 0; i < n; i++)
            q[3 * i] = q[3 * i + 1] = q[3 * i + 2] = p[i];
    }
    free(px->p);
    px->p = q;
    px->ch = ch;
    return MD_OK;
}

/* ---- PIL's bilinear resample ---- */

#define PRECISION_BITS (32 - 8 - 2)

static double bilinear(double x)
{
    if (x < 0.0)
        x = -x;
    return x < 1.0 ? 1.0 - x : 0.0;
}

/* Coefficients of every output position: bounds[2*i] the first input,
 * bounds[2*i+1] how many; k[i*ksize ..] the fixed-point weights. Returns
 * ksize, or 0 when memory runs out. */
static int coeffs(int64_t in_size, int64_t out_size, int **bounds_out, int32_t **k_out,
                  md_err *err)
{
    double scale = (double)in_size / (double)out_size;
    double filterscale = scale < 1.0 ? 1.0 : scale;
    double support = 1.0 * filterscale; /* bilinear's support is 1 */
    int ksize = (int)ceil(support) * 2 + 1;
    double *kd = md_mallocarray_checked((size_t)out_size, (size_t)ksize * sizeof(double),
                                        "the resize coefficients", err);
    int *bounds = md_mallocarray_checked((size_t)out_size, 2 * sizeof(int),
                                         "the resize coefficients", err);
    int32_t *k = md_mallocarray_checked((size_t)out_size, (size_t)ksize * sizeof(int32_t),
                                        "the resize coefficients", err);
    if (!kd || !bounds || !k) {
        free(kd);
        free(bounds);
        free(k);
        return 0;
    }
    for (int64_t xx = 0; xx < out_size; xx++) {
        double center = ((double)xx + 0.5) * scale;
        double ww = 0.0, ss = 1.0 / filterscale;
        int xmin = (int)(center - support + 0.5);
        if (xmin < 0)
            xmin = 0;
        int xmax = (int)(center + support + 0.5);
        if (xmax > in_size)
            xmax = (int)in_size;
        xmax -= xmin;
        double *kk = kd + xx * ksize;
        int x;
        for (x = 0; x < xmax; x++) {
            double w = bilinear((x + xmin - center + 0.5) * ss);
            kk[x] = w;
            ww += w;
        }
        for (x = 0; x < xmax; x++)
            if (ww != 0.0)
                kk[x] /= ww;
        for (; x < ksize; x++)
            kk[x] = 0;
        bounds[xx * 2] = xmin;
        bounds[xx * 2 + 1] = xmax;
    }
    for (int64_t i = 0; i < out_size * ksize; i++)
        k[i] = kd[i] < 0 ? (int32_t)(-0.5 + kd[i] * (1 << PRECISION_BITS))
                         : (int32_t)(0.5 + kd[i] * (1 << PRECISION_BITS));
    free(kd);
    *bounds_out = bounds;
    *k_out = k;
    return ksize;
}

static unsigned char clip8(int64_t v)
{
    if (v >= ((int64_t)1 << PRECISION_BITS << 8))
        return 255;
    if (v <= 0)
        return 0;
    return (unsigned char)(v >> PRECISION_BITS);
}

/* Resize to w x h as PIL's Image.resize((w, h), BILINEAR): the horizontal
 * pass over the rows the vertical one reads, then the vertical pass; each
 * only when its edge changes. */
static md_status resample(pix *px, int64_t w, int64_t h, int64_t max_pixels, const char *name,
                          md_err *err)
{
    int need_h = w != px->w, need_v = h != px->h;
    if (!need_h && !need_v)
        return MD_OK; /* PIL returns a copy */
    if (w > MAX_EDGE || h > MAX_EDGE || w * h > max_pixels)
        return too_large(err, name, w, h, max_pixels, " after resize");
    size_t ch = (size_t)px->ch;
    int *bh = NULL, *bv = NULL;
    int32_t *kh = NULL, *kv = NULL;
    md_status st = MD_OK;
    pix tmp = {0}, res = {0};
    int ksh = coeffs(px->w, w, &bh, &kh, err);
    int ksv = ksh ? coeffs(px->h, h, &bv, &kv, err) : 0;
    if (!ksh || !ksv) {
        st = MD_ENOMEM;
        goto out;
    }
    const pix *src = px;
    if (need_h) {
        /* only the rows the vertical pass will read */
        int64_t first = bv[0], last = bv[(h - 1) * 2] + bv[(h - 1) * 2 + 1];
        for (int64_t i = 0; i < h; i++)
            bv[i * 2] -= (int)first;
        /* the horizontal pass's image is as large as w x (rows it keeps):
         * bounded like the result (a 1 x 40M image resized to 40 x 1 would
         * otherwise hold 40 x 40M pixels in between) */
        if (w * (last - first) > max_pixels) {
            st = too_large(err, name, w, last - first, max_pixels,
                           " in the resize's horizontal pass");
            goto out;
        }
        tmp = (pix){.w = w, .h = last - first, .ch = px->ch};
        tmp.p = md_mallocarray_checked((size_t)(tmp.w * tmp.h), ch, "the resized image", err);
        if (!tmp.p) {
            st = MD_ENOMEM;
            goto out;
        }
        for (int64_t y = 0; y < tmp.h; y++) {
            const unsigned char *in = px->p + (size_t)(y + first) * (size_t)px->w * ch;
            unsigned char *o = tmp.p + (size_t)y * (size_t)w * ch;
            for (int64_t xx = 0; xx < w; xx++) {
                int xmin = bh[xx * 2], xmax = bh[xx * 2 + 1];
                const int32_t *k = kh + xx * ksh;
                for (size_t c = 0; c < ch; c++) {
                    int64_t ss = (int64_t)1 << (PRECISION_BITS - 1);
                    for (int x = 0; x < xmax; x++)
                        ss += (int64_t)in[(size_t)(x + xmin) * ch + c] * k[x];
                    o[(size_t)xx * ch + c] = clip8(ss);
                }
            }
        }
        src = &tmp;
    }
    if (need_v) {
        size_t stride = (size_t)src->w * ch;
        res = (pix){.w = src->w, .h = h, .ch = px->ch};
        res.p = md_mallocarray_checked((size_t)(res.w * res.h), ch, "the resized image", err);
        if (!res.p) {
            st = MD_ENOMEM;
            goto out;
        }
        for (int64_t yy = 0; yy < h; yy++) {
            int ymin = bv[yy * 2], ymax = bv[yy * 2 + 1];
            const int32_t *k = kv + yy * ksv;
            unsigned char *o = res.p + (size_t)yy * stride;
            for (size_t xx = 0; xx < stride; xx++) {
                int64_t ss = (int64_t)1 << (PRECISION_BITS - 1);
                for (int y = 0; y < ymax; y++)
                    ss += (int64_t)src->p[(size_t)(y + ymin) * stride + xx] * k[y];
                o[xx] = clip8(ss);
            }
        }
    } else {
        res = tmp;
        tmp.p = NULL;
    }
    free(px->p);
    *px = res;
    res.p = NULL;
out:
    free(tmp.p);
    free(res.p);
    free(bh);
    free(bv);
    free(kh);
    free(kv);
    return st;
}

/* ---- torchvision's Resize size, CenterCrop ---- */

/* Resize(N): the smaller edge becomes N, the other int(N * long / short). */
static void resize_size(const pix *px, int64_t n, int64_t *w, int64_t *h)
{
    int64_t sw = px->w, sh = px->h;
    int64_t shortest = sw <= sh ? sw : sh, longest = sw <= sh ? sh : sw;
    int64_t other = (int64_t)((double)(n * longest) / (double)shortest);
    if (sw <= sh) {
        *w = n;
        *h = other;
    } else {
        *w = other;
        *h = n;
    }
}

/* Python's int(round(d / 2.0)) for d >= 0: half to even. */
static int64_t half_round_even(int64_t d)
{
    int64_t q = d / 2;
    if (d % 2 == 0)
        return q;
    return q % 2 == 0 ? q : q + 1;
}

/* CenterCrop(ch, cw) into out floats (ToTensor: v / 255, channels first). */
static void crop_to_tensor(const pix *px, int64_t chh, int64_t cw, float *out)
{
    int64_t off_y, off_x; /* source row/column of the crop's (0, 0); may be < 0 (padding) */
    if (chh > px->h)
        off_y = -((chh - px->h) / 2);
    else
        off_y = half_round_even(px->h - chh);
    if (cw > px->w)
        off_x = -((cw - px->w) / 2);
    else
        off_x = half_round_even(px->w - cw);
    /* when only one edge is padded, torchvision pads first and takes the
     * other edge's offset from the padded image, whose other edge is the
     * image's own: the same offsets as above */
    int ch = px->ch;
    for (int c = 0; c < ch; c++)
        for (int64_t y = 0; y < chh; y++) {
            int64_t sy = y + off_y;
            float *o = out + ((size_t)c * (size_t)chh + (size_t)y) * (size_t)cw;
            for (int64_t x = 0; x < cw; x++) {
                int64_t sx = x + off_x;
                unsigned v = sy >= 0 && sy < px->h && sx >= 0 && sx < px->w
                                 ? px->p[((size_t)sy * (size_t)px->w + (size_t)sx) * (size_t)ch +
                                         (size_t)c]
                                 : 0u;
                o[x] = (float)v / 255.0f;
            }
        }
}

md_status md_image_to_tensor(const void *data, size_t len, const md_image_opts *o,
                             const char *name, float *out, md_err *err)
{
    pix px = {.inline_max = o->inline_max};
    md_status st;
    switch (md_image_sniff(data, len)) {
    case MD_IMAGE_PNG:
        st = decode_png(data, len, o->max_pixels, name, &px, err);
        break;
    case MD_IMAGE_JPEG:
        st = decode_jpeg(data, len, o->max_pixels, o->max_scans, name, &px, err);
        break;
    default:
        return invalid(err, name,
                       len == 0 ? "the file is empty%s; send a PNG or JPEG file"
                                : "not a PNG or JPEG file (told by its first bytes)%s; send PNG "
                                  "or JPEG (convert other formats first)",
                       NULL);
    }
    /* the slot is this call's, not the pix's: a resize replaces the pix */
    int held = px.gated;
    px.gated = 0;
    if (st != MD_OK) {
        gate_leave(held);
        return st;
    }
    if ((st = convert(&px, o->channels, err)) != MD_OK)
        goto out;
    if (o->resize) {
        int64_t w = o->resize_w, h = o->resize_h;
        if (o->resize == 1)
            resize_size(&px, o->resize_h, &w, &h);
        if ((st = resample(&px, w, h, o->max_pixels, name, err)) != MD_OK)
            goto out;
    }
    if (o->crop) {
        crop_to_tensor(&px, o->crop_h, o->crop_w, out);
    } else if (px.h != o->height || px.w != o->width) {
        st = md_err_setc(err, MD_EUNPROC, "invalid_image",
                         "%s is %lldx%lld (width x height)%s but the model takes %lldx%lld; "
                         "send images of that size or declare preprocess.image.resize / "
                         "center_crop",
                         name, (long long)px.w, (long long)px.h,
                         o->resize ? " after resize" : "", (long long)o->width,
                         (long long)o->height);
    } else {
        crop_to_tensor(&px, o->height, o->width, out);
    }
out:
    free(px.p);
    gate_leave(held);
    return st;
}
