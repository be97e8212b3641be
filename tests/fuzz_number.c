/*
 * fuzz_number.c - differential libFuzzer target for the request decoder's
 * numbers: whatever the digits, md_parse_double (fast_float) equals strtod
 * bit for bit, and a number decoded by md_tensor_decode equals
 * (float)strtod, the rounding the decoder has always promised. `make fuzz`
 * runs it over tests/fuzz_corpus_number/.
 *
 * The input is taken as one number's text. When it matches JSON's number
 * grammar the three results are compared; otherwise the decoder must refuse
 * "[text]" (or accept it only as one number with blanks around it).
 */
#include <ctype.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../predictor/numparse.h"
#include "../predictor/predictor.h"

/* JSON's number grammar: -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)? */
static int json_number(const char *p, size_t n)
{
    size_t i = 0;
    if (i < n && p[i] == '-')
        i++;
    if (i >= n || !isdigit((unsigned char)p[i]))
        return 0;
    if (p[i] == '0')
        i++;
    else
        while (i < n && isdigit((unsigned char)p[i]))
            i++;
    if (i < n && p[i] == '.') {
        i++;
        if (i >= n || !isdigit((unsigned char)p[i]))
            return 0;
        while (i < n && isdigit((unsigned char)p[i]))
            i++;
    }
    if (i < n && (p[i] == 'e' || p[i] == 'E')) {
        i++;
        if (i < n && (p[i] == '+' || p[i] == '-'))
            i++;
        if (i >= n || !isdigit((unsigned char)p[i]))
            return 0;
        while (i < n && isdigit((unsigned char)p[i]))
            i++;
    }
    return i == n;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size > 200)
        return 0;
    char text[256], body[260];
    memcpy(text, data, size);
    text[size] = '\0';
    if (strlen(text) != size)
        return 0; /* a NUL inside: strtod would stop there */
    int num = json_number(text, size);

    if (num) {
        double want = strtod(text, NULL), got = 0;
        if (md_parse_double(text, text + size, &got) != 0)
            abort(); /* a JSON number always parses */
        if (memcmp(&want, &got, sizeof want) != 0)
            abort(); /* bit for bit, sign of zero and infinities included */
    }

    body[0] = '[';
    memcpy(body + 1, text, size);
    body[size + 1] = ']';
    md_tensor t;
    md_err err;
    md_status st = md_tensor_decode(body, size + 2, "application/json", 1 << 20, &t, &err);
    if (num) {
        float want = (float)strtod(text, NULL);
        if (!isfinite(want)) {
            if (st == MD_OK)
                abort(); /* past float32's range is an error */
        } else {
            if (st != MD_OK || t.count != 1 || memcmp(&want, &t.data[0], sizeof want) != 0)
                abort();
        }
    }
    if (st == MD_OK)
        md_tensor_free(&t);
    else if (err.msg[0] == '\0')
        abort(); /* every failure explains itself */
    return 0;
}
