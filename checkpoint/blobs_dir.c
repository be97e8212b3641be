/*
 * blobs_dir.c - the blobs seam's embedded default (blobs_impl.h): the bytes
 * live in --store/blobs/<sha256> and nowhere else, so an upload is durable
 * once blobs.c renames its temp file there (put has nothing to do) and a
 * fetch only says whether the file is there. Also the one choice of backend,
 * md_blobs_open, from blob_url's scheme.
 */
#define _GNU_SOURCE
#include "blobs_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../config/md_err.h"

typedef struct md_blobs_dir {
    md_blobs base;
    char dir[4096];
} md_blobs_dir;

static md_status dir_open(const md_blobs_args *args, md_blobs **out, md_err *err)
{
    (void)err;
    md_blobs_dir *b = md_xcalloc(1, sizeof *b);
    b->base.ops = &md_blobs_dir_ops;
    snprintf(b->dir, sizeof b->dir, "%s", args->dir);
    *out = &b->base;
    return MD_OK;
}

static void dir_close(md_blobs *base) { free(base); }

static md_status dir_put(md_blobs *base, const char *sha256, const char *path, char *key,
                         md_err *err)
{
    (void)base, (void)sha256, (void)path, (void)err;
    key[0] = '\0'; /* the sha256 names it; blobs.c renames the file into blobs/ */
    return MD_OK;
}

static md_status dir_fetch(md_blobs *base, const char *sha256, const char *key, md_err *err)
{
    (void)key;
    md_blobs_dir *b = (md_blobs_dir *)base;
    char path[4200];
    snprintf(path, sizeof path, "%s/blobs/%s", b->dir, sha256);
    if (access(path, R_OK) != 0)
        return md_err_setc(err, MD_ENOTFOUND, "checkpoint_missing",
                           "store %s: checkpoint file blobs/%.64s is missing", b->dir, sha256);
    return MD_OK;
}

const md_blobs_ops md_blobs_dir_ops = {
    .name = "directory",
    .open = dir_open,
    .close = dir_close,
    .put = dir_put,
    .fetch = dir_fetch,
    .remove = NULL, /* blobs.c unlinks the file inside the collector's transaction */
    .list = NULL,   /* blobs.c's sweep at open walks blobs/ itself */
    .pin = NULL,    /* nothing is evicted */
    .trim = NULL,          /* no bound */
    .write_metrics = NULL, /* modeld_store_* say it all */
    .data_url = NULL,      /* job outputs stay in --store/jobs */
};

const char *md_blobs_ops_missing(const md_blobs_ops *ops)
{
    if (!ops->name)
        return "name";
    if (!ops->open)
        return "open";
    if (!ops->close)
        return "close";
    if (!ops->put)
        return "put";
    if (!ops->fetch)
        return "fetch";
    return NULL;
}

md_status md_blobs_open(const md_blobs_args *args, md_blobs **out, md_err *err)
{
    *out = NULL;
    const md_blobs_ops *ops = NULL;
    const char *url = args->url ? args->url : "";
    if (!url[0])
        ops = &md_blobs_dir_ops;
    else if (strncmp(url, "s3://", 5) == 0)
        ops = &md_blobs_s3_ops;
    else
        return md_err_setc(err, MD_EINVAL, "blob_url_invalid",
                           "blob_url \"%.200s\": only s3://BUCKET/PREFIX is supported (empty = "
                           "the store directory's blobs/)",
                           url);
    const char *missing = md_blobs_ops_missing(ops);
    md_assert(missing == NULL);
    md_status st = ops->open(args, out, err);
    if (st != MD_OK)
        *out = NULL;
    return st;
}
