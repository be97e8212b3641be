/*
 * s3.h - a small S3 client over libcurl: put, get (resumed), head, delete and
 * ListObjectsV2, signed with AWS Signature Version 4 by libcurl's
 * CURLOPT_AWS_SIGV4. The blob store's S3 backend (blobs_s3.c) and the
 * s3:// deploy source are built on it; nothing else in modeld talks to S3.
 *
 * Configuration is the one every AWS client reads (md_s3_config_from_env):
 * AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN (each also as
 * *_FILE: a file holding it), AWS_REGION / AWS_DEFAULT_REGION, and
 * AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL for MinIO, Ceph or any other S3,
 * and AWS_CA_BUNDLE for an endpoint whose certificate a private CA signed.
 * A custom endpoint is addressed path-style (http://host/BUCKET/KEY) unless
 * told otherwise; AWS itself virtual-hosted (https://BUCKET.s3.REGION...),
 * but path-style for a bucket name with a '.' (no certificate covers it).
 *
 * Secrets stay in md_s3_config and the handle: no log line and no md_err
 * message ever holds one. Every failure maps to the shared md_status in one
 * function (md_s3_map_error): the network, a timeout, 5xx and SlowDown are
 * MD_EUNAVAIL (retry later), NoSuchKey MD_ENOTFOUND, a refused signature or
 * credential MD_EFORBIDDEN; the server's own message goes to the log.
 *
 * This header is private to checkpoint/ (checkpoint.h stays the folder's one
 * public interface); tests and the fuzz target include it directly.
 *
 * Thread safety: an md_s3 handle is immutable after md_s3_open and may be
 * used by any number of threads at once (each call makes its own libcurl
 * handle). The pure functions (encoding, query, XML, URL parsing) keep no
 * state. Every call that talks to the network blocks: never from a
 * libmicrohttpd thread.
 */
#ifndef MD_S3_H
#define MD_S3_H

#include <stddef.h>
#include <stdint.h>

#include "../config/md_err.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct md_s3 md_s3;

#define MD_S3_KEY_MAX 1024        /* S3's own limit on a key's bytes */
#define MD_S3_BUCKET_MAX 63
#define MD_S3_TOKEN_MAX 8192      /* a session token (STS ones run to ~2 KB) */
#define MD_S3_SECRET_MAX 256
#define MD_S3_ENDPOINT_MAX 512
#define MD_S3_REGION_MAX 64       /* libcurl's own bound on each SigV4 part */
#define MD_S3_LIST_PAGE_MAX (8 << 20) /* bytes of one ListObjectsV2 answer */
#define MD_S3_ERROR_BODY_MAX (16 << 10) /* bytes of an error answer kept */
#define MD_S3_CONT_TOKEN_MAX 2048 /* a continuation token's bytes */
#define MD_S3_QUERY_PARAMS_MAX 16 /* parameters of one request */

/* Credentials and where to reach S3. Holds secrets: never log or print it. */
typedef struct md_s3_config {
    char access_key_id[MD_S3_SECRET_MAX];
    char secret_access_key[MD_S3_SECRET_MAX];
    char session_token[MD_S3_TOKEN_MAX]; /* "" = none */
    char region[MD_S3_REGION_MAX];       /* "us-east-1" when unset */
    char endpoint[MD_S3_ENDPOINT_MAX];   /* "" = AWS; else scheme://host[:port] */
    char ca_bundle[MD_S3_ENDPOINT_MAX];  /* "" = the system's CAs; else a PEM file */
    int path_style;                      /* -1 = auto (on for a custom endpoint), 0, 1 */
} md_s3_config;

/* Network bounds of every call. md_s3_net_defaults fills sensible ones: no
 * call can hang, since a stalled peer trips the low-speed limit. */
