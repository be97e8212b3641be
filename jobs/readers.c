/*
 * readers.c - streaming dataset readers for batch jobs: CSV, JSONL, NPY and
 * IDX (the MNIST family, plain or gzip), one row of float32 values (and an
 * integer label) at a time. The contract is in jobs.h.
 *
 * Over 800 lines on purpose: four formats behind one md_reader, and the two
 * text formats share the record scanner and its buffer (see DESIGN), so
 * splitting per format would export that scanner's internals for nothing.
 *
 * DESIGN
 * Memory is bounded by the longest row, never by the file.
 *
 * Text formats (CSV, JSONL) share one record scanner over a read buffer that
 * starts at READ_CHUNK and doubles only when a single record does not fit, up
 * to MAX_RECORD. A longer record is not kept: the scanner drops its bytes as
 * it goes, finds its end, and reports it as one bad row, so a runaway line
 * costs no more memory than MAX_RECORD and the rows after it are still read.
 * The CSV scanner is a four-state machine (field start, unquoted, quoted,
 * just after a closing quote) so that a newline inside quotes does not end
 * the record; its state survives buffer refills, so no byte is scanned
 * twice. A whole record is then split into fields in place (quotes removed,
 * doubled quotes undone), which is why the scanner and the splitter must
 * agree on where quotes open: only at the start of a field, after optional
 * spaces.
 *
 * Binary formats (NPY, IDX) read exactly one row's bytes per call into a row
 * buffer sized at open (float32 NPY rows straight into the caller's row),
 * from stdio (NPY) or gzstream.c (IDX: ISA-L's inflate for gzip files, twice
 * zlib's speed; other files are read as they are), then convert with one
 * vectorizable loop per element type: a job converts every row on a thread
 * that shares the cores with the workers.
 *
 * Row numbers in messages are 0-based data rows: the CSV header and blank
 * lines are not rows. They equal md_reader_position() before the call, the
 * count a resuming caller skips.
 */
#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "gzstream.h"
#include "images.h"
#include "jobs.h"
#include "npzset.h"

#define READ_CHUNK (64 * 1024)          /* the text buffer's first size */
#define NPY_READ_BUFFER (1024 * 1024)   /* stdio buffer of an NPY file */
#define MAX_RECORD (64 * 1024 * 1024)   /* the longest CSV/JSONL row kept */
#define SHOW_MAX 40                     /* characters of a bad value quoted back */

typedef enum { FMT_CSV, FMT_JSONL, FMT_NPY, FMT_IDX, FMT_IMAGES, FMT_NPZ } reader_format;

/* Where the CSV scanner is within a record. */
typedef enum {
    CSV_FIELD_START, /* after a comma or at the record start (spaces keep it) */
    CSV_UNQUOTED,    /* inside an unquoted field: quotes are plain text */
    CSV_QUOTED,      /* inside quotes: commas and newlines are text */
    CSV_AFTER_QUOTE  /* just after a closing quote; a second one is an escaped quote */
} csv_state;

typedef enum { NPY_F4, NPY_F8, NPY_I8, NPY_I4, NPY_U1 } npy_kind;

struct md_reader {
    reader_format format;
    char *name;        /* the file's base name, for messages */
    int64_t width;     /* values per row */
    int64_t total;     /* rows, or -1 when the format does not say */
    int64_t position;  /* data rows consumed; -1 while reading the CSV header */
    int has_labels;

    /* text formats: the record scanner */
    FILE *fp;
    char *buf;
    size_t cap;        /* bytes allocated; one more than the data it may hold */
    size_t start;      /* the current record's first byte */
    size_t scan;       /* the first byte not yet scanned */
    size_t end;        /* one past the last byte read */
    csv_state state;
    int eof;
    int discarding;    /* the current record passed MAX_RECORD; its bytes are dropped */

    /* csv */
    size_t ncols;
    char **colnames;
    char **fields;     /* ncols pointers into the current record */
    size_t *feature_cols;
    long label_col;    /* -1: none */

    /* jsonl */
    char *features_key;
    char *label_key;   /* NULL: no labels */
    json_t *pending;   /* row 0, parsed at open to learn the width */

    /* npy, idx */
    npy_kind kind;
    size_t esize;
    unsigned char *rowbuf;
    size_t rowbytes;
    md_gz *gz;
    md_gz *gz_labels;
    char *label_name;  /* the labels file's base name */
    int end_checked;   /* idx: the data after the last row was read (idx_end) */

    /* images: a folder of PNG and JPEG files (images.c) */
    md_images *images;

    /* chunked jobs (issue 26): file bytes before buf[0] (text formats), and
     * where an NPY's rows start */
    int64_t buf_base;
    int64_t data_off;

    /* npz: one array per named input (npzset.c) */
    md_npzset *npz;

    /* named inputs (csv, jsonl): each input's values come from `src`, the
     * CSV columns (indexes in in_cols) or JSON fields (in_keys) */
    int n_in;
    md_io_info in[MD_MAX_IO];
    size_t *in_cols;       /* csv: per input, per value, its column */
    size_t in_first[MD_MAX_IO]; /* csv: where input i's columns start in in_cols */
    char **in_keys;        /* jsonl: per input, its field(s), in_first as for csv */
    int in_whole[MD_MAX_IO]; /* jsonl: one field holds the whole value (flattened) */
    size_t in_nkeys[MD_MAX_IO];
    size_t in_nkeys_total;  /* names in in_keys */
};

/* ---- messages ---- */

static const char *base_name(const char *path)
{
    const char *slash = strrchr(path, '/');
    return slash ? slash + 1 : path;
}


