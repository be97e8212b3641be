/* s3.c - the S3 client of s3.h: configuration, s3:// URLs, one signed request
 * path over libcurl, the operations built on it, and a bounded XML extractor.
 *
 * DESIGN
 * Signing is libcurl's (CURLOPT_AWS_SIGV4 "aws:amz:REGION:s3"), and Debian
 * 12's libcurl 7.88 signs what it is given, so the request is built to be
 * signable as is:
 *  - the canonical query is the query sent: md_s3_query_build encodes and
 *    sorts it here ("name=" for an empty value), since 7.88 copies the URL's
 *    query into the canonical request without normalising it;
 *  - the canonical URI is the path sent: keys are percent-encoded here ('/'
 *    kept) and CURLOPT_PATH_AS_IS stops libcurl from removing "." and ".."
 *    segments it would then not sign;
 *  - the payload hash is x-amz-content-sha256, always sent by us: 7.88 hashes
 *    only CURLOPT_POSTFIELDS otherwise, so a streamed PUT would be signed as
 *    if empty. A file's sha256 is computed before it is streamed;
 *  - every header we add (Range, If-Match, x-amz-security-token, and the
 *    x-amz-date of the tests' worked examples) is signed, since 7.88 signs
 *    every CURLOPT_HTTPHEADER entry; none of ours has an empty value, which
 *    7.88 would sign but not send. 7.88 sorts the signed headers as whole
 *    "name:value" lines, so no header name of ours may be another's prefix
 *    followed by '-' (x-amz-meta-a and x-amz-meta-a-b would sort wrongly).
 * A call never hangs: a connect timeout, a low-speed limit (a peer that
 * accepts and stops answering trips it) and, for small calls, a total bound.
 * A download that is cut resumes from the bytes written with a Range request
 * guarded by If-Match, or starts over when the server ignores the range or
 * the object changed; it only ever writes to the caller's temp file.
 * Every failure goes through md_s3_map_error, the one mapping of CURLcode +
 * HTTP status + S3 <Code> to md_status; the server's words go to the log.
 * The XML answers are read by a small extractor that bounds every field and
 * decodes the five entities and numeric references; it never allocates.
 */
#define _GNU_SOURCE /* memmem */
#include "s3.h"

#include <curl/curl.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define EMPTY_SHA256 "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
#define PUT_MAX ((int64_t)5 << 30) /* S3's limit on one PUT */

struct md_s3 {
    md_s3_config cfg;
    md_s3_net net;
    char bucket[MD_S3_BUCKET_MAX + 1];
    char prefix[MD_S3_KEY_MAX + 2];
    char base[MD_S3_ENDPOINT_MAX + MD_S3_BUCKET_MAX + 16]; /* URL up to the key's '/' */
    int bucket_path;   /* path-style: the key follows "/BUCKET" */
    char where[MD_S3_ENDPOINT_MAX]; /* the endpoint, for messages */
    char provider[MD_S3_REGION_MAX + 16];
};

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
static void curl_init(void) { curl_global_init(CURL_GLOBAL_DEFAULT); }

/* ---- configuration ---- */

void md_s3_net_defaults(md_s3_net *net)
{
    memset(net, 0, sizeof *net);
    net->connect_timeout_ms = 5000;
    net->low_speed_bytes = 1024;
    net->low_speed_time_s = 15;
    net->request_timeout_ms = 60000;
    net->max_resumes = 5;
}

static const char *env(const char *name)
{
    const char *v = getenv(name);
    return v && *v ? v : NULL;
}

/* The value of NAME or of the file NAME_FILE names, into out. *found says
 * whether either was set. Never puts the value in a message. */
static md_status env_value(const char *name, char *out, size_t size, int *found, md_err *err)
{
    char file_var[64];
    snprintf(file_var, sizeof file_var, "%s_FILE", name);
    const char *v = env(name), *f = env(file_var);
    out[0] = '\0';
    *found = 0;
    if (v && f)
        return md_err_set(err, MD_EINVAL, "both %s and %s are set: keep one of them", name, file_var);
    size_t n;
    if (v) {
        n = strlen(v);
        if (n >= size)
            return md_err_set(err, MD_EINVAL, "%s is longer than %zu bytes: check its value", name,
                              size - 1);
        memcpy(out, v, n + 1);
    } else if (f) {
        char shown[256];
        md_text_escape(shown, sizeof shown, f);
        int fd = open(f, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            return md_err_set(err, MD_EINVAL, "%s=%s cannot be opened (%s): point it at a readable file",
                              file_var, shown, strerror(errno));
        n = 0;
        for (;;) {
            if (n == size) {
                close(fd);
                return md_err_set(err, MD_EINVAL, "%s=%s holds more than %zu bytes: is it the right file?",
                                  file_var, shown, size - 2);
            }
            ssize_t r = read(fd, out + n, size - n);
            if (r < 0 && errno == EINTR)
                continue;
            if (r < 0) {
                int e = errno;
                close(fd);
                return md_err_set(err, MD_EINVAL, "%s=%s cannot be read (%s)", file_var, shown, strerror(e));
            }
            if (r == 0)
                break;
            n += (size_t)r;
        }
        close(fd);
        if (n > 0 && out[n - 1] == '\n')
            n--;
        if (n > 0 && out[n - 1] == '\r')
            n--;
        if (n >= size)
            return md_err_set(err, MD_EINVAL, "%s=%s holds more than %zu bytes: is it the right file?",
                              file_var, shown, size - 1);
        out[n] = '\0';
        if (n == 0)
            return md_err_set(err, MD_EINVAL, "%s=%s is empty: write the value into it", file_var, shown);
    } else {
        return MD_OK;
    }
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)out[i] < 0x20 || out[i] == 0x7f) {
            memset(out, 0, size);
            return md_err_set(err, MD_EINVAL, "%s%s holds a control character (a line break?): "
                              "it must be one line", v ? name : file_var, v ? "" : "'s file");
        }
    *found = 1;
    return MD_OK;
}

static int region_ok(const char *r)
{
    if (!*r)
        return 0;
    for (; *r; r++)
        if (!((*r >= 'a' && *r <= 'z') || (*r >= '0' && *r <= '9') || *r == '-'))
            return 0;
    return 1;
}

/* scheme://host[:port] with an optional trailing '/', nothing else. */
static int endpoint_ok(char *e)
{
    size_t n = strlen(e);
    if (n && e[n - 1] == '/')
        e[--n] = '\0';
    const char *host = !strncmp(e, "http://", 7) ? e + 7 : !strncmp(e, "https://", 8) ? e + 8 : NULL;
    if (!host || !*host)
        return 0;
    for (const char *c = host; *c; c++)
        if ((unsigned char)*c <= 0x20 || *c == 0x7f || strchr("/?#@\\", *c))
            return 0;
    return 1;
}

md_status md_s3_config_from_env(md_s3_config *cfg, md_err *err)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->path_style = -1;
    int have_id, have_secret, have_token;
    md_status st;
    if ((st = env_value("AWS_ACCESS_KEY_ID", cfg->access_key_id, sizeof cfg->access_key_id, &have_id,
                        err)) != MD_OK ||
        (st = env_value("AWS_SECRET_ACCESS_KEY", cfg->secret_access_key, sizeof cfg->secret_access_key,
                        &have_secret, err)) != MD_OK ||
        (st = env_value("AWS_SESSION_TOKEN", cfg->session_token, sizeof cfg->session_token, &have_token,
                        err)) != MD_OK) {
        memset(cfg, 0, sizeof *cfg);
        return st;
    }
    if (have_id != have_secret) {
        memset(cfg, 0, sizeof *cfg);
        return md_err_set(err, MD_EINVAL, "%s is set but %s is not: S3 needs both (or their _FILE forms)",
                          have_id ? "AWS_ACCESS_KEY_ID" : "AWS_SECRET_ACCESS_KEY",
                          have_id ? "AWS_SECRET_ACCESS_KEY" : "AWS_ACCESS_KEY_ID");
    }
    if (!have_id) {
        memset(cfg, 0, sizeof *cfg);
        return md_err_set(err, MD_EINVAL, "no S3 credentials: set AWS_ACCESS_KEY_ID and "
                          "AWS_SECRET_ACCESS_KEY (or AWS_ACCESS_KEY_ID_FILE and AWS_SECRET_ACCESS_KEY_FILE)");
    }
    if (strchr(cfg->access_key_id, ':')) {
        memset(cfg, 0, sizeof *cfg);
        return md_err_set(err, MD_EINVAL, "AWS_ACCESS_KEY_ID holds a ':', which no access key id has: "
                          "check its value");
    }
    const char *region_var = env("AWS_REGION") ? "AWS_REGION" : "AWS_DEFAULT_REGION";
    const char *region = env(region_var);
    if (region) {
        char shown[80];
        md_text_escape(shown, sizeof shown, region);
        if (strlen(region) >= sizeof cfg->region || !region_ok(region)) {
            memset(cfg, 0, sizeof *cfg);
            return md_err_set(err, MD_EINVAL, "%s=%s is not a region: use a name such as us-east-1 "
                              "(lower-case letters, digits and '-')", region_var, shown);
        }
        snprintf(cfg->region, sizeof cfg->region, "%s", region);
    } else {
        snprintf(cfg->region, sizeof cfg->region, "us-east-1");
    }
    const char *ep_var = env("AWS_ENDPOINT_URL_S3") ? "AWS_ENDPOINT_URL_S3" : "AWS_ENDPOINT_URL";
    const char *ep = env(ep_var);
    if (ep) {
        char shown[128];
        md_text_escape(shown, sizeof shown, ep);
        if (strlen(ep) >= sizeof cfg->endpoint) {
            memset(cfg, 0, sizeof *cfg);
            return md_err_set(err, MD_EINVAL, "%s is longer than %zu bytes", ep_var, sizeof cfg->endpoint - 1);
        }
        snprintf(cfg->endpoint, sizeof cfg->endpoint, "%s", ep);
        if (!endpoint_ok(cfg->endpoint)) {
            memset(cfg, 0, sizeof *cfg);
            return md_err_set(err, MD_EINVAL, "%s=%s is not an endpoint: use http(s)://HOST[:PORT], "
                              "e.g. http://127.0.0.1:9000 for MinIO", ep_var, shown);
        }
    }
    const char *ca = env("AWS_CA_BUNDLE");
    if (ca) {
        char shown[128];
        md_text_escape(shown, sizeof shown, ca);
        if (strlen(ca) >= sizeof cfg->ca_bundle || access(ca, R_OK) != 0) {
            memset(cfg, 0, sizeof *cfg);
            return md_err_set(err, MD_EINVAL, "AWS_CA_BUNDLE=%s is not a readable file: point it at "
                              "the PEM file of the CA that signed the endpoint's certificate", shown);
        }
        snprintf(cfg->ca_bundle, sizeof cfg->ca_bundle, "%s", ca);
    }
    return MD_OK;
}

