/*
 * test_config.c - unit tests of config/config.h: the defaults, the four
 * sources and their precedence (defaults < JSON file < MODELD_* < flags), the
 * flag and variable naming, list settings, the actions, the JSON dump, and
 * every error path, each of which must answer MD_EINVAL with one line naming
 * the source, the key and the value.
 *
 * Every test passes its own NULL-terminated envp (never the real environ) and
 * writes its config files with mkstemp under /tmp, removing them afterwards.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "../config/md_metrics.h"
#include <unistd.h>

#include "../config/config.h"
#include "test_util.h"

/* ---- helpers ---- */

#define ARGV(...) ((char *[]){"modeld", __VA_ARGS__, NULL})
#define ENVP(...) ((char *[]){__VA_ARGS__, NULL})

static char *no_args[] = {"modeld", NULL};
static char *no_env[] = {NULL};

/* Load argv (NULL-terminated, argv[0] the program) and envp into cfg; returns the status. */
static md_status load(md_cfg *cfg, char **argv, char **envp, md_cfg_action *action, md_err *err)
{
    int argc = 0;
    while (argv && argv[argc])
        argc++;
    md_err_clear(err);
    *action = (md_cfg_action)-1;
    return md_cfg_load(cfg, argc, argv, envp, action, err);
}

/* Load and expect MD_EINVAL whose message has every substring given. */
#define EXPECT_EINVAL(argv, envp, ...)                                                   \
    do {                                                                                       \
        md_cfg cfg_;                                                                           \
        md_cfg_action act_;                                                                    \
        md_err err_;                                                                           \
        md_status st_ = load(&cfg_, (argv), (envp), &act_, &err_);                     \
        if (st_ != MD_EINVAL)                                                                  \
            fail_msg("expected MD_EINVAL, got %d (msg \"%s\")", (int)st_, err_.msg);           \
        assert_int_equal(err_.status, MD_EINVAL);                                              \
        assert_null(strchr(err_.msg, '\n')); /* one line */                                    \
        assert_msg_has(err_.msg, __VA_ARGS__, NULL);                                           \
        md_cfg_free(&cfg_);                                                                    \
    } while (0)

static const char *const all_keys[] = {
    "host", "port", "threads", "max_body_bytes", "connection_timeout_s", "keepalive_timeout_s",
    "drain_seconds", "access_log", "log_level", "store", "index_url", "blob_url",
    "cache_max_bytes", "s3_path_style", "max_checkpoint_bytes",
    "max_average_bytes",
    "allowed_paths",
    "allowed_urls", "allowed_s3",
    "download_connect_timeout_s", "download_timeout_s", "download_max_redirects",
    "workers", "intra_op_threads", "max_batch_size", "max_delay_us", "coalesce_us", "queue_limit", "timeout_ms",
    "default_model", "max_request_images", "max_jobs", "job_lease_s", "job_nice",
    "max_image_pixels", "max_jpeg_scans", "max_large_decodes", "prepack_max_bytes", "max_loaded_bytes",
    "job_max_files", "job_retention_s", "job_max_image_bytes",
    "store_poll_ms",
    "allow_private_urls", "test_job_chunk_delay_ms", "admin_token", "admin_token_file",
    "predict_token", "predict_token_file", "metrics_token", "metrics_token_file", "open_admin",
};
#define N_KEYS (sizeof all_keys / sizeof all_keys[0])

static void assert_defaults(const md_cfg *cfg)
{
    assert_string_equal(cfg->host, "127.0.0.1");
    assert_int_equal(cfg->port, 8080);
    assert_int_equal(cfg->threads, 0);
    assert_int_equal(cfg->coalesce_us, 500);
    assert_int_equal(cfg->max_body_bytes, 67108864LL);
    assert_int_equal(cfg->connection_timeout_s, 30);
    assert_int_equal(cfg->keepalive_timeout_s, 75);
    assert_int_equal(cfg->drain_seconds, 5);
    assert_string_equal(cfg->access_log, "stderr");
    assert_string_equal(cfg->log_level, "info");
    assert_string_equal(cfg->store, "./modeld-data");
    assert_int_equal(cfg->max_checkpoint_bytes, 4294967296LL);
    assert_int_equal(cfg->max_average_bytes, 17179869184LL);
    assert_int_equal(cfg->allowed_paths.count, 0);
    assert_int_equal(cfg->allowed_urls.count, 0);
    assert_string_equal(cfg->default_model, "");
    assert_int_equal(cfg->max_request_images, 64);
    assert_int_equal(cfg->max_batch_size, 64);
    assert_int_equal(cfg->timeout_ms, 30000);
    assert_int_equal(cfg->max_jobs, 2);
    assert_int_equal(cfg->job_nice, 19);
    assert_int_equal(cfg->job_lease_s, 30);
    assert_int_equal(cfg->store_poll_ms, 1000);
    assert_int_equal(cfg->allow_private_urls, 0); /* downloads refuse internal addresses */
    assert_int_equal(cfg->test_job_chunk_delay_ms, 0);
    assert_int_equal(cfg->max_loaded_bytes, 0); /* no budget unless one is set */
}

/* ---- defaults ---- */

static void test_defaults(void **state)
{
    (void)state;
    md_cfg cfg;
    md_cfg_defaults(&cfg);
    assert_defaults(&cfg);
    md_cfg_free(&cfg);
}

static void test_load_with_nothing_gives_defaults(void **state)
{
    (void)state;
    md_cfg cfg;
    md_cfg_action action;
    md_err err;
    /* unrelated variables (no MODELD_ prefix) are ignored */
    assert_int_equal(load(&cfg, no_args, ENVP("HOME=/root", "PORT=1", "modeld_port=2"), &action,
                          &err),
                     MD_OK);
    assert_int_equal(action, MD_CFG_RUN);
    assert_defaults(&cfg);
    md_cfg_free(&cfg);

    /* envp NULL and argc 0 mean no environment and no flags */
    assert_int_equal(load(&cfg, NULL, NULL, &action, &err), MD_OK);
    assert_int_equal(action, MD_CFG_RUN);
    assert_defaults(&cfg);
    md_cfg_free(&cfg);
}

