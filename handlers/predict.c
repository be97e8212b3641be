/*
 * predict.c - online predictions: POST /predict, /models/{name}[/versions/{v}]/predict
 * (JSON rows, TF Serving instances, Ray Serve array, NPY) and the Open
 * Inference Protocol V2 routes.
 *
 * The handler decodes the body, finds the loaded version (retained), suspends
 * the connection and submits; the batcher calls predict_done on a worker
 * thread, which encodes the answer and resumes the connection. No server
 * thread waits on inference.
 *
 * The JSON/NPY routes (POST or PUT, and the TorchServe-style /predictions/NAME)
 * also take images for a version that declares preprocess.image: a PNG or
 * JPEG body (Content-Type image/png or image/jpeg, or application/octet-stream
 * or none with the bytes of one: curl -T, --data-binary) is one row; a
 * multipart/form-data body is one row per file part, answered in order
 * (curl -F image=@a.png -F image=@b.jpg). See "images" below.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "../predictor/image.h"
#include "../predictor/predictor.h"
#include "answer.h"
#include "handlers.h"

typedef struct pctx {
    md_req *req;
    md_model *model;
    int top_k;      /* 0: none asked */
    int npy;        /* answer application/x-npy */
    int v2;         /* answer the V2 inference response */
    int v2_binary;  /* its output as raw bytes after the JSON (binary tensor data) */
    int v1;         /* answer KServe V1's {"predictions": ...} only */
    char v2_id[128];
    char v2_output[64];
    int columnar;        /* a columnar request: answer {"outputs": ...} */
    int n_pick;          /* V2: the declared outputs asked for, by index (0: all) */
    int pick[MD_MAX_IO];
    int shadow;          /* the shadow version to compare with, 0: none */
    md_tensor shadow_in; /* the request's copy for it */
} pctx;

/* ---- answers ---- */

static void finish(pctx *c)
{
    md_tensor_free(&c->shadow_in); /* not sent: the primary failed */
    md_req_resume(c->req);
    md_model_release(c->model);
    free(c);
}

/* After the primary's answer is on its way: its shadow's turn. */
static void to_shadow(pctx *c, md_app *app, const float *out, const int64_t *shape, int ndim,
                      double seconds)
{
    if (!c->shadow)
        return;
    md_tensor in = c->shadow_in;
    memset(&c->shadow_in, 0, sizeof c->shadow_in);
    md_shadow_run(app, md_model_name(c->model), md_model_version(c->model), c->shadow, &in, out,
                  shape, ndim, seconds);
}

static void predict_done(void *ctx, md_status st, const md_err *err, const float *out,
                         const int64_t *shape, int ndim)
{
    pctx *c = ctx;
    md_app *app = md_req_app(c->req);
    (void)st;
    if (!out && strcmp(md_err_code(err), "client_closed") == 0) {
        /* nobody reads this: it records the hang-up (nginx's 499) in the access log */
        md_reply_bytes(c->req, 499, "application/json", NULL, 0);
        finish(c);
        return;
    }
    /* every answer names the version that made it, whatever its body can
     * say (a traffic split may have chosen it), its errors too */
    char v[16];
    snprintf(v, sizeof v, "%d", md_model_version(c->model));
    md_reply_header(c->req, "X-Model-Version", v);
    if (!out) {
        md_model_note_answer(c->model, 0, 0);
        md_reply_error(c->req, err);
        finish(c);
        return;
    }
    int n_out = md_model_n_outputs(c->model); /* an NPY answer has one (go_on checked) */
    if (c->npy) {
        size_t len;
        int64_t one[MD_MAX_DIMS];
        if (n_out == 1) { /* the output's own per-row shape */
            md_io_info oi;
            md_model_output(c->model, 0, &oi);
            one[0] = shape[0];
            memcpy(one + 1, oi.shape, sizeof(int64_t) * (size_t)oi.ndim);
            shape = one;
            ndim = 1 + oi.ndim;
        }
        char *npy = md_npy_encode(out, shape, ndim, &len);
        double seconds = md_req_elapsed_s(c->req);
        md_model_note_answer(c->model, 1, seconds);
        md_reply_bytes(c->req, 200, "application/x-npy", npy, len);
        to_shadow(c, app, out, shape, ndim, seconds);
        finish(c);
        return;
    }
    int64_t width = ndim >= 2 ? 1 : ndim == 1;
    for (int d = 1; d < ndim; d++)
        width *= shape[d];
    int class_out = n_out ? md_model_classes_output(c->model) : 0;
    if (n_out && class_out >= 0) {
        md_io_info ci;
        md_model_output(c->model, class_out, &ci);
        width = ci.ndim == 1 ? ci.values : 0;
    }
    md_answer_opts o = {
        .kind = c->v2 ? MD_ANSWER_V2 : c->v1 ? MD_ANSWER_V1 : MD_ANSWER_PREDICT,
        .model = md_model_name(c->model),
        .version = md_model_version(c->model),
        .labels = md_model_labels(c->model),
        .classes = md_model_classes(c->model, width),
        .top_k = c->top_k,
        .v2_id = c->v2_id,
        .v2_output = c->v2_output,
        .v2_binary = c->v2_binary,
        .n_out = n_out,
        .out_values = md_model_output_values(c->model),
        .class_out = class_out,
        .columnar = c->columnar,
        .n_pick = c->n_pick,
    };
    for (int j = 0; j < n_out; j++)
        md_model_output(c->model, j, &o.outs[j]);
    memcpy(o.pick, c->pick, sizeof o.pick);
    if (n_out && class_out < 0)
        o.classes.kind = MD_CLASSES_NONE;
    if (c->top_k && o.kind == MD_ANSWER_PREDICT && o.classes.kind == MD_CLASSES_NONE) {
        md_err e;
        md_err_setc(&e, MD_EINVAL, "no_classes",
                    "top_k needs classes, and model %s version %d has none: %s (in the "
                    "config of a new version)",
                    o.model, o.version, md_classes_none_reason());
        md_reply_error(c->req, &e);
        finish(c);
        return;
    }
    size_t len, json_len;
    char *body = md_answer_encode(&o, out, shape, ndim, &len, &json_len);
    if (!body) {
        md_err e;
        md_err_setc(&e, MD_ENOMEM, "out_of_memory",
                    "the answer of %lld rows does not fit in memory; send fewer rows a request",
                    ndim > 0 ? (long long)shape[0] : 0LL);
        md_model_note_answer(c->model, 0, 0);
        md_reply_error(c->req, &e);
        finish(c);
        return;
    }
    double seconds = md_req_elapsed_s(c->req);
    md_model_note_answer(c->model, 1, seconds);
    if (c->v2 && c->v2_binary) {
        char head[32];
        snprintf(head, sizeof head, "%zu", json_len);
        md_reply_header(c->req, "Inference-Header-Content-Length", head);
        md_reply_bytes(c->req, 200, "application/octet-stream", body, len);
    } else {
        md_reply_bytes(c->req, 200, "application/json", body, len);
    }
    to_shadow(c, app, out, shape, ndim, seconds);
    finish(c);
}

/* ---- finding the model ----
 *
 * Every prediction route looks the model up once, in memory only
 * (md_app_lookup: the registry and what app.c remembers), on the
 * libmicrohttpd thread. On a hit it goes straight on to the batcher with the
 * model that lookup retained; a lookup that cannot answer (a version not
 * loaded here yet) hands the request to a deferred thread, which resolves it
 * (a store read, maybe a load, once however many ask) and then goes on the
 * same way. No libmicrohttpd thread ever loads or waits on a load, and there
 * is no second lookup that a delete could make miss. */

/* What the handler read on its own thread, for whichever thread submits.
 * Request state: freed with the request. */
typedef enum body_kind {
    BODY_ROWS = 0, /* JSON rows or NPY: md_tensor_decode */
    BODY_IMAGE,    /* one PNG or JPEG */
    BODY_FORM,     /* multipart/form-data: one image per file part */
    BODY_V2,       /* a large V2 JSON request, read after the lookup (v2_read) */
} body_kind;

