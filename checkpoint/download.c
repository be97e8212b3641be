/* download.c - checkpoint and dataset downloads with libcurl, and the
 * allow-list checks that decide which sources may be read at all. */
#define _GNU_SOURCE
#include <curl/curl.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "checkpoint.h"

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
static void curl_init(void) { curl_global_init(CURL_GLOBAL_DEFAULT); }

/* Is real path `p` inside real directory `dir`? */
static int path_under(const char *p, const char *dir)
{
    char rdir[PATH_MAX];
    if (!realpath(dir, rdir))
        return 0;
    size_t n = strlen(rdir);
    if (n == 1 && rdir[0] == '/')
        return 1;
    return strncmp(p, rdir, n) == 0 && (p[n] == '/' || p[n] == '\0');
}

md_status md_source_check(const char *url, const md_fetch_opts *o, md_err *err)
{
    if (strncmp(url, "file://", 7) == 0) {
        const char *path = url + 7;
        if (path[0] != '/')
            return md_err_setc(err, MD_EINVAL, "invalid_source",
                               "source %s: file URLs need an absolute path, as file:///dir/model.pt",
                               url);
        if (!o->allowed_paths || o->allowed_paths->count == 0)
            return md_err_setc(err, MD_EINVAL, "source_not_allowed",
                               "source %s: file:// sources are disabled; set allowed_paths to the "
                               "directories the server may read",
                               url);
        char real[PATH_MAX];
        if (!realpath(path, real))
            return md_err_setc(err, MD_EINVAL, "source_not_found", "source %s: %s", url,
                               strerror(errno));
        for (int i = 0; i < o->allowed_paths->count; i++)
            if (path_under(real, o->allowed_paths->items[i]))
                return MD_OK;
        return md_err_setc(err, MD_EINVAL, "source_not_allowed",
                           "source %s is not under allowed_paths; add its directory to the "
                           "allowed_paths setting",
                           url);
    }
    if (strncmp(url, "http://", 7) != 0 && strncmp(url, "https://", 8) != 0)
        return md_err_setc(err, MD_EINVAL, "invalid_source",
                           "source \"%.200s\": only http://, https:// and file:// URLs are supported",
                           url);
    if (o->allowed_urls && o->allowed_urls->count > 0) {
        for (int i = 0; i < o->allowed_urls->count; i++)
            if (strncmp(url, o->allowed_urls->items[i], strlen(o->allowed_urls->items[i])) == 0)
                return MD_OK;
        return md_err_setc(err, MD_EINVAL, "source_not_allowed",
                           "source %.200s does not start with any allowed_urls prefix; add its "
                           "prefix to the allowed_urls setting",
                           url);
    }
    return MD_OK;
}

typedef struct sink {
    md_blob_writer *w;
    FILE *f;
    long long written, max_bytes;
    md_err *err;
    int failed;
} sink;

static size_t on_data(char *data, size_t size, size_t n, void *cls)
{
    sink *s = cls;
    size_t len = size * n;
    if (s->w) {
        if (md_blob_write(s->w, data, len, s->err) != MD_OK) {
            s->failed = 1;
            return 0; /* makes curl stop with CURLE_WRITE_ERROR */
        }
        return len;
    }
    if (s->written + (long long)len > s->max_bytes) {
        md_err_setc(s->err, MD_ETOOBIG, "download_too_large",
                    "the download is larger than the limit of %lld bytes", s->max_bytes);
        s->failed = 1;
        return 0;
    }
    if (fwrite(data, 1, len, s->f) != len) {
        md_err_set(s->err, MD_EIO, "writing the download failed: %s", strerror(errno));
        s->failed = 1;
        return 0;
    }
    s->written += (long long)len;
    return len;
}