/* ---- s3:// URLs ---- */

static int utf8_ok_no_controls(const unsigned char *s)
{
    while (*s) {
        size_t n = s[0] < 0x80 ? 1 : s[0] >= 0xc2 && s[0] <= 0xdf ? 2 : s[0] >= 0xe0 && s[0] <= 0xef ? 3
                 : s[0] >= 0xf0 && s[0] <= 0xf4 ? 4 : 0;
        if (n == 0 || (n == 1 && (s[0] < 0x20 || s[0] == 0x7f)))
            return 0;
        for (size_t i = 1; i < n; i++)
            if ((s[i] & 0xc0) != 0x80)
                return 0;
        if ((s[0] == 0xe0 && s[1] < 0xa0) || (s[0] == 0xed && s[1] >= 0xa0) ||
            (s[0] == 0xf0 && s[1] < 0x90) || (s[0] == 0xf4 && s[1] >= 0x90))
            return 0;
        s += n;
    }
    return 1;
}

/* NULL when `b` is a valid bucket name, else what is wrong with it. */
static const char *bucket_problem(const char *b, size_t n)
{
    if (n < 3 || n > MD_S3_BUCKET_MAX)
        return "it must be 3 to 63 characters long";
    for (size_t i = 0; i < n; i++) {
        char c = b[i];
        if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '-'))
            return "it may hold only lower-case letters, digits, '.' and '-'";
        if (c == '.' && i + 1 < n && b[i + 1] == '.')
            return "it may not hold two '.' in a row";
    }
    int alnum0 = (b[0] >= 'a' && b[0] <= 'z') || (b[0] >= '0' && b[0] <= '9');
    int alnum1 = (b[n - 1] >= 'a' && b[n - 1] <= 'z') || (b[n - 1] >= '0' && b[n - 1] <= '9');
    if (!alnum0 || !alnum1)
        return "it must start and end with a letter or a digit";
    int dots = 0, digits_only = 1;
    for (size_t i = 0; i < n; i++) {
        dots += b[i] == '.';
        if (b[i] != '.' && !(b[i] >= '0' && b[i] <= '9'))
            digits_only = 0;
    }
    if (dots == 3 && digits_only)
        return "it may not look like an IP address";
    static const char *const bad_prefix[] = {"xn--", "sthree-", "amzn-s3-demo-"};
    for (size_t i = 0; i < sizeof bad_prefix / sizeof *bad_prefix; i++)
        if (!strncmp(b, bad_prefix[i], strlen(bad_prefix[i])))
            return "it may not start with xn--, sthree- or amzn-s3-demo- (reserved by S3)";
    static const char *const bad_suffix[] = {"-s3alias", "--ol-s3", ".mrap", "--x-s3"};
    for (size_t i = 0; i < sizeof bad_suffix / sizeof *bad_suffix; i++) {
        size_t k = strlen(bad_suffix[i]);
        if (n >= k && !memcmp(b + n - k, bad_suffix[i], k))
            return "it may not end with -s3alias, --ol-s3, .mrap or --x-s3 (reserved by S3)";
    }
    return NULL;
}

md_status md_s3_url_parse(const char *url, char *bucket, char *prefix, md_err *err)
{
    char shown[160];
    md_text_escape(shown, sizeof shown, url ? url : "");
    bucket[0] = prefix[0] = '\0';
    if (!url || strncmp(url, "s3://", 5) != 0)
        return md_err_set(err, MD_EINVAL, "\"%s\" is not an s3:// URL: write s3://BUCKET/PREFIX", shown);
    const char *b = url + 5, *slash = strchr(b, '/');
    size_t n = slash ? (size_t)(slash - b) : strlen(b);
    if (n == 0)
        return md_err_set(err, MD_EINVAL, "\"%s\" names no bucket: write s3://BUCKET/PREFIX", shown);
    const char *why = bucket_problem(b, n);
    if (why)
        return md_err_set(err, MD_EINVAL, "\"%s\": the bucket name is not valid for S3: %s", shown, why);
    const char *p = slash ? slash + 1 : "";
    if (strlen(p) > MD_S3_KEY_MAX)
        return md_err_set(err, MD_EINVAL, "\"%s\": the prefix is longer than S3's %d bytes", shown,
                          MD_S3_KEY_MAX);
    if (!utf8_ok_no_controls((const unsigned char *)p))
        return md_err_set(err, MD_EINVAL, "\"%s\": the prefix must be UTF-8 without control characters",
                          shown);
    memcpy(bucket, b, n);
    bucket[n] = '\0';
    snprintf(prefix, MD_S3_KEY_MAX + 1, "%s", p);
    return MD_OK;
}

md_status md_s3_open(const md_s3_config *cfg, const char *url, const md_s3_net *net, md_s3 **out,
                     md_err *err)
{
    *out = NULL;
    pthread_once(&curl_once, curl_init);
    char bucket[MD_S3_BUCKET_MAX + 1], prefix[MD_S3_KEY_MAX + 1];
    md_status st = md_s3_url_parse(url, bucket, prefix, err);
    if (st != MD_OK)
        return st;
    if (!cfg->access_key_id[0] || !cfg->secret_access_key[0])
        return md_err_set(err, MD_EINVAL, "no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY");
    if (!region_ok(cfg->region))
        return md_err_set(err, MD_EINVAL, "the S3 region is not valid: set AWS_REGION (e.g. us-east-1)");
    md_s3 *s = md_xcalloc(1, sizeof *s);
    s->cfg = *cfg;
    if (net)
        s->net = *net;
    else
        md_s3_net_defaults(&s->net);
    snprintf(s->bucket, sizeof s->bucket, "%s", bucket);
    size_t pn = strlen(prefix);
    snprintf(s->prefix, sizeof s->prefix, "%s%s", prefix, pn && prefix[pn - 1] != '/' ? "/" : "");
    snprintf(s->provider, sizeof s->provider, "aws:amz:%s:s3", cfg->region);
    char ep[MD_S3_ENDPOINT_MAX];
    int custom = cfg->endpoint[0] != '\0';
    if (custom) {
        snprintf(ep, sizeof ep, "%s", cfg->endpoint);
        if (!endpoint_ok(ep)) {
            md_s3_close(s);
            return md_err_set(err, MD_EINVAL, "the S3 endpoint is not http(s)://HOST[:PORT]: check "
                              "AWS_ENDPOINT_URL_S3");
        }
    } else {
        snprintf(ep, sizeof ep, "https://s3.%s.amazonaws.com", cfg->region);
    }
    snprintf(s->where, sizeof s->where, "%s", ep);
    /* auto: path-style for a custom endpoint; on AWS virtual-hosted, except a
     * bucket with a '.', which the *.s3.REGION.amazonaws.com certificate
     * cannot cover over https (the SDKs fall back the same way) */
    s->bucket_path = cfg->path_style >= 0 ? cfg->path_style : custom || strchr(s->bucket, '.') != NULL;
    if (s->bucket_path) {
        snprintf(s->base, sizeof s->base, "%s/%s", ep, s->bucket);
    } else {
        const char *host = strstr(ep, "://") + 3;
        snprintf(s->base, sizeof s->base, "%.*s%s.%s", (int)(host - ep), ep, s->bucket, host);
    }
    *out = s;
    return MD_OK;
}

void md_s3_close(md_s3 *s3)
{
    if (!s3)
        return;
    /* volatile: the scrub of the secrets is not optimised away */
    volatile unsigned char *p = (volatile unsigned char *)&s3->cfg;
    for (size_t i = 0; i < sizeof s3->cfg; i++)
        p[i] = 0;
    free(s3);
}

const char *md_s3_bucket(const md_s3 *s3) { return s3->bucket; }
const char *md_s3_prefix(const md_s3 *s3) { return s3->prefix; }

/* ---- encoding ---- */

long md_s3_uri_encode(char *out, size_t size, const char *in, size_t len, int keep_slash)
{
    static const char hex[] = "0123456789ABCDEF";
    size_t o = 0;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)in[i];
        int keep = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
                   c == '-' || c == '.' || c == '_' || c == '~' || (keep_slash && c == '/');
        if (o + (keep ? 1 : 3) >= size)
            return -1;
        if (keep) {
            out[o++] = (char)c;
        } else {
            out[o++] = '%';
            out[o++] = hex[c >> 4];
            out[o++] = hex[c & 15];
        }
    }
    if (o >= size)
        return -1;
    out[o] = '\0';
    return (long)o;
}

/* One byte's SigV4 encoding ('/' encoded) into out; its length. */
static size_t enc1(unsigned char c, char out[3])
{
    static const char hex[] = "0123456789ABCDEF";
    if ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' ||
        c == '.' || c == '_' || c == '~') {
        out[0] = (char)c;
        return 1;
    }
    out[0] = '%';
    out[1] = hex[c >> 4];
    out[2] = hex[c & 15];
    return 3;
}

/* strcmp of the encodings of a and b, without writing them out: the order
 * SigV4 sorts parameters in (it differs from the raw bytes' order: '|' is
 * "%7C", before 'A'). */
