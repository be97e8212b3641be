/*
 * test_s3.c - unit tests of the S3 client (checkpoint/s3.c) against a tiny
 * loopback HTTP listener thread that captures each request and answers as
 * scripted (a reply, a body cut short, or silence):
 *  - the signer reproduces AWS's published Signature Version 4 examples for
 *    S3 (GET Object with a Range, PUT Object, GET ?lifecycle, GET bucket
 *    ?max-keys=2&prefix=J) byte for byte, driven through the same request
 *    path as every operation (the date fixed with the x-amz-date header the
 *    request carries, the AWS host reached with CURLOPT_CONNECT_TO);
 *  - the canonical query builder and key encoding;
 *  - the one error mapping: a stalled server (MD_EUNAVAIL within the small
 *    low-speed limit set here), a refused connection, 503 SlowDown, 403 with
 *    S3's XML (MD_EFORBIDDEN naming the AWS_* settings, never the secret),
 *    404 NoSuchKey; a download cut mid-way resumes with Range and If-Match;
 *  - the AWS_* environment (with *_FILE forms), s3:// URLs and bucket names,
 *    the XML extractor's entities and bounds.
 */
#define _GNU_SOURCE /* strcasestr */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "../checkpoint/s3.h"
#include "test_util.h"

#define EX_KEY "AKIAIOSFODNN7EXAMPLE"
#define EX_SECRET "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
#define EMPTY_SHA "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"

/* ---- the loopback listener ---- */

typedef enum { ACT_REPLY, ACT_CUT, ACT_STALL } act_kind;

typedef struct act {
    act_kind kind;
    const char *head;  /* status line and headers, with the blank line */
    const char *body;
    size_t body_len;
    size_t send_len;   /* ACT_CUT: bytes of body sent before the close */
} act;

#define MAX_ACTS 6

typedef struct listener {
    int fd;
    int port;
    pthread_t thread;
    act acts[MAX_ACTS];
    int n_acts;
    atomic_int served;
    atomic_int stop;
    char req[MAX_ACTS][8192];
    char body[MAX_ACTS][256];
} listener;

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* Wait until fd is readable or the listener is told to stop: 1 readable. */
static int wait_readable(listener *l, int fd)
{
    while (!atomic_load(&l->stop)) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int r = poll(&p, 1, 50);
        if (r > 0)
            return 1;
    }
    return 0;
}

static void write_all(int fd, const char *p, size_t n)
{
    while (n > 0) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w <= 0)
            return;
        p += w;
        n -= (size_t)w;
    }
}

static void *listener_main(void *ud)
{
    listener *l = ud;
    for (int i = 0; i < l->n_acts; i++) {
        if (!wait_readable(l, l->fd))
            return NULL;
        int c = accept(l->fd, NULL, NULL);
        if (c < 0)
            return NULL;
        size_t n = 0;
        char *req = l->req[i];
        while (!strstr(req, "\r\n\r\n") && n + 1 < sizeof l->req[i]) {
            if (!wait_readable(l, c))
                break;
            ssize_t r = recv(c, req + n, sizeof l->req[i] - 1 - n, 0);
            if (r <= 0)
                break;
            n += (size_t)r;
            req[n] = '\0';
        }
        char *end = strstr(req, "\r\n\r\n");
        const char *cl = strcasestr(req, "\r\ncontent-length:");
        if (end && cl && cl < end) { /* the body (small in these tests) */
            size_t want = (size_t)strtoul(cl + 17, NULL, 10), have = n - (size_t)(end + 4 - req);
            memcpy(l->body[i], end + 4, have < sizeof l->body[i] ? have : sizeof l->body[i] - 1);
            while (have < want && have < sizeof l->body[i] - 1 && wait_readable(l, c)) {
                ssize_t r = recv(c, l->body[i] + have, sizeof l->body[i] - 1 - have, 0);
                if (r <= 0)
                    break;
                have += (size_t)r;
            }
        }
        atomic_fetch_add(&l->served, 1);
        act *a = &l->acts[i];
        if (a->kind == ACT_STALL) {
            while (!atomic_load(&l->stop)) { /* hold the connection, say nothing */
                char sink[512];
                struct pollfd p = {.fd = c, .events = POLLIN};
                if (poll(&p, 1, 50) > 0 && recv(c, sink, sizeof sink, 0) <= 0)
                    break;
            }
        } else {
            write_all(c, a->head, strlen(a->head));
            write_all(c, a->body, a->kind == ACT_CUT ? a->send_len : a->body_len);
        }
        close(c);
    }
    return NULL;
}

static int listen_loopback(int *port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    assert_true(fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(fd, 8), 0);
    socklen_t len = sizeof a;
    assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &len), 0);
    *port = ntohs(a.sin_port);
    return fd;
}

static void listener_start(listener *l)
{
    l->fd = listen_loopback(&l->port);
    atomic_store(&l->served, 0);
    atomic_store(&l->stop, 0);
    assert_int_equal(pthread_create(&l->thread, NULL, listener_main, l), 0);
}

static void listener_stop(listener *l)
{
    atomic_store(&l->stop, 1);
    pthread_join(l->thread, NULL);
    close(l->fd);
}

static listener *listener_new(void)
{
    listener *l = calloc(1, sizeof *l);
    assert_non_null(l);
    return l;
}

static void add_reply(listener *l, const char *head, const char *body)
{
    l->acts[l->n_acts++] = (act){ACT_REPLY, head, body, strlen(body), 0};
}

/* The value of header `name` in captured request i ("" when absent). */
static const char *req_header(listener *l, int i, const char *name, char *out, size_t size)
{
    char pat[80];
    snprintf(pat, sizeof pat, "\r\n%s:", name);
    const char *h = strcasestr(l->req[i], pat);
    out[0] = '\0';
    if (!h)
        return out;
    h += strlen(pat);
    while (*h == ' ')
        h++;
    size_t n = strcspn(h, "\r\n");
    snprintf(out, size, "%.*s", (int)(n < size ? n : size - 1), h);
    return out;
}

