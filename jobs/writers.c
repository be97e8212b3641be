/*
 * writers.c - a batch job's output: one predicted row formatted as JSON
 * Lines or CSV, the NPY header (a fixed slot, filled with the final shape at
 * the end), and the output file itself: opened under allowed_paths or in the
 * store's jobs/ directory, a new inode per run, published under its name
 * only if nothing is there. The scheduler (scheduler.c) drives them; the
 * contract is writers.h, private to jobs/.
 */
#define _GNU_SOURCE
#include "writers.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

int md_job_write_all(int fd, const char *p, size_t n)
{
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* ---- output formats ---- */

int md_job_include_has(json_t *include, const char *what, int dflt)
{
    if (!json_is_array(include))
        return dflt;
    size_t i;
    json_t *v;
    json_array_foreach(include, i, v)
    {
        if (json_is_string(v) && strcmp(json_string_value(v), what) == 0)
            return 1;
    }
    return 0;
}

/* Append one output row as text to `b`. */
void md_job_format_row(char **b, size_t *len, size_t *cap, const md_job_outfmt *o, md_model *m,
                       int64_t index, const char *path, const float *y, const md_classes *cls,
                       int has_label, int64_t label, const float *outs)
{
    json_t *labels = md_model_labels(m);
    int64_t width = cls->width;
    char num[40];
#define ADD(s)                                                                                \
    do {                                                                                      \
        size_t l_ = strlen(s);                                                                \
        if (*len + l_ + 1 > *cap) {                                                           \
            *cap = (*cap + l_ + 1) * 2;                                                       \
            *b = realloc(*b, *cap);                                                           \
            md_assert(*b != NULL);                                                            \
        }                                                                                     \
        memcpy(*b + *len, s, l_ + 1);                                                         \
        *len += l_;                                                                           \
    } while (0)
    /* a class by name (JSON: a JSON string) or by index */
#define ADD_CLASS(k)                                                                          \
    do {                                                                                      \
        json_t *name_ = labels ? json_array_get(labels, (size_t)(k)) : NULL;                  \
        if (json_is_string(name_) && o->kind == 0) {                                          \
            char *t_ = json_dumps(name_, JSON_ENCODE_ANY);                                    \
            ADD(t_);                                                                          \
            free(t_);                                                                         \
        } else if (json_is_string(name_)) {                                                   \
            ADD(json_string_value(name_));                                                    \
        } else {                                                                              \
            snprintf(num, sizeof num, "%lld", (long long)(k));                                \
            ADD(num);                                                                         \
        }                                                                                     \
    } while (0)
    int64_t cl = md_classes_top(cls, y);
    const char *sep = o->kind == 1 ? "," : ",";
    int first = 1;
    if (o->kind == 0)
        ADD("{");
    if (o->inc_index) {
        if (o->kind == 0)
            ADD("\"index\":");
        snprintf(num, sizeof num, "%lld", (long long)index);
        ADD(num);
        first = 0;
    }
    if (o->inc_path) {
        /* JSON: a JSON string (jansson escapes it); CSV: RFC 4180, quoted
         * when it holds a comma, a quote or a line break */
        if (!first)
            ADD(sep);
        if (o->kind == 0) {
            ADD("\"path\":");
            json_t *s = json_string(path ? path : "");
            if (!s) {
                /* a file name that is not UTF-8 (JSON strings must be):
                 * its non-ASCII bytes become '?' */
                char *ascii = md_xstrdup(path);
                for (char *p = ascii; *p; p++)
                    if ((unsigned char)*p >= 0x80)
                        *p = '?';
                s = json_string(ascii);
                free(ascii);
            }
            char *t = json_dumps(s, JSON_ENCODE_ANY);
            md_assert(t != NULL);
            ADD(t);
            free(t);
            json_decref(s);
        } else if (path && strpbrk(path, ",\"\r\n")) {
            ADD("\"");
            for (const char *p = path; *p; p++) {
                char one[3] = {*p, *p == '"' ? '"' : '\0', '\0'};
                ADD(one);
            }
            ADD("\"");
        } else {
            ADD(path ? path : "");
        }
        first = 0;
    }
    for (int j = 0; outs && j < md_model_n_outputs(m); j++) {
        /* each declared output, its values flattened */
        md_io_info oi;
        md_model_output(m, j, &oi);
        if (!first)
            ADD(sep);
        if (o->kind == 0) {
            json_t *name = json_string(oi.name);
            char *t = json_dumps(name, JSON_ENCODE_ANY);
            md_assert(t != NULL);
            ADD(t);
            ADD(":");
            free(t);
            json_decref(name);
            if (oi.ndim > 0)
                ADD("[");
        }
        for (int64_t v = 0; v < oi.values; v++) {
            if (v)
                ADD(","); /* CSV: a column per value (NAME_0, NAME_1, ...) */
            md_float_format(outs[oi.off + v], num, sizeof num);
            ADD(num);
        }
        if (o->kind == 0 && oi.ndim > 0)
            ADD("]");
        first = 0;
    }
    if (outs && !y) { /* no classes output: the outputs are the answer */
        if (o->inc_label) {
            if (!first)
                ADD(sep);
            if (o->kind == 0)
                ADD("\"label\":");
            if (has_label)
                snprintf(num, sizeof num, "%lld", (long long)label);
            else
                snprintf(num, sizeof num, "%s", o->kind == 0 ? "null" : "");
            ADD(num);
        }
        ADD(o->kind == 0 ? "}\n" : "\n");
        return;
    }
    float *p = NULL;
    if (cls->kind != MD_CLASSES_NONE && cls->classes > 0) {
        p = md_xmalloc(sizeof(float) * (size_t)cls->classes);
        md_classes_probs(cls, y, p);
    }
    if (o->inc_pred) {
        if (!first)
            ADD(sep);
        if (o->kind == 0)
            ADD("\"prediction\":");
        int multi = cls->kind == MD_CLASSES_MULTI;
        if ((o->top_k > 0 && cls->classes > 1) || (multi && o->top_k == 0)) {
            /* the k most likely classes, best first; or, multi-label, every
             * class present, best first (ranked on the values: a class is
             * present when its value passes the cut, so they lead) */
            int64_t k = o->top_k > 0 ? o->top_k : cls->classes;
            k = k < cls->classes ? k : cls->classes;
            int64_t *top = md_xmalloc(sizeof(int64_t) * (size_t)k);
            float *scratch = md_xmalloc(sizeof(float) * (size_t)cls->classes * 2);
            k = md_classes_top_k(cls, y, k, scratch, top, scratch + cls->classes);
            if (o->kind == 0)
                ADD("[");
            for (int64_t t = 0; t < k; t++) {
                if (multi && o->top_k == 0 && !md_classes_present(cls, y, top[t]))
                    break;
                if (t)
                    ADD(o->kind == 0 ? "," : ";");
                ADD_CLASS(top[t]);
            }
            free(top);
            free(scratch);
            if (o->kind == 0)
                ADD("]");
        } else if (cls->kind == MD_CLASSES_BINARY ||
                   (cls->kind == MD_CLASSES_ARGMAX && labels &&
                    json_is_string(json_array_get(labels, (size_t)cl)))) {
            ADD_CLASS(cl);
        } else if (cls->kind == MD_CLASSES_ARGMAX && width > 1 &&
                   (labels || md_model_output_logits(m))) {
            snprintf(num, sizeof num, "%lld", (long long)cl);
            ADD(num);
        } else {
            /* no class to name: the values as they are */
            if (o->kind == 0)
                ADD("[");
            for (int64_t j = 0; j < width; j++) {
                if (j)
                    ADD(o->kind == 0 ? "," : ";");
                md_float_format(y[j], num, sizeof num);
                ADD(num);
            }
            if (o->kind == 0)
                ADD("]");
        }
        first = 0;
    }
    if (o->inc_label) {
        if (!first)
            ADD(sep);
        if (o->kind == 0)
            ADD("\"label\":");
        if (has_label)
            snprintf(num, sizeof num, "%lld", (long long)label);
        else
            snprintf(num, sizeof num, "%s", o->kind == 0 ? "null" : "");
        ADD(num);
        first = 0;
    }
    if (o->inc_scores) {
        /* each class's probability (md_classes_probs); a row without
         * classes: its values */
        if (!first)
            ADD(sep);
        if (o->kind == 0)
            ADD("\"scores\":[");
        int64_t n = p ? cls->classes : width;
        for (int64_t j = 0; j < n; j++) {
            if (j)
                ADD(o->kind == 0 ? "," : ";");
            md_float_format(p ? p[j] : y[j], num, sizeof num);
            ADD(num);
        }
        if (o->kind == 0)
            ADD("]");
    }
    free(p);
    ADD(o->kind == 0 ? "}\n" : "\n");
#undef ADD_CLASS
#undef ADD
}

void md_job_npy_header(char out[MD_JOB_NPY_HEADER], int64_t rows, const int64_t *shape,
                       int ndim)
{
    char dims[200];
    int n = snprintf(dims, sizeof dims, "%lld,", (long long)rows);
    for (int d = 1; d < ndim; d++)
        n += snprintf(dims + n, sizeof dims - (size_t)n, " %lld,", (long long)shape[d]);
    if (ndim > 1)
        dims[n - 1] = '\0';
    memset(out, ' ', MD_JOB_NPY_HEADER);
    memcpy(out, "\x93NUMPY\x01\x00", 8);
    out[8] = (char)(MD_JOB_NPY_HEADER - 10);
    out[9] = 0;
    int h = snprintf(out + 10, MD_JOB_NPY_HEADER - 10, "{'descr': '<f4', 'fortran_order': False, "
                                                "'shape': (%s), }",
                     dims);
    out[10 + h] = ' '; /* snprintf's NUL */
    out[MD_JOB_NPY_HEADER - 1] = '\n';
}

/* Write the final NPY header: the shape is known only at the end. The
 * width comes from the file's size and the rows written (`rows`, counted
 * from the committed state), not from this run's chunks: a run that resumes
 * with nothing left to compute writes the same header as the first. */
static md_status finish_npy(int fd, long long out_bytes, int64_t rows, const char *path,
                            md_err *err)
{
    char h[MD_JOB_NPY_HEADER];
    long long payload = out_bytes - MD_JOB_NPY_HEADER;
    int64_t width = 0;
    if (rows > 0) {
        if (payload <= 0 || payload % ((long long)sizeof(float) * rows) != 0)
            return md_err_set(err, MD_EIO, "the job output %s holds %lld bytes of predictions, "
                              "not a whole number of float32 values for each of its %lld rows",
                              path, payload, (long long)rows);
        width = payload / (long long)sizeof(float) / rows;
    }
    int64_t shape[2] = {rows, width};
    md_job_npy_header(h, rows, shape, rows > 0 ? 2 : 1);
    if (pwrite(fd, h, MD_JOB_NPY_HEADER, 0) != MD_JOB_NPY_HEADER)
        return md_err_set(err, MD_EIO, "writing %s failed: %s", path, strerror(errno));
    return MD_OK;
}

/* ---- the output file ---- */

/*
 * The output lives in a directory opened once per run: under allowed_paths
 * component by component without following symlinks (output.path), or the
 * store's jobs/ directory. Each run writes into a file of its own: a new
 * inode created with O_EXCL under a unique temp name, filled with the
 * committed bytes of the previous <leaf>.partial when resuming, then renamed
 * over <leaf>.partial. A runner that lost its lease and has not noticed yet
 * still holds the old inode, so it can never write into the new owner's
 * file. The finished file is renamed to <leaf> only if nothing is there.
 */
md_status md_job_out_open_dir(const md_strlist *allowed_paths, md_store *store, json_t *output,
                              const char *out_path, md_job_outfile *of, md_err *err)
{
    of->dirfd = -1;
    of->path = out_path;
    const char *leaf;
    const char *opath = json_string_value(json_object_get(output, "path"));
    if (opath && strncmp(opath, "s3://", 5) != 0) { /* s3://: staged in the store, then put */
        /* checked again here: this replica's allowed_paths may differ from
         * the one that took the request, and the tree may have changed */
        md_status st = md_path_open_dir(allowed_paths, "output.path", out_path,
                                        "invalid_path", &of->dirfd, &leaf, err);
        if (st != MD_OK)
            return st;
    } else {
        char dir[4200];
        snprintf(dir, sizeof dir, "%s/jobs", md_store_dir(store));
        of->dirfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (of->dirfd < 0)
            return md_err_set(err, MD_EIO, "cannot open %s: %s", dir, strerror(errno));
        const char *slash = strrchr(out_path, '/');
        leaf = slash ? slash + 1 : out_path;
    }
    if (strlen(leaf) + 40 > sizeof of->leaf)
        return md_err_setc(err, MD_EINVAL, "invalid_path",
                           "output.path %.200s: the file name is longer than %zu bytes", out_path,
                           sizeof of->leaf - 40);
    snprintf(of->leaf, sizeof of->leaf, "%s", leaf);
    snprintf(of->partial, sizeof of->partial, "%s.partial", leaf);
    return MD_OK;
}

/* Copy the first `n` bytes of `from` into `to` (both at offset 0). */
static int copy_prefix(int from, int to, long long n)
{
    char buf[65536];
    long long off = 0;
    while (off < n) {
        size_t want = (size_t)(n - off < (long long)sizeof buf ? n - off : (long long)sizeof buf);
        ssize_t r = pread(from, buf, want, (off_t)off);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        if (md_job_write_all(to, buf, (size_t)r) != 0)
            return -1;
        off += r;
    }
    return 0;
}

/* This run's partial file, positioned at `out_bytes` (see above). `fresh`:
 * nothing is committed yet. `in_fd` (or -1) is the input, which must not be
 * the output. Returns the descriptor, or -1 with `err` set. */
int md_job_out_open_partial(md_job_outfile *of, int fresh, long long out_bytes, int in_fd,
                            const atomic_int *lost, md_err *err)
{
    struct stat sb, in_sb;
    if (fresh && fstatat(of->dirfd, of->leaf, &sb, AT_SYMLINK_NOFOLLOW) == 0) {
        md_err_setc(err, MD_ECONFLICT, "output_exists",
                    "the output %.200s already exists; modeld never replaces a file: remove it "
                    "or give another output.path",
                    of->path);
        return -1;
    }
    unsigned rnd = 0;
    if (getrandom(&rnd, sizeof rnd, 0) != sizeof rnd)
        rnd = (unsigned)time(NULL) ^ (unsigned)(uintptr_t)&rnd;
    char tmp[400];
    snprintf(tmp, sizeof tmp, "%s.%ld.%08x", of->partial, (long)getpid(), rnd);
    int fd = openat(of->dirfd, tmp, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0) {
        md_err_set(err, MD_EIO, "cannot create the job output %s.partial: %s", of->path,
                   strerror(errno));
        return -1;
    }
    if (!fresh) {
        int old = openat(of->dirfd, of->partial, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
        if (old < 0 || fstat(old, &sb) != 0 || !S_ISREG(sb.st_mode) || sb.st_size < out_bytes) {
            md_err_set(err, MD_EIO, "the job output %s.partial is missing, not a regular file or "
                       "shorter than its %lld committed bytes; the job cannot resume: create it "
                       "again",
                       of->path, out_bytes);
            goto fail_old;
        }
        if (in_fd >= 0 && fstat(in_fd, &in_sb) == 0 && in_sb.st_dev == sb.st_dev &&
            in_sb.st_ino == sb.st_ino) {
            md_err_setc(err, MD_EINVAL, "invalid_path",
                        "the input is this job's own output file %s.partial", of->path);
            goto fail_old;
        }
        if (copy_prefix(old, fd, out_bytes) != 0) {
            md_err_set(err, MD_EIO, "copying the job output %s.partial failed: %s", of->path,
                       strerror(errno));
            goto fail_old;
        }
        close(old);
        if (fsync(fd) != 0) {
            md_err_set(err, MD_EIO, "fsync of %s.partial failed: %s", of->path, strerror(errno));
            goto fail;
        }
        goto renamed;
    fail_old:
        if (old >= 0)
            close(old);
        goto fail;
    }
renamed:
    /* the lease keeper ran through the copy; a lease lost meanwhile means
     * another replica owns <leaf>.partial now: leave it alone */
    if (lost && atomic_load(lost)) {
        md_err_setc(err, MD_ECONFLICT, "job_taken_over",
                    "another replica took the job over while its output was being copied");
        goto fail;
    }
    if (renameat(of->dirfd, tmp, of->dirfd, of->partial) != 0) {
        md_err_set(err, MD_EIO, "cannot rename the job output to %s.partial: %s", of->path,
                   strerror(errno));
        goto fail;
    }
    if (md_fsync_dir(of->dirfd, of->path, err) != MD_OK) {
        close(fd);
        return -1;
    }
    if (lseek(fd, (off_t)out_bytes, SEEK_SET) != (off_t)out_bytes) {
        md_err_set(err, MD_EIO, "cannot seek in %s.partial: %s", of->path, strerror(errno));
        close(fd);
        return -1;
    }
    return fd;
fail:
    unlinkat(of->dirfd, tmp, 0);
    close(fd);
    return -1;
}

/* Give the finished (or cancelled) partial file `fd` its name: only if
 * <leaf>.partial is still this run's file (another job given the same
 * output.path replaces it with its own), never over a file that appeared
 * meanwhile; durable once the directory is. */
static md_status out_publish(md_job_outfile *of, int fd, md_err *err)
{
    struct stat mine, there;
    if (fstat(fd, &mine) != 0 ||
        fstatat(of->dirfd, of->partial, &there, AT_SYMLINK_NOFOLLOW) != 0 ||
        mine.st_dev != there.st_dev || mine.st_ino != there.st_ino)
        return md_err_setc(err, MD_ECONFLICT, "output_conflict",
                           "another job wrote to the same output %.200s; this job's result "
                           "is discarded: give each job its own output.path",
                           of->path);
    if (renameat2(of->dirfd, of->partial, of->dirfd, of->leaf, RENAME_NOREPLACE) != 0) {
        int e = errno;
        if (e == EINVAL || e == ENOSYS) { /* a file system without RENAME_NOREPLACE */
            if (linkat(of->dirfd, of->partial, of->dirfd, of->leaf, 0) == 0) {
                unlinkat(of->dirfd, of->partial, 0);
                e = 0;
            } else {
                e = errno;
            }
        }
        if (e == EEXIST)
            return md_err_setc(err, MD_ECONFLICT, "output_exists",
                               "the output %.200s appeared while the job ran; modeld never "
                               "replaces a file: the result stays in %.200s.partial",
                               of->path, of->path);
        if (e)
            return md_err_set(err, MD_EIO, "cannot rename %s.partial to %s: %s", of->path,
                              of->path, strerror(e));
    }
    return md_fsync_dir(of->dirfd, of->path, err);
}

/* The output as written so far becomes the job's file (finished or
 * cancelled alike): an NPY gets its final header, the data is made durable,
 * then published under its name; *fd is closed on success. */
md_status md_job_out_finish(md_job_outfile *of, int *fd, int npy, long long out_bytes,
                            int64_t rows, const char *partial, md_err *err)
{
    if (npy && finish_npy(*fd, out_bytes, rows, partial, err) != MD_OK)
        return err->status;
    if (fsync(*fd) != 0)
        return md_err_set(err, MD_EIO, "fsync of %s failed: %s", partial, strerror(errno));
    if (out_publish(of, *fd, err) != MD_OK)
        return err->status;
    close(*fd);
    *fd = -1;
    return MD_OK;
}
