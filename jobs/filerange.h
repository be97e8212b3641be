/*
 * filerange.h - a byte range of a local file as a pipe (issue 26).
 *
 * A chunk of a job over every replica reads [0, head) and [from, to) of its
 * input: the header, then its own rows. An S3 input gives them through
 * md_s3_stream_open_range; a local file (under allowed_paths, at the same
 * path on every replica) through this, so the readers see the same thing:
 * a pipe whose bytes are those ranges, read by pread on a thread.
 */
#ifndef MD_FILERANGE_H
#define MD_FILERANGE_H

#include "../config/md_err.h"

typedef struct md_filerange md_filerange;

/* Start streaming [0, head) then [from, to) of `src` (a regular file; the
 * stream takes it and closes it; to < 0: its end). *fd is the read end of
 * the pipe, which the caller closes. Blocks only to start the thread. */
md_status md_filerange_open(int src, long long head, long long from, long long to, int *fd,
                            md_filerange **out, md_err *err);

/* The file's size and modification time when it was opened ("SIZE:MTIME"):
 * a plan records it, and a chunk that finds another one was planned on a
 * different file (as an S3 ETag). */
const char *md_filerange_tag(const md_filerange *r);

/* MD_OK once every byte was written; MD_EIO (in `err`) when a read failed,
 * MD_ECONFLICT input_changed when the file ended early (it changed since
 * the job was planned). */
md_status md_filerange_status(md_filerange *r, md_err *err);

/* Stop (a reader that stopped early) and free. Accepts NULL. */
void md_filerange_close(md_filerange *r);

#endif
