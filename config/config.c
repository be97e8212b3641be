/*
 * config.c - settings table, the four sources, validation, help and JSON dump.
 *
 * Every setting is one row of `settings`: key, type, offset into md_cfg,
 * default, bounds and help. Flag and environment names are derived from the
 * key, so a new setting is one row and is at once a JSON key, a flag, an
 * environment variable, a line of --help and a field of --print-config.
 */
#include "config.h"

#include <ctype.h>
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

typedef enum { T_INT, T_SIZE, T_STR, T_ENUM, T_LIST, T_BOOL } setting_type;

typedef struct setting {
    const char *key;
    setting_type type;
    size_t offset;
    long long min, max;      /* T_INT, T_SIZE */
    const char *def;         /* default, as text */
    const char *choices;     /* T_ENUM: "a|b|c" */
    const char *help;
} setting;

#define OFF(f) offsetof(md_cfg, f)
#define MiB (1024LL * 1024)
#define GiB (1024LL * MiB)

static const setting settings[] = {
    {"host", T_STR, OFF(host), 0, 0, "127.0.0.1", NULL, "address to listen on (0.0.0.0 for all)"},
    {"port", T_INT, OFF(port), 1, 65535, "8080", NULL, "TCP port to listen on"},
    {"threads", T_INT, OFF(threads), 0, 1024, "0", NULL, "HTTP threads; 0 = one per core"},
    {"max_body_bytes", T_SIZE, OFF(max_body_bytes), 1, 64 * GiB, "67108864", NULL,
     "largest request body accepted (413 past it)"},
    {"connection_timeout_s", T_INT, OFF(connection_timeout_s), 1, 86400, "30", NULL,
     "drop a connection whose request makes no progress for this long"},
    {"keepalive_timeout_s", T_INT, OFF(keepalive_timeout_s), 1, 86400, "75", NULL,
     "close an idle keep-alive connection after this long"},
    {"drain_seconds", T_INT, OFF(drain_seconds), 0, 3600, "5", NULL,
     "on SIGTERM, report not ready this long before closing the listener"},
    {"access_log", T_STR, OFF(access_log), 0, 0, "stderr", NULL,
     "where to write one JSON line per request: stderr, off, or a file path"},
    {"log_level", T_ENUM, OFF(log_level), 0, 0, "info", "debug|info|warn|error",
     "least severe message logged"},
    {"store", T_STR, OFF(store), 0, 0, "./modeld-data", NULL,
     "store directory: index.sqlite and checkpoint blobs"},
    {"index_url", T_STR, OFF(index_url), 0, 0, "", NULL,
     "where the index (models, versions, settings, jobs) lives: empty = index.sqlite in the "
     "store directory; postgresql://USER:PASSWORD@HOST:PORT/DB?sslmode=... (a libpq URI) = "
     "PostgreSQL 15, shared by replicas on several hosts (the store directory keeps the "
     "blobs); the password is never printed"},
    {"blob_url", T_STR, OFF(blob_url), 0, 0, "", NULL,
     "where checkpoint bytes live: empty = blobs/ in the store directory; s3://BUCKET/PREFIX "
     "= S3 or any S3-compatible storage (credentials, region and endpoint from AWS_ACCESS_KEY_ID, "
     "AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION, AWS_ENDPOINT_URL_S3 and their "
     "*_FILE forms), and the store directory becomes this replica's cache of them"},
    {"cache_max_bytes", T_SIZE, OFF(cache_max_bytes), 0, 1LL << 50, "0", NULL,
     "with blob_url set: most bytes of checkpoints the store directory caches; past it the "
     "least recently used files go (never one being read); 0 = no bound"},
    {"s3_path_style", T_ENUM, OFF(s3_path_style), 0, 0, "auto", "auto|true|false",
     "address S3 buckets path-style (http://ENDPOINT/BUCKET/KEY: MinIO, Ceph, most custom "
     "endpoints) or virtual-hosted (https://BUCKET.s3.REGION.amazonaws.com); auto = path-style "
     "for a custom endpoint (AWS_ENDPOINT_URL_S3), virtual-hosted for AWS"},
    {"max_checkpoint_bytes", T_SIZE, OFF(max_checkpoint_bytes), 1, 1024 * GiB, "4294967296", NULL,
     "largest checkpoint accepted by upload or download"},
    {"max_average_bytes", T_SIZE, OFF(max_average_bytes), 1, 1024 * GiB, "17179869184", NULL,
     "most bytes of stored versions one weight average reads (their sizes summed; 413 past "
     "it): the sources are read one at a time, this bounds the work of one request"},
    {"allowed_paths", T_LIST, OFF(allowed_paths), 0, 0, "", NULL,
     "directories file:// sources and job inputs may come from (comma-separated)"},
    {"allowed_urls", T_LIST, OFF(allowed_urls), 0, 0, "", NULL,
     "when set, URL sources must match one of these: same scheme, host and port, and a path "
     "under the listed one (comma-separated)"},
    {"allowed_s3", T_LIST, OFF(allowed_s3), 0, 0, "", NULL,
     "buckets and prefixes s3://BUCKET/KEY deploy sources may come from, as BUCKET or "
     "BUCKET/PREFIX (comma-separated); empty = s3:// sources refused. Read with the AWS_* "
     "credentials; not subject to allow_private_urls"},
    {"allow_private_urls", T_INT, OFF(allow_private_urls), 0, 1, "0", NULL,
     "1 = downloads may connect to loopback, private, link-local and other internal "
     "addresses (and go through the environment's http(s)_proxy); 0 = such a connection is "
     "refused, at every redirect, and no proxy is used"},
    {"download_connect_timeout_s", T_INT, OFF(download_connect_timeout_s), 1, 3600, "10", NULL,
     "connect timeout for checkpoint and dataset downloads"},
    {"download_timeout_s", T_INT, OFF(download_timeout_s), 1, 86400, "600", NULL,
     "total time allowed for one download"},
    {"download_max_redirects", T_INT, OFF(download_max_redirects), 0, 50, "5", NULL,
     "redirects followed by a download"},
    {"workers", T_INT, OFF(workers), 0, 256, "0", NULL,
     "predictor workers per loaded model version; 0 = one per core"},
    {"intra_op_threads", T_INT, OFF(intra_op_threads), 1, 256, "1", NULL,
     "libtorch threads inside one worker's forward"},
    {"max_batch_size", T_INT, OFF(max_batch_size), 1, 1000000, "64", NULL,
     "most rows in one forward"},
    {"max_delay_us", T_INT, OFF(max_delay_us), 0, 10000000, "0", NULL,
     "wait for more rows until this long after a batch's first request"},
    {"coalesce_us", T_INT, OFF(coalesce_us), 0, 10000000, "500", NULL,
     "while a worker computes and its forwards average at most this long, requests of "
     "less than half a batch wait for it instead of waking another worker; 0 = never"},
    {"queue_limit", T_INT, OFF(queue_limit), 1, 10000000, "1024", NULL,
     "queued requests per model version before answering 503"},
    {"timeout_ms", T_INT, OFF(timeout_ms), 1, 3600000, "30000", NULL,
     "a prediction not done in this long answers 504"},
    {"default_model", T_STR, OFF(default_model), 0, 0, "", NULL,
     "model answering POST /predict; empty = the only deployed model"},
    {"max_request_images", T_INT, OFF(max_request_images), 1, 100000, "64", NULL,
     "most images one prediction request may send (the parts of a multipart/form-data "
     "body; 413 past it); a folder of images is a batch job's work"},
    {"max_jobs", T_INT, OFF(max_jobs), 1, 1024, "2", NULL, "batch jobs running at once"},
    {"store_poll_ms", T_INT, OFF(store_poll_ms), 0, 60000, "1000", NULL,
     "how often to look for changes other replicas made to the store; 0 = never"},
    {"job_lease_s", T_INT, OFF(job_lease_s), 2, 3600, "30", NULL,
     "a replica sharing the store takes over a job whose runner went silent this long"},
    {"max_image_pixels", T_SIZE, OFF(max_image_pixels), 1, 1LL << 40, "40000000", NULL,
     "largest image (width x height, also after resize) a prediction or job decodes; "
     "checked from the file's header before decoding (413 past it)"},
    {"max_jpeg_scans", T_INT, OFF(max_jpeg_scans), 1, 1000000, "500", NULL,
     "most scans a progressive JPEG may have (each costs a pass over the image; encoders "
     "write about 10); past it the image is refused (422)"},
    {"max_large_decodes", T_INT, OFF(max_large_decodes), 0, 1024, "0", NULL,
     "images over 1 Mpx decoded at once, in requests and jobs together (each holds up to ~12 "
     "bytes a pixel while it decodes); the others wait for their turn. 0 = the number of cores"},
    {"prepack_max_bytes", T_SIZE, OFF(prepack_max_bytes), 0, 1LL << 40, "33554432", NULL,
     "a CPU model's float32 linear layers may also run packed once (XNNPACK) instead of the "
     "BLAS packing them on every forward: 2-3x faster forwards of 1-16 rows, at the cost of "
     "a packed copy of those weights for each forward running at once (at most one per core "
     "and per worker); this bounds all the packed copies of one version together, so the "
     "version stays near one copy of its weights (a model whose linear weights are larger "
     "is not packed; 0 = never; a version opts out with config \"prepack\": false)"},
    {"max_loaded_bytes", T_SIZE, OFF(max_loaded_bytes), 0, 1LL << 50, "0", NULL,
     "most bytes of weights (parameters and buffers) the loaded versions may hold together; "
     "past it the least recently used version without requests in flight is unloaded "
     "(defaults last) and loads again on its next request, and a load that cannot make room "
     "answers 503. Only defaults load at start and deploy; other versions on first use. "
     "0 = no bound (the default: modeld cannot tell what else shares its memory). In a "
     "container, about half the memory limit: requests, workers and libtorch need the rest"},
    {"job_nice", T_INT, OFF(job_nice), 0, 19, "19", NULL,
     "nice of the workers computing batch jobs: 0 = equal to online work, 19 = spare CPU only"},
    {"job_max_files", T_INT, OFF(job_max_files), 1, 100000000, "1000000", NULL,
     "most files and folders a job over an image folder (input.format images) lists"},
    {"job_retention_s", T_INT, OFF(job_retention_s), 0, 315360000, "0", NULL,
     "remove a job this many seconds after it ended (604800 = 7 days), with the output the "
     "server wrote for it: its copy in --store/jobs and, with blob_url in S3, its object "
     "under PREFIX/jobs/; an output.path the job was given is never removed. 0 = keep jobs "
     "until DELETE /jobs/ID?purge=true"},
    {"job_max_image_bytes", T_SIZE, OFF(job_max_image_bytes), 1, 64 * GiB, "67108864", NULL,
     "largest image file a job over an image folder reads (a larger one is a bad row)"},
    {"admin_token", T_LIST, OFF(admin_token), 0, 0, "", NULL,
     "bearer tokens (comma-separated; several for rotation) every route that changes state "
     "needs: deploys, architecture, PATCH, deletes, jobs; empty = those routes are open"},
    {"admin_token_file", T_STR, OFF(admin_token_file), 0, 0, "", NULL,
     "a file of admin tokens, one per line, added to admin_token"},
    {"predict_token", T_LIST, OFF(predict_token), 0, 0, "", NULL,
     "bearer tokens predictions and reads (GET) need (an admin token works too); empty = open"},
    {"predict_token_file", T_STR, OFF(predict_token_file), 0, 0, "", NULL,
     "a file of predict tokens, one per line, added to predict_token"},
    {"metrics_token", T_LIST, OFF(metrics_token), 0, 0, "", NULL,
     "bearer tokens GET /metrics needs (an admin token works too); empty = open"},
    {"metrics_token_file", T_STR, OFF(metrics_token_file), 0, 0, "", NULL,
     "a file of metrics tokens, one per line, added to metrics_token"},
    {"open_admin", T_BOOL, OFF(open_admin), 0, 0, "false", NULL,
     "true = the admin routes (deploys, PATCH, DELETE, jobs) stay open while predict_token "
     "or metrics_token is set and admin_token is not; false = modeld refuses to start so. "
     "Ignored once admin_token is set; a bare --open-admin means true"},
    {"test_job_chunk_delay_ms", T_INT, OFF(test_job_chunk_delay_ms), 0, 600000, "0", NULL,
     "for tests only: commit after every job chunk and sleep this long after each committed "
     "chunk, so a test can act in the middle of a job"},
};
#define N_SETTINGS (sizeof settings / sizeof settings[0])

