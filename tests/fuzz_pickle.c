/*
 * fuzz_pickle.c - libFuzzer harness for the restricted unpickler
 * (checkpoint/pickle.c), which reads data.pkl of uploaded torch.save files.
 * `make fuzz` builds it with small memory limits (MD_CKPT_MAX_TOTAL_BYTES,
 * MD_PICKLE_MAX_ARENA) and runs it over tests/fuzz_corpus_pickle/, whose
 * seeds are the data.pkl of the committed fixtures (make_ckpt_fixtures.py).
 *
 * Input: a 2-byte little-endian length L, L bytes of pickle, then the bytes
 * every storage record holds (keys "0" to "99" all name that one buffer;
 * other keys are absent), so storage sizes, offsets and strides are fuzzed
 * against a real bound. Checks beyond "no crash": a success holds tensors
 * whose byte counts equal their shape's product times the element size, and
 * names that are C strings; a failure has a status and a message. The same
 * input is read again under a budget of BUDGET bytes: it succeeds exactly
 * when the first read did with tensors of at most BUDGET bytes together,
 * else fails with MD_ETOOBIG (the budget is checked before any copy). The
 * pickle read tensor by tensor (md_ckpt_unpickle_each, with and without the
 * data) hands over exactly those tensors in that order when the list
 * reader succeeds.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../checkpoint/formats.h"

#define BUDGET 64 /* bytes of tensors the second read may copy out */

typedef struct records {
    const uint8_t *data;
    size_t size;
} records;

static md_status record(void *ctx, const char *key, const uint8_t **data, size_t *size,
                        md_err *err)
{
    records *r = ctx;
    size_t n = strlen(key);
    if (n < 1 || n > 2 || key[0] < '0' || key[0] > '9' ||
        (n == 2 && (key[1] < '0' || key[1] > '9')))
        return md_err_set(err, MD_EUNPROC, "no record data/%s", key);
    *data = r->data;
    *size = r->size;
    return MD_OK;
}

/* md_ckpt_unpickle_each's callee: tensor `at` must be the list's. */
typedef struct compare {
    const md_tensors *t;
    size_t at;
    int with_data;
} compare;

static md_status same(void *ctx, const char *name, md_ckpt_dtype dtype, int ndim,
                      const int64_t *shape, const void *data, size_t nbytes, md_err *err)
{
    (void)err;
    compare *c = ctx;
    const md_tensors *t = c->t;
    if (t) {
        size_t i = c->at;
        if (i >= md_tensors_count(t) || strcmp(name, md_tensors_name(t, i)) != 0 ||
            dtype != md_tensors_dtype(t, i) || ndim != md_tensors_ndim(t, i) ||
            (ndim && memcmp(shape, md_tensors_shape(t, i), sizeof *shape * (size_t)ndim)) ||
            nbytes != md_tensors_nbytes(t, i) || (data == NULL) == c->with_data ||
            (data && nbytes && memcmp(data, md_tensors_data(t, i), nbytes)))
            abort();
    }
    c->at++;
    return MD_OK;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 2)
        return 0;
    size_t len = data[0] | (size_t)data[1] << 8;
    if (len > size - 2)
        len = size - 2;
    /* copies, so reads past either end are caught by ASan */
    uint8_t *pkl = malloc(len ? len : 1), *rec = malloc(size - 2 - len + 1);
    memcpy(pkl, data + 2, len);
    memcpy(rec, data + 2 + len, size - 2 - len);
    records r = {rec, size - 2 - len};
    md_tensors *t = NULL;
    md_err err;
    md_err_clear(&err);
    md_status st = md_ckpt_unpickle(pkl, len, record, &r, "fuzz.pt", NULL, &t, &err);
    size_t total = 0;
    for (size_t i = 0; st == MD_OK && i < md_tensors_count(t); i++)
        total += md_tensors_nbytes(t, i);
    md_ckpt_budget budget = {BUDGET, "the fuzzer's budget"};
    md_tensors *tb = NULL;
    md_err berr;
    md_status bst = md_ckpt_unpickle(pkl, len, record, &r, "fuzz.pt", &budget, &tb, &berr);
    if (st == MD_OK && total <= BUDGET ? bst != MD_OK
                                       : bst == MD_OK || (st == MD_OK && bst != MD_ETOOBIG))
        abort();
    md_tensors_free(tb);
    if (st == MD_OK) {
        for (size_t i = 0; i < md_tensors_count(t); i++) {
            size_t numel = 1;
            for (int d = 0; d < md_tensors_ndim(t, i); d++)
                numel *= (size_t)md_tensors_shape(t, i)[d];
            if (numel * md_ckpt_dtype_size(md_tensors_dtype(t, i)) != md_tensors_nbytes(t, i))
                abort();
            if (md_tensors_find(t, md_tensors_name(t, i)) != (long)i)
                abort();
            const uint8_t *b = md_tensors_data(t, i);
            volatile uint8_t sum = 0;
            for (size_t k = 0; k < md_tensors_nbytes(t, i); k++)
                sum ^= b[k];
        }
        for (size_t i = 0; i < md_tensors_scalar_count(t); i++)
            if (!md_tensors_scalar_name(t, i))
                abort();
        for (int with_data = 0; with_data < 2; with_data++) {
            compare c = {t, 0, with_data};
            if (md_ckpt_unpickle_each(pkl, len, record, &r, "fuzz.pt", with_data, same, &c,
                                      &err) != MD_OK ||
                c.at != md_tensors_count(t))
                abort();
        }
        md_tensors_free(t);
    } else if (t || err.status != st || !err.msg[0]) {
        abort();
    } else {
        compare c = {NULL, 0, 1};
        md_status each = md_ckpt_unpickle_each(pkl, len, record, &r, "fuzz.pt", 1, same, &c,
                                               &err);
        if (each != MD_OK && (err.status != each || !err.msg[0]))
            abort();
    }
    free(pkl);
    free(rec);
    return 0;
}
