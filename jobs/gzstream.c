/*
 * gzstream.c - see gzstream.h.
 *
 * DESIGN
 * Two buffers: `in` holds file bytes (the two bytes sniffed at open first),
 * `out` what the inflater wrote and the caller has not taken yet. A plain
 * file's bytes go from `in` to the caller; a gzip file's through
 * isal_inflate. Each member's header (RFC 1952: the fixed ten bytes, then
 * FEXTRA, FNAME, FCOMMENT, FHCRC as its flags say) is parsed here, as a
 * stream, with the same checks as zlib's (method 8, no reserved flag, the
 * header CRC when FHCRC is set); the inflater then gets the raw deflate data
 * and checks the trailer, CRC-32 and length (ISAL_GZIP_NO_HDR_VER). ISA-L's
 * own header parser (ISAL_GZIP) was not kept: it cannot resume a header cut
 * by a read boundary (its flags come from an uninitialised local; isa-l
 * issue 224), and every 128 KiB of a multi-member file is such a boundary.
 * When a member ends, the next two input bytes decide: gzip's magic starts
 * another member, anything else is ignored, as zlib's gzread does. The
 * inflater keeps no pointer into `in` between calls, so `in` may be
 * compacted between them. Input that ends inside a member is an error
 * ("unexpected end of file"), never a silent short file: the reader says
 * which row it cut.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <isa-l/igzip_lib.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

#include "gzstream.h"

/* The buffers; tests/fuzz_gzstream.c builds with tiny ones (>= 16), so that
 * every header field and trailer is cut by a read somewhere. */
#ifndef MD_GZ_IN_SIZE
#define MD_GZ_IN_SIZE (128 * 1024)
#endif
#ifndef MD_GZ_OUT_SIZE
#define MD_GZ_OUT_SIZE (128 * 1024)
#endif
#define IN_SIZE MD_GZ_IN_SIZE
#define OUT_SIZE MD_GZ_OUT_SIZE

struct md_gz {
    int fd;
    int gzip;
    int in_eof;        /* read() gave 0: no more file bytes */
    int done;          /* no more data: the end, or an error */
    int sys_errno;
    const char *err;   /* NULL, or a static message */
    char errbuf[96];
    unsigned char *in;
    size_t in_pos, in_len;   /* unread file bytes: in[in_pos, in_len) */
    unsigned char *out;
    size_t out_pos, out_len; /* inflated bytes not taken: out[out_pos, out_len) */
    struct inflate_state *st;
    int in_member;     /* gzip: a member's header is parsed and its data inflating */
};

static void fail_errno(md_gz *g, int e)
{
    g->sys_errno = e;
    snprintf(g->errbuf, sizeof g->errbuf, "read failed: %s", strerror(e));
    g->err = g->errbuf;
    g->done = 1;
}

static void fail(md_gz *g, const char *msg)
{
    g->err = msg;
    g->done = 1;
}

/* Move the unread bytes to the front and read more behind them. 0, or -1
 * on a read error (recorded). Sets in_eof at the end of the file. */
static int fill(md_gz *g)
{
    if (g->in_pos > 0) {
        memmove(g->in, g->in + g->in_pos, g->in_len - g->in_pos);
        g->in_len -= g->in_pos;
        g->in_pos = 0;
    }
    while (!g->in_eof && g->in_len < IN_SIZE) {
        ssize_t r = read(g->fd, g->in + g->in_len, IN_SIZE - g->in_len);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            fail_errno(g, errno);
            return -1;
        }
        if (r == 0)
            g->in_eof = 1;
        g->in_len += (size_t)r;
        break; /* one read a call: a pipe or a slow disk need not fill it */
    }
    return 0;
}

