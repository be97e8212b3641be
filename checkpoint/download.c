/* download.c - checkpoint and dataset downloads with libcurl, and the
 * allow-list checks that decide which sources and paths may be used at all.
 *
 * DESIGN
 * A URL from a request may point anywhere, so what it may reach is decided
 * where the bytes are, not on its text:
 *  - every connection libcurl opens goes through open_socket(), which refuses
 *    loopback, private, link-local and other internal addresses (unless
 *    allow_private_urls): a name that resolves (or re-resolves) to 127.0.0.1
 *    or 169.254.169.254 reaches nothing;
 *  - redirects are followed here, one hop at a time (libcurl's own following
 *    is off), and each hop's URL is parsed with libcurl's URL API and held to
 *    allowed_urls by scheme, host, port and a path prefix ending on a segment
 *    boundary: "https://a.com" does not allow "https://a.com.evil/";
 *  - messages quote the URL the client sent, never a redirect target or any
 *    fetched byte.
 * A path from a request is opened, never just checked: the allowed directory
 * is resolved once and opened, then each component is opened with openat and
 * O_NOFOLLOW (md_path_open_dir), so a symlink under allowed_paths leads
 * nowhere and there is no window between a check and the open.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <curl/curl.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "checkpoint.h"
#include "s3.h"
#include "store_internal.h"

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
static void curl_init(void) { curl_global_init(CURL_GLOBAL_DEFAULT); }

/* ---- internal addresses ---- */

static int v4_internal(uint32_t a) /* host byte order */
{
    return (a >> 24) == 0 ||                   /* 0.0.0.0/8 "this network" */
           (a >> 24) == 10 ||                  /* 10/8 */
           (a >> 22) == (100u << 2 | 1) ||     /* 100.64/10 carrier-grade NAT */
           (a >> 24) == 127 ||                 /* loopback */
           (a >> 16) == (169u << 8 | 254) ||   /* link-local, cloud metadata */
           (a >> 20) == (172u << 4 | 1) ||     /* 172.16/12 */
           (a >> 8) == (192u << 16 | 0 << 8 | 0) || /* 192.0.0/24 protocol assignments */
           (a >> 16) == (192u << 8 | 168) ||   /* 192.168/16 */
           (a >> 17) == (198u << 7 | 18 >> 1) || /* 198.18/15 benchmarking */
           (a >> 28) >= 14;                    /* 224/4 multicast, 240/4 reserved, broadcast */
}

int md_addr_is_internal(const struct sockaddr *sa)
{
    if (sa->sa_family == AF_INET)
        return v4_internal(ntohl(((const struct sockaddr_in *)sa)->sin_addr.s_addr));
    if (sa->sa_family != AF_INET6)
        return 1; /* unix sockets and the like: never for a download */
    const unsigned char *b = ((const struct sockaddr_in6 *)sa)->sin6_addr.s6_addr;
    static const unsigned char zero[16];
    uint32_t v4 = (uint32_t)b[12] << 24 | (uint32_t)b[13] << 16 | (uint32_t)b[14] << 8 | b[15];
    if (memcmp(b, zero, 10) == 0 && b[10] == 0xff && b[11] == 0xff)
        return v4_internal(v4); /* ::ffff:a.b.c.d, IPv4-mapped */
    if (memcmp(b, zero, 12) == 0)
        return 1; /* ::, ::1 and the deprecated IPv4-compatible ::a.b.c.d */
    if (b[0] == 0x00 && b[1] == 0x64 && b[2] == 0xff && b[3] == 0x9b && memcmp(b + 4, zero, 8) == 0)
        return v4_internal(v4); /* 64:ff9b::/96 NAT64 */
    if (b[0] == 0x00 && b[1] == 0x64 && b[2] == 0xff && b[3] == 0x9b && b[4] == 0x00 && b[5] == 0x01)
        return 1; /* 64:ff9b:1::/48 local-use NAT64 (RFC 8215): a private translator */
    if (memcmp(b, zero, 8) == 0 && b[8] == 0xff && b[9] == 0xff && b[10] == 0 && b[11] == 0)
        return v4_internal(v4); /* ::ffff:0:a.b.c.d, IPv4-translated (RFC 2765) */
    if (b[0] == 0x20 && b[1] == 0x01 && b[2] == 0x00 && b[3] == 0x00)
        return 1; /* 2001::/32 Teredo: a tunnel whose client address is obfuscated inside */
    if (b[0] == 0x20 && b[1] == 0x02) /* 2002::/16 6to4: the IPv4 address in bits 16..47 */
        return v4_internal((uint32_t)b[2] << 24 | (uint32_t)b[3] << 16 | (uint32_t)b[4] << 8 | b[5]);
    return (b[0] & 0xfe) == 0xfc ||             /* fc00::/7 unique local */
           (b[0] == 0xfe && (b[1] & 0xc0) == 0x80) || /* fe80::/10 link-local */
           (b[0] == 0xfe && (b[1] & 0xc0) == 0xc0) || /* fec0::/10 site-local (deprecated) */
           b[0] == 0xff;                        /* multicast */
}

