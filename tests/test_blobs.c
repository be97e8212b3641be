/*
 * test_blobs.c - one conformance suite for every blobs backend
 * (checkpoint/blobs_impl.h), as the index backends share test_store.
 *
 * Without S3_URL it runs against the directory backend (make unit); under
 * tests/with_s3.sh (make e2e runs it through tests/e2e/test_blobs_seam.py)
 * S3_URL and the AWS_* variables name s3rver behind the SigV4-checking proxy
 * and it runs against the S3 backend with a cache in a temp directory:
 * put then fetch into an empty cache, unknown bytes, an object whose bytes
 * are not the ones asked for (never under a final name), delete, listing,
 * and least-recently-used eviction that never takes a pinned file.
 */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <dirent.h>
#include <ftw.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../checkpoint/blobs_impl.h"

static char blob_url[512]; /* "" = the directory */

typedef struct fx {
    char dir[256];
    md_blobs *b;
} fx;

static void sha_hex(const void *data, size_t n, char out[65])
{
    unsigned char d[32];
    unsigned int len = 0;
    EVP_Digest(data, n, d, &len, EVP_sha256(), NULL);
    for (int i = 0; i < 32; i++)
        snprintf(out + 2 * i, 3, "%02x", d[i]);
}

static void write_file(const char *path, const void *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(data, 1, n, f), n);
    fclose(f);
}

static int cached(fx *f, const char *sha)
{
    char p[512];
    snprintf(p, sizeof p, "%s/blobs/%s", f->dir, sha);
    return access(p, R_OK) == 0;
}

static void drop_cached(fx *f, const char *sha)
{
    char p[512];
    snprintf(p, sizeof p, "%s/blobs/%s", f->dir, sha);
    unlink(p);
}

static int tmp_files(fx *f)
{
    char p[512];
    snprintf(p, sizeof p, "%s/tmp", f->dir);
    DIR *d = opendir(p);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d)))
        n += e->d_name[0] != '.';
    if (d)
        closedir(d);
    return n;
}

/* What blobs.c does with an upload: put, then the file takes its final
 * name in blobs/ (the directory's blob, S3's cache). `seed` makes bytes of
 * `n` bytes; `sha` and `key` receive their names. */
static void store_bytes(fx *f, int seed, size_t n, char sha[65], char key[MD_BLOB_KEY_MAX])
{
    char *data = malloc(n);
    assert_non_null(data);
    for (size_t i = 0; i < n; i++)
        data[i] = (char)(seed * 31 + (int)(i * 7));
    sha_hex(data, n, sha);
    char tmp[512], final[512];
    snprintf(tmp, sizeof tmp, "%s/tmp/upload-%d", f->dir, seed);
    snprintf(final, sizeof final, "%s/blobs/%s", f->dir, sha);
    write_file(tmp, data, n);
    md_err err;
    assert_int_equal(bl_put(f->b, sha, tmp, key, &err), MD_OK);
    assert_int_equal(rename(tmp, final), 0);
    free(data);
}

static int open_backend(fx *f, long long cache_max)
{
    md_blobs_args args = {.url = blob_url, .dir = f->dir, .cache_max_bytes = cache_max,
                          .path_style = -1};
    md_err err;
    md_status st = md_blobs_open(&args, &f->b, &err);
    if (st != MD_OK)
        fprintf(stderr, "blobs open: %s\n", err.msg);
    return st == MD_OK ? 0 : -1;
}

static int setup_with(void **state, long long cache_max)
{
    fx *f = calloc(1, sizeof *f);
    snprintf(f->dir, sizeof f->dir, "/tmp/test_blobs_XXXXXX");
    if (!mkdtemp(f->dir))
        return -1;
    char p[512];
    snprintf(p, sizeof p, "%s/blobs", f->dir);
    mkdir(p, 0755);
    snprintf(p, sizeof p, "%s/tmp", f->dir);
    mkdir(p, 0755);
    *state = f;
    return open_backend(f, cache_max);
}

static int setup(void **state) { return setup_with(state, 0); }
static int setup_small_cache(void **state) { return setup_with(state, 3000); }

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