typedef struct pending {
    char name[256];
    int version;
    int unversioned; /* the request named no version (a split or a shadow may apply) */
    int v2;
    int top_k;
    int npy;
    body_kind body;
    md_model *model;   /* images sent to a deferred thread: the model found, retained */
    int have_tensor;   /* V2: decoded before the lookup */
    int v2_binary;
    int v1;
    md_tensor t;
    char content_type[512];
    int has_content_type;
    char v2_id[128];
    char v2_output[64];
    /* named inputs: V2's several inputs (or an integer one), read before the
     * lookup; packed for the version once it is known (named_rows) */
    md_arrays arrays;
    int have_arrays;
    char v2_input[MD_IO_NAME_MAX]; /* V2: the one float input's name */
    char v2_datatype[8];           /* ... and its datatype */
    int columnar;
    int n_outs;                    /* V2: the outputs asked for by name */
    char outs[MD_MAX_IO][MD_IO_NAME_MAX];
} pending;

static void pending_free(void *p)
{
    pending *pd = p;
    if (pd && pd->have_tensor)
        md_tensor_free(&pd->t);
    if (pd && pd->have_arrays)
        md_arrays_free(&pd->arrays);
    if (pd)
        md_model_release(pd->model);
    free(pd);
}

static size_t max_values(md_req *req)
{
    md_app *app = md_req_app(req);
    return (size_t)app->cfg->max_body_bytes / 2 + 1024;
}

static int client_alive(void *ctx) { return !md_req_client_gone(((pctx *)ctx)->req); }

static void submit(md_req *req, md_model *m, md_tensor *t, pctx *c)
{
    md_err err;
    md_err_clear(&err);
    c->req = req;
    c->model = m;
    /* suspend first: the answer may come before this thread returns */
    md_req_suspend(req);
    if (md_model_submit_alive(m, t, MD_PRIO_ONLINE, predict_done, client_alive, c, &err) !=
        MD_OK) {
        if (md_status_http(err.status) >= 500) /* a full queue, a stopping version */
            md_model_note_answer(m, 0, 0);
        char v[16];
        snprintf(v, sizeof v, "%d", md_model_version(m));
        md_reply_header(req, "X-Model-Version", v);
        md_reply_error(req, &err);
        finish(c);
    }
}

/* ---- images ----
 *
 * What the body is: told on the handler thread from the Content-Type and,
 * where that does not say (application/octet-stream, none), from the bytes
 * (md_image_sniff). Between PNG and JPEG the bytes decide: a part curl
 * labelled image/png from its name whose bytes are a JPEG decodes as a JPEG;
 * bytes that are neither answer 422 from md_image_to_tensor, naming the image.
 * A Content-Type naming another image type (image/gif, image/webp) answers
 * 415, as does an application/octet-stream body that is no image.
 *
 * A form's text fields (curl -F top_k=3) are refused (400 naming the field)
 * rather than ignored: an option silently dropped would answer something else
 * than was asked, as an unknown query parameter would (options go in the
 * query). A part is a file when it has a filename, a Content-Type other than
 * text/plain, or the bytes of a PNG or JPEG.
 *
 * Which thread decodes: a small image (MNIST's 28x28 in a few hundred bytes)
 * decodes in well under a millisecond, less than handing it on costs, so it
 * decodes on the libmicrohttpd thread that looked the model up. Only a body
 * of at most INLINE_IMAGE_BYTES is small in that sense: the work of a decode
 * follows the file's bytes as well as its pixels (a 28x28 PNG can carry
 * megabytes of chunks; libpng skips them, but reading them is still a pass
 * over the body, issue 24). So:
 *  - a request whose images' headers say more than INLINE_PIXELS pixels in
 *    all (or that cannot be told cheaply), or that declares a resize, is
 *    decoded on a deferred thread (md_req_defer): it may wait there for a
 *    large-decode slot, which an HTTP or decode-pool thread never does;
 *  - any other body of more than INLINE_IMAGE_BYTES is decoded on the decode
 *    pool (md_req_offload; a deferred thread when the pool's queue is full),
 *    counted in modeld_http_decoded_off_thread_total;
 *  - the rest decodes inline.
 * The pixel count read here only chooses the thread, md_image_to_tensor
 * checks every image's own header against max_image_pixels before decoding.
 * Should the hint be wrong, the handler and pool decoders refuse any one
 * image over INLINE_PIXELS by its real header (inline_max) and the request is
 * deferred then, so neither ever waits for a large-decode slot. */

#define INLINE_PIXELS ((int64_t)1 << 16)
#define INLINE_IMAGE_BYTES (8 * 1024)
/* an image decoded inline never waits for a large-decode slot */
_Static_assert(INLINE_PIXELS < MD_IMAGE_GATE_PIXELS, "inline decodes must stay under the gate");

/* The media type of a Content-Type value (before ';', trimmed) into out. */
static void media_type(const char *ct, char *out, size_t size)
{
    while (*ct == ' ' || *ct == '\t')
        ct++;
    size_t n = strcspn(ct, ";");
    while (n && (ct[n - 1] == ' ' || ct[n - 1] == '\t'))
        n--;
    snprintf(out, size, "%.*s", (int)n, ct);
}

static int is_png_or_jpeg_type(const char *t, size_t n)
{
    return md_multipart_eq(t, n, "image/png") || md_multipart_eq(t, n, "image/jpeg") ||
           md_multipart_eq(t, n, "image/jpg") || md_multipart_eq(t, n, "image/pjpeg");
}

/* Whether the `n` bytes at `t` name an image type other than PNG or JPEG. */
static int is_other_image_type(const char *t, size_t n)
{
    return n > 6 && strncasecmp(t, "image/", 6) == 0 && !is_png_or_jpeg_type(t, n);
}

#define IMAGE_TYPES_HELP "modeld decodes PNG and JPEG images; convert it to PNG (lossless)"

/* What the body of a JSON/NPY route is (see above). `ct` may be NULL. */
static md_status classify_body(const char *ct, const char *body, size_t len, body_kind *kind,
                               md_err *err)
{
    *kind = BODY_ROWS;
    int image_bytes = body && len && md_image_sniff(body, len) != MD_IMAGE_NONE;
    if (!ct) {
        if (image_bytes)
            *kind = BODY_IMAGE;
        return MD_OK;
    }
    char t[128];
    media_type(ct, t, sizeof t);
    size_t n = strlen(t);
    if (md_multipart_eq(t, n, "multipart/form-data"))
        *kind = BODY_FORM;
    else if (is_png_or_jpeg_type(t, n))
        *kind = BODY_IMAGE;
    else if (is_other_image_type(t, n))
        return md_err_setc(err, MD_EMEDIA, "unsupported_image_type",
                           "Content-Type %.60s: " IMAGE_TYPES_HELP, t);
    else if (md_multipart_eq(t, n, "application/octet-stream")) {
        if (!image_bytes)
            return md_err_setc(err, MD_EMEDIA, "unsupported_media_type",
                               "an application/octet-stream body is taken as one PNG or JPEG "
                               "image, and these %zu bytes are neither; send an image, or rows "
                               "as application/json or application/x-npy",
                               len);
        *kind = BODY_IMAGE;
    }
    return MD_OK;
}

/* Width x height from the header of a PNG (IHDR) or a JPEG (its first SOF
 * marker), or -1 when it cannot be told from the first bytes. A hint that
 * only picks the thread to decode on: never used to size anything. */
