/*
 * fuzz_safetensors.c - libFuzzer harness for the safetensors reader and
 * writer (checkpoint/safetensors.c). `make fuzz` runs it over
 * tests/fuzz_corpus_safetensors/ (seeds from make_ckpt_fixtures.py).
 *
 * The input is the file. Checks beyond "no crash": a failure has a status
 * and a message; a success writes back (md_safetensors_write) to a file that
 * reads again to the same names, dtypes, shapes, data and metadata, and
 * writing that gives the same bytes (the writer is deterministic).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../checkpoint/formats.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint8_t *copy = malloc(size ? size : 1);
    memcpy(copy, data, size);
    md_tensors *t = NULL;
    md_err err;
    md_err_clear(&err);
    md_status st = md_safetensors_read(copy, size, &t, &err);
    free(copy);
    if (st != MD_OK) {
        if (t || err.status != st || !err.msg[0])
            abort();
        return 0;
    }
    uint8_t *out, *out2;
    size_t len, len2;
    if (md_safetensors_write(t, &out, &len, &err) != MD_OK)
        abort();
    md_tensors *back = NULL;
    if (md_safetensors_read(out, len, &back, &err) != MD_OK)
        abort();
    if (md_tensors_count(back) != md_tensors_count(t) ||
        md_tensors_meta_count(back) != md_tensors_meta_count(t))
        abort();
    for (size_t i = 0; i < md_tensors_count(t); i++) {
        if (strcmp(md_tensors_name(back, i), md_tensors_name(t, i)) != 0 ||
            md_tensors_dtype(back, i) != md_tensors_dtype(t, i) ||
            md_tensors_ndim(back, i) != md_tensors_ndim(t, i) ||
            md_tensors_nbytes(back, i) != md_tensors_nbytes(t, i) ||
            memcmp(md_tensors_shape(back, i), md_tensors_shape(t, i),
                   (size_t)md_tensors_ndim(t, i) * sizeof(int64_t)) != 0 ||
            memcmp(md_tensors_data(back, i), md_tensors_data(t, i), md_tensors_nbytes(t, i)) != 0)
            abort();
    }
    for (size_t i = 0; i < md_tensors_meta_count(t); i++) {
        const char *v = md_tensors_meta_get(back, md_tensors_meta_key(t, i));
        if (!v || strcmp(v, md_tensors_meta_value(t, i)) != 0)
            abort();
    }
    if (md_safetensors_write(back, &out2, &len2, &err) != MD_OK || len2 != len ||
        memcmp(out, out2, len) != 0)
        abort();
    free(out);
    free(out2);
    md_tensors_free(back);
    md_tensors_free(t);
    return 0;
}