static md_status open_error(md_err *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static md_status open_error(md_err *err, const char *fmt, ...)
{
    char msg[MD_ERR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return md_err_setc(err, MD_EINVAL, "invalid_dataset", "%s", msg);
}

/* MD_EINVAL "NAME row N: reason" (row -1 is the CSV header). */
static md_status row_error(const md_reader *r, int64_t row, md_err *err, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static md_status row_error(const md_reader *r, int64_t row, md_err *err, const char *fmt, ...)
{
    char msg[MD_ERR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (row < 0)
        return md_err_setc(err, MD_EINVAL, "invalid_dataset", "%s header: %s", r->name, msg);
    return md_err_setc(err, MD_EINVAL, "invalid_dataset", "%s row %lld: %s", r->name,
                       (long long)row, msg);
}

/* `s` quoted for a message, cut to SHOW_MAX characters. `out` holds SHOW_MAX + 8. */
static const char *show(const char *s, char *out)
{
    size_t n = strlen(s);
    if (n <= SHOW_MAX)
        snprintf(out, SHOW_MAX + 8, "\"%s\"", s);
    else
        snprintf(out, SHOW_MAX + 8, "\"%.*s...\"", SHOW_MAX, s);
    return out;
}

/* ---- numbers ---- */

static int is_blank(char c)
{
    return c == ' ' || c == '\t';
}

typedef enum { NUM_OK, NUM_EMPTY, NUM_NOT_NUMBER, NUM_RANGE } num_result;

/* A float32 from the whole of `s` (spaces around it allowed). */
static num_result parse_float(const char *s, float *out)
{
    while (is_blank(*s))
        s++;
    if (!*s)
        return NUM_EMPTY;
    char *end;
    double d = strtod(s, &end);
    if (end == s)
        return NUM_NOT_NUMBER;
    while (is_blank(*end))
        end++;
    if (*end)
        return NUM_NOT_NUMBER;
    /* NaN, infinities and values past float32 (checked before the cast,
     * which would be undefined) */
    if (!(fabs(d) <= FLT_MAX))
        return NUM_RANGE;
    *out = (float)d;
    return NUM_OK;
}

/* 1 when `d` is an integer that fits int64. */
static int integral_double(double d, int64_t *out)
{
    if (!(d >= -9223372036854775808.0 && d < 9223372036854775808.0) || d != floor(d))
        return 0;
    *out = (int64_t)d;
    return 1;
}

/* An integer label from the whole of `s` ("3", " 3 ", "3.0"). */
static num_result parse_label(const char *s, int64_t *out)
{
    while (is_blank(*s))
        s++;
    if (!*s)
        return NUM_EMPTY;
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    const char *rest = end;
    while (is_blank(*rest))
        rest++;
    if (end != s && !*rest && errno == 0) {
        *out = v;
        return NUM_OK;
    }
    double d = strtod(s, &end);
    if (end == s)
        return NUM_NOT_NUMBER;
    while (is_blank(*end))
        end++;
    if (*end || !integral_double(d, out))
        return NUM_NOT_NUMBER;
    return NUM_OK;
}

/* ---- the text record scanner ---- */

/*
 * The next non-blank record of a text file, NUL-terminated in place without
 * its line end ("\n" or "\r\n"); valid until the next call. `csv` selects
 * the quote-aware scanner. Each record returned or reported bad advances
 * r->position. MD_OK; MD_ENOTFOUND at the end; MD_EIO on a read error;
 * MD_ENOMEM when the buffer cannot grow; MD_EINVAL (the record consumed) for
 * a record longer than MAX_RECORD or a quote still open at the end of the file.
 */
static md_status read_record(md_reader *r, int csv, char **rec, size_t *len, md_err *err)
{
    for (;;) {
        size_t i = r->scan;
        int found = 0;
        if (csv) {
            csv_state s = r->state;
            for (; i < r->end; i++) {
                char c = r->buf[i];
                if (s == CSV_QUOTED) {
                    if (c == '"')
                        s = CSV_AFTER_QUOTE;
                } else if (c == '\n') {
                    found = 1;
                    break;
                } else if (c == ',') {
                    s = CSV_FIELD_START;
                } else if (c == '"' && (s == CSV_FIELD_START || s == CSV_AFTER_QUOTE)) {
                    s = CSV_QUOTED;
                } else if (!(s == CSV_FIELD_START && is_blank(c))) {
                    s = CSV_UNQUOTED;
                }
            }
            r->state = s;
        } else {
            char *nl = memchr(r->buf + i, '\n', r->end - i);
            if (nl) {
                i = (size_t)(nl - r->buf);
                found = 1;
            } else {
                i = r->end;
            }
        }

        if (found || (r->eof && (r->end > r->start || r->discarding))) {
            char *p = r->buf + r->start;
            size_t n = i - r->start;
            int open_quote = !found && r->state == CSV_QUOTED;
            r->start = r->scan = found ? i + 1 : r->end;
            r->state = CSV_FIELD_START;
            if (r->discarding) {
                r->discarding = 0;
                return row_error(r, r->position++, err, "the row is longer than %d MiB",
                                 MAX_RECORD / (1024 * 1024));
            }
            if (n && p[n - 1] == '\r')
                n--;
            p[n] = '\0'; /* the '\n', or the spare byte after the data */
            size_t k = 0;
            while (k < n && (is_blank(p[k]) || p[k] == '\r'))
                k++;
            if (k == n && !open_quote)
                continue; /* a blank line is not a row */
            if (open_quote)
                return row_error(r, r->position++, err,
                                 "a quoted field is not closed before the end of the file");
            r->position++;
            *rec = p;
            *len = n;
            return MD_OK;
        }
        r->scan = i;
        if (r->eof)
            return MD_ENOTFOUND;

        /* need more bytes: make room at the end */
        if (r->discarding) {
            r->buf_base += (int64_t)r->end;
            r->start = r->scan = r->end = 0;
        } else if (r->start > 0) {
            r->buf_base += (int64_t)r->start;
            memmove(r->buf, r->buf + r->start, r->end - r->start);
            r->end -= r->start;
            r->scan -= r->start;
            r->start = 0;
        }
        if (r->end + 1 >= r->cap) {
            if (r->cap - 1 >= MAX_RECORD) {
                r->discarding = 1;
                r->buf_base += (int64_t)r->end;
                r->start = r->scan = r->end = 0;
            } else {
                size_t cap = (r->cap - 1) * 2 + 1;
                if (cap - 1 > MAX_RECORD)
                    cap = MAX_RECORD + 1;
                char *grown = realloc(r->buf, cap);
                if (!grown)
                    return md_err_set(err, MD_ENOMEM, "%s row %lld: out of memory for a row of %zu bytes",
                                      r->name, (long long)r->position, r->end);
                r->buf = grown;
                r->cap = cap;
            }
        }
        size_t got = fread(r->buf + r->end, 1, r->cap - 1 - r->end, r->fp);
        r->end += got;
        if (got == 0) {
            if (ferror(r->fp))
                return md_err_set(err, MD_EIO, "%s: read failed: %s", r->name, strerror(errno));
            r->eof = 1;
        }
    }
}

/* Open `path` for reading with stdio; a directory is refused. */
static md_status open_stream(md_reader *r, const char *path, md_err *err)
{
    r->fp = fopen(path, "rb");
    if (!r->fp)
        return open_error(err, "cannot open dataset %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fileno(r->fp), &st) == 0 && S_ISDIR(st.st_mode))
        return open_error(err, "dataset %s is a directory, not a file", path);
    return MD_OK;
}

static void text_init(md_reader *r)
{
    r->cap = READ_CHUNK + 1;
    r->buf = md_xmalloc(r->cap);
    /* the scanner reads whole chunks into its own buffer */
    setvbuf(r->fp, NULL, _IONBF, 0);
}

/* ---- CSV ---- */

/*
 * Split the record `rec` (`len` bytes, NUL at rec[len]) into fields in
 * place: quotes removed, "" turned into ", each field NUL-terminated. Stores
 * the first `max` field starts in `fields` and returns the number of fields.
 * *bad is set when text follows a closing quote.
 */
static size_t split_fields(char *rec, size_t len, char **fields, size_t max, int *bad)
{
    char *p = rec, *end = rec + len;
    size_t n = 0;
    *bad = 0;
    for (;;) {
        char *start = p, *q = p, *w;
        while (q < end && is_blank(*q))
            q++;
        if (q < end && *q == '"') {
            w = start;
            q++;
            while (q < end) {
                if (*q == '"') {
                    if (q + 1 < end && q[1] == '"') {
                        *w++ = '"';
                        q += 2;
                        continue;
                    }
                    q++;
                    break;
                }
                *w++ = *q++;
            }
            while (q < end && is_blank(*q))
                q++;
            if (q < end && *q != ',') {
                *bad = 1;
                while (q < end && *q != ',')
                    q++;
            }
        } else {
            while (q < end && *q != ',')
                q++;
            w = q;
        }
        if (n < max)
            fields[n] = start;
        n++;
        int more = q < end; /* q is at a comma */
        *w = '\0';          /* w <= q: the comma or the record's NUL */
        if (!more)
            return n;
        p = q + 1;
    }
}

/* "a, b, c" of the header's names, cut to fit a message. */
static void column_list(const md_reader *r, char *out, size_t size)
{
    size_t used = 0;
    out[0] = '\0';
    for (size_t i = 0; i < r->ncols; i++) {
        int n = snprintf(out + used, size - used, "%s%s", i ? ", " : "", r->colnames[i]);
        if (n < 0 || (size_t)n >= size - used) {
            if (size > 4)
                strcpy(out + size - 4, "...");
            return;
        }
        used += (size_t)n;
    }
}

static long find_column(const md_reader *r, const char *name)
{
    for (size_t i = 0; i < r->ncols; i++)
        if (!strcmp(r->colnames[i], name))
            return (long)i;
    return -1;
}

/* ---- named inputs (csv and jsonl with input.columns) ---- */

static const char *json_type_name(const json_t *v);

/* An int64 from the whole of `s` (spaces around it allowed), exactly: a
 * fraction or an exponent is refused, never rounded. */
static num_result parse_int64(const char *s, int64_t *out)
{
    while (is_blank(*s))
        s++;
    if (!*s)
        return NUM_EMPTY;
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (end == s)
        return NUM_NOT_NUMBER;
    while (is_blank(*end))
        end++;
    if (*end)
        return NUM_NOT_NUMBER;
    if (errno == ERANGE)
        return NUM_RANGE;
    *out = v;
    return NUM_OK;
}

/* input.columns against the version's inputs: for each input its source
 * names (one, or as many as it has values), into r->in_keys (the names,
 * owned) and in_first/in_nkeys. `csv`: every name must be one value. */
static md_status named_sources(md_reader *r, const md_reader_opts *opts, int csv, md_err *err)
{
    json_t *cols = opts->columns;
    if (cols && !json_is_object(cols))
        return open_error(err, "%s: input.columns must be an object mapping each input to its "
                          "column, e.g. {\"numeric\": [\"age\", \"bmi\"], \"category\": "
                          "\"city_id\"}", r->name);
    if (opts->features)
        return open_error(err, "%s: the model takes named inputs: map them with input.columns "
                          "instead of input.features", r->name);
    const char *key;
    json_t *v;
    json_object_foreach(cols, key, v)
    {
        int known = 0;
        for (int i = 0; i < opts->n_inputs && !known; i++)
            known = strcmp(opts->inputs[i].name, key) == 0;
        if (!known)
            return open_error(err, "%s: input.columns names \"%s\", which is not one of the "
                              "model's inputs", r->name, key);
    }
    r->n_in = opts->n_inputs;
    size_t total = 0;
    for (int i = 0; i < r->n_in; i++) {
        r->in[i] = opts->inputs[i];
        json_t *c = cols ? json_object_get(cols, r->in[i].name) : NULL;
        size_t n = json_is_array(c) ? json_array_size(c) : 1;
        total += n;
    }
    r->in_keys = md_xcalloc(total ? total : 1, sizeof *r->in_keys);
    r->in_nkeys_total = total;
    size_t at = 0;
    for (int i = 0; i < r->n_in; i++) {
        const md_io_info *io = &r->in[i];
        json_t *c = cols ? json_object_get(cols, io->name) : NULL;
        r->in_first[i] = at;
        if (c && !json_is_string(c) && !json_is_array(c))
            return open_error(err, "%s: input.columns.%s must be a column name or an array of "
                              "them", r->name, io->name);
        if (json_is_array(c)) {
            if ((int64_t)json_array_size(c) != io->values)
                return open_error(err, "%s: input.columns.%s names %zu columns, and input \"%s\" "
                                  "takes %lld values a row", r->name, io->name,
                                  json_array_size(c), io->name, (long long)io->values);
            for (size_t j = 0; j < json_array_size(c); j++) {
                const char *name = json_string_value(json_array_get(c, j));
                if (!name)
                    return open_error(err, "%s: input.columns.%s[%zu] is not a string",
                                      r->name, io->name, j);
                r->in_keys[at++] = md_xstrdup(name);
            }
            r->in_nkeys[i] = json_array_size(c);
        } else {
            const char *name = c ? json_string_value(c) : io->name;
            if (csv && io->values != 1)
                return open_error(err, "%s: input \"%s\" takes %lld values a row: name its "
                                  "columns in input.columns, e.g. {\"%s\": [\"a\", \"b\"]}",
                                  r->name, io->name, (long long)io->values, io->name);
            r->in_keys[at++] = md_xstrdup(name);
            r->in_nkeys[i] = 1;
            r->in_whole[i] = 1;
        }
    }
    int64_t words = 0;
    for (int i = 0; i < r->n_in; i++)
        words += r->in[i].values * (r->in[i].is_int ? 2 : 1);
    r->width = words;
    return MD_OK;
}

/* csv: the named columns into r->in_cols. */
static md_status named_csv_columns(md_reader *r, md_err *err)
{
    size_t total = 0;
    for (int i = 0; i < r->n_in; i++)
        total += r->in_nkeys[i];
    r->in_cols = md_xcalloc(total ? total : 1, sizeof *r->in_cols);
    for (size_t k = 0; k < total; k++) {
        long c = find_column(r, r->in_keys[k]);
        if (c < 0) {
            char cols[256];
            column_list(r, cols, sizeof cols);
            return open_error(err, "%s: the column \"%s\" (input.columns) is not in the header "
                              "(columns: %s)", r->name, r->in_keys[k], cols);
        }
        r->in_cols[k] = (size_t)c;
    }
    return MD_OK;
}

/* Whether an integer input declared `dtype` holds v (refused rather than wrapped). */
static int int_fits(const char *dtype, int64_t v)
{
    if (!strcmp(dtype, "uint8"))
        return v >= 0 && v <= 255;
    if (!strcmp(dtype, "int32"))
        return v >= INT32_MIN && v <= INT32_MAX;
    if (!strcmp(dtype, "bool"))
        return v == 0 || v == 1;
    return 1;
}

/* One value of input i into the row's words: an int64 in two words, a float in one. */
static void put_value(md_reader *r, float *row, int i, int64_t j, int64_t iv, float fv)
{
    const md_io_info *io = &r->in[i];
    if (io->is_int)
        memcpy(row + io->off + 2 * j, &iv, sizeof iv);
    else
        row[io->off + j] = fv;
}

static md_status named_csv_next(md_reader *r, int64_t rowno, float *row, md_err *err)
{
    char shown[SHOW_MAX + 8];
    for (int i = 0; i < r->n_in; i++) {
        for (size_t j = 0; j < r->in_nkeys[i]; j++) {
            size_t c = r->in_cols[r->in_first[i] + j];
            const char *f = r->fields[c];
            int64_t iv = 0;
            float fv = 0;
            num_result nr = r->in[i].is_int ? parse_int64(f, &iv) : parse_float(f, &fv);
            if (nr == NUM_EMPTY)
                return row_error(r, rowno, err, "column \"%s\" (input \"%s\") is empty",
                                 r->colnames[c], r->in[i].name);
            if (nr == NUM_OK && r->in[i].is_int && !int_fits(r->in[i].dtype, iv))
                return row_error(r, rowno, err, "column \"%s\" (input \"%s\") holds %lld, "
                                 "which its dtype %s does not", r->colnames[c], r->in[i].name,
                                 (long long)iv, r->in[i].dtype);
            if (nr != NUM_OK)
                return row_error(r, rowno, err, "column \"%s\" (input \"%s\") is not %s: %s",
                                 r->colnames[c], r->in[i].name,
                                 r->in[i].is_int ? "an integer (input declared an integer "
                                                   "type; values are not rounded)"
                                                 : "a finite float32 number",
                                 show(f, shown));
            put_value(r, row, i, (int64_t)j, iv, fv);
        }
    }
    return MD_OK;
}

/* A JSON value (nested arrays flattened) of input i; *n counts its values. */
static int named_json_values(md_reader *r, json_t *v, float *row, int i, int64_t *n)
{
    if (json_is_array(v)) {
        size_t k;
        json_t *e;
        json_array_foreach(v, k, e) {
            int rc = named_json_values(r, e, row, i, n);
            if (rc)
                return rc;
        }
        return 0;
    }
    int64_t iv = 0;
    float fv = 0;
    if (r->in[i].is_int) {
        if (json_is_integer(v))
            iv = json_integer_value(v);
        else if (json_is_boolean(v))
            iv = json_is_true(v);
        else
            return -1;
        if (!int_fits(r->in[i].dtype, iv))
            return -3;
    } else {
        if (!json_is_number(v))
            return -1;
        double d = json_number_value(v);
        if (!(fabs(d) <= FLT_MAX))
            return -2;
        fv = (float)d;
    }
    if (*n < r->in[i].values)
        put_value(r, row, i, *n, iv, fv);
    (*n)++;
    return 0;
}

static md_status named_jsonl_convert(md_reader *r, json_t *v, int64_t rowno, float *row,
                                     md_err *err)
{
    if (!json_is_object(v))
        return row_error(r, rowno, err, "is %s, not an object with the inputs' fields",
                         json_type_name(v));
    for (int i = 0; i < r->n_in; i++) {
        int64_t n = 0;
        for (size_t j = 0; j < r->in_nkeys[i]; j++) {
            const char *key = r->in_keys[r->in_first[i] + j];
            json_t *x = json_object_get(v, key);
            if (!x)
                return row_error(r, rowno, err, "has no field \"%s\" (input \"%s\")", key,
                                 r->in[i].name);
            int rc = named_json_values(r, x, row, i, &n);
            if (rc)
                return row_error(r, rowno, err, "field \"%s\" (input \"%s\") holds %s", key,
                                 r->in[i].name,
                                 rc == -3 ? "a value its integer dtype does not hold"
                                 : rc == -2 ? "a value past float32's range"
                                 : r->in[i].is_int ? "a value that is not an integer (the "
                                                     "input is declared an integer type)"
                                                   : "a value that is not a number");
        }
        if (n != r->in[i].values)
            return row_error(r, rowno, err, "input \"%s\" has %lld values, and takes %lld a row",
                             r->in[i].name, (long long)n, (long long)r->in[i].values);
    }
    if (r->label_key) {
        json_t *l = json_object_get(v, r->label_key);
        if (!l)
            return row_error(r, rowno, err, "has no field \"%s\" (the label)", r->label_key);
    }
    return MD_OK;
}

static md_status csv_open(md_reader *r, const md_reader_opts *opts, md_err *err)
{
    if (opts->features && !json_is_array(opts->features))
        return open_error(err, "%s: for csv, features must be an array of column names", r->name);
    md_status st;
    if (opts->n_inputs > 0 && (st = named_sources(r, opts, 1, err)) != MD_OK)
        return st;
    st = open_stream(r, opts->path, err);
    if (st != MD_OK)
        return st;
    text_init(r);

    char *rec;
    size_t len;
    r->position = -1;
    st = read_record(r, 1, &rec, &len, err);
    if (st == MD_ENOTFOUND)
        return open_error(err, "%s is empty; a csv needs a header line naming its columns", r->name);
    if (st != MD_OK)
        return st;
    if (len >= 3 && !memcmp(rec, "\xEF\xBB\xBF", 3)) { /* a UTF-8 byte order mark */
        rec += 3;
        len -= 3;
    }
    size_t max = 1;
    for (size_t i = 0; i < len; i++)
        max += rec[i] == ',';
    char **names = md_malloc_checked(max * sizeof *names, "the csv header", err);
    if (!names)
        return MD_ENOMEM;
    int bad;
    r->ncols = split_fields(rec, len, names, max, &bad);
    if (bad) {
        free(names);
        return row_error(r, -1, err, "a quoted column name has text after its closing quote");
    }
    r->colnames = md_xcalloc(r->ncols, sizeof *r->colnames);
    for (size_t i = 0; i < r->ncols; i++) {
        char *s = names[i];
        while (is_blank(*s))
            s++;
        size_t n = strlen(s);
        while (n && is_blank(s[n - 1]))
            n--;
        s[n] = '\0';
        r->colnames[i] = md_xstrdup(s);
    }
    free(names);
    r->position = 0;

    char cols[256];
    if (r->n_in) {
        st = named_csv_columns(r, err);
        if (st != MD_OK)
            return st;
    }
    if (opts->label) {
        r->label_col = find_column(r, opts->label);
        if (r->label_col < 0) {
            column_list(r, cols, sizeof cols);
            return open_error(err, "%s: the label column \"%s\" is not in the header (columns: %s)",
                              r->name, opts->label, cols);
        }
        r->has_labels = 1;
    }
    if (r->n_in) {
        /* the width is the inputs' words (named_sources) */
    } else if (opts->features) {
        size_t n = json_array_size(opts->features);
        if (n == 0)
            return open_error(err, "%s: features is empty; name at least one column", r->name);
        r->feature_cols = md_xcalloc(n, sizeof *r->feature_cols);
        for (size_t j = 0; j < n; j++) {
            const char *name = json_string_value(json_array_get(opts->features, j));
            if (!name)
                return open_error(err, "%s: features[%zu] is not a string; features names columns",
                                  r->name, j);
            long c = find_column(r, name);
            if (c < 0) {
                column_list(r, cols, sizeof cols);
                return open_error(err, "%s: the feature column \"%s\" is not in the header (columns: %s)",
                                  r->name, name, cols);
            }
            r->feature_cols[j] = (size_t)c;
        }
        r->width = (int64_t)n;
    } else {
        r->feature_cols = md_xcalloc(r->ncols, sizeof *r->feature_cols);
        for (size_t i = 0; i < r->ncols; i++)
            if ((long)i != r->label_col)
                r->feature_cols[r->width++] = i;
        if (r->width == 0)
            return open_error(err, "%s has no feature columns: its only column is the label \"%s\"",
                              r->name, opts->label);
    }
    r->fields = md_xcalloc(r->ncols, sizeof *r->fields);
    return MD_OK;
}

static md_status csv_next(md_reader *r, float *row, int64_t *label, md_err *err)
{
    char *rec;
    size_t len;
    md_status st = read_record(r, 1, &rec, &len, err);
    if (st != MD_OK)
        return st;
    int64_t rowno = r->position - 1;
    int bad;
    size_t n = split_fields(rec, len, r->fields, r->ncols, &bad);
    if (bad)
        return row_error(r, rowno, err, "a quoted field has text after its closing quote");
    if (n != r->ncols)
        return row_error(r, rowno, err, "has %zu fields, the header has %zu", n, r->ncols);
    char shown[SHOW_MAX + 8];
    if (r->n_in) {
        st = named_csv_next(r, rowno, row, err);
        if (st != MD_OK)
            return st;
    }
    for (int64_t j = 0; j < r->width && !r->n_in; j++) {
        size_t c = r->feature_cols[j];
        const char *f = r->fields[c];
        switch (parse_float(f, &row[j])) {
        case NUM_OK:
            break;
        case NUM_EMPTY:
            return row_error(r, rowno, err, "column \"%s\" is empty", r->colnames[c]);
        case NUM_NOT_NUMBER:
            return row_error(r, rowno, err, "column \"%s\" is not a number: %s", r->colnames[c],
                             show(f, shown));
        case NUM_RANGE:
            return row_error(r, rowno, err, "column \"%s\" is not a finite float32 number: %s",
                             r->colnames[c], show(f, shown));
        }
    }
    if (r->label_col >= 0) {
        const char *f = r->fields[r->label_col];
        switch (parse_label(f, label)) {
        case NUM_OK:
            break;
        case NUM_EMPTY:
            return row_error(r, rowno, err, "the label column \"%s\" is empty",
                             r->colnames[r->label_col]);
        default:
            return row_error(r, rowno, err, "the label column \"%s\" is not an integer: %s",
                             r->colnames[r->label_col], show(f, shown));
        }
    }
    return MD_OK;
}

/* ---- JSONL ---- */

/* Append the numbers of `v` (nested arrays flattened) to row[0..cap); *n
 * counts them all. Returns 0; -1 when value *n is not a number; -2 when it
 * is not a finite float32. `row` may be NULL (count only). */
static int flatten(json_t *v, float *row, int64_t cap, int64_t *n)
{
    if (json_is_array(v)) {
        size_t i;
        json_t *e;
        json_array_foreach(v, i, e) {
            int rc = flatten(e, row, cap, n);
            if (rc)
                return rc;
        }
        return 0;
    }
    if (!json_is_number(v))
        return -1;
    double d = json_number_value(v);
    if (!(fabs(d) <= FLT_MAX))
        return -2;
    if (row && *n < cap)
        row[*n] = (float)d;
    (*n)++;
    return 0;
}

static const char *json_type_name(const json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER:
    case JSON_REAL: return "a number";
    case JSON_TRUE:
    case JSON_FALSE: return "a boolean";
    default: return "null";
    }
}

/* The values and label of one parsed row. With row NULL (at open) only
 * counts, into r->width. */
static md_status jsonl_convert(md_reader *r, json_t *v, int64_t rowno, float *row, int64_t *label,
                               md_err *err)
{
    json_t *values = v;
    if (json_is_object(v)) {
        values = json_object_get(v, r->features_key);
        if (!values)
            return row_error(r, rowno, err, "has no field \"%s\"", r->features_key);
        if (!json_is_array(values))
            return row_error(r, rowno, err, "field \"%s\" is %s, not an array of numbers",
                             r->features_key, json_type_name(values));
        if (r->label_key) {
            json_t *l = json_object_get(v, r->label_key);
            int64_t value;
            if (!l)
                return row_error(r, rowno, err, "has no field \"%s\" (the label)", r->label_key);
            if (json_is_integer(l))
                value = json_integer_value(l);
            else if (!json_is_real(l) || !integral_double(json_real_value(l), &value))
                return row_error(r, rowno, err, "the label field \"%s\" is not an integer",
                                 r->label_key);
            if (label)
                *label = value;
        }
    } else if (json_is_array(v)) {
        if (r->label_key)
            return row_error(r, rowno, err,
                             "is an array, so it has no label field \"%s\"; write objects "
                             "{\"%s\": [...], \"%s\": n}",
                             r->label_key, r->features_key, r->label_key);
    } else {
        return row_error(r, rowno, err, "is %s, not an array or an object", json_type_name(v));
    }
    int64_t n = 0;
    int rc = flatten(values, row, row ? r->width : 0, &n);
    if (rc == -1)
        return row_error(r, rowno, err, "value %lld is not a number", (long long)n);
    if (rc == -2)
        return row_error(r, rowno, err, "value %lld is not a finite float32 number", (long long)n);
    if (!row) {
        if (n == 0)
            return row_error(r, rowno, err, "has no values; the first row sets the width");
        r->width = n;
    } else if (n != r->width) {
        return row_error(r, rowno, err, "has %lld values, the first row has %lld", (long long)n,
                         (long long)r->width);
    }
    return MD_OK;
}

/* Read and parse the next row; *v is a new reference. */
static md_status jsonl_parse_next(md_reader *r, json_t **v, md_err *err)
{
    char *rec;
    size_t len;
    md_status st = read_record(r, 0, &rec, &len, err);
    if (st != MD_OK)
        return st;
    json_error_t jerr;
    *v = json_loadb(rec, len, JSON_DECODE_ANY, &jerr);
    if (!*v)
        return row_error(r, r->position - 1, err, "invalid JSON: %s (column %d)", jerr.text,
                         jerr.column);
    return MD_OK;
}

static md_status jsonl_open(md_reader *r, const md_reader_opts *opts, md_err *err)
{
    if (opts->features && !json_is_string(opts->features))
        return open_error(err, "%s: for jsonl, features must be a string naming the field "
                          "that holds the values", r->name);
    md_status st;
    if (opts->n_inputs > 0 && (st = named_sources(r, opts, 0, err)) != MD_OK)
        return st;
    st = open_stream(r, opts->path, err);
    if (st != MD_OK)
        return st;
    text_init(r);
    r->features_key = md_xstrdup(opts->features ? json_string_value(opts->features) : "features");
    if (opts->label)
        r->label_key = md_xstrdup(opts->label);

    json_t *v;
    st = jsonl_parse_next(r, &v, err);
    if (st == MD_ENOTFOUND)
        return open_error(err, "%s has no rows; the first row sets the width", r->name);
    if (st != MD_OK)
        return st;
    if (!r->label_key && json_is_object(v) && json_object_get(v, "label"))
        r->label_key = md_xstrdup("label");
    st = r->n_in ? (json_is_object(v) ? MD_OK
                                      : row_error(r, 0, err, "is %s, not an object with the "
                                                  "inputs' fields", json_type_name(v)))
                 : jsonl_convert(r, v, 0, NULL, NULL, err);
    if (st != MD_OK) {
        json_decref(v);
        return st;
    }
    r->has_labels = r->label_key != NULL;
    r->pending = v;
    r->position = 0;
    return MD_OK;
}

static md_status jsonl_next(md_reader *r, float *row, int64_t *label, md_err *err)
{
    json_t *v = r->pending;
    r->pending = NULL;
    if (v) {
        r->position++;
    } else {
        md_status st = jsonl_parse_next(r, &v, err);
        if (st != MD_OK)
            return st;
    }
    md_status st;
    if (r->n_in) {
        st = named_jsonl_convert(r, v, r->position - 1, row, err);
        if (st == MD_OK && r->label_key) {
            json_t *l = json_object_get(v, r->label_key);
            int64_t value;
            if (json_is_integer(l))
                *label = json_integer_value(l);
            else if (json_is_real(l) && integral_double(json_real_value(l), &value))
                *label = value;
            else
                st = row_error(r, r->position - 1, err, "the label field \"%s\" is not an "
                               "integer", r->label_key);
        }
    } else {
        st = jsonl_convert(r, v, r->position - 1, row, label, err);
    }
    json_decref(v);
    return st;
}

/* ---- NPY ---- */

static md_status npy_open(md_reader *r, const md_reader_opts *opts, md_err *err)
{
    if (opts->features)
        return open_error(err, "%s: features applies to csv and jsonl only", r->name);
    if (opts->label)
        return open_error(err, "%s: npy files carry no labels; leave label out", r->name);
    md_status st = open_stream(r, opts->path, err);
    if (st != MD_OK)
        return st;
    /* 1 MiB reads: with 64 KiB ones the read syscalls cost the reader thread
     * more than its copies (perf), and the reader shares the cores with
     * the forwards */
    setvbuf(r->fp, NULL, _IOFBF, NPY_READ_BUFFER);

    unsigned char pre[12];
    size_t hlen = 0, off = 0;
    int version = 0;
    md_npy_pre_status ps = md_npy_preamble(pre, fread(pre, 1, 10, r->fp), &version, &hlen, &off);
    if (ps == MD_NPY_PRE_MORE) {
        if (fread(pre + 10, 1, 2, r->fp) != 2)
            return open_error(err, "%s: the NPY header is truncated", r->name);
        ps = md_npy_preamble(pre, 12, &version, &hlen, &off);
    }
    if (ps == MD_NPY_PRE_NOT_NPY)
        return open_error(err, "%s is not an NPY file (no \\x93NUMPY magic); write it with numpy.save",
                          r->name);
    if (ps == MD_NPY_PRE_VERSION)
        return open_error(err, "%s: NPY version %d is not supported", r->name, version);
    if (ps == MD_NPY_PRE_LARGE)
        return open_error(err, "%s: the NPY header is %zu bytes, more than 64 KiB", r->name, hlen);
    char header[MD_NPY_HEADER_MAX + 1];
    if (fread(header, 1, hlen, r->fp) != hlen)
        return open_error(err, "%s: the NPY header is truncated", r->name);
    header[hlen] = '\0';
    off += hlen;
    r->data_off = (int64_t)off;

    md_npy_dict dict;
    md_npy_dict_status ds = md_npy_parse_dict(header, &dict);
    if (ds == MD_NPY_DICT_KEYS)
        return open_error(err, "%s: the NPY header lacks descr, fortran_order or shape", r->name);
    if (ds == MD_NPY_DICT_FORTRAN)
        return open_error(err, "%s: the array is in Fortran order; save a C-order array "
                          "(numpy.ascontiguousarray)", r->name);
    const char *type = dict.descr;
    if (!strcmp(type, "<f4"))
        r->kind = NPY_F4, r->esize = 4;
    else if (!strcmp(type, "<f8"))
        r->kind = NPY_F8, r->esize = 8;
    else if (!strcmp(type, "<i8"))
        r->kind = NPY_I8, r->esize = 8;
    else if (!strcmp(type, "<i4"))
        r->kind = NPY_I4, r->esize = 4;
    else if (!strcmp(type, "|u1") || !strcmp(type, "<u1"))
        r->kind = NPY_U1, r->esize = 1;
    else
        return open_error(err, "%s: NPY dtype '%s' is not supported; use float32, float64, int64, "
                          "int32 or uint8 (little-endian)", r->name, type);

    const int64_t *dims = dict.shape;
    int ndim = dict.ndim;
    if (dict.shape_status != MD_NPY_DICT_OK)
        return open_error(err, "%s: the NPY shape is malformed or has more than %d dims", r->name,
                          MD_MAX_DIMS);
    if (ndim == 0)
        return open_error(err, "%s holds a scalar; save an array of rows", r->name);
    r->total = dims[0];
    r->width = 1;
    for (int i = 1; i < ndim; i++) {
        if (md_mul_i64(r->width, dims[i], &r->width) || r->width > MD_MAX_ROW_VALUES)
            return open_error(err, "%s: a row holds more than %lld values (the shape past dim 0), "
                              "the limit per row", r->name, (long long)MD_MAX_ROW_VALUES);
    }
    if (r->width == 0)
        return open_error(err, "%s: rows have no values (shape has a 0 past dim 0)", r->name);
    r->rowbytes = (size_t)r->width * r->esize;

    struct stat sb;
    if (fstat(fileno(r->fp), &sb) == 0 && S_ISREG(sb.st_mode)) {
        int64_t avail = (int64_t)sb.st_size - (int64_t)off;
        if (r->total > avail / (int64_t)r->rowbytes)
            return open_error(err, "%s is truncated: the header says %lld rows of %zu bytes, the "
                              "file holds %lld data bytes", r->name, (long long)r->total,
                              r->rowbytes, (long long)avail);
    }
    r->rowbuf = md_malloc_checked(r->rowbytes, "an NPY row", err);
    return r->rowbuf ? MD_OK : MD_ENOMEM;
}

/* Row conversions to float32: one tight loop per element type over restrict
 * pointers, so the compiler vectorizes them (a job converts every row of its
 * dataset on the job thread, which shares the cores with the workers). */
static void u8_to_f32(float *restrict dst, const unsigned char *restrict src, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        dst[i] = (float)src[i];
}

static void i32_to_f32(float *restrict dst, const int32_t *restrict src, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        dst[i] = (float)src[i];
}

static void i64_to_f32(float *restrict dst, const int64_t *restrict src, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        dst[i] = (float)src[i];
}

/* The index of the first value that is NaN, infinite or (for float64) out
 * of float32's range, or -1. The common all-finite case is one branch-free
 * pass. */
static int64_t first_bad_f32(const float *x, int64_t n)
{
    int bad = 0;
    for (int64_t i = 0; i < n; i++)
        bad |= !(fabsf(x[i]) <= FLT_MAX);
    for (int64_t i = 0; bad && i < n; i++)
        if (!(fabsf(x[i]) <= FLT_MAX))
            return i;
    return -1;
}

static int64_t first_bad_f64(const double *x, int64_t n)
{
    int bad = 0;
    for (int64_t i = 0; i < n; i++)
        bad |= !(fabs(x[i]) <= FLT_MAX);
    for (int64_t i = 0; bad && i < n; i++)
        if (!(fabs(x[i]) <= FLT_MAX))
            return i;
    return -1;
}

static void f64_to_f32(float *restrict dst, const double *restrict src, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        dst[i] = (float)src[i];
}

static md_status npy_next(md_reader *r, float *row, md_err *err)
{
    if (r->position >= r->total)
        return MD_ENOTFOUND;
    int64_t rowno = r->position;
    /* float32 rows are read straight into the caller's row */
    void *dst = r->kind == NPY_F4 ? (void *)row : (void *)r->rowbuf;
    if (fread(dst, 1, r->rowbytes, r->fp) != r->rowbytes) {
        if (ferror(r->fp))
            return md_err_set(err, MD_EIO, "%s row %lld: read failed: %s", r->name,
                              (long long)rowno, strerror(errno));
        return md_err_set(err, MD_EIO, "%s row %lld: the file ends early (truncated); its header "
                          "says %lld rows", r->name, (long long)rowno, (long long)r->total);
    }
    r->position++;
    /* rowbuf comes from malloc, so it is aligned for any element type */
    int64_t bad = -1;
    switch (r->kind) {
    case NPY_F4:
        bad = first_bad_f32(row, r->width);
        if (bad >= 0)
            return row_error(r, rowno, err, "value %lld is NaN or infinite", (long long)bad);
        break;
    case NPY_F8:
        bad = first_bad_f64((const double *)(void *)r->rowbuf, r->width);
        if (bad >= 0)
            return row_error(r, rowno, err, "value %lld is not a finite float32 number",
                             (long long)bad);
        f64_to_f32(row, (const double *)(void *)r->rowbuf, r->width);
        break;
    case NPY_I8: i64_to_f32(row, (const int64_t *)(void *)r->rowbuf, r->width); break;
    case NPY_I4: i32_to_f32(row, (const int32_t *)(void *)r->rowbuf, r->width); break;
    case NPY_U1: u8_to_f32(row, r->rowbuf, r->width); break;
    }
    return MD_OK;
}

/* ---- IDX ---- */

/* Open an IDX file (plain or gzip) and read its magic and dims. */
static md_status idx_header(const char *path, md_gz **gz, unsigned char magic[4], int64_t *dims,
                            md_err *err)
{
    const char *name = base_name(path);
    errno = 0;
    *gz = md_gz_open(path);
    if (!*gz)
        return open_error(err, "cannot open dataset %s: %s", path,
                          errno ? strerror(errno) : "out of memory");
    struct stat st;
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode))
        return open_error(err, "dataset %s is a directory, not a file", path);
    if (md_gz_read(*gz, magic, 4) != 4 || magic[0] != 0 || magic[1] != 0 || magic[3] < 1 ||
        magic[3] > MD_MAX_DIMS)
        return open_error(err, "%s is not an IDX file (the MNIST format: magic 0x00000803 for "
                          "images, 0x00000801 for labels)", name);
    if (magic[2] != 0x08)
        return open_error(err, "%s: IDX element type 0x%02x is not supported; only unsigned "
                          "bytes (0x08)", name, magic[2]);
    for (int i = 0; i < magic[3]; i++) {
        unsigned char b[4];
        if (md_gz_read(*gz, b, 4) != 4)
            return open_error(err, "%s: the IDX header is truncated", name);
        dims[i] = (int64_t)b[0] << 24 | (int64_t)b[1] << 16 | (int64_t)b[2] << 8 | b[3];
    }
    return MD_OK;
}

static md_status idx_open(md_reader *r, const md_reader_opts *opts, md_err *err)
{
    if (opts->features)
        return open_error(err, "%s: features applies to csv and jsonl only", r->name);
    unsigned char magic[4];
    int64_t dims[MD_MAX_DIMS];
    md_status st = idx_header(opts->path, &r->gz, magic, dims, err);
    if (st != MD_OK)
        return st;
    r->total = dims[0];
    r->data_off = 4 + 4 * (int64_t)magic[3]; /* the magic, then one size per dim */
    r->width = 1;
    for (int i = 1; i < magic[3]; i++) {
        if (md_mul_i64(r->width, dims[i], &r->width) || r->width > MD_MAX_ROW_VALUES)
            return open_error(err, "%s: a row holds more than %lld values (the dims past the "
                              "first), the limit per row", r->name, (long long)MD_MAX_ROW_VALUES);
    }
    if (r->width == 0)
        return open_error(err, "%s: rows have no values (a dim past the first is 0)", r->name);
    r->rowbytes = (size_t)r->width;
    r->rowbuf = md_malloc_checked(r->rowbytes, "an IDX row", err);
    if (!r->rowbuf)
        return MD_ENOMEM;

    if (opts->label) {
        int64_t ldims[MD_MAX_DIMS];
        st = idx_header(opts->label, &r->gz_labels, magic, ldims, err);
        r->label_name = md_xstrdup(base_name(opts->label));
        if (st != MD_OK)
            return st;
        if (magic[3] != 1)
            return open_error(err, "%s is not an IDX labels file (magic 0x00000801, one dim); it "
                              "has %d dims", r->label_name, magic[3]);
        if (ldims[0] != r->total)
            return open_error(err, "%s has %lld labels but %s has %lld rows; they must match",
                              r->label_name, (long long)ldims[0], r->name,
                              (long long)r->total);
        r->has_labels = 1;
    }
    return MD_OK;
}

/* MD_EIO for a short read: a read error, corrupt gzip data or a truncated file. */
static md_status gz_failure(md_reader *r, md_gz *gz, const char *name, int64_t rowno, md_err *err)
{
    const char *msg = md_gz_error(gz, NULL);
    if (msg)
        return md_err_set(err, MD_EIO, "%s row %lld: %s", name, (long long)rowno, msg);
    return md_err_set(err, MD_EIO, "%s row %lld: the file ends early (truncated); its header says "
                      "%lld rows", name, (long long)rowno, (long long)r->total);
}

/* After the last row: read on to the end of the data, so that a gzip
 * member's CRC-32 and length, which follow its last byte, are checked (a
 * damaged file fails its job instead of passing for a good one). Bytes past
 * the rows the header declares are allowed, and not read past END_DRAIN. */
#define END_DRAIN (1 << 20)
static md_status idx_end(md_reader *r, md_gz *gz, const char *name, md_err *err)
{
    unsigned char b[4096];
    size_t drained = 0, got;
    while (drained < END_DRAIN && (got = md_gz_read(gz, b, sizeof b)) > 0) {
        drained += got;
        if (got < sizeof b)
            break;
    }
    const char *msg = md_gz_error(gz, NULL);
    if (msg)
        return md_err_set(err, MD_EIO, "%s, after its last row (%lld): %s; the file is damaged",
                          name, (long long)r->total, msg);
    return MD_OK;
}

static md_status idx_next(md_reader *r, float *row, int64_t *label, md_err *err)
{
    if (r->position >= r->total) {
        if (!r->end_checked) {
            r->end_checked = 1;
            md_status st = idx_end(r, r->gz, r->name, err);
            if (st == MD_OK && r->gz_labels)
                st = idx_end(r, r->gz_labels, r->label_name, err);
            if (st != MD_OK)
                return st;
        }
        return MD_ENOTFOUND;
    }
    int64_t rowno = r->position;
    if (md_gz_read(r->gz, r->rowbuf, r->rowbytes) != r->rowbytes)
        return gz_failure(r, r->gz, r->name, rowno, err);
    if (r->gz_labels) {
        unsigned char b;
        if (md_gz_read(r->gz_labels, &b, 1) != 1)
            return gz_failure(r, r->gz_labels, r->label_name, rowno, err);
        if (label)
            *label = b;
    }
    r->position++;
    u8_to_f32(row, r->rowbuf, r->width);
    return MD_OK;
}

/* ---- the public interface ---- */

md_status md_reader_open(const md_reader_opts *opts, md_reader **out, md_err *err)
{
    *out = NULL;
    if (!opts || !opts->path || !*opts->path)
        return open_error(err, "no dataset path given");
    reader_format format;
    if (!opts->format)
        return open_error(err, "no format given for dataset %s; use csv, jsonl, npy, idx or images",
                          base_name(opts->path));
    if (!strcmp(opts->format, "csv"))
        format = FMT_CSV;
    else if (!strcmp(opts->format, "jsonl"))
        format = FMT_JSONL;
    else if (!strcmp(opts->format, "npy"))
        format = FMT_NPY;
    else if (!strcmp(opts->format, "idx"))
        format = FMT_IDX;
    else if (!strcmp(opts->format, "images"))
        format = FMT_IMAGES;
    else if (!strcmp(opts->format, "npz"))
        format = FMT_NPZ;
    else
        return open_error(err, "unknown dataset format \"%s\"; use csv, jsonl, npy, npz, idx or "
                          "images",
                          opts->format);

    md_reader *r = md_xcalloc(1, sizeof *r);
    r->format = format;
    r->name = md_xstrdup(base_name(opts->path));
    r->total = -1;
    r->label_col = -1;
    md_status st;
    switch (format) {
    case FMT_CSV: st = csv_open(r, opts, err); break;
    case FMT_JSONL: st = jsonl_open(r, opts, err); break;
    case FMT_NPY: st = npy_open(r, opts, err); break;
    case FMT_NPZ:
        if (opts->n_inputs < 1) {
            st = open_error(err, "%s: an npz dataset holds one array per model input, and the "
                            "model declares no config.inputs: use npy", r->name);
            break;
        }
        r->n_in = opts->n_inputs;
        for (int i = 0; i < r->n_in; i++) {
            r->in[i] = opts->inputs[i];
            r->width += r->in[i].values * (r->in[i].is_int ? 2 : 1);
        }
        st = md_npzset_open(opts->path, r->name, r->in, r->n_in, opts->label, &r->npz, err);
        if (st == MD_OK) {
            r->total = md_npzset_rows(r->npz);
            r->has_labels = opts->label != NULL;
        }
        break;
    case FMT_IMAGES:
        st = md_images_open(opts, r->name, &r->images, err);
        if (st == MD_OK) {
            r->width = md_images_width(r->images);
            r->total = md_images_count(r->images);
            r->has_labels = md_images_has_labels(r->images);
        }
        break;
    default: st = idx_open(r, opts, err); break;
    }
    /* csv and jsonl widths come from a header or a first line: bounded by
     * the record limit, and here by the per-row limit every format shares */
    if (st == MD_OK && r->width > MD_MAX_ROW_VALUES)
        st = open_error(err, "%s: a row holds %lld values, more than the limit of %lld per row",
                        r->name, (long long)r->width, (long long)MD_MAX_ROW_VALUES);
    if (st != MD_OK) {
        md_reader_close(r);
        return st;
    }
    *out = r;
    return MD_OK;
}

int64_t md_reader_row_width(const md_reader *r)
{
    return r->width;
}

int64_t md_reader_total_rows(const md_reader *r)
{
    return r->total;
}

int md_reader_has_labels(const md_reader *r)
{
    return r->has_labels;
}

md_status md_reader_next(md_reader *r, float *row, int64_t *label, md_err *err)
{
    int64_t unused;
    if (!label)
        label = &unused;
    *label = -1; /* rows without labels */
    switch (r->format) {
    case FMT_CSV: return csv_next(r, row, label, err);
    case FMT_JSONL: return jsonl_next(r, row, label, err);
    case FMT_NPY: return npy_next(r, row, err);
    case FMT_NPZ: {
        md_status st = md_npzset_next(r->npz, r->position, row, label, err);
        if (st == MD_OK || st == MD_EINVAL)
            r->position++; /* a bad row is consumed */
        return st;
    }
    case FMT_IMAGES: {
        md_status st = md_images_read(r->images, r->position, row, label, err);
        if (st == MD_OK || st == MD_EINVAL)
            r->position++; /* a bad image is consumed, as a bad row is */
        return st;
    }
    default: return idx_next(r, row, label, err);
    }
}

md_status md_reader_skip_to(md_reader *r, int64_t rows, md_err *err)
{
    if (r->format == FMT_IMAGES) {
        r->position = rows < r->total ? rows : r->total;
        return MD_OK;
    }
    float *row = md_xmalloc(sizeof(float) * (size_t)(r->width > 0 ? r->width : 1));
    md_status st = MD_OK;
    while (r->position < rows) {
        int64_t label;
        st = md_reader_next(r, row, &label, err);
        if (st == MD_ENOTFOUND || (st != MD_OK && st != MD_EINVAL))
            break;
    }
    free(row);
    return st == MD_EIO || st == MD_ENOMEM ? st : MD_OK;
}

const char *md_reader_row_name(const md_reader *r, int64_t index)
{
    return r->images ? md_images_path(r->images, index) : NULL;
}

int64_t md_reader_files_skipped(const md_reader *r)
{
    return r->images ? md_images_skipped(r->images) : -1;
}

int64_t md_reader_position(const md_reader *r)
{
    return r->position;
}

void md_reader_close(md_reader *r)
{
    if (!r)
        return;
    if (r->fp)
        fclose(r->fp);
    md_gz_close(r->gz);
    md_gz_close(r->gz_labels);
    for (size_t i = 0; r->colnames && i < r->ncols; i++)
        free(r->colnames[i]);
    free(r->colnames);
    free(r->fields);
    free(r->feature_cols);
    free(r->in_cols);
    for (size_t k = 0; k < r->in_nkeys_total; k++)
        free(r->in_keys[k]);
    free(r->in_keys);
    free(r->features_key);
    free(r->label_key);
    json_decref(r->pending);
    free(r->rowbuf);
    free(r->buf);
    free(r->label_name);
    md_images_close(r->images);
    md_npzset_close(r->npz);
    free(r->name);
    free(r);
}

/* ---- chunked jobs (issue 26) ---- */

int64_t md_reader_byte_offset(const md_reader *r)
{
    if (r->format != FMT_CSV && r->format != FMT_JSONL)
        return -1;
    return r->buf_base + (int64_t)r->start;
}

int md_reader_layout(const md_reader *r, int64_t *data_off, int64_t *row_bytes, int64_t *label_off)
{
    *label_off = -1;
    if (r->format == FMT_NPY) {
        *data_off = r->data_off;
        *row_bytes = (int64_t)r->rowbytes;
        return 1;
    }
    if (r->format == FMT_IDX && !md_gz_is_gzip(r->gz) &&
        (!r->gz_labels || !md_gz_is_gzip(r->gz_labels))) {
        *data_off = r->data_off;
        *row_bytes = (int64_t)r->rowbytes;
        *label_off = r->gz_labels ? 8 : -1; /* magic and the count: one byte a label */
        return 1;
    }
    return 0;
}
