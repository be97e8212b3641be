/*
 * s3_data.c - job datasets in S3 (checkpoint.h, "datasets in S3"): an object
 * read as a stream of Range GETs into a pipe, a folder of images copied into
 * a local directory, and an output file uploaded (multipart when large).
 * Built on the client of s3.h; the allow-list check is download.c's
 * md_s3_data_check, the one place allowed_s3 is read.
 *
 * DESIGN
 * The dataset readers (jobs/readers.c) read a path front to back with stdio
 * or gzstream; a pipe is the one kind of path every one of them reads
 * without a change. So a stream is a thread that reads the object in pieces
 * (PIECE_BYTES, one Range GET each, guarded by If-Match the HEAD's ETag) into
 * one buffer, then writes the piece into the pipe. A piece is fetched whole
 * before it is written, so libcurl's low-speed limit never sees the stall of
 * a full pipe (a job pausing between chunks) as a stalled server. A failed
 * piece is retried from its start after a back-off, up to net.max_resumes
 * times; then the thread records the failure and closes the write end, and
 * the reader's EOF is checked against md_s3_stream_status, so a cut object
 * is never taken for a short one. Memory is one piece whatever the size.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "checkpoint.h"
#include "s3.h"

#define PIECE_BYTES (8L << 20)
#define FIRST_PIECE_BYTES (256L << 10)

/* Tests shrink pieces and parts (MD_TEST_S3_PIECE_BYTES,
 * MD_TEST_S3_PART_BYTES) so small objects still take several requests. */
static long long env_ll(const char *name, long long dflt)
{
    const char *v = getenv(name);
    long long n = v ? atoll(v) : 0;
    return n > 0 ? n : dflt;
}

/* A client for s3://bucket with the AWS_* credentials and this server's
 * download bounds (the same as the deploy path's). */
static md_status client_open(const md_fetch_opts *o, const char *bucket, md_s3 **s3, md_err *err)
{
    md_s3_config cfg;
    md_status st = md_s3_config_from_env(&cfg, err);
    if (st != MD_OK)
        return st;
    md_s3_net net;
    md_s3_net_defaults(&net);
    if (o->connect_timeout_s > 0)
        net.connect_timeout_ms = o->connect_timeout_s * 1000L;
    const char *stall = getenv("MD_TEST_S3_STALL_S");
    if (stall && atoi(stall) > 0) {
        net.low_speed_time_s = atoi(stall);
        net.request_timeout_ms = atoi(stall) * 1000L;
    }
    char root[MD_S3_BUCKET_MAX + 8];
    snprintf(root, sizeof root, "s3://%s", bucket);
    st = md_s3_open(&cfg, root, &net, s3, err);
    explicit_bzero(&cfg, sizeof cfg);
    return st;
}

/* The job-facing error code of an S3 failure. */
static md_status coded(md_status st, md_err *err)
{
    if (st == MD_EUNAVAIL)
        snprintf(err->code, sizeof err->code, "s3_unavailable");
    else if (st == MD_ENOTFOUND)
        snprintf(err->code, sizeof err->code, "input_not_found");
    return st;
}

/* ---- an object as a stream ---- */

struct md_s3_stream {
    md_s3 *s3;
    char key[MD_S3_KEY_MAX + 1];
    char etag[128];
    char what[32];   /* the job field it reads, for messages */
    int pinned;      /* etag is the one a job's plan recorded */
    long long size;
    /* the byte ranges read, in order: [from[i], to[i]) */
    long long from[2], to[2];
    int nseg;
    int wfd;
    pthread_t thread;
    int started;
    atomic_int stop;
    pthread_mutex_t mu;
    md_status st; /* under mu */
    md_err err;
};

static void pause_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