static int64_t pixels_hint(const unsigned char *d, size_t len)
{
    if (len >= 24 && memcmp(d, "\x89PNG\r\n\x1a\n", 8) == 0 && memcmp(d + 12, "IHDR", 4) == 0) {
        int64_t w = ((int64_t)d[16] << 24) | (d[17] << 16) | (d[18] << 8) | d[19];
        int64_t h = ((int64_t)d[20] << 24) | (d[21] << 16) | (d[22] << 8) | d[23];
        return w * h; /* each < 2^32: no overflow in int64 */
    }
    if (len < 4 || d[0] != 0xFF || d[1] != 0xD8)
        return -1;
    size_t i = 2;
    while (i + 4 <= len) {
        if (d[i] != 0xFF)
            return -1;
        unsigned m = d[i + 1];
        if (m == 0xFF) { /* fill byte */
            i++;
            continue;
        }
        if (m == 0x00)
            return -1; /* libjpeg skips such bytes; where it resumes is not told here */
        if (m == 0x01 || (m >= 0xD0 && m <= 0xD8)) { /* markers without a length */
            i += 2;
            continue;
        }
        size_t seg = ((size_t)d[i + 2] << 8) | d[i + 3];
        if (m >= 0xC0 && m <= 0xCF && m != 0xC4 && m != 0xC8 && m != 0xCC) {
            if (i + 9 > len)
                return -1;
            return (int64_t)(((unsigned)d[i + 5] << 8) | d[i + 6]) *
                   (int64_t)(((unsigned)d[i + 7] << 8) | d[i + 8]);
        }
        if (seg < 2)
            return -1;
        i += 2 + seg;
    }
    return -1;
}

/* How `part` of a form names itself in messages: "image 2 (b.jpg)", with the
 * field's name when it has no filename; client text, printable ASCII only. */
static void part_label(size_t index, const md_multipart_part *part, char *out, size_t size)
{
    const char *s = part->filename && part->filename_len ? part->filename : part->name;
    size_t n = part->filename && part->filename_len ? part->filename_len : part->name_len;
    char clean[64];
    size_t o = 0;
    for (size_t i = 0; i < n && o + 4 < sizeof clean; i++)
        clean[o++] = s[i] >= 0x20 && s[i] < 0x7f ? s[i] : '?';
    if (o + 4 >= sizeof clean && o < n)
        memcpy(clean + o, "...", 3), o += 3;
    clean[o] = '\0';
    if (o)
        snprintf(out, size, "image %zu (%s)", index, clean);
    else
        snprintf(out, size, "image %zu", index);
}

/* Whether a form part is a file (see above). */
static int part_is_file(const md_multipart_part *p)
{
    if (p->filename)
        return 1;
    if (p->content_type && !md_multipart_eq(p->content_type, p->content_type_len, "text/plain"))
        return 1;
    return md_image_sniff(p->data, p->len) != MD_IMAGE_NONE;
}

/* What the images of a request are, read without decoding any. */
typedef struct image_scan {
    size_t count;   /* images */
    int64_t pixels; /* the sum of their headers' width x height; -1: not told */
} image_scan;

static md_status begin_form(md_req *req, const pending *pd, const char *body, size_t len,
                            md_multipart *mp, md_err *err)
{
    md_app *app = md_req_app(req);
    return md_multipart_begin(mp, pd->content_type, body, len,
                              (size_t)app->cfg->max_request_images, "max_request_images", err);
}

/* Count the images and check the form's parts (400 for a text field, 415 for
 * an image type not decoded, 400 when there is none), nothing decoded. */
static md_status scan_images(md_req *req, const pending *pd, const char *body, size_t len,
                             image_scan *out, md_err *err)
{
    out->count = 0;
    out->pixels = 0;
    if (pd->body == BODY_IMAGE) {
        out->count = 1;
        out->pixels = pixels_hint((const unsigned char *)body, len);
        return MD_OK;
    }
    md_multipart mp;
    md_status st = begin_form(req, pd, body, len, &mp, err);
    for (;;) {
        md_multipart_part p;
        int more = 0;
        if (st != MD_OK || (st = md_multipart_next(&mp, &p, &more, err)) != MD_OK || !more)
            break;
        char label[96];
        part_label(out->count + 1, &p, label, sizeof label);
        if (!part_is_file(&p))
            return md_err_setc(err, MD_EINVAL, "unexpected_form_field",
                               "form field \"%.*s\" is not a file: a prediction's "
                               "multipart/form-data body takes image files only (curl -F "
                               "image=@a.png); options go in the query (?top_k=3)",
                               (int)(p.name_len > 60 ? 60 : p.name_len), p.name);
        if (p.content_type && is_other_image_type(p.content_type, p.content_type_len))
            return md_err_setc(err, MD_EMEDIA, "unsupported_image_type",
                               "%s is %.*s: " IMAGE_TYPES_HELP, label,
                               (int)(p.content_type_len > 40 ? 40 : p.content_type_len),
                               p.content_type);
        out->count++;
        int64_t px = pixels_hint((const unsigned char *)p.data, p.len);
        if (px < 0 || out->pixels < 0 || md_add_i64(out->pixels, px, &out->pixels))
            out->pixels = -1;
    }
    if (st == MD_OK && out->count == 0)
        st = md_err_setc(err, MD_EINVAL, "no_images",
                         "the multipart/form-data body holds no file; send images as curl -F "
                         "image=@a.png -F image=@b.jpg");
    return st;
}

/* Decode the request's images (scan_images counted `count`) into one tensor
 * [count, C, H, W] of ToTensor values (prescaled: the version's
 * preprocess.scale is not applied; mean and std are). */
static md_status decode_images(md_req *req, const pending *pd, const md_image_opts *o,
                               size_t count, md_tensor *t, md_err *err)
{
    size_t len, per = md_image_values(o), total;
    const char *body = md_req_body(req, &len);
    memset(t, 0, sizeof *t);
    if (md_mul_size(count, per, &total) || total > max_values(req))
        return md_err_setc(err, MD_ETOOBIG, "too_many_values",
                           "%zu images of %zu values each (%d x %lld x %lld) are more than the "
                           "limit of %zu input values; send fewer images per request or raise "
                           "max_body_bytes",
                           count, per, o->channels, (long long)o->height, (long long)o->width,
                           max_values(req));
    float *data = md_mallocarray_checked(total, sizeof(float), "the images' values", err);
    if (!data)
        return err->status;
    md_status st = MD_OK;
    if (pd->body == BODY_IMAGE) {
        st = md_image_to_tensor(body, len, o, "the image", data, err);
    } else {
        md_multipart mp;
        st = begin_form(req, pd, body, len, &mp, err);
        size_t i = 0;
        while (st == MD_OK && i < count) {
            md_multipart_part p;
            int more = 0;
            if ((st = md_multipart_next(&mp, &p, &more, err)) != MD_OK || !more)
                break;
            if (!part_is_file(&p))
                continue; /* not reached: scan_images refused it */
            char label[96];
            part_label(i + 1, &p, label, sizeof label);
            st = md_image_to_tensor(p.data, p.len, o, label, data + i * per, err);
            i++;
        }
        if (st == MD_OK && i != count)
            st = md_err_set(err, MD_EINTERNAL, "the form's images changed between two reads");
    }
    if (st != MD_OK) {
        free(data);
        return st;
    }
    t->ndim = 4;
    t->shape[0] = (int64_t)count;
    t->shape[1] = o->channels;
    t->shape[2] = o->height;
    t->shape[3] = o->width;
    t->count = total;
    t->data = data;
    t->prescaled = 1;
    return MD_OK;
}

/* 422 image_not_declared for a version without preprocess.image. */
static md_status not_declared(md_model *m, md_err *err)
{
    int64_t shape[MD_MAX_DIMS];
    int nd = md_model_input_shape(m, shape);
    const char *mode = nd == 3 && shape[0] == 3 ? "RGB" : "L";
    return md_err_setc(err, MD_EUNPROC, "image_not_declared",
                       "model %s version %d declares no preprocess.image, so it takes no "
                       "images; deploy a version whose config has \"preprocess\": {\"image\": "
                       "{\"mode\": \"%s\"}} (with \"resize\" and \"center_crop\" as the model "
                       "was trained, and input.shape [C, H, W]), or send rows of numbers",
                       md_model_name(m), md_model_version(m), mode);
}

/* Where go_on runs: the handler thread hands large work on; the decode pool
 * decodes small-pixel images but hands a large one on to a deferred thread;
 * a deferred thread does everything itself. */
