/*
 * images.h - PRIVATE to jobs/: the dataset reader over a folder of images
 * (input.format "images"), which readers.c puts behind md_reader. The
 * contract users see is md_reader's in jobs.h; this header only splits the
 * folder reader out of readers.c.
 *
 * Thread safety: one md_images per job runner, like md_reader.
 */
#ifndef MD_JOB_IMAGES_H
#define MD_JOB_IMAGES_H

#include <stdint.h>

#include "jobs.h"

typedef struct md_images md_images;

/* List and sort the images under opts->path (a directory; see images.c's
 * DESIGN), learn the classes. `name` (borrowed for the call) names the
 * dataset in messages. MD_EINVAL (invalid_dataset) naming the problem;
 * MD_ETOOBIG past opts->max_files. */
md_status md_images_open(const md_reader_opts *opts, const char *name, md_images **out,
                         md_err *err);
/* Values per row (md_image_values of the version's preprocess.image). */
int64_t md_images_width(const md_images *im);
/* Images listed (rows). */
int64_t md_images_count(const md_images *im);
/* 1 when rows carry labels (folder or regex). */
int md_images_has_labels(const md_images *im);
/* Files under the directory left out of the rows: symlinks, non-regular
 * files, files that are neither PNG nor JPEG. */
int64_t md_images_skipped(const md_images *im);
/* Image `index`'s path relative to the directory; borrowed, valid until
 * md_images_close. NULL past the end. */
const char *md_images_path(const md_images *im, int64_t index);
/* Decode image `index` into `row`, its class into *label (-1: none).
 * MD_EINVAL for a bad row (corrupt, truncated, too many pixels, no label),
 * naming `name`, the row and the file; MD_ENOMEM; MD_ENOTFOUND past the end. */
md_status md_images_read(md_images *im, int64_t index, float *row, int64_t *label, md_err *err);
/* Accepts NULL. */
void md_images_close(md_images *im);

#endif
