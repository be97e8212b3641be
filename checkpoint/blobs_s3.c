/*
 * blobs_s3.c - the blobs seam's S3 backend (blobs_impl.h), chosen by
 * blob_url = s3://BUCKET/PREFIX: checkpoint bytes are objects under
 * PREFIX/blobs/<sha256>/<nonce>, and --store/blobs/<sha256> is this
 * replica's cache of them.
 *
 * DESIGN
 * - Upload: the finished temp file (its sha256 known) is PUT under a new key
 *   with a random nonce, before the row naming it commits (blobs.c records
 *   the key in blob_keys in that transaction), so the object exists whenever
 *   a row names it, and no collector of an older upload of the same bytes
 *   can delete this one (another key).
 * - Fetch: a cached file is used as it is (checked when it was placed). A
 *   missing one is downloaded into tmp/upload-<pid>-fetch-XXXXXX (s3.c
 *   resumes a cut transfer with Range, or starts over), hashed, and renamed
 *   to blobs/<sha256> only when its sha256 is the one asked for: a final
 *   name never holds partial or wrong bytes. A crash leaves a temp file the
 *   sweep at open removes.
 * - Eviction: after each download and each committed upload, past
 *   cache_max_bytes, the least recently used cached files (by atime, which
 *   every fetch sets) are unlinked, never a pinned one: fetch pins the file
 *   it answers until the caller is done reading it. A reader that already opened a file keeps it after an
 *   unlink (Linux keeps an open file's inode), so a loaded version never
 *   needs its file again.
 * - Every network call is bounded (s3.c: connect timeout, low-speed limit):
 *   S3 stalled or gone is MD_EUNAVAIL after a while, never a hang. The
 *   low-speed window can be shortened for the tests by MD_TEST_S3_STALL_S.
 */
#define _GNU_SOURCE
#include "blobs_impl.h"
#include "s3.h"

#include "../config/md_metrics.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct pin {
    char sha[65];
    int count;
} pin;

typedef struct md_blobs_s3 {
    md_blobs base;
    md_s3 *s3;
    char dir[4096];
    long long cache_max_bytes;
    pthread_mutex_t mu; /* pins and eviction */
    pin *pins;
    int n_pins, cap_pins;
    /* metrics */
    atomic_llong hits, downloads, download_errors, download_bytes, evictions, uploads,
        upload_errors;
} md_blobs_s3;

#define S3B(b) ((md_blobs_s3 *)(b))

/* S3 unreachable is the one failure a client should retry: named so. */
static md_status coded(md_status st, md_err *err)
{
    if (st == MD_EUNAVAIL && err)
        snprintf(err->code, sizeof err->code, "s3_unavailable");
    return st;
}

static md_status s3b_open(const md_blobs_args *args, md_blobs **out, md_err *err)
{
    md_s3_config cfg;
    md_status st = md_s3_config_from_env(&cfg, err);
    if (st != MD_OK)
        return st;
    if (args->path_style >= 0)
        cfg.path_style = args->path_style;
    md_s3_net net;
    md_s3_net_defaults(&net);
    const char *stall = getenv("MD_TEST_S3_STALL_S");
    if (stall && atoi(stall) > 0)
        net.low_speed_time_s = atoi(stall);
    if (stall && atoi(stall) > 0)
        net.request_timeout_ms = atoi(stall) * 1000L;
    md_s3 *s3 = NULL;
    st = md_s3_open(&cfg, args->url, &net, &s3, err);
    explicit_bzero(&cfg, sizeof cfg);
    if (st != MD_OK)
        return st;
    /* blobs/<64>/<32> must fit under S3's key limit after the prefix */
    if (strlen(md_s3_prefix(s3)) > MD_S3_KEY_MAX - 110) {
        md_s3_close(s3);
        return md_err_setc(err, MD_EINVAL, "blob_url_invalid",
                           "blob_url: the prefix is longer than %d bytes; use a shorter one",
                           MD_S3_KEY_MAX - 110);
    }
    md_blobs_s3 *b = md_xcalloc(1, sizeof *b);
    b->base.ops = &md_blobs_s3_ops;
    b->base.caps = MD_BLOBS_CAP_REMOTE;
    b->s3 = s3;
    b->cache_max_bytes = args->cache_max_bytes;
    snprintf(b->dir, sizeof b->dir, "%s", args->dir);
    pthread_mutex_init(&b->mu, NULL);
    *out = &b->base;
    return MD_OK;
}

