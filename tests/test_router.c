/*
 * test_router.c - unit tests of the pure parts of server/server.h (server/router.c)
 * and of the status mapping in config/md_err.h: route matching with {param}
 * segments, 404 versus 405 and the Allow list, the bounded body accumulator,
 * and the JSON error bodies.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "../config/md_err.h"
#include "../server/router.h"

/* ---- routing ---- */

enum {
    R_VERSION_GET,
    R_VERSION_DELETE,
    R_MODELS_GET,
    R_MODELS_POST,
    R_HEALTHZ_GET,
    R_LATEST_GET, /* a second GET matching /models/x/versions/latest */
    R_PREDICT_POST,
    R_V1_PREDICT, /* a literal after the parameter: KServe V1's {name}:predict */
    R_V1_MODEL,
    N_ROUTES
};

static const md_route routes[N_ROUTES] = {
    [R_VERSION_GET] = {"GET", "/models/{name}/versions/{version}", NULL, NULL},
    [R_VERSION_DELETE] = {"DELETE", "/models/{name}/versions/{version}", NULL, NULL},
    [R_MODELS_GET] = {"GET", "/models", NULL, NULL},
    [R_MODELS_POST] = {"POST", "/models", NULL, NULL},
    [R_HEALTHZ_GET] = {"GET", "/healthz", NULL, NULL},
    [R_LATEST_GET] = {"GET", "/models/{name}/versions/latest", NULL, NULL},
    [R_PREDICT_POST] = {"POST", "/predict", NULL, NULL},
    [R_V1_PREDICT] = {"POST", "/v1/models/{name}:predict", NULL, NULL},
    [R_V1_MODEL] = {"GET", "/v1/models/{name}", NULL, NULL},
};

static md_status find(const char *method, const char *path, md_route_match *m, char *allow,
                      size_t allow_size)
{
    memset(m, 0, sizeof *m);
    return md_route_find(routes, N_ROUTES, method, path, m, allow, allow_size);
}

/* Expect `method path` not to match any pattern (404). */
static void expect_not_found(const char *method, const char *path)
{
    md_route_match m;
    char allow[64];
    md_status st = find(method, path, &m, allow, sizeof allow);
    if (st != MD_ENOTFOUND)
        fail_msg("%s %s: expected MD_ENOTFOUND, got %d", method, path, (int)st);
}

/* Expect `method path` to match routes[want]; returns the match in *m. */
static void expect_route(const char *method, const char *path, int want, md_route_match *m)
{
    char allow[64];
    md_status st = find(method, path, m, allow, sizeof allow);
    if (st != MD_OK)
        fail_msg("%s %s: expected MD_OK, got %d", method, path, (int)st);
    assert_ptr_equal(m->route, &routes[want]);
}

static void assert_param(const md_route_match *m, int i, const char *name, const char *value)
{
    assert_true(i < m->n_params);
    assert_int_equal(m->params[i].name_len, strlen(name));
    assert_memory_equal(m->params[i].name, name, strlen(name));
    assert_string_equal(m->params[i].value, value);
}

static void test_exact_match(void **state)
{
    (void)state;
    md_route_match m;
    expect_route("GET", "/healthz", R_HEALTHZ_GET, &m);
    assert_int_equal(m.n_params, 0);
    expect_route("GET", "/models", R_MODELS_GET, &m);
    assert_int_equal(m.n_params, 0);
    expect_route("POST", "/models", R_MODELS_POST, &m);
    assert_int_equal(m.n_params, 0);
}

static void test_params_extracted(void **state)
{
    (void)state;
    md_route_match m;
    expect_route("GET", "/models/mlp/versions/3", R_VERSION_GET, &m);
    assert_int_equal(m.n_params, 2);
    assert_param(&m, 0, "name", "mlp");
    assert_param(&m, 1, "version", "3");

    expect_route("DELETE", "/models/cnn/versions/12", R_VERSION_DELETE, &m);
    assert_int_equal(m.n_params, 2);
    assert_param(&m, 0, "name", "cnn");
    assert_param(&m, 1, "version", "12");
}

