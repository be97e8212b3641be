/*
 * jobs.h - batch-predict jobs: the job table's queries (job_store.c).
 *
 * The job table lives in the store's SQLite index (the migrations that make
 * it are in checkpoint/store.c), so these functions take an md_store.
 *
 * Thread safety: every md_store_job_* function is safe to call from any
 * thread (the store's mutex serialises them). JSON results are new
 * references the caller decrefs.
 */
#ifndef MD_JOBS_H
#define MD_JOBS_H

#include <jansson.h>

#include "../checkpoint/checkpoint.h"
#include "../config/md_err.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- the job table (job_store.c) ---- */

/* Insert a queued job row. */
md_status md_store_job_create(md_store *store, const char *id, const char *model, int version,
                              json_t *spec, const char *output_path, md_err *err);
/* One job as JSON (id, model, version, spec, status, rows_done, rows_total,
 * rows_skipped, output_path, output_bytes, correct, labeled, confusion,
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
 * that died once its lease (jobs.lease_until, wall-clock seconds) runs out.
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

#ifdef __cplusplus
}
#endif
#endif