/* ---- URLs ---- */

typedef struct url_parts {
    char scheme[8];
    char host[256];
    long port;
    char path[2048];
} url_parts;

/* Parse an absolute http(s) URL with libcurl's parser (the one that will
 * connect), so the host compared is the host reached. 0 on success. */
static int url_parse(const char *url, url_parts *p)
{
    pthread_once(&curl_once, curl_init);
    CURLU *h = curl_url();
    if (!h)
        return -1;
    int rc = -1;
    char *scheme = NULL, *host = NULL, *port = NULL, *path = NULL;
    if (curl_url_set(h, CURLUPART_URL, url, 0) != CURLUE_OK ||
        curl_url_get(h, CURLUPART_SCHEME, &scheme, 0) != CURLUE_OK ||
        curl_url_get(h, CURLUPART_HOST, &host, 0) != CURLUE_OK ||
        curl_url_get(h, CURLUPART_PORT, &port, CURLU_DEFAULT_PORT) != CURLUE_OK ||
        curl_url_get(h, CURLUPART_PATH, &path, 0) != CURLUE_OK)
        goto out;
    if (strlen(scheme) >= sizeof p->scheme || strlen(host) >= sizeof p->host ||
        strlen(path) >= sizeof p->path)
        goto out;
    snprintf(p->scheme, sizeof p->scheme, "%s", scheme);
    snprintf(p->host, sizeof p->host, "%s", host);
    snprintf(p->path, sizeof p->path, "%s", path[0] ? path : "/");
    p->port = strtol(port, NULL, 10);
    rc = 0;
out:
    curl_free(scheme);
    curl_free(host);
    curl_free(port);
    curl_free(path);
    curl_url_cleanup(h);
    return rc;
}

/* Does `u` match the allowed_urls entry `allowed`: same scheme, host and
 * port, and a path equal to the entry's or under it on a '/' boundary?
 * Encoded dots and slashes are refused: the server would decode them into
 * "..", which the path comparison cannot see. */
static int url_allowed_by(const url_parts *u, const char *allowed)
{
    url_parts a;
    if (url_parse(allowed, &a) != 0)
        return 0;
    if (strcasecmp(u->scheme, a.scheme) != 0 || strcasecmp(u->host, a.host) != 0 ||
        u->port != a.port)
        return 0;
    if (strcasestr(u->path, "%2e") || strcasestr(u->path, "%2f") || strcasestr(u->path, "%5c"))
        return 0;
    size_t n = strlen(a.path);
    if (strncmp(u->path, a.path, n) != 0)
        return 0;
    return a.path[n - 1] == '/' || u->path[n] == '\0' || u->path[n] == '/';
}

/* 1 when `host` (as libcurl parsed it: IPv6 in brackets) is an internal
 * address written out, such as 127.0.0.1, [::1] or 169.254.169.254. */
static int host_is_internal_literal(const char *host)
{
    struct sockaddr_in a4 = {.sin_family = AF_INET};
    struct sockaddr_in6 a6 = {.sin6_family = AF_INET6};
    char h[256];
    size_t n = strlen(host);
    if (n >= 2 && host[0] == '[' && host[n - 1] == ']' && n - 2 < sizeof h) {
        memcpy(h, host + 1, n - 2);
        h[n - 2] = '\0';
        char *zone = strchr(h, '%');
        if (zone)
            *zone = '\0';
        return inet_pton(AF_INET6, h, &a6.sin6_addr) == 1 &&
               md_addr_is_internal((struct sockaddr *)&a6);
    }
    return inet_pton(AF_INET, host, &a4.sin_addr) == 1 &&
           md_addr_is_internal((struct sockaddr *)&a4);
}

/* Check an http(s) URL. `shown` is what a message may quote: the URL the
 * client sent (for a redirect hop, never the server's Location). */
static md_status url_check(const char *url, const char *shown, int is_redirect,
                           const md_fetch_opts *o, md_err *err)
{
    url_parts u;
    if ((strncasecmp(url, "http://", 7) != 0 && strncasecmp(url, "https://", 8) != 0) ||
        url_parse(url, &u) != 0) {
        if (is_redirect)
            return md_err_setc(err, MD_EUNPROC, "download_failed",
                               "source %.200s redirects to a URL that is not http or https; "
                               "give the final URL instead",
                               shown);
        return md_err_setc(err, MD_EINVAL, "invalid_source",
                           "source \"%.200s\": not a valid http://, https:// or file:// URL", url);
    }
    /* a literal internal address is refused at once; a name is checked on
     * the addresses it resolves to, when connecting (open_socket) */
    if (!o->allow_private && host_is_internal_literal(u.host)) {
        if (is_redirect)
            return md_err_setc(err, MD_EINVAL, "source_not_allowed",
                               "source %.200s redirects to a loopback, private or link-local "
                               "address; set allow_private_urls=1 if the server may download "
                               "from internal hosts",
                               shown);
        return md_err_setc(err, MD_EINVAL, "source_not_allowed",
                           "source %.200s is a loopback, private or link-local address; set "
                           "allow_private_urls=1 if the server may download from internal hosts",
                           url);
    }
    if (!o->allowed_urls || o->allowed_urls->count == 0)
        return MD_OK;
    for (int i = 0; i < o->allowed_urls->count; i++)
        if (url_allowed_by(&u, o->allowed_urls->items[i]))
            return MD_OK;
    if (is_redirect)
        return md_err_setc(err, MD_EINVAL, "source_not_allowed",
                           "source %.200s redirects to a URL outside allowed_urls; give a URL "
                           "whose redirects stay there, or add the target to allowed_urls",
                           shown);
    return md_err_setc(err, MD_EINVAL, "source_not_allowed",
                       "source %.200s is not under any allowed_urls entry (same scheme, host and "
                       "port, and a path under the entry's); add it to the allowed_urls setting",
                       url);
}