int md_cfg_cores(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static void *field(md_cfg *cfg, const setting *s) { return (char *)cfg + s->offset; }

/* Tokens: never printed (--print-config shows how many, not what). */
static int setting_secret(const setting *s)
{
    size_t n = strlen(s->key);
    return s->type == T_LIST && n > 6 && strcmp(s->key + n - 6, "_token") == 0;
}
static const void *cfield(const md_cfg *cfg, const setting *s)
{
    return (const char *)cfg + s->offset;
}

static void strlist_free(md_strlist *l)
{
    for (int i = 0; i < l->count; i++)
        free(l->items[i]);
    free(l->items);
    l->items = NULL;
    l->count = 0;
}

static void strlist_push(md_strlist *l, const char *s, size_t n)
{
    l->items = realloc(l->items, sizeof(char *) * (size_t)(l->count + 2));
    if (!l->items)
        md_assert(!"out of memory");
    char *copy = md_xmalloc(n + 1);
    memcpy(copy, s, n);
    copy[n] = '\0';
    l->items[l->count++] = copy;
    l->items[l->count] = NULL;
}

/* "true"/"1" -> 1, "false"/"0" -> 0, anything else -> -1. */
static int bool_word(const char *value)
{
    if (strcmp(value, "true") == 0 || strcmp(value, "1") == 0)
        return 1;
    if (strcmp(value, "false") == 0 || strcmp(value, "0") == 0)
        return 0;
    return -1;
}

/* Parse text (from env, flag or default) into the field. `source` names where
 * the value came from, for the error message. */
static md_status set_from_text(md_cfg *cfg, const setting *s, const char *value, const char *source,
                               md_err *err)
{
    switch (s->type) {
    case T_BOOL: {
        int b = bool_word(value);
        if (b < 0)
            return md_err_set(err, MD_EINVAL, "%s: %s=\"%s\" is not a boolean; allowed: true, "
                              "false, 1, 0", source, s->key, value);
        *(int *)field(cfg, s) = b;
        return MD_OK;
    }
    case T_INT:
    case T_SIZE: {
        errno = 0;
        char *end = NULL;
        while (isspace((unsigned char)*value))
            value++;
        long long v = strtoll(value, &end, 10);
        if (end == value || *end != '\0' || errno == ERANGE)
            return md_err_set(err, MD_EINVAL, "%s: %s=\"%s\" is not an integer; allowed %lld..%lld",
                              source, s->key, value, s->min, s->max);
        if (v < s->min || v > s->max)
            return md_err_set(err, MD_EINVAL, "%s: %s=%lld is out of range; allowed %lld..%lld",
                              source, s->key, v, s->min, s->max);
        if (s->type == T_INT)
            *(int *)field(cfg, s) = (int)v;
        else
            *(long long *)field(cfg, s) = v;
        return MD_OK;
    }
    case T_ENUM: {
        size_t n = strlen(value);
        const char *c = s->choices;
        while (c) {
            const char *bar = strchr(c, '|');
            size_t len = bar ? (size_t)(bar - c) : strlen(c);
            if (len == n && n > 0 && strncmp(c, value, n) == 0)
                break;
            c = bar ? bar + 1 : NULL;
        }
        if (!c)
            return md_err_set(err, MD_EINVAL, "%s: %s=\"%s\" is not allowed; allowed: %s", source,
                              s->key, value, s->choices);
    } /* fall through */
    case T_STR: {
        char **p = field(cfg, s);
        if (s->type == T_STR && strcmp(s->key, "host") == 0 && value[0] == '\0')
            return md_err_set(err, MD_EINVAL, "%s: host is empty; give an address such as 127.0.0.1",
                              source);
        if (s->type == T_STR && strcmp(s->key, "store") == 0 && value[0] == '\0')
            return md_err_set(err, MD_EINVAL, "%s: store is empty; give a directory path", source);
        free(*p);
        *p = md_xstrdup(value);
        return MD_OK;
    }
    case T_LIST: {
        md_strlist *l = field(cfg, s);
        strlist_free(l);
        const char *p = value;
        while (*p) {
            const char *comma = strchr(p, ',');
            size_t len = comma ? (size_t)(comma - p) : strlen(p);
            if (len > 0)
                strlist_push(l, p, len);
            if (!comma)
                break;
            p = comma + 1;
        }
        return MD_OK;
    }
    }
    return md_err_set(err, MD_EINTERNAL, "unknown setting type");
}

/* Apply one JSON value from the config file. */
static md_status set_from_json(md_cfg *cfg, const setting *s, json_t *v, const char *source,
                               md_err *err)
{
    char text[64];
    switch (s->type) {
    case T_BOOL:
        if (!json_is_boolean(v)) {
            char *dump = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
            md_err_set(err, MD_EINVAL, "%s: %s=%s is not a boolean; write true or false", source,
                       s->key, dump ? dump : "?");
            free(dump);
            return MD_EINVAL;
        }
        return set_from_text(cfg, s, json_is_true(v) ? "true" : "false", source, err);
    case T_INT:
    case T_SIZE:
        if (!json_is_integer(v)) {
            char *dump = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
            md_err_set(err, MD_EINVAL, "%s: %s=%s is not an integer; allowed %lld..%lld", source,
                       s->key, dump ? dump : "?", s->min, s->max);
            free(dump);
            return MD_EINVAL;
        }
        snprintf(text, sizeof text, "%lld", (long long)json_integer_value(v));
        return set_from_text(cfg, s, text, source, err);
    case T_STR:
    case T_ENUM:
        if (!json_is_string(v)) {
            char *dump = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
            md_err_set(err, MD_EINVAL, "%s: %s=%s is not a string", source, s->key,
                       dump ? dump : "?");
            free(dump);
            return MD_EINVAL;
        }
        return set_from_text(cfg, s, json_string_value(v), source, err);
    case T_LIST: {
        md_strlist *l = field(cfg, s);
        if (json_is_string(v))
            return set_from_text(cfg, s, json_string_value(v), source, err);
        if (!json_is_array(v))
            return md_err_set(err, MD_EINVAL, "%s: %s must be an array of strings", source, s->key);
        strlist_free(l);
        size_t i;
        json_t *item;
        json_array_foreach(v, i, item)
        {
            if (!json_is_string(item))
                return md_err_set(err, MD_EINVAL, "%s: %s[%zu] is not a string", source, s->key, i);
            if (json_string_length(item) == 0)
                continue; /* as in "a,,b" from env or flags: an empty prefix would allow all */
            strlist_push(l, json_string_value(item), strlen(json_string_value(item)));
        }
        return MD_OK;
    }
    }
    return md_err_set(err, MD_EINTERNAL, "unknown setting type");
}

static const setting *find_key(const char *key)
{
    for (size_t i = 0; i < N_SETTINGS; i++)
        if (strcmp(settings[i].key, key) == 0)
            return &settings[i];
    return NULL;
}

/* "--drain-seconds" -> "drain_seconds"; returns NULL if not a settings flag. */
static const setting *find_flag(const char *flag, size_t len)
{
    char key[64];
    if (len >= sizeof key)
        return NULL;
    for (size_t i = 0; i < len; i++)
        key[i] = flag[i] == '-' ? '_' : flag[i];
    key[len] = '\0';
    /* only the dashed spelling is a flag: --drain_seconds is not */
    if (memchr(flag, '_', len))
        return NULL;
    return find_key(key);
}

static void env_name(const setting *s, char *out, size_t size)
{
    size_t n = (size_t)snprintf(out, size, "MODELD_");
    for (const char *k = s->key; *k && n + 1 < size; k++)
        out[n++] = (char)toupper((unsigned char)*k);
    out[n] = '\0';
}

static void flag_name(const setting *s, char *out, size_t size)
{
    size_t n = (size_t)snprintf(out, size, "--");
    for (const char *k = s->key; *k && n + 1 < size; k++)
        out[n++] = *k == '_' ? '-' : *k;
    out[n] = '\0';
}

/* "; did you mean X?" for an unknown setting name spelled as `kind` (0: a
 * config-file key, 1: a flag without its dashes, 2: an environment variable),
 * or "" when no setting is near. */
static void suggest_setting(const char *word, size_t len, int kind, char *out, size_t size)
{
    char key[64];
    out[0] = '\0';
    if (kind == 2) {
        if (len > 7 && strncmp(word, "MODELD_", 7) == 0)
            word += 7, len -= 7;
    }
    if (len >= sizeof key)
        return;
    for (size_t i = 0; i < len; i++)
        key[i] = word[i] == '-' ? '_' : (char)tolower((unsigned char)word[i]);
    key[len] = '\0';
    const char *keys[N_SETTINGS];
    for (size_t i = 0; i < N_SETTINGS; i++)
        keys[i] = settings[i].key;
    const char *near = md_suggest(key, keys, N_SETTINGS);
    if (!near && kind == 1 && memchr(word, '_', len))
        near = find_key(key) ? find_key(key)->key : NULL; /* --drain_seconds */
    if (!near)
        return;
    const setting *s = find_key(near);
    char name[96];
    if (kind == 1)
        flag_name(s, name, sizeof name);
    else if (kind == 2)
        env_name(s, name, sizeof name);
    else
        snprintf(name, sizeof name, "%s", s->key);
    snprintf(out, size, "; did you mean %s?", name);
}

void md_cfg_defaults(md_cfg *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    for (size_t i = 0; i < N_SETTINGS; i++) {
        md_err err;
        md_status st = set_from_text(cfg, &settings[i], settings[i].def, "default", &err);
        md_assert(st == MD_OK);
    }
}

void md_cfg_free(md_cfg *cfg)
{
    if (!cfg)
        return;
    for (size_t i = 0; i < N_SETTINGS; i++) {
        const setting *s = &settings[i];
        if (s->type == T_STR || s->type == T_ENUM)
            free(*(char **)field(cfg, s));
        else if (s->type == T_LIST)
            strlist_free(field(cfg, s));
    }
    memset(cfg, 0, sizeof *cfg);
}

static md_status load_file(md_cfg *cfg, const char *path, md_err *err)
{
    char source[600];
    snprintf(source, sizeof source, "config file %s", path);
    FILE *f = fopen(path, "rb");
    if (!f)
        return md_err_set(err, MD_EINVAL, "%s: cannot read: %s", source, strerror(errno));
    struct stat sb;
    if (fstat(fileno(f), &sb) == 0 && S_ISDIR(sb.st_mode)) {
        fclose(f);
        return md_err_set(err, MD_EINVAL, "%s: cannot read: Is a directory", source);
    }
    json_error_t jerr;
    json_t *root = json_loadf(f, JSON_REJECT_DUPLICATES, &jerr);
    fclose(f);
    if (!root)
        return md_err_set(err, MD_EINVAL, "%s: invalid JSON at line %d, column %d: %s", source,
                          jerr.line, jerr.column, jerr.text);
    md_status st = MD_OK;
    if (!json_is_object(root)) {
        st = md_err_set(err, MD_EINVAL, "%s: the top level must be a JSON object of settings",
                        source);
        goto out;
    }
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v)
    {
        const setting *s = find_key(key);
        if (!s) {
            char hint[128];
            suggest_setting(key, strlen(key), 0, hint, sizeof hint);
            st = md_err_set(err, MD_EINVAL,
                            "%s: unknown key \"%s\"%s; see modeld --help for the settings", source,
                            key, hint);
            goto out;
        }
        if ((st = set_from_json(cfg, s, v, source, err)) != MD_OK)
            goto out;
    }
out:
    json_decref(root);
    return st;
}