static void test_free_zeroes_and_accepts_null(void **state)
{
    (void)state;
    md_cfg_free(NULL);
    md_cfg cfg;
    md_cfg_defaults(&cfg);
    md_cfg_free(&cfg);
    assert_null(cfg.host);
    assert_null(cfg.store);
    assert_null(cfg.allowed_paths.items);
    assert_int_equal(cfg.port, 0);
    md_cfg_free(&cfg); /* twice is harmless once zeroed */
}

/* ---- precedence ---- */

static void test_file_overrides_defaults(void **state)
{
    (void)state;
    char path[64];
    write_temp(path, "{\"port\": 9001, \"drain_seconds\": 7, \"store\": \"/srv/file-store\",\n"
                     " \"max_body_bytes\": 1048576, \"log_level\": \"debug\"}\n");
    md_cfg cfg;
    md_cfg_action action;
    md_err err;
    char **argv = ARGV("--config", path);
    assert_int_equal(load(&cfg, argv, no_env, &action, &err), MD_OK);
    assert_int_equal(action, MD_CFG_RUN);
    assert_int_equal(cfg.port, 9001);
    assert_int_equal(cfg.drain_seconds, 7);
    assert_string_equal(cfg.store, "/srv/file-store");
    assert_int_equal(cfg.max_body_bytes, 1048576LL);
    assert_string_equal(cfg.log_level, "debug");
    /* a key the file does not name keeps its default */
    assert_int_equal(cfg.keepalive_timeout_s, 75);
    assert_string_equal(cfg.access_log, "stderr");
    md_cfg_free(&cfg);

    /* --config=PATH is the same */
    char arg[80];
    snprintf(arg, sizeof arg, "--config=%s", path);
    char *argv2[] = {"modeld", arg, NULL};
    assert_int_equal(load(&cfg, argv2, no_env, &action, &err), MD_OK);
    assert_int_equal(cfg.port, 9001);
    assert_int_equal(cfg.drain_seconds, 7);
    md_cfg_free(&cfg);
    unlink(path);
}

static void test_modeld_config_env_names_the_file(void **state)
{
    (void)state;
    char path[64], var[96];
    write_temp(path, "{\"port\": 9011, \"keepalive_timeout_s\": 11}");
    snprintf(var, sizeof var, "MODELD_CONFIG=%s", path);
    md_cfg cfg;
    md_cfg_action action;
    md_err err;
    assert_int_equal(load(&cfg, no_args, ENVP(var), &action, &err), MD_OK);
    assert_int_equal(cfg.port, 9011);
    assert_int_equal(cfg.keepalive_timeout_s, 11);
    md_cfg_free(&cfg);
    unlink(path);
}

static void test_config_flag_beats_modeld_config(void **state)
{
    (void)state;
    char env_path[64], flag_path[64], var[96];
    write_temp(env_path, "{\"port\": 1111, \"drain_seconds\": 1}");
    write_temp(flag_path, "{\"port\": 2222}");
    snprintf(var, sizeof var, "MODELD_CONFIG=%s", env_path);
    md_cfg cfg;
    md_cfg_action action;
    md_err err;
    char **argv = ARGV("--config", flag_path);
    assert_int_equal(load(&cfg, argv, ENVP(var), &action, &err), MD_OK);
    assert_int_equal(cfg.port, 2222);
    assert_int_equal(cfg.drain_seconds, 5); /* the env's file is not read at all */
    md_cfg_free(&cfg);
    unlink(env_path);
    unlink(flag_path);
}

static void test_env_overrides_file(void **state)
{
    (void)state;
    char path[64];
    write_temp(path, "{\"port\": 9001, \"drain_seconds\": 7, \"store\": \"/from/file\"}");
    md_cfg cfg;
    md_cfg_action action;
    md_err err;
    char **argv = ARGV("--config", path);
    assert_int_equal(load(&cfg, argv,
                          ENVP("MODELD_PORT=9002", "MODELD_STORE=/from/env"), &action, &err),
                     MD_OK);
    assert_int_equal(cfg.port, 9002);
    assert_string_equal(cfg.store, "/from/env");
    assert_int_equal(cfg.drain_seconds, 7); /* only in the file */
    md_cfg_free(&cfg);
    unlink(path);
}

static void test_flags_override_env(void **state)
{
    (void)state;
    char path[64];
    write_temp(path, "{\"port\": 9001, \"drain_seconds\": 7, \"keepalive_timeout_s\": 70}");
    md_cfg cfg;
    md_cfg_action action;
    md_err err;
    /* the flag comes before --config on the command line and still wins */
    char **argv = ARGV("--port", "9003", "--config", path, "--store", "/from/flag");
    assert_int_equal(load(&cfg, argv,
                          ENVP("MODELD_PORT=9002", "MODELD_STORE=/from/env",
                               "MODELD_KEEPALIVE_TIMEOUT_S=71"),
                          &action, &err),
                     MD_OK);
    assert_int_equal(cfg.port, 9003);
    assert_string_equal(cfg.store, "/from/flag");
    assert_int_equal(cfg.keepalive_timeout_s, 71); /* env, no flag */
    assert_int_equal(cfg.drain_seconds, 7);        /* file only */
    assert_int_equal(cfg.connection_timeout_s, 30); /* default */
    md_cfg_free(&cfg);
    unlink(path);
}

