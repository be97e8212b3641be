/*
 * fuzz_tensor.c - libFuzzer harness for the hand-written request decoders
 * (md_tensor_decode: JSON rows / instances / array+shape; md_npy_decode).
 * `make fuzz` builds it with clang's -fsanitize=fuzzer,address,undefined and
 * runs it for FUZZ_SECONDS over the corpus in tests/fuzz_corpus/.
 * Checks beyond "no crash": a decoded tensor's count equals the product of
 * its shape, and every value is finite.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../predictor/predictor.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    md_err err;
    md_tensor t;
    /* the first byte picks the content type, the rest is the body */
    const char *ct = size && (data[0] & 1) ? "application/x-npy" : "application/json";
    const char *body = size ? (const char *)data + 1 : (const char *)data;
    size_t len = size ? size - 1 : 0;
    if (md_tensor_decode(body, len, ct, 1 << 20, &t, &err) == MD_OK) {
        size_t count = 1;
        for (int d = 0; d < t.ndim; d++)
            count *= (size_t)t.shape[d];
        if (count != t.count || t.ndim < 1 || t.ndim > MD_MAX_DIMS)
            abort();
        for (size_t i = 0; i < t.count; i++)
            if (!isfinite(t.data[i]))
                abort();
        md_tensor_free(&t);
    } else if (err.msg[0] == '\0') {
        abort(); /* every failure explains itself */
    }
    return 0;
}