/* ---- clients ---- */

static md_s3_config example_config(void)
{
    md_s3_config cfg;
    memset(&cfg, 0, sizeof cfg);
    snprintf(cfg.access_key_id, sizeof cfg.access_key_id, EX_KEY);
    snprintf(cfg.secret_access_key, sizeof cfg.secret_access_key, EX_SECRET);
    snprintf(cfg.region, sizeof cfg.region, "us-east-1");
    cfg.path_style = -1;
    return cfg;
}

/* A client for AWS's worked examples: virtual-hosted examplebucket on
 * s3.amazonaws.com, reached on the listener, the date fixed. */
static md_s3 *example_client(listener *l, char *connect_to)
{
    md_s3_config cfg = example_config();
    snprintf(cfg.endpoint, sizeof cfg.endpoint, "http://s3.amazonaws.com");
    cfg.path_style = 0;
    md_s3_net net;
    md_s3_net_defaults(&net);
    sprintf(connect_to, "examplebucket.s3.amazonaws.com:80:127.0.0.1:%d", l->port);
    net.connect_to = connect_to;
    net.amz_date = "20130524T000000Z";
    md_s3 *s3 = NULL;
    md_err err;
    assert_int_equal(md_s3_open(&cfg, "s3://examplebucket", &net, &s3, &err), MD_OK);
    return s3;
}

/* A path-style client of bucket "models" with prefix "p" on the listener,
 * with a small low-speed limit. */
static md_s3 *local_client(int port, long low_speed_time_s)
{
    md_s3_config cfg = example_config();
    snprintf(cfg.endpoint, sizeof cfg.endpoint, "http://127.0.0.1:%d", port);
    md_s3_net net;
    md_s3_net_defaults(&net);
    net.connect_timeout_ms = 2000;
    net.low_speed_time_s = low_speed_time_s;
    net.request_timeout_ms = 0; /* only the low-speed limit bounds these calls */
    md_s3 *s3 = NULL;
    md_err err;
    assert_int_equal(md_s3_open(&cfg, "s3://models/p", &net, &s3, &err), MD_OK);
    return s3;
}

static void assert_authorization(listener *l, int i, const char *signed_headers, const char *signature)
{
    char auth[512], want[512];
    req_header(l, i, "Authorization", auth, sizeof auth);
    /* libcurl writes ", " between the parts, AWS's page "," : both are valid */
    snprintf(want, sizeof want,
             "AWS4-HMAC-SHA256 Credential=" EX_KEY "/20130524/us-east-1/s3/aws4_request, "
             "SignedHeaders=%s, Signature=%s", signed_headers, signature);
    assert_string_equal(auth, want);
}

/* ---- (a) AWS's worked examples ---- */

static const char OK_HEAD[] = "HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";

static void test_aws_example_get_object(void **state)
{
    (void)state;
    listener *l = listener_new();
    add_reply(l, "HTTP/1.1 206 Partial Content\r\nContent-Length: 10\r\nContent-Range: bytes 0-9/44\r\n"
                 "Connection: close\r\n\r\n", "0123456789");
    listener_start(l);
    char ct[128];
    md_s3 *s3 = example_client(l, ct);
    const char *hdrs[] = {"Range: bytes=0-9", NULL};
    md_s3_request req = {.method = "GET", .key = "test.txt", .headers = hdrs};
    md_s3_response *resp = calloc(1, sizeof *resp);
    md_err err;
    assert_int_equal(md_s3_request_send(s3, &req, resp, &err), MD_OK);
    assert_int_equal(resp->http_status, 206);
    assert_string_equal(resp->body, "0123456789");
    listener_stop(l);
    assert_true(!strncmp(l->req[0], "GET /test.txt HTTP/1.1\r\n", 24));
    char v[128];
    assert_string_equal(req_header(l, 0, "Host", v, sizeof v), "examplebucket.s3.amazonaws.com");
    assert_string_equal(req_header(l, 0, "x-amz-content-sha256", v, sizeof v), EMPTY_SHA);
    assert_authorization(l, 0, "host;range;x-amz-content-sha256;x-amz-date",
                         "f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41");
    md_s3_close(s3);
    free(resp);
    free(l);
}

static void test_aws_example_put_object(void **state)
{
    (void)state;
    listener *l = listener_new();
    add_reply(l, OK_HEAD, "");
    listener_start(l);
    char ct[128], path[64];
    write_temp(path, "Welcome to Amazon S3.");
    md_s3 *s3 = example_client(l, ct);
    const char *hdrs[] = {"Date: Fri, 24 May 2013 00:00:00 GMT", "x-amz-storage-class: REDUCED_REDUNDANCY",
                          NULL};
    md_s3_request req = {.method = "PUT", .key = "test$file.text", .headers = hdrs, .upload_path = path};
    md_err err;
    assert_int_equal(md_s3_request_send(s3, &req, NULL, &err), MD_OK);
    listener_stop(l);
    assert_true(!strncmp(l->req[0], "PUT /test%24file.text HTTP/1.1\r\n", 32));
    char v[128];
    assert_string_equal(req_header(l, 0, "x-amz-content-sha256", v, sizeof v),
                        "44ce7dd67c959e0d3524ffac1771dfbba87d2b6b4b4e99e42034a8b803f8b072");
    assert_string_equal(l->body[0], "Welcome to Amazon S3.");
    assert_authorization(l, 0, "date;host;x-amz-content-sha256;x-amz-date;x-amz-storage-class",
                         "98ad721746da40c64f1a55b78f14c238d841ea1380cd77a1b5971af0ece108bd");
    md_s3_close(s3);
    free(l);
    unlink(path);
}