typedef enum where { ON_DEFERRED = 0, ON_HANDLER, ON_POOL } where;

static void images_deferred(md_req *req);
static void images_offloaded(md_req *req);
static void go_on(md_req *req, pending *pd, md_model *m, where at);

/* The images of the body into pd->t for `m`. Returns 1 when done; 0 when it
 * replied (an error) or handed the request to another thread (from the
 * handler thread or the decode pool), `m` taken in both cases. */
static int images_to_tensor(md_req *req, pending *pd, md_model *m, where at)
{
    md_err err;
    md_err_clear(&err);
    const md_image_opts *o = md_model_image(m);
    size_t len;
    const char *body = md_req_body(req, &len);
    image_scan scan = {0, 0};
    md_status st = o ? scan_images(req, pd, body, len, &scan, &err) : not_declared(m, &err);
    /* a declared resize is deferred whatever the headers say: a tiny image
     * of an extreme aspect ratio can resize to max_image_pixels (review) */
    if (st == MD_OK && at == ON_HANDLER &&
        (o->resize || scan.pixels < 0 || scan.pixels > INLINE_PIXELS)) {
        pd->model = m; /* the request's state owns it until images_deferred takes it */
        md_req_defer(req, images_deferred);
        return 0;
    }
    if (st == MD_OK && at == ON_HANDLER && len > INLINE_IMAGE_BYTES) {
        pd->model = m; /* the request's state owns it until images_offloaded takes it */
        if (!md_req_offload(req, images_offloaded))
            md_req_defer(req, images_deferred); /* never inline: the body is not small */
        return 0;
    }
    if (st == MD_OK && at != ON_DEFERRED) {
        /* the headers are only a hint (a JPEG may hide its real size from
         * it): the decoder itself refuses more than INLINE_PIXELS an image
         * here, and then the request goes to a deferred thread after all */
        md_image_opts inl = *o;
        inl.inline_max = INLINE_PIXELS;
        st = decode_images(req, pd, &inl, scan.count, &pd->t, &err);
        if (st == MD_EBUSY && strcmp(md_err_code(&err), "image_not_inline") == 0) {
            pd->model = m;
            md_req_defer(req, images_deferred);
            return 0;
        }
    } else if (st == MD_OK) {
        st = decode_images(req, pd, o, scan.count, &pd->t, &err);
    }
    if (st != MD_OK) {
        md_model_release(m);
        md_reply_error(req, &err);
        return 0;
    }
    pd->have_tensor = 1;
    return 1;
}

/* On a deferred thread: decode the images, then submit. */
static void images_deferred(md_req *req)
{
    pending *pd = md_req_state(req);
    md_model *m = pd->model;
    pd->model = NULL;
    go_on(req, pd, m, ON_DEFERRED);
}

/* On the decode pool: decode the images or rows (or read the V2 request; a
 * large image is handed on), then submit; a client that hung up while its
 * body waited is not decoded for (499 in the access log). */
static void offloaded(md_req *req, where at)
{
    pending *pd = md_req_state(req);
    md_model *m = pd->model;
    pd->model = NULL;
    if (md_req_client_gone(req)) {
        md_model_release(m);
        md_reply_bytes(req, 499, "application/json", NULL, 0);
        return;
    }
    go_on(req, pd, m, at);
}

static void images_offloaded(md_req *req) { offloaded(req, ON_POOL); }
static void rows_offloaded(md_req *req) { offloaded(req, ON_DEFERRED); }


static md_status v2_read(md_req *req, pending *pd, const char *body, size_t json_len,
                         const char *bin, size_t bin_len, md_err *err);
static int v2_wants_binary(json_t *root);
static void v2_output_names(pending *pd, json_t *outs);

/* The inputs of a V2 request by name into pd->arrays: every input's data
 * read where it lies in the body (md_v2_parse_spans: no jansson node per
 * value), integers exactly; with the binary extension, each input's bytes
 * in turn after the JSON. For several inputs, and for one integer input of
 * a version with declared inputs (named_rows reads it again this way). */
static md_status v2_named(md_req *req, pending *pd, const char *body, size_t json_len,
                          const char *bin, size_t bin_len, md_err *err)
{
    (void)req;
    size_t span_a[MD_MAX_IO], span_b[MD_MAX_IO];
    json_t *root = md_v2_parse_spans(body, json_len, max_values(req), span_a, span_b, err);
    if (!root)
        return err->status;
    json_t *inputs = json_object_get(root, "inputs");
    md_status st = MD_OK;
    if (!json_is_array(inputs) || json_array_size(inputs) < 1 ||
        json_array_size(inputs) > MD_MAX_IO)
        st = md_err_set(err, MD_EINVAL, "the request needs \"inputs\": an array of 1 to %d "
                        "tensors", MD_MAX_IO);
    md_arrays a;
    memset(&a, 0, sizeof a);
    size_t at = 0, total = 0;
    for (size_t k = 0; st == MD_OK && k < json_array_size(inputs); k++) {
        json_t *x = json_array_get(inputs, k);
        const char *xname = json_string_value(json_object_get(x, "name"));
        json_t *bs = json_object_get(json_object_get(x, "parameters"), "binary_data_size");
        if (bs) {
            if (!bin || !json_is_integer(bs) || json_integer_value(bs) < 0 ||
                (unsigned long long)json_integer_value(bs) > bin_len - at)
                st = md_err_set(err, MD_EINVAL,
                                "input \"%.64s\": binary_data_size must count bytes that "
                                "follow the JSON header (Inference-Header-Content-Length), "
                                "in the inputs' order; %zu remain",
                                xname ? xname : "(unnamed)", bin ? bin_len - at : 0);
            else {
                size_t xn = (size_t)json_integer_value(bs);
                st = md_v2_decode_array(x, bin + at, xn, max_values(req) - total, &a.a[k], err);
                at += xn;
            }
        } else {
            st = md_v2_text_array(x, body + span_a[k], span_b[k] - span_a[k],
                                  max_values(req) - total, &a.a[k], err);
        }
        if (st == MD_OK) {
            a.n = (int)k + 1;
            total += a.a[k].count;
            for (size_t p = 0; p < k && st == MD_OK; p++)
                if (strcmp(a.a[p].name, a.a[k].name) == 0)
                    st = md_err_set(err, MD_EINVAL, "input \"%s\" is given twice", a.a[k].name);
        }
    }
    if (st == MD_OK && at != bin_len)
        st = md_err_set(err, MD_EINVAL,
                        "%zu bytes follow the JSON header, and the inputs' binary_data_size "
                        "count %zu",
                        bin_len, at);
    if (st != MD_OK) {
        md_arrays_free(&a);
        json_decref(root);
        return st;
    }
    if (pd->have_arrays)
        md_arrays_free(&pd->arrays);
    pd->arrays = a;
    pd->have_arrays = 1;
    pd->v2_binary = v2_wants_binary(root);
    const char *id = json_string_value(json_object_get(root, "id"));
    snprintf(pd->v2_id, sizeof pd->v2_id, "%s", id ? id : "");
    json_t *outs = json_object_get(root, "outputs");
    v2_output_names(pd, outs);
    json_decref(root);
    return MD_OK;
}

/* The JSON part and the binary data of the request's V2 body (v2_split's
 * reading, which the request has passed already). */
static void v2_parts(md_req *req, size_t *json_len, const char **bin, size_t *bin_len)
{
    size_t len;
    const char *body = md_req_body(req, &len);
    const char *h = md_req_header(req, "Inference-Header-Content-Length");
    unsigned long long n = h ? strtoull(h, NULL, 10) : 0;
    *json_len = n && n <= len ? (size_t)n : len;
    *bin = n && n <= len ? body + n : NULL;
    *bin_len = n && n <= len ? len - (size_t)n : 0;
}

/* ---- named inputs (config.inputs) ----
 *
 * A version with declared inputs is sent rows as objects, columns, NPZ or
 * V2 requests naming each input (V2 is read before the lookup, into
 * pd->arrays, or into pd->t for one float input). They are packed for that
 * version here (md_model_pack), after the lookup: what the version declares
 * decides how a JSON body reads. A version without declared inputs takes
 * one V2 input as ever, read as floats. */