static int enc_cmp(const char *a, const char *b)
{
    char ba[3], bb[3];
    size_t na = 0, nb = 0, ia = 0, ib = 0;
    for (;;) {
        if (ia == na) {
            na = *a ? enc1((unsigned char)*a++, ba) : 0;
            ia = 0;
        }
        if (ib == nb) {
            nb = *b ? enc1((unsigned char)*b++, bb) : 0;
            ib = 0;
        }
        if (na == 0 || nb == 0)
            return (na != 0) - (nb != 0);
        unsigned char x = (unsigned char)ba[ia++], y = (unsigned char)bb[ib++];
        if (x != y)
            return x < y ? -1 : 1;
    }
}

long md_s3_query_build(char *out, size_t size, const md_s3_param *params, size_t n)
{
    if (size == 0 || n > MD_S3_QUERY_PARAMS_MAX)
        return -1;
    size_t order[MD_S3_QUERY_PARAMS_MAX];
    for (size_t i = 0; i < n; i++)
        order[i] = i;
    for (size_t i = 1; i < n; i++) /* insertion sort: a handful of parameters */
        for (size_t j = i; j > 0; j--) {
            const md_s3_param *a = &params[order[j - 1]], *b = &params[order[j]];
            int c = enc_cmp(a->name, b->name);
            if (c == 0)
                c = enc_cmp(a->value ? a->value : "", b->value ? b->value : "");
            if (c <= 0)
                break;
            size_t t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    size_t o = 0;
    out[0] = '\0';
    for (size_t i = 0; i < n; i++) {
        const md_s3_param *p = &params[order[i]];
        const char *v = p->value ? p->value : "";
        long w;
        if (i) {
            if (o + 1 >= size)
                return -1;
            out[o++] = '&';
        }
        if ((w = md_s3_uri_encode(out + o, size - o, p->name, strlen(p->name), 0)) < 0)
            return -1;
        o += (size_t)w;
        if (o + 1 >= size)
            return -1;
        out[o++] = '=';
        if ((w = md_s3_uri_encode(out + o, size - o, v, strlen(v), 0)) < 0)
            return -1;
        o += (size_t)w;
    }
    out[o] = '\0';
    return (long)o;
}

/* ---- the XML extractor ---- */

static size_t utf8_put(char *out, uint32_t cp)
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xc0 | cp >> 6);
        out[1] = (char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xe0 | cp >> 12);
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        out[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    out[0] = (char)(0xf0 | cp >> 18);
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
    out[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

/* Decode the text in[0..n) into out (size bytes, NUL-terminated). Returns
 * the length, or -1: a '<' (no nested markup where text is expected), an
 * unknown or malformed entity, a reference to NUL, a surrogate or past
 * U+10FFFF, or text that does not fit. */
static long xml_decode(const char *in, size_t n, char *out, size_t size)
{
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        char c = in[i];
        if (c == '<' || c == '\0')
            return -1;
        if (c != '&') {
            if (o + 1 >= size)
                return -1;
            out[o++] = c;
            i++;
            continue;
        }
        const char *semi = memchr(in + i, ';', n - i < 12 ? n - i : 12);
        if (!semi)
            return -1;
        const char *name = in + i + 1;
        size_t len = (size_t)(semi - name);
        char buf[4];
        size_t w;
        if (len == 3 && !memcmp(name, "amp", 3))
            buf[0] = '&', w = 1;
        else if (len == 2 && !memcmp(name, "lt", 2))
            buf[0] = '<', w = 1;
        else if (len == 2 && !memcmp(name, "gt", 2))
            buf[0] = '>', w = 1;
        else if (len == 4 && !memcmp(name, "quot", 4))
            buf[0] = '"', w = 1;
        else if (len == 4 && !memcmp(name, "apos", 4))
            buf[0] = '\'', w = 1;
        else if (len >= 2 && name[0] == '#') {
            int hexa = name[1] == 'x';
            size_t d = hexa ? 2 : 1;
            if (d >= len)
                return -1;
            uint32_t cp = 0;
            for (; d < len; d++) {
                char ch = name[d];
                int v = ch >= '0' && ch <= '9' ? ch - '0'
                      : hexa && ch >= 'a' && ch <= 'f' ? ch - 'a' + 10
                      : hexa && ch >= 'A' && ch <= 'F' ? ch - 'A' + 10 : -1;
                if (v < 0)
                    return -1;
                cp = cp * (hexa ? 16u : 10u) + (uint32_t)v;
                if (cp > 0x10ffff)
                    return -1;
            }
            if (cp == 0 || (cp >= 0xd800 && cp <= 0xdfff))
                return -1;
            w = utf8_put(buf, cp);
        } else {
            return -1;
        }
        if (o + w >= size)
            return -1;
        memcpy(out + o, buf, w);
        o += w;
        i = (size_t)(semi - in) + 1;
    }
    out[o] = '\0';
    return (long)o;
}

/* The content of the first <tag>...</tag> (or <tag/>) in xml[from..len):
 * 1 with [*start, *end), 0 absent, -1 opened and never closed. */
static int xml_find(const char *xml, size_t len, size_t from, const char *tag, size_t *start,
                    size_t *end)
{
    size_t tn = strlen(tag);
    char open[72], close[72];
    if (tn + 4 > sizeof open)
        return -1;
    open[0] = '<';
    memcpy(open + 1, tag, tn);
    snprintf(close, sizeof close, "</%s>", tag);
    size_t pos = from;
    while (pos < len) {
        const char *o = memmem(xml + pos, len - pos, open, tn + 1);
        if (!o)
            return 0;
        size_t after = (size_t)(o - xml) + tn + 1;
        if (after < len && xml[after] == '>') {
            const char *c = memmem(xml + after + 1, len - after - 1, close, tn + 3);
            if (!c)
                return -1;
            *start = after + 1;
            *end = (size_t)(c - xml);
            return 1;
        }
        if (after + 1 < len && xml[after] == '/' && xml[after + 1] == '>') {
            *start = *end = after + 2;
            return 1;
        }
        pos = after; /* "<KeyCount" is not "<Key" */
    }
    return 0;
}

int md_s3_xml_text(const char *xml, size_t len, const char *tag, char *out, size_t size)
{
    size_t s, e;
    if (size == 0)
        return -1;
    out[0] = '\0';
    int f = xml_find(xml, len, 0, tag, &s, &e);
    if (f <= 0)
        return f;
    return xml_decode(xml + s, e - s, out, size) < 0 ? (out[0] = '\0', -1) : 1;
}

static md_status malformed(md_err *err, const char *what)
{
    return md_err_set(err, MD_EIO, "a malformed ListObjectsV2 answer from S3 (%s)", what);
}

md_status md_s3_parse_list(const char *xml, size_t len, md_s3_list_fn fn, void *ctx, int *truncated,
                           int *stopped, char *token, size_t token_size, md_err *err)
{
    *truncated = 0;
    *stopped = 0;
    if (token_size)
        token[0] = '\0';
    if (!memmem(xml, len, "<ListBucketResult", 17))
        return malformed(err, "no ListBucketResult");
    char flag[8];
    int f = md_s3_xml_text(xml, len, "IsTruncated", flag, sizeof flag);
    if (f < 0 || (f == 1 && strcmp(flag, "true") && strcmp(flag, "false")))
        return malformed(err, "IsTruncated");
    *truncated = f == 1 && !strcmp(flag, "true");
    if (token_size && md_s3_xml_text(xml, len, "NextContinuationToken", token, token_size) < 0)
        return malformed(err, "NextContinuationToken too long or malformed");
    if (*truncated && !token[0])
        return malformed(err, "truncated without a NextContinuationToken");
    size_t pos = 0, s, e;
    md_s3_object obj;
    for (;;) {
        f = xml_find(xml, len, pos, "Contents", &s, &e);
        if (f < 0)
            return malformed(err, "unclosed Contents");
        if (f == 0)
            break;
        pos = e + 11; /* past "</Contents>" */
        const char *block = xml + s;
        size_t n = e - s;
        memset(&obj, 0, sizeof obj);
        if (md_s3_xml_text(block, n, "Key", obj.key, sizeof obj.key) != 1 || !obj.key[0])
            return malformed(err, "a Contents without a valid Key");
        char num[24];
        if (md_s3_xml_text(block, n, "Size", num, sizeof num) != 1 || !num[0] || strlen(num) > 18)
            return malformed(err, "a Contents without a valid Size");
        int64_t size = 0;
        for (const char *c = num; *c; c++) {
            if (*c < '0' || *c > '9')
                return malformed(err, "a Size that is not a number");
            size = size * 10 + (*c - '0'); /* at most 18 digits: no overflow */
        }
        obj.size = size;
        if (md_s3_xml_text(block, n, "LastModified", obj.last_modified, sizeof obj.last_modified) < 0 ||
            md_s3_xml_text(block, n, "ETag", obj.etag, sizeof obj.etag) < 0)
            return malformed(err, "LastModified or ETag");
        if (fn && fn(ctx, &obj)) {
            *stopped = 1;
            return MD_OK;
        }
    }
    return MD_OK;
}

void md_s3_parse_error(const char *xml, size_t len, char *code, size_t code_size, char *message,
                       size_t message_size)
{
    if (code_size && md_s3_xml_text(xml, len, "Code", code, code_size) != 1)
        code[0] = '\0';
    if (message_size && md_s3_xml_text(xml, len, "Message", message, message_size) != 1)
        message[0] = '\0';
}

/* ---- the one mapping of failures ---- */

static int is_code(const char *c, const char *const *set)
{
    for (; *set; set++)
        if (!strcmp(c, *set))
            return 1;
    return 0;
}

md_status md_s3_map_error(const md_s3 *s3, int cc, long http_status, const char *s3_code,
                          const char *native, const char *op, const char *key, md_err *err)
{
    const char *bucket = s3 ? s3->bucket : "?", *where = s3 ? s3->where : "S3";
    char k[200], code[64] = "", nat[300];
    md_text_escape(k, sizeof k, key ? key : "");
    /* only a plain token of the server's is quoted back (AccessDenied, ...) */
    if (s3_code && strlen(s3_code) < sizeof code && strspn(s3_code, "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                                           "abcdefghijklmnopqrstuvwxyz0123456789.") ==
                                                        strlen(s3_code))
        snprintf(code, sizeof code, "%s", s3_code);
    md_text_escape(nat, sizeof nat, native ? native : "");
    /* a HEAD answered 404 is an answer (is the name free?), not a failure */
    md_log(cc == 0 && http_status == 404 && op && !strcmp(op, "HEAD") ? MD_LOG_DEBUG : MD_LOG_WARN,
           "s3: %s s3://%s/%s at %s: curl %d, HTTP %ld %s: %s", op, bucket, k, where, cc,
           http_status, code, nat);

    static const char *const unavailable[] = {"SlowDown", "ServiceUnavailable", "InternalError",
                                              "RequestTimeout", "OperationAborted", NULL};
    static const char *const forbidden[] = {"AccessDenied", "SignatureDoesNotMatch", "InvalidAccessKeyId",
                                            "ExpiredToken", "InvalidToken", "TokenRefreshRequired",
                                            "AllAccessDisabled", "RequestTimeTooSkewed",
                                            "AuthorizationHeaderMalformed", "AccountProblem", NULL};
    static const char creds[] = "check AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (or their _FILE forms), "
                                "AWS_SESSION_TOKEN and AWS_REGION, and that they may use this bucket";
    if (cc != CURLE_OK) {
        if (cc == CURLE_OPERATION_TIMEDOUT)
            return md_err_set(err, MD_EUNAVAIL,
                              "S3 at %s did not answer %s s3://%s/%s in time (connect %ld ms, or under "
                              "%ld bytes/s for %ld s): retry later", where, op, bucket, k,
                              s3 ? s3->net.connect_timeout_ms : 0L, s3 ? s3->net.low_speed_bytes : 0L,
                              s3 ? s3->net.low_speed_time_s : 0L);
        if (cc == CURLE_PEER_FAILED_VERIFICATION || cc == CURLE_SSL_CACERT_BADFILE)
            return md_err_set(err, MD_EUNAVAIL, "S3 at %s: its TLS certificate was not accepted (%s): "
                              "check AWS_ENDPOINT_URL_S3", where, curl_easy_strerror((CURLcode)cc));
        return md_err_set(err, MD_EUNAVAIL, "S3 at %s cannot be reached for %s s3://%s/%s (%s): check "
                          "AWS_ENDPOINT_URL_S3 and the network, or retry later", where, op, bucket, k,
                          curl_easy_strerror((CURLcode)cc));
    }
    if (code[0] && is_code(code, unavailable))
        return md_err_set(err, MD_EUNAVAIL, "S3 at %s is busy or failing (HTTP %ld %s) for %s s3://%s/%s: "
                          "retry later", where, http_status, code, op, bucket, k);
    if (code[0] && is_code(code, forbidden))
        return md_err_set(err, MD_EFORBIDDEN, "S3 refused %s s3://%s/%s (HTTP %ld %s): %s", op, bucket, k,
                          http_status, code, creds);
    if (!strcmp(code, "NoSuchBucket"))
        return md_err_set(err, MD_ENOTFOUND, "S3 at %s has no bucket %s: create it or fix the s3:// URL",
                          where, bucket);
    if (!strcmp(code, "NoSuchKey") || http_status == 404)
        return md_err_set(err, MD_ENOTFOUND, "no object s3://%s/%s", bucket, k);
    if (http_status == 401 || http_status == 403)
        return md_err_set(err, MD_EFORBIDDEN, "S3 refused %s s3://%s/%s (HTTP %ld%s%s): %s", op, bucket,
                          k, http_status, code[0] ? " " : "", code, creds);
    if (http_status >= 500 || http_status == 429)
        return md_err_set(err, MD_EUNAVAIL, "S3 at %s is busy or failing (HTTP %ld%s%s) for %s s3://%s/%s: "
                          "retry later", where, http_status, code[0] ? " " : "", code, op, bucket, k);
    if (http_status == 412)
        return md_err_set(err, MD_ECONFLICT, "s3://%s/%s changed while it was read", bucket, k);
    return md_err_set(err, MD_EIO, "S3 answered %s s3://%s/%s with HTTP %ld%s%s", op, bucket, k,
                      http_status, code[0] ? " " : "", code);
}

/* ---- one request ---- */

typedef struct s3_call {
    CURL *curl;
    /* the answer's body: to fd (2xx of a download) or into mem */
    int sink_fd;
    int64_t sink_off;     /* where the next byte goes */
    int64_t sink_base;    /* the offset asked for (Range) */
    int64_t written;      /* bytes written to sink_fd by this try */
    int sink_errno;
    int range_restart;    /* a 200 to a ranged request: rewritten from 0 */
    int range_mismatch;   /* a 206 that does not start where asked */
    int body_started;
    char *mem;
    size_t mem_len, mem_cap, mem_max;
    int mem_keep_all;     /* a 2xx listing: past mem_max is an error */
    int mem_overflow;
    int mem_nomem;        /* the answer's buffer could not grow */
    /* the upload: the whole file read with read(), or (src_ranged) the
     * bytes [src_base, src_end) read with pread from src_pos */
    int src_fd;
    int src_errno;
    int src_ranged;
    int64_t src_base, src_pos, src_end;
    /* headers of the last answer */
    char etag[128];
    char content_range[128];
    int64_t content_length;
    char errbuf[CURL_ERROR_SIZE];
} s3_call;

static long response_code(s3_call *c)
{
    long code = 0;
    curl_easy_getinfo(c->curl, CURLINFO_RESPONSE_CODE, &code);
    return code;
}

static size_t on_header(char *data, size_t size, size_t n, void *ud)
{
    s3_call *c = ud;
    size_t len = size * n;
    if (len >= 5 && !memcmp(data, "HTTP/", 5)) { /* a new answer (after 100 Continue) */
        c->etag[0] = c->content_range[0] = '\0';
        c->content_length = -1;
        return len;
    }
    const char *colon = memchr(data, ':', len);
    if (!colon)
        return len;
    size_t name_len = (size_t)(colon - data);
    const char *v = colon + 1, *end = data + len;
    while (v < end && (*v == ' ' || *v == '\t'))
        v++;
    while (end > v && (end[-1] == '\r' || end[-1] == '\n' || end[-1] == ' '))
        end--;
    size_t vlen = (size_t)(end - v);
    char *dst = NULL;
    size_t cap = 0;
    if (name_len == 4 && !strncasecmp(data, "etag", 4))
        dst = c->etag, cap = sizeof c->etag;
    else if (name_len == 13 && !strncasecmp(data, "content-range", 13))
        dst = c->content_range, cap = sizeof c->content_range;
    else if (name_len == 14 && !strncasecmp(data, "content-length", 14)) {
        int64_t v64 = 0;
        size_t i = 0;
        for (; i < vlen && i < 18 && v[i] >= '0' && v[i] <= '9'; i++)
            v64 = v64 * 10 + (v[i] - '0');
        c->content_length = i == vlen && i > 0 ? v64 : -1;
    }
    for (size_t i = 0; dst && i < vlen; i++)
        if ((unsigned char)v[i] < 0x20 || v[i] == 0x7f)
            dst = NULL; /* never echoed into a request header (If-Match) */
    if (dst && vlen < cap) {
        memcpy(dst, v, vlen);
        dst[vlen] = '\0';
    }
    return len;
}

static int mem_append(s3_call *c, const char *data, size_t len)
{
    if (c->mem_len + len > c->mem_max) {
        if (c->mem_keep_all) {
            c->mem_overflow = 1;
            return -1;
        }
        len = c->mem_max - c->mem_len; /* an error answer: its start is enough */
    }
    if (c->mem_len + len + 1 > c->mem_cap) {
        size_t cap = c->mem_cap ? c->mem_cap : 16384;
        while (cap < c->mem_len + len + 1)
            cap *= 2;
        if (cap > c->mem_max + 1)
            cap = c->mem_max + 1;
        char *m = realloc(c->mem, cap);
        if (!m) {
            c->mem_nomem = 1;
            return -1;
        }
        c->mem = m;
        c->mem_cap = cap;
    }
    memcpy(c->mem + c->mem_len, data, len);
    c->mem_len += len;
    c->mem[c->mem_len] = '\0';
    return 0;
}

/* A 206 answer must start where it was asked to: "bytes START-END/TOTAL". */
static int range_starts_at(const char *cr, int64_t at)
{
    if (strncmp(cr, "bytes ", 6) != 0)
        return 0;
    int64_t v = 0;
    const char *p = cr + 6;
    int digits = 0;
    for (; *p >= '0' && *p <= '9' && digits < 19; p++, digits++)
        v = v * 10 + (*p - '0');
    return digits > 0 && *p == '-' && v == at;
}

static size_t on_write(char *data, size_t size, size_t n, void *ud)
{
    s3_call *c = ud;
    size_t len = size * n;
    long code = response_code(c);
    if (c->sink_fd >= 0 && code >= 200 && code < 300) {
        if (!c->body_started) {
            c->body_started = 1;
            if (code == 200 && c->sink_base > 0) { /* the range was ignored: all bytes again */
                if (ftruncate(c->sink_fd, 0) != 0) {
                    c->sink_errno = errno;
                    return 0;
                }
                c->sink_off = 0;
                c->range_restart = 1;
            } else if (code == 206 && !range_starts_at(c->content_range, c->sink_base)) {
                c->range_mismatch = 1;
                return 0;
            }
        }
        size_t done = 0;
        while (done < len) {
            ssize_t w = pwrite(c->sink_fd, data + done, len - done, (off_t)c->sink_off);
            if (w < 0 && errno == EINTR)
                continue;
            if (w <= 0) {
                c->sink_errno = w < 0 ? errno : EIO;
                return 0;
            }
            done += (size_t)w;
            c->sink_off += w;
            c->written += w;
        }
        return len;
    }
    return mem_append(c, data, len) == 0 ? len : 0;
}

static size_t on_read(char *buf, size_t size, size_t n, void *ud)
{
    s3_call *c = ud;
    for (;;) {
        size_t want = size * n;
        if (c->src_ranged && (int64_t)want > c->src_end - c->src_pos)
            want = (size_t)(c->src_end - c->src_pos);
        ssize_t r = c->src_ranged ? pread(c->src_fd, buf, want, (off_t)c->src_pos)
                                  : read(c->src_fd, buf, want);
        if (r > 0 && c->src_ranged)
            c->src_pos += r;
        if (r >= 0)
            return (size_t)r;
        if (errno != EINTR) {
            c->src_errno = errno;
            return CURL_READFUNC_ABORT;
        }
    }
}

static int on_seek(void *ud, curl_off_t offset, int origin)
{
    s3_call *c = ud;
    if (c->src_ranged) {
        if (origin != SEEK_SET || offset < 0 || offset > c->src_end - c->src_base)
            return CURL_SEEKFUNC_FAIL;
        c->src_pos = c->src_base + (int64_t)offset;
        return CURL_SEEKFUNC_OK;
    }
    return lseek(c->src_fd, (off_t)offset, origin) < 0 ? CURL_SEEKFUNC_FAIL : CURL_SEEKFUNC_OK;
}

/* The full key (prefix + key), checked against S3's limit. */
static md_status full_key(const md_s3 *s3, const char *key, char out[MD_S3_KEY_MAX + 1], md_err *err)
{
    size_t pn = strlen(s3->prefix), kn = strlen(key);
    if (pn + kn > MD_S3_KEY_MAX) {
        char k[120];
        md_text_escape(k, sizeof k, key);
        return md_err_set(err, MD_EINVAL, "the S3 key %s%s is longer than S3's %d bytes", s3->prefix, k,
                          MD_S3_KEY_MAX);
    }
    memcpy(out, s3->prefix, pn);
    memcpy(out + pn, key, kn + 1);
    return MD_OK;
}

/* sha256 of the file at fd as hex; the offset is left at 0. */
static md_status file_sha256(int fd, char hex[65], md_err *err, const char *shown)
{
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    if (!ctx || EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) != 1) {
        EVP_MD_CTX_free(ctx);
        return md_err_set(err, MD_EINTERNAL, "sha256 is not available from OpenSSL");
    }
    static __thread unsigned char buf[65536];
    md_status st = MD_OK;
    for (;;) {
        ssize_t r = read(fd, buf, sizeof buf);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            st = md_err_set(err, MD_EIO, "cannot read %s to upload it: %s", shown, strerror(errno));
            break;
        }
        if (r == 0)
            break;
        EVP_DigestUpdate(ctx, buf, (size_t)r);
    }
    unsigned char md[32];
    unsigned int mdn = 0;
    if (st == MD_OK)
        EVP_DigestFinal_ex(ctx, md, &mdn);
    EVP_MD_CTX_free(ctx);
    if (st != MD_OK)
        return st;
    for (int i = 0; i < 32; i++)
        snprintf(hex + 2 * i, 3, "%02x", md[i]);
    if (lseek(fd, 0, SEEK_SET) != 0)
        return md_err_set(err, MD_EIO, "cannot rewind %s to upload it: %s", shown, strerror(errno));
    return MD_OK;
}