static void test_aws_example_get_lifecycle(void **state)
{
    (void)state;
    listener *l = listener_new();
    add_reply(l, OK_HEAD, "");
    listener_start(l);
    char ct[128];
    md_s3 *s3 = example_client(l, ct);
    md_s3_param params[] = {{"lifecycle", NULL}};
    md_s3_request req = {.method = "GET", .key = "", .params = params, .n_params = 1};
    md_err err;
    assert_int_equal(md_s3_request_send(s3, &req, NULL, &err), MD_OK);
    listener_stop(l);
    assert_true(!strncmp(l->req[0], "GET /?lifecycle= HTTP/1.1\r\n", 27));
    assert_authorization(l, 0, "host;x-amz-content-sha256;x-amz-date",
                         "fea454ca298b7da1c68078a5d1bdbfbbe0d65c699e0f91ac7a200a0136783543");
    md_s3_close(s3);
    free(l);
}

static void test_aws_example_list_bucket(void **state)
{
    (void)state;
    listener *l = listener_new();
    add_reply(l, OK_HEAD, "");
    listener_start(l);
    char ct[128];
    md_s3 *s3 = example_client(l, ct);
    /* given out of order: the builder sorts them as the signature needs */
    md_s3_param params[] = {{"prefix", "J"}, {"max-keys", "2"}};
    md_s3_request req = {.method = "GET", .key = "", .params = params, .n_params = 2};
    md_err err;
    assert_int_equal(md_s3_request_send(s3, &req, NULL, &err), MD_OK);
    listener_stop(l);
    assert_true(!strncmp(l->req[0], "GET /?max-keys=2&prefix=J HTTP/1.1\r\n", 36));
    assert_authorization(l, 0, "host;x-amz-content-sha256;x-amz-date",
                         "34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7");
    md_s3_close(s3);
    free(l);
}

/* A session token is sent as x-amz-security-token and signed. */
static void test_session_token_is_sent_and_signed(void **state)
{
    (void)state;
    listener *l = listener_new();
    add_reply(l, OK_HEAD, "");
    listener_start(l);
    md_s3_config cfg = example_config();
    snprintf(cfg.session_token, sizeof cfg.session_token, "FwoGZXIvYXdzEXAMPLETOKEN");
    snprintf(cfg.endpoint, sizeof cfg.endpoint, "http://127.0.0.1:%d", l->port);
    md_s3 *s3 = NULL;
    md_err err;
    assert_int_equal(md_s3_open(&cfg, "s3://models", NULL, &s3, &err), MD_OK);
    assert_int_equal(md_s3_delete(s3, "a b", &err), MD_OK);
    listener_stop(l);
    assert_true(!strncmp(l->req[0], "DELETE /models/a%20b HTTP/1.1\r\n", 31));
    char v[512];
    assert_string_equal(req_header(l, 0, "x-amz-security-token", v, sizeof v), "FwoGZXIvYXdzEXAMPLETOKEN");
    req_header(l, 0, "Authorization", v, sizeof v);
    assert_msg_has(v, "SignedHeaders=host;x-amz-content-sha256;x-amz-date;x-amz-security-token,", NULL);
    md_s3_close(s3);
    free(l);
}

/* ---- (b) the canonical query and key encoding ---- */

static void test_query_builder(void **state)
{
    (void)state;
    char q[512];
    md_s3_param p1[] = {{"prefix", "J"}, {"max-keys", "2"}};
    assert_int_equal(md_s3_query_build(q, sizeof q, p1, 2), 19);
    assert_string_equal(q, "max-keys=2&prefix=J");
    md_s3_param p2[] = {{"list-type", "2"}, {"prefix", "models/a b+c"},
                        {"continuation-token", "1/Ab+=="}, {"lifecycle", ""}};
    assert_true(md_s3_query_build(q, sizeof q, p2, 4) > 0);
    assert_string_equal(q, "continuation-token=1%2FAb%2B%3D%3D&lifecycle=&list-type=2&"
                           "prefix=models%2Fa%20b%2Bc");
    /* sorted by the encoded name, then by value */
    md_s3_param p3[] = {{"b", "2"}, {"a", "x y"}, {"a", "1"}, {"A", "~"}};
    assert_true(md_s3_query_build(q, sizeof q, p3, 4) > 0);
    assert_string_equal(q, "A=~&a=1&a=x%20y&b=2");
    /* the encoded order, not the raw one: '|' is "%7C", before 'A' */
    md_s3_param p4[] = {{"bA", "1"}, {"b|", "2"}, {"c", "A"}, {"c", "|"}};
    assert_true(md_s3_query_build(q, sizeof q, p4, 4) > 0);
    assert_string_equal(q, "b%7C=2&bA=1&c=%7C&c=A");
    assert_int_equal(md_s3_query_build(q, sizeof q, NULL, 0), 0);
    assert_string_equal(q, "");
    assert_int_equal(md_s3_query_build(q, 8, p1, 2), -1); /* does not fit */
}

static void test_key_encoding(void **state)
{
    (void)state;
    char out[128];
    const char *k = "blobs/ab cd/x+y=z&é~._-!*'()$";
    assert_true(md_s3_uri_encode(out, sizeof out, k, strlen(k), 1) > 0);
    assert_string_equal(out, "blobs/ab%20cd/x%2By%3Dz%26%C3%A9~._-%21%2A%27%28%29%24");
    assert_true(md_s3_uri_encode(out, sizeof out, "a/b", 3, 0) > 0);
    assert_string_equal(out, "a%2Fb");
    assert_int_equal(md_s3_uri_encode(out, 4, "a b", 3, 1), -1);
    assert_int_equal(md_s3_uri_encode(out, 4, "abc", 3, 1), 3);
}