static void test_later_flag_wins(void **state)
{
    (void)state;
    md_cfg cfg;
    md_cfg_action action;
    md_err err;
    char **argv = ARGV("--port", "9100", "--port=9200");
    assert_int_equal(load(&cfg, argv, no_env, &action, &err), MD_OK);
    assert_int_equal(cfg.port, 9200);
    md_cfg_free(&cfg);
}

/* ---- flag forms and naming ---- */

static void test_flag_space_and_equals_forms(void **state)
{
    (void)state;
    md_cfg cfg;
    md_cfg_action action;
    md_err err;
    char **argv = ARGV("--port", "9100", "--store=/data/x", "--access-log=off", "--host",
                       "0.0.0.0", "--max-body-bytes=1024");
    assert_int_equal(load(&cfg, argv, no_env, &action, &err), MD_OK);
    assert_int_equal(cfg.port, 9100);
    assert_string_equal(cfg.store, "/data/x");
    assert_string_equal(cfg.access_log, "off");
    assert_string_equal(cfg.host, "0.0.0.0");
    assert_int_equal(cfg.max_body_bytes, 1024LL);
    md_cfg_free(&cfg);

    /* a value containing '=' is kept whole after the first '=' */
    char **argv2 = ARGV("--default-model=a=b");
    assert_int_equal(load(&cfg, argv2, no_env, &action, &err), MD_OK);
    assert_string_equal(cfg.default_model, "a=b");
    md_cfg_free(&cfg);
}

static void test_dashed_flag_and_env_names(void **state)
{
    (void)state;
    md_cfg cfg;
    md_cfg_action action;
    md_err err;
    char **argv = ARGV("--drain-seconds", "12", "--keepalive-timeout-s=13");
    assert_int_equal(load(&cfg, argv, no_env, &action, &err), MD_OK);
    assert_int_equal(cfg.drain_seconds, 12);
    assert_int_equal(cfg.keepalive_timeout_s, 13);
    md_cfg_free(&cfg);

    assert_int_equal(load(&cfg, no_args,
                          ENVP("MODELD_DRAIN_SECONDS=14", "MODELD_MAX_BODY_BYTES=2048",
                               "MODELD_LOG_LEVEL=warn"),
                          &action, &err),
                     MD_OK);
    assert_int_equal(cfg.drain_seconds, 14);
    assert_int_equal(cfg.max_body_bytes, 2048LL);
    assert_string_equal(cfg.log_level, "warn");
    md_cfg_free(&cfg);

    /* only the dashed spelling is a flag */
    EXPECT_EINVAL(ARGV("--drain_seconds", "3"), no_env, "--drain_seconds", "unknown flag");
}

/* ---- lists ---- */

static void test_list_from_env_and_flag(void **state)
{
    (void)state;
    md_cfg cfg;
    md_cfg_action action;
    md_err err;
    assert_int_equal(load(&cfg, no_args, ENVP("MODELD_ALLOWED_PATHS=a,b"), &action, &err),
                     MD_OK);
    assert_int_equal(cfg.allowed_paths.count, 2);
    assert_string_equal(cfg.allowed_paths.items[0], "a");
    assert_string_equal(cfg.allowed_paths.items[1], "b");
    assert_null(cfg.allowed_paths.items[2]);
    assert_int_equal(cfg.allowed_urls.count, 0);
    md_cfg_free(&cfg);

    /* empty items are dropped, never kept as "" (a prefix of every path) */
    assert_int_equal(load(&cfg, no_args, ENVP("MODELD_ALLOWED_PATHS=a,,b,"), &action, &err),
                     MD_OK);
    assert_int_equal(cfg.allowed_paths.count, 2);
    assert_string_equal(cfg.allowed_paths.items[0], "a");
    assert_string_equal(cfg.allowed_paths.items[1], "b");
    md_cfg_free(&cfg);
    assert_int_equal(load(&cfg, no_args, ENVP("MODELD_ALLOWED_PATHS="), &action, &err), MD_OK);
    assert_int_equal(cfg.allowed_paths.count, 0);
    md_cfg_free(&cfg);

    /* a flag replaces the env's list rather than appending to it */
    char **argv = ARGV("--allowed-urls", "https://x/,https://y/", "--allowed-paths=/only");
    assert_int_equal(load(&cfg, argv, ENVP("MODELD_ALLOWED_PATHS=a,b"), &action, &err),
                     MD_OK);
    assert_int_equal(cfg.allowed_paths.count, 1);
    assert_string_equal(cfg.allowed_paths.items[0], "/only");
    assert_null(cfg.allowed_paths.items[1]);
    assert_int_equal(cfg.allowed_urls.count, 2);
    assert_string_equal(cfg.allowed_urls.items[0], "https://x/");
    assert_string_equal(cfg.allowed_urls.items[1], "https://y/");
    md_cfg_free(&cfg);
}

static void test_list_from_json_array(void **state)
{
    (void)state;
    char path[64];
    /* array items are taken whole: a comma inside one does not split it */
    write_temp(path, "{\"allowed_paths\": [\"/data/a\", \"/data/b,c\", \"/data/d\"],\n"
                     " \"allowed_urls\": \"https://u/,https://v/\"}");
    md_cfg cfg;
    md_cfg_action action;
    md_err err;
    char **argv = ARGV("--config", path);
    assert_int_equal(load(&cfg, argv, no_env, &action, &err), MD_OK);
    assert_int_equal(cfg.allowed_paths.count, 3);
    assert_string_equal(cfg.allowed_paths.items[0], "/data/a");
    assert_string_equal(cfg.allowed_paths.items[1], "/data/b,c");
    assert_string_equal(cfg.allowed_paths.items[2], "/data/d");
    assert_null(cfg.allowed_paths.items[3]);
    assert_int_equal(cfg.allowed_urls.count, 2);
    assert_string_equal(cfg.allowed_urls.items[1], "https://v/");
    md_cfg_free(&cfg);

    /* the environment replaces the file's list */
    assert_int_equal(load(&cfg, argv, ENVP("MODELD_ALLOWED_PATHS=/env"), &action, &err), MD_OK);
    assert_int_equal(cfg.allowed_paths.count, 1);
    assert_string_equal(cfg.allowed_paths.items[0], "/env");
    md_cfg_free(&cfg);
    unlink(path);

    /* a list of non-strings is refused, naming the key and the index */
    write_temp(path, "{\"allowed_paths\": [\"/ok\", 5]}");
    EXPECT_EINVAL(ARGV("--config", path), no_env, path, "allowed_paths[1]", "not a string");
    unlink(path);
    write_temp(path, "{\"allowed_paths\": {\"a\": 1}}");
    EXPECT_EINVAL(ARGV("--config", path), no_env, path, "allowed_paths", "array of strings");
    unlink(path);
}

