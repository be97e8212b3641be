/*
 * jobs.c - batch-predict jobs as a REST resource: POST /jobs, GET /jobs,
 * GET /jobs/{id}, DELETE /jobs/{id} (cancel; ?purge=true removes an ended job),
 * GET /jobs/{id}/output.
 * Everything a job needs is checked here, before its row is inserted.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <regex.h>
#include <stdatomic.h>

/* md_s3_data_check's buffers (checkpoint.h) */
#define MD_S3_BUCKET_CHARS 64
#define MD_S3_KEY_CHARS 1025
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "handlers.h"

/* An input file: opened under allowed_paths without following symlinks
 * (md_path_open_file), then closed; the runner opens it again the same way,
 * under its own replica's settings. */
/* md_jobs_start failed at start (logged): jobs cannot run on this server. */
static md_status jobs_unavailable(md_err *err)
{
    return md_err_setc(err, MD_EUNAVAIL, "jobs_unavailable",
                       "batch jobs are unavailable on this server (see its log at start); "
                       "use another replica or restart it");
}

static md_status check_input(const md_cfg *cfg, const char *what, const char *path, md_err *err)
{
    if (!strncmp(path, "s3://", 5)) { /* allowed_s3 only: S3 itself is asked by the runner */
        md_fetch_opts fo = md_fetch_opts_from_cfg(cfg);
        char bucket[MD_S3_BUCKET_CHARS], key[MD_S3_KEY_CHARS];
        return md_s3_data_check(path, &fo, what, 0, bucket, key, err);
    }
    int fd;
    md_status st = md_path_open_file(&cfg->allowed_paths, what, path, "input_not_found", &fd, err);
    if (st == MD_OK)
        close(fd);
    return st;
}

/* 1 when the local `path` lies in the directory `dir` (both resolved). */
static int path_in_dir(const char *path, const char *dir)
{
    char parent[PATH_MAX], rp[PATH_MAX], rd[PATH_MAX];
    snprintf(parent, sizeof parent, "%s", path);
    char *slash = strrchr(parent, '/');
    if (slash == parent)
        slash[1] = '\0';
    else if (slash)
        *slash = '\0';
    else
        snprintf(parent, sizeof parent, ".");
    if (!realpath(parent, rp) || !realpath(dir, rd))
        return 0;
    size_t n = strlen(rd);
    return strncmp(rp, rd, n) == 0 && (rp[n] == '\0' || rp[n] == '/' || rd[n - 1] == '/');
}

/* The server's own area, never an output.path: a job's removal deletes
 * what lies there (job_retention.c). */
static md_status output_reserved(const char *path, const char *area, md_err *err)
{
    return md_err_setc(err, MD_EINVAL, "invalid_job",
                       "output.path %.200s lies in the server's own store (%.200s: checkpoints "
                       "and the outputs it keeps, removed with their jobs); give a path outside "
                       "it, or leave output.path out to have the server keep the output",
                       path, area);
}

/* An output file: its directory under allowed_paths without following
 * symlinks, outside the server's own store, and nothing there yet (a job
 * never replaces a file). */
static md_status check_output(md_app *app, const char *path, md_err *err)
{
    const md_cfg *cfg = app->cfg;
    if (!strncmp(path, "s3://", 5)) { /* whether it exists is the runner's check */
        char root[1200];
        if (md_store_data_url(app->store, root, sizeof root) &&
            !strncmp(path, root, strlen(root)))
            return output_reserved(path, root, err);
        md_fetch_opts fo = md_fetch_opts_from_cfg(cfg);
        char bucket[MD_S3_BUCKET_CHARS], key[MD_S3_KEY_CHARS];
        return md_s3_data_check(path, &fo, "output.path", 0, bucket, key, err);
    }
    if (path_in_dir(path, md_store_dir(app->store)))
        return output_reserved(path, md_store_dir(app->store), err);
    int dirfd;
    const char *leaf;
    md_status st = md_path_open_dir(&cfg->allowed_paths, "output.path", path, "invalid_path",
                                    &dirfd, &leaf, err);
    if (st != MD_OK)
        return st;
    struct stat sb;
    if (fstatat(dirfd, leaf, &sb, AT_SYMLINK_NOFOLLOW) == 0)
        st = md_err_setc(err, MD_ECONFLICT, "output_exists",
                         "output.path %.200s already exists; modeld never replaces a file: "
                         "remove it or give another output.path",
                         path);
    close(dirfd);
    return st;
}

