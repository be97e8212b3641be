/*
 * images.c - the dataset reader over a folder of images (input.format
 * "images"): the PNG and JPEG files under a directory, one row each,
 * decoded and preprocessed by predictor/image.h as the model version
 * declares (preprocess.image), labelled by their class folder (torchvision's
 * ImageFolder) or by a regular expression on the file name. readers.c puts
 * it behind md_reader (jobs/images.h).
 *
 * DESIGN
 * The whole listing is made at open, so that a row's number is its file's
 * index in one deterministic order and a resumed job skips by number without
 * reading a file. The tree is walked from the directory the scheduler opened
 * under allowed_paths, each level with openat(O_NOFOLLOW): names starting
 * with a dot are ignored (".git", ".DS_Store", editors' temp files);
 * symlinks (never followed: one could lead out of allowed_paths), other
 * non-regular files and regular files that are neither PNG nor JPEG by their
 * first bytes are left out and counted (files_skipped). The images are
 * sorted by relative path, byte by byte (strcmp), the same order on every
 * file system and in every locale. Classes are learned at open, over every
 * listed image, so a file's label index does not depend on where a run
 * starts:
 *   folder  the first directory under the path (ImageFolder's class folder;
 *           for the usual <path>/<class>/<file> layout, the parent's name)
 *   regex   POSIX extended, on the file name: the first capture group, or
 *           the whole match when there is none
 * Class strings become indices as the version's labels say when it declares
 * labels and every class string is one of them (a folder per label name),
 * else by their sorted order (ImageFolder's class_to_idx).
 *
 * A resumed job lists the folder again and goes on by position, so it is
 * exact as long as the folder did not change in between (as any dataset
 * file must not).
 *
 * Reading a row opens the file again component by component with O_NOFOLLOW
 * (the tree may have changed since the listing), reads at most
 * max_file_bytes into one buffer the reader keeps, and decodes it. A file
 * that does not decode (truncated, corrupt, CMYK, a pixel bomb told from its
 * header), has no label, or went away is a bad row named by its path: the
 * job's on_error policy decides, as for a malformed CSV row.
 */
#define _GNU_SOURCE
#include "images.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <regex.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define SNIFF_BYTES 16

#define LABEL_NONE (-1)     /* no labels asked */
#define LABEL_MISSING (-2)  /* labels asked, this file has none: a bad row */

typedef enum { LABELS_NONE, LABELS_FOLDER, LABELS_REGEX } label_mode;

typedef struct img_file {
    char *rel;     /* path relative to the directory */
    char *cls;     /* class string while opening; NULL after */
    int64_t label; /* class index, LABEL_NONE or LABEL_MISSING */
} img_file;

struct md_images {
    int root;                /* the directory */
    char *name;              /* the dataset in messages */
    md_image_opts opts;
    int64_t width;
    img_file *files;
    size_t n, cap;
    int64_t entries;         /* directory entries looked at, for max_files */
    int64_t max_files;
    long long max_file_bytes;
    int64_t skipped;
    label_mode labels;
    regex_t re;
    int re_ok;
    unsigned char *buf;      /* the file being decoded */
    size_t buf_cap;
};