/* A key with "." and ".." segments is sent (and signed) as it is. */
static void test_dot_segments_are_kept(void **state)
{
    (void)state;
    listener *l = listener_new();
    add_reply(l, OK_HEAD, "");
    listener_start(l);
    md_s3 *s3 = local_client(l->port, 5);
    md_err err;
    assert_int_equal(md_s3_delete(s3, "a/../b/./c", &err), MD_OK);
    listener_stop(l);
    assert_true(!strncmp(l->req[0], "DELETE /models/p/a/../b/./c HTTP/1.1\r\n", 38));
    md_s3_close(s3);
    free(l);
}

/* ---- (c) failures and their one mapping ---- */

static void test_stall_is_unavailable_within_the_low_speed_limit(void **state)
{
    (void)state;
    listener *l = listener_new();
    l->acts[l->n_acts++] = (act){.kind = ACT_STALL};
    listener_start(l);
    md_s3 *s3 = local_client(l->port, 1);
    char path[64];
    temp_path(path);
    md_err err;
    double t0 = now_s();
    assert_int_equal(md_s3_get_path(s3, "m.pt", path, NULL, &err), MD_EUNAVAIL);
    double took = now_s() - t0;
    /* the limit is 1 s; the bound is loose so a loaded machine passes too,
     * and tight enough that a call without the limit (hanging) fails */
    assert_true(took < 20.0);
    assert_msg_has(err.msg, "did not answer", "s3://models/p/m.pt", "retry later", NULL);
    assert_int_equal(access(path, F_OK), -1); /* no partial file left */
    listener_stop(l);
    md_s3_close(s3);
    free(l);
}

static void test_refused_is_unavailable(void **state)
{
    (void)state;
    int port;
    int fd = listen_loopback(&port);
    close(fd); /* nothing listens there now */
    md_s3 *s3 = local_client(port, 1);
    md_err err;
    md_s3_object info;
    assert_int_equal(md_s3_head(s3, "m.pt", &info, &err), MD_EUNAVAIL);
    assert_msg_has(err.msg, "cannot be reached", "AWS_ENDPOINT_URL_S3", NULL);
    md_s3_close(s3);
}

static void test_slow_down_is_unavailable(void **state)
{
    (void)state;
    listener *l = listener_new();
    add_reply(l, "HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: 108\r\n"
                 "Connection: close\r\n\r\n",
              "<?xml version=\"1.0\"?><Error><Code>SlowDown</Code><Message>Please reduce your request "
              "rate.</Message></Error>");
    listener_start(l);
    md_s3 *s3 = local_client(l->port, 5);
    char path[64];
    temp_path(path);
    md_err err;
    assert_int_equal(md_s3_put_file(s3, "m.pt", "/etc/hostname", &err), MD_EUNAVAIL);
    assert_msg_has(err.msg, "503", "SlowDown", "retry later", NULL);
    listener_stop(l);
    md_s3_close(s3);
    free(l);
}

static void test_forbidden_names_the_settings_not_the_secret(void **state)
{
    (void)state;
    static const char body[] = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SignatureDoesNotMatch"
                               "</Code><Message>The request signature we calculated does not match the "
                               "signature you provided.</Message><Key>m.pt</Key></Error>";
    char head[200];
    snprintf(head, sizeof head, "HTTP/1.1 403 Forbidden\r\nContent-Length: %zu\r\nConnection: close\r\n\r\n",
             sizeof body - 1);
    listener *l = listener_new();
    add_reply(l, head, body);
    add_reply(l, "HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n", "");
    listener_start(l);
    md_s3 *s3 = local_client(l->port, 5);
    char path[64];
    temp_path(path);
    md_err err;
    assert_int_equal(md_s3_get_path(s3, "m.pt", path, NULL, &err), MD_EFORBIDDEN);
    assert_msg_has(err.msg, "s3://models/p/m.pt", "SignatureDoesNotMatch", "AWS_ACCESS_KEY_ID",
                   "AWS_SECRET_ACCESS_KEY", "AWS_REGION", NULL);
    assert_null(strstr(err.msg, EX_SECRET));
    assert_null(strstr(err.msg, "does not match")); /* the server's words go to the log */
    assert_int_equal(access(path, F_OK), -1);
    /* a HEAD's 403 has no body: the status alone decides */
    md_s3_object info;
    assert_int_equal(md_s3_head(s3, "m.pt", &info, &err), MD_EFORBIDDEN);
    assert_null(strstr(err.msg, EX_SECRET));
    listener_stop(l);
    md_s3_close(s3);
    free(l);
}

static void test_no_such_key_is_not_found(void **state)
{
    (void)state;
    static const char body[] = "<Error><Code>NoSuchKey</Code><Message>The specified key does not exist."
                               "</Message></Error>";
    char head[200];
    snprintf(head, sizeof head, "HTTP/1.1 404 Not Found\r\nContent-Length: %zu\r\nConnection: close\r\n\r\n",
             sizeof body - 1);
    listener *l = listener_new();
    add_reply(l, head, body);
    add_reply(l, "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n", "");
    listener_start(l);
    md_s3 *s3 = local_client(l->port, 5);
    char path[64];
    temp_path(path);
    md_err err;
    assert_int_equal(md_s3_get_path(s3, "gone.pt", path, NULL, &err), MD_ENOTFOUND);
    assert_msg_has(err.msg, "no object s3://models/p/gone.pt", NULL);
    md_s3_object info;
    assert_int_equal(md_s3_head(s3, "gone.pt", &info, &err), MD_ENOTFOUND);
    listener_stop(l);
    md_s3_close(s3);
    free(l);
}