typedef struct md_s3_net {
    long connect_timeout_ms;  /* TCP + TLS connect (default 5000) */
    long low_speed_bytes;     /* abort below this many bytes/s ... (default 1024) */
    long low_speed_time_s;    /* ... sustained this long (default 15) */
    long request_timeout_ms;  /* whole-call bound for head, delete, one list page
                                 (default 60000); 0 = none. Put and get are bounded by
                                 the low-speed limit alone: big objects take long. */
    int max_resumes;          /* a cut download resumes this often (default 5) */
    /* Test-only hooks: a CURLOPT_CONNECT_TO entry ("HOST:PORT:ADDR:PORT"),
     * and a fixed x-amz-date ("20130524T000000Z") for the worked examples.
     * NULL in production. */
    const char *connect_to;
    const char *amz_date;
} md_s3_net;

/* What HEAD (or a listing) says of one object. */
typedef struct md_s3_object {
    char key[MD_S3_KEY_MAX + 1]; /* relative to the handle's prefix */
    int64_t size;
    char etag[128];              /* with its quotes, as S3 sends it */
    char last_modified[40];      /* as S3 sends it (ISO 8601 in listings) */
} md_s3_object;

/* Fill `net` with the defaults above. Thread-safe. */
void md_s3_net_defaults(md_s3_net *net);

/* Read the AWS_* environment into `cfg` (see the file comment). A *_FILE
 * variable names a file whose contents (one trailing newline stripped) are
 * the value; setting both forms of one is an error, as is a key id without a
 * secret or the reverse, a region or an endpoint that cannot be one. Every
 * message names the variable and the fix, never a secret's value.
 * Not thread-safe against concurrent setenv (getenv). */
md_status md_s3_config_from_env(md_s3_config *cfg, md_err *err);

/* Split "s3://BUCKET[/PREFIX]" into its bucket and prefix. The bucket must
 * follow S3's naming rules (3-63 of a-z 0-9 . -, starting and ending with a
 * letter or digit, no "..", not an IP address, no reserved prefix or
 * suffix); the prefix is at most MD_S3_KEY_MAX bytes of valid UTF-8 without
 * control characters, and is returned as given. bucket has room for
 * MD_S3_BUCKET_MAX + 1, prefix for MD_S3_KEY_MAX + 1. Thread-safe. */
md_status md_s3_url_parse(const char *url, char *bucket, char *prefix, md_err *err);

/* Open a client for `url` ("s3://BUCKET/PREFIX"; keys given to the calls
 * below are relative to PREFIX, with a '/' put between a non-empty PREFIX
 * that lacks one and the key). `cfg` and `net` are copied (net may be NULL
 * for the defaults). Talks to no server. On success *out is a new handle the
 * caller frees with md_s3_close. Thread-safe. */
md_status md_s3_open(const md_s3_config *cfg, const char *url, const md_s3_net *net, md_s3 **out,
                     md_err *err);

/* Free `s3` (scrubbing its secrets). Accepts NULL. */
void md_s3_close(md_s3 *s3);

/* The bucket and the normalised prefix ("" or ending in '/'); borrowed,
 * valid until md_s3_close. */
const char *md_s3_bucket(const md_s3 *s3);
const char *md_s3_prefix(const md_s3 *s3);

/* Upload the file at `path` as `key`: its sha256 is computed first and sent
 * as x-amz-content-sha256 (the signature covers the bytes), then the file is
 * streamed. Objects past 5 GiB (S3's single PUT limit) are MD_ETOOBIG. */
md_status md_s3_put_file(md_s3 *s3, const char *key, const char *path, md_err *err);

/* As md_s3_put_file when the file's sha256 is already known (a
 * content-addressed blob): `sha256_hex` (64 lower-case hex digits) is sent as
 * x-amz-content-sha256 without reading the file twice. S3 checks the bytes
 * against it: a file that is not those bytes is refused (HTTP 400
 * XAmzContentSHA256Mismatch, MD_EIO) and nothing is stored. */
md_status md_s3_put_file_sha256(md_s3 *s3, const char *key, const char *path, const char *sha256_hex,
                                md_err *err);