static void test_params_percent_decoded(void **state)
{
    (void)state;
    md_route_match m;
    expect_route("GET", "/models/my%2Dmodel/versions/1", R_VERSION_GET, &m);
    assert_param(&m, 0, "name", "my-model");
    expect_route("GET", "/models/my%2dmodel/versions/1", R_VERSION_GET, &m); /* lower-case hex */
    assert_param(&m, 0, "name", "my-model");
    expect_route("GET", "/models/a%20b/versions/%31%30", R_VERSION_GET, &m);
    assert_param(&m, 0, "name", "a b");
    assert_param(&m, 1, "version", "10");
    expect_route("GET", "/models/100%25/versions/1", R_VERSION_GET, &m);
    assert_param(&m, 0, "name", "100%");
    /* an escape as the last characters of a segment */
    expect_route("GET", "/models/x%41/versions/1", R_VERSION_GET, &m);
    assert_param(&m, 0, "name", "xA");
}

static void test_param_with_literal_suffix(void **state)
{
    (void)state;
    md_route_match m;
    char allow[64];
    expect_route("POST", "/v1/models/fashion:predict", R_V1_PREDICT, &m);
    assert_int_equal(m.n_params, 1);
    assert_param(&m, 0, "name", "fashion");
    expect_route("POST", "/v1/models/a:b:predict", R_V1_PREDICT, &m);
    assert_param(&m, 0, "name", "a:b");
    expect_route("POST", "/v1/models/my%2Dmodel:predict", R_V1_PREDICT, &m);
    assert_param(&m, 0, "name", "my-model");
    expect_route("GET", "/v1/models/fashion", R_V1_MODEL, &m);
    assert_param(&m, 0, "name", "fashion");
    /* the parameter is never empty; the literal must end the segment */
    assert_int_equal(find("POST", "/v1/models/:predict", &m, allow, sizeof allow), MD_EMETHOD);
    assert_string_equal(allow, "GET");
    assert_int_equal(find("POST", "/v1/models/fashion:explain", &m, allow, sizeof allow),
                     MD_EMETHOD);
    assert_int_equal(find("POST", "/v1/models/fashion", &m, allow, sizeof allow), MD_EMETHOD);
    expect_not_found("POST", "/v1/models/fashion:predict/x");
}

static void test_bad_params_do_not_match(void **state)
{
    (void)state;
    /* a parameter never spans segments, so an encoded '/' is refused */
    expect_not_found("GET", "/models/a%2Fb/versions/1");
    expect_not_found("GET", "/models/a%2fb/versions/1");
    expect_not_found("GET", "/models/%2F/versions/1");
    /* NUL would truncate the name */
    expect_not_found("GET", "/models/a%00b/versions/1");
    /* malformed escapes */
    expect_not_found("GET", "/models/a%zzb/versions/1");
    expect_not_found("GET", "/models/a%G1/versions/1");
    expect_not_found("GET", "/models/a%2zb/versions/1");
    expect_not_found("GET", "/models/a%4G/versions/1");
    expect_not_found("GET", "/models/a%/versions/1");
    expect_not_found("GET", "/models/a%2/versions/1");
    expect_not_found("GET", "/models/a/versions/1%");
    expect_not_found("GET", "/models/a/versions/1%4");
}

static void test_param_length_limit(void **state)
{
    (void)state;
    md_route_match m;
    char name[300], path[400];
    /* 255 characters fit the 256-byte value with its NUL */
    memset(name, 'n', 255);
    name[255] = '\0';
    snprintf(path, sizeof path, "/models/%s/versions/1", name);
    expect_route("GET", path, R_VERSION_GET, &m);
    assert_param(&m, 0, "name", name);
    /* one more does not fit: refused rather than truncated */
    memset(name, 'n', 256);
    name[256] = '\0';
    snprintf(path, sizeof path, "/models/%s/versions/1", name);
    expect_not_found("GET", path);
}

static void test_shape_mismatches_not_found(void **state)
{
    (void)state;
    /* trailing slash */
    expect_not_found("GET", "/healthz/");
    expect_not_found("GET", "/models/");
    expect_not_found("GET", "/models/a/versions/1/");
    /* extra segment */
    expect_not_found("GET", "/healthz/x");
    expect_not_found("GET", "/models/a/versions/1/x");
    /* too few segments */
    expect_not_found("GET", "/models/a");
    expect_not_found("GET", "/models/a/versions");
    /* empty segment where a parameter is expected */
    expect_not_found("GET", "/models//versions/1");
    expect_not_found("GET", "/models/a/versions/");
    expect_not_found("GET", "//healthz");
    /* unknown */
    expect_not_found("GET", "/nope");
    expect_not_found("GET", "/");
    expect_not_found("GET", "");
    expect_not_found("GET", "/healthzz");
    expect_not_found("GET", "/health");
    expect_not_found("GET", "healthz");
    /* 404 wins over 405: an unknown path is not "method not allowed" */
    expect_not_found("DELETE", "/nope");
}