/* A V2 request's one float input (pd->t) as a named array. */
static void tensor_to_arrays(pending *pd, md_arrays *a)
{
    memset(a, 0, sizeof *a);
    a->n = 1;
    md_array *x = &a->a[0];
    snprintf(x->name, sizeof x->name, "%s", pd->v2_input);
    snprintf(x->datatype, sizeof x->datatype, "%s", pd->v2_datatype);
    x->ndim = pd->t.ndim;
    memcpy(x->shape, pd->t.shape, sizeof x->shape);
    x->count = pd->t.count;
    x->f32 = pd->t.data;
    memset(&pd->t, 0, sizeof pd->t);
    pd->have_tensor = 0;
}

/* The request's rows for `m`, which declares inputs, packed into pd->t. */
static md_status named_rows(md_req *req, pending *pd, md_model *m, md_err *err)
{
    md_arrays a;
    md_status st = MD_OK;
    memset(&a, 0, sizeof a);
    if (pd->have_arrays) {
        a = pd->arrays;
        memset(&pd->arrays, 0, sizeof pd->arrays);
        pd->have_arrays = 0;
    } else if (pd->have_tensor && pd->v2 &&
               (!strncmp(pd->v2_datatype, "INT", 3) || !strncmp(pd->v2_datatype, "UINT", 4) ||
                !strcmp(pd->v2_datatype, "BOOL"))) {
        /* one integer V2 input, read as floats before the version was
         * known: read it again, exactly */
        size_t json_len, bin_len, len;
        const char *bin, *body = md_req_body(req, &len);
        v2_parts(req, &json_len, &bin, &bin_len);
        md_tensor_free(&pd->t);
        pd->have_tensor = 0;
        st = v2_named(req, pd, body, json_len, bin, bin_len, err);
        if (st == MD_OK) {
            a = pd->arrays;
            memset(&pd->arrays, 0, sizeof pd->arrays);
            pd->have_arrays = 0;
        }
    } else if (pd->have_tensor) {
        tensor_to_arrays(pd, &a);
    } else {
        size_t len;
        const char *body = md_req_body(req, &len);
        const char *ct = pd->has_content_type ? pd->content_type : NULL;
        md_io_info in[MD_MAX_IO];
        int n = md_model_n_inputs(m);
        for (int i = 0; i < n; i++)
            md_model_input(m, i, &in[i]);
        if (ct && strncasecmp(ct, "application/x-npz", 17) == 0) {
            st = md_npz_decode(body, len, max_values(req), &a, err);
        } else if (ct && strncasecmp(ct, "application/x-npy", 17) == 0) {
            if (n != 1)
                st = md_err_setc(err, MD_EINVAL, "invalid_input",
                                 "model %s version %d takes several inputs, and an NPY body "
                                 "holds one array: send an NPZ body (numpy.savez) with one "
                                 "array per input, by name",
                                 md_model_name(m), md_model_version(m));
            else if ((st = md_npy_decode_array(body, len, max_values(req), &a.a[0], err)) ==
                     MD_OK) {
                a.n = 1;
                snprintf(a.a[0].name, sizeof a.a[0].name, "%s", in[0].name);
                if (a.a[0].ndim == in[0].ndim && a.a[0].ndim < MD_MAX_DIMS) {
                    /* one row without its batch dimension */
                    memmove(a.a[0].shape + 1, a.a[0].shape, sizeof(int64_t) * (MD_MAX_DIMS - 1));
                    a.a[0].shape[0] = 1;
                    a.a[0].ndim++;
                }
            }
        } else if (!md_tensor_json_type(ct)) {
            st = md_err_setc(err, MD_EMEDIA, "unsupported_media_type",
                             "Content-Type %.60s is not accepted; send application/json, "
                             "application/x-npz or application/x-npy",
                             ct);
        } else if (!body || len == 0) {
            st = md_err_setc(err, MD_EINVAL, "empty_body",
                             "the request has no body; send rows such as [{\"%s\": ...}]",
                             in[0].name);
        } else {
            st = md_named_decode(body, len, in, n, max_values(req), &a, &pd->columnar, err);
        }
    }
    if (st == MD_OK)
        st = md_model_pack(m, &a, &pd->t, err);
    md_arrays_free(&a);
    if (st == MD_OK)
        pd->have_tensor = 1;
    return st;
}

/* V2's named arrays for a version that takes one unnamed input: the one
 * input, as floats (as V2 requests were always read for it). */
static md_status arrays_to_tensor(pending *pd, md_model *m, md_err *err)
{
    md_arrays *a = &pd->arrays;
    if (a->n != 1)
        return md_err_setc(err, MD_EINVAL, "invalid_input",
                           "the request has %d inputs, and model %s version %d takes one "
                           "(it declares no config.inputs)",
                           a->n, md_model_name(m), md_model_version(m));
    md_array *x = &a->a[0];
    md_tensor t;
    memset(&t, 0, sizeof t);
    t.ndim = x->ndim;
    memcpy(t.shape, x->shape, sizeof t.shape);
    t.count = x->count;
    if (x->is_int) {
        t.data = md_mallocarray_checked(x->count ? x->count : 1, sizeof(float), "the input", err);
        if (!t.data)
            return MD_ENOMEM;
        for (size_t i = 0; i < x->count; i++)
            t.data[i] = (float)x->i64[i];
    } else {
        t.data = x->f32;
        x->f32 = NULL;
    }
    md_arrays_free(a);
    pd->have_arrays = 0;
    pd->t = t;
    pd->have_tensor = 1;
    return MD_OK;
}

/* V2's "outputs": [{"name"}] against `m`'s declared outputs into c->pick. */
static md_status pick_outputs(const pending *pd, md_model *m, pctx *c, md_err *err)
{
    int n_out = md_model_n_outputs(m);
    if (!pd->v2 || !n_out)
        return MD_OK;
    for (int k = 0; k < pd->n_outs; k++) {
        if (!pd->outs[k][0])
            return md_err_setc(err, MD_EINVAL, "invalid_input",
                               "every entry of \"outputs\" needs the \"name\" of an output");
        for (int p = 0; p < k; p++)
            if (strcmp(pd->outs[p], pd->outs[k]) == 0)
                return md_err_setc(err, MD_EINVAL, "invalid_input",
                                   "output \"%s\" is asked for twice", pd->outs[k]);
        int found = -1;
        for (int j = 0; j < n_out && found < 0; j++) {
            md_io_info oi;
            md_model_output(m, j, &oi);
            if (strcmp(oi.name, pd->outs[k]) == 0)
                found = j;
        }
        if (found < 0) {
            char names[256];
            int len = 0;
            for (int j = 0; j < n_out && len >= 0 && (size_t)len < sizeof names; j++) {
                md_io_info oi;
                md_model_output(m, j, &oi);
                len += snprintf(names + len, sizeof names - (size_t)len, "%s\"%s\"",
                                j ? ", " : "", oi.name);
            }
            return md_err_setc(err, MD_EINVAL, "invalid_input",
                               "output \"%s\" is not one of model %s version %d's outputs (%s)",
                               pd->outs[k], md_model_name(m), md_model_version(m), names);
        }
        c->pick[c->n_pick++] = found;
    }
    return MD_OK;
}

/* Decode the body if not done yet and submit to `m` (a reference, taken).
 * `at`: ON_HANDLER, so big images may go to a deferred thread or the decode
 * pool, and a JSON body of OFFLOAD_BYTES or more is decoded on the decode
 * pool (md_req_offload): its parse (~1 ns a byte) would hold this
 * libmicrohttpd thread, and every connection it serves, meanwhile; so is a
 * V2 JSON request of that size (BODY_V2). NPY is a copy, cheaper than the
 * hand-off, and so is the JSON header of a binary V2 request. */
