/*
 * gzstream.h - a file read as it is, or inflated as it goes when it is gzip,
 * for the IDX reader (readers.c): what zlib's gzread did there, at twice its
 * speed (ISA-L's igzip inflate: 1.4 us instead of 2.8 us a 784-byte row on
 * this machine's cores, the runner's whole cost of an IDX.gz job row).
 *
 * A file whose first two bytes are gzip's magic (1f 8b) is inflated; any
 * other is read as it is. Members of a multi-member gzip file follow one
 * another; bytes after the last member that do not start another are
 * ignored, as gzread ignores them. A member's CRC-32 is checked at its end.
 *
 * Thread safety: one md_gz is used by one thread at a time.
 */
#ifndef MD_GZSTREAM_H
#define MD_GZSTREAM_H

#include <stddef.h>

typedef struct md_gz md_gz;

/* Opens `path` for reading. NULL with errno set when it cannot be opened (or
 * ENOMEM). A directory opens; its first read fails (EISDIR). */
md_gz *md_gz_open(const char *path);

/* Reads up to n bytes into buf; returns how many. Fewer than n only at the
 * end of the data or on an error: md_gz_error() then says which. */
size_t md_gz_read(md_gz *g, void *buf, size_t n);

/* NULL when the last short read was the end of the data. Otherwise what
 * went wrong, for a message: "read failed: <strerror>" (sys_errno set to the
 * errno), or a gzip problem such as "unexpected end of file" or "invalid
 * compressed data (a bad deflate block)" or "incorrect data check (CRC-32 or
 * length)" (sys_errno 0). */
const char *md_gz_error(const md_gz *g, int *sys_errno);

void md_gz_close(md_gz *g);

/* 1 when the file is gzip (inflated as it is read), which has no random
 * access: a chunked job keeps it one chunk. */
int md_gz_is_gzip(const md_gz *g);

#endif