static void *stream_main(void *arg)
{
    md_s3_stream *s = arg;
    /* a reader that stopped early closes the read end: the write then fails
     * with EPIPE on this thread, instead of SIGPIPE ending the process */
    sigset_t pipe_set;
    sigemptyset(&pipe_set);
    sigaddset(&pipe_set, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_set, NULL);
    size_t piece = (size_t)env_ll("MD_TEST_S3_PIECE_BYTES", PIECE_BYTES);
    if (piece > MD_S3_RANGE_MAX)
        piece = MD_S3_RANGE_MAX;
    char *buf = malloc(piece);
    md_err err;
    md_err_clear(&err);
    md_status st = buf ? MD_OK : md_err_set(&err, MD_ENOMEM, "no memory for an S3 read buffer");
    int seg = 0;
    size_t ramp = FIRST_PIECE_BYTES;
    long long off = s->nseg > 0 ? s->from[0] : 0;
    for (;;) {
        while (seg < s->nseg && off >= s->to[seg])
            if (++seg < s->nseg)
                off = s->from[seg];
        if (st != MD_OK || seg >= s->nseg || atomic_load(&s->stop))
            break;
        /* the first pieces small, then doubling up to `piece`: the reader
         * starts on its first rows after one short GET, not after 8 MiB
         * (a job chunk's model waits for them) */
        size_t step = ramp < piece ? ramp : piece;
        ramp = ramp < piece / 2 ? ramp * 2 : piece;
        size_t want = (long long)step < s->to[seg] - off ? step : (size_t)(s->to[seg] - off);
        size_t got = 0;
        for (int attempt = 0;; attempt++) {
            st = md_s3_get_range(s->s3, s->key, off, want, s->etag, buf, &got, &err);
            if (st == MD_OK && got != want)
                st = md_err_set(&err, MD_EUNAVAIL, "S3 answered %zu of the %zu bytes asked of "
                                "s3://%s/%s at byte %lld", got, want, md_s3_bucket(s->s3), s->key,
                                off);
            if (st == MD_OK || st == MD_ECONFLICT || st == MD_ENOTFOUND || st == MD_EFORBIDDEN ||
                attempt >= 5 || atomic_load(&s->stop))
                break;
            pause_ms(200L << attempt);
        }
        if (st == MD_ECONFLICT && s->pinned)
            md_err_setc(&err, MD_ECONFLICT, "input_changed", "%s s3://%s/%s changed since the "
                        "job was planned (ETag %.64s); run the job again", s->what,
                        md_s3_bucket(s->s3), s->key, s->etag);
        else if (st == MD_ECONFLICT)
            md_err_set(&err, MD_ECONFLICT, "s3://%s/%s changed while the job read it; run the job "
                       "again on the new object", md_s3_bucket(s->s3), s->key);
        for (size_t done = 0; st == MD_OK && done < got;) {
            ssize_t w = write(s->wfd, buf + done, got - done);
            if (w < 0 && errno == EINTR)
                continue;
            if (w <= 0) {
                atomic_store(&s->stop, 1); /* EPIPE: the reader is gone */
                break;
            }
            done += (size_t)w;
        }
        off += (long long)got;
    }
    free(buf);
    pthread_mutex_lock(&s->mu);
    s->st = st;
    s->err = err;
    coded(st, &s->err);
    pthread_mutex_unlock(&s->mu);
    close(s->wfd); /* EOF for the reader, after the status is set */
    s->wfd = -1;
    return NULL;
}

md_status md_s3_stream_open(const char *url, const md_fetch_opts *o, const char *what, int *fd,
                            md_s3_stream **out, md_err *err)
{
    return md_s3_stream_open_range(url, o, what, 0, 0, -1, fd, out, err);
}

md_status md_s3_stream_open_range(const char *url, const md_fetch_opts *o, const char *what,
                                  long long head_bytes, long long from, long long to, int *fd,
                                  md_s3_stream **out, md_err *err)
{
    return md_s3_stream_open_pinned(url, o, what, NULL, head_bytes, from, to, fd, out, err);
}