static void s3b_close(md_blobs *base)
{
    md_blobs_s3 *b = S3B(base);
    md_s3_close(b->s3);
    pthread_mutex_destroy(&b->mu);
    free(b->pins);
    free(b);
}

static md_status s3b_put(md_blobs *base, const char *sha256, const char *path, char *key,
                         md_err *err)
{
    unsigned char nonce[16];
    if (getrandom(nonce, sizeof nonce, 0) != (ssize_t)sizeof nonce)
        return md_err_set(err, MD_EINTERNAL, "cannot draw a random key: %s", strerror(errno));
    int n = snprintf(key, MD_BLOB_KEY_MAX, "blobs/%.64s/", sha256);
    for (size_t i = 0; i < sizeof nonce; i++)
        n += snprintf(key + n, (size_t)(MD_BLOB_KEY_MAX - n), "%02x", nonce[i]);
    /* on failure the key stays: the PUT may still land (a stalled server
     * that goes on), so the caller's abort tries a delete; the orphan sweep
     * deletes it otherwise */
    md_status st = coded(md_s3_put_file_sha256(S3B(base)->s3, key, path, sha256, err), err);
    atomic_fetch_add(st == MD_OK ? &S3B(base)->uploads : &S3B(base)->upload_errors, 1);
    return st;
}

/* ---- the cache ---- */

/* pins: b->mu held */
static pin *pin_find(md_blobs_s3 *b, const char *sha)
{
    for (int i = 0; i < b->n_pins; i++)
        if (strcmp(b->pins[i].sha, sha) == 0)
            return &b->pins[i];
    return NULL;
}

static void s3b_pin(md_blobs *base, const char *sha256, int on)
{
    md_blobs_s3 *b = S3B(base);
    pthread_mutex_lock(&b->mu);
    pin *p = pin_find(b, sha256);
    if (on) {
        if (!p) {
            if (b->n_pins == b->cap_pins) {
                b->cap_pins = b->cap_pins ? 2 * b->cap_pins : 8;
                b->pins = realloc(b->pins, sizeof *b->pins * (size_t)b->cap_pins);
                md_assert(b->pins != NULL);
            }
            p = &b->pins[b->n_pins++];
            snprintf(p->sha, sizeof p->sha, "%s", sha256);
            p->count = 0;
        }
        p->count++;
    } else if (p && --p->count <= 0) {
        *p = b->pins[--b->n_pins];
    }
    pthread_mutex_unlock(&b->mu);
}

typedef struct cached {
    char name[65];
    long long size;
    struct timespec used;
} cached;

static int by_use(const void *a, const void *b)
{
    const cached *x = a, *y = b;
    if (x->used.tv_sec != y->used.tv_sec)
        return x->used.tv_sec < y->used.tv_sec ? -1 : 1;
    return x->used.tv_nsec < y->used.tv_nsec ? -1 : x->used.tv_nsec > y->used.tv_nsec;
}

/* Past cache_max_bytes, unlink the least recently used unpinned files. */
static void evict(md_blobs_s3 *b)
{
    if (b->cache_max_bytes <= 0)
        return;
    char path[4200];
    snprintf(path, sizeof path, "%s/blobs", b->dir);
    pthread_mutex_lock(&b->mu);
    DIR *d = opendir(path);
    if (!d) {
        pthread_mutex_unlock(&b->mu);
        return;
    }
    cached *files = NULL;
    int n = 0, cap = 0;
    long long total = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        struct stat sb;
        if (strlen(e->d_name) != 64 || fstatat(dirfd(d), e->d_name, &sb, 0) != 0 ||
            !S_ISREG(sb.st_mode))
            continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 64;
            files = realloc(files, sizeof *files * (size_t)cap);
            md_assert(files != NULL);
        }
        memcpy(files[n].name, e->d_name, 64); /* a sha256 in hex: 64 bytes, checked above */
        files[n].name[64] = '\0';
        files[n].size = (long long)sb.st_size;
        files[n].used = sb.st_atim;
        total += files[n].size;
        n++;
    }
    if (total > b->cache_max_bytes) {
        qsort(files, (size_t)n, sizeof *files, by_use);
        for (int i = 0; i < n && total > b->cache_max_bytes; i++) {
            if (pin_find(b, files[i].name))
                continue; /* being read: kept */
            if (unlinkat(dirfd(d), files[i].name, 0) == 0) {
                total -= files[i].size;
                atomic_fetch_add(&b->evictions, 1);
                md_log(MD_LOG_INFO, "blob cache %s: evicted %s (%lld bytes; cache_max_bytes %lld)",
                       path, files[i].name, files[i].size, b->cache_max_bytes);
            }
        }
    }
    closedir(d);
    free(files);
    pthread_mutex_unlock(&b->mu);
}