/* One libcurl transfer into `s` with the limits of `o`. */
static md_status fetch(const char *url, const md_fetch_opts *o, sink *s, md_err *err)
{
    md_status st = md_source_check(url, o, err);
    if (st != MD_OK)
        return st;
    pthread_once(&curl_once, curl_init);
    CURL *c = curl_easy_init();
    if (!c)
        return md_err_set(err, MD_EINTERNAL, "cannot start libcurl");
    char curl_err[CURL_ERROR_SIZE] = "";
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https,file");
    curl_easy_setopt(c, CURLOPT_REDIR_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(c, CURLOPT_FOLLOWLOCATION, 1L);
    curl_easy_setopt(c, CURLOPT_MAXREDIRS, (long)o->max_redirects);
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT, (long)o->connect_timeout_s);
    curl_easy_setopt(c, CURLOPT_TIMEOUT, (long)o->timeout_s);
    curl_easy_setopt(c, CURLOPT_MAXFILESIZE_LARGE, (curl_off_t)o->max_bytes);
    curl_easy_setopt(c, CURLOPT_FAILONERROR, 1L);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_data);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, s);
    curl_easy_setopt(c, CURLOPT_ERRORBUFFER, curl_err);
    curl_easy_setopt(c, CURLOPT_USERAGENT, "modeld");
    CURLcode rc = curl_easy_perform(c);
    long http = 0;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &http);
    curl_easy_cleanup(c);
    if (rc == CURLE_OK)
        return MD_OK;
    if (s->failed)
        return err->status;
    if (rc == CURLE_FILESIZE_EXCEEDED)
        return md_err_setc(err, MD_ETOOBIG, "download_too_large",
                           "source %.200s is larger than the limit of %lld bytes", url,
                           o->max_bytes);
    if (rc == CURLE_OPERATION_TIMEDOUT)
        return md_err_setc(err, MD_EUNPROC, "download_failed",
                           "downloading %.200s timed out (%s); check the URL or raise "
                           "download_timeout_s",
                           url, curl_err[0] ? curl_err : curl_easy_strerror(rc));
    if (rc == CURLE_TOO_MANY_REDIRECTS)
        return md_err_setc(err, MD_EUNPROC, "download_failed",
                           "downloading %.200s: more than %d redirects (download_max_redirects)",
                           url, o->max_redirects);
    if (rc == CURLE_HTTP_RETURNED_ERROR)
        return md_err_setc(err, MD_EUNPROC, "download_failed",
                           "downloading %.200s: the server answered HTTP %ld", url, http);
    return md_err_setc(err, MD_EUNPROC, "download_failed", "downloading %.200s failed: %s", url,
                       curl_err[0] ? curl_err : curl_easy_strerror(rc));
}

md_status md_fetch_blob(md_store *store, const char *url, const md_fetch_opts *o,
                        md_blob_writer **out, md_err *err)
{
    *out = NULL;
    md_status st = md_source_check(url, o, err);
    if (st != MD_OK)
        return st;
    md_blob_writer *w = NULL;
    if ((st = md_blob_begin(store, o->max_bytes, &w, err)) != MD_OK)
        return st;
    sink s = {.w = w, .err = err};
    if ((st = fetch(url, o, &s, err)) != MD_OK) {
        md_blob_abort(w);
        return st;
    }
    *out = w;
    return MD_OK;
}

md_status md_fetch_file(const char *url, const md_fetch_opts *o, const char *dest, md_err *err)
{
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.download", dest);
    FILE *f = fopen(tmp, "wb");
    if (!f)
        return md_err_set(err, MD_EIO, "cannot create %s: %s", tmp, strerror(errno));
    sink s = {.f = f, .max_bytes = o->max_bytes, .err = err};
    md_status st = fetch(url, o, &s, err);
    if (fflush(f) != 0 || fsync(fileno(f)) != 0) {
        if (st == MD_OK)
            st = md_err_set(err, MD_EIO, "writing %s failed: %s", tmp, strerror(errno));
    }
    fclose(f);
    if (st == MD_OK && rename(tmp, dest) != 0)
        st = md_err_set(err, MD_EIO, "cannot rename %s: %s", tmp, strerror(errno));
    if (st != MD_OK)
        unlink(tmp);
    return st;
}
