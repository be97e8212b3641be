/*
 * s3_images.h - PRIVATE to jobs/: a folder of images in S3 split into
 * chunks by index (issue 26). The planning replica lists the folder once
 * (md_job_s3_images_list) and records the listing in the job's plan; each
 * chunk downloads only its own images (md_job_s3_images_fetch) and reads
 * them through the images reader with that listing (md_reader_opts'
 * image_list), so its rows, labels and paths are the whole folder's.
 *
 * Thread safety: every call blocks and uses handles of its own.
 */
#ifndef MD_JOB_S3_IMAGES_H
#define MD_JOB_S3_IMAGES_H

#include <stdint.h>

#include "jobs.h"

/* Most bytes a listing's paths and ETags take in a job's plan (the plan is
 * one row in the index, read by every chunk): past it the job fails with
 * listing_too_large. At ~60-byte keys, ~150,000 images. */
#define MD_JOB_S3_LISTING_MAX_BYTES (16L * 1024 * 1024)

/*
 * List the images of the folder `url` (s3://BUCKET/PREFIX/) as the single
 * runner's copy-and-walk sees them (images.c's DESIGN): keys sorted by
 * strcmp, names starting with a dot (and whatever is under them) left out,
 * objects that are empty, larger than max_file_bytes or neither PNG nor JPEG
 * by their first bytes (one small Range GET each, If-Match its ETag)
 * counted in *skipped; past max_files objects or entries MD_ETOOBIG
 * too_many_files; deeper than MD_IMAGES_MAX_DEPTH MD_EINVAL.
 * On success *listing is a new object {"paths": [...], "etags": [...]}
 * (the caller's reference), paths relative to the folder. keep_going (may
 * be NULL) is asked between objects; 0 stops with MD_ECONFLICT.
 */
md_status md_job_s3_images_list(const char *url, const md_fetch_opts *o, int64_t max_files,
                                long long max_file_bytes, int (*keep_going)(void *ctx), void *ctx,
                                json_t **listing, int64_t *skipped, md_err *err);

/*
 * Download the images [from, to) of `listing` (as md_job_s3_images_list
 * made it) into the empty directory dirfd at their relative paths, each
 * checked against its planned ETag: one replaced or deleted since the plan
 * is MD_ECONFLICT input_changed. Nothing else of the folder is read.
 */
md_status md_job_s3_images_fetch(const char *url, const md_fetch_opts *o, json_t *listing,
                                 int64_t from, int64_t to, int dirfd, int (*keep_going)(void *ctx),
                                 void *ctx, md_err *err);

#endif
