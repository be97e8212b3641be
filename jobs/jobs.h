/*
 * jobs.h - batch-predict jobs over whole datasets: the streaming dataset
 * readers (readers.c), the scheduler that runs jobs on the models' job
 * workers (scheduler.c) and writes their output (writers.c, behind the
 * private writers.h), and the job table's queries (job_store.c).
 *
 * It uses predictor.h (models, tensors, top-k) and checkpoint.h (the store,
 * downloads, allowed paths); neither of them includes this header. The job
 * table lives in the store's SQLite index (the migrations that make it are
 * in checkpoint/store.c), so its functions take an md_store.
 *
 * Thread safety: stated per section below. JSON results are new references
 * the caller decrefs.
 */
#ifndef MD_JOBS_H
#define MD_JOBS_H

#include <jansson.h>

#include <stdint.h>

#include "../checkpoint/checkpoint.h"
#include "../config/md_err.h"
#include "../predictor/image.h"
#include "../predictor/predictor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- dataset readers (readers.c) ---- */

/*
 * A streaming reader over one dataset file: rows come one at a time, so
 * memory stays bounded whatever the file size. Formats:
 *   csv   header line; numeric feature columns (all but `label`, or the
 *         columns named in `features`); quoted fields; CRLF; `label` column
 *   jsonl one JSON value per line: an array of numbers (nested arrays are
 *         flattened), or an object whose field `features` (default
 *         "features") holds them and whose field `label` holds the label
 *   npy   float32/float64/int64/int32/uint8, C order, 2-D or N-D (rows = dim 0)
 *   idx   the MNIST family, plain or gzip (gzstream.h); `label` is the path of the
 *         matching labels file (idx1), optional
 *   images `path` is a directory: its PNG and JPEG files, recursively, in
 *         byte order of their relative paths, one row each, decoded and
 *         preprocessed as `image` says; labels from the class folder or a
 *         regular expression on the file name (label_from; jobs/images.c)
 * Not thread-safe: one reader per job.
 */
typedef struct md_reader md_reader;

typedef struct md_reader_opts {
    const char *path;
    const char *format;    /* "csv", "jsonl", "npy", "idx" */
    json_t *features;      /* csv: array of column names; jsonl: field name string; or NULL */
    const char *label;     /* csv column, jsonl field, or idx labels file; or NULL */
    /* images only */
    const md_image_opts *image; /* the version's preprocess.image (borrowed); required */
    json_t *label_from;    /* "folder", "none", {"regex": R}, or NULL: "folder" when the
                            * directory has subdirectories, else none (borrowed) */
    json_t *class_names;   /* the version's labels (array of strings, borrowed) or NULL */
    int64_t max_files;     /* most directory entries listed; past it MD_ETOOBIG */
    json_t *image_list;    /* or NULL. A listing made already (an array of paths relative to
                            * `path`, sorted by strcmp: a chunked job's plan, s3_images.h)
                            * read instead of walking `path`, which need hold only the files
                            * read; labels and rows are the listing's (borrowed) */
    /* named inputs (csv and jsonl): the version's declared inputs
     * (md_model_input, borrowed) and input.columns, {"input": "column" or
     * ["column", ...]} (borrowed; NULL: each input's column or field has its
     * name). Each row is then the inputs' values side by side as
     * md_model_pack lays them out (md_model_pack_rows), integers exact, and
     * md_reader_row_width counts 4-byte words. */
    const md_io_info *inputs;
    int n_inputs;
    json_t *columns;
    long long max_file_bytes; /* the largest image file read; a larger one is a bad row */
} md_reader_opts;

/* Defaults of the images limits (settings job_max_files, job_max_image_bytes). */
#define MD_IMAGES_MAX_FILES_DEFAULT 1000000
#define MD_IMAGES_MAX_FILE_BYTES_DEFAULT (64LL * 1024 * 1024)
/* Directories nest at most this deep under an images input.path. */
#define MD_IMAGES_MAX_DEPTH 32

/* Open the dataset. MD_EINVAL naming the file and the problem. */
md_status md_reader_open(const md_reader_opts *opts, md_reader **out, md_err *err);
/* Values per row (known after open: from the header, first line, or dims). */
int64_t md_reader_row_width(const md_reader *r);
/* Total rows when the format says (npy, idx), else -1. */
int64_t md_reader_total_rows(const md_reader *r);
/* 1 when rows carry labels. */
int md_reader_has_labels(const md_reader *r);
/*
 * Read the next row into `row` (md_reader_row_width floats) and its label
 * (when any) into `*label`. Returns MD_OK; MD_ENOTFOUND at the end; MD_EINVAL
 * for a malformed row, with a message naming the row number (0-based data
 * row) and the reason; the bad row is consumed, so the caller may skip it.
 * MD_EIO on read errors.
 */