md_status md_s3_stream_open_pinned(const char *url, const md_fetch_opts *o, const char *what,
                                   const char *etag, long long head_bytes, long long from,
                                   long long to, int *fd, md_s3_stream **out, md_err *err)
{
    *fd = -1;
    *out = NULL;
    char bucket[MD_S3_BUCKET_MAX + 1], key[MD_S3_KEY_MAX + 1];
    md_status st = md_s3_data_check(url, o, what, 0, bucket, key, err);
    if (st != MD_OK)
        return st;
    md_s3_stream *s = calloc(1, sizeof *s);
    if (!s)
        return md_err_set(err, MD_ENOMEM, "no memory for an S3 stream");
    s->wfd = -1;
    pthread_mutex_init(&s->mu, NULL);
    snprintf(s->key, sizeof s->key, "%s", key);
    if ((st = client_open(o, bucket, &s->s3, err)) != MD_OK)
        goto fail;
    md_s3_object info;
    if ((st = md_s3_head(s->s3, key, &info, err)) != MD_OK) {
        if (st == MD_ENOTFOUND)
            md_err_setc(err, MD_ENOTFOUND, "input_not_found",
                        "%s %.200s: no such object in S3; put the dataset there or fix the key",
                        what, url);
        coded(st, err);
        goto fail;
    }
    snprintf(s->what, sizeof s->what, "%s", what);
    if (etag && etag[0] && strcmp(etag, info.etag) != 0) {
        /* replaced since the plan: no byte of it is read */
        st = md_err_setc(err, MD_ECONFLICT, "input_changed", "%s %.200s changed since the job "
                         "was planned (ETag %.64s); run the job again", what, url, etag);
        goto fail;
    }
    s->pinned = etag && etag[0];
    s->size = info.size;
    snprintf(s->etag, sizeof s->etag, "%s", info.etag);
    if (to < 0 || to > s->size)
        to = s->size;
    if (head_bytes > s->size)
        head_bytes = s->size;
    if (from < head_bytes)
        from = head_bytes; /* [0, to) read once */
    if (head_bytes > 0) {
        s->from[s->nseg] = 0;
        s->to[s->nseg++] = head_bytes;
    }
    if (from < to) {
        s->from[s->nseg] = from;
        s->to[s->nseg++] = to;
    }
    int p[2];
    if (pipe2(p, O_CLOEXEC) != 0) {
        st = md_err_set(err, MD_EIO, "cannot make a pipe for %s: %s", what, strerror(errno));
        goto fail;
    }
    s->wfd = p[1];
    if (pthread_create(&s->thread, NULL, stream_main, s) != 0) {
        close(p[0]);
        st = md_err_set(err, MD_EIO, "cannot start the reader thread of %s", what);
        goto fail;
    }
    s->started = 1;
    *fd = p[0];
    *out = s;
    return MD_OK;
fail:
    md_s3_stream_close(s);
    return st;
}

md_status md_s3_stream_status(md_s3_stream *s, md_err *err)
{
    pthread_mutex_lock(&s->mu);
    md_status st = s->st;
    if (st != MD_OK && err)
        *err = s->err;
    pthread_mutex_unlock(&s->mu);
    return st;
}

long long md_s3_stream_size(const md_s3_stream *s) { return s->size; }

const char *md_s3_stream_etag(const md_s3_stream *s) { return s->etag; }