typedef struct call_spec {
    const char *method;     /* GET PUT HEAD DELETE */
    const char *fkey;       /* full key, "" for the bucket */
    const char *query;      /* canonical, "" for none */
    const char *const *headers;
    const char *payload_sha; /* NULL = empty */
    int upload_fd;           /* -1 none */
    int64_t upload_size;
    int bounded;             /* apply request_timeout_ms */
} call_spec;

/* Build, sign and perform one request; *cc is libcurl's verdict. */
static md_status call_perform(md_s3 *s3, s3_call *c, const call_spec *sp, CURLcode *cc, md_err *err)
{
    char *path = NULL, *url = NULL;
    struct curl_slist *hdrs = NULL;
    md_status st = MD_OK;
    size_t kn = strlen(sp->fkey);
    size_t path_cap = 3 * kn + 2;
    path = malloc(path_cap);
    size_t url_cap = strlen(s3->base) + path_cap + strlen(sp->query) + 4;
    url = malloc(url_cap);
    if (!path || !url) {
        st = md_err_set(err, MD_ENOMEM, "no memory for an S3 request");
        goto out;
    }
    path[0] = '\0';
    if (kn || !s3->bucket_path) { /* path-style bucket calls go to "/BUCKET" itself */
        path[0] = '/';
        if (md_s3_uri_encode(path + 1, path_cap - 1, sp->fkey, kn, 1) < 0) {
            st = md_err_set(err, MD_EINTERNAL, "an S3 key did not fit its encoding buffer");
            goto out;
        }
    }
    snprintf(url, url_cap, "%s%s%s%s", s3->base, path, sp->query[0] ? "?" : "", sp->query);

    char line[MD_S3_TOKEN_MAX + 40];
    if (s3->net.amz_date) {
        snprintf(line, sizeof line, "x-amz-date: %s", s3->net.amz_date);
        hdrs = curl_slist_append(hdrs, line);
    }
    snprintf(line, sizeof line, "x-amz-content-sha256: %s", sp->payload_sha ? sp->payload_sha : EMPTY_SHA256);
    hdrs = curl_slist_append(hdrs, line);
    if (s3->cfg.session_token[0]) {
        snprintf(line, sizeof line, "x-amz-security-token: %s", s3->cfg.session_token);
        hdrs = curl_slist_append(hdrs, line);
        memset(line, 0, sizeof line);
    }
    for (const char *const *h = sp->headers; h && *h; h++)
        hdrs = curl_slist_append(hdrs, *h);
    if (!hdrs) {
        st = md_err_set(err, MD_ENOMEM, "no memory for an S3 request");
        goto out;
    }

    CURL *e = c->curl;
    curl_easy_setopt(e, CURLOPT_URL, url);
    curl_easy_setopt(e, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(e, CURLOPT_PATH_AS_IS, 1L);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e, CURLOPT_FOLLOWLOCATION, 0L);
    curl_easy_setopt(e, CURLOPT_USERAGENT, "modeld");
    curl_easy_setopt(e, CURLOPT_AWS_SIGV4, s3->provider);
    curl_easy_setopt(e, CURLOPT_USERNAME, s3->cfg.access_key_id);
    curl_easy_setopt(e, CURLOPT_PASSWORD, s3->cfg.secret_access_key);
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, hdrs);
    curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, s3->net.connect_timeout_ms);
    curl_easy_setopt(e, CURLOPT_LOW_SPEED_LIMIT, s3->net.low_speed_bytes);
    curl_easy_setopt(e, CURLOPT_LOW_SPEED_TIME, s3->net.low_speed_time_s);
    if (sp->bounded && s3->net.request_timeout_ms > 0)
        curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, s3->net.request_timeout_ms);
    curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(e, CURLOPT_HEADERDATA, c);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_write);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, c);
    curl_easy_setopt(e, CURLOPT_ERRORBUFFER, c->errbuf);
    if (s3->cfg.ca_bundle[0])
        curl_easy_setopt(e, CURLOPT_CAINFO, s3->cfg.ca_bundle);
    struct curl_slist *connect_to = NULL;
    if (s3->net.connect_to) {
        connect_to = curl_slist_append(NULL, s3->net.connect_to);
        curl_easy_setopt(e, CURLOPT_CONNECT_TO, connect_to);
    }
    if (!strcmp(sp->method, "HEAD"))
        curl_easy_setopt(e, CURLOPT_NOBODY, 1L);
    else if (!strcmp(sp->method, "PUT") || sp->upload_fd >= 0) {
        curl_easy_setopt(e, CURLOPT_UPLOAD, 1L);
        if (strcmp(sp->method, "PUT") != 0) /* a POST with a body (multipart's complete) */
            curl_easy_setopt(e, CURLOPT_CUSTOMREQUEST, sp->method);
        c->src_fd = sp->upload_fd;
        curl_easy_setopt(e, CURLOPT_READFUNCTION, on_read);
        curl_easy_setopt(e, CURLOPT_READDATA, c);
        curl_easy_setopt(e, CURLOPT_SEEKFUNCTION, on_seek);
        curl_easy_setopt(e, CURLOPT_SEEKDATA, c);
        curl_easy_setopt(e, CURLOPT_INFILESIZE_LARGE, (curl_off_t)(sp->upload_fd >= 0 ? sp->upload_size : 0));
    } else if (strcmp(sp->method, "GET") != 0)
        curl_easy_setopt(e, CURLOPT_CUSTOMREQUEST, sp->method);
    c->content_length = -1;
    *cc = curl_easy_perform(e);
    curl_slist_free_all(connect_to);