#define OFFLOAD_BYTES (64 * 1024)
static void go_on(md_req *req, pending *pd, md_model *m, where at)
{
    md_err err;
    md_err_clear(&err);
    if (!pd->have_tensor && pd->body == BODY_V2) {
        if (at == ON_HANDLER) {
            pd->model = m;
            if (md_req_offload(req, rows_offloaded))
                return;
            pd->model = NULL;
        }
        size_t len;
        const char *body = md_req_body(req, &len);
        if (v2_read(req, pd, body, len, NULL, 0, &err) != MD_OK) {
            md_model_release(m);
            md_reply_error(req, &err);
            return;
        }
    }
    if (!pd->have_tensor && !pd->have_arrays && pd->body != BODY_ROWS &&
        !images_to_tensor(req, pd, m, at))
        return;
    if (md_model_n_inputs(m) > 0 && !pd->have_tensor && !pd->have_arrays && at == ON_HANDLER) {
        size_t len;
        md_req_body(req, &len);
        if (len >= OFFLOAD_BYTES) {
            pd->model = m; /* as below: the pool decodes large bodies */
            if (md_req_offload(req, rows_offloaded))
                return;
            pd->model = NULL;
        }
    }
    if (md_model_n_inputs(m) > 0 ? named_rows(req, pd, m, &err) != MD_OK
        : pd->have_arrays       ? arrays_to_tensor(pd, m, &err) != MD_OK
                                : 0) {
        md_model_release(m);
        md_reply_error(req, &err);
        return;
    }
    if (!pd->have_tensor) {
        size_t len;
        const char *body = md_req_body(req, &len);
        const char *ct = pd->has_content_type ? pd->content_type : NULL;
        if (at == ON_HANDLER && len >= OFFLOAD_BYTES && md_tensor_json_type(ct)) {
            pd->model = m; /* the request's state owns it until rows_offloaded takes it */
            if (md_req_offload(req, rows_offloaded))
                return;
            pd->model = NULL; /* no room in the pool: decode here */
        }
        if (md_tensor_decode(body, len, ct, max_values(req), &pd->t, &err) != MD_OK) {
            md_model_release(m);
            md_reply_error(req, &err);
            return;
        }
    }
    pctx *c = md_xcalloc(1, sizeof *c);
    /* refusals that need the version, before anything is queued (the
     * tensor stays the request's: pending_free frees it) */
    if (pick_outputs(pd, m, c, &err) != MD_OK ||
        (pd->npy && md_model_n_outputs(m) > 1 &&
         md_err_setc(&err, MD_EINVAL, "invalid_input",
                     "model %s version %d answers %d outputs, and an NPY body holds one "
                     "array: ask for JSON (Accept: application/json)",
                     md_model_name(m), md_model_version(m), md_model_n_outputs(m)))) {
        free(c);
        md_model_release(m);
        md_reply_error(req, &err);
        return;
    }
    pd->have_tensor = 0; /* submit takes it, even on failure */
    c->top_k = pd->top_k;
    c->npy = pd->npy;
    c->v2 = pd->v2;
    c->v2_binary = pd->v2_binary;
    c->v1 = pd->v1;
    memcpy(c->v2_id, pd->v2_id, sizeof c->v2_id);
    memcpy(c->v2_output, pd->v2_output, sizeof c->v2_output);
    c->columnar = pd->columnar;
    if (pd->unversioned) {
        int sv = md_traffic_shadow(((md_app *)md_req_app(req))->traffic, md_model_name(m),
                                   md_model_version(m));
        if (sv && md_shadow_room(md_model_name(m), md_model_version(m), sv) &&
            md_shadow_copy(&pd->t, &c->shadow_in))
            c->shadow = sv;
    }
    md_tensor t = pd->t;
    submit(req, m, &t, c);
}

/* On a deferred thread: resolve (may load or wait on a load), then go on. */
static void resolve_deferred(md_req *req)
{
    pending *pd = md_req_state(req);
    md_err err;
    md_err_clear(&err);
    md_model *m = md_app_resolve(md_req_app(req), pd->name, pd->version, &err);
    if (!m) {
        md_reply_error(req, &err);
        return;
    }
    go_on(req, pd, m, ON_DEFERRED);
}

/* Takes `pd` (request state from here). */
static void find_and_go(md_req *req, pending *pd)
{
    md_req_set_state(req, pd, pending_free);
    md_err err;
    pd->unversioned = pd->version == 0;
    if (pd->version == 0) /* unversioned: the model's traffic split may choose */
        pd->version = md_traffic_pick(((md_app *)md_req_app(req))->traffic, pd->name, req);
    md_model *m = md_app_lookup(md_req_app(req), pd->name, pd->version, &err);
    if (m)
        go_on(req, pd, m, ON_HANDLER);
    else if (err.status != MD_OK)
        md_reply_error(req, &err); /* known here: not found, a remembered failure */
    else
        md_req_defer(req, resolve_deferred);
}

/* The name answering POST /predict: default_model, else the only model with
 * a loaded default. Returns 0 after replying when there is none. */
static int default_name(md_req *req, char *out, size_t size)
{
    md_app *app = md_req_app(req);
    if (app->cfg->default_model[0]) {
        snprintf(out, size, "%s", app->cfg->default_model);
        return 1;
    }
    json_t *names = md_registry_names(app->registry);
    int ok = json_array_size(names) == 1;
    if (ok) {
        snprintf(out, size, "%s", json_string_value(json_array_get(names, 0)));
    } else {
        md_err err;
        char *list = json_dumps(names, JSON_COMPACT);
        md_err_setc(&err, MD_EINVAL, "no_default_model",
                    json_array_size(names) ? "several models are deployed (%s); use POST "
                                             "/models/NAME/predict or set default_model"
                                           : "no model is deployed%s; deploy one with POST "
                                             "/models/NAME/versions",
                    json_array_size(names) ? list : "");
        free(list);
        md_reply_error(req, &err);
    }
    json_decref(names);
    return ok;
}

/* The JSON/NPY routes; `name` NULL: POST /predict. Query and headers are
 * read here, on the handler thread. `v1`: KServe V1's answer. */
static void predict_as(md_req *req, const char *name, int version, int v1)
{
    md_err err;
    md_err_clear(&err);
    long top_k;
    if (md_req_query_int(req, "top_k", 1, MD_TOP_K_MAX, 0, "invalid_top_k", &top_k, &err) !=
        MD_OK) {
        md_reply_error(req, &err);
        return;
    }
    pending *pd = md_xcalloc(1, sizeof *pd);
    if (name)
        snprintf(pd->name, sizeof pd->name, "%s", name);
    else if (!default_name(req, pd->name, sizeof pd->name)) {
        free(pd);
        return;
    }
    pd->version = version;
    pd->v1 = v1;
    pd->top_k = (int)top_k;
    const char *accept = md_req_header(req, "Accept");
    /* KServe V1 answers {"predictions": ...} whatever Accept says */
    pd->npy = !v1 && accept && strstr(accept, "application/x-npy") != NULL;
    const char *ct = md_req_header(req, "Content-Type");
    if (ct) {
        pd->has_content_type = 1;
        snprintf(pd->content_type, sizeof pd->content_type, "%s", ct);
    }
    size_t len;
    const char *body = md_req_body(req, &len);
    /* KServe V1 takes instances only */
    md_err_clear(&err);
    if (!v1 && classify_body(ct, body, len, &pd->body, &err) == MD_OK &&
        pd->body == BODY_FORM && strlen(ct) >= sizeof pd->content_type)
        md_err_setc(&err, MD_EINVAL, "invalid_multipart",
                    "the Content-Type header has %zu characters, more than the %zu a "
                    "multipart/form-data one may have here",
                    strlen(ct), sizeof pd->content_type - 1);
    if (err.status != MD_OK) {
        free(pd);
        md_reply_error(req, &err);
        return;
    }
    find_and_go(req, pd);
}

static void predict(md_req *req, const char *name, int version)
{
    predict_as(req, name, version, 0);
}

void md_handle_predict_default(md_req *req) { predict(req, NULL, 0); }

void md_handle_predict_model(md_req *req) { predict(req, md_req_param(req, "name"), 0); }