static const char *env_get(char **envp, const char *name)
{
    size_t n = strlen(name);
    for (char **e = envp; e && *e; e++)
        if (strncmp(*e, name, n) == 0 && (*e)[n] == '=')
            return *e + n + 1;
    return NULL;
}

/* The value of a flag: "--key=value" or "--key value". Advances *i. */
static md_status flag_value(int argc, char **argv, int *i, const char *eq, const char *flag,
                            const char **value, md_err *err)
{
    if (eq) {
        *value = eq + 1;
        return MD_OK;
    }
    if (*i + 1 >= argc)
        return md_err_set(err, MD_EINVAL, "flag %s: missing value; write %s VALUE", flag, flag);
    *value = argv[++*i];
    return MD_OK;
}

/* A token is 1..512 visible ASCII characters (what an Authorization header
 * carries); the message names the setting, never the token. */
static md_status check_tokens(const md_strlist *l, const char *what, md_err *err)
{
    for (int i = 0; i < l->count; i++) {
        size_t n = strlen(l->items[i]);
        int ok = n > 0 && n <= 512;
        for (size_t k = 0; ok && k < n; k++)
            ok = l->items[i][k] > 0x20 && l->items[i][k] < 0x7f;
        if (!ok)
            return md_err_set(err, MD_EINVAL,
                              "%s: token %d is not 1 to 512 visible ASCII characters (no spaces "
                              "or commas)",
                              what, i + 1);
    }
    return MD_OK;
}

