/*
 * answer.h - the JSON answers of the prediction routes (private to
 * handlers/): modeld's own {"model", "version", "predictions", "labels",
 * "scores"}, KServe V1's {"predictions"} and the Open Inference Protocol V2
 * inference response (JSON, or with the binary tensor data extension).
 *
 * Encoded on the worker thread that computed the answer, so its cost is the
 * worker's: numbers go through md_float_format (the shortest digits that read
 * back as the same float32, std::to_chars), labels are escaped by hand, and
 * the buffer grows by doubling; bench/decode.c measures it per value.
 *
 * Thread safety: a pure function of its arguments.
 */
#ifndef MD_ANSWER_H
#define MD_ANSWER_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#include "../predictor/predictor.h"

typedef enum md_answer_kind {
    MD_ANSWER_PREDICT = 0, /* POST /predict and the model routes */
    MD_ANSWER_V1,          /* KServe V1: {"predictions": ...} */
    MD_ANSWER_V2,          /* Open Inference Protocol V2 */
} md_answer_kind;

typedef struct md_answer_opts {
    md_answer_kind kind;
    const char *model;      /* the model's name */
    int version;
    json_t *labels;         /* the version's labels (borrowed) or NULL */
    md_classes classes;     /* how a row reads as classes (labels, scores, top_k) */
    int top_k;              /* 0: not asked */
    const char *v2_id;      /* V2: the request's id ("" or NULL: none) */
    const char *v2_output;  /* V2: the output's name ("" or NULL: output0) */
    int v2_binary;          /* V2: the values as raw float32 after the JSON */
    /* declared outputs (md_model_n_outputs > 0): `out` is then [rows,
     * out_values], output j's row at outs[j].off */
    int n_out;
    md_io_info outs[MD_MAX_IO];
    int64_t out_values;
    int class_out;          /* the output labels and scores read; -1: none */
    int columnar;           /* PREDICT: {"outputs": ...} for a columnar request */
    int n_pick;             /* V2: the outputs asked for (0: all), by index */
    int pick[MD_MAX_IO];
} md_answer_opts;

/*
 * Encode the answer for `out` (C order float32 of shape[0..ndim)). Returns a
 * new malloc'd buffer of *len bytes (the caller frees it or hands it to
 * md_reply_bytes), and in *json_len the length of its JSON part (all of it
 * but for V2 binary data); NULL when memory runs out (the answer's size is
 * the request's rows times the outputs, so this is a 503, never an abort).
 */
char *md_answer_encode(const md_answer_opts *o, const float *out, const int64_t *shape, int ndim,
                       size_t *len, size_t *json_len);

#endif