static md_status dataset_error(md_err *err, md_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static md_status dataset_error(md_err *err, md_status st, const char *fmt, ...)
{
    char msg[MD_ERR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return md_err_setc(err, st, st == MD_ETOOBIG ? "too_many_files" : "invalid_dataset", "%s",
                       msg);
}

/* ---- listing ---- */

/* 1 when the regular file `name` in `dirfd` starts as a PNG or a JPEG. A
 * file that cannot be opened or read is not an image here (skipped). */
static int sniff(int dirfd, const char *name)
{
    int fd = openat(dirfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0)
        return 0;
    unsigned char head[SNIFF_BYTES];
    ssize_t got = pread(fd, head, sizeof head, 0);
    close(fd);
    return got > 0 && md_image_sniff(head, (size_t)got) != MD_IMAGE_NONE;
}

static void add_file(md_images *im, const char *rel)
{
    if (im->n == im->cap) {
        im->cap = im->cap ? im->cap * 2 : 256;
        im->files = realloc(im->files, im->cap * sizeof *im->files);
        md_assert(im->files != NULL); /* bounded by max_files entries */
    }
    im->files[im->n].rel = md_xstrdup(rel);
    im->files[im->n].cls = NULL;
    im->files[im->n].label = LABEL_NONE;
    im->n++;
}

/* List the directory `fd` (taken: closed here), `rel` its path relative to
 * the root ("" for the root; a buffer of PATH_MAX bytes, restored on return). */
static md_status walk(md_images *im, int fd, char *rel, int depth, md_err *err)
{
    DIR *d = fdopendir(fd);
    if (!d) {
        close(fd);
        return dataset_error(err, MD_EINVAL, "%s: cannot list %s: %s", im->name,
                             rel[0] ? rel : "the directory", strerror(errno));
    }
    size_t base = strlen(rel);
    md_status st = MD_OK;
    struct dirent *e;
    errno = 0;
    while (st == MD_OK && (e = readdir(d)) != NULL) {
        const char *name = e->d_name;
        if (name[0] == '.' && (name[1] == '\0' || (name[1] == '.' && name[2] == '\0')))
            continue;
        /* hidden files count too: a folder of millions of dot-files must
         * not be listed without bound */
        if (++im->entries > im->max_files) {
            st = dataset_error(err, MD_ETOOBIG,
                               "%s holds more than %lld files and folders, the limit of one "
                               "job (setting job_max_files): split the dataset into several "
                               "jobs or raise job_max_files",
                               im->name, (long long)im->max_files);
            break;
        }
        if (name[0] == '.')
            continue; /* hidden files and folders are not read */
        size_t len = strlen(name);
        if (base + len + 2 > PATH_MAX) {
            st = dataset_error(err, MD_EINVAL, "%s: the path %.100s/%.100s... is longer than %d "
                               "bytes", im->name, rel, name, PATH_MAX - 1);
            break;
        }
        if (base)
            rel[base] = '/';
        memcpy(rel + base + (base ? 1 : 0), name, len + 1);
        struct stat sb;
        if (fstatat(dirfd(d), name, &sb, AT_SYMLINK_NOFOLLOW) != 0) {
            im->skipped++; /* gone since readdir */
        } else if (S_ISDIR(sb.st_mode)) {
            if (depth + 1 > MD_IMAGES_MAX_DEPTH) {
                st = dataset_error(err, MD_EINVAL,
                                   "%s: %.200s is more than %d folders deep; images may "
                                   "nest at most %d folders under input.path",
                                   im->name, rel, MD_IMAGES_MAX_DEPTH, MD_IMAGES_MAX_DEPTH);
            } else {
                int sub = openat(dirfd(d), name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
                if (sub < 0)
                    im->skipped++; /* unreadable, or replaced by a symlink meanwhile */
                else
                    st = walk(im, sub, rel, depth + 1, err);
            }
        } else if (S_ISREG(sb.st_mode) && sniff(dirfd(d), name)) {
            add_file(im, rel);
        } else {
            im->skipped++; /* a symlink, a FIFO, a socket, a device, not PNG/JPEG */
        }
        rel[base] = '\0';
        errno = 0;
    }
    if (st == MD_OK && errno != 0)
        st = dataset_error(err, MD_EINVAL, "%s: cannot list %s: %s", im->name,
                           rel[0] ? rel : "the directory", strerror(errno));
    closedir(d);
    return st;
}

static int by_rel(const void *a, const void *b)
{
    return strcmp(((const img_file *)a)->rel, ((const img_file *)b)->rel);
}

static int by_string(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* ---- labels ---- */

static md_status labels_setup(md_images *im, const md_reader_opts *opts, md_err *err)
{
    json_t *lf = opts->label_from;
    if (!lf) {
        /* the ImageFolder layout when there are class folders */
        im->labels = LABELS_NONE;
        for (size_t i = 0; i < im->n; i++)
            if (strchr(im->files[i].rel, '/')) {
                im->labels = LABELS_FOLDER;
                break;
            }
        return MD_OK;
    }
    if (json_is_string(lf) && !strcmp(json_string_value(lf), "folder")) {
        im->labels = LABELS_FOLDER;
        return MD_OK;
    }
    if (json_is_string(lf) && !strcmp(json_string_value(lf), "none")) {
        im->labels = LABELS_NONE;
        return MD_OK;
    }
    const char *pattern = json_string_value(json_object_get(lf, "regex"));
    if (!json_is_object(lf) || !pattern || json_object_size(lf) != 1)
        return dataset_error(err, MD_EINVAL, "input.label_from must be \"folder\", \"none\" or "
                             "{\"regex\": \"...\"}");
    int rc = regcomp(&im->re, pattern, REG_EXTENDED);
    if (rc != 0) {
        char why[160];
        regerror(rc, &im->re, why, sizeof why);
        return dataset_error(err, MD_EINVAL, "input.label_from.regex \"%.100s\" is not a POSIX "
                             "extended regular expression: %s", pattern, why);
    }
    im->re_ok = 1;
    im->labels = LABELS_REGEX;
    return MD_OK;
}

/* The class string of `f` (a new string) or NULL when it has none. */
static char *class_of(md_images *im, const img_file *f)
{
    if (im->labels == LABELS_FOLDER) {
        const char *slash = strchr(f->rel, '/');
        return slash ? strndup(f->rel, (size_t)(slash - f->rel)) : NULL;
    }
    const char *slash = strrchr(f->rel, '/');
    const char *file = slash ? slash + 1 : f->rel;
    regmatch_t m[2];
    if (regexec(&im->re, file, 2, m, 0) != 0)
        return NULL;
    int g = im->re.re_nsub >= 1 && m[1].rm_so >= 0 ? 1 : 0;
    return strndup(file + m[g].rm_so, (size_t)(m[g].rm_eo - m[g].rm_so));
}

/* Class strings to indices (see DESIGN). */
static void labels_assign(md_images *im, json_t *class_names)
{
    if (im->labels == LABELS_NONE)
        return;
    size_t nclasses = 0;
    char **classes = md_xmalloc((im->n ? im->n : 1) * sizeof *classes);
    for (size_t i = 0; i < im->n; i++) {
        im->files[i].cls = class_of(im, &im->files[i]);
        md_assert(im->files[i].cls != NULL || im->labels != LABELS_FOLDER ||
                  !strchr(im->files[i].rel, '/'));
        if (im->files[i].cls)
            classes[nclasses++] = im->files[i].cls;
    }
    qsort(classes, nclasses, sizeof *classes, by_string);
    size_t distinct = 0;
    for (size_t i = 0; i < nclasses; i++)
        if (distinct == 0 || strcmp(classes[distinct - 1], classes[i]) != 0)
            classes[distinct++] = classes[i];
    /* the version's labels, when every class is one of them */
    int64_t *by_label = md_xmalloc((distinct ? distinct : 1) * sizeof *by_label);
    int use_labels = json_is_array(class_names) && distinct > 0;
    for (size_t c = 0; c < distinct && use_labels; c++) {
        by_label[c] = -1;
        for (size_t k = 0; k < json_array_size(class_names); k++) {
            const char *s = json_string_value(json_array_get(class_names, k));
            if (s && !strcmp(s, classes[c])) {
                by_label[c] = (int64_t)k;
                break;
            }
        }
        use_labels = by_label[c] >= 0;
    }
    for (size_t i = 0; i < im->n; i++) {
        img_file *f = &im->files[i];
        if (!f->cls) {
            f->label = LABEL_MISSING;
            continue;
        }
        char **hit = bsearch(&f->cls, classes, distinct, sizeof *classes, by_string);
        size_t c = (size_t)(hit - classes);
        f->label = use_labels ? by_label[c] : (int64_t)c;
    }
    for (size_t i = 0; i < im->n; i++) {
        free(im->files[i].cls);
        im->files[i].cls = NULL;
    }
    free(by_label);
    free(classes);
}

/* ---- the reader ---- */

md_status md_images_open(const md_reader_opts *opts, const char *name, md_images **out,
                         md_err *err)
{
    *out = NULL;
    if (!opts->image)
        return dataset_error(err, MD_EINVAL, "%s: an images dataset needs the model version's "
                             "preprocess.image", name);
    if (opts->features)
        return dataset_error(err, MD_EINVAL, "%s: features applies to csv and jsonl only", name);
    md_images *im = md_xcalloc(1, sizeof *im);
    im->root = -1;
    im->name = md_xstrdup(name);
    im->opts = *opts->image;
    im->max_files = opts->max_files > 0 ? opts->max_files : MD_IMAGES_MAX_FILES_DEFAULT;
    im->max_file_bytes =
        opts->max_file_bytes > 0 ? opts->max_file_bytes : MD_IMAGES_MAX_FILE_BYTES_DEFAULT;
    size_t values = md_image_values(&im->opts);
    im->width = (int64_t)values;
    md_status st = MD_OK;
    if (values == 0 || im->width > MD_MAX_ROW_VALUES) {
        st = dataset_error(err, MD_EINVAL, "%s: the version's image input holds %zu values, "
                           "outside 1..%lld", name, values, (long long)MD_MAX_ROW_VALUES);
        goto fail;
    }
    if ((st = labels_setup(im, opts, err)) != MD_OK)
        goto fail;
    im->root = open(opts->path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (im->root < 0) {
        st = dataset_error(err, MD_EINVAL, "%s: cannot open the directory: %s%s", name,
                           strerror(errno),
                           errno == ENOTDIR ? " (format images reads a directory of PNG and "
                                              "JPEG files)" : "");
        goto fail;
    }
    int fd = dup(im->root);
    if (fd < 0) {
        st = dataset_error(err, MD_EINVAL, "%s: cannot list the directory: %s", name,
                           strerror(errno));
        goto fail;
    }
    fcntl(fd, F_SETFD, FD_CLOEXEC);
    char rel[PATH_MAX] = "";
    if (opts->image_list) {
        /* a chunk of a job whose plan listed the folder (s3_images.c): the
         * same rows and labels as that listing, whichever files are here */
        close(fd);
        size_t n = json_array_size(opts->image_list);
        if ((int64_t)n > im->max_files) {
            st = dataset_error(err, MD_ETOOBIG, "%s lists more than %lld files, the limit of one "
                               "job (setting job_max_files)", name, (long long)im->max_files);
            goto fail;
        }
        for (size_t i = 0; i < n; i++) {
            const char *p = json_string_value(json_array_get(opts->image_list, i));
            if (!p || !p[0]) {
                st = dataset_error(err, MD_EINVAL, "%s: entry %zu of the listing is not a "
                                   "path", name, i);
                goto fail;
            }
            add_file(im, p);
        }
    } else if ((st = walk(im, fd, rel, 0, err)) != MD_OK) {
        goto fail;
    }
    qsort(im->files, im->n, sizeof *im->files, by_rel);
    /* a label_from left out means folder labels only when there are class
     * folders: known after the listing */
    if (!opts->label_from && (st = labels_setup(im, opts, err)) != MD_OK)
        goto fail;
    labels_assign(im, opts->class_names);
    *out = im;
    return MD_OK;
fail:
    md_images_close(im);
    return st;
}

int64_t md_images_width(const md_images *im) { return im->width; }
int64_t md_images_count(const md_images *im) { return (int64_t)im->n; }
int md_images_has_labels(const md_images *im) { return im->labels != LABELS_NONE; }
int64_t md_images_skipped(const md_images *im) { return im->skipped; }

const char *md_images_path(const md_images *im, int64_t index)
{
    return index >= 0 && (size_t)index < im->n ? im->files[index].rel : NULL;
}

/* MD_EINVAL "NAME row N: ..." (a bad row: consumed, the policy decides). */
static md_status row_error(md_images *im, int64_t index, md_err *err, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static md_status row_error(md_images *im, int64_t index, md_err *err, const char *fmt, ...)
{
    char msg[MD_ERR_MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return md_err_setc(err, MD_EINVAL, "invalid_image", "%s row %lld: %s", im->name,
                       (long long)index, msg);
}

/* Open `rel` under the root one component at a time, no symlink followed. */
static int open_beneath(int root, const char *rel)
{
    char part[PATH_MAX];
    int dir = root;
    const char *p = rel;
    for (;;) {
        const char *slash = strchr(p, '/');
        if (!slash) {
            int fd = openat(dir, p, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
            int e = errno;
            if (dir != root)
                close(dir);
            errno = e;
            return fd;
        }
        size_t len = (size_t)(slash - p);
        memcpy(part, p, len);
        part[len] = '\0';
        int next = openat(dir, part, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        int e = errno;
        if (dir != root)
            close(dir);
        if (next < 0) {
            errno = e;
            return -1;
        }
        dir = next;
        p = slash + 1;
    }
}

md_status md_images_read(md_images *im, int64_t index, float *row, int64_t *label, md_err *err)
{
    if (index < 0 || (size_t)index >= im->n)
        return MD_ENOTFOUND;
    const img_file *f = &im->files[index];
    *label = f->label < 0 ? -1 : f->label;
    if (f->label == LABEL_MISSING)
        return im->labels == LABELS_FOLDER
                   ? row_error(im, index, err, "%.300s is not in a class folder: put it in "
                               "<input.path>/<class>/, or give input.label_from",
                               f->rel)
                   : row_error(im, index, err, "the file name of %.300s does not match "
                               "input.label_from.regex, so it has no label",
                               f->rel);
    int fd = open_beneath(im->root, f->rel);
    if (fd < 0)
        return row_error(im, index, err, "%.300s cannot be opened: %s%s", f->rel,
                         strerror(errno),
                         errno == ELOOP ? " (a symlink now: none is followed)" : "");
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return row_error(im, index, err, "%.300s is no longer a regular file", f->rel);
    }
    if ((long long)sb.st_size > im->max_file_bytes) {
        close(fd);
        return row_error(im, index, err, "%.300s is %lld bytes, more than the %lld an image "
                         "may have (setting job_max_image_bytes)",
                         f->rel, (long long)sb.st_size, im->max_file_bytes);
    }
    size_t want = (size_t)sb.st_size;
    if (want + 1 > im->buf_cap) {
        unsigned char *grown = md_malloc_checked(want + 1, "an image file", err);
        if (!grown) {
            close(fd);
            return MD_ENOMEM;
        }
        free(im->buf);
        im->buf = grown;
        im->buf_cap = want + 1;
    }
    size_t got = 0;
    while (got < want) {
        ssize_t r = pread(fd, im->buf + got, want - got, (off_t)got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            int e = errno;
            close(fd);
            return row_error(im, index, err, "%.300s: read failed: %s", f->rel, strerror(e));
        }
        if (r == 0)
            break; /* shrank meanwhile: decode what is there (truncated) */
        got += (size_t)r;
    }
    close(fd);
    md_err derr;
    md_err_clear(&derr);
    md_status st = md_image_to_tensor(im->buf, got, &im->opts, f->rel, row, &derr);
    if (st == MD_OK)
        return MD_OK;
    if (st == MD_ENOMEM) {
        *err = derr;
        return st;
    }
    /* corrupt, truncated, unsupported, too many pixels: a bad row */
    return strstr(derr.msg, f->rel) ? row_error(im, index, err, "%s", derr.msg)
                                    : row_error(im, index, err, "%.200s: %s", f->rel, derr.msg);
}

void md_images_close(md_images *im)
{
    if (!im)
        return;
    if (im->root >= 0)
        close(im->root);
    for (size_t i = 0; i < im->n; i++) {
        free(im->files[i].rel);
        free(im->files[i].cls);
    }
    free(im->files);
    if (im->re_ok)
        regfree(&im->re);
    free(im->buf);
    free(im->name);
    free(im);
}