/* ---- paths ---- */

md_status md_path_open_dir(const md_strlist *allowed, const char *what, const char *path,
                           const char *notfound_code, int *dirfd, const char **leaf, md_err *err)
{
    *dirfd = -1;
    *leaf = NULL;
    if (path[0] != '/')
        return md_err_setc(err, MD_EINVAL, "invalid_path", "%s \"%.200s\" must be an absolute path",
                           what, path);
    if (!allowed || allowed->count == 0)
        return md_err_setc(err, MD_EINVAL, "path_not_allowed",
                           "%s paths are disabled; set allowed_paths to the directories modeld may "
                           "use, or give a URL",
                           what);
    if (strlen(path) >= PATH_MAX)
        return md_err_setc(err, MD_EINVAL, "invalid_path", "%s is longer than %d bytes", what,
                           PATH_MAX - 1);
    const char *last = strrchr(path, '/') + 1;
    if (!*last || strcmp(last, ".") == 0 || strcmp(last, "..") == 0)
        return md_err_setc(err, MD_EINVAL, "invalid_path", "%s \"%.200s\" must name a file", what,
                           path);
    for (const char *c = path; (c = strstr(c, "/..")) != NULL; c += 3)
        if (c[3] == '/' || c[3] == '\0')
            return md_err_setc(err, MD_EINVAL, "invalid_path",
                               "%s \"%.200s\" must not contain \"..\"; give the path itself",
                               what, path);
    for (int i = 0; i < allowed->count; i++) {
        /* the allowed directory as configured or as resolved: the one symlink
         * resolution is the administrator's, everything below it is opened
         * component by component without following any */
        char real[PATH_MAX];
        if (!realpath(allowed->items[i], real))
            continue;
        const char *cands[2] = {allowed->items[i], real};
        const char *rel = NULL;
        for (int k = 0; k < 2 && !rel; k++) {
            size_t n = strlen(cands[k]);
            while (n > 1 && cands[k][n - 1] == '/')
                n--;
            if (n == 1 && cands[k][0] == '/')
                rel = path + 1;
            else if (strncmp(path, cands[k], n) == 0 && path[n] == '/')
                rel = path + n + 1;
        }
        if (!rel)
            continue;
        int fd = open(real, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (fd < 0)
            continue;
        char comp[PATH_MAX];
        const char *p = rel;
        while (p < last) {
            const char *slash = strchr(p, '/');
            size_t len = (size_t)(slash - p);
            if (len == 0 || (len == 1 && p[0] == '.')) {
                p = slash + 1;
                continue;
            }
            memcpy(comp, p, len);
            comp[len] = '\0';
            int next = openat(fd, comp, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
            int e = errno;
            close(fd);
            if (next < 0) {
                if (e == ENOENT)
                    return md_err_setc(err, MD_EINVAL, notfound_code,
                                       "%s %.200s: the directory %.*s does not exist", what, path,
                                       (int)(slash - path), path);
                return md_err_setc(err, MD_EINVAL, "path_not_allowed",
                                   "%s %.200s: %.*s is a symlink or not a directory; modeld "
                                   "follows no symlink under allowed_paths, give the real path",
                                   what, path, (int)(slash - path), path);
            }
            fd = next;
            p = slash + 1;
        }
        *dirfd = fd;
        *leaf = last;
        return MD_OK;
    }
    return md_err_setc(err, MD_EINVAL, "path_not_allowed",
                       "%s %.200s is not under allowed_paths; add its directory to the "
                       "allowed_paths setting",
                       what, path);
}

/* Open the last component of `path` under allowed_paths with `flags` (always
 * O_NOFOLLOW), mapping a refusal to the error for files and directories
 * alike: missing, a symlink (never followed), not a directory, or another. */
static md_status open_leaf(const md_strlist *allowed, const char *what, const char *path,
                           const char *notfound_code, int flags, int *fd, md_err *err)
{
    *fd = -1;
    int dirfd;
    const char *leaf;
    md_status st = md_path_open_dir(allowed, what, path, notfound_code, &dirfd, &leaf, err);
    if (st != MD_OK)
        return st;
    int f = openat(dirfd, leaf, flags | O_NOFOLLOW | O_CLOEXEC);
    int e = errno;
    struct stat sb;
    /* O_DIRECTORY | O_NOFOLLOW on a symlink says ENOTDIR: tell them apart */
    if (f < 0 && e == ENOTDIR && fstatat(dirfd, leaf, &sb, AT_SYMLINK_NOFOLLOW) == 0 &&
        S_ISLNK(sb.st_mode))
        e = ELOOP;
    close(dirfd);
    if (f >= 0) {
        *fd = f;
        return MD_OK;
    }
    if (e == ENOENT)
        return md_err_setc(err, MD_EINVAL, notfound_code, "%s %.200s does not exist", what, path);
    if (e == ELOOP)
        return md_err_setc(err, MD_EINVAL, "path_not_allowed",
                           "%s %.200s is a symlink; modeld follows no symlink under "
                           "allowed_paths, give the real path",
                           what, path);
    if (e == ENOTDIR)
        return md_err_setc(err, MD_EINVAL, "invalid_path", "%s %.200s is not a directory", what,
                           path);
    return md_err_setc(err, MD_EINVAL, "path_not_allowed", "%s %.200s cannot be opened: %s", what,
                       path, strerror(e));
}

md_status md_path_open_file(const md_strlist *allowed, const char *what, const char *path,
                            const char *notfound_code, int *fd, md_err *err)
{
    int f;
    *fd = -1;
    /* O_NONBLOCK: a FIFO planted here must not hang the open */
    md_status st = open_leaf(allowed, what, path, notfound_code, O_RDONLY | O_NONBLOCK, &f, err);
    if (st != MD_OK)
        return st;
    struct stat sb;
    if (fstat(f, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(f);
        return md_err_setc(err, MD_EINVAL, "invalid_path", "%s %.200s is not a regular file",
                           what, path);
    }
    int fl = fcntl(f, F_GETFL);
    if (fl < 0 || fcntl(f, F_SETFL, fl & ~O_NONBLOCK) != 0) {
        close(f);
        return md_err_set(err, MD_EIO, "%s %.200s: fcntl failed: %s", what, path, strerror(errno));
    }
    *fd = f;
    return MD_OK;
}

md_status md_path_open_directory(const md_strlist *allowed, const char *what, const char *path,
                                 const char *notfound_code, int *fd, md_err *err)
{
    return open_leaf(allowed, what, path, notfound_code, O_RDONLY | O_DIRECTORY, fd, err);
}

md_status md_fsync_dir(int dirfd, const char *what, md_err *err)
{
    if (fsync(dirfd) != 0 && errno != EINVAL) /* EINVAL: a file system without dir fsync */
        return md_err_set(err, MD_EIO, "fsync of the directory of %s failed: %s", what,
                          strerror(errno));
    return MD_OK;
}

md_fetch_opts md_fetch_opts_from_cfg(const md_cfg *cfg)
{
    md_fetch_opts o = {
        .max_bytes = cfg->max_checkpoint_bytes,
        .connect_timeout_s = cfg->download_connect_timeout_s,
        .timeout_s = cfg->download_timeout_s,
        .max_redirects = cfg->download_max_redirects,
        .allowed_paths = &cfg->allowed_paths,
        .allowed_urls = &cfg->allowed_urls,
        .allow_private = cfg->allow_private_urls,
        .allowed_s3 = &cfg->allowed_s3,
    };
    return o;
}

/* ---- s3:// sources ----
 * Operator-configured storage: read with the AWS_* credentials, not subject
 * to allow_private_urls (the endpoint is the operator's), but only from the
 * buckets and prefixes allowed_s3 lists. */

/* Whether s3://bucket/key is under the allowed_s3 entry "BUCKET[/PREFIX]":
 * the same bucket, and the key under the prefix at a '/' boundary (unless
 * the prefix ends in '/'). */
static int s3_allowed_by(const char *bucket, const char *key, const char *entry)
{
    const char *slash = strchr(entry, '/');
    size_t blen = slash ? (size_t)(slash - entry) : strlen(entry);
    if (strlen(bucket) != blen || strncmp(bucket, entry, blen) != 0)
        return 0;
    const char *prefix = slash ? slash + 1 : "";
    size_t plen = strlen(prefix);
    if (plen == 0)
        return 1;
    if (strncmp(key, prefix, plen) != 0)
        return 0;
    return prefix[plen - 1] == '/' || key[plen] == '/';
}

static md_status s3_source_check(const char *url, const md_fetch_opts *o, char *bucket,
                                 char *key, md_err *err)
{
    md_err perr;
    if (md_s3_url_parse(url, bucket, key, &perr) != MD_OK)
        return md_err_setc(err, MD_EINVAL, "invalid_source", "source %.200s: %s", url, perr.msg);
    size_t klen = strlen(key);
    if (klen == 0 || key[klen - 1] == '/')
        return md_err_setc(err, MD_EINVAL, "invalid_source",
                           "source %.200s names no object; give s3://BUCKET/KEY of the "
                           "checkpoint file",
                           url);
    /* S3 keys are literal, but not every S3-compatible server keeps "." and
     * ".." segments so: the allow-list must see the key the server reads */
    for (const char *seg = key; seg; seg = strchr(seg, '/') ? strchr(seg, '/') + 1 : NULL) {
        size_t n = strcspn(seg, "/");
        if ((n == 1 && seg[0] == '.') || (n == 2 && seg[0] == '.' && seg[1] == '.') || n == 0)
            return md_err_setc(err, MD_EINVAL, "invalid_source",
                               "source %.200s: a key with an empty, \".\" or \"..\" segment "
                               "is not accepted; name the object without them",
                               url);
    }
    if (!o->allowed_s3 || o->allowed_s3->count == 0)
        return md_err_setc(err, MD_EFORBIDDEN, "source_not_allowed",
                           "source %.200s: s3:// sources are disabled; set allowed_s3 to the "
                           "buckets (or BUCKET/PREFIX) the server may deploy from",
                           url);
    for (int i = 0; i < o->allowed_s3->count; i++)
        if (s3_allowed_by(bucket, key, o->allowed_s3->items[i]))
            return MD_OK;
    return md_err_setc(err, MD_EFORBIDDEN, "source_not_allowed",
                       "source %.200s is not under any allowed_s3 entry (BUCKET or "
                       "BUCKET/PREFIX); add it to the allowed_s3 setting",
                       url);
}

md_status md_s3_data_check(const char *url, const md_fetch_opts *o, const char *what, int folder,
                            char *bucket, char *key, md_err *err)
{
    md_err perr;
    if (md_s3_url_parse(url, bucket, key, &perr) != MD_OK)
        return md_err_setc(err, MD_EINVAL, "invalid_path", "%s %.200s: %s", what, url, perr.msg);
    size_t klen = strlen(key);
    if (!folder && (klen == 0 || key[klen - 1] == '/'))
        return md_err_setc(err, MD_EINVAL, "invalid_path",
                           "%s %.200s names no object; give s3://BUCKET/KEY of the file", what,
                           url);
    if (folder && klen > 0 && key[klen - 1] != '/')
        return md_err_setc(err, MD_EINVAL, "invalid_path",
                           "%s %.200s: a folder of images in S3 is a prefix ending in '/', as "
                           "s3://BUCKET/images/",
                           what, url);
    for (const char *seg = key; klen && seg && *seg;
         seg = strchr(seg, '/') ? strchr(seg, '/') + 1 : NULL) {
        size_t n = strcspn(seg, "/");
        if ((n == 1 && seg[0] == '.') || (n == 2 && seg[0] == '.' && seg[1] == '.') || n == 0)
            return md_err_setc(err, MD_EINVAL, "invalid_path",
                               "%s %.200s: a key with an empty, \".\" or \"..\" segment is not "
                               "accepted; name the object without them",
                               what, url);
    }
    if (!o->allowed_s3 || o->allowed_s3->count == 0)
        return md_err_setc(err, MD_EFORBIDDEN, "source_not_allowed",
                           "%s %.200s: s3:// datasets are disabled; set allowed_s3 to the "
                           "buckets (or BUCKET/PREFIX) jobs may read and write",
                           what, url);
    for (int i = 0; i < o->allowed_s3->count; i++)
        if (s3_allowed_by(bucket, key, o->allowed_s3->items[i]))
            return MD_OK;
    return md_err_setc(err, MD_EFORBIDDEN, "source_not_allowed",
                       "%s %.200s is not under any allowed_s3 entry (BUCKET or BUCKET/PREFIX); "
                       "add it to the allowed_s3 setting",
                       what, url);
}

/* Download s3://bucket/key into a new blob writer: HEAD first, so an object
 * past max_bytes is refused before a byte is written; then the bytes into
 * the writer's temp file (s3.c resumes a cut transfer), hashed there. */
static md_status fetch_s3(md_store *store, const char *url, const md_fetch_opts *o,
                          md_blob_writer **out, md_err *err)
{
    char bucket[MD_S3_BUCKET_MAX + 1], key[MD_S3_KEY_MAX + 1];
    md_status st = s3_source_check(url, o, bucket, key, err);
    if (st != MD_OK)
        return st;
    md_s3_config cfg;
    if ((st = md_s3_config_from_env(&cfg, err)) != MD_OK)
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
    md_s3 *s3 = NULL;
    st = md_s3_open(&cfg, root, &net, &s3, err);
    explicit_bzero(&cfg, sizeof cfg);
    if (st != MD_OK)
        return st;
    md_s3_object info;
    md_blob_writer *w = NULL;
    if ((st = md_s3_head(s3, key, &info, err)) == MD_OK && info.size > o->max_bytes)
        st = md_err_setc(err, MD_ETOOBIG, "checkpoint_too_large",
                         "source %.200s holds %lld bytes, more than the limit of %lld; raise "
                         "max_checkpoint_bytes to accept it",
                         url, (long long)info.size, o->max_bytes);
    if (st == MD_OK)
        st = md_blob_begin(store, o->max_bytes, &w, err);
    if (st == MD_OK)
        st = md_s3_get_fd(s3, key, w->fd, &info, err);
    if (st == MD_OK)
        st = md_blob_adopt(w, err);
    md_s3_close(s3);
    if (st == MD_EUNAVAIL)
        snprintf(err->code, sizeof err->code, "s3_unavailable");
    else if (st == MD_ENOTFOUND)
        snprintf(err->code, sizeof err->code, "source_not_found");
    if (st != MD_OK) {
        md_blob_abort(w);
        return st;
    }
    *out = w;
    return MD_OK;
}

md_status md_source_check(const char *url, const md_fetch_opts *o, md_err *err)
{
    if (strncmp(url, "s3://", 5) == 0) {
        char bucket[MD_S3_BUCKET_MAX + 1], key[MD_S3_KEY_MAX + 1];
        return s3_source_check(url, o, bucket, key, err);
    }
    if (strncmp(url, "file://", 7) == 0) {
        const char *path = url + 7;
        if (path[0] != '/')
            return md_err_setc(err, MD_EINVAL, "invalid_source",
                               "source %.200s: file URLs need an absolute path, as "
                               "file:///dir/model.pt",
                               url);
        if (!o->allowed_paths || o->allowed_paths->count == 0)
            return md_err_setc(err, MD_EINVAL, "source_not_allowed",
                               "source %.200s: file:// sources are disabled; set allowed_paths to "
                               "the directories the server may read",
                               url);
        int fd;
        md_status st = md_path_open_file(o->allowed_paths, "source", path, "source_not_found", &fd,
                                         err);
        if (st == MD_OK)
            close(fd);
        else if (strcmp(err->code, "path_not_allowed") == 0 ||
                 strcmp(err->code, "invalid_path") == 0)
            snprintf(err->code, sizeof err->code, "source_not_allowed");
        return st;
    }
    if (strncmp(url, "http://", 7) != 0 && strncmp(url, "https://", 8) != 0)
        return md_err_setc(err, MD_EINVAL, "invalid_source",
                           "source \"%.200s\": only http://, https://, file:// and s3:// URLs are "
                           "supported",
                           url);
    return url_check(url, url, 0, o, err);
}

/* ---- transfers ---- */

typedef struct sink {
    md_blob_writer *w;
    int fd;
    long long written, max_bytes;
    md_err *err;
    int failed;
    CURL *curl;
    int allow_private;
    int refused_address; /* open_socket refused an internal address */
    const md_fetch_opts *o;
} sink;

static md_status sink_put(sink *s, const char *data, size_t len)
{
    if (s->w)
        return md_blob_write(s->w, data, len, s->err);
    if (s->written + (long long)len > s->max_bytes)
        return md_err_setc(s->err, MD_ETOOBIG, "download_too_large",
                           "the download is larger than the limit of %lld bytes", s->max_bytes);
    while (len) {
        ssize_t w = write(s->fd, data, len);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0)
            return md_err_set(s->err, MD_EIO, "writing the download failed: %s", strerror(errno));
        data += w;
        len -= (size_t)w;
        s->written += w;
    }
    return MD_OK;
}

static size_t on_data(char *data, size_t size, size_t n, void *cls)
{
    sink *s = cls;
    size_t len = size * n;
    long code = 0;
    /* the body of a redirect is not the download */
    if (curl_easy_getinfo(s->curl, CURLINFO_RESPONSE_CODE, &code) == CURLE_OK && code >= 300 &&
        code < 400)
        return len;
    if (sink_put(s, data, len) != MD_OK) {
        s->failed = 1;
        return 0; /* makes curl stop with CURLE_WRITE_ERROR */
    }
    return len;
}

/* Every connection, to every address of every hop, is opened here. */
static curl_socket_t open_socket(void *cls, curlsocktype purpose, struct curl_sockaddr *a)
{
    sink *s = cls;
    (void)purpose;
    if (!s->allow_private && md_addr_is_internal(&a->addr)) {
        s->refused_address = 1;
        return CURL_SOCKET_BAD;
    }
    return socket(a->family, a->socktype | SOCK_CLOEXEC, a->protocol);
}

static int on_progress(void *cls, curl_off_t dltotal, curl_off_t dlnow, curl_off_t ultotal,
                       curl_off_t ulnow)
{
    sink *s = cls;
    (void)dltotal, (void)dlnow, (void)ultotal, (void)ulnow;
    if (s->o->keep_going && !s->o->keep_going(s->o->keep_going_ctx)) {
        md_err_setc(s->err, MD_ECONFLICT, "download_stopped", "the download was stopped");
        s->failed = 1;
        return 1;
    }
    return 0;
}

/* A file:// source: opened under allowed_paths without following symlinks
 * and read here (libcurl would open the path string again). */
static md_status fetch_path(const char *url, const md_fetch_opts *o, sink *s, md_err *err)
{
    int fd;
    md_status st = md_source_check(url, o, err);
    if (st != MD_OK)
        return st;
    if ((st = md_path_open_file(o->allowed_paths, "source", url + 7, "source_not_found", &fd,
                                err)) != MD_OK)
        return st;
    struct stat sb;
    if (fstat(fd, &sb) == 0 && sb.st_size > o->max_bytes) {
        close(fd);
        return md_err_setc(err, MD_ETOOBIG, "download_too_large",
                           "source %.200s is larger than the limit of %lld bytes", url,
                           o->max_bytes);
    }
    char buf[65536];
    long long total = 0;
    for (;;) {
        ssize_t n = read(fd, buf, sizeof buf);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            st = md_err_set(err, MD_EIO, "reading %.200s failed: %s", url, strerror(errno));
            break;
        }
        if (n == 0)
            break;
        total += n;
        if (total > o->max_bytes) {
            st = md_err_setc(err, MD_ETOOBIG, "download_too_large",
                             "source %.200s is larger than the limit of %lld bytes", url,
                             o->max_bytes);
            break;
        }
        if ((st = sink_put(s, buf, (size_t)n)) != MD_OK)
            break;
    }
    close(fd);
    return st;
}

#define SETOPT(c, opt, val)                                                                   \
    do {                                                                                      \
        if (curl_easy_setopt(c, opt, val) != CURLE_OK) {                                      \
            curl_easy_cleanup(c);                                                             \
            return md_err_set(err, MD_EINTERNAL, "libcurl refused option %s; libcurl %s is "  \
                              "too old or built without it", #opt, curl_version());           \
        }                                                                                     \
    } while (0)

/* One request of a transfer: `url` (a hop), nothing followed. On success
 * `*http` is the status and `*location` a new string (or NULL). */
static md_status fetch_hop(const char *url, const char *shown, const md_fetch_opts *o,
                           long timeout_s, sink *s, long *http, char **location, md_err *err)
{
    *location = NULL;
    *http = 0;
    s->refused_address = 0; /* per hop: an earlier hop's refusal says nothing of this one */
    CURL *c = curl_easy_init();
    if (!c)
        return md_err_set(err, MD_EINTERNAL, "cannot start libcurl");
    char curl_err[CURL_ERROR_SIZE] = "";
    s->curl = c;
    SETOPT(c, CURLOPT_URL, url);
    SETOPT(c, CURLOPT_PROTOCOLS_STR, "http,https");
    SETOPT(c, CURLOPT_FOLLOWLOCATION, 0L); /* followed in fetch(), each hop checked */
    SETOPT(c, CURLOPT_CONNECTTIMEOUT, (long)o->connect_timeout_s);
    SETOPT(c, CURLOPT_TIMEOUT, timeout_s); /* what is left of the whole download's */
    SETOPT(c, CURLOPT_MAXFILESIZE_LARGE, (curl_off_t)o->max_bytes);
    SETOPT(c, CURLOPT_FAILONERROR, 1L);
    SETOPT(c, CURLOPT_NOSIGNAL, 1L);
    SETOPT(c, CURLOPT_WRITEFUNCTION, on_data);
    SETOPT(c, CURLOPT_WRITEDATA, s);
    SETOPT(c, CURLOPT_OPENSOCKETFUNCTION, open_socket);
    SETOPT(c, CURLOPT_OPENSOCKETDATA, s);
    SETOPT(c, CURLOPT_XFERINFOFUNCTION, on_progress);
    SETOPT(c, CURLOPT_XFERINFODATA, s);
    SETOPT(c, CURLOPT_NOPROGRESS, 0L);
    SETOPT(c, CURLOPT_ERRORBUFFER, curl_err);
    SETOPT(c, CURLOPT_USERAGENT, "modeld");
    if (!o->allow_private)
        SETOPT(c, CURLOPT_PROXY, ""); /* a proxy would connect where open_socket cannot see */
    CURLcode rc = curl_easy_perform(c);
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, http);
    md_status st = MD_OK;
    if (rc == CURLE_OK) {
        char *loc = NULL;
        if (*http >= 300 && *http < 400 &&
            curl_easy_getinfo(c, CURLINFO_REDIRECT_URL, &loc) == CURLE_OK && loc)
            *location = md_xstrdup(loc);
    } else if (s->failed) {
        st = err->status;
    } else if (s->refused_address && rc == CURLE_COULDNT_CONNECT) {
        st = md_err_setc(err, MD_EINVAL, "source_not_allowed",
                         "source %.200s leads to a loopback, private or link-local address; set "
                         "allow_private_urls=1 if the server may download from internal hosts",
                         shown);
    } else if (rc == CURLE_FILESIZE_EXCEEDED) {
        st = md_err_setc(err, MD_ETOOBIG, "download_too_large",
                         "source %.200s is larger than the limit of %lld bytes", shown,
                         o->max_bytes);
    } else if (rc == CURLE_OPERATION_TIMEDOUT) {
        st = md_err_setc(err, MD_EUNPROC, "download_failed",
                         "downloading %.200s timed out; check the URL or raise "
                         "download_timeout_s",
                         shown);
    } else if (rc == CURLE_HTTP_RETURNED_ERROR) {
        st = md_err_setc(err, MD_EUNPROC, "download_failed",
                         "downloading %.200s: the server answered HTTP %ld", shown, *http);
    } else {
        /* libcurl's own words name hosts and addresses, not fetched bytes */
        st = md_err_setc(err, MD_EUNPROC, "download_failed", "downloading %.200s failed: %s",
                         shown, curl_easy_strerror(rc));
    }
    curl_easy_cleanup(c);
    s->curl = NULL;
    return st;
}

/* A whole transfer into `s`: the first URL, then each redirect checked
 * like it, at most max_redirects. */
static md_status fetch(const char *url, const md_fetch_opts *o, sink *s, md_err *err)
{
    if (strncmp(url, "file://", 7) == 0)
        return fetch_path(url, o, s, err);
    md_status st = md_source_check(url, o, err);
    if (st != MD_OK)
        return st;
    pthread_once(&curl_once, curl_init);
    s->o = o;
    s->allow_private = o->allow_private;
    char *cur = md_xstrdup(url);
    /* download_timeout_s bounds the whole download, every redirect included */
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int hop = 0;; hop++) {
        long http = 0;
        char *next = NULL;
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        long left = (long)o->timeout_s - (long)(now.tv_sec - t0.tv_sec);
        if (o->timeout_s > 0 && left < 1) {
            st = md_err_setc(err, MD_EUNPROC, "download_failed",
                             "downloading %.200s timed out after %d redirects; check the URL or "
                             "raise download_timeout_s",
                             url, hop);
            break;
        }
        st = fetch_hop(cur, url, o, o->timeout_s > 0 ? left : 0, s, &http, &next, err);
        free(cur);
        cur = next;
        if (st != MD_OK)
            break;
        if (http >= 300 && http < 400) {
            if (!next) {
                st = md_err_setc(err, MD_EUNPROC, "download_failed",
                                 "downloading %.200s: the server answered HTTP %ld without a "
                                 "Location",
                                 url, http);
                break;
            }
            if (hop >= o->max_redirects) {
                st = md_err_setc(err, MD_EUNPROC, "download_failed",
                                 "downloading %.200s: more than %d redirects "
                                 "(download_max_redirects)",
                                 url, o->max_redirects);
                break;
            }
            if ((st = url_check(next, url, 1, o, err)) != MD_OK)
                break;
            continue;
        }
        break;
    }
    free(cur);
    return st;
}