out:
    /* the list held the session token: scrub it before it is freed */
    for (struct curl_slist *h = hdrs; h; h = h->next)
        if (!strncasecmp(h->data, "x-amz-security-token:", 21))
            memset(h->data, 0, strlen(h->data));
    curl_slist_free_all(hdrs);
    free(path);
    free(url);
    return st;
}

static void call_init(s3_call *c, size_t mem_max, int keep_all)
{
    memset(c, 0, sizeof *c);
    c->sink_fd = c->src_fd = -1;
    c->content_length = -1;
    c->mem_max = mem_max;
    c->mem_keep_all = keep_all;
    c->curl = curl_easy_init();
}

static void call_free(s3_call *c)
{
    if (c->curl)
        curl_easy_cleanup(c->curl);
    free(c->mem);
    c->curl = NULL;
    c->mem = NULL;
}

/* The verdict on a performed call: MD_OK for a 2xx, else the mapped error. */
static md_status call_verdict(md_s3 *s3, s3_call *c, CURLcode cc, const char *op, const char *fkey,
                              const char *shown_file, md_err *err)
{
    char k[200];
    md_text_escape(k, sizeof k, fkey);
    if (cc == CURLE_WRITE_ERROR && c->sink_errno)
        return md_err_set(err, c->sink_errno == ENOSPC ? MD_ENOSPC : MD_EIO,
                          "writing s3://%s/%s to disk failed: %s", s3->bucket, k, strerror(c->sink_errno));
    if (c->mem_nomem)
        return md_err_set(err, MD_ENOMEM, "no memory for S3's answer to %s s3://%s/%s", op, s3->bucket, k);
    if (c->mem_overflow)
        return md_err_set(err, MD_EIO, "S3's answer to %s s3://%s/%s is larger than %zu bytes", op,
                          s3->bucket, k, c->mem_max);
    if (cc == CURLE_ABORTED_BY_CALLBACK && c->src_errno)
        return md_err_set(err, MD_EIO, "reading %s to upload it failed: %s", shown_file ? shown_file : "",
                          strerror(c->src_errno));
    long http = response_code(c);
    if (cc == CURLE_OK && http >= 200 && http < 300)
        return MD_OK;
    char code[64] = "", msg[256] = "";
    if (c->mem && cc == CURLE_OK)
        md_s3_parse_error(c->mem, c->mem_len, code, sizeof code, msg, sizeof msg);
    const char *native = cc != CURLE_OK ? (c->errbuf[0] ? c->errbuf : curl_easy_strerror(cc)) : msg;
    return md_s3_map_error(s3, cc != CURLE_OK ? (int)cc : 0, http, code, native, op, fkey, err);
}