md_status md_reader_next(md_reader *r, float *row, int64_t *label, md_err *err);
/* The number of data rows consumed so far (good and bad). */
int64_t md_reader_position(const md_reader *r);
/* Move to position `rows` (a resuming job's committed rows_done): images by
 * number without reading a file, other formats by reading rows (bad ones
 * consumed). MD_OK (also when the data ends first), or MD_EIO. */
md_status md_reader_skip_to(md_reader *r, int64_t rows, md_err *err);
/* The name of row `index`, the image's path relative to the directory, for
 * images; NULL for other formats. Borrowed, valid until md_reader_close. */
const char *md_reader_row_name(const md_reader *r, int64_t index);
/* Files under an images directory that are not rows (symlinks, non-regular
 * files, neither PNG nor JPEG); -1 for other formats. */
int64_t md_reader_files_skipped(const md_reader *r);
/* Close. Accepts NULL. */
void md_reader_close(md_reader *r);

/* Chunked jobs (issue 26). The file offset where the next row's record
 * starts (csv, jsonl; blank lines before it included), -1 for other
 * formats: one pass of the reader gives byte ranges of whole rows, so a
 * quoted newline never splits one. */
int64_t md_reader_byte_offset(const md_reader *r);
/* 1 when rows are fixed-size at known offsets (npy; plain idx and its plain
 * labels file): *data_off where row 0 starts, *row_bytes each, *label_off
 * where the labels file's bytes start (one a row; -1: no labels file).
 * 0 otherwise (text formats, gzip, images). */
int md_reader_layout(const md_reader *r, int64_t *data_off, int64_t *row_bytes,
                     int64_t *label_off);

/* ---- the job scheduler (scheduler.c) ---- */

typedef struct md_jobs md_jobs;

/* Resolve name and version (0 = the default) to a loaded model, retained. */
typedef md_model *(*md_model_resolver)(void *ctx, const char *name, int version, md_err *err);
/* Told (with the resolver's ctx) that a job's record_metric made `version` of
 * `name` the default in the store (promotion policy), so that what serves
 * /predict follows before the job reads as succeeded. */
typedef void (*md_default_moved)(void *ctx, const char *name, int version);

/*
 * Start `max_jobs` job runners over the jobs table of `store`. Each claims
 * the oldest job nobody alive holds, with a lease of lease_s seconds that it
 * renews while the job runs: jobs made here or through a replica sharing the
 * store, and jobs a stopped or dead process left (they resume from their
 * last committed chunk). `fetch` (copied; its lists borrowed for the
 * runners' lifetime) bounds input downloads and names allowed_paths.
 * test_chunk_delay_ms (for tests only, else 0): commit after every chunk and
 * pause this long after each, so a test can act in the middle of a job.
 * image_max_files and image_max_bytes bound images inputs (md_reader_opts'
 * max_files and max_file_bytes; 0: the defaults).
 */
md_status md_jobs_start(md_store *store, int max_jobs, double lease_s, int test_chunk_delay_ms,
                        int64_t image_max_files, long long image_max_bytes,
                        const md_fetch_opts *fetch, md_model_resolver resolve,
                        md_default_moved moved, void *resolve_ctx, md_jobs **out, md_err *err);
/* Queue a job already inserted in the store. Thread-safe. */
void md_jobs_enqueue(md_jobs *jobs, const char *id);

/* Wake the idle runners now (the index notified a change, which may be a
 * chunk plan or a chunk given back): they look for work at once rather
 * than at their next poll. Thread-safe. */
void md_jobs_wake(md_jobs *jobs);
/* Cancel: a queued job at once, a running one after its current chunk; the
 * output so far is kept and marked partial. Thread-safe. */
md_status md_jobs_cancel(md_jobs *jobs, const char *id, md_err *err);
/* Start removing jobs that ended retention_s ago (0: none, but this
 * replica's files of jobs removed elsewhere still go): job_retention.c's
 * janitor thread, stopped by md_jobs_stop. Call once, after md_jobs_start. */
void md_jobs_set_retention(md_jobs *jobs, int retention_s);
/* Remove the ended job `id` now (DELETE /jobs/ID?purge=true): see
 * md_job_remove. Blocks on S3 and the index. Thread-safe. */