void md_handle_predict_version(md_req *req)
{
    int v;
    if (md_req_version_param(req, &v))
        predict(req, md_req_param(req, "name"), v);
}

/* ---- Open Inference Protocol V2 ---- */

/* The JSON part of a V2 request: the whole body, or with the binary tensor
 * data extension the first Inference-Header-Content-Length bytes, the rest
 * being the inputs' raw values (*bin, *bin_len). Returns 0 after replying. */
static int v2_split(md_req *req, const char *body, size_t len, size_t *json_len,
                    const char **bin, size_t *bin_len)
{
    md_err err;
    const char *h = md_req_header(req, "Inference-Header-Content-Length");
    *json_len = len;
    *bin = NULL;
    *bin_len = 0;
    if (!h)
        return 1;
    char *end;
    errno = 0;
    unsigned long long n = strtoull(h, &end, 10);
    if (errno || end == h || *end || h[0] == '-' || n == 0 || n > len) {
        md_err_setc(&err, MD_EINVAL, "invalid_input",
                    "Inference-Header-Content-Length is '%s'; it must be the byte length of "
                    "the JSON part of the body (1 to %zu)",
                    h, len);
        md_reply_error(req, &err);
        return 0;
    }
    *json_len = (size_t)n;
    *bin = body + n;
    *bin_len = len - (size_t)n;
    return 1;
}

/* The outputs a V2 request asks for by name into pd->outs (an entry
 * without a name as "", refused for a version with declared outputs). */
static void v2_output_names(pending *pd, json_t *outs)
{
    pd->n_outs = 0;
    for (size_t k = 0; k < json_array_size(outs) && k < MD_MAX_IO; k++) {
        const char *on = json_string_value(json_object_get(json_array_get(outs, k), "name"));
        snprintf(pd->outs[pd->n_outs++], sizeof pd->outs[0], "%.*s",
                 (int)sizeof pd->outs[0] - 1, on ? on : "");
    }
}

/* Whether the request asks for its output as binary data: the output's
 * "parameters": {"binary_data": true}, or the request's
 * "binary_data_output": true (what tritonclient sends). */
static int v2_wants_binary(json_t *root)
{
    json_t *outs = json_object_get(root, "outputs");
    json_t *p = json_object_get(json_array_get(outs, 0), "parameters");
    json_t *b = json_object_get(p, "binary_data");
    if (b)
        return json_is_true(b);
    return json_is_true(json_object_get(json_object_get(root, "parameters"),
                                        "binary_data_output"));
}

/* Read a V2 request (its JSON part, and the binary data after it with the
 * extension) into `pd`: the input tensor, the id and output name to answer
 * with, whether the output goes back as binary. The JSON part of a request
 * without binary data goes through md_v2_parse, which reads a large "data"
 * array with the row scanner. MD_OK, or the error to answer. Any thread. */
static md_status v2_read(md_req *req, pending *pd, const char *body, size_t json_len,
                         const char *bin, size_t bin_len, md_err *err)
{
    int decoded = 0;
    md_tensor t;
    memset(&t, 0, sizeof t);
    /* with binary data the JSON part holds no data for the row scanner */
    json_t *root = md_v2_parse(body, json_len, max_values(req), !bin, &t, &decoded, err);
    if (!root)
        return err->status;
    json_t *inputs = json_object_get(root, "inputs");
    if (!json_is_array(inputs) || json_array_size(inputs) < 1 ||
        json_array_size(inputs) > MD_MAX_IO) {
        md_tensor_free(&t);
        json_decref(root);
        return md_err_set(err, MD_EINVAL, "the request needs \"inputs\": an array of 1 to %d "
                          "tensors", MD_MAX_IO);
    }
    json_t *in = json_array_get(inputs, 0);
    json_t *outs = json_object_get(root, "outputs");
    v2_output_names(pd, outs);
    const char *dt0 = json_string_value(json_object_get(in, "datatype"));
    if (json_array_size(inputs) > 1) {
        /* several inputs: read by name, their data where it lies (v2_named) */
        md_tensor_free(&t);
        json_decref(root);
        return v2_named(req, pd, body, json_len, bin, bin_len, err);
    }
    const char *in_name = json_string_value(json_object_get(in, "name"));
    snprintf(pd->v2_input, sizeof pd->v2_input, "%s", in_name ? in_name : "");
    snprintf(pd->v2_datatype, sizeof pd->v2_datatype, "%s", dt0 && strlen(dt0) < 8 ? dt0 : "");
    json_t *bsize = json_object_get(json_object_get(in, "parameters"), "binary_data_size");
    md_status st;
    if (decoded) {
        st = MD_OK; /* no binary data, no binary_data_size: md_v2_parse read it */
    } else if (bsize) {
        if (!json_is_integer(bsize) || json_integer_value(bsize) < 0 ||
            (unsigned long long)json_integer_value(bsize) != bin_len)
            st = md_err_set(err, MD_EINVAL,
                            bin ? "input binary_data_size must be the %zu bytes that follow the "
                                  "JSON header"
                                : "input binary_data_size needs the Inference-Header-Content-"
                                  "Length header (%zu bytes of binary data follow no header)",
                            bin_len);
        else
            st = md_v2_decode_binary(in, bin, bin_len, max_values(req), &t, err);
    } else if (bin_len) {
        st = md_err_set(err, MD_EINVAL,
                        "%zu bytes follow the JSON header but no input has "
                        "\"parameters\": {\"binary_data_size\": N}",
                        bin_len);
    } else {
        st = md_v2_decode(in, max_values(req), &t, err);
    }
    if (st != MD_OK) {
        json_decref(root);
        return st;
    }
    pd->v2_binary = v2_wants_binary(root);
    pd->t = t;
    pd->have_tensor = 1;
    const char *id = json_string_value(json_object_get(root, "id"));
    snprintf(pd->v2_id, sizeof pd->v2_id, "%s", id ? id : "");
    const char *oname = json_string_value(json_object_get(json_array_get(outs, 0), "name"));
    snprintf(pd->v2_output, sizeof pd->v2_output, "%s", oname ? oname : "output0");
    json_decref(root);
    return MD_OK;
}

static void v2_infer(md_req *req, int version)
{
    md_err err;
    md_err_clear(&err);
    const char *name = md_req_param(req, "name");
    size_t len, json_len, bin_len;
    const char *body = md_req_body(req, &len), *bin;
    if (!v2_split(req, body, len, &json_len, &bin, &bin_len))
        return;
    pending *pd = md_xcalloc(1, sizeof *pd);
    snprintf(pd->name, sizeof pd->name, "%s", name);
    pd->version = version;
    pd->v2 = 1;
    if (!bin && json_len >= OFFLOAD_BYTES) {
        /* read after the lookup, on the decode pool (go_on) */
        pd->body = BODY_V2;
    } else if (v2_read(req, pd, body, json_len, bin, bin_len, &err) != MD_OK) {
        pending_free(pd);
        md_reply_error(req, &err);
        return;
    }
    find_and_go(req, pd);
}

void md_handle_v2_infer(md_req *req) { v2_infer(req, 0); }

void md_handle_v2_infer_version(md_req *req)
{
    int v;
    if (md_req_version_param(req, &v))
        v2_infer(req, v);
}

/* The V2 datatype of a config dtype. */
static const char *v2_datatype(const char *dtype)
{
    return !dtype || !strcmp(dtype, "float32") ? "FP32"
           : !strcmp(dtype, "float64")         ? "FP64"
           : !strcmp(dtype, "int64")           ? "INT64"
           : !strcmp(dtype, "int32")           ? "INT32"
           : !strcmp(dtype, "bool")            ? "BOOL"
                                               : "UINT8";
}