static void test_method_not_allowed(void **state)
{
    (void)state;
    md_route_match m;
    char allow[64];

    /* two GET routes match /models/x/versions/latest: GET is listed once */
    assert_int_equal(find("POST", "/models/x/versions/latest", &m, allow, sizeof allow),
                     MD_EMETHOD);
    assert_string_equal(allow, "GET, DELETE");

    assert_int_equal(find("POST", "/models/x/versions/1", &m, allow, sizeof allow), MD_EMETHOD);
    assert_string_equal(allow, "GET, DELETE");

    assert_int_equal(find("PUT", "/models", &m, allow, sizeof allow), MD_EMETHOD);
    assert_string_equal(allow, "GET, POST");

    assert_int_equal(find("DELETE", "/healthz", &m, allow, sizeof allow), MD_EMETHOD);
    assert_string_equal(allow, "GET");

    /* HEAD is GET's: on a POST-only path it is not allowed */
    assert_int_equal(find("HEAD", "/predict", &m, allow, sizeof allow), MD_EMETHOD);
    assert_string_equal(allow, "POST");

    /* methods are case-sensitive tokens */
    assert_int_equal(find("get", "/healthz", &m, allow, sizeof allow), MD_EMETHOD);
    assert_string_equal(allow, "GET");
}

static void test_allow_never_overflows(void **state)
{
    (void)state;
    md_route_match m;
    char buf[32];
    memset(buf, 'Z', sizeof buf);
    /* room for "GET" only: the list is cut at a whole method, stays terminated */
    assert_int_equal(find("POST", "/models/x/versions/1", &m, buf, 8), MD_EMETHOD);
    assert_true(strlen(buf) < 8);
    assert_string_equal(buf, "GET");
    for (size_t i = 8; i < sizeof buf; i++)
        assert_int_equal(buf[i], 'Z');
}

static void test_head_matches_get(void **state)
{
    (void)state;
    md_route_match m;
    expect_route("HEAD", "/healthz", R_HEALTHZ_GET, &m);
    expect_route("HEAD", "/models", R_MODELS_GET, &m);
    expect_route("HEAD", "/models/my%2Dmodel/versions/2", R_VERSION_GET, &m);
    assert_param(&m, 0, "name", "my-model");
    assert_param(&m, 1, "version", "2");
}

/* ---- body accumulator ---- */

static void test_body_accumulates(void **state)
{
    (void)state;
    md_body b = {.limit = 100};
    md_err err;
    md_err_clear(&err);
    assert_int_equal(md_body_append(&b, "hello", 5, &err), MD_OK);
    assert_int_equal(b.len, 5);
    assert_string_equal(b.data, "hello");
    assert_int_equal(md_body_append(&b, ", world", 7, &err), MD_OK);
    assert_int_equal(b.len, 12);
    assert_memory_equal(b.data, "hello, world", 12);
    assert_int_equal(b.data[12], '\0');
    /* a zero-length chunk changes nothing */
    assert_int_equal(md_body_append(&b, "", 0, &err), MD_OK);
    assert_int_equal(b.len, 12);
    assert_string_equal(b.data, "hello, world");
    /* bytes are copied verbatim, NULs included */
    assert_int_equal(md_body_append(&b, "a\0b", 3, &err), MD_OK);
    assert_int_equal(b.len, 15);
    assert_memory_equal(b.data + 12, "a\0b", 3);
    assert_int_equal(b.data[15], '\0');
    assert_int_equal(err.status, MD_OK);
    md_body_free(&b);
    assert_null(b.data);
    assert_int_equal(b.len, 0);
    md_body_free(NULL);
}