md_status md_jobs_purge(md_jobs *jobs, const char *id, md_err *err);
/* Stop the runners; running jobs stop after their current chunk and stay
 * "running" in the store, so the next start resumes them. Accepts NULL. */
void md_jobs_stop(md_jobs *jobs);

/* ---- the job table (job_store.c) ----
 * Every md_store_job_* function is safe to call from any thread (the store's
 * mutex serialises them). */

/* Insert a queued job row. */
md_status md_store_job_create(md_store *store, const char *id, const char *model, int version,
                              json_t *spec, const char *output_path, md_err *err);
/* One job as JSON (id, model, version, spec, status, rows_done, rows_total,
 * rows_skipped, files_skipped (images inputs, else null), output_path, output_bytes, correct, labeled, confusion,
 * rows_per_s, partial, error, created_at, started_at, finished_at, updated_at). */
md_status md_store_job_get(md_store *store, const char *id, json_t **out, md_err *err);
/* Jobs newest first, filtered by status and model (NULL = any), ids before
 * `before` (pagination), at most `limit`: {"jobs": [...], "next": id|null}. */
md_status md_store_job_list(md_store *store, const char *status, const char *model,
                            const char *before, int limit, json_t **out, md_err *err);
/* Set the columns named by the keys of `fields` (an object of known column
 * names) in one statement, so progress commits atomically. */
md_status md_store_job_update(md_store *store, const char *id, json_t *fields, md_err *err);

/*
 * Leases: a process runs a job only while it holds it (jobs.owner), so
 * replicas sharing a store run each job once, and take over the jobs of one
 * that died once its lease (jobs.lease_until: seconds since the epoch on the
 * index's clock, PostgreSQL's for every replica) runs out.
 */
/* Claim the oldest queued or running job that nobody holds, whose lease ran
 * out, or whose holder `owner_dead` says is gone; lease it to `owner` for
 * lease_s. `id` gets its id, or "" when there is none. */
md_status md_store_job_claim_next(md_store *store, const char *owner, double lease_s,
                                  int (*owner_dead)(const char *owner, void *ctx), void *ctx,
                                  char id[64], md_err *err);
/* md_store_job_update (fields may be NULL) only while `owner` holds the job,
 * renewing its lease for lease_s; MD_ECONFLICT (job_lease_lost) when it does
 * not. *cancel_requested (may be NULL) gets the job's cancel flag. */
md_status md_store_job_update_owned(md_store *store, const char *id, const char *owner,
                                    double lease_s, json_t *fields, int *cancel_requested,
                                    md_err *err);
/* Give the job back (on shutdown), so another process may claim it at once. */
md_status md_store_job_release(md_store *store, const char *id, const char *owner, md_err *err);
/* Cancel: a queued job nobody holds is cancelled now (*cancelled_now = 1);
 * otherwise the job is flagged for its holder, which stops at its next
 * commit, keeping the output so far. */
/* Write the job metric families (jobs and committed rows by state;
 * Prometheus text) to `f`. Takes the store's lock for one query. */
void md_jobs_write_metrics(md_store *store, FILE *f);
md_status md_store_job_request_cancel(md_store *store, const char *id, int *cancelled_now,
                                      md_err *err);

/* ---- removing ended jobs (job_store.c; job_retention.c does it) ---- */

/* Ids of ended jobs (succeeded, failed, cancelled) that ended before
 * `before` (an ISO time as the store writes them: md_now_iso) and that no
 * replica is removing, oldest first, at most `limit`: a new JSON array. */
md_status md_store_jobs_ended_before(md_store *store, const char *before, int limit,
                                     json_t **out, md_err *err);
/* Ended chunked jobs whose parts were not all dropped yet (their plan is
 * still there: a coordinator stopped between recording the job and
 * deleting its parts) that ended before `before` (ISO), at most `limit`:
 * a new array of [id, spec]. */
md_status md_store_jobs_parts_left(md_store *store, const char *before, int limit,
                                   json_t **out, md_err *err);
/* Record that an ended job's parts are gone (its plan cleared). */
md_status md_store_job_parts_dropped(md_store *store, const char *id, md_err *err);
/* Take the ended job `id` for removal for lease_s seconds (on the index's
 * clock), in one transaction: its chunk rows are deleted (the fence: no
 * late runner finishes one), and *part_keys gets the S3 keys they named (a
 * new array). MD_ENOTFOUND job_not_found; MD_ECONFLICT job_not_finished
 * while it is queued or running, job_removing while another holds it. */
