/*
 * fuzz_zipdir.c - libFuzzer harness for md_zip_dir_read (checkpoint/zipdir.c),
 * which reads the central directory of every uploaded zip the way libtorch's
 * reader will, before libtorch opens the file. `make fuzz` runs it over
 * tests/fuzz_corpus_zipdir/ (small torch.save and TorchScript archives from
 * tests/fixtures/ckpt, and zip64 variants of one).
 *
 * The input is the file (written to a memfd: the reader works on a file
 * descriptor). Checks beyond "no crash": a failure has a status and a
 * message and no directory; a success lists names that lie inside the
 * directory it read, and never more entries than the file could hold.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "../checkpoint/formats.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    int fd = memfd_create("fuzz_zipdir", MFD_CLOEXEC);
    if (fd < 0)
        abort();
    if (size && write(fd, data, size) != (ssize_t)size)
        abort();
    md_zip_dir *dir = NULL;
    md_err err;
    md_err_clear(&err);
    md_status st = md_zip_dir_read(fd, &dir, &err);
    close(fd);
    if (st != MD_OK) {
        if (dir || err.status != st || !err.msg[0])
            abort();
        return 0;
    }
    size_t n = md_zip_dir_count(dir);
    if (n > size / 46) /* each entry has a 46-byte header in the file */
        abort();
    volatile uint8_t sum = 0;
    for (size_t i = 0; i < n; i++) {
        size_t len;
        const char *name = md_zip_dir_name(dir, i, &len);
        for (size_t k = 0; k < len; k++) /* ASan: inside the directory's copy */
            sum ^= (uint8_t)name[k];
    }
    md_zip_dir_free(dir);
    return 0;
}
