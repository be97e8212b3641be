/*
 * fuzz_gzstream.c - libFuzzer harness for jobs/gzstream.c, the stream the
 * IDX reader reads job datasets through (ISA-L's inflate for gzip files),
 * differential against zlib's gzread, which it replaced. `make fuzz` builds
 * it and runs it over tests/fuzz_corpus_gzstream/.
 *
 * The first byte picks the read size (1 to 256 bytes a call, or 64 KiB);
 * the rest is the file. `make fuzz` builds gzstream.c with 32-byte buffers,
 * so that read boundaries cut every header field, deflate block and
 * trailer. Checks beyond "no crash" (ASan, UBSan): a read never returns
 * more than asked; once a read comes back short, every later one returns 0
 * and the error stays; md_gz agrees with zlib's inflate (the whole file at
 * once, member after member as gzread takes them) on whether the file reads
 * to its end, and then gives the same bytes. The reference is inflate, not
 * gzread: gzread (zlib 1.2.13) can end a cut-short member early with no
 * error (found by this target: 16384 of 16488 bytes, then a clean EOF).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

#include "../jobs/gzstream.h"

#define MAX_OUT (8u << 20) /* inflated bytes compared at most (a bomb stops here) */

/* The file's bytes as gzread means them, through zlib's inflate: a gzip file
 * member after member (bytes after one that do not start with gzip's magic
 * end it), anything else as it is. 0: read to the end; -1: an error; 1: more
 * than `cap` bytes, undecided. */
static int reference(const uint8_t *in, size_t n, unsigned char *out, size_t cap, size_t *nout)
{
    *nout = 0;
    if (n < 2 || in[0] != 0x1f || in[1] != 0x8b) {
        if (n > cap)
            return 1;
        memcpy(out, in, n);
        *nout = n;
        return 0;
    }
    size_t pos = 0;
    for (;;) {
        z_stream z;
        memset(&z, 0, sizeof z);
        if (inflateInit2(&z, 15 + 16) != Z_OK)
            abort();
        z.next_in = (Bytef *)(in + pos);
        z.avail_in = (uInt)(n - pos);
        z.next_out = out + *nout;
        z.avail_out = (uInt)(cap - *nout);
        int ret = inflate(&z, Z_FINISH);
        *nout = cap - z.avail_out;
        pos = n - z.avail_in;
        inflateEnd(&z);
        if (ret == Z_STREAM_END) {
            if (n - pos >= 2 && in[pos] == 0x1f && in[pos + 1] == 0x8b)
                continue;
            return 0;
        }
        return ret == Z_BUF_ERROR && z.avail_out == 0 ? 1 : -1;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    size_t step = data[0] == 255 ? 65536 : (size_t)data[0] + 1;
    static char path[64];
    if (!path[0])
        snprintf(path, sizeof path, "/tmp/fuzz_gzstream.%d", (int)getpid());
    FILE *f = fopen(path, "wb");
    if (!f || (size > 1 && fwrite(data + 1, 1, size - 1, f) != size - 1))
        abort();
    fclose(f);

    static unsigned char a[MAX_OUT + 65536], b[MAX_OUT + 65536];
    md_gz *g = md_gz_open(path);
    if (!g)
        abort();
    size_t na = 0;
    int a_short = 0;
    while (na < MAX_OUT) {
        size_t got = md_gz_read(g, a + na, step);
        if (got > step)
            abort();
        na += got;
        if (got < step) {
            a_short = 1;
            break;
        }
    }
    const char *a_err = md_gz_error(g, NULL);
    if (a_short) {
        unsigned char c;
        if (md_gz_read(g, &c, 1) != 0 || md_gz_error(g, NULL) != a_err)
            abort();
    }
    md_gz_close(g);

    size_t nb = 0;
    int ref = reference(data + 1, size - 1, b, MAX_OUT, &nb);
    if (a_short && ref != 1 && (a_err == NULL) != (ref == 0)) {
        fprintf(stderr, "md_gz: %s; zlib's inflate: %s\n", a_err ? a_err : "read to the end",
                ref == 0 ? "read to the end" : "failed");
        abort();
    }
    if (a_short && !a_err && ref == 0 && (na != nb || memcmp(a, b, na) != 0)) {
        fprintf(stderr, "md_gz read %zu bytes, zlib %zu, and they differ\n", na, nb);
        abort();
    }
    return 0;
}