/* ---- actions ---- */

static void test_actions(void **state)
{
    (void)state;
    md_cfg cfg;
    md_cfg_action action;
    md_err err;

    assert_int_equal(load(&cfg, ARGV("--help"), no_env, &action, &err), MD_OK);
    assert_int_equal(action, MD_CFG_HELP);
    md_cfg_free(&cfg);

    assert_int_equal(load(&cfg, ARGV("-h"), no_env, &action, &err), MD_OK);
    assert_int_equal(action, MD_CFG_HELP);
    md_cfg_free(&cfg);

    assert_int_equal(load(&cfg, ARGV("--version"), no_env, &action, &err), MD_OK);
    assert_int_equal(action, MD_CFG_VERSION);
    md_cfg_free(&cfg);

    /* --print-config still loads every source, so it shows the effective values */
    char **argv = ARGV("--port", "9300", "--print-config");
    assert_int_equal(load(&cfg, argv, ENVP("MODELD_DRAIN_SECONDS=9"), &action, &err), MD_OK);
    assert_int_equal(action, MD_CFG_PRINT_CONFIG);
    assert_int_equal(cfg.port, 9300);
    assert_int_equal(cfg.drain_seconds, 9);
    md_cfg_free(&cfg);

    /* --help wins over --print-config wherever it appears */
    assert_int_equal(load(&cfg, ARGV("--help", "--print-config"), no_env, &action, &err),
                     MD_OK);
    assert_int_equal(action, MD_CFG_HELP);
    md_cfg_free(&cfg);
    assert_int_equal(load(&cfg, ARGV("--print-config", "--help"), no_env, &action, &err),
                     MD_OK);
    assert_int_equal(action, MD_CFG_HELP);
    md_cfg_free(&cfg);

    /* --help and --version answer even when the config file is broken */
    char path[64], var[96];
    write_temp(path, "{ not json");
    snprintf(var, sizeof var, "MODELD_CONFIG=%s", path);
    assert_int_equal(load(&cfg, ARGV("--version"), ENVP(var), &action, &err), MD_OK);
    assert_int_equal(action, MD_CFG_VERSION);
    md_cfg_free(&cfg);
    assert_int_equal(load(&cfg, ARGV("--help"), ENVP(var), &action, &err), MD_OK);
    assert_int_equal(action, MD_CFG_HELP);
    md_cfg_free(&cfg);
    /* but --print-config reports it */
    EXPECT_EINVAL(ARGV("--print-config"), ENVP(var), "config file", path, "line 1");
    unlink(path);

    /* print-config with a bad setting is an error, not a dump of a wrong config */
    EXPECT_EINVAL(ARGV("--print-config", "--port", "0"), no_env, "port", "1..65535");
}

static void test_help_lists_flags_and_env(void **state)
{
    (void)state;
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    assert_non_null(f);
    md_cfg_print_help(f);
    assert_int_equal(fclose(f), 0);
    assert_non_null(buf);
    for (size_t i = 0; i < N_KEYS; i++) {
        char flag[80], env[96];
        snprintf(flag, sizeof flag, "--");
        snprintf(env, sizeof env, "MODELD_");
        size_t fn = 2, en = 7;
        for (const char *k = all_keys[i]; *k; k++) {
            flag[fn++] = *k == '_' ? '-' : *k;
            env[en++] = (char)(*k >= 'a' && *k <= 'z' ? *k - 'a' + 'A' : *k);
        }
        flag[fn] = '\0';
        env[en] = '\0';
        assert_msg_has(buf, flag, env, NULL);
    }
    assert_msg_has(buf, "--config", "--print-config", "--version", "debug|info|warn|error", NULL);
    free(buf);
}

/* ---- JSON dump ---- */

/* index_url is printed without its password (userinfo or password=). */
static void test_index_url_masked(void **state)
{
    (void)state;
    md_cfg cfg;
    md_cfg_action action;
    md_err err;
    char **argv = ARGV("--index-url", "postgresql://modeld:s3cret@db:5432/modeld?password=s3cret");
    assert_int_equal(load(&cfg, argv, ENVP("MODELD_LOG_LEVEL=error"), &action, &err), MD_OK);
    assert_string_equal(cfg.index_url, "postgresql://modeld:s3cret@db:5432/modeld?password=s3cret");
    char *text = md_cfg_to_json(&cfg);
    assert_null(strstr(text, "s3cret"));
    assert_non_null(strstr(text, "postgresql://modeld:***@db:5432/modeld?password=***"));
    free(text);
    md_cfg_free(&cfg);
    assert_int_equal(load(&cfg, ARGV("--port", "9400"), ENVP("MODELD_INDEX_URL=postgresql://u@h/d"),
                          &action, &err),
                     MD_OK);
    assert_string_equal(cfg.index_url, "postgresql://u@h/d");
    md_cfg_free(&cfg);
}

