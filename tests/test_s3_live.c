/*
 * test_s3_live.c - the S3 client (checkpoint/s3.c) against a real S3 server:
 * npm's s3rver behind the SigV4-checking proxy of tests/e2e/s3.py, so every
 * request here is also checked for its signature the way S3 checks it. Run
 * only under tests/with_s3.sh (make s3-live, part of make test), which
 * exports AWS_* for it, S3_URL, S3RVER_PID and S3_HARNESS_CONTROL:
 *  - put, head, get, delete of keys with characters that need encoding;
 *  - a put with a known sha256: S3 refuses bytes that are not those;
 *  - a ~20 MB object whose download the proxy cuts mid-way: it resumes with
 *    Range and arrives whole;
 *  - a listing of more than one page (max-keys 2) with continuation tokens;
 *  - a wrong secret: 403 -> MD_EFORBIDDEN, naming the settings, not the secret;
 *  - s3rver stopped (SIGSTOP): MD_EUNAVAIL within the low-speed bound, and the
 *    same client works again once it is continued.
 */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <curl/curl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include "../checkpoint/s3.h"
#include "test_util.h"

static const char *env_or_fail(const char *name)
{
    const char *v = getenv(name);
    if (!v || !*v)
        fail_msg("%s is not set: run this under tests/with_s3.sh", name);
    return v;
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* A client from the environment, as modeld makes one; a unique run prefix
 * keeps repeated runs on one server apart. */
static md_s3 *client(const char *secret_override, long low_speed_time_s)
{
    md_s3_config cfg;
    md_err err;
    if (md_s3_config_from_env(&cfg, &err) != MD_OK)
        fail_msg("%s", err.msg);
    if (secret_override)
        snprintf(cfg.secret_access_key, sizeof cfg.secret_access_key, "%s", secret_override);
    md_s3_net net;
    md_s3_net_defaults(&net);
    if (low_speed_time_s) {
        net.low_speed_time_s = low_speed_time_s;
        net.request_timeout_ms = 0; /* the low-speed limit alone must end a stall */
    }
    char url[256];
    snprintf(url, sizeof url, "%s/run-%ld", env_or_fail("S3_URL"), (long)getpid());
    md_s3 *s3 = NULL;
    if (md_s3_open(&cfg, url, &net, &s3, &err) != MD_OK)
        fail_msg("%s", err.msg);
    return s3;
}

/* POST or GET to the proxy's control knob; the answer into out. */
static void control(const char *what, int post, char *out, size_t size)
{
    char url[256];
    snprintf(url, sizeof url, "%s/%s", env_or_fail("S3_HARNESS_CONTROL"), what);
    FILE *mem = fmemopen(out, size, "w");
    CURL *c = curl_easy_init();
    curl_easy_setopt(c, CURLOPT_URL, url);
    if (post)
        curl_easy_setopt(c, CURLOPT_POSTFIELDS, "");
    curl_easy_setopt(c, CURLOPT_WRITEDATA, mem);
    curl_easy_setopt(c, CURLOPT_TIMEOUT, 10L);
    assert_int_equal(curl_easy_perform(c), CURLE_OK);
    curl_easy_cleanup(c);
    fclose(mem);
}

static long stat_of(const char *name)
{
    char buf[256] = "";
    control("stats", 0, buf, sizeof buf);
    char pat[32];
    snprintf(pat, sizeof pat, "%s=", name);
    const char *p = strstr(buf, pat);
    assert_non_null(p);
    return strtol(p + strlen(pat), NULL, 10);
}

static void write_file(const char *path, const char *data, size_t len)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(data, 1, len, f), len);
    fclose(f);
}

static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    *len = (size_t)n;
    return buf;
}

static void test_put_head_get_delete(void **state)
{
    (void)state;
    md_s3 *s3 = client(NULL, 0);
    static const char *const keys[] = {"models/plain.pt", "models/a b+c=d&e$f.pt",
                                       "models/caf\xc3\xa9/(1)~'x'.pt"};
    char src[64], dst[64];
    write_temp(src, "checkpoint bytes \x01\x02\x03");
    temp_path(dst);
    for (size_t i = 0; i < sizeof keys / sizeof *keys; i++) {
        md_err err;
        md_s3_object info;
        if (md_s3_put_file(s3, keys[i], src, &err) != MD_OK)
            fail_msg("put %s: %s", keys[i], err.msg);
        assert_int_equal(md_s3_head(s3, keys[i], &info, &err), MD_OK);
        assert_int_equal(info.size, 20);
        assert_true(strlen(info.etag) > 2);
        if (md_s3_get_path(s3, keys[i], dst, &info, &err) != MD_OK)
            fail_msg("get %s: %s", keys[i], err.msg);
        size_t n;
        char *got = read_file(dst, &n);
        assert_int_equal(n, 20);
        assert_memory_equal(got, "checkpoint bytes \x01\x02\x03", 20);
        free(got);
        assert_int_equal(md_s3_delete(s3, keys[i], &err), MD_OK);
        assert_int_equal(md_s3_head(s3, keys[i], &info, &err), MD_ENOTFOUND);
        assert_int_equal(md_s3_get_path(s3, keys[i], dst, &info, &err), MD_ENOTFOUND);
        assert_msg_has(err.msg, "no object", NULL);
    }
    unlink(src);
    md_s3_close(s3);
}