static void test_mapping_table(void **state)
{
    (void)state;
    md_err err;
    assert_int_equal(md_s3_map_error(NULL, 7 /* COULDNT_CONNECT */, 0, NULL, NULL, "GET", "k", &err),
                     MD_EUNAVAIL);
    assert_int_equal(md_s3_map_error(NULL, 28 /* OPERATION_TIMEDOUT */, 0, NULL, NULL, "GET", "k", &err),
                     MD_EUNAVAIL);
    assert_int_equal(md_s3_map_error(NULL, 0, 500, "InternalError", "x", "GET", "k", &err), MD_EUNAVAIL);
    assert_int_equal(md_s3_map_error(NULL, 0, 502, "", NULL, "GET", "k", &err), MD_EUNAVAIL);
    assert_int_equal(md_s3_map_error(NULL, 0, 503, "SlowDown", NULL, "GET", "k", &err), MD_EUNAVAIL);
    assert_int_equal(md_s3_map_error(NULL, 0, 404, "NoSuchKey", NULL, "GET", "k", &err), MD_ENOTFOUND);
    assert_int_equal(md_s3_map_error(NULL, 0, 404, "NoSuchBucket", NULL, "GET", "k", &err), MD_ENOTFOUND);
    assert_int_equal(md_s3_map_error(NULL, 0, 403, "AccessDenied", NULL, "GET", "k", &err), MD_EFORBIDDEN);
    assert_int_equal(md_s3_map_error(NULL, 0, 403, "InvalidAccessKeyId", NULL, "GET", "k", &err),
                     MD_EFORBIDDEN);
    assert_int_equal(md_s3_map_error(NULL, 0, 400, "AuthorizationHeaderMalformed", NULL, "GET", "k", &err),
                     MD_EFORBIDDEN);
    assert_int_equal(md_s3_map_error(NULL, 0, 403, "", NULL, "HEAD", "k", &err), MD_EFORBIDDEN);
    assert_int_equal(md_s3_map_error(NULL, 0, 412, "PreconditionFailed", NULL, "GET", "k", &err),
                     MD_ECONFLICT);
    assert_int_equal(md_s3_map_error(NULL, 0, 400, "InvalidArgument", NULL, "GET", "k", &err), MD_EIO);
    /* a code that is not a plain token is not quoted back */
    md_s3_map_error(NULL, 0, 400, "<script>", NULL, "GET", "k", &err);
    assert_null(strstr(err.msg, "<script>"));
}

/* A download cut mid-way resumes from the bytes written, with Range and
 * If-Match; the file holds the whole object once. */
static void test_cut_download_resumes_with_range(void **state)
{
    (void)state;
    enum { N = 100000, CUT = 40000 };
    char *obj = malloc(N);
    for (int i = 0; i < N; i++)
        obj[i] = (char)('a' + (i * 7) % 26);
    char head1[256], head2[256];
    snprintf(head1, sizeof head1, "HTTP/1.1 200 OK\r\nContent-Length: %d\r\nETag: \"abc\"\r\n"
                                  "Connection: close\r\n\r\n", N);
    snprintf(head2, sizeof head2, "HTTP/1.1 206 Partial Content\r\nContent-Length: %d\r\nETag: \"abc\"\r\n"
                                  "Content-Range: bytes %d-%d/%d\r\nConnection: close\r\n\r\n",
             N - CUT, CUT, N - 1, N);
    listener *l = listener_new();
    l->acts[l->n_acts++] = (act){ACT_CUT, head1, obj, N, CUT};
    l->acts[l->n_acts++] = (act){ACT_REPLY, head2, obj + CUT, N - CUT, 0};
    listener_start(l);
    md_s3 *s3 = local_client(l->port, 5);
    char path[64];
    temp_path(path);
    md_err err;
    md_s3_object info;
    assert_int_equal(md_s3_get_path(s3, "big.pt", path, &info, &err), MD_OK);
    listener_stop(l);
    assert_int_equal(info.size, N);
    assert_string_equal(info.etag, "\"abc\"");
    char v[512];
    assert_string_equal(req_header(l, 0, "Range", v, sizeof v), "");
    assert_string_equal(req_header(l, 1, "Range", v, sizeof v), "bytes=40000-");
    assert_string_equal(req_header(l, 1, "If-Match", v, sizeof v), "\"abc\"");
    req_header(l, 1, "Authorization", v, sizeof v);
    assert_msg_has(v, "SignedHeaders=host;if-match;range;x-amz-content-sha256;x-amz-date", NULL);
    FILE *f = fopen(path, "rb");
    char *got = malloc(N + 1);
    assert_int_equal(fread(got, 1, N + 1, f), N);
    fclose(f);
    assert_memory_equal(got, obj, N);
    unlink(path);
    md_s3_close(s3);
    free(got);
    free(obj);
    free(l);
}

/* A server that ignores the Range answers 200 with everything: start over. */
static void test_cut_download_starts_over_when_range_is_ignored(void **state)
{
    (void)state;
    enum { N = 50000, CUT = 20000 };
    char *obj = malloc(N);
    for (int i = 0; i < N; i++)
        obj[i] = (char)('A' + (i * 5) % 26);
    char head[256];
    snprintf(head, sizeof head, "HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n", N);
    listener *l = listener_new();
    l->acts[l->n_acts++] = (act){ACT_CUT, head, obj, N, CUT};
    l->acts[l->n_acts++] = (act){ACT_REPLY, head, obj, N, 0};
    listener_start(l);
    md_s3 *s3 = local_client(l->port, 5);
    char path[64];
    temp_path(path);
    md_err err;
    md_s3_object info;
    assert_int_equal(md_s3_get_path(s3, "x", path, &info, &err), MD_OK);
    listener_stop(l);
    char v[64];
    assert_string_equal(req_header(l, 1, "Range", v, sizeof v), "bytes=20000-");
    struct stat st;
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(st.st_size, N);
    FILE *f = fopen(path, "rb");
    char *got = malloc(N);
    assert_int_equal(fread(got, 1, N, f), N);
    fclose(f);
    assert_memory_equal(got, obj, N);
    unlink(path);
    md_s3_close(s3);
    free(got);
    free(obj);
    free(l);
}