static void test_to_json_has_every_key(void **state)
{
    (void)state;
    md_cfg cfg;
    md_cfg_action action;
    md_err err;
    char **argv = ARGV("--port", "9400", "--store", "/s \"quoted\"", "--allowed-paths", "/p,/q");
    assert_int_equal(load(&cfg, argv, ENVP("MODELD_LOG_LEVEL=error"), &action, &err), MD_OK);
    char *text = md_cfg_to_json(&cfg);
    assert_non_null(text);
    json_error_t jerr;
    json_t *root = json_loads(text, 0, &jerr);
    if (!root)
        fail_msg("md_cfg_to_json output does not parse: %s: %s", jerr.text, text);
    assert_true(json_is_object(root));
    assert_int_equal(json_object_size(root), N_KEYS);
    for (size_t i = 0; i < N_KEYS; i++)
        if (!json_object_get(root, all_keys[i]))
            fail_msg("key %s missing from %s", all_keys[i], text);

    assert_true(json_is_integer(json_object_get(root, "port")));
    assert_int_equal(json_integer_value(json_object_get(root, "port")), 9400);
    assert_string_equal(json_string_value(json_object_get(root, "index_url")), "");
    assert_int_equal(json_integer_value(json_object_get(root, "max_body_bytes")), 67108864LL);
    assert_int_equal(json_integer_value(json_object_get(root, "max_checkpoint_bytes")),
                     4294967296LL);
    assert_int_equal(json_integer_value(json_object_get(root, "drain_seconds")), 5);
    assert_string_equal(json_string_value(json_object_get(root, "store")), "/s \"quoted\"");
    assert_string_equal(json_string_value(json_object_get(root, "host")), "127.0.0.1");
    assert_string_equal(json_string_value(json_object_get(root, "log_level")), "error");
    assert_string_equal(json_string_value(json_object_get(root, "access_log")), "stderr");
    assert_string_equal(json_string_value(json_object_get(root, "default_model")), "");
    json_t *paths = json_object_get(root, "allowed_paths");
    assert_true(json_is_array(paths));
    assert_int_equal(json_array_size(paths), 2);
    assert_string_equal(json_string_value(json_array_get(paths, 0)), "/p");
    assert_string_equal(json_string_value(json_array_get(paths, 1)), "/q");
    json_t *urls = json_object_get(root, "allowed_urls");
    assert_true(json_is_array(urls));
    assert_int_equal(json_array_size(urls), 0);

    /* the dump is itself a valid config file that reproduces the settings */
    char path[64];
    write_temp(path, text);
    md_cfg again;
    char **argv2 = ARGV("--config", path);
    assert_int_equal(load(&again, argv2, no_env, &action, &err), MD_OK);
    char *text2 = md_cfg_to_json(&again);
    assert_string_equal(text, text2);
    free(text2);
    md_cfg_free(&again);
    unlink(path);

    json_decref(root);
    free(text);
    md_cfg_free(&cfg);
}

/* ---- errors ---- */

static void test_port_out_of_range_each_source(void **state)
{
    (void)state;
    EXPECT_EINVAL(ARGV("--port", "70000"), no_env, "flag --port", "port", "70000", "65535");
    EXPECT_EINVAL(ARGV("--port=70000"), no_env, "flag --port", "port", "70000", "65535");
    EXPECT_EINVAL(no_args, ENVP("MODELD_PORT=70000"), "environment MODELD_PORT", "port",
                  "70000", "65535");
    EXPECT_EINVAL(ARGV("--port", "0"), no_env, "port", "0", "1..65535");

    char path[64];
    write_temp(path, "{\"port\": 70000}");
    EXPECT_EINVAL(ARGV("--config", path), no_env, "config file", path, "port", "70000",
                  "65535");
    unlink(path);
}

static void test_not_an_integer(void **state)
{
    (void)state;
    EXPECT_EINVAL(ARGV("--port", "abc"), no_env, "flag --port", "port", "abc",
                  "not an integer");
    EXPECT_EINVAL(ARGV("--port", "80x"), no_env, "port", "80x", "not an integer");
    EXPECT_EINVAL(ARGV("--port", ""), no_env, "flag --port", "port", "not an integer");
    EXPECT_EINVAL(no_args, ENVP("MODELD_THREADS=1.5"), "environment MODELD_THREADS", "threads",
                  "1.5", "not an integer");
    EXPECT_EINVAL(ARGV("--max-body-bytes", "99999999999999999999999"), no_env,
                  "max_body_bytes", "99999999999999999999999");

    char path[64];
    write_temp(path, "{\"drain_seconds\": 2.5}");
    EXPECT_EINVAL(ARGV("--config", path), no_env, path, "drain_seconds", "2.5",
                  "not an integer");
    unlink(path);
}

static void test_negative_timeout(void **state)
{
    (void)state;
    EXPECT_EINVAL(ARGV("--connection-timeout-s", "-1"), no_env, "flag --connection-timeout-s",
                  "connection_timeout_s", "-1", "86400");
    EXPECT_EINVAL(no_args, ENVP("MODELD_CONNECTION_TIMEOUT_S=-1"),
                  "environment MODELD_CONNECTION_TIMEOUT_S", "connection_timeout_s", "-1");
    char path[64];
    write_temp(path, "{\"connection_timeout_s\": -1}");
    EXPECT_EINVAL(ARGV("--config", path), no_env, path, "connection_timeout_s", "-1");
    unlink(path);
}