static int one_of(const char *v, const char *const *choices)
{
    for (int i = 0; v && choices[i]; i++)
        if (strcmp(v, choices[i]) == 0)
            return 1;
    return 0;
}

/* An images input: a directory under allowed_paths (opened, then closed,
 * as check_input does for a file) and its label_from. */
static md_status check_images_input(const md_cfg *cfg, json_t *in, md_err *err)
{
    static const char *const not_for_images[] = {"url", "label", "features", "shape", NULL};
    for (int i = 0; not_for_images[i]; i++)
        if (json_object_get(in, not_for_images[i]))
            return md_err_setc(err, MD_EINVAL, "invalid_job",
                               "input.%s does not apply to format images: give input.path (a "
                               "directory of PNG and JPEG files) and, for labels, "
                               "input.label_from (\"folder\" or {\"regex\": \"...\"})",
                               not_for_images[i]);
    const char *path = json_string_value(json_object_get(in, "path"));
    if (!path)
        return md_err_setc(err, MD_EINVAL, "invalid_job",
                           "input.path is required for format images: the directory of images");
    int fd;
    md_status st;
    if (!strncmp(path, "s3://", 5)) {
        md_fetch_opts fo = md_fetch_opts_from_cfg(cfg);
        char bucket[MD_S3_BUCKET_CHARS], key[MD_S3_KEY_CHARS];
        if ((st = md_s3_data_check(path, &fo, "input.path", 1, bucket, key, err)) != MD_OK)
            return st;
    } else {
        st = md_path_open_directory(&cfg->allowed_paths, "input.path", path, "input_not_found",
                                    &fd, err);
        if (st != MD_OK)
            return st;
        close(fd);
    }
    json_t *lf = json_object_get(in, "label_from");
    if (!lf || (json_is_string(lf) && one_of(json_string_value(lf),
                                             (const char *const[]){"folder", "none", NULL})))
        return MD_OK;
    const char *re = json_string_value(json_object_get(lf, "regex"));
    if (!json_is_object(lf) || !re || json_object_size(lf) != 1)
        return md_err_setc(err, MD_EINVAL, "invalid_job",
                           "input.label_from must be \"folder\" (the class folder, as "
                           "torchvision's ImageFolder), \"none\", or {\"regex\": \"...\"} (on "
                           "the file name; its first group is the label)");
    regex_t compiled;
    int rc = regcomp(&compiled, re, REG_EXTENDED);
    if (rc != 0) {
        char why[160];
        regerror(rc, &compiled, why, sizeof why);
        return md_err_setc(err, MD_EINVAL, "invalid_job",
                           "input.label_from.regex \"%.100s\" is not a POSIX extended regular "
                           "expression: %s",
                           re, why);
    }
    regfree(&compiled);
    return MD_OK;
}

static md_status check_keys(json_t *o, const char *what, const char *const *allowed, md_err *err)
{
    const char *key;
    json_t *v;
    json_object_foreach(o, key, v)
    {
        if (!one_of(key, allowed)) {
            char list[200] = "";
            for (int i = 0; allowed[i]; i++) {
                strcat(list, i ? ", " : "");
                strcat(list, allowed[i]);
            }
            return md_err_setc(err, MD_EINVAL, "unknown_field",
                               "%s has an unknown key \"%.40s\"; allowed: %s", what, key, list);
        }
    }
    return MD_OK;
}

