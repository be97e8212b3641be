/*
 * npzset.h - PRIVATE to jobs/: an NPZ dataset (numpy.savez or
 * savez_compressed of one array per model input), read row by row for the
 * dataset reader (readers.c, format "npz"). Not part of jobs.h.
 *
 * Thread safety: one reader per job, like md_reader.
 */
#ifndef MD_JOB_NPZSET_H
#define MD_JOB_NPZSET_H

#include <stdint.h>

#include "jobs.h"

typedef struct md_npzset md_npzset;

/* Open the NPZ file at `path` (`name` its base name, for messages) for the
 * version's inputs in[0..n) (borrowed for the set's life), each from the
 * member of its name, and `label` (NULL: none) from the member so named (one
 * integer a row). Every member's dtype and shape are checked here: integer
 * arrays for integer inputs, rows of the input's shape, one row count. */
md_status md_npzset_open(const char *path, const char *name, const md_io_info *in, int n,
                         const char *label, md_npzset **out, md_err *err);
int64_t md_npzset_rows(const md_npzset *s);
/* Row `rowno` (the next one) as md_model_pack lays it out (row words: each
 * input at in[i].off, integers as int64 in two words); its label into
 * *label when there is a label member. MD_EINVAL names the member and row
 * (a damaged member, a value its dtype does not hold); MD_EIO. */
md_status md_npzset_next(md_npzset *s, int64_t rowno, float *row, int64_t *label, md_err *err);
/* Accepts NULL. */
void md_npzset_close(md_npzset *s);

#endif