/* Add the tokens of each *_token_file (one per line; blank lines and lines
 * starting with '#' skipped) to its list, then check every token. */
static md_status load_tokens(md_cfg *cfg, md_err *err)
{
    struct {
        const char *file_key;
        char *path;
        md_strlist *list;
    } t[] = {{"admin_token_file", cfg->admin_token_file, &cfg->admin_token},
             {"predict_token_file", cfg->predict_token_file, &cfg->predict_token},
             {"metrics_token_file", cfg->metrics_token_file, &cfg->metrics_token}};
    for (size_t k = 0; k < sizeof t / sizeof t[0]; k++) {
        if (t[k].path && t[k].path[0]) {
            FILE *f = fopen(t[k].path, "r");
            if (!f)
                return md_err_set(err, MD_EINVAL, "%s: cannot read %s: %s", t[k].file_key,
                                  t[k].path, strerror(errno));
            char line[1024];
            int added = 0;
            while (fgets(line, sizeof line, f)) {
                size_t n = strcspn(line, "\r\n");
                line[n] = '\0';
                if (n == 0 || line[0] == '#')
                    continue;
                strlist_push(t[k].list, line, n);
                added++;
            }
            fclose(f);
            if (!added)
                return md_err_set(err, MD_EINVAL, "%s: %s holds no token", t[k].file_key,
                                  t[k].path);
        }
        char what[64];
        snprintf(what, sizeof what, "%.*s", (int)(strlen(t[k].file_key) - 5), t[k].file_key);
        if (check_tokens(t[k].list, what, err) != MD_OK)
            return MD_EINVAL;
    }
    return MD_OK;
}