static void test_unknown_names(void **state)
{
    (void)state;
    char path[64];
    write_temp(path, "{\"port\": 9000, \"prot\": 9001}");
    EXPECT_EINVAL(ARGV("--config", path), no_env, "config file", path, "unknown key", "prot",
                  "did you mean port?");
    unlink(path);

    /* each spelling's typo gets the nearest name in that spelling */
    EXPECT_EINVAL(ARGV("--prot", "80"), no_env, "--prot", "unknown flag", "did you mean --port?");
    EXPECT_EINVAL(ARGV("--prot=80"), no_env, "--prot", "unknown flag", "did you mean --port?");
    EXPECT_EINVAL(ARGV("--drain-second", "3"), no_env, "did you mean --drain-seconds?");
    EXPECT_EINVAL(ARGV("--drain_seconds", "3"), no_env, "did you mean --drain-seconds?");
    EXPECT_EINVAL(no_args, ENVP("HOME=/root", "MODELD_PROT=80"), "MODELD_PROT", "unknown",
                  "did you mean MODELD_PORT?");
    /* nothing near: no suggestion */
    md_cfg cfg;
    md_cfg_action act;
    md_err err;
    assert_int_equal(load(&cfg, ARGV("--zzzz", "1"), no_env, &act, &err), MD_EINVAL);
    assert_null(strstr(err.msg, "did you mean"));
    md_cfg_free(&cfg);
}

static void test_missing_or_unreadable_file(void **state)
{
    (void)state;
    char path[64];
    write_temp(path, "{}");
    unlink(path); /* now certainly missing */
    EXPECT_EINVAL(ARGV("--config", path), no_env, "config file", path, "cannot read");

    char var[96];
    snprintf(var, sizeof var, "MODELD_CONFIG=%s", path);
    EXPECT_EINVAL(no_args, ENVP(var), "config file", path, "cannot read");

    if (geteuid() != 0) {
        write_temp(path, "{\"port\": 9000}");
        assert_int_equal(chmod(path, 0), 0);
        EXPECT_EINVAL(ARGV("--config", path), no_env, "config file", path, "cannot read");
        unlink(path);
    }
    /* a directory opens but cannot be read as a file (works as root too) */
    char dir[64];
    strcpy(dir, "/tmp/modeld_test_config_dir_XXXXXX");
    assert_non_null(mkdtemp(dir));
    remember_temp(dir);
    EXPECT_EINVAL(ARGV("--config", dir), no_env, "config file", dir);
    rmdir(dir);
}

static void test_malformed_json(void **state)
{
    (void)state;
    char path[64];
    write_temp(path, "{\n  \"port\": 8080,\n  \"store\": ,\n  \"drain_seconds\": 1\n}\n");
    EXPECT_EINVAL(ARGV("--config", path), no_env, "config file", path, "line 3");
    unlink(path);

    write_temp(path, "");
    EXPECT_EINVAL(ARGV("--config", path), no_env, "config file", path, "invalid JSON");
    unlink(path);

    /* a key given twice is ambiguous: refused */
    write_temp(path, "{\"port\": 1, \"port\": 2}");
    EXPECT_EINVAL(ARGV("--config", path), no_env, "config file", path, "port");
    unlink(path);
}

static void test_top_level_not_object(void **state)
{
    (void)state;
    char path[64];
    write_temp(path, "[{\"port\": 9000}]");
    EXPECT_EINVAL(ARGV("--config", path), no_env, "config file", path, "top level", "object");
    unlink(path);
    write_temp(path, "\"port\"");
    EXPECT_EINVAL(ARGV("--config", path), no_env, "config file", path);
    unlink(path);
}

static void test_wrong_json_type(void **state)
{
    (void)state;
    char path[64];
    write_temp(path, "{\"port\": \"8080\"}");
    EXPECT_EINVAL(ARGV("--config", path), no_env, "config file", path, "port", "\"8080\"",
                  "not an integer");
    unlink(path);
    write_temp(path, "{\"store\": 5}");
    EXPECT_EINVAL(ARGV("--config", path), no_env, path, "store", "5", "not a string");
    unlink(path);
    write_temp(path, "{\"port\": null}");
    EXPECT_EINVAL(ARGV("--config", path), no_env, path, "port", "null");
    unlink(path);
    write_temp(path, "{\"port\": true}");
    EXPECT_EINVAL(ARGV("--config", path), no_env, path, "port", "true");
    unlink(path);
}

static void test_bad_enum(void **state)
{
    (void)state;
    EXPECT_EINVAL(ARGV("--log-level", "loud"), no_env, "flag --log-level", "log_level",
                  "loud", "debug|info|warn|error");
    EXPECT_EINVAL(no_args, ENVP("MODELD_LOG_LEVEL=loud"), "environment MODELD_LOG_LEVEL",
                  "log_level", "loud");
    /* a prefix or an empty value is not a choice */
    EXPECT_EINVAL(ARGV("--log-level", "inf"), no_env, "log_level", "inf");
    EXPECT_EINVAL(ARGV("--log-level", ""), no_env, "log_level");
    EXPECT_EINVAL(ARGV("--log-level", "INFO"), no_env, "log_level", "INFO");
    char path[64];
    write_temp(path, "{\"log_level\": \"loud\"}");
    EXPECT_EINVAL(ARGV("--config", path), no_env, path, "log_level", "loud");
    unlink(path);
}

static void test_flag_missing_value(void **state)
{
    (void)state;
    EXPECT_EINVAL(ARGV("--port"), no_env, "--port", "missing value");
    EXPECT_EINVAL(ARGV("--store", "/x", "--drain-seconds"), no_env, "--drain-seconds",
                  "missing value");
    EXPECT_EINVAL(ARGV("--config"), no_env, "--config", "missing value");
}

static void test_positional_argument(void **state)
{
    (void)state;
    EXPECT_EINVAL(ARGV("serve"), no_env, "serve", "not a flag");
    EXPECT_EINVAL(ARGV("--port", "9000", "extra"), no_env, "extra", "not a flag");
    EXPECT_EINVAL(ARGV("-p"), no_env, "-p");
}