void md_s3_stream_close(md_s3_stream *s)
{
    if (!s)
        return;
    atomic_store(&s->stop, 1);
    if (s->started)
        pthread_join(s->thread, NULL);
    else if (s->wfd >= 0)
        close(s->wfd);
    md_s3_close(s->s3);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

/* ---- a folder of images ---- */

typedef struct folder_ctx {
    md_s3 *s3;
    int dirfd;
    size_t prefix_len;
    int64_t max_files;
    long long max_file_bytes;
    int (*keep_going)(void *);
    void *kg_ctx;
    int64_t files;
    md_status st;
    md_err *err;
    const char *url;
} folder_ctx;

/* Open (making it when absent) the directory `rel` (a '/'-separated path of
 * checked segments) under dirfd; -1 with errno. */
static int open_subdir(int dirfd, const char *rel, size_t len)
{
    int cur = dup(dirfd);
    size_t i = 0;
    while (cur >= 0 && i < len) {
        size_t n = strcspn(rel + i, "/");
        if (i + n > len)
            n = len - i;
        char seg[MD_S3_KEY_MAX + 1];
        memcpy(seg, rel + i, n);
        seg[n] = '\0';
        if (mkdirat(cur, seg, 0700) != 0 && errno != EEXIST) {
            close(cur);
            return -1;
        }
        int next = openat(cur, seg, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        close(cur);
        cur = next;
        i += n + 1;
    }
    return cur;
}

/* 1 when `rel` (a key below a folder's prefix) names a file on disk: not a
 * "folder" marker (ending in '/'), no empty, "." or ".." segment. */
static int folder_key_ok(const char *rel)
{
    size_t len = strlen(rel);
    if (len == 0 || rel[len - 1] == '/')
        return 0;
    for (const char *seg = rel; seg; seg = strchr(seg, '/') ? strchr(seg, '/') + 1 : NULL) {
        size_t n = strcspn(seg, "/");
        if (n == 0 || (n == 1 && seg[0] == '.') || (n == 2 && seg[0] == '.' && seg[1] == '.'))
            return 0;
    }
    return 1;
}

static int folder_object(void *ud, const md_s3_object *obj)
{
    folder_ctx *f = ud;
    const char *rel = obj->key + f->prefix_len;
    if (!folder_key_ok(rel))
        return 0; /* a marker, or no such name on disk: not a file of the folder */
    if (f->keep_going && !f->keep_going(f->kg_ctx)) {
        f->st = md_err_set(f->err, MD_ECONFLICT, "the job stopped while its images were fetched");
        return 1;
    }
    if (f->files >= f->max_files) {
        f->st = md_err_setc(f->err, MD_ETOOBIG, "too_many_files",
                            "input.path %.200s holds more than %lld objects; raise job_max_files "
                            "or split the folder",
                            f->url, (long long)f->max_files);
        return 1;
    }
    const char *slash = strrchr(rel, '/');
    int dfd = slash ? open_subdir(f->dirfd, rel, (size_t)(slash - rel)) : dup(f->dirfd);
    const char *leaf = slash ? slash + 1 : rel;
    int fd = dfd < 0 ? -1
                     : openat(dfd, leaf, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) {
        f->st = md_err_set(f->err, MD_EIO, "cannot make a local copy of %s: %s", rel,
                           strerror(errno));
        if (dfd >= 0)
            close(dfd);
        return 1;
    }
    md_status st = MD_OK;
    if (obj->size > f->max_file_bytes) {
        /* the reader refuses it by its size without reading it */
        if (ftruncate(fd, (off_t)obj->size) != 0)
            st = md_err_set(f->err, MD_EIO, "cannot size the local copy of %s: %s", rel,
                            strerror(errno));
    } else {
        st = coded(md_s3_get_fd(f->s3, obj->key, fd, NULL, f->err), f->err);
    }
    close(fd);
    close(dfd);
    if (st != MD_OK) {
        f->st = st;
        return 1;
    }
    f->files++;
    return 0;
}

md_status md_s3_fetch_folder(const char *url, const md_fetch_opts *o, int dirfd, int64_t max_files,
                             long long max_file_bytes, int (*keep_going)(void *ctx), void *ctx,
                             int64_t *files, md_err *err)
{
    *files = 0;
    char bucket[MD_S3_BUCKET_MAX + 1], key[MD_S3_KEY_MAX + 1];
    md_status st = md_s3_data_check(url, o, "input.path", 1, bucket, key, err);
    if (st != MD_OK)
        return st;
    md_s3 *s3 = NULL;
    if ((st = client_open(o, bucket, &s3, err)) != MD_OK)
        return st;
    folder_ctx f = {.s3 = s3, .dirfd = dirfd, .prefix_len = strlen(key), .max_files = max_files,
                    .max_file_bytes = max_file_bytes, .keep_going = keep_going, .kg_ctx = ctx,
                    .err = err, .url = url};
    st = md_s3_list(s3, key, 1000, folder_object, &f, err);
    if (st == MD_OK)
        st = f.st;
    coded(st, err);
    md_s3_close(s3);
    *files = f.files;
    return st;
}

/* ---- a folder listed once, its objects read one by one (chunked image
 * jobs: jobs/s3_images.c) ---- */

struct md_s3_folder {
    md_s3 *s3;
    char prefix[MD_S3_KEY_MAX + 1]; /* the folder's key prefix, "" or ending in '/' */
    char url[MD_S3_BUCKET_MAX + MD_S3_KEY_MAX + 8];
};

md_status md_s3_folder_open(const char *url, const md_fetch_opts *o, md_s3_folder **out,
                            md_err *err)
{
    *out = NULL;
    char bucket[MD_S3_BUCKET_MAX + 1], key[MD_S3_KEY_MAX + 1];
    md_status st = md_s3_data_check(url, o, "input.path", 1, bucket, key, err);
    if (st != MD_OK)
        return st;
    md_s3_folder *f = calloc(1, sizeof *f);
    if (!f)
        return md_err_set(err, MD_ENOMEM, "no memory for an S3 folder");
    snprintf(f->prefix, sizeof f->prefix, "%s", key);
    snprintf(f->url, sizeof f->url, "%s", url);
    if ((st = client_open(o, bucket, &f->s3, err)) != MD_OK) {
        free(f);
        return st;
    }
    *out = f;
    return MD_OK;
}

typedef struct list_ctx {
    size_t prefix_len;
    md_s3_folder_fn fn;
    void *ctx;
} list_ctx;

static int list_object(void *ud, const md_s3_object *obj)
{
    list_ctx *l = ud;
    const char *rel = obj->key + l->prefix_len;
    if (!folder_key_ok(rel))
        return 0; /* as md_s3_fetch_folder */
    return l->fn(l->ctx, rel, obj->size, obj->etag);
}

md_status md_s3_folder_list(md_s3_folder *f, md_s3_folder_fn fn, void *ctx, md_err *err)
{
    list_ctx l = {.prefix_len = strlen(f->prefix), .fn = fn, .ctx = ctx};
    return coded(md_s3_list(f->s3, f->prefix, 1000, list_object, &l, err), err);
}

/* The object of `rel` under the folder: its full key into `key`; MD_EINVAL
 * when too long (a listing never gives one). */
static md_status folder_key(md_s3_folder *f, const char *rel, char *key, md_err *err)
{
    /* a path from a plan becomes a local file: no segment may climb out */
    for (const char *seg = rel; seg; seg = strchr(seg, '/') ? strchr(seg, '/') + 1 : NULL) {
        size_t n = strcspn(seg, "/");
        if (n == 0 || (n == 1 && seg[0] == '.') || (n == 2 && seg[0] == '.' && seg[1] == '.'))
            return md_err_setc(err, MD_EINVAL, "invalid_path", "the listed path %.300s has an "
                               "empty, \".\" or \"..\" segment", rel);
    }
    int n = snprintf(key, MD_S3_KEY_MAX + 1, "%s%s", f->prefix, rel);
    if (n < 0 || n > MD_S3_KEY_MAX)
        return md_err_setc(err, MD_EINVAL, "invalid_path", "the key %.200s%.200s is longer "
                           "than S3 allows", f->prefix, rel);
    return MD_OK;
}

static md_status changed(md_s3_folder *f, const char *rel, const char *etag, md_err *err)
{
    return md_err_setc(err, MD_ECONFLICT, "input_changed", "input.path %.200s%.300s changed "
                       "since the job was planned (ETag %.64s); run the job again", f->url, rel,
                       etag);
}

md_status md_s3_folder_read(md_s3_folder *f, const char *rel, const char *etag, size_t len,
                            char *buf, size_t *got, md_err *err)
{
    char key[MD_S3_KEY_MAX + 1];
    md_status st = folder_key(f, rel, key, err);
    if (st != MD_OK)
        return st;
    *got = 0;
    st = md_s3_get_range(f->s3, key, 0, len, etag, buf, got, err);
    if (st == MD_ECONFLICT)
        return changed(f, rel, etag, err);
    return coded(st, err);
}

md_status md_s3_folder_get(md_s3_folder *f, const char *rel, const char *etag, int dirfd,
                           md_err *err)
{
    char key[MD_S3_KEY_MAX + 1];
    md_status st = folder_key(f, rel, key, err);
    if (st != MD_OK)
        return st;
    const char *slash = strrchr(rel, '/');
    int dfd = slash ? open_subdir(dirfd, rel, (size_t)(slash - rel)) : dup(dirfd);
    const char *leaf = slash ? slash + 1 : rel;
    int fd = dfd < 0 ? -1
                     : openat(dfd, leaf, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) {
        st = md_err_set(err, MD_EIO, "cannot make a local copy of %.300s: %s", rel,
                        strerror(errno));
        if (dfd >= 0)
            close(dfd);
        return st;
    }
    md_s3_object info;
    memset(&info, 0, sizeof info);
    st = md_s3_get_fd(f->s3, key, fd, &info, err);
    close(fd);
    close(dfd);
    if (st == MD_ECONFLICT || (st == MD_OK && etag && etag[0] && strcmp(info.etag, etag) != 0))
        return changed(f, rel, etag, err); /* the answer's ETag names the bytes it sent */
    if (st == MD_ENOTFOUND)
        return md_err_setc(err, MD_ECONFLICT, "input_changed", "input.path %.200s%.300s was "
                           "deleted since the job was planned; run the job again", f->url, rel);
    return coded(st, err);
}

void md_s3_folder_close(md_s3_folder *f)
{
    if (!f)
        return;
    md_s3_close(f->s3);
    free(f);
}

/* ---- an output ----
 * path NULL: only check that the object is not there yet (a job checks
 * before it computes, so a taken name fails it at once, not at the end). */

/* The output path `url` checked (an object, or with folder a prefix), its
 * key, and a client for its bucket. */
static md_status output_open(const char *url, const md_fetch_opts *o, int folder,
                             char key[MD_S3_KEY_MAX + 1], md_s3 **s3, md_err *err)
{
    char bucket[MD_S3_BUCKET_MAX + 1];
    *s3 = NULL;
    md_status st = md_s3_data_check(url, o, "output.path", folder, bucket, key, err);
    return st == MD_OK ? client_open(o, bucket, s3, err) : st;
}

/* Read up to n bytes (fewer only at EOF); -1 on an error. */
static ssize_t read_full(int fd, char *buf, size_t n)
{
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, buf + got, n - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return -1;
        if (r == 0)
            break;
        got += (size_t)r;
    }
    return (ssize_t)got;
}

/* Whether the object `url` holds exactly the bytes that `fd` (a file, or
 * another object's stream, `fd_stream`: checked whole too) reads to its
 * end: an output already there that an earlier run of the same job put
 * (its runner stopped between the upload and recording success) is that
 * run's, not a name taken by someone else. Reads the object once, in
 * pieces. MD_OK: the same; MD_ECONFLICT: they differ; any other status:
 * it could not tell (S3 away or cut short: 503, retried by the caller). */
static md_status object_equals(const char *url, const md_fetch_opts *o, int fd,
                               md_s3_stream *fd_stream, md_err *err)
{
    int ofd = -1;
    md_s3_stream *s = NULL;
    md_status st = md_s3_stream_open(url, o, "output.path", &ofd, &s, err);
    if (st == MD_ENOTFOUND) /* gone since its HEAD: nothing to tell apart */
        return md_err_set(err, MD_EUNAVAIL, "the output %.200s went away while it was read; "
                          "try again", url);
    if (st != MD_OK)
        return st;
    enum { PIECE = 64 * 1024 };
    char *a = malloc(PIECE), *b = malloc(PIECE);
    int differ = 0;
    st = a && b ? MD_OK : md_err_set(err, MD_ENOMEM, "no memory to compare %.200s", url);
    while (st == MD_OK && !differ) {
        ssize_t na = read_full(ofd, a, PIECE), nb = read_full(fd, b, PIECE);
        if (na < 0 || nb < 0)
            st = md_err_set(err, MD_EIO, "reading to compare with %.200s: %s", url,
                            strerror(errno));
        else if (na != nb || memcmp(a, b, (size_t)na) != 0)
            differ = 1;
        else if (na == 0)
            break;
    }
    free(a);
    free(b);
    close(ofd);
    /* a stream cut short reads as a short file: only whole ones tell */
    md_err serr;
    if (st == MD_OK && md_s3_stream_status(s, &serr) != MD_OK)
        st = (*err = serr).status;
    if (st == MD_OK && fd_stream && !differ && md_s3_stream_status(fd_stream, &serr) != MD_OK)
        st = (*err = serr).status;
    md_s3_stream_close(s);
    if (st == MD_OK && differ)
        st = md_err_setc(err, MD_ECONFLICT, "output_exists", "the bytes differ");
    if (st != MD_OK && st != MD_ECONFLICT && st != MD_ENOMEM) {
        /* could not tell: S3 away or cut short, to be tried again (a job's
         * coordinator gives the job back rather than failing it) */
        err->status = st = MD_EUNAVAIL;
        coded(st, err);
    }
    return st;
}

/* The answer to an output that exists: MD_OK when its bytes are those of
 * `fd` (object_equals; fd -1: not this job's, a size that differs),
 * output_exists when they are not, else why it could not tell. */
static md_status output_taken(const char *url, const md_fetch_opts *o, int fd,
                              md_s3_stream *fd_stream, md_err *err)
{
    md_err cerr;
    md_status st = fd >= 0 ? object_equals(url, o, fd, fd_stream, &cerr) : MD_ECONFLICT;
    if (st == MD_OK) {
        md_log(MD_LOG_INFO, "the output %.200s is in S3 already, byte for byte this job's: an "
               "earlier run of it put it", url);
        return MD_OK;
    }
    if (st != MD_ECONFLICT) {
        *err = cerr;
        return st;
    }
    return md_err_setc(err, MD_ECONFLICT, "output_exists",
                       "the output %.200s already exists in S3; modeld never replaces an "
                       "output: delete it or give another output.path",
                       url);
}

md_status md_s3_data_put(const char *url, const md_fetch_opts *o, const char *path, md_err *err)
{
    char key[MD_S3_KEY_MAX + 1];
    md_s3 *s3 = NULL;
    md_status st = output_open(url, o, 0, key, &s3, err);
    if (st != MD_OK)
        return st;
    md_s3_object info;
    md_err herr;
    st = md_s3_head(s3, key, &info, &herr);
    if (st == MD_OK) {
        struct stat sb;
        int fd = path ? open(path, O_RDONLY | O_CLOEXEC) : -1;
        if (fd >= 0 && (fstat(fd, &sb) != 0 || sb.st_size != info.size)) {
            close(fd); /* another size: not this job's */
            fd = -1;
        }
        st = output_taken(url, o, fd, NULL, err);
        if (fd >= 0)
            close(fd);
    } else if (st == MD_ENOTFOUND && !path)
        st = MD_OK; /* only asked whether the name is free */
    else if (st == MD_ENOTFOUND)
        st = md_s3_put_file_multipart(s3, key, path,
                                      env_ll("MD_TEST_S3_PART_BYTES", MD_S3_PART_BYTES_DEFAULT), err);
    else
        *err = herr;
    coded(st == MD_ENOTFOUND ? MD_EIO : st, err);
    md_s3_close(s3);
    return st;
}

md_status md_s3_data_delete(const char *url, const md_fetch_opts *o, md_err *err)
{
    char key[MD_S3_KEY_MAX + 1];
    md_s3 *s3 = NULL;
    md_status st = output_open(url, o, 0, key, &s3, err);
    if (st != MD_OK)
        return st;
    st = coded(md_s3_delete(s3, key, err), err);
    md_s3_close(s3);
    return st;
}

md_status md_s3_data_put_new(const char *url, const md_fetch_opts *o, const char *path,
                             md_err *err)
{
    char key[MD_S3_KEY_MAX + 1];
    md_s3 *s3 = NULL;
    md_status st = output_open(url, o, 0, key, &s3, err);
    if (st != MD_OK)
        return st;
    st = md_s3_put_file_multipart(s3, key, path,
                                  env_ll("MD_TEST_S3_PART_BYTES", MD_S3_PART_BYTES_DEFAULT), err);
    coded(st == MD_ENOTFOUND ? MD_EIO : st, err);
    md_s3_close(s3);
    return st;
}

/* The keys of a listing, to delete once it is over (a deletion during the
 * listing could move its continuation). */
typedef struct key_list {
    char **keys;
    size_t n, cap;
    int failed;
} key_list;

static int collect_key(void *ctx, const md_s3_object *obj)
{
    key_list *l = ctx;
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 64;
        char **grown = realloc(l->keys, cap * sizeof *grown);
        if (!grown) {
            l->failed = 1;
            return 1;
        }
        l->keys = grown;
        l->cap = cap;
    }
    if (!(l->keys[l->n] = strdup(obj->key))) {
        l->failed = 1;
        return 1;
    }
    l->n++;
    return 0;
}