static void v2_model_meta(md_req *req, int version)
{
    md_app *app = md_req_app(req);
    md_err err;
    const char *name = md_req_param(req, "name");
    json_t *info = NULL;
    if (md_store_get_model(app->store, name, &info, &err) != MD_OK) {
        md_reply_error(req, &err);
        return;
    }
    json_t *versions = json_array();
    size_t i;
    json_t *v, *chosen = NULL;
    json_int_t def = json_integer_value(json_object_get(info, "default_version"));
    json_array_foreach(json_object_get(info, "versions"), i, v)
    {
        json_int_t n = json_integer_value(json_object_get(v, "version"));
        char s[24];
        snprintf(s, sizeof s, "%lld", (long long)n);
        json_array_append_new(versions, json_string(s));
        if (n == (version ? version : def))
            chosen = v;
    }
    if (!chosen) {
        json_decref(versions);
        json_decref(info);
        md_err_setc(&err, MD_ENOTFOUND, "version_not_found", "model %s has no version %d", name,
                    version);
        md_reply_error(req, &err);
        return;
    }
    json_t *cfg = json_object_get(chosen, "config");
    if (json_object_get(cfg, "inputs") || json_object_get(cfg, "outputs")) {
        /* declared inputs and outputs, as tritonclient lists them */
        json_t *ins = json_array(), *outs = json_array();
        json_t *e;
        json_array_foreach(json_object_get(cfg, "inputs"), i, e)
        {
            json_t *sh = json_array();
            json_array_append_new(sh, json_integer(-1));
            json_t *d;
            size_t k;
            json_array_foreach(json_object_get(e, "shape"), k, d) json_array_append(sh, d);
            json_array_append_new(ins, json_pack("{s:O,s:s,s:o}", "name",
                                                 json_object_get(e, "name"), "datatype",
                                                 v2_datatype(json_string_value(
                                                     json_object_get(e, "dtype"))),
                                                 "shape", sh));
        }
        if (!json_object_get(cfg, "inputs")) {
            json_t *sh = json_array();
            json_array_append_new(sh, json_integer(-1));
            json_t *d;
            size_t k;
            json_array_foreach(json_object_get(json_object_get(cfg, "input"), "shape"), k, d)
                json_array_append(sh, d);
            json_array_append_new(ins, json_pack("{s:s,s:s,s:o}", "name", "input0", "datatype",
                                                 v2_datatype(json_string_value(json_object_get(
                                                     json_object_get(cfg, "input"), "dtype"))),
                                                 "shape", sh));
        }
        json_array_foreach(json_object_get(cfg, "outputs"), i, e)
        {
            json_t *sh = json_array();
            json_array_append_new(sh, json_integer(-1));
            json_t *d;
            size_t k;
            json_array_foreach(json_object_get(e, "shape"), k, d) json_array_append(sh, d);
            if (!json_object_get(e, "shape"))
                json_array_append_new(sh, json_integer(-1));
            json_array_append_new(outs, json_pack("{s:O,s:s,s:o}", "name",
                                                  json_object_get(e, "name"), "datatype", "FP32",
                                                  "shape", sh));
        }
        if (!json_array_size(outs))
            json_array_append_new(outs, json_pack("{s:s,s:s,s:[i]}", "name", "output0",
                                                  "datatype", "FP32", "shape", -1));
        json_t *meta = json_pack("{s:s,s:o,s:s,s:o,s:o}", "name", name, "versions", versions,
                                 "platform", "pytorch_torchscript", "inputs", ins, "outputs",
                                 outs);
        json_decref(info);
        md_reply_json(req, 200, meta);
        return;
    }
    json_t *shape = json_array();
    json_array_append_new(shape, json_integer(-1));
    json_t *cshape = json_object_get(json_object_get(json_object_get(chosen, "config"), "input"),
                                     "shape");
    json_t *d;
    json_array_foreach(cshape, i, d) json_array_append(shape, d);
    const char *dtype = json_string_value(json_object_get(
        json_object_get(json_object_get(chosen, "config"), "input"), "dtype"));
    const char *v2type = !dtype || !strcmp(dtype, "float32") ? "FP32"
                         : !strcmp(dtype, "float64")         ? "FP64"
                         : !strcmp(dtype, "int64")           ? "INT64"
                                                             : "UINT8";
    json_t *out = json_pack("{s:s,s:o,s:s,s:[{s:s,s:s,s:o}],s:[{s:s,s:s,s:[i]}]}", "name", name,
                            "versions", versions, "platform", "pytorch_torchscript", "inputs",
                            "name", "input0", "datatype", v2type, "shape", shape, "outputs", "name",
                            "output0", "datatype", "FP32", "shape", -1);
    json_decref(info);
    md_reply_json(req, 200, out);
}

void md_handle_v2_model(md_req *req) { v2_model_meta(req, 0); }

void md_handle_v2_model_version(md_req *req)
{
    int v;
    if (md_req_version_param(req, &v))
        v2_model_meta(req, v);
}

/* {"name", "ready", "loaded"}: 200 when the version serves a request now:
 * loaded here, or stored and not failed (its first request loads it, as
 * for a default unloaded to free memory under max_loaded_bytes: a load
 * balancer must not take the replica out of rotation for that). 503 while
 * the server starts or drains, for a model without a default, and for a
 * version whose load failed (with the reason); 404 when the model or the
 * version does not exist. */
static void model_ready(md_req *req, const char *name, int version)
{
    md_app *app = md_req_app(req);
    md_model *m = md_registry_get(app->registry, name, version);
    md_model_release(m);
    if (m && atomic_load(&app->ready) == MD_READY) {
        md_reply_json(req, 200, json_pack("{s:s,s:b,s:b}", "name", name, "ready", 1, "loaded", 1));
        return;
    }
    md_err err;
    json_t *info = NULL;
    if (md_store_get_model(app->store, name, &info, &err) != MD_OK) {
        md_reply_error(req, &err);
        return;
    }
    int v = version;
    if (!v)
        v = (int)json_integer_value(json_object_get(info, "default_version"));
    json_decref(info);
    json_t *row = NULL;
    if (v && md_store_get_version(app->store, name, v, &row, &err) != MD_OK) {
        md_reply_error(req, &err);
        return;
    }
    const char *state = json_string_value(json_object_get(row, "state"));
    int failed = state && strcmp(state, "failed") == 0;
    int ready = v && !failed && atomic_load(&app->ready) == MD_READY;
    json_t *out = json_pack("{s:s,s:b,s:b}", "name", name, "ready", ready, "loaded", m != NULL);
    if (!ready) {
        const char *why = !v ? "the model has no default version"
                          : failed ? json_string_value(json_object_get(row, "state_reason"))
                          : "the server is starting or shutting down";
        json_object_set_new(out, "reason", json_string(why ? why : "its load failed"));
    }
    json_decref(row);
    md_reply_json(req, ready ? 200 : 503, out);
}

static void v2_model_ready(md_req *req, int version)
{
    model_ready(req, md_req_param(req, "name"), version);
}

void md_handle_v2_model_ready(md_req *req) { v2_model_ready(req, 0); }

void md_handle_v2_model_version_ready(md_req *req)
{
    int v;
    if (md_req_version_param(req, &v))
        v2_model_ready(req, v);
}

void md_handle_v2_live(md_req *req) { md_reply_json(req, 200, json_pack("{s:b}", "live", 1)); }

void md_handle_v2_ready(md_req *req)
{
    md_app *app = md_req_app(req);
    int ready = atomic_load(&app->ready) == MD_READY;
    md_reply_json(req, ready ? 200 : 503, json_pack("{s:b}", "ready", ready));
}

void md_handle_v2_server(md_req *req)
{
    md_reply_json(req, 200,
                  json_pack("{s:s,s:s,s:[s]}", "name", "modeld", "version", MODELD_VERSION,
                            "extensions", "binary_tensor_data"));
}

/* ---- KServe V1 (TF Serving's REST shape) ----
 * POST /v1/models/NAME:predict {"instances": rows} answers {"predictions":
 * rows} from the default version; GET /v1/models/NAME answers readiness. */

void md_handle_v1_predict(md_req *req) { predict_as(req, md_req_param(req, "name"), 0, 1); }

void md_handle_v1_model(md_req *req) { model_ready(req, md_req_param(req, "name"), 0); }
