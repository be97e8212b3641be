/*
 * writers.h - PRIVATE to jobs/: a batch job's output, written by writers.c
 * for the scheduler (scheduler.c). Not part of jobs.h: nothing outside the
 * scheduler writes job output.
 *
 * Thread safety: every function works on what it is given (one job's
 * buffers, descriptors and md_job_outfile, used by that job's runner only).
 */
#ifndef MD_JOB_WRITERS_H
#define MD_JOB_WRITERS_H

#include <jansson.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "jobs.h"

/* The NPY output's header slot: written first with a placeholder shape and
 * rewritten in place with the final one when the job ends. */
#define MD_JOB_NPY_HEADER 128

/* Write all `n` bytes of `p` to `fd` (retrying short writes and EINTR);
 * 0, or -1 with errno. */
int md_job_write_all(int fd, const char *p, size_t n);

/* ---- output formats ---- */

/* Whether output.include (a JSON array of strings, borrowed) names `what`;
 * `dflt` when there is no include list. */
int md_job_include_has(json_t *include, const char *what, int dflt);

typedef struct md_job_outfmt {
    int kind; /* 0 jsonl, 1 csv, 2 npy */
    int inc_index, inc_pred, inc_label, inc_scores;
    int inc_path; /* images inputs: the file's path relative to input.path */
    int top_k;
    int header_written;
} md_job_outfmt;

/* Append one output row (JSON Lines or CSV per `o`) to the growing buffer
 * `*b` (`*len` used of `*cap`, grown with realloc). `m` is borrowed for its
 * labels; `path` names the row's file (images; NULL: none); `y` holds the
 * row's cls->width outputs, read as classes by `cls` (md_model_classes). */
/* For a version with declared outputs, `outs` is the row's whole answer
 * (md_model_output_values floats): each output is written as a field of its
 * name (CSV: a column per value, NAME_0, NAME_1, ...), and `y` is the classes
 * output's part of it (NULL with `cls` NONE when no output is marked); NULL
 * otherwise. */
void md_job_format_row(char **b, size_t *len, size_t *cap, const md_job_outfmt *o, md_model *m,
                       int64_t index, const char *path, const float *y, const md_classes *cls,
                       int has_label, int64_t label, const float *outs);

/* An NPY (<f4) header of `rows` x shape[1..ndim) into `out`, padded to the
 * fixed slot. */
void md_job_npy_header(char out[MD_JOB_NPY_HEADER], int64_t rows, const int64_t *shape, int ndim);

/* ---- the output file ---- */

typedef struct md_job_outfile {
    int dirfd;
    char leaf[256];
    char partial[300];
    const char *path; /* the output path, for messages */
} md_job_outfile;

/* Open the directory the output goes in: output.path's under `allowed_paths`
 * (no symlink followed), else the store's jobs/ directory; fills `of`
 * (of->dirfd is -1 until then, closed by the caller). */
md_status md_job_out_open_dir(const md_strlist *allowed_paths, md_store *store, json_t *output,
                              const char *out_path, md_job_outfile *of, md_err *err);

/* This run's partial file, positioned at `out_bytes`; `fresh`: nothing is
 * committed yet. `in_fd` (or -1) is the input, which must not be the
 * output; `lost` is checked before the new file replaces the old. Returns
 * the descriptor, or -1 with `err` set. */
int md_job_out_open_partial(md_job_outfile *of, int fresh, long long out_bytes, int in_fd,
                            const atomic_int *lost, md_err *err);

/* The output as written so far becomes the job's file (finished or
 * cancelled alike): an NPY gets its final header, the data is made durable,
 * then published under its name; *fd is closed on success. */
md_status md_job_out_finish(md_job_outfile *of, int *fd, int npy, long long out_bytes,
                            int64_t rows, const char *partial, md_err *err);

#endif