/* ---- operations ---- */

/* Open the file an upload sends (`shown`: its name escaped for messages):
 * *fd and its *size, or MD_EIO naming it. */
static md_status open_upload(const char *path, const char *shown, int *fd, long long *size,
                             md_err *err)
{
    *fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat stt;
    if (*fd < 0 || fstat(*fd, &stt) != 0) {
        md_status st = md_err_set(err, MD_EIO, "cannot open %s to upload it: %s", shown,
                                  strerror(errno));
        if (*fd >= 0)
            close(*fd);
        *fd = -1;
        return st;
    }
    *size = (long long)stt.st_size;
    return MD_OK;
}

md_status md_s3_request_send(md_s3 *s3, const md_s3_request *req, md_s3_response *resp, md_err *err)
{
    char fkey[MD_S3_KEY_MAX + 1], query[8192];
    md_status st = full_key(s3, req->key ? req->key : "", fkey, err);
    if (st != MD_OK)
        return st;
    if (md_s3_query_build(query, sizeof query, req->params, req->n_params) < 0)
        return md_err_set(err, MD_EINVAL, "an S3 query is too long");
    call_spec sp = {.method = req->method, .fkey = fkey, .query = query, .headers = req->headers,
                    .upload_fd = -1, .bounded = !req->upload_path};
    char sha[65], shown[160] = "";
    int fd = -1;
    if (req->upload_path) {
        md_text_escape(shown, sizeof shown, req->upload_path);
        long long size = 0;
        if ((st = open_upload(req->upload_path, shown, &fd, &size, err)) != MD_OK)
            return st;
        if ((st = file_sha256(fd, sha, err, shown)) != MD_OK) {
            close(fd);
            return st;
        }
        sp.payload_sha = sha;
        sp.upload_fd = fd;
        sp.upload_size = size;
    }
    s3_call c;
    call_init(&c, MD_S3_ERROR_BODY_MAX, 0);
    CURLcode cc = CURLE_FAILED_INIT;
    st = c.curl ? call_perform(s3, &c, &sp, &cc, err) : md_err_set(err, MD_ENOMEM, "no libcurl handle");
    if (st == MD_OK) {
        if (resp) {
            resp->http_status = response_code(&c);
            resp->body_len = c.mem_len;
            if (c.mem_len)
                memcpy(resp->body, c.mem, c.mem_len);
            resp->body[c.mem_len] = '\0';
        }
        st = call_verdict(s3, &c, cc, req->method, fkey, shown, err);
    }
    call_free(&c);
    if (fd >= 0)
        close(fd);
    return st;
}

static int sha256_hex_ok(const char *h)
{
    if (!h || strlen(h) != 64)
        return 0;
    for (const char *c = h; *c; c++)
        if (!((*c >= '0' && *c <= '9') || (*c >= 'a' && *c <= 'f')))
            return 0;
    return 1;
}

static md_status put_file(md_s3 *s3, const char *key, const char *path, const char *known_sha,
                          md_err *err)
{
    char fkey[MD_S3_KEY_MAX + 1], shown[160];
    md_status st = full_key(s3, key, fkey, err);
    if (st != MD_OK)
        return st;
    md_text_escape(shown, sizeof shown, path);
    int fd = -1;
    long long size = 0;
    if ((st = open_upload(path, shown, &fd, &size, err)) != MD_OK)
        return st;
    if (size > PUT_MAX) {
        close(fd);
        return md_err_set(err, MD_ETOOBIG, "%s is %lld bytes, past S3's 5 GiB for one PUT", shown,
                          size);
    }
    char sha[65];
    if (known_sha)
        memcpy(sha, known_sha, 65);
    else if ((st = file_sha256(fd, sha, err, shown)) != MD_OK) {
        close(fd);
        return st;
    }
    call_spec sp = {.method = "PUT", .fkey = fkey, .query = "", .payload_sha = sha, .upload_fd = fd,
                    .upload_size = size};
    s3_call c;
    call_init(&c, MD_S3_ERROR_BODY_MAX, 0);
    CURLcode cc = CURLE_FAILED_INIT;
    st = c.curl ? call_perform(s3, &c, &sp, &cc, err) : md_err_set(err, MD_ENOMEM, "no libcurl handle");
    if (st == MD_OK)
        st = call_verdict(s3, &c, cc, "PUT", fkey, shown, err);
    call_free(&c);
    close(fd);
    return st;
}

md_status md_s3_put_file(md_s3 *s3, const char *key, const char *path, md_err *err)
{
    return put_file(s3, key, path, NULL, err);
}

md_status md_s3_put_file_sha256(md_s3 *s3, const char *key, const char *path, const char *sha256_hex,
                                md_err *err)
{
    if (!sha256_hex_ok(sha256_hex))
        return md_err_set(err, MD_EINVAL, "a sha256 must be 64 lower-case hex digits");
    return put_file(s3, key, path, sha256_hex, err);
}

/* A HEAD or a DELETE of `key`: no body either way. `c` stays for the
 * caller to read (HEAD) and free, whatever the outcome. */
static md_status bodiless_call(md_s3 *s3, const char *method, const char *key, s3_call *c,
                               md_err *err)
{
    call_init(c, MD_S3_ERROR_BODY_MAX, 0);
    char fkey[MD_S3_KEY_MAX + 1];
    md_status st = full_key(s3, key, fkey, err);
    if (st != MD_OK)
        return st;
    call_spec sp = {.method = method, .fkey = fkey, .query = "", .upload_fd = -1, .bounded = 1};
    CURLcode cc = CURLE_FAILED_INIT;
    st = c->curl ? call_perform(s3, c, &sp, &cc, err)
                 : md_err_set(err, MD_ENOMEM, "no libcurl handle");
    if (st == MD_OK)
        st = call_verdict(s3, c, cc, method, fkey, NULL, err);
    return st;
}

md_status md_s3_head(md_s3 *s3, const char *key, md_s3_object *info, md_err *err)
{
    s3_call c;
    md_status st = bodiless_call(s3, "HEAD", key, &c, err);
    if (st == MD_OK && info) {
        memset(info, 0, sizeof *info);
        snprintf(info->key, sizeof info->key, "%s", key);
        info->size = c.content_length;
        snprintf(info->etag, sizeof info->etag, "%s", c.etag);
    }
    call_free(&c);
    return st;
}

md_status md_s3_delete(md_s3 *s3, const char *key, md_err *err)
{
    s3_call c;
    md_status st = bodiless_call(s3, "DELETE", key, &c, err);
    call_free(&c);
    return st;
}

md_status md_s3_copy(md_s3 *s3, const char *src_key, const char *dst_key, md_err *err)
{
    char fsrc[MD_S3_KEY_MAX + 1], enc[3 * MD_S3_KEY_MAX + 1], header[3 * MD_S3_KEY_MAX + 128];
    md_status st = full_key(s3, src_key, fsrc, err);
    if (st != MD_OK)
        return st;
    if (md_s3_uri_encode(enc, sizeof enc, fsrc, strlen(fsrc), 1) < 0)
        return md_err_set(err, MD_EINVAL, "the S3 key %s is too long to copy", fsrc);
    snprintf(header, sizeof header, "x-amz-copy-source: /%s/%s", md_s3_bucket(s3), enc);
    const char *headers[] = {header, NULL};
    md_s3_request req = {.method = "PUT", .key = dst_key, .headers = headers};
    md_s3_response resp;
    if ((st = md_s3_request_send(s3, &req, &resp, err)) != MD_OK)
        return st;
    /* a copy may fail after its 200 was sent: the error is then the body */
    if (strstr(resp.body, "<Error>"))
        return md_err_set(err, MD_EUNAVAIL, "copying s3://%s/%s to %s failed: %.300s",
                          md_s3_bucket(s3), fsrc, dst_key, resp.body);
    return MD_OK;
}

/* TOTAL of a Content-Range "bytes A-B/TOTAL" or "bytes * /TOTAL"; -1 unknown. */
static int64_t range_total(const char *cr)
{
    const char *slash = strrchr(cr, '/');
    if (!slash || !slash[1])
        return -1;
    int64_t v = 0;
    int digits = 0;
    for (const char *p = slash + 1; *p; p++, digits++) {
        if (*p < '0' || *p > '9' || digits >= 18)
            return -1;
        v = v * 10 + (*p - '0');
    }
    return v;
}