static void test_empty_host_and_store(void **state)
{
    (void)state;
    EXPECT_EINVAL(ARGV("--host", ""), no_env, "flag --host", "host", "empty");
    EXPECT_EINVAL(ARGV("--host="), no_env, "flag --host", "host", "empty");
    EXPECT_EINVAL(no_args, ENVP("MODELD_HOST="), "environment MODELD_HOST", "host", "empty");
    EXPECT_EINVAL(ARGV("--store", ""), no_env, "flag --store", "store", "empty");
    char path[64];
    write_temp(path, "{\"host\": \"\"}");
    EXPECT_EINVAL(ARGV("--config", path), no_env, "config file", path, "host", "empty");
    unlink(path);
}

/* ---- md_metrics: the Prometheus text helpers ---- */

static char *render(void (*fn)(FILE *, void *), void *arg)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    assert_non_null(f);
    fn(f, arg);
    assert_int_equal(fclose(f), 0);
    return buf;
}

static void write_hist(FILE *f, void *h) { md_prom_hist(f, "x_seconds", "model=\"m\"", h); }

static void test_metrics_histogram(void **state)
{
    (void)state;
    static const double b[] = {1, 2, 4};
    md_hist h;
    md_hist_init(&h, b, 3);
    double obs[] = {0.5, 1, 1.5, 4, 5, -1 /* a clock step back counts as 0 */};
    for (size_t i = 0; i < sizeof obs / sizeof obs[0]; i++)
        md_hist_observe(&h, obs[i]);
    assert_int_equal(md_hist_count(&h), 6);
    char *t = render(write_hist, &h);
    assert_string_equal(t, "x_seconds_bucket{model=\"m\",le=\"1\"} 3\n"
                           "x_seconds_bucket{model=\"m\",le=\"2\"} 4\n"
                           "x_seconds_bucket{model=\"m\",le=\"4\"} 5\n"
                           "x_seconds_bucket{model=\"m\",le=\"+Inf\"} 6\n"
                           "x_seconds_sum{model=\"m\"} 12\n"
                           "x_seconds_count{model=\"m\"} 6\n");
    free(t);
    /* quantiles as histogram_quantile: buckets 3 (<=1), 1 (1..2], 1 (2..4], 1 (+Inf) */
    assert_true(fabs(md_hist_quantile(&h, 0.5) - 1.0) < 1e-12);   /* rank 3: top of [0,1] */
    assert_true(fabs(md_hist_quantile(&h, 0.25) - 0.5) < 1e-12);  /* rank 1.5 of 3 in [0,1] */
    assert_true(fabs(md_hist_quantile(&h, 4.5 / 6) - 3.0) < 1e-12); /* half of (2,4] */
    assert_true(fabs(md_hist_quantile(&h, 0.99) - 4.0) < 1e-12);  /* +Inf: the last bound */
    md_hist empty;
    md_hist_init(&empty, b, 3);
    assert_true(isnan(md_hist_quantile(&empty, 0.5)));
}

static void test_metrics_labels_escaped(void **state)
{
    (void)state;
    char l[64] = "";
    md_prom_label(l, sizeof l, "model", "a\"b\\c\nd");
    md_prom_label(l, sizeof l, "v", "1");
    assert_string_equal(l, "model=\"a\\\"b\\\\c\\nd\",v=\"1\"");
    /* too long for the buffer: cut, still NUL-terminated, never overflowing */
    char small[12] = "";
    md_prom_label(small, sizeof small, "model", "abcdefghijklmnop");
    assert_true(strlen(small) < sizeof small);
}

/* ---- tokens ---- */

static void test_tokens_from_env_flags_and_files(void **state)
{
    (void)state;
    md_cfg cfg;
    md_cfg_action action;
    md_err err;
    char path[64];
    write_temp(path, "# rotated 2026-11\nfile-tok-1\n\nfile-tok-2\r\n");
    assert_int_equal(load(&cfg, ARGV("--admin-token-file", path, "--predict-token", "p1,p2"),
                          ENVP("MODELD_ADMIN_TOKEN=env-admin"), &action, &err),
                     MD_OK);
    assert_int_equal(cfg.admin_token.count, 3);
    assert_string_equal(cfg.admin_token.items[0], "env-admin");
    assert_string_equal(cfg.admin_token.items[1], "file-tok-1");
    assert_string_equal(cfg.admin_token.items[2], "file-tok-2");
    assert_int_equal(cfg.predict_token.count, 2);
    assert_int_equal(cfg.metrics_token.count, 0);
    /* --print-config never shows a token */
    char *text = md_cfg_to_json(&cfg);
    assert_null(strstr(text, "env-admin"));
    assert_null(strstr(text, "file-tok"));
    assert_null(strstr(text, "\"p1\""));
    assert_non_null(strstr(text, "<redacted>"));
    free(text);
    md_cfg_free(&cfg);
}

static void test_bad_tokens_refused_without_echo(void **state)
{
    (void)state;
    md_cfg cfg;
    md_cfg_action action;
    md_err err;
    /* a space inside a token: refused, and the message does not quote it */
    assert_int_equal(load(&cfg, ARGV("--admin-token", "secret part"), no_env, &action, &err),
                     MD_EINVAL);
    assert_msg_has(err.msg, "admin_token", "token 1", NULL);
    assert_null(strstr(err.msg, "secret"));
    md_cfg_free(&cfg);
    /* a file that is missing or holds no token */
    assert_int_equal(load(&cfg, ARGV("--metrics-token-file", "/nonexistent/tokens"), no_env,
                          &action, &err),
                     MD_EINVAL);
    assert_msg_has(err.msg, "metrics_token_file", "/nonexistent/tokens", NULL);
    md_cfg_free(&cfg);
    char path[64];
    write_temp(path, "# nothing yet\n\n");
    assert_int_equal(load(&cfg, ARGV("--predict-token-file", path), no_env, &action, &err),
                     MD_EINVAL);
    assert_msg_has(err.msg, "predict_token_file", "holds no token", NULL);
    md_cfg_free(&cfg);
}