md_status md_store_job_removal_claim(md_store *store, const char *id, double lease_s,
                                     json_t **part_keys, md_err *err);
/* Give a removal taken by md_store_job_removal_claim back (it failed). */
md_status md_store_job_removal_release(md_store *store, const char *id, md_err *err);
/* Delete the job's row (and any chunk row), and record its id in
 * jobs_removed stamped with the index's clock, in one transaction (NOTIFY
 * modeld_change at its commit). MD_ENOTFOUND job_not_found. */
md_status md_store_job_delete(md_store *store, const char *id, md_err *err);
/* Those of `ids` (a JSON array of strings) recorded as removed: a new
 * array. Takes the store's lock per 100 ids. */
md_status md_store_jobs_removed_among(md_store *store, json_t *ids, json_t **removed,
                                      md_err *err);
/* Removals recorded at or after `since` (an ISO time), oldest first, at
 * most `limit`: a new array of [id, removed_at]. */
md_status md_store_jobs_removed_since(md_store *store, const char *since, int limit,
                                      json_t **out, md_err *err);
/* Forget the removals recorded before `before` (an ISO time). */
md_status md_store_jobs_removed_prune(md_store *store, const char *before, md_err *err);
/* Now on the index's clock (PostgreSQL's, or SQLite's host), as an ISO time
 * in `out`: the clock removals are stamped with. */
md_status md_store_db_now_iso(md_store *store, char out[32], md_err *err);

/* ---- the janitor (job_retention.c; its DESIGN) ---- */

typedef struct md_job_janitor md_job_janitor;
/* Remove the ended job `id`: the server's S3 objects of it, its rows (its
 * id recorded in jobs_removed), this replica's files of it; `why` for the
 * log. MD_ENOTFOUND job_not_found, MD_ECONFLICT job_not_finished, or the
 * S3 or index failure (the row is then kept). Blocks. Thread-safe. */
md_status md_job_remove(md_store *store, const md_fetch_opts *fetch, const char *id,
                        const char *why, md_err *err);
/* The thread that removes jobs ended retention_s ago (0: none) and this
 * replica's files of jobs removed by any replica; NULL if it cannot start.
 * `fetch` must outlive it. */
md_job_janitor *md_job_janitor_start(md_store *store, const md_fetch_opts *fetch,
                                     int retention_s, double lease_s);
/* Delete the S3 parts of the ended chunked job `id` (spec: its spec): those
 * its chunks named, then everything under <output>.chunks/<id>/; then
 * record them dropped (md_store_job_parts_dropped). This replica's kept
 * parts on disk are the caller's. Blocks. Thread-safe. */
md_status md_job_drop_parts(md_store *store, const md_fetch_opts *fetch, const char *id,
                            json_t *spec, md_err *err);
/* Look for removed jobs' files now (a NOTIFY was heard). Accepts NULL. */
void md_job_janitor_wake(md_job_janitor *janitor);
/* Stop and free. Accepts NULL. */
void md_job_janitor_stop(md_job_janitor *janitor);
/* Remove the folder `name` under the directory `parent` and what it holds,
 * never following a symlink; depth: 0 at the top. */
void md_job_remove_tree(int parent, const char *name, int depth);
/* modeld_jobs_removed_total (Prometheus text) to `f`. Thread-safe. */
void md_jobs_write_removed_metrics(FILE *f);

/* ---- one job over every replica: its chunks (job_store.c) ----
 * With the PostgreSQL index only: see the DESIGN in job_store.c. Every
 * function is thread-safe (the store's mutex). */

/* 1 when jobs are planned into chunks any replica may run (PostgreSQL). */
int md_store_jobs_chunked(md_store *store);

typedef struct md_job_chunk {
    char job_id[64];
    int64_t seq;                 /* 0-based, in input order */
    int64_t start_row, end_row;  /* rows [start, end) of the input */
    int64_t start_byte, end_byte; /* csv, jsonl: the input bytes of those rows; else -1 */
    int64_t attempt;             /* 1 for the first claim, +1 per takeover */
    int taken_over;              /* claimed from a holder whose lease ran out */
} md_job_chunk;

typedef struct md_job_chunk_counts {
    int64_t rows, skipped, correct, labeled;
    long long output_bytes;
    const char *confusion; /* JSON text, or NULL */
} md_job_chunk_counts;

/* Record the chunks of `job_id` (an array of [start_row, end_row,
 * start_byte, end_byte]) and its `plan` (JSON the runners read back) in one
 * transaction, only while `owner` holds the job and it has none yet:
 * *planned = 1; MD_ECONFLICT otherwise. */