/* Download `key` into `fd` (opened for writing; truncated to 0 first), and
 * fsync it. A transfer cut mid-way resumes with "Range: bytes=N-" (and
 * If-Match the first answer's ETag) from the bytes already written, up to
 * net.max_resumes times while each try makes progress; an answer that
 * ignores the range, or an object that changed, starts over. `info` (may be
 * NULL) receives the size and ETag. On failure the fd's contents are
 * unspecified. */
md_status md_s3_get_fd(md_s3 *s3, const char *key, int fd, md_s3_object *info, md_err *err);

/* As md_s3_get_fd into a new file at `tmp_path` (created, mode 0600), which
 * is removed again on failure: the caller renames it to a final name only
 * after md_s3_get_path succeeded (and it checked the bytes). */
md_status md_s3_get_path(md_s3 *s3, const char *key, const char *tmp_path, md_s3_object *info,
                         md_err *err);

/* HEAD `key`: size and ETag into `info`. MD_ENOTFOUND when absent. */
md_status md_s3_head(md_s3 *s3, const char *key, md_s3_object *info, md_err *err);

/* DELETE `key`. Deleting a key that does not exist succeeds (S3 answers 204). */
md_status md_s3_delete(md_s3 *s3, const char *key, md_err *err);

/* Copy the object `src_key` to `dst_key` (both relative to the handle's
 * prefix, in its bucket) inside S3 (CopyObject: no byte crosses the
 * network; objects up to 5 GB), over what `dst_key` holds. */
md_status md_s3_copy(md_s3 *s3, const char *src_key, const char *dst_key, md_err *err);

/* Called once per listed object, in S3's (UTF-8 byte) order; `obj` is
 * borrowed for the call. Return non-zero to stop the listing early (the
 * listing then returns MD_OK). */
typedef int (*md_s3_list_fn)(void *ctx, const md_s3_object *obj);

/* ListObjectsV2 of every key under `prefix` (relative to the handle's),
 * following continuation tokens page by page; `page_size` is max-keys (0 =
 * S3's default of 1000). */
md_status md_s3_list(md_s3 *s3, const char *prefix, int page_size, md_s3_list_fn fn, void *ctx,
                     md_err *err);

/* Read the bytes [offset, offset + len) of `key` into `buf` (len bytes, at
 * most MD_S3_RANGE_MAX) with one "Range" GET, guarded by "If-Match:
 * if_match" when if_match is non-empty (an object replaced meanwhile is
 * MD_ECONFLICT, HTTP 412). *got is the bytes read: fewer than len only at
 * the object's end. An answer that ignores the range (past offset 0) or
 * starts elsewhere is MD_EIO. Bounded by request_timeout_ms and the
 * low-speed limit, so a stalled server fails the call, never hangs it. */
#define MD_S3_RANGE_MAX (64 << 20)
md_status md_s3_get_range(md_s3 *s3, const char *key, int64_t offset, size_t len,
                          const char *if_match, char *buf, size_t *got, md_err *err);

/* Upload the file at `path` as `key`: one PUT when it is at most
 * `part_bytes` (0: MD_S3_PART_BYTES_DEFAULT), else a multipart upload of
 * parts of part_bytes (each signed with its own sha256, read with pread so
 * the file is never held in memory), completed with the parts' ETags in
 * order, and aborted on any failure so no half object and no orphan parts
 * remain. More than 10000 parts is MD_ETOOBIG. */
#define MD_S3_PART_BYTES_DEFAULT ((int64_t)16 << 20)
md_status md_s3_put_file_multipart(md_s3 *s3, const char *key, const char *path, int64_t part_bytes,
                                   md_err *err);

/* ---- the one request path, for tests and operations not wrapped above ---- */

typedef struct md_s3_param {
    const char *name;  /* unencoded */
    const char *value; /* unencoded; "" or NULL is sent as "name=" */
} md_s3_param;