/* Issue 24: a predict or metrics token without an admin token left the admin
 * routes open behind a server that looked guarded; refused unless open_admin. */
static void test_tokens_without_admin_token_need_open_admin(void **state)
{
    (void)state;
    EXPECT_EINVAL(ARGV("--predict-token", "p1"), no_env, "predict_token", "admin_token",
                  "open_admin", "--open-admin");
    EXPECT_EINVAL(ARGV("--open-admin=false"), ENVP("MODELD_METRICS_TOKEN=m1"), "metrics_token",
                  "admin_token", "open_admin");
    md_cfg cfg;
    md_cfg_action action;
    md_err err;
    /* no token at all: open, as before */
    assert_int_equal(load(&cfg, ARGV("--port", "9000"), no_env, &action, &err), MD_OK);
    assert_int_equal(cfg.open_admin, 0);
    md_cfg_free(&cfg);
    /* an admin token guards them */
    assert_int_equal(load(&cfg, ARGV("--predict-token", "p1", "--admin-token", "a1"), no_env,
                          &action, &err),
                     MD_OK);
    md_cfg_free(&cfg);
    /* open_admin from each source; a bare flag means true and takes no value */
    assert_int_equal(load(&cfg, ARGV("--predict-token", "p1", "--open-admin", "--port", "9001"),
                          no_env, &action, &err),
                     MD_OK);
    assert_int_equal(cfg.open_admin, 1);
    assert_int_equal(cfg.port, 9001);
    md_cfg_free(&cfg);
    assert_int_equal(load(&cfg, ARGV("--predict-token", "p1", "--open-admin", "true"), no_env,
                          &action, &err),
                     MD_OK);
    assert_int_equal(cfg.open_admin, 1);
    md_cfg_free(&cfg);
    assert_int_equal(load(&cfg, ARGV("--predict-token", "p1"), ENVP("MODELD_OPEN_ADMIN=1"),
                          &action, &err),
                     MD_OK);
    assert_int_equal(cfg.open_admin, 1);
    md_cfg_free(&cfg);
    char path[64];
    write_temp(path, "{\"open_admin\": true, \"predict_token\": [\"p1\"]}");
    assert_int_equal(load(&cfg, ARGV("--config", path), no_env, &action, &err), MD_OK);
    assert_int_equal(cfg.open_admin, 1);
    char *text = md_cfg_to_json(&cfg);
    assert_non_null(strstr(text, "\"open_admin\": true"));
    free(text);
    md_cfg_free(&cfg);
    unlink(path);
    /* not a boolean */
    EXPECT_EINVAL(ARGV("--open-admin", "maybe"), no_env, "--open-admin", "open_admin", "maybe");
    EXPECT_EINVAL(ARGV("--port", "9000"), ENVP("MODELD_OPEN_ADMIN=yes"), "MODELD_OPEN_ADMIN",
                  "yes");
    write_temp(path, "{\"open_admin\": 1}");
    EXPECT_EINVAL(ARGV("--config", path), no_env, "open_admin", "true or false");
    unlink(path);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_tokens_from_env_flags_and_files, remove_temps),
        cmocka_unit_test_teardown(test_bad_tokens_refused_without_echo, remove_temps),
        cmocka_unit_test_teardown(test_tokens_without_admin_token_need_open_admin, remove_temps),
        cmocka_unit_test(test_metrics_histogram),
        cmocka_unit_test(test_metrics_labels_escaped),
        cmocka_unit_test_teardown(test_defaults, remove_temps),
        cmocka_unit_test_teardown(test_load_with_nothing_gives_defaults, remove_temps),
        cmocka_unit_test_teardown(test_free_zeroes_and_accepts_null, remove_temps),
        cmocka_unit_test_teardown(test_file_overrides_defaults, remove_temps),
        cmocka_unit_test_teardown(test_modeld_config_env_names_the_file, remove_temps),
        cmocka_unit_test_teardown(test_config_flag_beats_modeld_config, remove_temps),
        cmocka_unit_test_teardown(test_env_overrides_file, remove_temps),
        cmocka_unit_test_teardown(test_flags_override_env, remove_temps),
        cmocka_unit_test_teardown(test_later_flag_wins, remove_temps),
        cmocka_unit_test_teardown(test_flag_space_and_equals_forms, remove_temps),
        cmocka_unit_test_teardown(test_dashed_flag_and_env_names, remove_temps),
        cmocka_unit_test_teardown(test_list_from_env_and_flag, remove_temps),
        cmocka_unit_test_teardown(test_list_from_json_array, remove_temps),
        cmocka_unit_test_teardown(test_actions, remove_temps),
        cmocka_unit_test_teardown(test_help_lists_flags_and_env, remove_temps),
        cmocka_unit_test_teardown(test_to_json_has_every_key, remove_temps),
        cmocka_unit_test(test_index_url_masked),
        cmocka_unit_test_teardown(test_port_out_of_range_each_source, remove_temps),
        cmocka_unit_test_teardown(test_not_an_integer, remove_temps),
        cmocka_unit_test_teardown(test_negative_timeout, remove_temps),
        cmocka_unit_test_teardown(test_unknown_names, remove_temps),
        cmocka_unit_test_teardown(test_missing_or_unreadable_file, remove_temps),
        cmocka_unit_test_teardown(test_malformed_json, remove_temps),
        cmocka_unit_test_teardown(test_top_level_not_object, remove_temps),
        cmocka_unit_test_teardown(test_wrong_json_type, remove_temps),
        cmocka_unit_test_teardown(test_bad_enum, remove_temps),
        cmocka_unit_test_teardown(test_flag_missing_value, remove_temps),
        cmocka_unit_test_teardown(test_positional_argument, remove_temps),
        cmocka_unit_test_teardown(test_empty_host_and_store, remove_temps),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