static void test_body_grows_across_many_chunks(void **state)
{
    (void)state;
    const size_t limit = 1 << 20;
    md_body b = {.limit = limit};
    md_err err;
    char chunk[1000];
    size_t total = 0;
    for (int i = 0; total + sizeof chunk <= limit; i++) {
        memset(chunk, 'a' + i % 26, sizeof chunk);
        assert_int_equal(md_body_append(&b, chunk, sizeof chunk, &err), MD_OK);
        total += sizeof chunk;
        assert_int_equal(b.len, total);
        assert_int_equal(b.data[total], '\0');
    }
    for (size_t off = 0; off < total; off += sizeof chunk)
        assert_int_equal(b.data[off], 'a' + (int)(off / sizeof chunk) % 26);
    assert_true(b.cap >= b.len + 1);
    md_body_free(&b);
}

static void test_body_exactly_at_limit(void **state)
{
    (void)state;
    md_body b = {.limit = 5000};
    md_err err;
    char *big = malloc(5001);
    assert_non_null(big);
    memset(big, 'x', 5001);

    assert_int_equal(md_body_append(&b, big, 3000, &err), MD_OK);
    assert_int_equal(md_body_append(&b, big, 2000, &err), MD_OK);
    assert_int_equal(b.len, 5000);
    assert_int_equal(b.data[5000], '\0');
    md_body_free(&b);

    /* all at once */
    b = (md_body){.limit = 5000};
    assert_int_equal(md_body_append(&b, big, 5000, &err), MD_OK);
    assert_int_equal(b.len, 5000);
    md_body_free(&b);
    free(big);
}

static void test_body_one_byte_over_rejected(void **state)
{
    (void)state;
    md_body b = {.limit = 5000};
    md_err err;
    md_err_clear(&err);
    char *big = malloc(5001);
    assert_non_null(big);
    memset(big, 'y', 5001);

    assert_int_equal(md_body_append(&b, big, 4999, &err), MD_OK);
    assert_int_equal(md_body_append(&b, "ab", 2, &err), MD_ETOOBIG);
    assert_int_equal(err.status, MD_ETOOBIG);
    assert_int_equal(md_status_http(err.status), 413);
    assert_non_null(strstr(err.msg, "5000"));
    assert_non_null(strstr(err.msg, "max_body_bytes"));
    /* nothing of the rejected chunk was buffered */
    assert_int_equal(b.len, 4999);
    assert_int_equal(b.data[4999], '\0');
    assert_true(b.cap <= b.limit + 1);
    for (size_t i = 0; i < 4999; i++)
        if (b.data[i] != 'y')
            fail_msg("byte %zu changed", i);
    /* one byte still fits, then the body is full */
    assert_int_equal(md_body_append(&b, "z", 1, &err), MD_OK);
    assert_int_equal(b.len, 5000);
    assert_int_equal(md_body_append(&b, "z", 1, &err), MD_ETOOBIG);
    assert_int_equal(b.len, 5000);
    assert_true(b.cap <= b.limit + 1);
    md_body_free(&b);

    /* a single chunk one past the limit, on an empty body */
    b = (md_body){.limit = 5000};
    md_err_clear(&err);
    assert_int_equal(md_body_append(&b, big, 5001, &err), MD_ETOOBIG);
    assert_int_equal(b.len, 0);
    assert_non_null(strstr(err.msg, "5000"));
    assert_non_null(strstr(err.msg, "max_body_bytes"));
    md_body_free(&b);

    /* a huge n must not wrap the length check */
    b = (md_body){.limit = 5000};
    assert_int_equal(md_body_append(&b, "q", 1, &err), MD_OK);
    assert_int_equal(md_body_append(&b, big, SIZE_MAX, &err), MD_ETOOBIG);
    assert_int_equal(b.len, 1);
    md_body_free(&b);
    free(big);
}

/* ---- error bodies ---- */

static void test_error_body_shape_default_code(void **state)
{
    (void)state;
    md_err err;
    md_err_set(&err, MD_ENOTFOUND, "model \"%s\" not found", "mlp");
    assert_string_equal(md_err_code(&err), "not_found");
    json_t *body = md_error_body(&err, 0);
    assert_non_null(body);
    assert_true(json_is_object(body));
    assert_int_equal(json_object_size(body), 1);
    json_t *e = json_object_get(body, "error");
    assert_true(json_is_object(e));
    assert_int_equal(json_object_size(e), 2);
    assert_string_equal(json_string_value(json_object_get(e, "code")), "not_found");
    assert_string_equal(json_string_value(json_object_get(e, "message")), "model \"mlp\" not found");
    /* it serialises to JSON that parses back to the same value */
    char *text = json_dumps(body, JSON_COMPACT);
    assert_non_null(text);
    json_t *back = json_loads(text, 0, NULL);
    assert_non_null(back);
    assert_true(json_equal(back, body));
    json_decref(back);
    free(text);
    json_decref(body);

    md_err_set(&err, MD_EBUSY, "queue full");
    body = md_error_body(&err, 0);
    assert_string_equal(
        json_string_value(json_object_get(json_object_get(body, "error"), "code")), "overloaded");
    json_decref(body);
}