static md_status validate(md_app *app, json_t *spec, const char *id, char *out_path,
                          size_t out_size, md_err *err)
{
    static const char *const top[] = {"model", "version", "input", "output", "batch_size",
                                      "top_k", "on_error", "record_metric", "chunk_rows", NULL};
    static const char *const in_keys[] = {"path", "url", "format", "features", "label", "shape",
                                          "label_from", "columns", NULL};
    static const char *const out_keys[] = {"path", "format", "include", NULL};
    static const char *const in_formats[] = {"csv", "jsonl", "npy", "npz", "idx", "images",
                                             NULL};
    static const char *const out_formats[] = {"jsonl", "csv", "npy", NULL};
    static const char *const includes[] = {"index", "path", "prediction", "label", "scores",
                                           NULL};
    md_status st;
    if ((st = check_keys(spec, "the job", top, err)) != MD_OK)
        return st;
    const char *model = json_string_value(json_object_get(spec, "model"));
    if (!model)
        return md_err_setc(err, MD_EINVAL, "invalid_job", "model is required: the name of a deployed model");
    json_t *info = NULL;
    if ((st = md_store_get_model(app->store, model, &info, err)) != MD_OK)
        return st;
    json_decref(info);
    json_t *version = json_object_get(spec, "version");
    if (version && (!json_is_integer(version) || json_integer_value(version) < 1))
        return md_err_setc(err, MD_EINVAL, "invalid_version", "version must be a positive integer");
    if (version) {
        json_t *v = NULL;
        if ((st = md_store_get_version(app->store, model, (int)json_integer_value(version), &v,
                                       err)) != MD_OK)
            return st;
        json_decref(v);
    }
    json_t *in = json_object_get(spec, "input");
    if (!json_is_object(in))
        return md_err_setc(err, MD_EINVAL, "invalid_job",
                           "input is required: {\"path\" or \"url\", \"format\": csv|jsonl|npy|idx}");
    if ((st = check_keys(in, "input", in_keys, err)) != MD_OK)
        return st;
    const char *in_format = json_string_value(json_object_get(in, "format"));
    const char *in_where = json_string_value(json_object_get(in, "path"));
    if (!in_where)
        in_where = json_string_value(json_object_get(in, "url"));
    if (!json_object_get(in, "format") && in_where && strlen(in_where) > 4 &&
        !strcmp(in_where + strlen(in_where) - 4, ".npz")) {
        /* numpy's own name says what it is */
        json_object_set_new(in, "format", json_string("npz"));
        in_format = "npz";
    }
    int images = in_format && !strcmp(in_format, "images");
    if (images && (st = check_images_input(app->cfg, in, err)) != MD_OK)
        return st;
    json_t *columns = json_object_get(in, "columns");
    if (columns && (!json_is_object(columns) ||
                    (in_format && strcmp(in_format, "csv") && strcmp(in_format, "jsonl"))))
        return md_err_setc(err, MD_EINVAL, "invalid_job",
                           "input.columns maps each of the model's named inputs to its csv "
                           "columns or jsonl fields: {\"numeric\": [\"age\", \"bmi\"], "
                           "\"category\": \"city_id\"}");
    if (!images && json_object_get(in, "label_from"))
        return md_err_setc(err, MD_EINVAL, "invalid_job",
                           "input.label_from applies to format images only; csv, jsonl and idx "
                           "take input.label");
    const char *path = json_string_value(json_object_get(in, "path"));
    const char *url = json_string_value(json_object_get(in, "url"));
    if (!!path == !!url)
        return md_err_setc(err, MD_EINVAL, "invalid_job", "input needs exactly one of path and url");
    if (!one_of(json_string_value(json_object_get(in, "format")), in_formats))
        return md_err_setc(err, MD_EINVAL, "invalid_format",
                           "input.format must be one of csv, jsonl, npy, npz, idx, images");
    /* an NPZ is a zip, read from its directory at the end: not a stream */
    if (path && !strncmp(path, "s3://", 5) &&
        !strcmp(json_string_value(json_object_get(in, "format")), "npz"))
        return md_err_setc(err, MD_EINVAL, "invalid_job",
                           "input.path %.200s: an npz input is read from its zip directory, not "
                           "as a stream, so it cannot be read from S3 yet; copy it under "
                           "allowed_paths, or put one npy per input in S3",
                           path);
    if (path && !images && (st = check_input(app->cfg, "input.path", path, err)) != MD_OK)
        return st;
    md_fetch_opts fo = md_fetch_opts_from_cfg(app->cfg);
    if (url && (st = md_source_check(url, &fo, err)) != MD_OK)
        return st;
    const char *label = json_string_value(json_object_get(in, "label"));
    if (label && !strcmp(json_string_value(json_object_get(in, "format")), "idx") &&
        (st = check_input(app->cfg, "input.label", label, err)) != MD_OK)
        return st;
    json_t *out = json_object_get(spec, "output");
    if (out && !json_is_object(out))
        return md_err_setc(err, MD_EINVAL, "invalid_job", "output must be an object");
    if (out && (st = check_keys(out, "output", out_keys, err)) != MD_OK)
        return st;
    const char *ofmt = json_string_value(json_object_get(out, "format"));
    if (ofmt && !one_of(ofmt, out_formats))
        return md_err_setc(err, MD_EINVAL, "invalid_format",
                           "output.format must be one of jsonl, csv, npy");
    json_t *inc = json_object_get(out, "include");
    if (inc) {
        size_t i;
        json_t *v;
        if (!json_is_array(inc))
            return md_err_setc(err, MD_EINVAL, "invalid_job", "output.include must be an array");
        json_array_foreach(inc, i, v)
        {
            if (!one_of(json_string_value(v), includes))
                return md_err_setc(err, MD_EINVAL, "invalid_job",
                                   "output.include[%zu] must be index, path, prediction, label "
                                   "or scores",
                                   i);
        }
    }
    const char *opath = json_string_value(json_object_get(out, "path"));
    if (opath) {
        if ((st = check_output(app, opath, err)) != MD_OK)
            return st;
        snprintf(out_path, out_size, "%s", opath);
        if (!strncmp(opath, "s3://", 5)) /* written in the store, then put in S3 */
            snprintf(out_path, out_size, "%s/jobs/%s.%s", md_store_dir(app->store), id,
                     ofmt ? ofmt : "jsonl");
    } else {
        snprintf(out_path, out_size, "%s/jobs/%s.%s", md_store_dir(app->store), id,
                 ofmt ? ofmt : "jsonl");
    }
    json_t *cr = json_object_get(spec, "chunk_rows");
    if (cr && (!json_is_integer(cr) || json_integer_value(cr) < 1 ||
               json_integer_value(cr) > 1000000000))
        return md_err_setc(err, MD_EINVAL, "invalid_job",
                           "chunk_rows must be an integer in 1..1000000000 (rows per chunk of a "
                           "job over every replica; rounded up to whole batches)");
    json_t *bs = json_object_get(spec, "batch_size");
    if (bs && (!json_is_integer(bs) || json_integer_value(bs) < 1 || json_integer_value(bs) > 65536))
        return md_err_setc(err, MD_EINVAL, "invalid_job", "batch_size must be an integer in 1..65536");
    json_t *tk = json_object_get(spec, "top_k");
    if (tk && (!json_is_integer(tk) || json_integer_value(tk) < 1 ||
               json_integer_value(tk) > MD_TOP_K_MAX))
        return md_err_setc(err, MD_EINVAL, "invalid_job",
                           "top_k must be an integer in 1..%d (the top_k limit)", MD_TOP_K_MAX);
    json_t *rm = json_object_get(spec, "record_metric");
    if (rm && !json_is_string(rm))
        return md_err_setc(err, MD_EINVAL, "invalid_job",
                           "record_metric must name a metric, e.g. \"test_accuracy\"");
    md_status rst;
    if (rm && (rst = md_metric_name_check(json_string_value(rm), "record_metric", "invalid_job",
                                          err)) != MD_OK)
        return rst;
    json_t *lf = json_object_get(in, "label_from");
    if (rm && !images && !json_object_get(in, "label"))
        return md_err_setc(err, MD_EINVAL, "invalid_job",
                           "record_metric records the accuracy on a labelled dataset; give "
                           "input.label (the label column, field or IDX labels file)");
    if (rm && images && json_is_string(lf) && !strcmp(json_string_value(lf), "none"))
        return md_err_setc(err, MD_EINVAL, "invalid_job",
                           "record_metric records the accuracy on a labelled dataset; "
                           "input.label_from \"none\" gives no labels");
    json_t *oe = json_object_get(spec, "on_error");
    if (oe && !one_of(json_string_value(oe), (const char *const[]){"fail", "skip", NULL}))
        return md_err_setc(err, MD_EINVAL, "invalid_job", "on_error must be \"fail\" or \"skip\"");
    return MD_OK;
}