md_status md_s3_data_delete_prefix(const char *url, const md_fetch_opts *o, long long *deleted,
                                   md_err *err)
{
    if (deleted)
        *deleted = 0;
    char key[MD_S3_KEY_MAX + 1];
    md_s3 *s3 = NULL;
    md_status st = output_open(url, o, 1, key, &s3, err);
    if (st != MD_OK)
        return st;
    key_list l = {0};
    st = md_s3_list(s3, key, 0, collect_key, &l, err);
    if (st == MD_OK && l.failed)
        st = md_err_set(err, MD_ENOMEM, "out of memory for a listing of %.200s", url);
    for (size_t i = 0; i < l.n; i++) {
        /* the listing's keys are relative to the handle's (the bucket's root) */
        if (st == MD_OK && (st = md_s3_delete(s3, l.keys[i], err)) == MD_OK && deleted)
            (*deleted)++;
        free(l.keys[i]);
    }
    free(l.keys);
    coded(st, err);
    md_s3_close(s3);
    return st;
}

md_status md_s3_data_copy(const char *src_url, const char *dst_url, const md_fetch_opts *o,
                          int replace, md_err *err)
{
    char key[MD_S3_KEY_MAX + 1], src_bucket[MD_S3_BUCKET_MAX + 1], src_key[MD_S3_KEY_MAX + 1];
    md_s3 *s3 = NULL;
    md_status st = md_s3_data_check(src_url, o, "output.path", 0, src_bucket, src_key, err);
    if (st != MD_OK)
        return st;
    if ((st = output_open(dst_url, o, 0, key, &s3, err)) != MD_OK)
        return st;
    if (strcmp(src_bucket, md_s3_bucket(s3)) != 0) {
        md_s3_close(s3);
        return md_err_set(err, MD_EINVAL, "a copy within S3 stays in one bucket (%s, %s)",
                          src_url, dst_url);
    }
    md_s3_object info;
    md_err herr;
    st = replace ? MD_ENOTFOUND : md_s3_head(s3, key, &info, &herr);
    if (st == MD_OK) {
        int fd = -1;
        md_s3_stream *src = NULL;
        st = md_s3_stream_open(src_url, o, "output.path", &fd, &src, err);
        if (st == MD_OK && md_s3_stream_size(src) != info.size) {
            close(fd); /* another size: not this job's */
            fd = -1;
        }
        if (st == MD_OK)
            st = output_taken(dst_url, o, fd, src, err);
        else if (st == MD_ENOTFOUND) /* the part is gone: cannot tell */
            st = md_err_set(err, MD_EUNAVAIL, "the part %.200s went away; try again", src_url);
        if (fd >= 0)
            close(fd);
        md_s3_stream_close(src);
    } else if (st == MD_ENOTFOUND)
        st = md_s3_copy(s3, src_key, key, err);
    else
        *err = herr;
    coded(st, err);
    md_s3_close(s3);
    return st;
}