md_gz *md_gz_open(const char *path)
{
    md_gz *g = calloc(1, sizeof *g);
    if (!g) {
        errno = ENOMEM;
        return NULL;
    }
    g->fd = open(path, O_RDONLY | O_CLOEXEC);
    if (g->fd < 0) {
        int e = errno;
        free(g);
        errno = e;
        return NULL;
    }
    g->in = malloc(IN_SIZE);
    if (!g->in) {
        md_gz_close(g);
        errno = ENOMEM;
        return NULL;
    }
    /* sniff the magic: a directory or an unreadable file reads as plain,
     * and its error comes with the first read */
    while (g->in_len < 2 && !g->in_eof && !g->done)
        fill(g);
    if (g->in_len >= 2 && g->in[0] == 0x1f && g->in[1] == 0x8b) {
        g->out = malloc(OUT_SIZE);
        g->st = malloc(sizeof *g->st);
        if (!g->out || !g->st) {
            md_gz_close(g);
            errno = ENOMEM;
            return NULL;
        }
        g->gzip = 1;
    }
    return g;
}

static const char *inflate_message(int ret)
{
    switch (ret) {
    case ISAL_INVALID_BLOCK: return "invalid compressed data (a bad deflate block)";
    case ISAL_INVALID_SYMBOL: return "invalid compressed data (a bad deflate symbol)";
    case ISAL_INVALID_LOOKBACK: return "invalid compressed data (a distance too far back)";
    case ISAL_INVALID_WRAPPER: return "invalid gzip header";
    case ISAL_UNSUPPORTED_METHOD: return "unknown compression method in the gzip header";
    case ISAL_INCORRECT_CHECKSUM: return "incorrect data check (CRC-32 or length)";
    default: return "invalid compressed data";
    }
}

/* At least k (<= IN_SIZE) unread bytes in `in`. 0, or -1 (recorded: a
 * read error, or the file ends first). */
static int need(md_gz *g, size_t k)
{
    while (g->in_len - g->in_pos < k) {
        if (g->in_eof) {
            fail(g, "unexpected end of file");
            return -1;
        }
        if (fill(g) != 0)
            return -1;
    }
    return 0;
}

/* Pass over `count` header bytes (FEXTRA's), into the header CRC. */
static int skip_bytes(md_gz *g, size_t count, uLong *crc)
{
    while (count > 0) {
        if (need(g, 1) != 0)
            return -1;
        size_t k = g->in_len - g->in_pos < count ? g->in_len - g->in_pos : count;
        *crc = crc32(*crc, g->in + g->in_pos, (uInt)k);
        g->in_pos += k;
        count -= k;
    }
    return 0;
}

/* Pass over a NUL-terminated header string (FNAME, FCOMMENT), of any length. */
static int skip_string(md_gz *g, uLong *crc)
{
    for (;;) {
        if (need(g, 1) != 0)
            return -1;
        size_t avail = g->in_len - g->in_pos;
        const unsigned char *nul = memchr(g->in + g->in_pos, 0, avail);
        size_t k = nul ? (size_t)(nul - (g->in + g->in_pos)) + 1 : avail;
        *crc = crc32(*crc, g->in + g->in_pos, (uInt)k);
        g->in_pos += k;
        if (nul)
            return 0;
    }
}

/* Parse the header of the member at in[in_pos] and set the inflater up for
 * its data. 0, or -1 (recorded). */
static int member_header(md_gz *g)
{
    if (need(g, 10) != 0)
        return -1;
    const unsigned char *h = g->in + g->in_pos;
    if (h[0] != 0x1f || h[1] != 0x8b) {
        fail(g, "invalid gzip header");
        return -1;
    }
    if (h[2] != 8) {
        fail(g, "unknown compression method in the gzip header");
        return -1;
    }
    int flags = h[3];
    if (flags & 0xe0) {
        fail(g, "unknown flags set in the gzip header");
        return -1;
    }
    uLong crc = crc32(0L, h, 10);
    g->in_pos += 10;
    if (flags & 4) { /* FEXTRA: a little-endian length, then that many bytes */
        if (need(g, 2) != 0)
            return -1;
        size_t xlen = g->in[g->in_pos] | (size_t)g->in[g->in_pos + 1] << 8;
        crc = crc32(crc, g->in + g->in_pos, 2);
        g->in_pos += 2;
        if (skip_bytes(g, xlen, &crc) != 0)
            return -1;
    }
    if ((flags & 8) && skip_string(g, &crc) != 0) /* FNAME */
        return -1;
    if ((flags & 16) && skip_string(g, &crc) != 0) /* FCOMMENT */
        return -1;
    if (flags & 2) { /* FHCRC: the low 16 bits of the CRC-32 of the header so far */
        if (need(g, 2) != 0)
            return -1;
        unsigned stored = g->in[g->in_pos] | (unsigned)g->in[g->in_pos + 1] << 8;
        if (stored != (crc & 0xffff)) {
            fail(g, "incorrect header check in the gzip header");
            return -1;
        }
        g->in_pos += 2;
    }
    isal_inflate_init(g->st);
    g->st->crc_flag = ISAL_GZIP_NO_HDR_VER; /* raw deflate, then the trailer checked */
    g->in_member = 1;
    return 0;
}