static void test_error_body_explicit_code(void **state)
{
    (void)state;
    md_err err;
    md_err_setc(&err, MD_ENOTFOUND, "model_not_found", "no model named %s", "cnn");
    assert_string_equal(md_err_code(&err), "model_not_found");
    json_t *body = md_error_body(&err, 0);
    json_t *e = json_object_get(body, "error");
    assert_string_equal(json_string_value(json_object_get(e, "code")), "model_not_found");
    assert_string_equal(json_string_value(json_object_get(e, "message")), "no model named cnn");
    json_decref(body);

    /* md_err_set after md_err_setc clears the explicit code */
    md_err_set(&err, MD_EINVAL, "bad");
    assert_string_equal(md_err_code(&err), "invalid_request");
}

static void test_error_body_v2(void **state)
{
    (void)state;
    md_err err;
    md_err_setc(&err, MD_EINVAL, "bad_input", "input \"x\" has 3 values, model expects 4");
    json_t *body = md_error_body(&err, 1);
    assert_true(json_is_object(body));
    assert_int_equal(json_object_size(body), 1);
    json_t *e = json_object_get(body, "error");
    assert_true(json_is_string(e));
    assert_string_equal(json_string_value(e), "input \"x\" has 3 values, model expects 4");
    json_decref(body);
}

static void test_error_body_empty_message(void **state)
{
    (void)state;
    md_err err;
    md_err_set(&err, MD_ETIMEOUT, "%s", "");
    json_t *body = md_error_body(&err, 0);
    const char *msg = json_string_value(json_object_get(json_object_get(body, "error"), "message"));
    assert_non_null(msg);
    assert_true(msg[0] != '\0'); /* a client always gets some text */
    json_decref(body);
    body = md_error_body(&err, 1);
    assert_true(json_is_string(json_object_get(body, "error")));
    assert_true(json_string_value(json_object_get(body, "error"))[0] != '\0');
    json_decref(body);
}

/* ---- status mapping ---- */

static void test_status_http(void **state)
{
    (void)state;
    static const struct {
        md_status st;
        int http;
    } want[] = {
        {MD_OK, 200},          {MD_EINVAL, 400},   {MD_ENOTFOUND, 404}, {MD_EMETHOD, 405},
        {MD_ECONFLICT, 409},   {MD_ETOOBIG, 413},  {MD_EMEDIA, 415},    {MD_EUNPROC, 422},
        {MD_EAUTH, 401},       {MD_EBUSY, 503},    {MD_EUNAVAIL, 503},  {MD_ETIMEOUT, 504},
        {MD_ENOMEM, 503},      {MD_EIO, 500},      {MD_EINTERNAL, 500}, {MD_ENOSPC, 507},
        {MD_EFORBIDDEN, 403},
    };
    assert_int_equal(sizeof want / sizeof want[0], MD_STATUS_COUNT);
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        if (md_status_http(want[i].st) != want[i].http)
            fail_msg("status %d: http %d, want %d", (int)want[i].st, md_status_http(want[i].st),
                     want[i].http);
        /* every status has a non-empty code, distinct from every other */
        const char *code = md_status_code(want[i].st);
        assert_non_null(code);
        assert_true(code[0] != '\0');
        for (size_t j = 0; j < i; j++)
            assert_string_not_equal(code, md_status_code(want[j].st));
    }
    /* out of range is an internal error, never a crash or a 2xx */
    assert_int_equal(md_status_http(MD_STATUS_COUNT), 500);
    assert_int_equal(md_status_http((md_status)-1), 500);
}