static int teardown(void **state)
{
    fx *f = *state;
    bl_close(f->b);
    nftw(f->dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    free(f);
    return 0;
}

static void test_ops_complete(void **state)
{
    fx *f = *state;
    assert_null(md_blobs_ops_missing(f->b->ops));
    assert_int_equal(bl_remote(f->b), blob_url[0] != '\0');
}

/* Where the server keeps objects of its own (cluster job outputs under
 * jobs/): blob_url with the prefix normalised to end in '/', for S3; none
 * for the directory. */
static void test_data_url(void **state)
{
    fx *f = *state;
    char url[1200];
    int has = bl_data_url(f->b, url, sizeof url);
    assert_int_equal(has, blob_url[0] != '\0');
    if (has) {
        char want[sizeof blob_url + 2];
        snprintf(want, sizeof want, "%s/", blob_url);
        assert_string_equal(url, want);
    }
    assert_int_equal(bl_data_url(f->b, url, 8), 0); /* no room: none, never a cut URL */
}

/* Put, then fetch: from the cache as it is, and (S3) from the object once
 * the cache lost it, checked and named. */
static void test_put_then_fetch(void **state)
{
    fx *f = *state;
    char sha[65], key[MD_BLOB_KEY_MAX];
    md_err err;
    store_bytes(f, 1, 5000, sha, key);
    assert_int_equal(bl_fetch(f->b, sha, key, &err), MD_OK);
    bl_pin(f->b, sha, 0);
    if (!bl_remote(f->b)) {
        assert_string_equal(key, "");
        return;
    }
    assert_non_null(strstr(key, sha));
    drop_cached(f, sha);
    assert_false(cached(f, sha));
    assert_int_equal(bl_fetch(f->b, sha, key, &err), MD_OK);
    bl_pin(f->b, sha, 0);
    assert_true(cached(f, sha));
    assert_int_equal(tmp_files(f), 0);
}

static void test_unknown_bytes_not_found(void **state)
{
    fx *f = *state;
    md_err err;
    const char *sha = "1111111111111111111111111111111111111111111111111111111111111111";
    assert_int_equal(bl_fetch(f->b, sha, NULL, &err), MD_ENOTFOUND);
    assert_false(cached(f, sha));
}

/* An object that does not hold the bytes asked for is refused and never
 * gets their name; nothing stays in tmp/. */
static void test_wrong_bytes_never_named(void **state)
{
    fx *f = *state;
    if (!bl_remote(f->b))
        skip();
    char sha[65], key[MD_BLOB_KEY_MAX];
    md_err err;
    store_bytes(f, 2, 4000, sha, key);
    const char *other = "2222222222222222222222222222222222222222222222222222222222222222";
    assert_int_equal(bl_fetch(f->b, other, key, &err), MD_EIO);
    assert_string_equal(md_err_code(&err), "blob_corrupt");
    assert_false(cached(f, other));
    assert_int_equal(tmp_files(f), 0);
}

/* remove deletes the object: a later fetch finds nothing; list shows what
 * is stored with its age. */
static int found_key;
static const char *wanted_key;
static int on_key(void *ctx, const char *key, long long age)
{
    (void)ctx;
    if (strcmp(key, wanted_key) == 0 && age >= 0 && age < 3600)
        found_key = 1;
    return 0;
}

static void test_remove_and_list(void **state)
{
    fx *f = *state;
    if (!bl_remote(f->b))
        skip();
    char sha[65], key[MD_BLOB_KEY_MAX];
    md_err err;
    store_bytes(f, 3, 3000, sha, key);
    found_key = 0;
    wanted_key = key;
    assert_int_equal(bl_list(f->b, on_key, NULL, &err), MD_OK);
    assert_true(found_key);
    assert_int_equal(bl_remove(f->b, key, &err), MD_OK);
    drop_cached(f, sha);
    assert_int_equal(bl_fetch(f->b, sha, key, &err), MD_ENOTFOUND);
    found_key = 0;
    assert_int_equal(bl_list(f->b, on_key, NULL, &err), MD_OK);
    assert_false(found_key);
}

/* cache_max_bytes 3000 holds one 2000-byte file: a download evicts the
 * least recently used unpinned one, never a pinned one. */
static void test_eviction_spares_pinned(void **state)
{
    fx *f = *state;
    if (!bl_remote(f->b))
        skip();
    char a[65], b[65], ka[MD_BLOB_KEY_MAX], kb[MD_BLOB_KEY_MAX];
    md_err err;
    store_bytes(f, 4, 2000, a, ka);
    store_bytes(f, 5, 2000, b, kb);
    drop_cached(f, a);
    drop_cached(f, b);
    assert_int_equal(bl_fetch(f->b, a, ka, &err), MD_OK);
    bl_pin(f->b, a, 0);
    assert_int_equal(bl_fetch(f->b, b, kb, &err), MD_OK); /* evicts a */
    assert_false(cached(f, a));
    assert_true(cached(f, b));
    /* b stays pinned (being read) while a comes back: nothing can go */
    assert_int_equal(bl_fetch(f->b, a, ka, &err), MD_OK);
    assert_true(cached(f, a));
    assert_true(cached(f, b));
    bl_pin(f->b, a, 0);
    bl_pin(f->b, b, 0);
}

int main(void)
{
    const char *s3 = getenv("S3_URL");
    if (s3 && s3[0])
        snprintf(blob_url, sizeof blob_url, "%s/conformance-%ld", s3, (long)getpid());
    fprintf(stderr, "blobs backend: %s\n", blob_url[0] ? blob_url : "directory");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_ops_complete, setup, teardown),
        cmocka_unit_test_setup_teardown(test_data_url, setup, teardown),
        cmocka_unit_test_setup_teardown(test_put_then_fetch, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unknown_bytes_not_found, setup, teardown),
        cmocka_unit_test_setup_teardown(test_wrong_bytes_never_named, setup, teardown),
        cmocka_unit_test_setup_teardown(test_remove_and_list, setup, teardown),
        cmocka_unit_test_setup_teardown(test_eviction_spares_pinned, setup_small_cache,
                                        teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