/* Cut every time, with nothing new after the first: give up, remove the file. */
static void test_cut_download_without_progress_fails(void **state)
{
    (void)state;
    static char obj[1000];
    memset(obj, 'z', sizeof obj);
    static const char head1[] = "HTTP/1.1 200 OK\r\nContent-Length: 1000\r\nConnection: close\r\n\r\n";
    static const char head2[] = "HTTP/1.1 206 Partial Content\r\nContent-Length: 500\r\n"
                                "Content-Range: bytes 500-999/1000\r\nConnection: close\r\n\r\n";
    listener *l = listener_new();
    l->acts[l->n_acts++] = (act){ACT_CUT, head1, obj, 1000, 500};
    l->acts[l->n_acts++] = (act){ACT_CUT, head2, obj, 500, 0};
    listener_start(l);
    md_s3 *s3 = local_client(l->port, 5);
    char path[64];
    temp_path(path);
    md_err err;
    assert_int_equal(md_s3_get_path(s3, "x", path, NULL, &err), MD_EUNAVAIL);
    assert_int_equal(access(path, F_OK), -1);
    listener_stop(l);
    md_s3_close(s3);
    free(l);
}

/* A listing follows continuation tokens and strips the handle's prefix. */
typedef struct seen {
    char keys[8][64];
    int64_t sizes[8];
    int n;
} seen;

static int collect(void *ctx, const md_s3_object *o)
{
    seen *s = ctx;
    if (s->n < 8) {
        snprintf(s->keys[s->n], sizeof s->keys[0], "%.63s", o->key);
        s->sizes[s->n] = o->size;
    }
    s->n++;
    return 0;
}

static void test_list_follows_continuation(void **state)
{
    (void)state;
    static const char page1[] =
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?><ListBucketResult xmlns=\"http://s3.amazonaws.com/doc/"
        "2006-03-01/\"><Name>models</Name><Prefix>p/</Prefix><KeyCount>2</KeyCount><MaxKeys>2</MaxKeys>"
        "<IsTruncated>true</IsTruncated><NextContinuationToken>t/1+=</NextContinuationToken>"
        "<Contents><Key>p/a&amp;b</Key><LastModified>2026-01-01T00:00:00.000Z</LastModified>"
        "<ETag>&quot;e1&quot;</ETag><Size>3</Size></Contents>"
        "<Contents><Key>p/c&#233;</Key><Size>0</Size></Contents></ListBucketResult>";
    static const char page2[] =
        "<ListBucketResult><IsTruncated>false</IsTruncated><Contents><Key>p/d</Key><Size>12345678901"
        "</Size></Contents></ListBucketResult>";
    char h1[160], h2[160];
    snprintf(h1, sizeof h1, "HTTP/1.1 200 OK\r\nContent-Length: %zu\r\nConnection: close\r\n\r\n",
             sizeof page1 - 1);
    snprintf(h2, sizeof h2, "HTTP/1.1 200 OK\r\nContent-Length: %zu\r\nConnection: close\r\n\r\n",
             sizeof page2 - 1);
    listener *l = listener_new();
    add_reply(l, h1, page1);
    add_reply(l, h2, page2);
    listener_start(l);
    md_s3 *s3 = local_client(l->port, 5);
    seen s = {0};
    md_err err;
    assert_int_equal(md_s3_list(s3, "", 2, collect, &s, &err), MD_OK);
    listener_stop(l);
    assert_int_equal(s.n, 3);
    assert_string_equal(s.keys[0], "a&b");
    assert_int_equal(s.sizes[0], 3);
    assert_string_equal(s.keys[1], "c\xc3\xa9");
    assert_string_equal(s.keys[2], "d");
    assert_int_equal(s.sizes[2], 12345678901LL);
    assert_true(!strncmp(l->req[0], "GET /models?list-type=2&max-keys=2&prefix=p%2F HTTP/1.1", 55));
    assert_true(!strncmp(l->req[1], "GET /models?continuation-token=t%2F1%2B%3D&list-type=2&max-keys=2"
                                    "&prefix=p%2F HTTP/1.1", 84));
    md_s3_close(s3);
    free(l);
}

/* ---- configuration, URLs, XML ---- */

static void clear_aws_env(void)
{
    static const char *const vars[] = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                                       "AWS_ACCESS_KEY_ID_FILE", "AWS_SECRET_ACCESS_KEY_FILE",
                                       "AWS_SESSION_TOKEN_FILE", "AWS_REGION", "AWS_DEFAULT_REGION",
                                       "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_CA_BUNDLE", NULL};
    for (int i = 0; vars[i]; i++)
        unsetenv(vars[i]);
}

