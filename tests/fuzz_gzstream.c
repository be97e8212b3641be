/*
 * fuzz_gzstream.c - libFuzzer harness for jobs/gzstream.c, the stream the
 * IDX reader reads job datasets through (ISA-L's inflate for gzip files),
 * differential against zlib's gzread, which it replaced. `make fuzz` builds
 * it and runs it over tests/fuzz_corpus_gzstream/.
 *
 * The first byte picks the read size (1 to 256 bytes a call, or 64 KiB);
 * the rest is the file. Checks beyond "no crash" (ASan, UBSan): a read
 * never returns more than asked; once a read comes back short, every later
 * one returns 0 and the error stays; when both md_gz and zlib read the file
 * to its end without an error, they give the same bytes.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

#include "../jobs/gzstream.h"

#define MAX_OUT (8u << 20) /* inflated bytes compared at most (a bomb stops here) */

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

    gzFile z = gzopen(path, "rb");
    if (!z)
        abort();
    size_t nb = 0;
    int r = 1;
    while (nb < MAX_OUT && (r = gzread(z, b + nb, 4096)) > 0)
        nb += (size_t)r;
    int zerr = Z_OK;
    gzerror(z, &zerr);
    int b_ok = r == 0 && (zerr == Z_OK || zerr == Z_STREAM_END);
    gzclose(z);

    if (a_short && !a_err && b_ok && (na != nb || memcmp(a, b, na) != 0)) {
        fprintf(stderr, "md_gz read %zu bytes, zlib %zu, and they differ\n", na, nb);
        abort();
    }
    return 0;
}