/* The sha256 of the file open at `fd`, from its start, into hex. */
static int hash_fd(int fd, char hex[65])
{
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    if (!ctx || EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) != 1) {
        EVP_MD_CTX_free(ctx);
        return -1;
    }
    static __thread unsigned char buf[1 << 16];
    off_t off = 0;
    for (;;) {
        ssize_t n = pread(fd, buf, sizeof buf, off);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            EVP_MD_CTX_free(ctx);
            return -1;
        }
        if (n == 0)
            break;
        EVP_DigestUpdate(ctx, buf, (size_t)n);
        off += n;
    }
    unsigned char digest[32];
    unsigned int dlen = 0;
    int ok = EVP_DigestFinal_ex(ctx, digest, &dlen) == 1 && dlen == 32;
    EVP_MD_CTX_free(ctx);
    for (unsigned i = 0; ok && i < 32; i++)
        snprintf(hex + 2 * i, 3, "%02x", digest[i]);
    return ok ? 0 : -1;
}

static md_status download(md_blobs_s3 *b, const char *sha256, const char *key, const char *path,
                          md_err *err)
{
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s/tmp/upload-%ld-fetch-XXXXXX", b->dir, (long)getpid());
    int fd = mkostemp(tmp, O_CLOEXEC);
    if (fd < 0)
        return md_err_set(err, MD_EIO, "store %s: cannot create a temp file in tmp/: %s", b->dir,
                          strerror(errno));
    md_s3_object info;
    md_status st = coded(md_s3_get_fd(b->s3, key, fd, &info, err), err);
    if (st == MD_OK)
        atomic_fetch_add(&b->download_bytes, (long long)info.size);
    char got[65] = "";
    if (st == MD_OK && hash_fd(fd, got) != 0)
        st = md_err_set(err, MD_EIO, "store %s: cannot read back the downloaded %s: %s", b->dir,
                        key, strerror(errno));
    if (st == MD_OK && strcmp(got, sha256) != 0)
        st = md_err_setc(err, MD_EIO, "blob_corrupt",
                         "s3://%s/%s%s holds bytes whose sha256 is %s, not %s; the object was "
                         "changed outside modeld: upload the version again",
                         md_s3_bucket(b->s3), md_s3_prefix(b->s3), key, got, sha256);
    close(fd);
    /* complete and checked, else never under the final name */
    if (st == MD_OK && rename(tmp, path) != 0)
        st = md_err_set(err, MD_EIO, "store %s: cannot move the downloaded blob into blobs/: %s",
                        b->dir, strerror(errno));
    if (st != MD_OK) {
        unlink(tmp);
        return st;
    }
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/blobs", b->dir);
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
        fsync(dfd);
        close(dfd);
    }
    md_log(MD_LOG_INFO, "blob cache %s: fetched %s (%lld bytes)", dir, sha256,
           (long long)info.size);
    return MD_OK;
}

static void s3b_trim(md_blobs *base) { evict(S3B(base)); }

static md_status s3b_fetch(md_blobs *base, const char *sha256, const char *key, md_err *err)
{
    md_blobs_s3 *b = S3B(base);
    char path[4200];
    snprintf(path, sizeof path, "%s/blobs/%s", b->dir, sha256);
    s3b_pin(base, sha256, 1); /* before looking: no eviction between the look and the read */
    /* atime is the cache's recency, set by hand (mounts are relatime) */
    struct timespec times[2] = {{0, UTIME_NOW}, {0, UTIME_OMIT}};
    if (utimensat(AT_FDCWD, path, times, 0) == 0) {
        atomic_fetch_add(&b->hits, 1);
        return MD_OK;
    }
    md_status st;
    if (!key || !key[0])
        st = md_err_setc(err, MD_ENOTFOUND, "checkpoint_missing",
                         "blob %.64s is in neither the cache %s/blobs nor s3://%s/%s", sha256,
                         b->dir, md_s3_bucket(b->s3), md_s3_prefix(b->s3));
    else
        st = download(b, sha256, key, path, err);
    if (st != MD_OK) {
        if (st != MD_ENOTFOUND || (key && key[0]))
            atomic_fetch_add(&b->download_errors, 1);
        s3b_pin(base, sha256, 0);
        return st;
    }
    atomic_fetch_add(&b->downloads, 1);
    evict(b);
    return MD_OK;
}