/* A known sha256 is sent as is, and S3 holds the bytes to it. */
static void test_put_with_a_known_sha256(void **state)
{
    (void)state;
    md_s3 *s3 = client(NULL, 0);
    char src[64];
    write_temp(src, "blob bytes");
    /* sha256("blob bytes") */
    static const char right[] = "269d6dd0cedf40e040fbe1b1be1860175a7bb24322549b9064c531f525af3a5b";
    static const char wrong[] = "0000000000000000000000000000000000000000000000000000000000000000";
    md_err err;
    md_s3_object info;
    assert_int_equal(md_s3_put_file_sha256(s3, "blobs/x", src, wrong, &err), MD_EIO);
    assert_msg_has(err.msg, "400", "XAmzContentSHA256Mismatch", "blobs/x", NULL);
    assert_int_equal(md_s3_head(s3, "blobs/x", &info, &err), MD_ENOTFOUND);
    if (md_s3_put_file_sha256(s3, "blobs/x", src, right, &err) != MD_OK)
        fail_msg("put: %s", err.msg);
    assert_int_equal(md_s3_head(s3, "blobs/x", &info, &err), MD_OK);
    assert_int_equal(info.size, 10);
    assert_int_equal(md_s3_put_file_sha256(s3, "blobs/x", src, "ABC", &err), MD_EINVAL);
    assert_int_equal(md_s3_delete(s3, "blobs/x", &err), MD_OK);
    unlink(src);
    md_s3_close(s3);
}

static void test_large_object_cut_and_resumed(void **state)
{
    (void)state;
    enum { N = 20 * 1000 * 1000 + 7 };
    char *obj = malloc(N);
    uint32_t x = 2463534242u;
    for (size_t i = 0; i < N; i++) { /* xorshift: no run the resume could skip unnoticed */
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        obj[i] = (char)x;
    }
    char src[64], dst[64];
    temp_path(src);
    temp_path(dst);
    write_file(src, obj, N);
    md_s3 *s3 = client(NULL, 0);
    md_err err;
    if (md_s3_put_file(s3, "big/model.pt", src, &err) != MD_OK)
        fail_msg("put: %s", err.msg);
    long cuts = stat_of("cuts");
    char ok[16];
    control("cut?after=7000000", 1, ok, sizeof ok);
    md_s3_object info;
    if (md_s3_get_path(s3, "big/model.pt", dst, &info, &err) != MD_OK)
        fail_msg("get: %s", err.msg);
    assert_int_equal(stat_of("cuts"), cuts + 1); /* it was cut, and still arrived whole */
    assert_int_equal(info.size, N);
    size_t n;
    char *got = read_file(dst, &n);
    assert_int_equal(n, N);
    assert_memory_equal(got, obj, N);
    free(got);
    assert_int_equal(md_s3_delete(s3, "big/model.pt", &err), MD_OK);
    unlink(src);
    free(obj);
    md_s3_close(s3);
}

typedef struct listing {
    char keys[16][64];
    int n;
} listing;

static int collect(void *ctx, const md_s3_object *o)
{
    listing *l = ctx;
    if (l->n < 16)
        snprintf(l->keys[l->n], sizeof l->keys[0], "%.63s", o->key);
    l->n++;
    return 0;
}