md_status md_store_chunks_plan(md_store *store, const char *job_id, const char *owner,
                               json_t *chunks, json_t *plan, int *planned, md_err *err);
/* The job's plan (a new reference), or *plan = NULL when it has none. */
md_status md_store_chunk_plan_get(md_store *store, const char *job_id, json_t **plan, md_err *err);
/* Claim the first chunk (oldest job first; only `only_job`'s when not NULL)
 * that is pending, or running with its lease run out on the database's
 * clock: leased to `owner` for lease_s seconds, attempt + 1. *found = 0
 * when there is none. */
md_status md_store_chunk_claim(md_store *store, const char *owner, double lease_s,
                               const char *only_job, md_job_chunk *c, int *found, md_err *err);
/* Renew the lease while owner and attempt still hold the chunk; MD_ECONFLICT
 * (chunk_lease_lost) when not. *cancel_requested gets the job's flag. */
md_status md_store_chunk_renew(md_store *store, const md_job_chunk *c, const char *owner,
                               double lease_s, int *cancel_requested, md_err *err);
/* Mark the chunk done with its counts and output object, fenced by owner
 * and attempt (MD_ECONFLICT chunk_lease_lost when they no longer hold it:
 * nothing changes), adding its counts to the job's in the same
 * transaction; *all_done = 1 when that was the job's last chunk. */
md_status md_store_chunk_finish(md_store *store, const md_job_chunk *c, const char *owner,
                                const md_job_chunk_counts *counts, const char *output_key,
                                int *all_done, md_err *err);
/* Give the chunk back (pending again), if owner and attempt still hold it;
 * MD_ECONFLICT ("chunk_lease_lost") when they do not (taken over, or done). */
md_status md_store_chunk_release(md_store *store, const md_job_chunk *c, const char *owner,
                                 md_err *err);
/* Write the chunk metric families (this process's counters; Prometheus
 * text) to `f`: chunks claimed, finished, taken over, refused, rows.
 * Called by md_jobs_write_metrics. Thread-safe (atomics). */
void md_jobs_write_chunk_metrics(FILE *f);
/* The job's chunks in order: [{seq, status, start_row, end_row, rows,
 * output_key, output_bytes, confusion, skipped, correct, labeled}], a new
 * reference. */
md_status md_store_chunks_list(md_store *store, const char *job_id, json_t **out, md_err *err);

/* ---- where a job's output lives (job_output.c; its DESIGN) ---- */

/* The S3 object that holds job `id`'s output (spec: the job's spec,
 * borrowed) into `url` (size bytes): output.path when it is s3://; with no
 * output.path in cluster mode (S3 blobs) the server's own object
 * s3://BUCKET/PREFIX/jobs/<id>/output.<jsonl|csv|npy>. Returns 1, or 0
 * when the output is a local file only (a local output.path; single host).
 * Thread-safe. */
int md_job_output_url(md_store *store, const char *id, json_t *spec, char *url, size_t size);
/* Put the finished output file `path` as job `id`'s object (see
 * md_job_output_url): a user's s3:// output.path never over an existing
 * object (md_s3_data_put: output_exists); the server's own object, whose
 * key only this job uses, replacing what an earlier run of the job left
 * (a runner stopped between its upload and recording success). Blocks.
 * Thread-safe. */
md_status md_job_output_put(md_store *store, const md_fetch_opts *o, const char *id,
                            json_t *spec, const char *path, md_err *err);
/* As md_job_output_put, the output made a copy of the object `part_url`
 * (same bucket) inside S3 (CopyObject), under the same rule. Blocks. */
md_status md_job_output_copy(md_store *store, const md_fetch_opts *o, const char *id,
                             json_t *spec, const char *part_url, md_err *err);
/* `in` with allowed_s3 extended by the server's own BUCKET/PREFIX/jobs/
 * (cluster mode; else `in` as it is) into *out, for the runners and for
 * GET /jobs/ID/output. `list` holds the new list (it borrows in's entries:
 * keep `in`'s lists alive while *out is used); free it with
 * md_job_fetch_free. MD_ENOMEM only. Thread-safe. */
md_status md_job_fetch_opts(md_store *store, const md_fetch_opts *in, md_fetch_opts *out,
                            md_strlist *list, md_err *err);
/* Free what md_job_fetch_opts made. Accepts NULL and an empty list. */
void md_job_fetch_free(md_strlist *list);

#ifdef __cplusplus
}
#endif
#endif