/* Tokens for predictions or metrics without one for admin routes leave
 * deploys, PATCH and DELETE open to anyone while the server looks guarded:
 * refused unless open_admin says that is meant. No token at all is the
 * plainly open server of a laptop, as before. */
static md_status check_admin_open(const md_cfg *cfg, md_err *err)
{
    if (cfg->admin_token.count > 0 || cfg->open_admin)
        return MD_OK;
    const char *set = cfg->predict_token.count > 0   ? "predict_token"
                      : cfg->metrics_token.count > 0 ? "metrics_token"
                                                     : NULL;
    if (!set)
        return MD_OK;
    return md_err_set(err, MD_EINVAL,
                      "%s is set but admin_token is not, so deploys, PATCH and DELETE would be "
                      "open to anyone: set admin_token (or admin_token_file), or set open_admin "
                      "(--open-admin, MODELD_OPEN_ADMIN=true) to keep them open on purpose",
                      set);
}

md_status md_cfg_load(md_cfg *cfg, int argc, char **argv, char **envp, md_cfg_action *action,
                      md_err *err)
{
    md_cfg_defaults(cfg);
    *action = MD_CFG_RUN;

    /* Pass 1: find --config (flag wins over MODELD_CONFIG) and the actions. */
    const char *config_path = env_get(envp, "MODELD_CONFIG");
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0)
            *action = MD_CFG_HELP;
        else if (strcmp(a, "--version") == 0)
            *action = MD_CFG_VERSION;
        else if (strcmp(a, "--print-config") == 0)
            *action = *action == MD_CFG_RUN ? MD_CFG_PRINT_CONFIG : *action;
        else if (strncmp(a, "--config", 8) == 0 && (a[8] == '\0' || a[8] == '=')) {
            const char *eq = a[8] == '=' ? a + 8 : NULL;
            if (flag_value(argc, argv, &i, eq, "--config", &config_path, err) != MD_OK)
                return MD_EINVAL;
        } else if (strncmp(a, "--", 2) == 0 && !strchr(a, '=')) {
            const setting *s = find_flag(a + 2, strlen(a + 2));
            if (s && (s->type != T_BOOL || (i + 1 < argc && strncmp(argv[i + 1], "-", 1) != 0)))
                i++; /* skip the setting's value: "--store --help" names a store */
        }
    }
    if (*action == MD_CFG_HELP || *action == MD_CFG_VERSION)
        return MD_OK;

    if (config_path && *config_path && load_file(cfg, config_path, err) != MD_OK)
        return MD_EINVAL;

    /* Environment: every MODELD_* must be a known setting, so typos are caught. */
    for (char **e = envp; e && *e; e++) {
        if (strncmp(*e, "MODELD_", 7) != 0)
            continue;
        const char *eq = strchr(*e, '=');
        if (!eq)
            continue;
        char name[96];
        size_t n = (size_t)(eq - *e);
        if (n >= sizeof name)
            n = sizeof name - 1;
        memcpy(name, *e, n);
        name[n] = '\0';
        if (strcmp(name, "MODELD_CONFIG") == 0)
            continue;
        const setting *s = NULL;
        for (size_t k = 0; k < N_SETTINGS && !s; k++) {
            char env[96];
            env_name(&settings[k], env, sizeof env);
            if (strcmp(env, name) == 0)
                s = &settings[k];
        }
        char source[128];
        snprintf(source, sizeof source, "environment %s", name);
        if (!s) {
            char hint[128];
            suggest_setting(name, strlen(name), 2, hint, sizeof hint);
            return md_err_set(err, MD_EINVAL,
                              "%s: unknown setting%s; see modeld --help for the MODELD_* names",
                              source, hint);
        }
        if (set_from_text(cfg, s, eq + 1, source, err) != MD_OK)
            return MD_EINVAL;
    }

    /* Flags. */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0 || strcmp(a, "--version") == 0 ||
            strcmp(a, "--print-config") == 0)
            continue;
        if (strncmp(a, "--config", 8) == 0 && (a[8] == '\0' || a[8] == '=')) {
            if (a[8] == '\0')
                i++;
            continue;
        }
        if (strncmp(a, "--", 2) != 0)
            return md_err_set(err, MD_EINVAL,
                              "argument \"%s\": not a flag; settings are given as --key value", a);
        const char *eq = strchr(a, '=');
        size_t len = eq ? (size_t)(eq - a - 2) : strlen(a + 2);
        const setting *s = find_flag(a + 2, len);
        if (!s) {
            char hint[128];
            suggest_setting(a + 2, len, 1, hint, sizeof hint);
            return md_err_set(err, MD_EINVAL, "flag %.*s: unknown flag%s; see modeld --help",
                              (int)(len + 2), a, hint);
        }
        char flag[80], source[96];
        flag_name(s, flag, sizeof flag);
        snprintf(source, sizeof source, "flag %s", flag);
        const char *value = NULL;
        if (s->type == T_BOOL && !eq && (i + 1 >= argc || argv[i + 1][0] == '-'))
            value = "true"; /* a bare --open-admin (no setting's value starts with '-') */
        else if (flag_value(argc, argv, &i, eq, flag, &value, err) != MD_OK)
            return MD_EINVAL;
        if (set_from_text(cfg, s, value, source, err) != MD_OK)
            return MD_EINVAL;
    }
    if (load_tokens(cfg, err) != MD_OK)
        return MD_EINVAL;
    return check_admin_open(cfg, err);
}