/* One signed request: METHOD /KEY?QUERY with `headers` ("Name: value"
 * strings, NULL-terminated list, may be NULL) added and signed. A body comes
 * from `upload_path` (whose sha256 is computed first) or none; the answer's
 * body (up to MD_S3_ERROR_BODY_MAX bytes) goes to `body` when given. Status
 * and body of a non-2xx answer are mapped by md_s3_map_error. `key` is
 * relative to the handle's prefix ("" for the bucket itself). */
typedef struct md_s3_request {
    const char *method;
    const char *key;
    const md_s3_param *params;
    size_t n_params;
    const char *const *headers;
    const char *upload_path;
} md_s3_request;

typedef struct md_s3_response {
    long http_status;
    char body[MD_S3_ERROR_BODY_MAX + 1];
    size_t body_len;
} md_s3_response;

md_status md_s3_request_send(md_s3 *s3, const md_s3_request *req, md_s3_response *resp,
                             md_err *err);

/* ---- pure helpers (thread-safe, no allocation) ---- */

/* Percent-encode `in` (len bytes) per SigV4: RFC 3986 unreserved characters
 * (A-Z a-z 0-9 - . _ ~) are kept, every other byte is %XX (upper-case hex);
 * '/' is kept when keep_slash (an object key in a path), else %2F. Returns
 * the length written (out is NUL-terminated), or -1 when it does not fit in
 * `size` bytes. */
long md_s3_uri_encode(char *out, size_t size, const char *in, size_t len, int keep_slash);

/* The canonical query string of `params` (at most MD_S3_QUERY_PARAMS_MAX):
 * each name and value encoded as above ('/' as %2F), sorted by encoded name
 * then value, "name=value" joined by '&', "name=" for an empty (or NULL)
 * value: the form libcurl 7.88 must be given, since it signs the query as it
 * finds it. -1 when it does not fit in `size` bytes. */
long md_s3_query_build(char *out, size_t size, const md_s3_param *params, size_t n);

/* Parse one ListObjectsV2 answer: `fn` per <Contents> (Key, Size,
 * LastModified, ETag, entities decoded; keys as S3 gives them, prefix and
 * all), *truncated from IsTruncated, and NextContinuationToken into `token`
 * (`token_size` bytes; "" when absent). Every field is bounded: a key past
 * MD_S3_KEY_MAX, a size that is not a non-negative integer, a malformed
 * entity or an unclosed element is MD_EIO ("a malformed ListObjectsV2
 * answer"). Returns MD_OK also when fn stopped the walk (*stopped = 1). */
md_status md_s3_parse_list(const char *xml, size_t len, md_s3_list_fn fn, void *ctx, int *truncated,
                           int *stopped, char *token, size_t token_size, md_err *err);

/* From an S3 error answer, the <Code> and <Message> (entities decoded,
 * truncated to their buffers); "" when absent or malformed. */
void md_s3_parse_error(const char *xml, size_t len, char *code, size_t code_size, char *message,
                       size_t message_size);

/* The text of the first <tag>...</tag> in xml[0..len), entities decoded,
 * into out (`size` bytes, NUL-terminated). 1 found, 0 absent, -1 malformed
 * or longer than size - 1. The extractor every answer goes through. */
int md_s3_xml_text(const char *xml, size_t len, const char *tag, char *out, size_t size);

/* THE mapping of a failed call to a status: libcurl's code `cc` (CURLcode as
 * int, 0 = the transfer worked), the HTTP status, and the S3 <Code> (may be
 * "" or NULL). `op` and `key` name what was asked ("GET", "models/a"); the
 * message names the bucket and key and, for a refusal, the AWS_* settings to
 * check. `native` (S3's <Message> or libcurl's error text; may be NULL) is
 * written to the log, not into `err`. Returns the status set. */
md_status md_s3_map_error(const md_s3 *s3, int cc, long http_status, const char *s3_code,
                          const char *native, const char *op, const char *key, md_err *err);

#ifdef __cplusplus
}
#endif
#endif