static int transfer_cut(CURLcode cc)
{
    return cc == CURLE_PARTIAL_FILE || cc == CURLE_RECV_ERROR || cc == CURLE_OPERATION_TIMEDOUT ||
           cc == CURLE_GOT_NOTHING || cc == CURLE_SEND_ERROR || cc == CURLE_HTTP2_STREAM ||
           cc == CURLE_HTTP2;
}

md_status md_s3_get_fd(md_s3 *s3, const char *key, int fd, md_s3_object *info, md_err *err)
{
    char fkey[MD_S3_KEY_MAX + 1];
    md_status st = full_key(s3, key, fkey, err);
    if (st != MD_OK)
        return st;
    if (ftruncate(fd, 0) != 0)
        return md_err_set(err, MD_EIO, "cannot truncate the download's file: %s", strerror(errno));
    int64_t have = 0, total = -1;
    char etag[128] = "";
    int resumes = 0;
    for (;;) {
        char range[64], ifmatch[160];
        const char *hdrs[3] = {NULL, NULL, NULL};
        if (have > 0) {
            snprintf(range, sizeof range, "Range: bytes=%" PRId64 "-", have);
            hdrs[0] = range;
            if (etag[0]) {
                snprintf(ifmatch, sizeof ifmatch, "If-Match: %s", etag);
                hdrs[1] = ifmatch;
            }
        }
        call_spec sp = {.method = "GET", .fkey = fkey, .query = "", .headers = hdrs, .upload_fd = -1};
        s3_call c;
        call_init(&c, MD_S3_ERROR_BODY_MAX, 0);
        c.sink_fd = fd;
        c.sink_off = c.sink_base = have;
        CURLcode cc = CURLE_FAILED_INIT;
        st = c.curl ? call_perform(s3, &c, &sp, &cc, err) : md_err_set(err, MD_ENOMEM, "no libcurl handle");
        if (st != MD_OK) {
            call_free(&c);
            return st;
        }
        long http = response_code(&c);
        if ((http == 200 || http == 206) && c.etag[0] && !etag[0])
            snprintf(etag, sizeof etag, "%s", c.etag);
        if (http == 200 && c.content_length >= 0)
            total = c.content_length;
        else if (http == 206)
            total = range_total(c.content_range);
        int progressed = c.written > 0;
        if (http == 200 || http == 206)
            have = c.sink_off;
        if (cc == CURLE_OK && (http == 200 || http == 206)) {
            call_free(&c);
            break;
        }
        /* asked from past the end: complete when the object is that long */
        if (cc == CURLE_OK && http == 416 && have > 0 && range_total(c.content_range) == have) {
            total = have;
            call_free(&c);
            break;
        }
        int again = 0;
        if ((cc == CURLE_OK && (http == 412 || http == 416)) || c.range_mismatch) {
            have = 0; /* the object changed, or the answer was not the range asked: start over */
            etag[0] = '\0';
            if (ftruncate(fd, 0) != 0) {
                st = md_err_set(err, MD_EIO, "cannot truncate the download's file: %s", strerror(errno));
                call_free(&c);
                return st;
            }
            again = 1;
        } else if (transfer_cut(cc) && (http == 200 || http == 206) && progressed && !c.sink_errno) {
            again = 1; /* cut mid-way: ask for the rest */
        }
        if (again && resumes < s3->net.max_resumes) {
            char k[200];
            md_text_escape(k, sizeof k, fkey);
            md_log(MD_LOG_INFO, "s3: GET s3://%s/%s cut after %" PRId64 " bytes (%s): resuming", s3->bucket,
                   k, have, cc != CURLE_OK ? curl_easy_strerror(cc) : "restart");
            resumes++;
            call_free(&c);
            continue;
        }
        st = call_verdict(s3, &c, cc, "GET", fkey, NULL, err);
        if (st == MD_OK) /* a 2xx that is neither 200 nor 206 */
            st = md_err_set(err, MD_EIO, "S3 answered GET with HTTP %ld", http);
        call_free(&c);
        return st;
    }
    if (total >= 0 && have != total) {
        char k[200];
        md_text_escape(k, sizeof k, fkey);
        return md_err_set(err, MD_EUNAVAIL, "s3://%s/%s arrived with %" PRId64 " of its %" PRId64
                          " bytes: retry later", s3->bucket, k, have, total);
    }
    if (fsync(fd) != 0)
        return md_err_set(err, errno == ENOSPC ? MD_ENOSPC : MD_EIO, "fsync of a download failed: %s",
                          strerror(errno));
    if (info) {
        memset(info, 0, sizeof *info);
        snprintf(info->key, sizeof info->key, "%s", key);
        info->size = have;
        snprintf(info->etag, sizeof info->etag, "%s", etag);
    }
    return MD_OK;
}

md_status md_s3_get_path(md_s3 *s3, const char *key, const char *tmp_path, md_s3_object *info,
                         md_err *err)
{
    int fd = open(tmp_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) {
        char shown[160];
        md_text_escape(shown, sizeof shown, tmp_path);
        return md_err_set(err, errno == ENOSPC ? MD_ENOSPC : MD_EIO, "cannot create %s: %s", shown,
                          strerror(errno));
    }
    md_status st = md_s3_get_fd(s3, key, fd, info, err);
    if (close(fd) != 0 && st == MD_OK)
        st = md_err_set(err, MD_EIO, "closing a download failed: %s", strerror(errno));
    if (st != MD_OK)
        unlink(tmp_path);
    return st;
}

typedef struct list_ctx {
    md_s3 *s3;
    md_s3_list_fn fn;
    void *ctx;
    size_t prefix_len;
} list_ctx;

static int list_strip(void *ud, const md_s3_object *obj)
{
    list_ctx *l = ud;
    if (strncmp(obj->key, l->s3->prefix, l->prefix_len) != 0)
        return 0; /* not under our prefix: a server that ignored it */
    md_s3_object rel = *obj;
    memmove(rel.key, obj->key + l->prefix_len, strlen(obj->key) - l->prefix_len + 1);
    return l->fn(l->ctx, &rel);
}

md_status md_s3_list(md_s3 *s3, const char *prefix, int page_size, md_s3_list_fn fn, void *ctx,
                     md_err *err)
{
    char fprefix[MD_S3_KEY_MAX + 1];
    md_status st = full_key(s3, prefix ? prefix : "", fprefix, err);
    if (st != MD_OK)
        return st;
    char *token = md_xmalloc(MD_S3_CONT_TOKEN_MAX + 1), *prev = md_xmalloc(MD_S3_CONT_TOKEN_MAX + 1);
    char *query = md_xmalloc(3 * (MD_S3_KEY_MAX + MD_S3_CONT_TOKEN_MAX) + 128);
    size_t query_cap = 3 * (MD_S3_KEY_MAX + MD_S3_CONT_TOKEN_MAX) + 128;
    token[0] = prev[0] = '\0';
    char max_keys[16];
    snprintf(max_keys, sizeof max_keys, "%d", page_size);
    list_ctx lc = {.s3 = s3, .fn = fn, .ctx = ctx, .prefix_len = strlen(s3->prefix)};
    for (int page = 0;; page++) {
        md_s3_param params[4] = {{"list-type", "2"}, {"prefix", fprefix}};
        size_t n = 2;
        if (page_size > 0)
            params[n++] = (md_s3_param){"max-keys", max_keys};
        if (token[0])
            params[n++] = (md_s3_param){"continuation-token", token};
        if (md_s3_query_build(query, query_cap, params, n) < 0) {
            st = md_err_set(err, MD_EINTERNAL, "an S3 listing's query did not fit");
            break;
        }
        call_spec sp = {.method = "GET", .fkey = "", .query = query, .upload_fd = -1, .bounded = 1};
        s3_call c;
        call_init(&c, MD_S3_LIST_PAGE_MAX, 1);
        CURLcode cc = CURLE_FAILED_INIT;
        st = c.curl ? call_perform(s3, &c, &sp, &cc, err) : md_err_set(err, MD_ENOMEM, "no libcurl handle");
        if (st == MD_OK)
            st = call_verdict(s3, &c, cc, "LIST", fprefix, NULL, err);
        int truncated = 0, stopped = 0;
        if (st == MD_OK) {
            memcpy(prev, token, strlen(token) + 1);
            st = md_s3_parse_list(c.mem ? c.mem : "", c.mem_len, list_strip, &lc, &truncated, &stopped, token,
                                  MD_S3_CONT_TOKEN_MAX + 1, err);
            if (st == MD_OK && truncated && !strcmp(prev, token))
                st = malformed(err, "the same continuation token twice");
        }
        call_free(&c);
        if (st != MD_OK || stopped || !truncated)
            break;
    }
    free(token);
    free(prev);
    free(query);
    return st;
}

/* ---- ranged reads and multipart uploads (job datasets, issue 26) ---- */

