/*
 * image.h - images as model input: PNG (libpng) and JPEG (libjpeg-turbo)
 * decoded and preprocessed as torchvision 0.14 does for PIL images, so a
 * version declared with
 *
 *   "preprocess": {"image": {"mode": "L" | "RGB", "resize": N | [H, W],
 *                            "center_crop": N | [H, W]},
 *                  "mean": [...], "std": [...]}
 *
 * answers an image as it answers the tensor
 *   Normalize(mean, std)(ToTensor()(CenterCrop(c)(Resize(r)(img.convert(mode)))))
 * (Resize: bilinear with antialiasing, PIL's fixed-point resampler; an int
 * resizes the smaller edge). md_image_to_tensor does everything up to and
 * including ToTensor (values v / 255 in [0, 1], channels first); Normalize is
 * the batcher's (mean/std), and preprocess.scale is not applied to images
 * (md_tensor.prescaled).
 *
 * The decoders come from libraries; what is written here is the glue, the
 * mode conversion, the resampler and the crop, fuzzed by tests/fuzz_image.c.
 *
 * Thread safety: every function is a pure function of its arguments.
 */
#ifndef MD_IMAGE_H
#define MD_IMAGE_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#include "../config/md_err.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The default bound on an image's pixels (width x height), checked from the
 * header before anything is decoded (setting max_image_pixels). */
#define MD_IMAGE_MAX_PIXELS_DEFAULT (40LL * 1000 * 1000)

/* Images past this many pixels wait for a large-decode slot
 * (md_image_set_large_decodes); smaller ones never wait. */
#define MD_IMAGE_GATE_PIXELS ((int64_t)1 << 20)

/* The default bound on a progressive JPEG's scans (setting max_jpeg_scans):
 * each scan costs a pass over the whole image, encoders write about 10. */
#define MD_IMAGE_MAX_JPEG_SCANS_DEFAULT 500

typedef enum md_image_kind { MD_IMAGE_NONE = 0, MD_IMAGE_PNG, MD_IMAGE_JPEG } md_image_kind;

/* PNG or JPEG by the file's first bytes (never by name or Content-Type). */
md_image_kind md_image_sniff(const void *data, size_t len);

/* A version's declared image preprocessing and the tensor it must produce. */
typedef struct md_image_opts {
    int channels;        /* 1 (mode "L") or 3 ("RGB") */
    int64_t height;      /* the input shape's H and W: what the crop (or the */
    int64_t width;       /* resize, or the image itself) must end at */
    int resize;          /* 0 none; 1 smaller edge to resize_h (torchvision
                          * Resize(int)); 2 exactly resize_h x resize_w */
    int64_t resize_h, resize_w;
    int crop;            /* 1: center crop to crop_h x crop_w */
    int64_t crop_h, crop_w;
    int64_t max_pixels;  /* width x height bound checked before decoding */
    int max_scans;       /* a JPEG's scans at most (0: the default) */
    int64_t inline_max;  /* > 0: an image whose header says more pixels is not
                          * decoded (MD_EBUSY, code "image_not_inline"), so a
                          * thread that must never wait can hand it on */
} md_image_opts;

/*
 * Read a version config's preprocess.image (with input.shape [C, H, W] or
 * [H, W] for C = 1, which it requires) into `out`. Returns MD_OK with
 * *declared = 0 when the config has no preprocess.image; MD_EUNPROC naming
 * the key and what is allowed when it is wrong (also: mode "RGB" with C != 3,
 * a crop or resize that cannot end at H x W). `config` borrowed.
 */
md_status md_image_opts_from_config(json_t *config, int64_t max_pixels, md_image_opts *out,
                                    int *declared, md_err *err);

/* The floats one image becomes: channels x height x width. */
size_t md_image_values(const md_image_opts *o);

/*
 * Decode the PNG or JPEG `data` (`len` bytes) and preprocess it as `o` says
 * into `out` (room for md_image_values(o) floats, C order [C, H, W], values
 * v / 255). `name` names the image in messages ("image 2", "cats/a.png").
 * MD_ETOOBIG when width x height is past o->max_pixels (told from the
 * header, before any pixel is decoded); MD_EUNPROC (code invalid_image)
 * naming the image and the problem for a truncated or corrupt file, a
 * format other than PNG or JPEG, a CMYK JPEG or a 16-bit grayscale PNG, and
 * for an image whose size after resize and crop is not H x W (saying which
 * preprocess.image to declare). Every buffer is sized from the header and
 * checked before it is allocated (MD_ENOMEM when it cannot be).
 */
md_status md_image_to_tensor(const void *data, size_t len, const md_image_opts *o,
                             const char *name, float *out, md_err *err);

/* Images of more than MD_IMAGE_GATE_PIXELS decode at most `slots` at a time in the process
 * (setting max_large_decodes, default the number of cores); the others wait
 * in md_image_to_tensor. Thread-safe; main() sets it once. */
void md_image_set_large_decodes(int slots);
/* Slots held now, and the most held at once since the last set (tests). */
void md_image_large_decodes(int *busy, int *peak);
/* Test only: called by a decode right after it took a slot. */
void md_image_set_gate_hook(void (*hook)(void));

#ifdef __cplusplus
}
#endif
#endif
