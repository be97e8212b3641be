/*
 * s3_images.c - a folder of images in S3 split into chunks by index (issue
 * 26; s3_images.h). The single runner copies the whole folder into a local
 * tree and walks it (scheduler.c's s3_images_open); a chunked job cannot,
 * since each replica computes only some rows. So:
 *
 * DESIGN
 * The planning replica lists the prefix once, page by page, and applies the
 * walk's rules to the keys: what the walk would never see (a segment that
 * starts with a dot, and everything under it) is left out; past max_files
 * objects, or files and folders, the job fails as the walk would; an object
 * that is empty, larger than job_max_image_bytes, or neither PNG nor JPEG
 * by its first 16 bytes (one Range GET, If-Match its listed ETag) is not a
 * row and counts in files_skipped. What is left, sorted by strcmp (S3's
 * byte order, and the walk's), is the listing: paths and their ETags,
 * recorded in the job's plan, bounded by MD_JOB_S3_LISTING_MAX_BYTES. Every
 * chunk reads the plan, downloads only the images of its rows [from, to)
 * into a directory of its own, each answer's ETag checked against the
 * listed one (an answer's ETag names the bytes it carried, so this holds
 * even where a server ignores If-Match), and opens the images reader with
 * the whole listing: labels are learned over every listed image, so a row's
 * class index, its number and its path are what the single runner writes.
 */
#define _GNU_SOURCE
#include "s3_images.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SNIFF_BYTES 16

typedef struct listed {
    char *rel;
    int64_t size;
    char etag[128];
} listed;

typedef struct list_state {
    listed *items;
    size_t n, cap;
    int64_t max_files;
    const char *url;
    md_status st;
    md_err *err;
    int (*keep_going)(void *);
    void *kg_ctx;
} list_state;

static int on_object(void *ctx, const char *rel, int64_t size, const char *etag)
{
    list_state *l = ctx;
    if ((int64_t)l->n >= l->max_files) {
        /* the single runner's copy stops here with the same words */
        l->st = md_err_setc(l->err, MD_ETOOBIG, "too_many_files",
                            "input.path %.200s holds more than %lld objects; raise "
                            "job_max_files or split the folder",
                            l->url, (long long)l->max_files);
        return 1;
    }
    if (l->keep_going && l->n % 1000 == 0 && !l->keep_going(l->kg_ctx)) {
        l->st = md_err_set(l->err, MD_ECONFLICT, "the job stopped while its images were listed");
        return 1;
    }
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 256;
        listed *grown = realloc(l->items, cap * sizeof *grown);
        if (!grown) {
            l->st = md_err_set(l->err, MD_ENOMEM, "no memory to list input.path %.200s", l->url);
            return 1;
        }
        l->items = grown;
        l->cap = cap;
    }
    listed *it = &l->items[l->n];
    it->rel = strdup(rel);
    if (!it->rel) {
        l->st = md_err_set(l->err, MD_ENOMEM, "no memory to list input.path %.200s", l->url);
        return 1;
    }
    it->size = size;
    snprintf(it->etag, sizeof it->etag, "%s", etag);
    l->n++;
    return 0;
}

static int by_rel(const void *a, const void *b)
{
    return strcmp(((const listed *)a)->rel, ((const listed *)b)->rel);
}

/* Length of the common leading folders of a and b ("x/y/f", "x/z/g": 2). */
static size_t shared_prefix(const char *a, const char *b)
{
    size_t i = 0, last = 0;
    while (a[i] && a[i] == b[i]) {
        if (a[i] == '/')
            last = i + 1;
        i++;
    }
    return last;
}