void md_handle_jobs_create(md_req *req)
{
    md_app *app = md_req_app(req);
    md_err err;
    md_err_clear(&err);
    size_t len;
    const char *body = md_req_body(req, &len);
    json_error_t jerr;
    json_t *spec = body ? json_loadb(body, len, 0, &jerr) : NULL;
    if (!json_is_object(spec)) {
        md_err_setc(&err, MD_EINVAL, "invalid_json",
                    "the body must be a JSON job such as {\"model\": \"fashion\", \"input\": "
                    "{\"path\": \"/data/test.csv\", \"format\": \"csv\"}}");
        json_decref(spec);
        md_reply_error(req, &err);
        return;
    }
    /* ids sort by creation time: j<ms since epoch><random> */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    unsigned rnd = 0;
    if (getrandom(&rnd, sizeof rnd, 0) != sizeof rnd)
        rnd = (unsigned)ts.tv_nsec;
    char id[48];
    snprintf(id, sizeof id, "j%013lld%06x", (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000,
             rnd & 0xffffff);
    char out_path[4096];
    md_status st = app->jobs ? validate(app, spec, id, out_path, sizeof out_path, &err)
                             : jobs_unavailable(&err);
    if (st == MD_OK) {
        json_t *version = json_object_get(spec, "version");
        st = md_store_job_create(app->store, id, json_string_value(json_object_get(spec, "model")),
                                 version ? (int)json_integer_value(version) : 0, spec, out_path,
                                 &err);
    }
    json_decref(spec);
    if (st != MD_OK) {
        md_reply_error(req, &err);
        return;
    }
    md_jobs_enqueue(app->jobs, id);
    char loc[80];
    snprintf(loc, sizeof loc, "/jobs/%s", id);
    md_reply_header(req, "Location", loc);
    md_reply_json(req, 202, json_pack("{s:s,s:s}", "id", id, "status", "queued"));
}

/* Add what is derived from the stored counters: accuracy, ETA. */
static json_t *job_view(json_t *job)
{
    json_int_t labeled = json_integer_value(json_object_get(job, "labeled"));
    json_int_t correct = json_integer_value(json_object_get(job, "correct"));
    if (labeled > 0)
        json_object_set_new(job, "accuracy", json_real((double)correct / (double)labeled));
    else if (json_is_string(json_object_get(job, "accuracy_note")))
        json_object_set_new(job, "accuracy", json_null()); /* and accuracy_note says why */
    json_t *total = json_object_get(job, "rows_total");
    double rps = json_number_value(json_object_get(job, "rows_per_s"));
    const char *status = json_string_value(json_object_get(job, "status"));
    if (json_is_integer(total) && rps > 0 && !strcmp(status, "running"))
        json_object_set_new(
            job, "eta_s",
            json_real((double)(json_integer_value(total) -
                               json_integer_value(json_object_get(job, "rows_done"))) /
                      rps));
    char link[80];
    snprintf(link, sizeof link, "/jobs/%s/output", json_string_value(json_object_get(job, "id")));
    json_object_set_new(job, "output", json_string(link));
    return job;
}

/* The job `id`'s row (a new reference), or NULL after answering the error
 * (404 job_not_found). */
static json_t *job_or_reply(md_req *req, const char *id)
{
    md_app *app = md_req_app(req);
    md_err err;
    json_t *job = NULL;
    if (md_store_job_get(app->store, id, &job, &err) != MD_OK) {
        md_reply_error(req, &err);
        return NULL;
    }
    return job;
}

void md_handle_job_get(md_req *req)
{
    json_t *job = job_or_reply(req, md_req_param(req, "id"));
    if (job)
        md_reply_json(req, 200, job_view(job));
}

void md_handle_jobs_list(md_req *req)
{
    md_app *app = md_req_app(req);
    md_err err;
    md_err_clear(&err);
    long limit;
    if (!md_req_limit(req, &limit))
        return;
    const char *status = md_req_query(req, "status");
    static const char *const states[] = {"queued", "running", "succeeded", "failed", "cancelled",
                                         NULL};
    if (status && !one_of(status, states)) {
        md_err_setc(&err, MD_EINVAL, "invalid_status",
                    "status=%.20s: use queued, running, succeeded, failed or cancelled", status);
        md_reply_error(req, &err);
        return;
    }
    json_t *out = NULL;
    if (md_store_job_list(app->store, status, md_req_query(req, "model"),
                          md_req_query(req, "before"), (int)limit, &out, &err) != MD_OK) {
        md_reply_error(req, &err);
        return;
    }
    size_t i;
    json_t *j;
    json_array_foreach(json_object_get(out, "jobs"), i, j) job_view(j);
    md_reply_json(req, 200, out);
}

/* DELETE /jobs/ID?purge=true, deferred: S3 and the index. */
static void job_purge_deferred(md_req *req)
{
    md_app *app = md_req_app(req);
    md_err err;
    const char *id = md_req_param(req, "id");
    if (md_jobs_purge(app->jobs, id, &err) != MD_OK) {
        md_reply_error(req, &err);
        return;
    }
    md_reply_json(req, 200, json_pack("{s:{s:s}}", "deleted", "job", id));
}

void md_handle_job_cancel(md_req *req)
{
    md_app *app = md_req_app(req);
    md_err err;
    const char *id = md_req_param(req, "id");
    if (!app->jobs) {
        jobs_unavailable(&err);
        md_reply_error(req, &err);
        return;
    }
    const char *purge = md_req_query(req, "purge");
    if (purge && strcmp(purge, "true") && strcmp(purge, "false")) {
        md_err_setc(&err, MD_EINVAL, "invalid_query",
                    "purge=%.20s: use purge=true to remove an ended job and the output the "
                    "server wrote for it, or leave it out to cancel",
                    purge);
        md_reply_error(req, &err);
        return;
    }
    if (purge && !strcmp(purge, "true")) {
        md_req_defer(req, job_purge_deferred);
        return;
    }
    if (md_jobs_cancel(app->jobs, id, &err) != MD_OK) {
        md_reply_error(req, &err);
        return;
    }
    json_t *job = job_or_reply(req, id);
    if (job)
        md_reply_json(req, 202, job_view(job));
}

/* A job output that is an S3 object and not on this replica (job_output.c:
 * cluster mode): streamed from S3 as it is read, never whole in memory. */
typedef struct output_s3 {
    char url[1200];
    char content_type[64];
    int partial;
} output_s3;

/* Job outputs streaming from S3 at once: each holds an S3 reader thread
 * and a watcher thread (server/http.c) until its client has read it, so a
 * crowd of slow clients is bounded; past it 503 overloaded, Retry-After. */
#define OUTPUT_STREAMS_MAX 64 /* (the metric's help says it too) */
static atomic_int output_streams;

static void output_stream_done(void *ctx)
{
    md_s3_stream_close(ctx);
    atomic_fetch_sub(&output_streams, 1);
}

void md_jobs_write_output_metrics(FILE *f)
{
    md_prom_family(f, "modeld_job_output_streams", "gauge",
                   "Job outputs this replica streams from S3 now (GET /jobs/ID/output of a job "
                   "another replica assembled); past 64 at once, more answer 503.");
    md_prom_sample(f, "modeld_job_output_streams", "", atomic_load(&output_streams));
}

/* Deferred: the HEAD and the stream's start talk to S3. */
static void output_s3_deferred(md_req *req)
{
    md_app *app = md_req_app(req);
    output_s3 *o = md_req_state(req);
    md_err err;
    md_err_clear(&err);
    int max = OUTPUT_STREAMS_MAX;
    const char *test_max = getenv("MD_TEST_OUTPUT_STREAMS_MAX"); /* for tests only */
    if (test_max && atoi(test_max) > 0)
        max = atoi(test_max);
    if (atomic_fetch_add(&output_streams, 1) >= max) {
        atomic_fetch_sub(&output_streams, 1);
        md_err_setc(&err, MD_EBUSY, "overloaded",
                    "%d job outputs are streaming from S3 already, the most at once; retry, "
                    "or read %.300s from S3 directly",
                    max, o->url);
        md_reply_error(req, &err);
        return;
    }
    md_fetch_opts cfg_fo = md_fetch_opts_from_cfg(app->cfg), fo;
    md_strlist own;
    if (md_job_fetch_opts(app->store, &cfg_fo, &fo, &own, &err) != MD_OK) {
        atomic_fetch_sub(&output_streams, 1);
        md_reply_error(req, &err);
        return;
    }
    int fd = -1;
    md_s3_stream *s = NULL;
    md_status st = md_s3_stream_open(o->url, &fo, "the job output", &fd, &s, &err);
    md_job_fetch_free(&own);
    if (st == MD_ENOTFOUND) {
        md_err_setc(&err, MD_ENOTFOUND, "output_missing",
                    "the job's output %.300s is not in S3 (deleted, or its upload never "
                    "finished); run the job again",
                    o->url);
    } else if (st != MD_OK && st != MD_EUNAVAIL) {
        /* the message names the object and the problem; the code says where */
        snprintf(err.code, sizeof err.code, "output_missing");
    }
    if (st != MD_OK) {
        atomic_fetch_sub(&output_streams, 1);
        md_reply_error(req, &err);
        return;
    }
    if (o->partial)
        md_reply_header(req, "X-Partial", "true");
    /* output_stream_done closes the stream and gives the slot back */
    md_reply_stream(req, 200, o->content_type, fd, (size_t)md_s3_stream_size(s),
                    output_stream_done, s);
}

void md_handle_job_output(md_req *req)
{
    md_app *app = md_req_app(req);
    md_err err;
    json_t *job = job_or_reply(req, md_req_param(req, "id"));
    if (!job)
        return;
    const char *status = json_string_value(json_object_get(job, "status"));
    if (strcmp(status, "succeeded") != 0 && strcmp(status, "cancelled") != 0) {
        md_err_setc(&err, MD_ECONFLICT, "job_not_finished",
                    "job %s is %s; its output is available once it has succeeded or was "
                    "cancelled",
                    json_string_value(json_object_get(job, "id")), status);
        json_decref(job);
        md_reply_error(req, &err);
        return;
    }
    /* opened as the runner wrote it: under allowed_paths (output.path) or
     * in the store, no symlink followed, a regular file only */
    const char *path = json_string_value(json_object_get(job, "output_path"));
    json_t *spec_out = json_object_get(json_object_get(job, "spec"), "output");
    int fd = -1;
    struct stat sb;
    char own[4200];
    const char *spec_path = json_string_value(json_object_get(spec_out, "path"));
    if (spec_path && strncmp(spec_path, "s3://", 5) != 0) { /* s3://: the store's copy */
        md_err_clear(&err);
        if (md_path_open_file(&app->cfg->allowed_paths, "output.path", path, "output_missing",
                              &fd, &err) != MD_OK)
            fd = -1;
    } else {
        /* this replica's own copy: the same name in its store (output_path
         * names the store of the replica that took the request) */
        const char *leaf = strrchr(path, '/');
        snprintf(own, sizeof own, "%s/jobs/%s", md_store_dir(app->store), leaf ? leaf + 1 : path);
        path = own;
        fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
        if (fd >= 0 && (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode))) {
            close(fd);
            fd = -1;
        }
    }
    const char *fmt = json_string_value(
        json_object_get(json_object_get(json_object_get(job, "spec"), "output"), "format"));
    const char *ct = fmt && !strcmp(fmt, "npy")   ? "application/x-npy"
                     : fmt && !strcmp(fmt, "csv") ? "text/csv"
                                                  : "application/x-ndjson";
    output_s3 *o = fd < 0 ? calloc(1, sizeof *o) : NULL;
    if (o && md_job_output_url(app->store, json_string_value(json_object_get(job, "id")),
                               json_object_get(job, "spec"), o->url, sizeof o->url)) {
        /* not on this replica (another one ran or assembled it): from S3 */
        snprintf(o->content_type, sizeof o->content_type, "%s", ct);
        o->partial = json_is_true(json_object_get(job, "partial"));
        json_decref(job);
        md_req_set_state(req, o, free);
        md_req_defer(req, output_s3_deferred);
        return;
    }
    free(o);
    if (fd < 0 || fstat(fd, &sb) != 0) {
        if (fd >= 0)
            close(fd);
        md_err_setc(&err, MD_ENOTFOUND, "output_missing",
                    "the output file %s is missing, or is not a regular file reachable under "
                    "allowed_paths without a symlink",
                    path);
        json_decref(job);
        md_reply_error(req, &err);
        return;
    }
    if (json_is_true(json_object_get(job, "partial")))
        md_reply_header(req, "X-Partial", "true");
    json_decref(job);
    md_reply_fd(req, 200, ct, fd, (size_t)sb.st_size);
}
