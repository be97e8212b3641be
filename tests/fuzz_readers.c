/*
 * fuzz_readers.c - libFuzzer harness for the dataset readers (readers.c:
 * the hand-written CSV scanner and splitter, JSONL rows, the NPY header
 * parser and the IDX header), which read files a job names. `make fuzz`
 * builds it beside fuzz_tensor and runs it over tests/fuzz_corpus_readers/.
 *
 * The first byte picks the format (bits 0-1) and the options (bit 2: a label
 * column/field, bit 3: named features); the rest is the file. Checks beyond
 * "no crash": every row read is finite; each call, good or bad, consumes one
 * row (the position moves by one), so a malformed file never loops; every
 * failure explains itself; a format that declares its row count never
 * yields more rows.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../jobs/jobs.h"

#define MAX_WIDTH (1 << 20) /* rows wider than this are not read (the harness's buffer) */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    static const char *const formats[] = {"csv", "jsonl", "npy", "idx"};
    const char *format = formats[data[0] & 3];
    int with_label = (data[0] >> 2) & 1, with_features = (data[0] >> 3) & 1;

    static char path[64];
    if (!path[0])
        snprintf(path, sizeof path, "/tmp/fuzz_readers.%d", (int)getpid());
    FILE *f = fopen(path, "wb");
    if (!f)
        abort();
    if (size > 1 && fwrite(data + 1, 1, size - 1, f) != size - 1)
        abort();
    fclose(f);

    json_t *features = NULL;
    if (with_features)
        features = !strcmp(format, "jsonl") ? json_string("x") : json_pack("[s,s]", "a", "b");
    /* idx labels come from a second file: the same bytes, which is rarely valid */
    md_reader_opts o = {.path = path, .format = format, .features = features,
                        .label = with_label ? (!strcmp(format, "idx") ? path : "label") : NULL};
    md_reader *r = NULL;
    md_err err;
    md_err_clear(&err);
    md_status st = md_reader_open(&o, &r, &err);
    json_decref(features);
    if (st != MD_OK) {
        if (err.msg[0] == '\0' || r != NULL)
            abort();
        return 0;
    }
    int64_t width = md_reader_row_width(r), total = md_reader_total_rows(r);
    if (width < 1)
        abort();
    if (width <= MAX_WIDTH) {
        float *row = malloc(sizeof(float) * (size_t)width);
        if (!row)
            abort();
        /* rows are bounded by the declared count (npy, idx) or, in text, by
         * the bytes (a row takes at least one), so this many calls end it;
         * an idx.gz may inflate far past its size, so reading stops at 100k */
        int64_t limit = total >= 0 ? total : (int64_t)size;
        for (int64_t i = 0; i <= limit && i <= 100000; i++) {
            int64_t before = md_reader_position(r), label = 0;
            md_err_clear(&err);
            st = md_reader_next(r, row, &label, &err);
            if (st == MD_ENOTFOUND)
                break;
            if (st == MD_EIO) {
                if (err.msg[0] == '\0')
                    abort();
                break;
            }
            if (md_reader_position(r) != before + 1)
                abort();
            if (st == MD_EINVAL) {
                if (err.msg[0] == '\0')
                    abort();
                continue;
            }
            if (st != MD_OK)
                abort();
            for (int64_t j = 0; j < width; j++)
                if (!isfinite(row[j]))
                    abort();
            if (i == limit)
                abort(); /* more rows than declared, or than bytes */
        }
        free(row);
    }
    md_reader_close(r);
    return 0;
}