md_status md_fetch_blob(md_store *store, const char *url, const md_fetch_opts *o,
                        md_blob_writer **out, md_err *err)
{
    *out = NULL;
    if (strncmp(url, "s3://", 5) == 0)
        return fetch_s3(store, url, o, out, err);
    md_status st = md_source_check(url, o, err);
    if (st != MD_OK)
        return st;
    md_blob_writer *w = NULL;
    if ((st = md_blob_begin(store, o->max_bytes, &w, err)) != MD_OK)
        return st;
    sink s = {.w = w, .fd = -1, .err = err};
    if ((st = fetch(url, o, &s, err)) != MD_OK) {
        md_blob_abort(w);
        return st;
    }
    *out = w;
    return MD_OK;
}

md_status md_fetch_file(const char *url, const md_fetch_opts *o, const char *dest, md_err *err)
{
    /* a temp name of this call's own: two processes downloading the same
     * dest never write into one file; the last rename wins, whole */
    unsigned rnd = 0;
    if (getrandom(&rnd, sizeof rnd, 0) != sizeof rnd)
        rnd = (unsigned)(uintptr_t)&rnd ^ (unsigned)getpid();
    char tmp[PATH_MAX + 64];
    if (snprintf(tmp, sizeof tmp, "%s.download.%ld.%08x", dest, (long)getpid(), rnd) >=
        (int)sizeof tmp)
        return md_err_set(err, MD_EINVAL, "download destination %.200s is too long", dest);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0)
        return md_err_set(err, MD_EIO, "cannot create %s: %s", tmp, strerror(errno));
    sink s = {.fd = fd, .max_bytes = o->max_bytes, .err = err};
    md_status st = fetch(url, o, &s, err);
    if (st == MD_OK && fsync(fd) != 0)
        st = md_err_set(err, MD_EIO, "writing %s failed: %s", tmp, strerror(errno));
    if (close(fd) != 0 && st == MD_OK)
        st = md_err_set(err, MD_EIO, "writing %s failed: %s", tmp, strerror(errno));
    if (st == MD_OK && rename(tmp, dest) != 0)
        st = md_err_set(err, MD_EIO, "cannot rename %s: %s", tmp, strerror(errno));
    if (st != MD_OK) {
        unlink(tmp);
        return st;
    }
    /* the rename is durable only once the directory is */
    char dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%s", dest);
    char *slash = strrchr(dir, '/');
    if (slash)
        *(slash == dir ? slash + 1 : slash) = '\0';
    int dfd = open(slash ? dir : ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0)
        return md_err_set(err, MD_EIO, "cannot open the directory of %s: %s", dest,
                          strerror(errno));
    st = md_fsync_dir(dfd, dest, err);
    close(dfd);
    return st;
}