static void test_err_set_returns_status(void **state)
{
    (void)state;
    md_err err;
    for (int s = MD_EINVAL; s < MD_STATUS_COUNT; s++) {
        md_err_clear(&err);
        assert_int_equal(md_err_set(&err, (md_status)s, "status %d", s), s);
        assert_int_equal(err.status, s);
        char want[32];
        snprintf(want, sizeof want, "status %d", s);
        assert_string_equal(err.msg, want);
        assert_string_equal(md_err_code(&err), md_status_code((md_status)s));
        assert_int_equal(md_err_setc(&err, (md_status)s, "c", "x"), s);
    }
    /* a NULL err still returns the status */
    assert_int_equal(md_err_set(NULL, MD_EIO, "disk"), MD_EIO);
    /* clear resets everything */
    md_err_setc(&err, MD_EIO, "disk_full", "disk");
    md_err_clear(&err);
    assert_int_equal(err.status, MD_OK);
    assert_string_equal(err.msg, "");
    assert_string_equal(md_err_code(&err), "ok");
    /* a long message is truncated, still terminated */
    char longmsg[2 * MD_ERR_MSG_MAX];
    memset(longmsg, 'm', sizeof longmsg - 1);
    longmsg[sizeof longmsg - 1] = '\0';
    md_err_set(&err, MD_EINVAL, "%s", longmsg);
    assert_int_equal(strlen(err.msg), MD_ERR_MSG_MAX - 1);
}

/* Found by fuzz_config: a config path holding a newline made a two-line
 * error. Messages quote client input; they stay one printable line. */
static void test_err_message_one_line(void **state)
{
    (void)state;
    md_err err;
    md_err_set(&err, MD_EINVAL, "config file %s: not found", "a\nb\r\x1b[31mc\x7f");
    assert_null(strchr(err.msg, '\n'));
    assert_null(strchr(err.msg, '\r'));
    assert_null(strchr(err.msg, '\x1b'));
    assert_null(strchr(err.msg, '\x7f'));
    assert_string_equal(err.msg, "config file a\\x0ab\\x0d\\x1b[31mc\\x7f: not found");
    /* the message becomes a JSON string: bytes that are not UTF-8 are written
     * as \xNN too (jansson refuses them, which turned a 400 into a 500);
     * well-formed UTF-8 passes */
    md_err_set(&err, MD_EINVAL, "model %s / %s / %s", "\xff\xfe", "caf\xc3\xa9",
               "cut \xe2\x82");
    assert_string_equal(err.msg, "model \\xff\\xfe / caf\xc3\xa9 / cut \\xe2\\x82");
    md_err_set(&err, MD_EINVAL, "%s", "\xc0\xaf \xed\xa0\x80 \xf4\x90\x80\x80"); /* overlong, surrogate, past U+10FFFF */
    assert_null(strchr(err.msg, '\xc0'));
    assert_null(strchr(err.msg, '\xed'));
    assert_null(strchr(err.msg, '\xf4'));
}

/* ---- query parameters and "did you mean" ---- */

static void test_query_known_and_unknown(void **state)
{
    (void)state;
    md_route r = {"POST", "/models/{name}/predict", NULL, NULL, "top_k", MD_AUTH_PREDICT};
    md_err err;
    md_err_clear(&err);
    assert_int_equal(md_route_check_query(&r, "top_k", &err), MD_OK);
    assert_int_equal(md_route_check_query(&r, "top", &err), MD_EINVAL);
    assert_string_equal(md_err_code(&err), "unknown_query_parameter");
    assert_non_null(strstr(err.msg, "\"top\""));
    assert_non_null(strstr(err.msg, "it takes: top_k"));
    assert_non_null(strstr(err.msg, "did you mean top_k?"));
    /* version is chosen by the path on routes without {version} */
    assert_int_equal(md_route_check_query(&r, "version", &err), MD_EINVAL);
    assert_non_null(strstr(err.msg, "/versions/VERSION/"));
    /* a prefix of a known name is not accepted (no prefix matching) */
    md_route j = {"GET", "/jobs", NULL, NULL, "status model limit before", MD_AUTH_READ};
    assert_int_equal(md_route_check_query(&j, "mode", &err), MD_EINVAL);
    assert_non_null(strstr(err.msg, "did you mean model?"));
    assert_int_equal(md_route_check_query(&j, "before", &err), MD_OK);
    md_route none = {"GET", "/healthz", NULL, NULL, NULL, MD_AUTH_OPEN};
    assert_int_equal(md_route_check_query(&none, "", &err), MD_EINVAL);
    assert_non_null(strstr(err.msg, "takes no query parameters"));
}