static void test_config_from_env(void **state)
{
    (void)state;
    md_s3_config cfg;
    md_err err;
    clear_aws_env();
    assert_int_equal(md_s3_config_from_env(&cfg, &err), MD_EINVAL);
    assert_msg_has(err.msg, "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", NULL);

    setenv("AWS_ACCESS_KEY_ID", EX_KEY, 1);
    assert_int_equal(md_s3_config_from_env(&cfg, &err), MD_EINVAL);
    assert_msg_has(err.msg, "AWS_ACCESS_KEY_ID is set but AWS_SECRET_ACCESS_KEY is not", NULL);

    char secret_file[64], token_file[64];
    write_temp(secret_file, EX_SECRET "\n");
    write_temp(token_file, "tok\r\n");
    setenv("AWS_SECRET_ACCESS_KEY_FILE", secret_file, 1);
    setenv("AWS_SESSION_TOKEN_FILE", token_file, 1);
    setenv("AWS_DEFAULT_REGION", "eu-west-3", 1);
    setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000/", 1);
    assert_int_equal(md_s3_config_from_env(&cfg, &err), MD_OK);
    assert_string_equal(cfg.secret_access_key, EX_SECRET);
    assert_string_equal(cfg.session_token, "tok");
    assert_string_equal(cfg.region, "eu-west-3");
    assert_string_equal(cfg.endpoint, "http://127.0.0.1:9000");

    setenv("AWS_REGION", "us-west-2", 1); /* AWS_REGION wins, as in the SDKs */
    setenv("AWS_ENDPOINT_URL_S3", "https://minio.example:9000", 1);
    assert_int_equal(md_s3_config_from_env(&cfg, &err), MD_OK);
    assert_string_equal(cfg.region, "us-west-2");
    assert_string_equal(cfg.endpoint, "https://minio.example:9000");
    /* path-style on for a custom endpoint */
    md_s3 *s3 = NULL;
    assert_int_equal(md_s3_open(&cfg, "s3://bkt/pre", NULL, &s3, &err), MD_OK);
    assert_string_equal(md_s3_prefix(s3), "pre/");
    md_s3_close(s3);

    setenv("AWS_SECRET_ACCESS_KEY", "x", 1);
    assert_int_equal(md_s3_config_from_env(&cfg, &err), MD_EINVAL);
    assert_msg_has(err.msg, "both AWS_SECRET_ACCESS_KEY and AWS_SECRET_ACCESS_KEY_FILE", NULL);
    unsetenv("AWS_SECRET_ACCESS_KEY");

    setenv("AWS_SESSION_TOKEN_FILE", "/nonexistent/token", 1);
    assert_int_equal(md_s3_config_from_env(&cfg, &err), MD_EINVAL);
    assert_msg_has(err.msg, "AWS_SESSION_TOKEN_FILE=/nonexistent/token", "cannot be opened", NULL);
    unsetenv("AWS_SESSION_TOKEN_FILE");

    char bad_file[64];
    write_temp(bad_file, "ab\ncd\n"); /* two lines: a wrong file, say */
    setenv("AWS_SECRET_ACCESS_KEY_FILE", bad_file, 1);
    assert_int_equal(md_s3_config_from_env(&cfg, &err), MD_EINVAL);
    assert_msg_has(err.msg, "AWS_SECRET_ACCESS_KEY_FILE", "one line", NULL);
    assert_null(strstr(err.msg, "ab"));
    setenv("AWS_SECRET_ACCESS_KEY_FILE", secret_file, 1);

    setenv("AWS_CA_BUNDLE", secret_file, 1); /* any readable file will do here */
    assert_int_equal(md_s3_config_from_env(&cfg, &err), MD_OK);
    assert_string_equal(cfg.ca_bundle, secret_file);
    setenv("AWS_CA_BUNDLE", "/nonexistent/ca.pem", 1);
    assert_int_equal(md_s3_config_from_env(&cfg, &err), MD_EINVAL);
    assert_msg_has(err.msg, "AWS_CA_BUNDLE=/nonexistent/ca.pem is not a readable file", NULL);
    unsetenv("AWS_CA_BUNDLE");

    setenv("AWS_REGION", "US East", 1);
    assert_int_equal(md_s3_config_from_env(&cfg, &err), MD_EINVAL);
    assert_msg_has(err.msg, "AWS_REGION=US East is not a region", NULL);
    unsetenv("AWS_REGION");
    setenv("AWS_ENDPOINT_URL_S3", "minio:9000", 1);
    assert_int_equal(md_s3_config_from_env(&cfg, &err), MD_EINVAL);
    assert_msg_has(err.msg, "AWS_ENDPOINT_URL_S3=minio:9000", "http(s)://HOST[:PORT]", NULL);
    clear_aws_env();
    unlink(secret_file);
    unlink(token_file);
    unlink(bad_file);
}

static void test_virtual_hosted_addressing(void **state)
{
    (void)state;
    /* reach "AWS" on the listener: the URL must be https://bucket.s3.region...,
     * so ask over http with the same shape through connect_to */
    listener *l = listener_new();
    add_reply(l, OK_HEAD, "");
    listener_start(l);
    md_s3_config cfg = example_config();
    snprintf(cfg.endpoint, sizeof cfg.endpoint, "http://s3.eu-west-1.amazonaws.com");
    cfg.path_style = 0;
    snprintf(cfg.region, sizeof cfg.region, "eu-west-1");
    md_s3_net net;
    md_s3_net_defaults(&net);
    char ct[128];
    snprintf(ct, sizeof ct, "my-bucket.s3.eu-west-1.amazonaws.com:80:127.0.0.1:%d", l->port);
    net.connect_to = ct;
    md_s3 *s3 = NULL;
    md_err err;
    assert_int_equal(md_s3_open(&cfg, "s3://my-bucket/m", &net, &s3, &err), MD_OK);
    assert_int_equal(md_s3_delete(s3, "k", &err), MD_OK);
    listener_stop(l);
    assert_true(!strncmp(l->req[0], "DELETE /m/k HTTP/1.1\r\n", 22));
    char v[256];
    assert_string_equal(req_header(l, 0, "Host", v, sizeof v), "my-bucket.s3.eu-west-1.amazonaws.com");
    req_header(l, 0, "Authorization", v, sizeof v);
    assert_msg_has(v, "/eu-west-1/s3/aws4_request", NULL);
    md_s3_close(s3);
    free(l);
}