static json_t *setting_json(const md_cfg *cfg, const setting *s)
{
    switch (s->type) {
    case T_BOOL:
        return json_boolean(*(const int *)cfield(cfg, s));
    case T_INT:
        return json_integer(*(const int *)cfield(cfg, s));
    case T_SIZE:
        return json_integer(*(const long long *)cfield(cfg, s));
    case T_STR:
        if (strcmp(s->key, "index_url") == 0) {
            char masked[1024];
            md_url_mask(*(char *const *)cfield(cfg, s), masked, sizeof masked);
            return json_string(masked);
        }
        return json_string(*(char *const *)cfield(cfg, s));
    case T_ENUM:
        return json_string(*(char *const *)cfield(cfg, s));
    case T_LIST: {
        const md_strlist *l = cfield(cfg, s);
        json_t *a = json_array();
        for (int i = 0; i < l->count; i++)
            json_array_append_new(a, json_string(setting_secret(s) ? "<redacted>" : l->items[i]));
        return a;
    }
    }
    return json_null();
}

char *md_cfg_to_json(const md_cfg *cfg)
{
    json_t *o = json_object();
    for (size_t i = 0; i < N_SETTINGS; i++)
        json_object_set_new(o, settings[i].key, setting_json(cfg, &settings[i]));
    char *s = json_dumps(o, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(o);
    md_assert(s != NULL);
    return s;
}

void md_cfg_print_help(FILE *out)
{
    fprintf(out,
            "usage: modeld [--config FILE] [--print-config] [--help] [--version] [--KEY VALUE ...]\n"
            "\n"
            "Serves PyTorch models over HTTP: TorchScript archives, and torch.save\n"
            "state_dicts or safetensors files loaded into a model's TorchScript\n"
            "architecture. Settings, later wins:\n"
            "defaults < JSON file (--config FILE or MODELD_CONFIG) < environment < flags.\n"
            "\n");
    for (size_t i = 0; i < N_SETTINGS; i++) {
        const setting *s = &settings[i];
        char flag[80], env[96];
        flag_name(s, flag, sizeof flag);
        env_name(s, env, sizeof env);
        fprintf(out, "  %-30s %s\n", flag, s->help);
        fprintf(out, "  %-30s default: %s%s%s  env: %s%s%s\n", "",
                s->type == T_STR || s->type == T_LIST ? "\"" : "", s->def,
                s->type == T_STR || s->type == T_LIST ? "\"" : "", env,
                s->choices || s->type == T_BOOL ? "  allowed: " : "",
                s->choices ? s->choices : s->type == T_BOOL ? "true|false" : "");
    }
}