static void test_suggest(void **state)
{
    (void)state;
    const char *names[] = {"fashion", "fashion_cnn", NULL, "mlp"};
    assert_string_equal(md_suggest("fashon", names, 4), "fashion");
    assert_string_equal(md_suggest("FASHION_CN", names, 4), "fashion_cnn");
    assert_string_equal(md_suggest("mpl", names, 4), "mlp");
    assert_null(md_suggest("fashion", names, 4)); /* exact: no suggestion */
    assert_string_equal(md_suggest("Fashion", names, 4), "fashion"); /* case only */
    assert_null(md_suggest("resnet", names, 4));  /* too far */
    assert_null(md_suggest("", names, 4));
    assert_null(md_suggest("x", names, 0));
    char longw[200];
    memset(longw, 'a', sizeof longw - 1);
    longw[sizeof longw - 1] = '\0';
    assert_null(md_suggest(longw, names, 4));
}

/* ---- W3C trace context ---- */

#define TP_OK "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

static void test_traceparent_valid(void **state)
{
    (void)state;
    assert_int_equal(strlen(TP_OK), MD_TRACEPARENT_LEN);
    assert_true(md_traceparent_valid(TP_OK));
    /* another version and any flags are accepted when the layout is version 00's */
    assert_true(md_traceparent_valid("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"));
    assert_true(md_traceparent_valid("00-00000000000000000000000000000001-0000000000000001-ff"));
}

static void test_traceparent_invalid(void **state)
{
    (void)state;
    const char *bad[] = {
        NULL,
        "",
        /* one character short and one too long */
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-011",
        /* upper case hex */
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00F067aa0ba902b7-01",
        /* all-zero trace id, all-zero parent id */
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        /* forbidden version */
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        /* separators moved or replaced */
        "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "004-bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7.01",
        /* non-hex characters, a space, a NUL-free injection attempt */
        "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0 ",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa\"a902b7-01",
        "zz-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        if (md_traceparent_valid(bad[i]))
            fail_msg("accepted invalid traceparent #%zu %s", i, bad[i] ? bad[i] : "(null)");
    }
}

static void test_traceparent_format(void **state)
{
    (void)state;
    const unsigned char trace[16] = {0x4b, 0xf9, 0x2f, 0x35, 0x77, 0xb3, 0x4d, 0xa6,
                                     0xa3, 0xce, 0x92, 0x9d, 0x0e, 0x0e, 0x47, 0x36};
    const unsigned char span[8] = {0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7};
    char out[MD_TRACEPARENT_LEN + 1];
    memset(out, 'x', sizeof out);
    md_traceparent_format(out, trace, span, 1);
    assert_string_equal(out, TP_OK);
    assert_true(md_traceparent_valid(out));
    /* all-zero bytes (a failed random source) still give a valid header */
    const unsigned char zeros[16] = {0};
    md_traceparent_format(out, zeros, zeros, 0);
    assert_string_equal(out, "00-00000000000000000000000000000001-0000000000000001-00");
    assert_true(md_traceparent_valid(out));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_exact_match),
        cmocka_unit_test(test_params_extracted),
        cmocka_unit_test(test_param_with_literal_suffix),
        cmocka_unit_test(test_params_percent_decoded),
        cmocka_unit_test(test_bad_params_do_not_match),
        cmocka_unit_test(test_param_length_limit),
        cmocka_unit_test(test_shape_mismatches_not_found),
        cmocka_unit_test(test_method_not_allowed),
        cmocka_unit_test(test_allow_never_overflows),
        cmocka_unit_test(test_head_matches_get),
        cmocka_unit_test(test_body_accumulates),
        cmocka_unit_test(test_body_grows_across_many_chunks),
        cmocka_unit_test(test_body_exactly_at_limit),
        cmocka_unit_test(test_body_one_byte_over_rejected),
        cmocka_unit_test(test_error_body_shape_default_code),
        cmocka_unit_test(test_error_body_explicit_code),
        cmocka_unit_test(test_error_body_v2),
        cmocka_unit_test(test_error_body_empty_message),
        cmocka_unit_test(test_status_http),
        cmocka_unit_test(test_err_set_returns_status),
        cmocka_unit_test(test_err_message_one_line),
        cmocka_unit_test(test_query_known_and_unknown),
        cmocka_unit_test(test_suggest),
        cmocka_unit_test(test_traceparent_valid),
        cmocka_unit_test(test_traceparent_invalid),
        cmocka_unit_test(test_traceparent_format),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