static md_status s3b_remove(md_blobs *base, const char *key, md_err *err)
{
    return md_s3_delete(S3B(base)->s3, key, err);
}

typedef struct list_ctx {
    md_blobs_list_fn fn;
    void *ctx;
    time_t now;
} list_ctx;

static int on_object(void *ctx, const md_s3_object *obj)
{
    list_ctx *l = ctx;
    struct tm tm = {0};
    long long age = 0;
    if (strptime(obj->last_modified, "%Y-%m-%dT%H:%M:%S", &tm))
        age = (long long)(l->now - timegm(&tm));
    return l->fn(l->ctx, obj->key, age);
}

static md_status s3b_list(md_blobs *base, md_blobs_list_fn fn, void *ctx, md_err *err)
{
    list_ctx l = {fn, ctx, time(NULL)};
    return md_s3_list(S3B(base)->s3, "blobs/", 0, on_object, &l, err);
}

/* Bytes of the cache's files now (a scan: the cache holds checkpoints, a
 * few files). */
static long long cache_bytes(md_blobs_s3 *b)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/blobs", b->dir);
    DIR *d = opendir(path);
    long long total = 0;
    struct dirent *e;
    while (d && (e = readdir(d))) {
        struct stat sb;
        if (strlen(e->d_name) == 64 && fstatat(dirfd(d), e->d_name, &sb, 0) == 0 &&
            S_ISREG(sb.st_mode))
            total += (long long)sb.st_size;
    }
    if (d)
        closedir(d);
    return total;
}

static void s3b_write_metrics(md_blobs *base, FILE *f)
{
    md_blobs_s3 *b = S3B(base);
    md_prom_family(f, "modeld_blob_cache_bytes", "gauge",
                   "Bytes of checkpoints in this replica's cache of the S3 blobs.");
    md_prom_sample(f, "modeld_blob_cache_bytes", "", (double)cache_bytes(b));
    md_prom_family(f, "modeld_blob_cache_max_bytes", "gauge",
                   "cache_max_bytes: the cache's bound (0 = none).");
    md_prom_sample(f, "modeld_blob_cache_max_bytes", "", (double)b->cache_max_bytes);
    md_prom_family(f, "modeld_blob_fetches_total", "counter",
                   "Checkpoints asked of the cache: found there (hit), downloaded from S3, or "
                   "not fetched (error: S3 unreachable, the object missing or changed).");
    md_prom_sample(f, "modeld_blob_fetches_total", "result=\"hit\"",
                   (double)atomic_load(&b->hits));
    md_prom_sample(f, "modeld_blob_fetches_total", "result=\"download\"",
                   (double)atomic_load(&b->downloads));
    md_prom_sample(f, "modeld_blob_fetches_total", "result=\"error\"",
                   (double)atomic_load(&b->download_errors));
    md_prom_family(f, "modeld_blob_download_bytes_total", "counter",
                   "Bytes downloaded from S3 into the cache.");
    md_prom_sample(f, "modeld_blob_download_bytes_total", "",
                   (double)atomic_load(&b->download_bytes));
    md_prom_family(f, "modeld_blob_evictions_total", "counter",
                   "Cached checkpoints evicted to stay under cache_max_bytes.");
    md_prom_sample(f, "modeld_blob_evictions_total", "", (double)atomic_load(&b->evictions));
    md_prom_family(f, "modeld_blob_uploads_total", "counter",
                   "Checkpoints put in S3 (ok), or not (error: nothing was stored).");
    md_prom_sample(f, "modeld_blob_uploads_total", "result=\"ok\"",
                   (double)atomic_load(&b->uploads));
    md_prom_sample(f, "modeld_blob_uploads_total", "result=\"error\"",
                   (double)atomic_load(&b->upload_errors));
}

static int s3b_data_url(md_blobs *base, char *url, size_t size)
{
    md_blobs_s3 *b = S3B(base);
    int n = snprintf(url, size, "s3://%s/%s", md_s3_bucket(b->s3), md_s3_prefix(b->s3));
    return n > 0 && (size_t)n < size;
}

const md_blobs_ops md_blobs_s3_ops = {
    .name = "s3",
    .open = s3b_open,
    .close = s3b_close,
    .put = s3b_put,
    .fetch = s3b_fetch,
    .remove = s3b_remove,
    .list = s3b_list,
    .pin = s3b_pin,
    .trim = s3b_trim,
    .write_metrics = s3b_write_metrics,
    .data_url = s3b_data_url,
};