static void test_url_and_bucket_rules(void **state)
{
    (void)state;
    char b[64], p[MD_S3_KEY_MAX + 1];
    md_err err;
    assert_int_equal(md_s3_url_parse("s3://my.bucket-1/models/prod", b, p, &err), MD_OK);
    assert_string_equal(b, "my.bucket-1");
    assert_string_equal(p, "models/prod");
    assert_int_equal(md_s3_url_parse("s3://abc", b, p, &err), MD_OK);
    assert_string_equal(p, "");
    static const struct {
        const char *url, *says;
    } bad[] = {
        {"http://b/x", "not an s3:// URL"},
        {"s3:///x", "names no bucket"},
        {"s3://ab/x", "3 to 63"},
        {"s3://My-Bucket/x", "lower-case letters"},
        {"s3://a..b/x", "two '.'"},
        {"s3://-ab/x", "start and end"},
        {"s3://ab-/x", "start and end"},
        {"s3://192.168.5.4/x", "IP address"},
        {"s3://xn--abc/x", "reserved"},
        {"s3://abc-s3alias/x", "reserved"},
        {"s3://a_b/x", "lower-case letters"},
        {"s3://abc/a\nb", "control characters"},
        {"s3://abc/\xff", "UTF-8"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        assert_int_equal(md_s3_url_parse(bad[i].url, b, p, &err), MD_EINVAL);
        assert_msg_has(err.msg, bad[i].says, NULL);
    }
}

static void test_xml_extractor(void **state)
{
    (void)state;
    char out[64];
    const char *x = "<a><KeyCount>2</KeyCount><Key>x&lt;&gt;&amp;&quot;&apos;&#65;&#x42;&#x20AC;</Key></a>";
    assert_int_equal(md_s3_xml_text(x, strlen(x), "Key", out, sizeof out), 1);
    assert_string_equal(out, "x<>&\"'AB\xe2\x82\xac");
    assert_int_equal(md_s3_xml_text(x, strlen(x), "KeyCount", out, sizeof out), 1);
    assert_string_equal(out, "2");
    assert_int_equal(md_s3_xml_text(x, strlen(x), "Size", out, sizeof out), 0);
    assert_int_equal(md_s3_xml_text(x, strlen(x), "Key", out, 4), -1); /* too long */
    static const char *const bad[] = {"<K>&bogus;</K>", "<K>&#0;</K>", "<K>&#xD800;</K>", "<K>&#x110000;</K>",
                                      "<K>&amp</K>", "<K>a<b>c</b></K>", "<K>open", "<K>&#;</K>",
                                      "<K>&#x;</K>"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        assert_int_equal(md_s3_xml_text(bad[i], strlen(bad[i]), "K", out, sizeof out), -1);
    assert_int_equal(md_s3_xml_text("<K/>", 4, "K", out, sizeof out), 1);
    assert_string_equal(out, "");

    char code[32], msg[64];
    const char *e = "<Error><Code>NoSuchKey</Code><Message>The key &quot;a&quot; is gone</Message></Error>";
    md_s3_parse_error(e, strlen(e), code, sizeof code, msg, sizeof msg);
    assert_string_equal(code, "NoSuchKey");
    assert_string_equal(msg, "The key \"a\" is gone");

    int truncated, stopped;
    char token[32];
    md_err err;
    const char *l1 = "<ListBucketResult><IsTruncated>true</IsTruncated></ListBucketResult>";
    assert_int_equal(md_s3_parse_list(l1, strlen(l1), NULL, NULL, &truncated, &stopped, token, sizeof token,
                                      &err), MD_EIO);
    assert_msg_has(err.msg, "NextContinuationToken", NULL);
    const char *l2 = "<ListBucketResult><Contents><Key>a</Key><Size>-1</Size></Contents></ListBucketResult>";
    assert_int_equal(md_s3_parse_list(l2, strlen(l2), NULL, NULL, &truncated, &stopped, token, sizeof token,
                                      &err), MD_EIO);
    const char *l3 = "<Error><Code>AccessDenied</Code></Error>";
    assert_int_equal(md_s3_parse_list(l3, strlen(l3), NULL, NULL, &truncated, &stopped, token, sizeof token,
                                      &err), MD_EIO);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_aws_example_get_object, remove_temps),
        cmocka_unit_test_teardown(test_aws_example_put_object, remove_temps),
        cmocka_unit_test_teardown(test_aws_example_get_lifecycle, remove_temps),
        cmocka_unit_test_teardown(test_aws_example_list_bucket, remove_temps),
        cmocka_unit_test_teardown(test_session_token_is_sent_and_signed, remove_temps),
        cmocka_unit_test(test_query_builder),
        cmocka_unit_test(test_key_encoding),
        cmocka_unit_test(test_dot_segments_are_kept),
        cmocka_unit_test_teardown(test_stall_is_unavailable_within_the_low_speed_limit, remove_temps),
        cmocka_unit_test(test_refused_is_unavailable),
        cmocka_unit_test_teardown(test_slow_down_is_unavailable, remove_temps),
        cmocka_unit_test_teardown(test_forbidden_names_the_settings_not_the_secret, remove_temps),
        cmocka_unit_test_teardown(test_no_such_key_is_not_found, remove_temps),
        cmocka_unit_test(test_mapping_table),
        cmocka_unit_test_teardown(test_cut_download_resumes_with_range, remove_temps),
        cmocka_unit_test_teardown(test_cut_download_starts_over_when_range_is_ignored, remove_temps),
        cmocka_unit_test_teardown(test_cut_download_without_progress_fails, remove_temps),
        cmocka_unit_test(test_list_follows_continuation),
        cmocka_unit_test_teardown(test_config_from_env, remove_temps),
        cmocka_unit_test(test_virtual_hosted_addressing),
        cmocka_unit_test(test_url_and_bucket_rules),
        cmocka_unit_test(test_xml_extractor),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
