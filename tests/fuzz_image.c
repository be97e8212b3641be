/*
 * fuzz_image.c - libFuzzer harness for image input (predictor/image.c):
 * the glue around libpng and libjpeg-turbo (memory sources, error longjmps,
 * the header checks before any pixel buffer), the mode conversion, PIL's
 * resampler and the center crop. `make fuzz` builds it beside the other
 * targets and runs it over tests/fuzz_corpus_image/.
 *
 * The first four bytes pick the options as a version config could declare
 * them (built here the way md_image_opts_from_config builds them, so every
 * combination is one a deploy accepts): byte 0 bit 0 mode RGB (else L),
 * bits 1-2 resize none / N / [h, w] / none, bit 3 center_crop; bytes 1-3 the
 * input's H and W (1..64) and the resize (1..96). The rest is the file.
 * max_pixels is 1 << 20, so no step allocates much. Byte 0 bit 4 rewrites
 * the CRC of every whole PNG chunk before the call: libpng refuses a chunk
 * whose CRC is wrong, so without it nearly every mutation of a PNG stops at
 * the first CRC and the decoder's glue past it is never reached.
 *
 * Checks beyond "no crash": a success wrote every value and each is
 * v / 255 for an integer v in 0..255; a failure is one of the documented
 * statuses (too large, invalid_image, out of memory) with its code and a
 * one-line message naming the image.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <zlib.h>

#include "../predictor/image.h"

#define NAME "fuzz.png"

/* Give every whole chunk after the PNG signature its correct CRC. */
static void fix_png_crcs(uint8_t *p, size_t len)
{
    size_t off = 8;
    while (len >= 12 && off <= len - 12) {
        uint32_t n = (uint32_t)p[off] << 24 | (uint32_t)p[off + 1] << 16 |
                     (uint32_t)p[off + 2] << 8 | p[off + 3];
        if (n > len - 12 - off)
            break;
        uLong crc = crc32(0L, p + off + 4, (uInt)n + 4);
        uint8_t *c = p + off + 8 + n;
        c[0] = (uint8_t)(crc >> 24);
        c[1] = (uint8_t)(crc >> 16);
        c[2] = (uint8_t)(crc >> 8);
        c[3] = (uint8_t)crc;
        off += 12 + (size_t)n;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 4)
        return 0;
    md_image_opts o;
    memset(&o, 0, sizeof o);
    o.channels = data[0] & 1 ? 3 : 1;
    o.height = data[1] % 64 + 1;
    o.width = data[2] % 64 + 1;
    int64_t r = data[3] % 96 + 1;
    int resize = (data[0] >> 1) & 3;
    o.crop = (data[0] >> 3) & 1;
    o.max_pixels = 1 << 20;
    o.max_scans = 64; /* a scan bomb is refused early, not decoded 500 times */
    if (resize == 1) {
        o.resize = 1;
        /* without a crop the smaller edge must be the input's (as the config requires) */
        o.resize_h = o.resize_w = o.crop ? r : (o.height < o.width ? o.height : o.width);
    } else if (resize == 2) {
        o.resize = 2;
        o.resize_h = o.crop ? r : o.height;
        o.resize_w = o.crop ? (r * 7) % 96 + 1 : o.width;
    }
    if (o.crop) {
        o.crop_h = o.height;
        o.crop_w = o.width;
    }
    size_t n = md_image_values(&o);
    float *out = malloc(n * sizeof(float));
    if (!out)
        abort();
    for (size_t i = 0; i < n; i++)
        out[i] = NAN;
    /* the file in a buffer of its own size, so ASan sees a read past its end */
    size_t len = size - 4;
    uint8_t *file = malloc(len ? len : 1);
    if (!file)
        abort();
    memcpy(file, data + 4, len);
    if ((data[0] >> 4) & 1 && md_image_sniff(file, len) == MD_IMAGE_PNG)
        fix_png_crcs(file, len);
    md_err err;
    md_err_clear(&err);
    md_status st = md_image_to_tensor(file, len, &o, NAME, out, &err);
    free(file);
    if (st == MD_OK) {
        for (size_t i = 0; i < n; i++) {
            float v = out[i] * 255.0f;
            if (!(v >= -0.5f && v <= 255.5f) || out[i] != (float)lrintf(v) / 255.0f)
                abort();
        }
    } else {
        const char *code = md_err_code(&err);
        int known = (st == MD_ETOOBIG && strcmp(code, "image_too_large") == 0) ||
                    (st == MD_EUNPROC && strcmp(code, "invalid_image") == 0) || st == MD_ENOMEM;
        if (!known || err.status != st || err.msg[0] == '\0' || strchr(err.msg, '\n') ||
            (st != MD_ENOMEM && !strstr(err.msg, NAME)))
            abort();
    }
    free(out);
    return 0;
}