static void test_list_pages(void **state)
{
    (void)state;
    md_s3 *s3 = client(NULL, 0);
    char src[64];
    write_temp(src, "x");
    md_err err;
    static const char *const keys[] = {"ds/a", "ds/b b", "ds/c+", "ds/d/e", "ds/f", "ds/g", "ds/h"};
    enum { K = sizeof keys / sizeof *keys };
    for (int i = 0; i < K; i++)
        if (md_s3_put_file(s3, keys[i], src, &err) != MD_OK)
            fail_msg("put %s: %s", keys[i], err.msg);
    if (md_s3_put_file(s3, "other/z", src, &err) != MD_OK) /* not under ds/ */
        fail_msg("put: %s", err.msg);
    long pages = stat_of("lists");
    listing l = {0};
    if (md_s3_list(s3, "ds/", 2, collect, &l, &err) != MD_OK)
        fail_msg("list: %s", err.msg);
    assert_int_equal(l.n, K);
    for (int i = 0; i < K; i++)
        assert_string_equal(l.keys[i], keys[i]);
    assert_int_equal(stat_of("lists") - pages, (K + 1) / 2); /* 4 pages of at most 2 */
    for (int i = 0; i < K; i++)
        assert_int_equal(md_s3_delete(s3, keys[i], &err), MD_OK);
    assert_int_equal(md_s3_delete(s3, "other/z", &err), MD_OK);
    l.n = 0;
    assert_int_equal(md_s3_list(s3, "ds/", 2, collect, &l, &err), MD_OK);
    assert_int_equal(l.n, 0);
    unlink(src);
    md_s3_close(s3);
}

static void test_wrong_secret_is_forbidden(void **state)
{
    (void)state;
    static const char wrong[] = "not-the-secret-0123456789abcdef";
    md_s3 *s3 = client(wrong, 0);
    char src[64], dst[64];
    write_temp(src, "x");
    temp_path(dst);
    md_err err;
    long refused = stat_of("refused");
    assert_int_equal(md_s3_put_file(s3, "models/w.pt", src, &err), MD_EFORBIDDEN);
    assert_msg_has(err.msg, "SignatureDoesNotMatch", "models/w.pt", "AWS_SECRET_ACCESS_KEY", NULL);
    assert_null(strstr(err.msg, wrong));
    assert_null(strstr(err.msg, getenv("AWS_SECRET_ACCESS_KEY")));
    assert_int_equal(md_s3_get_path(s3, "models/w.pt", dst, NULL, &err), MD_EFORBIDDEN);
    assert_int_equal(access(dst, F_OK), -1);
    md_s3_object info;
    assert_int_equal(md_s3_head(s3, "models/w.pt", &info, &err), MD_EFORBIDDEN);
    listing l = {0};
    assert_int_equal(md_s3_list(s3, "", 0, collect, &l, &err), MD_EFORBIDDEN);
    assert_true(stat_of("refused") >= refused + 4);
    unlink(src);
    md_s3_close(s3);
}

static pid_t stopped_pid;

static int continue_s3rver(void **state)
{
    (void)state;
    if (stopped_pid > 0)
        kill(stopped_pid, SIGCONT);
    stopped_pid = 0;
    return remove_temps(state);
}

static void test_stopped_server_is_unavailable_within_the_bound(void **state)
{
    (void)state;
    md_s3 *s3 = client(NULL, 2);
    char src[64], dst[64];
    write_temp(src, "before the stop");
    temp_path(dst);
    md_err err;
    assert_int_equal(md_s3_put_file(s3, "models/s.pt", src, &err), MD_OK);
    stopped_pid = (pid_t)atol(env_or_fail("S3RVER_PID"));
    assert_int_equal(kill(stopped_pid, SIGSTOP), 0);
    double t0 = now_s();
    md_s3_object info;
    assert_int_equal(md_s3_head(s3, "models/s.pt", &info, &err), MD_EUNAVAIL);
    assert_msg_has(err.msg, "did not answer", "retry later", NULL);
    assert_int_equal(md_s3_get_path(s3, "models/s.pt", dst, &info, &err), MD_EUNAVAIL);
    assert_int_equal(access(dst, F_OK), -1);
    /* two calls, each ended by a 2 s low-speed limit: loose enough for a
     * loaded machine, and a call that hung would never get here */
    assert_true(now_s() - t0 < 40.0);
    assert_int_equal(kill(stopped_pid, SIGCONT), 0);
    stopped_pid = 0;
    /* the same client works again: poll with a deadline, no sleep-and-hope */
    md_status st = MD_EUNAVAIL;
    for (double deadline = now_s() + 30; st != MD_OK && now_s() < deadline;)
        st = md_s3_head(s3, "models/s.pt", &info, &err);
    assert_int_equal(st, MD_OK);
    assert_int_equal(info.size, 15);
    assert_int_equal(md_s3_delete(s3, "models/s.pt", &err), MD_OK);
    unlink(src);
    md_s3_close(s3);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_put_head_get_delete, remove_temps),
        cmocka_unit_test_teardown(test_put_with_a_known_sha256, remove_temps),
        cmocka_unit_test_teardown(test_large_object_cut_and_resumed, remove_temps),
        cmocka_unit_test_teardown(test_list_pages, remove_temps),
        cmocka_unit_test_teardown(test_wrong_secret_is_forbidden, remove_temps),
        cmocka_unit_test_teardown(test_stopped_server_is_unavailable_within_the_bound, continue_s3rver),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