md_status md_job_s3_images_list(const char *url, const md_fetch_opts *o, int64_t max_files,
                                long long max_file_bytes, int (*keep_going)(void *ctx), void *ctx,
                                json_t **listing, int64_t *skipped, md_err *err)
{
    *listing = NULL;
    *skipped = 0;
    if (max_files <= 0)
        max_files = MD_IMAGES_MAX_FILES_DEFAULT;
    if (max_file_bytes <= 0)
        max_file_bytes = MD_IMAGES_MAX_FILE_BYTES_DEFAULT;
    md_s3_folder *f = NULL;
    md_status st = md_s3_folder_open(url, o, &f, err);
    if (st != MD_OK)
        return st;
    list_state l = {.max_files = max_files, .url = url, .err = err, .keep_going = keep_going,
                    .kg_ctx = ctx};
    st = md_s3_folder_list(f, on_object, &l, err);
    if (st == MD_OK)
        st = l.st;
    if (st == MD_OK)
        qsort(l.items, l.n, sizeof *l.items, by_rel);
    json_t *paths = json_array(), *etags = json_array();
    int64_t entries = 0;
    size_t bytes = 0;
    const char *prev = "";
    for (size_t i = 0; st == MD_OK && i < l.n; i++) {
        const listed *it = &l.items[i];
        /* the walk's entries: each folder once (keys under one folder are
         * contiguous in this order), then the file; not below a dot name */
        size_t from = shared_prefix(prev, it->rel);
        prev = it->rel;
        int hidden = 0, depth = 0;
        for (const char *seg = it->rel; seg && !hidden;) {
            const char *slash = strchr(seg, '/');
            size_t at = (size_t)(seg - it->rel);
            if (at >= from)
                entries++; /* a folder first seen, or the file */
            hidden = seg[0] == '.';
            if (slash && !hidden && ++depth > MD_IMAGES_MAX_DEPTH) {
                st = md_err_setc(err, MD_EINVAL, "invalid_dataset",
                                 "input.path %.200s: %.200s is more than %d folders deep; images "
                                 "may nest at most %d folders under input.path",
                                 url, it->rel, MD_IMAGES_MAX_DEPTH, MD_IMAGES_MAX_DEPTH);
                break;
            }
            seg = slash ? slash + 1 : NULL;
        }
        if (st == MD_OK && entries > max_files)
            st = md_err_setc(err, MD_ETOOBIG, "too_many_files",
                             "input.path %.200s holds more than %lld files and folders, the "
                             "limit of one job (setting job_max_files): split the dataset into "
                             "several jobs or raise job_max_files",
                             url, (long long)max_files);
        if (st != MD_OK || hidden)
            continue;
        int image = 0;
        if (it->size > 0 && it->size <= max_file_bytes) {
            char head[SNIFF_BYTES];
            size_t got = 0;
            st = md_s3_folder_read(f, it->rel, it->etag, sizeof head, head, &got, err);
            image = st == MD_OK && md_image_sniff(head, got) != MD_IMAGE_NONE;
        }
        if (st != MD_OK)
            break;
        if (!image) {
            (*skipped)++; /* the walk's files_skipped: not PNG or JPEG, or too large */
            continue;
        }
        bytes += strlen(it->rel) + strlen(it->etag) + 8;
        if (bytes > MD_JOB_S3_LISTING_MAX_BYTES) {
            st = md_err_setc(err, MD_ETOOBIG, "listing_too_large",
                             "input.path %.200s lists more images than one chunked job's plan "
                             "holds (their paths and ETags past %ld MiB, near image %zu): split "
                             "the folder into several jobs",
                             url, MD_JOB_S3_LISTING_MAX_BYTES >> 20, i);
            break;
        }
        json_array_append_new(paths, json_string(it->rel));
        json_array_append_new(etags, json_string(it->etag));
        if (keep_going && i % 256 == 0 && !keep_going(ctx))
            st = md_err_set(err, MD_ECONFLICT, "the job stopped while its images were listed");
    }
    for (size_t i = 0; i < l.n; i++)
        free(l.items[i].rel);
    free(l.items);
    md_s3_folder_close(f);
    if (st != MD_OK) {
        json_decref(paths);
        json_decref(etags);
        return st;
    }
    *listing = json_pack("{s:o,s:o}", "paths", paths, "etags", etags);
    return MD_OK;
}

md_status md_job_s3_images_fetch(const char *url, const md_fetch_opts *o, json_t *listing,
                                 int64_t from, int64_t to, int dirfd, int (*keep_going)(void *ctx),
                                 void *ctx, md_err *err)
{
    json_t *paths = json_object_get(listing, "paths"), *etags = json_object_get(listing, "etags");
    size_t n = json_array_size(paths);
    if (!json_is_array(paths) || json_array_size(etags) != n || from < 0 || to < from ||
        (size_t)to > n)
        return md_err_set(err, MD_EINTERNAL, "the plan's listing of %.200s does not hold images "
                          "%lld..%lld", url, (long long)from, (long long)to);
    md_s3_folder *f = NULL;
    md_status st = md_s3_folder_open(url, o, &f, err);
    for (int64_t i = from; st == MD_OK && i < to; i++) {
        if (keep_going && !keep_going(ctx)) {
            st = md_err_set(err, MD_ECONFLICT, "the job stopped while its images were fetched");
            break;
        }
        st = md_s3_folder_get(f, json_string_value(json_array_get(paths, (size_t)i)),
                              json_string_value(json_array_get(etags, (size_t)i)), dirfd, err);
    }
    md_s3_folder_close(f);
    return st;
}
