/*
 * fuzz_npz.c - libFuzzer harness for md_npz_decode (predictor/npz.c), the
 * NPZ request body decoder, seeded with tests/fuzz_corpus_npz/ (archives
 * numpy wrote, from tests/fixtures/make_npz.py). Checks beyond "no crash": a
 * decoded body has 1..MD_MAX_IO arrays with unique, NUL-terminated names
 * without ".npy", each count its shape's product, all of them together at
 * most the limit, floats finite, exactly one of f32/i64 set; a failure
 * leaves nothing behind and explains itself.
 *
 * A mutated member almost never keeps its CRC, which would keep the fuzzer
 * out of the NPY decoding behind it; so when the first byte is odd, the
 * harness drops it and first rewrites the CRCs of the stored members it can
 * find (directory and local header) to match their bytes.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "../predictor/predictor.h"

#define MAX_VALUES (1u << 16)

static uint64_t le(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

/* Rewrite the CRC of every stored member whose directory entry and local
 * header lie inside the buffer. */
static void fix_crcs(uint8_t *d, size_t len)
{
    for (size_t i = 0; i + 46 <= len; i++) {
        if (le(d + i, 4) != 0x02014b50u || le(d + i + 10, 2) != 0)
            continue;
        uint64_t csize = le(d + i + 20, 4), off = le(d + i + 42, 4);
        if (off > len || len - off < 30 || le(d + off, 4) != 0x04034b50u)
            continue;
        uint64_t data = off + 30 + le(d + off + 26, 2) + le(d + off + 28, 2);
        if (data > len || csize > len - data)
            continue;
        uint32_t crc = (uint32_t)crc32(0L, d + data, (uInt)csize);
        put32(d + i + 16, crc);
        put32(d + off + 14, crc);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint8_t *buf = NULL;
    const char *body = (const char *)data;
    if (size > 0 && (data[0] & 1)) {
        buf = malloc(size);
        memcpy(buf, data + 1, size - 1);
        fix_crcs(buf, size - 1);
        body = (const char *)buf;
        size--;
    }
    md_arrays a;
    md_err err;
    md_err_clear(&err);
    md_status st = md_npz_decode(body, size, MAX_VALUES, &a, &err);
    if (st == MD_OK) {
        if (a.n < 1 || a.n > MD_MAX_IO)
            abort();
        size_t total = 0;
        for (int i = 0; i < a.n; i++) {
            md_array *x = &a.a[i];
            size_t nlen = strnlen(x->name, sizeof x->name);
            if (nlen == sizeof x->name || (nlen >= 4 && !strcmp(x->name + nlen - 4, ".npy")))
                abort();
            for (int j = 0; j < i; j++)
                if (!strcmp(a.a[j].name, x->name))
                    abort();
            if (x->ndim < 0 || x->ndim > MD_MAX_DIMS)
                abort();
            size_t count = 1;
            for (int d = 0; d < x->ndim; d++)
                count *= (size_t)x->shape[d];
            if (count != x->count)
                abort();
            total += count;
            if (count && ((x->is_int && (!x->i64 || x->f32)) || (!x->is_int && (!x->f32 || x->i64))))
                abort();
            if (!x->is_int)
                for (size_t k = 0; k < count; k++)
                    if (!isfinite(x->f32[k]))
                        abort();
        }
        if (total > MAX_VALUES)
            abort();
        md_arrays_free(&a);
    } else if (err.msg[0] == '\0' || a.n != 0) {
        abort();
    }
    free(buf);
    return 0;
}