/* Inflate into `out` until it holds something, the data ends or an error
 * stops it (then done is set). */
static void inflate_some(md_gz *g)
{
    struct inflate_state *st = g->st;
    g->out_pos = g->out_len = 0;
    while (!g->done) {
        if (!g->in_member) {
            if (member_header(g) != 0)
                return;
        } else if (st->block_state == ISAL_BLOCK_FINISH) {
            /* a member ended: does another follow? */
            while (g->in_len - g->in_pos < 2 && !g->in_eof)
                if (fill(g) != 0)
                    return;
            if (g->in_len - g->in_pos >= 2 && g->in[g->in_pos] == 0x1f &&
                g->in[g->in_pos + 1] == 0x8b) {
                g->in_member = 0;
                continue;
            }
            g->done = 1; /* the end; trailing bytes are ignored */
            return;
        }
        if (g->in_pos == g->in_len && !g->in_eof && fill(g) != 0)
            return;
        size_t avail = g->in_len - g->in_pos;
        st->next_in = g->in + g->in_pos;
        st->avail_in = (uint32_t)avail;
        st->next_out = g->out;
        st->avail_out = OUT_SIZE;
        int ret = isal_inflate(st);
        g->in_pos += avail - st->avail_in;
        g->out_len = OUT_SIZE - st->avail_out;
        if (ret != ISAL_DECOMP_OK) {
            fail(g, inflate_message(ret)); /* what came before the error is still read */
            return;
        }
        if (g->out_len > 0)
            return;
        if (st->block_state == ISAL_BLOCK_FINISH)
            continue;
        if (g->in_pos == g->in_len || avail == st->avail_in) {
            /* it wants more input (it took none of what it had: deflate
             * data it cannot decode yet); never spin on the same bytes */
            if (g->in_eof) {
                fail(g, "unexpected end of file");
                return;
            }
            if (g->in_len - g->in_pos == IN_SIZE) {
                fail(g, "invalid compressed data (no progress)");
                return;
            }
            if (fill(g) != 0)
                return;
        }
    }
}

/* Copy up to `want` of the bytes from[*pos, len) to dst; returns how many. */
static size_t take(unsigned char *dst, size_t want, const unsigned char *from, size_t *pos,
                   size_t len)
{
    size_t k = len - *pos < want ? len - *pos : want;
    memcpy(dst, from + *pos, k);
    *pos += k;
    return k;
}

size_t md_gz_read(md_gz *g, void *buf, size_t n)
{
    unsigned char *dst = buf;
    size_t got = 0;
    while (got < n) {
        if (g->gzip) {
            if (g->out_pos == g->out_len) {
                if (g->done)
                    break;
                inflate_some(g);
                continue;
            }
            got += take(dst + got, n - got, g->out, &g->out_pos, g->out_len);
        } else {
            if (g->in_pos == g->in_len) {
                if (g->done || g->in_eof || fill(g) != 0)
                    break;
                continue;
            }
            got += take(dst + got, n - got, g->in, &g->in_pos, g->in_len);
        }
    }
    return got;
}

const char *md_gz_error(const md_gz *g, int *sys_errno)
{
    if (sys_errno)
        *sys_errno = g->sys_errno;
    return g->err;
}

void md_gz_close(md_gz *g)
{
    if (!g)
        return;
    if (g->fd >= 0)
        close(g->fd);
    free(g->in);
    free(g->out);
    free(g->st);
    free(g);
}

int md_gz_is_gzip(const md_gz *g) { return g && g->gzip; }