md_status md_s3_get_range(md_s3 *s3, const char *key, int64_t offset, size_t len,
                          const char *if_match, char *buf, size_t *got, md_err *err)
{
    *got = 0;
    if (len == 0 || offset < 0 || len > MD_S3_RANGE_MAX)
        return md_err_set(err, MD_EINVAL, "an S3 range read must ask for 1 to %d bytes",
                          MD_S3_RANGE_MAX);
    char fkey[MD_S3_KEY_MAX + 1];
    md_status st = full_key(s3, key, fkey, err);
    if (st != MD_OK)
        return st;
    char range[96], match[160];
    snprintf(range, sizeof range, "Range: bytes=%" PRId64 "-%" PRId64, offset,
             offset + (int64_t)len - 1);
    const char *headers[3] = {range, NULL, NULL};
    if (if_match && if_match[0]) {
        snprintf(match, sizeof match, "If-Match: %s", if_match);
        headers[1] = match;
    }
    call_spec sp = {.method = "GET", .fkey = fkey, .query = "", .headers = headers, .upload_fd = -1,
                    .bounded = 1};
    s3_call c;
    /* the piece into memory, bounded by what was asked (an error answer by
     * its own bound) */
    call_init(&c, len > MD_S3_ERROR_BODY_MAX ? len : MD_S3_ERROR_BODY_MAX, 1);
    CURLcode cc = CURLE_FAILED_INIT;
    st = c.curl ? call_perform(s3, &c, &sp, &cc, err) : md_err_set(err, MD_ENOMEM, "no libcurl handle");
    if (st == MD_OK)
        st = call_verdict(s3, &c, cc, "GET", fkey, NULL, err);
    if (st == MD_OK) {
        long code = response_code(&c);
        char k[200];
        md_text_escape(k, sizeof k, fkey);
        if (code == 206 && !range_starts_at(c.content_range, offset))
            st = md_err_set(err, MD_EIO, "S3 answered a range of s3://%s/%s that does not start "
                            "at byte %" PRId64, s3->bucket, k, offset);
        else if (code != 206 && offset > 0)
            st = md_err_set(err, MD_EIO, "S3 ignored the range asked of s3://%s/%s (HTTP %ld)",
                            s3->bucket, k, code);
        else if (c.mem_len > len)
            st = md_err_set(err, MD_EIO, "S3 answered more of s3://%s/%s than the range asked",
                            s3->bucket, k);
        else {
            if (c.mem_len)
                memcpy(buf, c.mem, c.mem_len);
            *got = c.mem_len;
        }
    }
    call_free(&c);
    return st;
}

/* sha256 of the bytes [off, off + len) of fd as hex. */
static md_status range_sha256(int fd, int64_t off, int64_t len, char hex[65], md_err *err,
                              const char *shown)
{
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    if (!ctx || EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) != 1) {
        EVP_MD_CTX_free(ctx);
        return md_err_set(err, MD_EINTERNAL, "sha256 is not available from OpenSSL");
    }
    static __thread unsigned char buf[65536];
    md_status st = MD_OK;
    while (len > 0) {
        size_t want = len < (int64_t)sizeof buf ? (size_t)len : sizeof buf;
        ssize_t r = pread(fd, buf, want, (off_t)off);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            st = md_err_set(err, MD_EIO, "cannot read %s to upload it: %s", shown,
                            r < 0 ? strerror(errno) : "the file is shorter than it was");
            break;
        }
        EVP_DigestUpdate(ctx, buf, (size_t)r);
        off += r;
        len -= r;
    }
    unsigned char md[32];
    unsigned int mdn = 0;
    if (st == MD_OK)
        EVP_DigestFinal_ex(ctx, md, &mdn);
    EVP_MD_CTX_free(ctx);
    if (st == MD_OK)
        for (int i = 0; i < 32; i++)
            snprintf(hex + 2 * i, 3, "%02x", md[i]);
    return st;
}

/* One request whose body is the bytes [off, off + len) of fd; the answer's
 * ETag into etag (may be NULL), its body (bounded) kept in *c for the caller
 * to read and free. */
static md_status ranged_upload(md_s3 *s3, const char *method, const char *fkey, const char *query,
                               int fd, int64_t off, int64_t len, const char *shown, char *etag,
                               size_t etag_size, s3_call *c, md_err *err)
{
    call_init(c, MD_S3_ERROR_BODY_MAX, 0);
    char sha[65];
    md_status st = range_sha256(fd, off, len, sha, err, shown);
    if (st != MD_OK)
        return st;
    c->src_ranged = 1;
    c->src_base = c->src_pos = off;
    c->src_end = off + len;
    call_spec sp = {.method = method, .fkey = fkey, .query = query, .payload_sha = sha,
                    .upload_fd = fd, .upload_size = len};
    CURLcode cc = CURLE_FAILED_INIT;
    st = c->curl ? call_perform(s3, c, &sp, &cc, err) : md_err_set(err, MD_ENOMEM, "no libcurl handle");
    if (st == MD_OK)
        st = call_verdict(s3, c, cc, method, fkey, shown, err);
    if (st == MD_OK && etag)
        snprintf(etag, etag_size, "%s", c->etag);
    return st;
}

md_status md_s3_put_file_multipart(md_s3 *s3, const char *key, const char *path, int64_t part_bytes,
                                   md_err *err)
{
    if (part_bytes < 1)
        part_bytes = MD_S3_PART_BYTES_DEFAULT;
    char fkey[MD_S3_KEY_MAX + 1], shown[160];
    md_status st = full_key(s3, key, fkey, err);
    if (st != MD_OK)
        return st;
    md_text_escape(shown, sizeof shown, path);
    int fd = -1;
    long long size = 0;
    if ((st = open_upload(path, shown, &fd, &size, err)) != MD_OK)
        return st;
    if (size <= part_bytes) {
        close(fd);
        return put_file(s3, key, path, NULL, err);
    }
    int64_t parts = (size + part_bytes - 1) / part_bytes;
    if (parts > 10000) {
        close(fd);
        return md_err_set(err, MD_ETOOBIG, "%s is %lld bytes: more than S3's 10000 parts of %lld "
                          "bytes", shown, size, (long long)part_bytes);
    }
    /* CreateMultipartUpload */
    char query[1024 + 64];
    md_s3_param p1[1] = {{"uploads", ""}};
    md_s3_query_build(query, sizeof query, p1, 1);
    call_spec sp = {.method = "POST", .fkey = fkey, .query = query, .upload_fd = -1, .bounded = 1};
    s3_call c;
    call_init(&c, MD_S3_ERROR_BODY_MAX, 0);
    CURLcode cc = CURLE_FAILED_INIT;
    st = c.curl ? call_perform(s3, &c, &sp, &cc, err) : md_err_set(err, MD_ENOMEM, "no libcurl handle");
    if (st == MD_OK)
        st = call_verdict(s3, &c, cc, "POST", fkey, NULL, err);
    char upload_id[1024] = "";
    if (st == MD_OK && (!c.mem || md_s3_xml_text(c.mem, c.mem_len, "UploadId", upload_id,
                                                 sizeof upload_id) != 1))
        st = malformed(err, "no UploadId in the answer to CreateMultipartUpload");
    call_free(&c);
    if (st != MD_OK) {
        close(fd);
        return st;
    }
    /* the parts, then CompleteMultipartUpload with their ETags in order */
    size_t body_cap = 128 + (size_t)parts * 200, body_len = 0;
    char *body = malloc(body_cap);
    if (!body)
        st = md_err_set(err, MD_ENOMEM, "no memory for a multipart upload's part list");
    if (st == MD_OK)
        body_len = (size_t)snprintf(body, body_cap, "<CompleteMultipartUpload>");
    for (int64_t i = 0; st == MD_OK && i < parts; i++) {
        char num[24], etag[128], esc[160];
        snprintf(num, sizeof num, "%" PRId64, i + 1);
        md_s3_param pp[2] = {{"partNumber", num}, {"uploadId", upload_id}};
        md_s3_query_build(query, sizeof query, pp, 2);
        int64_t off = i * part_bytes, len = size - off < part_bytes ? size - off : part_bytes;
        st = ranged_upload(s3, "PUT", fkey, query, fd, off, len, shown, etag, sizeof etag, &c, err);
        call_free(&c);
        if (st == MD_OK && !etag[0])
            st = malformed(err, "no ETag in the answer to UploadPart");
        if (st != MD_OK)
            break;
        /* an ETag is quoted hex: only '"' needs escaping in XML text */
        size_t k = 0;
        for (const char *e = etag; *e && k + 7 < sizeof esc; e++) {
            if (*e == '"')
                memcpy(esc + k, "&quot;", 6), k += 6;
            else if (*e == '&' || *e == '<')
                continue;
            else
                esc[k++] = *e;
        }
        esc[k] = '\0';
        body_len += (size_t)snprintf(body + body_len, body_cap - body_len,
                                     "<Part><PartNumber>%s</PartNumber><ETag>%s</ETag></Part>", num,
                                     esc);
    }
    if (st == MD_OK) {
        body_len += (size_t)snprintf(body + body_len, body_cap - body_len,
                                     "</CompleteMultipartUpload>");
        int mfd = memfd_create("md-s3-complete", MFD_CLOEXEC);
        if (mfd < 0 || write(mfd, body, body_len) != (ssize_t)body_len)
            st = md_err_set(err, MD_EIO, "cannot stage a multipart upload's part list: %s",
                            strerror(errno));
        md_s3_param pc[1] = {{"uploadId", upload_id}};
        md_s3_query_build(query, sizeof query, pc, 1);
        if (st == MD_OK)
            st = ranged_upload(s3, "POST", fkey, query, mfd, 0, (int64_t)body_len, shown, NULL, 0,
                               &c, err);
        /* S3 may answer 200 with an <Error> body when the completion fails */
        char code[64] = "", msg[256] = "";
        if (st == MD_OK && c.mem && memmem(c.mem, c.mem_len, "<Error>", 7)) {
            md_s3_parse_error(c.mem, c.mem_len, code, sizeof code, msg, sizeof msg);
            st = md_s3_map_error(s3, 0, 500, code, msg, "POST", fkey, err);
        }
        call_free(&c);
        if (mfd >= 0)
            close(mfd);
    }
    free(body);
    close(fd);
    if (st != MD_OK) {
        /* AbortMultipartUpload, so the parts stop costing storage */
        md_s3_param pa[1] = {{"uploadId", upload_id}};
        md_s3_query_build(query, sizeof query, pa, 1);
        call_spec sa = {.method = "DELETE", .fkey = fkey, .query = query, .upload_fd = -1,
                        .bounded = 1};
        call_init(&c, MD_S3_ERROR_BODY_MAX, 0);
        md_err ignored;
        if (c.curl)
            call_perform(s3, &c, &sa, &cc, &ignored);
        call_free(&c);
    }
    return st;
}
