/*
 * job_output.c - where a job's output lives (jobs.h, "where a job's output
 * lives"), and the S3 rights the server's own job outputs need.
 *
 * DESIGN
 * Single host (blobs in a directory): a job with no output.path writes
 * --store/jobs/<id>.<ext>, and GET /jobs/ID/output serves that file, as
 * before. Cluster mode (blob_url = s3://BUCKET/PREFIX): any replica may run
 * the job, or a chunk of it, and any replica may be asked for its output
 * behind a load balancer, so the output is an object of the server's own,
 *     s3://BUCKET/PREFIX/jobs/<id>/output.<jsonl|csv|npy>
 * (chunked jobs' parts beside it, <that key>.chunks/<seq>-<attempt>). The
 * blob store's keys are PREFIX/blobs/<sha256>/<nonce>, and its listing and
 * orphan sweep look under PREFIX/blobs/ only, so the two never meet. From
 * there on such a job is handled as one whose output.path is s3://: the
 * runner stages the file in --store/jobs and puts it before the job reads
 * as succeeded; a job with an s3:// input is chunked over every replica.
 * The bucket is the server's, not a dataset the user named: the runners
 * and GET /jobs/ID/output get BUCKET/PREFIX/jobs/ added to allowed_s3
 * (md_job_fetch_opts), so no one has to list it there. A user's own
 * input.path or output.path there is still checked against allowed_s3 as
 * configured when the job is created. Credentials and endpoint are the
 * blob store's (the AWS_* environment, as for every S3 call).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jobs.h"

/* Job ids are made by the server (j<ms><hex>); anything else is not put
 * in a key. */
static int id_ok(const char *id)
{
    size_t n = id ? strlen(id) : 0;
    if (n == 0 || n > 63)
        return 0;
    for (size_t i = 0; i < n; i++)
        if (!((id[i] >= 'a' && id[i] <= 'z') || (id[i] >= 'A' && id[i] <= 'Z') ||
              (id[i] >= '0' && id[i] <= '9') || id[i] == '-' || id[i] == '_'))
            return 0;
    return 1;
}

int md_job_output_url(md_store *store, const char *id, json_t *spec, char *url, size_t size)
{
    json_t *output = json_object_get(spec, "output");
    const char *path = json_string_value(json_object_get(output, "path"));
    if (size)
        url[0] = '\0';
    if (path) {
        if (strncmp(path, "s3://", 5) != 0)
            return 0;
        int n = snprintf(url, size, "%s", path);
        return n > 0 && (size_t)n < size;
    }
    char root[1200];
    if (!md_store_data_url(store, root, sizeof root) || !id_ok(id))
        return 0;
    const char *fmt = json_string_value(json_object_get(output, "format"));
    if (!fmt || (strcmp(fmt, "csv") && strcmp(fmt, "npy")))
        fmt = "jsonl";
    int n = snprintf(url, size, "%sjobs/%s/output.%s", root, id, fmt);
    return n > 0 && (size_t)n < size;
}

/* The job's output object in `url`; *own: 1 for the server's own key (no
 * output.path), which an earlier run of this very job may have written. */
static md_status output_target(md_store *store, const char *id, json_t *spec, char *url,
                               size_t size, int *own, md_err *err)
{
    if (!md_job_output_url(store, id, spec, url, size))
        return md_err_set(err, MD_EINTERNAL, "job %s has no output object in S3", id);
    *own = !json_string_value(json_object_get(json_object_get(spec, "output"), "path"));
    return MD_OK;
}

md_status md_job_output_copy(md_store *store, const md_fetch_opts *o, const char *id,
                             json_t *spec, const char *part_url, md_err *err)
{
    char url[1200];
    int own = 0;
    md_status st = output_target(store, id, spec, url, sizeof url, &own, err);
    return st == MD_OK ? md_s3_data_copy(part_url, url, o, own, err) : st;
}

md_status md_job_output_put(md_store *store, const md_fetch_opts *o, const char *id,
                            json_t *spec, const char *path, md_err *err)
{
    char url[1200];
    int own = 0;
    md_status st = output_target(store, id, spec, url, sizeof url, &own, err);
    if (st != MD_OK)
        return st;
    if (own) {
        /* this job's own key: what is there is an earlier run's upload of
         * the same job (a runner stopped between its put and "succeeded") */
        md_err derr;
        md_status dst = md_s3_data_delete(url, o, &derr);
        if (dst != MD_OK && dst != MD_ENOTFOUND) {
            *err = derr;
            return dst;
        }
    }
    return md_s3_data_put(url, o, path, err);
}

md_status md_job_fetch_opts(md_store *store, const md_fetch_opts *in, md_fetch_opts *out,
                            md_strlist *list, md_err *err)
{
    *out = *in;
    memset(list, 0, sizeof *list);
    char root[1200];
    if (!md_store_data_url(store, root, sizeof root))
        return MD_OK; /* nothing of the server's own in S3 */
    int have = in->allowed_s3 ? in->allowed_s3->count : 0;
    list->items = calloc((size_t)have + 2, sizeof(char *));
    if (!list->items)
        return md_err_set(err, MD_ENOMEM, "no memory for the allowed_s3 list");
    for (int i = 0; i < have; i++)
        list->items[i] = in->allowed_s3->items[i]; /* borrowed: see md_job_fetch_free */
    /* "BUCKET/PREFIX/jobs/": s3_allowed_by takes BUCKET/PREFIX entries */
    size_t len = strlen(root + 5) + sizeof "jobs/";
    list->items[have] = malloc(len);
    if (!list->items[have]) {
        free(list->items);
        memset(list, 0, sizeof *list);
        return md_err_set(err, MD_ENOMEM, "no memory for the allowed_s3 list");
    }
    snprintf(list->items[have], len, "%sjobs/", root + 5);
    list->count = have + 1;
    out->allowed_s3 = list;
    return MD_OK;
}

void md_job_fetch_free(md_strlist *list)
{
    if (!list || !list->items)
        return;
    free(list->items[list->count - 1]); /* the one entry of our own */
    free(list->items);
    memset(list, 0, sizeof *list);
}
